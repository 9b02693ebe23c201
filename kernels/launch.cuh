// Kernel launches in one place: the dynamic shared memory opt-in, the launch, its error.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <mutex>
#include <vector>

namespace deepep {

// Dynamic shared memory a kernel may take without opting in.
constexpr size_t kDefaultDynamicSmem = 48 * 1024;

// Opts `kernel` in to `smem` bytes of dynamic shared memory on the current device. The
// attribute is per (function, device), as one process may drive several GPUs; each is set once
// (again only for a larger size), not per launch.
inline cudaError_t allow_dynamic_smem(const void* kernel, size_t smem) {
  if (smem <= kDefaultDynamicSmem) return cudaSuccess;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  }
  struct Allowed {
    const void* kernel;
    int device;
    size_t smem;
  };
  static std::mutex mutex;
  static std::vector<Allowed>& allowed = *new std::vector<Allowed>;  // never destroyed: launches at exit
  std::lock_guard<std::mutex> lock(mutex);
  Allowed* entry = nullptr;
  for (Allowed& a : allowed) {
    if (a.kernel == kernel && a.device == device) entry = &a;
  }
  if (entry != nullptr && entry->smem >= smem) return cudaSuccess;
  const cudaError_t rc = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (rc != cudaSuccess) return rc;
  if (entry != nullptr) {
    entry->smem = smem;
  } else {
    allowed.push_back({kernel, device, smem});
  }
  return cudaSuccess;
}

// Launches `kernel` and returns the launch's error (0 on success), as the C ABI's launch
// functions do.
template <typename... Params, typename... Args>
int launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                  const Args&... args) {
  const cudaError_t rc = allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
  if (rc != cudaSuccess) return int(rc);
  kernel<<<grid, block, smem, stream>>>(args...);
  return int(cudaGetLastError());
}

}  // namespace deepep
