// Low-latency dispatch: deepep::ll::dispatch<...>.
//
// Send phase. Each token goes once to every rank that owns one of its experts
// (not once per expert): the slot carries the token's top-k list with the row
// each (token, expert) pair takes at the receiver, and the receiver fans the
// payload out into its experts' packed rows. Row positions are deterministic:
// within expert e, source ranks ascending; within a source, (token, k) ascending.
//   * token t goes to slot t of every destination (slots are sparse: the count
//     message's bitmap says which are filled), so a token needs no count of the
//     tokens before it per destination;
//   * block b owns tokens t = b, b+G, ...: it quantises t once and stores it into
//     every destination slot (its destinations need only t's own top-k), then counts,
//     per expert, the entries of the tokens before t (a shared-memory histogram; t's
//     row inside the source block) while the payload crosses NVLink, and writes the
//     slot header last;
//   * block b also owns destinations d = G-1-b, ...: it sends d the count message
//     (per-expert counts and the bitmap of filled slots);
//   * every writer releases its stores and adds to done[d]; the count block adds
//     kDoneTag - n_d, so whoever brings done[d] to kDoneTag signals d.
// Receive phase. Every block waits for all sources' signals, builds the begin
// table from the count messages, then warps copy slots into the packed outputs.
//
// Code size is latency here: after a GEMM every instruction line is a cold fetch, so
// per-destination work runs in short loops over pointers kept in shared memory rather
// than loops unrolled over the largest top-k.
#include "ll_common.cuh"
#include "ll_work_items.cuh"
#include "ll_prof.cuh"

