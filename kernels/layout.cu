// get_dispatch_layout: one pass over topk_idx.
//
// Each block takes tiles of tokens. Per token a thread marks its ranks in a
// shared-memory row of is_token_in_rank (first mark of a rank counts the token
// for that rank), and counts every valid expert slot. Rows are written out with
// coalesced stores. Block histograms are added (fire-and-forget atomics) into
// zeroed workspace accumulators; the last block to finish (ticket) moves them
// to the outputs and re-zeroes them, so the outputs need no memset and no
// block waits on a chain of dependent loads. Integer sums are order-independent,
// so the result is deterministic.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "deepep_kernels.h"
#include "launch.cuh"

namespace deepep {

constexpr int kLayoutThreads = 256;
constexpr int kMaxTileTokens = 256;
constexpr int kMinTileTokens = 32;
constexpr size_t kLayoutSmemBudget = 96 * 1024;
constexpr int kSlotsPerBatch = 8;

struct LayoutGeometry {
  int tile_tokens;
  int num_blocks;
  int num_counters;  // experts + ranks + rdma ranks
  size_t counters_bytes;
  size_t smem_bytes;
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline LayoutGeometry layout_geometry(const DeepepLayoutParams& p) {
  LayoutGeometry g;
  g.num_counters = p.num_experts + p.num_ranks + p.num_rdma_ranks;
  g.counters_bytes = ceil_div(int64_t(g.num_counters) * 4, 16) * 16;
  // Aim for ~16 blocks of one token per thread: each thread keeps 8 loads in flight.
  int64_t tile = ceil_div(std::max<int64_t>(p.num_tokens, 1), 16);
  tile = ceil_div(tile, kMinTileTokens) * kMinTileTokens;
  tile = std::min<int64_t>(std::max<int64_t>(tile, kMinTileTokens), kMaxTileTokens);
  // Keep the shared row tile within budget for large rank counts.
  while (tile > kMinTileTokens && g.counters_bytes + size_t(tile) * p.num_ranks > kLayoutSmemBudget) tile /= 2;
  g.tile_tokens = int(tile);
  const int64_t tiles = std::max<int64_t>(ceil_div(p.num_tokens, tile), 1);
  g.num_blocks = int(std::min<int64_t>(tiles, std::max(2 * p.num_sms, 1)));
  g.smem_bytes = g.counters_bytes + size_t(g.tile_tokens) * p.num_ranks;
  return g;
}

template <typename IdxT>
__global__ void __launch_bounds__(kLayoutThreads)
    dispatch_layout_kernel(DeepepLayoutParams p, int tile_tokens, int counters_bytes) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int num_experts = p.num_experts, num_ranks = p.num_ranks, num_rdma = p.num_rdma_ranks;
  const int num_counters = num_experts + num_ranks + num_rdma;
  int* expert_count = reinterpret_cast<int*>(smem);
  int* rank_count = expert_count + num_experts;
  int* rdma_count = rank_count + num_ranks;
  unsigned char* rows = smem + counters_bytes;
  const int experts_per_rank = num_experts / num_ranks;
  const int ranks_per_node = p.num_ranks_per_rdma_rank;
  const IdxT* topk = static_cast<const IdxT*>(p.topk_idx);

  for (int i = threadIdx.x; i < num_counters; i += blockDim.x) expert_count[i] = 0;

