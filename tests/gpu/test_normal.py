"""Normal-mode (intranode) dispatch and combine on 2, 4 and 8 GPUs (and a 2-rank subgroup of 4)
against the independent torch reference in normal_reference.py.

Workers run the way DeepEP's own tests do: default dtype BF16, default device CUDA, a Buffer
over dist.new_group(all ranks). One buffer is sized by DeepEP's NVL hint (7168 hidden, max over
the default dispatch and combine configs), one has int(1e9) bytes. Cases: routings (random,
skewed, empty rank, -1 heavy, duplicates), token counts 0/1/17/4096 (also different per rank),
hidden 2048/4096/6000/7168, top-k 1/8/16, BF16 and FP8 (float32 and int32 scales, row- and
column-major), with and without top-k, expert alignment, the handle, cached and repeated calls,
num_worst_tokens, combine bias, events and streams, CUDA-graph replay, a Config sweep, bad input,
and a peer that stalls before dispatch, cached dispatch or combine, or inside dispatch (after its
notify) or combine (its data kernel late) (last, each on its own buffer, then a new one).

Every exact output is compared with torch.equal. Checks are collected (common.Checks) rather
than raised at once so that all ranks keep making the same collective calls."""
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

import deep_ep
from common import (Checks, assert_same, ctypes_launches, destroy_after_stall, expect_raises_match, finish, make_buffer,
                    random_topk, ref_layout, skip, spawn)
from normal_reference import ref_combine, ref_dispatch

E = 256
MAX_HIDDEN = 7168
SPIN_CYCLES = 20_000_000  # ~10 ms of GPU time: the host enqueues the call behind a delayed copy
X_NAMED = r'\bx\b'  # the message names the argument x (not x_scales)
STALLED_RANK = 1
STALL_TIMEOUT_MS = 3000
HANDLE_NAMES = ('rank_prefix_matrix', 'channel_prefix_matrix', 'recv_channel_prefix_matrix', 'recv_src_idx',
                'is_token_in_rank', 'send_head')


# ---------------------------------------------------------------- setup
def hint_bytes(world, hidden=MAX_HIDDEN):
    """DeepEP's sizing (README, Megatron, SGLang): the NVL hint for BF16 rows, max over the
    default dispatch and combine configs."""
    return max(deep_ep.Buffer.get_dispatch_config(world).get_nvl_buffer_size_hint(hidden * 2, world),
               deep_ep.Buffer.get_combine_config(world).get_nvl_buffer_size_hint(hidden * 2, world))


def make_ctx(group, rep):
    # As DeepEP's tests/utils.init_dist: tensors default to BF16 on the GPU.
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device('cuda')
    return SimpleNamespace(group=group, rank=group.rank(), world=group.size(), rep=rep, buffers={})


