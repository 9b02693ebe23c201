// Shared device code of the normal-mode kernels: the LSA transport primitives
// (put a row, signal a slot, bounded wait), the channel split, the ring-slot
// layout and the end-of-kernel epoch bump.
//
// Rings. Every (channel, sender, receiver) pair has a ring of `ring_tokens`
// slots in the receiver's NVL region; every slot has a flag word in its header
// and a "consumed" word in the sender's NVL region. A flag holds
// (generation << 32) | (sequence + 1), the generation derived from a device op
// epoch bumped by every data kernel, so flags left by earlier calls (or earlier
// CUDA-graph replays, or other ring layouts) never match, and nothing is ever
// reset. Flag addresses move with the slot geometry, so they may sit on payload
// another op left (top-k ids, token indices): the generation lies in
// [2^30, 2^31), which no int32 payload reaches (see flag_generation).
#pragma once

#include <cuda_runtime.h>
#include <nccl_device.h>

#include <cstdint>

#include "bounded_wait.cuh"
#include "bulk_copy.cuh"
#include "deepep_kernels.h"
#include "memory_order.cuh"
#include "stream_ops.cuh"
#include "warp_copy.cuh"

namespace deepep {
namespace normal {

constexpr int kDataThreads = 768;  // 24 warps per block of the data kernels
constexpr int kDataWarps = kDataThreads / kWarp;
// Ring slots start on 128-byte boundaries (their stride a multiple of it) and a slot's row starts
// 128 bytes in, so a warp's 512-byte store of a row covers whole cache lines: its NVLink writes
// carry no partial lines. The header itself is 16 bytes: flag (8) + source token index (4) + pad.
constexpr int kSlotAlign = 128;
constexpr int kSlotHeaderBytes = kSlotAlign;
__host__ __device__ constexpr int64_t align_slot(int64_t bytes) { return (bytes + kSlotAlign - 1) / kSlotAlign * kSlotAlign; }

// Source tokens of channel c: DeepEP's split, contiguous ranges of ceil(T / C).
__device__ __forceinline__ void channel_range(int64_t num_tokens, int num_channels, int c, int64_t& begin,
                                              int64_t& end) {
  const int64_t per = (num_tokens + num_channels - 1) / num_channels;
  begin = min(num_tokens, per * c);
  end = min(num_tokens, begin + per);
}

// The high word of every flag of op `epoch`. Slots carry int32 expert ids in [-1, E), token
// indices and counts, all below 2^30, and a flag's address may hold such payload of another
// geometry: with bit 30 set (and bit 31 clear, so not -1) no such pair equals a flag. The low
// 30 bits are a bijection of the epoch's (offset, odd multiplies, xorshifts), so flags of ops less
// than 2^30 apart never equal each other, and float payload matches with chance ~2^-30 per
// word. A bare epoch (0, 1, 2, ...) let stale ids pass a wait on a fresh buffer (review F2).
__host__ __device__ __forceinline__ uint32_t flag_generation(uint32_t epoch) {
  constexpr uint32_t kLow30 = (1u << 30) - 1;
  uint32_t x = ((epoch + 0x9e3779b9u) * 0x2c1b3c6du) & kLow30;  // the offset keeps epoch 0 off round values
  x ^= x >> 15;
  x = (x * 0x297a2d39u) & kLow30;
  x ^= x >> 12;
  return (1u << 30) | x;
}

// `generation` = flag_generation(op epoch), computed once per kernel.
__device__ __forceinline__ uint64_t make_flag(uint32_t generation, int64_t seq) {
  return (uint64_t(generation) << 32) | uint64_t(uint32_t(seq + 1));
}

// ---------------------------------------------------------------- bulk copies (TMA; primitives: bulk_copy.cuh)
// Copies `bytes` (multiple of 16, 16-byte aligned ends) from src to dst through
// two shared-memory stages of kChunk bytes; lane 0 drives the copy engine.
// Returns once src has been read (dst writes may still be in flight).
template <int kChunk>
__device__ __forceinline__ void warp_bulk_copy(void* dst, const void* src, int64_t bytes, uint8_t* stages,
                                               uint64_t* bars, uint32_t* phases, int lane) {
  if (lane == 0) {
    for (int64_t off = 0; off < bytes; off += 2 * kChunk) {
      const int64_t off1 = off + kChunk;
      const uint32_t n0 = uint32_t(bytes - off < kChunk ? bytes - off : kChunk);
      const uint32_t n1 = off1 < bytes ? uint32_t(bytes - off1 < kChunk ? bytes - off1 : kChunk) : 0u;
      bulk_wait_smem_read();
      bulk_load(stages, static_cast<const uint8_t*>(src) + off, n0, &bars[0]);
      if (n1) bulk_load(stages + kChunk, static_cast<const uint8_t*>(src) + off1, n1, &bars[1]);
      mbarrier_wait(&bars[0], phases[0]);
      bulk_store(static_cast<uint8_t*>(dst) + off, stages, n0);
      if (n1) {
        mbarrier_wait(&bars[1], phases[1]);
        bulk_store(static_cast<uint8_t*>(dst) + off1, stages + kChunk, n1);
      }
    }
  }
  __syncwarp();
}

// put-with-signal, batched: a release costs a system-scope fence that waits
// for the warp's NVLink stores to be acknowledged, so a warp publishes the
// flags of up to kFlagBatch rows behind one fence. Flush before any blocking
// wait (a warp never blocks holding unpublished rows) and at the end.
template <int kFlagBatch = 4>
struct FlagBatch {
  int32_t seq[kFlagBatch];  // sequence numbers; the flag address and value derive from them
  int count = 0;

