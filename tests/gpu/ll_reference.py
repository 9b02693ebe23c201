"""An independent pure-torch reference of low-latency (LL) dispatch and combine, as pinned down by
docs/low_latency.md (on top of deepep-buffer-api.md sections 6.4-6.7).

Nothing here calls torch.distributed: the functions take every rank's inputs (gathered by the
caller, e.g. with normal_reference.gather_rows) and compute what one rank must hold.

* ref_ll_dispatch: packed_recv_x (BF16 or FP8 e4m3), packed_recv_x_scales (float32 scale_inv, or
  int32 UE8M0 exponent bytes), packed_recv_count, src_info and layout_range, in the contract's
  deterministic row order (per local expert: source ranks ascending, each source's rows in
  ascending (token, top-k slot) order). Rows at or past packed_recv_count are zero here (the
  library leaves them unspecified): compare only `valid` rows.
* ref_ll_combine / ref_ll_combine_local: out[t] = bf16(fp32 chain acc = fma(y_k, w_k, acc) over k
  ascending, skipping -1 slots and experts of masked ranks). The fp32 fma is emulated exactly:
  the double sum is computed with round-to-odd (TwoSum + nextafter), then rounded once to fp32,
  which is the correctly rounded fma (53 >= 24 + 2 bits). The contract's simpler recipe
  (acc.double() + y.double() * w.double()).float() can be 1 fp32 ulp off through double rounding.
* fp8_quantize, ue8m0_pack, per_token_cast_back and calc_diff (DeepEP's definitions, own code).

`python tests/gpu/ll_reference.py` runs CPU self-checks of all of the above (no GPU, no deep_ep)."""
import math
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128  # channels per FP8 scale

# mode name -> (use_fp8, round_scale, use_ue8m0)
MODES = {
    'bf16': (False, False, False),
    'fp8': (True, False, False),
    'fp8_round': (True, True, False),
    'fp8_ue8m0': (True, True, True),
}


# ---------------------------------------------------------------- FP8
def _f32(value, like):
    return torch.full_like(like, value, dtype=torch.float32)


def fp8_quantize(x: torch.Tensor, round_scale: bool = False):
    """The contract's per-token, per-128-channel e4m3 cast of BF16 x [T, H] (H % 128 == 0).
    Returns (q [T, H] float8_e4m3fn, scale_inv [T, H/128] float32), bit-exact:
    amax = max(1e-4, max |x|) in fp32; plain: scale_inv = amax * fp32(1/448), scale = 448 / amax;
    round_scale: e = ceil(log2(amax * fp32(1/448))) from the fp32 bits, scale_inv = 2^e,
    scale = 2^-e; q = e4m3 saturating cast of fp32(x) * scale (round to nearest even)."""
    assert x.dim() == 2 and x.size(1) % BLOCK == 0, f'x must be [T, H] with H % 128 == 0, got {tuple(x.shape)}'
    num_tokens, hidden = x.shape
    blocks = x.float().view(num_tokens, hidden // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=2) if num_tokens else blocks.new_zeros(0, hidden // BLOCK)
    amax = torch.maximum(amax, _f32(1e-4, amax))
    inv_448 = _f32(1.0, amax) / _f32(FP8_MAX, amax)  # fp32(1/448), as the fp32 constant 1 / 448.0f
    if round_scale:
        bits = (amax * inv_448).view(torch.int32)
        exponent = ((bits >> 23) & 0xff) - 127 + ((bits & 0x7fffff) != 0).to(torch.int32)
        scale_inv = ((exponent + 127) << 23).view(torch.float32)
        scale = ((127 - exponent) << 23).view(torch.float32)
    else:
        scale_inv = amax * inv_448
        scale = _f32(FP8_MAX, amax) / amax
    scaled = blocks * scale.unsqueeze(2)
    q = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8).view(num_tokens, hidden)
    return q, scale_inv


def exponent_bytes(scale_inv: torch.Tensor) -> torch.Tensor:
    """The UE8M0 byte of positive float32 scales: (float bits >> 23) & 0xff, as int64."""
    return ((scale_inv.float().contiguous().view(torch.int32) >> 23) & 0xff).long()


