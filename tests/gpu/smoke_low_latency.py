"""Fast end-to-end smoke of low-latency (LL) mode on 2 GPUs (about 30 s): one BF16 and one FP8
dispatch + combine at DeepEP's shape (M = T = 128, hidden 7168, 288 experts, top-8), the same in
hook mode, each checked bit for bit against ll_reference.py (combine: at most 1 BF16 ulp), then a
short timing. The exhaustive checks are in test_low_latency.py."""
import os
import sys
import time

os.environ.setdefault('DEEPEP_GPU_TIMEOUT_SECS', '20')

import torch
import torch.distributed as dist

import deep_ep
from common import Checks, assert_same, finish, spawn, timing_wanted
from ll_reference import (MODES, bf16_ulp_distance, expert_scales, per_token_cast_back, received_rows,
                          ref_ll_combine_local, ref_ll_dispatch)
from normal_reference import gather_rows

M, HIDDEN, EXPERTS, TOPK = 128, 7168, 288, 8


def check_rows(name, got, want, valid):
    if got.dtype == torch.float8_e4m3fn:
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    if torch.equal(got[valid], want[valid]):
        return
    bad = int((got[valid] != want[valid]).reshape(int(valid.sum()), -1).any(1).sum())
    assert bad == 0, f'{name}: {bad} of {int(valid.sum())} valid rows differ from the reference'


def check_combined(rep, name, got, want):
    assert got.dtype == torch.bfloat16 and got.shape == want.shape, f'{name}: {got.dtype} {tuple(got.shape)}'
    ulps = bf16_ulp_distance(got, want)
    worst = int(ulps.max()) if ulps.numel() else 0
    assert worst <= 1, f'{name}: {int((ulps > 0).sum())} elements differ, up to {worst} BF16 ulp'
    if worst:
        rep.info(f'{name}: {int((ulps > 0).sum())} elements 1 ulp off (allowed, not bit-exact)')


def smoke(rank, world, group, rep):
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device('cuda')
    group = dist.new_group(list(range(world)))
    local = EXPERTS // world
    num_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(M, HIDDEN, world, EXPERTS)
    buf = deep_ep.Buffer(group, num_rdma_bytes=num_bytes, low_latency_mode=True, num_qps_per_rank=local,
                         explicitly_destroy=True)
    try:
        x = torch.randn(M, HIDDEN, dtype=torch.bfloat16)
        scores = torch.randn(M, EXPERTS, dtype=torch.float32).abs() + 1
        topk = torch.topk(scores, TOPK, dim=-1).indices.to(deep_ep.topk_idx_t)
        topk[3, 2] = topk[100, 0] = -1
        topk[7] = -1
        weights = torch.randn(M, TOPK, dtype=torch.float32).abs()
        all_x, all_topk = gather_rows(x, group), gather_rows(topk, group)
        factor = expert_scales(EXPERTS, x.device)

        def round_trip(mode, hook):
            use_fp8, round_scale, use_ue8m0 = MODES[mode]
            ref = ref_ll_dispatch(all_x, all_topk, rank, EXPERTS, M, use_fp8, round_scale, use_ue8m0)
            chk = Checks()
            stats = torch.zeros(local, dtype=torch.int32)
            recv_x, count, handle, event, recv_hook = buf.low_latency_dispatch(
                x, topk, M, EXPERTS, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8,
                round_scale=round_scale, use_ue8m0=use_ue8m0, async_finish=not hook, return_recv_hook=hook)
            recv_hook() if hook else event.current_stream_wait()
            data, scales = recv_x if use_fp8 else (recv_x, None)
            chk(assert_same, 'packed_recv_count', count, ref.count)
            chk(assert_same, 'cumulative_local_expert_recv_stats', stats, ref.count)
            chk(assert_same, 'layout_range', handle[1], ref.layout_range)
            chk(check_rows, 'src_info', handle[0], ref.src_info, ref.valid)
            chk(check_rows, 'packed_recv_x', data, ref.x, ref.valid)
            if use_fp8:
                chk(check_rows, 'packed_recv_x_scales', scales, ref.x_scales, ref.valid)
            chk.agree(group)
            deq = per_token_cast_back(data, scales) if use_fp8 else data
            y = (deq.float() * factor[rank * local:(rank + 1) * local].view(-1, 1, 1)).to(torch.bfloat16)
            want = ref_ll_combine_local(received_rows(x, use_fp8, round_scale), topk, weights, EXPERTS, world, factor)
            out = torch.empty(M, HIDDEN, dtype=torch.bfloat16)
            combined, event, recv_hook = buf.low_latency_combine(y, topk, weights, handle, async_finish=not hook,
                                                                 return_recv_hook=hook, out=out)
            recv_hook() if hook else event.current_stream_wait()
            chk(check_combined, rep, f'combined_x ({mode}, hook={hook})', combined, want)
            chk.done()
            return y, handle

        cases = [('bf16', False), ('fp8', False), ('bf16', True), ('fp8_ue8m0', True)]
        ok = all([rep.run(f'smoke_{mode}_{"hook" if hook else "async"}_dispatch_combine', round_trip, mode, hook)
                  for mode, hook in cases])
        passed = torch.tensor([int(ok)], dtype=torch.int32)
        dist.all_reduce(passed, op=dist.ReduceOp.MIN, group=group)
        if passed.item() and timing_wanted():  # a short timing only when every rank is healthy
            y, handle = round_trip('fp8', False)
            iters = 20
            torch.cuda.synchronize()
            group.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                _, _, handle, _, _ = buf.low_latency_dispatch(x, topk, M, EXPERTS, use_fp8=True)
                buf.low_latency_combine(y, topk, weights, handle)
            torch.cuda.synchronize()
            if rank == 0:
                us = (time.perf_counter() - start) / iters * 1e6
                print(f'  [{world} GPUs] FP8 dispatch + BF16 combine (T={M}, H={HIDDEN}, E={EXPERTS}, top-{TOPK}): '
                      f'{us:.0f} us per pair (host-timed)', flush=True)
    finally:
        torch.cuda.synchronize()
        buf.destroy()


def main():
    gpus = torch.cuda.device_count()
    if gpus < 2:
        print(f'smoke_low_latency needs 2 GPUs, found {gpus}')
        return 1
    spawn(smoke, 2, timeout=120)
    finish()


if __name__ == '__main__':
    sys.exit(main())
