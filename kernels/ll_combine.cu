// Low-latency combine: deepep::ll::combine<...>.
//
// Send phase. Every packed row (local expert e, row r) of the dispatch handle
// goes back to its source rank j, into slot [global expert][source token] of
// j's combine area (DeepEP's layout: duplicates of a (token, expert) pair land
// on one slot, as in DeepEP). Rows are split into chunks so that every warp of
// the grid has work; the writer that completes home j's last chunk signals j.
// Receive phase. Each warp owns (token, 256 channels) and sums the token's top-k
// slots in fp32 with fma in top-k order (DeepEP's order), then rounds to BF16.
#include "ll_common.cuh"
#include "ll_work_items.cuh"
#include "ll_prof.cuh"
#if DEEPEP_HAVE_LOGFMT
#include "ll_logfmt.cuh"
#endif

namespace deepep {
namespace ll {

// 256-channel groups of a BF16 row (one int4 per lane); the last is half a warp when H % 256 == 128.
__host__ __device__ constexpr int combine_groups(int hidden) { return (hidden + 255) / 256; }

template <int kRemote>
__device__ __forceinline__ void combine_done(const Transport<kRemote>& tr, int home, int add, int expected,
                                             uint64_t signal) {
  int* done = tr.c.done + tr.kind_half(kSignalCombine) * tr.c.num_ranks + home;
  const int old = atomic_add_acq_rel_gpu(done, add);
  if (old + add == expected) {
    *done = 0;
    tr.signal(home, kSignalCombine, signal);
  }
}

// In-place exclusive prefix sum of a[0, n) in shared memory, the total into a[n]; the whole block
// calls. Every warp scans 32 entries of a 512-entry round (one round at DeepEP's shapes: El*R is
// 288 at 288 experts); one warp walking all of them took 270 cycles more (2x H200, T=128).
__device__ __forceinline__ void block_exclusive_scan(int* a, int n) {
  __shared__ int warp_sums[kWarps];
  __shared__ int carry;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  if (threadIdx.x == 0) carry = 0;
  for (int base = 0; base < n; base += kThreads) {
    const int idx = base + threadIdx.x;
    const int v = idx < n ? a[idx] : 0;
    int incl = v;
#pragma unroll
    for (int s = 1; s < kWarp; s <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, incl, s);
      if (lane >= s) incl += y;
    }
    if (lane == kWarp - 1) warp_sums[warp] = incl;
    __syncthreads();  // warp_sums written; carry of the round before
    int before = carry;
    for (int w = 0; w < warp; ++w) before += warp_sums[w];
    if (idx < n) a[idx] = before + incl - v;
    __syncthreads();  // every thread read carry and warp_sums
    if (threadIdx.x == kThreads - 1) carry = before + incl;
  }
  __syncthreads();
  if (threadIdx.x == 0) a[n] = carry;
  __syncthreads();
}

template <int kRemote, bool kLogfmt>
__device__ void combine_send(const DeepepLlCombineParams& p, const Transport<kRemote>& tr, int* smem) {
  const auto& c = p.common;
  const int R = c.num_ranks, El = c.num_local_experts, H = c.hidden, M = c.max_tokens;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t rows_per_expert = int64_t(R) * M;
  const int64_t cslot = combine_data_bytes(H);
  const int64_t view_row = view_row_bytes(H);
  const uint64_t meta_base = c.combine_recv_offset + uint64_t(c.num_experts) * M * cslot;
  const auto send = tr.begin_send(kSignalCombine);  // its loads are used only at the signals and the end
  // smem: prefix [El*R + 1] of block sizes in (expert, source) order; each block's first packed
  // row [El*R]; rows per home [R]; this block's written chunks per home [R].
  int* prefix = smem;
  int* block_begin = prefix + El * R + 1;
  int* home_rows = block_begin + El * R;
  int* home_written = home_rows + R;
  for (int j = threadIdx.x; j < 2 * R; j += kThreads) home_rows[j] = 0;
  __syncthreads();
  // All threads load the El*R ranges at once (one memory round trip), then the block scans the
  // counts in shared memory.
  for (int idx = threadIdx.x; idx < El * R; idx += kThreads) {
    const int j = idx % R;
    const int64_t range = __ldg(p.layout_range + idx);
    int n = peer_active(c, j) ? int(uint32_t(range)) : 0;
    const int64_t first = range >> 32;
    // A handle entry addresses at most M rows of source j inside expert e's R*M rows; anything
    // else (a corrupted or foreign handle) is a fault, and its rows are not sent.
    if (n != 0 && (n < 0 || n > M || first < 0 || first + n > rows_per_expert)) {
      // After a stall the handle may be a failed dispatch's poison (all -1): the stall, not a
      // fault that the host would report first, is the error.
      if (blockIdx.x == 0 && !buffer_failed(c.wait))
        record_fault(c, DEEPEP_FAULT_LL_COMBINE_HANDLE, DEEPEP_HANDLE_LL_LAYOUT_RANGE, idx, range);
      n = 0;
    }
    prefix[idx] = n;
    block_begin[idx] = int(first);
    if (n) atomicAdd(&home_rows[j], n);
  }
  __syncthreads();
  block_exclusive_scan(prefix, El * R);
  const int total_rows = prefix[El * R];
  LL_PROF_STAGE(prof::kPrefixed);
  const int row_vec = H / 8;  // 16-byte groups of a BF16 row
  const int total_warps = gridDim.x * kWarps;
  // Chunks of whole 256-channel groups (one int4 per lane per step); when H % 256 == 128
  // the last group has only its first half-warp.
  const int groups = combine_groups(H);
  const int row_bytes = 2 * H;
  // At most one chunk per warp (rounded down): rounding up left a second round for a few warps
  // (T=16, 4 ranks: 2176 chunks on 2112 warps, 1.3 us more than 2048).
  int chunks = total_rows > 0 ? total_warps / total_rows : 1;
  chunks = max(1, min(chunks, groups));
  // Homes that get no rows still need their signal.
  for (int j = blockIdx.x * kThreads + threadIdx.x; j < R; j += gridDim.x * kThreads)
    if (home_rows[j] == 0 && peer_active(c, j)) tr.signal(j, kSignalCombine, tr.signal_of(send));

  const bool zero_copy = p.zero_copy != 0;
  for (int w = blockIdx.x * kWarps + warp; w < total_rows * chunks; w += total_warps) {
    const int row_idx = w / chunks, chunk = w % chunks;
    int lo = 0, hi = El * R - 1;  // block (e, j): prefix[b] <= row_idx < prefix[b + 1]
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (prefix[mid] <= row_idx) lo = mid; else hi = mid - 1;
    }
    const int e = lo / R, j = lo % R;
    const int row = block_begin[lo] + (row_idx - prefix[lo]);
    const int t = __ldg(p.src_info + int64_t(e) * rows_per_expert + row);
    if (uint32_t(t) >= uint32_t(M)) {  // a token index the receiver's M slots cannot hold: not sent
      if (chunk == 0 && lane == 0 && !buffer_failed(c.wait))  // as for layout_range above
        record_fault(c, DEEPEP_FAULT_LL_COMBINE_HANDLE, DEEPEP_HANDLE_LL_SRC_INFO, int64_t(e) * rows_per_expert + row, t);
      if (lane == 0) atomicAdd(&home_written[j], 1);  // counted all the same: home j still gets its signal
      continue;  // warp-uniform (one t per warp)
    }
    const int global_expert = c.rank * El + e;
    const uint64_t view_offset = c.view_offset + (uint64_t(e) * rows_per_expert + row) * view_row;
    const int4* src = zero_copy ? reinterpret_cast<const int4*>(tr.local(view_offset))
                                : static_cast<const int4*>(p.x) + (int64_t(e) * rows_per_expert + row) * row_vec;
    const uint64_t slot_index = uint64_t(global_expert) * M + t;
    const uint64_t dst_offset = c.combine_recv_offset + slot_index * cslot;
    const bool direct = tr.direct(j);
    // Direct: store into j's slot. Remote: stage into the view row (unless zero-copy) and put.
    const int g_begin = chunk * groups / chunks, g_end = (chunk + 1) * groups / chunks;
    if constexpr (kLogfmt) {
#if DEEPEP_HAVE_LOGFMT
      const int num_blocks = H / 128;
      const uint64_t meta_offset = meta_base + slot_index * combine_meta_bytes(H);
      // Staging (remote): the view row holds the blocks, then the metadata (its H/64 tail).
      const int64_t stage_meta_at = combine_data_bytes(H);
      uint8_t* dst = direct ? tr.lsa(dst_offset, j) : tr.local(view_offset);
      uint8_t* meta = direct ? tr.lsa(meta_offset, j) : tr.local(view_offset + stage_meta_at);
      for (int g = g_begin; g < g_end; ++g) {
        const int block = 2 * g + lane / 16;
        if (block >= num_blocks) continue;  // half-warp uniform
        const int4 v = ld_stream(src + g * kWarp + lane);
        logfmt_encode_block(v, lane % 16, dst + int64_t(block) * kLogfmtSlotBytes, meta + int64_t(block) * kLogfmtMetaBytes);
      }
      __syncwarp();
      if (!direct) {
        // Put this chunk's block areas and metadata.
        const int b0 = 2 * g_begin, b1 = min(2 * g_end, num_blocks);
        tr.put(j, dst_offset + b0 * kLogfmtSlotBytes, view_offset + b0 * kLogfmtSlotBytes,
               int64_t(b1 - b0) * kLogfmtSlotBytes, lane);
        tr.put_bytes(j, meta_offset + int64_t(b0) * kLogfmtMetaBytes,
                     view_offset + stage_meta_at + int64_t(b0) * kLogfmtMetaBytes, int64_t(b1 - b0) * kLogfmtMetaBytes,
                     lane);
      }
#endif
    } else {
      int4* dst = reinterpret_cast<int4*>(direct ? tr.lsa(dst_offset, j) : tr.local(view_offset));
      if (direct || !zero_copy) {
        // Loads of kUnroll groups go out together (the asm stores are compiler barriers, so a
        // load-store loop would wait one memory latency per 512 bytes).
        constexpr int kUnroll = 8;
        for (int g0 = g_begin; g0 < g_end; g0 += kUnroll) {
          int4 v[kUnroll];
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int i = (g0 + u) * kWarp + lane;
            if (g0 + u < g_end && i < row_vec) v[u] = ld_stream(src + i);
          }
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int i = (g0 + u) * kWarp + lane;
            if (g0 + u < g_end && i < row_vec) st_stream(dst + i, v[u]);
          }
        }
        __syncwarp();
      }
      if (!direct) {
        const int64_t chunk_begin = int64_t(g_begin) * kWarp * 16;
        const int64_t chunk_end = min(int64_t(g_end) * kWarp * 16, int64_t(row_bytes));
        tr.put(j, dst_offset + chunk_begin, view_offset + chunk_begin, chunk_end - chunk_begin, lane);
      }
    }
    __syncwarp();
    if (lane == 0) atomicAdd(&home_written[j], 1);
  }
  // One release per (block, home) at the end, not one round trip per chunk: the barrier makes
  // every warp's stores part of what thread j releases.
  __syncthreads();
  LL_PROF_STAGE(prof::kRowsSent);
  for (int j = threadIdx.x; j < R; j += kThreads)
    if (home_written[j] > 0) combine_done(tr, j, home_written[j], home_rows[j] * chunks, tr.signal_of(send));
  tr.end_send(kSignalCombine, send);
  LL_PROF_STAGE(prof::kCombineSendEnd);
}

