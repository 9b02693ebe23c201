// Dispatch notify: one block per rank. It turns is_token_in_rank into the
// channel prefix matrix, sends every peer what it needs (tokens sent to each
// rank, the channel prefixes and expert counts for that peer), passes one
// bounded LSA barrier, and derives the receive side: rank prefix matrix,
// receive channel offsets, per-expert counts (host-mapped for the one host
// wait of a non-cached dispatch).
//
// Exchange slots are double-buffered by the notify epoch's parity: a fast rank
// may write notify k+1 before a slow one has read notify k (no barrier between).
//
// Shrink mode: masked ranks get nothing and are not waited for; a peer that misses the barrier,
// or whose slot does not carry this notify's tag (it skipped a notify, masks us and wrote nothing,
// or found us silent at its barrier and took its tag back), is masked at the kernel's end. Either
// way its slot reads as zeros here, so its rows are absent from the receive count, the prefixes
// and the per-expert list (docs/normal_shrink.md).
#include "launch.cuh"
#include "normal_common.cuh"

namespace deepep {
namespace normal {

constexpr int kNotifyThreads = 1024;
// One exchange slot: R totals + C channel prefixes + local expert counts.
constexpr int kNotifySlotInts = DEEPEP_NOTIFY_SLOT_INTS;
constexpr int kNotifySlotBytes = kNotifySlotInts * 4;
constexpr int kNotifyTag = kNotifySlotInts - 1;  // shrink mode: flag_generation(sender's notify epoch)
// Shrink mode: what a sender leaves in the tag of a peer it found silent at its barrier. Never a
// tag (flag_generation has bit 30 set), so the peer, reading the slot when it reaches this notify
// epoch late (it skipped a notify), takes the sender as absent instead of reading stale counts.
constexpr int32_t kNotifyNoTag = 0;

template <bool kShrink>
__global__ void __launch_bounds__(kNotifyThreads) notify_kernel(ncclDevComm dev_comm, DeepepNotifyParams p) {
  const DeepepNormalCommon& c = p.common;
  const int R = c.num_ranks, C = c.num_channels, me = c.rank;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, num_warps = blockDim.x / kWarp;
  const int local_experts = p.cached ? 0 : p.num_experts / R;
  __shared__ int32_t chan_count[DEEPEP_MAX_NVL_RANKS][DEEPEP_MAX_CHANNELS];  // inclusive prefix after step 1
  __shared__ int32_t totals[DEEPEP_MAX_NVL_RANKS];
  __shared__ int32_t rank_prefix[DEEPEP_MAX_NVL_RANKS][DEEPEP_MAX_NVL_RANKS];
  if (buffer_failed(c.wait)) return;  // the host reports the stall that caused this
  const uint32_t masked = masked_ranks<kShrink>(c);
  __shared__ uint32_t absent;               // masked, or silent at the barrier (shrink mode)

  const uint32_t notify_epoch = *c.notify_epoch, parity = notify_epoch & 1u;
  const int32_t tag = int32_t(flag_generation(notify_epoch));
  // 1. Channel prefixes (ours, as a sender).
  if (p.cached) {
    for (int i = threadIdx.x; i < R * C; i += blockDim.x) chan_count[i / C][i % C] = p.channel_prefix_matrix[i];
  } else {
    for (int ch = warp; ch < C; ch += num_warps) {
      int64_t begin, end;
      channel_range(p.num_tokens, C, ch, begin, end);
      int count[DEEPEP_MAX_NVL_RANKS] = {};
      for (int64_t t = begin + lane; t < end; t += kWarp) {
        const uint8_t* row = p.is_token_in_rank + t * R;
#pragma unroll
        for (int r = 0; r < DEEPEP_MAX_NVL_RANKS; ++r)
          if (r < R) count[r] += row[r] != 0;
      }
#pragma unroll
      for (int r = 0; r < DEEPEP_MAX_NVL_RANKS; ++r) {
        int v = count[r];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0 && r < R) chan_count[r][ch] = v;
      }
    }
    check_topk_ids(c, p);
    __syncthreads();
    if (threadIdx.x < R) {
      const int r = threadIdx.x;
      for (int ch = 1; ch < C; ++ch) chan_count[r][ch] += chan_count[r][ch - 1];
      for (int ch = 0; ch < C; ++ch) p.channel_prefix_matrix[r * C + ch] = chan_count[r][ch];
      const int total = C > 0 ? chan_count[r][C - 1] : 0;
      totals[r] = total;
      if (p.num_tokens_per_rank != nullptr && p.num_tokens_per_rank[r] != total)
        record_fault(c, DEEPEP_FAULT_RANK_COUNT, r, p.num_tokens_per_rank[r], total);
    }
  }
  __syncthreads();
  // A cached handle's channel prefixes become peers' row ranges: each row non-decreasing in [0, T].
  if (p.cached && threadIdx.x < R) {
    const int r = threadIdx.x;
    for (int ch = 0, prev = 0; ch < C; prev = chan_count[r][ch++])
      if (chan_count[r][ch] < prev || chan_count[r][ch] > p.num_tokens)
        record_fault(c, DEEPEP_FAULT_DISPATCH_HANDLE, DEEPEP_HANDLE_CHANNEL_PREFIX, r * C + ch,
                     chan_count[r][ch]);
  }

