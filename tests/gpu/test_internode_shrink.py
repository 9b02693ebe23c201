"""Shrink (enable_shrink=True) in internode normal mode (docs/internode.md, "Shrink") on 2 GPUs as
2 virtual nodes of 1 (DEEPEP_VIRTUAL_NODE_SIZE=1: each rank is its own node and forwarder):
rank 1 goes silent, rank 0 finishes the op without it.

Phases, each on a fresh shrink buffer: notify (rank 1 makes no call: rank 0's notify wait
expires), dispatch (rank 1's dispatch data kernel starts after a GPU sleep past rank 0's timeout),
combine (rank 1's combine starts after such a sleep). Rank 0 must finish within the timeout plus
slack; its recv_x / top-k / weights equal the torch reference with rank 1's traffic removed (notify:
its rows absent; dispatch: its rows present but empty: x 0, top-k -1, weight 0), its combine the
sum over the survivors, mask exactly {1}, dropped counters exact. Then a later round skips rank 1
at once, and a new buffer (internode recovery always needs one: the scale-out running totals of a
masked pair are out of step) is exact again. Handle entries are not checked here (test_internode.py
checks them without shrink).

With 4 GPUs it also runs 4 ranks as 2 nodes of 2 (DEEPEP_VIRTUAL_NODE_SIZE=2; rank r is GPU r % 2
of node r // 2), rank 3 (node 1, GPU 1) silent, the three phases as above, dispatch first, then a
cached dispatch:
* dispatch: rank 3's rows for rank 0 go through the live forwarder rank 1, which ends rank 3's
  stream towards rank 0 with an end marker: rank 0 empties those rows and masks rank 3, not rank 1.
  Without the marker rank 0's receiver waits for slots that never come, masks the live rank 1 and
  leaves rank 3's rows unwritten (mask check and recv_x check fail). Rank 3 is also the forwarder
  of node 1's GPU 1, so rank 2's rows of ranks 1 and 3 never come: rank 2 gives up on rank 3
  (one timeout: rank 3 never started the op) and empties them.
* notify: every survivor's notify wait on rank 3 expires; rows of rank 3, and at rank 2 those of
  rank 1 (its forwarder on node 1 is rank 3), are absent. Not sent (index 1): rank 1's tokens for
  node 1 (one per destination rank), rank 2's forwarded rows for rank 3; combine leaves rank 3's
  part of those rows out at rank 2 (index 2: their send_nvl_head entries are >= 0).
* combine: dispatch is complete for all 4; every survivor's combine notify wait expires, and the
  combine leaves out what goes through rank 3: rank 2 (forwarder beside it) leaves out its rows
  and sends it nothing, rank 1 leaves out node 1's row of its tokens (forwarder rank 3) and sends
  back nothing of rank 3's rows it forwarded.
* cached_dispatch: a dispatch with all 4 live gives the handle, then a cached dispatch with it in
  which rank 3 is silent as in the dispatch phase. Ranks 0 and 1 get what they get there (rank 3's
  rows emptied by rank 1's end marker, or by rank 1 as their forwarder). Rank 2 gives up on its
  forwarder rank 3 and, with no recv_src_meta to tell which rows came, empties every row of
  sources 1 and 3 and counts them (no marker counted any). The kernels before this rule counted
  the untaken slots (the rows plus a marker per node and channel) and left those rows as the
  allocator gave them: the test fills freed blocks of recv_x's size with 7.0 first, so such rows
  are nonzero (the count differs either way).
Every survivor's outputs are checked against rows_of / a sum over the kept contributions, the
mask is exactly {3}, the dropped counters exact (combine_dropped_2x2 names the kernel lines), then
a later round and recovery on a new buffer."""
import os
import sys
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

import deep_ep
from common import Checks, finish, shrink_state, skip, spawn, watchdog
from test_normal import sleep_cycles

SILENT = 1
TIMEOUT_MS = 2000
SLEEP_MS = 3 * TIMEOUT_MS
SLACK_S = 5
TOKENS, HIDDEN, TOPK, E = 256, 2048, 4, 16  # a channel's rows fit its ring: no sender waits for credits
PHASES = ('notify', 'dispatch', 'combine')
RECV_EMPTY, NOT_SENT, COMBINE_LEFT_OUT, COMBINE_NOT_SENT = range(4)