namespace deepep {
namespace ll {

constexpr int kDoneTag = 1 << 30;
struct TokenRoute {
  int expert[DEEPEP_LL_MAX_TOPK];
  int pos[DEEPEP_LL_MAX_TOPK];       // row inside (expert, this source) block
  int dst[DEEPEP_LL_MAX_TOPK];       // distinct destination ranks, first-seen order
  uint8_t* ptr[DEEPEP_LL_MAX_TOPK];  // slot t at dst[i] (LSA), or NULL (remote or masked)
  int num_dst;
  int staged;  // some destination goes through the staging slot (remote path)
};

// Max over the 8 lanes of an aligned lane group (one 128-channel block).
__device__ __forceinline__ float lanes8_max(float v) {
#pragma unroll
  for (int m = 4; m >= 1; m >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}

// DeepEP's per-128-channel scale: amax >= 1e-4; optionally a power of two.
__device__ __forceinline__ void fp8_scales(float amax, bool round_scale, float& scale, float& scale_inv) {
  if (round_scale) {
    const uint32_t bits = __float_as_uint(amax * (1.0f / 448.0f));
    const int exp = int((bits >> 23) & 0xff) - 127 + ((bits & 0x7fffffu) != 0);
    scale = __uint_as_float(uint32_t(127 - exp) << 23);
    scale_inv = __uint_as_float(uint32_t(exp + 127) << 23);
  } else {
    scale_inv = amax * (1.0f / 448.0f);
    scale = 448.0f / amax;
  }
}

__device__ __forceinline__ int topk_entry(const DeepepLlDispatchParams& p, int64_t i) {
  return load_expert(p.topk_idx, p.topk_idx_is_int32 != 0, i, p.common.num_experts);
}

// Calls f(i, e) for every valid entry e = topk_idx[i], i < n (flat index), the block's threads
// taking consecutive entries (coalesced); kEntryBatch loads per thread go out together.
constexpr int kEntryBatch = 4;
template <typename F>
__device__ __forceinline__ void for_topk_entries(const DeepepLlDispatchParams& p, int n, F&& f) {
#pragma unroll 1
  for (int base = threadIdx.x; base < n; base += kEntryBatch * kThreads) {
    int e[kEntryBatch];
#pragma unroll
    for (int u = 0; u < kEntryBatch; ++u) e[u] = base + u * kThreads < n ? topk_entry(p, base + u * kThreads) : -1;
#pragma unroll
    for (int u = 0; u < kEntryBatch; ++u)
      if (e[u] >= 0) f(base + u * kThreads, e[u]);
  }
}

// Destinations of token t (block-wide; the result lands in `route`, positions without the
// tokens before t: add_positions adds them). Warp 0 alone: one load of t's top-k row.
template <int kRemote>
__device__ void route_destinations(const DeepepLlDispatchParams& p, const Transport<kRemote>& tr, int t,
                                   TokenRoute& route) {
  const auto& c = p.common;
  const int K = c.num_topk, El = c.num_local_experts, M = c.max_tokens;
  if (threadIdx.x < kWarp) {
    // Lane k holds entry k; duplicates and first-seen destinations by shuffles.
    const int lane = threadIdx.x;
    const int e = lane < K ? topk_entry(p, int64_t(t) * K + lane) : -1;
    const int d = e >= 0 ? int(unsigned(e) / unsigned(El)) : -1;
    int dup = 0;
    bool first_dst = d >= 0;
    for (int k2 = 0; k2 < K; ++k2) {
      const int e2 = __shfl_sync(0xffffffffu, e, k2), d2 = __shfl_sync(0xffffffffu, d, k2);
      if (k2 < lane) {
        dup += e2 == e;
        first_dst &= d2 != d;
      }
    }
    const uint32_t firsts = __ballot_sync(0xffffffffu, first_dst);
    const int num_dst = __popc(firsts);
    if (lane < K) {
      route.expert[lane] = e;
      route.pos[lane] = dup;  // duplicates inside the token come first in (token, k) order
    }
    if (first_dst) route.dst[__popc(firsts & ((1u << lane) - 1))] = d;
    __syncwarp();
    bool staged = false;
    if (lane < num_dst) {
      const int dst = route.dst[lane];
      uint8_t* ptr = nullptr;
      if (peer_active(c, dst)) {
        if (tr.direct(dst)) ptr = tr.lsa(c.dispatch_recv_offset + (uint64_t(c.rank) * M + t) * p.dispatch_slot_bytes, dst);
        else staged = true;
      }
      route.ptr[lane] = ptr;
    }
    staged = __any_sync(0xffffffffu, staged);
    if (lane == 0) {
      route.num_dst = num_dst;
      route.staged = staged;
    }
  }
  __syncthreads();
}

// Adds to each of t's positions the entries of the tokens before t naming its expert (block-wide).
// `expert_hist` [E] is zero on entry and holds that histogram on return (the caller zeroes it
// after every thread is past this call).
__device__ void add_positions(const DeepepLlDispatchParams& p, int t, TokenRoute& route, int* expert_hist) {
  const int K = p.common.num_topk;
  for_topk_entries(p, t * K, [&](int, int e) { atomicAdd(expert_hist + e, 1); });
  __syncthreads();
  if (threadIdx.x < K && route.expert[threadIdx.x] >= 0) route.pos[threadIdx.x] += expert_hist[route.expert[threadIdx.x]];
  __syncthreads();
}

template <int kRemote>
__device__ __forceinline__ void count_done(const Transport<kRemote>& tr, int d, int add, uint64_t signal) {
  int* done = tr.c.done + tr.kind_half(kSignalDispatch) * tr.c.num_ranks + d;
  const int old = atomic_add_acq_rel_gpu(done, add);
  if (old + add == kDoneTag) {
    *done = 0;
    tr.signal(d, kSignalDispatch, signal);
  }
}

// Shared memory of the send phase (ints): count hist [El + 1], bitmap [W], tokens sent to each
// owned destination [ceil(R / G)], expert histogram [E].
__host__ __device__ inline size_t dispatch_send_smem_ints(int num_ranks, int num_experts, int max_tokens, int grid) {
  return size_t(num_experts / num_ranks + 1) + size_t(count_bitmap_words(max_tokens)) +
         size_t((num_ranks + grid - 1) / grid) + size_t(num_experts);
}

template <int kRemote, bool kFp8>
__device__ void dispatch_send(const DeepepLlDispatchParams& p, const Transport<kRemote>& tr, int* smem) {
  const auto& c = p.common;
  const int T = p.num_tokens, K = c.num_topk, El = c.num_local_experts, H = c.hidden, M = c.max_tokens;
  const int E = c.num_experts, W = count_bitmap_words(M);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t slot_bytes = p.dispatch_slot_bytes;
  const int64_t header = dispatch_header_bytes(K);
  const int64_t count_bytes = p.count_bytes;
  const auto send = tr.begin_send(kSignalDispatch);  // its loads are used only at the signals and the end

  int* hist = smem;                           // [El + 1]: tokens, then per-expert counts
  int* bitmap = hist + El + 1;                // [W]
  int* owned_tokens = bitmap + W;             // [owned destinations]: tokens sent to each
  int* expert_hist = owned_tokens + (c.num_ranks + gridDim.x - 1) / gridDim.x;  // [E]
#pragma unroll 1
  for (int x = threadIdx.x; x < E; x += kThreads) expert_hist[x] = 0;

  // Count messages for the destinations this block owns. Their done adds wait until the end
  // of the send phase, so that one fence covers them and this block's tokens.
  // Destination d's count belongs to block G - 1 - d (mod G): the last blocks, which carry no
  // token when T + R <= G, so counting runs beside the token sends.
  const int count_block = gridDim.x - 1 - blockIdx.x;
  for (int d = count_block, i = 0; d < c.num_ranks; d += gridDim.x, ++i) {
    if (!peer_active(c, d)) continue;
#pragma unroll 1
    for (int x = threadIdx.x; x <= El + W; x += kThreads) hist[x] = 0;  // hist and bitmap
    __syncthreads();
    for_topk_entries(p, T * K, [&](int i, int e) {
      const int local = e - d * El;
      if (unsigned(local) < unsigned(El)) {
        const unsigned t = unsigned(i) / unsigned(K);
        atomicAdd(&hist[1 + local], 1);
        atomicOr(reinterpret_cast<unsigned*>(bitmap) + t / kWarp, 1u << (t % kWarp));
      }
    });
    __syncthreads();
    if (threadIdx.x < kWarp) {  // tokens sent to d: the bitmap's population
      int n = 0;
      for (int x = threadIdx.x; x < W; x += kWarp) n += __popc(unsigned(bitmap[x]));
      n = __reduce_add_sync(0xffffffffu, n);
      if (threadIdx.x == 0) hist[0] = n;
    }
    __syncthreads();
    const bool direct = tr.direct(d);
    const uint64_t dst_offset = c.count_offset + uint64_t(c.rank) * count_bytes;
    const uint64_t stage_offset = c.staging_offset + uint64_t(M) * slot_bytes + uint64_t(d) * count_bytes;
    int* msg = reinterpret_cast<int*>(direct ? tr.lsa(dst_offset, d) : tr.local(stage_offset));
#pragma unroll 1
    for (int x = threadIdx.x; x < El + W; x += kThreads) msg[x] = x < El ? hist[1 + x] : bitmap[x - El];
    if (threadIdx.x == 0) owned_tokens[i] = hist[0];
    __syncthreads();
    if (!direct && warp == 0) tr.put(d, dst_offset, stage_offset, count_bytes, lane);
    __syncthreads();
  }
  __syncthreads();  // expert_hist cleared
  LL_PROF_STAGE(prof::kCounted);

  __shared__ TokenRoute route;
  const int hidden_vec = H / 8;  // 16-byte groups of 8 bf16
  const int lane_groups = H / 16;  // FP8: 16 channels per lane, one 16-byte store per destination
  constexpr int kLoads = 2;        // BF16: a row's loads of kLoads steps go out together
  // first[] below holds the first step of either path: FP8's two loads per lane, BF16's kLoads.
  static_assert(kLoads == 2, "first[] and the BF16 loop's first step assume two loads");
  for (int t = blockIdx.x; t < T; t += gridDim.x) {
    const int4* x_row = static_cast<const int4*>(p.x) + int64_t(t) * hidden_vec;
    // The payload's first step of loads goes out beside the routing's: both are one round trip.
    int4 first[2] = {make_int4(0, 0, 0, 0), make_int4(0, 0, 0, 0)};
    if constexpr (kFp8) {
      if (int(threadIdx.x) < lane_groups) {
        first[0] = ld_stream(x_row + 2 * threadIdx.x);
        first[1] = ld_stream(x_row + 2 * threadIdx.x + 1);
      }
    } else {
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int i = int(threadIdx.x) + u * kThreads;
        if (i < hidden_vec) first[u] = ld_stream(x_row + i);
      }
    }
    route_destinations(p, tr, t, route);
    LL_PROF_STAGE(prof::kRouted);
    const int nd = route.num_dst;
    const bool staged = kRemote != kRemoteNone && route.staged != 0;
    const uint64_t stage_offset = c.staging_offset + uint64_t(t) * slot_bytes;
    uint8_t* stage = kRemote == kRemoteNone ? nullptr : tr.local(stage_offset);
    if constexpr (kFp8) {
      // Payload: each lane converts 16 channels (two 16-byte loads) into one 16-byte store per
      // destination; 8 lanes make a 128-channel block. H <= 8192: one step per warp.
#pragma unroll 1
      for (int g0 = warp * kWarp; g0 < lane_groups; g0 += kThreads) {
        const int g = g0 + lane;
        const bool valid = g < lane_groups;  // 8-lane groups are entirely valid or not (H % 128 == 0)
        int4 v[2] = {first[0], first[1]};
        if (g0 != warp * kWarp && valid) {
          v[0] = ld_stream(x_row + 2 * g);
          v[1] = ld_stream(x_row + 2 * g + 1);
        }
        const auto* bf = reinterpret_cast<const __nv_bfloat16*>(v);
        float f[16];
        float amax = 1e-4f;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          f[j] = __bfloat162float(bf[j]);
          amax = fmaxf(amax, fabsf(f[j]));
        }
        amax = lanes8_max(amax);
        float scale, scale_inv;
        fp8_scales(amax, p.round_scale != 0, scale, scale_inv);
        int4 packed;
        auto* q = reinterpret_cast<__nv_fp8x2_storage_t*>(&packed);
#pragma unroll
        for (int j = 0; j < 16; j += 2)
          q[j / 2] = __nv_cvt_float2_to_fp8x2(make_float2(f[j] * scale, f[j + 1] * scale), __NV_SATFINITE, __NV_E4M3);
        if (valid) {
          const bool writes_scale = (lane % 8) == 0;
          const int64_t data_at = header + 16 * int64_t(g), scale_at = header + H + 4 * int64_t(g / 8);
#pragma unroll 1
          for (int d = 0; d < nd; ++d) {
            uint8_t* slot = route.ptr[d];
            if (slot == nullptr) continue;
            *reinterpret_cast<int4*>(slot + data_at) = packed;
            if (writes_scale) *reinterpret_cast<float*>(slot + scale_at) = scale_inv;
          }
          if (staged) {
            *reinterpret_cast<int4*>(stage + data_at) = packed;
            if (writes_scale) *reinterpret_cast<float*>(stage + scale_at) = scale_inv;
          }
        }
      }
    } else {
      // Payload: BF16 as is, 16 bytes per lane.
      for (int base0 = warp * kWarp; base0 < hidden_vec; base0 += kLoads * kThreads) {
        int4 loaded[kLoads] = {first[0], first[1]};
        if (base0 != warp * kWarp) {
#pragma unroll
          for (int u = 0; u < kLoads; ++u) {
            const int i = base0 + u * kThreads + lane;
            loaded[u] = i < hidden_vec ? ld_stream(x_row + i) : make_int4(0, 0, 0, 0);
          }
        }
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
          const int i = base0 + u * kThreads + lane;
          if (i >= hidden_vec) continue;
#pragma unroll 1
          for (int d = 0; d < nd; ++d)
            if (route.ptr[d] != nullptr) st_stream(reinterpret_cast<int4*>(route.ptr[d] + header) + i, loaded[u]);
          if (staged) st_stream(reinterpret_cast<int4*>(stage + header) + i, loaded[u]);
        }
      }
    }
    // The rows' positions (the tokens before t) while the payload crosses NVLink, then the
    // header: source token, then (position << 16 | expert) per top-k entry.
    add_positions(p, t, route, expert_hist);
    if (threadIdx.x <= K) {
      const int k = threadIdx.x - 1;
      const uint32_t word = threadIdx.x == 0 ? uint32_t(t)
                                             : (route.expert[k] < 0 ? 0xffffu
                                                                    : (uint32_t(route.pos[k]) << 16) |
                                                                          uint32_t(route.expert[k] & 0xffff));
#pragma unroll 1
      for (int i = 0; i < nd; ++i)
        if (route.ptr[i] != nullptr) reinterpret_cast<uint32_t*>(route.ptr[i])[threadIdx.x] = word;
      if (staged) reinterpret_cast<uint32_t*>(stage)[threadIdx.x] = word;
    }
    LL_PROF_STAGE(prof::kStored);
    __syncthreads();
#pragma unroll 1
    for (int x = threadIdx.x; x < E; x += kThreads) expert_hist[x] = 0;  // for the next token (read above)
    if (staged) {
      // Remote destinations: put the staged slot, one warp per destination.
      for (int i = warp; i < nd; i += kWarps) {
        const int d = route.dst[i];
        if (tr.direct(d) || !peer_active(c, d)) continue;
        tr.put(d, c.dispatch_recv_offset + (uint64_t(c.rank) * M + t) * slot_bytes, stage_offset, slot_bytes, lane);
      }
      __syncthreads();
    }
    // One thread per destination: release this token's stores, then count it done.
    if (threadIdx.x < nd && peer_active(c, route.dst[threadIdx.x])) {
      count_done(tr, route.dst[threadIdx.x], 1, tr.signal_of(send));
    }
    __syncthreads();
    LL_PROF_STAGE(prof::kTokenDone);
  }
  // The count messages' done adds (kDoneTag - tokens): whoever completes done[d] signals d.
  for (int d = count_block + threadIdx.x * gridDim.x, i = threadIdx.x; d < c.num_ranks;
       d += kThreads * gridDim.x, i += kThreads) {
    if (!peer_active(c, d)) continue;
    count_done(tr, d, kDoneTag - owned_tokens[i], tr.signal_of(send));
  }
  LL_PROF_STAGE(prof::kSent);
  tr.end_send(kSignalDispatch, send);
  LL_PROF_STAGE(prof::kSendEnd);
}

