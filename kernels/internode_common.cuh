// Shared device code of the internode normal-mode kernels (docs/internode.md): the scale-out
// transport (GIN puts and signals, or their LSA emulation for virtual nodes), the counters of
// the scale-out rings, the region layouts and the row layouts.
//
// Protocol. Every kernel pair of an op starts after a notify round (an all-to-all of counters:
// every rank has then finished its previous data kernel), so rings start empty and per-op slot
// numbers k (slot k % ring) suffice. Every op has one: dispatch's prepare launches it, cached or
// not, before the data kernel; combine launches it before its own (src/internode). So the ring
// may change from op to op (the host grows it into the RDMA region: dispatch's and combine's
// rows differ), as long as all ranks use the same one in an op: counters and running totals
// count rows, never slots, and no wait reads another op's ring size. Scale-out ring (channel c, node s) of rank (n, l) is
// written only by (s, l), by a warp group: its rows go to slots k, then one thread adds the
// chunk's row count to the reader's tail counter (c, s) (publish), so a tail of k means "rows
// < k have landed"; the reader adds the rows it has read, per round, to the writer's head
// counter (c, n). Counters only grow over the buffer's life; each side keeps its running totals
// in the workspace (sent, received), so a wait compares with "total before this op + k + 1" and
// a stale signal is already counted. NVLink rings (channel c, writer GPU) carry a flag per slot
// with the op's generation (normal_common.cuh), and a consumed word per slot at the writer.
#pragma once

#include <cuda_bf16.h>
#include <nccl.h>
#include <nccl_device.h>

#include <cstdint>

#include "deepep_kernels.h"
#include "ll_common.cuh"
#include "normal_common.cuh"

