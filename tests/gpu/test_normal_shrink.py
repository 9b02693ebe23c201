"""Shrink (enable_shrink=True) in normal mode on 2 GPUs (docs/normal_shrink.md): rank 1 goes
silent, rank 0 finishes the op without it.

Phases, each on a fresh shrink buffer (default dtype BF16, device CUDA, as DeepEP's tests):
  notify    rank 1 skips a dispatch and its combine (rank 0's notify barrier times out);
  dispatch  rank 1's dispatch data kernel starts after a GPU sleep longer than rank 0's timeout
            (after its notify: the counts were exchanged);
  combine   rank 1's combine starts after such a sleep;
  cached_dispatch  a dispatch with both ranks live (checked exactly) gives the handle; then a
            cached dispatch with that handle, of a new payload, in which rank 1's data kernel starts
            after such a sleep (after its notify: late_cached_dispatch), then a combine with the
            handle. docs/normal_shrink.md: a source silent after notify leaves its rows present but
            empty, and "the same holds for a cached dispatch"; the cached dispatch returns recv_x
            only, so rank 0's recv_x must be the new payload's reference with rank 1's rows (its
            range in the handle) all zero (the freed blocks of recv_x's size are filled with 7.0
            first, so a row the kernel left unwritten shows), the dropped counter 0 = those rows,
            nothing else; the combine leaves rank 1 out as in the dispatch phase.
Rank 0 must finish within the timeout plus slack, equal the torch reference restricted to the
survivors bit for bit (rows of a source silent at notify absent; rows of one silent after notify
present but empty: x 0, top-k -1, weight 0, source index -1; combine the survivors' sum), report
exactly {1} as masked, and count the dropped rows. A later round must skip the peer on both ranks
(no timeout, each rank's own rows only, the tokens not sent counted). Then: after a rank missed
ops (notify phase) a new buffer is exact; a rank that was only late (dispatch, combine,
cached_dispatch phases) rejoins after low_latency_clean_mask_buffer on both ranks, and the same
buffer is exact again."""
import ctypes
import sys
import time

import torch
import torch.distributed as dist

import deep_ep
from common import Checks, ctypes_launches, finish, shrink_state, skip, spawn, watchdog
from normal_reference import DispatchRef
from test_normal import (E, check_cached, check_combine, check_dispatch, expect_dispatch, hint_bytes, late_dispatch,
                         layout_args, make_ctx, make_inputs, make_x, roundtrip, sleep_cycles)

SILENT = 1
TIMEOUT_MS = 2000
SLEEP_MS = 3 * TIMEOUT_MS  # the silent rank's GPU sleep: well past the survivor's timeout
SLACK_S = 5
TOKENS, HIDDEN = 256, 2048  # a channel's tokens fit its ring: no sender waits for ring space
PHASES = ('notify', 'dispatch', 'combine', 'cached_dispatch')
# Buffer.normal_query_dropped_buffer's entries.
RECV_EMPTY, NOT_SENT, COMBINE_LEFT_OUT, COMBINE_NOT_SENT = range(4)


# ---------------------------------------------------------------- references
def rows_from(ref, src, me):
    """The rows source `src` has in `me`'s full dispatch reference: [lo, hi). Column `me` of
    rank_prefix_matrix (rank_prefix_matrix[i][j]: tokens ranks 0..i send to rank j)."""
    prefix = ref.handle[0]
    lo = int(prefix[src - 1, me]) if src > 0 else 0
    return lo, int(prefix[src, me])


def own_rows(ref, me):
    """The rows source `me` has in its own full dispatch reference: [lo, hi)."""
    return rows_from(ref, me, me)


