"""Low-latency (LL) mode on 2, 4 and all visible GPUs (up to 8) against the independent torch
reference in ll_reference.py, through the public deep_ep.Buffer API only.

The contract is docs/low_latency.md (deterministic row order, bit-exact FP8 and combine). Workers
run as DeepEP's tests do: default dtype BF16, default device CUDA, Buffers over dist.new_group, the
main Buffer sized by get_low_latency_rdma_size_hint(128, 7168, R, 288) with num_qps_per_rank=E/R.

Cases: DeepEP's own loop (rank-valued and random x, hook and not, BF16 / FP8 / round_scale /
UE8M0, 1 or 2 dispatches back to back, zero_copy, out=) with every DeepEP check; the exact
reference on every output; T 0/1/37/128 and uneven per rank; hidden 128/1536/2048/5120/6400/7168;
top-k 1/8/16; 288 and 256 experts; skewed, -1-heavy, all -1 and duplicate routings; two results in
flight; odd call counts; stats; events and hooks; stream order; LogFMT; kernels per call (profiler);
CUDA graphs; bad input; then, each on its own Buffer: virtual nodes, a too-small and a non-LL
buffer, mixing normal and LL mode, a subgroup of the last ranks, shrink mode, and (last, it
leaves its buffer unusable) a stalled peer without shrink.

With more than one expert output per token in play, expert g returns bf16(received row * a
per-expert factor), so the combine reference needs only local data; a few cases use random
expert outputs and the all-gathered reference instead. Checks are collected (common.Checks) so
that all ranks keep making the same collective calls.

Usage: PYTHONPATH=compat/python python tests/gpu/test_low_latency.py [--world 2 4] [-k REGEX]
(-k keeps the cases whose name matches; the main buffer is always created and destroyed.)"""
import argparse
import gc
import math
import os
import random
import re
import sys
import time
import weakref
from types import SimpleNamespace

os.environ.setdefault('DEEPEP_GPU_TIMEOUT_SECS', '30')  # before common's default of 60

import torch
import torch.distributed as dist

import deep_ep
from common import Checks, assert_same, destroy_after_stall, finish, ref_layout, skip, spawn, watchdog
from ll_reference import (FP8, MODES, bf16_ulp_distance, calc_diff, expert_scales, per_token_cast_back,
                          received_rows, ref_ll_combine, ref_ll_combine_local, ref_ll_dispatch, valid_rows)
from normal_reference import gather_rows, ref_combine, ref_dispatch

M = 128  # num_max_dispatch_tokens_per_rank, as DeepEP's test
MAIN_H = 7168
SMALL_H = 2048  # the hidden size of the cases on their own (smaller) buffers
RANK_OFFSET = 128  # DeepEP's rank-valued x: every row holds rank - 128 (exact in BF16)
ALL_MODES = tuple(MODES)  # bf16, fp8, fp8_round, fp8_ue8m0
BF16, F32, I32, I64 = torch.bfloat16, torch.float32, torch.int32, torch.int64
SPIN_CYCLES = 20_000_000  # ~10 ms of GPU time
STALLED_RANK = 1
SHRINK_TIMEOUT_MS = 2000
SHRINK_CASE = 'shrink_mask_api_rank1_fails_then_recovers'
STALL_CASE = 'stalled_peer_without_shrink_raises'
STALL_TIMEOUT_MS = 3000
VN_ENV = 'DEEPEP_VIRTUAL_NODE_SIZE'
X_NAMED = r'\bx\b'


# ---------------------------------------------------------------- setup
def expected_device():
    return torch.device('cuda', torch.cuda.current_device())


def experts_for(world, base):
    """base experts if the rank count divides it, else the next multiple of the rank count."""
    return base if base % world == 0 else world * math.ceil(base / world)


def make_ctx(group, rep):
    # As DeepEP's tests/utils.init_dist: tensors default to BF16 on the GPU.
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device('cuda')
    rank, world = group.rank(), group.size()
    return SimpleNamespace(group=group, rank=rank, world=world, rep=rep, rng=random.Random(7 + rank),
                           E=experts_for(world, 288), E256=experts_for(world, 256), shapes={}, main=None,
                           bad_inp=None)


