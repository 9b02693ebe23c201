"""Internode normal-mode benchmark as 2 virtual nodes (DEEPEP_VIRTUAL_NODE_SIZE): 2 GPUs as 2 nodes
of 1 (both legs over NVLink, the forwarder is the receiver), 4 GPUs as 2 of 2 and 8 as 2 of 4
where visible, against the intranode op of the same ranks, shape and SMs in the same processes
(docs/internode.md's check on these machines: internode >= 80% of intranode). DeepEP's shape:
4096 tokens/rank, hidden 7168, top-8 of 256 experts, DeepEP's grouped routing (each token within
its min(nodes, 4) best nodes); BF16 dispatch through the cached handle (DeepEP's tuning loop) and
BF16 combine, timed as DeepEP's tests/utils.bench. Reported: GB/s = received bytes / time
(DeepEP's counting, all rows); DeepEP's two internode bandwidths, the bytes each leg carried (the
buffer's traffic counters) / time; each op's kernels by stage (notify, data kernel; kineto, rank
0). First, before any profiler session, the host time per call of the internode ops at T=128 (the
loop is host-bound) on each host path: the compiled one (InternodeOps, _fast_internode.h) where
every rank loaded it, and ctypes; the paths alternate, each keeps its best round (--skip-host: not
measured). Plot: bench/plot_internode.py.

Run: python bench/bench_internode.py [--json PATH] [--sms 24 ...] [--tokens 4096] [--worlds 2 4 ...]
     [--chunks NVL_SEND NVL_RECV RDMA_SEND RDMA_RECV]  (Config after num_sms; default 8 256 16 128)
     [--skip-host]
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

import deep_ep
from bench_common import OURS, bench, host_loop, host_paths, init_worker, spawn_workers, trace_events

HIDDEN = 7168
NUM_EXPERTS = 256
NUM_TOPK = 8


# Config's chunk fields after num_sms: NVL send, NVL receive, RDMA send, RDMA receive tokens
# (--chunks; the intranode op uses the NVL ones).
DEFAULT_CHUNKS = (8, 256, 16, 128)


def config(num_sms, chunks):
    return deep_ep.Config(num_sms, *chunks)


def make_buffers(group, world, max_sms, chunks):
    """(intranode buffer, internode buffer over 2 virtual nodes), both sized by DeepEP's hints for
    the largest SM count measured."""
    nodes = 2
    configs = (config(max_sms, chunks),)
    nvl = max(c.get_nvl_buffer_size_hint(HIDDEN * 2, world) for c in configs)
    rdma = max(c.get_rdma_buffer_size_hint(HIDDEN * 2, nodes * 8) for c in configs)  # nodes of 8 in the hint
    intra = deep_ep.Buffer(group, num_nvl_bytes=nvl, explicitly_destroy=True)
    os.environ['DEEPEP_VIRTUAL_NODE_SIZE'] = str(world // nodes)
    try:
        inter = deep_ep.Buffer(group, num_nvl_bytes=nvl, num_rdma_bytes=rdma, explicitly_destroy=True)
    finally:
        del os.environ['DEEPEP_VIRTUAL_NODE_SIZE']
    assert inter.runtime.get_num_rdma_ranks() == nodes
    return intra, inter


def measure(buffer, tokens, num_sms, chunks):
    """(dispatch us, combine us, received rows, leg bytes) of one buffer; leg bytes (internode
    only, else zeros): this rank's scale-out and NVLink bytes of one dispatch, then of one combine
    (the traffic counters around one more call of each)."""
    topk_idx = grouped_topk(tokens, nodes=2)
    weights = torch.rand(tokens, NUM_TOPK, dtype=torch.float32, device='cuda')
    x = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, device='cuda')
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS)
    dispatch_config = combine_config = config(num_sms, chunks)
    recv_x, _, _, _, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=weights, config=dispatch_config)
    dispatch_us = bench(lambda: buffer.dispatch(x, handle=handle, config=dispatch_config))[0]
    combine_us = bench(lambda: buffer.combine(recv_x, handle, config=combine_config))[0]
    stages = {'dispatch': kernel_times(lambda: buffer.dispatch(x, handle=handle, config=dispatch_config)),
              'combine': kernel_times(lambda: buffer.combine(recv_x, handle, config=combine_config))}
    legs = [0, 0, 0, 0]
    if buffer.runtime.get_num_rdma_ranks() > 1:
        before = traffic(buffer)
        buffer.dispatch(x, handle=handle, config=dispatch_config)
        between = traffic(buffer)
        buffer.combine(recv_x, handle, config=combine_config)
        after = traffic(buffer)
        # DeepepTrafficKind: dispatch scale-out rows, bytes, NVLink rows, bytes; combine's four.
        legs = [between[1] - before[1], between[3] - before[3], after[5] - between[5], after[7] - between[7]]
    return dispatch_us, combine_us, recv_x.size(0), legs, stages


def grouped_topk(tokens, nodes):
    """DeepEP's test routing: top-k of |randn| + 1 scores within each token's num_topk_groups =
    min(nodes, 4) best nodes (by their best expert's score)."""
    scores = torch.randn(tokens, NUM_EXPERTS, device='cuda').abs() + 1
    best = scores.view(tokens, nodes, -1).amax(-1).topk(min(nodes, 4), dim=-1).indices
    keep = torch.zeros(tokens, nodes, dtype=torch.bool, device='cuda').scatter_(1, best, True)
    scores = scores.masked_fill(~keep.repeat_interleave(NUM_EXPERTS // nodes, dim=1), 0)
    return torch.topk(scores, NUM_TOPK, dim=-1, sorted=False).indices.to(deep_ep.topk_idx_t)


def kernel_times(fn, calls=20):
    """Per-stage GPU time of one call, us: the op's kernels by stage (notify, the data kernel,
    anything else), from kineto over `calls` back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    stages = {}
    for e in trace_events(prof):
        if e.get('ph') != 'X' or e.get('cat') != 'kernel':
            continue
        name = e['name']
        stage = 'notify' if 'notify' in name else 'data' if ('dispatch' in name or 'combine' in name) else 'other'
        stages[stage] = stages.get(stage, 0.0) + float(e['dur']) / calls
    return stages


def fmt(stages):
    return ' + '.join(f'{k} {v:.0f}' for k, v in sorted(stages.items()))


def traffic(buffer):
    out = torch.zeros(8, dtype=torch.int64, device='cuda')
    buffer.internode_query_traffic_buffer(out)
    return out.tolist()


HOST_TOKENS = 128  # kernels are short: the loop is host-bound
HOST_CALLS = 500
HOST_ROUNDS = 5  # per op: the paths alternate, best round kept (the CPU's speed drifts)


def measure_host(buffer, group, num_sms, chunks, say):
    """{op: {host path: {'launch_us', 'wall_us'}}}: host us per call of the Python layer on the
    internode buffer at T=HOST_TOKENS (bench_common.host_loop), on each host path
    (bench_common.host_paths over _internode_fast: 'compiled' where every rank loaded it, 'ctypes')."""
    topk_idx = grouped_topk(HOST_TOKENS, nodes=2)
    weights = torch.rand(HOST_TOKENS, NUM_TOPK, dtype=torch.float32, device='cuda')
    x = torch.randn(HOST_TOKENS, HIDDEN, dtype=torch.bfloat16, device='cuda')
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS)
    cfg = config(num_sms, chunks)
    layout = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                  num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=weights)
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, **layout, config=cfg)
    ops = {'dispatch (cached)': lambda: buffer.dispatch(x, handle=handle, config=cfg),
           'dispatch (non-cached)': lambda: buffer.dispatch(x, **layout, config=cfg),
           'combine': lambda: buffer.combine(recv_x, handle, config=cfg)}
    paths, restore = host_paths(buffer, OURS, '_internode_fast', group)
    rows = {}
    try:
        for name, fn in ops.items():
            best = {}
            for _ in range(HOST_ROUNDS):
                for path, use in paths.items():
                    use()
                    launch_us, wall_us = host_loop(fn, HOST_CALLS)
                    if path not in best or launch_us < best[path]['launch_us']:
                        best[path] = {'launch_us': launch_us, 'wall_us': wall_us}
            rows[name] = best
            say(f'host, T={HOST_TOKENS}, SMs {num_sms}: internode {name}: '
                + ', '.join(f'{path} {b["launch_us"]:.1f} us/call' for path, b in best.items()) + ' (rank 0)')
    finally:
        restore()
    return rows


def worker(rank, world, port, args):
    say = init_worker(rank, world, port)
    torch.set_default_dtype(torch.bfloat16)
    group = dist.new_group(list(range(world)))
    intra, inter = make_buffers(group, world, max(args.sms), args.chunks)
    results = []
    host = None
    try:
        # Before any profiler session (CUPTI can leave launch overhead behind).
        if not args.skip_host:
            host = measure_host(inter, group, max(args.sms), args.chunks, say)
        for num_sms in args.sms:
            row = {'num_sms': num_sms, 'num_tokens': args.tokens, 'chunks': list(args.chunks)}
            for name, buffer in (('intranode', intra), ('internode', inter)):
                d_us, c_us, rows, legs, stages = measure(buffer, args.tokens, num_sms, args.chunks)
                stats = torch.tensor([d_us, c_us, rows, *legs], dtype=torch.float64, device='cuda')
                dist.all_reduce(stats, group=group)
                d_us, c_us, rows, *legs = (stats / world).tolist()
                gb = rows * HIDDEN * 2 / 1e9
                row[name] = {'dispatch_us': d_us, 'combine_us': c_us, 'dispatch_gbps': gb / (d_us / 1e6),
                             'combine_gbps': gb / (c_us / 1e6), 'stages_us_rank0': stages}
                if name == 'internode':  # DeepEP's two bandwidths: bytes each leg carried / time
                    for key, b, us in (('dispatch_scaleout', legs[0], d_us), ('dispatch_nvl', legs[1], d_us),
                                       ('combine_scaleout', legs[2], c_us), ('combine_nvl', legs[3], c_us)):
                        row[name][f'{key}_gbps'] = b / 1e9 / (us / 1e6)
            row['internode_vs_intranode'] = {op: row['intranode'][f'{op}_us'] / row['internode'][f'{op}_us']
                                             for op in ('dispatch', 'combine')}
            say(f"{world} ranks as 2x{world // 2}, SMs {num_sms}: dispatch {row['internode']['dispatch_us']:.0f} us internode vs "
                f"{row['intranode']['dispatch_us']:.0f} us intranode ({row['internode_vs_intranode']['dispatch']:.2f}x), "
                f"combine {row['internode']['combine_us']:.0f} vs {row['intranode']['combine_us']:.0f} us "
                f"({row['internode_vs_intranode']['combine']:.2f}x); check >= 0.80; scale-out / NVLink GB/s: dispatch "
                f"{row['internode']['dispatch_scaleout_gbps']:.0f} / {row['internode']['dispatch_nvl_gbps']:.0f}, combine "
                f"{row['internode']['combine_scaleout_gbps']:.0f} / {row['internode']['combine_nvl_gbps']:.0f}; "
                f"rank 0 kernels, us: dispatch {fmt(row['internode']['stages_us_rank0']['dispatch'])}, "
                f"combine {fmt(row['internode']['stages_us_rank0']['combine'])}")
            results.append(row)
    finally:
        intra.destroy()
        inter.destroy()
    if rank == 0 and args.json:
        runs = []
        if os.path.exists(args.json):  # one file for every world size of this run
            with open(args.json) as f:
                runs = json.load(f)['runs']
        runs.append({'world': world, 'nodes': 2, 'node_size': world // 2, 'results': results, 'host': host})
        with open(args.json, 'w') as f:
            json.dump({'shape': {'hidden': HIDDEN, 'experts': NUM_EXPERTS, 'topk': NUM_TOPK}, 'runs': runs}, f, indent=1)


if __name__ == '__main__':
    parser = argparse.ArgumentParser()
    parser.add_argument('--json')
    parser.add_argument('--sms', type=int, nargs='+', default=[8, 12, 16, 20, 24])
    parser.add_argument('--tokens', type=int, default=4096)
    parser.add_argument('--worlds', type=int, nargs='+', help='ranks, as 2 nodes of half (default: 2, 4, 8 as GPUs allow)')
    parser.add_argument('--chunks', type=int, nargs=4, default=DEFAULT_CHUNKS,
                        metavar=('NVL_SEND', 'NVL_RECV', 'RDMA_SEND', 'RDMA_RECV'),
                        help="Config's chunk fields after num_sms (default: %(default)s)")
    parser.add_argument('--skip-host', action='store_true', help='no host-time measurement')
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    worlds = args.worlds or [w for w in (2, 4, 8) if w <= gpus]
    if not worlds or any(w < 2 or w % 2 or w > gpus for w in worlds):
        sys.exit(f'bench_internode: --worlds {worlds}: each even, at least 2 and at most the {gpus} GPUs visible')
    if args.json and os.path.exists(args.json):
        os.remove(args.json)
    for world in worlds:
        spawn_workers(worker, world, args)
