"""Eager (no CUDA graph) timeline of one MoE layer's communication at T tokens/rank, for whichever
deep_ep is importable: ours, or DeepEP V1's own package (--package; only its public API is used).

Parts, each on its own buffer, one process per GPU (NCCL process group):
  low_latency: one low_latency_dispatch (FP8, received-count stats) + one low_latency_combine,
               shape as bench_low_latency.py (hidden 7168, top-8 of 288 experts, 10 masked slots, M = T);
  normal:      one get_dispatch_layout + non-cached dispatch (BF16, top-k) + combine, shape as
               bench_normal.py (hidden 7168, top-8 of 256 experts), 24 SMs.
  cached_loop: --loop-calls cached BF16 dispatches (normal's shape), each between two CUDA event
               records as DeepEP's tests/utils.bench times them (its e2e figure is that span).
  ll_loop:     --loop-calls LL dispatch + combine pairs (low_latency's shape), as DeepEP's
               test_low_latency.py benches them plain (events around each pair).
After --warmups plain calls, torch.profiler (CPU + CUDA activities) records one warm-up step (so that
CUPTI's start-up stays out) and then the measured step; each call runs in a record_function range.
Per part and rank it writes the chrome trace (--trace-dir), and rank 0 prints:
  calls:    each call's host us (its range);
  host:     per CPU op / CUDA runtime or driver call made inside the calls (cudaLaunchKernel,
            cudaEventRecord, cudaStreamWaitEvent, memcpy, synchronize, ...): count and total host us;
  gpu:      per GPU activity (kernels, memcpy, memset) launched inside the calls: count and GPU us;
  timeline: the GPU activities in start order (offset from the first call's start, stream, us, and
            when the host launched it), with the GPU's idle gaps (all streams of the device) between;
  wall:     first call's start to the last GPU activity's end.
The ranks line up with a barrier before the step (outside the calls); a peer's lag shows up as a
receive kernel that runs long, not as a gap.

Run: python bench/eager_profile.py [--tokens 128] [--parts low_latency normal] [--trace-dir DIR] [--json PATH]
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.profiler
from torch.profiler import ProfilerActivity, record_function

os.environ.setdefault('DEEPEP_GPU_TIMEOUT_SECS', '60')

import deep_ep  # noqa: E402
from bench_common import add_package_arg, init_worker, resolve_package, spawn_workers  # noqa: E402
from bench_low_latency import (HIDDEN, NUM_MASKED, NUM_TOPK, Inputs as LLInputs, LowLatency,  # noqa: E402
                               NUM_EXPERTS as LL_EXPERTS, make_buffer, max_tokens_for)
from bench_normal import HOST_SMS, NUM_EXPERTS, Inputs as NormalInputs, cached_configs  # noqa: E402

RANGE = 'eager:'
LAUNCH_CATS = ('cuda_runtime', 'cuda_driver')
HOST_CATS = ('cpu_op',) + LAUNCH_CATS
GPU_CATS = ('kernel', 'gpu_memcpy', 'gpu_memset')
PARTS = ('low_latency', 'normal', 'cached_loop', 'll_loop')
TOP_OPS = 20  # CPU op rows printed (the JSON has all)


def low_latency_steps(group, args, rank, world):
    """(buffer, [(call name, fn)]): one LL dispatch + combine; the combine sends random expert output."""
    M = max_tokens_for(args.tokens, world, 't')
    ll_args = argparse.Namespace(hidden=HIDDEN, num_experts=LL_EXPERTS, num_topk=NUM_TOPK,
                                 masked_slots=NUM_MASKED, seed=0)
    buffer, _ = make_buffer(group, M, ll_args, world)
    ll = LowLatency(buffer, LLInputs(ll_args, args.tokens, rank, world), M, ll_args)
    ll.sim_x = torch.randn(LL_EXPERTS // world, world * M, HIDDEN, dtype=torch.bfloat16, device='cuda')
    return buffer, [('low_latency_dispatch', ll.dispatch_step), ('low_latency_combine', ll.combine_step)]


def normal_steps(group, args, rank, world):
    """(buffer, [(call name, fn)]): get_dispatch_layout, non-cached dispatch with top-k, combine."""
    buffer, dcfg, ccfg = normal_buffer(group, world)
    inp = NormalInputs(buffer, args.tokens, rank)
    state = {}

    def layout():
        ntpr, _, ntpe, itir, _ = buffer.get_dispatch_layout(inp.topk_idx, NUM_EXPERTS)
        state.update(num_tokens_per_rank=ntpr, num_tokens_per_expert=ntpe, is_token_in_rank=itir)

    def dispatch():
        recv_x, _, _, _, handle, _ = buffer.dispatch(inp.x, topk_idx=inp.topk_idx, topk_weights=inp.topk_weights,
                                                     config=dcfg, **state)
        state.clear()
        state['combine'] = (recv_x, handle)

    def combine():
        recv_x, handle = state.pop('combine')
        buffer.combine(recv_x, handle, config=ccfg)

    return buffer, [('get_dispatch_layout', layout), ('dispatch', dispatch), ('combine', combine)]


def normal_buffer(group, world):
    """(buffer, dispatch config, combine config) of the normal parts: 24 SMs, NVL bytes by DeepEP's hint."""
    dcfg, ccfg = cached_configs(HOST_SMS)
    num_nvl_bytes = max([int(1e9)] + [c.get_nvl_buffer_size_hint(HIDDEN * 2, world) for c in (dcfg, ccfg)])
    buffer = deep_ep.Buffer(group, num_nvl_bytes, 0, low_latency_mode=False, num_qps_per_rank=1,
                            explicitly_destroy=True)
    return buffer, dcfg, ccfg


