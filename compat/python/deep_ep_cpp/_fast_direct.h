// The direct entries of the compiled host path: DeepEP's Buffer methods (get_dispatch_layout,
// intranode_dispatch / _combine, low_latency_dispatch / _combine and deep_ep's _ll_dispatch /
// _ll_combine) as methods of the ops objects, which sync() makes the deep_ep_cpp.Buffer's instance
// attributes: a call goes from Python straight into C++, without the 4-9 us of the Buffer class's
// Python method. A direct entry takes only the fast case (no previous_event, no async_, no
// allocate_on_comm_stream, arguments that convert, a deep_ep_cpp Config). Anything else, and input
// the op does not take (kBadInput, kNewShape: nothing was launched or ordered then), goes to the
// class's Python method with the same arguments (the fallback), which handles events, names bad
// arguments (the ctypes path) and raises the same errors as before.
#pragma once

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <initializer_list>
#include <string>

#include "_fast_streams.h"

namespace deepep_fast {

// torch's default stream has the handle 0, which the C ABI reads as "the buffer's comm stream": it
// travels as cudaStreamLegacy (the same stream), as _streams.py's stream_handle does.
constexpr uintptr_t kCudaStreamLegacy = 1;

// The C ABI's handle of `device`'s current (compute) stream, through c10 (no CUDA headers).
inline uintptr_t current_stream(int device) {
  const c10::Device on(c10::DeviceType::CUDA, c10::DeviceIndex(device));
  const auto handle = reinterpret_cast<uintptr_t>(c10::impl::getDeviceGuardImpl(on.type())->getStream(on).native_handle());
  return handle != 0 ? handle : kCudaStreamLegacy;
}

// deep_ep_cpp's pieces the compiled path needs (set_python_helpers, once per process): what the
// Python path raises for a failed call, and the Config class (its instances carry their C
// struct's address as `_address`). Never destroyed: no destructor may run at interpreter exit.
struct __attribute__((visibility("hidden"))) PythonHelpers {
  py::object raise_status;        // raise_status(status): the library's error
  py::object raise_driver_error;  // raise_driver_error(code): a failed stream ordering
  py::object config_type;
};

inline const PythonHelpers*& python_helpers() {
  static const PythonHelpers* helpers = nullptr;
  return helpers;
}

inline void set_python_helpers(py::object raise_status, py::object raise_driver_error, py::object config_type) {
  if (python_helpers() == nullptr)
    python_helpers() = new PythonHelpers{std::move(raise_status), std::move(raise_driver_error), std::move(config_type)};
}

// Raises what the Python path raises for an op's failed result: (kDriverError, code) or (status,).
[[noreturn]] inline void raise_failed(const py::tuple& result) {
  const int status = result[0].cast<int>();
  if (const PythonHelpers* h = python_helpers()) {
    if (status == kDriverError)
      h->raise_driver_error(result[1]);
    else
      h->raise_status(status);
  }
  throw std::runtime_error("deepep-nccl: compiled op failed with status " + std::to_string(status) +
                           " (no status raiser registered)");
}

// `src` as pybind converts it for a parameter of type T (what the ops' own bindings accept);
// false where it does not convert.
template <typename T>
bool load(py::handle src, T& out) {
  py::detail::make_caster<T> caster;
  if (!caster.load(src, true)) return false;
  out = py::detail::cast_op<T&&>(std::move(caster));
  return true;
}

inline bool is_false(py::handle flag) { return flag.ptr() == Py_False; }
inline bool is_bool(py::handle flag) { return is_false(flag) || flag.ptr() == Py_True; }

// The address of a deep_ep_cpp Config's C struct (its `_address`); 0 for anything else (a
// subclass, another type, a Config without one), which falls back.
inline uintptr_t config_address(py::handle config) {
  const PythonHelpers* h = python_helpers();
  if (h == nullptr || reinterpret_cast<PyObject*>(Py_TYPE(config.ptr())) != h->config_type.ptr()) return 0;
  static PyObject* const name = PyUnicode_InternFromString("_address");
  PyObject* address = PyObject_GetAttr(config.ptr(), name);
  const uintptr_t value = address != nullptr ? uintptr_t(PyLong_AsVoidPtr(address)) : 0;
  Py_XDECREF(address);
  if (PyErr_Occurred()) PyErr_Clear();
  return value;
}

// In a direct entry's picks: DeepEP's event slot, None on the fast path (no async_).
constexpr int kEventSlot = -1;

// A direct entry's return value from its op's result (status, outputs...): result[i] for each i
// of `picks` (kEventSlot: None) when the op succeeded; a null object for kBadInput and kNewShape
// (the caller falls back); for a failed op it raises what the Python path raises.
inline py::object answer(const py::tuple& result, std::initializer_list<int> picks) {
  const int status = result[0].cast<int>();
  if (status == kBadInput || status == kNewShape) return py::object();
  if (status != 0) raise_failed(result);
  py::tuple out(picks.size());
  size_t i = 0;
  for (const int pick : picks) out[i++] = pick == kEventSlot ? py::none() : py::object(result[pick]);
  return std::move(out);
}

// What the direct entries need of their deep_ep_cpp.Buffer, given once by its sync() (bind_buffer):
// a weak reference to it (it owns the ops object: a strong one would be a cycle) and its comm stream.
// Hidden, as pybind's own types are: it holds a py::object.
class __attribute__((visibility("hidden"))) DirectBinding {
 public:
  void bind(py::object buffer_ref, uintptr_t comm_stream) {
    if (!PyWeakref_CheckRef(buffer_ref.ptr())) throw py::type_error("bind_buffer takes a weakref.ref to the Buffer");
    if (comm_stream == 0) throw py::value_error("bind_buffer takes the comm stream's handle (nonzero)");
    buffer_ref_ = std::move(buffer_ref);
    comm_stream_ = comm_stream;
  }

  // The Buffer (a strong reference for the call). Raises where it was deleted: its handle is freed
  // then (only a caller that kept a direct entry gets here), or where bind_buffer was not called.
  py::object buffer() const {
    PyObject* buffer = nullptr;
    if (buffer_ref_) {
#if PY_VERSION_HEX >= 0x030D0000
      if (PyWeakref_GetRef(buffer_ref_.ptr(), &buffer) < 0) throw py::error_already_set();
#else
      buffer = PyWeakref_GetObject(buffer_ref_.ptr());  // borrowed; None once dead
      buffer = buffer == Py_None ? nullptr : (Py_INCREF(buffer), buffer);
#endif
    }
    if (buffer == nullptr) throw std::runtime_error("deepep-nccl: this op's Buffer was deleted (or never synced)");
    return py::reinterpret_steal<py::object>(buffer);
  }

  uintptr_t comm_stream() const { return comm_stream_; }

  // The fallback: the Buffer class's Python method `name`, with the direct entry's arguments.
  static py::object fallback(const py::object& buffer, const char* name, const py::args& args,
                             const py::kwargs& kwargs) {
    return py::type::handle_of(buffer).attr(name)(buffer, *args, **kwargs);
  }

 private:
  py::object buffer_ref_;
  uintptr_t comm_stream_ = 0;
};

}  // namespace deepep_fast