static_assert(kItemGroupWords == kWarp, "an item group is one 16-byte word per lane");

constexpr int kFusedSources = 8;  // sources whose count messages one thread reads at once

// Block 0 of the receive publishes layout_range[e][j] = (begin << 32) | count, and
// packed_recv_count[e] (also added to the cumulative stats).
__device__ __forceinline__ void publish_range(const DeepepLlDispatchParams& p, int e, int j, int begin, int n) {
  p.packed_recv_layout_range[int64_t(e) * p.common.num_ranks + j] = (int64_t(begin) << 32) | int64_t(uint32_t(n));
}
__device__ __forceinline__ void publish_count(const DeepepLlDispatchParams& p, int e, int total) {
  p.packed_recv_count[e] = total;
  if (p.cumulative_local_expert_recv_stats != nullptr) atomicAdd(p.cumulative_local_expert_recv_stats + e, total);
}

// A receive that failed outside shrink mode (Transport::wait_sources; review F9) leaves every
// output 0xff (poison_output: NaN rows and scales, -1 ints): CUDA-graph replays never reach the
// host's stall check, so the outputs must not look like a result. Every row, not only a missing
// source's: its counts are unknown and the later sources' rows start after them (begin). The
// counts read -1 (so does the handle): never a row count, the -1 ints of normal mode's poison;
// DeepEP's consumers read packed_recv_count as signed int32 (grouped GEMMs' masked_m: no rows).
// Blocks agree, except in the op whose wait expires if a signal lands just then: a block that saw
// it writes its rows beside the poison (the stall is still reported); later receives all fail.
template <bool kFp8>
__device__ __forceinline__ void poison_dispatch(const DeepepLlDispatchParams& p) {
  const auto& c = p.common;
  const int64_t el = c.num_local_experts, rows = el * c.num_ranks * c.max_tokens, h = c.hidden;
  poison_output(p.packed_recv_x, rows * (kFp8 ? h : 2 * h));
  if (kFp8) poison_output(p.packed_recv_x_scales, rows * (p.use_ue8m0 != 0 ? h / 512 : h / 128) * 4);
  poison_output(p.packed_recv_count, el * 4);
  poison_output(p.packed_recv_src_info, rows * 4);
  poison_output(p.packed_recv_layout_range, el * c.num_ranks * 8);
}

