// clean_low_latency_buffer on the device, as DeepEP's: one block on the caller's stream runs a
// barrier over the ranks, zeroes this rank's LL signal words, counters and GIN signals, and
// barriers again, so no rank signals into a half before its owner has zeroed it. Nothing waits
// on the host, so it can be captured in a CUDA graph and costs no device synchronization at a
// normal -> LL switch.
//
// The barrier is an all-to-all of arrival counts over the LL transport (LSA adds inside the
// node, GIN signals of bank DEEPEP_LL_CLEAN_BANK across nodes): rank s adds 1 to word [s] of
// every peer, then waits until each peer's word reaches its own count of barriers passed. The
// words are never reset, so there is nothing to race with. Shrink mode skips masked ranks and
// masks a rank that does not arrive in time (DeepEP's mask-aware barrier); outside shrink mode
// a late rank is a stall record and the buffer reports it at its next call.
//
// The LL signals carry the clean generation (the barriers passed, see ll_common.cuh): a signal
// from before the clean, such as a masked rank's late one landing after the zeroing, can never
// match afterwards.
//
// Shrink mode, counts out of step. Peers in the node get this rank's arrivals even when masked,
// so a live rank masked for being slow stays in step and rejoins after
// low_latency_clean_mask_buffer. A rank that missed a whole clean never reaches its peers' count:
// they mask it at every later clean, so it cannot rejoin that buffer (DeepEP's cannot either).
// It may itself take the missed clean's arrivals for the current one and pass early, which is
// harmless: every peer that went on without it had it masked and sends it nothing. A peer more
// than one barrier ahead went on without this rank and counts as never arrived. Across nodes
// masked peers get no arrival, as in DeepEP (a dead node's queue may fail). GIN: an arrival goes
// on the same context as this rank's earlier LL signals to that peer, so it lands after them and
// the zeroing after the first barrier clears them.
#include "ll_common.cuh"

namespace deepep {
namespace ll {

constexpr int kCleanThreads = 512;

enum CleanArrival { kNotYet, kArrived, kOutOfStep };

// Where a peer's count `seen` stands against this barrier's `target`. Target + 1 is in step: the
// peer passed this barrier (it needed this rank's arrival) and reached the next one. Further
// ahead is only possible with counts out of step.
__device__ __forceinline__ CleanArrival clean_arrival(uint32_t seen, uint32_t target) {
  const int32_t ahead = int32_t(seen - target);
  return ahead < 0 ? kNotYet : ahead <= 1 ? kArrived : kOutOfStep;
}

template <int kRemote>
__device__ void clean_barrier(const Transport<kRemote>& t, uint32_t target) {
  const DeepepLlCommon& c = t.c;
  // Every thread's earlier writes (this kernel's zeroing; earlier kernels are stream-ordered
  // before it) are released to the system before any arrival leaves this rank.
  __threadfence_system();
  __syncthreads();
  for (int peer = threadIdx.x; peer < c.num_ranks; peer += blockDim.x) {
    const bool over_lsa = kRemote != kRemoteGin || t.direct(peer);
    if (over_lsa || peer_active(c, peer)) t.arrive(peer);
  }
  for (int src = threadIdx.x; src < c.num_ranks; src += blockDim.x) {
    if (!peer_active(c, src)) continue;
    uint32_t seen = t.read_arrivals(src);
    CleanArrival state = clean_arrival(seen, target);
    bool masked_meanwhile = false;
    const uint64_t start = global_time_ns();
    while (state == kNotYet) {
      if (c.shrink && *reinterpret_cast<volatile int*>(c.mask + src) != 0) {
        masked_meanwhile = true;
        break;
      }
      if (global_time_ns() - start > c.wait.timeout_ns) break;
      seen = t.read_arrivals(src);
      state = clean_arrival(seen, target);
    }
    if (state == kArrived || masked_meanwhile) continue;
    if (c.shrink) {
      atomicExch(c.mask + src, 1);
    } else {
      record_stall(c.wait, src, DEEPEP_WAIT_OP_LL_CLEAN, 0, target, seen);
    }
  }
  __syncthreads();
}

template <int kRemote>
__global__ void __launch_bounds__(kCleanThreads) clean_kernel(ncclDevComm dev_comm, DeepepLlCleanParams p) {
  const Transport<kRemote> t(p.common, dev_comm);
  __shared__ uint32_t passed;
  if (threadIdx.x == 0) passed = *p.barrier_epoch;
  __syncthreads();
  const uint32_t epoch = passed;

  // Peers may still be signalling into this rank's halves (their last LL op).
  clean_barrier(t, epoch + 1);
  for (int r = 0; r < DEEPEP_LL_CLEAN_REGIONS; ++r) {
    auto* words = static_cast<uint32_t*>(p.zero[r]);
    if (words == nullptr) continue;
    for (int64_t i = threadIdx.x; i < p.zero_bytes[r] / 4; i += blockDim.x) words[i] = 0;
  }
#if DEEPEP_HAVE_GIN
  if constexpr (kRemote == kRemoteGin) {
    // Transport reads and resets GIN signals through context 0: the same here.
    ncclGin gin(dev_comm, 0);
    for (int id = threadIdx.x; id < p.num_gin_signals; id += blockDim.x) gin.resetSignal(id);
  }
#endif
  // A new generation: no signal written before this clean (a masked rank's late one included)
  // can equal a value sent after it. Ranks in step pass the same barriers, so they agree on it.
  __syncthreads();  // the zeroing above covers op_seq
  const uint64_t generation = uint64_t(epoch + 2) << 32;
  for (int i = threadIdx.x; i < 4 * DEEPEP_LL_MAX_BLOCKS; i += blockDim.x) p.common.op_seq[i] = generation;
  // No peer's next LL op may signal this rank before the zeroing above is done.
  clean_barrier(t, epoch + 2);
  if (threadIdx.x == 0) *p.barrier_epoch = epoch + 2;
}

// The launcher's kernels, by remote kind.
constexpr void (*kCleanKernels[kRemoteKinds])(ncclDevComm, DeepepLlCleanParams) = {
    clean_kernel<kRemoteNone>,
    clean_kernel<kRemoteEmulated>,
#if DEEPEP_HAVE_GIN
    clean_kernel<kRemoteGin>,
#endif
};

}  // namespace ll

cudaError_t preload_ll_control_kernels() { return load_kernels(ll::kCleanKernels); }

}  // namespace deepep

extern "C" int deepep_launch_ll_clean(const void* dev_comm, const DeepepLlCleanParams* params, int remote_kind,
                                      void* stream) {
  using namespace deepep::ll;
  const ncclDevComm& dc = *static_cast<const ncclDevComm*>(dev_comm);
  if (remote_kind < 0 || remote_kind >= kRemoteKinds) return int(cudaErrorInvalidValue);
  const auto kernel = kCleanKernels[remote_kind];
  return deepep::launch_kernel(kernel, 1, kCleanThreads, 0, static_cast<cudaStream_t>(stream), dc, *params);
}
