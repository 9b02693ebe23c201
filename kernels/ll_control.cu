// Low-latency housekeeping on the device: clean_low_latency_buffer's reset of the NCCL GIN
// signals (the LSA signal words are plain window memory, zeroed by the host).
#include "ll_common.cuh"

namespace deepep {
namespace ll {

#if DEEPEP_HAVE_GIN
__global__ void reset_gin_signals(ncclDevComm dev_comm, int num_signals) {
  // Transport reads and resets GIN signals through context 0: the same here.
  ncclGin gin(dev_comm, 0);
  for (int id = blockIdx.x * blockDim.x + threadIdx.x; id < num_signals; id += gridDim.x * blockDim.x)
    gin.resetSignal(id);
}
#endif

}  // namespace ll
}  // namespace deepep

extern "C" int deepep_launch_ll_reset_gin_signals(const void* dev_comm, int num_signals, void* stream) {
#if DEEPEP_HAVE_GIN
  const ncclDevComm& dc = *static_cast<const ncclDevComm*>(dev_comm);
  deepep::ll::reset_gin_signals<<<1, 256, 0, static_cast<cudaStream_t>(stream)>>>(dc, num_signals);
  return int(cudaGetLastError());
#else
  (void)dev_comm;
  (void)num_signals;
  (void)stream;
  return int(cudaErrorNotSupported);
#endif
}
