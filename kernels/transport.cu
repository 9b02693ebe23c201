// NCCL device-communicator helpers and the LSA control kernels (barrier,
// peer check). Host helpers here are compiled against the same NCCL headers as
// the kernels, so Rust never needs to know the version-dependent layouts.
#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include "bounded_wait.cuh"
#include "deepep_kernels.h"
#include "launch.cuh"

extern "C" void deepep_devcomm_requirements_init(void* out, int lsa_barrier_count, int gin_signal_count) {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 29, 0)
  // 2.29+ checks size/magic/version stamped by the initializer.
  ncclDevCommRequirements reqs = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
#else
  ncclDevCommRequirements reqs = {};
#endif
  reqs.lsaBarrierCount = lsa_barrier_count;
  reqs.lsaMultimem = false;  // NVLS multicast stays off on shared machines
  if (gin_signal_count > 0) {
    // Peers outside the LSA team: GIN to every rank (LL all-to-all), indexed signals.
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 29, 7)
    reqs.ginConnectionType = NCCL_GIN_CONNECTION_FULL;
#elif NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 7)
    reqs.ginForceEnable = true;
#endif
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 7)
    reqs.ginContextCount = 4;
    reqs.ginSignalCount = gin_signal_count;
#endif
  }
  *static_cast<ncclDevCommRequirements*>(out) = reqs;
}

extern "C" void deepep_devcomm_info(const void* dev_comm, DeepepDevCommInfo* out) {
  const ncclDevComm& dc = *static_cast<const ncclDevComm*>(dev_comm);
  out->rank = dc.rank;
  out->num_ranks = dc.nRanks;
  out->lsa_rank = dc.lsaRank;
  out->lsa_size = dc.lsaSize;
}

namespace deepep {

constexpr int kControlThreads = 128;

__global__ void __launch_bounds__(kControlThreads)
    lsa_barrier_kernel(ncclDevComm dev_comm, int index, DeepepWaitContext wait) {
  ncclCoopCta cta;
  BoundedLsaBarrier<ncclCoopCta> barrier(cta, dev_comm, index);
  barrier.arrive(cta, cuda::memory_order_acq_rel);
  barrier.wait_bounded(cta, wait);
}

__global__ void __launch_bounds__(kControlThreads)
    lsa_peer_check_kernel(ncclDevComm dev_comm, ncclWindow_t window, size_t slots_offset, uint32_t tag,
                          int barrier_index, DeepepWaitContext wait, int32_t* mismatches) {
  ncclCoopCta cta;
  const int me = dev_comm.lsaRank;
  const int n = dev_comm.lsaSize;
  // Publish my tag into every peer's slot for me, through NVLink (LSA) pointers.
  for (int peer = threadIdx.x; peer < n; peer += blockDim.x) {
    auto* slot = static_cast<volatile uint32_t*>(
        ncclGetLsaPointer(window, slots_offset + sizeof(uint32_t) * me, peer));
    *slot = tag ^ static_cast<uint32_t>(me);
  }
  BoundedLsaBarrier<ncclCoopCta> barrier(cta, dev_comm, barrier_index);
  barrier.arrive(cta, cuda::memory_order_acq_rel);
  if (!barrier.wait_bounded(cta, wait)) return;
  const auto* local = static_cast<const volatile uint32_t*>(ncclGetLocalPointer(window, slots_offset));
  for (int peer = threadIdx.x; peer < n; peer += blockDim.x) {
    if (local[peer] != (tag ^ static_cast<uint32_t>(peer))) atomicAdd(mismatches, 1);
  }
}

__global__ void __launch_bounds__(kControlThreads)
    window_geometry_kernel(ncclWindow_t window, int lsa_size, uint64_t* out) {
  for (int p = threadIdx.x; p < lsa_size; p += blockDim.x)
    out[p] = reinterpret_cast<uint64_t>(ncclGetLsaPointer(window, 0, p));
  if (threadIdx.x == 0) out[lsa_size] = reinterpret_cast<uint64_t>(ncclGetLocalPointer(window, 0));
}

// The control launchers' kernels (one each, below).
cudaError_t preload_transport_kernels() {
  return load_kernels(lsa_barrier_kernel, lsa_peer_check_kernel, window_geometry_kernel);
}

}  // namespace deepep

extern "C" int deepep_launch_window_geometry(void* window, int lsa_size, uint64_t* out, void* stream) {
  deepep::window_geometry_kernel<<<1, deepep::kControlThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<ncclWindow_t>(window), lsa_size, out);
  return static_cast<int>(cudaGetLastError());
}

extern "C" int deepep_launch_lsa_barrier(const void* dev_comm, int index, DeepepWaitContext wait, void* stream) {
  const ncclDevComm& dc = *static_cast<const ncclDevComm*>(dev_comm);
  deepep::lsa_barrier_kernel<<<1, deepep::kControlThreads, 0, static_cast<cudaStream_t>(stream)>>>(dc, index, wait);
  return static_cast<int>(cudaGetLastError());
}

extern "C" int deepep_launch_lsa_peer_check(const void* dev_comm, void* window, size_t slots_offset, uint32_t tag,
                                            int barrier_index, DeepepWaitContext wait, int32_t* mismatches,
                                            void* stream) {
  const ncclDevComm& dc = *static_cast<const ncclDevComm*>(dev_comm);
  deepep::lsa_peer_check_kernel<<<1, deepep::kControlThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      dc, static_cast<ncclWindow_t>(window), slots_offset, tag, barrier_index, wait, mismatches);
  return static_cast<int>(cudaGetLastError());
}
