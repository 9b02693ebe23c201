// Internode notify: one block. Dispatch: turns is_token_in_rank into the sender's prefix
// matrices (per destination rank and node), sends every rank its slot (the rank's channel
// prefixes, the node's channel prefixes for the same-GPU forwarder, the rank's expert counts),
// waits for all R slots, and derives the receive side. Combine (p.dispatch 0): the
// same round without data, then DeepEP's rewrite of the two head tensors in place. The mode is
// p.dispatch, not is_token_in_rank: a dispatch of 0 tokens has no tensor data (NULL).
// The round is an all-to-all, so after it every rank has finished its previous data kernel:
// the data kernel that follows may start its rings empty. Slots are double-buffered by the
// round's parity (a rank can be one round ahead of another, never two: each round waits for all).
//
// Shrink mode (docs/internode.md, "Shrink"): masked ranks get no slot and are not waited for; a
// rank whose slot does not come within the timeout, or does not carry this round's tag, is
// absent, and so is every source whose forwarder on this node is absent (its rows would come
// through it): an absent source's slot reads as zeros (its rows absent from every count). The
// absent are masked before the receive side is derived (one block: the kernel's own reads).
#include <climits>

#include "internode_common.cuh"
#include "launch.cuh"

namespace deepep {
namespace internode {

// DeepEP's in-place head rewrite, over one segment [begin, end) of a column, by one warp (32
// rows at a time: the segments are long and few): a negative entry becomes -(the next
// non-negative entry below it) - 1, or -kHeadNone - 1. Idempotent. The non-negative entries must
// count 0, 1, 2, ... (each is a row's place in its ring or stream): the first that does not is a
// fault naming `entry` (flat index into `head`). Not repaired: a wait for a row that never comes
// expires (bounded).
__device__ __forceinline__ void rewrite_segment(const DeepepInternodeCommon& c, int entry, int32_t* head,
                                                int64_t stride, int64_t begin, int64_t end, int64_t column, int lane) {
  const uint32_t below = (1u << lane) - 1u;  // lanes before this one
  int32_t expect = 0;
  for (int64_t base = begin; base < end; base += kWarp) {
    const int64_t i = base + lane;
    const int32_t h = i < end ? head[i * stride] : -1;
    const uint32_t kept = __ballot_sync(0xffffffffu, h >= 0);
    const uint32_t wrong = __ballot_sync(0xffffffffu, h >= 0 && h != expect + __popc(kept & below));
    if (wrong != 0) {
      if (lane == __ffs(wrong) - 1) record_fault(c, DEEPEP_FAULT_COMBINE_HANDLE, entry, i * stride + column, h);
      break;
    }
    expect += __popc(kept);
  }
  int32_t next = kHeadNone;  // the first non-negative entry below the rows done
  for (int64_t top = end; top > begin; top -= kWarp) {
    const int64_t i = top - kWarp + lane;  // lanes below begin take no part
    const int32_t h = i >= begin ? head[i * stride] : -1;
    const uint32_t kept = __ballot_sync(0xffffffffu, h >= 0);
    const uint32_t after = kept & ~(below | (1u << lane));  // kept lanes past this one
    const int32_t from = __shfl_sync(0xffffffffu, h, after != 0 ? __ffs(after) - 1 : lane);
    if (i >= begin && h < 0) head[i * stride] = -(after != 0 ? from : next) - 1;
    if (kept != 0) next = __shfl_sync(0xffffffffu, h, __ffs(kept) - 1);
  }
}

// Shrink mode: the last int of a notify slot is its sender's tag, flag_generation(round); what a
// sender leaves there for a peer silent in its round is never a tag (bit 30 clear), so the peer,
// reaching that round late (it skipped it), finds the sender absent instead of stale counts.
constexpr int kNotifyTag = DEEPEP_INTERNODE_NOTIFY_SLOT_INTS - 1;
constexpr int32_t kNotifyNoTag = 0;

template <int kRemote, bool kShrink>
__global__ void __launch_bounds__(kNotifyThreads) internode_notify_kernel(ncclDevComm dev_comm,
                                                                        DeepepInternodeNotifyParams p) {
  const DeepepInternodeCommon& c = p.common;
  const Transport<kRemote> tr(c, dev_comm);
  const int R = c.num_ranks, N = c.num_nodes, G = c.node_size, C = c.num_channels, me = c.rank;
  const int my_gpu = me % G;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, num_warps = blockDim.x / kWarp;
  const bool with_data = p.dispatch != 0;
  const int local_experts = (with_data && !p.cached) ? p.num_experts / R : 0;
  const RdmaLayout rdma{0, 0, N, C, R};
  __shared__ int failed;
  if (normal::buffer_failed(c.wait)) return;
  if (threadIdx.x == 0) failed = 0;
  const uint64_t round = c.totals[notify_rounds(c)];
  const int parity = int(round & 1);
  const int32_t tag = int32_t(flag_generation(uint32_t(round)));

  // 1. The sender's prefix matrices (inclusive over channels). Item i < R * C is rank i / C's
  // channel i % C, the others node (i - R * C) / C's.
  const auto matrix = [&](int i) {
    return i < R * C ? p.gbl_channel_prefix_matrix + i : p.rdma_channel_prefix_matrix + (i - R * C);
  };
  const auto count_of = [&](int i) {  // item i's tokens (is_token_in_rank); the whole warp calls
    const bool per_rank = i < R * C;
    const int row = per_rank ? i / C : (i - R * C) / C, ch = i % C;
    int64_t begin, end;
    channel_range(p.num_tokens, C, ch, begin, end);
    int count = 0;
    for (int64_t t = begin + lane; t < end; t += kWarp) {
      const uint8_t* in = p.is_token_in_rank + t * R;
      if (per_rank) {
        count += in[row] != 0;
      } else {
        bool any = false;
        for (int g = 0; g < G; ++g) any |= in[row * G + g] != 0;
        count += any;
      }
    }
    return __reduce_add_sync(0xffffffffu, count);
  };
  bool build = with_data && !p.cached;
  if (with_data && p.cached) {
    // The handle's matrices tell the peers how many rows this rank sends, and the data kernel
    // sends is_token_in_rank's: the first entry that disagrees is a fault, and the matrices are
    // rebuilt from is_token_in_rank so that peers expect what is sent (no stall, no ring out of step).
    __shared__ int bad_item;
    if (threadIdx.x == 0) bad_item = INT_MAX;
    __syncthreads();
    for (int i = warp; i < (R + N) * C; i += num_warps) {
      const int32_t* m = matrix(i);
      const int64_t v = *m, prev = i % C > 0 ? m[-1] : 0;
      const int count = count_of(i);
      if (lane == 0 && (v < 0 || v > p.num_tokens || v - prev != count)) atomicMin(&bad_item, i);
    }
    __syncthreads();
    build = bad_item != INT_MAX;
    if (build && threadIdx.x == 0) {
      const int i = bad_item;
      record_fault(c, DEEPEP_FAULT_DISPATCH_HANDLE,
                   i < R * C ? DEEPEP_HANDLE_GBL_CHANNEL_PREFIX : DEEPEP_HANDLE_RDMA_CHANNEL_PREFIX,
                   i < R * C ? i : i - R * C, *matrix(i));
    }
    __syncthreads();
  }
  if (build) {
    for (int i = warp; i < (R + N) * C; i += num_warps) {
      const int count = count_of(i);
      if (lane == 0) *matrix(i) = count;
    }
    normal::check_topk_ids(c, p);
    __syncthreads();
    for (int row = threadIdx.x; row < R + N; row += blockDim.x) {
      int32_t* m = matrix(row * C);
      for (int ch = 1; ch < C; ++ch) m[ch] += m[ch - 1];
      if (row < R && p.num_tokens_per_rank != nullptr && C > 0 && p.num_tokens_per_rank[row] != m[C - 1])
        record_fault(c, DEEPEP_FAULT_RANK_COUNT, row, p.num_tokens_per_rank[row], m[C - 1]);
      if (row >= R && p.num_tokens_per_rdma_rank != nullptr && C > 0 && p.num_tokens_per_rdma_rank[row - R] != m[C - 1])
        record_fault(c, DEEPEP_FAULT_RDMA_RANK_COUNT, row - R, p.num_tokens_per_rdma_rank[row - R], m[C - 1]);
    }
  }
  __syncthreads();

  // 2. One slot to every rank (a warp per destination), then its notify counter.
  for (int dst = warp; dst < R; dst += num_warps) {
    if (masked<kShrink>(c, dst)) continue;
    const uint64_t recv_off = c.rdma_offset + rdma.notify_recv(parity, me);
    const uint64_t send_off = c.rdma_offset + rdma.notify_send(parity, dst);
    int32_t* slot = reinterpret_cast<int32_t*>(tr.row_target(dst, recv_off, send_off));
    const int ints = with_data ? 2 * C + local_experts : 0;
    const bool forwarder = dst % G == my_gpu;
    for (int i = lane; i < ints; i += kWarp) {
      int32_t v;
      if (i < C) v = p.gbl_channel_prefix_matrix[dst * C + i];
      else if (i < 2 * C) v = forwarder ? p.rdma_channel_prefix_matrix[(dst / G) * C + i - C] : 0;
      else v = p.num_tokens_per_expert[dst * local_experts + (i - 2 * C)];
      slot[i] = v;
    }
    if (kShrink && lane == 0) slot[kNotifyTag] = tag;
    if (kShrink) {
      tr.put_add(dst, recv_off, send_off, kNotifySlotBytes, notify_counter(c, me), lane);
    } else if (ints > 0) {
      tr.put_add(dst, recv_off, send_off, align16(int64_t(ints) * 4), notify_counter(c, me), lane);
    } else {
      __syncwarp();
      if (lane == 0) tr.add(dst, notify_counter(c, me), 1);
    }
  }

  // 3. Every rank's slot of this round.
  for (int src = threadIdx.x; src < R; src += blockDim.x) {
    if constexpr (kShrink) {
      uint64_t seen = 0;  // an expiry marks src gone (1)
      if (!masked<kShrink>(c, src)) tr.wait_or_gone(src, notify_counter(c, src), round + 1, seen, true);
    } else if (!tr.wait_counter(src, notify_counter(c, src), round + 1, DEEPEP_WAIT_OP_INTERNODE_NOTIFY, src, true)) {
      failed = 1;
    }
  }
  __syncthreads();
  if (failed) return;
  if (threadIdx.x == 0) c.totals[notify_rounds(c)] = round + 1;
  if constexpr (kShrink) {
    // The same thread per source as the wait: a silent one gets our tag taken back (a peer that
    // skipped this round reaches it at its next one, where our counter add and our tag would
    // look current: it must find us absent, docs/internode.md); a present one without this
    // round's tag (out of step, or it masks us) is absent (2). Then the absent are masked.
    const int32_t* tags = reinterpret_cast<const int32_t*>(tr.local(c.rdma_offset + rdma.notify_recv(parity, 0)));
    for (int src = threadIdx.x; src < R; src += blockDim.x) {
      if (masked<kShrink>(c, src)) continue;
      if (c.peer_gone[src] == 1) {
        const uint64_t tag_off = kNotifySlotBytes - 16;  // the slot's last 16 bytes hold the tag
        const uint64_t recv_off = c.rdma_offset + rdma.notify_recv(parity, me) + tag_off;
        const uint64_t send_off = c.rdma_offset + rdma.notify_send(parity, src) + tag_off;
        volatile int32_t* t = reinterpret_cast<volatile int32_t*>(tr.row_target(src, recv_off, send_off));
        t[3] = kNotifyNoTag;
        __threadfence_system();
        tr.put_plain(src, recv_off, send_off, 16);
      } else if (src != me && tags[src * DEEPEP_INTERNODE_NOTIFY_SLOT_INTS + kNotifyTag] != tag) {
        c.peer_gone[src] = 2;
      }
    }
    __syncthreads();
    for (int src = threadIdx.x; src < R; src += blockDim.x) {
      if (c.peer_gone[src] != 0) {
        c.mask[src] = 1;
        c.peer_gone[src] = 0;
      }
    }
    __threadfence();
    __syncthreads();
  }

  if (!with_data) {
    // Combine: DeepEP's rewrite of the heads it reads (segments: source channels; (node, channel)
    // blocks of the scale-out receive space).
    // Either head may be empty (NULL): a rank without tokens still rewrites the rows it received.
    if (p.combined_rdma_head == nullptr && p.combined_nvl_head == nullptr) return;
    // The blocks first: recv_rdma_rank_prefix_sum non-decreasing in [0, rows], each node's channel
    // prefixes non-decreasing from 0 up to its rank prefix sum's step (the combine kernel bounds
    // every segment again; these checks name the entry).
    for (int n = threadIdx.x; n < N; n += blockDim.x) {
      const int64_t base = n > 0 ? p.recv_rdma_rank_prefix_sum[n - 1] : 0, top = p.recv_rdma_rank_prefix_sum[n];
      const bool base_ok = 0 <= base && base <= p.num_rdma_rows;  // else entry n - 1 is blamed
      if (top < 0 || top > p.num_rdma_rows || (base_ok && top < base)) {
        record_fault(c, DEEPEP_FAULT_COMBINE_HANDLE, DEEPEP_HANDLE_RECV_RDMA_RANK_PREFIX, n, top);
        continue;
      }
      if (!base_ok) continue;
      const int32_t* m = p.recv_rdma_channel_prefix_matrix + n * C;
      for (int ch = 0; ch < C; ++ch) {
        if (m[ch] < (ch > 0 ? m[ch - 1] : 0) || (ch + 1 == C ? m[ch] != top - base : m[ch] > top - base)) {
          record_fault(c, DEEPEP_FAULT_COMBINE_HANDLE, DEEPEP_HANDLE_RECV_RDMA_CHANNEL_PREFIX, n * C + ch, m[ch]);
          break;
        }
      }
    }
    for (int i = warp; p.combined_rdma_head != nullptr && i < C * N; i += num_warps) {
      int64_t begin, end;
      channel_range(p.num_tokens, C, i / N, begin, end);
      rewrite_segment(c, DEEPEP_HANDLE_SEND_RDMA_HEAD, p.combined_rdma_head + i % N, N, begin, end, i % N, lane);
    }
    for (int i = warp; p.combined_nvl_head != nullptr && i < N * C * G; i += num_warps) {
      const int n = i / (C * G), ch = (i / G) % C, g = i % G;
      const int64_t base = n > 0 ? p.recv_rdma_rank_prefix_sum[n - 1] : 0;
      const int64_t begin = base + (ch > 0 ? p.recv_rdma_channel_prefix_matrix[n * C + ch - 1] : 0);
      const int64_t end = base + p.recv_rdma_channel_prefix_matrix[n * C + ch];
      if (0 <= begin && begin <= end && end <= p.num_rdma_rows)
        rewrite_segment(c, DEEPEP_HANDLE_SEND_NVL_HEAD, p.combined_nvl_head + g, G, begin, end, g, lane);
    }
    return;
  }

  // 4. The receive side.
  const int32_t* raw_slots = reinterpret_cast<const int32_t*>(tr.local(c.rdma_offset + rdma.notify_recv(parity, 0)));
  const int stride = DEEPEP_INTERNODE_NOTIFY_SLOT_INTS;
  // Shrink mode: a source's rows are absent when it, or its forwarder on this node, is masked
  // (the absent were masked above): its slot reads as zeros.
  const auto absent = [&](int src) {
    return masked<kShrink>(c, src) || masked<kShrink>(c, (me / G) * G + src % G);
  };
  const auto slot_at = [&](int i) -> int32_t {
    if (kShrink && absent(i / stride)) return 0;
    return raw_slots[i];
  };
  struct Slots {
    decltype(slot_at)& at;
    __device__ int32_t operator[](int i) const { return at(i); }
  };
  const Slots slots{slot_at};
  // The rank prefix sums go to their output and are read back from it after the barrier (no
  // per-rank shared array: any R).
  int32_t* rank_prefix = p.recv_gbl_rank_prefix_sum;
  // Cached: the handle's rank prefix sums must be what the peers' counts give; an entry that is
  // not is a fault, then rewritten (the data kernel reads them).
  const auto settle = [&](int32_t* out, int entry, int i, int32_t v) {
    if (out[i] == v) return;
    if (p.cached) record_fault(c, DEEPEP_FAULT_DISPATCH_HANDLE, entry, i, out[i]);
    out[i] = v;
  };
  if (threadIdx.x == 0) {
    int32_t acc = 0;
    for (int s = 0; s < R; ++s) {
      acc += C > 0 ? max(slots[s * stride + C - 1], 0) : 0;
      settle(rank_prefix, DEEPEP_HANDLE_RECV_GBL_RANK_PREFIX, s, acc);
    }
    acc = 0;
    for (int n = 0; n < N; ++n) {
      acc += C > 0 ? max(slots[(n * G + my_gpu) * stride + 2 * C - 1], 0) : 0;
      settle(p.recv_rdma_rank_prefix_sum, DEEPEP_HANDLE_RECV_RDMA_RANK_PREFIX, n, acc);
    }
  }
  __syncthreads();
  // A peer's prefixes are non-decreasing from 0 (the data kernel bounds every row it writes).
  const auto peer_prefix = [&](int src, int i) {
    const int32_t v = slots[src * stride + i], before = i % C > 0 ? slots[src * stride + i - 1] : 0;
    if (v < before) record_fault(c, DEEPEP_FAULT_DISPATCH_HANDLE, DEEPEP_HANDLE_PEER_COUNTS, src * stride + i, v);
    return v;
  };
  for (int i = threadIdx.x; i < R * C; i += blockDim.x) {
    const int s = i / C, ch = i % C;
    peer_prefix(s, ch);
    p.recv_gbl_channel_prefix_matrix[i] = (s > 0 ? rank_prefix[s - 1] : 0) + (ch > 0 ? slots[s * stride + ch - 1] : 0);
  }
  for (int i = threadIdx.x; i < N * C; i += blockDim.x) {
    const int n = i / C, ch = i % C;
    p.recv_rdma_channel_prefix_matrix[i] = peer_prefix(n * G + my_gpu, C + ch);
  }
  __syncthreads();
  const int num_recv = R > 0 ? rank_prefix[R - 1] : 0;
  const int num_rdma_recv = N > 0 ? p.recv_rdma_rank_prefix_sum[N - 1] : 0;
  if (p.num_worst_tokens > 0 && max(num_recv, num_rdma_recv) > p.num_worst_tokens && threadIdx.x == 0)
    record_fault(c, DEEPEP_FAULT_WORST_TOO_SMALL, p.num_worst_tokens, max(num_recv, num_rdma_recv), 0);
  // 5. Host-visible counts: the list, the scale-out rows, then num_recv_tokens (the host spins on it).
  if (p.counts != nullptr) {
    for (int e = threadIdx.x; e < local_experts; e += blockDim.x) {
      int sum = 0;
      for (int s = 0; s < R; ++s) sum += slots[s * stride + 2 * C + e];
      const int a = p.expert_alignment;
      p.counts->num_recv_tokens_per_expert[e] = (sum + a - 1) / a * a;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      p.counts->num_rdma_recv_tokens = num_rdma_recv;
      __threadfence_system();
      *reinterpret_cast<volatile int32_t*>(&p.counts->num_recv_tokens) = num_recv;
      __threadfence_system();
    }
  }
}

// The launcher's kernels, by [remote kind: emulated, GIN][shrink]. The GIN row is compiled in
// every build, as before; the launcher selects it only where DEEPEP_HAVE_GIN.
constexpr void (*kNotifyKernels[2][2])(ncclDevComm, DeepepInternodeNotifyParams) = {
    {internode_notify_kernel<ll::kRemoteEmulated, false>, internode_notify_kernel<ll::kRemoteEmulated, true>},
    {internode_notify_kernel<ll::kRemoteGin, false>, internode_notify_kernel<ll::kRemoteGin, true>},
};

}  // namespace internode

cudaError_t preload_internode_notify_kernels() { return load_kernels(internode::kNotifyKernels); }

}  // namespace deepep

extern "C" int deepep_launch_internode_notify(const void* dev_comm, const DeepepInternodeNotifyParams* params,
                                              int remote_kind, void* stream) {
  using namespace deepep::internode;
  const ncclDevComm& dc = *static_cast<const ncclDevComm*>(dev_comm);
  const auto s = static_cast<cudaStream_t>(stream);
  const bool shrink = params->common.shrink != 0;
  const int by_remote = remote_kind == DEEPEP_LL_REMOTE_EMULATED ? 0
                        : remote_kind == DEEPEP_LL_REMOTE_GIN && DEEPEP_HAVE_GIN ? 1
                                                                               : -1;
  if (by_remote < 0) return int(cudaErrorInvalidValue);
  return deepep::launch_kernel(kNotifyKernels[by_remote][shrink ? 1 : 0], 1, kNotifyThreads, 0, s, dc, *params);
}