def new_buffer(group, node_size=1):
    os.environ['DEEPEP_VIRTUAL_NODE_SIZE'] = str(node_size)
    cfg = deep_ep.Buffer.get_dispatch_config(2)
    nvl = cfg.get_nvl_buffer_size_hint(HIDDEN * 2, 2 * node_size)
    rdma = cfg.get_rdma_buffer_size_hint(HIDDEN * 2, 16)
    return deep_ep.Buffer(group, nvl, rdma, explicitly_destroy=True, enable_shrink=True)


def expect_received(chk, out, want, label, where):
    """The dispatch outputs (recv_x, recv_topk_idx, recv_topk_weights) equal `want`, shapes included."""
    for got, expected, name in zip(out[:3], want, ('recv_x', 'recv_topk_idx', 'recv_topk_weights')):
        got = got.long() if name == 'recv_topk_idx' else got
        chk.expect(got.shape == expected.shape and torch.equal(got, expected), f'{label}: {name}{where}')


def state_then_combine(ctx, chk, buf, out, world, want_state, label, where):
    """Checks (mask, dropped) after the dispatch `out`, then combines it back within the timeout:
    (combined_x, combined_topk_weights)."""
    state = shrink_state(buf, world)
    chk.expect(state == want_state, f'{label}: after dispatch (mask, dropped) {state}, expected {want_state}{where}')
    start = time.monotonic()
    got_x, got_w, _ = buf.combine(out[0], out[4], topk_weights=out[2])
    torch.cuda.synchronize()
    ctx.rep.info(f'{label}: combine done in {time.monotonic() - start:.1f} s{where}')
    chk.expect(time.monotonic() - start < TIMEOUT_MS / 1000 + SLACK_S, f'{label}: combine too slow{where}')
    return got_x, got_w


def inputs(rank, seed):
    g = torch.Generator(device='cpu').manual_seed(seed * 10 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g, device='cpu').to(torch.bfloat16).cuda()
    topk = torch.stack([torch.randperm(E, generator=g, device="cpu")[:TOPK] for _ in range(TOKENS)])
    weights = torch.rand(TOKENS, TOPK, generator=g, device='cpu').float().cuda()
    return x, topk.long().cuda(), weights


def dispatch(buf, x, topk, weights):
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
    out = buf.dispatch(x, topk_idx=topk, topk_weights=weights, num_tokens_per_rank=per_rank,
                       num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                       num_tokens_per_expert=per_expert)
    return out, in_rank


def late_dispatch(buf, x, topk, w, cycles, handle=None):
    """A dispatch whose data kernel starts `cycles` after its notify (prepare + host wait): the
    ctypes launch wrapped with a GPU sleep before it, as test_normal.late_dispatch (this call takes
    the ctypes path: the compiled one calls the library's launch directly). With `handle`, a cached
    dispatch. Returns dispatch's 6-tuple."""
    from deep_ep_cpp import _internode

    launch = _internode.lib.deepep_internode_dispatch

    def delayed(handle, args, outs, stream):
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            torch.cuda._sleep(cycles)
        return launch(handle, args, outs, stream)

    runtime = buf.runtime
    compiled, runtime._internode_fast = runtime._internode_fast, None
    _internode.lib.deepep_internode_dispatch = delayed
    try:
        return dispatch(buf, x, topk, w)[0] if handle is None else buf.dispatch(x, handle=handle)
    finally:
        _internode.lib.deepep_internode_dispatch = launch
        runtime._internode_fast = compiled


def rows_of(src_x, src_topk, src_w, me, world=2):
    """Rows source sends to `me`, in token order: x, local top-k (-1 elsewhere), weights (0 elsewhere)."""
    el = E // world
    local = (src_topk >= me * el) & (src_topk < (me + 1) * el)
    take = local.any(1)
    topk = torch.where(local, src_topk - me * el, torch.full_like(src_topk, -1))[take]
    w = torch.where(local, src_w, torch.zeros_like(src_w))[take]
    return src_x[take], topk, w, take


