// Normal-mode combine: the reverse of dispatch. 2C blocks, two per channel,
// each with sender and reducer warps; a per-block LSA barrier first makes sure
// every peer has finished its previous op, since rings of different ops share
// the NVL region.
//
// Sender (on the rank that received tokens): for each remote original source,
// the rows of its (source, channel) block go in order into that source's ring
// (c, us).
// Reducer (on the original source): one warp per token, in token order within
// the channel. send_head[t][r] is t's sequence number in ring (c, r) (or -1);
// our own contribution is read straight from x. Sum in fp32 in DeepEP's order:
// bias_0 + bias_1 first, then ranks ascending; one rounding to bf16.
//
// Shrink mode (docs/normal_shrink.md): a masked rank's contributions are left out of the sum (and
// of combined_topk_weights), nothing is sent to it, and the barrier does not wait for it; a rank
// that goes silent during the kernel is treated so from then on and masked at the end.
#include <cuda_bf16.h>

#include "launch.cuh"
#include "normal_common.cuh"

namespace deepep {
namespace normal {


struct CombineSlot {
  int32_t hidden_bytes;
  __device__ __forceinline__ int64_t x_off() const { return kSlotHeaderBytes; }
  __device__ __forceinline__ int64_t weights_off() const { return x_off() + hidden_bytes; }
};

// Channels from which the combine senders (at 2 ranks) prefetch their rows into L2.
constexpr int kCombinePrefetchChannels = 12;

// Sender warps of one block; with the other block of the channel they form one
// group per remote destination. Returns -1, or the first row (sequence number) of the warp it
// did not send (a wait expired, or shrink mode masks the destination), for drop_sends.
template <int kBatch, bool kShrink>
__device__ __forceinline__ int64_t combine_send(const DeepepCombineParams& p, int ch, int part, int parts, int warp,
                                             int num_warps, int lane) {
  const DeepepNormalCommon& c = p.common;
  const int R = c.num_ranks, me = c.rank, C = c.num_channels;
  if (R < 2) return -1;
  const int group_size = num_warps / (R - 1);
  const int peer_idx = warp / group_size;
  if (peer_idx >= R - 1) return -1;
  const int stride = parts * group_size, member = part * group_size + warp % group_size;
  FlagBatch<kBatch> flags;
  const int dst = peer_idx < me ? peer_idx : peer_idx + 1;
  const uint32_t generation = flag_generation(*c.op_epoch);
  const RingLayout ring{p.slot_bytes, c.ring_tokens, R};
  const CombineSlot layout{p.hidden_bytes};
  const int hidden_int4 = p.hidden_bytes / 16;
  const int K = p.num_topk;

  const int64_t start = p.recv_channel_prefix_matrix[dst * C + ch];
  const int64_t stop = ch + 1 < C ? p.recv_channel_prefix_matrix[dst * C + ch + 1] : p.rank_prefix_matrix[dst * R + me];
  if ((masked_ranks<kShrink>(c) >> dst) & 1u) return member;
  // The handle's rows of x: out of range, nothing is read or sent (the peer's reducer then
  // stalls, bounded, naming this rank) and the fault names the entry.
  if (start < 0 || stop < start || stop > p.num_recv_rows) {
    if (lane == 0 && member == part * group_size)
      record_fault(c, DEEPEP_FAULT_COMBINE_HANDLE, DEEPEP_HANDLE_RECV_CHANNEL_PREFIX, dst * C + ch,
                   start < 0 || stop < start ? start : stop);
    return -1;
  }
  uint8_t* dst_nvl = nvl_base(c, dst);
  uint8_t* my_nvl = nvl_base(c, me);
  const auto flag_of = [&](int32_t s, uint64_t*& ptr, uint64_t& value) {
    ptr = reinterpret_cast<uint64_t*>(dst_nvl + ring.slot_offset(ch, me, s % ring.ring));
    value = make_flag(generation, s);
  };
  // With many channels a row's x goes into L2 one row ahead of its loads (4096 tokens, 24 SMs:
  // 2x H200 241 -> 223 us, 4x H200 558 -> 546 us; at 12 SMs it cost 299 -> 317 on 2 ranks, so fewer
  // channels go without). Unmeasured above 4 ranks: those keep the loads as they were.
  const bool prefetch = R <= 4 && C >= kCombinePrefetchChannels;
  const auto prefetch_row = [&](int64_t s) {
    if (prefetch && lane == 0 && s < stop - start)
      bulk_prefetch_l2(static_cast<const uint8_t*>(p.x) + (start + s) * p.hidden_bytes, uint32_t(p.hidden_bytes));
  };
  prefetch_row(member);
  for (int64_t s = member; s < stop - start; s += stride) {
    prefetch_row(s + stride);
    const int64_t slot = s % ring.ring;
    if (s >= ring.ring) {
      const uint64_t* consumed = reinterpret_cast<const uint64_t*>(my_nvl + ring.consumed_offset(C, ch, dst, slot));
      if (ld_relaxed_sys(consumed) != make_flag(generation, s - ring.ring)) {
        flags.flush(lane, flag_of);
        if (!warp_wait_relaxed<kShrink>(consumed, make_flag(generation, s - ring.ring), c, dst, DEEPEP_WAIT_OP_COMBINE_CONSUMED,
                               ch))
          return s;
      }
    }
    const int64_t row = start + s;
    uint8_t* slot_ptr = dst_nvl + ring.slot_offset(ch, me, slot);
    warp_copy<4, CopyLoad::kStream>(
        reinterpret_cast<int4*>(slot_ptr + layout.x_off()),
        reinterpret_cast<const int4*>(static_cast<const uint8_t*>(p.x) + row * p.hidden_bytes), hidden_int4, lane);
    if (p.topk_weights != nullptr) {
      float* weights = reinterpret_cast<float*>(slot_ptr + layout.weights_off());
      for (int k = lane; k < K; k += kWarp) weights[k] = p.topk_weights[row * K + k];
    }
    flags.add(int32_t(s), lane, flag_of);
  }
  flags.flush(lane, flag_of);
  return -1;
}

// Shrink mode: a sender warp (combine_send's geometry) that stopped at row `from`: the rest of
// its rows count as not sent.
__device__ __forceinline__ void drop_sends(const DeepepCombineParams& p, int ch, int part, int parts, int warp,
                                           int num_warps, int lane, int64_t from) {
  const DeepepNormalCommon& c = p.common;
  const int R = c.num_ranks, me = c.rank, C = c.num_channels;
  const int group_size = num_warps / (R - 1), peer_idx = warp / group_size;
  const int stride = parts * group_size, dst = peer_idx < me ? peer_idx : peer_idx + 1;
  const int64_t start = p.recv_channel_prefix_matrix[dst * C + ch];
  const int64_t rows = (ch + 1 < C ? p.recv_channel_prefix_matrix[dst * C + ch + 1] : p.rank_prefix_matrix[dst * R + me]) - start;
  if (lane == 0 && from < rows) count_dropped(c, DEEPEP_DROPPED_COMBINE_SEND, (rows - from + stride - 1) / stride);
}

// Adds one 16-byte group of bf16 values into fp32 accumulators.
__device__ __forceinline__ void accumulate(float (&acc)[8], const int4& v) {
  const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&v);
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] += __bfloat162float(h[e]);
}

