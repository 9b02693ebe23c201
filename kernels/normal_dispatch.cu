// Normal-mode dispatch. 2C blocks: block c < C sends channel c's tokens to the other ranks,
// block C + c copies the channel's tokens for this rank and drains channel c's rings. (Measured
// on 4x H200: mixing senders and receivers in every block was slower, and so were copy-engine
// sends. On 2x H100, 4096 tokens, 24 SMs: the own rows on the sender blocks took as long per warp
// as the NVLink rows and kept half their warps off NVLink; on the receiver blocks, by TMA, BF16
// dispatch went 293 -> 268 us and FP8 192 -> 160.)
//
// Sender: warps form one group per remote destination rank. A group walks the channel's tokens
// in order (32 at a time, ballot + popc give each token its sequence number in the (channel,
// destination) stream) and its warps take every G-th token into the destination's ring slot
// over NVLink. This rank's own tokens go by TMA from x straight into recv_x (no ring), walked
// the same way by one group: the receiver block's first kDataWarps / R warps, and at 2 ranks also
// the sender block's first sender_own_warps.
// Receiver: one warp group per remote source copies slots out into the final
// rows (start of the (source, channel) block + sequence), converts top-k ids to
// local ids, and hands the slot back. Per-slot flags, no group barriers: any
// number of warps, any ring size >= 1 is deadlock-free.
// Rings of consecutive ops share the NVL region and this kernel has no barrier: the notify
// kernel that prepare launches before every dispatch (cached ones too) is that barrier, so a
// dispatch launched without its prepare could overwrite rings a peer still reads.
//
// Shrink mode (docs/normal_shrink.md): nothing is sent to a masked rank (its send_head entries are
// -1) and nothing is expected from one; the rows notify counted for a source that is masked, or
// goes silent, during this kernel are left empty (empty_row). Every such row is counted.
#include "launch.cuh"
#include "normal_common.cuh"