  for (int64_t tile_begin = int64_t(blockIdx.x) * tile_tokens; tile_begin < p.num_tokens;
       tile_begin += int64_t(gridDim.x) * tile_tokens) {
    const int64_t remaining = p.num_tokens - tile_begin;
    const int n = remaining < tile_tokens ? int(remaining) : tile_tokens;
    const int row_bytes = n * num_ranks;
    for (int i = threadIdx.x; i < (row_bytes + 3) / 4; i += blockDim.x) reinterpret_cast<uint32_t*>(rows)[i] = 0;
    __syncthreads();

    for (int t = threadIdx.x; t < n; t += blockDim.x) {
      unsigned char* row = rows + t * num_ranks;
      const IdxT* slots = topk + (tile_begin + t) * p.num_topk;
      for (int k0 = 0; k0 < p.num_topk; k0 += kSlotsPerBatch) {
        int64_t experts[kSlotsPerBatch];
#pragma unroll
        for (int j = 0; j < kSlotsPerBatch; ++j)
          experts[j] = k0 + j < p.num_topk ? static_cast<int64_t>(__ldg(slots + k0 + j)) : -1;
#pragma unroll
        for (int j = 0; j < kSlotsPerBatch; ++j) {
          const int64_t expert = experts[j];
          if (expert < 0 || expert >= num_experts) continue;  // -1: no selection
          atomicAdd(&expert_count[expert], 1);
          const int rank = int(expert) / experts_per_rank;
          if (row[rank] == 0) {  // only this thread touches this row
            row[rank] = 1;
            atomicAdd(&rank_count[rank], 1);
          }
        }
      }
      for (int node = 0; node < num_rdma; ++node) {
        bool any = false;
        for (int r = node * ranks_per_node; r < (node + 1) * ranks_per_node; ++r) any |= (row[r] != 0);
        if (any) atomicAdd(&rdma_count[node], 1);
      }
    }
    __syncthreads();

    // Coalesced copy of the tile's rows; tile_begin * num_ranks is a multiple
    // of 32, so the vector path only depends on the output base alignment.
    unsigned char* dst = p.is_token_in_rank + tile_begin * num_ranks;
    int done = 0;
    if ((reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
      const int vecs = row_bytes / 16;
      for (int i = threadIdx.x; i < vecs; i += blockDim.x)
        reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(rows)[i];
      done = vecs * 16;
    }
    for (int i = done + threadIdx.x; i < row_bytes; i += blockDim.x) dst[i] = rows[i];
    __syncthreads();
  }

  int32_t* accumulators = p.accumulators;
  for (int i = threadIdx.x; i < num_counters; i += blockDim.x) {
    if (expert_count[i] != 0) atomicAdd(accumulators + i, expert_count[i]);
  }
  __threadfence();
  __syncthreads();

  __shared__ bool is_last_block;
  if (threadIdx.x == 0) is_last_block = (atomicAdd(p.ticket, 1u) == gridDim.x - 1);
  __syncthreads();
  if (!is_last_block) return;
  __threadfence();

  for (int i = threadIdx.x; i < num_counters; i += blockDim.x) {
    const int32_t sum = atomicExch(accumulators + i, 0);  // read and reset for the next launch
    if (i < num_experts) {
      p.num_tokens_per_expert[i] = sum;
    } else if (i < num_experts + num_ranks) {
      p.num_tokens_per_rank[i - num_experts] = sum;
    } else {
      p.num_tokens_per_rdma_rank[i - num_experts - num_ranks] = sum;
    }
  }
  if (threadIdx.x == 0) *p.ticket = 0;  // ready for the next launch on this stream
}

// The launcher's kernels, by the top-k ids' type: int64, int32.
constexpr void (*kLayoutKernels[2])(DeepepLayoutParams, int, int) = {dispatch_layout_kernel<int64_t>,
                                                                     dispatch_layout_kernel<int32_t>};

}  // namespace deepep

// NCCL-independent (one copy, global): each build's deepep_preload_kernels calls it.
extern "C" int deepep_preload_layout_kernels(void) { return int(deepep::load_kernels(deepep::kLayoutKernels)); }

extern "C" int64_t deepep_dispatch_layout_workspace_elems(const DeepepLayoutParams* params) {
  return int64_t(deepep::layout_geometry(*params).num_counters);
}

extern "C" int deepep_launch_dispatch_layout(const DeepepLayoutParams* params, void* stream) {
  const DeepepLayoutParams& p = *params;
  const deepep::LayoutGeometry g = deepep::layout_geometry(p);
  if (g.num_counters > p.accumulators_capacity) return int(cudaErrorInvalidValue);
  const auto kernel = deepep::kLayoutKernels[p.topk_idx_is_int32 ? 1 : 0];
  return deepep::launch_kernel(kernel, g.num_blocks, deepep::kLayoutThreads, g.smem_bytes,
                               static_cast<cudaStream_t>(stream), p, g.tile_tokens, int(g.counters_bytes));
}
