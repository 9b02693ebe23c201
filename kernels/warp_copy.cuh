// One warp copies a row of 16-byte words (local or NVLink destination alike), shared by the LL
// and normal kernels.
#pragma once

#include <cuda_runtime.h>

#include "stream_ops.cuh"

namespace deepep {

constexpr int kWarp = 32;

// kCg: the source may have been written during this kernel (ld_cg). kStream: it is not (an
// input tensor: ld_stream).
enum class CopyLoad { kCg, kStream };

template <CopyLoad kLoad>
__device__ __forceinline__ int4 copy_load(const int4* p) {
  if constexpr (kLoad == CopyLoad::kCg) {
    return ld_cg(p);
  } else {
    return ld_stream(p);
  }
}

// Copies n words; each lane keeps kUnroll loads in flight before its stores (the asm stores are
// compiler barriers: a load-store loop would wait one memory latency per word).
template <int kUnroll, CopyLoad kLoad>
__device__ __forceinline__ void warp_copy(int4* dst, const int4* src, int n, int lane) {
  int i = lane;
  for (; i + (kUnroll - 1) * kWarp < n; i += kUnroll * kWarp) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = copy_load<kLoad>(src + i + u * kWarp);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) st_stream(dst + i + u * kWarp, v[u]);
  }
  for (; i < n; i += kWarp) st_stream(dst + i, copy_load<kLoad>(src + i));
}

}  // namespace deepep
