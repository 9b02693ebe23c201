"""The LL protocol under lag, misuse and recovery on 2 GPUs, through the public deep_ep.Buffer API,
against the torch reference (ll_reference.py). The virtual-rank cases of the same findings are
test_ll_generations.py; this file runs them where the window is NCCL's and the peer a real GPU.

Every rank derives every rank's inputs from seeds (no gather), so each case is a few LL calls.
A rank made late sleeps on the GPU (torch.cuda._sleep) before its call, so its peer's receive
finds nothing yet. Each case has its own Buffer (GPU timeout 3 s; a stalled buffer is left behind).

  lagging_rank                rank 1 late at every call: exact (the NCCL EP #2303 guard)
  dropped_dispatch_hook       F1: rank 0 never calls one dispatch's hook; two calls later, on the same
  dropped_combine_hook        half with rank 1 late, its receive must wait: before the fix it returned
                              the dropped op's data at once
  doubled_hook                F1: a hook called twice is an error naming it, and the buffer goes on
                              exact (before: no error, then a deadlock until the GPU timeout)
  graph_one_dispatch          F5: a CUDA graph holding one low_latency_dispatch, replayed between eager
                              LL calls: exact; replayed twice in a row: the next call raises (two
                              sends on one half), and after a clean the buffer goes on exact (before:
                              nothing is raised)
  shape_change_without_clean  F6: LL rounds at E = 64, 16, 64 with no clean: exact (before: a stall)
  shrink_masked_rank_rejoins  F3: rank 1 misses a dispatch (rank 0 masks it), makes it late, both clear
                              the mask without a clean; the next op on that half, rank 1 late: exact,
                              nobody masked (before: rank 0 took the stale flag and the old data)

  graph_replay_after_stall[_hooks]
                              F9: dispatch + combine captured in a CUDA graph (_hooks: FP8 dispatch,
                              both receives by hook; GPU timeout 1.5 s), one replay exact; then rank 1
                              stops replaying. Rank 0's replays, the one whose waits expire and the
                              next (graph.replay() only, no library call between), must leave recv_x
                              (and its scales), the handle's src_info and layout_range and combined_x
                              all 0xff bytes, packed_recv_count all -1; then is_available() is False
                              and the next call raises naming rank 1's dispatch (before: the outputs
                              held rank 0's own rows and counts and the last good replay's rows)

  corrupted_handle_combine    issue 24 item 3: low_latency_combine with a handle whose src_info holds
                              a token index >= M, then one whose layout_range addresses rows past the
                              expert's: the next call raises naming the entry, the RDMA region past the
                              LL area (a guard filled with a pattern) is untouched, and after a clean
                              the buffer goes on exact (before: the rows were written at the bad index)

Usage: PYTHONPATH=compat/python python tests/gpu/test_ll_generations_2gpu.py [-k REGEX]"""
import argparse
import re
import sys
import time

import torch
import torch.distributed as dist

import deep_ep
from common import Checks, expect_raises_match, finish, skip, spawn, watchdog
from ll_reference import bf16_ulp_distance, ref_ll_combine, ref_ll_dispatch

BF16 = torch.bfloat16
M, H, E, K = 64, 2048, 16, 4
SLEEP = 20_000_000  # GPU cycles (~10 ms)
TIMEOUT_MS = 3000
STALL_MS = 1500  # graph_replay_after_stall: a replay waits this long per receive kind and half


