// Shared device code of the normal-mode kernels: the LSA transport primitives
// (put a row, signal a slot, bounded wait), the channel split, the ring-slot
// layout and the end-of-kernel epoch bump.
//
// Rings. Every (channel, sender, receiver) pair has a ring of `ring_tokens`
// slots in the receiver's NVL region; every slot has a flag word in its header
// and a "consumed" word in the sender's NVL region. A flag holds
// (op epoch << 32) | (sequence + 1): the epoch is a device counter bumped by
// every data kernel, so flags left by earlier calls (or earlier CUDA-graph
// replays, or other ring layouts) never match, and nothing is ever reset.
#pragma once

#include <cuda_runtime.h>
#include <nccl_device.h>

#include <cstdint>

#include "bounded_wait.cuh"
#include "deepep_kernels.h"

namespace deepep {
namespace normal {

constexpr int kWarp = 32;
constexpr int kDataThreads = 768;  // 24 warps per block of the data kernels
constexpr int kDataWarps = kDataThreads / kWarp;
constexpr int kSlotHeaderBytes = 16;  // flag (8) + source token index (4) + pad

__host__ __device__ constexpr int64_t align16(int64_t x) { return (x + 15) / 16 * 16; }

// Source tokens of channel c: DeepEP's split, contiguous ranges of ceil(T / C).
__device__ __forceinline__ void channel_range(int64_t num_tokens, int num_channels, int c, int64_t& begin,
                                              int64_t& end) {
  const int64_t per = (num_tokens + num_channels - 1) / num_channels;
  begin = min(num_tokens, per * c);
  end = min(num_tokens, begin + per);
}

__device__ __forceinline__ uint64_t make_flag(uint32_t epoch, int64_t seq) {
  return (uint64_t(epoch) << 32) | uint64_t(uint32_t(seq + 1));
}

// ---------------------------------------------------------------- memory ops
__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
// Streaming load that skips L1: ring slots are rewritten by peers within one kernel.
__device__ __forceinline__ int4 ld_stream(const int4* p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ void st_stream(int4* p, int4 v) {
  asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

// put: one warp copies n 16-byte words; loads are batched so each lane keeps
// kUnroll loads in flight before its stores (local or NVLink destination alike).
template <int kUnroll = 4>
__device__ __forceinline__ void warp_put(int4* dst, const int4* src, int n, int lane) {
  int i = lane;
  for (; i + (kUnroll - 1) * kWarp < n; i += kUnroll * kWarp) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = ld_stream(src + i + u * kWarp);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) st_stream(dst + i + u * kWarp, v[u]);
  }
  for (; i < n; i += kWarp) st_stream(dst + i, ld_stream(src + i));
}

// signal: after the warp's payload stores, one release store publishes `value`.
__device__ __forceinline__ void warp_signal(uint64_t* flag, uint64_t value, int lane) {
  __syncwarp();
  if (lane == 0) st_release_sys(flag, value);
}

// True once any wait of this buffer expired: later waits give up at once so a
// dead peer costs one timeout, not one per wait.
__device__ __forceinline__ bool buffer_failed(const DeepepWaitContext& w) {
  return *reinterpret_cast<volatile uint32_t*>(w.stall_lock) != 0;
}

// wait: every lane polls `flag` until it equals `expected` (acquire). Returns
// false after recording a stall when the budget runs out or another wait failed.
__device__ __forceinline__ bool warp_wait(const uint64_t* flag, uint64_t expected, const DeepepWaitContext& w,
                                          int peer, int op, int counter) {
  if (ld_acquire_sys(flag) == expected) return true;
  const uint64_t start = global_time_ns();
  uint64_t seen;
  for (int spin = 0;; ++spin) {
    seen = ld_acquire_sys(flag);
    if (seen == expected) return true;
    if ((spin & 63) == 63) {
      if (buffer_failed(w)) return false;
      if (global_time_ns() - start > w.timeout_ns) break;
    }
  }
  if ((threadIdx.x & 31) == 0) record_stall(w, peer, op, counter, int64_t(expected & 0xffffffffu), int64_t(seen & 0xffffffffu));
  return false;
}

// First fault of a launch wins (host-mapped record, claimed with a CAS on its flag).
__device__ __forceinline__ void record_fault(DeepepFaultRecord* f, int code, int64_t a, int64_t b, int64_t c) {
  if (f == nullptr) return;
  if (atomicCAS(&f->flag, 0u, 2u) != 0u) return;
  f->code = code;
  f->a = a;
  f->b = b;
  f->c = c;
  __threadfence_system();
  *reinterpret_cast<volatile uint32_t*>(&f->flag) = 1u;
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

// Reads the op epoch at kernel start; the last block to finish bumps it, so
// the next data kernel on this stream (and every peer's matching kernel) sees
// epoch + 1.
__device__ __forceinline__ void finish_op(const DeepepNormalCommon& c) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(c.ticket, 1u) == gridDim.x - 1) {
      *c.ticket = 0;
      atomicAdd(c.op_epoch, 1u);
    }
  }
}

}  // namespace normal
}  // namespace deepep
