// Internode combine data kernel (docs/internode.md, "Combine"), the reverse of dispatch. 2C blocks:
// * block c < C: NVLink sender groups (one per other local GPU l) send this rank's received rows
//   of sources (s, l), s ascending, channel c, into l's NVLink ring (c, my GPU), each warp every
//   group-size-th row; the other warps are the final receiver: for each source token of channel
//   c (in batches, warps striding over the batch's tokens) bias_0 + bias_1, then the nodes'
//   partial rows in ascending node, one rounding.
// * block C + c: forwarder groups (one per source node s) sum, per row of the scale-out receive
//   segment (s, c), the rows of the local GPUs in its mask (ascending GPU, fp32, from 0; this
//   GPU's rows straight from x), round to bf16 and write the row into the source (s, my GPU)'s
//   scale-out ring (c, my node), each warp every group-size-th row; one tail add per chunk.
// Heads were rewritten by the combine notify; an entry >= 0 is a row's sequence number.
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

// x's rows [start, stop) from source rank src in channel ch: the last channel of a source ends
// where the next source starts, the last source at x's rows (DeepEP's: combine takes no
// recv_gbl_rank_prefix_sum). False (a fault recorded) for a range outside x.
__device__ bool source_rows(const DeepepInternodeCombineParams& p, int src, int ch, int lane, int64_t& start,
                            int64_t& stop) {
  const int C = p.common.num_channels;
  start = p.gbl_channel_prefix_matrix[src * C + ch];
  stop = ch + 1 < C                     ? p.gbl_channel_prefix_matrix[src * C + ch + 1]
         : src + 1 < p.common.num_ranks ? p.gbl_channel_prefix_matrix[(src + 1) * C]
                                        : p.num_recv_rows;
  if (start >= 0 && stop >= start && stop <= p.num_recv_rows) return true;
  if (lane == 0)
    record_fault(p.common.fault, DEEPEP_FAULT_COMBINE_HANDLE, DEEPEP_HANDLE_RECV_CHANNEL_PREFIX, src * C + ch,
                 start < 0 ? start : stop);
  return false;
}