def timed(fn):
    """fn between two event records, as DeepEP's bench times one call."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def call():
        start.record()
        fn()
        end.record()
    return call


def cached_loop_steps(group, args, rank, world):
    """(buffer, [(call name, fn)] * loop_calls): cached BF16 dispatches back to back."""
    buffer, dcfg, _ = normal_buffer(group, world)
    inp = NormalInputs(buffer, args.tokens, rank)
    handle = buffer.dispatch(inp.x, config=dcfg, **inp.layout)[4]
    call = timed(lambda: buffer.dispatch(inp.x, handle=handle, config=dcfg))
    return buffer, [(f'cached_dispatch#{i}', call) for i in range(args.loop_calls)]


def ll_loop_steps(group, args, rank, world):
    """(buffer, [(call name, fn)] * loop_calls): LL dispatch + combine pairs back to back."""
    buffer, steps = low_latency_steps(group, args, rank, world)
    (_, dispatch), (_, combine) = steps

    def pair():
        dispatch()
        combine()
    call = timed(pair)
    return buffer, [(f'll_dispatch_combine#{i}', call) for i in range(args.loop_calls)]


def profile(steps, warmups, trace_path):
    """Runs the steps warmups times, then under torch.profiler one discarded step and one recorded
    step; writes the recorded step's chrome trace to trace_path and returns its events."""
    def one_step():
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        for name, fn in steps:
            with record_function(RANGE + name):
                fn()
        torch.cuda.synchronize()

    for _ in range(warmups):
        for _, fn in steps:
            fn()
    done = []

    def save(prof):
        prof.export_chrome_trace(trace_path)
        done.append(trace_path)

    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                                schedule=torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=1),
                                on_trace_ready=save) as prof:
        for _ in range(2):
            one_step()
            prof.step()
    assert done, 'the profiler saved no trace'
    with open(trace_path) as f:
        trace = json.load(f)
    return trace['traceEvents'] if isinstance(trace, dict) else trace


def analyze(events):
    """The summary of one recorded step (see the module doc); times in us, offsets from the first call's start."""
    xs = [e for e in events if e.get('ph') == 'X' and 'dur' in e]
    for e in xs:
        e['ts'], e['dur'] = float(e['ts']), float(e['dur'])
    calls = sorted((e for e in xs if e.get('cat') == 'user_annotation' and e['name'].startswith(RANGE)),
                   key=lambda e: e['ts'])
    assert calls, 'no call ranges in the trace'
    t0 = calls[0]['ts']
    thread = (calls[0]['pid'], calls[0]['tid'])

    def in_call(e):
        return (e['pid'], e['tid']) == thread and any(
            c['ts'] <= e['ts'] and e['ts'] + e['dur'] <= c['ts'] + c['dur'] + 1e-3 for c in calls)

    host = [e for e in xs if e.get('cat') in HOST_CATS and in_call(e)]
    launches = {e['args']['correlation']: e for e in host
                if e['cat'] in LAUNCH_CATS and 'correlation' in e.get('args', {})}
    gpu = sorted((e for e in xs if e.get('cat') in GPU_CATS and e.get('args', {}).get('correlation') in launches),
                 key=lambda e: e['ts'])

    def totals(evs, key):
        out = {}
        for e in evs:
            row = out.setdefault(key(e), {'count': 0, 'us': 0.0})
            row['count'] += 1
            row['us'] += e['dur']
        return [dict(zip(('cat', 'name'), k), **v) for k, v in sorted(out.items(), key=lambda kv: -kv[1]['us'])]

    timeline, gaps, busy, end = [], [], 0.0, t0
    prev = 'first call start'
    for e in gpu:
        if e['ts'] > end:
            gaps.append({'at': end - t0, 'us': e['ts'] - end, 'after': prev, 'before': e['name'][:80]})
        busy += max(0.0, e['ts'] + e['dur'] - max(e['ts'], end))
        end = max(end, e['ts'] + e['dur'])
        prev = e['name'][:80]
        launch = launches[e['args']['correlation']]
        timeline.append({'at': e['ts'] - t0, 'us': e['dur'], 'stream': e['args'].get('stream'), 'cat': e['cat'],
                         'name': e['name'], 'launched_at': launch['ts'] - t0, 'launched_by': launch['name']})
    return {'calls': [{'name': c['name'][len(RANGE):], 'at': c['ts'] - t0, 'host_us': c['dur']} for c in calls],
            'host_span_us': max(c['ts'] + c['dur'] for c in calls) - t0,
            'wall_us': end - t0, 'gpu_busy_us': busy, 'gpu_idle_us': end - t0 - busy,
            'host': totals(host, lambda e: (e['cat'], e['name'])),
            'gpu': totals(gpu, lambda e: (e['cat'], e['name'])),
            'timeline': timeline, 'gaps': gaps}


