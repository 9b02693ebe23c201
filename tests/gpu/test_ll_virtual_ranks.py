"""The LL kernels with 2-8 virtual ranks on ONE GPU (tests/gpu/ll_virtual.py), against the
independent torch reference of ll_reference.py.

What this covers that one real rank cannot: several sources per receiver (count messages, the
per-source prefix of every expert's rows, layout_range, src_info), uneven token counts per
source, the emulated remote path of virtual nodes, combine homes on every rank, and both buffer
halves over repeated calls. Every output is compared bit for bit (combine: at most 1 BF16 ulp,
as test_low_latency.py). The real multi-GPU path (NCCL window, NVLink) is test_low_latency.py's.
The clean_* cases run clean_low_latency_buffer's kernel: its barrier between the ranks, the mode
switch it exists for (halves overwritten, then exact LL rounds), and a rank that never arrives.

Usage: python tests/gpu/test_ll_virtual_ranks.py [-k REGEX]"""
import sys
import time

import torch

from ll_reference import bf16_ulp_distance, expert_scales, ref_ll_combine, ref_ll_dispatch
from ll_virtual import run_cases

MODES = {'bf16': (False, False, False), 'fp8': (True, False, False), 'fp8_round': (True, True, False),
         'fp8_ue8m0': (True, True, True)}


def make_topk(gen, tokens, num_topk, num_experts, routing):
    """[T, K] int64 routing: distinct random experts ('random'), every token to expert 0 and the
    rest -1 ('skewed'), random with a quarter of the slots -1 ('holes'), with a repeated expert
    per token ('dupes': the receiver must keep both copies, in (token, k) order), or with a fifth
    of the slots out of range ('invalid': ids E, E + 7, 2**31 + 5 and -3, which the kernels skip like -1;
    int64 ids are read as their low 32 bits, as DeepEP does)."""
    if routing == 'skewed':
        topk = torch.full((tokens, num_topk), -1, dtype=torch.int64)
        topk[:, 0] = 0
        return topk
    scores = torch.rand(tokens, num_experts, generator=gen)
    topk = scores.topk(num_topk, dim=1).indices
    if routing == 'holes':
        topk[torch.rand(tokens, num_topk, generator=gen) < 0.25] = -1
    elif routing == 'dupes' and num_topk > 1:
        topk[:, -1] = topk[:, 0]
    elif routing == 'invalid':
        bad = torch.tensor([num_experts, num_experts + 7, 2**31 + 5, -3])
        pick = torch.randint(0, len(bad), topk.shape, generator=gen)
        topk = torch.where(torch.rand(tokens, num_topk, generator=gen) < 0.2, bad[pick], topk)
    return topk


def as_reference(topk, num_experts):
    """The routing the kernels act on: ids outside [0, E) are skipped, like -1."""
    return topk.masked_fill((topk < 0) | (topk >= num_experts), -1)