// kMaxRanks bounds the sources per token at compile time so that source
// pointers and loads stay in registers; kUnroll hidden groups per lane are in
// flight together (kMaxRanks * kUnroll 16-byte loads per lane).
template <int kMaxRanks, int kUnroll, bool kShrink>
__device__ __forceinline__ void combine_reduce(const DeepepCombineParams& p, int ch, int part, int parts, int warp,
                                               int num_warps, int lane) {
  const DeepepNormalCommon& c = p.common;
  const int R = c.num_ranks, me = c.rank, C = c.num_channels;
  const uint32_t generation = flag_generation(*c.op_epoch);
  const RingLayout ring{p.slot_bytes, c.ring_tokens, R};
  const CombineSlot layout{p.hidden_bytes};
  const int hidden_int4 = p.hidden_bytes / 16;
  const int K = p.num_topk;
  uint8_t* my_nvl = nvl_base(c, me);
  const int64_t self_base = p.recv_channel_prefix_matrix[me * C + ch];
  const int4* bias_0 = static_cast<const int4*>(p.bias_0);
  const int4* bias_1 = static_cast<const int4*>(p.bias_1);
  const uint32_t masked = masked_ranks<kShrink>(c);  // 0 outside shrink mode

  int64_t begin, end;
  channel_range(p.num_tokens, C, ch, begin, end);
  const int stride = parts * num_warps;
  for (int64_t t = begin + part * num_warps + warp; t < end; t += stride) {
    // Lane r holds send_head[t][r] (t's sequence number in ring (c, r), or -1).
    int head = lane < R ? p.send_head[t * R + lane] : -1;
    if (masked != 0) {  // shrink mode: a masked rank's row is not waited for, and counted
      const uint32_t lost = __ballot_sync(0xffffffffu, head >= 0) & masked;
      if (lane == 0) count_dropped(c, DEEPEP_DROPPED_COMBINE_RECV, __popc(lost));
      if ((lost >> lane) & 1u) head = -1;
    }
    const uint32_t mask = __ballot_sync(0xffffffffu, head >= 0);
    const uint8_t* source[kMaxRanks];
    int64_t self_row = 0;
    bool ok = true, bad_self = false;
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r) {
      source[r] = nullptr;
      if ((mask >> r) & 1u) {
        const int64_t seq = __shfl_sync(0xffffffffu, head, r);
        if (r == me) {
          self_row = self_base + seq;
          bad_self = uint64_t(self_row) >= uint64_t(p.num_recv_rows);  // a send_head or prefix entry out of range
          if (!bad_self) source[r] = static_cast<const uint8_t*>(p.x) + self_row * p.hidden_bytes - layout.x_off();
        } else {
          source[r] = my_nvl + ring.slot_offset(ch, r, seq % ring.ring);
          if (!kShrink) {
            ok = ok && warp_wait<kShrink>(reinterpret_cast<const uint64_t*>(source[r]), make_flag(generation, seq), c,
                                          r, DEEPEP_WAIT_OP_COMBINE_SLOT, ch);
          } else if (!warp_wait<kShrink>(reinterpret_cast<const uint64_t*>(source[r]), make_flag(generation, seq), c, r,
                                         DEEPEP_WAIT_OP_COMBINE_SLOT, ch)) {
            source[r] = nullptr;  // this contribution is dropped (its slot is handed back anyway)
            if (lane == 0) count_dropped(c, DEEPEP_DROPPED_COMBINE_RECV, 1);
          }
        }
      }
    }
    if (!ok) return;
    if (bad_self && lane == 0)  // our row is left out of the sum
      record_fault(c, DEEPEP_FAULT_COMBINE_HANDLE, DEEPEP_HANDLE_SEND_HEAD, t * R + me, self_row);

    int4* out = reinterpret_cast<int4*>(static_cast<uint8_t*>(p.combined_x) + t * p.hidden_bytes);
    for (int i0 = lane; i0 < hidden_int4; i0 += kWarp * kUnroll) {
      int4 loaded[kUnroll][kMaxRanks];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = i0 + u * kWarp;
#pragma unroll
        for (int r = 0; r < kMaxRanks; ++r)
          if (source[r] != nullptr && i < hidden_int4)
            loaded[u][r] = ld_ring(reinterpret_cast<const int4*>(source[r] + layout.x_off()) + i);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = i0 + u * kWarp;
        if (i >= hidden_int4) break;
        // DeepEP's order: bias_0 + bias_1 first, then ranks ascending; one rounding.
        float acc[8];
        const int4 b0 = bias_0 != nullptr ? ld_stream(bias_0 + t * hidden_int4 + i) : make_int4(0, 0, 0, 0);
        const int4 b1 = bias_1 != nullptr ? ld_stream(bias_1 + t * hidden_int4 + i) : make_int4(0, 0, 0, 0);
        const __nv_bfloat16* v0 = reinterpret_cast<const __nv_bfloat16*>(&b0);
        const __nv_bfloat16* v1 = reinterpret_cast<const __nv_bfloat16*>(&b1);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = __bfloat162float(v0[e]) + __bfloat162float(v1[e]);
#pragma unroll
        for (int r = 0; r < kMaxRanks; ++r)
          if (source[r] != nullptr) accumulate(acc, loaded[u][r]);
        int4 packed;
        __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(&packed);
#pragma unroll
        for (int e = 0; e < 8; ++e) o[e] = __float2bfloat16_rn(acc[e]);
        out[i] = packed;
      }
    }
    if (p.combined_topk_weights != nullptr) {
      // Same order as x: ranks ascending, our own row read from topk_weights.
      for (int k = lane; k < K; k += kWarp) {
        float w = 0.0f;
#pragma unroll
        for (int r = 0; r < kMaxRanks; ++r) {
          if (source[r] == nullptr) continue;
          const float* row = r == me ? p.topk_weights + self_row * K
                                     : reinterpret_cast<const float*>(source[r] + layout.weights_off());
          w += row[k];
        }
        p.combined_topk_weights[t * K + k] = w;
      }
    }
    // Hand the remote slots back.
    __syncwarp();
    if (lane < R && lane != me && head >= 0) {
      uint64_t* consumed =
          reinterpret_cast<uint64_t*>(nvl_base(c, lane) + ring.consumed_offset(C, ch, me, head % ring.ring));
      st_relaxed_sys(consumed, make_flag(generation, head));  // no release: see warp_release_slot
    }
  }
}

