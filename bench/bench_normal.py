"""Normal-mode (high-throughput) dispatch/combine benchmark at DeepEP's shape (hidden 7168,
top-8 of 256 experts, random routing as DeepEP's test_intranode), one process per GPU.

For every SM count and tokens/rank T it measures BF16 dispatch, FP8 dispatch (e4m3 + fp32
scale per 128 channels, column-major scales as DeepEP's test passes them), both through the
cached handle (DeepEP's tuning loop) and the non-cached path (layout tensors + top-k: includes
the host wait for the receive counts), and BF16 combine of the BF16-dispatched rows. Per op:
  1. end to end, timed exactly like DeepEP's tests/utils.bench (CUDA events around each call,
     L2 flushed once after warm-up, first sample dropped), best NVL chunk of a small sweep;
  2. GPU kernel time: the sum of the durations of every kernel the op launches (kineto, over
     back-to-back calls, DeepEP's bench_kineto style), per call; copies/memsets apart;
  3. GB/s = received bytes / time, DeepEP's counting: BF16 recv_x.numel()*2, FP8 that times
     (1 + 4/128)/2, combine the BF16 dispatch bytes. Times and bytes are averaged over ranks.
Also: the Megatron-style NCCL all-to-all dispatcher in the same process group (same routing),
and the host time per call of the Python layer (plain and under DeepEP's test defaults, bf16 default
dtype + cuda default device), on both host paths (the compiled one, deep_ep_cpp/_fast.cpp, and ctypes).
With DeepEP V1's own package importable (--package deepep_v1, or auto-detected) everything runs
through its public API alone (one host path, labelled deepep_v1).

Run: python bench/bench_normal.py [--json PATH] [--quick] [--world N] [--package auto|deepep-nccl|deepep_v1]
"""
import argparse
import json
import os
import re
import socket
import sys

import torch
import torch.distributed as dist
import torch.profiler

import deep_ep
from bench_common import (AllToAllDispatcher, DeepEPDefaults, add_package_arg, bench as deepep_bench, detect_package,
                          host_loop, host_paths, init_worker, resolve_package, spawn_workers, trace_events)

HIDDEN = 7168
NUM_EXPERTS = 256
NUM_TOPK = 8
NVL_RECV_TOKENS = 256  # deep_ep.Config(num_sms, nvl_chunk, 256), as DeepEP's tuning loop
FP8_FACTOR = (1 + 4 / 128) / 2  # DeepEP's FP8 byte count relative to BF16
SMS = (8, 12, 16, 24, 32)
TOKENS = (512, 1024, 4096, 8192)
QUICK_SMS = (12, 24)
QUICK_TOKENS = (4096,)
DISPATCH_CHUNKS = (6, 12, 24)
COMBINE_CHUNKS = (4, 8)
HOST_SMS = 24
HOST_TOKENS = (128, 4096)  # 128: kernels are short, the loop is host-bound
HOST_CALLS = {128: 1000, 4096: 50}
KINETO_CALLS = 20

# shared/reference/baselines.md (4x H200, NV18; hidden 7168, top-8 of 256 experts, 4096
# tokens/rank unless said). Different runs: compare ratios measured in one run.
REFERENCE = {
    'source': 'shared/reference/baselines.md, measured 2026-11-21 on nvidia-h200-x4',
    'deepep_v1': {
        'num_sms': 24, 'num_tokens': 4096,
        'method': 'DeepEP tests/utils.bench (CUDA events, end to end), cached-handle dispatch, best NVL chunk',
        'dispatch_bf16': {'us': 810, 'gbps': 262, 'nvl_chunk': 4},
        'dispatch_fp8': {'us': 429, 'gbps': 255, 'nvl_chunk': 6},
        'combine_bf16': {'us': 593, 'gbps': 358, 'nvl_chunk': 9},
        'get_dispatch_layout_us': 34,
    },
    'deepep_v2': {
        'num_sms': 24, 'num_tokens': 4096,
        'method': 'kineto, one kernel; with_followup adds the copy (dispatch) / reduce (combine) kernel; '
                  'bytes per token 7488 (FP8 incl. scales, top-k) / 14368 (combine)',
        'dispatch_fp8': {'kernel_us': 289, 'kernel_gbps': 384, 'with_followup_us': 355, 'with_followup_gbps': 313},
        'combine_bf16': {'kernel_us': 547, 'kernel_gbps': 389, 'with_followup_us': 619, 'with_followup_gbps': 343},
    },
    'nccl_ep': {
        'num_sms': 16, 'num_tokens': 4096,
        'method': 'contrib/nccl_ep ep_bench HT, BF16 only; kernel and event (end to end) time',
        'dispatch_bf16': {'kernel_us': [544, 552], 'kernel_gbps': [384, 389],
                          'event_us': [703, 719], 'event_gbps': [295, 301]},
        'combine_bf16': {'kernel_us': [503, 511], 'kernel_gbps': [414, 421],
                         'event_us': [731, 740], 'event_gbps': [286, 290]},
    },
    'nccl_alltoall_megatron': {
        'method': 'shared/bench/torch_alltoall_baseline.py (loop average), BF16',
        '4096': {'dispatch_us': 749, 'combine_us': 1588},
        '128': {'dispatch_us': 234, 'combine_us': 105},
    },
    'logical_ceiling_gbps': 524,
}


