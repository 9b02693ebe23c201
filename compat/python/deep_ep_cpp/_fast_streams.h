// DeepEP's stream protocol for the compiled host path: the comm stream waits for the compute
// stream before an op, and the compute stream for the comm stream after it, through an event.
// The module is built with torch's headers only (no CUDA toolkit needed), so the few CUDA driver
// entry points are looked up in the libcuda that torch already loaded. Through Python the same
// two record + wait pairs cost about 3.5 us per op (torch's event methods). The ctypes path's twin
// is _streams.py; _fast_order.h says why two remain and which test holds them equal.
#pragma once

#include <dlfcn.h>

#include "_fast_common.h"
#include "_fast_order.h"

namespace deepep_fast {

// Returned (with the driver's error code) when the ordering itself failed.
constexpr int kDriverError = -3;

class CudaDriver {
 public:
  using Event = void*;
  using Stream = void*;

  // nullptr when libcuda or an entry point is missing (the Python protocol is used then).
  static const CudaDriver* get() {
    static const CudaDriver* driver = load();
    return driver;
  }

  int (*event_create)(Event*, unsigned);
  int (*event_destroy)(Event);
  int (*event_record)(Event, Stream);
  int (*stream_wait_event)(Stream, Event, unsigned);
  int (*stream_synchronize)(Stream);
  int (*ctx_get_device)(int*);
  // Optional (nullptr where missing): only the direct entries' previous_event takes it (_fast_direct.h).
  int (*stream_is_capturing)(Stream, int*);

 private:
  static const CudaDriver* load() {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == nullptr) return nullptr;
    static CudaDriver d;
    // The unversioned names are the ABI these signatures have; cuEventDestroy's is _v2.
    if (!find(lib, "cuEventCreate", d.event_create) || !find(lib, "cuEventDestroy_v2", d.event_destroy) ||
        !find(lib, "cuEventRecord", d.event_record) || !find(lib, "cuStreamWaitEvent", d.stream_wait_event) ||
        !find(lib, "cuStreamSynchronize", d.stream_synchronize) || !find(lib, "cuCtxGetDevice", d.ctx_get_device))
      return nullptr;
    find(lib, "cuStreamIsCapturing", d.stream_is_capturing);
    return &d;
  }

  template <typename Fn>
  static bool find(void* lib, const char* name, Fn& fn) {
    fn = reinterpret_cast<Fn>(dlsym(lib, name));
    return fn != nullptr;
  }
};

// One buffer's stream ordering: an event of its own (created in the context current at
// construction: the buffer's device, as Buffer.sync() makes it).
class StreamOrder {
 public:
  explicit StreamOrder(int device) : driver_(CudaDriver::get()), device_(device) {
    constexpr unsigned kDisableTiming = 0x2;
    if (driver_ != nullptr && driver_->event_create(&event_, kDisableTiming) != 0) event_ = nullptr;
  }
  ~StreamOrder() {
    if (event_ != nullptr) driver_->event_destroy(event_);
  }
  StreamOrder(const StreamOrder&) = delete;
  StreamOrder& operator=(const StreamOrder&) = delete;

  // Whether this thread can order streams here: the stream handle 0 / 1 (legacy default stream)
  // means the current context's, so the current device must be the buffer's.
  bool usable() const {
    int device = -1;
    return event_ != nullptr && driver_->ctx_get_device(&device) == 0 && device == device_;
  }

  // Orders waiter's later work after signaler's work so far; 0 or the driver's error.
  int wait(uintptr_t waiter, uintptr_t signaler) const {
    const int recorded = driver_->event_record(event_, as_stream(signaler));
    return recorded != 0 ? recorded : driver_->stream_wait_event(as_stream(waiter), event_, 0);
  }

  void synchronize(uintptr_t stream) const { driver_->stream_synchronize(as_stream(stream)); }

  // Orders waiter's later work after a caller's event (a cudaEvent_t, nonzero); 0 or the driver's error.
  int wait_event(uintptr_t waiter, uintptr_t event) const {
    return driver_->stream_wait_event(as_stream(waiter), reinterpret_cast<CudaDriver::Event>(event), 0);
  }

  // Whether `stream` is capturing a CUDA graph; also true where that cannot be told.
  bool capturing(uintptr_t stream) const {
    int status = 1;  // CU_STREAM_CAPTURE_STATUS_ACTIVE
    return driver_->stream_is_capturing == nullptr || driver_->stream_is_capturing(as_stream(stream), &status) != 0 ||
           status != 0;
  }

 private:
  const CudaDriver* driver_;
  int device_;
  CudaDriver::Event event_ = nullptr;
};

// The ordering around one launch (_fast_order.h) through this buffer's event.
using Ordering = OrderingOf<StreamOrder>;

inline py::tuple driver_error(int code) { return py::make_tuple(kDriverError, code); }

}  // namespace deepep_fast