// Send warps per block. Reducing, not sending, bounds a 2-rank combine: on 2x H100 (4096 tokens)
// 8 of 24 took 267 -> 254 us at 24 SMs and 366 -> 320 at 12 (16 and 6 were slower). More ranks
// keep the half that 4x H200 measured.
template <int kMaxRanks>
constexpr int kCombineSendWarps = kMaxRanks == 2 ? 8 : kDataWarps / 2;

// Both blocks of a channel barrier, then send with kCombineSendWarps warps and reduce with the
// rest, each taking every other row/token. (Measured on 4x H200: this beat one sending and one
// reducing block per channel.)
template <int kMaxRanks, int kUnroll, int kBatch, bool kShrink>
__global__ void __launch_bounds__(kDataThreads, 1) combine_kernel(ncclDevComm dev_comm, DeepepCombineParams p) {
  constexpr int kSendWarps = kCombineSendWarps<kMaxRanks>;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int ch = int(blockIdx.x) / 2, part = int(blockIdx.x) % 2;
  if (!buffer_failed(p.common.wait)) {
    // Rings of different ops share the NVL region: every peer must have finished its previous op.
    ncclCoopCta cta;
    BoundedLsaBarrier<ncclCoopCta> barrier(cta, dev_comm, p.common.barrier_base + blockIdx.x);
    barrier.arrive(cta, cuda::memory_order_acq_rel);
    bool passed;
    if constexpr (kShrink) {
      // A silent peer is given up for the whole kernel (peer_gone): blocks past the barrier
      // before it was skip it in their waits at once.
      const uint32_t silent = barrier.wait_survivors(cta, p.common.wait, masked_ranks<true>(p.common));
      if (threadIdx.x < p.common.num_ranks && ((silent >> threadIdx.x) & 1u)) atomicExch(p.common.peer_gone + threadIdx.x, 1);
      __syncthreads();
      passed = true;
    } else {
      passed = barrier.wait_bounded(cta, p.common.wait);
    }
    if (passed) {
      if (warp < kSendWarps) {
        const int64_t unsent = combine_send<kBatch, kShrink>(p, ch, part, 2, warp, kSendWarps, lane);
        if (kShrink && unsent >= 0) drop_sends(p, ch, part, 2, warp, kSendWarps, lane, unsent);
      } else combine_reduce<kMaxRanks, kUnroll, kShrink>(p, ch, part, 2, warp - kSendWarps, kDataWarps - kSendWarps, lane);
    }
  }
  if (buffer_failed(p.common.wait)) {
    poison_output(p.combined_x, p.num_tokens * p.hidden_bytes);
    poison_output(p.combined_topk_weights, p.num_tokens * p.num_topk * 4);
  }
  finish_op<kShrink>(p.common);
}

