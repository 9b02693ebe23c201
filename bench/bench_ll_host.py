"""Host time of the low-latency calls: what `deep_ep.Buffer.low_latency_dispatch` / `low_latency_combine`
(and `clean_low_latency_buffer`, at every normal -> LL switch) cost the calling CPU thread per call (outside CUDA graphs, every MoE layer of a decode step pays it).

Method: warm up, synchronize, then time N back-to-back calls with time.perf_counter (nothing waits for
the GPU inside the loop; N is small enough that the launch queue never fills), synchronize; the median
over rounds of the per-call mean, in us. Measured per op, once with plain defaults and once as DeepEP's
tests run (torch.set_default_dtype(bfloat16), torch.set_default_device('cuda')), and per host path:
the compiled one (deep_ep_cpp/_fast.cpp) when it loaded, and the ctypes one. With DeepEP V1's own
package importable (--package deepep_v1, or auto-detected) the same loops run through its public API
alone, one host path labelled deepep_v1. A torch op pair
(`torch.empty` + `add_`) is timed the same way as a yardstick for this CPU.

Shape and inputs as bench_low_latency.py (hidden 7168, top-8 of 288 experts, DeepEP's routing with
10 masked slots, FP8 dispatch, BF16 combine).

With several processes (default: every visible GPU) each rank runs the same loop; the non-graph
calls do not wait for the GPU, so this is each rank's CPU cost while its peers run theirs.
M per T as bench_low_latency.py (T rounded up so that R*M % 4 == 0).

Run: python bench/bench_ll_host.py [--num-processes N] [--tokens 1 128] [--calls 200] [--rounds 7]
     [--profile] [--json PATH] [--package auto|deepep-nccl|deepep_v1]
"""
import argparse
import cProfile
import io
import json
import os
import pstats
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist

os.environ.setdefault('DEEPEP_GPU_TIMEOUT_SECS', '60')

from bench_common import (DeepEPDefaults, add_package_arg, host_paths, init_worker, resolve_package,  # noqa: E402
                          spawn_workers)
from bench_low_latency import (HIDDEN, NUM_EXPERTS, NUM_MASKED, NUM_TOPK, Inputs, make_buffer,  # noqa: E402
                               max_tokens_for)


def host_us(fn, calls, rounds):
    """(median, min) over rounds of the mean host time of one fn() call, in us. Shared cloud
    CPUs are noisy (a round can run at half speed): the min is the figure to compare builds by."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    means = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        means.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(means), min(means)


def process_state(args):
    """What slows this process's CPU thread whatever the op: the CPUs it may run on, its threads,
    and the torch yardstick's (median, min) us at T=1 (a buffer's communicator adds threads;
    timed before and after Buffer creation to tell the op from the process)."""
    yard = torch.zeros(1, args.hidden, dtype=torch.bfloat16, device='cuda')

    def yardstick():
        torch.empty(1, args.hidden, dtype=torch.bfloat16, device='cuda')
        yard.add_(1)

    return {'cpus_allowed': len(os.sched_getaffinity(0)), 'threads': len(os.listdir('/proc/self/task')),
            'yardstick_us': host_us(yardstick, args.calls, args.rounds)}


def ops(buffer, num_tokens, args):
    """name -> a zero-argument callable issuing one call (or one pair) of that op."""
    inp = Inputs(args, num_tokens, dist.get_rank(), dist.get_world_size())
    x, topk_idx, topk_weights, stats = inp.x, inp.topk_idx, inp.topk_weights, inp.stats
    M, E = max_tokens_for(num_tokens, dist.get_world_size(), 't'), args.num_experts
    _, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, M, E)
    expert_out = torch.randn(stats.numel(), handle[0].size(1), args.hidden, dtype=torch.bfloat16, device='cuda')
    yard = torch.zeros(num_tokens, args.hidden, dtype=torch.bfloat16, device='cuda')

    def dispatch():
        buffer.low_latency_dispatch(x, topk_idx, M, E, cumulative_local_expert_recv_stats=stats)

    def dispatch_hook():
        buffer.low_latency_dispatch(x, topk_idx, M, E, cumulative_local_expert_recv_stats=stats,
                                    return_recv_hook=True)[-1]()

    def combine():
        buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle)

    def combine_hook():
        buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle, return_recv_hook=True)[-1]()

    def pair():
        h = buffer.low_latency_dispatch(x, topk_idx, M, E, cumulative_local_expert_recv_stats=stats)[2]
        buffer.low_latency_combine(expert_out, topk_idx, topk_weights, h)

    def clean():
        # Collective: every rank runs the same loop. DeepEP's is one kernel and no host wait.
        buffer.clean_low_latency_buffer(M, args.hidden, E)

    def torch_yardstick():
        torch.empty(num_tokens, args.hidden, dtype=torch.bfloat16, device='cuda')
        yard.add_(1)

    return {'dispatch': dispatch, 'dispatch hook (send + hook())': dispatch_hook, 'combine': combine,
            'combine hook (send + hook())': combine_hook, 'dispatch + combine': pair,
            'clean_low_latency_buffer': clean, 'torch.empty + add_ (yardstick)': torch_yardstick}


def worker(rank, world, port, args):
    init_worker(rank, world, port)
    group = dist.new_group(list(range(world)))
    before = process_state(args)
    buffer, _ = make_buffer(group, max(max_tokens_for(T, world, 't') for T in args.tokens), args, world)
    states = [None] * world
    dist.all_gather_object(states, {'before_buffer': before, 'after_buffer': process_state(args)}, group=group)
    results = []
    # Ours: both host paths side by side when the compiled one loaded (deep_ep_cpp/_fast.py).
    paths, restore = host_paths(buffer, args.package, '_ll_ops', group)
    try:
        for path, use in paths.items():
            use()
            for deepep_defaults in (False, True):
                with DeepEPDefaults(deepep_defaults):
                    for T in args.tokens:
                        for name, fn in ops(buffer, T, args).items():
                            dist.barrier(group)
                            us = host_us(fn, args.calls, args.rounds)
                            gathered = [None] * world
                            dist.all_gather_object(gathered, us, group=group)
                            results.append({'package': args.package, 'op': name, 'num_tokens': T,
                                            'deepep_defaults': deepep_defaults, 'host_path': path,
                                            'host_us': gathered})
                            if (args.profile and rank == 0 and T == max(args.tokens)
                                    and name == 'dispatch + combine'):
                                profile(fn, deepep_defaults)
        restore()
    finally:
        buffer.destroy()
    if rank == 0:
        report(results, states, world, args)
    dist.barrier(group)
    dist.destroy_process_group()


def profile(fn, deepep_defaults):
    """cProfile of 2000 calls: where the host time goes (rank 0)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats('tottime').print_stats(25)
    print(f'--- cProfile, dispatch + combine, DeepEP defaults {deepep_defaults} (tottime, 2000 calls) ---')
    print(out.getvalue())