def alone_ref(ref, inp, me, other):
    """What `me` receives when `other` is absent at notify (masked before it, or silent at its
    barrier): its own rows only, the counts and prefixes without `other`, send_head -1 for it."""
    lo, hi = own_rows(ref, me)
    el = E // 2
    sent = inp.in_rank.sum(0, dtype=torch.int64)  # tokens me sends to each rank
    rank_prefix = torch.zeros(2, 2, dtype=torch.int64)
    rank_prefix[me:] += sent  # row i: live sources <= i, only me
    recv_channel = ref.handle[2].clone()
    recv_channel[me] -= lo  # me's rows now start at 0 (no rows of other before them)
    recv_channel[other] = int(rank_prefix[other - 1, me]) if other > 0 else 0  # other's range is empty
    send_head = ref.handle[5].clone()
    send_head[:, other] = -1
    handle = (rank_prefix.int(), ref.handle[1], recv_channel.int(), ref.handle[3][lo:hi], ref.handle[4], send_head)
    counts = inp.per_expert[me * el:(me + 1) * el].tolist()
    return DispatchRef(ref.recv_x[lo:hi], None, ref.recv_topk_idx[lo:hi], ref.recv_topk_weights[lo:hi], counts, handle,
                       hi - lo)


def emptied_ref(ref, me, other):
    """What `me` receives when `other` goes silent after notify: every row, those of `other`
    empty (x 0, top-k -1, weight 0, source index -1); counts and handle as exchanged."""
    lo, hi = rows_from(ref, other, me)
    recv_x, topk, weights, src = (ref.recv_x.clone(), ref.recv_topk_idx.clone(), ref.recv_topk_weights.clone(),
                                  ref.handle[3].clone())
    recv_x[lo:hi], topk[lo:hi], weights[lo:hi], src[lo:hi] = 0, -1, 0, -1
    handle = ref.handle[:3] + (src,) + ref.handle[4:]
    return DispatchRef(recv_x, None, topk, weights, ref.num_recv_tokens_per_expert_list, handle, ref.num_recv)


def alone_combine(ref, inp, me, y, weights):
    """Combine with every peer's contribution left out: me's own rows, back at their tokens. y
    has the rows of the dispatch that was combined: all of ref's, or me's alone (alone_ref)."""
    lo, hi = own_rows(ref, me)
    if y.size(0) != ref.num_recv:  # alone_ref's rows: me's come first
        lo, hi = 0, hi - lo
    tokens = inp.in_rank[:, me].nonzero().squeeze(1)
    x = torch.zeros(inp.tokens, y.size(1), dtype=torch.bfloat16)
    w = torch.zeros(inp.tokens, weights.size(1), dtype=torch.float32)
    x[tokens], w[tokens] = y[lo:hi], weights[lo:hi]
    return x, w


# ---------------------------------------------------------------- helpers
def new_buffer(ctx):
    buf = deep_ep.Buffer(ctx.group, num_nvl_bytes=hint_bytes(2, HIDDEN), explicitly_destroy=True, enable_shrink=True)
    ctx.buffers['shrink'] = buf
    return buf


def late_cached_dispatch(buf, x, handle, cycles):
    """A cached dispatch whose data kernel starts `cycles` after its notify: (dispatch's 6-tuple,
    whether the delay was put in). A cached dispatch waits for no count, so the ctypes path makes
    it one call, deepep_intranode_dispatch_fused (notify, then the data kernel); for this call that
    entry is replaced by its two steps, deepep_intranode_dispatch_prepare (the notify: it takes a
    cached dispatch and waits for nothing) and deepep_intranode_dispatch (the data kernel), with a
    GPU sleep between them. The compiled path is off for the call, as in late_dispatch."""
    from deep_ep_cpp import _normal
    from deep_ep_cpp._lib import MAX_LOCAL_EXPERTS

    lib, runtime = _normal.lib, buf.runtime
    fused, calls = lib.deepep_intranode_dispatch_fused, []
    num_recv, per_expert = ctypes.c_int(), (ctypes.c_int * MAX_LOCAL_EXPERTS)()

    def split(handle_, args, outs, stream):
        calls.append(stream)
        status = lib.deepep_intranode_dispatch_prepare(handle_, args, ctypes.addressof(num_recv),
                                                       ctypes.addressof(per_expert), MAX_LOCAL_EXPERTS, stream)
        if status:
            return status
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            torch.cuda._sleep(cycles)
        return lib.deepep_intranode_dispatch(handle_, args, outs, stream)

    lib.deepep_intranode_dispatch_fused = split
    try:
        with ctypes_launches(runtime):  # the entry above is taken
            return buf.dispatch(x, handle=handle), bool(calls)
    finally:
        lib.deepep_intranode_dispatch_fused = fused


