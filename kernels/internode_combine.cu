// Internode combine data kernel (docs/internode.md, "Combine"), the reverse of dispatch. 2C blocks:
// * block c < C: NVLink sender groups (one per other local GPU l) send this rank's received rows
//   of sources (s, l), s ascending, channel c, into l's NVLink ring (c, my GPU), each warp every
//   group-size-th row; the other warps are the final receiver: for each source token of channel
//   c (in batches, warps striding over the batch's tokens) bias_0 + bias_1, then the nodes'
//   partial rows in ascending node, one rounding.
// * block C + c: forwarder groups (one per source node s, or several in turn: g, g + groups, ...)
//   sum, per row of the scale-out receive
//   segment (s, c), the rows of the local GPUs in its mask (ascending GPU, fp32, from 0; this
//   GPU's rows straight from x), round to bf16 and write the row into the source (s, my GPU)'s
//   scale-out ring (c, my node), each warp every group-size-th row; one tail add per chunk.
// With one GPU per node (G == 1) this rank's own node has no ring: its forwarder's row of a token
// would be the one x row the heads name, rounded through fp32 (as_forwarded), so the final
// receiver reads that row from x and applies the same rounding (the same bits), and the
// forwarder groups take the other N - 1 nodes (at N = 2 all 16 warps send to the one peer).
// Heads were rewritten by the combine notify; an entry >= 0 is a row's sequence number.
//
// No wait cycle when forwarder groups take source nodes in turn. Give every wait the node s whose
// tokens it combines: a forwarder's segment (s, c), the final receiver of node s (it waits on the
// forwarders of segments (s, c) on every node, they on its credits), an NVLink sender at its
// current source node (its stream runs s ascending; it waits for slots of that s or an earlier
// one to be consumed). Every wait is on work of the same or a smaller s, and a group reaches
// segment s only after its smaller ones (the same ascending order on every rank). By induction on
// s: once all work of smaller s completes, that of s is the one-group-per-node design's (the
// ring's chunk + round <= ring + 1, the NVLink slots consumed in each GPU's stream order), which
// completes. G == 1 removes the own node's segments and its waits (the receiver reads x, which
// waits for nothing; the own ring's counters and totals stay as they are, on both sides this rank).
//
// Shrink mode (kShrink; docs/internode.md, "Shrink"): rows for a masked or gone peer are not sent
// (counted), contributions of a masked or gone peer are left out of a sum (counted), every wait
// expires into "gone". A forwarder whose source is masked still takes its NVLink slots (their
// writers must not wait on it), it only sends nothing back.
#include "internode_common.cuh"
#include "launch.cuh"

namespace deepep {
namespace internode {

__device__ __forceinline__ void accumulate(float (&acc)[8], const int4& v) {
  const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&v);
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] += __bfloat162float(h[e]);
}
__device__ __forceinline__ int4 pack_bf16(const float (&acc)[8]) {
  int4 packed;
  __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(&packed);
#pragma unroll
  for (int e = 0; e < 8; ++e) o[e] = __float2bfloat16_rn(acc[e]);
  return packed;
}

// Row sums of combine. Time goes to load latency, not arithmetic: a warp that adds one 16-byte
// word per lane at a time keeps 512 B in flight (docs/internode.md, "Combine's time"), so every
// lane loads kSumLoads words before it adds any, within the 80 registers of a 768-thread block.
constexpr int kSumLoads = 8;

// The forwarder's row for a token with one source row v and no bias (sum_few_rows<1>): bf16(0.0f +
// v), in fp32. The receiver applies it to a row it reads from x in place of that forwarder's ring
// copy (G == 1, own node), so that the bits match (-0.0 becomes +0.0, NaN the canonical one).
__device__ __forceinline__ int4 as_forwarded(const int4& v) {
  float acc[8] = {};
  accumulate(acc, v);
  return pack_bf16(acc);
}

__device__ __forceinline__ const int4* shfl_row(const int4* row, int j) {
  return reinterpret_cast<const int4*>(__shfl_sync(0xffffffffu, reinterpret_cast<uint64_t>(row), j));
}

// sum_rows without a start and with kRows rows (lanes a, b): kLoads words per lane in flight,
// no accumulator kept across loads. Lane `lone`'s row (-1: none) is taken as_forwarded.
template <int kRows, int kLoads>
__device__ __forceinline__ void sum_few_rows(int4* out, const int4* row, int a, int b, int hidden_int4, int lane,
                                             int lone) {
  constexpr int kUnroll = kLoads / kRows;
  const int4* src[2] = {shfl_row(row, a), shfl_row(row, b)};
  for (int i0 = lane; i0 < hidden_int4; i0 += kUnroll * kWarp) {
    // Every word defined on every path (zero past the row): an undefined one would carry the
    // previous pass's register into this one, live across the loop, and ptxas spilled such words.
    int4 v[kUnroll][kRows];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int r = 0; r < kRows; ++r)
        v[u][r] = i0 + u * kWarp < hidden_int4 ? ld_ring(src[r] + i0 + u * kWarp) : make_int4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (i0 + u * kWarp >= hidden_int4) break;
      float acc[8] = {};
#pragma unroll
      for (int r = 0; r < kRows; ++r) accumulate(acc, (r == 0 ? a : b) == lone ? as_forwarded(v[u][r]) : v[u][r]);
      st_stream(out + i0 + u * kWarp, pack_bf16(acc));
    }
  }
}

