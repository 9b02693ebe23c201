"""Where the host time of an overlapped normal op goes: the calls Megatron-LM's DeepEP dispatcher
makes (previous_event, async_finish, allocate_on_comm_stream), taken apart one argument at a time.

bench_normal.py's "(async)" host rows time the whole call, `Buffer.capture()` included. This
splits them, for whichever deep_ep is importable (ours: the compiled host path as sync() left it;
DeepEP V1's own with PYTHONPATH at its build): per op (get_dispatch_layout, the cached BF16
dispatch, combine; T=128, 24 SMs, bench_normal's inputs) the host us per call of the plain call,
with each stream argument alone and together (the previous event captured once, outside the timed
loop), then with `Buffer.capture()` inside the call as bench_normal times it; and the event pieces
alone: `Buffer.capture()`, `deep_ep_cpp.EventHandle()`, `torch.cuda.Event()` + `record()`. Each row
is the best of ROUNDS rounds (rank average); then one cProfile of the full overlapped combine
(rank 0, tottime) says which Python frames the difference sits in.

Run: python bench/async_host_split.py [--world 2] [--json FILE]   (about 20 s)"""
import argparse
import cProfile
import io
import json
import os
import pstats
import sys

import torch
import torch.distributed as dist

import deep_ep
import deep_ep_cpp
from bench_common import OURS, add_package_arg, host_loop, init_worker, resolve_package, spawn_workers
from bench_normal import HIDDEN, HOST_SMS, NUM_EXPERTS, Inputs, Point, cached_configs, overlap

NUM_TOKENS = 128  # kernels are short: the loop is host-bound
CALLS = 400
ROUNDS = 5
PROFILED_CALLS = 2000

# The stream arguments of each variant (previous_event: the one captured outside the loop); the
# last is bench_normal's "(async)" call, which captures its previous event inside (overlap()).
OVERLAPPED = 'all three, capture() in the call'
VARIANTS = {
    'plain': {},
    'previous_event': {'previous_event': True},
    'async_finish': {'async_finish': True},
    'previous_event + async_finish': {'previous_event': True, 'async_finish': True},
    'all three': {'previous_event': True, 'async_finish': True, 'allocate_on_comm_stream': True},
    OVERLAPPED: None,
}


def stream_kwargs(variant, captured):
    """The call's keyword arguments of `variant`, with `captured` as the previous event made outside."""
    if variant == OVERLAPPED:
        return overlap()
    return {name: captured if name == 'previous_event' else value for name, value in VARIANTS[variant].items()}


def op_calls(buffer, inp, pt):
    """{op: fn(**stream kwargs)} at HOST_SMS, as bench_normal's host rows call them."""
    dcfg, ccfg = cached_configs(HOST_SMS)
    return {
        'get_dispatch_layout': lambda **kw: buffer.get_dispatch_layout(inp.topk_idx, NUM_EXPERTS, **kw),
        'dispatch (cached)': lambda **kw: buffer.dispatch(inp.x, handle=pt.handle, config=dcfg, **kw),
        'combine': lambda **kw: buffer.combine(pt.recv_x, pt.handle, config=ccfg, **kw),
    }


def event_pieces():
    """{piece: fn()} of the events an overlapped call makes."""
    def torch_event():
        torch.cuda.Event().record()
    return {'Buffer.capture()': deep_ep.Buffer.capture, 'deep_ep_cpp.EventHandle()': deep_ep_cpp.EventHandle,
            'torch.cuda.Event() + record()': torch_event}


def best_us(fn):
    return min(host_loop(fn, CALLS)[0] for _ in range(ROUNDS))


class Fallbacks:
    """Ours: counts the calls that reached the Buffer class's Python method of an op (a direct
    entry handing the call over), so a row that timed the class method says so. V1: none."""

    NAMES = ('get_dispatch_layout', 'intranode_dispatch', 'intranode_combine')

    def __init__(self, buffer, package):
        self.count = 0
        self.cls = type(buffer.runtime)
        self.methods = {name: getattr(self.cls, name) for name in self.NAMES} if package == OURS else {}
        for name, method in self.methods.items():
            setattr(self.cls, name, self.counted(method))

    def counted(self, method):
        def call(*args, **kwargs):
            self.count += 1
            return method(*args, **kwargs)
        return call

    def restore(self):
        for name, method in self.methods.items():
            setattr(self.cls, name, method)