def make_inputs(world, seed, tokens, num_topk, routing='random', topk_int32=False):
    """Per rank: x [T_r, H] BF16 (amplitude varies per 128-channel block, so FP8 scales differ)
    and topk [T_r, K]. `tokens` is an int (every rank) or a list (per rank)."""
    gen = torch.Generator().manual_seed(seed)
    counts = tokens if isinstance(tokens, (list, tuple)) else [tokens] * world.num_ranks
    all_x, all_topk = [], []
    for t in counts:
        amp = torch.rand(1, world.hidden // 128, 1, generator=gen) * 4 + 0.01
        x = (torch.randn(t, world.hidden // 128, 128, generator=gen) * amp).view(t, world.hidden)
        all_x.append(x.to(torch.bfloat16).cuda())
        topk = make_topk(gen, t, num_topk, world.num_experts, routing)
        all_topk.append((topk.to(torch.int32) if topk_int32 else topk).cuda())
    return all_x, all_topk


def check_equal(name, got, want, valid=None):
    if got.dtype == torch.float8_e4m3fn:
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    if valid is not None:
        got, want = got[valid], want[valid]
    if not torch.equal(got, want):
        bad = (got != want).reshape(got.size(0), -1).any(1) if got.dim() else torch.tensor([True])
        raise AssertionError(f'{name}: {int(bad.sum())} of {got.size(0) if got.dim() else 1} rows differ, '
                             f'first at {int(bad.nonzero()[0])}')


def check_dispatch(world, all_x, all_topk, outs, mode, stats_calls=1):
    use_fp8, round_scale, ue8m0 = MODES[mode]
    for r in range(world.num_ranks):
        ref = ref_ll_dispatch(all_x, all_topk, r, world.num_experts, world.max_tokens, use_fp8, round_scale, ue8m0)
        out = outs[r]
        what = f'rank {r}'
        check_equal(f'{what} packed_recv_count', out['count'], ref.count)
        check_equal(f'{what} layout_range', out['layout_range'], ref.layout_range)
        check_equal(f'{what} src_info', out['src_info'], ref.src_info, ref.valid)
        check_equal(f'{what} packed_recv_x', out['x'], ref.x, ref.valid)
        if use_fp8:
            check_equal(f'{what} packed_recv_x_scales', out['scales'], ref.x_scales, ref.valid)
        check_equal(f'{what} cumulative_local_expert_recv_stats', out['stats'], ref.count * stats_calls)
        assert bool((out['wait_stats'] > 0).all()), f'{what} dispatch_wait_recv_cost_stats not added to'


def check_combine(world, all_y, all_topk, all_w, got):
    for r in range(world.num_ranks):
        want = ref_ll_combine(all_y, all_topk, r, all_w[r], world.num_experts, world.max_tokens)
        if torch.equal(got[r], want):
            continue
        ulps = bf16_ulp_distance(got[r], want)
        if int(ulps.max()) > 1:
            raise AssertionError(f'rank {r} combined_x: {int((ulps > 0).sum())} elements differ, up to '
                                 f'{int(ulps.max())} BF16 ulp')


def round_trip(world, seed, tokens, num_topk, modes, routing='random', topk_int32=False, rounds=1):
    """`rounds` x (dispatch in each mode, then combine of random expert outputs): both buffer
    halves, fresh data each time, every output checked."""
    for i in range(rounds):
        all_x, all_topk = make_inputs(world, seed + i, tokens, num_topk, routing, topk_int32)
        ref_topk = [as_reference(t, world.num_experts) for t in all_topk]
        for mode in modes:
            use_fp8, round_scale, ue8m0 = MODES[mode]
            outs = world.dispatch(all_x, all_topk, use_fp8, round_scale, ue8m0)
            torch.cuda.synchronize()
            world.check_no_stall()
            check_dispatch(world, all_x, ref_topk, outs, mode)
            if mode == 'bf16':
                bf16_outs = outs
        gen = torch.Generator(device='cuda').manual_seed(seed + 1000 + i)
        el, rows, h = world.local_experts, world.num_ranks * world.max_tokens, world.hidden
        if routing == 'dupes':
            assert 'bf16' in modes, 'the duplicate-expert case derives its expert outputs from a BF16 dispatch'
            # Both copies of a duplicated (token, expert) pair map to one combine slot (DeepEP's
            # layout), so their outputs must agree: y = bf16(received row * factor of the expert).
            factor = expert_scales(world.num_experts, 'cuda').view(world.num_ranks, el, 1, 1)
            all_y = [(bf16_outs[r]['x'].float() * factor[r]).to(torch.bfloat16) for r in range(world.num_ranks)]
        else:
            all_y = [torch.randn(el, rows, h, device='cuda', generator=gen).to(torch.bfloat16)
                     for _ in range(world.num_ranks)]
        all_w = [torch.rand(t.shape, device='cuda', generator=gen) for t in all_topk]
        got = world.combine(all_y, all_topk, all_w, outs)
        torch.cuda.synchronize()
        world.check_no_stall()
        check_combine(world, all_y, ref_topk, all_w, got)


WAIT_OP_LL_CLEAN = 8  # DEEPEP_WAIT_OP_LL_CLEAN (kernels/deepep_kernels.h)


def scribble_halves(world):
    """What normal-mode kernels leave in the LL halves (both modes share the RDMA region): every
    byte 0xff, so a signal word reads 2**64 - 1, a value no send stores."""
    for r in range(world.num_ranks):
        world.rank_window(r)[:world.halves_bytes()].fill_(0xff)


def expect_stall(world, op, peer=None):
    torch.cuda.synchronize()
    words = world.stall.cpu().view(torch.int32).tolist()
    assert words[0] == 1, 'expected a stall record, found none'
    assert words[3] == op, f'stall of wait op {words[3]}, expected {op}'
    assert peer is None or words[2] == peer, f'stall names peer {words[2]}, expected {peer}'
    world.reset_stall()


def check_cleaned(world, ranks, cleans, absent=()):
    """After `cleans` cleans: both halves' signal words and the LL counters zero, op_seq at the
    new generation (the barriers passed, 2 per clean) with no sends, one arrival per clean barrier
    from every rank not in `absent`, the count of barriers passed."""
    for r in ranks:
        for parity in (0, 1):
            assert not world.signal_words(r, parity).any(), f'rank {r}: half {parity} signal words not zero'
        state, _, gin_sent = world.counters(r)
        assert not state.any(), f'rank {r}: done/source_state/ticket not zero'
        assert not gin_sent.any(), f'rank {r}: gin_sent not zero'
        seq = world.op_seq(r)
        assert bool((seq == (2 * cleans) << 32).all()), f'rank {r}: op_seq {seq.unique().tolist()} after {cleans} cleans'
        arrivals = world.arrival_words(r).tolist()
        want = [0 if src in absent else 2 * cleans for src in range(world.num_ranks)]
        assert arrivals == want, f'rank {r}: clean barrier arrivals {arrivals}, expected {want}'
        assert world.clean_epoch(r) == 2 * cleans, f'rank {r}: {world.clean_epoch(r)} barriers passed'


def clean_after_normal_mode(world, seed, tokens, num_topk, modes):
    """SGLang's mode switch: LL rounds, the halves overwritten (as normal-mode calls do) and stale
    LL counters, clean_low_latency_buffer on every rank, then LL rounds on both halves, exact."""
    round_trip(world, seed, tokens, num_topk, modes)
    for cleans in (1, 2):
        scribble_halves(world)
        for part in (p for r in range(world.num_ranks) for p in world.counters(r)):
            part.fill_(-1)
        world.clean()
        world.check_no_stall()
        check_cleaned(world, range(world.num_ranks), cleans)
        round_trip(world, seed + 10 * cleans, tokens, num_topk, modes, rounds=2)


def uncleaned_halves_exact(world, seed, tokens, num_topk):
    """Halves overwritten after LL rounds (0xff, as normal-mode data would) and no clean: the next
    LL rounds are still exact, since every signal is a value the sender stores (keyed, so no
    overwritten word equals one) and every byte a receive reads is rewritten by its op. A clean
    then finds the world in step."""
    round_trip(world, seed, tokens, num_topk, ('bf16',))
    scribble_halves(world)
    round_trip(world, seed + 1, tokens, num_topk, ('bf16', 'fp8'), rounds=2)
    world.clean()
    world.check_no_stall()
    check_cleaned(world, range(world.num_ranks), 1)
    round_trip(world, seed + 2, tokens, num_topk, ('bf16', 'fp8'), rounds=2)


def clean_waits_for_every_rank(world, seed, tokens, num_topk):
    """The first barrier holds: rank 0's clean, launched alone, neither finishes nor zeroes its
    overwritten signal words while the others have not arrived; once they do, all finish."""
    round_trip(world, seed, tokens, num_topk, ('bf16',))
    scribble_halves(world)
    torch.cuda.synchronize()
    first = world.launch_clean([0])
    time.sleep(0.2)
    assert not first[0].query(), "rank 0's clean finished before the other ranks arrived"
    for parity in (0, 1):
        words = world.signal_words(0, parity)  # read on another stream while the clean spins
        assert bool((words == -1).all()), f'rank 0 zeroed half {parity} before the other ranks arrived'
    world.launch_clean(range(1, world.num_ranks))
    torch.cuda.synchronize()
    world.check_no_stall()
    check_cleaned(world, range(world.num_ranks), 1)
    round_trip(world, seed + 1, tokens, num_topk, ('bf16', 'fp8'), rounds=2)


def clean_without_a_rank(world, absent):
    """One rank never calls clean. Shrink mode: the others mask it after the timeout and finish
    (DeepEP's mask-aware barrier), with no stall. Otherwise: a stall record naming it."""
    present = [r for r in range(world.num_ranks) if r != absent]
    world.clean(present)
    if not world.base['shrink']:
        expect_stall(world, WAIT_OP_LL_CLEAN, peer=absent)
        return
    world.check_no_stall()
    check_cleaned(world, present, 1, absent=(absent,))
    for r in present:
        want = [int(src == absent) for src in range(world.num_ranks)]
        assert world.mask(r).tolist() == want, f'rank {r}: mask {world.mask(r).tolist()}, expected {want}'


def slow_rank_rejoins(world, slow):
    """Shrink mode: `slow` reaches clean only after the others' timeout. They mask it and finish;
    it then passes both barriers on their arrivals (a masked peer in the node still gets them),
    masking no one. After low_latency_clean_mask_buffer on every rank, a clean of all is in step."""
    present = [r for r in range(world.num_ranks) if r != slow]
    world.clean(present)
    world.clean([slow])
    world.check_no_stall()
    check_cleaned(world, range(world.num_ranks), 1)
    for r in range(world.num_ranks):
        want = [int(r != slow and src == slow) for src in range(world.num_ranks)]
        assert world.mask(r).tolist() == want, f'rank {r}: mask {world.mask(r).tolist()}, expected {want}'
        world.mask(r).zero_()  # low_latency_clean_mask_buffer
    world.clean()
    world.check_no_stall()
    check_cleaned(world, range(world.num_ranks), 2)
    assert not any(world.mask(r).any() for r in range(world.num_ranks)), 'a rank was masked again'


def missed_clean_fails_safe(world, absent):
    """Shrink mode: `absent` skips a clean entirely, then takes part in the next ones. Its count
    stays behind, so the others never take it as arrived: after every low_latency_clean_mask_buffer
    + clean they mask it again (its own masks depend on timing, so they are not checked), and
    nothing is a stall."""
    present = [r for r in range(world.num_ranks) if r != absent]
    world.clean(present)
    for _ in range(2):
        for r in range(world.num_ranks):
            world.mask(r).zero_()
        world.clean()
        world.check_no_stall()
        for r in present:
            want = [int(src == absent) for src in range(world.num_ranks)]
            assert world.mask(r).tolist() == want, f'rank {r}: mask {world.mask(r).tolist()}, expected {want}'


def clean_cases():
    # name: (world kwargs, check, check kwargs)
    small = dict(num_ranks=4, num_experts=32, max_tokens=32, hidden=1024)
    return {
        'clean_r4_after_normal_mode': (small, clean_after_normal_mode,
                                       dict(seed=20, tokens=[32, 0, 5, 32], num_topk=8, modes=('bf16', 'fp8'))),
        'clean_r8_virtual_nodes_of_4': (dict(num_ranks=8, num_experts=64, max_tokens=16, hidden=2048, node_size=4),
                                        clean_after_normal_mode,
                                        dict(seed=21, tokens=16, num_topk=8, modes=('fp8_ue8m0', 'bf16'))),
        'clean_r32_after_normal_mode': (dict(num_ranks=32, num_experts=64, max_tokens=4, hidden=512, node_size=8),
                                        clean_after_normal_mode, dict(seed=22, tokens=4, num_topk=4, modes=('bf16',))),
        'clean_r4_uncleaned_halves_exact': ({**small, 'timeout_s': 0.3}, uncleaned_halves_exact,
                                            dict(seed=23, tokens=32, num_topk=8)),
        'clean_r4_waits_for_every_rank': (small, clean_waits_for_every_rank, dict(seed=24, tokens=32, num_topk=8)),
        'clean_r4_shrink_masks_absent_rank': ({**small, 'timeout_s': 0.3, 'shrink': True}, clean_without_a_rank,
                                              dict(absent=2)),
        'clean_r4_shrink_slow_rank_rejoins': ({**small, 'timeout_s': 0.3, 'shrink': True}, slow_rank_rejoins,
                                              dict(slow=1)),
        'clean_r4_shrink_missed_clean_fails_safe': ({**small, 'timeout_s': 0.3, 'shrink': True},
                                                    missed_clean_fails_safe, dict(absent=3)),
        'clean_r4_absent_rank_stalls': ({**small, 'timeout_s': 0.3}, clean_without_a_rank, dict(absent=1)),
    }


def cases():
    all_modes = tuple(MODES)
    # name: (world kwargs, round_trip kwargs)
    return {
        'r4_bench_shape_all_modes': (dict(num_ranks=4, num_experts=288, max_tokens=128, hidden=7168),
                                     dict(seed=1, tokens=128, num_topk=8, modes=all_modes, rounds=2)),
        'r4_uneven_tokens_int32_topk': (dict(num_ranks=4, num_experts=288, max_tokens=128, hidden=7168),
                                        dict(seed=2, tokens=[128, 0, 1, 77], num_topk=8, modes=('fp8', 'bf16'),
                                             topk_int32=True)),
        'r8_top16_holes': (dict(num_ranks=8, num_experts=64, max_tokens=64, hidden=2048),
                           dict(seed=3, tokens=[64, 1, 33, 0, 64, 5, 64, 17], num_topk=16, routing='holes',
                                modes=all_modes)),
        'r2_top1_skewed_h5120': (dict(num_ranks=2, num_experts=16, max_tokens=96, hidden=5120),
                                 dict(seed=4, tokens=96, num_topk=1, routing='skewed', modes=all_modes)),
        'r4_duplicate_experts_h6400': (dict(num_ranks=4, num_experts=32, max_tokens=40, hidden=6400),
                                       dict(seed=5, tokens=40, num_topk=8, routing='dupes',
                                            modes=('bf16', 'fp8', 'fp8_round'))),
        # H % 256 == 128: the combine receive's last 256-channel group is half a warp, both with one
        # group per item (T=5, 77) and with two (T=128: more items than warps).
        'r4_half_group_h7296': (dict(num_ranks=4, num_experts=32, max_tokens=128, hidden=7296),
                                dict(seed=13, tokens=[128, 5, 0, 77], num_topk=8, modes=('bf16', 'fp8', 'fp8_round'))),
        'r2_m1024_h1024': (dict(num_ranks=2, num_experts=16, max_tokens=1024, hidden=1024),
                           dict(seed=6, tokens=[1024, 700], num_topk=4, modes=('fp8', 'bf16'))),
        'r4_virtual_nodes_of_2': (dict(num_ranks=4, num_experts=288, max_tokens=128, hidden=7168, node_size=2),
                                  dict(seed=7, tokens=[128, 3, 64, 0], num_topk=8, modes=all_modes, rounds=2)),
        'r8_virtual_nodes_of_4_h2048': (dict(num_ranks=8, num_experts=256, max_tokens=32, hidden=2048, node_size=4),
                                        dict(seed=8, tokens=32, num_topk=8, routing='holes', modes=('fp8', 'bf16'))),
        # More than 8 sources: the receive reads the count messages in two passes.
        'r16_top8_h1024': (dict(num_ranks=16, num_experts=256, max_tokens=24, hidden=1024),
                           dict(seed=10, tokens=[24, 0, 7] * 5 + [24], num_topk=8, routing='holes',
                                modes=('fp8', 'bf16'))),
        'r32_virtual_nodes_of_8_h512': (dict(num_ranks=32, num_experts=64, max_tokens=8, hidden=512, node_size=8),
                                        dict(seed=11, tokens=8, num_topk=4, modes=('fp8_ue8m0', 'bf16'))),
        # Out-of-range expert ids (int64, one beyond 2**31) are skipped by dispatch and combine.
        'r4_invalid_ids': (dict(num_ranks=4, num_experts=64, max_tokens=32, hidden=1024),
                           dict(seed=12, tokens=[32, 5, 0, 32], num_topk=8, routing='invalid', modes=('fp8', 'bf16'))),
        'r4_small_grid': (dict(num_ranks=4, num_experts=288, max_tokens=128, hidden=7168, num_blocks=3),
                          dict(seed=9, tokens=128, num_topk=8, modes=('fp8_ue8m0', 'bf16'))),
    }


def main():
    checks = {name: (world_kw, round_trip, trip_kw) for name, (world_kw, trip_kw) in cases().items()}
    checks.update(clean_cases())
    return run_cases('test_ll_virtual_ranks', __doc__.split('\n')[0], checks)


if __name__ == '__main__':
    sys.exit(main())
