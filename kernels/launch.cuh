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

// Lazy loading (CUDA 12.2+ default) loads a kernel's module at its first launch, and that load
// may wait for the device's running kernels: a first launch of a kernel that a spinning kernel
// waits for can then deadlock (CUDA programming guide, "Lazy Loading", "Potential Hazards").
// Buffer creation therefore loads every kernel of its build first (deepep_preload_kernels).
// cudaFuncGetAttributes forces a kernel's load; it is idempotent and cheap once loaded.
template <typename... Params>
cudaError_t load_kernels(void (*kernel)(Params...)) {
  cudaFuncAttributes attributes;
  return cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(kernel));
}

// Loads every kernel of a launcher's table (an array of kernel pointers, of any rank): the table
// the launcher indexes, so that the kernels loaded are exactly those it can select.
template <typename Entry, size_t N>
cudaError_t load_kernels(const Entry (&table)[N]) {
  for (const Entry& entry : table) {
    const cudaError_t rc = load_kernels(entry);
    if (rc != cudaSuccess) return rc;
  }
  return cudaSuccess;
}

// Loads several kernels or tables (of different signatures), stopping at the first error.
template <typename First, typename Second, typename... Rest>
cudaError_t load_kernels(const First& first, const Second& second, const Rest&... rest) {
  const cudaError_t rc = load_kernels(first);
  return rc != cudaSuccess ? rc : load_kernels(second, rest...);
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

// Each launcher's translation unit loads its kernel table (the build's, kernels/nccl_build.cu,
// calls them all).
cudaError_t preload_transport_kernels();
cudaError_t preload_normal_notify_kernels();
cudaError_t preload_normal_dispatch_kernels();
cudaError_t preload_normal_combine_kernels();
cudaError_t preload_ll_dispatch_kernels();
cudaError_t preload_ll_combine_kernels();
cudaError_t preload_ll_control_kernels();
cudaError_t preload_internode_notify_kernels();
cudaError_t preload_internode_dispatch_kernels();
cudaError_t preload_internode_combine_kernels();

}  // namespace deepep
