"""Shared by the benchmarks: DeepEP's timing method and one process per GPU."""
import socket

import torch
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