template <int kRemote, bool kFp8>
__device__ void dispatch_recv(const DeepepLlDispatchParams& p, const Transport<kRemote>& tr, int* smem) {
  const auto& c = p.common;
  const int R = c.num_ranks, El = c.num_local_experts, H = c.hidden, M = c.max_tokens, K = c.num_topk;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t slot_bytes = p.dispatch_slot_bytes;
  const int64_t header = dispatch_header_bytes(K);
  const int64_t rows_per_expert = int64_t(R) * M;
  // smem: begin [R][El] (counts, then exclusive prefixes over sources), filled-slot bitmaps
  // [R][W], active [R + 1].
  const int W = count_bitmap_words(M);
  int* begin = smem;
  int* filled = begin + R * El;
  int* active = filled + R * W;
  // Work items: every potential slot (source j, slot i < M) split into chunks of whole 32-word
  // groups (chunk-major, then slot-major, spread over the blocks: item_place, first_item). Only
  // the first item may be loaded before the bitmaps are known (see first_loaded): loading every
  // potential slot's payload then was up to 0.4 us slower when T < M (most potential slots
  // empty; their reads delay the useful ones).
  const int payload_vec = kFp8 ? H / 16 : H / 8;  // 16-byte words of payload data (without scales)
  const int num_scales = H / 128;
  const int total_warps = gridDim.x * kWarps;
  const int payload_groups = (payload_vec + kWarp - 1) / kWarp;
  const unsigned potential = unsigned(R) * unsigned(M);
  const unsigned chunks = receive_chunks(total_warps, potential, payload_groups);
  const unsigned num_items = potential * chunks;
  auto place_of = [&](unsigned q) { return item_place(q, chunks, potential, R, payload_groups, payload_vec); };
  // The first item's place is integer divisions (long dependent chains) of parameters: computed
  // before the wait, beside the signal's round trip.
  unsigned w = first_item(blockIdx.x, warp, gridDim.x);
  const ItemPlace first = place_of(w);
  computed_here(first.j, first.i, first.v_begin, first.v_end);
  auto slot_of = [&](const ItemPlace& it) {
    return tr.local(c.dispatch_recv_offset + (uint64_t(it.j) * M + it.i) * slot_bytes);
  };
  if (__syncthreads_or(tr.wait_sources(kSignalDispatch, active, p.dispatch_wait_recv_cost_stats))) {
    poison_dispatch<kFp8>(p);  // outside shrink mode only: finish_receive has nothing to do
    return;
  }
  LL_PROF_STAGE(prof::kWaited);

  constexpr int kUnroll = kItemMaxGroups;  // a chunk is one batch of loads
  int4 v[kUnroll];
  uint32_t head_token = 0, head_entry = 0xffffu, scale_word = 0;
  const bool ue8m0 = p.use_ue8m0 != 0;
  const int scale_groups = ue8m0 ? num_scales / 4 : num_scales;
  // One scale word of this lane (g < scale_groups): fp32 bits, or 4 UE8M0 exponents packed.
  auto scale_at = [&](const uint8_t* slot, int g) -> uint32_t {
    const float* scales = reinterpret_cast<const float*>(slot + header + H);
    if (!ue8m0) return __float_as_uint(__ldcg(scales + g));
    const float4 s4 = __ldcg(reinterpret_cast<const float4*>(scales) + g);
    return (__float_as_uint(s4.x) >> 23) | ((__float_as_uint(s4.y) >> 23) << 8) |
           ((__float_as_uint(s4.z) >> 23) << 16) | ((__float_as_uint(s4.w) >> 23) << 24);
  };
  auto load_item = [&](const ItemPlace& it) {
    const uint8_t* slot = slot_of(it);
    const int4* src = reinterpret_cast<const int4*>(slot + header);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (it.v_begin + lane + u * kWarp < it.v_end) v[u] = ld_cg(src + it.v_begin + lane + u * kWarp);
    const uint32_t* words = reinterpret_cast<const uint32_t*>(slot);
    head_token = __ldcg(words);
    head_entry = lane < K ? __ldcg(words + 1 + lane) : 0xffffu;
    const int g = int(it.chunk) * kWarp + lane;
    if (kFp8 && g < scale_groups) scale_word = scale_at(slot, g);
  };
  // Warp-uniform; an inactive source's bitmap is zero.
  auto is_filled = [&](const ItemPlace& it) { return ((filled[it.j * W + (it.i >> 5)] >> (it.i & 31)) & 1) != 0; };

  // The first item's loads go out beside the count messages when its slot is likely filled: a
  // slot index below this rank's own T (a hint only; the bitmap decides). This takes a memory
  // round trip off the items that are, without the reads of empty slots that cost when T < M.
  bool first_loaded = false;
  if (w < num_items && first.i < p.num_tokens && active[first.j]) {
    load_item(first);
    first_loaded = true;
  }
  // The count messages -> begin[j][e], the exclusive prefix over sources of expert e's rows,
  // and filled[j][*], source j's bitmap; block 0 publishes the counts and layout_range. Column x
  // of a message is expert x's count for x < El, then bitmap word x - El.
  // Up to kFusedSources sources, thread x loads column x from every source at once (the counts
  // are summed in registers); more sources take two passes (one word per thread, then the prefix
  // in shared memory). Loading them before the wait (checked after it) was 0.3 us slower: with
  // every block's signal polls they make one L2 hot spot.
  const int columns = El + W;
  auto column = [&](int j, int x) {
    return __ldcg(reinterpret_cast<const int*>(tr.local(c.count_offset + uint64_t(j) * p.count_bytes)) + x);
  };
  if (R <= kFusedSources) {
    for (int x = threadIdx.x; x < columns; x += kThreads) {
      int n[kFusedSources];
#pragma unroll
      for (int j = 0; j < kFusedSources; ++j) n[j] = j < R && active[j] ? column(j, x) : 0;
      if (x >= El) {
#pragma unroll
        for (int j = 0; j < kFusedSources; ++j)
          if (j < R) filled[j * W + x - El] = n[j];
      } else {
        int acc = 0;
#pragma unroll
        for (int j = 0; j < kFusedSources; ++j) {
          if (j >= R) break;
          begin[j * El + x] = acc;
          if (blockIdx.x == 0) publish_range(p, x, j, acc, n[j]);
          acc += n[j];
        }
        if (blockIdx.x == 0) publish_count(p, x, acc);
      }
    }
  } else {
    for (int idx = threadIdx.x; idx < R * columns; idx += kThreads) {
      const int j = int(unsigned(idx) / unsigned(columns)), x = idx - j * columns;
      const int n = active[j] ? column(j, x) : 0;
      if (x < El) begin[j * El + x] = n; else filled[j * W + x - El] = n;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < El; e += kThreads) {
      int acc = 0;
      for (int j = 0; j < R; ++j) {
        const int n = begin[j * El + e];
        begin[j * El + e] = acc;
        if (blockIdx.x == 0) publish_range(p, e, j, acc, n);
        acc += n;
      }
      if (blockIdx.x == 0) publish_count(p, e, acc);
    }
  }
  __syncthreads();
  LL_PROF_STAGE(prof::kBegins);

  for (bool is_first = true; w < num_items; w += total_warps, is_first = false) {
    const ItemPlace it = is_first ? first : place_of(w);
    if (!is_filled(it)) continue;
    if (!(is_first && first_loaded)) load_item(it);
    const uint8_t* slot = slot_of(it);
    // Lane k holds top-k entry k: its local expert and packed row, if the expert is ours.
    // The copies below take them by shuffle: no per-lane row arrays, no 64-bit division.
    const int local_expert = int(head_entry & 0xffffu) - c.rank * El;  // 0xffff (-1 slot) is never ours
    const bool mine = local_expert >= 0 && local_expert < El;
    const int my_e = mine ? local_expert : 0;
    const int my_row = mine ? begin[it.j * El + my_e] + int(head_entry >> 16) : 0;
    const uint32_t mine_mask = __ballot_sync(0xffffffffu, mine);
    const int4* src = reinterpret_cast<const int4*>(slot + header);
    int4* dst = static_cast<int4*>(p.packed_recv_x);
    // Loops below are warp-uniform (bounds checked per lane inside): they hold shuffles.
    for (int base = it.v_begin; base < it.v_end; base += kUnroll * kWarp) {
      if (base != it.v_begin) {  // the first batch came with load_item
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (base + lane + u * kWarp < it.v_end) v[u] = ld_cg(src + base + lane + u * kWarp);
      }
      for (uint32_t m = mine_mask; m != 0; m &= m - 1) {
        const int k = __ffs(m) - 1;
        const int64_t packed_row = int64_t(__shfl_sync(0xffffffffu, my_e, k)) * rows_per_expert +
                                   __shfl_sync(0xffffffffu, my_row, k);
        int4* row_dst = dst + packed_row * payload_vec + base + lane;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (base + lane + u * kWarp < it.v_end) st_stream(row_dst + u * kWarp, v[u]);
      }
    }
    if constexpr (kFp8) {
      // Scales: the chunks of the slot take interleaved 32-lane groups of them. The scale
      // tensor is [E_l][groups][R*M]: element (e, g, row) at (e * groups + g) * R*M + row.
      for (int g0 = int(it.chunk) * kWarp; g0 < scale_groups; g0 += int(chunks) * kWarp) {
        const int g = g0 + lane;
        const uint32_t word = g0 == int(it.chunk) * kWarp || g >= scale_groups ? scale_word : scale_at(slot, g);
        for (uint32_t m = mine_mask; m != 0; m &= m - 1) {
          const int k = __ffs(m) - 1;
          const int e = __shfl_sync(0xffffffffu, my_e, k), row = __shfl_sync(0xffffffffu, my_row, k);
          if (g < scale_groups)
            static_cast<uint32_t*>(p.packed_recv_x_scales)[(int64_t(e) * scale_groups + g) * rows_per_expert + row] =
                word;
        }
      }
    }
    if (it.chunk == 0 && mine) p.packed_recv_src_info[int64_t(my_e) * rows_per_expert + my_row] = int(head_token);
  }

  LL_PROF_STAGE(prof::kCopied);
  tr.finish_receive(kSignalDispatch);
}