namespace deepep {
namespace internode {

using normal::flag_generation;
using normal::make_flag;
using normal::warp_wait;
using normal::warp_wait_relaxed;

constexpr int kThreads = 768;
constexpr int kWarps = kThreads / kWarp;
constexpr int kNotifyThreads = 1024;
constexpr int kMaxNodeSize = DEEPEP_INTERNODE_MAX_NODE_SIZE;
constexpr int kHeadNone = 1 << 25;  // DeepEP's "no later head in this segment"
// SourceMeta {source node, NVLink mask} of a num_worst_tokens padding row (dispatch writes it past
// the received rows): combine's last source range ends at the first such row, not at x's end.
constexpr int kPaddingMeta = -1;
static_assert(kMaxNodeSize <= kWarps, "a warp per other local GPU and at least one forwarder warp");
static_assert(kMaxNodeSize <= kWarp, "a lane per local GPU");

// Chunking of a scale-out ring of `ring` slots. The writer publishes its tail per chunk of at
// most send_chunk rows (a group barrier each); the reader returns credits per round of at most
// recv_round rows. A writer blocked on credits holds an unpublished chunk, a reader blocked on
// the tail holds an uncredited round: with chunk + round <= ring + 1 both cannot happen at once.
__host__ __device__ constexpr int send_chunk(int ring) { return ring < 63 ? (ring + 1) / 2 : 32; }
__host__ __device__ constexpr int recv_round(int ring) { return ring + 1 - send_chunk(ring); }

// Warp groups: `warps` warps per role, roles in warp order, in a block of `block_warps` warps;
// `groups` of them (min(num_roles, block_warps) when a role has one warp). With more roles than
// groups, group g takes roles g, g + groups, ... in turn (see the kernels for why this order is
// free of wait cycles). A group of several warps syncs on named barrier 1 + role (1..15; a block
// holds at most kWarps / 2 such groups).
struct WarpGroup {
  int role, member, warps, groups;
  __device__ WarpGroup(int warp, int num_roles, int block_warps = kWarps) {
    warps = max(1, block_warps / max(num_roles, 1));
    groups = min(max(num_roles, 1), block_warps / warps);
    role = warp / warps;
    member = warp % warps;
  }
  __device__ __forceinline__ void sync() const {
    if (warps == 1) __syncwarp();
    else asm volatile("bar.sync %0, %1;" ::"r"(1 + role), "r"(warps * kWarp) : "memory");
  }
  __device__ __forceinline__ bool leader(int lane) const { return member == 0 && lane == 0; }
  // Whether `p` holds on every thread of the group (a barrier: every member must call it).
  __device__ __forceinline__ bool all(bool p) const {
    if (warps == 1) return __all_sync(0xffffffffu, p);
    int r;
    asm volatile("{ .reg .pred in, out; setp.ne.s32 in, %1, 0; bar.red.and.pred out, %2, %3, in; selp.s32 %0, 1, 0, out; }"
                 : "=r"(r) : "r"(int(p)), "r"(1 + role), "r"(warps * kWarp) : "memory");
    return r != 0;
  }
};
static_assert(kWarps / 2 + 1 <= 15, "named barriers of the warp groups");

// Counter indices (window words and GIN signals alike): tail [Cb][N], head [Cb][N], notify [R]
// with Cb = c.counter_channels, the buffer's bound on channels (deepep_kernels.h). Strides come
// from the buffer (N, Cb), not from the op (C), so the counters mean the same to every op.
__device__ __forceinline__ int tail_counter(const DeepepInternodeCommon& c, int channel, int node) {
  return channel * c.num_nodes + node;
}
__device__ __forceinline__ int head_counter(const DeepepInternodeCommon& c, int channel, int node) {
  return (c.counter_channels + channel) * c.num_nodes + node;
}
__device__ __forceinline__ int notify_counter(const DeepepInternodeCommon& c, int rank) {
  return 2 * c.counter_channels * c.num_nodes + rank;
}
// The arrival window word (after the counters; deepep_kernels.h), read by LSA peers only.
__device__ __forceinline__ int arrival_word(const DeepepInternodeCommon& c) {
  return 2 * c.counter_channels * c.num_nodes + c.num_ranks;
}
// Workspace running totals: sent [Cb][N], received [Cb][N], the notify rounds done.
__device__ __forceinline__ int sent_total(const DeepepInternodeCommon& c, int channel, int node) {
  return channel * c.num_nodes + node;
}
__device__ __forceinline__ int recv_total(const DeepepInternodeCommon& c, int channel, int node) {
  return (c.counter_channels + channel) * c.num_nodes + node;
}
__device__ __forceinline__ int notify_rounds(const DeepepInternodeCommon& c) {
  return 2 * c.counter_channels * c.num_nodes;
}

constexpr int64_t kNotifySlotBytes = int64_t(DEEPEP_INTERNODE_NOTIFY_SLOT_INTS) * 4;

// Rows. Dispatch: header (source token, destination-GPU mask on the row's node), x, scales,
// top-k ids (int32), weights. Combine: x (bf16), weights. An NVLink slot is a 16-byte header
// (flag, source rank, sequence) before the row.
struct DispatchRow {
  int32_t hidden_bytes, num_scales, num_topk;
  __host__ __device__ int64_t x_off() const { return DEEPEP_INTERNODE_ROW_HEADER_BYTES; }
  __host__ __device__ int64_t scales_off() const { return x_off() + align16(hidden_bytes); }
  __host__ __device__ int64_t topk_off() const { return scales_off() + align16(int64_t(num_scales) * 4); }
  __host__ __device__ int64_t weights_off() const { return topk_off() + align16(int64_t(num_topk) * 4); }
  __host__ __device__ int64_t bytes() const { return weights_off() + align16(int64_t(num_topk) * 4); }
};
struct CombineRow {
  int32_t hidden_bytes, num_topk;
  __host__ __device__ int64_t weights_off() const { return align16(hidden_bytes); }
  __host__ __device__ int64_t bytes() const { return weights_off() + align16(int64_t(num_topk) * 4); }
};
constexpr int kNvlHeaderBytes = DEEPEP_INTERNODE_NVL_HEADER_BYTES;

// RDMA region: notify receive slots [2][R], notify staging [2][R], receive rings [C][N][ring],
// send rings (GIN staging) [C][N][ring].
struct RdmaLayout {
  int64_t row_bytes;
  int ring, num_nodes, num_channels, num_ranks;
  __device__ int64_t notify_recv(int parity, int src) const { return (int64_t(parity) * num_ranks + src) * kNotifySlotBytes; }
  __device__ int64_t notify_send(int parity, int dst) const {
    return (2 * int64_t(num_ranks) + int64_t(parity) * num_ranks + dst) * kNotifySlotBytes;
  }
  __device__ int64_t rings() const { return 4 * int64_t(num_ranks) * kNotifySlotBytes; }
  __device__ int64_t recv_slot(int channel, int node, int64_t k) const {
    return rings() + ((int64_t(channel) * num_nodes + node) * ring + k % ring) * row_bytes;
  }
  __device__ int64_t send_slot(int channel, int node, int64_t k) const {
    return recv_slot(channel, node, k) + int64_t(num_channels) * num_nodes * ring * row_bytes;
  }
};

__device__ __forceinline__ void red_add_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// DEEPEP_INTERNODE_OUTLINE (a kernel file defines it before including this header): Transport's
// add, publish and wait spin out of line. It takes them out of dispatch's per-row loops; in
// combine (128 registers a thread) ptxas spills more around the calls, so combine keeps them inline.
#ifndef DEEPEP_INTERNODE_OUTLINE
#define DEEPEP_INTERNODE_OUTLINE 0
#endif
template <int kRemote>
struct Transport;
// Out-of-line slow paths of Transport (not in the callers' per-row loops: a GIN put or signal,
// the spin of a wait, each with its own registers). A wait's result and last value read.
struct WaitResult {
  uint64_t seen;
  bool ok;
};
template <int kRemote>
__device__ __noinline__ WaitResult transport_wait(const DeepepInternodeCommon& c, const ncclDevComm& dc, int src, int idx,
                                                  uint64_t target, int op, int channel, bool alone);
template <int kRemote>
__device__ __noinline__ WaitResult transport_wait_shrink(const DeepepInternodeCommon& c, const ncclDevComm& dc, int src,
                                                         int idx, uint64_t target);
template <int kRemote>
__device__ __noinline__ void transport_add(const DeepepInternodeCommon& c, const ncclDevComm& dc, int peer, int idx,
                                           uint64_t delta);
template <int kRemote>
__device__ __noinline__ void transport_publish(const DeepepInternodeCommon& c, const ncclDevComm& dc, int peer,
                                               RdmaLayout rdma, int ch, int64_t first, int count, int idx);

// How this rank reaches a peer. Peers of the same node, and every peer under the emulation (one
// physical node), take LSA loads and stores; kRemoteGin peers of other nodes take GIN.
template <int kRemote>
struct Transport {
  const DeepepInternodeCommon& c;
  ncclDevComm const& dev_comm;
  __device__ Transport(const DeepepInternodeCommon& common, ncclDevComm const& dc) : c(common), dev_comm(dc) {}