# ---------------------------------------------------------------- phases
def silent_round(ctx, chk, buf, phase, inp, ref, cycles):
    """The round in which rank 1 goes silent. Rank 0 checks its results and counters."""
    if phase == 'cached_dispatch':
        silent_cached_round(ctx, chk, buf, inp, ref, cycles)
        return
    me = ctx.rank
    if me == SILENT:
        if phase == 'dispatch':
            out = late_dispatch(buf, inp, cycles)
            buf.combine(torch.randn(ref.num_recv, HIDDEN, dtype=torch.bfloat16), out[4], topk_weights=out[2])
        elif phase == 'combine':
            out = buf.dispatch(inp.x, **layout_args(inp))
            torch.cuda._sleep(cycles)  # combine's stream waits for this one
            buf.combine(torch.randn(ref.num_recv, HIDDEN, dtype=torch.bfloat16), out[4], topk_weights=out[2])
        return  # notify: rank 1 makes no call
    n01 = int(inp.in_rank[:, SILENT].sum())  # tokens rank 0 sends rank 1
    n10 = ref.num_recv - own_rows(ref, me)[1]  # rows rank 0 receives from rank 1
    start = time.monotonic()
    out = buf.dispatch(inp.x, **layout_args(inp))
    torch.cuda.synchronize()
    seconds = time.monotonic() - start
    if phase == 'notify':
        got_ref, want_dropped = alone_ref(ref, inp, me, SILENT), [0, n01, 0, 0]
    elif phase == 'dispatch':
        got_ref, want_dropped = emptied_ref(ref, me, SILENT), [n10, 0, 0, 0]
    else:
        got_ref, want_dropped = ref, [0, 0, 0, 0]
    chk(check_dispatch, out, got_ref, inp.in_rank)
    chk.expect(seconds < TIMEOUT_MS / 1000 + SLACK_S, f'the {phase} phase\'s dispatch took {seconds:.1f} s')
    state, want = shrink_state(buf, 2), ([0, 0] if phase == 'combine' else [0, 1], want_dropped)
    chk.expect(state == want, f'after the {phase} phase\'s dispatch: (mask, dropped) {state}, expected {want}')

    y = torch.randn(got_ref.num_recv, HIDDEN, dtype=torch.bfloat16)
    start = time.monotonic()
    got = buf.combine(y, out[4], topk_weights=out[2])
    torch.cuda.synchronize()
    seconds = time.monotonic() - start
    chk.expect(seconds < TIMEOUT_MS / 1000 + SLACK_S, f'the {phase} phase\'s combine took {seconds:.1f} s')
    chk(check_combine, got, alone_combine(ref, inp, me, y, out[2]))
    if phase == 'dispatch':
        want_dropped = [n10, 0, n01, n10]  # rank 1's contributions left out, its (empty) rows not sent back
    elif phase == 'combine':
        want_dropped = [0, 0, n01, 0]  # the rows rank 0 sent back fit rank 1's rings: sent
    got_state = shrink_state(buf, 2)
    chk.expect(got_state == ([0, 1], want_dropped),
               f'after the {phase} phase\'s combine: (mask, dropped) {got_state}, expected ([0, 1], {want_dropped})')