// An item is kSub consecutive 256-channel groups of one token (LogFMT: kSub = 1; see
// launch_combine).
template <int kRemote, bool kLogfmt, int kSub>
__device__ void combine_recv(const DeepepLlCombineParams& p, const Transport<kRemote>& tr, int* smem) {
  const auto& c = p.common;
  const int El = c.num_local_experts, H = c.hidden, M = c.max_tokens, K = c.num_topk;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t cslot = combine_data_bytes(H);
  const bool i32 = p.topk_idx_is_int32 != 0;
  int* active = smem;  // [R]
  const int groups = H / 256;  // H % 256 == 0 here; H % 256 == 128 uses a half group below
  const int groups_total = combine_groups(H);
  constexpr int kBatch = 8;  // top-k entries whose loads are issued together
  const int item_groups = (groups_total + kSub - 1) / kSub;
  const int items = p.num_tokens * item_groups;
  // Items spread over the blocks (first_item): at T=1..32 block-major items kept 2-56 blocks busy
  // and took 0.3-0.9 us longer.
  const int start_item = int(first_item(blockIdx.x, warp, gridDim.x));
  // The first item's token and group (integer division) and its top-k ids and weights do not
  // depend on the peers: computed and loaded before the wait.
  const int first_t = int(unsigned(start_item) / unsigned(item_groups));
  const int first_g0 = (start_item - first_t * item_groups) * kSub;
  computed_here(first_t, first_g0);
  int first_e[kBatch];
  float first_weight[kBatch];
#pragma unroll
  for (int u = 0; u < kBatch; ++u) {
    first_e[u] = -1;
    first_weight[u] = 0.0f;
  }
  if (!kLogfmt && start_item < items) {
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (u < K) first_e[u] = load_topk(p.topk_idx, i32, int64_t(first_t) * K + u);  // checked after the wait
      if (u < K) first_weight[u] = __ldg(p.topk_weights + int64_t(first_t) * K + u);
    }
  }
  if (__syncthreads_or(tr.wait_sources(kSignalCombine, active, p.combine_wait_recv_cost_stats))) {
    // Failed outside shrink mode (review F9; ll_dispatch.cu poison_dispatch): no token's sum is
    // known to be whole, so all of combined_x is NaN (0xff). finish_receive has nothing to do.
    poison_output(p.out, int64_t(p.num_tokens) * H * 2);
    return;
  }
  LL_PROF_STAGE(prof::kCombineWaited);
  const uint8_t* recv = tr.local(c.combine_recv_offset);
  const uint8_t* recv_meta = recv + int64_t(c.num_experts) * M * cslot;
  // Only shrink mode skips sources (masked ones); outside it a source that never arrived is a
  // reported stall, so the per-entry owner lookup (a division by El) is left out.
  auto skipped = [&](int e) { return c.shrink && !active[e / El]; };
  for (int w = start_item; w < items; w += gridDim.x * kWarps) {
    const bool is_first = w == start_item;
    const int t = is_first ? first_t : int(unsigned(w) / unsigned(item_groups));
    const int g0 = is_first ? first_g0 : (w - t * item_groups) * kSub;
    bool lane_valid[kSub];  // the last group is half when H % 256 == 128
#pragma unroll
    for (int sub = 0; sub < kSub; ++sub) lane_valid[sub] = g0 + sub < groups_total && (g0 + sub < groups || lane < 16);
    float acc[kSub][8];
#pragma unroll
    for (int sub = 0; sub < kSub; ++sub)
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[sub][q] = 0.0f;
    if constexpr (kLogfmt) {
      const int g = g0;
      for (int k = 0; k < K; ++k) {
        const int e = load_expert(p.topk_idx, i32, int64_t(t) * K + k, c.num_experts);
        if (e < 0 || skipped(e)) continue;
        const float weight = __ldg(p.topk_weights + int64_t(t) * K + k);
        float v[8];
#if DEEPEP_HAVE_LOGFMT
        const int64_t slot_index = int64_t(e) * M + t;
        const int block = 2 * g + lane / 16;
        if (lane_valid[0])
          logfmt_decode_block(recv + slot_index * cslot + int64_t(block) * kLogfmtSlotBytes,
                              recv_meta + slot_index * combine_meta_bytes(H) + int64_t(block) * kLogfmtMetaBytes,
                              lane % 16, v);
        else
#endif
#pragma unroll
          for (int q = 0; q < 8; ++q) v[q] = 0.0f;
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[0][q] = fmaf(v[q], weight, acc[0][q]);
      }
    } else {
      // Loads of kBatch top-k entries are issued together (ids, then weights and slots), then
      // summed in top-k order: two memory round trips per batch instead of two per entry.
      for (int k0 = 0; k0 < K; k0 += kBatch) {
        const bool preloaded = is_first && k0 == 0;
        int e[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          e[u] = preloaded    ? valid_expert(first_e[u], c.num_experts)
                 : k0 + u < K ? load_expert(p.topk_idx, i32, int64_t(t) * K + k0 + u, c.num_experts)
                              : -1;
          if (e[u] >= 0 && skipped(e[u])) e[u] = -1;
        }
        int4 raw[kBatch][kSub];
        float weight[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          weight[u] = 0.0f;
          const int4* slot = reinterpret_cast<const int4*>(recv + (int64_t(e[u] < 0 ? 0 : e[u]) * M + t) * cslot);
#pragma unroll
          for (int sub = 0; sub < kSub; ++sub) {
            raw[u][sub] = make_int4(0, 0, 0, 0);
            if (e[u] >= 0 && lane_valid[sub]) raw[u][sub] = ld_cg(slot + (g0 + sub) * kWarp + lane);
          }
          if (e[u] >= 0) weight[u] = preloaded ? first_weight[u] : __ldg(p.topk_weights + int64_t(t) * K + k0 + u);
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          if (e[u] < 0) continue;
#pragma unroll
          for (int sub = 0; sub < kSub; ++sub) {
            const auto* bf = reinterpret_cast<const __nv_bfloat16*>(&raw[u][sub]);
#pragma unroll
            for (int q = 0; q < 8; ++q) acc[sub][q] = fmaf(__bfloat162float(bf[q]), weight[u], acc[sub][q]);
          }
        }
      }
    }
#pragma unroll
    for (int sub = 0; sub < kSub; ++sub) {
      if (!lane_valid[sub]) continue;
      int4 packed;
      auto* out = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
      for (int q = 0; q < 4; ++q) out[q] = __floats2bfloat162_rn(acc[sub][2 * q], acc[sub][2 * q + 1]);
      st_stream(static_cast<int4*>(p.out) + int64_t(t) * (H / 8) + (g0 + sub) * kWarp + lane, packed);
    }
  }
  LL_PROF_STAGE(prof::kReduced);
  tr.finish_receive(kSignalCombine);
}

