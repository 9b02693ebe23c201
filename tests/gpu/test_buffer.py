"""Buffer lifecycle and surface on 2 GPUs (a subset also on 4): Gloo bootstrap,
attributes and local buffer views, size hints, teardown paths, a create/destroy
leak check, not-yet-implemented methods, and a stalled peer that must time out
with an error naming it. Every case builds its own Buffer so a failure stays local."""
import gc
import os
import sys
import time

import torch
import torch.distributed as dist

import deep_ep
from common import (assert_layout, expect_raises, finish, settled_device_memory, make_buffer, random_topk,
                    skip, spawn)

E, K = 256, 8
NVL = 64 << 20
MiB = 1 << 20
# DeepEP's worked values (spec section 2): hidden 7168 BF16, max over dispatch/combine configs.
NVL_HINT_7168 = {2: 83_927_552, 4: 167_854_976}


def check_layout(buf, world, num_tokens=512):
    topk = random_topk(num_tokens, E, K)
    assert_layout(buf.get_dispatch_layout(topk, E), topk, E, world)


def attributes(rank, world, group):
    with make_buffer(group, num_nvl_bytes=NVL) as buf:
        got = (buf.rank, buf.group_size, buf.num_nvl_bytes, buf.num_rdma_bytes, buf.low_latency_mode)
        assert got == (rank, world, NVL, 0, False), f'(rank, group_size, nvl, rdma, ll) = {got}'
        assert buf.group is group, 'buf.group must be the group passed in (Megatron compares it)'
        assert buf.runtime.get_num_rdma_ranks() == 1
        assert buf.runtime.is_available()
        buf.runtime.check_peers()

        stream = buf.get_comm_stream()
        assert isinstance(stream, torch.cuda.Stream), f'get_comm_stream() returned {type(stream).__name__}'
        assert stream.device == torch.device('cuda', rank), f'comm stream on {stream.device}'
        assert stream != torch.cuda.current_stream(), 'the comm stream must not be the current stream'

        view = buf.get_local_buffer_tensor(torch.int32)
        assert view.dtype == torch.int32 and view.dim() == 1 and view.numel() == NVL // 4, \
            f'int32 view: {view.dtype} {tuple(view.shape)}'
        assert view.device == torch.device('cuda', rank), f'view on {view.device}'
        # Writes through one view are visible through another (same memory, whole extent mapped).
        pattern = torch.arange(1024, dtype=torch.int32, device='cuda') + 1000 * rank
        view[:1024] = pattern
        view[-1] = -7
        again = buf.get_local_buffer_tensor(torch.int32)
        assert torch.equal(again[:1024], pattern) and again[-1].item() == -7, 'writes did not persist'
        shaped = buf.get_local_buffer_tensor(torch.int32, size=torch.Size([4, 8]))
        assert torch.equal(shaped, pattern[:32].view(4, 8)), 'size= view differs'
        offset = buf.get_local_buffer_tensor(torch.uint8, offset=256)
        assert offset.data_ptr() == view.data_ptr() + 256, 'offset= is not a byte offset'
        assert torch.equal(offset[:4].cpu(), pattern[64:65].cpu().view(torch.uint8)), 'offset view reads wrong bytes'
        check_layout(buf, world)


