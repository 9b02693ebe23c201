"""Fast end-to-end smoke of normal-mode dispatch/combine (first step of the GPU suite):
one random routing per world size, checked against an all-gathered torch reference, plus
a short timing at DeepEP's benchmark shape. The exhaustive checks are in test_normal.py."""
import sys
import time

import torch
import torch.distributed as dist

import deep_ep
from common import finish, spawn, timing_wanted


def reference_recv(x_all, in_rank_all, rank):
    """Rows of every source's x sent to `rank`, by source rank then token index."""
    return torch.cat([x_all[s][in_rank_all[s][:, rank]] for s in range(len(x_all))])


def smoke(rank, world, group, rep, num_tokens, hidden):
    num_experts, num_topk = 256, 8
    buf = deep_ep.Buffer(group, int(1e9), explicitly_destroy=True)
    try:
        x = torch.randn(num_tokens, hidden, dtype=torch.bfloat16, device='cuda')
        scores = torch.randn(num_tokens, num_experts, device='cuda').abs() + 1
        topk_idx = scores.topk(num_topk, dim=-1, sorted=False).indices
        topk_weights = torch.rand(num_tokens, num_topk, device='cuda')
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, num_experts)
        x_all = [torch.empty_like(x) for _ in range(world)]
        in_all = [torch.empty_like(in_rank) for _ in range(world)]
        dist.all_gather(x_all, x, group=group)
        dist.all_gather(in_all, in_rank, group=group)
        expected = reference_recv(x_all, in_all, rank)
        config = deep_ep.Config(24, 6, 256)

        def dispatch_case():
            recv_x, recv_topk, recv_w, counts, handle, _ = buf.dispatch(
                x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=topk_idx, topk_weights=topk_weights, config=config)
            assert recv_x.shape == expected.shape, f'recv_x {tuple(recv_x.shape)} != {tuple(expected.shape)}'
            assert torch.equal(recv_x, expected), 'recv_x rows differ from the reference'
            epr = num_experts // world
            assert sum(counts) == int(((recv_topk >= 0) & (recv_topk < epr)).sum()), 'per-expert counts'
            combined, _, _ = buf.combine(recv_x, handle, config=config)
            ref = (x.float() * in_rank.sum(1, keepdim=True)).to(torch.bfloat16)
            diff = (combined.float() - ref.float()).abs().max().item()
            assert diff <= 0.05 * max(1.0, ref.float().abs().max().item()), f'combine max diff {diff}'
            cached_x, *_ = buf.dispatch(x, handle=handle, config=config)
            assert torch.equal(cached_x, expected), 'cached dispatch differs'
            return handle

        rep.run(f'smoke dispatch+combine T={num_tokens} H={hidden} on {world}', dispatch_case)
        if num_tokens >= 1024 and timing_wanted():
            handle = dispatch_case()
            for name, fn in (
                ('dispatch cached', lambda: buf.dispatch(x, handle=handle, config=config)),
                ('combine', lambda: buf.combine(expected, handle, config=config)),
            ):
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
                group.barrier()
                start = time.perf_counter()
                for _ in range(20):
                    fn()
                torch.cuda.synchronize()
                us = (time.perf_counter() - start) / 20 * 1e6
                if rank == 0:
                    gbps = expected.numel() * 2 / us / 1e3
                    print(f'  [{world} GPUs] {name}: {us:.0f} us/call, {gbps:.0f} GB/s (rank 0 recv bytes)', flush=True)
    finally:
        torch.cuda.synchronize()
        buf.destroy()


def main():
    gpus = torch.cuda.device_count()
    for world in (2, 4, 8):
        if world <= gpus:
            spawn(smoke, world, 512, 2048, timeout=180)
            spawn(smoke, world, 4096, 7168, timeout=180)
    finish()


if __name__ == '__main__':
    sys.exit(main())
