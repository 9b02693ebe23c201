"""Internode handles corrupted on one rank (issue 24 item 3 for internode normal mode), on 2 GPUs
as 2 virtual nodes of 1, the way DeepEP's tests run (default dtype BF16, default device CUDA).

Each case: a healthy dispatch, then on CORRUPT_RANK one handle entry gets a value no dispatch
produces, then a cached dispatch or a combine over that handle. Every output the library
allocates lies between two guard regions (test_normal_protocol.GuardedTorch: the internode ops
allocate through deep_ep_cpp._lib's torch, which this test points at guarded memory); the guards
must stay untouched on every rank, and some rank must report an error naming a handle entry or
the op's bad input (a peer waiting for rows that were skipped may also stall, bounded). An
entry the op does not read ('unread') must change nothing.

Handle entries (DeepEP's order): 0 is_token_in_rank, 1 rdma_channel_prefix_matrix,
2 gbl_channel_prefix_matrix, 3 recv_rdma_channel_prefix_matrix, 4 recv_rdma_rank_prefix_sum,
5 recv_gbl_channel_prefix_matrix, 6 recv_gbl_rank_prefix_sum, 7 recv_src_meta, 8 send_rdma_head,
9 send_nvl_head.

Run: python tests/gpu/test_internode_protocol.py (needs 2 GPUs)."""
import os

os.environ['DEEPEP_NCCL_FAST'] = '0'  # before deep_ep loads: the guards are the ctypes path's allocations
# (the compiled path, _fast_internode.h, allocates through torch's C++ API, which GuardedTorch cannot reach)

import sys

import torch
import torch.distributed as dist

from common import Checks, finish, skip, spawn
from deep_ep_cpp import _lib
from test_internode import E, make_buffer, make_ctx, route
from test_normal_protocol import GuardedTorch, check_corrupted_call, destroy_after

CORRUPT_RANK = 1
STALL_MS = 1500
TOKENS, HIDDEN = 512, 2048
# What an error must name: a handle entry, a prefix or head check, or the counts a peer sent.
ENTRY_NAMED = r"handle|prefix|head|counts a peer sent|src_meta"
GUARDS = GuardedTorch()


def set_at(index, entry, value):
    """corrupt(handle): handle[entry][index] = value."""
    return lambda h: h[entry].__setitem__(index, value)


def first_kept_row_meta(h):
    """recv_src_meta of the first received row: its source node set past the last node."""
    h[7][0, :4] = torch.tensor([0x7f, 0, 0, 0], dtype=torch.uint8)


# name: (op, corrupt(handle) on CORRUPT_RANK)
CASES = {
    'gbl_channel_prefix_cached_dispatch': ('dispatch', set_at((0, 0), 2, -3)),
    'rdma_channel_prefix_cached_dispatch': ('dispatch', set_at((0, 0), 1, 1 << 20)),
    'recv_rdma_rank_prefix_cached_dispatch': ('dispatch', set_at(0, 4, -5)),
    # Entry 5 is no input of a cached dispatch (DeepEP's nor this one's): no error, the right rows.
    'recv_gbl_channel_prefix_cached_dispatch': ('unread', set_at((0, 1), 5, -2)),
    'recv_gbl_rank_prefix_cached_dispatch': ('dispatch', set_at(0, 6, 1 << 20)),
    'recv_rdma_channel_prefix_combine': ('combine', set_at((0, 0), 3, -2)),
    'recv_rdma_rank_prefix_combine': ('combine', set_at(0, 4, 1 << 20)),
    'recv_gbl_channel_prefix_combine': ('combine', set_at((1, 0), 5, -7)),
    'send_rdma_head_combine': ('combine', set_at((0, 0), 8, 1 << 20)),
    'send_nvl_head_combine': ('combine', set_at((0, 0), 9, 1 << 20)),
    'src_meta_combine': ('combine', first_kept_row_meta),
}


def corrupted_handle(ctx, name, op, corrupt):
    chk = Checks()
    buf = ctx.buffer = make_buffer(ctx)
    try:
        topk_idx = route('random', TOKENS, 8, ctx.world)
        weights = torch.rand(TOKENS, 8, dtype=torch.float32)
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, E)
        x = torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16)
        recv_x, _, recv_weights, _, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=weights)
        torch.cuda.synchronize()
        bad = GUARDS.violations()
        chk.expect(not bad, f'the healthy dispatch wrote outside its outputs: {bad}')
        chk.agree(ctx.group)
        buf.runtime.set_gpu_timeout_ms(STALL_MS)  # a peer waiting for skipped rows gives up soon
        if ctx.rank == CORRUPT_RANK:
            corrupt(handle)
        torch.cuda.synchronize()
        dist.barrier(group=ctx.group)
        if op == 'unread':
            again = buf.dispatch(x, handle=handle)[0]
            torch.cuda.synchronize()
            bad = GUARDS.violations()
            chk.expect(not bad, f'{name}: rank {ctx.rank} has writes outside the outputs: {bad[:3]}')
            chk.expect(torch.equal(again, recv_x), f'{name}: the cached dispatch changed the received rows')
        else:
            if op == 'dispatch':
                call = lambda: buf.dispatch(x, handle=handle)  # noqa: E731
            else:
                call = lambda: buf.combine(recv_x, handle, topk_weights=recv_weights)  # noqa: E731
            check_corrupted_call(ctx, chk, name, GUARDS, ENTRY_NAMED, call,
                                 lambda: buf.get_dispatch_layout(topk_idx, E))
    finally:
        destroy_after(ctx, buf, name, GUARDS)
    chk.done()


def worker(rank, world, group, rep):
    ctx = make_ctx(dist.new_group(list(range(world))), rep)
    _lib.torch = GUARDS  # every output the ctypes path allocates is guarded
    try:
        for name, (op, corrupt) in CASES.items():
            rep.run(name, corrupted_handle, ctx, name, op, corrupt)
    finally:
        _lib.torch = torch


if __name__ == '__main__':
    if torch.cuda.device_count() < 2:
        skip('w2', f'test_internode_protocol needs 2 GPUs, found {torch.cuda.device_count()}')
        sys.exit(1)
    spawn(worker, 2, timeout=400)
    finish()