template <int kRemote, bool kLogfmt, int kSub>
__global__ void __launch_bounds__(kThreads, 1) combine(ncclDevComm dev_comm, DeepepLlCombineParams p) {
  extern __shared__ int smem[];
  Transport<kRemote> tr(p.common, dev_comm);
  LL_PROF_BEGIN();
  if (runs_phase(p.common, DEEPEP_LL_PHASE_SEND)) combine_send<kRemote, kLogfmt>(p, tr, smem);
  if (runs_both_phases(p.common)) __syncthreads();
  if (runs_phase(p.common, DEEPEP_LL_PHASE_RECV)) combine_recv<kRemote, kLogfmt, kSub>(p, tr, smem);
  LL_PROF_END(prof::kCombine, p.common.phases, p.common.rank);
}

// The launcher's BF16 kernels, by [remote kind][receive groups per item: 1, 2]. The receive's
// BF16 items: one 256-channel group each while they fit in one round of the grid's warps
// (T <= 75 at H = 7168 on 132 SMs: 0.3-0.7 us less at T = 1..64), else two, twice the loads in
// flight per warp and half the rounds (one group is 1.6 us slower at T = 128). Separate kernels:
// one kernel holding both bodies was 0.3-0.4 us slower at T >= 128 (cold code fetch).
constexpr void (*kBf16CombineKernels[kRemoteKinds][2])(ncclDevComm, DeepepLlCombineParams) = {
    {combine<kRemoteNone, false, 1>, combine<kRemoteNone, false, 2>},
    {combine<kRemoteEmulated, false, 1>, combine<kRemoteEmulated, false, 2>},
#if DEEPEP_HAVE_GIN
    {combine<kRemoteGin, false, 1>, combine<kRemoteGin, false, 2>},
#endif
};

