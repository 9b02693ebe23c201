"""get_dispatch_layout benchmark at DeepEP's shape (4096 tokens/rank, 256 experts,
top-8), one process per GPU. Reports, per call:
  1. end to end, timed exactly like DeepEP's tests/utils.bench (the method behind
     DeepEP's published 34 us), plus a variant with L2 flushed before every call;
  2. GPU time from a CUDA graph replaying 100 layout calls;
  3. the plain-torch layout a user without DeepEP writes, timed like 1.
Layout moves no payload, so there is no GB/s figure."""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

import deep_ep
from bench_common import bench, init_worker, spawn_workers

DEEPEP_V1_US = 34  # DeepEP V1 @ 567632d, 4x H200, same shape (shared/reference/baselines.md)


def graph_us_per_call(fn, calls=100, replays=20):
    """GPU time per call: a CUDA graph of `calls` back-to-back calls, replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)


def torch_layout(topk_idx, num_experts, num_ranks):
    """What users without DeepEP write: bincount + scatter + sum (bincount syncs with the host)."""
    valid = topk_idx >= 0
    per_expert = torch.bincount(topk_idx.masked_fill(~valid, num_experts).flatten(),
                                minlength=num_experts + 1)[:num_experts].int()
    rank_idx = torch.where(valid, topk_idx // (num_experts // num_ranks), num_ranks)
    in_rank = torch.zeros(topk_idx.size(0), num_ranks + 1, dtype=torch.bool, device=topk_idx.device)
    in_rank = in_rank.scatter_(1, rank_idx, True)[:, :num_ranks]
    return in_rank.sum(0, dtype=torch.int32), None, per_expert, in_rank


def worker(rank, world, port, args):
    init_worker(rank, world, port)
    group = dist.group.WORLD
    torch.manual_seed(rank)
    T, E, K = args.num_tokens, args.num_experts, args.num_topk
    scores = torch.randn(T, E, device='cuda').abs() + 1  # DeepEP's test routing
    topk_idx = torch.topk(scores, K, dim=-1, sorted=False).indices.to(deep_ep.topk_idx_t)

    buffer = deep_ep.Buffer(group, num_nvl_bytes=64 << 20, explicitly_destroy=True)
    got = buffer.get_dispatch_layout(topk_idx, E)
    want = torch_layout(topk_idx, E, world)
    for i in (0, 2, 3):  # never time a wrong answer
        assert torch.equal(got[i], want[i].contiguous()), f'rank {rank}: layout output {i} differs from torch'

    result = {
        'deep_ep': bench(lambda: buffer.get_dispatch_layout(topk_idx, E)),
        'deep_ep_l2_flushed': bench(lambda: buffer.get_dispatch_layout(topk_idx, E), flush_every_call=True),
        'deep_ep_graph': graph_us_per_call(lambda: buffer.get_dispatch_layout(topk_idx, E)),
        'torch': bench(lambda: torch_layout(topk_idx, E, world)),
    }
    results = [None] * world
    dist.all_gather_object(results, result)
    buffer.destroy()
    if rank == 0:
        report(results, world, args)
    dist.destroy_process_group()


def report(results, world, args):
    props = torch.cuda.get_device_properties(0)
    shape = dict(num_tokens=args.num_tokens, num_experts=args.num_experts, num_topk=args.num_topk)
    print(f'GPU: {props.name}, {props.multi_processor_count} SMs; world size {world}; '
          f'shape: {args.num_tokens} tokens/rank, {args.num_experts} experts, top-{args.num_topk}')
    print(f'Baseline: DeepEP V1 on 4x H200: {DEEPEP_V1_US} us (same method as the first row)')

    def summary(key):
        rows = [r[key] for r in results]
        return {'avg_us': sum(r[0] for r in rows) / len(rows), 'min_us': min(r[1] for r in rows),
                'max_us': max(r[2] for r in rows), 'per_rank_avg_us': [r[0] for r in rows]}

    out = {'gpu': props.name, 'num_sms': props.multi_processor_count, 'world_size': world, 'shape': shape,
           'deepep_v1_4xh200_us': DEEPEP_V1_US, 'gbps': None}
    labels = {'deep_ep': 'deep_ep get_dispatch_layout (DeepEP bench method)',
              'deep_ep_l2_flushed': 'deep_ep get_dispatch_layout (L2 flushed before each call)',
              'torch': 'plain torch (bincount + scatter + sum)'}
    print(f'{"op":60s} {"avg us":>8s} {"min us":>8s} {"max us":>8s}  GB/s  per-rank avg us')
    for key, label in labels.items():
        s = out[key] = summary(key)
        ranks = ' '.join(f'{v:.1f}' for v in s['per_rank_avg_us'])
        print(f'{label:60s} {s["avg_us"]:8.1f} {s["min_us"]:8.1f} {s["max_us"]:8.1f}  n/a   {ranks}')
    graph = [r['deep_ep_graph'] for r in results]
    out['deep_ep_graph_us_per_call'] = {'avg_us': sum(graph) / len(graph), 'per_rank_us': graph}
    print(f'{"deep_ep get_dispatch_layout, GPU time (CUDA graph of 100 calls)":60s} '
          f'{sum(graph) / len(graph):8.1f} {min(graph):8.1f} {max(graph):8.1f}  n/a   '
          + ' '.join(f'{v:.1f}' for v in graph))
    print(f'speed-up over plain torch: {out["torch"]["avg_us"] / out["deep_ep"]["avg_us"]:.2f}x; '
          f'vs DeepEP V1: {DEEPEP_V1_US / out["deep_ep"]["avg_us"]:.2f}x')
    with open(args.json, 'w') as f:
        json.dump(out, f, indent=2)
    print(f'results written to {args.json}')


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--num-processes', type=int, default=torch.cuda.device_count())
    parser.add_argument('--num-tokens', type=int, default=4096)
    parser.add_argument('--num-experts', type=int, default=256)
    parser.add_argument('--num-topk', type=int, default=8)
    parser.add_argument('--json', default=os.path.join(os.environ.get('OUT') or '.', 'bench_layout.json'))
    args = parser.parse_args()
    if args.num_processes < 1 or args.num_processes > torch.cuda.device_count():
        sys.exit(f'--num-processes {args.num_processes}: {torch.cuda.device_count()} GPUs visible')
    if args.num_experts % args.num_processes:
        sys.exit(f'--num-experts {args.num_experts} must be divisible by {args.num_processes} processes')
    spawn_workers(worker, args.num_processes, args)


if __name__ == '__main__':
    main()