def go_silent(buf, phase, x, topk, w, cycles):
    """The silent rank's round: notify: no call at all (the survivors' notify wait expires);
    dispatch: its data kernel starts `cycles` after its notify; combine: a normal dispatch, then its
    combine starts `cycles` late (the survivors' combine notify expires)."""
    if phase == 'dispatch':
        out = late_dispatch(buf, x, topk, w, cycles)
        buf.combine(out[0], out[4], topk_weights=out[2])
    elif phase == 'combine':
        out, _ = dispatch(buf, x, topk, w)
        torch.cuda._sleep(cycles)
        buf.combine(out[0], out[4], topk_weights=out[2])


def silent_round(ctx, chk, buf, phase, seed, cycles):
    me = ctx.rank
    x, topk, w = inputs(me, seed)
    ctx.rep.info(f'{phase}: silent round starts')
    if me == SILENT:
        go_silent(buf, phase, x, topk, w, cycles)
        return
    ox, ot, ow = inputs(SILENT, seed)
    own = rows_of(x, topk, w, me)
    peer = rows_of(ox, ot, ow, me)
    n01 = int(rows_of(x, topk, w, SILENT)[3].sum())
    n10 = int(peer[3].sum())
    start = time.monotonic()
    out, _ = dispatch(buf, x, topk, w)
    torch.cuda.synchronize()
    ctx.rep.info(f'{phase}: dispatch done in {time.monotonic() - start:.1f} s')
    chk.expect(time.monotonic() - start < TIMEOUT_MS / 1000 + SLACK_S, f'{phase}: dispatch too slow')
    if phase == 'notify':
        want = own[:3]
        want_dropped = [0, n01, 0, 0]
    elif phase == 'dispatch':  # rank 1's rows present but empty, after rank 0's (sources ascending)
        want = (torch.cat([own[0], torch.zeros_like(peer[0])]), torch.cat([own[1], torch.full_like(peer[1], -1)]),
                torch.cat([own[2], torch.zeros_like(peer[2])]))
        want_dropped = [n10, 0, 0, 0]
    else:
        want = tuple(torch.cat([a, b]) for a, b in zip(own[:3], peer[:3]))
        want_dropped = [0, 0, 0, 0]
    expect_received(chk, out, want, phase, '')
    want_state = ([0, 0] if phase == 'combine' else [0, 1], want_dropped)
    got_x, got_w = state_then_combine(ctx, chk, buf, out, 2, want_state, phase, '')
    # Survivors only: rank 0's own rows back at their tokens (G = 1: one row per token and node).
    ref_x = torch.zeros_like(x)
    ref_w = torch.zeros_like(w)
    k = int(own[3].sum())
    ref_x[own[3]], ref_w[own[3]] = out[0][:k], out[2][:k]
    chk.expect(torch.equal(got_x, ref_x), f'{phase}: combined_x')
    chk.expect(torch.equal(got_w, ref_w), f'{phase}: combined_topk_weights')
    if phase == 'dispatch':
        want_dropped = [n10, 0, n01, n10]
    elif phase == 'combine':  # combine's notify masks rank 1 before the data kernel: nothing sent back
        want_dropped = [0, 0, n01, n10]
    state = shrink_state(buf, 2)
    chk.expect(state == ([0, 1], want_dropped), f'{phase}: after combine (mask, dropped) {state}')


def later_round(ctx, chk, buf, phase, seed):
    me, other = ctx.rank, 1 - ctx.rank
    x, topk, w = inputs(me, seed)
    own = rows_of(x, topk, w, me)
    not_sent = int(rows_of(x, topk, w, other)[3].sum())
    _, before = shrink_state(buf, 2)
    start = time.monotonic()
    out, _ = dispatch(buf, x, topk, w)
    got_x, _, _ = buf.combine(out[0], out[4], topk_weights=out[2])
    torch.cuda.synchronize()
    chk.expect(time.monotonic() - start < TIMEOUT_MS / 2000, f'{phase}: later round waited on the masked rank')
    chk.expect(torch.equal(out[0], own[0]), f'{phase}: later round recv_x on rank {me}')
    mask, after = shrink_state(buf, 2)
    chk.expect(mask == ([0, 1] if me == 0 else [1, 0]), f'{phase}: later round mask {mask} on rank {me}')
    chk.expect(after[NOT_SENT] - before[NOT_SENT] == not_sent, f'{phase}: later round not-sent {before} -> {after}')