def ue8m0_pack(scale_inv: torch.Tensor) -> torch.Tensor:
    """float32 scale_inv [..., H/128] (powers of two) -> int32 [..., H/512]: byte k (little endian)
    of int j is the exponent byte of scale_inv[..., 4j + k]."""
    assert scale_inv.size(-1) % 4 == 0, f'{scale_inv.size(-1)} scales do not pack into int32 words'
    b = exponent_bytes(scale_inv).view(*scale_inv.shape[:-1], scale_inv.size(-1) // 4, 4)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word)  # two's complement int32
    return word.to(torch.int32)


def ue8m0_unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., H/512] (any strides) -> float32 scales [..., H/128] (2^(byte - 127))."""
    words = packed.long() & 0xffffffff
    b = torch.stack([(words >> (8 * k)) & 0xff for k in range(4)], dim=-1)
    b = b.reshape(*packed.shape[:-1], packed.size(-1) * 4)
    return (b.to(torch.int32) << 23).view(torch.float32)


def per_token_cast_back(x_fp8: torch.Tensor, x_scales: torch.Tensor) -> torch.Tensor:
    """DeepEP's tests/utils.per_token_cast_back: BF16 of fp8 * scale per 128 channels. x_fp8 is
    [..., H]; x_scales is float32 [..., H/128] or int32 UE8M0 [..., H/512], any strides."""
    hidden = x_fp8.size(-1)
    if x_fp8.numel() == 0:
        return x_fp8.to(torch.bfloat16)
    if x_scales.dtype == torch.int32:
        x_scales = ue8m0_unpack(x_scales)
    rows = x_fp8.numel() // hidden
    values = x_fp8.float().reshape(rows, hidden // BLOCK, BLOCK)
    scales = x_scales.float().reshape(rows, hidden // BLOCK, 1)
    return (values * scales).reshape(x_fp8.shape).to(torch.bfloat16)


def received_rows(x: torch.Tensor, use_fp8: bool, round_scale: bool = False) -> torch.Tensor:
    """What an expert reads for each token of x [T, H] once dispatched and (for FP8) dequantised
    with per_token_cast_back: x itself for BF16."""
    if not use_fp8:
        return x
    q, scale_inv = fp8_quantize(x, round_scale)
    return per_token_cast_back(q, scale_inv)


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's tests/utils.calc_diff: 1 - 2 sum((x+1)(y+1)) / sum((x+1)^2 + (y+1)^2), in double."""
    if x.numel() == 0 and y.numel() == 0:
        return 0.0
    x, y = x.double() + 1, y.double() + 1
    return (1 - 2 * (x * y).sum() / (x * x + y * y).sum()).item()


# ---------------------------------------------------------------- routing layout
@dataclass
class LLLayout:
    """Where every (source rank, token, slot) lands. For source s: g[s], t[s], k[s] list its
    valid slots in ascending (token, slot) order, row[s] the row inside expert g's packed rows
    on the owner rank (g // num_local_experts)."""
    num_experts: int
    num_ranks: int
    counts: torch.Tensor  # [E, R] int64: rows source r sends to expert g
    begin: torch.Tensor  # [E, R] int64: first row of source r's block inside expert g
    g: List[torch.Tensor] = field(default_factory=list)
    t: List[torch.Tensor] = field(default_factory=list)
    k: List[torch.Tensor] = field(default_factory=list)
    row: List[torch.Tensor] = field(default_factory=list)

    @property
    def num_local_experts(self):
        return self.num_experts // self.num_ranks

    def local(self, rank):
        """(counts, begin) [E_l, R] of rank's local experts."""
        lo = rank * self.num_local_experts
        return self.counts[lo:lo + self.num_local_experts], self.begin[lo:lo + self.num_local_experts]


