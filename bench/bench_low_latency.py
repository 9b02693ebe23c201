"""Low-latency (LL) dispatch/combine benchmark through the public deep_ep.Buffer API.

One process per GPU, DeepEP's LL shape (hidden 7168, top-8 of 288 experts, FP8 dispatch, BF16
combine), swept over tokens per rank T.

Data and routing as DeepEP's tests/test_low_latency.py: x = randn * 0.1 (BF16), top-k of
|randn| + 1 scores, |randn| weights, 10 random (token, slot) positions set to -1 (duplicates
possible, so at T = 1 most of the token's slots end up masked: --masked-slots changes it).
M = num_max_dispatch_tokens_per_rank is T rounded up so that R*M % 4 == 0 (--m-policy max128:
max(T, 128) rounded the same way); one Buffer per T, sized with get_low_latency_rdma_size_hint(M,
H, R, E), num_qps_per_rank = E/R, destroyed after the T. Before timing, every T is checked: the
per-expert receive counts against the all-gathered routing, the received-count stats, the
combine of the dequantised rows against x * sum of the valid weights (calc_diff < 1e-3), the
hook-mode result and the graph replay result likewise.

Measured per T (phase 1 before any profiler session, since CUPTI can leave launch overhead
behind; phase 2 with the profiler):
  (a) GPU time per call of every kernel of each op, per rank (torch.profiler, CUDA + CPU
      activity, N back-to-back iterations after an fp32 8192^3 matmul and an all-reduce that
      line the ranks up, as DeepEP's bench_kineto(barrier_comm_profiling=True)). Every call
      runs inside a record_function range; a GPU activity belongs to the range whose CPU
      interval holds the runtime/driver call that launched it (CUPTI correlation id). The op's
      own kernels are those whose name contains '::dispatch' / '::combine'; anything else
      launched inside an LL call (kernels, memcpy, memset) is reported as "other" (expected:
      none). Non-hook mode: one dispatch + one combine per iteration. Hook mode
      (return_recv_hook=True): dispatch send, a BF16 matmul gap (so that the receive kernel
      measures receiving, not waiting, as DeepEP's large_gemm_with_hook), hook() = dispatch
      recv, combine send, gap, hook() = combine recv.
  (b) end to end of a CUDA-graph replay of one captured dispatch + combine pair (CUDA events
      around each replay, bench_common.bench, after a dist barrier);
  (c) end to end of plain dispatch + combine calls (bench_common.bench = DeepEP's
      tests/utils.bench), DeepEP's "Dispatch + combine bandwidth" line;
  (d) the Megatron-style NCCL all-to-all dispatcher (shared/bench/torch_alltoall_baseline.py,
      BF16, de-duplicated per rank, host sync for the counts) on the same routing: end to end
      (bench) and the sum of its kernels (profiler).
Bytes as DeepEP counts them, per rank, over the rank's valid (token, k) selections: dispatch
(FP8) H + H/128*4 + 16 per selection, combine 2H; the all-to-all counts its received BF16 rows.
Tables: rank average of the per-rank time, min/max over ranks, GB/s likewise.

Run: python bench/bench_low_latency.py [--num-processes N] [--tokens 1 16 128] [--quick] [--json PATH]
"""
import argparse
import json
import os
import random
import sys

import torch
import torch.distributed as dist
import torch.profiler
from torch.profiler import record_function

# An LL wait that never completes should fail the run, not eat the device budget.
os.environ.setdefault('DEEPEP_GPU_TIMEOUT_SECS', '60')

import deep_ep  # noqa: E402
from bench_common import AllToAllDispatcher, bench, init_worker, spawn_workers, trace_events  # noqa: E402
from bench_normal import calc_diff, fmt, machine_info  # noqa: E402

HIDDEN = 7168
NUM_EXPERTS = 288
NUM_TOPK = 8
TOKENS = (1, 16, 64, 128, 256, 512)
QUICK_TOKENS = (1, 128)
NUM_MASKED = 10  # DeepEP's test sets 10 random top-k slots to -1
COMBINE_TOLERANCE = 1e-3  # calc_diff; DeepEP's test uses 7e-4 for FP8 dispatch
RANGE = 'bench_ll:'  # record_function prefix of the profiled calls
LAUNCH_CATS = ('cuda_runtime', 'cuda_driver', 'runtime', 'driver')
GPU_CATS = ('kernel', 'gpu_memcpy', 'gpu_memset')

# shared/reference/baselines.md, 4x H200 (NV18), 128 tokens/rank, hidden 7168, top-8.
# Other runs on a shared machine: compare ratios measured in one run.
REFERENCE = {
    'source': 'shared/reference/baselines.md, measured 2026-11-21 on nvidia-h200-x4',
    'num_tokens': 128,
    'deepep_v1': {'dispatch_us': 32, 'combine_us': 57, 'e2e_us': 94.8,
                  'hook_dispatch_us': [25.3, 8.1], 'hook_combine_us': [45.8, 9.5],
                  'method': 'kineto per kernel (dispatch 32-37 us, combine 56-58 us over ranks), CUDA events '
                            'for dispatch + combine end to end; 288 experts, FP8 dispatch'},
    'deepep_v2': {'dispatch_us': [21.2, 3.5], 'combine_us': [25.8, 6.5],
                  'method': 'kineto: main kernel + follow-up kernel (dispatch copy, combine reduce); '
                            '256 experts, FP8 dispatch, 64 SMs'},
    'nccl_ep': {'dispatch_us': 37, 'combine_us': 61, 'dispatch_us_288_experts': [39.6, 40],
                'method': 'contrib/nccl_ep ep_bench LL kernel time, BF16 dispatch, 256 experts, 128 SMs'},
    'goal': {'dispatch_us': 18, 'combine_us': 24, 'e2e_us': 50},
    'nccl_alltoall_megatron': {'dispatch_us': 234, 'combine_us': 105,
                               'method': 'torch_alltoall_baseline.py, BF16, 256 experts, loop average'},
}