  __device__ __forceinline__ ncclWindow_t window() const { return static_cast<ncclWindow_t>(c.window); }
  __device__ __forceinline__ bool direct(int peer) const {
    return kRemote != ll::kRemoteGin || peer / c.node_size == c.rank / c.node_size;
  }
  // Pointers from the parameters' LSA mapping (as ll::Transport): no window-struct loads, and a
  // harness can lay out virtual ranks' windows at a stride (tests/gpu/internode_virtual_ranks.cu).
  __device__ __forceinline__ uint8_t* lsa(uint64_t offset, int peer) const {
    return c.lsa_base + uint64_t(peer - c.wait.lsa_base_rank) * c.lsa_stride + offset;
  }
  __device__ __forceinline__ uint8_t* local(uint64_t offset) const { return c.local_base + offset; }
#if DEEPEP_HAVE_GIN
  __device__ __forceinline__ int context(int peer) const {
    return dev_comm.ginContextCount > 0 ? peer % dev_comm.ginContextCount : 0;
  }
#endif

  // Adds `delta` to counter `idx` of `peer`, after the calling warp's earlier writes to it
  // (the warp synced; lane 0 calls).
  __device__ __forceinline__ void add(int peer, int idx, uint64_t delta) const {
    if (DEEPEP_INTERNODE_OUTLINE) transport_add<kRemote>(c, dev_comm, peer, idx, delta);
    else add_now(peer, idx, delta);
  }
  __device__ __forceinline__ void add_now(int peer, int idx, uint64_t delta) const {
    if (!direct(peer)) {
#if DEEPEP_HAVE_GIN
      ncclGin gin(dev_comm, context(peer));
      gin.signal(ncclTeamWorld(dev_comm), peer, ncclGin_SignalAdd{unsigned(c.gin_signal_base + idx), delta});
#endif
      return;
    }
    fence_acq_rel_sys();
    red_add_release_sys(reinterpret_cast<uint64_t*>(lsa(c.control_offset + 8ull * idx, peer)), delta);
  }
  // Counter `idx` of this rank, as written by `src`.
  __device__ __forceinline__ uint64_t read(int src, int idx) const {
    if (!direct(src)) {
#if DEEPEP_HAVE_GIN
      ncclGin gin(dev_comm, 0);
      return gin.readSignal(unsigned(c.gin_signal_base + idx));
#endif
    }
    return ld_acquire_sys(reinterpret_cast<const uint64_t*>(local(c.control_offset + 8ull * idx)));
  }
  // Where a warp writes `bytes` bound for `peer`'s `dst_offset`: the peer's memory (direct), or
  // this rank's staging at `staging_offset` for put_add.
  __device__ __forceinline__ uint8_t* row_target(int peer, uint64_t dst_offset, uint64_t staging_offset) const {
    return direct(peer) ? lsa(dst_offset, peer) : local(staging_offset);
  }
  // After the warp wrote a row to row_target: delivers it (GIN) and adds 1 to counter `idx`
  // of the peer, ordered after the row. The whole warp calls.
  __device__ __forceinline__ void put_add(int peer, uint64_t dst_offset, uint64_t staging_offset, int64_t bytes, int idx,
                                          int lane) const {
    __syncwarp();
    if (lane != 0) return;
    if (!direct(peer)) {
#if DEEPEP_HAVE_GIN
      __threadfence();  // the other lanes' staging writes, before the NIC reads them
      ncclGin gin(dev_comm, context(peer));
      gin.put(ncclTeamWorld(dev_comm), peer, window(), dst_offset, window(), staging_offset, size_t(bytes),
              ncclGin_SignalAdd{unsigned(c.gin_signal_base + idx), 1});
#endif
      return;
    }
    add_now(peer, idx, 1);
  }