# ------------------------------------------------------------------------ timing
def bench(fn, num_warmups=10, num_tests=20):
    """DeepEP's timing method (bench_common.bench) with this benchmark's defaults."""
    return deepep_bench(fn, num_warmups, num_tests)


class KinetoMarker:
    """What runs before the profiled calls (DeepEP's barrier_comm_profiling): a large matmul keeps
    the GPU busy while every rank queues its calls, then an all-reduce lines the ranks up. Its
    NCCL AllReduce kernel also marks where the op's kernels begin in the trace."""

    def __init__(self):
        self.a = torch.randn(8192, 8192, dtype=torch.bfloat16, device='cuda')
        self.b = torch.randn(8192, 8192, dtype=torch.bfloat16, device='cuda')
        self.c = torch.empty(8192, 8192, dtype=torch.bfloat16, device='cuda')
        self.flag = torch.zeros(1, dtype=torch.float32, device='cuda')
        self.warned = False

    def __call__(self):
        for _ in range(2):
            torch.matmul(self.a, self.b, out=self.c)
        dist.all_reduce(self.flag)


def kineto(fn, marker, num_calls=KINETO_CALLS):
    """GPU time per call: the sum of the durations of every kernel launched by num_calls
    back-to-back calls (torch.profiler, CUDA activity), divided by num_calls. Returns
    (kernel_us, copy_us, busy_us, kernels_per_call, {kernel name: us per call}, marker_found);
    copy_us sums the memcpy/memset activities, which are not in kernel_us; busy_us is the union of
    the kernel intervals per call (kernel_us counts overlapping kernels twice, busy_us once)."""
    fn()  # the first call of a config outside the trace
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        marker()
        for _ in range(num_calls):
            fn()
        torch.cuda.synchronize()
    events = trace_events(prof)
    gpu = [e for e in events if e.get('ph') == 'X' and e.get('cat') in ('kernel', 'gpu_memcpy', 'gpu_memset')]
    marks = [e for e in gpu if e['cat'] == 'kernel' and 'allreduce' in e['name'].lower()]
    found = bool(marks)
    if found:  # everything the op launches starts after the all-reduce (stream order)
        begin = max(float(e['ts']) + float(e['dur']) for e in marks)
        gpu = [e for e in gpu if float(e['ts']) >= begin - 1e-3]
    elif not marker.warned:
        marker.warned = True
        print(f'[rank {dist.get_rank()}] warning: no AllReduce kernel in the trace; kernel times '
              f'include the profiling preamble (matmul)', flush=True)
    kernels = [e for e in gpu if e['cat'] == 'kernel']
    kernel_us = sum(float(e['dur']) for e in kernels) / num_calls
    copy_us = sum(float(e['dur']) for e in gpu if e['cat'] != 'kernel') / num_calls
    busy, end = 0.0, float('-inf')
    for start, stop in sorted((float(e['ts']), float(e['ts']) + float(e['dur'])) for e in kernels):
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    breakdown = {}
    for e in kernels:
        name = e['name'][:160]
        breakdown[name] = breakdown.get(name, 0.0) + float(e['dur']) / num_calls
    return kernel_us, copy_us, busy / num_calls, len(kernels) / num_calls, breakdown, found


def rank_mean(values):
    """Element-wise mean over ranks (a collective); the same list on every rank."""
    t = torch.tensor(values, dtype=torch.float64, device='cuda')
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def agreed_argmin(values):
    """Index of the smallest rank-averaged value, decided by rank 0 so that every rank picks the
    same config (a different config per rank would break the collective calls)."""
    mean = rank_mean(values)
    choice = torch.tensor([min(range(len(mean)), key=mean.__getitem__)], dtype=torch.int64, device='cuda')
    dist.broadcast(choice, 0)
    return int(choice.item()), mean