def low_latency_buffer(rank, world, group):
    m, hidden, num_experts = 16, 2048, 4 * world
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(m, hidden, world, num_experts)
    assert rdma > 0 and rdma % 128 == 0, f'LL size hint {rdma}'
    with make_buffer(group, num_rdma_bytes=rdma, low_latency_mode=True,
                     num_qps_per_rank=num_experts // world) as buf:
        assert buf.low_latency_mode and buf.num_rdma_bytes == rdma
        assert buf.nvshmem_qp_depth == int(os.environ.get('NVSHMEM_QP_DEPTH', '1024')), buf.nvshmem_qp_depth
        view = buf.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True)
        assert view.numel() == rdma and view.device == torch.device('cuda', rank), \
            f'RDMA view: {tuple(view.shape)} on {view.device}'
        buf.get_local_buffer_tensor(torch.int8, use_rdma_buffer=True).zero_()  # what vLLM does
        view[-1] = 3
        assert view.sum().item() == 3, 'RDMA buffer writes did not persist'

        # The zeroed buffer serves LL calls: a BF16 dispatch whose per-expert counts match the
        # all-gathered routing, and a combine of the received rows (identity experts) that gives
        # back x times the token's weight sum.
        x = torch.randn(m, hidden, dtype=torch.bfloat16, device='cuda')
        topk = random_topk(m, num_experts, K)
        weights = torch.rand(m, K, device='cuda')
        local = num_experts // world
        buf.clean_low_latency_buffer(m, hidden, num_experts)
        recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, topk, m, num_experts, use_fp8=False)
        routing = [torch.empty_like(topk) for _ in range(world)]
        dist.all_gather(routing, topk, group=group)
        routing = torch.stack(routing)
        want = torch.stack([(routing == rank * local + e).sum() for e in range(local)]).to(torch.int32)
        assert torch.equal(recv_count, want), f'recv_count {recv_count.tolist()} != routing {want.tolist()}'
        combined, _, _ = buf.low_latency_combine(recv_x, topk, weights, handle)
        reference = (x.float() * weights.sum(dim=1, keepdim=True)).bfloat16()
        assert torch.allclose(combined.float(), reference.float(), rtol=2e-2, atol=2e-2), \
            f'combine of the dispatched rows differs from x * sum(weights): max error ' \
            f'{(combined.float() - reference.float()).abs().max().item()}'


def normal_needs_room(rank, world, group):
    """Normal mode on a buffer too small for its rings is a clear error naming num_nvl_bytes
    (and the buffer stays usable); the internode path is an error naming the single NVLink domain."""
    with make_buffer(group, num_nvl_bytes=NVL) as buf:
        num_tokens, hidden = 128, 7168
        x = torch.randn(num_tokens, hidden, dtype=torch.bfloat16, device='cuda')
        topk = random_topk(num_tokens, E, K)
        weights = torch.rand(num_tokens, K, device='cuda')
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, E)
        args = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                    topk_idx=topk, topk_weights=weights)
        expect_raises('dispatch', RuntimeError, lambda: buf.dispatch(x, **args), 'num_nvl_bytes', 'too small')
        # DeepEP's internode path on a buffer within one NVLink domain: an error saying so.
        cfg = deep_ep.Buffer.get_dispatch_config(world)
        expect_raises('internode_dispatch', RuntimeError, lambda: buf.internode_dispatch(x, config=cfg, **args),
                      'one NVLink domain')
        small = deep_ep.Config(deep_ep.Buffer.num_sms, 6, 32)  # 32-token rings fit 64 MiB
        recv_x, *_ = buf.dispatch(x, config=small, **args)
        assert recv_x.shape[1] == hidden, f'recv_x {tuple(recv_x.shape)}'
        check_layout(buf, world)


def gloo_group(rank, world, group):
    gloo = dist.new_group(backend='gloo')  # vLLM bootstraps through its CPU group
    with make_buffer(gloo, num_nvl_bytes=NVL) as buf:
        assert buf.rank == rank and buf.group_size == world
        buf.runtime.check_peers()
        check_layout(buf, world, 4096)


def size_hint(rank, world, group):
    for n, want in NVL_HINT_7168.items():
        got = [deep_ep.Buffer.get_dispatch_config(n).get_nvl_buffer_size_hint(7168 * 2, n),
               deep_ep.Buffer.get_combine_config(n).get_nvl_buffer_size_hint(7168 * 2, n)]
        assert max(got) == want, f'EP{n}: NVL hints (dispatch, combine) {got}, DeepEP gives {want}'
        rdma = deep_ep.Buffer.get_dispatch_config(n).get_rdma_buffer_size_hint(7168 * 2, n)
        assert rdma == 0, f'EP{n}: RDMA hint {rdma}, expected 0 on one node'
    with make_buffer(group, num_nvl_bytes=NVL_HINT_7168[world]) as buf:
        assert buf.get_local_buffer_tensor(torch.uint8).numel() == NVL_HINT_7168[world]
        check_layout(buf, world)


