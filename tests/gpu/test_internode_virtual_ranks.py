"""Internode normal mode with N nodes of G virtual ranks on ONE GPU (tests/gpu/internode_virtual.py),
against the pure-torch oracle internode_reference.py (DeepEP V1's values).

What this covers that 2 GPUs as 2 nodes of 1 (test_internode.py) cannot: the NVLink leg between
GPUs of a node (forwarders writing other GPUs' NVLink rings, receivers draining them, combine's
senders to the forwarder and its per-GPU sums), G > 1 in every handle entry (recv_src_meta's
masks, send_nvl_head), many source nodes per forwarder, and DeepEP's shape of 2 nodes of 8. Every
dispatch output and handle entry, the cached dispatch, combine's outputs and the heads it rewrites
are compared exactly; every case runs two rounds (op epochs and running counters carry over).
Each rank's traffic counters (both legs, rows and bytes) over a dispatch and over a combine are
compared with internode_reference.traffic_rows.
Shapes: 2x1 (the 2-GPU test's topology), 2x8, 3x4, 16x4 (64 ranks, one channel each: needs 128
SMs), and past the old cap of 16 nodes 20x3, 24x2, 32x1 and 64x1 (one channel each); routing random, with -1 holes, skewed onto one rank, with one node receiving nothing; BF16
and FP8 (column-major scales); small rings (credits wrap many times); num_worst_tokens.

Usage: python tests/gpu/test_internode_virtual_ranks.py [-k REGEX]"""
import sys

import torch

import internode_reference as ir
from internode_virtual import InternodeWorld, layout_of
from ll_virtual import run_cases

HANDLE_NAMES = ('is_token_in_rank', 'rdma_channel_prefix_matrix', 'gbl_channel_prefix_matrix',
                'recv_rdma_channel_prefix_matrix', 'recv_rdma_rank_prefix_sum', 'recv_gbl_channel_prefix_matrix',
                'recv_gbl_rank_prefix_sum', 'recv_src_meta', 'send_rdma_head', 'send_nvl_head')


def check_equal(name, got, want):
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f'{name}: {got.dtype} {tuple(got.shape)}, expected {want.dtype} {tuple(want.shape)}'
    if got.dtype == torch.float8_e4m3fn:
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    if not torch.equal(got, want):
        bad = (got != want).nonzero()
        first = tuple(bad[0].tolist()) if bad.numel() else ()
        raise AssertionError(f'{name}: {bad.size(0)} of {got.numel()} entries differ, first at {list(first)}'
                             + (f': got {got[first].item()}, expected {want[first].item()}' if first else ''))


