"""Long runs on 2 GPUs (issue 24 item 8): create/destroy cycles with flat device memory, and a
timed soak mixing normal and low-latency (LL) calls on ONE buffer, as SGLang's auto mode does.

1. `--cycles N` (default 1000): N Buffer create/destroy cycles, alternating a normal-mode buffer
   (num_nvl_bytes = 256 MiB) and an auto-mode one (the same plus num_rdma_bytes from the LL hint,
   low_latency_mode=True). Every `--op-every` cycles the buffer is used: get_dispatch_layout and a
   small normal dispatch + combine, or clean_low_latency_buffer and a small LL dispatch + combine,
   each checked against the torch references. Free device memory (torch.cuda.mem_get_info after
   gc, synchronize and empty_cache) is sampled after 3 warm-up cycles and every 25 cycles: it
   must stay within `--cycle-tolerance-mib` (default 64) of the warm-up value.
2. `--minutes M` (default 10): one Buffer with num_nvl_bytes (DeepEP's normal hint at hidden 7168),
   num_rdma_bytes (the LL hint for M=128, hidden 7168, 288 experts), low_latency_mode=True and
   num_qps_per_rank = E / R (SGLang's DeepEPBuffer in auto mode). Each iteration runs 1-3 ops
   picked at random, normal or LL, with shapes, routings and options drawn from a generator seeded
   by (seed, iteration), so both ranks draw the same ones (the data is seeded by iteration and
   rank):
   - normal: get_dispatch_layout (checked against common.ref_layout), dispatch (T 0-4096 per rank,
     hidden 2048-7168, top-k 1-16, BF16 or FP8 with float32 row/column-major or UE8M0 int32
     scales, expert_alignment 1 or 128, routings random / skewed / one rank empty / -1 heavy /
     duplicate experts), combine (received weights, sometimes one or two biases), a cached
     dispatch of a new payload; all bit-exact against normal_reference.py;
   - LL: clean_low_latency_buffer(M, H, E) first whenever a normal op ran since the last LL op
     (DeepEP's rule) or the LL hidden changed; then low_latency_dispatch (T 0-M per rank, hidden
     2048/4096/7168, top-k 1-16, BF16 / FP8 / FP8 round_scale / FP8 UE8M0, async or hook) checked
     bit-exact against ll_reference.py, and low_latency_combine (sometimes zero-copy) within 1
     BF16 ulp of it;
   - each op is repeated with the same inputs and its outputs must be bit-identical to the
     first run's;
   - device memory is sampled after every iteration; after a warm-up that runs every op kind and
     hidden once, it must stay within `--soak-tolerance-mib` (default 128) of the warm-up value,
     and torch's allocated bytes within the same tolerance.
   Prints one summary line: iterations, ops, cleans, max memory drift.

Both parts fit short runs: `--cycles 100 --minutes 1`; 0 skips a part. A failed iteration names
the seed and iteration; `--seed S --first-iteration I --iterations 1 --cycles 0` reruns it.
A hang fails the case within `--iteration-timeout` seconds (common.watchdog)."""
import argparse
import random
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

import deep_ep
from common import (Checks, assert_layout, assert_same, device_memory, finish, make_buffer, ref_layout,
                    settled_device_memory, spawn, watchdog)
from ll_reference import (MODES, bf16_ulp_distance, expert_scales, fp8_quantize, per_token_cast_back,
                          received_rows, ref_ll_combine_local, ref_ll_dispatch, ue8m0_pack)
from normal_reference import gather_rows, ref_combine, ref_dispatch

MiB = 1 << 20
E = 288  # one model: the same experts in both modes (DeepSeek-V3's 256 + 32 redundant)
LL_M = 128  # SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK's default
MAX_HIDDEN = 7168
NORMAL_HIDDENS = (2048, 4096, 5120, 7168)
LL_HIDDENS = (2048, 4096, 7168)  # multiples of 512 (UE8M0)
TOPKS = (1, 4, 8, 9, 16)
NORMAL_MAX_TOKENS = 4096
NORMAL_X = ('bf16', 'fp8_row', 'fp8_col', 'fp8_ue8m0')
ROUTINGS = ('random', 'random', 'skewed', 'empty_rank', 'minus_one_heavy', 'duplicates')
CYCLE_NVL = 256 * MiB
CYCLE_LL = (128, 4096, 32)  # (M, hidden, experts) of the cycles' auto-mode buffers
I32, F32, BF16 = torch.int32, torch.float32, torch.bfloat16


