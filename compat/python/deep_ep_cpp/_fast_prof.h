// Host-time stage timers of the compiled entries, for development builds: a module built with
// DEEPEP_NCCL_FAST_PROFILE=1 (_fast.py adds -DDEEPEP_FAST_PROFILE and skips the prebuilt one)
// prints, every kReportEvery calls of an op, the mean microseconds between its consecutive marks
// to stderr as one `[hostprof]` line. The product build compiles every mark out.
//
// An entry starts its op's timer (DEEPEP_FAST_BEGIN, naming the op and up to two variants, kept
// apart: e.g. a cached dispatch and one that waits for its count); the functions it calls pick the
// variant once they know it (DEEPEP_FAST_VARIANT) and mark stages (DEEPEP_FAST_MARK); both are
// no-ops where no timer runs on this thread (e.g. under the class methods' calls). The entry ends
// it just before it returns (DEEPEP_FAST_END); the last stage, up to the end, is "return". A
// timer is not synchronized: one thread at a time per op, as the benchmarks call them.
#pragma once

#ifdef DEEPEP_FAST_PROFILE
#include <array>
#include <chrono>
#include <cstdio>

namespace deepep_fast {

class StageTimer {
 public:
  StageTimer(const char* op, const char* variant0, const char* variant1) : op_(op), variants_{variant0, variant1} {}

  void begin() {
    variant_ = 0;
    stages_ = 0;
    last_ = now();
    start_ = last_;
    current() = this;
  }
  void variant(int v) { variant_ = v != 0 && variants_[1] != nullptr ? 1 : 0; }
  void mark(const char* stage) {
    const double t = now();
    if (stages_ < kMaxStages) {
      names_[stages_] = stage;
      call_[stages_++] = t - last_;
    }
    last_ = t;
  }
  // A call that never ends (a fallback, an error) adds nothing: its stages count at its end.
  void end() {
    mark("return");
    Stats& s = stats_[variant_];
    for (int i = 0; i < stages_; ++i) s.sum[i] += call_[i];
    s.total += last_ - start_;
    current() = nullptr;
    if (++s.calls % kReportEvery != 0) return;
    std::fprintf(stderr, "[hostprof] %s (%s): %ld calls, mean us: total %.2f |", op_, variants_[variant_], s.calls,
                 s.total / s.calls);
    for (int i = 0; i < stages_; ++i) std::fprintf(stderr, " %s %.2f", names_[i], s.sum[i] / s.calls);
    std::fprintf(stderr, "\n");
  }
  // The timer an entry of this thread started (nullptr: none).
  static StageTimer*& current() {
    thread_local StageTimer* timer = nullptr;
    return timer;
  }

 private:
  static constexpr int kMaxStages = 16;
  static constexpr long kReportEvery = 1000;
  struct Stats {
    std::array<double, kMaxStages> sum{};
    double total = 0;
    long calls = 0;
  };
  static double now() {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  const char* op_;
  std::array<const char*, 2> variants_;
  std::array<const char*, kMaxStages> names_{};
  std::array<double, kMaxStages> call_{};
  std::array<Stats, 2> stats_{};
  double start_ = 0, last_ = 0;
  int variant_ = 0, stages_ = 0;
};

}  // namespace deepep_fast

// Starts the timer of `op` (string literals; one timer per call site).
#define DEEPEP_FAST_BEGIN(op, variant0, variant1)                           \
  do {                                                                      \
    static ::deepep_fast::StageTimer timer_{op, variant0, variant1};        \
    timer_.begin();                                                         \
  } while (0)
#define DEEPEP_FAST_VARIANT(v)                                                                 \
  do {                                                                                         \
    if (::deepep_fast::StageTimer* t_ = ::deepep_fast::StageTimer::current()) t_->variant(v); \
  } while (0)
#define DEEPEP_FAST_MARK(stage)                                                                \
  do {                                                                                         \
    if (::deepep_fast::StageTimer* t_ = ::deepep_fast::StageTimer::current()) t_->mark(stage); \
  } while (0)
#define DEEPEP_FAST_END()                                                                \
  do {                                                                                   \
    if (::deepep_fast::StageTimer* t_ = ::deepep_fast::StageTimer::current()) t_->end(); \
  } while (0)
#else
#define DEEPEP_FAST_BEGIN(op, variant0, variant1) \
  do {                                            \
  } while (0)
#define DEEPEP_FAST_VARIANT(v) \
  do {                         \
  } while (0)
#define DEEPEP_FAST_MARK(stage) \
  do {                          \
  } while (0)
#define DEEPEP_FAST_END() \
  do {                    \
  } while (0)
#endif