template <int kRemote, bool kFp8>
__global__ void __launch_bounds__(kThreads, 1) dispatch(ncclDevComm dev_comm, DeepepLlDispatchParams p) {
  extern __shared__ int smem[];
  Transport<kRemote> tr(p.common, dev_comm);
  LL_PROF_BEGIN();
  if (runs_phase(p.common, DEEPEP_LL_PHASE_SEND)) dispatch_send<kRemote, kFp8>(p, tr, smem);
  if (runs_both_phases(p.common)) __syncthreads();
  if (runs_phase(p.common, DEEPEP_LL_PHASE_RECV)) dispatch_recv<kRemote, kFp8>(p, tr, smem);
  LL_PROF_END(prof::kDispatch, p.common.phases, p.common.rank);
}

// The launcher's kernels, by [remote kind][FP8].
constexpr void (*kDispatchKernels[kRemoteKinds][2])(ncclDevComm, DeepepLlDispatchParams) = {
    {dispatch<kRemoteNone, false>, dispatch<kRemoteNone, true>},
    {dispatch<kRemoteEmulated, false>, dispatch<kRemoteEmulated, true>},
#if DEEPEP_HAVE_GIN
    {dispatch<kRemoteGin, false>, dispatch<kRemoteGin, true>},
#endif
};

}  // namespace ll

