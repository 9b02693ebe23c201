"""Where DeepEP's plain e2e goes, without a profiler: per call of a back-to-back loop (DeepEP's
bench), the host call's start/end (perf_counter) and the GPU times of the events around it
(relative to a reference event recorded at the loop's start), per rank: e2e, host call, how far
the GPU runs behind the host, the GPU gap between calls. Loops: cached BF16 dispatch and LL
dispatch + combine at T=128, 2 ranks. For ours it also counts calls that fell back from the
compiled host path to ctypes. PKG labels the lines.

Run: PKG=ours python bench/plain_loop_probe.py   (V1: PYTHONPATH=/tmp/deepep_v1 PKG=v1 ...)"""
import os, sys, time, statistics
import argparse
import torch, torch.distributed as dist
import deep_ep
from bench_common import init_worker, spawn_workers
from bench_normal import Inputs, NVL_RECV_TOKENS, DISPATCH_CHUNKS
import bench_low_latency as bll

N = 40

def probe(name, fn, say, rank):
    """One loop of N calls after 30 warm-up calls; rank 0 prints every rank's medians."""
    for _ in range(30): fn()
    torch.cuda.synchronize(); dist.barrier(); torch.cuda.synchronize()
    ref = torch.cuda.Event(enable_timing=True)
    st = [torch.cuda.Event(enable_timing=True) for _ in range(N)]
    en = [torch.cuda.Event(enable_timing=True) for _ in range(N)]
    hs, he = [0.0] * N, [0.0] * N
    t0 = time.perf_counter(); ref.record()
    for i in range(N):
        hs[i] = time.perf_counter()
        st[i].record(); fn(); en[i].record()
        he[i] = time.perf_counter()
    torch.cuda.synchronize()
    rows = []
    for i in range(N):
        gs, ge = ref.elapsed_time(st[i]) * 1e3, ref.elapsed_time(en[i]) * 1e3
        rows.append(((hs[i] - t0) * 1e6, (he[i] - t0) * 1e6, gs, ge))
    rows = rows[5:]
    med = lambda xs: statistics.median(xs)
    e2e = med([r[3] - r[2] for r in rows]); host = med([r[1] - r[0] for r in rows])
    period = (rows[-1][0] - rows[0][0]) / (len(rows) - 1)
    lag = med([r[2] - r[0] for r in rows]); tail = med([r[3] - r[1] for r in rows])
    gap = med([rows[i][2] - rows[i - 1][3] for i in range(1, len(rows))])
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, (e2e, host, period, lag, tail, gap, rows[:6]))
    if rank == 0:
        for r, (e2e, host, period, lag, tail, gap, first) in enumerate(out):
            print(f'{os.environ.get("PKG","?")} {name} rank{r}: e2e {e2e:.1f} | host call {host:.1f} period {period:.1f} | '
                  f'GPU start - host start {lag:.1f} | GPU end - host end {tail:.1f} | GPU gap between calls {gap:.1f}', flush=True)
            print('   first rows (host s,e / gpu s,e): ' + ' ; '.join(f'{a:.0f},{b:.0f}/{c:.0f},{d:.0f}' for a, b, c, d in first), flush=True)

def worker(rank, world, port, args):
    say = init_worker(rank, world, port)
    buf = deep_ep.Buffer(dist.group.WORLD, int(1e9), 0, low_latency_mode=False, num_qps_per_rank=1, explicitly_destroy=True)
    rt = getattr(buf, 'runtime', None)
    if rank == 0 and rt is not None and hasattr(rt, '_normal_fast'):
        import deep_ep_cpp._fast as f
        print('host path:', 'compiled' if rt._normal_fast is not None else 'ctypes', '|', getattr(f, 'describe', lambda: '')(), flush=True)
    fell = []
    if rt is not None and hasattr(rt, '_fast_call'):
        orig = rt._fast_call
        def counted(op, *a):
            r = orig(op, *a)
            if r is None:
                fell.append(getattr(op, '__name__', str(op)))
            return r
        rt._fast_call = counted
    dcfg = deep_ep.Config(24, DISPATCH_CHUNKS[0], NVL_RECV_TOKENS)
    inp = Inputs(buf, 128, rank)
    handle = buf.dispatch(inp.x, config=dcfg, **inp.layout)[4]
    probe('cached_dispatch_T128', lambda: buf.dispatch(inp.x, handle=handle, config=dcfg), say, rank)
    if rank == 0:
        print(f'compiled-path fallbacks to ctypes: {len(fell)} {sorted(set(fell))[:5]}', flush=True)
    torch.cuda.synchronize(); buf.destroy()
    M = bll.max_tokens_for(128, world, 't')
    ll_args = argparse.Namespace(hidden=bll.HIDDEN, num_experts=bll.NUM_EXPERTS, num_topk=bll.NUM_TOPK, masked_slots=bll.NUM_MASKED, seed=0)
    lbuf, _ = bll.make_buffer(dist.group.WORLD, M, ll_args, world)
    ll = bll.LowLatency(lbuf, bll.Inputs(ll_args, 128, rank, world), M, ll_args)
    ll.sim_x = torch.randn(bll.NUM_EXPERTS // world, world * M, bll.HIDDEN, dtype=torch.bfloat16, device='cuda')
    def pair():
        ll.dispatch_step(); ll.combine_step()
    probe('ll_dispatch_combine_T128', pair, say, rank)
    torch.cuda.synchronize(); lbuf.destroy(); dist.barrier(); dist.destroy_process_group()

if __name__ == '__main__':
    if torch.cuda.device_count() < 2:
        sys.exit(f'plain_loop_probe: needs 2 GPUs, {torch.cuda.device_count()} visible')
    spawn_workers(worker, 2, None)