def implicit_destroy(rank, world, group, rep):
    # explicitly_destroy=False: dropping the last reference tears the buffer down
    # (collectively, on every rank) and gives its memory back.
    nvl = 256 * MiB
    buf = deep_ep.Buffer(group, num_nvl_bytes=nvl, explicitly_destroy=False)
    check_layout(buf, world)
    held = settled_device_memory()[0]
    del buf
    gc.collect()
    freed = settled_device_memory()[0] - held
    rep.info(f'del + gc released {freed / MiB:.0f} MiB of device memory')
    assert freed >= nvl // 2, f'only {freed / MiB:.0f} MiB freed after del + gc of a {nvl // MiB} MiB buffer'


def destroy_twice(rank, world, group):
    buf = deep_ep.Buffer(group, num_nvl_bytes=NVL, explicitly_destroy=True)
    check_layout(buf, world)
    buf.destroy()
    expect_raises('second destroy()', RuntimeError, buf.destroy)
    topk = random_topk(16, E, K)
    expect_raises('get_dispatch_layout after destroy', RuntimeError, lambda: buf.get_dispatch_layout(topk, E))
    expect_raises('get_local_buffer_tensor after destroy', RuntimeError,
                  lambda: buf.get_local_buffer_tensor(torch.int32))
    expect_raises('get_comm_stream after destroy', RuntimeError, buf.get_comm_stream)


def create_destroy_loop(rank, world, group, rep):
    def cycle():
        with make_buffer(group, num_nvl_bytes=256 * MiB) as buf:
            check_layout(buf, world, 128)

    for _ in range(3):  # NCCL and torch set up lazily-created state on the first cycles
        cycle()
    before, start = settled_device_memory()[0], time.monotonic()
    for _ in range(50):
        cycle()
    seconds = time.monotonic() - start
    after = settled_device_memory()[0]
    rep.info(f'free device memory after 3 warm-up cycles {before / MiB:.0f} MiB, after 50 more {after / MiB:.0f} MiB '
             f'({seconds / 50 * 1e3:.0f} ms per create/destroy)')
    assert before - after < 64 * MiB, f'{(before - after) / MiB:.0f} MiB lost over 50 create/destroy cycles'


def stalled_peer(rank, world, group):
    # Rank 1 never enters the barrier. Rank 0's buffer ends up poisoned and
    # destroy() is collective, so this buffer is never destroyed (explicitly_destroy
    # makes its release a no-op): this case must run last.
    buf = deep_ep.Buffer(group, num_nvl_bytes=NVL, explicitly_destroy=True)
    buf.runtime.check_peers()  # healthy first
    buf.runtime.set_gpu_timeout_ms(2000)
    dist.barrier()
    if rank == 0:
        start = time.monotonic()
        err = expect_raises('barrier() with a stalled peer', RuntimeError, buf.runtime.barrier, 'timed out', 'rank 1')
        seconds = time.monotonic() - start
        assert seconds < 10, f'timeout took {seconds:.1f} s with a 2 s budget: {err}'
        assert not buf.runtime.is_available(), 'buffer still available after a GPU timeout'
        expect_raises('layout on a poisoned buffer', RuntimeError,
                      lambda: buf.get_dispatch_layout(random_topk(16, E, K), E))
    else:
        time.sleep(4)  # the stalled peer
        assert buf.runtime.is_available()
    dist.barrier()


def worker(rank, world, group, rep):
    rep.run('attributes_and_local_buffer', attributes, rank, world, group)
    rep.run('size_hint_buffer', size_hint, rank, world, group)
    rep.run('gloo_group', gloo_group, rank, world, group)
    if world > 2:
        return
    rep.run('low_latency_buffer', low_latency_buffer, rank, world, group)
    rep.run('normal_needs_room', normal_needs_room, rank, world, group)
    rep.run('implicit_destroy_del_gc', implicit_destroy, rank, world, group, rep)
    rep.run('destroy_twice_and_use_after_destroy', destroy_twice, rank, world, group)
    rep.run('create_destroy_50_no_leak', create_destroy_loop, rank, world, group, rep)
    rep.run('stalled_peer_timeout', stalled_peer, rank, world, group)


if __name__ == '__main__':
    num_gpus = torch.cuda.device_count()
    if num_gpus < 2:
        print(f'test_buffer needs at least 2 GPUs, found {num_gpus}')
        sys.exit(1)
    spawn(worker, 2, timeout=240)
    if num_gpus >= 4:
        spawn(worker, 4, timeout=90)
    else:
        skip('w4', f'only {num_gpus} GPUs visible')
    finish()