cudaError_t preload_ll_dispatch_kernels() { return load_kernels(ll::kDispatchKernels); }

}  // namespace deepep

extern "C" int deepep_launch_ll_dispatch(const void* dev_comm, const DeepepLlDispatchParams* params, int remote_kind,
                                         int num_blocks, void* stream) {
  using namespace deepep::ll;
  const ncclDevComm& dc = *static_cast<const ncclDevComm*>(dev_comm);
  const DeepepLlDispatchParams& p = *params;
  if (remote_kind < 0 || remote_kind >= kRemoteKinds) return int(cudaErrorInvalidValue);
  const auto kernel = kDispatchKernels[remote_kind][p.use_fp8 != 0 ? 1 : 0];
  const auto& c = p.common;
  const size_t recv_ints = size_t(c.num_ranks) * (c.num_local_experts + count_bitmap_words(c.max_tokens)) +
                          size_t(c.num_ranks) + 1;
  const size_t send_ints = dispatch_send_smem_ints(c.num_ranks, c.num_experts, c.max_tokens, num_blocks);
  const size_t smem = sizeof(int) * (recv_ints > send_ints ? recv_ints : send_ints);
  return deepep::launch_kernel(kernel, num_blocks, kThreads, smem, static_cast<cudaStream_t>(stream), dc, p);
}