def ll_layout(all_topk: Sequence[torch.Tensor], num_experts: int, max_tokens: Optional[int] = None,
              masked_ranks: Sequence[int] = ()) -> LLLayout:
    """The contract's row order for every rank's topk_idx [T_s, K] (T_s may differ). Sources in
    masked_ranks send nothing. max_tokens (M) bounds the rows one source may send to one expert."""
    num_ranks = len(all_topk)
    assert num_experts % num_ranks == 0, f'num_experts {num_experts} % num_ranks {num_ranks} != 0'
    device = all_topk[0].device
    counts = torch.zeros(num_experts, num_ranks, dtype=torch.int64, device=device)
    per_source = []
    for s, topk in enumerate(all_topk):
        topk = topk.long()
        num_topk = topk.size(1) if topk.dim() == 2 else 1
        flat = topk.reshape(-1)
        valid = (flat >= 0) & (s not in masked_ranks)
        idx = valid.nonzero().squeeze(1)  # ascending (token, slot)
        g = flat[idx]
        assert bool((g < num_experts).all()), f'rank {s}: topk_idx has experts >= {num_experts}'
        cnt = torch.bincount(g, minlength=num_experts)
        counts[:, s] = cnt
        order = torch.sort(g, stable=True).indices
        start = cnt.cumsum(0) - cnt
        within = torch.empty_like(g)
        within[order] = torch.arange(g.numel(), device=device) - start[g[order]]
        per_source.append((g, idx // num_topk, idx % num_topk, within))
    if max_tokens is not None and counts.numel():
        worst = int(counts.max())
        assert worst <= max_tokens, (f'routing sends {worst} rows from one rank to one expert, more than '
                                     f'num_max_dispatch_tokens_per_rank {max_tokens}')
    begin = counts.cumsum(1) - counts
    layout = LLLayout(num_experts, num_ranks, counts, begin)
    for s, (g, t, k, within) in enumerate(per_source):
        layout.g.append(g)
        layout.t.append(t)
        layout.k.append(k)
        layout.row.append(begin[g, s] + within)
    return layout


# ---------------------------------------------------------------- dispatch
@dataclass
class LLDispatchRef:
    """What low_latency_dispatch must return on one rank (logical shapes; rows >= count are 0)."""
    x: torch.Tensor  # [E_l, R*M, H] bfloat16 or float8_e4m3fn
    x_scales: Optional[torch.Tensor]  # float32 [E_l, R*M, H/128], int32 [E_l, R*M, H/512], or None
    count: torch.Tensor  # [E_l] int32
    src_info: torch.Tensor  # [E_l, R*M] int32 (-1 past count)
    layout_range: torch.Tensor  # [E_l, R] int64: (begin << 32) | count
    valid: torch.Tensor  # [E_l, R*M] bool: rows [0, count)
    layout: LLLayout
    use_fp8: bool
    round_scale: bool
    use_ue8m0: bool


def ref_ll_dispatch(all_x: Sequence[torch.Tensor], all_topk: Sequence[torch.Tensor], rank: int, num_experts: int,
                    num_max_dispatch_tokens_per_rank: int, use_fp8: bool = False, round_scale: bool = False,
                    use_ue8m0: bool = False, masked_ranks: Sequence[int] = ()) -> LLDispatchRef:
    """low_latency_dispatch as seen by `rank`, from every rank's x [T_s, H] BF16 and topk_idx
    [T_s, K] (lists in rank order). masked_ranks: sources that send nothing (shrink mode)."""
    assert not use_ue8m0 or (use_fp8 and round_scale), 'use_ue8m0 needs use_fp8 and round_scale'
    num_ranks, m = len(all_x), num_max_dispatch_tokens_per_rank
    hidden = all_x[rank].size(1)
    device = all_x[rank].device
    layout = ll_layout(all_topk, num_experts, m, masked_ranks)
    local = num_experts // num_ranks
    rows = num_ranks * m
    num_scales = hidden // BLOCK
    recv = torch.zeros(local, rows, hidden, dtype=torch.uint8 if use_fp8 else torch.bfloat16, device=device)
    scales = None
    if use_fp8:
        scales = (torch.zeros(local, rows, num_scales // 4, dtype=torch.int32, device=device) if use_ue8m0
                  else torch.zeros(local, rows, num_scales, dtype=torch.float32, device=device))
    src_info = torch.full((local, rows), -1, dtype=torch.int32, device=device)
    for s in range(num_ranks):
        g, t, row = layout.g[s], layout.t[s], layout.row[s]
        mine = (g // local) == rank
        if not bool(mine.any()):
            continue
        e, t, row = g[mine] % local, t[mine], row[mine]
        x_s = all_x[s].to(device)
        if use_fp8:
            q, scale_inv = fp8_quantize(x_s, round_scale)
            recv[e, row] = q.view(torch.uint8)[t]
            scales[e, row] = (ue8m0_pack(scale_inv) if use_ue8m0 else scale_inv)[t]
        else:
            recv[e, row] = x_s[t]
        src_info[e, row] = t.to(torch.int32)
    counts, begin = layout.local(rank)
    count = counts.sum(1)
    valid = torch.arange(rows, device=device).unsqueeze(0) < count.unsqueeze(1)
    return LLDispatchRef(x=recv.view(FP8) if use_fp8 else recv, x_scales=scales, count=count.to(torch.int32),
                         src_info=src_info, layout_range=(begin << 32) | counts, valid=valid, layout=layout,
                         use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0)


def dequantized(ref: LLDispatchRef) -> torch.Tensor:
    """The reference's packed rows as BF16 (per_token_cast_back of the FP8 rows)."""
    return per_token_cast_back(ref.x, ref.x_scales) if ref.use_fp8 else ref.x


# ---------------------------------------------------------------- combine
def fma_f32(acc: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 fma(y, w, acc) for fp32 acc and w and BF16 or fp32 y: the product
    is exact in double; the double sum is rounded to odd (TwoSum error + nextafter), so the
    final rounding to fp32 is the single correct one."""
    a = acc.double()
    p = y.double() * w.double()
    s = a + p
    b_virtual = s - a
    err = (a - (s - b_virtual)) + (p - b_virtual)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.full_like(s, math.inf), torch.full_like(s, -math.inf))
    s = torch.where((err != 0) & even, torch.nextafter(s, toward), s)
    return s.float()


def ll_combine_chain(y_tk: torch.Tensor, topk_weights: torch.Tensor, use: torch.Tensor) -> torch.Tensor:
    """bf16(acc) with acc = fma(y_tk[:, k], w[:, k], acc) over k ascending where use[:, k],
    starting at +0. y_tk [T, K, H] (BF16 or fp32), topk_weights [T, K] fp32, use [T, K] bool."""
    num_tokens, num_topk, hidden = y_tk.shape
    acc = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=y_tk.device)
    w = topk_weights.float()
    for k in range(num_topk):
        acc = torch.where(use[:, k:k + 1], fma_f32(acc, y_tk[:, k], w[:, k:k + 1]), acc)
    return acc.to(torch.bfloat16)


def expert_scales(num_experts: int, device) -> torch.Tensor:
    """A distinct, exactly representable float32 factor per global expert (0.5 .. 2.0): tests
    make expert g's output bf16(received row * factor[g]) so every expert's rows differ."""
    return 0.5 + (torch.arange(num_experts, device=device) % 13).to(torch.float32) / 8


def _owner_use(topk_idx, num_experts, num_ranks, masked_ranks):
    idx = topk_idx.long()
    use = idx >= 0
    owner = torch.where(use, idx // (num_experts // num_ranks), torch.full_like(idx, -1))
    for r in masked_ranks:
        use &= owner != r
    return idx, use


def ref_ll_combine_local(token_rows: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                         num_experts: int, num_ranks: int, scales: Optional[torch.Tensor] = None,
                         masked_ranks: Sequence[int] = (), decode: Optional[Callable] = None) -> torch.Tensor:
    """Combine when expert g's output row for token t is bf16(token_rows[t] * scales[g]) (or
    token_rows[t] itself without scales): needs no other rank's data. token_rows [T, H] is what
    the experts received (see received_rows). decode: applied to each sent row (LogFMT)."""
    idx, use = _owner_use(topk_idx, num_experts, num_ranks, masked_ranks)
    num_tokens, num_topk = idx.shape
    hidden = token_rows.size(1)
    if scales is None:
        y = token_rows.unsqueeze(1).expand(num_tokens, num_topk, hidden)
    else:
        factor = scales[idx.clamp(min=0)]
        y = (token_rows.float().unsqueeze(1) * factor.unsqueeze(2)).to(torch.bfloat16)
    if decode is not None:
        y = decode(y.reshape(num_tokens * num_topk, hidden)).reshape(num_tokens, num_topk, hidden)
    return ll_combine_chain(y, topk_weights, use)


def valid_rows(y: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Rows [0, count[e]) of every local expert of a packed [E_l, R*M, H] tensor, expert-major."""
    rows = torch.arange(y.size(1), device=y.device).unsqueeze(0) < count.to(y.device).unsqueeze(1)
    return y[rows]


def ref_ll_combine(all_y: Sequence[torch.Tensor], all_topk: Sequence[torch.Tensor], rank: int,
                   topk_weights: torch.Tensor, num_experts: int, num_max_dispatch_tokens_per_rank: Optional[int] = None,
                   masked_ranks: Sequence[int] = (), decode: Optional[Callable] = None,
                   layout: Optional[LLLayout] = None) -> torch.Tensor:
    """low_latency_combine on `rank`: all_y[r] is what rank r passes as x, either the packed
    [E_l, R*M, H] tensor or only its valid rows [N_r, H] (expert-major, as valid_rows gives).
    The row for (token t, slot k) is the one t's slot k was dispatched to. masked_ranks: owners
    whose experts are ignored (and, for the layout, sources that sent nothing: pass the same set
    as the dispatch, or give its `layout`). decode: applied to each sent row (LogFMT)."""
    num_ranks = len(all_y)
    local = num_experts // num_ranks
    if layout is None:
        layout = ll_layout(all_topk, num_experts, num_max_dispatch_tokens_per_rank, masked_ranks)
    topk_idx = all_topk[rank]
    idx, use = _owner_use(topk_idx, num_experts, num_ranks, masked_ranks)
    num_tokens, num_topk = idx.shape
    hidden = all_y[rank].size(-1)
    device = topk_weights.device
    total = layout.counts.sum(1)  # [E]: rows per expert
    y_tk = torch.zeros(num_tokens, num_topk, hidden, dtype=all_y[rank].dtype, device=device)
    g, t, k, row = layout.g[rank], layout.t[rank], layout.k[rank], layout.row[rank]
    for r in range(num_ranks):
        if r in masked_ranks:
            continue
        sel = (g // local) == r
        if not bool(sel.any()):
            continue
        y_r = all_y[r].to(device)
        if y_r.dim() == 3:
            y_r = valid_rows(y_r, total[r * local:(r + 1) * local])
        per_expert = total[r * local:(r + 1) * local]
        offset = per_expert.cumsum(0) - per_expert
        flat = offset[g[sel] % local] + row[sel]
        y_tk[t[sel], k[sel]] = y_r[flat]
    if decode is not None:
        y_tk = decode(y_tk.reshape(num_tokens * num_topk, hidden)).reshape(num_tokens, num_topk, hidden)
    return ll_combine_chain(y_tk, topk_weights, use)


def bf16_ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in BF16 ulps (int32), +0 and -0 equal; NaNs give large distances."""
    def ordered(t):
        bits = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7fff), bits)

    return (ordered(a) - ordered(b)).abs()


# ================================================================ CPU self-checks
def _naive_dispatch(all_x, all_topk, rank, num_experts, m, use_fp8, round_scale, use_ue8m0):
    """Loop-by-loop version of the contract's description, for cross-checking ref_ll_dispatch."""
    num_ranks = len(all_x)
    local = num_experts // num_ranks
    hidden = all_x[0].size(1)
    out_x = torch.zeros(local, num_ranks * m, hidden, dtype=torch.float32)
    out_s = torch.zeros(local, num_ranks * m, hidden // 128, dtype=torch.float32)
    src = torch.full((local, num_ranks * m), -1, dtype=torch.int32)
    count = [0] * local
    layout = torch.zeros(local, num_ranks, dtype=torch.int64)
    for e in range(local):
        g = rank * local + e
        begin = 0
        for s in range(num_ranks):
            n = 0
            q = fp8_quantize(all_x[s], round_scale) if use_fp8 else None
            for t in range(all_topk[s].size(0)):
                for k in range(all_topk[s].size(1)):
                    if int(all_topk[s][t, k]) != g:
                        continue
                    r = begin + n
                    if use_fp8:
                        out_x[e, r] = q[0][t].float()
                        out_s[e, r] = q[1][t]
                    else:
                        out_x[e, r] = all_x[s][t].float()
                    src[e, r] = t
                    n += 1
            layout[e, s] = (begin << 32) | n
            begin += n
        count[e] = begin
    return out_x, out_s, src, torch.tensor(count, dtype=torch.int32), layout


def _round_f32_exact(value) -> float:
    """A Fraction rounded to the nearest float32, ties to even (numpy-free)."""
    import struct
    from fractions import Fraction
    if value == 0:
        return 0.0

    def f32(x):
        return struct.unpack('<f', struct.pack('<f', x))[0]

    def bits(x):
        return struct.unpack('<I', struct.pack('<f', x))[0]

    def from_bits(b):
        return struct.unpack('<f', struct.pack('<I', b))[0]

    def neighbours(x):  # x and the floats one ulp either side (the nearest is chosen below)
        b = bits(x)
        if b & 0x7fffffff == 0:
            return [x, from_bits(1), -from_bits(1)]
        return [x, from_bits(b + 1), from_bits(b - 1)]

    guess = f32(float(value))
    best = None
    for c in neighbours(guess):
        d = abs(Fraction(c) - value)
        key = (d, bits(c) & 1)
        if best is None or key < best[0]:
            best = (key, c)
    return best[1]


def _self_test():
    import random
    from fractions import Fraction
    torch.manual_seed(0)
    rnd = random.Random(0)
    checks = 0

    # 1. dispatch: vectorised reference == loop reference, all modes, uneven T, -1s, duplicates.
    num_ranks, num_experts, m, hidden = 3, 6, 8, 512
    token_counts = (5, 0, 8)
    all_x, all_topk = [], []
    for s, n in enumerate(token_counts):
        x = (torch.randn(n, hidden) * 3).to(torch.bfloat16)
        if n:
            x[0, :128] = 0  # an all-zero block: amax clamps to 1e-4
            x[-1, 128:256] = 1e-6
        topk = torch.randint(0, num_experts, (n, 3))
        if n:
            topk[0, 1] = -1
            topk[-1] = -1
            topk[n // 2, 2] = topk[n // 2, 0]  # a duplicate expert
        all_x.append(x)
        all_topk.append(topk)
    for mode, (fp8, rs, ue) in MODES.items():
        for rank in range(num_ranks):
            ref = ref_ll_dispatch(all_x, all_topk, rank, num_experts, m, fp8, rs, ue)
            nx, ns, nsrc, ncount, nlayout = _naive_dispatch(all_x, all_topk, rank, num_experts, m, fp8, rs, ue)
            assert torch.equal(ref.count, ncount), (mode, rank, ref.count, ncount)
            assert torch.equal(ref.layout_range, nlayout), (mode, rank)
            assert torch.equal(ref.src_info[ref.valid], nsrc[ref.valid]), (mode, rank)
            got_x = ref.x.float() if fp8 else ref.x.float()
            assert torch.equal(got_x[ref.valid], nx[ref.valid]), (mode, rank)
            assert torch.equal(ref.valid.sum(1).int(), ncount)
            if fp8:
                scales = ue8m0_unpack(ref.x_scales) if ue else ref.x_scales
                assert torch.equal(scales[ref.valid], ns[ref.valid]), (mode, rank)
                assert ref.x.dtype == FP8 and ref.x_scales.dtype == (torch.int32 if ue else torch.float32)
            checks += 1
    # Masked source: its rows vanish and later sources move up.
    ref = ref_ll_dispatch(all_x, all_topk, 0, num_experts, m, masked_ranks=(0,))
    expect = ref_ll_dispatch([all_x[0][:0]] + all_x[1:], [all_topk[0][:0]] + all_topk[1:], 0, num_experts, m)
    assert torch.equal(ref.layout_range, expect.layout_range) and torch.equal(ref.count, expect.count)
    checks += 1

    # 2. FP8 scales: plain = amax * fp32(1/448); round_scale = the smallest power of two >= that.
    import struct

    def f32(v):
        return struct.unpack('<f', struct.pack('<f', v))[0]

    x = (torch.randn(64, 1024) * torch.logspace(-6, 6, 64).unsqueeze(1)).to(torch.bfloat16)
    x[3] = 0
    x[5, :128] = 448
    x[6, :128] = -1e-5
    for rs in (False, True):
        q, scale_inv = fp8_quantize(x, rs)
        amax = x.float().view(64, 8, 128).abs().amax(2).clamp(min=f32(1e-4))
        inv = f32(1 / 448)
        for a, si in zip(amax.flatten().tolist()[::7], scale_inv.flatten().tolist()[::7]):
            v = f32(a * inv)
            if rs:
                mant, ex = math.frexp(v)
                e = ex - 1 if mant == 0.5 else ex
                assert si == 2.0 ** e, (a, si, e)
            else:
                assert si == v, (a, si, v)
        deq = per_token_cast_back(q, scale_inv)
        assert calc_diff(deq, x) < 1e-3, calc_diff(deq, x)
        assert bool((q.float().abs() <= 448).all())
        # Dequantisation error within half an e4m3 step (3 mantissa bits) of each value.
        rel = (deq.float() - x.float()).abs() / x.float().abs().clamp(min=1e-30)
        assert bool((rel[x.float().abs() > 1e-2] <= 2 ** -3.9).all()), float(rel[x.float().abs() > 1e-2].max())
        if rs:
            packed = ue8m0_pack(scale_inv)
            assert packed.dtype == torch.int32 and packed.shape == (64, 2)
            assert torch.equal(ue8m0_unpack(packed), scale_inv)
            assert torch.equal(per_token_cast_back(q, packed), deq)
            # Strided (column-major) int32 scales decode the same.
            assert torch.equal(per_token_cast_back(q, packed.t().contiguous().t()), deq)
            b = exponent_bytes(scale_inv[7]).tolist()
            word = b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24
            word = word - 2 ** 32 if word >= 2 ** 31 else word
            assert int(packed[7, 0]) == word
        checks += 1
    # A constant 128-block quantises losslessly without round_scale (DeepEP's check relies on it).
    const = torch.arange(128).to(torch.bfloat16).view(128, 1).expand(128, 256).contiguous()
    const[:, :128] = -121
    assert torch.equal(received_rows(const, True, False), const)
    checks += 1

    # 3. fma emulation == exact rounding; show the double-rounding hazard of the naive recipe.
    naive_wrong = 0
    cases = []
    for _ in range(3000):
        a = f32(rnd.uniform(-4, 4) * 2.0 ** rnd.randint(-30, 30))
        y = float(torch.tensor(rnd.uniform(-4, 4) * 2.0 ** rnd.randint(-30, 30)).to(torch.bfloat16))
        w = f32(rnd.uniform(-4, 4) * 2.0 ** rnd.randint(-30, 30))
        cases.append((a, y, w))
    for _ in range(3000):  # near-midpoint sums: a ~ 1, y * w ~ half an fp32 ulp of a
        a = f32(1.0 + rnd.randint(0, 2 ** 23 - 1) * 2.0 ** -23)
        y = float(torch.tensor(rnd.uniform(1, 2)).to(torch.bfloat16))
        w = f32(2.0 ** -24 / y * (1 + rnd.randint(-64, 64) * 2.0 ** -24))
        cases.append((a, y, w))
    cases.append((1.0, 1.0, f32(2.0 ** -24 + 2.0 ** -47)))
    at = torch.tensor([c[0] for c in cases], dtype=torch.float32)
    yt = torch.tensor([c[1] for c in cases], dtype=torch.float32).to(torch.bfloat16)
    wt = torch.tensor([c[2] for c in cases], dtype=torch.float32)
    got = fma_f32(at, yt, wt).tolist()
    naive = (at.double() + yt.double() * wt.double()).float().tolist()
    for (a, y, w), g, n in zip(cases, got, naive):
        exact = _round_f32_exact(Fraction(a) + Fraction(y) * Fraction(w))
        assert g == exact, (a, y, w, g, exact)
        naive_wrong += n != exact
    checks += 1

    # 4. combine: the chain, the gathered reference and the local one agree.
    num_ranks, num_experts, m, hidden = 2, 8, 6, 512
    all_x = [torch.randn(5, hidden).to(torch.bfloat16), torch.randn(3, hidden).to(torch.bfloat16)]
    all_topk = [torch.tensor([[0, 5, -1], [7, 2, 1], [-1, -1, -1], [3, 3, 4], [6, 0, 2]]),
                torch.tensor([[1, 4, 6], [5, -1, 0], [2, 7, 3]])]
    weights = [torch.rand(5, 3), torch.rand(3, 3)]
    scales = expert_scales(num_experts, 'cpu')
    for mode, (fp8, rs, ue) in MODES.items():
        for masked in ((), (1,)):
            refs = [ref_ll_dispatch(all_x, all_topk, r, num_experts, m, fp8, rs, ue, masked_ranks=masked)
                    for r in range(num_ranks)]
            local = num_experts // num_ranks
            ys = [(dequantized(refs[r]).float() * scales[r * local:(r + 1) * local].view(-1, 1, 1)).to(torch.bfloat16)
                  for r in range(num_ranks)]
            for rank in range(num_ranks):
                if rank in masked:
                    continue
                gathered = ref_ll_combine(ys, all_topk, rank, weights[rank], num_experts, m, masked_ranks=masked)
                rows = [valid_rows(ys[r], refs[r].count) for r in range(num_ranks)]
                packed = ref_ll_combine(rows, all_topk, rank, weights[rank], num_experts, m, masked_ranks=masked)
                local_ref = ref_ll_combine_local(received_rows(all_x[rank], fp8, rs), all_topk[rank], weights[rank],
                                                 num_experts, num_ranks, scales, masked_ranks=masked)
                assert torch.equal(gathered, packed) and torch.equal(gathered, local_ref), (mode, masked, rank)
                # Element by element against exact rational arithmetic.
                tok = received_rows(all_x[rank], fp8, rs)
                for t in range(tok.size(0)):
                    for h in (0, 17, hidden - 1):
                        acc = 0.0
                        for k in range(all_topk[rank].size(1)):
                            g = int(all_topk[rank][t, k])
                            if g < 0 or g // local in masked:
                                continue
                            yv = float(torch.tensor(float(tok[t, h]) * float(scales[g]),
                                                    dtype=torch.float32).to(torch.bfloat16))
                            acc = _round_f32_exact(Fraction(acc) + Fraction(yv) * Fraction(float(weights[rank][t, k])))
                        want = float(torch.tensor(acc, dtype=torch.float32).to(torch.bfloat16))
                        assert float(gathered[t, h]) == want, (mode, rank, t, h, float(gathered[t, h]), want)
            checks += 1
    assert float(bf16_ulp_distance(torch.tensor([1.0, -0.0]).to(torch.bfloat16),
                                   torch.tensor([1.0078125, 0.0]).to(torch.bfloat16)).max()) == 1

    # 5. calc_diff as DeepEP defines it.
    a = torch.randn(100)
    assert calc_diff(a, a) == 0 and calc_diff(torch.empty(0), torch.empty(0)) == 0.0
    assert abs(calc_diff(torch.zeros(4), torch.ones(4)) - (1 - 2 * 2 / 5)) < 1e-12
    checks += 1
    print(f'll_reference self-test: {checks} groups of checks passed on CPU '
          f'(the naive double recipe was off in {naive_wrong} of {len(cases)} fma cases)')


if __name__ == '__main__':
    _self_test()