# ---------------------------------------------------------------- memory
class Drift:
    """Largest loss of free device memory (and growth of torch-allocated bytes) since a baseline."""

    def __init__(self, settle=False):
        self.settle = settle
        self.seconds = 0.0  # spent sampling
        self.base = None
        self.samples = 0
        self.max_free_drop = 0
        self.max_alloc_growth = 0

    def sample(self):
        start = time.monotonic()
        free, allocated = settled_device_memory() if self.settle else device_memory()
        self.seconds += time.monotonic() - start
        if self.base is None:
            self.base = (free, allocated)
            return
        self.samples += 1
        self.max_free_drop = max(self.max_free_drop, self.base[0] - free)
        self.max_alloc_growth = max(self.max_alloc_growth, allocated - self.base[1])

    def check(self, what, tolerance):
        assert self.max_free_drop <= tolerance, \
            f'{what}: free device memory fell {self.max_free_drop / MiB:.1f} MiB below its value after the warm-up ' \
            f'(tolerance {tolerance / MiB:.0f} MiB)'
        assert self.max_alloc_growth <= tolerance, \
            f'{what}: torch-allocated memory grew {self.max_alloc_growth / MiB:.1f} MiB (tolerance {tolerance / MiB:.0f} MiB)'

    def text(self):
        return (f'max free-memory drop {self.max_free_drop / MiB:.1f} MiB, max torch-allocated growth '
                f'{self.max_alloc_growth / MiB:.1f} MiB over {self.samples} samples')


def any_rank(group, flag):
    """Collective: True on every rank if flag is true on any rank."""
    t = torch.tensor([int(bool(flag))], dtype=I32, device='cuda')
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


