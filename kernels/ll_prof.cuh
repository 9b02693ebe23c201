// Stage timers of the LL kernels, for development builds only:
//   DEEPEP_KERNEL_DEFINES=DEEPEP_PROFILE_LL=1 cargo build --release
// Thread 0 of every block stamps clock64 (cycles since the block's entry) at each stage; at the
// kernel's end the stamps are summed over blocks and maxed per call, and the last block prints,
// every kPrintEvery calls of one (op, phases), the window's mean and mean-of-max per stage, the
// span from the first block's entry to the last block's end, and the entry spread (globaltimer,
// ns). Only rank DEEPEP_PROFILE_LL_RANK (default 0) prints: ranks share stdout, and their device
// printfs interleave mid-line. A stamp inside the token loop keeps the block's last token. Without the define the macros
// are empty and the kernels compile as the product's. docs/low_latency.md "Where the time goes"
// has a reading.
#pragma once

namespace deepep {
namespace ll {
namespace prof {
enum Op { kDispatch, kCombine };
enum DispatchStage { kCounted, kRouted, kStored, kTokenDone, kSent, kSendEnd, kWaited, kBegins, kCopied };
enum CombineStage { kPrefixed, kRowsSent, kCombineSendEnd, kCombineWaited, kReduced };
}  // namespace prof
}  // namespace ll
}  // namespace deepep

#if DEEPEP_PROFILE_LL
#include <cstdio>
#ifndef DEEPEP_PROFILE_LL_RANK
#define DEEPEP_PROFILE_LL_RANK 0
#endif
namespace deepep {
namespace ll {
namespace prof {
constexpr int kStages = 9, kKinds = 6, kPrintEvery = 200;  // kinds: op x phases (send, recv, both)
struct Acc {
  unsigned long long sum[kKinds][kStages], max_sum[kKinds][kStages], cur_max[kKinds][kStages];
  unsigned long long n[kKinds][kStages], calls[kKinds], span_sum[kKinds], spread_sum[kKinds];
  unsigned long long entry_min[kKinds], entry_max[kKinds], end_max[kKinds];
  unsigned int done[kKinds];
};
__device__ Acc g_acc;
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ long long* stamps() {
  __shared__ long long s[kStages + 2];  // stages, then the entry's clock64 and globaltimer
  return s;
}
__device__ __forceinline__ void begin() {
  if (threadIdx.x != 0) return;
  long long* s = stamps();
  for (int i = 0; i < kStages; ++i) s[i] = -1;
  s[kStages] = clock64();
  s[kStages + 1] = (long long)global_ns();
}
__device__ __forceinline__ void stage(int i) {
  if (threadIdx.x == 0) stamps()[i] = clock64() - stamps()[kStages];
}
__device__ inline void end(int op, int phases, int rank) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  const int k = op * 3 + (phases - 1);
  const long long* s = stamps();
  Acc& a = g_acc;
  for (int i = 0; i < kStages; ++i)
    if (s[i] >= 0) {
      atomicAdd(&a.sum[k][i], (unsigned long long)s[i]);
      atomicAdd(&a.n[k][i], 1ull);
      atomicMax(&a.cur_max[k][i], (unsigned long long)s[i]);
    }
  atomicCAS(&a.entry_min[k], 0ull, ~0ull);  // first call: min starts at the top
  atomicMin(&a.entry_min[k], (unsigned long long)s[kStages + 1]);
  atomicMax(&a.entry_max[k], (unsigned long long)s[kStages + 1]);
  atomicMax(&a.end_max[k], global_ns());
  __threadfence();
  if (atomicAdd(&a.done[k], 1u) != gridDim.x - 1) return;
  __threadfence();  // the last block: every other block's adds are in
  a.done[k] = 0;
  for (int i = 0; i < kStages; ++i) {
    a.max_sum[k][i] += a.cur_max[k][i];
    a.cur_max[k][i] = 0;
  }
  a.span_sum[k] += a.end_max[k] - a.entry_min[k];
  a.spread_sum[k] += a.entry_max[k] - a.entry_min[k];
  a.entry_min[k] = ~0ull;
  a.entry_max[k] = a.end_max[k] = 0;
  if (++a.calls[k] % kPrintEvery != 0) return;
  if (rank == DEEPEP_PROFILE_LL_RANK) {
    // A stage not reached reads -1.
    double mean[kStages], max[kStages];
    for (int i = 0; i < kStages; ++i) {
      mean[i] = a.n[k][i] ? double(a.sum[k][i]) / a.n[k][i] : -1.0;
      max[i] = a.n[k][i] ? double(a.max_sum[k][i]) / kPrintEvery : -1.0;
    }
    const double span = double(a.span_sum[k]) / kPrintEvery, spread = double(a.spread_sum[k]) / kPrintEvery;
    if (op == kDispatch)
      printf("[llprof] dispatch phases=%d calls=%llu grid=%u span_ns=%.0f entry_spread_ns=%.0f cycles mean/max: "
             "counted %.0f/%.0f routed %.0f/%.0f stored %.0f/%.0f token_done %.0f/%.0f sent %.0f/%.0f "
             "send_end %.0f/%.0f waited %.0f/%.0f begins %.0f/%.0f copied %.0f/%.0f\n",
             phases, a.calls[k], gridDim.x, span, spread, mean[0], max[0], mean[1], max[1], mean[2], max[2], mean[3],
             max[3], mean[4], max[4], mean[5], max[5], mean[6], max[6], mean[7], max[7], mean[8], max[8]);
    else
      printf("[llprof] combine phases=%d calls=%llu grid=%u span_ns=%.0f entry_spread_ns=%.0f cycles mean/max: "
             "prefixed %.0f/%.0f rows_sent %.0f/%.0f send_end %.0f/%.0f waited %.0f/%.0f reduced %.0f/%.0f\n",
             phases, a.calls[k], gridDim.x, span, spread, mean[0], max[0], mean[1], max[1], mean[2], max[2], mean[3],
             max[3], mean[4], max[4]);
  }
  for (int i = 0; i < kStages; ++i) a.sum[k][i] = a.n[k][i] = a.max_sum[k][i] = 0;
  a.span_sum[k] = a.spread_sum[k] = 0;
}
}  // namespace prof
}  // namespace ll
}  // namespace deepep
#define LL_PROF_BEGIN() ::deepep::ll::prof::begin()
#define LL_PROF_STAGE(i) ::deepep::ll::prof::stage(i)
#define LL_PROF_END(op, phases, rank) ::deepep::ll::prof::end(op, phases, rank)
#else
#define LL_PROF_BEGIN() ((void)0)
#define LL_PROF_STAGE(i) ((void)0)
#define LL_PROF_END(op, phases, rank) ((void)0)
#endif
