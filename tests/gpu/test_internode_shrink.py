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
checks them without shrink)."""
import os
import sys
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

import deep_ep
from common import Checks, finish, skip, spawn, watchdog
from test_normal import sleep_cycles

SILENT = 1
TIMEOUT_MS = 2000
SLEEP_MS = 3 * TIMEOUT_MS
SLACK_S = 5
TOKENS, HIDDEN, TOPK, E = 256, 2048, 4, 16  # a channel's rows fit its ring: no sender waits for credits
PHASES = ('notify', 'dispatch', 'combine')
RECV_EMPTY, NOT_SENT, COMBINE_LEFT_OUT, COMBINE_NOT_SENT = range(4)


def new_buffer(group):
    os.environ['DEEPEP_VIRTUAL_NODE_SIZE'] = '1'
    cfg = deep_ep.Buffer.get_dispatch_config(2)
    nvl = cfg.get_nvl_buffer_size_hint(HIDDEN * 2, 2)
    rdma = cfg.get_rdma_buffer_size_hint(HIDDEN * 2, 16)
    return deep_ep.Buffer(group, nvl, rdma, explicitly_destroy=True, enable_shrink=True)


def query(buf):
    mask = torch.zeros(2, dtype=torch.int32)
    dropped = torch.zeros(4, dtype=torch.int64)
    buf.low_latency_query_mask_buffer(mask)
    buf.normal_query_dropped_buffer(dropped)
    torch.cuda.synchronize()
    return mask.tolist(), dropped.tolist()


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


def rows_of(src_x, src_topk, src_w, me):
    """Rows source sends to `me`, in token order: x, local top-k (-1 elsewhere), weights (0 elsewhere)."""
    el = E // 2
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
    chk.expect(out[0].shape == want[0].shape and torch.equal(out[0], want[0]), f'{phase}: recv_x')
    chk.expect(out[1].shape == want[1].shape and torch.equal(out[1].long(), want[1]), f'{phase}: recv_topk_idx')
    chk.expect(out[2].shape == want[2].shape and torch.equal(out[2], want[2]), f'{phase}: recv_topk_weights')
    state = query(buf)
    want_state = ([0, 0] if phase == 'combine' else [0, 1], want_dropped)
    chk.expect(state == want_state, f'{phase}: after dispatch (mask, dropped) {state}, expected {want_state}')
    start = time.monotonic()
    got_x, got_w, _ = buf.combine(out[0], out[4], topk_weights=out[2])
    torch.cuda.synchronize()
    ctx.rep.info(f'{phase}: combine done in {time.monotonic() - start:.1f} s')
    chk.expect(time.monotonic() - start < TIMEOUT_MS / 1000 + SLACK_S, f'{phase}: combine too slow')
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
    state = query(buf)
    chk.expect(state == ([0, 1], want_dropped), f'{phase}: after combine (mask, dropped) {state}')


def later_round(ctx, chk, buf, phase, seed):
    me, other = ctx.rank, 1 - ctx.rank
    x, topk, w = inputs(me, seed)
    own = rows_of(x, topk, w, me)
    not_sent = int(rows_of(x, topk, w, other)[3].sum())
    _, before = query(buf)
    start = time.monotonic()
    out, _ = dispatch(buf, x, topk, w)
    got_x, _, _ = buf.combine(out[0], out[4], topk_weights=out[2])
    torch.cuda.synchronize()
    chk.expect(time.monotonic() - start < TIMEOUT_MS / 2000, f'{phase}: later round waited on the masked rank')
    chk.expect(torch.equal(out[0], own[0]), f'{phase}: later round recv_x on rank {me}')
    mask, after = query(buf)
    chk.expect(mask == ([0, 1] if me == 0 else [1, 0]), f'{phase}: later round mask {mask} on rank {me}')
    chk.expect(after[NOT_SENT] - before[NOT_SENT] == not_sent, f'{phase}: later round not-sent {before} -> {after}')


@contextmanager
def shrink_buffer(ctx, phase):
    """A new shrink buffer, destroyed collectively on exit; an exception is printed before that
    cleanup, which can fail too when the ranks are out of step."""
    buf = new_buffer(ctx.group)
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
        chk.expect(query(buf) == ([0, 0], [0, 0, 0, 0]), f'{phase}: after recovery')
        chk.expect(out[0].size(0) > 0, f'{phase}: after recovery, no rows')
    chk.done()


def worker(rank, world, group, rep):
    from types import SimpleNamespace
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device('cuda')
    ctx = SimpleNamespace(group=dist.new_group(list(range(world))), rank=rank, rep=rep)
    for phase in PHASES:
        rep.run(f'internode_shrink_silent_in_{phase}', phase_run, ctx, phase)


if __name__ == '__main__':
    if torch.cuda.device_count() < 2:
        skip('w2/internode_shrink', f'test_internode_shrink needs 2 GPUs, found {torch.cuda.device_count()}')
        sys.exit(1)
    spawn(worker, 2, timeout=300)
    finish()