# ---------------------------------------------------------------- inputs
def route(kind, num_tokens, num_topk, world, num_experts):
    """topk_idx [T, K] (deep_ep.topk_idx_t) of one routing pattern; every expert at most once per
    token except with 'duplicates'."""
    per_rank = num_experts // world
    scores = torch.rand(num_tokens, num_experts, dtype=F32) + 1
    if kind == 'skewed':  # every token to the last rank's experts
        scores[:, :(world - 1) * per_rank] = 0
    elif kind == 'empty_rank':  # nothing to rank 0's experts
        scores[:, :per_rank] = 0
    topk = scores.topk(num_topk, dim=1).indices
    if kind == 'minus_one_heavy':  # most slots -1, some tokens routed nowhere
        topk[torch.rand(topk.shape, dtype=F32) < 0.8] = -1
        topk[:num_tokens // 8] = -1
    elif kind == 'duplicates' and num_topk > 1:  # the same expert in two slots of a token
        topk[:, 1] = topk[:, 0]
    elif kind == 'random' and num_tokens:  # a few -1 holes, as DeepEP's LL test makes
        holes = torch.randint(0, num_tokens * num_topk, (min(10, num_tokens),), dtype=torch.int64)
        topk.view(-1)[holes] = -1
    return topk.to(deep_ep.topk_idx_t)


def normal_payload(kind, num_tokens, hidden):
    """x as normal dispatch takes it: BF16 [T, H], or (FP8 [T, H], scales): float32 [T, H/128]
    row- or column-major, or UE8M0-packed int32 [T, H/512] column-major (SGLang with DeepGEMM)."""
    x = torch.randn(num_tokens, hidden, dtype=BF16)
    if kind == 'bf16':
        return x
    q, scale_inv = fp8_quantize(x, round_scale=kind == 'fp8_ue8m0')
    if kind == 'fp8_row':
        return q, scale_inv
    if kind == 'fp8_col':
        return q, scale_inv.t().contiguous().t()
    return q, ue8m0_pack(scale_inv).t().contiguous().t()


def draw_normal(rng, world, hidden=None, x=None):
    routing = rng.choice(ROUTINGS)
    tokens = [rng.choice((0, 1, rng.randint(1, 64), rng.randint(1, NORMAL_MAX_TOKENS),
                          rng.randint(1, NORMAL_MAX_TOKENS))) for _ in range(world)]
    return SimpleNamespace(kind='normal', routing=routing, tokens=tokens,
                           hidden=hidden or rng.choice(NORMAL_HIDDENS), topk=rng.choice(TOPKS),
                           x=x or rng.choice(NORMAL_X), cached_x=rng.choice(NORMAL_X),
                           alignment=rng.choice((1, 1, 128)), bias=rng.choice((None, None, 'one', 'two')))


def draw_ll(rng, world, hidden=None, mode=None, hook=None):
    routing = rng.choice(('random', 'random', 'skewed', 'minus_one_heavy', 'duplicates'))
    top = LL_M // 2 if routing == 'duplicates' else LL_M  # a duplicate slot sends a token twice to one expert
    tokens = [rng.choice((0, 1, rng.randint(1, top), top, rng.randint(1, top))) for _ in range(world)]
    return SimpleNamespace(kind='ll', routing=routing, tokens=tokens, hidden=hidden or rng.choice(LL_HIDDENS),
                           topk=rng.choice(TOPKS), mode=mode or rng.choice(tuple(MODES)),
                           hook=rng.random() < 0.5 if hook is None else hook, zero_copy=rng.random() < 0.25)


def describe(p):
    common_part = f'{p.kind} T={p.tokens} H={p.hidden} K={p.topk} routing={p.routing}'
    if p.kind == 'normal':
        return f'{common_part} x={p.x} cached_x={p.cached_x} align={p.alignment} bias={p.bias}'
    return f'{common_part} mode={p.mode} hook={p.hook} zero_copy={p.zero_copy}'


# ---------------------------------------------------------------- normal round trip
def bias_for(kind, num_tokens, hidden):
    if kind is None:
        return None
    if kind == 'one':
        return torch.randn(num_tokens, hidden, dtype=BF16)
    return torch.randn(num_tokens, hidden, dtype=BF16), torch.randn(num_tokens, hidden, dtype=BF16)


def split_x(x):
    return x if isinstance(x, tuple) else (x, None)


def normal_outputs(out):
    """The tensors of a dispatch result that a repeat must reproduce, cloned (send_head is
    rewritten by combine)."""
    data, scales = split_x(out[0])
    handle = out[4]
    named = [('recv_x', data), ('recv_x_scales', scales), ('recv_topk_idx', out[1]), ('recv_topk_weights', out[2])]
    named += [(f'handle[{i}]', handle[i]) for i in (0, 1, 2, 3, 5)]
    return [(n, t.clone()) for n, t in named if t is not None]


def check_normal_dispatch(out, ref, in_rank):
    assert isinstance(out, tuple) and len(out) == 6, f'dispatch returned {type(out).__name__}'
    data, scales = split_x(out[0])
    assert_same('recv_x', data, ref.recv_x)
    if ref.recv_x_scales is not None:
        assert scales is not None, 'FP8 dispatch returned no scales'
        assert_same('recv_x_scales', scales, ref.recv_x_scales)
    if ref.recv_topk_idx is not None:
        assert_same('recv_topk_idx', out[1], ref.recv_topk_idx)
        assert_same('recv_topk_weights', out[2], ref.recv_topk_weights)
    assert out[3] == ref.num_recv_tokens_per_expert_list, \
        f'num_recv_tokens_per_expert_list differs from the reference (sum {sum(out[3])} vs ' \
        f'{sum(ref.num_recv_tokens_per_expert_list)})'
    handle = out[4]
    assert handle[4] is in_rank, 'handle[4] is not the is_token_in_rank passed in'
    for i in (0, 1, 2, 3, 5):
        assert_same(f'handle[{i}]', handle[i], ref.handle[i])


def check_cached_dispatch(out, ref):
    assert all(o is None for o in out[1:5]), 'cached dispatch items 1..4 must be None'
    data, scales = split_x(out[0])
    assert_same('cached recv_x', data, ref.recv_x)
    if ref.recv_x_scales is not None:
        assert_same('cached recv_x_scales', scales, ref.recv_x_scales)


def check_repeat(what, first, second):
    assert len(first) == len(second), f'{what}: {len(second)} outputs, first run had {len(first)}'
    for (name, a), (_, b) in zip(first, second):
        assert_same(f'{what}: {name} vs the first run', b, a)


def normal_round(ctx, buf, p, chk, stats):
    """Layout, dispatch, combine and cached dispatch of one drawn shape, each checked against the
    reference and then repeated bit-identically."""
    world, rank = ctx.world, ctx.rank
    tokens = p.tokens[rank]
    topk = route(p.routing, tokens, p.topk, world, E)
    weights = torch.rand(tokens, p.topk, dtype=F32)
    x = normal_payload(p.x, tokens, p.hidden)
    x2 = normal_payload(p.cached_x, tokens, p.hidden)
    bias = bias_for(p.bias, tokens, p.hidden)

    layout = buf.get_dispatch_layout(topk, E)
    chk(assert_layout, layout, topk, E, world)
    per_rank, _, per_expert, in_rank = ref_layout(topk, E, world)
    args = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=topk, topk_weights=weights, expert_alignment=p.alignment)
    num_channels = deep_ep.Buffer.num_sms // 2
    ref = ref_dispatch(ctx.group, x, in_rank, per_expert, topk, weights, num_channels, p.alignment)
    ref2 = ref_dispatch(ctx.group, x2, in_rank, per_expert, num_channels=num_channels)

    results = []
    for attempt in range(2):
        out = buf.dispatch(x, **args)
        stats.ops += 1
        if attempt == 0:
            chk(check_normal_dispatch, out, ref, in_rank)
            chk.agree(ctx.group)  # a wrong handle must not reach combine
        dispatched = normal_outputs(out)
        y = torch.randn(ref.num_recv, p.hidden, dtype=BF16) if attempt == 0 else results[0][3]
        combined = buf.combine(y, out[4], topk_weights=out[2], bias=bias)
        cached = buf.dispatch(x2, handle=out[4])
        stats.ops += 2
        combined_out = [('combined_x', combined[0].clone()), ('combined_topk_weights', combined[1].clone())]
        cached_out = [(n, t.clone()) for n, t in zip(('cached recv_x', 'cached recv_x_scales'), split_x(cached[0]))
                      if t is not None]
        if attempt == 0:
            want_x, want_w = ref_combine(ctx.group, ref, y, out[2], bias)
            chk(assert_same, 'combined_x', combined[0], want_x)
            chk(assert_same, 'combined_topk_weights', combined[1], want_w)
            chk(check_cached_dispatch, cached, ref2)
        results.append((dispatched, combined_out, cached_out, y))
    chk(check_repeat, 'repeated dispatch', results[0][0], results[1][0])
    chk(check_repeat, 'repeated combine', results[0][1], results[1][1])
    chk(check_repeat, 'repeated cached dispatch', results[0][2], results[1][2])