namespace deepep {
namespace normal {

struct DispatchSlot {
  int32_t hidden_bytes, num_scales, num_topk;
  // The header: the slot's flag (u64), then the row's source token index (int32).
  static constexpr int64_t kSrcIdxOff = 8;
  __device__ __forceinline__ int64_t x_off() const { return kSlotHeaderBytes; }
  __device__ __forceinline__ int64_t scales_off() const { return x_off() + hidden_bytes; }
  __device__ __forceinline__ int64_t topk_off() const { return scales_off() + align16(int64_t(num_scales) * 4); }
  __device__ __forceinline__ int64_t weights_off() const { return topk_off() + align16(int64_t(num_topk) * 4); }
};

__device__ __forceinline__ int64_t load_topk(const void* topk, bool is_int32, int64_t i) {
  return is_int32 ? int64_t(static_cast<const int32_t*>(topk)[i]) : static_cast<const int64_t*>(topk)[i];
}

__device__ __forceinline__ void store_topk(void* topk, bool is_int32, int64_t i, int64_t v) {
  if (is_int32) static_cast<int32_t*>(topk)[i] = int32_t(v);
  else static_cast<int64_t*>(topk)[i] = v;
}

// Global expert id -> id local to `rank`, or -1 for another rank's expert.
__device__ __forceinline__ int64_t to_local_expert(int64_t e, int rank, int experts_per_rank) {
  const int64_t first = int64_t(rank) * experts_per_rank;
  return (e >= first && e < first + experts_per_rank) ? e - first : -1;
}

// Copies one token's side data (scales, top-k, weights, source index) for the
// self path: straight into the output row.
__device__ __forceinline__ void write_side_outputs(const DeepepDispatchParams& p, int64_t t, int64_t row, int lane) {
  const int K = p.num_topk;
  if (p.recv_x_scales != nullptr)
    for (int s = lane; s < p.num_scales; s += kWarp)
      static_cast<int32_t*>(p.recv_x_scales)[row * p.num_scales + s] =
          static_cast<const int32_t*>(p.x_scales)[t * p.scale_stride_token + s * p.scale_stride_scale];
  if (p.recv_topk_idx != nullptr) {
    const int epr = p.num_experts / p.common.num_ranks;
    for (int k = lane; k < K; k += kWarp) {
      const int64_t local = to_local_expert(load_topk(p.topk_idx, p.topk_idx_is_int32, t * K + k), p.common.rank, epr);
      store_topk(p.recv_topk_idx, p.topk_idx_is_int32, row * K + k, local);
      if (p.recv_topk_weights != nullptr) p.recv_topk_weights[row * K + k] = local >= 0 ? p.topk_weights[t * K + k] : 0.0f;
    }
  }
  if (lane == 0) p.recv_src_idx[row] = int32_t(t);
}

// Dynamic shared memory: two bulk-copy stages per warp (own rows and drained slots move by TMA),
// then their barriers.
constexpr int kCopyChunk = 4096;
constexpr size_t kDispatchSmemBytes = size_t(kDataWarps) * (2 * kCopyChunk + 2 * sizeof(uint64_t));

// Tokens of [begin, end) that is_token_in_rank marks for dst.
__device__ __forceinline__ int64_t marked_tokens(const uint8_t* is_token_in_rank, int R, int dst, int64_t begin,
                                                 int64_t end, int lane) {
  int64_t marked = 0;
#pragma unroll 4
  for (int64_t tile = begin; tile < end; tile += kWarp) {
    const int64_t t = tile + lane;
    marked += __popc(__ballot_sync(0xffffffffu, t < end && is_token_in_rank[t * R + dst] != 0));
  }
  return marked;
}

// A walking warp's destination (-1: a leftover warp, when R - 1 does not divide the warps), its
// index in the destination's group and the group's size.
struct SendRole {
  int dst, member, stride;
};
// Warps of a receiver block that copy this rank's own tokens; the rest drain the rings. Own rows
// are 1/R of what a rank receives and cost per row what a drained slot does.
__device__ __forceinline__ int own_warps(int num_ranks) { return kDataWarps / num_ranks; }
// Sender block warps [0, n) copy own rows too (members own_warps(R) + warp of the own group): at 2
// ranks the receiver blocks move twice the rows the sender blocks do. 2x H100, 4096 tokens, BF16 /
// FP8 dispatch us with 0 / 2 / 4 / 6 such warps: 24 SMs 272 / 255-263 / 258-268 / 259-266 and
// 159 / 160 / 160 / 157-160; 12 SMs 485 / 455-459 / 435-439 / 419-423 and 280 / 265-267 / 254-256
// / 248-250. More ranks (more NVLink rows per sender block) were not measured: none there.
__device__ __forceinline__ int sender_own_warps(int num_ranks) { return num_ranks == 2 ? kDataWarps / 4 : 0; }
// Sender block warp `warp` (of the warps past sender_own_warps): one group per remote destination.
__device__ __forceinline__ SendRole remote_role(int warp, int num_ranks, int me) {
  if (num_ranks < 2) return {-1, 0, 1};
  const int group_size = (kDataWarps - sender_own_warps(num_ranks)) / (num_ranks - 1), peer_idx = warp / group_size;
  if (peer_idx >= num_ranks - 1) return {-1, 0, 1};
  return {peer_idx < me ? peer_idx : peer_idx + 1, warp % group_size, group_size};
}

// Walks channel ch's tokens for role.dst; member m takes every stride-th token of the (channel,
// destination) stream: into dst's ring, or (dst == this rank) by TMA into recv_x. Returns -1, or
// the sequence number of the warp's first token it did not send (a wait expired, or shrink mode
// masks the destination: then 0), for drop_sends, which is kept out of this loop.
template <bool kShrink>
__device__ __forceinline__ int64_t send_channel(const DeepepDispatchParams& p, int ch, const SendRole role, int lane,
                                             uint8_t* stages, uint64_t* bars) {
  const DeepepNormalCommon& c = p.common;
  const int R = c.num_ranks, me = c.rank, C = c.num_channels;
  const int dst = role.dst;
  if (dst < 0) return -1;
  if ((masked_ranks<kShrink>(c) >> dst) & 1u) return 0;
  const int stride = role.stride, member = role.member;
  uint32_t phases[2] = {0, 0};
  FlagBatch<> flags;
  const uint32_t generation = flag_generation(*c.op_epoch);
  const RingLayout ring{p.slot_bytes, c.ring_tokens, R};
  const DispatchSlot layout{p.hidden_bytes, p.num_scales, p.num_topk};
  const int K = p.num_topk, S = p.num_scales;
  const bool with_topk = K > 0 && p.topk_idx != nullptr;
  const int32_t* scales_in = static_cast<const int32_t*>(p.x_scales);

  int64_t begin, end;
  channel_range(p.num_tokens, C, ch, begin, end);
  // A cached handle's is_token_in_rank (entry 4) must mark, per channel, the rows its
  // channel_prefix_matrix promised dst in notify: dst takes exactly that many, so one more or
  // fewer would shift or leave rows silently. On a mismatch the channel sends none (dst's wait
  // expires, naming this rank) and the fault names the entry. Non-cached, notify counted the
  // same tensor.
  if (p.cached) {
    const int64_t promised =
        int64_t(p.channel_prefix_matrix[dst * C + ch]) - (ch > 0 ? p.channel_prefix_matrix[dst * C + ch - 1] : 0);
    const int64_t marked = marked_tokens(p.is_token_in_rank, R, dst, begin, end, lane);
    if (marked != promised) {
      if (member == 0 && lane == 0)
        record_fault(c, DEEPEP_FAULT_DISPATCH_HANDLE, DEEPEP_HANDLE_IS_TOKEN_IN_RANK, dst * C + ch, marked);
      return -1;
    }
  }
  uint8_t* dst_nvl = dst == me ? nullptr : nvl_base(c, dst);
  uint8_t* my_nvl = nvl_base(c, me);
  const int64_t self_base = p.recv_channel_prefix_matrix[me * C + ch];

  const auto flag_of = [&](int32_t s, uint64_t*& ptr, uint64_t& value) {
    ptr = reinterpret_cast<uint64_t*>(dst_nvl + ring.slot_offset(ch, me, s % ring.ring));
    value = make_flag(generation, s);
  };
  int64_t seq_base = 0;
  for (int64_t tile = begin, tile_idx = 0; tile < end; tile += kWarp, ++tile_idx) {
    const int64_t t_lane = tile + lane;
    const bool in = t_lane < end && p.is_token_in_rank[t_lane * R + dst] != 0;
    const uint32_t mask = __ballot_sync(0xffffffffu, in);
    const int64_t my_seq = seq_base + __popc(mask & ((1u << lane) - 1u));
    if (p.send_head != nullptr && tile_idx % stride == member && t_lane < end)
      p.send_head[t_lane * R + dst] = in ? int32_t(my_seq) : -1;

    // Tokens of this tile whose sequence number falls to this warp.
    const int first = int((stride - seq_base % stride + member) % stride);
    uint32_t rest = mask;
    for (int skip = 0; skip < first && rest; ++skip) rest &= rest - 1;
    while (rest) {
      const int bit = __ffs(rest) - 1;
      const int64_t t = tile + bit;
      const int64_t s = seq_base + __popc(mask & ((1u << bit) - 1u));
      const uint8_t* src = static_cast<const uint8_t*>(p.x) + t * p.hidden_bytes;
      if (dst == me) {
        const int64_t row = self_base + s;
        if (uint64_t(row) < uint64_t(p.num_recv_rows)) {  // the handle's self_base may be anything
          warp_bulk_copy<kCopyChunk>(static_cast<uint8_t*>(p.recv_x) + row * p.hidden_bytes, src, p.hidden_bytes,
                                     stages, bars, phases, lane);
          write_side_outputs(p, t, row, lane);
        }
      } else {
        // Side data and the slot's consumed word are loaded together, before the
        // payload, so their latencies overlap.
        const int64_t slot = s % ring.ring;
        const uint64_t* consumed = reinterpret_cast<const uint64_t*>(my_nvl + ring.consumed_offset(C, ch, dst, slot));
        const uint64_t freed = s >= ring.ring ? ld_relaxed_sys(consumed) : 0;
        int32_t scale0 = 0, scale1 = 0, topk = 0;
        float weight = 0.0f;
        if (lane < S) scale0 = scales_in[t * p.scale_stride_token + lane * p.scale_stride_scale];
        if (lane + kWarp < S) scale1 = scales_in[t * p.scale_stride_token + (lane + kWarp) * p.scale_stride_scale];
        if (with_topk && lane < K) {
          topk = int32_t(load_topk(p.topk_idx, p.topk_idx_is_int32, t * K + lane));
          if (p.topk_weights != nullptr) weight = p.topk_weights[t * K + lane];
        }
        if (s >= ring.ring && freed != make_flag(generation, s - ring.ring)) {
          flags.flush(lane, flag_of);
          if (!warp_wait_relaxed<kShrink>(consumed, make_flag(generation, s - ring.ring), c, dst,
                                 DEEPEP_WAIT_OP_DISPATCH_CONSUMED, ch))
            return s;
        }
        uint8_t* slot_ptr = dst_nvl + ring.slot_offset(ch, me, slot);
        int32_t* scales = reinterpret_cast<int32_t*>(slot_ptr + layout.scales_off());
        if (lane < S) scales[lane] = scale0;
        if (lane + kWarp < S) scales[lane + kWarp] = scale1;
        for (int i = lane + 2 * kWarp; i < S; i += kWarp)
          scales[i] = scales_in[t * p.scale_stride_token + i * p.scale_stride_scale];
        if (with_topk) {
          int32_t* topk_out = reinterpret_cast<int32_t*>(slot_ptr + layout.topk_off());
          float* weights_out = reinterpret_cast<float*>(slot_ptr + layout.weights_off());
          if (lane < K) {
            topk_out[lane] = topk;
            weights_out[lane] = weight;
          }
          for (int k = lane + kWarp; k < K; k += kWarp) {
            topk_out[k] = int32_t(load_topk(p.topk_idx, p.topk_idx_is_int32, t * K + k));
            weights_out[k] = p.topk_weights != nullptr ? p.topk_weights[t * K + k] : 0.0f;
          }
        }
        if (lane == 0) reinterpret_cast<int32_t*>(slot_ptr + DispatchSlot::kSrcIdxOff)[0] = int32_t(t);
        // FlagBatch releases the row's flag after the fence (side data is ordered before it by
        // the warp sync).
        warp_copy<4, CopyLoad::kStream>(reinterpret_cast<int4*>(slot_ptr + layout.x_off()),
                                        reinterpret_cast<const int4*>(src), p.hidden_bytes / 16, lane);
        flags.add(int32_t(s), lane, flag_of);
      }
      // Next token of this warp: skip stride - 1 set bits.
      rest &= rest - 1;
      for (int skip = 1; skip < stride && rest; ++skip) rest &= rest - 1;
    }
    seq_base += __popc(mask);
  }
  flags.flush(lane, flag_of);
  return -1;
}

// Receiver warps: one group per remote source. Rows are moved by the copy
// engine through two smem stages per warp. Returns -1, or the sequence number of the warp's
// first row it did not receive (a wait expired, or shrink mode masks the source), for
// drop_receives, which is kept out of this loop.
template <int kChunk, bool kShrink>
__device__ __forceinline__ int64_t receive_channel(const DeepepDispatchParams& p, int ch, int warp, int num_warps,
                                                int lane, uint8_t* stages, uint64_t* bars) {
  const DeepepNormalCommon& c = p.common;
  const int R = c.num_ranks, me = c.rank, C = c.num_channels;
  if (R < 2) return -1;
  const int group_size = num_warps / (R - 1);
  const int peer_idx = warp / group_size;
  if (peer_idx >= R - 1) return -1;
  const int stride = group_size, member = warp % group_size;
  const int src = peer_idx < me ? peer_idx : peer_idx + 1;
  const uint32_t generation = flag_generation(*c.op_epoch);
  const RingLayout ring{p.slot_bytes, c.ring_tokens, R};
  const DispatchSlot layout{p.hidden_bytes, p.num_scales, p.num_topk};
  const int K = p.num_topk;
  const int epr = p.num_experts > 0 ? p.num_experts / R : 0;

  const int64_t start = p.recv_channel_prefix_matrix[src * C + ch];
  const int64_t stop = ch + 1 < C ? p.recv_channel_prefix_matrix[src * C + ch + 1] : p.rank_prefix_matrix[src * R + me];
  const int64_t count = stop - start;
  // Rows come from the handle (cached) or from what peers sent in notify: a range that is not
  // one is a fault, and the per-row check below keeps every write inside the outputs (rows past
  // them are no fault here: too small a num_worst_tokens, which notify reported).
  if (member == 0 && lane == 0 && (start < 0 || stop < start))
    record_fault(c, DEEPEP_FAULT_DISPATCH_HANDLE, DEEPEP_HANDLE_RECV_CHANNEL_PREFIX, src * C + ch,
                 start < 0 ? start : stop);
  uint8_t* my_nvl = nvl_base(c, me);
  uint8_t* src_nvl = nvl_base(c, src);
  uint32_t phases[2] = {0, 0};
  if ((masked_ranks<kShrink>(c) >> src) & 1u) return member;

  for (int64_t s = member; s < count; s += stride) {
    const int64_t slot = s % ring.ring;
    uint8_t* slot_ptr = my_nvl + ring.slot_offset(ch, src, slot);
    if (!warp_wait<kShrink>(reinterpret_cast<const uint64_t*>(slot_ptr), make_flag(generation, s), c, src,
                   DEEPEP_WAIT_OP_DISPATCH_SLOT, ch))
      return s;
    const int64_t row = start + s;
    if (uint64_t(row) < uint64_t(p.num_recv_rows)) {  // else too small a num_worst_tokens, or a bad range
      // Side data is loaded (L2 only: the slot is rewritten within the kernel) while lane 0 moves
      // the row, so that the two latencies overlap.
      const int S = p.num_scales;
      const int32_t* scales = reinterpret_cast<const int32_t*>(slot_ptr + layout.scales_off());
      const int32_t* topk = reinterpret_cast<const int32_t*>(slot_ptr + layout.topk_off());
      const float* weights = reinterpret_cast<const float*>(slot_ptr + layout.weights_off());
      const bool with_scales = p.recv_x_scales != nullptr, with_topk = p.recv_topk_idx != nullptr;
      const int32_t scale0 = with_scales && lane < S ? __ldcg(scales + lane) : 0;
      const int32_t scale1 = with_scales && lane + kWarp < S ? __ldcg(scales + lane + kWarp) : 0;
      const int32_t topk0 = with_topk && lane < K ? __ldcg(topk + lane) : 0;
      const float weight0 = with_topk && lane < K ? __ldcg(weights + lane) : 0.0f;
      const int32_t src_idx = lane == 0 ? __ldcg(reinterpret_cast<const int32_t*>(slot_ptr + DispatchSlot::kSrcIdxOff)) : 0;
      fence_generic_to_async();
      warp_bulk_copy<kChunk>(static_cast<uint8_t*>(p.recv_x) + row * p.hidden_bytes, slot_ptr + layout.x_off(),
                     p.hidden_bytes, stages, bars, phases, lane);
      if (with_scales) {
        int32_t* out = static_cast<int32_t*>(p.recv_x_scales) + row * S;
        if (lane < S) out[lane] = scale0;
        if (lane + kWarp < S) out[lane + kWarp] = scale1;
        for (int i = lane + 2 * kWarp; i < S; i += kWarp) out[i] = __ldcg(scales + i);
      }
      if (with_topk) {
        for (int k = lane; k < K; k += kWarp) {
          const int64_t local = to_local_expert(k == lane ? topk0 : __ldcg(topk + k), me, epr);
          store_topk(p.recv_topk_idx, p.topk_idx_is_int32, row * K + k, local);
          if (p.recv_topk_weights != nullptr)
            p.recv_topk_weights[row * K + k] = local >= 0 ? (k == lane ? weight0 : __ldcg(weights + k)) : 0.0f;
        }
      }
      if (lane == 0) p.recv_src_idx[row] = src_idx;
    }
    // Hand the slot back: the sender's consumed word for (channel, us, slot).
    uint64_t* consumed = reinterpret_cast<uint64_t*>(src_nvl + ring.consumed_offset(C, ch, me, slot));
    warp_release_slot(consumed, make_flag(generation, s), lane);
  }
  return -1;
}

// ---------------------------------------------------------------- shrink mode
// Shrink mode: a received row whose source is masked. recv_topk_idx -1 (no local expert, as
// num_worst_tokens' padding rows), zero weights, x and scales zero, recv_src_idx -1.
__device__ __forceinline__ void empty_row(const DeepepDispatchParams& p, int64_t row, int lane) {
  if (uint64_t(row) >= uint64_t(p.num_recv_rows)) return;
  int4* x = reinterpret_cast<int4*>(static_cast<uint8_t*>(p.recv_x) + row * p.hidden_bytes);
  for (int i = lane; i < p.hidden_bytes / 16; i += kWarp) x[i] = make_int4(0, 0, 0, 0);
  if (p.recv_x_scales != nullptr)
    for (int i = lane; i < p.num_scales; i += kWarp) static_cast<int32_t*>(p.recv_x_scales)[row * p.num_scales + i] = 0;
  if (p.recv_topk_idx != nullptr)
    for (int k = lane; k < p.num_topk; k += kWarp) {
      store_topk(p.recv_topk_idx, p.topk_idx_is_int32, row * p.num_topk + k, -1);
      if (p.recv_topk_weights != nullptr) p.recv_topk_weights[row * p.num_topk + k] = 0.0f;
    }
  if (lane == 0) p.recv_src_idx[row] = -1;
}

// A sender warp (send_channel's geometry) that stopped at sequence number `from`. For a
// destination masked at the kernel's start the warp's tiles get send_head -1 and all their
// tokens count; for one that went silent during it the warp's tokens from `from` on count
// (send_head stays unspecified there: combine ignores a masked rank's entries).
__device__ __forceinline__ void drop_sends(const DeepepDispatchParams& p, int ch, const SendRole& role, int lane,
                                           int64_t from) {
  const DeepepNormalCommon& c = p.common;
  const int R = c.num_ranks, C = c.num_channels;
  const int stride = role.stride, dst = role.dst, member = role.member;
  int64_t begin, end, dropped = 0;
  channel_range(p.num_tokens, C, ch, begin, end);
  if ((masked_ranks<true>(c) >> dst) & 1u) {
    for (int64_t tile = begin + int64_t(member) * kWarp; tile < end; tile += int64_t(stride) * kWarp) {
      const int64_t t = tile + lane;
      if (p.send_head != nullptr && t < end) p.send_head[t * R + dst] = -1;
      dropped += __popc(__ballot_sync(0xffffffffu, t < end && p.is_token_in_rank[t * R + dst] != 0));
    }
  } else {
    const int64_t total = p.channel_prefix_matrix[dst * C + ch] - (ch > 0 ? p.channel_prefix_matrix[dst * C + ch - 1] : 0);
    dropped = from < total ? (total - from + stride - 1) / stride : 0;
  }
  if (lane == 0) count_dropped(c, DEEPEP_DROPPED_DISPATCH_SEND, dropped);
}

// A receiver warp (receive_channel's geometry) that stopped at sequence number `from`: its rows
// from there on are left empty and counted.
__device__ __forceinline__ void drop_receives(const DeepepDispatchParams& p, int ch, int warp, int num_warps, int lane,
                                              int64_t from) {
  const DeepepNormalCommon& c = p.common;
  const int R = c.num_ranks, me = c.rank, C = c.num_channels;
  const int stride = num_warps / (R - 1), peer_idx = warp / stride;
  const int src = peer_idx < me ? peer_idx : peer_idx + 1;
  const int64_t start = p.recv_channel_prefix_matrix[src * C + ch];
  const int64_t count = (ch + 1 < C ? p.recv_channel_prefix_matrix[src * C + ch + 1] : p.rank_prefix_matrix[src * R + me]) - start;
  for (int64_t s = from; s < count; s += stride) empty_row(p, start + s, lane);
  if (lane == 0 && from < count) count_dropped(c, DEEPEP_DROPPED_DISPATCH_RECV, (count - from + stride - 1) / stride);
}

template <bool kShrink>
__global__ void __launch_bounds__(kDataThreads, 1) dispatch_kernel(DeepepDispatchParams p) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int C = p.common.num_channels;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (!buffer_failed(p.common.wait)) {
    const int R = p.common.num_ranks, own = own_warps(R), sender_own = sender_own_warps(R);
    uint8_t* stages = smem + size_t(warp) * 2 * kCopyChunk;
    uint64_t* bars = reinterpret_cast<uint64_t*>(smem + size_t(kDataWarps) * 2 * kCopyChunk) + 2 * warp;
    if (lane == 0) {
      mbarrier_init(&bars[0]);
      mbarrier_init(&bars[1]);
    }
    __syncwarp();
    int64_t missed = -1;  // a receive warp stopped by a masked source: its first row not received
    if (int(blockIdx.x) < C) {
      if (warp < sender_own) {
        send_channel<kShrink>(p, blockIdx.x, SendRole{p.common.rank, own + warp, own + sender_own}, lane, stages, bars);
      } else {
        const SendRole role = remote_role(warp - sender_own, R, p.common.rank);
        const int64_t unsent = send_channel<kShrink>(p, blockIdx.x, role, lane, nullptr, nullptr);
        if (kShrink && unsent >= 0) drop_sends(p, blockIdx.x, role, lane, unsent);
      }
    } else if (warp < own) {  // this rank is never masked: nothing to drop
      send_channel<kShrink>(p, blockIdx.x - C, SendRole{p.common.rank, warp, own + sender_own}, lane, stages, bars);
    } else {
      missed = receive_channel<kCopyChunk, kShrink>(p, blockIdx.x - C, warp - own, kDataWarps - own, lane, stages, bars);
    }
    if (lane == 0) bulk_wait_all();  // every row this warp copied by TMA has landed when the kernel ends
    __syncwarp();
    if (kShrink && missed >= 0) drop_receives(p, blockIdx.x - C, warp - own, kDataWarps - own, lane, missed);
  }
  // num_worst_tokens: rows past the received ones carry no expert.
  if (p.recv_topk_idx != nullptr) {
    const int R = p.common.num_ranks;
    const int64_t num_recv =
        min(max(int64_t(p.rank_prefix_matrix[(R - 1) * R + p.common.rank]), int64_t(0)), p.num_recv_rows);
    const int64_t first = num_recv * p.num_topk, last = p.num_recv_rows * p.num_topk;
    for (int64_t i = first + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < last;
         i += int64_t(gridDim.x) * blockDim.x)
      store_topk(p.recv_topk_idx, p.topk_idx_is_int32, i, -1);
  }
  if (buffer_failed(p.common.wait)) {
    const int64_t n = p.num_recv_rows, k = p.num_topk;
    poison_output(p.recv_x, n * p.hidden_bytes);
    poison_output(p.recv_x_scales, n * p.num_scales * 4);
    poison_output(p.recv_topk_idx, n * k * (p.topk_idx_is_int32 ? 4 : 8));
    poison_output(p.recv_topk_weights, n * k * 4);
    poison_output(p.recv_src_idx, n * 4);
  }
  finish_op<kShrink>(p.common);
}

}  // namespace normal
}  // namespace deepep

namespace deepep {
namespace normal {

// The launcher's kernels, by shrink.
constexpr void (*kDispatchKernels[2])(DeepepDispatchParams) = {dispatch_kernel<false>, dispatch_kernel<true>};

}  // namespace normal

cudaError_t preload_normal_dispatch_kernels() { return load_kernels(normal::kDispatchKernels); }

}  // namespace deepep

extern "C" int deepep_launch_normal_dispatch(const DeepepDispatchParams* params, void* stream) {
  return deepep::launch_kernel(deepep::normal::kDispatchKernels[params->common.shrink ? 1 : 0],
                               2 * params->common.num_channels,
                               deepep::normal::kDataThreads, deepep::normal::kDispatchSmemBytes,
                               static_cast<cudaStream_t>(stream), *params);
}
