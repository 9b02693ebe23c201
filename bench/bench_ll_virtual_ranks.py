"""Hook-mode LL kernels of R virtual ranks on ONE GPU (tests/gpu/ll_virtual.py).

Each receiving rank's kernel reads only its own window, as on real hardware, so its GPU time is
the per-rank receive time of an R-rank run. The senders' stores go to local memory instead of
over NVLink, so send times are the kernels' compute and latency without the NVLink transfer:
use them for A/B work, not as the send time of an R-rank run. Per iteration: every rank's
dispatch send, then every rank's receive, then the same for combine (random expert outputs),
with a BF16 matmul gap (as DeepEP's large_gemm_with_hook: caches are cold again) before each
kernel of the phase being timed: receives in one profiled run, sends in another. GPU time per
kernel from torch.profiler, median over iterations and ranks. Use it for A/B work on the LL
kernels when no multi-GPU machine is available; the product's numbers are bench_low_latency.py's.

Shapes: each T with M = max(128, T) (or --max-tokens), then with --large-m each T below it again
with that M: decode frameworks size M for their largest batch and call with fewer tokens, so
the receive must not slow down with empty slots.

Usage: python bench/bench_ll_virtual_ranks.py [--ranks 4] [--tokens 1 16 128 256] [--large-m 512] [--json F]"""
import argparse
import json
import os
import re
import statistics
import sys

import torch
import torch.profiler

from bench_common import trace_events  # noqa: E402
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'tests', 'gpu'))
from ll_virtual import VirtualWorld  # noqa: E402
from test_ll_virtual_ranks import MODES, make_inputs  # noqa: E402


def kernel_times(fn, iters):
    """fn() once untraced, then `iters` times under the profiler: {kernel name: [us, ...]}."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    times = {}
    for e in trace_events(prof):
        if e.get('ph') == 'X' and e.get('cat') == 'kernel':
            times.setdefault(e['name'], []).append(float(e['dur']))
    return times


def phase_us(times, op, phase):
    """Median GPU time of the send-only (phase 1) or receive-only (2) instantiation of deepep::ll::<op>."""
    pattern = re.compile(rf'll::{op}<\d+, (true|false), {phase}\b')
    durs = [d for name, ds in times.items() if pattern.search(name) for d in ds]
    return statistics.median(durs) if durs else float('nan'), len(durs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--ranks', type=int, default=4)
    parser.add_argument('--experts', type=int, default=288)
    parser.add_argument('--hidden', type=int, default=7168)
    parser.add_argument('--topk', type=int, default=8)
    parser.add_argument('--max-tokens', type=int, default=None, help='M (default: max(128, T))')
    parser.add_argument('--tokens', type=int, nargs='+', default=[1, 16, 128, 256])
    parser.add_argument('--large-m', type=int, default=None, help='also each T below this M with this M')
    parser.add_argument('--mode', choices=tuple(MODES), default='fp8')
    parser.add_argument('--iters', type=int, default=20)
    parser.add_argument('--json', default=None)
    args = parser.parse_args()
    torch.cuda.set_device(0)
    props = torch.cuda.get_device_properties(0)
    print(f'{props.name}, {props.multi_processor_count} SMs; {args.ranks} virtual ranks, hidden {args.hidden}, '
          f'top-{args.topk} of {args.experts}, {args.mode} dispatch, BF16 combine; hook-mode kernels, '
          f'median over {args.iters} iterations x {args.ranks} ranks (us; sends store locally, see above)', flush=True)
    gap_a = torch.randn(4096, 8192, dtype=torch.bfloat16, device='cuda')
    gap_b = torch.randn(8192, 4096, dtype=torch.bfloat16, device='cuda')
    gap_c = torch.empty(4096, 4096, dtype=torch.bfloat16, device='cuda')
    use_fp8, round_scale, ue8m0 = MODES[args.mode]
    mode = dict(use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=ue8m0)
    rows = []
    print('| T | M | dispatch send (local) | dispatch recv | combine send (local) | combine recv |\n'
          '| --- | --- | --- | --- | --- | --- |', flush=True)
    shapes = [(t, args.max_tokens or max(128, t)) for t in args.tokens]
    if args.large_m:
        shapes += [(t, args.large_m) for t in args.tokens if t < args.large_m]
    for tokens, m in shapes:
        world = VirtualWorld(args.ranks, args.experts, m, args.hidden)
        all_x, all_topk = make_inputs(world, tokens, tokens, args.topk)
        outs = [world.dispatch_outputs(use_fp8, ue8m0) for _ in range(args.ranks)]
        el, nrows = world.local_experts, args.ranks * m
        all_y = [torch.randn(el, nrows, args.hidden, device='cuda').to(torch.bfloat16) for _ in range(args.ranks)]
        all_w = [torch.rand(t.shape, device='cuda') for t in all_topk]
        combined = [torch.empty(t.size(0), args.hidden, dtype=torch.bfloat16, device='cuda') for t in all_topk]

        def iteration(gapped_phase):
            """One dispatch + combine of every rank; a matmul gap before each kernel of the phase
            being timed (1: sends, 2: receives), the other phase's kernels back to back."""
            def gap(phase):
                if phase == gapped_phase:
                    torch.matmul(gap_a, gap_b, out=gap_c)
            world.parity ^= 1
            for phase, call in ((1, world.dispatch_send), (2, world.dispatch_recv)):
                for r in range(args.ranks):
                    gap(phase)
                    call(r, all_x[r], all_topk[r], outs[r], **mode)
            world.parity ^= 1
            for phase in (1, 2):
                for r in range(args.ranks):
                    gap(phase)
                    world.combine_rank(r, phase, all_y[r], all_topk[r], all_w[r], outs[r], combined[r])

        row = {'tokens': tokens, 'max_tokens': m}
        for phase, name in ((2, 'recv'), (1, 'send_local')):
            times = kernel_times(lambda: iteration(phase), args.iters)
            for op in ('dispatch', 'combine'):
                us, n = phase_us(times, op, phase)
                assert n == args.iters * args.ranks, f'{op} phase {phase}: {n} kernels found'
                row[f'{op}_{name}_us'] = us
        world.check_no_stall()
        rows.append(row)
        print(f"| {tokens} | {m} | {row['dispatch_send_local_us']:.1f} | {row['dispatch_recv_us']:.1f} | "
              f"{row['combine_send_local_us']:.1f} | {row['combine_recv_us']:.1f} |", flush=True)
        world = outs = all_y = None  # free before the next shape allocates
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, 'w') as f:
            json.dump({'device': props.name, 'sms': props.multi_processor_count, 'args': vars(args), 'rows': rows},
                      f, indent=1)


if __name__ == '__main__':
    main()