# ---------------------------------------------------------------- LL round trip
def valid_equal(name, got, want, valid):
    """Rows where `valid` holds are equal (FP8 compared as bytes)."""
    if got.dtype == torch.float8_e4m3fn:
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    assert got.shape == want.shape, f'{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}'
    a, b = got[valid], want[valid]
    if torch.equal(a, b):
        return
    bad = int((a != b).reshape(a.size(0), -1).any(1).sum())
    raise AssertionError(f'{name}: {bad} of {a.size(0)} valid rows differ')


def check_ll_combined(name, got, want, stats):
    assert got.dtype == BF16 and got.shape == want.shape, f'{name}: {got.dtype} {tuple(got.shape)}'
    ulps = bf16_ulp_distance(got, want)
    worst = int(ulps.max()) if ulps.numel() else 0
    assert worst <= 1, f'{name}: {int((ulps > 0).sum())} elements differ, up to {worst} BF16 ulp'
    stats.ll_one_ulp += int((ulps > 0).sum())


def ll_round(ctx, buf, p, chk, stats):
    """clean_low_latency_buffer where DeepEP needs it, then LL dispatch + combine of one drawn
    shape checked against the reference, then the same again, bit-identical."""
    world, rank = ctx.world, ctx.rank
    local = E // world
    use_fp8, round_scale, use_ue8m0 = MODES[p.mode]
    if ctx.dirty or ctx.ll_hidden != p.hidden:
        buf.clean_low_latency_buffer(LL_M, p.hidden, E)
        stats.cleans += 1
        ctx.dirty, ctx.ll_hidden = False, p.hidden
    tokens = p.tokens[rank]
    x = torch.randn(tokens, p.hidden, dtype=BF16)
    topk = route(p.routing, tokens, p.topk, world, E)
    weights = torch.rand(tokens, p.topk, dtype=F32)
    all_x, all_topk = gather_rows(x, ctx.group), gather_rows(topk, ctx.group)  # the reference needs every rank's
    ref = ref_ll_dispatch(all_x, all_topk, rank, E, LL_M, use_fp8, round_scale, use_ue8m0)
    factor = expert_scales(E, x.device)
    want = ref_ll_combine_local(received_rows(x, use_fp8, round_scale), topk, weights, E, world, factor)

    runs = []
    for attempt in range(2):
        stats_tensor = torch.zeros(local, dtype=I32)
        recv_x, count, handle, event, hook = buf.low_latency_dispatch(
            x, topk, LL_M, E, cumulative_local_expert_recv_stats=stats_tensor, use_fp8=use_fp8,
            round_scale=round_scale, use_ue8m0=use_ue8m0, async_finish=not p.hook, return_recv_hook=p.hook)
        hook() if p.hook else event.current_stream_wait()
        del hook
        data, scales = recv_x if use_fp8 else (recv_x, None)
        if attempt == 0:
            chk(assert_same, 'packed_recv_count', count, ref.count)
            chk(assert_same, 'cumulative_local_expert_recv_stats', stats_tensor, ref.count)
            chk(assert_same, 'layout_range', handle[1], ref.layout_range)
            chk(valid_equal, 'src_info', handle[0], ref.src_info, ref.valid)
            chk(valid_equal, 'packed_recv_x', data, ref.x, ref.valid)
            if use_fp8:
                chk(valid_equal, 'packed_recv_x_scales', scales, ref.x_scales, ref.valid)
            chk.agree(ctx.group)  # a wrong handle must not reach combine
        deq = per_token_cast_back(data, scales) if use_fp8 else data
        y = (deq.float() * factor[rank * local:(rank + 1) * local].view(-1, 1, 1)).to(BF16)
        del deq
        if p.zero_copy:
            buf.get_next_low_latency_combine_buffer(handle)[:, :, :] = y
        out = torch.empty(tokens, p.hidden, dtype=BF16)
        combined, event, hook = buf.low_latency_combine(y, topk, weights, handle, zero_copy=p.zero_copy,
                                                        async_finish=not p.hook, return_recv_hook=p.hook, out=out)
        hook() if p.hook else event.current_stream_wait()
        del hook
        stats.ops += 2
        if attempt == 0:
            chk(check_ll_combined, f'combined_x ({p.mode}, hook={p.hook}, zero_copy={p.zero_copy})',
                combined, want, stats)
        runs.append(SimpleNamespace(count=count.clone(), layout=handle[1].clone(), src=handle[0].clone(),
                                    data=data.clone(), scales=None if scales is None else scales.clone(),
                                    combined=combined.clone()))
        del recv_x, data, scales, handle, y, combined, out
    a, b = runs
    chk(assert_same, 'repeated packed_recv_count', b.count, a.count)
    chk(assert_same, 'repeated layout_range', b.layout, a.layout)
    chk(valid_equal, 'repeated src_info', b.src, a.src, ref.valid)
    chk(valid_equal, 'repeated packed_recv_x', b.data, a.data, ref.valid)
    if a.scales is not None:
        chk(valid_equal, 'repeated packed_recv_x_scales', b.scales, a.scales, ref.valid)
    chk(assert_same, 'repeated combined_x', b.combined, a.combined)


