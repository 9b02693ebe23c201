// Normal-mode combine: the reverse of dispatch. 2C blocks: block c < C sends,
// block C + c reduces channel c.
//
// Sender (on the rank that received tokens): for each remote original source,
// the rows of its (source, channel) block go in order into that source's ring
// (c, us). A per-block LSA barrier first makes sure every peer has finished its
// previous op, since rings of different ops share the NVL region.
// Reducer (on the original source): one warp per token, in token order within
// the channel. send_head[t][r] is t's sequence number in ring (c, r) (or -1);
// our own contribution is read straight from x. Sum in fp32 in DeepEP's order:
// bias_0 + bias_1 first, then ranks ascending; one rounding to bf16.
#include <cuda_bf16.h>

#include "normal_common.cuh"

namespace deepep {
namespace normal {

struct CombineSlot {
  int32_t hidden_bytes;
  __device__ __forceinline__ int64_t x_off() const { return kSlotHeaderBytes; }
  __device__ __forceinline__ int64_t weights_off() const { return x_off() + hidden_bytes; }
};

__device__ __forceinline__ void combine_send(const ncclDevComm& dev_comm, const DeepepCombineParams& p, int ch, int warp, int lane) {
  const DeepepNormalCommon& c = p.common;
  const int R = c.num_ranks, me = c.rank, C = c.num_channels;
  {
    ncclCoopCta cta;
    BoundedLsaBarrier<ncclCoopCta> barrier(cta, dev_comm, c.barrier_base + ch);
    barrier.arrive(cta, cuda::memory_order_acq_rel);
    if (!barrier.wait_bounded(cta, c.wait)) return;
  }
  if (R < 2) return;
  const int group_size = kDataWarps / (R - 1);
  const int peer_idx = warp / group_size, member = warp % group_size;
  if (peer_idx >= R - 1) return;
  const int dst = peer_idx < me ? peer_idx : peer_idx + 1;
  const uint32_t epoch = *c.op_epoch;
  const RingLayout ring{p.slot_bytes, c.ring_tokens, R};
  const CombineSlot layout{p.hidden_bytes};
  const int hidden_int4 = p.hidden_bytes / 16;
  const int K = p.num_topk;

  const int64_t start = p.recv_channel_prefix_matrix[dst * C + ch];
  const int64_t stop = ch + 1 < C ? p.recv_channel_prefix_matrix[dst * C + ch + 1] : p.rank_prefix_matrix[dst * R + me];
  uint8_t* dst_nvl = nvl_base(c, dst);
  uint8_t* my_nvl = nvl_base(c, me);
  for (int64_t s = member; s < stop - start; s += group_size) {
    const int64_t slot = s % ring.ring;
    if (s >= ring.ring) {
      const uint64_t* consumed = reinterpret_cast<const uint64_t*>(my_nvl + ring.consumed_offset(C, ch, dst, slot));
      if (!warp_wait(consumed, make_flag(epoch, s - ring.ring), c.wait, dst, DEEPEP_WAIT_OP_COMBINE_CONSUMED, ch))
        return;
    }
    const int64_t row = start + s;
    uint8_t* slot_ptr = dst_nvl + ring.slot_offset(ch, me, slot);
    warp_put(reinterpret_cast<int4*>(slot_ptr + layout.x_off()),
             reinterpret_cast<const int4*>(static_cast<const uint8_t*>(p.x) + row * p.hidden_bytes), hidden_int4,
             lane);
    if (p.topk_weights != nullptr) {
      float* weights = reinterpret_cast<float*>(slot_ptr + layout.weights_off());
      for (int k = lane; k < K; k += kWarp) weights[k] = p.topk_weights[row * K + k];
    }
    warp_signal(reinterpret_cast<uint64_t*>(slot_ptr), make_flag(epoch, s), lane);
  }
}

__device__ __forceinline__ void combine_reduce(const DeepepCombineParams& p, int ch, int warp, int lane) {
  const DeepepNormalCommon& c = p.common;
  const int R = c.num_ranks, me = c.rank, C = c.num_channels;
  const uint32_t epoch = *c.op_epoch;
  const RingLayout ring{p.slot_bytes, c.ring_tokens, R};
  const CombineSlot layout{p.hidden_bytes};
  const int hidden_int4 = p.hidden_bytes / 16;
  const int K = p.num_topk;
  uint8_t* my_nvl = nvl_base(c, me);
  const int64_t self_base = p.recv_channel_prefix_matrix[me * C + ch];
  const int4* bias_0 = static_cast<const int4*>(p.bias_0);
  const int4* bias_1 = static_cast<const int4*>(p.bias_1);

  int64_t begin, end;
  channel_range(p.num_tokens, C, ch, begin, end);
  for (int64_t t = begin + warp; t < end; t += kDataWarps) {
    // Lane r holds send_head[t][r]; contributors in ascending rank order.
    const int head = lane < R ? p.send_head[t * R + lane] : -1;
    const uint32_t mask = __ballot_sync(0xffffffffu, head >= 0);
    const int4* sources[DEEPEP_MAX_NVL_RANKS];
    const float* source_weights[DEEPEP_MAX_NVL_RANKS];
    int num_sources = 0;
    bool ok = true;
    for (uint32_t m = mask; m; m &= m - 1) {
      const int r = __ffs(m) - 1;
      const int64_t seq = __shfl_sync(0xffffffffu, head, r);
      if (r == me) {
        const int64_t row = self_base + seq;
        sources[num_sources] = reinterpret_cast<const int4*>(static_cast<const uint8_t*>(p.x) + row * p.hidden_bytes);
        source_weights[num_sources] = p.topk_weights != nullptr ? p.topk_weights + row * K : nullptr;
      } else {
        const uint8_t* slot_ptr = my_nvl + ring.slot_offset(ch, r, seq % ring.ring);
        ok = ok && warp_wait(reinterpret_cast<const uint64_t*>(slot_ptr), make_flag(epoch, seq), c.wait, r,
                             DEEPEP_WAIT_OP_COMBINE_SLOT, ch);
        sources[num_sources] = reinterpret_cast<const int4*>(slot_ptr + layout.x_off());
        source_weights[num_sources] = reinterpret_cast<const float*>(slot_ptr + layout.weights_off());
      }
      ++num_sources;
    }
    if (!ok) return;

    int4* out = reinterpret_cast<int4*>(static_cast<uint8_t*>(p.combined_x) + t * p.hidden_bytes);
    for (int i = lane; i < hidden_int4; i += kWarp) {
      int4 loaded[DEEPEP_MAX_NVL_RANKS];
#pragma unroll
      for (int j = 0; j < DEEPEP_MAX_NVL_RANKS; ++j)
        if (j < num_sources) loaded[j] = ld_stream(sources[j] + i);
      float acc[8];
      {
        const int4 b0 = bias_0 != nullptr ? ld_stream(bias_0 + t * hidden_int4 + i) : make_int4(0, 0, 0, 0);
        const int4 b1 = bias_1 != nullptr ? ld_stream(bias_1 + t * hidden_int4 + i) : make_int4(0, 0, 0, 0);
        const __nv_bfloat16* v0 = reinterpret_cast<const __nv_bfloat16*>(&b0);
        const __nv_bfloat16* v1 = reinterpret_cast<const __nv_bfloat16*>(&b1);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = __bfloat162float(v0[e]) + __bfloat162float(v1[e]);
      }
#pragma unroll
      for (int j = 0; j < DEEPEP_MAX_NVL_RANKS; ++j) {
        if (j < num_sources) {
          const __nv_bfloat16* v = reinterpret_cast<const __nv_bfloat16*>(&loaded[j]);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[e] += __bfloat162float(v[e]);
        }
      }
      int4 packed;
      __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(&packed);
#pragma unroll
      for (int e = 0; e < 8; ++e) o[e] = __float2bfloat16_rn(acc[e]);
      out[i] = packed;
    }
    if (p.combined_topk_weights != nullptr) {
      for (int k = lane; k < K; k += kWarp) {
        float w = 0.0f;
        for (int j = 0; j < num_sources; ++j) w += source_weights[j][k];
        p.combined_topk_weights[t * K + k] = w;
      }
    }
    // Hand the remote slots back.
    __syncwarp();
    for (uint32_t m = mask; m; m &= m - 1) {
      const int r = __ffs(m) - 1;
      if (r == me) continue;
      const int64_t seq = __shfl_sync(0xffffffffu, head, r);
      if (lane == 0) {
        uint64_t* consumed = reinterpret_cast<uint64_t*>(nvl_base(c, r) + ring.consumed_offset(C, ch, me, seq % ring.ring));
        st_release_sys(consumed, make_flag(epoch, seq));
      }
    }
  }
}

__global__ void __launch_bounds__(kDataThreads, 1) combine_kernel(ncclDevComm dev_comm, DeepepCombineParams p) {
  const int C = p.common.num_channels;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (!buffer_failed(p.common.wait)) {
    if (int(blockIdx.x) < C) combine_send(dev_comm, p, blockIdx.x, warp, lane);
    else combine_reduce(p, blockIdx.x - C, warp, lane);
  }
  finish_op(p.common);
}

}  // namespace normal
}  // namespace deepep

extern "C" int64_t deepep_combine_slot_bytes(int32_t hidden_bytes, int32_t num_topk) {
  using deepep::normal::align16;
  return deepep::normal::kSlotHeaderBytes + align16(hidden_bytes) + align16(int64_t(num_topk) * 4);
}

extern "C" int deepep_launch_normal_combine(const void* dev_comm, const DeepepCombineParams* params, void* stream) {
  const ncclDevComm& dc = *static_cast<const ncclDevComm*>(dev_comm);
  const int blocks = 2 * params->common.num_channels;
  deepep::normal::combine_kernel<<<blocks, deepep::normal::kDataThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      dc, *params);
  return int(cudaGetLastError());
}