  // All lanes, after the row's stores. `flag_of(seq, &ptr, &value)` locates a flag.
  template <typename FlagOf>
  __device__ __forceinline__ void add(int32_t s, int lane, const FlagOf& flag_of) {
#pragma unroll
    for (int i = 0; i < kFlagBatch; ++i)
      if (i == count) seq[i] = s;
    if (++count == kFlagBatch) flush(lane, flag_of);
  }

  template <typename FlagOf>
  __device__ __forceinline__ void flush(int lane, const FlagOf& flag_of) {
    if (count == 0) return;
    __syncwarp();
    if (lane == 0) {
      fence_acq_rel_sys();
#pragma unroll
      for (int i = 0; i < kFlagBatch; ++i) {
        if (i < count) {
          uint64_t* ptr;
          uint64_t value;
          flag_of(seq[i], ptr, value);
          st_relaxed_sys(ptr, value);
        }
      }
    }
    count = 0;
  }
};

// Hands a ring slot back after the warp has read it, with a relaxed store and no
// release (review F8, as DeepEP). The PTX model alone would allow load buffering
// here (a read of the slot seeing the sender's next-lap write, made after it saw
// this store); what rules it out is that every read has completed first: lane 0
// waited on the mbarrier for the bulk loads, and the other loads' values were
// stored to the outputs before the warp sync. A st.release.sys would add a
// system-scope fence per slot, the cost FlagBatch exists to amortise.
__device__ __forceinline__ void warp_release_slot(uint64_t* consumed, uint64_t value, int lane) {
  __syncwarp();
  if (lane == 0) st_relaxed_sys(consumed, value);
}

// bounded_wait.cuh's, shared with the LL kernels.
using deepep::buffer_failed;
using deepep::poison_output;

// Shrink mode (docs/normal_shrink.md) is a template argument of the data kernels (kShrink, from
// common.shrink), so that their code without it stays as it was.
//
// The ranks masked when this kernel started, as bits, never this rank; 0 outside shrink mode.
// The mask changes only at a kernel's end (finish_op, notify) or between kernels (the host's
// update/clean, stream-ordered), so every block of a kernel reads the same snapshot (review F4).
template <bool kShrink>
__device__ __forceinline__ uint32_t masked_ranks(const DeepepNormalCommon& c) {
  if (!kShrink) return 0u;
  uint32_t bits = 0;
  for (int r = 0; r < c.num_ranks; ++r) bits |= (__ldcg(c.mask + r) != 0 ? 1u : 0u) << r;
  return bits & ~(1u << c.rank);
}

// Shrink mode: whether a wait of this kernel on `peer` already expired.
template <bool kShrink>
__device__ __forceinline__ bool peer_gone(const DeepepNormalCommon& c, int peer) {
  return kShrink && *reinterpret_cast<volatile int32_t*>(c.peer_gone + peer) != 0;
}

// Shrink mode: adds `n` dropped rows of `kind` (enum DeepepDroppedKind); one thread calls.
__device__ __forceinline__ void count_dropped(const DeepepNormalCommon& c, int kind, int64_t n) {
  if (n > 0) atomicAdd(reinterpret_cast<unsigned long long*>(c.dropped + kind), static_cast<unsigned long long>(n));
}

// wait: polls `flag` until it equals `expected`, then re-reads it with acquire
// semantics (one L1 invalidation per wait, not per poll; polls back off so that
// spinning warps leave issue slots and L2 bandwidth to the copies). Returns
// false when the budget runs out or another wait failed: after recording a stall, or in shrink
// mode after marking `peer` gone (no stall: the kernel drops the peer's traffic). Whole warps
// call it; in shrink mode the answer is the warp's (a lane that saw the peer given up while
// another saw its flag must not split the warp).
// `gone` is the kernel's peer-gone words (shrink mode only).
template <bool kAcquire, bool kShrink>
__device__ __forceinline__ bool warp_wait_flag(const uint64_t* flag, uint64_t expected, const DeepepWaitContext& w,
                                               int32_t* gone, int peer, int op, int counter) {
  uint64_t seen = ld_relaxed_sys(flag);
  // Shrink mode: the whole warp enters the wait if one lane does (it meets at __all_sync below);
  // lanes that saw the flag at once leave at their first poll.
  if (kShrink ? __any_sync(0xffffffffu, seen != expected) : seen != expected) {
    const uint64_t start = global_time_ns();
    bool got = true;
    for (int spin = 1;; ++spin) {
      if (spin > 4) __nanosleep(128);
      seen = ld_relaxed_sys(flag);
      if (seen == expected) break;
      if ((spin & 15) == 15) {
        if (kShrink) {
          if (buffer_failed(w) || *reinterpret_cast<volatile int32_t*>(gone + peer) != 0 ||
              global_time_ns() - start > w.timeout_ns) {
            got = false;
            break;
          }
        } else if (buffer_failed(w) || global_time_ns() - start > w.timeout_ns) {
          if (!buffer_failed(w) && (threadIdx.x & 31) == 0)
            record_stall(w, peer, op, counter, int64_t(expected & 0xffffffffu), int64_t(seen & 0xffffffffu));
          return false;
        }
      }
    }
    if (kShrink && !__all_sync(0xffffffffu, got)) {
      if ((threadIdx.x & 31) == 0) atomicExch(gone + peer, 1);
      return false;
    }
  }
  if (kAcquire) (void)ld_acquire_sys(flag);
  return true;
}

// For data a peer published with a release store: acquire before reading it.
template <bool kShrink>
__device__ __forceinline__ bool warp_wait(const uint64_t* flag, uint64_t expected, const DeepepNormalCommon& c,
                                          int peer, int op, int counter) {
  return warp_wait_flag<true, kShrink>(flag, expected, c.wait, c.peer_gone, peer, op, counter);
}
// The same for kernels without a shrink mode (internode).
__device__ __forceinline__ bool warp_wait(const uint64_t* flag, uint64_t expected, const DeepepWaitContext& w,
                                          int peer, int op, int counter) {
  return warp_wait_flag<true, false>(flag, expected, w, nullptr, peer, op, counter);
}

// For a word that only gates our own later stores (a freed ring slot): stores
// are never issued speculatively, so relaxed polling suffices.
template <bool kShrink>
__device__ __forceinline__ bool warp_wait_relaxed(const uint64_t* flag, uint64_t expected, const DeepepNormalCommon& c,
                                                  int peer, int op, int counter) {
  return warp_wait_flag<false, kShrink>(flag, expected, c.wait, c.peer_gone, peer, op, counter);
}
__device__ __forceinline__ bool warp_wait_relaxed(const uint64_t* flag, uint64_t expected, const DeepepWaitContext& w,
                                                  int peer, int op, int counter) {
  return warp_wait_flag<false, false>(flag, expected, w, nullptr, peer, op, counter);
}

// Base of a peer's (or our own) NVL region through LSA.
__device__ __forceinline__ uint8_t* nvl_base(const DeepepNormalCommon& c, int peer) {
  return static_cast<uint8_t*>(ncclGetLsaPointer(static_cast<ncclWindow_t>(c.window), c.nvl_offset, peer));
}

// Ring geometry inside one rank's NVL region: slots of every (channel, peer)
// ring, then one consumed word per slot.
struct RingLayout {
  int64_t slot_bytes;
  int ring;
  int num_ranks;
  __device__ __forceinline__ int64_t slot_offset(int channel, int peer, int64_t slot) const {
    return ((int64_t(channel) * num_ranks + peer) * ring + slot) * slot_bytes;
  }
  __device__ __forceinline__ int64_t consumed_offset(int num_channels, int channel, int peer, int64_t slot) const {
    return int64_t(num_channels) * num_ranks * ring * slot_bytes +
           ((int64_t(channel) * num_ranks + peer) * ring + slot) * int64_t(sizeof(uint64_t));
  }
};

// A notify kernel's check of the caller's top-k ids (notify params of either mode): each must be
// -1 or a valid expert, as ids beyond would be silently dropped. The block's threads share the work.
template <class Common, class NotifyParams>
__device__ __forceinline__ void check_topk_ids(const Common& c, const NotifyParams& p) {
  if (p.topk_idx == nullptr) return;
  const int64_t n = p.num_tokens * p.num_topk;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t e = p.topk_idx_is_int32 ? int64_t(static_cast<const int32_t*>(p.topk_idx)[i])
                                          : static_cast<const int64_t*>(p.topk_idx)[i];
    if (e < -1 || e >= p.num_experts) record_fault(c, DEEPEP_FAULT_TOPK_OUT_OF_RANGE, i, e, p.num_experts);
  }
}

// Reads the op epoch at kernel start; the last block to finish bumps it, so
// the next data kernel on this stream (and every peer's matching kernel) sees
// epoch + 1.
// Shrink mode: it also masks the peers a wait gave up on (from the next kernel on, every block
// having read its snapshot at its start) and resets them.
// Common: DeepepNormalCommon or DeepepInternodeCommon (the fields read here are named alike).
template <bool kShrink, class Common>
__device__ __forceinline__ void finish_op(const Common& c) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(c.ticket, 1u) == gridDim.x - 1) {
      *c.ticket = 0;
      atomicAdd(c.op_epoch, 1u);
      if (kShrink)
        for (int r = 0; r < c.num_ranks; ++r)
          if (atomicExch(c.peer_gone + r, 0) != 0) c.mask[r] = 1;
    }
  }
}

}  // namespace normal
}  // namespace deepep