def ll_buffer(ctx, m, hidden, num_experts, **kwargs):
    """DeepEP's LL Buffer: num_rdma_bytes from the hint, num_qps_per_rank = E / R."""
    num_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(m, hidden, ctx.world, num_experts)
    buf = deep_ep.Buffer(ctx.group, num_rdma_bytes=num_bytes, low_latency_mode=True,
                         num_qps_per_rank=num_experts // ctx.world, explicitly_destroy=True, **kwargs)
    ctx.shapes[buf] = (m, hidden, num_experts)
    return buf


def use_shape(ctx, buf, m, hidden, num_experts):
    """A buffer sized for the largest shape serves smaller ones; the LL signalling region moves
    with (M, H, E), so the buffer is cleaned (collectively) whenever the shape changes."""
    if ctx.shapes.get(buf) != (m, hidden, num_experts):
        buf.clean_low_latency_buffer(m, hidden, num_experts)
        ctx.shapes[buf] = (m, hidden, num_experts)


def destroy(ctx, buf):
    ctx.shapes.pop(buf, None)
    torch.cuda.synchronize()
    buf.destroy()


# ---------------------------------------------------------------- inputs
def make_topk(ctx, routing, num_tokens, num_topk, num_experts):
    """topk_idx [T, K] (deep_ep.topk_idx_t) for one routing pattern."""
    world, local = ctx.world, num_experts // ctx.world
    if routing in ('deepep', 'random'):
        scores = torch.randn(num_tokens, num_experts, dtype=F32).abs() + 1
        topk = torch.topk(scores, num_topk, dim=-1, largest=True, sorted=True).indices
        if routing == 'deepep' and num_tokens > 0:
            for _ in range(10):  # DeepEP's ten random -1 slots
                topk[ctx.rng.randint(0, num_tokens - 1), ctx.rng.randint(0, num_topk - 1)] = -1
            if num_tokens > 1:
                topk[num_tokens // 2] = -1  # and one token routed nowhere
    elif routing == 'skewed_expert':  # every token of every rank picks expert `hot` (on rank 1), at a random slot
        hot = local + 1 if world > 1 else 1
        scores = torch.rand(num_tokens, num_experts, dtype=F32) + 1
        scores[:, hot] = 10
        topk = torch.topk(scores, num_topk, dim=-1).indices
        topk = topk.gather(1, torch.rand(num_tokens, num_topk, dtype=F32).argsort(1))
    elif routing == 'skewed_rank':  # every slot on the last rank's experts: the others receive nothing
        topk = torch.rand(num_tokens, local, dtype=F32).argsort(1)[:, :num_topk] + (world - 1) * local
    elif routing == 'minus_one_heavy':
        topk = make_topk(ctx, 'random', num_tokens, num_topk, num_experts).long()
        topk[torch.rand(num_tokens, num_topk, dtype=F32) < 0.9] = -1
        topk[:num_tokens // 8] = -1
    elif routing == 'all_minus_one':
        topk = torch.full((num_tokens, num_topk), -1, dtype=I64)
    elif routing == 'duplicates':  # the same expert in several slots of a token: one row per (token, slot)
        topk = make_topk(ctx, 'random', num_tokens, num_topk, num_experts).long()
        if num_topk > 1:
            topk[:, 1] = topk[:, 0]
        topk[::3] = topk[::3, :1]
    else:
        raise ValueError(routing)
    return topk.to(deep_ep.topk_idx_t).contiguous()


def make_x(ctx, kind, num_tokens, hidden):
    if kind == 'rank':  # DeepEP: rank - 128 everywhere, the token index in the last 128 columns
        x = torch.ones(num_tokens, hidden, dtype=BF16) * (ctx.rank - RANK_OFFSET)
        x[:, -128:] = torch.arange(num_tokens).to(BF16).view(-1, 1)
        return x
    if kind == 'rand':  # DeepEP's x_pure_rand / perf tensor
        return torch.randn(num_tokens, hidden, dtype=BF16) * 0.1
    if kind == 'randn':
        return torch.randn(num_tokens, hidden, dtype=BF16)
    if kind == 'logfmt':  # DeepEP's LogFMT inputs: mostly |x| < 1
        return torch.randn(num_tokens, hidden, dtype=BF16) * 0.5 * ctx.rng.random()
    if kind == 'wide':  # 8 decades of block magnitudes, an all-zero block, a block below the 1e-4 clamp
        magnitude = 10 ** (torch.rand(num_tokens, hidden // 128, 1, dtype=F32) * 8 - 4)
        x = (torch.randn(num_tokens, hidden // 128, 128, dtype=F32) * magnitude).view(num_tokens, hidden).to(BF16)
        if num_tokens > 0:
            x[0, :128] = 0
        if num_tokens > 1 and hidden > 128:
            x[1, 128:256] = 1e-6
        return x
    raise ValueError(kind)


def make_inputs(ctx, T=None, H=None, K=8, E=None, routing='deepep', xkind='randn', m=None, topk_int32=False):
    """One rank's LL inputs plus every rank's x and topk_idx (collective: all-gathers). T (default
    M) may be a tuple of per-rank token counts (rank % len); H defaults to 7168, E to 288 ('256'
    for 256, both rounded up to a multiple of the rank count), m to M. topk_int32: the ops get
    int32 top-k ids (accepted beside DeepEP's int64), the reference int64."""
    T, H, m = M if T is None else T, MAIN_H if H is None else H, M if m is None else m
    E = ctx.E if E is None else (ctx.E256 if E == '256' else E)
    if isinstance(T, tuple):
        T = T[ctx.rank % len(T)]
    topk = make_topk(ctx, routing, T, K, E)
    x = make_x(ctx, xkind, T, H)
    weights = torch.randn(T, K, dtype=F32).abs()
    all_topk = gather_rows(topk, ctx.group)
    if topk_int32:
        topk = topk.to(I32)
    return SimpleNamespace(x=x, topk=topk, weights=weights, T=T, H=H, K=K, E=E, M=m, xkind=xkind, routing=routing,
                           all_x=gather_rows(x, ctx.group), all_topk=all_topk)


def with_x(inp, x):
    """inp with another payload (same routing), all_x updated by the caller."""
    return SimpleNamespace(**dict(vars(inp), x=x))


def reference(ctx, inp, mode, masked=()):
    fp8, round_scale, ue8m0 = MODES[mode]
    return ref_ll_dispatch(inp.all_x, inp.all_topk, ctx.rank, inp.E, inp.M, fp8, round_scale, ue8m0,
                           masked_ranks=masked)


# ---------------------------------------------------------------- calls
def ll_dispatch(buf, inp, mode, hook=False, async_=False, stats=None, wait_stats=None, x=None, topk=None):
    fp8, round_scale, ue8m0 = MODES[mode]
    return buf.low_latency_dispatch(inp.x if x is None else x, inp.topk if topk is None else topk, inp.M, inp.E,
                                    cumulative_local_expert_recv_stats=stats, dispatch_wait_recv_cost_stats=wait_stats,
                                    use_fp8=fp8, round_scale=round_scale, use_ue8m0=ue8m0, async_finish=async_,
                                    return_recv_hook=hook)


def ll_combine(buf, inp, y, handle, hook=False, async_=False, zero_copy=False, logfmt=False, out=None, wait_stats=None,
               weights=None):
    return buf.low_latency_combine(y, inp.topk, inp.weights if weights is None else weights, handle,
                                   use_logfmt=logfmt, zero_copy=zero_copy, async_finish=async_,
                                   return_recv_hook=hook, out=out, combine_wait_recv_cost_stats=wait_stats)


def complete(result, hook, async_):
    """Makes an LL call's results usable: run its receive hook, or wait on its event."""
    if hook:
        if callable(result[-1]):
            result[-1]()
    elif async_ and result[-2].event is not None:
        result[-2].current_stream_wait()


def dequant(recv_x):
    return per_token_cast_back(*recv_x) if isinstance(recv_x, tuple) else recv_x


def expert_output(ctx, inp, recv_x, y_kind):
    """What the experts return, [E_l, R*M, H] BF16: 'deq' DeepEP's simulated GEMM (the received
    rows, dequantised), 'expert' those rows times a per-expert factor, 'random' noise."""
    local = inp.E // ctx.world
    if y_kind == 'deq':
        return dequant(recv_x).clone()
    if y_kind == 'expert':
        factor = expert_scales(inp.E, inp.x.device)[ctx.rank * local:(ctx.rank + 1) * local]
        return (dequant(recv_x).float() * factor.view(-1, 1, 1)).to(BF16)
    if y_kind == 'random':
        return torch.randn(local, ctx.world * inp.M, inp.H, dtype=BF16)
    raise ValueError(y_kind)


def combine_reference(ctx, inp, mode, y_kind, y, ref, decode=None, masked=()):
    """The combined [T, H] this rank must get. 'deq'/'expert' need only local data; 'random'
    all-gathers every rank's valid rows (collective)."""
    fp8, round_scale, _ = MODES[mode]
    if y_kind in ('deq', 'expert'):
        rows = received_rows(inp.x, fp8, round_scale)
        scales = expert_scales(inp.E, inp.x.device) if y_kind == 'expert' else None
        return ref_ll_combine_local(rows, inp.topk, inp.weights, inp.E, ctx.world, scales, masked, decode)
    all_rows = gather_rows(valid_rows(y, ref.count), ctx.group)
    return ref_ll_combine(all_rows, inp.all_topk, ctx.rank, inp.weights, inp.E, inp.M, masked, decode,
                          layout=ref.layout)


def logfmt_decoders(hidden):
    """[(name, decode rows)] from logfmt_reference.logfmt_roundtrip (a separate module; [] when
    absent): DeepEP V1's chunked log-or-BF16 decision first, then the per-block decision."""
    try:
        import logfmt_reference as lf
    except ImportError:
        return []
    out = []
    if hasattr(lf, 'deepep_decision_blocks'):
        blocks = lf.deepep_decision_blocks(hidden)
        out.append((f'decision per {blocks} blocks (DeepEP V1)', lambda rows: lf.logfmt_roundtrip(rows, blocks)))
    out.append(('decision per block', lambda rows: lf.logfmt_roundtrip(rows)))
    return out


# ---------------------------------------------------------------- checks (raise AssertionError)
def check_tensor(name, t, dtype, shape):
    assert isinstance(t, torch.Tensor), f'{name} is {type(t).__name__}, not a tensor'
    assert t.dtype == dtype, f'{name} dtype {t.dtype}, expected {dtype}'
    assert tuple(t.shape) == tuple(shape), f'{name} shape {tuple(t.shape)}, expected {tuple(shape)}'
    assert t.device == expected_device(), f'{name} on {t.device}, expected {expected_device()}'


def check_strides(name, t, want):
    """Strides equal where the dimension has more than one element (others are arbitrary)."""
    got = [s for s, n in zip(t.stride(), t.shape) if n > 1]
    exp = [s for s, n in zip(want, t.shape) if n > 1]
    assert got == exp, f'{name} strides {t.stride()}, expected {tuple(want)}'


def check_event(what, event, is_async):
    assert isinstance(event, deep_ep.EventOverlap), f'{what}: returned {type(event).__name__}, not EventOverlap'
    assert (event.event is not None) == is_async, f'{what}: event.event is {event.event!r} with async_finish={is_async}'
    if is_async:  # DeepEP keeps the call's tensors alive through the event (record_stream stand-in)
        assert isinstance(event.extra_tensors, tuple) and event.extra_tensors, \
            f'{what}: async EventOverlap.extra_tensors is {event.extra_tensors!r}'


def check_hook(what, fn, hook):
    if hook:
        assert callable(fn), f'{what}: hook is {fn!r} with return_recv_hook=True'
    else:
        assert fn is None, f'{what}: hook is {fn!r} without return_recv_hook'


def check_dispatch_structure(out, inp, mode, hook, is_async, world):
    """Arity, dtypes, shapes, strides and the handle of a low_latency_dispatch result."""
    fp8, _, ue8m0 = MODES[mode]
    assert isinstance(out, tuple) and len(out) == 5, f'low_latency_dispatch returned {type(out).__name__} ' \
                                                     f'of {len(out) if isinstance(out, tuple) else "?"}'
    recv_x, count, handle, event, hook_fn = out
    check_event('low_latency_dispatch', event, is_async)
    check_hook('low_latency_dispatch', hook_fn, hook)
    local, rows, hidden = inp.E // world, world * inp.M, inp.H
    if fp8:
        assert isinstance(recv_x, tuple) and len(recv_x) == 2, f'FP8 recv_x is {type(recv_x).__name__}, not a 2-tuple'
        data, scales = recv_x
        check_tensor('packed_recv_x', data, FP8, (local, rows, hidden))
        s = hidden // 512 if ue8m0 else hidden // 128
        check_tensor('packed_recv_x_scales', scales, I32 if ue8m0 else F32, (local, rows, s))
        check_strides('packed_recv_x_scales', scales, (s * rows, 1, rows))
    else:
        assert isinstance(recv_x, torch.Tensor), f'BF16 recv_x is {type(recv_x).__name__}, not a tensor'
        data = recv_x
        check_tensor('packed_recv_x', data, BF16, (local, rows, hidden))
    assert data.is_contiguous(), f'packed_recv_x strides {data.stride()}: must be contiguous'
    check_tensor('packed_recv_count', count, I32, (local,))
    assert isinstance(handle, tuple) and len(handle) == 5, \
        f'handle is {type(handle).__name__} of {len(handle) if isinstance(handle, tuple) else "?"}, not a 5-tuple'
    check_tensor('handle[0] src_info', handle[0], I32, (local, rows))
    check_tensor('handle[1] layout_range', handle[1], I64, (local, world))
    assert tuple(handle[2:]) == (inp.M, inp.H, inp.E) and all(type(v) is int for v in handle[2:]), \
        f'handle[2:] = {handle[2:]!r}, expected (M, hidden, num_experts) = {(inp.M, inp.H, inp.E)}'


def check_valid(name, got, want, valid):
    """Rows [0, count) of each local expert equal (torch.equal; FP8 as bytes)."""
    if got.dtype == FP8:
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    a, b = got[valid], want[valid]
    if torch.equal(a, b):
        return
    bad = (a != b).reshape(a.size(0), -1).any(1)
    first = int(bad.nonzero()[0])
    expert, row = valid.nonzero()[first].tolist()
    raise AssertionError(f'{name}: {int(bad.sum())} of {a.size(0)} valid rows differ from the reference, '
                         f'first at [local expert {expert}, row {row}]')


def check_dispatch_values(out, ref):
    """Every output against the reference: counts, layout_range (all entries), and the valid
    rows of src_info, packed_recv_x and its scales (bit-exact)."""
    recv_x, count, handle = out[0], out[1], out[2]
    data, scales = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
    assert_same('packed_recv_count', count, ref.count)
    assert_same('handle[1] layout_range', handle[1], ref.layout_range)
    check_valid('handle[0] src_info', handle[0], ref.src_info, ref.valid)
    check_valid('packed_recv_x', data, ref.x, ref.valid)
    if scales is not None:
        check_valid('packed_recv_x_scales', scales, ref.x_scales, ref.valid)


def check_combined(name, got, want, rep):
    """Bit-exact, or at most 1 BF16 ulp on any element (reported)."""
    assert got.dtype == BF16 and got.shape == want.shape, f'{name}: {got.dtype} {tuple(got.shape)}'
    if torch.equal(got, want):
        return
    dist_ulp = bf16_ulp_distance(got, want)
    worst, differ = int(dist_ulp.max()), int((dist_ulp > 0).sum())
    if worst <= 1:
        rep.info(f'{name}: not bit-exact: {differ} of {got.numel()} elements differ by 1 BF16 ulp (allowed)')
        return
    at = tuple((dist_ulp == worst).nonzero()[0].tolist())
    raise AssertionError(f'{name}: {differ} of {got.numel()} elements differ, up to {worst} BF16 ulp, e.g. at '
                         f'{list(at)}: got {got[at].item()}, expected {want[at].item()}')


def check_combined_any(name, got, candidates, rep):
    """check_combined against the first of several (label, reference thunk) that fits."""
    errors = []
    for i, (label, want) in enumerate(candidates):
        try:
            check_combined(f'{name} [{label}]', got, want(), rep)
            if i:
                rep.info(f'{name}: matches the LogFMT reference with {label}, not {candidates[0][0]}')
            return label
        except AssertionError as e:
            errors.append(str(e))
    raise AssertionError(' | '.join(errors))


def check_combine_structure(res, inp, hook, is_async, target):
    assert isinstance(res, tuple) and len(res) == 3, f'low_latency_combine returned {type(res).__name__} ' \
                                                     f'of {len(res) if isinstance(res, tuple) else "?"}'
    combined, event, hook_fn = res
    check_event('low_latency_combine', event, is_async)
    check_hook('low_latency_combine', hook_fn, hook)
    check_tensor('combined_x', combined, BF16, (inp.T, inp.H))
    assert combined.is_contiguous(), f'combined_x strides {combined.stride()}'
    if target is not None and inp.T > 0:
        assert combined.data_ptr() == target.data_ptr(), 'combined_x is not the out= tensor'


def check_combine_buffer_view(view, inp, world):
    """get_next_low_latency_combine_buffer: BF16 [E_l, R*M, H], strides (R*M*S, S, 1), S = H + H/64."""
    local, rows, hidden = inp.E // world, world * inp.M, inp.H
    check_tensor('get_next_low_latency_combine_buffer', view, BF16, (local, rows, hidden))
    slot = hidden + hidden // 64
    check_strides('get_next_low_latency_combine_buffer', view, (rows * slot, slot, 1))


def deepep_dispatch_checks(ctx, inp, out, stats, round_scale):
    """DeepEP's own per-expert checks (tests/test_low_latency.py), on this rank's local experts:
    cumulative stats == recv_count == sum(layout_range & 0xffffffff) == global top-k count; with
    the rank-valued x: rows constant outside the last 128 columns, those columns == src_info (or
    calc_diff < 0.007 with round_scale), and each (begin, count) block holds its source's value."""
    world, local = ctx.world, inp.E // ctx.world
    first = ctx.rank * local
    recv_x, count, handle = out[0], out[1], out[2]
    src_info, ranges = handle[0], handle[1]
    per_src = torch.stack([torch.bincount(t[t >= 0].long(), minlength=inp.E)[first:first + local]
                           for t in inp.all_topk])  # [R, E_l]
    counts, totals = count.tolist(), per_src.sum(0).tolist()
    ranges_l = ranges.tolist()
    stat = stats.tolist() if stats is not None else counts
    mask32 = (1 << 32) - 1
    for i in range(local):
        low = sum(v & mask32 for v in ranges_l[i])
        assert stat[i] == counts[i] == low == totals[i], \
            f'local expert {i}: cumulative stats {stat[i]}, recv_count {counts[i]}, ' \
            f'sum(layout_range & 0xffffffff) {low}, global top-k count {totals[i]} must all be equal'
    if inp.xkind != 'rank':
        return
    deq = dequant(recv_x)
    rows = deq.size(1)
    valid = torch.arange(rows).unsqueeze(0) < count.unsqueeze(1)
    body, tail = deq[:, :, :-128], deq[:, :, -128:]
    amin, amax = body.amin(-1), body.amax(-1)
    assert torch.equal(amin[valid], amax[valid]), 'received rows are not constant outside the last 128 columns'
    if round_scale:
        for i in range(local):
            if counts[i]:
                diff = calc_diff(deq[i, :counts[i], -1], src_info[i, :counts[i]])
                assert diff < 0.007, f'local expert {i}: calc_diff(last column, src_info) = {diff} >= 0.007'
        return
    assert bool((tail[valid].float() == src_info[valid].unsqueeze(1).float()).all()), \
        'last 128 columns != src_info (the source token index)'
    owner = torch.full((local, rows), -1, dtype=I64, device='cpu')
    for i in range(local):
        for j in range(world):
            begin, n = ranges_l[i][j] >> 32, ranges_l[i][j] & mask32
            owner[i, begin:begin + n] = j
    owner = owner.to(count.device)
    assert torch.equal(amin[valid].float(), (owner[valid] - RANK_OFFSET).float()), \
        'a (begin, count) block of layout_range holds rows of another source rank'
    for j in range(world):
        got = ((amin == j - RANK_OFFSET) & valid).sum(1)
        assert torch.equal(got, per_src[j]), f'rows valued {j - RANK_OFFSET} per expert {got.tolist()} ' \
                                             f'!= rank {j} top-k counts {per_src[j].tolist()}'


def deepep_combine_check(inp, combined, fp8, round_scale, logfmt):
    """DeepEP: no NaN, calc_diff(x * sum of valid weights, combined) < 9e-4 (FP8 or LogFMT) /
    1e-5 (BF16), skipped with round_scale. Valid when the experts return the received rows."""
    assert not bool(torch.isnan(combined).any()), 'combined_x has NaN'
    if round_scale:
        return
    weight_sum = inp.weights.masked_fill(inp.topk == -1, 0).sum(dim=1).view(-1, 1)
    diff = calc_diff(inp.x * weight_sum, combined)
    limit = 9e-4 if (fp8 or logfmt) else 1e-5
    assert diff < limit, f'calc_diff(x * sum(w), combined_x) = {diff} >= {limit} (fp8={fp8}, logfmt={logfmt})'


# ---------------------------------------------------------------- one dispatch + combine round
def one_round(ctx, buf, inp, mode, chk, hook=False, async_=None, y_kind='expert', zero_copy=(False,), repeats=1,
              deepep=False, logfmt=False, use_out=True, stats=True, ref=None):
    """Dispatch (repeats times, each checked), then combine (once per zero_copy value) with the
    experts' output y; returns the outputs. async_ defaults to DeepEP's `not hook`."""
    fp8, round_scale, _ = MODES[mode]
    async_ = (not hook) if async_ is None else async_
    use_shape(ctx, buf, inp.M, inp.H, inp.E)
    ref = ref or reference(ctx, inp, mode)
    local = inp.E // ctx.world
    for _ in range(repeats):
        st = torch.zeros(local, dtype=I32) if stats else None
        out = ll_dispatch(buf, inp, mode, hook, async_, stats=st)
        chk(check_dispatch_structure, out, inp, mode, hook, async_, ctx.world)
        complete(out, hook, async_)
        chk(check_dispatch_values, out, ref)
        if st is not None:
            chk(assert_same, 'cumulative_local_expert_recv_stats', st, ref.count)
    if deepep:
        chk(deepep_dispatch_checks, ctx, inp, out, st, round_scale)
    chk.agree(ctx.group)

    y = expert_output(ctx, inp, out[0], y_kind)
    if logfmt:  # local references only: they are tried lazily, rank by rank
        assert y_kind in ('deq', 'expert'), 'LogFMT references need expert outputs derived from the received rows'
        want = None
        candidates = [(label, lambda d=d: combine_reference(ctx, inp, mode, y_kind, y, ref, d))
                      for label, d in logfmt_decoders(inp.H)]
    else:
        want = combine_reference(ctx, inp, mode, y_kind, y, ref)
    results = {}
    for zc in zero_copy:
        if zc:
            view = buf.get_next_low_latency_combine_buffer(out[2])
            chk(check_combine_buffer_view, view, inp, ctx.world)
            chk.agree(ctx.group)
            view[:, :, :] = y
        target = torch.empty(inp.T, inp.H, dtype=BF16) if use_out else None
        res = ll_combine(buf, inp, y, out[2], hook, async_, zero_copy=zc, logfmt=logfmt, out=target)
        chk(check_combine_structure, res, inp, hook, async_, target)
        complete(res, hook, async_)
        label = f'combined_x ({mode}, hook={hook}, zero_copy={zc}{", logfmt" if logfmt else ""})'
        if want is not None:
            chk(check_combined, label, res[0], want, ctx.rep)
        elif candidates:
            chk(check_combined_any, label, res[0], candidates, ctx.rep)
        if (deepep or logfmt) and y_kind == 'deq':
            chk(deepep_combine_check, inp, res[0], fp8, round_scale, logfmt)
        results[zc] = res[0]
    if len(results) == 2:
        chk(assert_same, 'zero_copy combine vs copying combine of the same data', results[True], results[False])
    return SimpleNamespace(out=out, ref=ref, y=y, combined=results)


# ---------------------------------------------------------------- cases on the main buffer
def deepep_loop(ctx, xkind, hook):
    """DeepEP's test_main loop for one x and one hook setting: every mode, 2 then 1 dispatches
    back to back (both halves), every DeepEP check plus the exact reference, combine of the
    dequantised rows with zero_copy False and True into out=."""
    inp = make_inputs(ctx, xkind=xkind)
    chk = Checks()
    for i, mode in enumerate(ALL_MODES):
        one_round(ctx, ctx.main, inp, mode, chk, hook=hook, y_kind='deq', zero_copy=(False, True),
                  repeats=2 if i % 2 == 0 else 1, deepep=True)
    chk.done()


def generic(ctx, modes=('bf16', 'fp8'), hooks=(False,), y_kind='expert', zero_copy=(False,), use_out=True,
            deepep=False, **inputs):
    inp = make_inputs(ctx, **inputs)
    chk = Checks()
    for mode in modes:
        for hook in hooks:
            one_round(ctx, ctx.main, inp, mode, chk, hook=hook, y_kind=y_kind, zero_copy=zero_copy, use_out=use_out,
                      deepep=deepep)
    chk.done()


FP8_MODES = ('fp8', 'fp8_round', 'fp8_ue8m0')
GENERIC = {
    # token counts (M = 128)
    'T0_H2048': dict(T=0, H=2048, hooks=(False, True)),
    'T1_H7168_all_modes': dict(T=1, modes=ALL_MODES, hooks=(False, True)),
    'T37_lt_M_H7168_all_modes': dict(T=37, modes=ALL_MODES, xkind='rank', deepep=True),
    'T_uneven_128_0_37_1_H5120': dict(T=(128, 0, 37, 1), H=5120, modes=ALL_MODES, hooks=(False, True)),
    'M32_T32_H2048': dict(T=32, H=2048, m=32),
    # hidden sizes
    'hidden2048_all_modes': dict(H=2048, modes=ALL_MODES, hooks=(False, True)),
    'hidden5120_all_modes': dict(H=5120, modes=ALL_MODES),
    'hidden1536_all_modes': dict(H=1536, modes=ALL_MODES),
    'hidden6400_not_multiple_of_512': dict(H=6400, modes=('bf16', 'fp8', 'fp8_round'), hooks=(False, True)),
    'hidden128': dict(H=128, modes=('bf16', 'fp8', 'fp8_round')),
    'fp8_wide_values_and_zero_blocks': dict(xkind='wide', modes=FP8_MODES),
    # top-k and experts
    'topk1': dict(K=1, modes=ALL_MODES),
    'topk16': dict(K=16, modes=('bf16', 'fp8_ue8m0'), hooks=(False, True)),
    'topk16_T37_H2048_zero_copy': dict(K=16, T=37, H=2048, zero_copy=(False, True)),
    'topk_idx_int32': dict(topk_int32=True, modes=('bf16', 'fp8'), hooks=(False, True), zero_copy=(False, True)),
    'experts256_all_modes': dict(E='256', modes=ALL_MODES, hooks=(False, True)),
    'experts256_rank_valued_deepep_checks': dict(E='256', xkind='rank', modes=ALL_MODES, y_kind='deq', deepep=True),
    # more than 512 (expert, source) blocks: combine's block-wide scan of the handle takes several rounds
    'experts1152_M16_T16_H1024': dict(E=1152, T=16, H=1024, m=16, modes=('bf16', 'fp8'), hooks=(False, True)),
    # routings
    'skewed_one_expert_gets_every_token': dict(routing='skewed_expert', modes=('bf16', 'fp8'), hooks=(False, True)),
    'skewed_one_rank_gets_everything': dict(routing='skewed_rank', modes=('bf16', 'fp8_ue8m0'), xkind='rank',
                                            deepep=True, y_kind='deq'),
    'minus_one_heavy': dict(routing='minus_one_heavy', modes=('bf16', 'fp8')),
    'all_minus_one': dict(routing='all_minus_one', H=2048, hooks=(False, True), zero_copy=(False, True)),
    'duplicate_experts_T16': dict(routing='duplicates', T=16, H=2048, modes=('bf16', 'fp8')),
    # expert outputs and out=
    'random_expert_outputs_gathered_reference': dict(y_kind='random', modes=('bf16', 'fp8'), zero_copy=(False, True)),
    'random_expert_outputs_hook_topk16': dict(y_kind='random', K=16, H=2048, hooks=(True,)),
    'combine_without_out': dict(use_out=False, hooks=(False, True)),
}


def in_flight(ctx, hook):
    """Two results in flight (both buffer halves): dispatch A, dispatch B, combine A, combine B.
    Without hooks all four are async and waited for only at the end; with hooks each receive
    hook runs before the next call (a send phase clears the other half's signals)."""
    buf = ctx.main
    a = make_inputs(ctx, xkind='randn')
    b = make_inputs(ctx, T=77, routing='random', xkind='wide')
    (mode_a, ref_a), (mode_b, ref_b) = ('bf16', reference(ctx, a, 'bf16')), ('fp8', reference(ctx, b, 'fp8'))
    use_shape(ctx, buf, M, MAIN_H, ctx.E)
    chk = Checks()
    async_ = not hook
    if hook:
        da = ll_dispatch(buf, a, mode_a, hook=True)
        da[4]()
        db = ll_dispatch(buf, b, mode_b, hook=True)
        db[4]()
    else:
        da = ll_dispatch(buf, a, mode_a, async_=True)
        db = ll_dispatch(buf, b, mode_b, async_=True)
        da[3].current_stream_wait()
        db[3].current_stream_wait()
    chk(check_dispatch_structure, da, a, mode_a, hook, async_, ctx.world)
    chk(check_dispatch_structure, db, b, mode_b, hook, async_, ctx.world)
    chk(check_dispatch_values, da, ref_a)
    chk(check_dispatch_values, db, ref_b)
    chk.agree(ctx.group)
    ya, yb = expert_output(ctx, a, da[0], 'expert'), expert_output(ctx, b, db[0], 'expert')
    want_a = combine_reference(ctx, a, mode_a, 'expert', ya, ref_a)
    want_b = combine_reference(ctx, b, mode_b, 'expert', yb, ref_b)
    if hook:
        ca = ll_combine(buf, a, ya, da[2], hook=True)
        ca[2]()
        cb = ll_combine(buf, b, yb, db[2], hook=True)
        cb[2]()
    else:
        ca = ll_combine(buf, a, ya, da[2], async_=True)
        cb = ll_combine(buf, b, yb, db[2], async_=True)
        ca[1].current_stream_wait()
        cb[1].current_stream_wait()
    chk(check_combined, 'combine A (after dispatch B)', ca[0], want_a, ctx.rep)
    chk(check_combined, 'combine B', cb[0], want_b, ctx.rep)
    chk.done()


def odd_calls(ctx):
    """One dispatch whose result is dropped, so that the following dispatch + combine pairs run
    with the halves swapped (each combine on the half its dispatch used one call before), then
    three dispatches in a row before a combine of the last: every result exact."""
    inp = make_inputs(ctx, routing='random', xkind='randn')
    other = make_inputs(ctx, T=64, xkind='wide')
    chk = Checks()
    use_shape(ctx, ctx.main, M, MAIN_H, ctx.E)

    def lone_dispatch(mode, hook):
        ref = reference(ctx, inp, mode)
        out = ll_dispatch(ctx.main, inp, mode, hook, not hook)
        complete(out, hook, not hook)
        chk(check_dispatch_values, out, ref)

    lone_dispatch('bf16', False)
    one_round(ctx, ctx.main, inp, 'fp8_ue8m0', chk)
    one_round(ctx, ctx.main, other, 'fp8_round', chk, hook=True)
    lone_dispatch('fp8', True)
    lone_dispatch('bf16', False)
    one_round(ctx, ctx.main, other, 'bf16', chk)
    chk.done()


def check_wait_stats(name, now, before, world):
    check_tensor(name, now, I64, (world,))
    assert bool((now >= before).all()), f'{name} decreased: {before.tolist()} -> {now.tolist()}'
    assert bool((now >= 0).all()), f'{name} negative: {now.tolist()}'


def stats_accumulate(ctx):
    """cumulative_local_expert_recv_stats (int32 [E_l]) += received counts; dispatch/combine
    wait-cost stats (int64 [R]) only grow and stay >= 0; all updated in place, hook or not."""
    buf, world, local = ctx.main, ctx.world, ctx.E // ctx.world
    inp = make_inputs(ctx)
    cum = torch.randint(0, 100, (local,), dtype=I32)
    expected = cum.clone()
    dw, cw = torch.full((world,), 5, dtype=I64), torch.full((world,), 7, dtype=I64)
    ptrs = (cum.data_ptr(), dw.data_ptr(), cw.data_ptr())
    use_shape(ctx, buf, M, MAIN_H, ctx.E)
    chk = Checks()
    for mode, hook in (('bf16', False), ('fp8', True), ('fp8_ue8m0', False)):
        ref = reference(ctx, inp, mode)
        before = dw.clone()
        out = ll_dispatch(buf, inp, mode, hook, not hook, stats=cum, wait_stats=dw)
        complete(out, hook, not hook)
        chk(check_dispatch_values, out, ref)
        expected += ref.count
        chk(assert_same, f'cumulative_local_expert_recv_stats after {mode} (accumulated)', cum, expected)
        chk(check_wait_stats, 'dispatch_wait_recv_cost_stats', dw, before, world)
        chk.agree(ctx.group)
        y = expert_output(ctx, inp, out[0], 'expert')
        want = combine_reference(ctx, inp, mode, 'expert', y, ref)
        before = cw.clone()
        res = ll_combine(buf, inp, y, out[2], hook, not hook, wait_stats=cw)
        complete(res, hook, not hook)
        chk(check_combined, f'combined_x ({mode}, with stats)', res[0], want, ctx.rep)
        chk(check_wait_stats, 'combine_wait_recv_cost_stats', cw, before, world)
    chk(check_tensor, 'cumulative_local_expert_recv_stats', cum, I32, (local,))
    chk.expect((cum.data_ptr(), dw.data_ptr(), cw.data_ptr()) == ptrs, 'a stats tensor was replaced, not updated')
    if ctx.rank == 0:
        ctx.rep.info(f'wait cycles after 3 rounds: dispatch {(dw - 5).tolist()}, combine {(cw - 7).tolist()}')
    chk.done()


def events_and_hooks(ctx):
    """Synchronous calls: event.event None, hook None, results ready at return. async_finish:
    an event with extra_tensors, usable as `with event:` and current_stream_wait(). Hook mode:
    no event, a callable hook, data after hook()."""
    buf = ctx.main
    inp = make_inputs(ctx)
    ref = reference(ctx, inp, 'fp8')
    use_shape(ctx, buf, M, MAIN_H, ctx.E)
    chk = Checks()
    outs = {}
    for variant, hook, async_ in (('sync', False, False), ('async', False, True), ('hook', True, False)):
        out = ll_dispatch(buf, inp, 'fp8', hook, async_)
        chk(check_dispatch_structure, out, inp, 'fp8', hook, async_, ctx.world)
        if variant == 'async':
            with out[3] as event:
                chk.expect(event is out[3], 'EventOverlap.__enter__ must return the event itself')
        elif variant == 'hook':
            out[4]()
        chk(check_dispatch_values, out, ref)
        outs[variant] = out
    chk.agree(ctx.group)
    for variant, hook, async_ in (('sync', False, False), ('async', False, True), ('hook', True, False)):
        out = outs[variant]
        y = expert_output(ctx, inp, out[0], 'expert')
        want = combine_reference(ctx, inp, 'fp8', 'expert', y, ref)
        res = ll_combine(buf, inp, y, out[2], hook, async_)
        chk(check_combine_structure, res, inp, hook, async_, None)
        if variant == 'async':
            res[1].current_stream_wait()
        elif variant == 'hook':
            res[2]()
        chk(check_combined, f'combined_x ({variant})', res[0], want, ctx.rep)
    chk.done()


def hook_keeps_tensors(ctx):
    """As DeepEP's hook (a C++ closure holding the op's tensors), the receive hook keeps the op's
    tensors alive: a caller may drop every other reference before hook(), and dropping the hook
    frees them."""
    buf = ctx.main
    inp = make_inputs(ctx)
    ref = reference(ctx, inp, 'fp8')
    use_shape(ctx, buf, M, MAIN_H, ctx.E)
    chk = Checks()
    out = ll_dispatch(buf, inp, 'fp8', hook=True)
    (x, scales), count, (src_info, layout_range, *shape), _, hook = out
    weak = [weakref.ref(t) for t in (x, scales, count, src_info, layout_range)]
    del out, x, scales, count, src_info, layout_range
    gc.collect()
    chk.expect(all(w() is not None for w in weak), 'the dispatch hook must keep its outputs alive')
    hook()
    x, scales, count, src_info, layout_range = (w() for w in weak)
    handle = (src_info, layout_range, *shape)
    chk(check_dispatch_values, ((x, scales), count, handle), ref)
    y = expert_output(ctx, inp, (x, scales), 'expert')
    want = combine_reference(ctx, inp, 'fp8', 'expert', y, ref)
    del x, scales, count, hook
    gc.collect()
    chk.expect(weak[0]() is None and weak[2]() is None, 'dropping the dispatch hook must free recv_x and count')
    chk.agree(ctx.group)
    res = ll_combine(buf, inp, y, handle, hook=True)
    combined, hook = res[0], res[2]
    weak_combined = weakref.ref(combined)
    del res, combined, y
    gc.collect()
    chk.expect(weak_combined() is not None, 'the combine hook must keep combined_x alive')
    hook()
    chk(check_combined, 'combined_x (hook, every other reference dropped)', weak_combined(), want, ctx.rep)
    del hook
    gc.collect()
    chk.expect(weak_combined() is None, 'dropping the combine hook must free combined_x')
    chk.done()


def delayed(tensor, value):
    """Copies value into tensor behind ~10 ms of GPU work on the current stream."""
    torch.cuda._sleep(SPIN_CYCLES)
    tensor.copy_(value)


def stream_order(ctx):
    """LL calls see work queued before them on the current stream: x, topk_weights and the
    expert outputs are written by a delayed copy just before each call (sync, async, hook)."""
    buf = ctx.main
    use_shape(ctx, buf, M, MAIN_H, ctx.E)
    chk = Checks()
    for variant, hook, async_ in (('sync', False, False), ('async', False, True), ('hook', True, False)):
        inp = make_inputs(ctx)
        ref = reference(ctx, inp, 'bf16')
        stale = with_x(inp, torch.randn(inp.T, inp.H, dtype=BF16))
        delayed(stale.x, inp.x)
        out = ll_dispatch(buf, stale, 'bf16', hook, async_)
        complete(out, hook, async_)
        chk(check_dispatch_values, out, ref)
        chk.agree(ctx.group)
        y = expert_output(ctx, inp, out[0], 'expert')
        want = combine_reference(ctx, inp, 'bf16', 'expert', y, ref)
        y_stale, w_stale = torch.randn_like(y), torch.rand_like(inp.weights)
        delayed(y_stale, y)
        w_stale.copy_(inp.weights)
        res = ll_combine(buf, inp, y_stale, out[2], hook, async_, weights=w_stale)
        complete(res, hook, async_)
        chk(check_combined, f'combined_x after a delayed copy ({variant})', res[0], want, ctx.rep)
    chk.done()


def logfmt_combine(ctx):
    """use_logfmt=True as DeepEP's --use-logfmt run: rank-valued and LogFMT-style x, BF16 and FP8
    dispatch, hook or not; DeepEP's tolerance always, and logfmt_reference (if present) within
    1 BF16 ulp with either of its log-or-BF16 decision rules (the one that fits is reported)."""
    if not logfmt_decoders(MAIN_H) and ctx.rank == 0:
        ctx.rep.info('tests/gpu/logfmt_reference.py not found: LogFMT combine checked with DeepEP tolerance only')
    chk = Checks()
    for xkind in ('rank', 'logfmt', 'rand'):
        inp = make_inputs(ctx, xkind=xkind)
        for mode, hook in (('bf16', False), ('fp8', True)):
            one_round(ctx, ctx.main, inp, mode, chk, hook=hook, y_kind='deq', logfmt=True)
    chk.done()


def kernels_per_call(ctx):
    """Profiler: a dispatch + combine launches exactly one kernel whose name contains '::dispatch'
    and one with '::combine' (twice each in hook mode: send, then hook()), one distinct name
    each (DeepEP's bench_kineto needs exactly one matching line), and no other kernel."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    buf = ctx.main
    inp = make_inputs(ctx)
    local = ctx.E // ctx.world
    y = torch.randn(local, ctx.world * M, MAIN_H, dtype=BF16)
    target = torch.empty(inp.T, inp.H, dtype=BF16)
    stats = torch.zeros(local, dtype=I32)
    dw, cw = torch.zeros(ctx.world, dtype=I64), torch.zeros(ctx.world, dtype=I64)
    use_shape(ctx, buf, M, MAIN_H, ctx.E)

    def pair(hook):
        out = ll_dispatch(buf, inp, 'fp8', hook, stats=stats, wait_stats=dw)
        if hook:
            out[4]()
        res = ll_combine(buf, inp, y, out[2], hook, out=target, wait_stats=cw)
        if hook:
            res[2]()

    for hook in (False, True):  # warm-up: lazy module loading and allocations outside the profile
        pair(hook)
    torch.cuda.synchronize()
    chk = Checks()
    for hook in (False, True):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            pair(hook)
            torch.cuda.synchronize()
        kernels, copies = [], []
        for e in prof.events():
            if e.device_type != DeviceType.CUDA:
                continue
            kind = getattr(e, 'activity_type', None)
            if kind:
                is_kernel = kind == 'kernel'
            else:  # older profilers: copies, memsets and stream/event syncs by name
                is_kernel = not (e.name.startswith(('Memcpy', 'Memset')) or 'Sync' in e.name or 'Wait' in e.name)
            (kernels if is_kernel else copies).append(e.name)
        want = 2 if hook else 1

        def verify():
            for word in ('dispatch', 'combine'):
                calls = [n for n in kernels if f'::{word}' in n]
                # One kernel per op, launched once per phase in hook mode: DeepEP's bench_kineto
                # requires exactly one profiler row whose name contains the word.
                distinct = {n for n in kernels if word in n}
                assert len(calls) == want and len(distinct) == 1, \
                    f'hook={hook}: {len(calls)} launches of kernels named *::{word}* (expected {want}), ' \
                    f'{len(distinct)} distinct names containing {word!r} (expected 1): {sorted(distinct)}'
            others = [n for n in kernels if '::dispatch' not in n and '::combine' not in n]
            assert not others, f'hook={hook}: other kernels launched by LL calls: {others}'

        chk(verify)
        if copies and ctx.rank == 0:
            ctx.rep.info(f'hook={hook}: LL calls also issued these non-kernel device activities: {sorted(set(copies))}')
    chk.done()


def cuda_graph(ctx, mode, hook, replays=5, clean=False):
    """A dispatch + combine pair (an even number of LL calls) captured in one CUDA graph after a
    warm-up on a side stream, replayed `replays` times with new x, topk_idx and weights copied
    into the captured inputs; every replay checked (stats accumulate across replays); then an
    eager round on the same buffer. clean=True captures clean_low_latency_buffer before the pair
    (DeepEP's is one kernel: no host wait, so it can be captured) and fills the RDMA region with
    0xff before every replay, as normal-mode calls would overwrite it: only the replayed clean
    makes the pair's signals count from zero again."""
    buf, local = ctx.main, ctx.E // ctx.world
    first = make_inputs(ctx, routing='random')
    static = SimpleNamespace(**vars(first))
    static.x, static.topk, static.weights = first.x.clone(), first.topk.clone(), first.weights.clone()
    stats = torch.zeros(local, dtype=I32)
    target = torch.empty(M, MAIN_H, dtype=BF16)
    factor = expert_scales(ctx.E, first.x.device)[ctx.rank * local:(ctx.rank + 1) * local].view(-1, 1, 1)
    use_shape(ctx, buf, M, MAIN_H, ctx.E)

    def step():
        if clean:
            buf.clean_low_latency_buffer(M, MAIN_H, ctx.E)
        out = ll_dispatch(buf, static, mode, hook, False, stats=stats)
        if hook:
            out[4]()
        y = (dequant(out[0]).float() * factor).to(BF16)
        res = ll_combine(buf, static, y, out[2], hook, False, out=target)
        if hook:
            res[2]()
        return out, res

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    expected_stats = reference(ctx, first, mode).count.clone()
    graph = torch.cuda.CUDAGraph()
    # thread_local: torch's NCCL watchdog thread may query events while this thread captures.
    with torch.cuda.graph(graph, capture_error_mode='thread_local'):
        out, res = step()

    chk = Checks()
    for i in range(replays):
        inp = make_inputs(ctx, routing='deepep' if i % 2 else 'random', xkind='wide' if i == 2 else 'randn')
        static.x.copy_(inp.x)
        static.topk.copy_(inp.topk)
        static.weights.copy_(inp.weights)
        if clean:
            torch.cuda.synchronize()  # every peer's writes into this rank's region have landed
            buf.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True).fill_(0xff)
        graph.replay()
        torch.cuda.synchronize()
        ref = reference(ctx, inp, mode)
        chk(check_dispatch_values, out, ref)
        expected_stats += ref.count
        chk(assert_same, f'replay {i}: cumulative_local_expert_recv_stats', stats, expected_stats)
        want = combine_reference(ctx, inp, mode, 'expert', None, ref)
        chk(check_combined, f'replay {i}: combined_x', res[0], want, ctx.rep)
    del graph
    chk.agree(ctx.group)
    one_round(ctx, buf, make_inputs(ctx), 'fp8', chk, hook=True)
    chk.done()


# ---------------------------------------------------------------- bad input
def expect_ll_error(what, exc, fn, pattern):
    """fn() must raise exc with a message matching pattern. If it returns instead, its receive
    hook runs and the device is synchronised, so that every rank stays in step."""
    try:
        result = fn()
    except exc as e:
        assert re.search(pattern, str(e)), f'{what}: {type(e).__name__} message does not match /{pattern}/: {str(e)!r}'
        return
    except Exception as e:
        raise AssertionError(f'{what}: expected {exc}, got {type(e).__name__}: {e}') from e
    if isinstance(result, tuple) and result and callable(result[-1]):
        result[-1]()
    torch.cuda.synchronize()
    raise AssertionError(f'{what}: expected {exc}, nothing was raised')


def bad_cases(ctx):
    """name -> (needs a good dispatch first, call(buf, inp, good), exception, pattern). inp: 17
    tokens at the main shape; good: (dispatch result, expert output y) of a BF16 dispatch of inp."""
    world, local = ctx.world, ctx.E // ctx.world

    def d(buf, inp, **kw):
        args = dict(x=inp.x, topk_idx=inp.topk, num_max_dispatch_tokens_per_rank=inp.M, num_experts=inp.E,
                    use_fp8=False)
        args.update(kw)
        return buf.low_latency_dispatch(**args)

    def c(buf, inp, good, **kw):
        out, y = good
        args = dict(x=y, topk_idx=inp.topk, topk_weights=inp.weights, handle=out[2])
        args.update(kw)
        return buf.low_latency_combine(**args)

    def x_of(inp, T=None, H=None):
        return torch.randn(inp.T if T is None else T, inp.H if H is None else H, dtype=BF16)

    def topk_of(inp, T=None, K=None):
        return make_topk(ctx, 'random', inp.T if T is None else T, inp.K if K is None else K, inp.E)

    rows = world * M
    return {
        'bad_T_gt_M': (False, lambda b, i, g: d(b, i, x=x_of(i, T=M + 1), topk_idx=topk_of(i, T=M + 1)),
                       RuntimeError, r'num_max_dispatch_tokens_per_rank|num_tokens|\bx\b'),
        'bad_topk17': (False, lambda b, i, g: d(b, i, topk_idx=topk_of(i, K=17)), RuntimeError, r'topk|top-k'),
        'bad_hidden_2000_not_multiple_of_128': (False, lambda b, i, g: d(b, i, x=x_of(i, H=2000)),
                                                RuntimeError, r'\bx\b|hidden'),
        'bad_num_experts_not_divisible': (False, lambda b, i, g: d(b, i, num_experts=i.E + 1), RuntimeError,
                                          r'num_experts'),
        'bad_M_gt_1024': (False, lambda b, i, g: d(b, i, num_max_dispatch_tokens_per_rank=1025), RuntimeError,
                          r'num_max_dispatch_tokens_per_rank|num_rdma_bytes'),
        'bad_x_float32': (False, lambda b, i, g: d(b, i, x=i.x.float()), RuntimeError, X_NAMED),
        'bad_x_fp8': (False, lambda b, i, g: d(b, i, x=i.x.to(FP8)), RuntimeError, X_NAMED),
        'bad_x_not_contiguous': (False, lambda b, i, g: d(b, i, x=i.x.t().contiguous().t()), RuntimeError, X_NAMED),
        'bad_topk_rows_differ_from_x': (False, lambda b, i, g: d(b, i, topk_idx=i.topk[:-1]), RuntimeError,
                                        r'topk_idx'),
        'bad_use_ue8m0_without_round_scale': (False, lambda b, i, g: d(b, i, use_fp8=True, use_ue8m0=True),
                                              RuntimeError, r'use_ue8m0|round_scale'),
        'bad_use_ue8m0_hidden_6400': (False, lambda b, i, g: d(b, i, x=x_of(i, H=6400), use_fp8=True, round_scale=True,
                                                               use_ue8m0=True),
                                      RuntimeError, r'use_ue8m0|hidden|\bx\b|512'),
        'bad_cumulative_stats_int64': (False, lambda b, i, g: d(b, i, cumulative_local_expert_recv_stats=torch.zeros(
            local, dtype=I64)), RuntimeError, r'cumulative_local_expert_recv_stats'),
        'bad_cumulative_stats_shape': (False, lambda b, i, g: d(b, i, cumulative_local_expert_recv_stats=torch.zeros(
            local + 1, dtype=I32)), RuntimeError, r'cumulative_local_expert_recv_stats'),
        'bad_dispatch_wait_stats_shape_RxR': (False, lambda b, i, g: d(b, i, dispatch_wait_recv_cost_stats=torch.zeros(
            world, world, dtype=I64)), RuntimeError, r'dispatch_wait_recv_cost_stats'),
        'bad_async_finish_with_return_recv_hook': (False, lambda b, i, g: d(b, i, async_finish=True,
                                                                            return_recv_hook=True),
                                                   (RuntimeError, AssertionError), r''),
        'bad_combine_x_float32': (True, lambda b, i, g: c(b, i, g, x=g[1].float()), RuntimeError, X_NAMED),
        'bad_combine_x_hidden': (True, lambda b, i, g: c(b, i, g, x=g[1][:, :, :-128].contiguous()), RuntimeError,
                                 r'\bx\b|hidden'),
        'bad_combine_x_rows': (True, lambda b, i, g: c(b, i, g, x=g[1][:, :rows - 1].contiguous()), RuntimeError,
                               X_NAMED),
        'bad_combine_weights_bf16': (True, lambda b, i, g: c(b, i, g, topk_weights=i.weights.to(BF16)), RuntimeError,
                                     r'topk_weights'),
        'bad_combine_weights_shape': (True, lambda b, i, g: c(b, i, g, topk_weights=i.weights[:, :-1].contiguous()),
                                      RuntimeError, r'topk_weights'),
        'bad_combine_out_shape': (True, lambda b, i, g: c(b, i, g, out=torch.empty(i.T + 1, i.H, dtype=BF16)),
                                  RuntimeError, r'\bout\b'),
        'bad_combine_out_float32': (True, lambda b, i, g: c(b, i, g, out=torch.empty(i.T, i.H, dtype=F32)),
                                    RuntimeError, r'\bout\b'),
        'bad_combine_wait_stats_int32': (True, lambda b, i, g: c(b, i, g, combine_wait_recv_cost_stats=torch.zeros(
            world, dtype=I32)), RuntimeError, r'combine_wait_recv_cost_stats'),
        'bad_combine_zero_copy_with_logfmt': (True, lambda b, i, g: c(b, i, g, zero_copy=True, use_logfmt=True),
                                              (RuntimeError, AssertionError), r'zero_copy|use_logfmt|logfmt'),
    }


def bad_input(ctx, name, needs_dispatch, call, exc, pattern):
    """The bad call raises exc naming the argument, on every rank alike; afterwards a dispatch +
    combine on the same buffer is still exact."""
    if ctx.bad_inp is None:
        ctx.bad_inp = make_inputs(ctx, T=17, routing='random')
    inp, buf = ctx.bad_inp, ctx.main
    use_shape(ctx, buf, M, MAIN_H, ctx.E)
    chk = Checks()
    good = None
    if needs_dispatch:
        out = ll_dispatch(buf, inp, 'bf16')
        good = (out, expert_output(ctx, inp, out[0], 'expert'))
    chk(expect_ll_error, name, exc, lambda: call(buf, inp, good), pattern)
    chk.agree(ctx.group)
    one_round(ctx, buf, inp, 'bf16', chk)
    chk.done()


# ---------------------------------------------------------------- cases on their own buffers
def virtual_nodes(ctx):
    """DEEPEP_VIRTUAL_NODE_SIZE=n (2 on an even count >= 4, else 1) set only while creating the
    buffer: traffic between virtual nodes takes the GIN-protocol path; every output is
    bit-identical to the plain buffer's (and to the reference)."""
    n = 2 if ctx.world >= 4 and ctx.world % 2 == 0 else 1
    previous = os.environ.get(VN_ENV)
    os.environ[VN_ENV] = str(n)
    try:
        vbuf = ll_buffer(ctx, M, MAIN_H, ctx.E)
    finally:
        if previous is None:
            del os.environ[VN_ENV]
        else:
            os.environ[VN_ENV] = previous
    chk = Checks()
    try:
        runs = (('randn', 'bf16', False, MAIN_H, (False, True)), ('rank', 'fp8', True, MAIN_H, (False,)),
                ('wide', 'fp8_ue8m0', False, MAIN_H, (False, True)), ('randn', 'fp8_round', True, SMALL_H, (False,)))
        for xkind, mode, hook, hidden, zero_copy in runs:
            inp = make_inputs(ctx, H=hidden, xkind=xkind, routing='deepep')
            ref = reference(ctx, inp, mode)
            plain = one_round(ctx, ctx.main, inp, mode, chk, hook=hook, zero_copy=zero_copy, ref=ref)
            virtual = one_round(ctx, vbuf, inp, mode, chk, hook=hook, zero_copy=zero_copy, ref=ref,
                                deepep=xkind == 'rank', y_kind='deq' if xkind == 'rank' else 'expert')
            if xkind == 'rank':
                continue  # different expert outputs: compared with the reference only

            def same():
                p, v = plain.out, virtual.out
                pd, ps = p[0] if isinstance(p[0], tuple) else (p[0], None)
                vd, vs = v[0] if isinstance(v[0], tuple) else (v[0], None)
                check_valid('virtual-node packed_recv_x vs plain', vd, pd, ref.valid)
                if ps is not None:
                    check_valid('virtual-node packed_recv_x_scales vs plain', vs, ps, ref.valid)
                check_valid('virtual-node src_info vs plain', v[2][0], p[2][0], ref.valid)
                assert_same('virtual-node layout_range vs plain', v[2][1], p[2][1])
                assert_same('virtual-node recv_count vs plain', v[1], p[1])
                for zc in zero_copy:
                    assert_same(f'virtual-node combined_x vs plain (zero_copy={zc})', virtual.combined[zc],
                                plain.combined[zc])

            chk(same)
    finally:
        destroy(ctx, vbuf)
    chk.done()


def buffer_too_small(ctx):
    """A buffer from the hint for hidden 2048 refuses hidden 7168 with an error naming
    num_rdma_bytes and the size needed, then serves hidden 2048 exactly."""
    buf = ll_buffer(ctx, M, SMALL_H, ctx.E)
    chk = Checks()
    try:
        big = make_inputs(ctx, routing='random')
        chk(expect_ll_error, f'dispatch of hidden {MAIN_H} on a buffer sized for {SMALL_H}', RuntimeError,
            lambda: ll_dispatch(buf, big, 'bf16'), r'(?s)(?=.*num_rdma_bytes)(?=.*\d{6})')  # and the size needed
        chk.agree(ctx.group)
        inp = make_inputs(ctx, H=SMALL_H)
        one_round(ctx, buf, inp, 'fp8_ue8m0', chk, hook=True)
    finally:
        destroy(ctx, buf)
    chk.done()


def not_low_latency_buffer(ctx):
    """LL calls on a buffer created with low_latency_mode=False raise naming low_latency_mode."""
    chk = Checks()
    buf = deep_ep.Buffer(ctx.group, num_nvl_bytes=64 << 20, explicitly_destroy=True)
    try:
        inp = make_inputs(ctx, T=17, H=SMALL_H, routing='random')
        y = torch.zeros(inp.E // ctx.world, ctx.world * M, inp.H, dtype=BF16)
        handle = (torch.zeros(inp.E // ctx.world, ctx.world * M, dtype=I32),
                  torch.zeros(inp.E // ctx.world, ctx.world, dtype=I64), M, inp.H, inp.E)
        for what, fn in (('low_latency_dispatch', lambda: ll_dispatch(buf, inp, 'bf16')),
                         ('low_latency_combine', lambda: ll_combine(buf, inp, y, handle)),
                         ('clean_low_latency_buffer', lambda: buf.clean_low_latency_buffer(M, inp.H, inp.E))):
            chk(expect_ll_error, f'{what} with low_latency_mode=False', RuntimeError, fn, r'low_latency_mode')
    finally:
        torch.cuda.synchronize()
        buf.destroy()
    chk.done()


def normal_round(ctx, buf, chk, num_tokens=256, hidden=None, num_experts=None, num_topk=8):
    """A normal-mode (intranode) dispatch + combine against normal_reference."""
    num_experts, hidden = num_experts or ctx.E, hidden or SMALL_H
    x = torch.randn(num_tokens, hidden, dtype=BF16)
    topk = make_topk(ctx, 'random', num_tokens, num_topk, num_experts)
    weights = torch.randn(num_tokens, num_topk, dtype=F32)
    per_rank, _, per_expert, in_rank = ref_layout(topk, num_experts, ctx.world)
    ref = ref_dispatch(ctx.group, x, in_rank, per_expert, topk, weights)
    recv_x, recv_topk, recv_w, counts, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=topk, topk_weights=weights)
    chk(assert_same, 'normal recv_x', recv_x, ref.recv_x)
    chk(assert_same, 'normal recv_topk_idx', recv_topk, ref.recv_topk_idx)
    chk(assert_same, 'normal recv_topk_weights', recv_w, ref.recv_topk_weights)
    chk.expect(counts == ref.num_recv_tokens_per_expert_list, 'normal num_recv_tokens_per_expert_list differs')
    chk.agree(ctx.group)
    y = torch.randn(ref.num_recv, hidden, dtype=BF16)
    want_x, want_w = ref_combine(ctx.group, ref, y, recv_w)
    combined, combined_w, _ = buf.combine(y, handle, topk_weights=recv_w)
    chk(assert_same, 'normal combined_x', combined, want_x)
    chk(assert_same, 'normal combined_topk_weights', combined_w, want_w)


def mixed_modes(ctx):
    """One buffer with num_nvl_bytes (normal hint) and num_rdma_bytes (LL hint), low_latency_mode:
    normal dispatch/combine, clean_low_latency_buffer, LL rounds, normal again, clean, LL again."""
    hidden, E, world = SMALL_H, ctx.E, ctx.world
    nvl = max(deep_ep.Buffer.get_dispatch_config(world).get_nvl_buffer_size_hint(hidden * 2, world),
              deep_ep.Buffer.get_combine_config(world).get_nvl_buffer_size_hint(hidden * 2, world))
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(M, hidden, world, E)
    buf = deep_ep.Buffer(ctx.group, num_nvl_bytes=nvl, num_rdma_bytes=rdma, low_latency_mode=True,
                         num_qps_per_rank=max(24, E // world), explicitly_destroy=True)
    chk = Checks()
    try:
        normal_round(ctx, buf, chk, hidden=hidden)
        buf.clean_low_latency_buffer(M, hidden, E)
        ctx.shapes[buf] = (M, hidden, E)
        inp = make_inputs(ctx, H=hidden)
        one_round(ctx, buf, inp, 'bf16', chk)
        one_round(ctx, buf, inp, 'fp8_ue8m0', chk, hook=True)
        normal_round(ctx, buf, chk, hidden=hidden)
        buf.clean_low_latency_buffer(M, hidden, E)
        one_round(ctx, buf, make_inputs(ctx, H=hidden, xkind='rank'), 'fp8', chk, y_kind='deq', deepep=True)
    finally:
        destroy(ctx, buf)
    chk.done()


def subgroup(ctx):
    """A Buffer over the last two ranks (the last one with 2 GPUs): group ranks differ from
    global ranks. BF16 and FP8 rounds exact, gathers over that group. Other ranks only join the
    new_group call."""
    members = list(range(ctx.world - min(2, ctx.world - 1), ctx.world))
    sub = dist.new_group(members)  # collective over the whole job
    if ctx.rank not in members:
        return
    sctx = make_ctx(sub, ctx.rep)
    sctx.E = sctx.E256 = 256
    buf = ll_buffer(sctx, M, SMALL_H, 256)
    chk = Checks()
    try:
        assert buf.rank == members.index(ctx.rank) and buf.group_size == len(members), (buf.rank, buf.group_size)
        inp = make_inputs(sctx, T=64, H=SMALL_H, E=256)
        one_round(sctx, buf, inp, 'bf16', chk, y_kind='random', zero_copy=(False, True))
        one_round(sctx, buf, inp, 'fp8_ue8m0', chk, hook=True)
    finally:
        destroy(sctx, buf)
    chk.done()


def query_mask(buf, world):
    mask = torch.full((world,), -1, dtype=I32)
    buf.low_latency_query_mask_buffer(mask)
    return mask.tolist()


def survivor_round(ctx, buf, inp, ref, chk):
    """A dispatch + combine on a rank that keeps going while rank STALLED_RANK is gone."""
    world = ctx.world
    start = time.monotonic()
    out = ll_dispatch(buf, inp, 'bf16')
    torch.cuda.synchronize()
    seconds = time.monotonic() - start
    chk.expect(seconds < 15, f'the dispatch with rank {STALLED_RANK} gone took {seconds:.1f} s '
                             f'(GPU timeout {SHRINK_TIMEOUT_MS} ms)')
    chk(check_dispatch_values, out, ref)
    y = expert_output(ctx, inp, out[0], 'expert')
    want = combine_reference(ctx, inp, 'bf16', 'expert', y, ref, masked=(STALLED_RANK,))
    res = ll_combine(buf, inp, y, out[2])
    torch.cuda.synchronize()
    chk(check_combined, f'combined_x ignoring rank {STALLED_RANK}', res[0], want, ctx.rep)
    mask = query_mask(buf, world)
    chk.expect(mask == [int(r == STALLED_RANK) for r in range(world)],
               f'query_mask_buffer reports {mask}, expected only rank {STALLED_RANK}')


def shrink(ctx):
    """enable_shrink=True. 1) The mask API: query/update/clean. 2) A healthy round. 3) Rank 1
    skips one low_latency_dispatch; the others (GPU timeout 2 s) mask it instead of failing: their
    dispatch equals the reference with rank 1 sending nothing, their combine ignores rank 1's
    experts, and query reports exactly {1}. 4) Recovery on every rank: clean the mask, then
    clean_low_latency_buffer(M, H, E); a full round is exact again."""
    hidden, E, world = SMALL_H, ctx.E, ctx.world
    buf = ll_buffer(ctx, M, hidden, E, enable_shrink=True)
    chk = Checks()
    try:
        with watchdog(ctx.rep, SHRINK_CASE, 150):
            none = [0] * world
            chk.expect(query_mask(buf, world) == none, f'fresh mask {query_mask(buf, world)}')
            peer = (ctx.rank + 1) % world
            buf.low_latency_update_mask_buffer(peer, True)
            chk.expect(query_mask(buf, world) == [int(r == peer) for r in range(world)],
                       f'after update_mask_buffer({peer}, True): {query_mask(buf, world)}')
            buf.low_latency_update_mask_buffer(peer, False)
            chk.expect(query_mask(buf, world) == none, f'after update_mask_buffer({peer}, False)')
            buf.low_latency_update_mask_buffer(peer, True)
            buf.low_latency_update_mask_buffer((ctx.rank + 2) % world, True)
            buf.low_latency_clean_mask_buffer()
            chk.expect(query_mask(buf, world) == none, f'after clean_mask_buffer: {query_mask(buf, world)}')
            dist.barrier(group=ctx.group)
            one_round(ctx, buf, make_inputs(ctx, H=hidden), 'bf16', chk)  # healthy, agrees
            # The failed round: inputs and the masked reference first (every rank gathers).
            inp = make_inputs(ctx, H=hidden, routing='random')
            ref = reference(ctx, inp, 'bf16', masked=(STALLED_RANK,))
            buf.runtime.set_gpu_timeout_ms(SHRINK_TIMEOUT_MS)
            dist.barrier(group=ctx.group)
            if ctx.rank != STALLED_RANK:
                try:
                    survivor_round(ctx, buf, inp, ref, chk)
                except Exception as e:  # keep every rank on the same collective calls
                    chk.expect(False, f'with rank {STALLED_RANK} gone: {type(e).__name__}: {e}')
            dist.barrier(group=ctx.group)
            # Recovery, collective over every rank.
            buf.runtime.set_gpu_timeout_ms(30_000)
            buf.low_latency_clean_mask_buffer()
            buf.clean_low_latency_buffer(M, hidden, E)
            chk.expect(query_mask(buf, world) == none, 'mask not clean after recovery')
            recover = make_inputs(ctx, H=hidden)
            one_round(ctx, buf, recover, 'bf16', chk)
            one_round(ctx, buf, recover, 'fp8', chk, hook=True)
    finally:
        with watchdog(ctx.rep, SHRINK_CASE, 60):
            destroy(ctx, buf)
    chk.done()


def stalled_peer(ctx):
    """Without enable_shrink, rank 1 skipping a dispatch is a RuntimeError naming rank 1 on the
    others (from that call or, the wait being on the GPU, from the next LL call) within 10 s;
    destroy() then returns or raises on every rank, under a watchdog. Its own buffer, run last:
    the buffer is unusable afterwards."""
    chk = Checks()
    buf = ll_buffer(ctx, M, SMALL_H, ctx.E)
    try:
        inp = make_inputs(ctx, H=SMALL_H, routing='random')
        one_round(ctx, buf, inp, 'bf16', chk)  # healthy first
        buf.runtime.set_gpu_timeout_ms(STALL_TIMEOUT_MS)
        dist.barrier(group=ctx.group)
        if ctx.rank == STALLED_RANK:
            time.sleep(3 * STALL_TIMEOUT_MS / 1000)  # well past the others' timeout
        else:
            def probe():
                ll_dispatch(buf, inp, 'bf16')
                torch.cuda.synchronize()
                ll_dispatch(buf, inp, 'bf16')  # a poisoned buffer refuses the next call
                torch.cuda.synchronize()

            start = time.monotonic()
            chk(expect_ll_error, f'LL dispatch while rank {STALLED_RANK} stalls', RuntimeError, probe,
                rf'\b(?:rank|peer)\s*{STALLED_RANK}\b')
            seconds = time.monotonic() - start
            chk.expect(seconds < 10, f'the stall was reported only after {seconds:.1f} s (GPU timeout '
                                     f'{STALL_TIMEOUT_MS} ms)')
    finally:
        dist.barrier(group=ctx.group)
        destroy_after_stall(ctx.rep, STALL_CASE, lambda: destroy(ctx, buf))
    chk.done()


# ---------------------------------------------------------------- workers
def main_cases(ctx):
    """name -> callable on the main buffer, in run order."""
    out = {}
    for xkind in ('rank', 'rand'):
        for hook in (False, True):
            out[f'deepep_loop_{"rank_valued" if xkind == "rank" else "random"}_x_hook{int(hook)}'] = \
                (lambda xkind=xkind, hook=hook: deepep_loop(ctx, xkind, hook))
    out.update({name: (lambda spec=spec: generic(ctx, **spec)) for name, spec in GENERIC.items()})
    out.update({
        'two_in_flight_async': lambda: in_flight(ctx, hook=False),
        'two_in_flight_hook': lambda: in_flight(ctx, hook=True),
        'odd_number_of_calls': lambda: odd_calls(ctx),
        'stats_accumulate': lambda: stats_accumulate(ctx),
        'events_and_hooks': lambda: events_and_hooks(ctx),
        'hook_keeps_tensors_alive': lambda: hook_keeps_tensors(ctx),
        'waits_for_compute_stream': lambda: stream_order(ctx),
        'logfmt_combine': lambda: logfmt_combine(ctx),
        'kernels_per_call_profiler': lambda: kernels_per_call(ctx),
    })
    out.update({name: (lambda name=name, bad=bad: bad_input(ctx, name, *bad)) for name, bad in bad_cases(ctx).items()})
    # Last on the main buffer: a failed capture can leave the stream unusable.
    out['cuda_graph_bf16'] = lambda: cuda_graph(ctx, 'bf16', hook=False)
    out['cuda_graph_fp8_ue8m0_hook'] = lambda: cuda_graph(ctx, 'fp8_ue8m0', hook=True)
    out['cuda_graph_clean_then_bf16'] = lambda: cuda_graph(ctx, 'bf16', hook=False, clean=True)
    return out


def own_buffer_cases(ctx):
    out = {'virtual_nodes': lambda: virtual_nodes(ctx)}  # needs the main buffer too
    out['destroy_main_buffer'] = lambda: destroy(ctx, ctx.main)
    out['bad_buffer_too_small'] = lambda: buffer_too_small(ctx)
    if ctx.world in (2, 4, 8):  # normal mode: one NVLink domain of 2, 4 or 8 ranks
        out['bad_low_latency_mode_false'] = lambda: not_low_latency_buffer(ctx)
        out['mixed_normal_and_low_latency'] = lambda: mixed_modes(ctx)
    if ctx.world >= 2:  # a group whose ranks are not the global ones; a peer to mask or to stall
        out['subgroup_last_two_ranks' if ctx.world >= 3 else 'subgroup_last_rank'] = lambda: subgroup(ctx)
        out[SHRINK_CASE] = lambda: shrink(ctx)
        out[STALL_CASE] = lambda: stalled_peer(ctx)  # last: leaves its buffer unusable
    return out


def run_cases(ctx, cases, pattern):
    for name, fn in cases.items():
        if pattern and not re.search(pattern, name) and name != 'destroy_main_buffer':
            continue
        start = time.monotonic()
        ctx.rep.run(name, fn)
        if ctx.rank == 0:
            print(f'  [w{ctx.world}] {name}: {time.monotonic() - start:.1f} s', flush=True)


def worker(rank, world, group, rep, pattern):
    ctx = make_ctx(dist.new_group(list(range(world))), rep)  # an EP subgroup, as DeepEP's init_dist

    def create():
        ctx.main = ll_buffer(ctx, M, MAIN_H, ctx.E)
        assert ctx.main.low_latency_mode and ctx.main.num_rdma_bytes == \
            deep_ep.Buffer.get_low_latency_rdma_size_hint(M, MAIN_H, world, ctx.E)

    start = time.monotonic()
    if not rep.run('create_main_buffer', create):
        return
    run_cases(ctx, main_cases(ctx), pattern)
    run_cases(ctx, own_buffer_cases(ctx), pattern)
    if rank == 0:
        print(f'  [w{world}] total {time.monotonic() - start:.0f} s', flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--world', type=int, nargs='*', help='world sizes (default: 2, 4 and all visible up to 8)')
    parser.add_argument('-k', dest='pattern', default='', help='run only the cases whose name matches this regex')
    parser.add_argument('--timeout', type=int, default=420, help='seconds per world size before the workers are killed')
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    if gpus < 1:
        print('test_low_latency needs a GPU, found none')
        return 1
    # One GPU: one rank (every case that needs no peer); the LL kernels' own paths all run.
    worlds = args.world or (sorted({2, 4, min(gpus, 8)}) if gpus >= 2 else [1])
    for world in worlds:
        if world > gpus or world < 1:
            skip(f'w{world}', f'{gpus} GPUs visible')
            continue
        spawn(worker, world, args.pattern, timeout=args.timeout)
    finish()


if __name__ == '__main__':
    sys.exit(main())