// The launcher's kernels, by [shrink][batched flag releases][ranks <= 2, <= 4, <= 8].
constexpr void (*kCombineKernels[2][2][3])(ncclDevComm, DeepepCombineParams) = {
    {{combine_kernel<2, 4, 1, false>, combine_kernel<4, 2, 1, false>, combine_kernel<8, 1, 1, false>},
     {combine_kernel<2, 4, 4, false>, combine_kernel<4, 2, 4, false>, combine_kernel<8, 1, 4, false>}},
    {{combine_kernel<2, 4, 1, true>, combine_kernel<4, 2, 1, true>, combine_kernel<8, 1, 1, true>},
     {combine_kernel<2, 4, 4, true>, combine_kernel<4, 2, 4, true>, combine_kernel<8, 1, 4, true>}},
};

}  // namespace normal

cudaError_t preload_normal_combine_kernels() { return load_kernels(normal::kCombineKernels); }

}  // namespace deepep

extern "C" int deepep_launch_normal_combine(const void* dev_comm, const DeepepCombineParams* params, void* stream) {
  const ncclDevComm& dc = *static_cast<const ncclDevComm*>(dev_comm);
  const int blocks = 2 * params->common.num_channels;
  const auto s = static_cast<cudaStream_t>(stream);
  constexpr int kThreads = deepep::normal::kDataThreads;
  const int ranks = params->common.num_ranks;
  // Batched flag releases paid off with few channels (12 SMs: +16%) and cost
  // with many (24 SMs: -8%), measured on 4x H200.
  const bool batch = params->common.num_channels <= 6;
  const int by_ranks = ranks <= 2 ? 0 : ranks <= 4 ? 1 : 2;
  const auto kernel = deepep::normal::kCombineKernels[params->common.shrink ? 1 : 0][batch ? 1 : 0][by_ranks];
  return deepep::launch_kernel(kernel, blocks, kThreads, 0, s, dc, *params);
}
