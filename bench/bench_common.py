"""Shared by the benchmarks: DeepEP's timing method and one process per GPU."""
import json
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def bench(fn, num_warmups=50, num_tests=50, flush_every_call=False):
    """DeepEP's tests/utils.bench: one CUDA event pair per call, a 256 MB write to flush L2
    after warm-up (and, if asked, before every call), first sample dropped.
    Returns (avg, min, max) in us."""
    torch.cuda.synchronize()
    cache = torch.empty(int(256e6 // 4), dtype=torch.int, device='cuda')
    for _ in range(num_warmups):
        fn()
    cache.zero_()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(num_tests)]
    for start, end in events:
        if flush_every_call:
            cache.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = [start.elapsed_time(end) * 1e3 for start, end in events][1:]
    return sum(times) / len(times), min(times), max(times)


def spawn_workers(worker, world, args):
    """Runs worker(rank, world, port, args) in one process per GPU, with a free rendezvous port."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(world, port, args), nprocs=world)


def init_worker(rank, world, port):
    """A spawned worker's setup: its GPU and the NCCL process group. Returns say(msg), which
    prints msg on rank 0 with the seconds since setup."""
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group('nccl', rank=rank, world_size=world, device_id=torch.device('cuda', rank))
    started = time.time()

    def say(msg):
        if rank == 0:
            print(f'[{time.time() - started:6.1f}s] {msg}', flush=True)

    return say


class AllToAllDispatcher:
    """Megatron's 'alltoall' token dispatcher on torch/NCCL, as shared/bench/torch_alltoall_baseline.py
    (index_select permute, counts exchange with a host sync, all_to_all_single with splits; combine
    reverses it and sums the copies with index_add_ in fp32), BF16; -1 top-k slots are skipped."""

    def __init__(self, inp, world, num_experts):
        self.x, self.topk_idx, self.world = inp.x, inp.topk_idx, world
        self.experts_per_rank = num_experts // world
        self.recv, self.order, self.send_splits, self.recv_splits = self.dispatch()
        self.recv_bytes = self.recv.numel() * 2

    def dispatch(self):
        x, num_tokens, dev = self.x, self.x.size(0), self.x.device
        dst_rank = torch.where(self.topk_idx >= 0, self.topk_idx // self.experts_per_rank, self.world)
        mask = torch.zeros(num_tokens, self.world + 1, dtype=torch.bool, device=dev)
        mask.scatter_(1, dst_rank, True)  # token -> rank, de-duplicated; column `world` collects the -1 slots
        mask = mask[:, :self.world]
        send_counts = mask.sum(0)
        order = mask.t().nonzero()[:, 1]  # tokens grouped by destination rank
        send = x.index_select(0, order)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()  # host sync, as Megatron
        recv = torch.empty(sum(recv_splits), x.size(1), dtype=x.dtype, device=dev)
        dist.all_to_all_single(recv, send, recv_splits, send_splits)
        return recv, order, send_splits, recv_splits

    def combine(self):
        back = torch.empty(sum(self.send_splits), self.recv.size(1), dtype=self.recv.dtype, device=self.recv.device)
        dist.all_to_all_single(back, self.recv, self.send_splits, self.recv_splits)
        out = torch.zeros(self.x.size(0), self.x.size(1), dtype=torch.float32, device=self.x.device)
        out.index_add_(0, self.order, back.float())
        return out.to(torch.bfloat16)


# ------------------------------------------------------------------------ package
OURS = 'deepep-nccl'
DEEPEP_V1 = 'deepep_v1'


def detect_package():
    """Which deep_ep is importable: ours (deep_ep_cpp over libdeepep_nccl.so, which has
    library_version) or DeepEP V1's own (its pybind deep_ep_cpp has none)."""
    import deep_ep_cpp
    return OURS if hasattr(deep_ep_cpp, 'library_version') else DEEPEP_V1


def add_package_arg(parser):
    parser.add_argument('--package', choices=('auto', OURS, DEEPEP_V1), default='auto',
                        help='the deep_ep package to measure: the importable one (auto), or fail unless it is '
                             f'this one. {DEEPEP_V1}: DeepEP V1 built by shared/bench/deepep_v1.sh, e.g. '
                             'PYTHONPATH=/tmp/deepep_v1; only its public API is used')


def resolve_package(args):
    """args.package set to the importable package; exits if --package named another (a PYTHONPATH slip
    would otherwise label one package's numbers with the other's name)."""
    found = detect_package()
    if args.package not in ('auto', found):
        sys.exit(f'--package {args.package}: the importable deep_ep is {found} (check PYTHONPATH)')
    args.package = found
    return found


def settle(fn, num_warmups):
    """num_warmups calls of fn, then this rank's GPU idle and every rank in step: where a host
    timing starts."""
    for _ in range(num_warmups):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()


def host_loop(fn, num_calls, num_warmups=20):
    """Host time of the call itself: perf_counter around num_calls back-to-back calls, one
    synchronize at the end. Returns (us per call until the loop returns, us per call including
    the final synchronize)."""
    settle(fn, num_warmups)
    t0 = time.perf_counter()
    for _ in range(num_calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / num_calls * 1e6, (t2 - t0) / num_calls * 1e6


def host_paths(buffer, package, attr, group=None):
    """{host path name: a function that makes buffer use it}, and a function restoring the original.
    Ours: 'compiled' (deep_ep_cpp/_fast.cpp: the direct entries sync() bound on buffer.runtime, and
    buffer.runtime.<attr> behind the class methods) where every rank loaded it (each op is
    collective, so all ranks must take the same path), and 'ctypes' (the direct entries set aside,
    attr None). Another package has one path, named after it, and nothing is switched."""
    if package != OURS:
        return {package: lambda: None}, lambda: None
    runtime = buffer.runtime
    compiled = getattr(runtime, attr)
    entries = runtime._unbind_direct_entries()
    vars(runtime).update(entries)

    def use(ops, bound):
        def select():
            setattr(runtime, attr, ops)
            runtime._unbind_direct_entries()
            vars(runtime).update(bound)
        return select

    everywhere = torch.tensor([int(compiled is not None)], device='cuda')
    dist.all_reduce(everywhere, op=dist.ReduceOp.MIN, group=group)
    paths = {'compiled': use(compiled, entries)} if everywhere.item() else {}
    paths['ctypes'] = use(None, {})
    return paths, use(compiled, entries)


class DeepEPDefaults:
    """The defaults DeepEP's tests run under (torch.set_default_dtype(bfloat16) and
    set_default_device('cuda')) while inside, if on; plain defaults after."""

    def __init__(self, on):
        self.on = on

    def __enter__(self):
        if self.on:
            torch.set_default_dtype(torch.bfloat16)
            torch.set_default_device('cuda')

    def __exit__(self, *exc):
        torch.set_default_device(None)
        torch.set_default_dtype(torch.float32)


# ------------------------------------------------------------------------ profiler


def trace_events(prof):
    """The chrome-trace events of a finished torch.profiler session (exported through a temp file)."""
    fd, path = tempfile.mkstemp(prefix='bench_trace_', suffix='.json')
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.remove(path)
    return trace['traceEvents'] if isinstance(trace, dict) else trace