  // One thread, after its group wrote rows [first, first + count) of the scale-out ring (channel
  // ch) at `peer` through row_target and synced: delivers them (GIN: from the staging ring, one
  // put per contiguous run, the last one with the signal) and adds `count` to tail counter `idx`.
  __device__ __forceinline__ void publish(int peer, const RdmaLayout& rdma, int ch, int64_t first, int count,
                                          int idx) const {
    if (count == 0) return;
    if (DEEPEP_INTERNODE_OUTLINE) transport_publish<kRemote>(c, dev_comm, peer, rdma, ch, first, count, idx);
    else publish_now(peer, rdma, ch, first, count, idx);
  }
  __device__ __forceinline__ void publish_now(int peer, const RdmaLayout& rdma, int ch, int64_t first, int count,
                                              int idx) const {
    if (!direct(peer)) {
#if DEEPEP_HAVE_GIN
      __threadfence();  // the group's staging writes, before the NIC reads them
      const int my_node = c.rank / c.node_size, node = peer / c.node_size;
      ncclGin gin(dev_comm, context(peer));
      for (int64_t k = first, end = first + count; k < end;) {
        const int64_t run = min(end - k, int64_t(rdma.ring) - k % rdma.ring);
        const uint64_t dst = c.rdma_offset + rdma.recv_slot(ch, my_node, k);
        const uint64_t src = c.rdma_offset + rdma.send_slot(ch, node, k);
        const size_t bytes = size_t(run * rdma.row_bytes);
        k += run;
        if (k < end) gin.put(ncclTeamWorld(dev_comm), peer, window(), dst, window(), src, bytes);
        else gin.put(ncclTeamWorld(dev_comm), peer, window(), dst, window(), src, bytes,
                     ncclGin_SignalAdd{unsigned(c.gin_signal_base + idx), uint64_t(count)});
      }
#endif
      return;
    }
    add_now(peer, idx, uint64_t(count));
  }