#if DEEPEP_HAVE_LOGFMT
// The launcher's LogFMT kernels, by remote kind.
constexpr void (*kLogfmtCombineKernels[kRemoteKinds])(ncclDevComm, DeepepLlCombineParams) = {
    combine<kRemoteNone, true, 1>,
    combine<kRemoteEmulated, true, 1>,
#if DEEPEP_HAVE_GIN
    combine<kRemoteGin, true, 1>,
#endif
};
#endif

}  // namespace ll

cudaError_t preload_ll_combine_kernels() {
  const cudaError_t rc = load_kernels(ll::kBf16CombineKernels);
#if DEEPEP_HAVE_LOGFMT
  if (rc == cudaSuccess) return load_kernels(ll::kLogfmtCombineKernels);
#endif
  return rc;
}

}  // namespace deepep

extern "C" int deepep_launch_ll_combine(const void* dev_comm, const DeepepLlCombineParams* params, int remote_kind,
                                        int num_blocks, void* stream) {
  using namespace deepep::ll;
  const ncclDevComm& dc = *static_cast<const ncclDevComm*>(dev_comm);
  const DeepepLlCombineParams& p = *params;
#if !DEEPEP_HAVE_LOGFMT
  if (p.use_logfmt) return int(cudaErrorNotSupported);
#endif
  if (remote_kind < 0 || remote_kind >= kRemoteKinds) return int(cudaErrorInvalidValue);
  void (*kernel)(ncclDevComm, DeepepLlCombineParams) = nullptr;
  if (p.use_logfmt) {
#if DEEPEP_HAVE_LOGFMT
    kernel = kLogfmtCombineKernels[remote_kind];
#endif
  } else {
    const int64_t single_items = int64_t(p.num_tokens) * combine_groups(p.common.hidden);
    kernel = kBf16CombineKernels[remote_kind][single_items <= int64_t(num_blocks) * kWarps ? 0 : 1];
  }
  const auto& c = p.common;
  const size_t smem = sizeof(int) * (2 * size_t(c.num_local_experts) * c.num_ranks + 3 * size_t(c.num_ranks) + 2);
  return deepep::launch_kernel(kernel, num_blocks, kThreads, smem, static_cast<cudaStream_t>(stream), dc, p);
}