def report(results, states, world, args):
    gpu = torch.cuda.get_device_name()
    print(f'\n{args.package}: host time per call, us (median of {args.rounds} rounds of {args.calls} calls; rank average, '
          f'min-max over {world} rank(s)); {gpu}, hidden {args.hidden}, top-{args.num_topk} of '
          f'{args.num_experts}, FP8 dispatch')
    print('| host path | op | T | plain: median | min | DeepEP defaults (bf16, cuda): median | min |')
    print('| --- | --- | --- | --- | --- | --- | --- |')
    table = {}
    for r in results:
        table.setdefault((r['host_path'], r['op'], r['num_tokens']), {})[r['deepep_defaults']] = r['host_us']

    def cell(values):
        avg = sum(values) / len(values)
        return f'{avg:.1f}' if len(values) == 1 else f'{avg:.1f} ({min(values):.1f}-{max(values):.1f})'

    def cells(per_rank):
        return f'{cell([m for m, _ in per_rank])} | {cell([b for _, b in per_rank])}'

    for (path, op, T), by_mode in table.items():
        print(f'| {path} | {op} | {T} | {cells(by_mode[False])} | {cells(by_mode[True])} |')
    for rank, st in enumerate(states):
        b, a = st['before_buffer'], st['after_buffer']
        print(f'rank {rank}: CPUs allowed {b["cpus_allowed"]} -> {a["cpus_allowed"]}, threads {b["threads"]} -> '
              f'{a["threads"]}, yardstick T=1 median/min {b["yardstick_us"][0]:.1f}/{b["yardstick_us"][1]:.1f} -> '
              f'{a["yardstick_us"][0]:.1f}/{a["yardstick_us"][1]:.1f} us (before -> after Buffer creation)')
    if args.json:
        with open(args.json, 'w') as f:
            json.dump({'tool': 'bench/bench_ll_host.py', 'package': args.package, 'gpu': gpu, 'world_size': world,
                       'settings': vars(args), 'process_state': states, 'results': results}, f, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--num-processes', type=int, default=torch.cuda.device_count(),
                        help='processes (GPUs); default: all visible')
    parser.add_argument('--tokens', type=int, nargs='+', default=[1, 128])
    parser.add_argument('--hidden', type=int, default=HIDDEN)
    parser.add_argument('--num-experts', type=int, default=NUM_EXPERTS)
    parser.add_argument('--num-topk', type=int, default=NUM_TOPK)
    parser.add_argument('--masked-slots', type=int, default=NUM_MASKED)
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--calls', type=int, default=200)
    parser.add_argument('--rounds', type=int, default=7)
    parser.add_argument('--profile', action='store_true', help='also print a cProfile of the pair (rank 0)')
    parser.add_argument('--json', default=None)
    add_package_arg(parser)
    args = parser.parse_args()
    resolve_package(args)
    if args.num_processes < 1 or args.num_processes > torch.cuda.device_count():
        sys.exit(f'--num-processes {args.num_processes}: {torch.cuda.device_count()} GPUs visible')
    if args.num_experts % args.num_processes:
        sys.exit(f'--num-experts {args.num_experts} must be divisible by the number of processes')
    if args.num_processes == 1:
        # One rank runs in this process (no spawn, no rendezvous beyond a local port).
        port = random.randint(20000, 60000)
        worker(0, 1, port, args)
    else:
        spawn_workers(worker, args.num_processes, args)


if __name__ == '__main__':
    main()
