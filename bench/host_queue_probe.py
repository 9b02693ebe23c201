"""Host time per call against the GPU queue's depth: cached dispatch, combine and get_dispatch_layout
at 24 SMs, per package (the importable deep_ep: ours, or DeepEP V1 with PYTHONPATH=/tmp/deepep_v1).

For each op and T, two ways, twice: `back-to-back`, 50 calls in a row as bench_normal's host_loop
makes them (perf_counter around each call; means of calls 1-10, 11-30 and 31-50, so that a queue
that fills shows as later calls growing), and `synced`, each call timed alone after a synchronize
(an empty queue). bench/RESULTS.md (2x H200, host time) reads it: whether a host time that grows with T is
the op's or the queue's.

Run: python bench/host_queue_probe.py [--world 2] [--tokens 128 4096] [--json FILE]"""
import argparse
import json
import time

import torch
import torch.distributed as dist

import deep_ep
from bench_common import add_package_arg, init_worker, resolve_package, settle, spawn_workers
from bench_normal import NUM_EXPERTS, Inputs, Point, cached_configs

CALLS = 50
WARMUPS = 20
NUM_SMS = 24
ROUNDS = 2


def per_call_us(fn, synced):
    """us of each of CALLS calls, back to back or each after a synchronize."""
    settle(fn, WARMUPS)
    times = []
    for _ in range(CALLS):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
        if synced:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return times


def mean(xs):
    return sum(xs) / len(xs)


def worker(rank, world, port, args):
    say = init_worker(rank, world, port)
    buf = deep_ep.Buffer(dist.group.WORLD, int(1e9), 0, explicitly_destroy=True)
    rows = []
    for num_tokens in args.tokens:
        inp = Inputs(buf, num_tokens, rank)
        pt = Point(buf, inp, NUM_SMS)
        dispatch_config, combine_config = cached_configs(NUM_SMS)
        ops = {'cached dispatch': lambda: buf.dispatch(inp.x, handle=pt.handle, config=dispatch_config),
               'combine': lambda: buf.combine(pt.recv_x, pt.handle, config=combine_config),
               'get_dispatch_layout': lambda: buf.get_dispatch_layout(inp.topk_idx, NUM_EXPERTS)}
        for name, fn in ops.items():
            for rnd in range(ROUNDS):
                b2b, synced = per_call_us(fn, False), per_call_us(fn, True)
                row = {'package': args.package, 'op': name, 'num_tokens': num_tokens, 'round': rnd,
                       'back_to_back_us': [mean(b2b[:10]), mean(b2b[10:30]), mean(b2b[30:])],
                       'synced_us': mean(synced), 'synced_min_us': min(synced)}
                rows.append(row)
                say(f'{args.package} T={num_tokens:5d} {name:19s} round {rnd}: back-to-back calls 1-10 / 11-30 / 31-50 '
                    + ' / '.join(f'{v:5.1f}' for v in row['back_to_back_us'])
                    + f' us | synced {row["synced_us"]:5.1f} (min {row["synced_min_us"]:5.1f}) us')
    buf.destroy()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0 and args.json:
        with open(args.json, 'w') as f:
            json.dump({'machine': torch.cuda.get_device_name(0), 'world': world, 'num_sms': NUM_SMS, 'rows': rows}, f,
                      indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--world', type=int, default=2)
    parser.add_argument('--tokens', type=int, nargs='+', default=[128, 4096])
    parser.add_argument('--json', help='rank 0 writes the rows here')
    add_package_arg(parser)
    args = parser.parse_args()
    resolve_package(args)
    spawn_workers(worker, args.world, args)


if __name__ == '__main__':
    main()