# ------------------------------------------------------------------------ data
def per_token_cast_to_fp8(x):
    """DeepEP's tests/utils.per_token_cast_to_fp8: e4m3 with one fp32 scale per 128 channels."""
    assert x.dim() == 2 and x.size(1) % 128 == 0
    m, n = x.shape
    x_view = x.view(m, -1, 128)
    x_amax = x_view.abs().float().amax(dim=2).view(m, -1).clamp(1e-4)
    return (x_view * (448.0 / x_amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(m, n), (x_amax / 448.0).view(m, -1)


def calc_diff(x, y):
    x, y = x.double() + 1, y.double() + 1
    denominator = (x * x + y * y).sum()
    return (1 - 2 * (x * y).sum() / denominator).item()


class Inputs:
    """One T's tokens, routing (|randn|+1, top-k, as DeepEP's test) and layout."""

    def __init__(self, buffer, num_tokens, rank):
        torch.manual_seed(rank * 1000003 + num_tokens)
        self.num_tokens = num_tokens
        self.x = torch.randn(num_tokens, HIDDEN, dtype=torch.bfloat16, device='cuda')
        x_e4m3, scales = per_token_cast_to_fp8(self.x)
        self.x_fp8 = (x_e4m3, scales.T.contiguous().T)  # column-major scales, as DeepEP's test
        scores = torch.randn(num_tokens, NUM_EXPERTS, dtype=torch.float32, device='cuda').abs() + 1
        self.topk_idx = torch.topk(scores, NUM_TOPK, dim=-1, largest=True, sorted=False)[1].to(deep_ep.topk_idx_t)
        self.topk_weights = torch.randn(num_tokens, NUM_TOPK, dtype=torch.float32, device='cuda')
        ntpr, _, ntpe, itir, _ = buffer.get_dispatch_layout(self.topk_idx, NUM_EXPERTS)
        self.num_tokens_per_rank, self.num_tokens_per_expert, self.is_token_in_rank = ntpr, ntpe, itir
        self.layout = dict(num_tokens_per_rank=ntpr, is_token_in_rank=itir, num_tokens_per_expert=ntpe,
                           topk_idx=self.topk_idx, topk_weights=self.topk_weights)


class Point:
    """The handle and BF16 receive rows of one (T, SMs): a non-cached BF16 dispatch with top-k.
    The handle's channel matrices depend on the SM count, so each SM count makes its own."""

    def __init__(self, buffer, inp, num_sms):
        self.num_sms = num_sms
        config = deep_ep.Config(num_sms, DISPATCH_CHUNKS[0], NVL_RECV_TOKENS)
        self.recv_x, _, _, self.recv_counts, self.handle, _ = buffer.dispatch(inp.x, config=config, **inp.layout)
        self.bf16_bytes = self.recv_x.numel() * 2


def cached_configs(num_sms):
    """(dispatch, combine) Configs of the cached ops timed outside the chunk sweeps: each op's first
    chunk of its sweep."""
    return (deep_ep.Config(num_sms, DISPATCH_CHUNKS[0], NVL_RECV_TOKENS),
            deep_ep.Config(num_sms, COMBINE_CHUNKS[0], NVL_RECV_TOKENS))


def op_specs(buffer, inp, pt, supported):
    """(op, dtype, chunks or None, fn factory taking a Config, received bytes on this rank).
    chunks None: the non-cached dispatch uses the best chunk of the cached one of its dtype."""
    specs = []
    xs = [('bf16', inp.x, pt.bf16_bytes)]
    if supported['fp8']:
        xs.append(('fp8', inp.x_fp8, pt.bf16_bytes * FP8_FACTOR))
    for dtype, x, nbytes in xs:
        specs.append(('dispatch', dtype, DISPATCH_CHUNKS,
                      lambda cfg, x=x: (lambda: buffer.dispatch(x, handle=pt.handle, config=cfg)), nbytes))
    if supported['combine']:
        specs.append(('combine', 'bf16', COMBINE_CHUNKS,
                      lambda cfg: (lambda: buffer.combine(pt.recv_x, pt.handle, config=cfg)), pt.bf16_bytes))
    for dtype, x, nbytes in xs:
        specs.append(('dispatch_noncached', dtype, None,
                      lambda cfg, x=x: (lambda: buffer.dispatch(x, config=cfg, **inp.layout)), nbytes))
    return specs


def verify(buffer, inp, pt, rank, world, supported):
    """Never time a wrong answer: counts, cached == non-cached rows, FP8 rows, combine sum."""
    per_rank = inp.num_tokens_per_rank.clone()
    dist.all_reduce(per_rank)
    per_expert = inp.num_tokens_per_expert.clone()
    dist.all_reduce(per_expert)
    where = f'rank {rank}, T={inp.num_tokens}, {pt.num_sms} SMs'
    assert pt.recv_x.size(0) == per_rank[rank].item(), f'{where}: {pt.recv_x.size(0)} rows received'
    assert list(pt.recv_counts) == per_expert.view(world, -1)[rank].tolist(), f'{where}: per-expert counts differ'
    config, combine_config = cached_configs(pt.num_sms)
    cached = buffer.dispatch(inp.x, handle=pt.handle, config=config)[0]
    assert torch.equal(cached, pt.recv_x), f'{where}: cached dispatch rows differ from the non-cached ones'
    if supported['fp8']:
        recv_fp8, recv_scales = buffer.dispatch(inp.x_fp8, handle=pt.handle, config=config)[0]
        want_fp8, want_scales = per_token_cast_to_fp8(pt.recv_x)
        assert torch.equal(recv_fp8.view(torch.uint8), want_fp8.view(torch.uint8)), f'{where}: FP8 rows differ'
        assert torch.equal(recv_scales, want_scales), f'{where}: FP8 scales differ'
    if supported['combine']:
        combined = buffer.combine(pt.recv_x, pt.handle, config=combine_config)[0]
        want = inp.x.float() * inp.is_token_in_rank.sum(1, keepdim=True)
        diff = calc_diff(combined.float(), want)
        assert diff < 1e-4, f'{where}: combine differs from the sum of copies (calc_diff {diff:.3g})'
    torch.cuda.synchronize()


def probe(buffer, inp, rank):
    """Which ops the library implements (NotImplementedError means no), agreed over ranks."""
    flags = {'dispatch': 1, 'fp8': 1, 'combine': 1}
    pt, reason = None, 'on another rank'
    try:
        pt = Point(buffer, inp, HOST_SMS)
    except NotImplementedError as e:
        flags = dict.fromkeys(flags, 0)
        reason = str(e)
    if pt is not None:
        try:
            buffer.dispatch(inp.x_fp8, handle=pt.handle, config=deep_ep.Config(HOST_SMS, 6, NVL_RECV_TOKENS))
        except NotImplementedError as e:
            flags['fp8'], reason = 0, str(e)
        try:
            buffer.combine(pt.recv_x, pt.handle, config=deep_ep.Config(HOST_SMS, 4, NVL_RECV_TOKENS))
        except NotImplementedError as e:
            flags['combine'], reason = 0, str(e)
    torch.cuda.synchronize()
    t = torch.tensor(list(flags.values()), dtype=torch.int32, device='cuda')
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    agreed = {k: bool(v) for k, v in zip(flags, t.tolist())}
    if rank == 0 and not all(agreed.values()):
        print(f'not measured (NotImplementedError): {[k for k, v in agreed.items() if not v]}: {reason}', flush=True)
    return agreed


# ------------------------------------------------------------------------ NCCL all-to-all
# ------------------------------------------------------------------------ worker
def record(op, dtype, num_sms, num_tokens, nvl_chunk, recv_bytes, e2e, chunk_sweep=None):
    return {'op': op, 'dtype': dtype, 'num_sms': num_sms, 'num_tokens': num_tokens, 'nvl_chunk': nvl_chunk,
            'recv_bytes': recv_bytes, 'e2e_us': list(e2e), 'chunk_sweep_e2e_us': chunk_sweep}


def add_kineto(rec, result):
    kernel_us, copy_us, busy_us, per_call, breakdown, found = result
    rec.update(kernel_us=kernel_us, copy_us=copy_us, kernel_busy_us=busy_us, kernels_per_call=per_call,
               kernel_breakdown=breakdown, kernel_marker_found=found)


HOST_ROUNDS = 5  # per (op, mode): the paths alternate, best round kept (the CPU's speed drifts)
HOST_WARMUP_S = 1.0  # of calls before any timing, all paths together


def host_ops(buffer, inp, supported):
    """{op name: a call of it} for the host measurement at HOST_SMS."""
    fns = {'get_dispatch_layout': lambda: buffer.get_dispatch_layout(inp.topk_idx, NUM_EXPERTS),
           'get_dispatch_layout (async)': lambda: buffer.get_dispatch_layout(inp.topk_idx, NUM_EXPERTS, **overlap())}
    if supported['dispatch']:
        pt = Point(buffer, inp, HOST_SMS)
        dcfg, ccfg = cached_configs(HOST_SMS)
        fns['dispatch (cached)'] = lambda: buffer.dispatch(inp.x, handle=pt.handle, config=dcfg)
        fns['dispatch (cached, async)'] = lambda: buffer.dispatch(inp.x, handle=pt.handle, config=dcfg, **overlap())
        if supported['fp8']:  # x as (e4m3 rows, column-major scales): the scales are one more tensor each way
            fns['dispatch (cached, FP8)'] = lambda: buffer.dispatch(inp.x_fp8, handle=pt.handle, config=dcfg)
        fns['dispatch (non-cached)'] = lambda: buffer.dispatch(inp.x, config=dcfg, **inp.layout)
        if supported['combine']:
            fns['combine'] = lambda: buffer.combine(pt.recv_x, pt.handle, config=ccfg)
            fns['combine (async)'] = lambda: buffer.combine(pt.recv_x, pt.handle, config=ccfg, **overlap())
    return fns


def overlap():
    """The stream arguments of a call that overlaps communication with compute, as Megatron-LM's
    DeepEP dispatcher passes them: an event of the current stream (captured within the timed call, as
    the caller pays for it), async_finish and allocate_on_comm_stream."""
    return {'previous_event': deep_ep.Buffer.capture(), 'async_finish': True, 'allocate_on_comm_stream': True}


HOST_MODES = ('plain', 'deepep_defaults')  # deepep_defaults: bf16 default dtype + cuda default device


def measure_host(buffer, inputs, package, supported, say):
    """Host us per call of the Python layer at HOST_SMS, plain and under DeepEP's test defaults
    (set_default_dtype(bfloat16) + set_default_device('cuda')), on each host path (bench_common.host_paths:
    ours has the compiled one, deep_ep_cpp/_fast.cpp, when it loaded, and ctypes). The paths alternate
    within each (op, mode), HOST_ROUNDS times, and each keeps its best round."""
    paths, restore = host_paths(buffer, package, '_normal_fast')
    rows = []
    try:
        # A build with a prebuilt host path is timed right after start-up, one that compiles its host
        # path first is not: warm both up alike (host-bound calls at the smallest T, ~40 us each).
        warm = host_ops(buffer, inputs[min(inputs)], supported)
        for use in paths.values():
            use()
            for fn in warm.values():
                host_loop(fn, 1, num_warmups=int(HOST_WARMUP_S / len(paths) / len(warm) / 40e-6))
        for num_tokens, inp in inputs.items():
            for name, fn in host_ops(buffer, inp, supported).items():
                per_path = {path: {'package': package, 'op': name, 'path': path, 'num_tokens': num_tokens,
                                   'num_sms': HOST_SMS, 'calls': HOST_CALLS[num_tokens]} for path in paths}
                for mode in HOST_MODES:
                    with DeepEPDefaults(mode == 'deepep_defaults'):
                        for _ in range(HOST_ROUNDS):
                            for path, use in paths.items():
                                use()
                                launch_us, wall_us = host_loop(fn, HOST_CALLS[num_tokens])
                                best = per_path[path].get(mode)
                                if best is None or launch_us < best['launch_us']:
                                    per_path[path][mode] = {'launch_us': launch_us, 'wall_us': wall_us}
                for path, row in per_path.items():
                    rows.append(row)
                    say(f'host {path:9s} {name:27s} T={num_tokens:5d}: plain {row["plain"]["launch_us"]:.1f} us/call, '
                        f'DeepEP defaults {row["deepep_defaults"]["launch_us"]:.1f} us/call (rank 0)')
    finally:
        restore()
    return rows


def worker(rank, world, port, args):
    say = init_worker(rank, world, port)
    group = dist.group.WORLD

    sms_list, tokens_list = args.sms, args.tokens
    hints = []
    for num_sms in set(sms_list) | {HOST_SMS}:
        for chunk in set(DISPATCH_CHUNKS) | set(COMBINE_CHUNKS):
            try:
                hints.append(deep_ep.Config(num_sms, chunk, NVL_RECV_TOKENS).get_nvl_buffer_size_hint(HIDDEN * 2, world))
            except Exception:  # an unsupported world size for the hint: 1e9 stays
                pass
    num_nvl_bytes = max([int(1e9)] + hints)
    buffer = deep_ep.Buffer(group, num_nvl_bytes, 0, low_latency_mode=False, num_qps_per_rank=1,
                            explicitly_destroy=True)
    say(f'Buffer: {num_nvl_bytes} NVL bytes; world {world}; SMs {sms_list}; tokens {tokens_list}')

    # Phase 1, before any profiler session (CUPTI can leave launch overhead behind): host time.
    host_inputs = {t: Inputs(buffer, t, rank) for t in HOST_TOKENS}
    supported = probe(buffer, host_inputs[HOST_TOKENS[0]], rank)
    host_rows = [] if args.skip_host else measure_host(buffer, host_inputs, args.package, supported, say)
    del host_inputs

    # Phase 2: end to end (DeepEP's bench), chunk sweeps; phase 3: kineto at the chosen chunks.
    records, baseline = [], []
    best = {}  # (op, dtype, num_sms, T) -> chunk, identical on every rank
    inputs = {t: Inputs(buffer, t, rank) for t in tokens_list}
    for num_tokens in tokens_list:
        inp = inputs[num_tokens]
        a2a = AllToAllDispatcher(inp, world, NUM_EXPERTS)
        for name, fn in (('nccl_a2a_dispatch', a2a.dispatch), ('nccl_a2a_combine', a2a.combine)):
            baseline.append(record(name, 'bf16', None, num_tokens, None, a2a.recv_bytes, bench(fn, args.warmups, args.tests)))
        say(f'T={num_tokens}: NCCL all-to-all dispatch {baseline[-2]["e2e_us"][0]:.0f} us, '
            f'combine {baseline[-1]["e2e_us"][0]:.0f} us (rank 0)')
        del a2a
        if not supported['dispatch']:
            continue
        for num_sms in sms_list:
            pt = Point(buffer, inp, num_sms)
            verify(buffer, inp, pt, rank, world, supported)
            line = []
            for op, dtype, chunks, factory, nbytes in op_specs(buffer, inp, pt, supported):
                if chunks is None:
                    chunk = best[('dispatch', dtype, num_sms, num_tokens)]
                    rec = record(op, dtype, num_sms, num_tokens, chunk, nbytes,
                                 bench(factory(deep_ep.Config(num_sms, chunk, NVL_RECV_TOKENS)), args.warmups, args.tests))
                else:
                    results = [bench(factory(deep_ep.Config(num_sms, c, NVL_RECV_TOKENS)), args.warmups, args.tests)
                               for c in chunks]
                    i, mean = agreed_argmin([r[0] for r in results])
                    chunk = best[(op, dtype, num_sms, num_tokens)] = chunks[i]
                    rec = record(op, dtype, num_sms, num_tokens, chunk, nbytes, results[i],
                                 {str(c): m for c, m in zip(chunks, mean)})
                records.append(rec)
                line.append(f'{op} {dtype} {rec["e2e_us"][0]:.0f} us')
            say(f'T={num_tokens} SMs={num_sms}: ' + ', '.join(line) + ' (rank 0, e2e)')
            del pt

    marker = KinetoMarker()
    for num_tokens in tokens_list:
        inp = inputs[num_tokens]
        a2a = AllToAllDispatcher(inp, world, NUM_EXPERTS)
        for rec in baseline:
            if rec['num_tokens'] == num_tokens:
                add_kineto(rec, kineto(a2a.dispatch if rec['op'] == 'nccl_a2a_dispatch' else a2a.combine, marker))
        del a2a
        if not supported['dispatch']:
            continue
        for num_sms in sms_list:
            pt = Point(buffer, inp, num_sms)
            by_key = {(r['op'], r['dtype']): r for r in records
                      if r['num_sms'] == num_sms and r['num_tokens'] == num_tokens}
            for op, dtype, _, factory, _ in op_specs(buffer, inp, pt, supported):
                rec = by_key[(op, dtype)]
                add_kineto(rec, kineto(factory(deep_ep.Config(num_sms, rec['nvl_chunk'], NVL_RECV_TOKENS)), marker))
            say(f'T={num_tokens} SMs={num_sms}: kineto done')
            del pt
    del marker

    gathered = [None] * world
    dist.all_gather_object(gathered, {'records': records, 'baseline': baseline, 'host': host_rows,
                                      'num_nvl_bytes': num_nvl_bytes})
    buffer.destroy()
    if rank == 0:
        report(gathered, world, args, supported)
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------ report
def merge(per_rank_lists):
    """Rank-averaged rows from the same-ordered per-rank records."""
    rows = []
    for recs in zip(*per_rank_lists):
        r0 = recs[0]
        row = {k: r0[k] for k in ('op', 'dtype', 'num_sms', 'num_tokens', 'nvl_chunk', 'chunk_sweep_e2e_us')}
        nbytes = [r['recv_bytes'] for r in recs]
        e2e = [r['e2e_us'][0] for r in recs]
        row['recv_bytes'] = sum(nbytes) / len(nbytes)
        row['e2e_us'] = sum(e2e) / len(e2e)
        row['e2e_us_min'] = min(r['e2e_us'][1] for r in recs)
        row['e2e_us_max'] = max(r['e2e_us'][2] for r in recs)
        row['e2e_gbps'] = row['recv_bytes'] / row['e2e_us'] / 1e3
        if 'kernel_us' in r0:
            kern = [r['kernel_us'] for r in recs]
            row['kernel_us'] = sum(kern) / len(kern)
            row['kernel_gbps'] = row['recv_bytes'] / row['kernel_us'] / 1e3 if row['kernel_us'] > 0 else None
            row['copy_us'] = sum(r['copy_us'] for r in recs) / len(recs)
            row['kernel_busy_us'] = sum(r['kernel_busy_us'] for r in recs) / len(recs)
            row['kernels_per_call'] = [r['kernels_per_call'] for r in recs]
            row['kernel_marker_found'] = all(r['kernel_marker_found'] for r in recs)
            row['kernel_breakdown_rank0'] = r0['kernel_breakdown']
        else:
            kern = []
        row['per_rank'] = {'recv_bytes': nbytes, 'e2e_us': e2e, 'kernel_us': kern}
        rows.append(row)
    return rows


OP_LABELS = {'dispatch': 'dispatch (cached)', 'dispatch_noncached': 'dispatch (non-cached)', 'combine': 'combine',
             'nccl_a2a_dispatch': 'NCCL a2a dispatch', 'nccl_a2a_combine': 'NCCL a2a combine'}


def fmt(v, spec):
    """format(v, spec) for a number, else '-' right-aligned to the spec's width."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return format(v, spec)
    return '-'.rjust(int(re.match(r'>?(\d+)', spec).group(1)))


def print_table(rows):
    print(f'{"op":22s} {"dtype":5s} {"SMs":>4s} {"T":>5s} {"chunk":>5s} {"e2e us":>8s} {"GB/s e2e":>8s} '
          f'{"kern us":>8s} {"GB/s kern":>9s} {"kern/call":>9s}')
    for r in rows:
        kpc = r.get('kernels_per_call')
        kpc = max(kpc) if kpc else None
        print(f'{OP_LABELS[r["op"]]:22s} {r["dtype"]:5s} {fmt(r["num_sms"], ">4d")} {r["num_tokens"]:5d} '
              f'{fmt(r["nvl_chunk"], ">5d")} {r["e2e_us"]:8.1f} {r["e2e_gbps"]:8.1f} {fmt(r.get("kernel_us"), "8.1f")} '
              f'{fmt(r.get("kernel_gbps"), "9.1f")} {fmt(kpc, "9.1f")}')


def print_reference(rows, baseline):
    v1, v2, ep = REFERENCE['deepep_v1'], REFERENCE['deepep_v2'], REFERENCE['nccl_ep']
    print(f'\nReference ({REFERENCE["source"]}; other runs: compare ratios), 4096 tokens/rank:')
    print(f'  DeepEP V1, 24 SMs, bench (e2e): BF16 dispatch {v1["dispatch_bf16"]["gbps"]} GB/s ({v1["dispatch_bf16"]["us"]} us), '
          f'FP8 dispatch {v1["dispatch_fp8"]["gbps"]} ({v1["dispatch_fp8"]["us"]} us), '
          f'combine {v1["combine_bf16"]["gbps"]} ({v1["combine_bf16"]["us"]} us)')
    print(f'  DeepEP V2, 24 SMs, kineto: FP8 dispatch {v2["dispatch_fp8"]["kernel_gbps"]} GB/s kernel, '
          f'{v2["dispatch_fp8"]["with_followup_gbps"]} with follow-up copy; combine {v2["combine_bf16"]["kernel_gbps"]} '
          f'kernel, {v2["combine_bf16"]["with_followup_gbps"]} with follow-up reduce')
    print(f'  NCCL EP, 16 SMs, BF16: dispatch {ep["dispatch_bf16"]["kernel_gbps"][0]}-{ep["dispatch_bf16"]["kernel_gbps"][1]} '
          f'GB/s kernel ({ep["dispatch_bf16"]["event_gbps"][0]}-{ep["dispatch_bf16"]["event_gbps"][1]} event); combine '
          f'{ep["combine_bf16"]["kernel_gbps"][0]}-{ep["combine_bf16"]["kernel_gbps"][1]} kernel '
          f'({ep["combine_bf16"]["event_gbps"][0]}-{ep["combine_bf16"]["event_gbps"][1]} event)')
    a2a = REFERENCE['nccl_alltoall_megatron']['4096']
    print(f'  NCCL all-to-all (Megatron style, other run): dispatch {a2a["dispatch_us"]} us, combine {a2a["combine_us"]} us; '
          f'logical NVLink ceiling ~{REFERENCE["logical_ceiling_gbps"]} GB/s')

    def find(rs, op, dtype, sms, t=4096):
        return next((r for r in rs if r['op'] == op and r['dtype'] == dtype and r['num_sms'] == sms
                     and r['num_tokens'] == t), None)

    lines = []
    for op, dtype, sms, ref_e2e, ref_kernel, label in (
            ('dispatch', 'bf16', 24, v1['dispatch_bf16']['gbps'], None, 'BF16 dispatch, 24 SMs'),
            ('dispatch', 'fp8', 24, v1['dispatch_fp8']['gbps'], v2['dispatch_fp8']['kernel_gbps'], 'FP8 dispatch, 24 SMs'),
            ('combine', 'bf16', 24, v1['combine_bf16']['gbps'], v2['combine_bf16']['kernel_gbps'], 'combine, 24 SMs'),
            ('dispatch', 'bf16', 16, None, sum(ep['dispatch_bf16']['kernel_gbps']) / 2, 'BF16 dispatch, 16 SMs'),
            ('combine', 'bf16', 16, None, sum(ep['combine_bf16']['kernel_gbps']) / 2, 'combine, 16 SMs')):
        r = find(rows, op, dtype, sms)
        if r is None:
            continue
        parts = [f'e2e {r["e2e_gbps"]:.0f} GB/s']
        if ref_e2e:
            parts.append(f'{r["e2e_gbps"] / ref_e2e:.2f}x DeepEP V1 ({ref_e2e})')
        if r.get('kernel_gbps'):
            parts.append(f'kernel {r["kernel_gbps"]:.0f} GB/s')
            if ref_kernel:
                who = 'DeepEP V2' if sms == 24 else 'NCCL EP'
                parts.append(f'{r["kernel_gbps"] / ref_kernel:.2f}x {who} kernel ({ref_kernel:g})')
        base = find(baseline, 'nccl_a2a_combine' if op == 'combine' else 'nccl_a2a_dispatch', 'bf16', None)
        if base is not None:
            parts.append(f'e2e {base["e2e_us"] / r["e2e_us"]:.2f}x the speed of the NCCL a2a (BF16) of this run')
        lines.append(f'  {label:22s}: ' + ', '.join(parts))
    if lines:
        print('\nThis run at 4096 tokens/rank vs reference:')
        print('\n'.join(lines))


def print_host(host):
    print(f'\nHost time per call of the Python layer ({HOST_SMS} SMs; N back-to-back calls, one synchronize at '
          f'the end; "launch" = loop time until the last call returns, "wall" = including the synchronize; '
          f'best of {HOST_ROUNDS} rounds, the host paths alternating; rank average; "DeepEP dflt" = under '
          f'set_default_dtype(bfloat16) + set_default_device("cuda")):')
    print(f'{"path":9s} {"op":27s} {"T":>5s} {"N":>4s} {"plain launch":>12s} {"plain wall":>10s} '
          f'{"DeepEP dflt launch":>18s} {"DeepEP dflt wall":>16s}')
    for r in host:
        print(f'{r["path"]:9s} {r["op"]:27s} {r["num_tokens"]:5d} {r["calls"]:4d} {r["plain"]["launch_us"]:12.1f} '
              f'{r["plain"]["wall_us"]:10.1f} {r["deepep_defaults"]["launch_us"]:18.1f} '
              f'{r["deepep_defaults"]["wall_us"]:16.1f}')
    print('(at T=128 kernels are short, so "launch" is the Python call itself; non-cached dispatch includes its '
          'host wait for the receive counts; at T=4096 "wall" is GPU-bound)')


def merge_host(per_rank_host):
    rows = []
    for recs in zip(*per_rank_host):
        row = {k: recs[0][k] for k in ('package', 'op', 'path', 'num_tokens', 'num_sms', 'calls')}
        for mode in HOST_MODES:
            row[mode] = {k: sum(r[mode][k] for r in recs) / len(recs) for k in ('launch_us', 'wall_us')}
            row[mode]['per_rank_launch_us'] = [r[mode]['launch_us'] for r in recs]
        rows.append(row)
    return rows


def nccl_version():
    v = torch.cuda.nccl.version()
    return '.'.join(map(str, v)) if isinstance(v, tuple) else str(v)


def machine_info(world, package=None):
    props = torch.cuda.get_device_properties(0)
    info = {'package': package or detect_package(), 'gpu': props.name, 'num_sms': props.multi_processor_count, 'world_size': world,
            'torch': torch.__version__, 'cuda': torch.version.cuda,
            'nccl_torch': nccl_version(), 'hostname': socket.gethostname(),
            'env': {k: v for k, v in os.environ.items() if k.startswith(('NCCL_', 'DEEPEP_', 'TORCH_SYMM'))}}
    try:
        import deep_ep_cpp
        info['deepep_nccl_library'] = deep_ep_cpp.library_version()
        info['nccl_runtime_code'] = deep_ep_cpp.nccl_runtime_version()
        info['nccl_compiled_code'] = deep_ep_cpp.nccl_compiled_version()
    except Exception:  # another deep_ep (DeepEP itself) has none of these
        pass
    return info


def report(gathered, world, args, supported):
    rows = merge([g['records'] for g in gathered])
    baseline = merge([g['baseline'] for g in gathered])
    host = merge_host([g['host'] for g in gathered])
    info = machine_info(world, args.package)
    print(f'\nPackage: {args.package}; GPU: {info["gpu"]}, {info["num_sms"]} SMs; world size {world}; torch {info["torch"]}, '
          f'NCCL {info["nccl_torch"]} (torch); shape: hidden {HIDDEN}, top-{NUM_TOPK} of {NUM_EXPERTS} experts')
    print(f'Times are rank averages; GB/s = received bytes / time (DeepEP counting); e2e = DeepEP tests/utils.bench '
          f'({args.warmups} warm-up, {args.tests} timed); kern = sum of all kernels per call (kineto, '
          f'{KINETO_CALLS} calls); best NVL chunk of {DISPATCH_CHUNKS} (dispatch) / {COMBINE_CHUNKS} (combine)\n')
    order = {'dispatch': 0, 'dispatch_noncached': 1, 'combine': 2}
    rows.sort(key=lambda r: (r['num_tokens'], r['num_sms'], order[r['op']], r['dtype']))
    print_table(rows + baseline)
    print_reference(rows, baseline)
    print_host(host)
    out = {'package': args.package, 'machine': info, 'supported': supported,
           'shape': {'hidden': HIDDEN, 'num_experts': NUM_EXPERTS, 'num_topk': NUM_TOPK,
                     'routing': 'topk(|randn|+1), per-rank seed', 'nvl_recv_tokens': NVL_RECV_TOKENS},
           'settings': {'sms': list(args.sms), 'tokens': list(args.tokens), 'dispatch_chunks': list(DISPATCH_CHUNKS),
                        'combine_chunks': list(COMBINE_CHUNKS), 'bench_warmups': args.warmups,
                        'bench_tests': args.tests, 'kineto_calls': KINETO_CALLS, 'quick': args.quick,
                        'num_nvl_bytes': gathered[0]['num_nvl_bytes'], 'host_sms': HOST_SMS,
                        'fp8_scales': 'float32 [T, H/128], column-major (DeepEP test)',
                        'noncached_dispatch': 'layout tensors + topk_idx + topk_weights, best cached chunk',
                        'bytes': 'BF16 recv_x.numel()*2; FP8 x (1+4/128)/2; combine = BF16 dispatch bytes'},
           'rows': rows, 'baseline_rows': baseline, 'host_overhead': host, 'reference': REFERENCE}
    with open(args.json, 'w') as f:
        json.dump(out, f, indent=2)
    print(f'\nresults written to {args.json}')


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--world', type=int, default=torch.cuda.device_count())
    parser.add_argument('--quick', action='store_true', help=f'SMs {QUICK_SMS}, tokens {QUICK_TOKENS}')
    parser.add_argument('--sms', type=int, nargs='+', help=f'SM counts (default {SMS})')
    parser.add_argument('--tokens', type=int, nargs='+', help=f'tokens per rank (default {TOKENS})')
    parser.add_argument('--skip-host', action='store_true', help='skip the Python host-overhead measurement')
    parser.add_argument('--warmups', type=int, default=10)
    parser.add_argument('--tests', type=int, default=20)
    parser.add_argument('--json', default=os.path.join(os.environ.get('OUT') or '.', 'bench_normal.json'))
    add_package_arg(parser)
    args = parser.parse_args()
    resolve_package(args)
    args.sms = tuple(args.sms or (QUICK_SMS if args.quick else SMS))
    args.tokens = tuple(args.tokens or (QUICK_TOKENS if args.quick else TOKENS))
    if args.world < 1 or args.world > torch.cuda.device_count():
        sys.exit(f'--world {args.world}: {torch.cuda.device_count()} GPUs visible')
    if NUM_EXPERTS % args.world:
        sys.exit(f'{NUM_EXPERTS} experts must be divisible by --world {args.world}')
    if any(s % 2 for s in args.sms):
        sys.exit(f'--sms {args.sms}: SM counts must be even')
    if args.tests < 2:
        sys.exit('--tests must be at least 2 (the first sample is dropped)')
    spawn_workers(worker, args.world, args)


if __name__ == '__main__':
    main()
