// Bounded spin waits: every wait has a %globaltimer budget and, on expiry,
// records who was waiting on whom in host-mapped memory instead of trapping.
#pragma once

#include <nccl_device.h>
#include "deepep_kernels.h"

namespace deepep {

__device__ __forceinline__ uint64_t global_time_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Bad input a kernel found: the first fault wins until the host has reported it. `lock` is
// DeepepWaitContext.fault_lock (the claim; see DeepepFaultRecord). Out of line: it runs only on
// bad input, and inlined it would grow the hot loops that check.
static __device__ __noinline__ void record_fault_at(DeepepFaultRecord* f, uint32_t* lock, int code, int64_t a,
                                                    int64_t b, int64_t c) {
  if (f == nullptr) return;
  const uint32_t released = *reinterpret_cast<volatile uint32_t*>(&f->released);
  if (atomicCAS(lock, released, released + 1u) != released) return;
  f->code = code;
  f->a = a;
  f->b = b;
  f->c = c;
  __threadfence_system();
  *reinterpret_cast<volatile uint32_t*>(&f->flag) = 1u;
}

// `common`: any kernel's common params (each has the record in `fault`, its claim in `wait`).
template <typename Common>
__device__ __forceinline__ void record_fault(const Common& common, int code, int64_t a, int64_t b, int64_t c) {
  record_fault_at(common.fault, common.wait.fault_lock, code, a, b, c);
}

// First expiring waiter wins; the others keep the first report.
__device__ __forceinline__ void record_stall(const DeepepWaitContext& w, int peer, int op, int counter,
                                             int64_t expected, int64_t seen) {
  DeepepStallRecord* r = w.stall;
  if (r == nullptr) return;
  // The claim lives in device memory: atomics on host-mapped memory are not
  // guaranteed over PCIe.
  if (atomicCAS(w.stall_lock, 0u, 1u) != 0u) return;
  r->rank = w.world_rank;
  r->peer = peer;
  r->op = op;
  r->counter = counter;
  r->expected = expected;
  r->seen = seen;
  __threadfence_system();
  *reinterpret_cast<volatile uint32_t*>(&r->flag) = 1;
  __threadfence_system();
}

// True once any wait of this buffer expired: later waits give up at once so a
// dead peer costs one timeout, not one per wait.
__device__ __forceinline__ bool buffer_failed(const DeepepWaitContext& w) {
  return *reinterpret_cast<volatile uint32_t*>(w.stall_lock) != 0;
}

// Fills `bytes` at p with 0xff across the grid: NaN in every float dtype (and UE8M0), -1 in
// int32/int64. A data kernel that skipped or abandoned its work after a stall leaves its
// outputs so, because CUDA-graph replays never reach the host check that reports the stall:
// their outputs must not look like results (review F9). Not inlined: it runs only after a
// stall, and one copy keeps the data kernels' code as it was.
static __device__ __noinline__ void poison_output(void* p, int64_t bytes) {
  if (p == nullptr || bytes <= 0) return;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, step = int64_t(gridDim.x) * blockDim.x;
  uint8_t* b = static_cast<uint8_t*>(p);
  const int64_t head = min(bytes, int64_t((16 - (reinterpret_cast<uintptr_t>(b) & 15)) & 15));
  const int64_t words = (bytes - head) / 16;
  for (int64_t i = first; i < head; i += step) b[i] = 0xff;
  int4* w = reinterpret_cast<int4*>(b + head);
  for (int64_t i = first; i < words; i += step) w[i] = make_int4(-1, -1, -1, -1);
  for (int64_t i = head + words * 16 + first; i < bytes; i += step) b[i] = 0xff;
}

// NCCL's LSA barrier with a bounded wait. arrive() is NCCL's; the unicast wait
// is re-implemented over the session's own inbox slots so that a dead peer
// produces a stall record instead of a hang (NCCL < 2.30 has no timeout).
template <typename Coop>
struct BoundedLsaBarrier : ncclLsaBarrierSession<Coop> {
  __device__ BoundedLsaBarrier(Coop coop, ncclDevComm const& comm, uint32_t index)
      : ncclLsaBarrierSession<Coop>(coop, comm, ncclTeamTagLsa(), index, /*multimem=*/false) {}

  // Returns false (and leaves the epoch unadvanced) when a peer never arrived.
  __device__ bool wait_bounded(Coop coop, const DeepepWaitContext& w) {
    __shared__ int timed_out;
    if (coop.thread_rank() == 0) timed_out = 0;
    coop.sync();
    const uint32_t target = this->epoch + 1;
    for (int i = coop.thread_rank(); i < this->team.nRanks - 1; i += coop.size()) {
      const int peer = i + (this->team.rank <= i ? 1 : 0);
      cuda::atomic_ref<uint32_t> inbox(*this->ucInbox(this->team.rank, peer));
      const uint64_t start = global_time_ns();
      uint32_t got;
      while (true) {
        got = inbox.load(cuda::memory_order_acquire);
        if (got - target <= (uint32_t(-1) >> 1)) break;
        if (global_time_ns() - start > w.timeout_ns) {
          record_stall(w, w.lsa_base_rank + peer, DEEPEP_WAIT_OP_LSA_BARRIER, this->index, target, got);
          atomicExch(&timed_out, 1);
          break;
        }
      }
    }
    coop.sync();
    const bool ok = (timed_out == 0);
    if (ok) this->epoch += 1;
    return ok;
  }

  // Shrink mode: waits for every peer except those in `skip` (bits of LSA ranks) and returns
  // the ones that did not arrive within the timeout, with no stall record. The epoch advances
  // either way: the survivors went through, and a silent peer's later arrivals count toward
  // targets it no longer reaches (it is masked; rejoining takes a new buffer).
  __device__ uint32_t wait_survivors(Coop coop, const DeepepWaitContext& w, uint32_t skip) {
    __shared__ uint32_t missing;
    if (coop.thread_rank() == 0) missing = 0;
    coop.sync();
    const uint32_t target = this->epoch + 1;
    for (int i = coop.thread_rank(); i < this->team.nRanks - 1; i += coop.size()) {
      const int peer = i + (this->team.rank <= i ? 1 : 0);
      if ((skip >> peer) & 1u) continue;
      cuda::atomic_ref<uint32_t> inbox(*this->ucInbox(this->team.rank, peer));
      const uint64_t start = global_time_ns();
      while (true) {
        const uint32_t got = inbox.load(cuda::memory_order_acquire);
        if (got - target <= (uint32_t(-1) >> 1)) break;
        if (global_time_ns() - start > w.timeout_ns) {
          atomicOr(&missing, 1u << peer);
          break;
        }
      }
    }
    coop.sync();
    this->epoch += 1;
    return missing;
  }
};

}  // namespace deepep