# ------------------------------------------------------------------------ inputs
def max_tokens_for(num_tokens, world, policy):
    """M for tokens/rank T: T (or max(T, 128)) rounded up so that R*M % 4 == 0 (DeepEP's TMA rule)."""
    m = max(num_tokens, 128) if policy == 'max128' else num_tokens
    while (world * m) % 4:
        m += 1
    return m


class Inputs:
    """One T's tokens, routing and weights, as DeepEP's test_low_latency (same on every call for
    the same (seed, rank, T), so phase 1 and phase 2 see the same routing)."""

    def __init__(self, args, num_tokens, rank, world):
        seed = args.seed * 1000003 + rank * 7919 + num_tokens
        torch.manual_seed(seed)
        rng = random.Random(seed)
        T, H, E, K = num_tokens, args.hidden, args.num_experts, args.num_topk
        self.num_tokens = T
        self.x = torch.randn(T, H, dtype=torch.bfloat16, device='cuda') * 0.1
        scores = torch.randn(T, E, dtype=torch.float32, device='cuda').abs() + 1
        topk_idx = torch.topk(scores, K, dim=-1, largest=True, sorted=True)[1]
        for _ in range(args.masked_slots):
            topk_idx[rng.randint(0, T - 1), rng.randint(0, K - 1)] = -1
        self.topk_idx = topk_idx.to(deep_ep.topk_idx_t).contiguous()
        self.topk_weights = torch.randn(T, K, dtype=torch.float32, device='cuda').abs()
        self.stats = torch.zeros(E // world, dtype=torch.int32, device='cuda')
        self.selections = int((self.topk_idx >= 0).sum().item())
        self.dispatch_bytes = self.selections * (H + H / 128 * 4 + 16)  # DeepEP: FP8 + scales + 16 B header
        self.combine_bytes = self.selections * 2 * H


def per_token_cast_back(fp8_rows, scales):
    """Dequantise FP8 rows [n, H] with their fp32 scale_inv [n, H/128] to BF16 (DeepEP's tests/utils)."""
    n, h = fp8_rows.shape
    return (fp8_rows.float().view(n, h // 128, 128) * scales.float().unsqueeze(-1)).view(n, h).to(torch.bfloat16)


class LowLatency:
    """The LL calls of one T on one buffer, as DeepEP's test_func: FP8 dispatch with the received-
    count stats, async_finish=False; combine of the dequantised received rows (sim_x)."""

    def __init__(self, buffer, inp, num_max_tokens, args):
        self.buffer, self.inp, self.M, self.args = buffer, inp, num_max_tokens, args
        self.sim_x = None
        self.state = {}

    def dispatch(self, hook=False):
        recv_x, count, handle, _, hook_fn = self.buffer.low_latency_dispatch(
            self.inp.x, self.inp.topk_idx, self.M, self.args.num_experts,
            cumulative_local_expert_recv_stats=self.inp.stats, use_fp8=True,
            async_finish=False, return_recv_hook=hook)
        return recv_x, count, handle, hook_fn

    def combine(self, handle, hook=False, out=None):
        combined, _, hook_fn = self.buffer.low_latency_combine(
            self.sim_x, self.inp.topk_idx, self.inp.topk_weights, handle,
            async_finish=False, return_recv_hook=hook, out=out)
        return combined, hook_fn

    def pair(self):
        handle = self.dispatch()[2]
        self.combine(handle)

    # the profiled steps, one record_function range each
    def dispatch_step(self):
        self.state['handle'] = self.dispatch()[2]

    def combine_step(self):
        self.combine(self.state.pop('handle'))

    def dispatch_send_step(self):
        _, _, self.state['handle'], self.state['hook'] = self.dispatch(hook=True)

    def combine_send_step(self):
        self.state['hook'] = self.combine(self.state.pop('handle'), hook=True)[1]

    def recv_step(self):
        self.state.pop('hook')()


def reference_combine(inp):
    return inp.x.float() * inp.topk_weights.masked_fill(inp.topk_idx < 0, 0).sum(dim=1, keepdim=True)


def check_combined(combined, want, what):
    assert combined.shape == want.shape, f'{what}: shape {tuple(combined.shape)} != {tuple(want.shape)}'
    assert not torch.isnan(combined).any().item(), f'{what}: NaN in the combined rows'
    diff = calc_diff(combined.float(), want)
    assert diff < COMBINE_TOLERANCE, f'{what}: calc_diff {diff:.3g} >= {COMBINE_TOLERANCE} against x * sum(weights)'
    return diff


def prepare_and_verify(ll, inp, args, rank, world, supported):
    """Never time a wrong answer. Checks the counts (against the all-gathered routing) and the stats,
    builds sim_x (the dequantised received rows, zero past each expert's count), checks combine and
    the hook-mode results. Returns a dict of what was checked."""
    E, K, T = args.num_experts, args.num_topk, inp.num_tokens
    num_local = E // world
    where = f'rank {rank}, T={T}'
    inp.stats.zero_()
    (fp8, scales), count, handle, _ = ll.dispatch()
    all_idx = torch.empty(world, T, K, dtype=inp.topk_idx.dtype, device='cuda')
    dist.all_gather_into_tensor(all_idx, inp.topk_idx)
    flat = all_idx.flatten()
    want = torch.bincount(flat[flat >= 0], minlength=E)[rank * num_local:(rank + 1) * num_local]
    counts = count.tolist()
    assert counts == want.tolist(), f'{where}: packed_recv_count {counts} != routing {want.tolist()}'
    assert inp.stats.tolist() == counts, f'{where}: cumulative_local_expert_recv_stats != packed_recv_count'
    sim_x = torch.zeros(num_local, world * ll.M, args.hidden, dtype=torch.bfloat16, device='cuda')
    for e, n in enumerate(counts):
        if n:
            sim_x[e, :n] = per_token_cast_back(fp8[e, :n], scales[e, :n])
    assert torch.isfinite(sim_x).all().item(), f'{where}: non-finite dequantised rows (FP8 scales?)'
    ll.sim_x = sim_x
    del fp8, scales
    checks = {'received_rows': sum(counts)}
    if not supported['combine']:
        return checks
    want_out = reference_combine(inp)
    combined = ll.combine(handle)[0]
    checks['combine_calc_diff'] = check_combined(combined, want_out, f'{where}, combine')
    if supported['hook']:
        _, hcount, hhandle, hook = ll.dispatch(hook=True)
        hook()
        assert hcount.tolist() == counts, f'{where}: hook-mode packed_recv_count differs'
        hcombined, hook = ll.combine(hhandle, hook=True)
        hook()
        checks['hook_combine_calc_diff'] = check_combined(hcombined, want_out, f'{where}, hook-mode combine')
        checks['hook_bit_identical'] = bool(torch.equal(hcombined, combined))
    torch.cuda.synchronize()
    return checks


def probe(args, group, rank, world):
    """Which LL features the library implements (NotImplementedError means no), agreed over ranks:
    tried on a small throwaway buffer (T = M = 4)."""
    flags, reason = {'dispatch': 1, 'combine': 1, 'hook': 1}, 'on another rank'
    buffer = None
    try:
        num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(4, args.hidden, world, args.num_experts)
        buffer = deep_ep.Buffer(group, num_rdma_bytes=num_rdma_bytes, low_latency_mode=True,
                                num_qps_per_rank=args.num_experts // world, explicitly_destroy=True)
        ll = LowLatency(buffer, Inputs(args, 4, rank, world), 4, args)
        ll.sim_x = torch.zeros(args.num_experts // world, world * 4, args.hidden, dtype=torch.bfloat16, device='cuda')
        handle = ll.dispatch()[2]
        try:
            ll.combine(handle)
        except NotImplementedError as e:
            flags['combine'], reason = 0, str(e)
        try:
            _, _, handle, hook = ll.dispatch(hook=True)
            hook()
            if flags['combine']:
                ll.combine(handle, hook=True)[1]()
        except NotImplementedError as e:
            flags['hook'], reason = 0, str(e)
        torch.cuda.synchronize()
    except NotImplementedError as e:
        flags, reason = dict.fromkeys(flags, 0), str(e)
    if buffer is not None:
        buffer.destroy()
    t = torch.tensor(list(flags.values()), dtype=torch.int32, device='cuda')
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    agreed = {k: bool(v) for k, v in zip(flags, t.tolist())}
    if rank == 0 and not all(agreed.values()):
        print(f'not measured (NotImplementedError): {[k for k, v in agreed.items() if not v]}: {reason}', flush=True)
    return agreed


def make_buffer(group, num_max_tokens, args, world):
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(num_max_tokens, args.hidden, world, args.num_experts)
    buffer = deep_ep.Buffer(group, num_rdma_bytes=num_rdma_bytes, low_latency_mode=True,
                            num_qps_per_rank=args.num_experts // world, explicitly_destroy=True)
    return buffer, num_rdma_bytes


# ------------------------------------------------------------------------ NCCL all-to-all
class Profiler:
    """Runs steps (label, fn, op kernel predicate or None) for N iterations under torch.profiler and
    attributes every GPU activity to the step whose call launched it."""

    def __init__(self):
        self.big = torch.randn(8192, 8192, dtype=torch.float32, device='cuda')
        self.big_out = torch.empty_like(self.big)
        self.flag = torch.zeros(1, dtype=torch.float32, device='cuda')
        self.gap_a = torch.randn(4096, 8192, dtype=torch.bfloat16, device='cuda')
        self.gap_b = torch.randn(8192, 4096, dtype=torch.bfloat16, device='cuda')
        self.gap_c = torch.empty(4096, 4096, dtype=torch.bfloat16, device='cuda')

    def marker(self):
        """DeepEP's barrier_comm_profiling: a long fp32 matmul (~15 ms) keeps the GPU busy while the
        host queues the calls, the all-reduce then starts every rank's first call together."""
        torch.matmul(self.big, self.big, out=self.big_out)
        dist.all_reduce(self.flag)

    def gap(self):
        """Compute between a hook-mode send and its hook (~0.5 ms), as DeepEP's large_gemm_with_hook."""
        torch.matmul(self.gap_a, self.gap_b, out=self.gap_c)

    def run(self, steps, iters, fallback=None):
        for _, fn, _ in steps:  # one untraced iteration
            fn()
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            with record_function(RANGE + 'marker'):
                self.marker()
            for _ in range(iters):
                for label, fn, _ in steps:
                    with record_function(RANGE + label):
                        fn()
            torch.cuda.synchronize()
        events = trace_events(prof)
        return attribute(events, {label: pred for label, _, pred in steps}, iters, fallback or {})


def attribute(events, preds, iters, fallback):
    """Per step label: the op's own kernels (name matches preds[label]) and every other GPU activity
    launched inside the step's calls, per call. A GPU activity's CUPTI correlation id names the
    runtime/driver call that launched it; the innermost record_function range holding that call's
    host timestamp (same thread first) is its step. Activities with no such call in the trace are
    attributed by name (fallback: name substring -> labels, assigned in GPU time order, cycling:
    DeepEP's method) or listed as unattributed."""
    ranges, all_ranges = {}, []
    for e in events:
        if e.get('ph') == 'X' and e.get('cat') == 'user_annotation' and str(e.get('name', '')).startswith(RANGE):
            r = (float(e['ts']), float(e['ts']) + float(e.get('dur', 0)), e['name'][len(RANGE):])
            ranges.setdefault(e.get('tid'), []).append(r)
            all_ranges.append(r)
    launches = {}
    for e in events:
        if e.get('ph') == 'X' and e.get('cat') in LAUNCH_CATS:
            corr = (e.get('args') or {}).get('correlation')
            if corr is not None:
                launches[corr] = (float(e['ts']), e.get('tid'))

    def innermost(candidates, ts):
        best = None
        for start, end, label in candidates:
            if start <= ts <= end and (best is None or end - start < best[0]):
                best = (end - start, label)
        return best[1] if best else None

    def step_of(activity):
        launch = launches.get((activity.get('args') or {}).get('correlation'))
        if launch is None:
            return None
        ts, tid = launch
        return innermost(ranges.get(tid, ()), ts) or innermost(all_ranges, ts) or '(outside)'

    gpu = sorted((e for e in events if e.get('ph') == 'X' and e.get('cat') in GPU_CATS), key=lambda e: float(e['ts']))
    buckets = {label: [] for label in preds}
    unattributed, outside, by_name, by_corr = [], [], 0, 0
    cycle = {pattern: 0 for pattern in fallback}
    for e in gpu:
        label = step_of(e)
        if label == '(outside)':  # launched outside every profiled call (not expected)
            outside.append(e)
            continue
        if label is not None:
            by_corr += 1
        else:
            pattern = next((p for p in fallback if e.get('cat') == 'kernel' and p in e['name']), None)
            if pattern is None:
                unattributed.append(e)
                continue
            labels = fallback[pattern]
            label = labels[cycle[pattern] % len(labels)]
            cycle[pattern] += 1
            by_name += 1
        if label in buckets:
            buckets[label].append(e)
    result = {}
    for label, pred in preds.items():
        if pred is None:  # marker / gap / helper steps: not reported
            continue
        own = [e for e in buckets[label] if e.get('cat') == 'kernel' and pred(e['name'])]
        other = [e for e in buckets[label] if not (e.get('cat') == 'kernel' and pred(e['name']))]
        durs = sorted(float(e['dur']) for e in own)
        result[label] = {
            'calls': iters,
            'us': sum(durs) / iters,
            'kernels_per_call': len(own) / iters,
            'instance_us': [durs[0], durs[len(durs) // 2], durs[-1]] if durs else None,
            'kernel_names': count_names(own),
            'other_per_call': len(other) / iters,
            'other_us': sum(float(e['dur']) for e in other) / iters,
            'other_names': count_names(other),
        }
    result['_attribution'] = {'by_correlation': by_corr, 'by_name': by_name, 'unattributed': len(unattributed),
                              'unattributed_names': count_names(unattributed),
                              'outside_names': count_names(outside)}
    return result


def count_names(activities):
    names = {}
    for e in activities:
        name = f'[{e.get("cat")}] {e["name"][:200]}' if e.get('cat') != 'kernel' else e['name'][:200]
        names[name] = names.get(name, 0) + 1
    return names


def is_dispatch_kernel(name):
    return '::dispatch' in name


def is_combine_kernel(name):
    return '::combine' in name


def any_kernel(_name):
    return True


# ------------------------------------------------------------------------ worker
def phase_events(ll, inp, args, supported, rank, world, out):
    """(b) graph replay and (c) plain dispatch + combine, end to end, CUDA events (bench)."""
    dist.barrier()
    torch.cuda.synchronize()
    out['e2e'] = list(bench(ll.pair, args.warmups, args.tests))
    graph, static_out, error = None, None, None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                ll.pair()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        dist.barrier()
        static_out = torch.empty(inp.num_tokens, args.hidden, dtype=torch.bfloat16, device='cuda')
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            handle = ll.dispatch()[2]
            ll.combine(handle, out=static_out)
    except Exception as e:  # capture unsupported: reported, not fatal
        graph, error = None, f'{type(e).__name__}: {e}'
    ok = torch.tensor([1 if graph is not None else 0], dtype=torch.int32, device='cuda')
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    out['graph_error'] = error if error else (None if ok.item() else 'capture failed on another rank')
    if ok.item():
        static_out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        out['checks']['graph_combine_calc_diff'] = check_combined(
            static_out, reference_combine(inp), f'rank {rank}, T={inp.num_tokens}, graph replay')
        dist.barrier()
        torch.cuda.synchronize()
        out['graph_e2e'] = list(bench(graph.replay, args.warmups, args.tests))
    del graph, static_out
    torch.cuda.synchronize()


def worker(rank, world, port, args):
    say = init_worker(rank, world, port)
    group = dist.group.WORLD

    supported = probe(args, group, rank, world)
    info = machine_info(world) if rank == 0 else None
    if rank == 0:
        print(f'GPU: {info["gpu"]}, {info["num_sms"]} SMs; {world} ranks; torch {info["torch"]}, NCCL {info["nccl_torch"]} '
              f'(torch); hidden {args.hidden}, top-{args.num_topk} of {args.num_experts} experts, FP8 dispatch, BF16 combine',
              flush=True)
    say(f'tokens/rank {list(args.tokens)}; supported {supported}')
    per_t = {t: {'num_tokens': t, 'checks': {}} for t in args.tokens}

    # Phase 1 (no profiler yet): correctness, plain and graph end to end, NCCL all-to-all end to end.
    for T in args.tokens:
        out = per_t[T]
        M = max_tokens_for(T, world, args.m_policy)
        inp = Inputs(args, T, rank, world)
        out.update(num_max_tokens=M, selections=inp.selections, dispatch_bytes=inp.dispatch_bytes,
                   combine_bytes=inp.combine_bytes)
        if supported['dispatch']:
            buffer, out['num_rdma_bytes'] = make_buffer(group, M, args, world)
            ll = LowLatency(buffer, inp, M, args)
            out['checks'].update(prepare_and_verify(ll, inp, args, rank, world, supported))
            if supported['combine']:
                phase_events(ll, inp, args, supported, rank, world, out)
            del ll
            torch.cuda.synchronize()
            dist.barrier()
            buffer.destroy()
        a2a = AllToAllDispatcher(inp, world, args.num_experts)
        out['a2a_bytes'] = a2a.recv_bytes
        for name, fn in (('a2a_dispatch', a2a.dispatch), ('a2a_combine', a2a.combine)):
            dist.barrier()
            out[name] = list(bench(fn, args.warmups, args.tests))
        del a2a
        say(f'T={T} M={M}: ' + ', '.join(f'{k} {out[k][0]:.1f} us' for k in ('e2e', 'graph_e2e', 'a2a_dispatch', 'a2a_combine')
                                        if out.get(k)) + ' (rank 0, events)')

    # Phase 2: kernel times under the profiler.
    prof = Profiler()
    points = []
    for T in args.tokens:
        out = per_t[T]
        inp = Inputs(args, T, rank, world)
        if supported['dispatch']:
            buffer, _ = make_buffer(group, out['num_max_tokens'], args, world)
            ll = LowLatency(buffer, inp, out['num_max_tokens'], args)
            prepare_and_verify(ll, inp, args, rank, world, supported)
            if supported['combine']:
                steps = [('dispatch', ll.dispatch_step, is_dispatch_kernel),
                         ('combine', ll.combine_step, is_combine_kernel)]
            else:  # dispatch alone (each call flips the buffer half; nothing waits on a combine)
                steps = [('dispatch', ll.dispatch, is_dispatch_kernel)]
            out['kineto'] = prof.run(steps, args.kineto_iters,
                                     {'::dispatch': ['dispatch'], '::combine': ['combine']})
            if supported['hook'] and supported['combine']:
                steps = [('dispatch_send', ll.dispatch_send_step, is_dispatch_kernel),
                         ('gap1', prof.gap, None),
                         ('dispatch_recv', ll.recv_step, is_dispatch_kernel),
                         ('combine_send', ll.combine_send_step, is_combine_kernel),
                         ('gap2', prof.gap, None),
                         ('combine_recv', ll.recv_step, is_combine_kernel)]
                out['kineto_hook'] = prof.run(steps, args.kineto_iters,
                                              {'::dispatch': ['dispatch_send', 'dispatch_recv'],
                                               '::combine': ['combine_send', 'combine_recv']})
            del ll, steps
            torch.cuda.synchronize()
            dist.barrier()
            buffer.destroy()
        a2a = AllToAllDispatcher(inp, world, args.num_experts)
        out['kineto_a2a'] = prof.run([('a2a_dispatch', a2a.dispatch, any_kernel),
                                      ('a2a_combine', a2a.combine, any_kernel)], args.kineto_iters)
        del a2a, inp
        gathered = [None] * world
        dist.all_gather_object(gathered, out)
        if rank == 0:
            point = build_point(gathered, world)
            points.append(point)
            print_point(point, world, args, info)
            write_json(args, info, supported, points, complete=T == args.tokens[-1])
        say(f'T={T}: profiled')
    del prof
    if rank == 0:
        print_summary(points, args)
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------ report
OP_LABELS = {
    'dispatch': ('dispatch', 'kineto'),
    'combine': ('combine', 'kineto'),
    'dispatch_send': ('dispatch send (hook)', 'kineto'),
    'dispatch_recv': ('dispatch recv (hook)', 'kineto'),
    'dispatch_hook': ('dispatch send+recv (hook)', 'kineto'),
    'combine_send': ('combine send (hook)', 'kineto'),
    'combine_recv': ('combine recv (hook)', 'kineto'),
    'combine_hook': ('combine send+recv (hook)', 'kineto'),
    'e2e': ('dispatch+combine, plain', 'events'),
    'graph_e2e': ('dispatch+combine, graph replay', 'graph+events'),
    'a2a_dispatch': ('NCCL a2a dispatch (BF16)', 'events'),
    'a2a_combine': ('NCCL a2a combine (BF16)', 'events'),
    'a2a_dispatch_kernels': ('NCCL a2a dispatch, kernels', 'kineto'),
    'a2a_combine_kernels': ('NCCL a2a combine, kernels', 'kineto'),
}


def make_row(op, per_rank_us, per_rank_bytes, bytes_what, **extra):
    label, method = OP_LABELS[op]
    n = len(per_rank_us)
    row = {'op': op, 'label': label, 'method': method, 'us': sum(per_rank_us) / n,
           'us_min': min(per_rank_us), 'us_max': max(per_rank_us), 'per_rank_us': per_rank_us,
           'bytes': None, 'bytes_what': bytes_what, 'gbps': None, 'gbps_min': None, 'gbps_max': None}
    if per_rank_bytes is not None:
        gbps = [b / t / 1e3 if t > 0 else 0.0 for b, t in zip(per_rank_bytes, per_rank_us)]
        row.update(bytes=sum(per_rank_bytes) / n, gbps=sum(gbps) / n, gbps_min=min(gbps), gbps_max=max(gbps),
                   per_rank_gbps=gbps)
    row.update(extra)
    return row


def merge_names(dicts):
    names = {}
    for d in dicts:
        for k, v in d.items():
            names[k] = names.get(k, 0) + v
    return names


def kineto_row(op, sessions, label, per_rank_bytes, bytes_what):
    recs = [s[label] for s in sessions]
    return make_row(op, [r['us'] for r in recs], per_rank_bytes, bytes_what,
                    kernels_per_call=[r['kernels_per_call'] for r in recs],
                    other_per_call=[r['other_per_call'] for r in recs],
                    other_us=[r['other_us'] for r in recs],
                    instance_us=[r['instance_us'] for r in recs],
                    kernel_names=merge_names(r['kernel_names'] for r in recs),
                    other_names=merge_names(r['other_names'] for r in recs))


def build_point(gathered, world):
    g0 = gathered[0]
    disp = [g['dispatch_bytes'] for g in gathered]
    comb = [g['combine_bytes'] for g in gathered]
    both = [a + b for a, b in zip(disp, comb)]
    a2a = [g['a2a_bytes'] for g in gathered]
    rows = {}
    if all('kineto' in g for g in gathered):
        ks = [g['kineto'] for g in gathered]
        rows['dispatch'] = kineto_row('dispatch', ks, 'dispatch', disp, 'dispatch (DeepEP FP8 counting)')
        if 'combine' in ks[0]:
            rows['combine'] = kineto_row('combine', ks, 'combine', comb, 'combine (2H per selection)')
    if all('kineto_hook' in g for g in gathered):
        ks = [g['kineto_hook'] for g in gathered]
        for op in ('dispatch', 'combine'):
            rows[f'{op}_send'] = kineto_row(f'{op}_send', ks, f'{op}_send', None, None)
            rows[f'{op}_recv'] = kineto_row(f'{op}_recv', ks, f'{op}_recv', None, None)
            total = [k[f'{op}_send']['us'] + k[f'{op}_recv']['us'] for k in ks]
            rows[f'{op}_hook'] = make_row(f'{op}_hook', total, disp if op == 'dispatch' else comb,
                                          'dispatch (DeepEP FP8 counting)' if op == 'dispatch' else 'combine (2H per selection)')
    for key, nbytes, what in (('e2e', both, 'dispatch + combine (DeepEP counting)'),
                              ('graph_e2e', both, 'dispatch + combine (DeepEP counting)'),
                              ('a2a_dispatch', a2a, 'received BF16 rows (rank de-duplicated)'),
                              ('a2a_combine', a2a, 'received BF16 rows (rank de-duplicated)')):
        if all(g.get(key) for g in gathered):
            rows[key] = make_row(key, [g[key][0] for g in gathered], nbytes, what,
                                 sample_min_us=[g[key][1] for g in gathered],
                                 sample_max_us=[g[key][2] for g in gathered])
    if all('kineto_a2a' in g for g in gathered):
        ks = [g['kineto_a2a'] for g in gathered]
        for op in ('a2a_dispatch', 'a2a_combine'):
            rows[f'{op}_kernels'] = kineto_row(f'{op}_kernels', ks, op, a2a, 'received BF16 rows (rank de-duplicated)')
    attribution = {}
    for key in ('kineto', 'kineto_hook', 'kineto_a2a'):
        if all(key in g for g in gathered):
            attribution[key] = [g[key]['_attribution'] for g in gathered]
    return {
        'num_tokens': g0['num_tokens'], 'num_max_tokens': g0['num_max_tokens'],
        'num_rdma_bytes': g0.get('num_rdma_bytes'),
        'selections': [g['selections'] for g in gathered],
        'bytes': {'dispatch': disp, 'combine': comb, 'a2a': a2a},
        'checks': [g['checks'] for g in gathered],
        'graph_error': g0.get('graph_error'),
        'attribution': attribution,
        'rows': rows,
    }


def print_point(point, world, args, info):
    T, M = point['num_tokens'], point['num_max_tokens']
    sel = point['selections']
    mb = lambda xs: sum(xs) / len(xs) / 1e6  # noqa: E731
    how = 'max(T, 128)' if args.m_policy == 'max128' else 'T'
    print(f'\n=== T={T} tokens/rank, M={M} ({how} rounded up so that R*M % 4 == 0); {world}x {info["gpu"]} '
          f'({info["num_sms"]} SMs), {args.num_experts} experts, top-{args.num_topk}, hidden {args.hidden}')
    print(f'valid selections/rank {sum(sel) / len(sel):.1f} ({min(sel)}-{max(sel)}; {args.masked_slots} slots set to -1); '
          f'bytes/rank: dispatch {mb(point["bytes"]["dispatch"]):.3f} MB, combine {mb(point["bytes"]["combine"]):.3f} MB '
          f'(DeepEP counting), NCCL a2a {mb(point["bytes"]["a2a"]):.3f} MB')
    print(f'{"op":32s} {"method":12s} {"us avg":>8s} {"us min":>8s} {"us max":>8s} {"GB/s avg":>8s} {"GB/s min":>8s} '
          f'{"GB/s max":>8s} {"k/call":>6s} {"other/call":>10s}')
    for op in OP_LABELS:
        r = point['rows'].get(op)
        if r is None:
            continue
        kpc = r.get('kernels_per_call')
        opc = r.get('other_per_call')
        print(f'{r["label"]:32s} {r["method"]:12s} {r["us"]:8.1f} {r["us_min"]:8.1f} {r["us_max"]:8.1f} '
              f'{fmt(r["gbps"], "8.1f")} {fmt(r["gbps_min"], "8.1f")} {fmt(r["gbps_max"], "8.1f")} '
              f'{fmt(max(kpc) if kpc else None, "6.2f")} {fmt(max(opc) if opc else None, "10.2f")}')
    for op in ('dispatch', 'combine', 'dispatch_send', 'dispatch_recv', 'combine_send', 'combine_recv'):
        r = point['rows'].get(op)
        if r is None:
            continue
        if max(r['kernels_per_call']) != 1 or min(r['kernels_per_call']) != 1:
            print(f'  WARNING {r["label"]}: {r["kernels_per_call"]} matching kernels per call over ranks (expected 1): '
                  f'{r["kernel_names"]}')
        if r['other_names']:
            print(f'  OTHER GPU work launched by {r["label"]} (expected none): '
                  + ', '.join(f'{k} x{v}' for k, v in r['other_names'].items()))
    for key, per_rank in point['attribution'].items():
        by_name = sum(a['by_name'] for a in per_rank)
        unattributed = merge_names(a['unattributed_names'] for a in per_rank)
        unattributed.update({f'(launched outside the profiled calls) {k}': v
                             for k, v in merge_names(a['outside_names'] for a in per_rank).items()})
        if by_name:
            print(f'  note ({key}): {by_name} kernels had no launch call in the trace and were attributed by name')
        if unattributed:
            print(f'  note ({key}): unattributed GPU activities: ' + ', '.join(f'{k} x{v}' for k, v in unattributed.items()))
    if point['graph_error']:
        print(f'  graph capture failed: {point["graph_error"]}')
    hook_same = [c.get('hook_bit_identical') for c in point['checks']]
    if any(h is False for h in hook_same):
        print(f'  note: hook-mode combine not bit-identical to non-hook on ranks '
              f'{[i for i, h in enumerate(hook_same) if h is False]} (within tolerance)')


def print_summary(points, args):
    ref = REFERENCE
    point = next((p for p in points if p['num_tokens'] == ref['num_tokens']), None)
    if point is None:
        return
    rows = point['rows']
    v1, v2, ep, goal = ref['deepep_v1'], ref['deepep_v2'], ref['nccl_ep'], ref['goal']
    print(f'\nAt {ref["num_tokens"]} tokens/rank vs {ref["source"]} (other runs: compare ratios; '
          f'speed-ups, >1 = this run is faster):')
    lines = []
    for op, theirs in (('dispatch', (('DeepEP V1', v1['dispatch_us']), ('DeepEP V2 incl. copy', sum(v2['dispatch_us'])),
                                     ('NCCL EP (BF16)', ep['dispatch_us']), ('goal', goal['dispatch_us']))),
                       ('combine', (('DeepEP V1', v1['combine_us']), ('DeepEP V2 incl. reduce', sum(v2['combine_us'])),
                                    ('NCCL EP', ep['combine_us']), ('goal', goal['combine_us']))),
                       ('graph_e2e', (('DeepEP V1 e2e', v1['e2e_us']), ('goal', goal['e2e_us']))),
                       ('e2e', (('DeepEP V1 e2e', v1['e2e_us']), ('goal', goal['e2e_us'])))):
        r = rows.get(op)
        if r is None:
            continue
        parts = [f'{name} {us:g} us: {us / r["us"]:.2f}x' for name, us in theirs]
        lines.append(f'  {r["label"]:32s} {r["us"]:7.1f} us; ' + ', '.join(parts))
    a2a_d, a2a_c, e2e = rows.get('a2a_dispatch'), rows.get('a2a_combine'), rows.get('e2e')
    if a2a_d and a2a_c and e2e:
        total = a2a_d['us'] + a2a_c['us']
        lines.append(f'  NCCL a2a of this run (BF16), dispatch + combine e2e {total:.1f} us: {total / e2e["us"]:.2f}x '
                     f'for the plain LL pair')
    for op, name in (('a2a_dispatch_kernels', 'dispatch'), ('a2a_combine_kernels', 'combine')):
        r, ours = rows.get(op), rows.get(name)
        if r is not None and ours is not None:
            lines.append(f'  NCCL a2a {name} kernels of this run {r["us"]:.1f} us: {r["us"] / ours["us"]:.2f}x for the LL {name} kernel')
    print('\n'.join(lines))


def write_json(args, info, supported, points, complete):
    world = info['world_size']
    out = {
        'tool': 'bench/bench_low_latency.py', 'complete': complete, 'machine': info, 'supported': supported,
        'shape': {'hidden': args.hidden, 'num_experts': args.num_experts, 'num_topk': args.num_topk,
                  'num_local_experts': args.num_experts // world, 'dispatch': 'FP8 e4m3, fp32 scale_inv per 128 channels',
                  'combine': 'BF16', 'routing': 'topk(|randn|+1, sorted), |randn| weights, x = randn*0.1 (DeepEP test)',
                  'masked_slots': args.masked_slots},
        'settings': {'tokens': list(args.tokens), 'm_policy': args.m_policy,
                     'm_rule': ('max(T, 128)' if args.m_policy == 'max128' else 'T') + ' rounded up so that R*M % 4 == 0',
                     'warmups': args.warmups, 'tests': args.tests, 'kineto_iters': args.kineto_iters,
                     'quick': args.quick, 'seed': args.seed, 'combine_tolerance': COMBINE_TOLERANCE,
                     'async_finish': False, 'cumulative_local_expert_recv_stats': True,
                     'bytes': 'per rank over valid selections: dispatch H + H/128*4 + 16, combine 2H; '
                              'a2a: received BF16 rows * 2H',
                     'hook_gap': 'BF16 matmul [4096, 8192] x [8192, 4096] between send and hook()'},
        'points': points, 'reference': REFERENCE,
    }
    with open(args.json, 'w') as f:
        json.dump(out, f, indent=2)
    if complete:
        print(f'\nresults written to {args.json}')


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--num-processes', type=int, default=torch.cuda.device_count(),
                        help='processes (GPUs); default: all visible')
    parser.add_argument('--tokens', type=int, nargs='+', help=f'tokens per rank (default {TOKENS}; --quick {QUICK_TOKENS})')
    parser.add_argument('--hidden', type=int, default=HIDDEN)
    parser.add_argument('--num-topk', type=int, default=NUM_TOPK)
    parser.add_argument('--num-experts', type=int, default=NUM_EXPERTS)
    parser.add_argument('--masked-slots', type=int, default=NUM_MASKED,
                        help='random (token, slot) positions set to -1 per rank, as DeepEP (default 10)')
    parser.add_argument('--m-policy', choices=('t', 'max128'), default='t',
                        help='M = T (default) or max(T, 128), rounded up so that R*M %% 4 == 0')
    parser.add_argument('--quick', action='store_true', help='tokens 1 and 128, fewer iterations')
    parser.add_argument('--warmups', type=int, help='bench warm-up calls (default 50, --quick 10)')
    parser.add_argument('--tests', type=int, help='bench timed calls (default 50, --quick 20)')
    parser.add_argument('--kineto-iters', type=int, help='profiled iterations (default 30, --quick 10)')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--json', default=os.path.join(os.environ.get('OUT') or '.', 'bench_ll.json'))
    args = parser.parse_args()
    args.tokens = tuple(args.tokens or (QUICK_TOKENS if args.quick else TOKENS))
    args.warmups = args.warmups if args.warmups is not None else (10 if args.quick else 50)
    args.tests = args.tests if args.tests is not None else (20 if args.quick else 50)
    args.kineto_iters = args.kineto_iters or (10 if args.quick else 30)
    world = args.num_processes
    if world < 1 or world > torch.cuda.device_count():
        sys.exit(f'--num-processes {world}: {torch.cuda.device_count()} GPUs visible')
    if args.num_experts % world:
        sys.exit(f'--num-experts {args.num_experts} must be divisible by the number of processes {world}')
    if args.hidden % 128:
        sys.exit(f'--hidden {args.hidden} must be a multiple of 128 (FP8 dispatch)')
    for T in args.tokens:
        if T < 1 or max_tokens_for(T, world, args.m_policy) > 1024:
            sys.exit(f'--tokens {T}: need 1 <= T and M <= 1024')
    if args.tests < 2:
        sys.exit('--tests must be at least 2 (the first sample is dropped)')
    spawn_workers(worker, world, args)


if __name__ == '__main__':
    main()
