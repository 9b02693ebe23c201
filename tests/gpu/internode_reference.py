"""An independent pure-torch reference of DeepEP V1's internode normal dispatch and combine
(deepep-buffer-api.md sections 4.2, 5.4, 6.2, 6.3; docs/internode.md), for R = N nodes x G GPUs
(DeepEP: G = 8; here any G <= 32 that divides R; rank r is GPU r % G of node r // G).

Nothing here needs torch.distributed: internode_dispatch_all / internode_combine_all take every
rank's inputs as lists in rank order (a virtual-rank harness has them; a multi-process test
gathers them with normal_reference.gather_rows, or calls ref_internode_dispatch /
ref_internode_combine, which do that). Works on CPU and GPU tensors.

What DeepEP V1 (567632d, csrc/kernels/internode.cu) computes, and what is modelled here:

* Channels: channel c of a source rank owns tokens [c*ceil(T/C), min(T, (c+1)*ceil(T/C))), as
  intranode (normal_reference.channel_bounds). A token goes to node n when any of the G ranks
  of n is in its is_token_in_rank row; it crosses the RDMA leg once per such node, to the
  forwarder (n, l) of the same GPU index l, which copies it over NVLink to each GPU of n in its
  mask.
* Row order on a receiver: ascending global source rank, then source token index. Every row's
  position follows from the prefix matrices, so it does not depend on how the forwarders
  interleave source nodes (the one timing-dependent thing in the data path).
* The 10-tuple handle, every entry exact (all int32 except handle[0], the caller's
  is_token_in_rank, and recv_src_meta, uint8):
  1 rdma_channel_prefix_matrix [N, C]: inclusive prefix over channels of the tokens going to
    node n (the sender's view);
  2 gbl_channel_prefix_matrix [R, C]: the same per destination rank;
  3 recv_rdma_channel_prefix_matrix [N, C]: row n = source rank (n, l_me)'s
    rdma_channel_prefix_matrix[my node] (inclusive, relative to that source, not offset);
  4 recv_rdma_rank_prefix_sum [N]: inclusive prefix over source nodes n of the tokens that
    (n, l_me) sends to my node: the rows of this GPU's RDMA receive space, (node, token) order;
  5 recv_gbl_channel_prefix_matrix [R, C]: absolute first receive row of (source s, channel c)
    = recv_gbl_rank_prefix_sum[s-1] + s's gbl_channel_prefix_matrix[me][c-1] (exclusive);
  6 recv_gbl_rank_prefix_sum [R]: inclusive prefix over source ranks of the rows I receive;
  7 recv_src_meta [Nrecv, 8] uint8: DeepEP's `struct SourceMeta {int src_rdma_rank;
    int is_token_in_nvl_rank_bits;}` as little-endian bytes: bytes 0-3 the source node,
    bytes 4-7 the mask of the token's destination GPUs on MY node (bit g = local rank g);
  8 send_rdma_head [T, N]: -1 where token t does not go to node n, else its index among the
    tokens of its channel that go to n (its slot sequence in that channel's RDMA stream);
  9 send_nvl_head [Nrdma_recv, G]: for each row of my RDMA receive space (a token of source
    (n, l_me)), -1 where it does not go to local GPU g, else its index among the rows of the
    same (source node, channel) that go to g.
* Combine's notify rewrites handle[8] and handle[9] in place (combined_rdma_head,
  combined_nvl_head, InternodeDispatchRef.combined_handle): inside each segment (a source
  channel for send_rdma_head; a (source node, channel) block of the RDMA receive space for
  send_nvl_head) every negative entry becomes -(next non-negative entry of the same column in
  the segment) - 1, or -(1 << 25) - 1 when none follows. Idempotent.
* Combine: the forwarder (n, l) sums, per token of source (s = (n0, l)) routed to node n, the
  rows of the GPUs g of n in the token's mask in ascending g, in fp32 starting from 0.0, and
  rounds to BF16 once; the source then computes fp32 bias_0 + bias_1 (each BF16 -> fp32; a
  missing bias reads as 0.0), adds the nodes' BF16 partials in ascending n, and rounds to BF16.
  combined_topk_weights: per node 0.0 + w_g in ascending g (fp32, not rounded), then 0.0 + the
  node sums in ascending n. Both orders are fixed by the kernel's lane loops, not by arrival,
  so DeepEP's result is bit-deterministic and this reference reproduces it bit for bit. It
  is order-dependent all the same: another fixed order, bias last, or one fp32 sum rounded once
  can give other bits (a single-stage sum can differ by an ulp or more where partials cancel).

Statistic (docs/internode.md): scale-out rows of a rank = per token, its distinct destination
nodes other than its own (scale_out_rows); bytes = rows x the implementation's row size.

Inputs: num_tokens_per_rank and num_tokens_per_rdma_rank are not taken: DeepEP's notify trusts
them to agree with is_token_in_rank (get_dispatch_layout's do), and here they are derived from
it. A cached dispatch (handle given) returns the same recv_x / recv_x_scales and nothing else.

Timing-dependent or undefined in DeepEP, so a test must not compare it:
* With num_worst_tokens > 0 the outputs have num_worst_tokens rows (and send_nvl_head too), of
  which only the first num_recv (num_rdma_recv for send_nvl_head) are defined; DeepEP fills
  recv_topk_idx's tail with -1 and leaves every other tail uninitialised. Here those tails are
  0 (recv_topk_idx: -1); compare [:num_recv] / [:num_rdma_recv], and the recv_topk_idx tail.
  num_recv_tokens_per_expert_list is then [].
* combine reads only the first num_recv rows of x here. DeepEP's NVL combine sender ends the
  last (source rank, channel) stream at x.size(0), so a padded x (num_worst_tokens) would push
  the padding rows to a forwarder that never consumes them: a test combines x[:num_recv].
* The order in which a forwarder's NVLink ring interleaves source nodes (not observable in any
  output: positions are computed, and send_nvl_head counts per (source node, channel)).
"""
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from normal_reference import _as_bytes, channel_bounds, channel_prefix, gather_rows, send_head_of, unpack_bias

