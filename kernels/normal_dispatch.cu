// Normal-mode dispatch. 2C blocks: block c < C sends channel c's tokens,
// block C + c receives channel c from every peer.
//
// Sender: warps are split into one group per destination rank. A group walks
// the channel's tokens in order (32 at a time, ballot + popc give each token
// its sequence number in the (channel, destination) stream) and its warps take
// every G-th token. Remote tokens go straight into the destination's ring slot
// over NVLink; tokens for this rank skip the ring and land in recv_x directly.
// Receiver: one warp group per remote source copies slots out into the final
// rows (start of the (source, channel) block + sequence), converts top-k ids to
// local ids, and hands the slot back. Per-slot flags, no group barriers: any
// number of warps, any ring size >= 1 is deadlock-free.
#include "normal_common.cuh"

namespace deepep {
namespace normal {

struct DispatchSlot {
  int32_t hidden_bytes, num_scales, num_topk;
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

__device__ __forceinline__ void send_channel(const DeepepDispatchParams& p, int ch, int warp, int lane) {
  const DeepepNormalCommon& c = p.common;
  const int R = c.num_ranks, me = c.rank, C = c.num_channels;
  const int group_size = kDataWarps / R;
  const int dst = warp / group_size, member = warp % group_size;
  if (dst >= R) return;  // leftover warps when R does not divide the warp count
  const uint32_t epoch = *c.op_epoch;
  const RingLayout ring{p.slot_bytes, c.ring_tokens, R};
  const DispatchSlot layout{p.hidden_bytes, p.num_scales, p.num_topk};
  const int hidden_int4 = p.hidden_bytes / 16;
  const int K = p.num_topk;

  int64_t begin, end;
  channel_range(p.num_tokens, C, ch, begin, end);
  uint8_t* dst_nvl = dst == me ? nullptr : nvl_base(c, dst);
  uint8_t* my_nvl = nvl_base(c, me);
  const int64_t self_base = p.recv_channel_prefix_matrix[me * C + ch];

  int64_t seq_base = 0;
  for (int64_t tile = begin, tile_idx = 0; tile < end; tile += kWarp, ++tile_idx) {
    const int64_t t_lane = tile + lane;
    const bool in = t_lane < end && p.is_token_in_rank[t_lane * R + dst] != 0;
    const uint32_t mask = __ballot_sync(0xffffffffu, in);
    const int64_t my_seq = seq_base + __popc(mask & ((1u << lane) - 1u));
    if (p.send_head != nullptr && tile_idx % group_size == member && t_lane < end)
      p.send_head[t_lane * R + dst] = in ? int32_t(my_seq) : -1;

    // Tokens of this tile whose sequence number falls to this warp.
    int first = int((group_size - seq_base % group_size + member) % group_size);
    uint32_t rest = mask;
    for (int skip = 0; skip < first && rest; ++skip) rest &= rest - 1;
    while (rest) {
      const int bit = __ffs(rest) - 1;
      const int64_t t = tile + bit;
      const int64_t s = seq_base + __popc(mask & ((1u << bit) - 1u));
      const int4* src = reinterpret_cast<const int4*>(static_cast<const uint8_t*>(p.x) + t * p.hidden_bytes);
      if (dst == me) {
        const int64_t row = self_base + s;
        if (row < p.num_recv_rows) {
          warp_put(reinterpret_cast<int4*>(static_cast<uint8_t*>(p.recv_x) + row * p.hidden_bytes), src, hidden_int4, lane);
          write_side_outputs(p, t, row, lane);
        }
      } else {
        const int64_t slot = s % ring.ring;
        if (s >= ring.ring) {
          const uint64_t* consumed =
              reinterpret_cast<const uint64_t*>(my_nvl + ring.consumed_offset(C, ch, dst, slot));
          if (!warp_wait(consumed, make_flag(epoch, s - ring.ring), c.wait, dst, DEEPEP_WAIT_OP_DISPATCH_CONSUMED, ch))
            return;
        }
        uint8_t* slot_ptr = dst_nvl + ring.slot_offset(ch, me, slot);
        warp_put(reinterpret_cast<int4*>(slot_ptr + layout.x_off()), src, hidden_int4, lane);
        if (p.num_scales > 0) {
          int32_t* scales = reinterpret_cast<int32_t*>(slot_ptr + layout.scales_off());
          for (int i = lane; i < p.num_scales; i += kWarp)
            scales[i] = static_cast<const int32_t*>(p.x_scales)[t * p.scale_stride_token + i * p.scale_stride_scale];
        }
        if (K > 0 && p.topk_idx != nullptr) {
          int32_t* topk = reinterpret_cast<int32_t*>(slot_ptr + layout.topk_off());
          float* weights = reinterpret_cast<float*>(slot_ptr + layout.weights_off());
          for (int k = lane; k < K; k += kWarp) {
            topk[k] = int32_t(load_topk(p.topk_idx, p.topk_idx_is_int32, t * K + k));
            if (p.topk_weights != nullptr) weights[k] = p.topk_weights[t * K + k];
          }
        }
        if (lane == 0) reinterpret_cast<int32_t*>(slot_ptr + 8)[0] = int32_t(t);
        warp_signal(reinterpret_cast<uint64_t*>(slot_ptr), make_flag(epoch, s), lane);
      }
      // Next token of this warp: skip group_size - 1 set bits.
      rest &= rest - 1;
      for (int skip = 1; skip < group_size && rest; ++skip) rest &= rest - 1;
    }
    seq_base += __popc(mask);
  }
}

__device__ __forceinline__ void receive_channel(const DeepepDispatchParams& p, int ch, int warp, int lane) {
  const DeepepNormalCommon& c = p.common;
  const int R = c.num_ranks, me = c.rank, C = c.num_channels;
  if (R < 2) return;
  const int group_size = kDataWarps / (R - 1);
  const int peer_idx = warp / group_size, member = warp % group_size;
  if (peer_idx >= R - 1) return;
  const int src = peer_idx < me ? peer_idx : peer_idx + 1;
  const uint32_t epoch = *c.op_epoch;
  const RingLayout ring{p.slot_bytes, c.ring_tokens, R};
  const DispatchSlot layout{p.hidden_bytes, p.num_scales, p.num_topk};
  const int hidden_int4 = p.hidden_bytes / 16;
  const int K = p.num_topk;
  const int epr = p.num_experts > 0 ? p.num_experts / R : 0;

  const int64_t start = p.recv_channel_prefix_matrix[src * C + ch];
  const int64_t stop = ch + 1 < C ? p.recv_channel_prefix_matrix[src * C + ch + 1] : p.rank_prefix_matrix[src * R + me];
  const int64_t count = stop - start;
  uint8_t* my_nvl = nvl_base(c, me);
  uint8_t* src_nvl = nvl_base(c, src);

  for (int64_t s = member; s < count; s += group_size) {
    const int64_t slot = s % ring.ring;
    uint8_t* slot_ptr = my_nvl + ring.slot_offset(ch, src, slot);
    if (!warp_wait(reinterpret_cast<const uint64_t*>(slot_ptr), make_flag(epoch, s), c.wait, src,
                   DEEPEP_WAIT_OP_DISPATCH_SLOT, ch))
      return;
    const int64_t row = start + s;
    if (row < p.num_recv_rows) {  // rows past the outputs only happen with too small a num_worst_tokens
      warp_put(reinterpret_cast<int4*>(static_cast<uint8_t*>(p.recv_x) + row * p.hidden_bytes),
               reinterpret_cast<const int4*>(slot_ptr + layout.x_off()), hidden_int4, lane);
      if (p.recv_x_scales != nullptr) {
        const int32_t* scales = reinterpret_cast<const int32_t*>(slot_ptr + layout.scales_off());
        for (int i = lane; i < p.num_scales; i += kWarp)
          static_cast<int32_t*>(p.recv_x_scales)[row * p.num_scales + i] = scales[i];
      }
      if (p.recv_topk_idx != nullptr) {
        const int32_t* topk = reinterpret_cast<const int32_t*>(slot_ptr + layout.topk_off());
        const float* weights = reinterpret_cast<const float*>(slot_ptr + layout.weights_off());
        for (int k = lane; k < K; k += kWarp) {
          const int64_t local = to_local_expert(topk[k], me, epr);
          store_topk(p.recv_topk_idx, p.topk_idx_is_int32, row * K + k, local);
          if (p.recv_topk_weights != nullptr) p.recv_topk_weights[row * K + k] = local >= 0 ? weights[k] : 0.0f;
        }
      }
      if (lane == 0) p.recv_src_idx[row] = reinterpret_cast<const int32_t*>(slot_ptr + 8)[0];
    }
    // Hand the slot back: the sender's consumed word for (channel, us, slot).
    uint64_t* consumed = reinterpret_cast<uint64_t*>(src_nvl + ring.consumed_offset(C, ch, me, slot));
    warp_signal(consumed, make_flag(epoch, s), lane);
  }
}

__global__ void __launch_bounds__(kDataThreads, 1) dispatch_kernel(DeepepDispatchParams p) {
  const int C = p.common.num_channels;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (!buffer_failed(p.common.wait)) {
    if (int(blockIdx.x) < C) send_channel(p, blockIdx.x, warp, lane);
    else receive_channel(p, blockIdx.x - C, warp, lane);
  }
  // num_worst_tokens: rows past the received ones carry no expert.
  if (p.recv_topk_idx != nullptr && int(blockIdx.x) >= C) {
    const int R = p.common.num_ranks;
    const int64_t num_recv = p.rank_prefix_matrix[(R - 1) * R + p.common.rank];
    const int64_t first = num_recv * p.num_topk, last = p.num_recv_rows * p.num_topk;
    for (int64_t i = first + (int64_t(blockIdx.x) - C) * blockDim.x + threadIdx.x; i < last;
         i += int64_t(C) * blockDim.x)
      store_topk(p.recv_topk_idx, p.topk_idx_is_int32, i, -1);
  }
  finish_op(p.common);
}

}  // namespace normal
}  // namespace deepep

extern "C" int64_t deepep_dispatch_slot_bytes(int32_t hidden_bytes, int32_t num_scales, int32_t num_topk) {
  using deepep::normal::align16;
  return deepep::normal::kSlotHeaderBytes + align16(hidden_bytes) + align16(int64_t(num_scales) * 4) +
         2 * align16(int64_t(num_topk) * 4);
}

extern "C" int deepep_launch_normal_dispatch(const DeepepDispatchParams* params, void* stream) {
  const int blocks = 2 * params->common.num_channels;
  deepep::normal::dispatch_kernel<<<blocks, deepep::normal::kDataThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      *params);
  return int(cudaGetLastError());
}