// sum_rows' general path over `chunks` chunks of rows, ascending: rows_of(q, row, mask) gives
// chunk q (lane j: row j's address; mask, warp-uniform: the rows to add). An accumulator per
// word, two rows per pass (kUnroll x 2 loads in flight). Row `lone` (q * kWarp + j; -1: none)
// is taken as_forwarded.
template <typename RowsOf>
__device__ __forceinline__ void sum_row_chunks(int4* out, RowsOf rows_of, int chunks, int hidden_int4,
                                               const int4* bias_0, const int4* bias_1, int lane, int lone) {
  constexpr int kUnroll = kSumLoads / 4;
  for (int i0 = lane; i0 < hidden_int4 + lane; i0 += kUnroll * kWarp) {
    float acc[kUnroll][8];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = i0 + u * kWarp;
      const int4 zero = make_int4(0, 0, 0, 0);
      const int4 b0 = bias_0 != nullptr && i < hidden_int4 ? ld_stream(bias_0 + i) : zero;
      const int4 b1 = bias_1 != nullptr && i < hidden_int4 ? ld_stream(bias_1 + i) : zero;
      const __nv_bfloat16* v0 = reinterpret_cast<const __nv_bfloat16*>(&b0);
      const __nv_bfloat16* v1 = reinterpret_cast<const __nv_bfloat16*>(&b1);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[u][e] = __bfloat162float(v0[e]) + __bfloat162float(v1[e]);
    }
    for (int q = 0; q < chunks; ++q) {
      const int4* row;
      uint32_t mask;
      rows_of(q, row, mask);
      const int lone_lane = lone - q * kWarp;  // in [0, kWarp) only in lone's chunk
      for (uint32_t rest = mask; rest != 0;) {
        const int a = __ffs(rest) - 1;
        rest &= rest - 1;
        const bool two = rest != 0;
        const int b = two ? __ffs(rest) - 1 : a;
        if (two) rest &= rest - 1;
        const int4 *ra = shfl_row(row, a), *rb = shfl_row(row, b);
        int4 va[kUnroll], vb[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (i0 + u * kWarp < hidden_int4) va[u] = ld_ring(ra + i0 + u * kWarp);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (two && i0 + u * kWarp < hidden_int4) vb[u] = ld_ring(rb + i0 + u * kWarp);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          accumulate(acc[u], a == lone_lane ? as_forwarded(va[u]) : va[u]);
          if (two) accumulate(acc[u], b == lone_lane ? as_forwarded(vb[u]) : vb[u]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i0 + u * kWarp < hidden_int4) st_stream(out + i0 + u * kWarp, pack_bf16(acc[u]));
  }
}

// out = bf16(start + rows in ascending lane order), in fp32 with one rounding; start is
// bias_0 + bias_1 (each null reads as 0.0, both null: 0.0). Lane j holds row j's address, `mask`
// (warp-uniform) the rows to add; lane `lone`'s row (-1: none) is taken as_forwarded. Whole
// warps call; rows of hidden_int4 16-byte words. kPairLoads: words per lane in flight for two
// rows without a start (the final receiver's case at N = 2 takes 16: see combine_receive).
template <int kPairLoads = kSumLoads>
__device__ __forceinline__ void sum_rows(int4* out, const int4* row, uint32_t mask, int hidden_int4, const int4* bias_0,
                                         const int4* bias_1, int lane, int lone = -1) {
  const int rows = __popc(mask);
  if (bias_0 == nullptr && bias_1 == nullptr && rows <= 2) {  // start 0.0: DeepEP's shape, N = 2 or G <= 2
    const int a = __ffs(mask) - 1, b = __ffs(mask & (mask - 1)) - 1;
    if (rows == 1) sum_few_rows<1, kSumLoads>(out, row, a, a, hidden_int4, lane, lone);
    else if (rows == 2) sum_few_rows<2, kPairLoads>(out, row, a, b, hidden_int4, lane, lone);
    else for (int i = lane; i < hidden_int4; i += kWarp) st_stream(out + i, make_int4(0, 0, 0, 0));
    return;
  }
  const auto one_chunk = [&](int, const int4*& r, uint32_t& m) {
    r = row;
    m = mask;
  };
  sum_row_chunks(out, one_chunk, 1, hidden_int4, bias_0, bias_1, lane, lone);
}

// out[w] = 0.0 + the rows' weights w in ascending order, w < K, over `chunks` chunks of rows:
// weights_of(q, weights, mask) gives chunk q (lane j: row j's weights, null: the row has none
// and adds nothing). Row `lone` (q * kWarp + j; -1: none) adds what its forwarder would have
// sent: 0.0 + its weight, 0.0 when null. Whole warps call.
template <typename WeightsOf>
__device__ __forceinline__ void sum_weight_chunks(float* out, WeightsOf weights_of, int chunks, int K, int lane,
                                                  int lone) {
  for (int w0 = 0; w0 < K; w0 += kWarp) {
    float acc = 0.0f;
    for (int q = 0; q < chunks; ++q) {
      const float* weights;
      uint32_t mask;
      weights_of(q, weights, mask);
      for (uint32_t rest = mask; rest != 0; rest &= rest - 1) {
        const int j = __ffs(rest) - 1;
        const float* w = reinterpret_cast<const float*>(__shfl_sync(0xffffffffu, reinterpret_cast<uint64_t>(weights), j));
        if (w0 + lane < K) {
          if (q * kWarp + j == lone) acc += w != nullptr ? 0.0f + w[w0 + lane] : 0.0f;
          else if (w != nullptr) acc += w[w0 + lane];
        }
      }
    }
    if (w0 + lane < K) out[w0 + lane] = acc;
  }
}
// The same for one chunk: lane j holds row j's weights.
__device__ __forceinline__ void sum_weights(float* out, const float* weights, uint32_t mask, int K, int lane,
                                            int lone = -1) {
  const auto one_chunk = [&](int, const float*& w, uint32_t& m) {
    w = weights;
    m = mask;
  };
  sum_weight_chunks(out, one_chunk, 1, K, lane, lone);
}

// The first of x's rows [start, stop) that is num_worst_tokens padding (dispatch marked its
// SourceMeta; padding is a suffix), else stop.
__device__ __noinline__ int64_t padding_start(const int32_t* src_meta, int64_t start, int64_t stop) {
  while (start < stop) {
    const int64_t mid = start + (stop - start) / 2;
    const bool padding = src_meta[2 * mid] == kPaddingMeta && src_meta[2 * mid + 1] == 0;
    if (padding) stop = mid;
    else start = mid + 1;
  }
  return start;
}

// x's rows [start, stop) from source rank src in channel ch: the last channel of a source ends
// where the next source starts, the last source at x's rows (DeepEP's: combine takes no
// recv_gbl_rank_prefix_sum) less num_worst_tokens padding. False (a fault recorded) for a range
// outside x.
__device__ bool source_rows(const DeepepInternodeCombineParams& p, int src, int ch, int lane, int64_t& start,
                            int64_t& stop) {
  const int C = p.common.num_channels;
  const bool last = ch + 1 == C && src + 1 == p.common.num_ranks;
  start = p.gbl_channel_prefix_matrix[src * C + ch];
  stop = ch + 1 < C ? p.gbl_channel_prefix_matrix[src * C + ch + 1]
         : !last    ? p.gbl_channel_prefix_matrix[(src + 1) * C]
                    : p.num_recv_rows;
  if (start >= 0 && stop >= start && stop <= p.num_recv_rows) {
    if (last && p.src_meta != nullptr) stop = padding_start(p.src_meta, start, stop);
    return true;
  }
  if (lane == 0)
    record_fault(p.common, DEEPEP_FAULT_COMBINE_HANDLE, DEEPEP_HANDLE_RECV_GBL_CHANNEL_PREFIX, src * C + ch,
                 start < 0 ? start : stop);
  return false;
}

// recv_src_meta (DeepEP's; this combine goes by the heads), checked once per call off the row
// loops, grid-strided: each row's source node within the world, its NVLink mask within the node's
// GPUs and holding this GPU (the row came here); num_worst_tokens padding skipped.
__device__ __noinline__ void check_src_meta(const DeepepInternodeCombineParams& p) {
  const int N = p.common.num_nodes, G = p.common.node_size, my_gpu = p.common.rank % G;
  for (int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < p.num_recv_rows; r += int64_t(gridDim.x) * blockDim.x) {
    const int32_t node = p.src_meta[2 * r];
    const uint32_t mask = uint32_t(p.src_meta[2 * r + 1]);
    if (node == kPaddingMeta && mask == 0) continue;
    if (node < 0 || node >= N)
      record_fault(p.common, DEEPEP_FAULT_COMBINE_HANDLE, DEEPEP_HANDLE_SRC_META, 2 * r, node);
    else if ((G < 32 && (mask >> G) != 0) || !((mask >> my_gpu) & 1u))
      record_fault(p.common, DEEPEP_FAULT_COMBINE_HANDLE, DEEPEP_HANDLE_SRC_META, 2 * r + 1, int64_t(mask));
  }
}

// Returns the rows of fwd's ring (channel ch) its warps wrote, all members together.
template <int kRemote, bool kShrink>
__device__ int64_t combine_nvl_send(const DeepepInternodeCombineParams& p, const Transport<kRemote>& tr, int ch, int fwd,
                                 int member, int warps, int lane, uint32_t generation) {
  const DeepepInternodeCommon& c = p.common;
  const int N = c.num_nodes, G = c.node_size, C = c.num_channels, me = c.rank, my_gpu = me % G;
  const CombineRow row{p.hidden_bytes, p.num_topk};
  const normal::RingLayout nvl = nvl_rings(c, kNvlHeaderBytes + row.bytes());
  uint8_t* my_nvl = tr.local(c.nvl_offset);
  uint8_t* fwd_nvl = nvl_of(tr, fwd);
  int64_t k = 0;
  bool live = !skipped_warp<kShrink>(c, (me / G) * G + fwd);  // shrink mode: rows for a masked forwarder not sent
  int64_t not_sent = 0;
  for (int s = 0; s < N; ++s) {
    int64_t start, stop;
    if (!source_rows(p, s * G + fwd, ch, lane, start, stop)) break;
    for (int64_t r = start; r < stop; ++r, ++k) {
      if (k % warps != member) continue;
      if (kShrink && !live) {
        ++not_sent;
        continue;
      }
      if (k >= nvl.ring) {
        const uint64_t* consumed = reinterpret_cast<const uint64_t*>(my_nvl + nvl.consumed_offset(C, ch, fwd, k % nvl.ring));
        if (!nvl_wait_relaxed<kShrink>(consumed, make_flag(generation, k - nvl.ring), c, (me / G) * G + fwd,
                                       DEEPEP_WAIT_OP_NVL_CONSUMED, ch)) {
          if (!kShrink) return k;
          live = false;
          ++not_sent;
          continue;
        }
      }
      uint8_t* slot = fwd_nvl + nvl.slot_offset(ch, my_gpu, k % nvl.ring);
      warp_copy<4, CopyLoad::kStream>(reinterpret_cast<int4*>(slot + kNvlHeaderBytes),
                                      reinterpret_cast<const int4*>(static_cast<const uint8_t*>(p.x) + r * p.hidden_bytes),
                                      p.hidden_bytes / 16, lane);
      if (p.topk_weights != nullptr)
        for (int i = lane; i < p.num_topk; i += kWarp)
          reinterpret_cast<float*>(slot + kNvlHeaderBytes + row.weights_off())[i] = p.topk_weights[r * p.num_topk + i];
      __syncwarp();
      if (lane == 0) {
        fence_acq_rel_sys();
        st_relaxed_sys(reinterpret_cast<uint64_t*>(slot), make_flag(generation, k));
      }
    }
  }
  if (kShrink && lane == 0) count_dropped(c, DEEPEP_DROPPED_COMBINE_SEND, not_sent);
  return k;
}

template <int kRemote, bool kShrink>
__device__ void combine_forward(const DeepepInternodeCombineParams& p, const Transport<kRemote>& tr, int ch,
                                int src_node, const WarpGroup& group, int lane, uint32_t generation) {
  const DeepepInternodeCommon& c = p.common;
  const int R = c.num_ranks, N = c.num_nodes, G = c.node_size, C = c.num_channels, me = c.rank;
  const int my_node = me / G, my_gpu = me % G, dst = src_node * G + my_gpu;
  const CombineRow row{p.hidden_bytes, p.num_topk};
  const RdmaLayout rdma{row.bytes(), c.rdma_ring_tokens, N, C, R};
  const normal::RingLayout nvl = nvl_rings(c, kNvlHeaderBytes + row.bytes());
  const int K = p.num_topk, hidden_int4 = p.hidden_bytes / 16;
  // Segment (s, ch) of the scale-out receive space, and where each GPU's rows of it start in
  // that GPU's NVLink stream of channel ch (its rows of earlier source nodes come first).
  auto segment = [&](int s, int64_t& begin, int64_t& end) {
    const int64_t base = s > 0 ? p.rdma_rank_prefix_sum[s - 1] : 0;
    begin = base + (ch > 0 ? p.rdma_channel_prefix_matrix[s * C + ch - 1] : 0);
    end = base + p.rdma_channel_prefix_matrix[s * C + ch];
  };
  // Lane j < G: GPU j's rows before this segment; a row's place in GPU j's stream is this plus
  // its head (the row's index among the segment's rows that GPU j got).
  int64_t offset = 0;
  for (int s = 0; s < src_node; ++s) {
    int64_t b, e;
    segment(s, b, e);
    for (int j = 0; j < G; ++j) {
      int n = 0;
      for (int64_t r = max(b, int64_t(0)) + lane; r < min(e, p.num_rdma_recv_rows); r += kWarp)
        n += p.combined_nvl_head[r * G + j] >= 0;
      n = __reduce_add_sync(0xffffffffu, n);
      if (lane == j) offset += n;
    }
  }
  int64_t begin, end;
  segment(src_node, begin, end);
  // This GPU's rows come straight from x: its rows from source dst of channel ch.
  int64_t own_start, own_stop;
  bool ok = source_rows(p, dst, ch, lane, own_start, own_stop);
  if (begin < 0 || end > p.num_rdma_recv_rows || end < begin) {
    if (lane == 0) record_fault(c, DEEPEP_FAULT_COMBINE_HANDLE, DEEPEP_HANDLE_RECV_RDMA_CHANNEL_PREFIX, src_node * C + ch, end);
    return;  // the whole group returns (the range is the same for all its warps)
  }
  const uint64_t sent = c.totals[sent_total(c, ch, src_node)];
  const int chunk = send_chunk(c.rdma_ring_tokens);
  uint64_t freed = 0;  // head counter, last read
  uint8_t* my_nvl = tr.local(c.nvl_offset);
  // Shrink mode: whether rows still go back to dst (masked or gone: not sent, counted), and the
  // contributions of masked or gone local GPUs left out (counted).
  bool live = !skipped_warp<kShrink>(c, dst);
  int64_t not_sent = 0, left_out = 0;
  for (int64_t q0 = 0; q0 < end - begin; q0 += chunk) {
    const int n = int(min(int64_t(chunk), end - begin - q0));
    for (int64_t i = q0 + group.member; ok && i < q0 + n; i += group.warps) {
      const int32_t head = lane < G ? p.combined_nvl_head[(begin + i) * G + lane] : -1;
      uint32_t mask = __ballot_sync(0xffffffffu, head >= 0);
      if constexpr (kShrink) {
        const uint32_t gone_gpus =
            __ballot_sync(0xffffffffu, head >= 0 && lane != my_gpu && skipped<kShrink>(c, my_node * G + lane)) & mask;
        left_out += __popc(gone_gpus);
        mask &= ~gone_gpus;
      }
      // Lane j in mask: GPU j's row (this GPU's from x, the others' NVLink slots) and weights.
      const int64_t k = offset + head;  // lane j != my_gpu: the row's place in GPU j's stream
      const uint8_t* slot = nullptr;
      const int4* src = nullptr;
      const float* weights = nullptr;
      if (head >= 0 && lane != my_gpu) {
        slot = my_nvl + nvl.slot_offset(ch, lane, k % nvl.ring);
        src = reinterpret_cast<const int4*>(slot + kNvlHeaderBytes);
        weights = reinterpret_cast<const float*>(slot + kNvlHeaderBytes + row.weights_off());
      }
      if ((mask >> my_gpu) & 1u) {
        const int64_t r = own_start + __shfl_sync(0xffffffffu, head, my_gpu);
        if (r >= own_stop) {
          if (lane == 0)
            record_fault(c, DEEPEP_FAULT_COMBINE_HANDLE, DEEPEP_HANDLE_SEND_NVL_HEAD, (begin + i) * G + my_gpu, r - own_start);
          ok = false;
        } else if (lane == my_gpu) {
          src = reinterpret_cast<const int4*>(static_cast<const uint8_t*>(p.x) + r * p.hidden_bytes);
          weights = p.topk_weights != nullptr ? p.topk_weights + r * K : nullptr;
        }
      }
      for (uint32_t rest = mask & ~(1u << my_gpu); ok && rest != 0; rest &= rest - 1) {
        const int j = __ffs(rest) - 1;
        const uint64_t* flag = reinterpret_cast<const uint64_t*>(__shfl_sync(0xffffffffu, reinterpret_cast<uint64_t>(slot), j));
        if constexpr (kShrink) {
          if (!nvl_wait<kShrink>(flag, make_flag(generation, __shfl_sync(0xffffffffu, k, j)), c, my_node * G + j,
                                 DEEPEP_WAIT_OP_NVL_SLOT, ch)) {
            mask &= ~(1u << j);  // j went silent: its contribution left out
            ++left_out;
          }
        } else {
          ok = warp_wait(flag, make_flag(generation, __shfl_sync(0xffffffffu, k, j)), c.wait, my_node * G + j,
                         DEEPEP_WAIT_OP_NVL_SLOT, ch);
        }
      }
      if constexpr (kShrink) {
        live = live && !skipped_warp<kShrink>(c, dst) &&
               (i < c.rdma_ring_tokens || tr.wait_or_gone(dst, head_counter(c, ch, src_node), sent + i + 1 - c.rdma_ring_tokens, freed));
        if (!live) ++not_sent;
      } else {
        ok = ok && (i < c.rdma_ring_tokens ||
                    tr.wait_counter(dst, head_counter(c, ch, src_node), sent + i + 1 - c.rdma_ring_tokens, freed,
                                    DEEPEP_WAIT_OP_RDMA_HEAD, ch));
      }
      if (!ok) break;
      if (!kShrink || live) {
      uint8_t* out = tr.row_target(dst, c.rdma_offset + rdma.recv_slot(ch, my_node, i),
                                   c.rdma_offset + rdma.send_slot(ch, src_node, i));
      sum_rows(reinterpret_cast<int4*>(out), src, mask, hidden_int4, nullptr, nullptr, lane);
      sum_weights(reinterpret_cast<float*>(out + row.weights_off()), weights, mask, K, lane);
      }
      // The NVLink slots back to their writers.
      __syncwarp();
      if (head >= 0 && lane != my_gpu && (!kShrink || ((mask >> lane) & 1u)))
        st_relaxed_sys(reinterpret_cast<uint64_t*>(nvl_of(tr, lane) + nvl.consumed_offset(C, ch, my_gpu, k % nvl.ring)),
                       make_flag(generation, k));
    }
    group.sync();
    if (ok && (!kShrink || live) && group.leader(lane)) tr.publish(dst, rdma, ch, q0, n, tail_counter(c, ch, my_node));
  }
  if constexpr (kShrink) {
    if (lane == 0) {
      count_dropped(c, DEEPEP_DROPPED_COMBINE_SEND, not_sent);
      count_dropped(c, DEEPEP_DROPPED_COMBINE_RECV, left_out);
    }
    if (!live) return;  // the totals with a masked peer stay as they were
  }
  if (group.leader(lane)) {
    c.totals[sent_total(c, ch, src_node)] = sent + (end - begin);
    if (src_node != my_node) count_traffic(c, DEEPEP_TRAFFIC_COMBINE_SCALEOUT_ROWS, end - begin, row.bytes());
  }
}

// The final receiver's words in flight per lane for a token of two rows (N = 2, no bias: DeepEP's
// test shape): 16 (8 of each row; 64 registers, no spills with every word defined in
// sum_few_rows). Every warp of its block sums whole tokens one at a time, so the words in flight
// bound the block (docs/internode.md, "Combine's time"): with 8 a token of two 14 KB rows took 7
// round trips per warp, with 16 it takes 4.
constexpr int kReceiverPairLoads = 16;

// Final receiver warps (warp `w` of `num_warps`, named barrier 1 among them): source tokens of
// channel ch in batches of at most recv_round tokens (at most that many rows per node), a whole
// number of tokens per warp where the round allows (warp w takes tokens w, w + num_warps, ...);
// credits go back once per batch. Source nodes in chunks of kWarp lanes (one chunk up to 32
// nodes); `consumed` and `done` (shared, [N]): rows of each node read in this batch and op.
// G == 1: this node's row of a token is x's row the heads name (the forwarder's: segment
// (my node, ch) of combined_nvl_head, x's rows of this rank's channel ch), bounded and checked as
// combine_forward does, taken as_forwarded; no wait, no credit, no total for this node.
template <int kRemote, bool kShrink>
__device__ void combine_receive(const DeepepInternodeCombineParams& p, const Transport<kRemote>& tr, int ch, int w,
                                int num_warps, int lane, int* consumed, int* done) {
  const DeepepInternodeCommon& c = p.common;
  const int R = c.num_ranks, N = c.num_nodes, G = c.node_size, C = c.num_channels, me = c.rank;
  const int my_node = me / G, my_gpu = me % G;
  const CombineRow row{p.hidden_bytes, p.num_topk};
  const RdmaLayout rdma{row.bytes(), c.rdma_ring_tokens, N, C, R};
  const int K = p.num_topk, hidden_int4 = p.hidden_bytes / 16;
  const int4* bias_0 = static_cast<const int4*>(p.bias_0);
  const int4* bias_1 = static_cast<const int4*>(p.bias_1);
  const int round = recv_round(c.rdma_ring_tokens);
  const int batch = round >= num_warps ? round / num_warps * num_warps : round;
  const int chunks = (N + kWarp - 1) / kWarp;
  int64_t begin, end;
  channel_range(p.num_tokens, C, ch, begin, end);
  // Rows consumed of each node's ring before this op (totals change only at the end); heads
  // count from 0 per op. Lane n: node n's, and its tail counter last read (first chunk).
  const uint64_t base0 = lane < N ? c.totals[recv_total(c, ch, lane)] : 0;
  uint64_t tail = 0;
  bool ok = true;
  // G == 1: this node's segment of the scale-out receive space and x's rows of this rank's
  // channel ch (own_ok false: a fault was recorded; a token with a row here then stops the warp,
  // as a forwarder that gave up would have left it waiting).
  const bool own_direct = G == 1;
  const int lone = own_direct ? my_node : -1;  // the row taken as_forwarded
  int64_t own_begin = 0, own_len = 0, own_start = 0, own_stop = 0;
  bool own_ok = true;
  if (own_direct) {
    const int64_t base = my_node > 0 ? p.rdma_rank_prefix_sum[my_node - 1] : 0;
    own_begin = base + (ch > 0 ? p.rdma_channel_prefix_matrix[my_node * C + ch - 1] : 0);
    const int64_t own_end = base + p.rdma_channel_prefix_matrix[my_node * C + ch];
    own_len = own_end - own_begin;
    own_ok = source_rows(p, me, ch, lane, own_start, own_stop);
    if (own_begin < 0 || own_end > p.num_rdma_recv_rows || own_end < own_begin) {
      if (lane == 0)
        record_fault(c, DEEPEP_FAULT_COMBINE_HANDLE, DEEPEP_HANDLE_RECV_RDMA_CHANNEL_PREFIX, my_node * C + ch, own_end);
      own_ok = false;
    }
  }
  int64_t left_out = 0;  // shrink mode: (token, node) rows of a masked or gone forwarder
  for (int64_t t0 = begin; t0 < end; t0 += batch) {
    for (int64_t t = t0 + w; ok && t < min(t0 + batch, end); t += num_warps) {
      int32_t head0 = -1;  // lane n: node n's head (first chunk)
      int32_t own_head = -1;  // G == 1: this node's head (all lanes)
      for (int q = 0; ok && q < chunks; ++q) {
        const int n = q * kWarp + lane;
        int32_t head = n < N ? p.combined_rdma_head[t * N + n] : -1;
        const uint64_t base = q == 0 ? base0 : n < N ? c.totals[recv_total(c, ch, n)] : 0;
        uint32_t mask = __ballot_sync(0xffffffffu, head >= 0);
        if (own_direct && q == my_node / kWarp) {
          own_head = __shfl_sync(0xffffffffu, head, my_node % kWarp);
          mask &= ~(1u << (my_node % kWarp));  // no ring, nothing to wait for or to credit
        }
        if constexpr (kShrink) {
          // A masked or gone forwarder's row (node n's contributions to token t) is left out.
          const uint32_t gone_nodes = __ballot_sync(0xffffffffu, head >= 0 && skipped<kShrink>(c, n * G + my_gpu)) & mask;
          left_out += __popc(gone_nodes);
          mask &= ~gone_nodes;
        }
        for (uint32_t rest = mask; ok && rest != 0; rest &= rest - 1) {
          const int j = __ffs(rest) - 1;
          const uint64_t target = __shfl_sync(0xffffffffu, base + head + 1, j);
          uint64_t seen = q == 0 ? __shfl_sync(0xffffffffu, tail, j) : 0;
          if constexpr (kShrink) {
            if (!tr.wait_or_gone((q * kWarp + j) * G + my_gpu, tail_counter(c, ch, q * kWarp + j), target, seen)) {
              mask &= ~(1u << j);
              ++left_out;
            }
          } else {
            ok = tr.wait_counter((q * kWarp + j) * G + my_gpu, tail_counter(c, ch, q * kWarp + j), target, seen,
                                 DEEPEP_WAIT_OP_RDMA_TAIL, ch);
          }
          if (q == 0 && lane == j) tail = seen;
        }
        // Shrink mode: only the rows taken (G == 1: this node's row stays, read from x).
        if (kShrink && !((mask >> lane) & 1u) && n != lone) head = -1;
        if ((mask >> lane) & 1u) atomicAdd(&consumed[n], 1);
        if (q == 0) head0 = head;
      }
      // G == 1: this rank's own row of token t (as combine_forward finds it), or none.
      const int4* own_x = nullptr;
      const float* own_weights = nullptr;
      if (ok && own_head >= 0) {
        const int32_t nvl = own_ok && own_head < own_len ? p.combined_nvl_head[own_begin + own_head] : -1;
        const int64_t r = own_start + nvl;
        if (!own_ok) {
          ok = false;  // the fault is recorded
        } else if (own_head >= own_len) {
          if (lane == 0) record_fault(c, DEEPEP_FAULT_COMBINE_HANDLE, DEEPEP_HANDLE_SEND_RDMA_HEAD, t * N + my_node, own_head);
          ok = false;
        } else if (nvl < 0 || r >= own_stop) {
          if (lane == 0)
            record_fault(c, DEEPEP_FAULT_COMBINE_HANDLE, DEEPEP_HANDLE_SEND_NVL_HEAD, (own_begin + own_head) * G + my_gpu, nvl);
          ok = false;
        } else {
          own_x = reinterpret_cast<const int4*>(static_cast<const uint8_t*>(p.x) + r * p.hidden_bytes);
          own_weights = p.topk_weights != nullptr ? p.topk_weights + r * K : nullptr;
        }
      }
      if (!ok) break;
      // DeepEP's order: bias_0 + bias_1, then nodes ascending; one rounding.
      int4* out = reinterpret_cast<int4*>(static_cast<uint8_t*>(p.combined_x) + t * p.hidden_bytes);
      const int4* b0 = bias_0 != nullptr ? bias_0 + t * hidden_int4 : nullptr;
      const int4* b1 = bias_1 != nullptr ? bias_1 + t * hidden_int4 : nullptr;
      float* out_weights = p.combined_topk_weights != nullptr ? p.combined_topk_weights + t * K : nullptr;
      if (chunks == 1) {
        // Lane n in mask: node n's row of token t (G == 1, n = my node: x's).
        const uint32_t mask = __ballot_sync(0xffffffffu, head0 >= 0);
        const uint8_t* src = tr.local(c.rdma_offset + rdma.recv_slot(ch, lane < N ? lane : 0, max(head0, 0)));
        const bool mine = lane == lone;
        sum_rows<kReceiverPairLoads>(out, mine ? own_x : reinterpret_cast<const int4*>(src), mask, hidden_int4, b0, b1,
                                     lane, lone);
        if (out_weights != nullptr)
          sum_weights(out_weights, mine ? own_weights : reinterpret_cast<const float*>(src + row.weights_off()), mask, K,
                      lane, lone);
      } else {
        // More nodes than lanes: chunk q's rows (lane j: node q * kWarp + j's), heads read again.
        const auto slot_of = [&](int q, uint32_t& mask) {
          const int n = q * kWarp + lane;
          const int32_t head = n < N ? p.combined_rdma_head[t * N + n] : -1;
          // Shrink mode: nodes given up on are left out (one given up on after its row of this
          // token came is left out too, uncounted: past 32 nodes the heads are read again).
          mask = __ballot_sync(0xffffffffu, head >= 0 && !skipped<kShrink>(c, n * G + my_gpu));
          return tr.local(c.rdma_offset + rdma.recv_slot(ch, n < N ? n : 0, max(head, 0)));
        };
        const auto rows_of = [&](int q, const int4*& r, uint32_t& mask) {
          r = reinterpret_cast<const int4*>(slot_of(q, mask));  // the whole warp (a ballot)
          if (q * kWarp + lane == lone) r = own_x;
        };
        const auto weights_of = [&](int q, const float*& wts, uint32_t& mask) {
          wts = reinterpret_cast<const float*>(slot_of(q, mask) + row.weights_off());
          if (q * kWarp + lane == lone) wts = own_weights;
        };
        sum_row_chunks(out, rows_of, chunks, hidden_int4, b0, b1, lane, lone);
        if (out_weights != nullptr) sum_weight_chunks(out_weights, weights_of, chunks, K, lane, lone);
      }
    }
    asm volatile("bar.sync 1, %0;" ::"r"(num_warps * kWarp) : "memory");
    // Credits of the batch (one thread per node).
    for (int n = w * kWarp + lane; n < N; n += num_warps * kWarp) {
      if (consumed[n] == 0) continue;
      done[n] += consumed[n];
      if (ok && !skipped<kShrink>(c, n * G + my_gpu)) tr.add(n * G + my_gpu, head_counter(c, ch, my_node), uint64_t(consumed[n]));
      consumed[n] = 0;
    }
    asm volatile("bar.sync 1, %0;" ::"r"(num_warps * kWarp) : "memory");
  }
  for (int n = w * kWarp + lane; n < N; n += num_warps * kWarp) c.totals[recv_total(c, ch, n)] += uint64_t(done[n]);
  if (kShrink && lane == 0) count_dropped(c, DEEPEP_DROPPED_COMBINE_RECV, left_out);
}

// Fewer threads than the other internode kernels: 128 registers a thread hold the row sums'
// loads in flight (kSumLoads) without spilling; 16 warps cover 16 forwarder groups (more nodes:
// in turn), or 7 NVLink sender warps and 9 receiver warps.
constexpr int kCombineThreads = 512;
constexpr int kCombineWarps = kCombineThreads / kWarp;
static_assert(kMaxNodeSize - 1 < kCombineWarps / 2, "a warp per NVLink sender role");
// Dynamic shared memory: combine_receive's consumed [N] and done [N].
__host__ __device__ constexpr int64_t combine_shared_bytes(int num_nodes) { return 2 * int64_t(num_nodes) * 4; }
static_assert(combine_shared_bytes(DEEPEP_INTERNODE_MAX_NODES) <= 48 << 10, "without the opt-in to more shared memory");

template <int kRemote, bool kShrink>
__global__ void __launch_bounds__(kCombineThreads, 1) internode_combine_kernel(
    const __grid_constant__ ncclDevComm dev_comm, const __grid_constant__ DeepepInternodeCombineParams p) {
  const DeepepInternodeCommon& c = p.common;
  const Transport<kRemote> tr(c, dev_comm);
  const int C = c.num_channels, N = c.num_nodes, G = c.node_size, my_gpu = c.rank % G;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  extern __shared__ int node_rows[];  // consumed [N], done [N]
  for (int i = threadIdx.x; i < 2 * N; i += blockDim.x) node_rows[i] = 0;
  __syncthreads();
  const uint32_t generation = flag_generation(*c.op_epoch);
  if (p.src_meta != nullptr) check_src_meta(p);
  if (!normal::buffer_failed(c.wait)) {
    if (int(blockIdx.x) < C) {
      // Half the block (at least a warp each) sends to the other local GPUs, the rest receives.
      const int per_gpu = G > 1 ? max(1, kCombineWarps / 2 / (G - 1)) : 0, senders = (G - 1) * per_gpu;
      if (warp < senders) {
        const int r = warp / per_gpu;
        const int64_t rows =
            combine_nvl_send<kRemote, kShrink>(p, tr, blockIdx.x, r < my_gpu ? r : r + 1, warp % per_gpu, per_gpu, lane, generation);
        if (warp % per_gpu == 0 && lane == 0)
          count_traffic(c, DEEPEP_TRAFFIC_COMBINE_NVL_ROWS, rows,
                        kNvlHeaderBytes + CombineRow{p.hidden_bytes, p.num_topk}.bytes());
      } else {
        combine_receive<kRemote, kShrink>(p, tr, blockIdx.x, warp - senders, kCombineWarps - senders, lane, node_rows, node_rows + N);
      }
    } else {
      // Forwarder groups per source node; G == 1: the other N - 1 nodes, ascending (the final
      // receiver reads this node's rows from x).
      const int own = G == 1 ? 1 : 0, nodes = N - own, my_node = c.rank / G;
      const WarpGroup group(warp, nodes, kCombineWarps);
      if (group.role < group.groups)
        for (int i = group.role; i < nodes; i += group.groups)
          combine_forward<kRemote, kShrink>(p, tr, blockIdx.x - C, own && i >= my_node ? i + 1 : i, group, lane, generation);
    }
  }
  if (normal::buffer_failed(c.wait)) {
    normal::poison_output(p.combined_x, p.num_tokens * p.hidden_bytes);
    normal::poison_output(p.combined_topk_weights, p.num_tokens * p.num_topk * 4);
  }
  finish_op<kShrink>(c);
}

// The launcher's kernels, by [remote kind: emulated, GIN][shrink]. The GIN row is compiled in
// every build, as before; the launcher selects it only where DEEPEP_HAVE_GIN.
constexpr void (*kCombineKernels[2][2])(ncclDevComm, DeepepInternodeCombineParams) = {
    {internode_combine_kernel<ll::kRemoteEmulated, false>, internode_combine_kernel<ll::kRemoteEmulated, true>},
    {internode_combine_kernel<ll::kRemoteGin, false>, internode_combine_kernel<ll::kRemoteGin, true>},
};

}  // namespace internode

cudaError_t preload_internode_combine_kernels() { return load_kernels(internode::kCombineKernels); }

}  // namespace deepep

extern "C" int deepep_launch_internode_combine(const void* dev_comm, const DeepepInternodeCombineParams* params,
                                               int remote_kind, void* stream) {
  using namespace deepep::internode;
  const ncclDevComm& dc = *static_cast<const ncclDevComm*>(dev_comm);
  const auto s = static_cast<cudaStream_t>(stream);
  const int blocks = 2 * params->common.num_channels;
  const int N = params->common.num_nodes;
  if (N < 1 || N > DEEPEP_INTERNODE_MAX_NODES) return int(cudaErrorInvalidValue);
  const size_t smem = size_t(combine_shared_bytes(N));
  const bool shrink = params->common.shrink != 0;
  const int by_remote = remote_kind == DEEPEP_LL_REMOTE_EMULATED ? 0
                        : remote_kind == DEEPEP_LL_REMOTE_GIN && DEEPEP_HAVE_GIN ? 1
                                                                               : -1;
  if (by_remote < 0) return int(cudaErrorInvalidValue);
  return deepep::launch_kernel(kCombineKernels[by_remote][shrink ? 1 : 0], blocks, kCombineThreads, smem, s, dc, *params);
}