def run_op(ctx, buf, p, stats):
    chk = Checks()
    if p.kind == 'normal':
        normal_round(ctx, buf, p, chk, stats)
        ctx.dirty = True  # DeepEP: clean_low_latency_buffer before the next LL call
        stats.normal += 1
    else:
        ll_round(ctx, buf, p, chk, stats)
        stats.ll += 1
    chk.agree(ctx.group)


# ---------------------------------------------------------------- the soak
def new_stats():
    return SimpleNamespace(iterations=0, normal=0, ll=0, ops=0, cleans=0, ll_one_ulp=0)


def soak(ctx, args):
    world = ctx.world
    nvl = max(deep_ep.Buffer.get_dispatch_config(world).get_nvl_buffer_size_hint(MAX_HIDDEN * 2, world),
              deep_ep.Buffer.get_combine_config(world).get_nvl_buffer_size_hint(MAX_HIDDEN * 2, world))
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(LL_M, MAX_HIDDEN, world, E)
    stats, drift = new_stats(), Drift()
    name = ctx.soak_name
    with make_buffer(ctx.group, num_nvl_bytes=nvl, num_rdma_bytes=rdma, low_latency_mode=True,
                     num_qps_per_rank=E // world) as buf:
        ctx.dirty, ctx.ll_hidden = True, None  # a new buffer is clean, but SGLang cleans first too
        # Warm-up: every op kind, payload and hidden once (lazily loaded kernels, torch and NCCL
        # state), then the baseline.
        rng = random.Random(f'warm-up {args.seed}')
        warm = [draw_normal(rng, world, hidden=h, x=xk) for h in NORMAL_HIDDENS for xk in NORMAL_X]
        warm += [draw_ll(rng, world, hidden=h, mode=m, hook=i % 2 == 1)
                 for i, (h, m) in enumerate((h, m) for h in LL_HIDDENS for m in MODES)]
        for i, p in enumerate(warm):
            torch.manual_seed(args.seed * 1_000_003 + 999_999 - i * world - ctx.rank)
            with watchdog(ctx.rep, name, args.iteration_timeout):
                try:
                    run_op(ctx, buf, p, stats)
                except AssertionError as e:
                    raise AssertionError(f'warm-up op {i} ({describe(p)}): {e}') from e
        drift.sample()
        start = time.monotonic()
        deadline = soak_deadline(args, start)
        it = args.first_iteration
        while True:
            done = args.iterations is not None and it >= args.first_iteration + args.iterations
            done = done or (deadline is not None and time.monotonic() >= deadline)
            if any_rank(ctx.group, done):  # both ranks stop after the same iteration
                break
            rng = random.Random(args.seed * 1_000_003 + it)
            plan = [draw_normal(rng, world) if rng.random() < 0.5 else draw_ll(rng, world)
                    for _ in range(rng.randint(1, 3))]
            for k, p in enumerate(plan):
                torch.manual_seed((args.seed * 1_000_003 + it) * 64 + k * world + ctx.rank)
                with watchdog(ctx.rep, name, args.iteration_timeout):
                    try:
                        run_op(ctx, buf, p, stats)
                    except AssertionError as e:
                        raise AssertionError(
                            f'iteration {it} op {k} ({describe(p)}): {e}; rerun: --cycles 0 --seed {args.seed} '
                            f'--first-iteration {it} --iterations 1') from e
            drift.sample()
            stats.iterations += 1
            it += 1
            if ctx.rank == 0 and stats.iterations % 50 == 0:
                ctx.rep.info(f'soak: {stats.iterations} iterations, {time.monotonic() - start:.0f} s, '
                             f'{drift.max_free_drop / MiB:.1f} MiB max drift')
        seconds = time.monotonic() - start
    summary = (f'soak summary: {stats.iterations} iterations in {seconds:.0f} s, {stats.normal} normal and '
               f'{stats.ll} LL round trips ({stats.ops} dispatch/combine calls, repeats included), '
               f'{stats.cleans} clean_low_latency_buffer calls; {drift.text()} '
               f'(tolerance {args.soak_tolerance_mib} MiB); LL combine elements 1 BF16 ulp off: {stats.ll_one_ulp}')
    ctx.rep.info(summary)
    assert stats.iterations > 0, 'no soak iteration ran'
    drift.check('soak', args.soak_tolerance_mib * MiB)


# ---------------------------------------------------------------- create/destroy cycles
def cycle_op(ctx, buf, auto, c, stats):
    """A small checked op on a cycle's buffer."""
    rng = random.Random(f'cycle {c}')
    chk = Checks()
    if not auto:
        p = draw_normal(rng, ctx.world, hidden=2048)
        p.tokens = [rng.randint(0, 256) for _ in range(ctx.world)]
        normal_round(ctx, buf, p, chk, stats)
    else:
        m, hidden, num_experts = CYCLE_LL
        buf.clean_low_latency_buffer(m, hidden, num_experts)
        tokens = rng.randint(0, m)
        use_fp8 = c % 4 == 1
        x = torch.randn(tokens, hidden, dtype=BF16)
        topk = route('random', tokens, 8, ctx.world, num_experts)
        weights = torch.rand(tokens, 8, dtype=F32)
        all_x, all_topk = gather_rows(x, ctx.group), gather_rows(topk, ctx.group)
        ref = ref_ll_dispatch(all_x, all_topk, ctx.rank, num_experts, m, use_fp8)
        recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, topk, m, num_experts, use_fp8=use_fp8)
        data, scales = recv_x if use_fp8 else (recv_x, None)
        chk(assert_same, 'packed_recv_count', count, ref.count)
        chk(valid_equal, 'packed_recv_x', data, ref.x, ref.valid)
        chk.agree(ctx.group)
        deq = per_token_cast_back(data, scales) if use_fp8 else data
        combined, _, _ = buf.low_latency_combine(deq, topk, weights, handle)
        want = ref_ll_combine_local(received_rows(x, use_fp8), topk, weights, num_experts, ctx.world)
        chk(check_ll_combined, 'combined_x', combined, want, stats)
        stats.ops += 2
    chk.agree(ctx.group)