def silent_cached_round(ctx, chk, buf, inp, ref, cycles):
    """cached_dispatch phase: a full dispatch of inp with both ranks live gives the handle (every
    output checked against ref); then a cached dispatch with it of a new payload x2 (same routing)
    in which rank 1's data kernel starts `cycles` after its notify, then a combine with the
    handle and the full dispatch's weights. Rank 0: recv_x is x2's reference with rank 1's rows
    (their range in the handle) all zero, mask {1}, dropped [rows from rank 1, 0, 0, 0]; then the
    combine as in the dispatch phase (rank 1 left out, its rows not sent back)."""
    me = ctx.rank
    x2 = make_x('bf16', inp.tokens, HIDDEN)
    ref2 = expect_dispatch(ctx, inp, x=x2)  # collective, before rank 1 goes silent
    full = buf.dispatch(inp.x, **layout_args(inp))
    chk(check_dispatch, full, ref, inp.in_rank)
    handle = full[4]
    y = torch.randn(ref.num_recv, HIDDEN, dtype=torch.bfloat16)
    state = shrink_state(buf, 2)
    chk.expect(state == ([0, 0], [0, 0, 0, 0]), f'cached_dispatch phase, full dispatch: (mask, dropped) {state}')
    torch.cuda.synchronize()
    dist.barrier(group=ctx.group)  # both ranks enter the cached dispatch together
    if me == SILENT:
        _, delayed = late_cached_dispatch(buf, x2, handle, cycles)
        chk.expect(delayed, 'the cached dispatch did not take deepep_intranode_dispatch_fused: its data kernel '
                            'was not delayed')
        buf.combine(y, handle, topk_weights=full[2])
        return
    n01 = int(inp.in_rank[:, SILENT].sum())  # tokens rank 0 sends rank 1
    lo, hi = rows_from(ref, SILENT, me)
    n10 = hi - lo  # rows rank 0 receives from rank 1 (the handle's range of source 1)
    # recv_x comes from torch's allocator: blocks of its size, filled with 7.0 and freed, make a row
    # the kernel leaves unwritten nonzero (the rule says zero).
    junk = [torch.full_like(full[0], 7.0) for _ in range(4)]
    del junk
    start = time.monotonic()
    out = buf.dispatch(x2, handle=handle)
    torch.cuda.synchronize()
    seconds = time.monotonic() - start
    chk(check_cached, out, emptied_ref(ref2, me, SILENT))
    chk.expect(seconds < TIMEOUT_MS / 1000 + SLACK_S, f'the cached dispatch took {seconds:.1f} s')
    state, want = shrink_state(buf, 2), ([0, 1], [n10, 0, 0, 0])
    chk.expect(state == want, f'after the cached dispatch: (mask, dropped) {state}, expected {want}')

    start = time.monotonic()
    got = buf.combine(y, handle, topk_weights=full[2])
    torch.cuda.synchronize()
    seconds = time.monotonic() - start
    chk.expect(seconds < TIMEOUT_MS / 1000 + SLACK_S, f'the cached_dispatch phase\'s combine took {seconds:.1f} s')
    chk(check_combine, got, alone_combine(ref, inp, me, y, full[2]))
    want = ([0, 1], [n10, 0, n01, n10])  # rank 1's contributions left out, its rows not sent back
    state = shrink_state(buf, 2)
    chk.expect(state == want, f'after the cached_dispatch phase\'s combine: (mask, dropped) {state}, expected {want}')