  // 2. Publish into every peer's slot for us: [totals R][our channel prefix for the peer C][its experts].
  for (int peer = 0; peer < R; ++peer) {
    if ((masked >> peer) & 1u) continue;
    int32_t* slot = reinterpret_cast<int32_t*>(static_cast<uint8_t*>(ncclGetLsaPointer(
        static_cast<ncclWindow_t>(c.window),
        c.notify_offset + (uint64_t(parity) * DEEPEP_MAX_NVL_RANKS + me) * kNotifySlotBytes, peer)));
    for (int i = threadIdx.x; i < R + C + local_experts; i += blockDim.x) {
      int32_t v;
      if (i < R) v = p.cached ? 0 : totals[i];
      else if (i < R + C) v = chan_count[peer][i - R];
      else v = p.num_tokens_per_expert[peer * local_experts + (i - R - C)];
      slot[i] = v;
    }
    if constexpr (kShrink)
      if (threadIdx.x == 0) slot[kNotifyTag] = tag;
  }

  // 3. One barrier: afterwards every peer's slot for this parity is complete.
  ncclCoopCta cta;
  BoundedLsaBarrier<ncclCoopCta> barrier(cta, dev_comm, c.barrier_base);
  barrier.arrive(cta, cuda::memory_order_acq_rel);
  if constexpr (kShrink) {
    const uint32_t silent = barrier.wait_survivors(cta, c.wait, masked);
    if (threadIdx.x == 0) {
      absent = masked | silent;
      // Take back the tag this thread wrote in a silent peer's slot in step 2: a peer that skipped
      // this notify reaches this epoch at its next one, where our arrival from this one passes its
      // barrier and our tag would match; it must find us absent (docs/normal_shrink.md). A peer
      // merely late that read the tag before this store takes us as present, and masks us at its
      // first wait on our traffic, if any (we send it nothing from now on): masks are per rank.
      for (int peer = 0; peer < R; ++peer) {
        if (!((silent >> peer) & 1u)) continue;
        int32_t* slot = reinterpret_cast<int32_t*>(static_cast<uint8_t*>(ncclGetLsaPointer(
            static_cast<ncclWindow_t>(c.window),
            c.notify_offset + (uint64_t(parity) * DEEPEP_MAX_NVL_RANKS + me) * kNotifySlotBytes, peer)));
        *reinterpret_cast<volatile int32_t*>(slot + kNotifyTag) = kNotifyNoTag;
      }
      if (silent) __threadfence_system();
    }
    __syncthreads();
  } else if (!barrier.wait_bounded(cta, c.wait)) {
    return;
  }

