// The receive hook protocol of the compiled host path's LL ops, without torch or pybind so that
// tests/python/test_ll_abi_cpu.py compiles it on a CPU machine.
//
// DeepEP's return_recv_hook: the op's send phase runs now (phases = send), and its hook later
// launches the receive phase with a copy of the op's arguments (phases = receive), on the stream
// the send ran on, into the buffer half the send used. Three copies of this exist, held equal by
// test_ll_abi_cpu.py: this one, _low_latency.py's _recv_hook (the ctypes path, which must work
// when this module cannot be built) and deepep_nccl.hpp's LowLatencyHook::receive (a public header
// of its own; an installed deep_ep_cpp does not ship it, so this module cannot include it).
#pragma once

#include <cstdint>

#include "deepep_nccl.h"

namespace deepep_fast {

// Phases of an LL op (its args' `phases`): the send, the receive, or both.
constexpr int kPhaseSend = DEEPEP_LL_PHASE_SEND;
constexpr int kPhaseRecv = DEEPEP_LL_PHASE_RECV;
constexpr int kPhaseBoth = DEEPEP_LL_PHASE_BOTH;

// The receive phase of a send-only call of `fn` (deepep_low_latency_dispatch or _combine): a copy
// of the args with phases = receive, the send's stream and buffer half. operator() launches it and
// returns the C ABI's status.
template <typename Args>
class LlRecvLaunch {
 public:
  // The shape of deepep_low_latency_dispatch / _combine (_fast_ll.h checks both against the header).
  using Fn = DeepepStatus (*)(const DeepepBuffer*, const Args*, void*, int*);

  LlRecvLaunch(Fn fn, uintptr_t buffer, const Args& args, uintptr_t stream, int buffer_idx)
      : fn_(fn), buffer_(buffer), args_(args), stream_(stream), buffer_idx_(buffer_idx) {
    args_.phases = kPhaseRecv;
  }

  int operator()() {
    return fn_(reinterpret_cast<const DeepepBuffer*>(buffer_), &args_, reinterpret_cast<void*>(stream_),
               &buffer_idx_);
  }

 private:
  Fn fn_;
  uintptr_t buffer_;
  Args args_;
  uintptr_t stream_;
  int buffer_idx_;
};

}  // namespace deepep_fast