template <int kRemote>
__device__ void combine_nvl_send(const DeepepInternodeCombineParams& p, const Transport<kRemote>& tr, int ch, int fwd,
                                 int member, int warps, int lane, uint32_t generation) {
  const DeepepInternodeCommon& c = p.common;
  const int N = c.num_nodes, G = c.node_size, C = c.num_channels, me = c.rank, my_gpu = me % G;
  const CombineRow row{p.hidden_bytes, p.num_topk};
  const normal::RingLayout nvl = nvl_rings(c, kNvlHeaderBytes + row.bytes());
  uint8_t* my_nvl = tr.local(c.nvl_offset);
  uint8_t* fwd_nvl = nvl_of(tr, fwd);
  int64_t k = 0;
  for (int s = 0; s < N; ++s) {
    int64_t start, stop;
    if (!source_rows(p, s * G + fwd, ch, lane, start, stop)) return;
    for (int64_t r = start; r < stop; ++r, ++k) {
      if (k % warps != member) continue;
      if (k >= nvl.ring) {
        const uint64_t* consumed = reinterpret_cast<const uint64_t*>(my_nvl + nvl.consumed_offset(C, ch, fwd, k % nvl.ring));
        if (!warp_wait_relaxed(consumed, make_flag(generation, k - nvl.ring), c.wait, (me / G) * G + fwd,
                               DEEPEP_WAIT_OP_NVL_CONSUMED, ch))
          return;
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
}

template <int kRemote>
__device__ void combine_forward(const DeepepInternodeCombineParams& p, const Transport<kRemote>& tr, int ch,
                                const WarpGroup& group, int lane, uint32_t generation) {
  const DeepepInternodeCommon& c = p.common;
  const int R = c.num_ranks, N = c.num_nodes, G = c.node_size, C = c.num_channels, me = c.rank;
  const int src_node = group.role, my_node = me / G, my_gpu = me % G, dst = src_node * G + my_gpu;
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
    if (lane == 0) record_fault(c.fault, DEEPEP_FAULT_COMBINE_HANDLE, DEEPEP_HANDLE_RECV_CHANNEL_PREFIX, src_node * C + ch, end);
    return;  // the whole group returns (the range is the same for all its warps)
  }
  const uint64_t sent = c.totals[sent_total(ch, src_node)];
  const int chunk = send_chunk(c.rdma_ring_tokens);
  uint64_t freed = 0;  // head counter, last read
  uint8_t* my_nvl = tr.local(c.nvl_offset);
  for (int64_t q0 = 0; q0 < end - begin; q0 += chunk) {
    const int n = int(min(int64_t(chunk), end - begin - q0));
    for (int64_t i = q0 + group.member; ok && i < q0 + n; i += group.warps) {
      const int32_t head = lane < G ? p.combined_nvl_head[(begin + i) * G + lane] : -1;
      const uint32_t mask = __ballot_sync(0xffffffffu, head >= 0);
      const uint8_t* source[kMaxNodeSize];  // row j: x (bf16), then weights at weights_off
      const float* own_weights = nullptr;     // this GPU's weights (x's rows have none inline)
#pragma unroll
      for (int j = 0; j < kMaxNodeSize; ++j) {
        source[j] = nullptr;
        if (!((mask >> j) & 1u)) continue;
        const int64_t h = __shfl_sync(0xffffffffu, head, j);
        if (j == my_gpu) {
          const int64_t r = own_start + h;
          if (r >= own_stop) {
            if (lane == 0) record_fault(c.fault, DEEPEP_FAULT_COMBINE_HANDLE, DEEPEP_HANDLE_RECV_CHANNEL_PREFIX, dst * C + ch, r);
            ok = false;
            continue;
          }
          source[j] = static_cast<const uint8_t*>(p.x) + r * p.hidden_bytes;
          if (p.topk_weights != nullptr) own_weights = p.topk_weights + r * K;
          continue;
        }
        const int64_t k = __shfl_sync(0xffffffffu, offset + head, j);
        source[j] = my_nvl + nvl.slot_offset(ch, j, k % nvl.ring);
        ok = ok && warp_wait(reinterpret_cast<const uint64_t*>(source[j]), make_flag(generation, k), c.wait,
                             my_node * G + j, DEEPEP_WAIT_OP_NVL_SLOT, ch);
        source[j] += kNvlHeaderBytes;
      }
      ok = ok && (i < c.rdma_ring_tokens ||
                  tr.wait_counter(dst, head_counter(ch, src_node), sent + i + 1 - c.rdma_ring_tokens, freed,
                                  DEEPEP_WAIT_OP_RDMA_HEAD, ch));
      if (!ok) break;
      uint8_t* out = tr.row_target(dst, c.rdma_offset + rdma.recv_slot(ch, my_node, i),
                                   c.rdma_offset + rdma.send_slot(ch, src_node, i));
      for (int v = lane; v < hidden_int4; v += kWarp) {
        float acc[8] = {};
#pragma unroll
        for (int j = 0; j < kMaxNodeSize; ++j)
          if (source[j] != nullptr) accumulate(acc, ld_ring(reinterpret_cast<const int4*>(source[j]) + v));
        reinterpret_cast<int4*>(out)[v] = pack_bf16(acc);
      }
      for (int w = lane; w < K; w += kWarp) {
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < kMaxNodeSize; ++j) {
          if (source[j] == nullptr) continue;
          const float* weights = j == my_gpu ? own_weights : reinterpret_cast<const float*>(source[j] + row.weights_off());
          if (weights != nullptr) acc += weights[w];
        }
        reinterpret_cast<float*>(out + row.weights_off())[w] = acc;
      }
      // The NVLink slots back to their writers.
      __syncwarp();
      if (head >= 0 && lane != my_gpu) {
        const int64_t k = offset + head;
        st_relaxed_sys(reinterpret_cast<uint64_t*>(nvl_of(tr, lane) + nvl.consumed_offset(C, ch, my_gpu, k % nvl.ring)),
                       make_flag(generation, k));
      }
    }
    group.sync();
    if (ok && group.leader(lane)) tr.publish(dst, rdma, ch, q0, n, tail_counter(ch, my_node));
  }
  if (group.leader(lane)) c.totals[sent_total(ch, src_node)] = sent + (end - begin);
}

// Final receiver warps (warp `w` of `num_warps`, named barrier 1 among them): source tokens of
// channel ch in batches of recv_round tokens (at most that many rows per node), warp w taking
// tokens w, w + num_warps, ...; credits go back once per batch.
template <int kRemote>
__device__ void combine_receive(const DeepepInternodeCombineParams& p, const Transport<kRemote>& tr, int ch, int w,
                                int num_warps, int lane, int* consumed) {
  const DeepepInternodeCommon& c = p.common;
  const int R = c.num_ranks, N = c.num_nodes, G = c.node_size, C = c.num_channels, me = c.rank;
  const int my_node = me / G, my_gpu = me % G;
  const CombineRow row{p.hidden_bytes, p.num_topk};
  const RdmaLayout rdma{row.bytes(), c.rdma_ring_tokens, N, C, R};
  const int K = p.num_topk, hidden_int4 = p.hidden_bytes / 16;
  const int4* bias_0 = static_cast<const int4*>(p.bias_0);
  const int4* bias_1 = static_cast<const int4*>(p.bias_1);
  const int batch = recv_round(c.rdma_ring_tokens);
  int64_t begin, end;
  channel_range(p.num_tokens, C, ch, begin, end);
  // Rows consumed of each node's ring before this op (lane n); heads count from 0 per op.
  const uint64_t base = lane < N ? c.totals[recv_total(ch, lane)] : 0;
  uint64_t tail = 0;  // lane n: node n's tail counter, last read
  int64_t done = 0;   // warp 0, lane n: rows of node n consumed in this op
  bool ok = true;
  for (int64_t t0 = begin; t0 < end; t0 += batch) {
    int used = 0;  // lane n: rows of node n this warp read in this batch
    for (int64_t t = t0 + w; ok && t < min(t0 + batch, end); t += num_warps) {
      const int32_t head = lane < N ? p.combined_rdma_head[t * N + lane] : -1;
      const uint32_t mask = __ballot_sync(0xffffffffu, head >= 0);
      const uint8_t* source[kMaxNodes];
#pragma unroll
      for (int n = 0; n < kMaxNodes; ++n) {
        source[n] = nullptr;
        if (!((mask >> n) & 1u)) continue;
        const int64_t k = __shfl_sync(0xffffffffu, head, n);
        const uint64_t target = __shfl_sync(0xffffffffu, base, n) + k + 1;
        uint64_t seen = __shfl_sync(0xffffffffu, tail, n);
        ok = ok && tr.wait_counter(n * G + my_gpu, tail_counter(ch, n), target, seen, DEEPEP_WAIT_OP_RDMA_TAIL, ch);
        if (lane == n) tail = seen;
        source[n] = tr.local(c.rdma_offset + rdma.recv_slot(ch, n, k));
      }
      if (!ok) break;
      int4* out = reinterpret_cast<int4*>(static_cast<uint8_t*>(p.combined_x) + t * p.hidden_bytes);
      for (int v = lane; v < hidden_int4; v += kWarp) {
        // DeepEP's order: bias_0 + bias_1, then nodes ascending; one rounding.
        const int4 b0 = bias_0 != nullptr ? ld_stream(bias_0 + t * hidden_int4 + v) : make_int4(0, 0, 0, 0);
        const int4 b1 = bias_1 != nullptr ? ld_stream(bias_1 + t * hidden_int4 + v) : make_int4(0, 0, 0, 0);
        const __nv_bfloat16* v0 = reinterpret_cast<const __nv_bfloat16*>(&b0);
        const __nv_bfloat16* v1 = reinterpret_cast<const __nv_bfloat16*>(&b1);
        float acc[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = __bfloat162float(v0[e]) + __bfloat162float(v1[e]);
#pragma unroll
        for (int n = 0; n < kMaxNodes; ++n)
          if (source[n] != nullptr) accumulate(acc, ld_ring(reinterpret_cast<const int4*>(source[n]) + v));
        out[v] = pack_bf16(acc);
      }
      if (p.combined_topk_weights != nullptr) {
        for (int i = lane; i < K; i += kWarp) {
          float acc = 0.0f;
#pragma unroll
          for (int n = 0; n < kMaxNodes; ++n)
            if (source[n] != nullptr) acc += reinterpret_cast<const float*>(source[n] + row.weights_off())[i];
          p.combined_topk_weights[t * K + i] = acc;
        }
      }
      used += head >= 0;
    }
    if (lane < N && used > 0) atomicAdd(&consumed[lane], used);
    asm volatile("bar.sync 1, %0;" ::"r"(num_warps * kWarp) : "memory");
    // Credits of the batch (one thread per node).
    if (w == 0 && lane < N && consumed[lane] > 0) {
      done += consumed[lane];
      if (ok) tr.add(lane * G + my_gpu, head_counter(ch, my_node), uint64_t(consumed[lane]));
      consumed[lane] = 0;
    }
    asm volatile("bar.sync 1, %0;" ::"r"(num_warps * kWarp) : "memory");
  }
  if (w == 0 && lane < N) c.totals[recv_total(ch, lane)] = base + done;
}

template <int kRemote>
__global__ void __launch_bounds__(kThreads, 1) internode_combine_kernel(ncclDevComm dev_comm,
                                                                        DeepepInternodeCombineParams p) {
  const DeepepInternodeCommon& c = p.common;
  const Transport<kRemote> tr(c, dev_comm);
  const int C = c.num_channels, N = c.num_nodes, G = c.node_size, my_gpu = c.rank % G;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  __shared__ int consumed[kMaxNodes];
  if (threadIdx.x < kMaxNodes) consumed[threadIdx.x] = 0;
  __syncthreads();
  const uint32_t generation = flag_generation(*c.op_epoch);
  if (!normal::buffer_failed(c.wait)) {
    if (int(blockIdx.x) < C) {
      // Half the block (at least a warp each) sends to the other local GPUs, the rest receives.
      const int per_gpu = G > 1 ? max(1, kWarps / 2 / (G - 1)) : 0, senders = (G - 1) * per_gpu;
      if (warp < senders) {
        const int r = warp / per_gpu;
        combine_nvl_send(p, tr, blockIdx.x, r < my_gpu ? r : r + 1, warp % per_gpu, per_gpu, lane, generation);
      } else {
        combine_receive(p, tr, blockIdx.x, warp - senders, kWarps - senders, lane, consumed);
      }
    } else {
      const WarpGroup group(warp, N);
      if (group.role < N) combine_forward(p, tr, blockIdx.x - C, group, lane, generation);
    }
  }
  if (normal::buffer_failed(c.wait)) {
    normal::poison_output(p.combined_x, p.num_tokens * p.hidden_bytes);
    normal::poison_output(p.combined_topk_weights, p.num_tokens * p.num_topk * 4);
  }
  finish_op(c);
}

}  // namespace internode
}  // namespace deepep

extern "C" int deepep_launch_internode_combine(const void* dev_comm, const DeepepInternodeCombineParams* params,
                                               int remote_kind, void* stream) {
  using namespace deepep::internode;
  const ncclDevComm& dc = *static_cast<const ncclDevComm*>(dev_comm);
  const auto s = static_cast<cudaStream_t>(stream);
  const int blocks = 2 * params->common.num_channels;
  if (remote_kind == DEEPEP_LL_REMOTE_EMULATED)
    return deepep::launch_kernel(internode_combine_kernel<deepep::ll::kRemoteEmulated>, blocks, kThreads, 0, s, dc,
                                 *params);
  if (remote_kind == DEEPEP_LL_REMOTE_GIN && DEEPEP_HAVE_GIN)
    return deepep::launch_kernel(internode_combine_kernel<deepep::ll::kRemoteGin>, blocks, kThreads, 0, s, dc, *params);
  return int(cudaErrorInvalidValue);
}
