// The waits of DeepEP's stream protocol around one op of the compiled host path: the launch stream
// waits for the compute stream before the op, the compute stream for the launch after it. The
// ctypes path does the same waits in Python (_streams.py: ORDER_BEFORE / ORDER_AFTER, torch
// events). Two implementations on purpose: this one must not call back into Python (that is the
// host time the compiled path saves). No torch and no CUDA here, so that tests/python can compile
// it alone and hold both to the same flags and waits (test_stream_order_matches_the_compiled_path).
#pragma once

#include <cstdint>

namespace deepep_fast {

// Order flags of an op: what the compiled path does around its launch.
constexpr int kOrderBefore = 1;  // the launch stream waits for the compute stream's work so far
constexpr int kOrderAfter = 2;   // the compute stream waits for the launch

// The ordering around one launch on `stream` for an op called on `compute` (flags: kOrder*).
// Order: usable(), wait(waiter, signaler) -> 0 or the driver's error, synchronize(stream).
template <typename Order>
struct OrderingOf {
  const Order* order;
  uintptr_t compute;
  int flags;

  // Checked before anything else: an op that cannot order its streams here takes the ctypes path.
  bool usable() const { return flags == 0 || order->usable(); }

  // Before a launch whose input checks passed; 0 or the driver's error.
  int before(uintptr_t stream) const { return (flags & kOrderBefore) ? order->wait(stream, compute) : 0; }
  // After a successful launch; 0 or the driver's error. On an error the caller drops the op's
  // outputs, which the compute stream's allocator may then reuse: the launch finishes first.
  int after(uintptr_t stream) const {
    if (!(flags & kOrderAfter)) return 0;
    const int error = order->wait(compute, stream);
    if (error != 0) order->synchronize(stream);
    return error;
  }
};

}  // namespace deepep_fast
