"""An independent pure-torch reference of DeepEP's intranode normal dispatch and combine
(deepep-buffer-api.md sections 5.4, 6.2 and 6.3).

Every rank all-gathers every rank's inputs and computes exactly what it must receive (row
order, payload, top-k rewrite, expert counts) and the 6-tuple handle it must hold, so the
library's results can be compared with torch.equal. Combine is reproduced bit for bit: fp32
accumulation of bias_0 + bias_1, then the copies from each destination rank in ascending
rank order, rounded to BF16 once.

All functions are collective over `group` (they call torch.distributed.all_gather), so
every rank must call them in the same order with matching argument kinds."""
import math
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

FP8_DTYPES = tuple(getattr(torch, n) for n in ('float8_e4m3fn', 'float8_e5m2') if hasattr(torch, n))


# ---------------------------------------------------------------- gathering
def gather_rows(t: torch.Tensor, group) -> List[torch.Tensor]:
    """Every rank's `t`, in group rank order. Ranks may differ in t.size(0) only. The bytes
    travel as uint8, so bool and FP8 tensors and any strides need no NCCL support."""
    world = dist.get_world_size(group)
    rows, tail = t.size(0), tuple(t.shape[1:])
    raw = t.contiguous().reshape(rows, math.prod(tail)).view(torch.uint8)
    count = torch.tensor([rows], dtype=torch.int64, device=t.device)
    counts = [torch.empty_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    counts = torch.cat(counts).tolist()
    # all_gather needs equal shapes: pad every rank to the longest (at least one row).
    padded = torch.zeros(max(max(counts), 1), raw.size(1), dtype=torch.uint8, device=t.device)
    padded[:rows] = raw
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return [p[:n].view(t.dtype).view(n, *tail) for p, n in zip(parts, counts)]


def _as_bytes(t):
    # Indexing and cat are not implemented for FP8 everywhere; move the bytes instead.
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


# ---------------------------------------------------------------- channel layout
def channel_bounds(num_tokens: int, num_channels: int) -> List[int]:
    """End token (exclusive) of each channel: channel c sends the source tokens
    [c*ceil(T/C), min(T, (c+1)*ceil(T/C)))."""
    per = -(-num_tokens // num_channels)
    return [min(num_tokens, (c + 1) * per) for c in range(num_channels)]


def channel_prefix(in_rank: torch.Tensor, num_channels: int) -> torch.Tensor:
    """[R, C] int64: entry [r][c] = tokens of channels 0..c that go to rank r (inclusive prefix)."""
    num_tokens, num_ranks = in_rank.shape
    sent_before = torch.cat([torch.zeros(1, num_ranks, dtype=torch.int64, device=in_rank.device),
                             in_rank.long().cumsum(0)])  # row i = tokens < i per destination
    ends = torch.tensor(channel_bounds(num_tokens, num_channels), dtype=torch.int64, device=in_rank.device)
    return sent_before[ends].t().contiguous()


def send_head_of(in_rank: torch.Tensor, num_channels: int) -> torch.Tensor:
    """[T, R] int32: -1 where t does not go to r, else t's index among the tokens of its channel
    that go to r (the slot it takes in that channel's queue to r)."""
    num_tokens, num_ranks = in_rank.shape
    if num_tokens == 0:
        return torch.empty(0, num_ranks, dtype=torch.int32, device=in_rank.device)
    per = -(-num_tokens // num_channels)
    before = in_rank.long().cumsum(0) - in_rank.long()  # tokens < t going to r
    channel_start = torch.arange(num_tokens, device=in_rank.device) // per * per
    within = before - before[channel_start]
    return torch.where(in_rank, within, torch.full_like(within, -1)).int()


# ---------------------------------------------------------------- dispatch
@dataclass
class DispatchRef:
    """What dispatch must return on this rank (rows in receive order)."""
    recv_x: torch.Tensor  # [Nrecv, H], x's dtype
    recv_x_scales: Optional[torch.Tensor]  # [Nrecv, S] row-major, the scales' dtype; None for BF16
    recv_topk_idx: Optional[torch.Tensor]  # [Nrecv, K] topk_idx's dtype, local expert id or -1
    recv_topk_weights: Optional[torch.Tensor]  # [Nrecv, K] float32, 0 where recv_topk_idx == -1
    num_recv_tokens_per_expert_list: List[int]
    # (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
    #  is_token_in_rank (the caller's tensor), send_head)
    handle: tuple
    num_recv: int


def ref_dispatch(group, x, is_token_in_rank, num_tokens_per_expert, topk_idx=None, topk_weights=None,
                 num_channels=10, expert_alignment=1) -> DispatchRef:
    """DeepEP's intranode dispatch as seen by this rank. `x` is a [T, H] tensor or an
    (FP8 [T, H], scales [T, S]) tuple with any strides; `num_channels` is config.num_sms // 2."""
    me, world = dist.get_rank(group), dist.get_world_size(group)
    x_data, x_scales = x if isinstance(x, tuple) else (x, None)
    in_rank = gather_rows(is_token_in_rank, group)
    xs = [_as_bytes(t) for t in gather_rows(x_data, group)]
    scales = gather_rows(x_scales, group) if x_scales is not None else None
    per_expert = gather_rows(num_tokens_per_expert.view(1, -1), group)
    topks = gather_rows(topk_idx, group) if topk_idx is not None else None
    weights = gather_rows(topk_weights, group) if topk_weights is not None else None

    # Rows from source s: its tokens bound for me, in ascending token index; sources ascending.
    src_tokens = [m[:, me].nonzero().squeeze(1) for m in in_rank]
    recv_src_idx = torch.cat(src_tokens).int()
    recv_x = torch.cat([x_s[t] for x_s, t in zip(xs, src_tokens)]).view(x_data.dtype)
    recv_x_scales = torch.cat([s_s[t] for s_s, t in zip(scales, src_tokens)]) if scales is not None else None

    # rank_prefix_matrix[i][j]: tokens ranks 0..i send to rank j (identical on every rank).
    sent = torch.stack([m.sum(0, dtype=torch.int64) for m in in_rank])
    rank_prefix = sent.cumsum(0)
    # recv_channel_prefix_matrix[s][c]: first row of source s's channel c on this rank.
    recv_channel = []
    for s, m in enumerate(in_rank):
        mine = channel_prefix(m, num_channels)[me]
        exclusive = torch.cat([mine.new_zeros(1), mine[:-1]])
        recv_channel.append(exclusive + (rank_prefix[s - 1, me] if s > 0 else 0))
    handle = (rank_prefix.int(),
              channel_prefix(is_token_in_rank, num_channels).int(),
              torch.stack(recv_channel).int(),
              recv_src_idx,
              is_token_in_rank,
              send_head_of(is_token_in_rank, num_channels))

    num_experts = num_tokens_per_expert.numel()
    local = num_experts // world
    first_expert = me * local
    totals = torch.cat(per_expert).sum(0)[first_expert:first_expert + local].tolist()
    counts = [(c + expert_alignment - 1) // expert_alignment * expert_alignment for c in totals]

    recv_topk_idx = recv_topk_weights = None
    if topks is not None:
        idx = torch.cat([t_s[t] for t_s, t in zip(topks, src_tokens)])
        is_local = (idx >= first_expert) & (idx < first_expert + local)
        recv_topk_idx = torch.where(is_local, idx - first_expert, torch.full_like(idx, -1))
        if weights is not None:
            w = torch.cat([w_s[t] for w_s, t in zip(weights, src_tokens)]).float()
            recv_topk_weights = torch.where(is_local, w, torch.zeros_like(w))
    return DispatchRef(recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, counts, handle,
                       recv_src_idx.numel())


# ---------------------------------------------------------------- combine
def unpack_bias(bias):
    if bias is None:
        return None, None
    if isinstance(bias, torch.Tensor):
        return bias, None
    bias_0, bias_1 = bias
    return bias_0, bias_1


def ref_combine(group, ref: DispatchRef, x, topk_weights=None, bias=None):
    """DeepEP's intranode combine on this rank for the dispatch described by `ref`: `x` and
    `topk_weights` are what this rank passes to combine (only the first ref.num_recv rows are
    read, so a num_worst_tokens tail may hold anything). Returns (combined_x [T, H] BF16,
    combined_topk_weights [T, K] float32 or None)."""
    me, world = dist.get_rank(group), dist.get_world_size(group)
    n = ref.num_recv
    xs = gather_rows(x[:n], group)
    ws = gather_rows(topk_weights[:n], group) if topk_weights is not None else None
    rank_prefix, in_rank = ref.handle[0], ref.handle[4]
    num_tokens, hidden = in_rank.size(0), x.size(1)

    bias_0, bias_1 = unpack_bias(bias)
    zeros = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
    acc = (bias_0.float() if bias_0 is not None else zeros) + (bias_1.float() if bias_1 is not None else zeros)
    acc_w = torch.zeros(num_tokens, ws[0].size(1), dtype=torch.float32, device=x.device) if ws else None
    for r in range(world):  # ascending destination rank: the library's accumulation order
        tokens = in_rank[:, r].nonzero().squeeze(1)
        first = int(rank_prefix[me - 1, r]) if me > 0 else 0
        rows = torch.arange(first, first + tokens.numel(), device=x.device)
        acc[tokens] += xs[r][rows].float()
        if acc_w is not None:
            acc_w[tokens] += ws[r][rows].float()
    return acc.to(torch.bfloat16), acc_w