def later_round(ctx, chk, buf, phase):
    """Both ranks, the peer masked (rank 1 masks rank 0 at this notify at the latest: rank 0 no
    longer writes its slot): each gets its own rows only, at once, and counts the tokens it did
    not send."""
    me, other = ctx.rank, 1 - ctx.rank
    inp = make_inputs(ctx, tokens=TOKENS, hidden=HIDDEN)
    ref = expect_dispatch(ctx, inp)  # collective, before any buffer call
    _, before = shrink_state(buf, 2)
    start = time.monotonic()
    out = buf.dispatch(inp.x, **layout_args(inp))
    y = torch.randn(out[0].size(0), HIDDEN, dtype=torch.bfloat16)
    got = buf.combine(y, out[4], topk_weights=out[2])
    torch.cuda.synchronize()
    seconds = time.monotonic() - start
    chk.expect(seconds < TIMEOUT_MS / 2000, f'{phase} phase, later round on rank {me} took {seconds:.2f} s: a wait on '
                                            f'the masked rank?')
    chk(check_dispatch, out, alone_ref(ref, inp, me, other), inp.in_rank)
    chk(check_combine, got, alone_combine(ref, inp, me, y, out[2]))
    mask, after = shrink_state(buf, 2)
    want_mask = [0, 1] if me == 0 else [1, 0]
    chk.expect(mask == want_mask, f'{phase} phase, later round: mask {mask} on rank {me}, expected {want_mask}')
    grew = [a - b for a, b in zip(after, before)]
    want = [0, int(inp.in_rank[:, other].sum()), 0, 0]
    chk.expect(grew == want, f'{phase} phase, later round: dropped grew by {grew} on rank {me}, expected {want}')


def shrink_phase(ctx, phase):
    assert ctx.world == 2, 'the references here are written for 2 ranks'
    chk = Checks()
    buf = new_buffer(ctx)
    try:
        chk(roundtrip, ctx, buf='shrink', tokens=TOKENS, hidden=HIDDEN)  # healthy first, every check exact
        state = shrink_state(buf, 2)
        chk.expect(state == ([0, 0], [0, 0, 0, 0]), f'healthy round: (mask, dropped) {state}')
        inp = make_inputs(ctx, tokens=TOKENS, hidden=HIDDEN)
        ref = expect_dispatch(ctx, inp)  # collective, before rank 1 goes silent
        cycles = sleep_cycles(SLEEP_MS)
        buf.runtime.set_gpu_timeout_ms(TIMEOUT_MS)
        torch.cuda.synchronize()
        dist.barrier(group=ctx.group)
        with watchdog(ctx.rep, f'shrink_{phase}', 60):
            silent_round(ctx, chk, buf, phase, inp, ref, cycles)
            torch.cuda.synchronize()  # rank 1: its late kernels are done
        dist.barrier(group=ctx.group)
        with watchdog(ctx.rep, f'shrink_{phase}', 30):
            later_round(ctx, chk, buf, phase)
        torch.cuda.synchronize()
        dist.barrier(group=ctx.group)
        if phase == 'notify':  # rank 1 missed ops: out of step for good, a new buffer is needed
            ctx.buffers.pop('shrink').destroy()
            buf = new_buffer(ctx)
        else:  # rank 1 made every call, late: it rejoins once both ranks cleared their masks
            buf.low_latency_clean_mask_buffer()
            torch.cuda.synchronize()
            dist.barrier(group=ctx.group)
        _, before = shrink_state(buf, 2)
        chk(roundtrip, ctx, buf='shrink', tokens=TOKENS, hidden=HIDDEN)
        mask, after = shrink_state(buf, 2)
        chk.expect(mask == [0, 0] and after == before, f'{phase} phase, after recovery: mask {mask}, dropped '
                                                       f'{before} -> {after}')
    finally:
        torch.cuda.synchronize()
        dist.barrier(group=ctx.group)
        if 'shrink' in ctx.buffers:
            ctx.buffers.pop('shrink').destroy()
    chk.done()


def worker(rank, world, group, rep):
    ctx = make_ctx(dist.new_group(list(range(world))), rep)
    for phase in PHASES:
        rep.run(f'shrink_silent_in_{phase}', shrink_phase, ctx, phase)


if __name__ == '__main__':
    num_gpus = torch.cuda.device_count()
    if num_gpus < 2:
        skip('w2/shrink', f'test_normal_shrink needs 2 GPUs, found {num_gpus}')
        sys.exit(1)
    spawn(worker, 2, timeout=300)
    finish()
