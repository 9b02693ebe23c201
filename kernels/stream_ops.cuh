// 16-byte loads and stores that bypass L1, shared by the normal and LL kernels: the data is
// written by peers during the kernel (a stale L1 line would be wrong) or touched once.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace deepep {

// Byte counts rounded up to whole 16-byte words (rows and slots these ops move).
__host__ __device__ constexpr int64_t align16(int64_t x) { return (x + 15) / 16 * 16; }

__device__ __forceinline__ int4 ld_stream(const int4* p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Loads from a ring slot a peer wrote (observed through this thread's flag acquire) and may
// rewrite in this kernel after the hand-back: a weak, coherent load that skips L1 allocation.
// Not ld.global.nc, whose data must stay read-only for the kernel's lifetime (review F7).
__device__ __forceinline__ int4 ld_ring(const int4* p) {
  int4 v;
  asm volatile("ld.global.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ void st_stream(int4* p, int4 v) {
  asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

// Data written by peers (or other blocks) during this kernel: L2, never a stale L1 line.
__device__ __forceinline__ int4 ld_cg(const int4* p) { return __ldcg(p); }

}  // namespace deepep