  const int32_t* slots = reinterpret_cast<const int32_t*>(static_cast<uint8_t*>(
      ncclGetLocalPointer(static_cast<ncclWindow_t>(c.window),
                          c.notify_offset + uint64_t(parity) * DEEPEP_MAX_NVL_RANKS * kNotifySlotBytes)));
  const int stride = kNotifySlotInts;
  if constexpr (kShrink) {
    const int src = threadIdx.x;
    if (src < R && src != me && !((absent >> src) & 1u) && slots[src * stride + kNotifyTag] != tag)
      atomicOr(&absent, 1u << src);
    __syncthreads();
  }
  // An absent source's slot holds nothing of this op: it reads as zeros.
  const auto slot_of = [&](int src, int i) {
    if constexpr (kShrink)
      if ((absent >> src) & 1u) return 0;
    return slots[src * stride + i];
  };
  // 4. Rank prefix matrix: inclusive over source ranks (given in cached mode).
  if (threadIdx.x < R) {
    const int j = threadIdx.x;
    int acc = 0;
    for (int i = 0; i < R; ++i) {
      // Each column is non-decreasing from 0: the handle's (cached) or built from peers' totals.
      const int prev = acc;
      if (p.cached) {
        acc = p.rank_prefix_matrix[i * R + j];
        if (acc < prev) record_fault(c, DEEPEP_FAULT_DISPATCH_HANDLE, DEEPEP_HANDLE_RANK_PREFIX, i * R + j, acc);
      } else {
        const int total = slot_of(i, j);
        if (total < 0) record_fault(c, DEEPEP_FAULT_DISPATCH_HANDLE, DEEPEP_HANDLE_PEER_COUNTS, i * stride + j, total);
        acc += max(total, 0);
        p.rank_prefix_matrix[i * R + j] = acc;
      }
      rank_prefix[i][j] = acc;
    }
  }
  __syncthreads();
  // 5. Where each (source, channel) starts among our received rows.
  for (int i = threadIdx.x; i < R * C; i += blockDim.x) {
    const int src = i / C, ch = i % C;
    const int base = src > 0 ? rank_prefix[src - 1][me] : 0;
    const int before = ch > 0 ? slot_of(src, R + ch - 1) : 0;
    if (slot_of(src, R + ch) < before)  // a peer's prefixes are non-decreasing (the data kernel bounds rows)
      record_fault(c, DEEPEP_FAULT_DISPATCH_HANDLE, DEEPEP_HANDLE_PEER_COUNTS, src * stride + R + ch,
                   slot_of(src, R + ch));
    p.recv_channel_prefix_matrix[i] = base + before;
  }
  const int num_recv = rank_prefix[R - 1][me];
  if (p.num_worst_tokens > 0 && num_recv > p.num_worst_tokens && threadIdx.x == 0)
    record_fault(c, DEEPEP_FAULT_WORST_TOO_SMALL, p.num_worst_tokens, num_recv, 0);
  // 6. Host-visible counts: the list first, num_recv_tokens last (the host spins on it).
  if (p.counts != nullptr) {
    for (int e = threadIdx.x; e < local_experts; e += blockDim.x) {
      int sum = 0;
      for (int src = 0; src < R; ++src) sum += slot_of(src, R + C + e);
      const int a = p.expert_alignment;
      p.counts->num_recv_tokens_per_expert[e] = (sum + a - 1) / a * a;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence_system();
      *reinterpret_cast<volatile int32_t*>(&p.counts->num_recv_tokens) = num_recv;
      __threadfence_system();
    }
  }
  if (threadIdx.x == 0) *c.notify_epoch += 1;
  // Shrink mode: silent peers are masked from the next kernel on (after every read of the mask).
  if (kShrink && threadIdx.x < R && ((absent & ~masked) >> threadIdx.x) & 1u) c.mask[threadIdx.x] = 1;
}

}  // namespace normal
}  // namespace deepep

namespace deepep {
namespace normal {

// The launcher's kernels, by shrink.
constexpr void (*kNotifyKernels[2])(ncclDevComm, DeepepNotifyParams) = {notify_kernel<false>, notify_kernel<true>};

}  // namespace normal

cudaError_t preload_normal_notify_kernels() { return load_kernels(normal::kNotifyKernels); }

}  // namespace deepep

extern "C" int deepep_launch_normal_notify(const void* dev_comm, const DeepepNotifyParams* params, void* stream) {
  const ncclDevComm& dc = *static_cast<const ncclDevComm*>(dev_comm);
  const auto kernel = deepep::normal::kNotifyKernels[params->common.shrink ? 1 : 0];
  return deepep::launch_kernel(kernel, 1, deepep::normal::kNotifyThreads, 0, static_cast<cudaStream_t>(stream), dc,
                               *params);
}