  // Bounded wait until counter `idx` (written by `src`) reaches `target`; the whole warp calls
  // (lane 0 records a stall), or one thread with `alone`.
  __device__ __forceinline__ bool wait_counter(int src, int idx, uint64_t target, int op, int channel,
                                               bool alone = false) const {
    if (DEEPEP_INTERNODE_OUTLINE) return transport_wait<kRemote>(c, dev_comm, src, idx, target, op, channel, alone).ok;
    return wait_now(src, idx, target, op, channel, alone).ok;
  }
  // The same with `seen`, the counter's last value read (it only grows): no read while it
  // already covers `target`.
  __device__ __forceinline__ bool wait_counter(int src, int idx, uint64_t target, uint64_t& seen, int op, int channel,
                                               bool alone = false) const {
    if (seen >= target) return true;
    const WaitResult r = DEEPEP_INTERNODE_OUTLINE ? transport_wait<kRemote>(c, dev_comm, src, idx, target, op, channel, alone)
                                                  : wait_now(src, idx, target, op, channel, alone);
    seen = r.seen;
    return r.ok;
  }
  // Shrink mode: the same bounded wait, but an expiry (or `src` already given up by this kernel)
  // marks `src` gone instead of a stall record (docs/internode.md, "Shrink"). One thread polls
  // (lane 0, or the caller with `alone`), so a warp's answer is one. Off the non-shrink path.
  __device__ __forceinline__ bool wait_or_gone(int src, int idx, uint64_t target, uint64_t& seen,
                                               bool alone = false) const {
    if (seen >= target) return true;
    WaitResult r{seen, false};
    if (alone || (threadIdx.x & 31) == 0) r = transport_wait_shrink<kRemote>(c, dev_comm, src, idx, target);
    if (!alone) {
      r.ok = __shfl_sync(0xffffffffu, r.ok, 0);
      r.seen = __shfl_sync(0xffffffffu, r.seen, 0);
    }
    seen = r.seen;
    return r.ok;
  }
  __device__ __forceinline__ WaitResult wait_shrink_now(int src, int idx, uint64_t target) const {
    volatile int32_t* gone = c.peer_gone + src;
    uint64_t seen = read(src, idx);
    if (seen >= target) return {seen, true};
    if (*gone != 0) return {seen, false};
    const uint64_t start = global_time_ns();
    for (int spin = 1;; ++spin) {
      if (spin > 4) __nanosleep(128);
      seen = read(src, idx);
      if (seen >= target) return {seen, true};
      if ((spin & 15) == 15 && (normal::buffer_failed(c.wait) || *gone != 0 || global_time_ns() - start > c.wait.timeout_ns)) {
        if (!normal::buffer_failed(c.wait)) atomicExch(c.peer_gone + src, 1);
        return {seen, false};
      }
    }
  }
  // Shrink mode: delivers `bytes` a thread wrote through row_target (GIN: a put without a
  // signal; LSA: already there).
  __device__ __forceinline__ void put_plain(int peer, uint64_t dst_offset, uint64_t staging_offset, int64_t bytes) const {
    if (direct(peer)) return;
#if DEEPEP_HAVE_GIN
    __threadfence();
    ncclGin gin(dev_comm, context(peer));
    gin.put(ncclTeamWorld(dev_comm), peer, window(), dst_offset, window(), staging_offset, size_t(bytes));
#endif
  }
  __device__ __forceinline__ WaitResult wait_now(int src, int idx, uint64_t target, int op, int channel,
                                                 bool alone) const {
    uint64_t seen = read(src, idx);
    if (seen >= target) return {seen, true};
    const uint64_t start = global_time_ns();
    for (int spin = 1;; ++spin) {
      if (spin > 4) __nanosleep(128);
      seen = read(src, idx);
      if (seen >= target) return {seen, true};
      if ((spin & 15) == 15 && (normal::buffer_failed(c.wait) || global_time_ns() - start > c.wait.timeout_ns)) {
        if (!normal::buffer_failed(c.wait) && (alone || (threadIdx.x & 31) == 0))
          record_stall(c.wait, src, op, channel, int64_t(target), int64_t(seen));
        return {seen, false};
      }
    }
  }
};

template <int kRemote>
__device__ __noinline__ WaitResult transport_wait(const DeepepInternodeCommon& c, const ncclDevComm& dc, int src, int idx,
                                                  uint64_t target, int op, int channel, bool alone) {
  return Transport<kRemote>(c, dc).wait_now(src, idx, target, op, channel, alone);
}
template <int kRemote>
__device__ __noinline__ WaitResult transport_wait_shrink(const DeepepInternodeCommon& c, const ncclDevComm& dc, int src,
                                                         int idx, uint64_t target) {
  return Transport<kRemote>(c, dc).wait_shrink_now(src, idx, target);
}
template <int kRemote>
__device__ __noinline__ void transport_add(const DeepepInternodeCommon& c, const ncclDevComm& dc, int peer, int idx,
                                           uint64_t delta) {
  Transport<kRemote>(c, dc).add_now(peer, idx, delta);
}
template <int kRemote>
__device__ __noinline__ void transport_publish(const DeepepInternodeCommon& c, const ncclDevComm& dc, int peer,
                                               RdmaLayout rdma, int ch, int64_t first, int count, int idx) {
  Transport<kRemote>(c, dc).publish_now(peer, rdma, ch, first, count, idx);
}

// NVLink rings in the NVL region: [C][G writer-or-reader GPU][ring] slots, then a consumed word
// per slot. Ring (c, w) at reader GPU r is written by local GPU w; its consumed words live at
// the writer, indexed (c, r).
__device__ __forceinline__ normal::RingLayout nvl_rings(const DeepepInternodeCommon& c, int64_t slot_bytes) {
  return normal::RingLayout{slot_bytes, c.nvl_ring_tokens, c.node_size};
}
template <int kRemote>
__device__ __forceinline__ uint8_t* nvl_of(const Transport<kRemote>& tr, int local_gpu) {
  const DeepepInternodeCommon& c = tr.c;
  return tr.lsa(c.nvl_offset, (c.rank / c.node_size) * c.node_size + local_gpu);
}

// Traffic statistics (enum DeepepTrafficKind): a warp's `rows` of `row_bytes` over one leg, added
// once when its work is done (never per row: the data path stays as it is). One thread calls.
__device__ __forceinline__ void count_traffic(const DeepepInternodeCommon& c, int rows_kind, int64_t rows,
                                              int64_t row_bytes) {
  if (rows <= 0) return;
  atomicAdd(reinterpret_cast<unsigned long long*>(c.traffic + rows_kind), static_cast<unsigned long long>(rows));
  atomicAdd(reinterpret_cast<unsigned long long*>(c.traffic + rows_kind + 1),
            static_cast<unsigned long long>(rows * row_bytes));
}

// Tokens of channel c (DeepEP's split).
__device__ __forceinline__ void channel_range(int64_t num_tokens, int num_channels, int ch, int64_t& begin,
                                              int64_t& end) {
  normal::channel_range(num_tokens, num_channels, ch, begin, end);
}

// Shrink mode (kShrink, a template argument of every internode kernel, from common.shrink, so
// the code without it stays as it was; docs/internode.md, "Shrink"). Whether `r` was masked
// when this kernel started (never this rank): the mask changes only at a kernel's end or
// between kernels (the host's update/clean, stream-ordered), so every block sees one snapshot.
template <bool kShrink>
__device__ __forceinline__ bool masked(const DeepepInternodeCommon& c, int r) {
  return kShrink && r != c.rank && __ldcg(c.mask + r) != 0;
}
// Whether a wait of this kernel on `r` expired (shrink mode).
template <bool kShrink>
__device__ __forceinline__ bool gone(const DeepepInternodeCommon& c, int r) {
  return kShrink && *reinterpret_cast<volatile int32_t*>(c.peer_gone + r) != 0;
}
// Masked, or gone in this kernel: its traffic is dropped.
template <bool kShrink>
__device__ __forceinline__ bool skipped(const DeepepInternodeCommon& c, int r) {
  return masked<kShrink>(c, r) || gone<kShrink>(c, r);
}
// The same, one answer per warp (lane 0's: peer_gone may change between the lanes' reads).
template <bool kShrink>
__device__ __forceinline__ bool skipped_warp(const DeepepInternodeCommon& c, int r) {
  return kShrink && __shfl_sync(0xffffffffu, int(skipped<kShrink>(c, r)), 0) != 0;
}
// Shrink mode: `n` rows of `kind` (enum DeepepDroppedKind) dropped; one thread calls.
__device__ __forceinline__ void count_dropped(const DeepepInternodeCommon& c, int kind, int64_t n) {
  if (n > 0) atomicAdd(reinterpret_cast<unsigned long long*>(c.dropped + kind), static_cast<unsigned long long>(n));
}
// NVLink slot waits: normal's, whose shrink mode marks the peer gone instead of a stall.
template <bool kShrink>
__device__ __forceinline__ bool nvl_wait(const uint64_t* flag, uint64_t expected, const DeepepInternodeCommon& c,
                                         int peer, int op, int channel) {
  if constexpr (kShrink) return normal::warp_wait_flag<true, true>(flag, expected, c.wait, c.peer_gone, peer, op, channel);
  else return warp_wait(flag, expected, c.wait, peer, op, channel);
}
template <bool kShrink>
__device__ __forceinline__ bool nvl_wait_relaxed(const uint64_t* flag, uint64_t expected, const DeepepInternodeCommon& c,
                                                 int peer, int op, int channel) {
  if constexpr (kShrink) return normal::warp_wait_flag<false, true>(flag, expected, c.wait, c.peer_gone, peer, op, channel);
  else return warp_wait_relaxed(flag, expected, c.wait, peer, op, channel);
}

// The last block to finish bumps the op epoch, and in shrink mode masks the peers a wait gave up on.
using normal::finish_op;

}  // namespace internode
}  // namespace deepep