SOURCE_META_BYTES = 8  # sizeof(SourceMeta): two int32
HEAD_NONE = 1 << 25  # DeepEP's "heuristic large number" for "no later head in this segment"


# ---------------------------------------------------------------- small pieces
def node_of(rank: int, num_nvl_ranks: int) -> int:
    return rank // num_nvl_ranks


def in_node(is_token_in_rank: torch.Tensor, num_nvl_ranks: int) -> torch.Tensor:
    """[T, N] bool: token t has a destination rank on node n."""
    num_tokens, num_ranks = is_token_in_rank.shape
    return is_token_in_rank.reshape(num_tokens, num_ranks // num_nvl_ranks, num_nvl_ranks).any(2)


def nvl_mask(is_token_in_rank: torch.Tensor, node: int, num_nvl_ranks: int) -> torch.Tensor:
    """[T] int64: bit g set when token t goes to local rank g of `node` (SourceMeta's mask)."""
    local = is_token_in_rank[:, node * num_nvl_ranks:(node + 1) * num_nvl_ranks].long()
    bits = torch.ones(num_nvl_ranks, dtype=torch.int64, device=local.device) << torch.arange(
        num_nvl_ranks, device=local.device)
    return (local * bits).sum(1)


def encode_source_meta(src_node: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[n, 8] uint8: SourceMeta {int32 src_rdma_rank; int32 is_token_in_nvl_rank_bits} as the
    little-endian bytes CUDA writes (built byte by byte so the host's endianness is irrelevant)."""
    words = torch.stack([src_node.long(), mask.long()], 1)  # [n, 2], each < 2^32
    shifts = torch.arange(0, 32, 8, device=words.device)
    return ((words.unsqueeze(2) >> shifts) & 0xff).reshape(-1, SOURCE_META_BYTES).to(torch.uint8)


def decode_source_meta(meta: torch.Tensor):
    """(src_node [n] int64, mask [n] int64) from [n, 8] uint8 rows (mask read unsigned)."""
    b = meta.long().reshape(-1, 2, 4)
    words = (b << torch.arange(0, 32, 8, device=meta.device)).sum(2)
    return words[:, 0], words[:, 1]


def _exclusive(prefix: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix (along the last dim) from an inclusive one."""
    return torch.cat([torch.zeros_like(prefix[..., :1]), prefix[..., :-1]], -1)


def _pad_rows(t: Optional[torch.Tensor], rows: int, fill=0) -> Optional[torch.Tensor]:
    if t is None or t.size(0) >= rows:
        return t
    tail = torch.full((rows - t.size(0), *t.shape[1:]), fill, dtype=_as_bytes(t).dtype, device=t.device)
    return torch.cat([_as_bytes(t), tail]).view(t.dtype)


# ---------------------------------------------------------------- head rewrite (combine notify)
def rewrite_heads(head: torch.Tensor, segment_end: torch.Tensor) -> torch.Tensor:
    """DeepEP's combine-notify rewrite of a [M, K] head tensor whose row i belongs to the segment
    ending (exclusive) at segment_end[i]: a negative entry becomes -(the first non-negative entry
    below it in its column and segment) - 1, or -HEAD_NONE - 1 if there is none. DeepEP walks
    each segment backwards; a suffix minimum of row indices does the same here."""
    rows = head.size(0)
    if rows == 0:
        return head.clone()
    idx = torch.arange(rows, device=head.device).unsqueeze(1).expand_as(head)
    key = torch.where(head >= 0, idx, torch.full_like(idx, rows))
    nxt = key.flip(0).cummin(0).values.flip(0)  # first row >= i with a head, else `rows`
    found = nxt < segment_end.to(head.device).unsqueeze(1)
    nxt_head = head.long().gather(0, nxt.clamp(max=rows - 1))
    encoded = torch.where(found, -nxt_head - 1, torch.full_like(nxt_head, -HEAD_NONE - 1))
    return torch.where(head >= 0, head.long(), encoded).to(head.dtype)


def combined_rdma_head(send_rdma_head: torch.Tensor, num_channels: int) -> torch.Tensor:
    """handle[8] after a combine (segments: the source channels of combine's config, which
    must have dispatch's C: combine asserts the prefix matrices have C columns)."""
    num_tokens = send_rdma_head.size(0)
    ends = torch.tensor(channel_bounds(num_tokens, num_channels), dtype=torch.int64)
    per = -(-num_tokens // num_channels) if num_tokens else 1
    return rewrite_heads(send_rdma_head, ends[torch.arange(num_tokens) // per])


def combined_nvl_head(send_nvl_head: torch.Tensor, recv_rdma_channel_prefix_matrix: torch.Tensor,
                      recv_rdma_rank_prefix_sum: torch.Tensor) -> torch.Tensor:
    """handle[9] after a combine. Segments: (source node n, channel c) blocks of the RDMA receive
    space, [rank_prefix[n-1] + cpm[n][c-1], rank_prefix[n-1] + cpm[n][c]). Rows past the last
    block (a num_worst_tokens tail) are left as they are, as DeepEP does."""
    cpm = recv_rdma_channel_prefix_matrix.long().cpu()
    base = _exclusive(recv_rdma_rank_prefix_sum.long().cpu()).unsqueeze(1)
    ends, lengths = (base + cpm).flatten(), (cpm - _exclusive(cpm)).flatten()
    covered = int(recv_rdma_rank_prefix_sum[-1]) if recv_rdma_rank_prefix_sum.numel() else 0
    out = send_nvl_head.clone()
    out[:covered] = rewrite_heads(send_nvl_head[:covered], ends.repeat_interleave(lengths))
    return out


# ---------------------------------------------------------------- dispatch
@dataclass
class InternodeDispatchRef:
    """What Buffer.internode_dispatch returns on one rank (rows in receive order)."""
    recv_x: torch.Tensor  # [rows, H], x's dtype
    recv_x_scales: Optional[torch.Tensor]  # [rows, S] row-major, the scales' dtype
    recv_topk_idx: Optional[torch.Tensor]  # [rows, K] topk_idx's dtype: local expert id or -1
    recv_topk_weights: Optional[torch.Tensor]  # [rows, K] float32, 0 where recv_topk_idx == -1
    num_recv_tokens_per_expert_list: List[int]  # aligned; [] with num_worst_tokens
    handle: tuple  # the 10-tuple, as dispatch returns it (heads not yet rewritten)
    num_recv: int  # defined rows of the recv_* tensors and recv_src_meta
    num_rdma_recv: int  # defined rows of send_nvl_head

    def combined_handle(self, num_channels: int) -> tuple:
        """The handle as it reads after a combine (heads rewritten; DeepEP does it in place)."""
        h = self.handle
        return h[:8] + (combined_rdma_head(h[8], num_channels), combined_nvl_head(h[9], h[3], h[4]))


def internode_dispatch_all(x: Sequence, is_token_in_rank: Sequence[torch.Tensor],
                           num_tokens_per_expert: Sequence[torch.Tensor],
                           topk_idx: Optional[Sequence[torch.Tensor]] = None,
                           topk_weights: Optional[Sequence[torch.Tensor]] = None, *,
                           num_nvl_ranks: int, num_channels: int, expert_alignment: int = 1,
                           num_worst_tokens: int = 0,
                           ranks: Optional[Sequence[int]] = None) -> List[Optional[InternodeDispatchRef]]:
    """DeepEP V1's internode dispatch on every rank (or only on `ranks`; others are None).
    Each argument is a list over ranks: x[r] a [T_r, H] tensor or an (FP8 [T_r, H], scales
    [T_r, S]) tuple with any strides; is_token_in_rank[r] [T_r, R] bool; num_tokens_per_expert[r]
    [E] (the layout's); topk_idx[r] [T_r, K]; topk_weights[r] [T_r, K] float32.
    num_channels is config.num_sms // 2."""
    num_ranks, g_ = len(is_token_in_rank), num_nvl_ranks
    assert 1 <= g_ <= 32 and num_ranks % g_ == 0, (num_ranks, g_)
    num_nodes, num_ch = num_ranks // g_, num_channels
    in_rank = list(is_token_in_rank)
    data = [xi[0] if isinstance(xi, tuple) else xi for xi in x]
    scales = [xi[1] for xi in x] if isinstance(x[0], tuple) else None
    nodes = [in_node(m, g_) for m in in_rank]

    # Sender-side entries (1, 2, 8): a function of the rank's own routing only.
    rdma_cpm = [channel_prefix(n, num_ch).int() for n in nodes]
    gbl_cpm = [channel_prefix(m, num_ch).int() for m in in_rank]
    rdma_head = [send_head_of(n, num_ch) for n in nodes]
    counts = torch.stack([m.sum(0, dtype=torch.int64) for m in in_rank])  # [src, dst rank]
    node_counts = torch.stack([n.sum(0, dtype=torch.int64) for n in nodes])  # [src, dst node]

    num_experts = num_tokens_per_expert[0].numel()
    local = num_experts // num_ranks
    out: List[Optional[InternodeDispatchRef]] = [None] * num_ranks
    for me in (range(num_ranks) if ranks is None else ranks):
        my_node, my_gpu = divmod(me, g_)
        dev = in_rank[me].device
        gbl_prefix = counts[:, me].cumsum(0)
        gbl_start = _exclusive(gbl_prefix)
        recv_gbl_cpm = torch.stack([_exclusive(gbl_cpm[s][me].long()) + gbl_start[s] for s in range(num_ranks)])

        # RDMA receive space: tokens of sources (n, my_gpu) bound for my node, (n, token) order.
        fwd_src = [n * g_ + my_gpu for n in range(num_nodes)]
        rdma_prefix = node_counts[fwd_src, my_node].cumsum(0)
        recv_rdma_cpm = torch.stack([rdma_cpm[s][my_node] for s in fwd_src])
        local_cols = slice(my_node * g_, (my_node + 1) * g_)
        nvl_head = torch.cat([send_head_of(in_rank[s][:, local_cols], num_ch)[nodes[s][:, my_node]] for s in fwd_src])

        # Rows I receive: from each source s its tokens bound for me, ascending token index.
        tokens = [in_rank[s][:, me].nonzero().squeeze(1) for s in range(num_ranks)]
        num_recv, num_rdma = int(gbl_prefix[-1]), int(rdma_prefix[-1])
        recv_x = torch.cat([_as_bytes(data[s])[t] for s, t in enumerate(tokens)]).view(data[0].dtype)
        recv_scales = torch.cat([scales[s][t] for s, t in enumerate(tokens)]).contiguous() if scales else None
        src_meta = encode_source_meta(
            torch.cat([torch.full_like(t, node_of(s, g_)) for s, t in enumerate(tokens)]),
            torch.cat([nvl_mask(in_rank[s], my_node, g_)[t] for s, t in enumerate(tokens)]))

        recv_idx = recv_w = None
        first = me * local
        if topk_idx is not None:
            idx = torch.cat([topk_idx[s][t] for s, t in enumerate(tokens)])
            is_local = (idx >= first) & (idx < first + local)
            recv_idx = torch.where(is_local, idx - first, torch.full_like(idx, -1))
            w = torch.cat([topk_weights[s][t] for s, t in enumerate(tokens)]).float()
            recv_w = torch.where(is_local, w, torch.zeros_like(w))

        per_expert = []
        if num_worst_tokens == 0:
            totals = torch.stack([e.long() for e in num_tokens_per_expert]).sum(0)[first:first + local].tolist()
            per_expert = [(c + expert_alignment - 1) // expert_alignment * expert_alignment for c in totals]
        else:  # DeepEP sizes every receive tensor (and send_nvl_head) by num_worst_tokens
            assert num_worst_tokens >= max(num_recv, num_rdma), (num_worst_tokens, num_recv, num_rdma)
            recv_x, recv_scales, recv_w = (_pad_rows(t, num_worst_tokens) for t in (recv_x, recv_scales, recv_w))
            recv_idx = _pad_rows(recv_idx, num_worst_tokens, -1)
            src_meta, nvl_head = _pad_rows(src_meta, num_worst_tokens), _pad_rows(nvl_head, num_worst_tokens)

        handle = (is_token_in_rank[me], rdma_cpm[me], gbl_cpm[me], recv_rdma_cpm.int().to(dev),
                  rdma_prefix.int().to(dev), recv_gbl_cpm.int().to(dev), gbl_prefix.int().to(dev),
                  src_meta.to(dev), rdma_head[me], nvl_head.int().to(dev))
        out[me] = InternodeDispatchRef(recv_x, recv_scales, recv_idx, recv_w, per_expert, handle, num_recv, num_rdma)
    return out


# ---------------------------------------------------------------- combine
def internode_combine_all(is_token_in_rank: Sequence[torch.Tensor], x: Sequence[torch.Tensor],
                          topk_weights: Optional[Sequence[torch.Tensor]] = None, bias: Optional[Sequence] = None, *,
                          num_nvl_ranks: int, sources: Optional[Sequence[int]] = None) -> list:
    """DeepEP V1's internode combine: for each source rank s (all, or `sources`; others None),
    (combined_x [T_s, H] BF16, combined_topk_weights [T_s, K] float32 or None).
    x[d] / topk_weights[d]: what rank d passes to combine, rows in d's receive order (only the
    rows of real tokens are read); bias[s]: None, a tensor or a (bias_0, bias_1) tuple of [T_s, H]
    BF16 (only the entries of `sources` are read). Summation order: see the module docstring."""
    num_ranks, g_ = len(is_token_in_rank), num_nvl_ranks
    num_nodes = num_ranks // g_
    counts = torch.stack([m.sum(0, dtype=torch.int64) for m in is_token_in_rank])
    first_row = counts.cumsum(0) - counts  # [src, dst]: first row of src's block on dst
    hidden = x[0].size(1)
    out: list = [None] * num_ranks
    for s in (range(num_ranks) if sources is None else sources):
        m = is_token_in_rank[s]
        num_tokens, dev = m.size(0), x[0].device
        b0, b1 = unpack_bias(bias[s] if bias is not None else None)
        zeros = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=dev)
        acc = (b0.float() if b0 is not None else zeros) + (b1.float() if b1 is not None else zeros)
        acc_w = None
        if topk_weights is not None:
            acc_w = torch.zeros(num_tokens, topk_weights[0].size(1), dtype=torch.float32, device=dev)
        node_mask = in_node(m, g_)
        for n in range(num_nodes):  # ascending node: the source's RDMA receiver lanes
            part = torch.zeros_like(zeros)
            part_w = torch.zeros_like(acc_w) if acc_w is not None else None
            for g in range(g_):  # ascending local rank: the forwarder's NVL lanes
                d = n * g_ + g
                tok = m[:, d].nonzero().squeeze(1).to(dev)
                rows = torch.arange(tok.numel(), device=dev) + int(first_row[s, d])
                part[tok] += x[d][rows].float()
                if part_w is not None:
                    part_w[tok] += topk_weights[d][rows].float()
            tok = node_mask[:, n].nonzero().squeeze(1).to(dev)
            acc[tok] += part[tok].to(torch.bfloat16).float()  # the forwarder's BF16 partial
            if acc_w is not None:
                acc_w[tok] += part_w[tok]  # weights travel as fp32: no rounding in between
        out[s] = (acc.to(torch.bfloat16), acc_w)
    return out


# ---------------------------------------------------------------- statistic
def scale_out_rows(is_token_in_rank: torch.Tensor, rank: int, num_nvl_ranks: int) -> int:
    """Rows rank `rank` puts on the scale-out leg in one dispatch (and receives back in one
    combine): per token, its distinct destination nodes other than its own."""
    nodes = in_node(is_token_in_rank, num_nvl_ranks)
    nodes[:, node_of(rank, num_nvl_ranks)] = False
    return int(nodes.sum())


def scale_out_bytes(is_token_in_rank: torch.Tensor, rank: int, num_nvl_ranks: int, row_bytes: int) -> int:
    """docs/internode.md's statistic: scale-out rows x the bytes of one row (the
    implementation's row; DeepEP's is deepep_row_bytes)."""
    return scale_out_rows(is_token_in_rank, rank, num_nvl_ranks) * row_bytes


def deepep_row_bytes(hidden_bytes: int, num_scales: int = 0, num_topk: int = 0) -> int:
    """DeepEP's get_num_bytes_per_token: x, scales (4 B each), SourceMeta, top-k ids (int32) and
    weights (fp32), rounded up to 16 bytes (combine sends no scales or ids: pass their 0)."""
    raw = hidden_bytes + SOURCE_META_BYTES + 4 * num_scales + 8 * num_topk
    return -(-raw // 16) * 16


def _align16(n: int) -> int:
    return -(-n // 16) * 16


# This implementation's rows (kernels/internode_common.cuh DispatchRow and CombineRow, pinned by
# src/internode/mod.rs's row_sizes test): each part padded to 16 bytes.
ROW_HEADER_BYTES = 16  # DEEPEP_INTERNODE_ROW_HEADER_BYTES: source token, destination-GPU mask
NVL_HEADER_BYTES = 16  # DEEPEP_INTERNODE_NVL_HEADER_BYTES: an NVLink slot's flag header


def dispatch_row_bytes(hidden_bytes: int, num_scales: int = 0, num_topk: int = 0) -> int:
    """A dispatch row: header, x, scales (4 B each), top-k ids (int32) and weights (fp32)."""
    return ROW_HEADER_BYTES + _align16(hidden_bytes) + _align16(4 * num_scales) + 2 * _align16(4 * num_topk)


def combine_row_bytes(hidden_bytes: int, num_topk: int = 0) -> int:
    """A combine row: x (BF16), then the top-k weights (fp32)."""
    return _align16(hidden_bytes) + _align16(4 * num_topk)


def traffic_rows(is_token_in_rank: Sequence[torch.Tensor], rank: int, num_nvl_ranks: int) -> List[int]:
    """Rows rank `rank` sends in one dispatch and one combine, as the traffic counters count them
    (docs/internode.md, "Statistics"), from every rank's is_token_in_rank: [dispatch scale-out
    (its tokens' distinct other destination nodes), dispatch NVLink (rows it forwards from sources
    (s, my GPU) to the other GPUs of my node), combine scale-out (rows of its scale-out receive
    space from other nodes, sent back), combine NVLink (rows it received from sources (s, j), j
    another GPU of my node, sent to forwarder j)]."""
    g = num_nvl_ranks
    node, gpu = divmod(rank, g)
    sources = [s * g + gpu for s in range(len(is_token_in_rank) // g)]
    others = [node * g + j for j in range(g) if j != gpu]
    dispatch_nvl = sum(int(is_token_in_rank[src][:, others].sum()) for src in sources)
    combine_out = sum(int(in_node(is_token_in_rank[src], g)[:, node].sum()) for src in sources if src // g != node)
    combine_nvl = sum(int(is_token_in_rank[s * g + j][:, rank].sum())
                      for s in range(len(is_token_in_rank) // g) for j in range(g) if j != gpu)
    return [scale_out_rows(is_token_in_rank[rank], rank, g), dispatch_nvl, combine_out, combine_nvl]


def traffic(rows: Sequence[int], dispatch_row: int, combine_row: int) -> List[int]:
    """The 8 counters (enum DeepepTrafficKind) of traffic_rows' rows: rows and bytes per leg, an
    NVLink slot's bytes the row's plus its header."""
    sizes = (dispatch_row, dispatch_row + NVL_HEADER_BYTES, combine_row, combine_row + NVL_HEADER_BYTES)
    return [v for n, size in zip(rows, sizes) for v in (n, n * size)]


# ---------------------------------------------------------------- collective wrappers
def ref_internode_dispatch(group, x, is_token_in_rank, num_tokens_per_expert, topk_idx=None, topk_weights=None, *,
                           num_nvl_ranks: int, num_channels: int, expert_alignment: int = 1,
                           num_worst_tokens: int = 0) -> InternodeDispatchRef:
    """internode_dispatch_all for this rank from every rank's inputs (collective over `group`)."""
    me = dist.get_rank(group)
    x_data, x_scales = x if isinstance(x, tuple) else (x, None)
    xs = gather_rows(x_data, group)
    if x_scales is not None:
        xs = list(zip(xs, gather_rows(x_scales, group)))
    refs = internode_dispatch_all(
        xs, gather_rows(is_token_in_rank, group),
        [e.view(-1) for e in gather_rows(num_tokens_per_expert.view(1, -1), group)],
        gather_rows(topk_idx, group) if topk_idx is not None else None,
        gather_rows(topk_weights, group) if topk_weights is not None else None,
        num_nvl_ranks=num_nvl_ranks, num_channels=num_channels, expert_alignment=expert_alignment,
        num_worst_tokens=num_worst_tokens, ranks=[me])
    ref = refs[me]
    # handle[0] is the caller's own tensor object in DeepEP.
    ref.handle = (is_token_in_rank,) + ref.handle[1:]
    return ref


def ref_internode_combine(group, is_token_in_rank, x, num_recv: int, topk_weights=None, bias=None, *,
                          num_nvl_ranks: int):
    """internode_combine_all for this rank (collective over `group`): x / topk_weights are this
    rank's combine inputs, of which the first num_recv rows are real."""
    me, world = dist.get_rank(group), dist.get_world_size(group)
    biases = [None] * world
    biases[me] = bias
    return internode_combine_all(
        gather_rows(is_token_in_rank, group), gather_rows(x[:num_recv], group),
        gather_rows(topk_weights[:num_recv], group) if topk_weights is not None else None, biases,
        num_nvl_ranks=num_nvl_ranks, sources=[me])[me]
