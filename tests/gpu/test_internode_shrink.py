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
of node r // 2), dispatch phase only: rank 3 (node 1, GPU 1) goes silent in dispatch. Its rows for
rank 0 go through the live forwarder rank 1, which ends rank 3's stream towards rank 0 with an end
marker: rank 0 empties those rows and masks rank 3, not rank 1. Without the marker rank 0's
receiver waits for slots that never come, masks the live rank 1 and leaves rank 3's rows unwritten
(mask check and recv_x check fail). Rank 3 is also the forwarder of node 1's GPU 1, so rank 2's rows
of ranks 1 and 3 never come: rank 2 gives up on rank 3 (twice the timeout) and empties them."""
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


def late_dispatch(buf, x, topk, w, cycles):
    """A dispatch whose data kernel starts `cycles` after its notify (prepare + host wait): the
    ctypes launch wrapped with a GPU sleep before it, as test_normal.late_dispatch."""
    from deep_ep_cpp import _internode

    launch = _internode.lib.deepep_internode_dispatch

    def delayed(handle, args, outs, stream):
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            torch.cuda._sleep(cycles)
        return launch(handle, args, outs, stream)

    _internode.lib.deepep_internode_dispatch = delayed
    try:
        return dispatch(buf, x, topk, w)[0]
    finally:
        _internode.lib.deepep_internode_dispatch = launch


def rows_of(src_x, src_topk, src_w, me, world=2):
    """Rows source sends to `me`, in token order: x, local top-k (-1 elsewhere), weights (0 elsewhere)."""
    el = E // world
    local = (src_topk >= me * el) & (src_topk < (me + 1) * el)
    take = local.any(1)
    topk = torch.where(local, src_topk - me * el, torch.full_like(src_topk, -1))[take]
    w = torch.where(local, src_w, torch.zeros_like(src_w))[take]
    return src_x[take], topk, w, take


def silent_round(ctx, chk, buf, phase, seed, cycles):
    me = ctx.rank
    x, topk, w = inputs(me, seed)
    ctx.rep.info(f'{phase}: silent round starts')
    if me == SILENT:
        if phase == 'dispatch':
            out = late_dispatch(buf, x, topk, w, cycles)
            buf.combine(out[0], out[4], topk_weights=out[2])
        elif phase == 'combine':
            out, _ = dispatch(buf, x, topk, w)
            torch.cuda._sleep(cycles)
            buf.combine(out[0], out[4], topk_weights=out[2])
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


# 2 nodes of 2, rank 3 silent in dispatch.
G2, WORLD2, SILENT2 = 2, 4, 3


def came_2x2(src, me):
    """Whether src's rows reach survivor `me` at 2x2 with SILENT2 silent in dispatch: a row of src
    crosses to the forwarder (node of me, GPU of src), then NVLink to me; neither may be SILENT2."""
    return src != SILENT2 and (me // G2) * G2 + src % G2 != SILENT2


def silent_dispatch_2x2(ctx, chk, buf, seed, cycles):
    me = ctx.rank
    x, topk, w = inputs(me, seed)
    ctx.rep.info('2x2 dispatch: silent round starts')
    if me == SILENT2:
        out = late_dispatch(buf, x, topk, w, cycles)
        buf.combine(out[0], out[4], topk_weights=out[2])
        return
    # Sources ascending: rows that come are exact, the others present but empty.
    parts, empty = [], 0
    for src in range(WORLD2):
        rx, rt, rw, _ = rows_of(*inputs(src, seed), me, WORLD2)
        if not came_2x2(src, me):
            rx, rt, rw = torch.zeros_like(rx), torch.full_like(rt, -1), torch.zeros_like(rw)
            empty += rx.size(0)
        parts.append((rx, rt, rw))
    want = tuple(torch.cat([p[i] for p in parts]) for i in range(3))
    start = time.monotonic()
    out, _ = dispatch(buf, x, topk, w)
    torch.cuda.synchronize()
    took = time.monotonic() - start
    ctx.rep.info(f'2x2 dispatch: dispatch done in {took:.1f} s on rank {me}')
    # Rank 2 waits twice the timeout for its forwarder rank 3 (dispatch_receive_shrink).
    chk.expect(took < 2 * TIMEOUT_MS / 1000 + SLACK_S, f'2x2 dispatch: dispatch too slow on rank {me}')
    expect_received(chk, out, want, '2x2 dispatch', f' on rank {me}')
    got_x, got_w = state_then_combine(ctx, chk, buf, out, WORLD2, ([0, 0, 0, 1], [empty, 0, 0, 0]), '2x2 dispatch',
                                      f' on rank {me}')
    # Each token's sum over the ranks its row reached (rows that came: copies of x; empty rows
    # and masked ranks give nothing); weights: each expert's weight where its rank got the row.
    el = E // WORLD2
    _, _, _, in_rank = dispatch_layout(buf, topk)
    reached = torch.stack([in_rank[:, d] & came_2x2(me, d) if d != SILENT2 else torch.zeros_like(in_rank[:, d])
                           for d in range(WORLD2)], 1)
    ref_x = (x.float() * reached.sum(1, keepdim=True).float()).to(x.dtype)
    ref_w = torch.where(reached.gather(1, topk // el), w, torch.zeros_like(w))
    chk.expect(torch.allclose(got_x.float(), ref_x.float(), rtol=2e-2, atol=2e-2), f'2x2 dispatch: combined_x on rank {me}')
    chk.expect(torch.allclose(got_w, ref_w, rtol=1e-5, atol=1e-6), f'2x2 dispatch: combined_topk_weights on rank {me}')
    mask, dropped = shrink_state(buf, WORLD2)
    # No fault (combine would raise), rank 3 alone masked, the dispatch's counters unchanged
    # (combine's own, indices 2 and 3, are not checked here).
    chk.expect(mask == [0, 0, 0, 1] and dropped[:2] == [empty, 0],
               f'2x2 dispatch: rank {me} after combine (mask, dropped) {(mask, dropped)}')


def dispatch_layout(buf, topk):
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
    return per_rank, per_rdma, per_expert, in_rank


def later_round_2x2(ctx, chk, buf, seed):
    """Rank 3 masked on every survivor: nobody waits on it; rows of it or through it are absent
    (notify), and the rows for it count as not sent: at a sender whose forwarder is rank 3 (its
    tokens' destination ranks on node 1), at the forwarder rank 2 (its rows for GPU 1)."""
    me = ctx.rank
    x, topk, w = inputs(me, seed)
    _, before = shrink_state(buf, WORLD2)
    start = time.monotonic()
    out, _ = dispatch(buf, x, topk, w)
    buf.combine(out[0], out[4], topk_weights=out[2])
    torch.cuda.synchronize()
    if me == SILENT2:
        return
    chk.expect(time.monotonic() - start < TIMEOUT_MS / 2000, f'2x2 later round waited on the masked rank (rank {me})')
    want_x = torch.cat([rows_of(*inputs(src, seed), me, WORLD2)[0] for src in range(WORLD2) if came_2x2(src, me)])
    chk.expect(out[0].shape == want_x.shape and torch.equal(out[0], want_x), f'2x2 later round recv_x on rank {me}')
    if me % G2 == SILENT2 % G2:
        not_sent = sum(int(rows_of(x, topk, w, d, WORLD2)[3].sum()) for d in (2, 3))
    elif me // G2 == SILENT2 // G2:
        not_sent = sum(int(rows_of(*inputs(src, seed), SILENT2, WORLD2)[3].sum()) for src in (0, 2))
    else:
        not_sent = 0
    mask, after = shrink_state(buf, WORLD2)
    chk.expect(mask == [0, 0, 0, 1], f'2x2 later round mask {mask} on rank {me}')
    chk.expect(after[NOT_SENT] - before[NOT_SENT] == not_sent,
               f'2x2 later round not-sent {before} -> {after} on rank {me}, expected +{not_sent}')


def phase_run_2x2(ctx):
    chk = Checks()
    seed = 7
    with shrink_buffer(ctx, '2x2 dispatch', G2) as buf:
        buf.runtime.set_gpu_timeout_ms(TIMEOUT_MS)
        cycles = sleep_cycles(SLEEP_MS)
        torch.cuda.synchronize()
        dist.barrier(group=ctx.group)
        with watchdog(ctx.rep, 'internode_shrink_2x2_dispatch', 60):
            silent_dispatch_2x2(ctx, chk, buf, seed, cycles)
            torch.cuda.synchronize()
        dist.barrier(group=ctx.group)
        ctx.rep.info('2x2 dispatch: later round')
        with watchdog(ctx.rep, 'internode_shrink_2x2_dispatch', 30):
            later_round_2x2(ctx, chk, buf, seed + 10)
    ctx.rep.info('2x2 dispatch: recovery on a new buffer')
    with shrink_buffer(ctx, '2x2 dispatch', G2) as buf:
        x, topk, w = inputs(ctx.rank, seed + 20)
        out, _ = dispatch(buf, x, topk, w)
        torch.cuda.synchronize()
        chk.expect(shrink_state(buf, WORLD2) == ([0] * WORLD2, [0, 0, 0, 0]), '2x2 dispatch: after recovery')
        chk.expect(out[0].size(0) > 0, '2x2 dispatch: after recovery, no rows')
    chk.done()


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
    chk = Checks()
    seed = PHASES.index(phase)
    with shrink_buffer(ctx, phase) as buf:
        buf.runtime.set_gpu_timeout_ms(TIMEOUT_MS)
        cycles = sleep_cycles(SLEEP_MS)
        torch.cuda.synchronize()
        dist.barrier(group=ctx.group)
        with watchdog(ctx.rep, f'internode_shrink_{phase}', 60):
            silent_round(ctx, chk, buf, phase, seed, cycles)
            torch.cuda.synchronize()
        dist.barrier(group=ctx.group)
        ctx.rep.info(f'{phase}: later round')
        with watchdog(ctx.rep, f'internode_shrink_{phase}', 30):
            later_round(ctx, chk, buf, phase, seed + 10)
    ctx.rep.info(f'{phase}: recovery on a new buffer')
    with shrink_buffer(ctx, phase) as buf:
        x, topk, w = inputs(ctx.rank, seed + 20)
        out, _ = dispatch(buf, x, topk, w)
        torch.cuda.synchronize()
        chk.expect(shrink_state(buf, 2) == ([0, 0], [0, 0, 0, 0]), f'{phase}: after recovery')
        chk.expect(out[0].size(0) > 0, f'{phase}: after recovery, no rows')
    chk.done()


def worker(rank, world, group, rep):
    from types import SimpleNamespace
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device('cuda')
    ctx = SimpleNamespace(group=dist.new_group(list(range(world))), rank=rank, rep=rep)
    if world == WORLD2:
        rep.run('internode_shrink_2x2_silent_in_dispatch', phase_run_2x2, ctx)
        return
    for phase in PHASES:
        rep.run(f'internode_shrink_silent_in_{phase}', phase_run, ctx, phase)


if __name__ == '__main__':
    if torch.cuda.device_count() < 2:
        skip('w2/internode_shrink', f'test_internode_shrink needs 2 GPUs, found {torch.cuda.device_count()}')
        sys.exit(1)
    spawn(worker, 2, timeout=300)
    if torch.cuda.device_count() >= WORLD2:
        spawn(worker, WORLD2, timeout=120)
    else:
        print(f'test_internode_shrink: 2x2 run skipped, it needs {WORLD2} GPUs, found {torch.cuda.device_count()}')
    finish()