# ---------------------------------------------------------------- inputs
def route(kind, num_tokens, num_topk, world):
    """topk_idx [T, K] of deep_ep.topk_idx_t for one routing pattern."""
    per_rank = E // world
    if kind == 'random':
        return random_topk(num_tokens, E, num_topk)
    if kind == 'skewed':  # every token to the last rank's experts: it receives T*world rows, the others none
        local = torch.rand(num_tokens, per_rank, dtype=torch.float32).argsort(1)[:, :num_topk]
        return (local + (world - 1) * per_rank).to(deep_ep.topk_idx_t)
    if kind == 'empty_rank':  # nothing goes to rank 0's experts: rank 0 receives no row but still sends
        scores = torch.rand(num_tokens, E, dtype=torch.float32) + 1
        scores[:, :per_rank] = 0
        return scores.topk(num_topk, dim=1).indices.to(deep_ep.topk_idx_t)
    if kind == 'minus_one_heavy':  # 90 % of slots -1, some rows routed nowhere at both ends
        t = random_topk(num_tokens, E, num_topk)
        t[torch.rand(t.shape, dtype=torch.float32) < 0.9] = -1
        t[:num_tokens // 8] = -1
        t[-3:] = -1
        return t
    if kind == 'all_minus_one':
        return torch.full((num_tokens, num_topk), -1, dtype=deep_ep.topk_idx_t)
    if kind == 'duplicates':  # the same expert twice in a row (counts per expert count it twice)
        t = torch.randint(0, E, (num_tokens, num_topk), dtype=deep_ep.topk_idx_t)
        if num_topk > 1:
            t[:, 1] = t[:, 0]
        t[::3] = t[::3, :1]
        return t
    raise ValueError(kind)


def fp8_cast(x):
    """Per-token FP8 e4m3 with one float32 scale per 128 channels (the recipe of DeepEP's tests)."""
    num_tokens, hidden = x.shape
    blocks = x.float().view(num_tokens, hidden // 128, 128)
    amax = blocks.abs().amax(2).clamp(min=1e-4)
    q = (blocks * (448.0 / amax).unsqueeze(2)).to(torch.float8_e4m3fn).view(num_tokens, hidden)
    return q, amax / 448.0


def make_x(kind, num_tokens, hidden):
    """x as dispatch takes it: BF16 [T, H], or (FP8 [T, H], scales [T, S]) in several layouts."""
    if kind == 'bf16':
        return torch.randn(num_tokens, hidden, dtype=torch.bfloat16)
    q, scales = fp8_cast(torch.randn(num_tokens, hidden, dtype=torch.float32))
    if kind == 'fp8_row':
        return q, scales
    if kind == 'fp8_col':  # column-major, as DeepEP's tests and SGLang pass them
        return q, scales.t().contiguous().t()
    # int32 scales: packed UE8M0 [T, H/512], carried as opaque bits.
    packed = torch.randint(-2 ** 31, 2 ** 31 - 1, (num_tokens, hidden // 512), dtype=torch.int32)
    if kind == 'fp8_int32':
        return q, packed
    if kind == 'fp8_int32_col':
        return q, packed.t().contiguous().t()
    raise ValueError(kind)


def make_inputs(ctx, routing='random', tokens=4096, hidden=4096, topk=8, x='bf16'):
    """One rank's dispatch inputs. tokens may be a tuple: per-rank counts (rank % len)."""
    if isinstance(tokens, tuple):
        tokens = tokens[ctx.rank % len(tokens)]
    topk_idx = route(routing, tokens, topk, ctx.world)
    # The layout comes from the torch reference, so these cases do not depend on the layout kernel.
    per_rank, _, per_expert, in_rank = ref_layout(topk_idx, E, ctx.world)
    return SimpleNamespace(x=make_x(x, tokens, hidden), topk=topk_idx,
                           weights=torch.randn(tokens, topk, dtype=torch.float32), per_rank=per_rank,
                           per_expert=per_expert, in_rank=in_rank, tokens=tokens, hidden=hidden)


def layout_args(inp, with_topk=True):
    args = dict(num_tokens_per_rank=inp.per_rank, is_token_in_rank=inp.in_rank,
                num_tokens_per_expert=inp.per_expert)
    if with_topk:
        args.update(topk_idx=inp.topk, topk_weights=inp.weights)
    return args


def expect_dispatch(ctx, inp, with_topk=True, num_sms=None, alignment=1, x=None, weights=None):
    """The reference for dispatching inp (or another payload x / weights with inp's routing)."""
    return ref_dispatch(ctx.group, inp.x if x is None else x, inp.in_rank, inp.per_expert,
                        inp.topk if with_topk else None,
                        (inp.weights if weights is None else weights) if with_topk else None,
                        num_channels=(num_sms or deep_ep.Buffer.num_sms) // 2, expert_alignment=alignment)


def sent_weights(topk_idx, weights):
    """What combining dispatch's recv_topk_weights must give back: each routed slot is non-zero
    on exactly one rank, so the sum is the sender's weight, and 0 on -1 slots (dispatch-backward)."""
    return torch.where(topk_idx >= 0, weights, torch.zeros_like(weights))


def make_bias(kind, num_tokens, hidden):
    if kind is None:
        return None
    if kind == 'one':
        return torch.randn(num_tokens, hidden, dtype=torch.bfloat16)
    return (torch.randn(num_tokens, hidden, dtype=torch.bfloat16),
            torch.randn(num_tokens, hidden, dtype=torch.bfloat16))


# ---------------------------------------------------------------- checks (raise AssertionError)
def check_event(what, event, is_async):
    assert isinstance(event, deep_ep.EventOverlap), f'{what}: returned {type(event).__name__}, not EventOverlap'
    assert (event.event is not None) == is_async, f'{what}: event.event is {event.event!r} with async_finish={is_async}'


def check_rows(name, got, want, rows):
    """got has `rows` rows (more than want's with num_worst_tokens); its head equals want."""
    assert isinstance(got, torch.Tensor), f'{name} is {type(got).__name__}, not a tensor'
    assert got.dtype == want.dtype, f'{name} dtype {got.dtype}, expected {want.dtype}'
    shape = (rows, *want.shape[1:])
    assert tuple(got.shape) == shape, f'{name} shape {tuple(got.shape)}, expected {shape}'
    assert_same(f'{name}[:{want.size(0)}]', got[:want.size(0)], want)


def check_recv_x(recv_x, ref, rows):
    if ref.recv_x_scales is None:
        assert isinstance(recv_x, torch.Tensor), f'recv_x is {type(recv_x).__name__} for BF16 x'
        data = recv_x
    else:
        assert isinstance(recv_x, tuple) and len(recv_x) == 2, f'FP8 recv_x is {type(recv_x).__name__}, not a 2-tuple'
        data, scales = recv_x
        check_rows('recv_x_scales', scales, ref.recv_x_scales, rows)
        assert scales.is_contiguous(), f'recv_x_scales strides {scales.stride()}: must be row-major contiguous'
    check_rows('recv_x', data, ref.recv_x, rows)
    assert data.is_contiguous(), f'recv_x strides {data.stride()}: must be contiguous'


def check_handle(handle, ref, in_rank, rows=None, after_combine=False):
    """All 6 handle elements against the reference; after a combine, send_head's -1 entries may
    have been rewritten in place (DeepEP encodes the next head there) but must stay negative."""
    assert isinstance(handle, tuple) and len(handle) == 6, f'handle is {type(handle).__name__} of {len(handle)}'
    assert handle[4] is in_rank, 'handle[4] must be the is_token_in_rank tensor passed to dispatch'
    for i in (0, 1, 2):
        assert_same(f'handle[{i}] {HANDLE_NAMES[i]}', handle[i], ref.handle[i])
    check_rows('handle[3] recv_src_idx', handle[3], ref.handle[3], ref.num_recv if rows is None else rows)
    got, want = handle[5], ref.handle[5]
    if not after_combine:
        assert_same('handle[5] send_head', got, want)
        return
    assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape, \
        f'handle[5] send_head is {got.dtype} {tuple(got.shape)} after combine'
    sent = want >= 0
    assert_same('handle[5] send_head (sent entries, after combine)', got[sent], want[sent])
    assert bool((got[~sent] < 0).all()), 'handle[5] send_head: an unsent entry became >= 0 after combine'


def check_dispatch(out, ref, in_rank, worst=0, is_async=False):
    """A non-cached dispatch result: arity, every output, the expert list and the handle."""
    assert isinstance(out, tuple) and len(out) == 6, f'dispatch returned {type(out).__name__} of {len(out)}'
    recv_x, recv_topk_idx, recv_topk_weights, counts, handle, event = out
    check_event('dispatch', event, is_async)
    n = ref.num_recv
    rows = worst or n
    check_recv_x(recv_x, ref, rows)
    if ref.recv_topk_idx is None:
        assert recv_topk_idx is None and recv_topk_weights is None, 'recv_topk_idx/weights must be None without topk'
    else:
        check_rows('recv_topk_idx', recv_topk_idx, ref.recv_topk_idx, rows)
        check_rows('recv_topk_weights', recv_topk_weights, ref.recv_topk_weights, rows)
        if worst:
            assert bool((recv_topk_idx[n:] == -1).all()), 'recv_topk_idx rows past the received ones must be -1'
    want = [] if worst else ref.num_recv_tokens_per_expert_list
    assert type(counts) is list and all(type(c) is int for c in counts), \
        f'num_recv_tokens_per_expert_list is {type(counts).__name__} of {sorted({type(c).__name__ for c in counts})}'
    if counts != want:
        first = next((i for i, (a, b) in enumerate(zip(counts, want)) if a != b), min(len(counts), len(want)))
        raise AssertionError(f'num_recv_tokens_per_expert_list has {len(counts)} entries (expected {len(want)}), '
                             f'first difference at {first}: {counts[first:first + 4]} vs {want[first:first + 4]}')
    check_handle(handle, ref, in_rank, rows)


def check_cached(out, ref, is_async=False):
    """A cached dispatch: (recv_x, None, None, None, None, event) with the reference rows."""
    assert isinstance(out, tuple) and len(out) == 6, f'cached dispatch returned {type(out).__name__} of {len(out)}'
    assert all(o is None for o in out[1:5]), \
        f'cached dispatch items 1..4 must be None, got {[type(o).__name__ for o in out[1:5]]}'
    check_event('cached dispatch', out[5], is_async)
    check_recv_x(out[0], ref, ref.num_recv)


def check_combine(out, want, is_async=False):
    assert isinstance(out, tuple) and len(out) == 3, f'combine returned {type(out).__name__} of {len(out)}'
    combined_x, combined_w, event = out
    check_event('combine', event, is_async)
    want_x, want_w = want
    assert_same('combined_x', combined_x, want_x)
    if want_w is None:
        assert combined_w is None, 'combined_topk_weights must be None without topk_weights'
    else:
        assert_same('combined_topk_weights', combined_w, want_w)


def same_head(normal, worst_out, n):
    """The first n rows of a num_worst_tokens dispatch equal the normal run's (torch.equal)."""
    pairs = [('recv_x', normal[0], worst_out[0])]
    if isinstance(normal[0], tuple):
        pairs = [('recv_x', normal[0][0], worst_out[0][0]), ('recv_x_scales', normal[0][1], worst_out[0][1])]
    pairs += [('recv_topk_idx', normal[1], worst_out[1]), ('recv_topk_weights', normal[2], worst_out[2])]
    for name, a, b in pairs:
        assert_same(f'{name}: num_worst_tokens head vs the normal run', b[:n], a)


# ---------------------------------------------------------------- dispatch + combine round trips
def roundtrip(ctx, buf='hint', routing='random', tokens=4096, hidden=4096, topk=8, x='bf16', with_topk=True,
              alignment=1, configs=None, bias=None, combine_weights=True):
    """Dispatch, check every output and the handle, then combine a random expert output (with
    the received weights and a bias when asked) and check it bit for bit. configs: None
    (config=None), 'default' (Buffer.get_*_config) or (num_sms, dispatch chunk, combine chunk)."""
    buffer = ctx.buffers[buf]
    inp = make_inputs(ctx, routing, tokens, hidden, topk, x)
    num_sms, config, combine_config = None, None, None
    if configs == 'default':
        config = deep_ep.Buffer.get_dispatch_config(ctx.world)
        combine_config = deep_ep.Buffer.get_combine_config(ctx.world)
    elif configs is not None:
        num_sms, dispatch_chunk, combine_chunk = configs
        config = deep_ep.Config(num_sms, dispatch_chunk, 256)
        combine_config = deep_ep.Config(num_sms, combine_chunk, 256)
    chk = Checks()
    ref = expect_dispatch(ctx, inp, with_topk, num_sms, alignment)
    out = buffer.dispatch(inp.x, **layout_args(inp, with_topk), expert_alignment=alignment, config=config)
    chk(check_dispatch, out, ref, inp.in_rank)
    chk.agree(ctx.group)

    y = torch.randn(ref.num_recv, hidden, dtype=torch.bfloat16)  # stands in for the experts' output
    weights = out[2] if combine_weights else None
    bias_value = make_bias(bias, inp.tokens, hidden)
    want = ref_combine(ctx.group, ref, y, weights, bias_value)
    got = buffer.combine(y, out[4], topk_weights=weights, bias=bias_value, config=combine_config)
    chk(check_combine, got, want)
    if weights is not None:
        chk(assert_same, 'combined_topk_weights vs the weights sent', got[1], sent_weights(inp.topk, inp.weights))
    chk(check_handle, out[4], ref, inp.in_rank, after_combine=True)
    chk.done()


CORE = {
    'random_T4096_H7168': dict(hidden=7168),
    'random_T17_H2048': dict(tokens=17, hidden=2048),
    'random_T1_H4096': dict(tokens=1),
    'random_T0_H4096': dict(tokens=0),
    'skewed_T4096_H7168': dict(routing='skewed', hidden=7168),
    'empty_rank0_T4096_H4096': dict(routing='empty_rank'),
    'minus_one_heavy_T4096_H2048': dict(routing='minus_one_heavy', hidden=2048),
    'all_minus_one_T17_H2048': dict(routing='all_minus_one', tokens=17, hidden=2048),
    'duplicate_experts_T4096_H2048': dict(routing='duplicates', hidden=2048),
    'topk1_T4096_H2048': dict(topk=1, hidden=2048),
    'topk16_T4096_H4096': dict(topk=16),
    'topk16_T17_H7168': dict(topk=16, tokens=17, hidden=7168),
    'hidden6000_T4096': dict(hidden=6000),
    'hidden6000_T17_no_topk': dict(hidden=6000, tokens=17, with_topk=False),
    'uneven_tokens_per_rank_H4096': dict(tokens=(4096, 0, 17, 1)),
    'no_topk_T4096_H4096': dict(with_topk=False),
    'no_topk_T1_H7168': dict(with_topk=False, tokens=1, hidden=7168),
    'fp8_row_scales_T4096_H7168': dict(x='fp8_row', hidden=7168),
    'fp8_col_scales_T4096_H7168': dict(x='fp8_col', hidden=7168),
    'fp8_col_scales_T0_H4096': dict(x='fp8_col', tokens=0),
    'fp8_col_scales_T1_H2048_skewed': dict(x='fp8_col', tokens=1, hidden=2048, routing='skewed'),
    'fp8_col_scales_T17_H2048_no_topk': dict(x='fp8_col', tokens=17, hidden=2048, with_topk=False),
    'fp8_int32_scales_T17_H7168': dict(x='fp8_int32', tokens=17, hidden=7168),
    'fp8_int32_col_scales_T4096_H4096_topk16': dict(x='fp8_int32_col', topk=16),
    'align128_T4096_H2048': dict(alignment=128, hidden=2048),
    'align128_T17_H4096_fp8_col': dict(alignment=128, tokens=17, x='fp8_col'),
    'align128_no_topk_T17_H2048': dict(alignment=128, tokens=17, hidden=2048, with_topk=False),
    'buffer_1e9_random_T4096_H7168_fp8_col': dict(buf='big', x='fp8_col', hidden=7168),
    'buffer_1e9_skewed_T4096_H2048': dict(buf='big', routing='skewed', hidden=2048),
    'buffer_1e9_T17_topk16_align128': dict(buf='big', tokens=17, topk=16, alignment=128),
}

COMBINE = {
    'combine_no_bias_no_weights': dict(hidden=2048, combine_weights=False),
    'combine_bias_tensor': dict(hidden=2048, bias='one'),
    'combine_bias_tuple_H7168': dict(hidden=7168, bias='two'),
    'combine_bias_tuple_no_weights': dict(hidden=2048, bias='two', combine_weights=False),
    'combine_bias_tuple_no_topk_T17': dict(tokens=17, hidden=2048, bias='two', with_topk=False),
    'combine_bias_tensor_minus_one_heavy': dict(routing='minus_one_heavy', hidden=2048, bias='one'),
}

# DeepEP's tuning sweep shape: Config(num_sms, chunk, 256); combine uses the same num_sms (the
# handle's channel count) with smaller chunks, as DeepEP's combine sweep does.
CONFIGS = {f'config_sms{sms}_chunk{chunk}': dict(buf='big', hidden=7168, configs=(sms, chunk, max(1, chunk // 2)))
           for sms in (8, 24) for chunk in (4, 8, 16, 32)}
CONFIGS.update({
    'config_sms24_chunk8_fp8_col': dict(buf='big', hidden=7168, x='fp8_col', configs=(24, 8, 4)),
    'config_sms8_chunk6_T17_topk16': dict(buf='big', tokens=17, topk=16, configs=(8, 6, 3)),
    'config_defaults_explicit': dict(hidden=7168, configs='default'),
})


def rank_valued(ctx):
    """DeepEP's own check: x = rank everywhere, so each source's block of rows holds its rank,
    the received weights (x = rank too) equal the source rank on local slots, and
    combine(recv_x) / (number of ranks the token went to) == x."""
    buf = ctx.buffers['hint']
    inp = make_inputs(ctx, hidden=2048)
    x = torch.ones(inp.tokens, inp.hidden, dtype=torch.bfloat16) * ctx.rank
    weights = torch.ones(inp.tokens, inp.topk.size(1), dtype=torch.float32) * ctx.rank
    total = inp.per_rank.clone()
    dist.all_reduce(total, group=ctx.group)
    chk = Checks()
    recv_x, recv_topk, recv_w, counts, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=inp.per_rank, is_token_in_rank=inp.in_rank, num_tokens_per_expert=inp.per_expert,
        topk_idx=inp.topk, topk_weights=weights)

    def blocks():
        assert recv_x.size(0) == int(total[ctx.rank]), f'{recv_x.size(0)} rows, expected {int(total[ctx.rank])}'
        ends = handle[0][:, ctx.rank].tolist()
        for s in range(ctx.world):
            block = recv_x[(ends[s - 1] if s else 0):ends[s]]
            assert bool((block == s).all()), f'rows from source {s} do not all hold {s}'
        local = E // ctx.world
        assert bool(((recv_topk >= -1) & (recv_topk < local)).all()), 'recv_topk_idx outside {-1} and [0, E/R)'
        source = recv_x[:, :1].float().expand_as(recv_w)
        assert torch.equal(recv_w, torch.where(recv_topk >= 0, source, torch.zeros_like(source))), \
            'recv_topk_weights are not the source rank on local slots and 0 elsewhere'
        assert counts == [int((recv_topk == i).sum()) for i in range(local)], 'per-expert counts != top-k hits'

    chk(blocks)
    chk.agree(ctx.group)
    combined, combined_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)

    def sums():
        copies = inp.in_rank.sum(1)
        sent = copies > 0
        assert torch.equal(combined[sent].float() / copies[sent].unsqueeze(1), x[sent].float()), \
            'combine(recv_x) / copies != x'
        assert not bool(combined[~sent].any()), 'tokens sent nowhere must combine to 0'
        assert torch.equal(combined_w, sent_weights(inp.topk, weights)), 'combined weights != the weights sent'

    chk(sums)
    chk.done()


# ---------------------------------------------------------------- repeated, cached, worst-case
def repeated_dispatch(ctx):
    """Two identical dispatches give bit-identical outputs and handles (the order is deterministic)."""
    buf = ctx.buffers['hint']
    inp = make_inputs(ctx, x='fp8_col')
    chk = Checks()
    ref = expect_dispatch(ctx, inp)
    first = buf.dispatch(inp.x, **layout_args(inp))
    second = buf.dispatch(inp.x, **layout_args(inp))
    chk(check_dispatch, first, ref, inp.in_rank)
    chk(check_dispatch, second, ref, inp.in_rank)

    def identical():
        assert_same('recv_x', second[0][0], first[0][0])
        assert_same('recv_x_scales', second[0][1], first[0][1])
        assert_same('recv_topk_idx', second[1], first[1])
        assert_same('recv_topk_weights', second[2], first[2])
        assert second[3] == first[3], 'num_recv_tokens_per_expert_list differs'
        for i in (0, 1, 2, 3, 5):
            assert_same(f'handle[{i}] {HANDLE_NAMES[i]}', second[4][i], first[4][i])

    chk(identical)
    chk.done()


def cached_dispatch(ctx):
    """handle= reuses the routing: the same x gives the same rows, new BF16 and FP8 payloads
    arrive in the same order, the result is (recv_x, None, None, None, None, event), and the
    handle is left as it was."""
    buf = ctx.buffers['hint']
    inp = make_inputs(ctx)
    chk = Checks()
    ref = expect_dispatch(ctx, inp)
    out = buf.dispatch(inp.x, **layout_args(inp))
    chk(check_dispatch, out, ref, inp.in_rank)
    chk.agree(ctx.group)
    handle = out[4]
    chk(check_cached, buf.dispatch(inp.x, handle=handle), ref)
    for kind in ('bf16', 'fp8_col', 'fp8_int32'):
        x = make_x(kind, inp.tokens, inp.hidden)
        want = expect_dispatch(ctx, inp, with_topk=False, x=x)
        chk(check_cached, buf.dispatch(x, handle=handle), want)
    chk(check_handle, handle, ref, inp.in_rank)
    chk.done()


def combine_twice(ctx):
    """Combine twice with one handle gives identical results (the first may rewrite send_head),
    and a cached dispatch on that handle still works (the backward of combine)."""
    buf = ctx.buffers['hint']
    inp = make_inputs(ctx, hidden=7168)
    chk = Checks()
    ref = expect_dispatch(ctx, inp)
    out = buf.dispatch(inp.x, **layout_args(inp))
    chk(check_dispatch, out, ref, inp.in_rank)
    chk.agree(ctx.group)
    y = torch.randn(ref.num_recv, inp.hidden, dtype=torch.bfloat16)
    bias = make_bias('two', inp.tokens, inp.hidden)
    want = ref_combine(ctx.group, ref, y, out[2], bias)
    first = buf.combine(y, out[4], topk_weights=out[2], bias=bias)
    second = buf.combine(y, out[4], topk_weights=out[2], bias=bias)
    chk(check_combine, first, want)
    chk(check_combine, second, want)
    chk(check_handle, out[4], ref, inp.in_rank, after_combine=True)
    chk(check_cached, buf.dispatch(inp.x, handle=out[4]), ref)
    chk.done()


def worst_tokens(ctx, routing='random', tokens=4096, hidden=4096, x='bf16'):
    """num_worst_tokens = T*world: exactly that many rows, the head equal to the normal run,
    tail recv_topk_idx -1, an empty expert list; combine with that handle reads only the
    received rows (the tail of its input is NaN)."""
    buf = ctx.buffers['hint']
    inp = make_inputs(ctx, routing, tokens, hidden, x=x)
    worst = inp.tokens * ctx.world
    chk = Checks()
    ref = expect_dispatch(ctx, inp)
    normal = buf.dispatch(inp.x, **layout_args(inp))
    out = buf.dispatch(inp.x, **layout_args(inp), num_worst_tokens=worst)
    chk(check_dispatch, normal, ref, inp.in_rank)
    chk(check_dispatch, out, ref, inp.in_rank, worst=worst)
    chk(same_head, normal, out, ref.num_recv)
    chk.agree(ctx.group)

    n = ref.num_recv
    y = torch.randn(worst, hidden, dtype=torch.bfloat16)
    y[n:] = float('nan')
    weights = out[2].clone()
    weights[n:] = float('nan')
    want = ref_combine(ctx.group, ref, y, weights)
    got = buf.combine(y, out[4], topk_weights=weights)
    chk(check_combine, got, want)
    chk(assert_same, 'combined_topk_weights vs the weights sent', got[1], sent_weights(inp.topk, inp.weights))
    chk.done()


def num_worst_tokens_without_topk(ctx):
    """DeepEP asserts that num_worst_tokens comes with top-k; here it also works without:
    exactly num_worst_tokens rows whose first rows equal the plain dispatch."""
    buf = ctx.buffers['hint']
    inp = make_inputs(ctx, tokens=64, hidden=2048)
    worst = 64 * ctx.world
    plain, *_ = buf.dispatch(inp.x, **layout_args(inp, with_topk=False))
    recv_x, topk, weights, counts, handle, _ = buf.dispatch(inp.x, **layout_args(inp, with_topk=False),
                                                             num_worst_tokens=worst)
    assert recv_x.shape == (worst, inp.x.shape[1]), f'recv_x {tuple(recv_x.shape)}, want {worst} rows'
    assert topk is None and weights is None and counts == [], 'no top-k outputs and an empty expert list'
    assert torch.equal(recv_x[:plain.shape[0]], plain), 'first rows differ from the plain dispatch'
    assert handle[3].shape[0] == worst, 'recv_src_idx has num_worst_tokens rows'


# ---------------------------------------------------------------- events and streams
def async_finish(ctx):
    """async_finish=True returns an event (dispatch, combine, cached dispatch); results are
    right once the current stream waits on it."""
    buf = ctx.buffers['hint']
    inp = make_inputs(ctx, hidden=2048)
    chk = Checks()
    ref = expect_dispatch(ctx, inp)
    out = buf.dispatch(inp.x, **layout_args(inp), async_finish=True)
    if out[5].event is not None:
        out[5].current_stream_wait()
    chk(check_dispatch, out, ref, inp.in_rank, is_async=True)
    chk.agree(ctx.group)
    y = torch.randn(ref.num_recv, inp.hidden, dtype=torch.bfloat16)
    want = ref_combine(ctx.group, ref, y, out[2])
    got = buf.combine(y, out[4], topk_weights=out[2], async_finish=True)
    if got[2].event is not None:
        got[2].current_stream_wait()
    chk(check_combine, got, want, is_async=True)
    cached = buf.dispatch(inp.x, handle=out[4], async_finish=True)
    if cached[5].event is not None:
        cached[5].current_stream_wait()
    chk(check_cached, cached, ref, is_async=True)
    chk.done()


def event_context(ctx):
    """`with event:` (Megatron's use): the current stream waits on exit; work inside may overlap."""
    buf = ctx.buffers['hint']
    inp = make_inputs(ctx, hidden=2048)
    chk = Checks()
    ref = expect_dispatch(ctx, inp)
    out = buf.dispatch(inp.x, **layout_args(inp), async_finish=True)
    with out[5] as event:
        chk.expect(event is out[5], 'EventOverlap.__enter__ must return the event itself')
        overlap = torch.randn(1024, 1024) @ torch.randn(1024, 1024)  # compute beside the dispatch
    chk(check_dispatch, out, ref, inp.in_rank, is_async=True)
    chk.agree(ctx.group)
    y = torch.randn(ref.num_recv, inp.hidden, dtype=torch.bfloat16)
    want = ref_combine(ctx.group, ref, y, out[2])
    got = buf.combine(y, out[4], topk_weights=out[2], async_finish=True)
    with got[2]:
        overlap += 1
    chk(check_combine, got, want, is_async=True)
    chk.done()


def delayed(tensor, value):
    """Copies value into tensor behind ~10 ms of GPU work on the current stream: a call that does
    not wait for the current stream (or previous_event) reads the old contents."""
    torch.cuda._sleep(SPIN_CYCLES)
    tensor.copy_(value)


def stream_order(ctx, previous_event=False, async_=False, on_comm_stream=False):
    """The comm stream waits for the current stream (or previous_event): dispatch, combine and
    cached dispatch read inputs written by a delayed copy just before the call. The reference
    is computed first, so its gathers do not synchronise the copy away."""
    buf = ctx.buffers['hint']
    inp = make_inputs(ctx, hidden=2048)
    kwargs = dict(async_finish=async_, allocate_on_comm_stream=on_comm_stream)

    def call(fn, *args, **more):
        kw = dict(kwargs, **more)
        if previous_event:
            kw['previous_event'] = deep_ep.Buffer.capture()
        out = fn(*args, **kw)
        if out[-1].event is not None:
            out[-1].current_stream_wait()
        return out

    chk = Checks()
    new_x = make_x('bf16', inp.tokens, inp.hidden)
    ref = expect_dispatch(ctx, inp, x=new_x)
    delayed(inp.x, new_x)
    out = call(buf.dispatch, inp.x, **layout_args(inp))
    chk(check_dispatch, out, ref, inp.in_rank, is_async=async_)
    chk.agree(ctx.group)

    y, new_y = (torch.randn(ref.num_recv, inp.hidden, dtype=torch.bfloat16) for _ in range(2))
    want = ref_combine(ctx.group, ref, new_y, out[2])
    delayed(y, new_y)
    chk(check_combine, call(buf.combine, y, out[4], topk_weights=out[2]), want, is_async=async_)

    x, new_x = (make_x('bf16', inp.tokens, inp.hidden) for _ in range(2))
    want = expect_dispatch(ctx, inp, with_topk=False, x=new_x)
    delayed(x, new_x)
    chk(check_cached, call(buf.dispatch, x, handle=out[4]), want, is_async=async_)
    chk.done()


def comm_stream_alloc_needs_event_and_async(ctx):
    """allocate_on_comm_stream=True without previous_event or without async_finish is refused
    (DeepEP asserts both), for dispatch and combine; the buffer stays usable."""
    buf = ctx.buffers['hint']
    inp = make_inputs(ctx, tokens=64, hidden=2048)
    chk = Checks()
    out = buf.dispatch(inp.x, **layout_args(inp))
    y = torch.randn(out[4][3].size(0), inp.hidden, dtype=torch.bfloat16)
    for kwargs in (dict(async_finish=True), dict(previous_event=deep_ep.Buffer.capture())):
        what = f'allocate_on_comm_stream=True with only {sorted(kwargs)}'
        chk(expect_raises_match, f'dispatch {what}', (RuntimeError, AssertionError),
            lambda: buf.dispatch(inp.x, **layout_args(inp), allocate_on_comm_stream=True, **kwargs), r'.')
        chk(expect_raises_match, f'combine {what}', (RuntimeError, AssertionError),
            lambda: buf.combine(y, out[4], allocate_on_comm_stream=True, **kwargs), r'.')
    chk(roundtrip, ctx, tokens=17, hidden=2048)
    chk.done()


# ---------------------------------------------------------------- CUDA graph
def cuda_graph(ctx, tokens=4096, hidden=4096, replays=3):
    """Dispatch with num_worst_tokens plus combine (of the received rows, with the received
    weights) captured in one CUDA graph after a warm-up on a side stream, then replayed with new
    x and weights copied into the captured inputs; every replay is checked right after."""
    buf = ctx.buffers['hint']
    inp = make_inputs(ctx, tokens=tokens, hidden=hidden)
    worst = inp.tokens * ctx.world

    def step():
        out = buf.dispatch(inp.x, **layout_args(inp), num_worst_tokens=worst)
        return out, buf.combine(out[0], out[4], topk_weights=out[2])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside capture, as torch recommends
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: torch's NCCL watchdog thread may query events while this thread captures.
    with torch.cuda.graph(graph, capture_error_mode='thread_local'):
        out, combined = step()

    chk = Checks()
    for _ in range(replays):
        new_x = make_x('bf16', inp.tokens, inp.hidden)
        new_w = torch.randn(inp.tokens, inp.topk.size(1), dtype=torch.float32)
        inp.x.copy_(new_x)
        inp.weights.copy_(new_w)
        graph.replay()
        torch.cuda.synchronize()
        ref = expect_dispatch(ctx, inp, x=new_x, weights=new_w)
        chk(check_dispatch, out, ref, inp.in_rank, worst=worst)
        chk.agree(ctx.group)
        want = ref_combine(ctx.group, ref, out[0], out[2])
        chk(check_combine, combined, want)
        chk(assert_same, 'combined_topk_weights vs the weights sent', combined[1], sent_weights(inp.topk, new_w))
    del graph
    chk.done()


# ---------------------------------------------------------------- bad input
def foreign_handle(handle, world):
    """The handle with a rank_prefix_matrix from a buffer of twice as many ranks."""
    return (torch.zeros(2 * world, 2 * world, dtype=torch.int32),) + tuple(handle[1:])


def bad_fp8_scales_rows(buf, inp, out):
    q, scales = fp8_cast(inp.x.float())
    bad_scales = torch.ones(inp.tokens + 1, scales.size(1), dtype=torch.float32)
    return buf.dispatch((q, bad_scales), **layout_args(inp))


def bad_topk_out_of_range(buf, inp, out):
    topk = inp.topk.clone()
    topk[0, 0] = E
    return buf.dispatch(inp.x, **dict(layout_args(inp), topk_idx=topk))


def expert_output_for(out, inp):
    return torch.randn(out[4][3].size(0), inp.hidden, dtype=torch.bfloat16)


# name: (call(buf, inp, out), exception, pattern the message must match). inp is 64 tokens of
# BF16 2048 hidden with top-k; out is a good dispatch of it (for handle-based cases).
BAD_INPUTS = {
    'bad_x_float64': (lambda buf, inp, out: buf.dispatch(inp.x.double(), **layout_args(inp)),
                      RuntimeError, X_NAMED),
    'bad_x_not_contiguous': (lambda buf, inp, out: buf.dispatch(inp.x.t().contiguous().t(), **layout_args(inp)),
                             RuntimeError, X_NAMED),
    'bad_hidden_1001_bf16': (lambda buf, inp, out: buf.dispatch(torch.randn(inp.tokens, 1001, dtype=torch.bfloat16),
                                                                **layout_args(inp)),
                             RuntimeError, r'\bx\b|hidden'),
    'bad_fp8_scales_first_dim': (bad_fp8_scales_rows, RuntimeError, r'scales'),
    'bad_topk_idx_out_of_range': (bad_topk_out_of_range, RuntimeError, r'topk_idx'),
    'bad_handle_other_rank_count_cached_dispatch': (
        lambda buf, inp, out: buf.dispatch(inp.x, handle=foreign_handle(out[4], buf.group_size)),
        RuntimeError, r'rank_prefix_matrix|handle'),
    'bad_handle_other_rank_count_combine': (
        lambda buf, inp, out: buf.combine(expert_output_for(out, inp), foreign_handle(out[4], buf.group_size)),
        RuntimeError, r'rank_prefix_matrix|handle'),
    'bad_config_odd_num_sms': (lambda buf, inp, out: buf.dispatch(inp.x, **layout_args(inp),
                                                                  config=deep_ep.Config(23, 8, 256)),
                               RuntimeError, r'num_sms'),
    'bad_combine_x_float32': (lambda buf, inp, out: buf.combine(expert_output_for(out, inp).float(), out[4]),
                              RuntimeError, X_NAMED),
    # DeepEP's Python asserts that a cached dispatch carries no top-k.
    'bad_cached_dispatch_with_topk': (lambda buf, inp, out: buf.dispatch(inp.x, handle=out[4], topk_idx=inp.topk,
                                                                         topk_weights=inp.weights),
                                      (AssertionError, RuntimeError), r''),
}


def bad_input(ctx, call, exc, pattern, name):
    """The bad call raises exc naming the argument, on every rank alike; then a normal
    dispatch + combine on the same buffer still works."""
    buf = ctx.buffers['hint']
    inp = make_inputs(ctx, tokens=64, hidden=2048)
    out = buf.dispatch(inp.x, **layout_args(inp))
    chk = Checks()
    chk(expect_raises_match, name, exc, lambda: call(buf, inp, out), pattern)
    chk(roundtrip, ctx, tokens=17, hidden=2048)
    chk.done()


def buffer_too_small(ctx):
    """A 1 MiB buffer cannot carry 7168-hidden rows: the error names num_nvl_bytes. The small
    buffer still tears down, and the main buffer still works."""
    chk = Checks()
    with make_buffer(ctx.group, num_nvl_bytes=1 << 20) as small:
        inp = make_inputs(ctx, tokens=64, hidden=7168)
        chk(expect_raises_match, 'dispatch of 7168 hidden on a 1 MiB buffer', RuntimeError,
            lambda: small.dispatch(inp.x, **layout_args(inp)), r'num_nvl_bytes')
    chk(roundtrip, ctx, tokens=17, hidden=2048)
    chk.done()


# ---------------------------------------------------------------- stalled peer
# dispatch_data_kernel: the peer stops inside the op (after its notify, before its data kernel).
# combine_data_kernel: the peer enters combine (the intranode combine is one kernel, no notify of
# its own; it starts with a per-block LSA barrier, kernels/normal_combine.cu) and its kernel starts
# well past the others' timeout.
STALL_PHASES = ('dispatch', 'cached_dispatch', 'combine', 'dispatch_data_kernel', 'combine_data_kernel')
# The phases in which the stalled rank makes the call, its kernel late (the others skip the call).
STALL_INSIDE = ('dispatch_data_kernel', 'combine_data_kernel')
# What the survivors' error must match: rank 1 named (any phase); inside combine, also as the rank
# that never arrived at the combine kernel's opening barrier (src/faults.rs: DEEPEP_WAIT_OP_LSA_BARRIER,
# the expected first expiry: the late kernel has not started) or, should a survivor get past it,
# whose combine rows never came (DEEPEP_WAIT_OP_COMBINE_SLOT / _CONSUMED).
STALL_NAMED = rf'\b(?:rank|peer)\s*{STALLED_RANK}\b'
STALL_PATTERNS = {
    'combine_data_kernel':
        rf'\brank {STALLED_RANK} never (?:arrived at LSA barrier|sent its combine data|freed a combine ring slot)',
}


def sleep_cycles(ms):
    """torch.cuda._sleep cycles that take about `ms` on this GPU."""
    probe = 10 ** 8
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(ms * probe / max(start.elapsed_time(end), 1e-3))


def late_dispatch(buf, inp, cycles, config=None):
    """A dispatch whose data kernel starts `cycles` after its notify: the ctypes path, with a GPU
    sleep put between its prepare (notify + host wait) and its data kernel launch."""
    from deep_ep_cpp import _normal

    runtime, launch = buf.runtime, _normal.lib.deepep_intranode_dispatch

    def delayed(handle, args, outs, stream):
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            torch.cuda._sleep(cycles)
        return launch(handle, args, outs, stream)

    _normal.lib.deepep_intranode_dispatch = delayed
    try:
        with ctypes_launches(runtime):  # the launch above is taken
            return buf.dispatch(inp.x, **layout_args(inp), config=config)
    finally:
        _normal.lib.deepep_intranode_dispatch = launch


def late_combine(buf, y, handle, cycles, **kwargs):
    """A combine whose kernel starts `cycles` late: the ctypes path (the compiled one is switched
    off for this call, as in late_dispatch), with a GPU sleep on the comm stream just before
    deepep_intranode_combine, the op's only launch (intranode combine has no notify of its own)."""
    from deep_ep_cpp import _normal

    runtime, launch = buf.runtime, _normal.lib.deepep_intranode_combine

    def delayed(handle, args, stream):
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            torch.cuda._sleep(cycles)
        return launch(handle, args, stream)

    _normal.lib.deepep_intranode_combine = delayed
    try:
        with ctypes_launches(runtime):  # the launch above is taken
            return buf.combine(y, handle, **kwargs)
    finally:
        _normal.lib.deepep_intranode_combine = launch


def stall_case(phase):
    return f'stalled_peer_{phase}_timeout'


def stalled_peer(ctx, phase):
    """Rank 1 skips an op (`phase`) that the others enter, or stops inside it: dispatch_data_kernel,
    its notify runs, its data kernel starts well past the others' timeout; combine_data_kernel, it
    calls combine but the combine's kernel (its only launch: no separate notify) starts well past
    the others' timeout. The others then give up at that kernel's opening per-block barrier, as
    when rank 1 skips combine; what differs is rank 1's side: it made the call, and its late kernel
    meets the others' stale barrier arrivals and rings (the others stay at a host barrier until it
    synchronized) before every rank destroys the buffer and makes a new one. The others must fail
    within 10 s with an error naming rank 1 instead of hanging (in the call where the host waits, as
    non-cached dispatch's notify does; else at the next call, and is_available() says so after a
    synchronize);
    destroy() must then return or raise on every rank,
    under a watchdog; and a new Buffer in the same processes must work (its results checked).
    Last, on their own buffers: the timeout leaves a buffer unusable."""
    chk = Checks()
    buf = deep_ep.Buffer(ctx.group, num_nvl_bytes=hint_bytes(ctx.world, 2048), explicitly_destroy=True)
    inp = make_inputs(ctx, tokens=256, hidden=2048)
    try:
        ref = expect_dispatch(ctx, inp)
        out = buf.dispatch(inp.x, **layout_args(inp))  # healthy first
        chk(check_dispatch, out, ref, inp.in_rank)
        handle = out[4]
        y = torch.randn(ref.num_recv, 2048, dtype=torch.bfloat16)
        calls = {'dispatch': lambda: buf.dispatch(inp.x, **layout_args(inp)),
                 'cached_dispatch': lambda: buf.dispatch(inp.x, handle=handle),
                 'combine': lambda: buf.combine(y, handle)}
        calls['dispatch_data_kernel'] = calls['dispatch']
        calls['combine_data_kernel'] = calls['combine']
        stops_inside = ctx.rank == STALLED_RANK and phase in STALL_INSIDE
        cycles = sleep_cycles(3 * STALL_TIMEOUT_MS) if stops_inside else 0
        torch.cuda.synchronize()
        buf.runtime.set_gpu_timeout_ms(STALL_TIMEOUT_MS)
        dist.barrier(group=ctx.group)
        if stops_inside:
            if phase == 'dispatch_data_kernel':
                late_dispatch(buf, inp, cycles)  # well past the others' timeout
            else:
                late_combine(buf, y, handle, cycles)
            torch.cuda.synchronize()
        elif ctx.rank == STALLED_RANK:
            time.sleep(3 * STALL_TIMEOUT_MS / 1000)  # well past the others' timeout
        else:
            start = time.monotonic()

            def stalled_op():
                calls[phase]()
                if phase != 'dispatch':  # no host wait on the stalled kernel: the stall surfaces at the next call
                    torch.cuda.synchronize()
                    chk.expect(not buf.runtime.is_available(), f'is_available() is True after the stalled {phase}')
                    buf.get_dispatch_layout(inp.topk, E)

            chk(expect_raises_match, f'{phase} while rank {STALLED_RANK} stalls', RuntimeError, stalled_op,
                STALL_PATTERNS.get(phase, STALL_NAMED))
            seconds = time.monotonic() - start
            chk.expect(seconds < 10, f'the stalled {phase} failed only after {seconds:.1f} s '
                                     f'(GPU timeout {STALL_TIMEOUT_MS} ms)')
    finally:
        dist.barrier(group=ctx.group)
        destroy_after_stall(ctx.rep, stall_case(phase), buf.destroy, chk)
    # The survivors (and the stalled rank) go on in the same processes with a new buffer.
    ctx.buffers['after_stall'] = deep_ep.Buffer(ctx.group, num_nvl_bytes=hint_bytes(ctx.world, 2048),
                                                explicitly_destroy=True)
    try:
        chk(roundtrip, ctx, buf='after_stall', tokens=256, hidden=2048)
    finally:
        ctx.buffers.pop('after_stall').destroy()
    chk.done()


# ---------------------------------------------------------------- workers
def cases(ctx):
    """name -> callable, in run order: everything that needs working buffers first."""
    out = {}
    for family in (CORE, COMBINE, CONFIGS):
        out.update({name: (lambda spec=spec: roundtrip(ctx, **spec)) for name, spec in family.items()})
    out.update({
        'deepep_rank_valued_check': lambda: rank_valued(ctx),
        'repeated_dispatch_bit_identical': lambda: repeated_dispatch(ctx),
        'cached_dispatch': lambda: cached_dispatch(ctx),
        'combine_twice_same_handle': lambda: combine_twice(ctx),
        'num_worst_tokens_T4096_H4096': lambda: worst_tokens(ctx),
        'num_worst_tokens_fp8_col_T17_H7168': lambda: worst_tokens(ctx, tokens=17, hidden=7168, x='fp8_col'),
        'num_worst_tokens_skewed_T4096_H2048': lambda: worst_tokens(ctx, 'skewed', hidden=2048),
        'num_worst_tokens_minus_one_heavy_T17_H2048': lambda: worst_tokens(ctx, 'minus_one_heavy', 17, 2048),
        'num_worst_tokens_without_topk': lambda: num_worst_tokens_without_topk(ctx),
        'async_finish': lambda: async_finish(ctx),
        'with_event_context': lambda: event_context(ctx),
        'waits_for_compute_stream': lambda: stream_order(ctx),
        'previous_event_sync': lambda: stream_order(ctx, previous_event=True),
        'previous_event_async_allocate_on_comm_stream': lambda: stream_order(ctx, True, True, True),
        'allocate_on_comm_stream_requires_event_and_async': lambda: comm_stream_alloc_needs_event_and_async(ctx),
    })
    out.update({name: (lambda name=name, bad=bad: bad_input(ctx, *bad, name)) for name, bad in BAD_INPUTS.items()})
    out['bad_buffer_too_small'] = lambda: buffer_too_small(ctx)
    # Last among the shared-buffer cases: a failed capture can leave the stream unusable.
    out['cuda_graph_worst_dispatch_combine'] = lambda: cuda_graph(ctx)
    return out


def run_with_buffers(ctx, names_and_fns, prefix=''):
    """Creates the hint-sized and the 1e9 buffers, runs the cases, then destroys both
    (reported as a case: teardown after all of them must be clean)."""
    rep = ctx.rep
    ctx.buffers['hint'] = deep_ep.Buffer(ctx.group, num_nvl_bytes=hint_bytes(ctx.world), explicitly_destroy=True)
    ctx.buffers['big'] = deep_ep.Buffer(ctx.group, num_nvl_bytes=int(1e9), explicitly_destroy=True)
    for name, fn in names_and_fns.items():
        rep.run(name, fn)

    def destroy_all():
        errors = []
        for buf in ctx.buffers.values():
            try:
                buf.destroy()
            except RuntimeError as e:
                errors.append(str(e))
        assert not errors, f'destroy() failed: {errors}'

    rep.run(f'{prefix}destroy_buffers', destroy_all)


def worker(rank, world, group, rep):
    ctx = make_ctx(dist.new_group(list(range(world))), rep)
    run_with_buffers(ctx, cases(ctx))
    for phase in STALL_PHASES:
        rep.run(stall_case(phase), stalled_peer, ctx, phase)


SUBGROUP_CASES = ('random_T4096_H7168', 'fp8_col_scales_T4096_H7168', 'no_topk_T4096_H4096',
                  'combine_bias_tuple_H7168', 'deepep_rank_valued_check', 'cached_dispatch',
                  'num_worst_tokens_T4096_H4096', 'async_finish', 'bad_x_float64')


def subgroup_worker(rank, world, group, rep):
    """A Buffer over ranks {0, 1} of a 4-rank job: group ranks, not global ones, must be used.
    Ranks 2 and 3 are outside the group; they record the cases as passed without work."""
    members, prefix = [0, 1], 'subgroup01_'
    sub = dist.new_group(members)  # collective over the whole job
    if rank not in members:
        for name in SUBGROUP_CASES + ('destroy_buffers',):
            rep.run(prefix + name, lambda: None)
        return
    ctx = make_ctx(sub, rep)
    everything = cases(ctx)
    run_with_buffers(ctx, {prefix + name: everything[name] for name in SUBGROUP_CASES}, prefix)


if __name__ == '__main__':
    num_gpus = torch.cuda.device_count()
    if num_gpus < 2:
        print(f'test_normal needs at least 2 GPUs, found {num_gpus}')
        sys.exit(1)
    for world in (2, 4, 8):
        if world > num_gpus:
            skip(f'w{world}', f'only {num_gpus} GPUs visible')
            continue
        spawn(worker, world, timeout=300)
    if num_gpus >= 4:
        spawn(subgroup_worker, 4, timeout=150)
    else:
        skip('w4/subgroup01', f'only {num_gpus} GPUs visible')
    finish()
