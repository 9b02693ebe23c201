"""Where DeepEP's plain e2e goes, without a profiler. DeepEP's bench loop (events around each call,
calls back to back) of a cached BF16 dispatch and of an LL dispatch + combine, at eager_profile.py's
shapes; per call the host call's start/end (perf_counter) and the GPU times of its events (from a
reference event recorded at the loop's start). Rank 0 prints each rank's medians: e2e, host call,
loop period, how far the GPU runs behind the host at a call's start and end, the GPU gap between
calls. For ours it also counts cached dispatches that left the direct entry for the class method, and
those that went on to ctypes (the LL ops select their path elsewhere).

Run: python bench/plain_loop_probe.py [--tokens 128] [--package auto|deepep-nccl|deepep_v1]"""
import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

from bench_common import add_package_arg, init_worker, resolve_package, spawn_workers
from bench_normal import Inputs as NormalInputs
from eager_profile import low_latency_steps, normal_buffer

NUM_CALLS, NUM_WARMUPS, SKIPPED = 40, 30, 5  # the first SKIPPED calls of the loop are not counted


def probe(label, fn, rank):
    """One loop of NUM_CALLS calls after NUM_WARMUPS; rank 0 prints every rank's medians (us)."""
    for _ in range(NUM_WARMUPS):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    ref = torch.cuda.Event(enable_timing=True)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(NUM_CALLS)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(NUM_CALLS)]
    host = []
    t0 = time.perf_counter()
    ref.record()
    for start, end in zip(starts, ends):
        h0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        host.append((h0 - t0, time.perf_counter() - t0))
    torch.cuda.synchronize()
    rows = [(hs * 1e6, he * 1e6, ref.elapsed_time(s) * 1e3, ref.elapsed_time(e) * 1e3)
            for (hs, he), s, e in zip(host, starts, ends)][SKIPPED:]
    med = statistics.median
    summary = {'e2e': med(ge - gs for _, _, gs, ge in rows), 'host call': med(he - hs for hs, he, _, _ in rows),
               'period': (rows[-1][0] - rows[0][0]) / (len(rows) - 1),
               'GPU behind at start': med(gs - hs for hs, _, gs, _ in rows),
               'GPU behind at end': med(ge - he for _, he, _, ge in rows),
               'GPU gap': med(b[2] - a[3] for a, b in zip(rows, rows[1:]))}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, summary)
    if rank == 0:
        for r, s in enumerate(gathered):
            print(f'{label} rank {r}: ' + ' | '.join(f'{k} {v:.1f}' for k, v in s.items()), flush=True)


def count_fallbacks(buffer):
    """Normal-mode calls of ours that left the direct entries (deep_ep_cpp/_fast_direct.h) for the class
    method, whose compiled try goes through _fast_call: (all of those, those that went on to ctypes
    because _fast_call answered None)."""
    runtime, left, fell = buffer.runtime, [], []
    fast_call = getattr(runtime, '_fast_call', None)
    if fast_call is not None:
        def counted(op, *args):
            name = getattr(op, '__name__', str(op))
            left.append(name)
            result = fast_call(op, *args)
            if result is None:
                fell.append(name)
            return result
        runtime._fast_call = counted
    return left, fell


def worker(rank, world, port, args):
    init_worker(rank, world, port)
    group = dist.group.WORLD
    buffer, dcfg, _ = normal_buffer(group, world)
    left, fell = count_fallbacks(buffer)
    inp = NormalInputs(buffer, args.tokens, rank)
    handle = buffer.dispatch(inp.x, config=dcfg, **inp.layout)[4]
    probe(f'{args.package} cached BF16 dispatch T={args.tokens}',
          lambda: buffer.dispatch(inp.x, handle=handle, config=dcfg), rank)
    if rank == 0:
        print(f'cached dispatches that left the direct entry (rank 0): {len(left)}, of them to ctypes: {len(fell)} '
              f'{sorted(set(fell))[:5]}', flush=True)
    torch.cuda.synchronize()
    buffer.destroy()

    buffer, ((_, dispatch), (_, combine)) = low_latency_steps(group, args, rank, world)

    def pair():
        dispatch()
        combine()
    probe(f'{args.package} LL dispatch + combine T={args.tokens}', pair, rank)
    torch.cuda.synchronize()
    buffer.destroy()
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--tokens', type=int, default=128, help='tokens per rank')
    add_package_arg(parser)
    args = parser.parse_args()
    resolve_package(args)
    if torch.cuda.device_count() < 2:
        sys.exit(f'plain_loop_probe: needs 2 GPUs, {torch.cuda.device_count()} visible')
    spawn_workers(worker, 2, args)


if __name__ == '__main__':
    main()