def short(name, width=70):
    name = name[5:] if name.startswith('void ') else name
    return name if len(name) <= width else name[:width - 3] + '...'


def print_summary(part, per_rank, args):
    s = per_rank[0]
    print(f'\n=== {args.package}: {part}, T={args.tokens}, rank 0 (one eager step after warm-up)')
    print('calls:  ' + ', '.join(f'{c["name"]} {c["host_us"]:.1f} us' for c in s['calls'])
          + f'; host span {s["host_span_us"]:.1f} us')
    runtime = [r for r in s['host'] if r['cat'] in LAUNCH_CATS]
    ops = [r for r in s['host'] if r['cat'] not in LAUNCH_CATS]
    for title, rows in (('CUDA runtime/driver calls inside the calls', runtime),
                        (f'CPU ops inside the calls (nested ones count in their parents too; top {TOP_OPS} of {len(ops)})',
                         ops[:TOP_OPS]),
                        ('GPU activities launched inside the calls', s['gpu'])):
        print(f'{title}:\n  {"name":56s} {"cat":12s} {"count":>5s} {"total us":>9s}')
        for r in rows:
            print(f'  {short(r["name"], 56):56s} {r["cat"]:12s} {r["count"]:5d} {r["us"]:9.1f}')
    print(f'timeline (us from the first call\'s start): {"at":>7s} {"us":>7s} {"stream":>6s} {"launched":>8s}')
    rows = [(g['at'], f'  {"idle":44s} {g["at"]:7.1f} {g["us"]:7.1f}') for g in s['gaps']]
    rows += [(t['at'], f'  {short(t["name"], 44):44s} {t["at"]:7.1f} {t["us"]:7.1f} {str(t["stream"]):>6s} '
                       f'{t["launched_at"]:8.1f}') for t in s['timeline']]
    for _, line in sorted(rows, key=lambda r: r[0]):
        print(line)
    for rank, r in enumerate(per_rank):
        print(f'rank {rank}: wall {r["wall_us"]:.1f} us (first call start -> last GPU activity end), host span '
              f'{r["host_span_us"]:.1f}, GPU busy {r["gpu_busy_us"]:.1f}, idle {r["gpu_idle_us"]:.1f} in '
              f'{len(r["gaps"])} gaps; ' + ', '.join(f'{c["name"]} {c["host_us"]:.1f}' for c in r['calls']))


def worker(rank, world, port, args):
    say = init_worker(rank, world, port)
    group = dist.group.WORLD
    results = {}
    for part in args.parts:
        make = {'low_latency': low_latency_steps, 'normal': normal_steps, 'cached_loop': cached_loop_steps,
                'll_loop': ll_loop_steps}[part]
        buffer, steps = make(group, args, rank, world)
        try:
            path = os.path.join(args.trace_dir, f'eager_{args.package}_{part}_T{args.tokens}_rank{rank}.json')
            summary = analyze(profile(steps, args.warmups, path))
        finally:
            torch.cuda.synchronize()
            buffer.destroy()
        gathered = [None] * world
        dist.all_gather_object(gathered, summary)
        results[part] = gathered
        if rank == 0:
            print_summary(part, gathered, args)
        say(f'{part}: traces in {args.trace_dir}')
    if rank == 0 and args.json:
        with open(args.json, 'w') as f:
            json.dump({'tool': 'bench/eager_profile.py', 'package': args.package, 'world_size': world,
                       'gpu': torch.cuda.get_device_name(), 'settings': vars(args), 'parts': results}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--num-processes', type=int, default=2)
    parser.add_argument('--tokens', type=int, default=128, help='tokens per rank (both parts)')
    parser.add_argument('--parts', nargs='+', choices=PARTS, default=list(PARTS))
    parser.add_argument('--warmups', type=int, default=20, help='plain steps before the profiler')
    parser.add_argument('--loop-calls', type=int, default=8, help='calls of the *_loop parts')
    parser.add_argument('--trace-dir', default=os.environ.get('OUT') or '.')
    parser.add_argument('--json', default=None)
    add_package_arg(parser)
    args = parser.parse_args()
    resolve_package(args)
    if args.num_processes < 2 or args.num_processes > torch.cuda.device_count():
        sys.exit(f'--num-processes {args.num_processes}: needs 2 or more of the {torch.cuda.device_count()} visible GPUs')
    os.makedirs(args.trace_dir, exist_ok=True)
    spawn_workers(worker, args.num_processes, args)


if __name__ == '__main__':
    main()