def profile(fn):
    """cProfile of PROFILED_CALLS calls of fn: the top frames by tottime."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(PROFILED_CALLS):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats('tottime').print_stats(14)
    return out.getvalue()


def worker(rank, world, port, args):
    say = init_worker(rank, world, port)
    hint = cached_configs(HOST_SMS)[0].get_nvl_buffer_size_hint(HIDDEN * 2, world)
    buffer = deep_ep.Buffer(dist.group.WORLD, max(hint, int(1e9)), 0, low_latency_mode=False, num_qps_per_rank=1,
                            explicitly_destroy=True)
    inp = Inputs(buffer, NUM_TOKENS, rank)
    pt = Point(buffer, inp, HOST_SMS)
    captured = deep_ep.Buffer.capture()
    rows = []
    fallbacks = Fallbacks(buffer, args.package)
    try:
        for op, call in op_calls(buffer, inp, pt).items():
            for variant in VARIANTS:
                before = fallbacks.count
                us = best_us(lambda: call(**stream_kwargs(variant, captured)))
                rows.append({'op': op, 'variant': variant, 'us': us, 'fell_back': fallbacks.count - before})
                say(f'{op:20s} {variant:34s} {us:6.1f} us/call, {rows[-1]["fell_back"]} fell back (rank 0)')
    finally:
        fallbacks.restore()
    for piece, fn in event_pieces().items():
        us = best_us(fn)
        rows.append({'op': 'event', 'variant': piece, 'us': us, 'fell_back': 0})
        say(f'{"event":20s} {piece:34s} {us:6.1f} us/call (rank 0)')
    combine = op_calls(buffer, inp, pt)['combine']
    dist.barrier()
    profiled = profile(lambda: combine(**stream_kwargs(OVERLAPPED, captured)))
    dist.barrier()
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        report(gathered, args, profiled)
    buffer.destroy()
    dist.destroy_process_group()


def report(per_rank, args, profiled):
    rows = [dict(r, us=sum(rank_rows[i]['us'] for rank_rows in per_rank) / len(per_rank))
            for i, r in enumerate(per_rank[0])]
    plain = {r['op']: r['us'] for r in rows if r['variant'] == 'plain'}
    print(f'\n{args.package}: host us per call, T={NUM_TOKENS}, {HOST_SMS} SMs, best of {ROUNDS} rounds of '
          f'{CALLS} calls, rank average; "+" = over the plain call; "fell back" = calls of ours that took '
          f'the class method, rank 0')
    print('| op | variant | us | + | fell back |\n| --- | --- | --- | --- | --- |')
    for r in rows:
        extra = f'{r["us"] - plain[r["op"]]:+.1f}' if r['op'] in plain else ''
        print(f'| {r["op"]} | {r["variant"]} | {r["us"]:.1f} | {extra} | {r["fell_back"]} |')
    print(f'\ncProfile of {PROFILED_CALLS} overlapped combines (all three, capture() in the call), rank 0:')
    print(profiled)
    with open(args.json, 'w') as f:
        json.dump({'package': args.package, 'world': len(per_rank), 'num_tokens': NUM_TOKENS, 'num_sms': HOST_SMS,
                   'calls': CALLS, 'rounds': ROUNDS, 'rows': rows, 'cprofile_combine': profiled}, f, indent=2)
    print(f'results written to {args.json}')


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--world', type=int, default=min(2, torch.cuda.device_count()))
    parser.add_argument('--json', default=os.path.join(os.environ.get('OUT') or '.', 'async_host_split.json'))
    add_package_arg(parser)
    args = parser.parse_args()
    resolve_package(args)
    if args.world < 2 or args.world > torch.cuda.device_count():
        sys.exit(f'--world {args.world}: needs 2..{torch.cuda.device_count()} GPUs')
    spawn_workers(worker, args.world, args)


if __name__ == '__main__':
    main()