class Case:
    """One Buffer and the inputs of numbered ops, the same on every rank (seeded per op and rank)."""

    def __init__(self, group, num_experts=E, shapes=(), guard_bytes=0, **kwargs):
        self.group, self.rank, self.world = group, group.rank(), group.size()
        self.E = num_experts
        size = max(deep_ep.Buffer.get_low_latency_rdma_size_hint(M, H, self.world, e) for e in (num_experts, *shapes))
        self.ll_bytes, self.guard_bytes = size, guard_bytes  # what the LL ops may touch; the guard follows it
        self.buf = deep_ep.Buffer(group, num_rdma_bytes=size + guard_bytes, low_latency_mode=True,
                                  num_qps_per_rank=max(1, num_experts // self.world), explicitly_destroy=True, **kwargs)
        self.buf.runtime.set_gpu_timeout_ms(TIMEOUT_MS)

    def inputs(self, op, num_experts=None):
        """x [T, H] and topk_idx [T, K] of every rank for op number `op` (T varies per rank)."""
        e = num_experts or self.E
        all_x, all_topk = [], []
        for r in range(self.world):
            g = torch.Generator().manual_seed(1000 * op + r)
            t = M - 7 * r
            all_x.append(torch.randn(t, H, generator=g).to(BF16).cuda())
            all_topk.append(torch.rand(t, e, generator=g).topk(K, dim=1).indices.cuda())
        return all_x, all_topk

    def expert_outputs(self, op, num_experts=None):
        """y [E_l, R*M, H] of every rank and this rank's weights [T, K] for combine op `op`."""
        e = num_experts or self.E
        g = torch.Generator().manual_seed(7 + 1000 * op)
        ys = [torch.randn(e // self.world, self.world * M, H, generator=g).to(BF16).cuda() for _ in range(self.world)]
        _, topk = self.inputs(op, e)
        weights = torch.rand(topk[self.rank].shape, generator=g).cuda()
        return ys, weights

    def dispatch(self, op, hook=False, late=(), num_experts=None):
        all_x, all_topk = self.inputs(op, num_experts)
        if self.rank in late:
            torch.cuda._sleep(SLEEP)
        out = self.buf.low_latency_dispatch(all_x[self.rank], all_topk[self.rank], M, num_experts or self.E,
                                            use_fp8=False, return_recv_hook=hook)
        return out

    def combine(self, op, dispatched, hook=False, late=(), num_experts=None):
        """Combine op `op` over dispatch result `dispatched` (of the same op number's inputs)."""
        ys, weights = self.expert_outputs(op, num_experts)
        _, all_topk = self.inputs(op, num_experts)
        if self.rank in late:
            torch.cuda._sleep(SLEEP)
        return self.buf.low_latency_combine(ys[self.rank], all_topk[self.rank], weights, dispatched[2],
                                            return_recv_hook=hook)

    def check_dispatch(self, what, op, out, masked=(), num_experts=None, use_fp8=False):
        all_x, all_topk = self.inputs(op, num_experts)
        ref = ref_ll_dispatch(all_x, all_topk, self.rank, num_experts or self.E, M, use_fp8=use_fp8,
                              masked_ranks=masked)
        recv_x, count, handle = out[0], out[1], out[2]
        pairs = [('recv_count', count, ref.count), ('layout_range', handle[1], ref.layout_range),
                 ('src_info', handle[0][ref.valid], ref.src_info[ref.valid])]
        if use_fp8:  # FP8 rows compared as bytes; the scales' view is column-major (DeepEP's)
            pairs += [('recv_x', recv_x[0].view(torch.uint8)[ref.valid], ref.x.view(torch.uint8)[ref.valid]),
                      ('recv_x_scales', recv_x[1][ref.valid], ref.x_scales[ref.valid])]
        else:
            pairs.append(('recv_x', recv_x[ref.valid], ref.x[ref.valid]))
        for name, got, want in pairs:
            assert torch.equal(got, want), f'{what}: {name} differs from the reference'

    def check_combine(self, what, op, combined, num_experts=None):
        ys, weights = self.expert_outputs(op, num_experts)
        _, all_topk = self.inputs(op, num_experts)
        want = ref_ll_combine(ys, all_topk, self.rank, weights, num_experts or self.E, M)
        ulps = bf16_ulp_distance(combined, want)
        assert int(ulps.max()) <= 1, f'{what}: combined_x off by up to {int(ulps.max())} BF16 ulp'

    def round(self, chk, op, late=(), hook=False, num_experts=None):
        """Dispatch op `op`, then combine its expert outputs; both checked."""
        d = self.dispatch(op, hook, late, num_experts)
        if hook:
            d[4]()
        torch.cuda.synchronize()
        chk(self.check_dispatch, f'dispatch {op}', op, d, num_experts=num_experts)
        c = self.combine(op, d, hook, late, num_experts)
        if hook:
            c[2]()
        torch.cuda.synchronize()
        chk(self.check_combine, f'combine {op}', op, c[0], num_experts=num_experts)

    def destroy(self, rep, name):
        dist.barrier(group=self.group)
        with watchdog(rep, name, 60):
            try:
                torch.cuda.synchronize()
                self.buf.destroy()
            except RuntimeError as e:  # a stalled buffer (before the fix) may report it again
                rep.info(f'{name}: destroy() raised {e}')


# ---------------------------------------------------------------- cases
def lagging_rank(case, chk):
    for op in range(1, 4):
        case.round(chk, op, late=(1,), hook=op % 2 == 0)


def dropped_hook(case, chk, kind):
    case.round(chk, 1)  # halves 0, 1
    a = case.dispatch(2)  # half 0
    torch.cuda.synchronize()
    if kind == 'dispatch':
        b = case.dispatch(3, hook=True)  # half 1: rank 0 drops the hook
    else:
        b = case.combine(2, a, hook=True)
    if case.rank != 0:
        b[-1]()
    c = case.dispatch(4)  # half 0
    if kind == 'dispatch':
        d = case.dispatch(5, hook=True, late=(1,))  # half 1, rank 1 late
        d[4]()
        torch.cuda.synchronize()
        chk(case.check_dispatch, 'dispatch 5 (the dropped hook two calls before)', 5, d)
    else:
        d = case.combine(4, c, hook=True, late=(1,))
        d[2]()
        torch.cuda.synchronize()
        chk(case.check_combine, 'combine 4 (the dropped hook two calls before)', 4, d[0])
    chk.agree(case.group)
    case.round(chk, 6, late=(1,), hook=True)


def doubled_hook(case, chk):
    case.round(chk, 1)
    b = case.dispatch(2, hook=True)
    b[4]()
    if case.rank == 0:
        try:
            b[4]()
            chk.expect(False, 'a second call of the dispatch hook raised nothing')
        except RuntimeError as e:
            chk.expect(re.search(r'receive hook runs once', str(e)) is not None, f'second hook call: {e}')
    torch.cuda.synchronize()
    chk(case.check_dispatch, 'dispatch 2', 2, b)
    c = case.combine(2, b, hook=True)
    c[2]()
    torch.cuda.synchronize()
    chk(case.check_combine, 'combine 2', 2, c[0])
    case.round(chk, 3, late=(1,), hook=True)


def graph_one_dispatch(case, chk):
    case.round(chk, 1)
    all_x, all_topk = case.inputs(2)
    x, topk = all_x[case.rank].clone(), all_topk[case.rank].clone()

    def step():
        return case.buf.low_latency_dispatch(x, topk, M, case.E, use_fp8=False)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
        step()  # even: the eager calls below keep alternating with the graph
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode='thread_local'):
        out = step()
    # The graph's op always takes half 0 and eager calls keep alternating on the host, so only one
    # replay-then-eager pair alternates (a second eager call would take half 0 after a replay).
    graph.replay()
    torch.cuda.synchronize()
    chk(case.check_dispatch, 'replay', 2, out)
    chk(case.check_dispatch, 'eager dispatch after the replay', 3, case.dispatch(3))
    torch.cuda.synchronize()
    dist.barrier(group=case.group)
    graph.replay()
    graph.replay()  # two sends in a row on the graph's half
    torch.cuda.synchronize()
    dist.barrier(group=case.group)
    try:
        case.dispatch(9)
        torch.cuda.synchronize()
        chk.expect(False, 'no error after a one-dispatch graph was replayed twice in a row')
    except RuntimeError as e:
        chk.expect(re.search(r'two low-latency sends in a row used buffer half', str(e)) is not None,
                   f'after two replays in a row: {e}')
    del graph
    # The host's next half is the graph's again: a clean puts the halves back in step.
    case.buf.clean_low_latency_buffer(M, H, case.E)
    case.round(chk, 10, late=(1,))


def shape_change_without_clean(case, chk):
    for i, e in enumerate((64, 16, 64)):
        case.round(chk, 1 + i, num_experts=e)


def shrink_masked_rank_rejoins(case, chk):
    case.round(chk, 1)
    dist.barrier(group=case.group)
    if case.rank == 0:
        x = case.dispatch(2)  # half 0: rank 1 is silent, rank 0 masks it after the timeout
        torch.cuda.synchronize()
        chk(case.check_dispatch, 'dispatch 2 with rank 1 silent', 2, x, masked=(1,))
        mask = torch.zeros(case.world, dtype=torch.int32, device='cuda')
        case.buf.low_latency_query_mask_buffer(mask)
        chk.expect(mask.tolist() == [0, 1], f'mask after the silent rank: {mask.tolist()}')
    dist.barrier(group=case.group)
    if case.rank == 1:
        case.dispatch(2)  # the late call: its signal lands after rank 0's receive ended
        torch.cuda.synchronize()
    dist.barrier(group=case.group)
    case.buf.low_latency_clean_mask_buffer()  # no clean_low_latency_buffer
    torch.cuda.synchronize()
    dist.barrier(group=case.group)
    y = case.dispatch(3)  # half 1
    torch.cuda.synchronize()
    chk(case.check_dispatch, 'dispatch 3', 3, y)
    z = case.dispatch(4, late=(1,))  # half 0, rank 1 late
    torch.cuda.synchronize()
    chk(case.check_dispatch, 'dispatch 4 (half of the late signal)', 4, z)
    mask = torch.zeros(case.world, dtype=torch.int32, device='cuda')
    case.buf.low_latency_query_mask_buffer(mask)
    chk.expect(mask.tolist() == [0, 0], f'mask after the rejoin: {mask.tolist()}')


def graph_replay_after_stall(case, chk, hook):
    case.buf.runtime.set_gpu_timeout_ms(STALL_MS)  # before capture: each launch keeps its budget
    case.round(chk, 1)
    all_x, all_topk = case.inputs(2)
    x, topk = all_x[case.rank].clone(), all_topk[case.rank].clone()
    ys, weights = case.expert_outputs(2)
    y = ys[case.rank].clone()
    use_fp8 = hook  # the hook variant also covers the FP8 scales

    def step():
        d = case.buf.low_latency_dispatch(x, topk, M, case.E, use_fp8=use_fp8, return_recv_hook=hook)
        if hook:
            d[4]()
        c = case.buf.low_latency_combine(y, topk, weights, d[2], return_recv_hook=hook)
        if hook:
            c[2]()
        return d, c[0]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside capture, as torch recommends
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode='thread_local'):
        out, combined = step()
    graph.replay()
    torch.cuda.synchronize()
    chk(case.check_dispatch, 'replay', 2, out, use_fp8=use_fp8)
    chk(case.check_combine, 'replay', 2, combined)
    chk.agree(case.group)

    dist.barrier(group=case.group)
    if case.rank == 0:  # rank 1 stops replaying: it goes on to the barrier of destroy()
        recv_x, scales = out[0] if use_fp8 else (out[0], None)
        for replay in ('the replay whose waits expired', 'the next replay'):
            graph.replay()  # no library call between the replays
            torch.cuda.synchronize()
            for name, t in (('recv_x', recv_x), ('combined_x', combined)):
                chk.expect(bool((t.view(torch.uint8) == 0xff).all()), f'{replay}: {name} is not all 0xff bytes')
            if scales is not None:  # same element size: the column-major view may change dtype
                chk.expect(bool((scales.view(torch.int32) == -1).all()), f'{replay}: recv_x_scales not all 0xff')
            for name, t in (('packed_recv_count', out[1]), ('src_info', out[2][0]), ('layout_range', out[2][1])):
                chk.expect(bool((t == -1).all()), f'{replay}: {name} is not all -1: {t.flatten()[:8].tolist()}')
        chk.expect(not case.buf.runtime.is_available(), 'is_available() is True after the stall')
        chk(expect_raises_match, 'the next call after the stall', RuntimeError, lambda: case.dispatch(3),
            r'rank 1 never sent its low-latency dispatch')
    del graph


def corrupted_handle_combine(case, chk):
    # DeepEP's view runs num_rdma_bytes from the offset (past the window's end): only the guard's bytes.
    guard = case.buf.get_local_buffer_tensor(torch.uint8, offset=case.ll_bytes, use_rdma_buffer=True)[:case.guard_bytes]
    for entry, op in (('src_info', 2), ('layout_range', 3)):
        case.round(chk, op - 1)
        guard.fill_(0x5a)
        torch.cuda.synchronize()
        dist.barrier(group=case.group)
        d = case.dispatch(op)
        torch.cuda.synchronize()
        src_info, layout_range = d[2][0].clone(), d[2][1].clone()
        if entry == 'src_info':  # the first row of the first (local expert, source) block that has rows
            e, j = next((e, j) for e in range(layout_range.size(0)) for j in range(case.world)
                        if int(layout_range[e, j]) & 0xffffffff)
            src_info[e, int(layout_range[e, j]) >> 32] = M + 5
        else:  # rows of (expert 0, source 1) said to start past the expert's R*M rows
            layout_range[0, 1] = ((case.world * M) << 32) | max(1, int(layout_range[0, 1]) & 0xffffffff)
        bad = (src_info, layout_range, *d[2][2:])
        case.combine(op, (d[0], d[1], bad))
        torch.cuda.synchronize()
        dist.barrier(group=case.group)
        try:
            case.buf.clean_low_latency_buffer(M, H, case.E)
            torch.cuda.synchronize()
            chk.expect(False, f'no error after a combine over a handle with a bad {entry}')
        except RuntimeError as e:
            chk.expect(re.search(rf'low_latency_combine: the handle.s {entry}', str(e)) is not None,
                       f'after a bad {entry}: {e}')
        torch.cuda.synchronize()
        chk.expect(bool((guard == 0x5a).all()), f'a combine over a bad {entry} wrote past the LL area')
        case.buf.clean_low_latency_buffer(M, H, case.E)
        dist.barrier(group=case.group)
    case.round(chk, 9)


CASES = {
    'lagging_rank': (lagging_rank, {}),
    'dropped_dispatch_hook': (lambda case, chk: dropped_hook(case, chk, 'dispatch'), {}),
    'dropped_combine_hook': (lambda case, chk: dropped_hook(case, chk, 'combine'), {}),
    'doubled_hook': (doubled_hook, {}),
    'graph_one_dispatch': (graph_one_dispatch, {}),
    'shape_change_without_clean': (shape_change_without_clean, dict(shapes=(64,))),
    'shrink_masked_rank_rejoins': (shrink_masked_rank_rejoins, dict(enable_shrink=True)),
    'corrupted_handle_combine': (corrupted_handle_combine, dict(guard_bytes=8 << 20)),
    # Last: their buffers are left stalled.
    'graph_replay_after_stall': (lambda case, chk: graph_replay_after_stall(case, chk, hook=False), {}),
    'graph_replay_after_stall_hooks': (lambda case, chk: graph_replay_after_stall(case, chk, hook=True), {}),
}


def worker(rank, world, group, rep, pattern):
    group = dist.new_group(list(range(world)))
    for name, (fn, kwargs) in CASES.items():
        if not re.search(pattern, name):
            continue

        def run(fn=fn, kwargs=kwargs, name=name):
            case = Case(group, **kwargs)
            chk = Checks()
            try:
                with watchdog(rep, name, 120):
                    fn(case, chk)
            except RuntimeError as e:  # a stall (before the fix): this rank's check fails, the others go on
                chk.expect(False, f'{type(e).__name__}: {e}')
            finally:
                case.destroy(rep, name)
            chk.done()

        start = time.monotonic()
        rep.run(name, run)
        if rank == 0:
            print(f'  {name}: {time.monotonic() - start:.1f} s', flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('-k', dest='pattern', default='', help='run only the cases whose name matches this regex')
    parser.add_argument('--timeout', type=int, default=600, help='seconds before the workers are killed')
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        skip('test_ll_generations_2gpu', f'needs 2 GPUs, found {torch.cuda.device_count()}')
        return 0
    spawn(worker, 2, args.pattern, timeout=args.timeout)
    finish()


if __name__ == '__main__':
    sys.exit(main())