def cycles(ctx, args):
    world = ctx.world
    m, hidden, num_experts = CYCLE_LL
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(m, hidden, world, num_experts)
    stats, drift = new_stats(), Drift(settle=True)
    warm_up = 3
    start = None
    for c in range(warm_up + args.cycles):
        auto = c % 2 == 1
        kwargs = dict(num_nvl_bytes=CYCLE_NVL)
        if auto:
            kwargs.update(num_rdma_bytes=rdma, low_latency_mode=True, num_qps_per_rank=num_experts // world)
        torch.manual_seed(c * world + ctx.rank)
        with watchdog(ctx.rep, ctx.cycles_name, args.iteration_timeout):
            with make_buffer(ctx.group, **kwargs) as buf:
                # Cycles alternate the two kinds: use both kinds every op_every cycles.
                if c < warm_up or (c - warm_up) % args.op_every < 2:
                    try:
                        cycle_op(ctx, buf, auto, c, stats)
                    except AssertionError as e:
                        raise AssertionError(f'cycle {c} ({"auto" if auto else "normal"} buffer): {e}') from e
        done = c + 1 - warm_up
        if done == 0:
            drift.sample()
            start, drift.seconds = time.monotonic(), 0.0  # the timed cycles start here
        elif done > 0 and (done % 25 == 0 or done == args.cycles):
            drift.sample()
            if ctx.rank == 0 and done % 100 == 0:
                ctx.rep.info(f'cycles: {done}, {drift.max_free_drop / MiB:.1f} MiB max drift')
    seconds = time.monotonic() - start - drift.seconds if start is not None else 0.0
    per = seconds / args.cycles * 1e3 if args.cycles else 0.0
    ctx.rep.info(f'cycles summary: {args.cycles} create/destroy cycles after {warm_up} warm-up ones, {per:.0f} ms '
                 f'per cycle (memory sampling left out), {stats.ops} checked ops; {drift.text()} (tolerance '
                 f'{args.cycle_tolerance_mib} MiB)')
    drift.check('create/destroy', args.cycle_tolerance_mib * MiB)


# ---------------------------------------------------------------- driver
def worker(rank, world, group, rep, args):
    # As DeepEP's tests/utils.init_dist: tensors default to BF16 on the GPU.
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device('cuda')
    group = dist.new_group(list(range(world)))
    ctx = SimpleNamespace(group=group, rank=rank, world=world, rep=rep,
                          cycles_name=f'create_destroy_{args.cycles}_cycles_flat_memory',
                          soak_name=(f'soak_{args.minutes:g}min' if args.minutes else f'soak_{args.iterations}_iterations')
                          + '_normal_and_ll_on_one_buffer')
    if args.cycles:
        rep.run(ctx.cycles_name, cycles, ctx, args)
    if soak_wanted(args):
        rep.run(ctx.soak_name, soak, ctx, args)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument('--cycles', type=int, default=1000, help='create/destroy cycles (0: skip)')
    ap.add_argument('--minutes', type=float, default=10.0,
                    help='soak duration in minutes (0 with no --iterations: skip the soak)')
    ap.add_argument('--iterations', type=int, default=None,
                    help='stop the soak after this many iterations (with --minutes 0: no time limit)')
    ap.add_argument('--first-iteration', type=int, default=0, help='first soak iteration (to rerun a failed one)')
    ap.add_argument('--seed', type=int, default=0)
    ap.add_argument('--op-every', type=int, default=10, help="use 2 of every N cycles' buffers for a checked op")
    ap.add_argument('--cycle-tolerance-mib', type=float, default=64)
    ap.add_argument('--soak-tolerance-mib', type=float, default=128)
    ap.add_argument('--iteration-timeout', type=float, default=180,
                    help='seconds one soak op or one cycle may take before the case fails as a hang')
    args = ap.parse_args(argv)
    if args.cycles < 0 or args.minutes < 0 or args.op_every < 1 or (args.iterations is not None and args.iterations < 1):
        ap.error('--cycles and --minutes must be >= 0, --op-every and --iterations >= 1')
    return args


def soak_wanted(args):
    return args.minutes > 0 or args.iterations is not None


def soak_deadline(args, start):
    """When the soak loop stops by time (None: only --iterations bounds it)."""
    return start + args.minutes * 60 if args.minutes > 0 else None


def driver_timeout(args):
    """The driver's bound: the cycles (about 0.2 s each, 3 s allowed), the soak (its minutes, or
    30 s an iteration), set-up and the warm-up ops."""
    seconds = 240 + args.cycles * 3
    if soak_wanted(args):
        soak_seconds = args.minutes * 60 if args.minutes > 0 else 0
        if args.iterations is not None:
            soak_seconds = min(soak_seconds, args.iterations * 30) if soak_seconds else args.iterations * 30
        seconds += soak_seconds * 1.1 + 300
    return seconds


def main():
    args = parse_args()
    gpus = torch.cuda.device_count()
    if gpus < 2:
        print(f'test_soak needs 2 GPUs, found {gpus}')
        return 1
    timeout = driver_timeout(args)
    print(f'test_soak: cycles={args.cycles} minutes={args.minutes:g} iterations={args.iterations} seed={args.seed} '
          f'(driver timeout {timeout:.0f} s)', flush=True)
    spawn(worker, 2, args, timeout=timeout)
    finish()


if __name__ == '__main__':
    sys.exit(main())