def make_topk(gen, world, tokens, num_topk, routing):
    """[T, K] int64 routing over the world's experts: distinct random experts ('random'), a quarter
    of the slots -1 ('holes'), every token to the last rank's experts ('skewed'), or never to
    node 1 ('empty_node': that node receives nothing, its ranks still send)."""
    e, r = world.num_experts, world.num_ranks
    scores = torch.rand(tokens, e, generator=gen)
    if routing == 'skewed':
        scores[:, :e - e // r] = -1
    elif routing == 'empty_node':
        per_node = e // world.num_nodes
        scores[:, per_node:2 * per_node] = -1
    topk = scores.topk(num_topk, dim=1).indices
    topk[scores.gather(1, topk) < 0] = -1
    if routing == 'holes':
        topk[torch.rand(tokens, num_topk, generator=gen) < 0.25] = -1
    return topk


def make_inputs(world, seed, tokens, num_topk, routing, fp8, topk_int32, device='cuda'):
    """Per rank: x (BF16, or FP8 with column-major float32 scales as DeepEP's tests), topk [T, K],
    weights [T, K]. `tokens`: an int (every rank) or a list per rank."""
    gen = torch.Generator().manual_seed(seed)
    counts = tokens if isinstance(tokens, (list, tuple)) else [tokens] * world.num_ranks
    xs, topks, weights = [], [], []
    for t in counts:
        x = torch.randn(t, world.hidden, generator=gen).to(torch.bfloat16).to(device)
        if fp8:
            scales = torch.rand(world.hidden // 128, t, generator=gen).to(device).T  # column-major
            x = (x.to(torch.float8_e4m3fn), scales)
        xs.append(x)
        topk = make_topk(gen, world, t, num_topk, routing)
        topks.append((topk.int() if topk_int32 else topk).to(device))
        weights.append(torch.rand(t, num_topk, generator=gen).to(device))
    return xs, topks, weights


def check_dispatch(refs, outs):
    for r, (ref, out) in enumerate(zip(refs, outs)):
        what, n, nr = f'rank {r}', ref.num_recv, ref.num_rdma_recv
        assert (out['num_recv'], out['num_rdma_recv']) == (n, nr), \
            f'{what}: receives {out["num_recv"]} rows ({out["num_rdma_recv"]} scale-out), expected {n} ({nr})'
        check_equal(f'{what} recv_x', out['recv_x'][:n], ref.recv_x[:n])
        if ref.recv_x_scales is not None:
            check_equal(f'{what} recv_x_scales', out['recv_x_scales'][:n], ref.recv_x_scales[:n])
        check_equal(f'{what} recv_topk_idx', out['recv_topk_idx'], ref.recv_topk_idx)  # tail: -1
        check_equal(f'{what} recv_topk_weights', out['recv_topk_weights'][:n], ref.recv_topk_weights[:n])
        assert out['per_expert'] == ref.num_recv_tokens_per_expert_list, \
            f'{what}: num_recv_tokens_per_expert {out["per_expert"]}, expected {ref.num_recv_tokens_per_expert_list}'
        defined = {'recv_src_meta': n, 'send_nvl_head': nr}
        for i, name in enumerate(HANDLE_NAMES[1:], 1):
            got, want = out['handle'][i], ref.handle[i]
            rows = defined.get(name, got.size(0))
            check_equal(f'{what} handle[{i}] {name}', got[:rows], want[:rows])


def check_traffic(world, op, before, want):
    """Every rank's traffic counters moved by want[r] (8 values) since `before` (per rank)."""
    for r in range(world.num_ranks):
        got = [a - b for a, b in zip(world.traffic(r), before[r])]
        assert got == want[r], f'rank {r} {op} traffic (DeepepTrafficKind order) {got}, expected {want[r]}'


def round_trip(world, seed, tokens, num_topk=8, routing='random', fp8=False, topk_int32=False, num_worst_tokens=0,
               expert_alignment=1, bias=False, rounds=2):
    """`rounds` x (dispatch, cached dispatch, combine of random expert outputs with the received
    weights, combine again), every output checked against the oracle. Combine takes as many rows as
    dispatch returned, as DeepEP (num_worst_tokens: a tail no channel covers, its weights NaN)."""
    g, c = world.node_size, world.num_channels
    for i in range(rounds):
        xs, topks, weights = make_inputs(world, seed + i, tokens, num_topk, routing, fp8, topk_int32)
        layouts = [layout_of(t, world.num_experts, world.num_ranks, g) for t in topks]
        in_rank = [lay[0] for lay in layouts]
        refs = ir.internode_dispatch_all(xs, in_rank, [lay[3] for lay in layouts], topks, weights,
                                         num_nvl_ranks=g, num_channels=c, expert_alignment=expert_alignment,
                                         num_worst_tokens=num_worst_tokens)
        before = [world.traffic(r) for r in range(world.num_ranks)]
        outs = world.dispatch(xs, topks, weights, expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens)
        check_dispatch(refs, outs)
        rows = [ir.traffic_rows(in_rank, r, g) for r in range(world.num_ranks)]
        x0 = xs[0][0] if fp8 else xs[0]
        dispatch_row = ir.dispatch_row_bytes(world.hidden * x0.element_size(), world.hidden // 128 if fp8 else 0,
                                             num_topk)
        combine_row = ir.combine_row_bytes(world.hidden * 2, num_topk)
        check_traffic(world, 'dispatch', before, [ir.traffic(n[:2] + [0, 0], dispatch_row, combine_row) for n in rows])
        handles = [o['handle'] for o in outs]

        if num_worst_tokens == 0:  # a cached dispatch: the same rows, bit for bit
            again = world.dispatch(xs, handles=handles)
            for r, (a, o) in enumerate(zip(again, outs)):
                check_equal(f'rank {r} cached recv_x', a['recv_x'], o['recv_x'])
                if fp8:
                    check_equal(f'rank {r} cached recv_x_scales', a['recv_x_scales'], o['recv_x_scales'])

        gen = torch.Generator().manual_seed(seed + 1000 + i)
        ys = [torch.randn(o['recv_x'].size(0), world.hidden, generator=gen).to(torch.bfloat16).cuda() for o in outs]
        ws = [o['recv_topk_weights'] for o in outs]
        n = [ref.num_recv for ref in refs]
        biases = None
        if bias:  # bias_0 on every rank, bias_1 on even ranks (a missing one reads as 0)
            rand = lambda t: torch.randn(t, world.hidden, generator=gen).to(torch.bfloat16).cuda()  # noqa: E731
            biases = [(rand(m.size(0)), rand(m.size(0)) if r % 2 == 0 else None) for r, m in enumerate(in_rank)]
        want = ir.internode_combine_all(in_rank, [y[:k] for y, k in zip(ys, n)], [w[:k] for w, k in zip(ws, n)], biases,
                                        num_nvl_ranks=g)
        before = [world.traffic(r) for r in range(world.num_ranks)]
        got = world.combine(ys, handles, ws, biases)
        check_traffic(world, 'combine', before,
                      [ir.traffic([0, 0] + n[2:], dispatch_row, combine_row) for n in rows])
        for r, ((gx, gw), (wx, ww)) in enumerate(zip(got, want)):
            check_equal(f'rank {r} combined_x', gx, wx)
            check_equal(f'rank {r} combined_topk_weights', gw, ww)
            after, nr = refs[r].combined_handle(c), refs[r].num_rdma_recv
            check_equal(f'rank {r} send_rdma_head after combine', handles[r][8], after[8])
            check_equal(f'rank {r} send_nvl_head after combine', handles[r][9][:nr], after[9][:nr])
        again = world.combine(ys, handles, ws, biases)  # heads already rewritten: idempotent
        for r, ((ax, aw), (gx, gw)) in enumerate(zip(again, got)):
            check_equal(f'rank {r} second combined_x', ax, gx)
            check_equal(f'rank {r} second combined_topk_weights', aw, gw)


def cases():
    h = 512
    # name: (InternodeWorld kwargs, round_trip kwargs)
    return {
        # The 2-GPU test's topology (2 nodes of 1): no NVLink leg, forwarder = receiver.
        '2x1_random': (dict(num_nodes=2, node_size=1, hidden=h, num_experts=16),
                       dict(seed=1, tokens=[96, 33], num_topk=4, bias=True)),
        # Without a bias (DeepEP's benchmark): the final receiver's one- and two-row sums, this
        # rank's own row read from x (one GPU per node); 5 nodes: up to 4 rows, the general sum.
        '2x1_no_bias': (dict(num_nodes=2, node_size=1, hidden=h, num_experts=16),
                        dict(seed=17, tokens=[96, 33])),
        '5x1_no_bias_small_rings': (dict(num_nodes=5, node_size=1, hidden=h, num_experts=40, rdma_ring_tokens=6),
                                    dict(seed=18, tokens=[64, 0, 17, 64, 5], num_topk=4)),
        # DeepEP's shape: 2 nodes of 8.
        '2x8_random': (dict(num_nodes=2, node_size=8, hidden=h, num_experts=64),
                       dict(seed=2, tokens=[64, 0, 1, 17] * 4, bias=True)),
        '2x8_holes_int32_topk': (dict(num_nodes=2, node_size=8, hidden=h, num_experts=64),
                                 dict(seed=3, tokens=48, routing='holes', topk_int32=True)),
        '2x8_skewed': (dict(num_nodes=2, node_size=8, hidden=h, num_experts=64),
                       dict(seed=4, tokens=40, num_topk=4, routing='skewed')),
        '2x8_fp8': (dict(num_nodes=2, node_size=8, hidden=h, num_experts=64),
                    dict(seed=5, tokens=[40, 7] * 8, fp8=True)),
        # Rings of 4: a writer waits for credits many times per channel, NVLink slots wrap.
        '2x8_small_rings': (dict(num_nodes=2, node_size=8, hidden=h, num_experts=64, rdma_ring_tokens=4,
                                 nvl_ring_tokens=4),
                            dict(seed=6, tokens=64)),
        '3x4_random': (dict(num_nodes=3, node_size=4, hidden=h, num_experts=48),
                       dict(seed=7, tokens=[50, 0, 3, 50, 21, 50, 1, 50, 9, 50, 0, 33], expert_alignment=4,
                            bias=True)),
        '3x4_empty_node': (dict(num_nodes=3, node_size=4, hidden=h, num_experts=48),
                           dict(seed=8, tokens=40, routing='empty_node')),
        '3x4_fp8_num_worst_tokens': (dict(num_nodes=3, node_size=4, hidden=h, num_experts=48),
                                     dict(seed=9, tokens=32, fp8=True, num_worst_tokens=12 * 32)),
        '3x4_one_channel_small_rings': (dict(num_nodes=3, node_size=4, hidden=1024, num_experts=48, num_channels=1,
                                             rdma_ring_tokens=6, nvl_ring_tokens=5),
                                        dict(seed=10, tokens=64, routing='holes')),
        # 64 ranks, one channel each (128 blocks: every rank's grid co-resident on 132 SMs).
        '16x4_random': (dict(num_nodes=16, node_size=4, hidden=256, num_experts=128, num_channels=1),
                        dict(seed=11, tokens=[24, 0, 5, 24] * 16)),
        '16x4_empty_node_fp8': (dict(num_nodes=16, node_size=4, hidden=256, num_experts=128, num_channels=1),
                                dict(seed=12, tokens=16, routing='empty_node', fp8=True, rounds=1)),
        # Past the old cap of 16 nodes, one channel each: warp groups take several nodes in turn
        # (dispatch's 24 sender warps, its forwarders beside G - 1 receivers, combine's 16
        # forwarder warps), the counters' strides from the world's N.
        '20x3_random': (dict(num_nodes=20, node_size=3, hidden=256, num_experts=120, num_channels=1),
                        dict(seed=13, tokens=[20, 0, 7] * 20, bias=True)),
        '24x2_holes_small_rings': (dict(num_nodes=24, node_size=2, hidden=256, num_experts=96, num_channels=1,
                                        rdma_ring_tokens=4, nvl_ring_tokens=4),
                                   dict(seed=14, tokens=24, routing='holes')),
        '32x1_random': (dict(num_nodes=32, node_size=1, hidden=256, num_experts=64, num_channels=1),
                        dict(seed=15, tokens=[32, 3, 0, 17] * 8, bias=True)),
        # More nodes than a warp's lanes: combine's receiver sums a token's rows in chunks of 32
        # nodes (a token reaches up to 8 nodes with top-8, any of the 64).
        '64x1_random_fp8': (dict(num_nodes=64, node_size=1, hidden=256, num_experts=128, num_channels=1),
                            dict(seed=16, tokens=[16, 1, 0, 9] * 16, fp8=True, bias=True)),
    }


def main():
    checks = {name: (world_kw, round_trip, trip_kw) for name, (world_kw, trip_kw) in cases().items()}
    return run_cases('test_internode_virtual_ranks', __doc__.split('\n')[0], checks, make_world=InternodeWorld)


if __name__ == '__main__':
    sys.exit(main())