# 2 nodes of 2, rank 3 (node 1, GPU 1) silent in notify, in dispatch or in combine. The dispatch
# phase runs first: it is the one that passed on 4x H100 before the other two were added.
G2, WORLD2, SILENT2 = 2, 4, 3
PHASES2 = ('dispatch', 'notify', 'combine', 'cached_dispatch')


def came_2x2(src, me):
    """Whether the path between src and survivor `me` avoids SILENT2 (masked or silent): a row of
    src crosses to the forwarder (node of me, GPU of src), then NVLink to me; neither may be
    SILENT2. Combine takes the same path back."""
    return src != SILENT2 and (me // G2) * G2 + src % G2 != SILENT2


def rows_count(src, dst, seed):
    """Rows source rank src sends to rank dst (its tokens with an expert on dst)."""
    return int(rows_of(*inputs(src, seed), dst, WORLD2)[3].sum())


def node_tokens(src, node, seed):
    """Tokens of src with an expert on `node`: its scale-out rows towards that node."""
    owner = inputs(src, seed)[1] // (E // WORLD2)
    return int((owner // G2 == node).any(1).sum())


def forwarded_for_silent(me, seed):
    """Rows that `me`, a forwarder on SILENT2's node, takes for SILENT2: those of the sources of its
    GPU on every node (its send_nvl_head column SILENT2 % G2 is >= 0 on each)."""
    return sum(rows_count(src, SILENT2, seed) for src in range(me % G2, WORLD2, G2))


def not_sent_2x2(me, seed):
    """Index 1 of a dispatch with SILENT2 masked at its notify: a sender whose forwarder on
    SILENT2's node is SILENT2 sends nothing to that node (each token counted once per destination
    rank there, dispatch_send); the forwarder beside SILENT2 forwards it nothing (one per row,
    dispatch_forward); a sender on the other GPUs sends normally (its forwarder counts)."""
    silent_node = SILENT2 // G2
    if me % G2 == SILENT2 % G2:
        return sum(rows_count(me, d, seed) for d in range(silent_node * G2, (silent_node + 1) * G2))
    if me // G2 == silent_node:
        return forwarded_for_silent(me, seed)
    return 0


def combine_dropped_2x2(me, seed, phase):
    """Indices 2 (left out) and 3 (not sent back) of the silent round's combine on survivor `me`,
    SILENT2 masked at its start (notify: since the dispatch's notify; combine: since the combine's).
    A forwarder beside SILENT2 leaves out SILENT2's row of every row whose head names it
    (combine_forward; notify: the heads of the rows it did not forward are >= 0 too) and sends
    SILENT2 nothing of the rows of its GPU's sources (combine_nvl_send; notify: none came). A rank
    whose forwarder on SILENT2's node is SILENT2 leaves out that node's row of each of its tokens
    (combine_receive; notify: send_rdma_head -1, none) and sends nothing back of SILENT2's rows it
    forwarded (combine_forward; notify: none came)."""
    silent_node, silent_gpu = divmod(SILENT2, G2)
    left_out = not_sent = 0
    if me // G2 == silent_node:
        left_out += forwarded_for_silent(me, seed)
        if phase == 'combine':
            not_sent += sum(rows_count(src, me, seed) for src in range(silent_gpu, WORLD2, G2))
    if me % G2 == silent_gpu and phase == 'combine':
        left_out += node_tokens(me, silent_node, seed)
        not_sent += node_tokens(SILENT2, me // G2, seed)
    return left_out, not_sent


def expected_rows_2x2(me, seed, lost):
    """Survivor me's (recv_x, recv_topk_idx, recv_topk_weights), sources ascending, and the count
    of emptied rows. Rows whose path is not came_2x2 are `lost`: 'empty' (present but empty:
    silent in dispatch), 'absent' (masked at notify), or None (they come: silent in combine)."""
    parts, empty = [], 0
    for src in range(WORLD2):
        rx, rt, rw, _ = rows_of(*inputs(src, seed), me, WORLD2)
        if lost is not None and not came_2x2(src, me):
            if lost == 'absent':
                continue
            rx, rt, rw = torch.zeros_like(rx), torch.full_like(rt, -1), torch.zeros_like(rw)
            empty += rx.size(0)
        parts.append((rx, rt, rw))
    return tuple(torch.cat([p[i] for p in parts]) for i in range(3)), empty


def combined_reference_2x2(buf, x, topk, w, me):
    """Survivor me's (combined_x, combined_topk_weights): each token's sum over the ranks its row
    reached and whose path avoids SILENT2 (rows that came: copies of x; empty rows, absent rows
    and SILENT2's give nothing); weights: each expert's weight where its rank's row is kept."""
    el = E // WORLD2
    _, _, _, in_rank = dispatch_layout(buf, topk)
    reached = torch.stack([in_rank[:, d] & came_2x2(me, d) if d != SILENT2 else torch.zeros_like(in_rank[:, d])
                           for d in range(WORLD2)], 1)
    ref_x = (x.float() * reached.sum(1, keepdim=True).float()).to(x.dtype)
    ref_w = torch.where(reached.gather(1, topk // el), w, torch.zeros_like(w))
    return ref_x, ref_w


def silent_round_2x2(ctx, chk, buf, phase, seed, cycles):
    if phase == 'cached_dispatch':
        silent_cached_round_2x2(ctx, chk, buf, seed, cycles)
        return
    me, name = ctx.rank, f'2x2 {phase}'
    x, topk, w = inputs(me, seed)
    ctx.rep.info(f'{name}: silent round starts')
    if me == SILENT2:
        go_silent(buf, phase, x, topk, w, cycles)
        return
    # notify: rows of SILENT2 or through it absent; dispatch: those rows present but empty;
    # combine: every row comes (SILENT2 goes silent after dispatch).
    want, empty = expected_rows_2x2(me, seed, {'notify': 'absent', 'dispatch': 'empty', 'combine': None}[phase])
    prefill_freed(want[0])
    start = time.monotonic()
    out, _ = dispatch(buf, x, topk, w)
    torch.cuda.synchronize()
    took = time.monotonic() - start
    ctx.rep.info(f'{name}: dispatch done in {took:.1f} s on rank {me}')
    unwritten_rows(ctx, chk, buf, out, want[0], name, took)
    # Dispatch: rank 2 waits one timeout for its forwarder rank 3, which never started the op
    # (wait_slot_or_end; waiting twice, rank 2 reached combine a timeout after ranks 0 and 1,
    # whose waits on it then expired, masking it); notify: one timeout on rank 3's notify
    # counter; combine: no wait.
    limit = TIMEOUT_MS / 1000 + SLACK_S
    chk.expect(took < limit, f'{name}: dispatch too slow on rank {me}')
    expect_received(chk, out, want, name, f' on rank {me}')
    if phase == 'dispatch':
        want_state = ([0, 0, 0, 1], [empty, 0, 0, 0])
    elif phase == 'notify':
        want_state = ([0, 0, 0, 1], [0, not_sent_2x2(me, seed), 0, 0])
    else:
        want_state = ([0] * WORLD2, [0, 0, 0, 0])
    got_x, got_w = state_then_combine(ctx, chk, buf, out, WORLD2, want_state, name, f' on rank {me}')
    ref_x, ref_w = combined_reference_2x2(buf, x, topk, w, me)
    chk.expect(torch.allclose(got_x.float(), ref_x.float(), rtol=2e-2, atol=2e-2), f'{name}: combined_x on rank {me}')
    chk.expect(torch.allclose(got_w, ref_w, rtol=1e-5, atol=1e-6), f'{name}: combined_topk_weights on rank {me}')
    mask, dropped = shrink_state(buf, WORLD2)
    if phase == 'dispatch':
        # No fault (combine would raise), rank 3 alone masked, the dispatch's counters unchanged
        # (combine's own, indices 2 and 3, are not checked here).
        chk.expect(mask == [0, 0, 0, 1] and dropped[:2] == [empty, 0],
                   f'{name}: rank {me} after combine (mask, dropped) {(mask, dropped)}')
    else:
        want_state = ([0, 0, 0, 1], want_state[1][:2] + list(combine_dropped_2x2(me, seed, phase)))
        chk.expect((mask, dropped) == want_state,
                   f'{name}: rank {me} after combine (mask, dropped) {(mask, dropped)}, expected {want_state}')


def silent_cached_round_2x2(ctx, chk, buf, seed, cycles):
    """A dispatch with every rank live, then a cached dispatch with its handle in which SILENT2 is
    silent (its data kernel late, as in the dispatch phase), then a combine with that handle."""
    me, name = ctx.rank, '2x2 cached_dispatch'
    x, topk, w = inputs(me, seed)
    full, _ = dispatch(buf, x, topk, w)
    handle = full[4]
    torch.cuda.synchronize()
    chk.expect(torch.equal(full[0], expected_rows_2x2(me, seed, None)[0][0]), f'{name}: full dispatch on rank {me}')
    chk.expect(shrink_state(buf, WORLD2) == ([0] * WORLD2, [0, 0, 0, 0]), f'{name}: full dispatch state on rank {me}')
    ctx.rep.info(f'{name}: silent round starts')
    if me == SILENT2:
        out = late_dispatch(buf, x, topk, w, cycles, handle=handle)
        buf.combine(out[0], handle)
        return
    # The rows of SILENT2 or through it: emptied as in the dispatch phase on ranks 0 and 1 (end
    # markers; the forwarder's own rows), and on rank 2 all of sources 1 and 3 (its receiver gave
    # up on its forwarder SILENT2: dispatch_receive_shrink's cached rule, rows in the ranges less
    # those its markers counted, none here). Index 0 counts exactly those rows; nothing is counted
    # as not sent: every ring fits its rows, so no wait on SILENT2 expires before its rows left.
    want, empty = expected_rows_2x2(me, seed, 'empty')
    # recv_x comes from torch.empty: blocks of its size freed just before, filled with 7.0, make
    # a row the kernel leaves unwritten nonzero (exact zeros are required).
    junk = [torch.full_like(full[0], 7.0) for _ in range(4)]
    del junk
    start = time.monotonic()
    recv_x = buf.dispatch(x, handle=handle)[0]
    torch.cuda.synchronize()
    took = time.monotonic() - start
    ctx.rep.info(f'{name}: cached dispatch done in {took:.1f} s on rank {me}')
    # Rank 2 waits one timeout for its forwarder rank 3, which never started the op.
    chk.expect(took < TIMEOUT_MS / 1000 + SLACK_S, f'{name}: cached dispatch too slow on rank {me}')
    chk.expect(recv_x.shape == want[0].shape and torch.equal(recv_x, want[0]), f'{name}: recv_x on rank {me}')
    state, want_state = shrink_state(buf, WORLD2), ([0, 0, 0, 1], [empty, 0, 0, 0])
    chk.expect(state == want_state, f'{name}: after dispatch (mask, dropped) {state}, expected {want_state} on rank {me}')
    start = time.monotonic()
    got_x, _, _ = buf.combine(recv_x, handle)
    torch.cuda.synchronize()
    chk.expect(time.monotonic() - start < TIMEOUT_MS / 1000 + SLACK_S, f'{name}: combine too slow on rank {me}')
    # The rows that came are copies of x, the others zero, as in the dispatch phase.
    ref_x, _ = combined_reference_2x2(buf, x, topk, w, me)
    chk.expect(torch.allclose(got_x.float(), ref_x.float(), rtol=2e-2, atol=2e-2), f'{name}: combined_x on rank {me}')
    mask, dropped = shrink_state(buf, WORLD2)
    chk.expect(mask == [0, 0, 0, 1] and dropped[:2] == [empty, 0],
               f'{name}: rank {me} after combine (mask, dropped) {(mask, dropped)}')


def dispatch_layout(buf, topk):
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
    return per_rank, per_rdma, per_expert, in_rank


UNWRITTEN_FILL = -5.0  # what prefill_freed leaves in blocks a dispatch may take for recv_x


def prefill_freed(like):
    """Diagnostic: blocks of `like`'s size, filled with UNWRITTEN_FILL and freed, so that a recv_x
    taken from them shows a row the dispatch never wrote (every row of a dispatch is written, with
    data or zeros, so this changes no result)."""
    junk = [torch.full_like(like, UNWRITTEN_FILL) for _ in range(4)]
    del junk


def unwritten_rows(ctx, chk, buf, out, want_x, label, took):
    """Diagnostic check after a (synchronized) non-cached dispatch on a survivor: no row of
    recv_src_meta (handle[7]) may still hold dispatch_receive_shrink's sentinel -2 (the next
    combine's check would fail on it). Each such row is printed with its source rank, channel and
    place in that channel's range (handle[6], handle[5]), and what its recv_x holds (the expected
    row, zeros, UNWRITTEN_FILL: never written, another expected row: misplaced); then (mask,
    dropped), read in a try, as a fault the dispatch recorded (DEEPEP_FAULT_SHRINK_UNWRITTEN, the
    receiver group's tallies) surfaces at that call. Printed on every survivor, also without such
    rows: the dispatch time and state, to compare the ranks."""
    me, handle = ctx.rank, out[4]
    meta = handle[7].view(torch.int32).reshape(-1, 2)
    bad = (meta[:, 0] == -2).nonzero().flatten().tolist()
    try:
        state = shrink_state(buf, WORLD2)
    except Exception as e:  # the dispatch's fault, reported once: printed, then the checks go on
        state = f'{type(e).__name__}: {e}'
    ctx.rep.info(f'{label}: dispatch {took:.2f} s on rank {me}, rows {meta.size(0)} (expected {want_x.size(0)}), '
                 f'{len(bad)} left at -2, (mask, dropped) {state}')
    if not bad:
        return
    rank_sum = handle[6].cpu().tolist()
    chan = handle[5].cpu()
    recv_x, same_shape = out[0], out[0].shape == want_x.shape
    lines = []
    for r in bad[:24]:
        src = sum(1 for v in rank_sum if v <= r)
        starts = chan[src].tolist() if src < len(rank_sum) else []
        ch = max([i for i, v in enumerate(starts) if 0 <= v <= r], default=-1)
        stop = (starts[ch + 1] if ch + 1 < len(starts) else rank_sum[src]) if ch >= 0 else -1
        row = recv_x[r]
        if bool((row == UNWRITTEN_FILL).all()):
            what = 'never written (fill)'
        elif same_shape and torch.equal(row, want_x[r]):
            what = 'the expected row'
        elif not bool(row.any()):
            what = 'zeros'
        else:
            hits = (want_x == row).all(1).nonzero().flatten().tolist() if same_shape else []
            what = f'expected row(s) {hits[:4]}' if hits else 'other data'
        lines.append(f'row {r}: source {src}, channel {ch}, place {r - starts[ch] if ch >= 0 else -1} of '
                     f'{stop - starts[ch] if ch >= 0 else -1}, meta word 1 {int(meta[r, 1])}, recv_x {what}')
    ctx.rep.info(f'{label}: rank {me} rows at -2: ' + '; '.join(lines))
    chk.expect(False, f'{label}: {len(bad)} recv_src_meta rows left at -2 on rank {me} (first {bad[:8]}); '
                      f'state {state}')


def later_round_2x2(ctx, chk, buf, phase, seed):
    """Rank 3 masked on every survivor: nobody waits on it; rows of it or through it are absent
    (notify), and the rows for it count as not sent: at a sender whose forwarder is rank 3 (its
    tokens' destination ranks on node 1), at the forwarder rank 2 (its rows for GPU 1)."""
    me, name = ctx.rank, f'2x2 {phase}'
    x, topk, w = inputs(me, seed)
    _, before = shrink_state(buf, WORLD2)
    want_x = expected_rows_2x2(me, seed, 'absent')[0][0]
    if me != SILENT2:
        prefill_freed(want_x)
    start = time.monotonic()
    out, _ = dispatch(buf, x, topk, w)
    torch.cuda.synchronize()
    took = time.monotonic() - start
    if me != SILENT2:  # diagnostic (a check too): rows left unwritten, before combine trips on them
        unwritten_rows(ctx, chk, buf, out, want_x, f'{name} later round', took)
    start = time.monotonic()
    buf.combine(out[0], out[4], topk_weights=out[2])
    torch.cuda.synchronize()
    if me == SILENT2:
        return
    took += time.monotonic() - start  # dispatch and combine, as before (the diagnostic left out)
    chk.expect(took < TIMEOUT_MS / 2000, f'{name}: later round waited on the masked rank (rank {me})')
    chk.expect(out[0].shape == want_x.shape and torch.equal(out[0], want_x), f'{name}: later round recv_x on rank {me}')
    not_sent = not_sent_2x2(me, seed)
    mask, after = shrink_state(buf, WORLD2)
    chk.expect(mask == [0, 0, 0, 1], f'{name}: later round mask {mask} on rank {me}')
    chk.expect(after[NOT_SENT] - before[NOT_SENT] == not_sent,
               f'{name}: later round not-sent {before} -> {after} on rank {me}, expected +{not_sent}')


def run_phase(ctx, phase, prefix, seed, node_size, world, silent, later):
    """One phase: a silent round, a later round on the same buffer (the mask kept), then a new
    buffer whose first dispatch has a clean state. `prefix` ('' or '2x2 ') starts its labels."""
    chk = Checks()
    name, test = f'{prefix}{phase}', f"internode_shrink_{prefix.replace(' ', '_')}{phase}"
    with shrink_buffer(ctx, name, node_size) as buf:
        buf.runtime.set_gpu_timeout_ms(TIMEOUT_MS)
        cycles = sleep_cycles(SLEEP_MS)
        torch.cuda.synchronize()
        dist.barrier(group=ctx.group)
        with watchdog(ctx.rep, test, 60):
            silent(ctx, chk, buf, phase, seed, cycles)
            torch.cuda.synchronize()
        dist.barrier(group=ctx.group)
        ctx.rep.info(f'{name}: later round')
        with watchdog(ctx.rep, test, 30):
            later(ctx, chk, buf, phase, seed + 10)
    ctx.rep.info(f'{name}: recovery on a new buffer')
    with shrink_buffer(ctx, name, node_size) as buf:
        x, topk, w = inputs(ctx.rank, seed + 20)
        out, _ = dispatch(buf, x, topk, w)
        torch.cuda.synchronize()
        chk.expect(shrink_state(buf, world) == ([0] * world, [0, 0, 0, 0]), f'{name}: after recovery')
        chk.expect(out[0].size(0) > 0, f'{name}: after recovery, no rows')
    chk.done()


def phase_run_2x2(ctx, phase):
    run_phase(ctx, phase, '2x2 ', 7 + PHASES2.index(phase), G2, WORLD2, silent_round_2x2, later_round_2x2)


@contextmanager
def shrink_buffer(ctx, phase, node_size=1):
    """A new shrink buffer, destroyed collectively on exit; an exception is printed before that
    cleanup, which can fail too when the ranks are out of step."""
    buf = new_buffer(ctx.group, node_size)
    try:
        yield buf
    except Exception as e:
        ctx.rep.info(f'{phase}: {type(e).__name__}: {e}')
        raise
    finally:
        torch.cuda.synchronize()
        dist.barrier(group=ctx.group)
        buf.destroy()


def phase_run(ctx, phase):
    run_phase(ctx, phase, '', PHASES.index(phase), 1, 2, silent_round, later_round)


def wanted(name):
    """Whether phase `name` ('2x1_notify', '2x2_cached_dispatch', ...) runs: every phase, or those
    INTERNODE_SHRINK_PHASES names (space-separated; seeds stay per phase, so a phase alone is
    the same run)."""
    only = os.environ.get('INTERNODE_SHRINK_PHASES', '').split()
    return not only or name in only


def worker(rank, world, group, rep):
    from types import SimpleNamespace
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device('cuda')
    ctx = SimpleNamespace(group=dist.new_group(list(range(world))), rank=rank, rep=rep)
    if world == WORLD2:
        for phase in filter(lambda p: wanted(f'2x2_{p}'), PHASES2):
            rep.run(f'internode_shrink_2x2_silent_in_{phase}', phase_run_2x2, ctx, phase)
        return
    for phase in filter(lambda p: wanted(f'2x1_{p}'), PHASES):
        rep.run(f'internode_shrink_silent_in_{phase}', phase_run, ctx, phase)


if __name__ == '__main__':
    if torch.cuda.device_count() < 2:
        skip('w2/internode_shrink', f'test_internode_shrink needs 2 GPUs, found {torch.cuda.device_count()}')
        sys.exit(1)
    if any(wanted(f'2x1_{p}') for p in PHASES):
        spawn(worker, 2, timeout=300)
    if any(wanted(f'2x2_{p}') for p in PHASES2):
        if torch.cuda.device_count() >= WORLD2:
            spawn(worker, WORLD2, timeout=300)  # four phases of about 10-20 s each (a silent rank sleeps 6 s)
        else:
            print(f'test_internode_shrink: 2x2 run skipped, it needs {WORLD2} GPUs, found {torch.cuda.device_count()}')
    finish()
