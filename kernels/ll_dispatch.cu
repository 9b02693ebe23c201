// Low-latency dispatch: deepep::ll::dispatch<...>.
//
// Send phase. Each token goes once to every rank that owns one of its experts
// (not once per expert): the slot carries the token's top-k list with the row
// each (token, expert) pair takes at the receiver, and the receiver fans the
// payload out into its experts' packed rows. Row positions are deterministic:
// within expert e, source ranks ascending; within a source, (token, k) ascending.
//   * block b owns tokens t = b, b+G, ...: it counts, over the tokens before t,
//     how many went to each of t's destination ranks (t's slot there) and how
//     many chose each of t's experts (t's row inside the source block), then
//     quantises t once and stores it into every destination slot;
//   * block b also owns destinations d = b, b+G, ...: it sends d the count
//     message (tokens and per-expert counts from this rank);
//   * every writer releases its stores and adds to done[d]; the count block adds
//     kDoneTag - n_d, so whoever brings done[d] to kDoneTag signals d.
// Receive phase. Every block waits for all sources' signals, builds the begin
// table from the count messages, then warps copy slots into the packed outputs.
#include "ll_common.cuh"

namespace deepep {
namespace ll {

constexpr int kDoneTag = 1 << 30;
constexpr int kCountHeaderInts = 4;  // count message: [tokens, 0, 0, 0, per-expert counts...]

// Padded to 16 bytes so that every slot starts 16-byte aligned (H = 128: 128 + 4 scales).
__host__ __device__ constexpr int64_t dispatch_payload_bytes(int hidden, bool fp8) {
  return fp8 ? align16(int64_t(hidden) + 4 * (hidden / 128)) : 2 * int64_t(hidden);
}

struct TokenRoute {
  int expert[DEEPEP_LL_MAX_TOPK];
  int pos[DEEPEP_LL_MAX_TOPK];   // row inside (expert, this source) block
  int dst[DEEPEP_LL_MAX_TOPK];   // distinct destination ranks, first-seen order
  int slot[DEEPEP_LL_MAX_TOPK];  // the token's slot at dst[i]
  int num_dst;
};

__device__ __forceinline__ float half_warp_max(float v) {
#pragma unroll
  for (int m = 8; m >= 1; m >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
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

// Routing of token t (block-wide; the result lands in `route`, shared memory).
__device__ void route_token(const DeepepLlDispatchParams& p, int t, TokenRoute& route, int* counters) {
  const auto& c = p.common;
  const int K = c.num_topk, El = c.num_local_experts;
  const bool i32 = p.topk_idx_is_int32 != 0;
  if (threadIdx.x < 2 * DEEPEP_LL_MAX_TOPK) counters[threadIdx.x] = 0;
  if (threadIdx.x < kWarp) {
    // Warp 0: lane k holds entry k; duplicates and first-seen destinations by shuffles.
    const int lane = threadIdx.x;
    const int e = lane < K ? load_topk(p.topk_idx, i32, int64_t(t) * K + lane) : -1;
    const int d = e >= 0 ? e / El : -1;
    int dup = 0;
    bool first_dst = d >= 0;
    for (int k2 = 0; k2 < K; ++k2) {
      const int e2 = __shfl_sync(0xffffffffu, e, k2);
      if (k2 < lane) {
        dup += e2 == e;
        first_dst &= d < 0 || e2 < 0 || e2 / El != d;
      }
    }
    const uint32_t firsts = __ballot_sync(0xffffffffu, first_dst);
    if (lane < K) {
      route.expert[lane] = e;
      route.pos[lane] = dup;  // duplicates inside the token come first in (token, k) order
    }
    if (first_dst) route.dst[__popc(firsts & ((1u << lane) - 1))] = d;
    if (lane == 0) route.num_dst = __popc(firsts);
  }
  __syncthreads();
  int cpos[DEEPEP_LL_MAX_TOPK], cslot[DEEPEP_LL_MAX_TOPK];
#pragma unroll
  for (int k = 0; k < DEEPEP_LL_MAX_TOPK; ++k) cpos[k] = cslot[k] = 0;
  const int nd = route.num_dst;
  for (int tp = threadIdx.x; tp < t; tp += kThreads) {
    uint32_t hit = 0;
    for (int k2 = 0; k2 < K; ++k2) {
      const int e2 = load_topk(p.topk_idx, i32, int64_t(tp) * K + k2);
      if (e2 < 0) continue;
      const int d2 = e2 / El;
#pragma unroll
      for (int k = 0; k < DEEPEP_LL_MAX_TOPK; ++k) {
        if (k < K) cpos[k] += route.expert[k] == e2;
        if (k < nd && route.dst[k] == d2) hit |= 1u << k;
      }
    }
#pragma unroll
    for (int k = 0; k < DEEPEP_LL_MAX_TOPK; ++k) cslot[k] += (hit >> k) & 1u;
  }
  const int lane = threadIdx.x % kWarp;
#pragma unroll
  for (int k = 0; k < DEEPEP_LL_MAX_TOPK; ++k) {
    if (k >= K) break;
    const int a = __reduce_add_sync(0xffffffffu, cpos[k]);
    const int b = __reduce_add_sync(0xffffffffu, cslot[k]);
    if (lane == 0) {
      if (a) atomicAdd(&counters[k], a);
      if (b) atomicAdd(&counters[DEEPEP_LL_MAX_TOPK + k], b);
    }
  }
  __syncthreads();
  if (threadIdx.x < K) route.pos[threadIdx.x] += counters[threadIdx.x];
  if (threadIdx.x < nd) route.slot[threadIdx.x] = counters[DEEPEP_LL_MAX_TOPK + threadIdx.x];
  __syncthreads();
}

template <int kRemote>
__device__ __forceinline__ void count_done(const Transport<kRemote>& tr, int d, int add) {
  const int old = atomic_add_acq_rel_gpu(tr.c.done + d, add);
  if (old + add == kDoneTag) {
    tr.c.done[d] = 0;
    tr.signal(d, kSignalDispatch, 1u);
  }
}

template <int kRemote, bool kFp8>
__device__ void dispatch_send(const DeepepLlDispatchParams& p, const Transport<kRemote>& tr, int* smem) {
  const auto& c = p.common;
  const int T = p.num_tokens, K = c.num_topk, El = c.num_local_experts, H = c.hidden, M = c.max_tokens;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const bool i32 = p.topk_idx_is_int32 != 0;
  const int64_t slot_bytes = p.dispatch_slot_bytes;
  const int64_t header = dispatch_header_bytes(K);
  const int64_t count_bytes = p.count_bytes;
  const int num_scales = H / 128;

  // Count messages for the destinations this block owns. Their done adds wait until the end
  // of the send phase, so that one fence covers them and this block's tokens.
  int* hist = smem;                 // [El + 1]
  int* owned_tokens = hist + El + 1;  // [owned destinations]: tokens sent to each
  // Destination d's count belongs to block G - 1 - d (mod G): the last blocks, which carry no
  // token when T + R <= G, so counting runs beside the token sends.
  const int count_block = gridDim.x - 1 - blockIdx.x;
  for (int d = count_block, i = 0; d < c.num_ranks; d += gridDim.x, ++i) {
    if (!peer_active(c, d)) continue;
    for (int x = threadIdx.x; x <= El; x += kThreads) hist[x] = 0;
    __syncthreads();
    for (int t = threadIdx.x; t < T; t += kThreads) {
      bool any = false;
      for (int k = 0; k < K; ++k) {
        const int e = load_topk(p.topk_idx, i32, int64_t(t) * K + k);
        if (e >= 0 && e / El == d) {
          atomicAdd(&hist[1 + e - d * El], 1);
          any = true;
        }
      }
      if (any) atomicAdd(&hist[0], 1);
    }
    __syncthreads();
    const bool direct = tr.direct(d);
    const uint64_t dst_offset = c.count_offset + uint64_t(c.rank) * count_bytes;
    const uint64_t stage_offset = c.staging_offset + uint64_t(M) * slot_bytes + uint64_t(d) * count_bytes;
    int* msg = reinterpret_cast<int*>(direct ? tr.lsa(dst_offset, d) : tr.local(stage_offset));
    for (int x = threadIdx.x; x < kCountHeaderInts + El; x += kThreads)
      msg[x] = x == 0 ? hist[0] : (x < kCountHeaderInts ? 0 : hist[1 + x - kCountHeaderInts]);
    if (threadIdx.x == 0) owned_tokens[i] = hist[0];
    __syncthreads();
    if (!direct && warp == 0) tr.put(d, dst_offset, stage_offset, count_bytes, lane);
    __syncthreads();
  }

  __shared__ TokenRoute route;
  __shared__ int counters[2 * DEEPEP_LL_MAX_TOPK];
  const int hidden_vec = H / 8;  // 16-byte groups of 8 bf16
  for (int t = blockIdx.x; t < T; t += gridDim.x) {
    route_token(p, t, route, counters);
    const int nd = route.num_dst;
    // Destination slot base pointers (direct) or the staging slot (remote).
    uint8_t* dst_ptr[DEEPEP_LL_MAX_TOPK];
    bool any_remote = false;
    const uint64_t stage_offset = c.staging_offset + uint64_t(t) * slot_bytes;
    uint8_t* stage = kRemote == kRemoteNone ? nullptr : tr.local(stage_offset);
#pragma unroll
    for (int i = 0; i < DEEPEP_LL_MAX_TOPK; ++i) {
      dst_ptr[i] = nullptr;
      if (i < nd && peer_active(c, route.dst[i])) {
        const int d = route.dst[i];
        if (tr.direct(d)) {
          dst_ptr[i] = tr.lsa(c.dispatch_recv_offset + (uint64_t(c.rank) * M + route.slot[i]) * slot_bytes, d);
        } else {
          any_remote = true;
        }
      }
    }
    // Header: source token, then (position << 16 | expert) per top-k entry.
    if (threadIdx.x <= K) {
      const int k = threadIdx.x - 1;
      const uint32_t word = threadIdx.x == 0 ? uint32_t(t)
                                             : (route.expert[k] < 0 ? 0xffffu
                                                                    : (uint32_t(route.pos[k]) << 16) |
                                                                          uint32_t(route.expert[k] & 0xffff));
#pragma unroll
      for (int i = 0; i < DEEPEP_LL_MAX_TOPK; ++i)
        if (dst_ptr[i] != nullptr) reinterpret_cast<uint32_t*>(dst_ptr[i])[threadIdx.x] = word;
      if (any_remote) reinterpret_cast<uint32_t*>(stage)[threadIdx.x] = word;
    }
    // Payload: each warp converts 32 groups of 8 channels (two 128-channel blocks) per step.
    const int4* x_row = static_cast<const int4*>(p.x) + int64_t(t) * hidden_vec;
    constexpr int kLoads = 2;  // the row's loads of kLoads steps go out together
    for (int base0 = warp * kWarp; base0 < hidden_vec; base0 += kLoads * kThreads) {
      int4 loaded[kLoads];
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int i = base0 + u * kThreads + lane;
        loaded[u] = i < hidden_vec ? ld_stream(x_row + i) : make_int4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int i = base0 + u * kThreads + lane;
        const bool valid = i < hidden_vec;  // half-warps are entirely valid or not (H % 128 == 0)
        const int4 v = loaded[u];
        if constexpr (kFp8) {
          const auto* bf = reinterpret_cast<const __nv_bfloat16*>(&v);
          float f[8];
          float amax = 1e-4f;
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            f[j] = __bfloat162float(bf[j]);
            amax = fmaxf(amax, fabsf(f[j]));
          }
          amax = half_warp_max(amax);
          float scale, scale_inv;
          fp8_scales(amax, p.round_scale != 0, scale, scale_inv);
          int2 packed;
          auto* q = reinterpret_cast<__nv_fp8x2_storage_t*>(&packed);
#pragma unroll
          for (int j = 0; j < 8; j += 2)
            q[j / 2] = __nv_cvt_float2_to_fp8x2(make_float2(f[j] * scale, f[j + 1] * scale), __NV_SATFINITE, __NV_E4M3);
          if (valid) {
            const bool writes_scale = (lane % 16) == 0;
            const int64_t scale_at = header + H + 4 * int64_t(i / 16);
#pragma unroll
            for (int d = 0; d < DEEPEP_LL_MAX_TOPK; ++d) {
              if (dst_ptr[d] == nullptr) continue;
              *reinterpret_cast<int2*>(dst_ptr[d] + header + 8 * int64_t(i)) = packed;
              if (writes_scale) *reinterpret_cast<float*>(dst_ptr[d] + scale_at) = scale_inv;
            }
            if (any_remote) {
              *reinterpret_cast<int2*>(stage + header + 8 * int64_t(i)) = packed;
              if (writes_scale) *reinterpret_cast<float*>(stage + scale_at) = scale_inv;
            }
          }
          (void)num_scales;
        } else {
          if (valid) {
#pragma unroll
            for (int d = 0; d < DEEPEP_LL_MAX_TOPK; ++d)
              if (dst_ptr[d] != nullptr) st_stream(reinterpret_cast<int4*>(dst_ptr[d] + header) + i, v);
            if (any_remote) st_stream(reinterpret_cast<int4*>(stage + header) + i, v);
          }
        }
      }
    }
    __syncthreads();
    if (kRemote != kRemoteNone && any_remote) {
      // Remote destinations: put the staged slot, one warp per destination.
      for (int i = warp; i < nd; i += kWarps) {
        const int d = route.dst[i];
        if (tr.direct(d) || !peer_active(c, d)) continue;
        tr.put(d, c.dispatch_recv_offset + (uint64_t(c.rank) * M + route.slot[i]) * slot_bytes, stage_offset,
               slot_bytes, lane);
      }
      __syncthreads();
    }
    // One thread per destination: release this token's stores, then count it done.
    if (threadIdx.x < nd && peer_active(c, route.dst[threadIdx.x])) {
      count_done(tr, route.dst[threadIdx.x], 1);
    }
    __syncthreads();
  }
  // The count messages' done adds (kDoneTag - tokens): whoever completes done[d] signals d.
  for (int d = count_block + threadIdx.x * gridDim.x, i = threadIdx.x; d < c.num_ranks;
       d += kThreads * gridDim.x, i += kThreads) {
    if (!peer_active(c, d)) continue;
    count_done(tr, d, kDoneTag - owned_tokens[i]);
  }
}

// Where work item w of the receive lies: source j, slot i, and its chunk's 16-byte words
// [v_begin, v_end) of the payload (whole 32-word groups).
struct ItemPlace {
  int j, i, v_begin, v_end;
  unsigned chunk;
};
__device__ __forceinline__ ItemPlace item_place(unsigned w, unsigned chunks, int max_tokens, int payload_groups,
                                                int payload_vec) {
  const unsigned slot_idx = w / chunks, chunk = w - slot_idx * chunks;
  const unsigned j = slot_idx / unsigned(max_tokens);
  ItemPlace it;
  it.j = int(j);
  it.i = int(slot_idx - j * unsigned(max_tokens));
  it.chunk = chunk;
  it.v_begin = int(chunk * unsigned(payload_groups) / chunks) * kWarp;
  it.v_end = min(int((chunk + 1) * unsigned(payload_groups) / chunks) * kWarp, payload_vec);
  return it;
}

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

template <int kRemote, bool kFp8>
__device__ void dispatch_recv(const DeepepLlDispatchParams& p, const Transport<kRemote>& tr, int* smem) {
  const auto& c = p.common;
  const int R = c.num_ranks, El = c.num_local_experts, H = c.hidden, M = c.max_tokens, K = c.num_topk;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t slot_bytes = p.dispatch_slot_bytes;
  const int64_t header = dispatch_header_bytes(K);
  const int64_t rows_per_expert = int64_t(R) * M;
  // smem: begin [R][El] (counts, then exclusive prefixes over sources), tokens [R], active [R + 1].
  int* begin = smem;
  int* tokens = begin + R * El;
  int* active = tokens + R;
  // Work items: every potential slot (source j, slot i < M) split into chunks of whole 32-word
  // groups. The mapping does not depend on the counts, so each warp issues its first item's
  // loads (header, payload, first scales) right after the wait, beside the count-message loads:
  // one memory round trip instead of one per step. Slots past a source's count are skipped once
  // the counts are known (their speculative loads are harmless window reads).
  const int payload_vec = kFp8 ? H / 16 : H / 8;  // 16-byte words of payload data (without scales)
  const int num_scales = H / 128;
  const int total_warps = gridDim.x * kWarps;
  const int payload_groups = (payload_vec + kWarp - 1) / kWarp;
  const unsigned potential = unsigned(R) * unsigned(M);
  const unsigned chunks = max(1u, min(unsigned(total_warps) / potential, unsigned(payload_groups)));
  const unsigned num_items = potential * chunks;
  auto place_of = [&](unsigned w) { return item_place(w, chunks, M, payload_groups, payload_vec); };
  // The first item's place is integer divisions (long dependent chains) of parameters: computed
  // before the wait, beside the signal's round trip.
  unsigned w = blockIdx.x * kWarps + warp;
  const ItemPlace first = place_of(w);
  computed_here(first.j, first.i, first.v_begin, first.v_end);
  const uint32_t expected = tr.wait_sources(kSignalDispatch, active, p.dispatch_wait_recv_cost_stats);
  __syncthreads();

  constexpr int kUnroll = 8;
  int4 v[kUnroll];
  uint32_t head_token = 0, head_entry = 0xffffu, scale_word = 0;
  const bool ue8m0 = p.use_ue8m0 != 0;
  const int scale_groups = ue8m0 ? num_scales / 4 : num_scales;
  auto count_msg = [&](int j) {
    return reinterpret_cast<const int*>(tr.local(c.count_offset + uint64_t(j) * p.count_bytes));
  };
  auto slot_of = [&](const ItemPlace& it) {
    return tr.local(c.dispatch_recv_offset + (uint64_t(it.j) * M + it.i) * slot_bytes);
  };
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
  if (w < num_items && active[first.j]) load_item(first);

  // The count messages ([tokens, 0, 0, 0, per-expert counts]) -> begin[j][e], the exclusive
  // prefix over sources of expert e's rows, and tokens[j]; block 0 publishes the counts and
  // layout_range. Up to kFusedSources sources, thread e loads expert e's counts from every source
  // at once and sums them in registers (thread El: the token counts); more sources take two
  // passes (one word per thread, then the prefix in shared memory).
  if (R <= kFusedSources) {
    for (int e = threadIdx.x; e <= El; e += kThreads) {
      int n[kFusedSources];
#pragma unroll
      for (int j = 0; j < kFusedSources; ++j)
        n[j] = j < R && active[j] ? __ldcg(count_msg(j) + (e == El ? 0 : kCountHeaderInts + e)) : 0;
      if (e == El) {
#pragma unroll
        for (int j = 0; j < kFusedSources; ++j)
          if (j < R) tokens[j] = n[j];
      } else {
        int acc = 0;
#pragma unroll
        for (int j = 0; j < kFusedSources; ++j) {
          if (j >= R) break;
          begin[j * El + e] = acc;
          if (blockIdx.x == 0) publish_range(p, e, j, acc, n[j]);
          acc += n[j];
        }
        if (blockIdx.x == 0) publish_count(p, e, acc);
      }
    }
  } else {
    for (int idx = threadIdx.x; idx < R * (El + 1); idx += kThreads) {
      const int j = int(unsigned(idx) / unsigned(El + 1)), x = idx - j * (El + 1);
      const int n = active[j] ? __ldcg(count_msg(j) + (x == 0 ? 0 : kCountHeaderInts + x - 1)) : 0;
      if (x == 0) tokens[j] = n; else begin[j * El + x - 1] = n;
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

  for (bool is_first = true; w < num_items; w += total_warps, is_first = false) {
    const ItemPlace it = is_first ? first : place_of(w);
    if (it.i >= tokens[it.j]) continue;  // warp-uniform; tokens[j] is 0 for an inactive source
    if (!is_first) load_item(it);
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

  tr.finish_receive(kSignalDispatch, expected);
}

template <int kRemote, bool kFp8, int kPhases>
__global__ void __launch_bounds__(kThreads, 1) dispatch(ncclDevComm dev_comm, DeepepLlDispatchParams p) {
  extern __shared__ int smem[];
  Transport<kRemote> tr(p.common, dev_comm);
  if constexpr ((kPhases & DEEPEP_LL_PHASE_SEND) != 0) dispatch_send<kRemote, kFp8>(p, tr, smem);
  if constexpr (kPhases == (DEEPEP_LL_PHASE_SEND | DEEPEP_LL_PHASE_RECV)) __syncthreads();
  if constexpr ((kPhases & DEEPEP_LL_PHASE_RECV) != 0) dispatch_recv<kRemote, kFp8>(p, tr, smem);
}

template <int kRemote, bool kFp8>
int launch_dispatch(const ncclDevComm& dc, const DeepepLlDispatchParams& p, int num_blocks, cudaStream_t stream) {
  const auto& c = p.common;
  const size_t smem = sizeof(int) * (size_t(c.num_ranks) * c.num_local_experts + 2 * size_t(c.num_ranks) + 2 +
                                     size_t(c.num_local_experts));
  return launch_for_phases(c.phases, dispatch<kRemote, kFp8, DEEPEP_LL_PHASE_SEND>,
                           dispatch<kRemote, kFp8, DEEPEP_LL_PHASE_RECV>,
                           dispatch<kRemote, kFp8, DEEPEP_LL_PHASE_SEND | DEEPEP_LL_PHASE_RECV>, dc, p, smem,
                           num_blocks, stream);
}

}  // namespace ll
}  // namespace deepep

extern "C" int64_t deepep_ll_dispatch_slot_bytes(int32_t hidden, int32_t num_topk, int32_t use_fp8) {
  return deepep::ll::dispatch_header_bytes(num_topk) + deepep::ll::dispatch_payload_bytes(hidden, use_fp8 != 0);
}

extern "C" int deepep_ll_gin_compiled(void) { return DEEPEP_HAVE_GIN; }

extern "C" int deepep_launch_ll_dispatch(const void* dev_comm, const DeepepLlDispatchParams* params, int remote_kind,
                                         int num_blocks, void* stream) {
  using namespace deepep::ll;
  const ncclDevComm& dc = *static_cast<const ncclDevComm*>(dev_comm);
  const auto s = static_cast<cudaStream_t>(stream);
  const bool fp8 = params->use_fp8 != 0;
  switch (remote_kind) {
    case kRemoteNone:
      return fp8 ? launch_dispatch<kRemoteNone, true>(dc, *params, num_blocks, s)
                 : launch_dispatch<kRemoteNone, false>(dc, *params, num_blocks, s);
    case kRemoteEmulated:
      return fp8 ? launch_dispatch<kRemoteEmulated, true>(dc, *params, num_blocks, s)
                 : launch_dispatch<kRemoteEmulated, false>(dc, *params, num_blocks, s);
#if DEEPEP_HAVE_GIN
    case kRemoteGin:
      return fp8 ? launch_dispatch<kRemoteGin, true>(dc, *params, num_blocks, s)
                 : launch_dispatch<kRemoteGin, false>(dc, *params, num_blocks, s);
#endif
    default:
      return int(cudaErrorInvalidValue);
  }
}
