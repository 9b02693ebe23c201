// The direct entries of the compiled host path: DeepEP's Buffer methods (get_dispatch_layout,
// intranode_dispatch / _combine, low_latency_dispatch / _combine and deep_ep's _ll_dispatch /
// _ll_combine) as methods of the ops objects, which sync() makes the deep_ep_cpp.Buffer's instance
// attributes: a call goes from Python straight into C++, without the 4-9 us of the Buffer class's
// Python method. A direct entry takes only the fast case (no previous_event, no async_, no
// allocate_on_comm_stream, arguments that convert, a deep_ep_cpp Config), and DeepEP's events
// (previous_event, async_, allocate_on_comm_stream: OpStreams below, as _streams.py's protocol) where
// they are what the class method takes them for. Anything else, and input the op does not take
// (kBadInput, kNewShape: nothing was launched then), goes to the class's Python method with the same
// arguments (the fallback), which names bad arguments (the ctypes path) and raises the same errors.
#pragma once

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <array>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>

#include "_fast_streams.h"

namespace deepep_fast {

// torch's default stream has the handle 0, which the C ABI reads as "the buffer's comm stream": it
// travels as cudaStreamLegacy (the same stream), as _streams.py's stream_handle does.
constexpr uintptr_t kCudaStreamLegacy = 1;

// `device`'s current (compute) stream, through c10 (no CUDA headers).
inline c10::Stream current_stream(int device) {
  const c10::Device on(c10::DeviceType::CUDA, c10::DeviceIndex(device));
  return c10::impl::getDeviceGuardImpl(on.type())->getStream(on);
}

// The C ABI's handle of a torch stream.
inline uintptr_t stream_handle(const c10::Stream& s) {
  const auto handle = reinterpret_cast<uintptr_t>(s.native_handle());
  return handle != 0 ? handle : kCudaStreamLegacy;
}

// deep_ep_cpp's pieces the compiled path needs (set_python_helpers, once per process): what the
// Python path raises for a failed call, the Config class (its instances carry their C struct's
// address as `_address`) and DeepEP's events: the EventHandle class (_event.py: its one slot,
// `event`, holds a torch.cuda.Event) with torch's classes under it. Never destroyed: no destructor
// may run at interpreter exit.
struct __attribute__((visibility("hidden"))) PythonHelpers {
  py::object raise_status;        // raise_status(status): the library's error
  py::object raise_driver_error;  // raise_driver_error(code): a failed stream ordering
  py::object config_type;
  py::object event_handle_type;   // deep_ep_cpp.EventHandle
  py::object cuda_event_type;     // torch.cuda.Event
  py::object cuda_event_base;     // torch._C._CudaEventBase: its tp_new makes, its `record` records
  py::object record;              // _CudaEventBase.record(event, stream), under torch.cuda.Event.record
  py::object cuda_stream_base;    // torch._C._CudaStreamBase: what `record` takes (unchecked there)
  // Whether the direct entries take DeepEP's events: torch has CUDA and its Event is made as below.
  bool events = false;
};

inline const PythonHelpers*& python_helpers() {
  static const PythonHelpers* helpers = nullptr;
  return helpers;
}

// Returns whether the direct entries take DeepEP's events (PythonHelpers::events): then
// current_stream_event() may be called.
inline bool set_python_helpers(py::object raise_status, py::object raise_driver_error, py::object config_type,
                               py::object event_handle_type) {
  if (python_helpers() != nullptr) return python_helpers()->events;
  auto* h = new PythonHelpers{};
  h->raise_status = std::move(raise_status);
  h->raise_driver_error = std::move(raise_driver_error);
  h->config_type = std::move(config_type);
  h->event_handle_type = std::move(event_handle_type);
  const py::module_ torch_c = py::module_::import("torch._C");
  h->cuda_event_base = py::getattr(torch_c, "_CudaEventBase", py::none());
  h->cuda_stream_base = py::getattr(torch_c, "_CudaStreamBase", py::none());
  h->cuda_event_type = py::module_::import("torch.cuda").attr("Event");
  // recorded_event() makes a torch.cuda.Event as its __new__ does with its defaults (the base's
  // tp_new) and runs no __init__: only where it derives from the base alone and no class has one.
  if (!h->cuda_event_base.is_none() && !h->cuda_stream_base.is_none()) {
    const auto type = reinterpret_cast<PyTypeObject*>(h->cuda_event_type.ptr());
    h->record = h->cuda_event_base.attr("record");
    h->events = type->tp_base == reinterpret_cast<PyTypeObject*>(h->cuda_event_base.ptr()) &&
                PyTuple_GET_SIZE(type->tp_bases) == 1 && type->tp_init == PyBaseObject_Type.tp_init;
  }
  python_helpers() = h;
  return h->events;
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

inline bool is_bool(py::handle flag) { return flag.ptr() == Py_True || flag.ptr() == Py_False; }

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

// In a direct entry's picks: DeepEP's event slot.
constexpr int kEventSlot = -1;

// A direct entry's return value from its op's result (status, outputs...): result[i] for each i
// of `picks` (kEventSlot: what event() returns, called once the op succeeded: the EventHandle or
// None) when the op succeeded; a null object for kBadInput and kNewShape (the caller falls back);
// for a failed op it raises what the Python path raises.
template <typename Event>
py::object answer(const py::tuple& result, std::initializer_list<int> picks, Event event) {
  const int status = result[0].cast<int>();
  if (status == kBadInput || status == kNewShape) return py::object();
  if (status != 0) raise_failed(result);
  const py::object made = event();
  py::tuple out(picks.size());
  size_t i = 0;
  for (const int pick : picks) out[i++] = pick == kEventSlot ? made : py::object(result[pick]);
  return std::move(out);
}

inline py::object steal(PyObject* o) {
  if (o == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(o);
}

// The name of a deep_ep_cpp.EventHandle's one slot (_event.py): its torch.cuda.Event.
inline PyObject* event_slot() {
  static PyObject* const name = PyUnicode_InternFromString("event");
  return name;
}

// A torch.cuda.Event recorded on `stream` (a torch stream object: torch.cuda.Stream or its C base):
// what torch.cuda.Event().record(stream) makes, without their Python frames: the event its
// __new__ makes with its defaults (the base's tp_new, no arguments), recorded by the C method under
// torch.cuda.Event.record. Only where helpers->events.
inline py::object recorded_cuda_event(const PythonHelpers& h, py::handle stream) {
  const py::tuple none;
  const auto base = reinterpret_cast<PyTypeObject*>(h.cuda_event_base.ptr());
  py::object event = steal(base->tp_new(reinterpret_cast<PyTypeObject*>(h.cuda_event_type.ptr()), none.ptr(), nullptr));
  steal(PyObject_CallFunctionObjArgs(h.record.ptr(), event.ptr(), stream.ptr(), nullptr));
  return event;
}

// A deep_ep_cpp.EventHandle recorded on `stream` (a torch.cuda.Stream): what EventHandle(stream)
// makes (_event.py), its event set as `event` (object.__new__: no __init__ to run).
inline py::object recorded_event(const PythonHelpers& h, py::handle stream) {
  const py::tuple none;
  py::object handle = steal(PyBaseObject_Type.tp_new(reinterpret_cast<PyTypeObject*>(h.event_handle_type.ptr()), none.ptr(), nullptr));
  if (PyObject_SetAttr(handle.ptr(), event_slot(), recorded_cuda_event(h, stream).ptr()) != 0)
    throw py::error_already_set();
  return handle;
}

// torch.cuda.Event() recorded on the current stream of the current device: what EventHandle()
// makes (_event.py takes it from here once set_python_helpers returned true). Its Python twin
// builds a torch.cuda.Stream for the current stream per call, the larger part of its cost; here
// the torch stream object (the C base) of the last current stream is kept.
inline py::object current_stream_event() {
  const PythonHelpers* h = python_helpers();
  if (h == nullptr || !h->events)
    throw std::runtime_error("deepep-nccl: current_stream_event needs set_python_helpers with torch's CUDA events");
  const c10::impl::DeviceGuardImplInterface* cuda = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  const c10::Stream current = cuda->getStream(cuda->getDevice());
  // Never destroyed (no destructor may run at interpreter exit); read and replaced under the GIL.
  static auto* const last = new std::pair<std::optional<c10::Stream>, py::object>();
  if (last->first != current) {
    const c10::StreamData3 packed = current.pack3();
    last->second = h->cuda_stream_base(py::arg("stream_id") = packed.stream_id,
                                       py::arg("device_index") = packed.device_index,
                                       py::arg("device_type") = static_cast<int>(packed.device_type));
    last->first = current;
  }
  // A reference of this call's own: torch's record may release the GIL, and another thread's call
  // may replace `last` meanwhile.
  const py::object stream = last->second;
  return recorded_cuda_event(*h, stream);
}

// previous_event's raw cudaEvent_t into `event` (0: never recorded, where torch's wait does
// nothing) where it is a deep_ep_cpp.EventHandle holding a torch.cuda.Event (whose wait the class
// method calls); false for anything else, subclasses too (the class method takes it).
inline bool previous_event_of(const PythonHelpers& h, py::handle previous_event, uintptr_t& event) {
  static PyObject* const handle_name = PyUnicode_InternFromString("cuda_event");
  if (Py_TYPE(previous_event.ptr()) != reinterpret_cast<PyTypeObject*>(h.event_handle_type.ptr())) return false;
  PyObject* inner = PyObject_GetAttr(previous_event.ptr(), event_slot());
  PyObject* raw = inner != nullptr && Py_TYPE(inner) == reinterpret_cast<PyTypeObject*>(h.cuda_event_type.ptr())
                      ? PyObject_GetAttr(inner, handle_name)
                      : nullptr;
  if (raw != nullptr) event = uintptr_t(PyLong_AsVoidPtr(raw));
  Py_XDECREF(raw);
  Py_XDECREF(inner);
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return raw != nullptr;
}

// What the direct entries need of their deep_ep_cpp.Buffer, given once by its sync() (bind_buffer):
// a weak reference to it (it owns the ops object: a strong one would be a cycle) and its comm stream
// (a torch.cuda.Stream). Hidden, as pybind's own types are: it holds a py::object.
class __attribute__((visibility("hidden"))) DirectBinding {
 public:
  void bind(py::object buffer_ref, py::object comm_stream) {
    if (!PyWeakref_CheckRef(buffer_ref.ptr())) throw py::type_error("bind_buffer takes a weakref.ref to the Buffer");
    const auto handle = comm_stream.attr("cuda_stream").cast<uintptr_t>();
    if (handle == 0) throw py::value_error("bind_buffer takes the comm stream (its handle nonzero)");
    buffer_ref_ = std::move(buffer_ref);
    comm_stream_ = handle;
    // DeepEP's events need it as a torch stream (record_stream, EventHandle); without one (or
    // without torch's CUDA classes) the events' cases fall back.
    const PythonHelpers* h = python_helpers();
    const int cuda = h != nullptr && h->events ? PyObject_IsInstance(comm_stream.ptr(), h->cuda_stream_base.ptr()) : 0;
    if (cuda < 0) throw py::error_already_set();
    if (cuda == 1) {
      comm_ = c10::Stream::unpack3(comm_stream.attr("stream_id").cast<c10::StreamId>(),
                                   comm_stream.attr("device_index").cast<c10::DeviceIndex>(),
                                   static_cast<c10::DeviceType>(comm_stream.attr("device_type").cast<int>()));
      comm_object_ = std::move(comm_stream);
    }
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
  // The comm stream as torch's (c10::Stream); empty where the direct entries take no events (set
  // only with helpers->events).
  const std::optional<c10::Stream>& comm() const { return comm_; }
  // An async_ op's EventHandle: recorded on the comm stream now (only where comm()).
  py::object comm_event() const { return recorded_event(*python_helpers(), comm_object_); }

  // The fallback: the Buffer class's Python method `name`, with the direct entry's arguments.
  static py::object fallback(const py::object& buffer, const char* name, const py::args& args,
                             const py::kwargs& kwargs) {
    return py::type::handle_of(buffer).attr(name)(buffer, *args, **kwargs);
  }

 private:
  py::object buffer_ref_;
  uintptr_t comm_stream_ = 0;
  std::optional<c10::Stream> comm_;
  py::object comm_object_;  // the comm stream's torch.cuda.Stream (with comm_)
};

// allocate_on_comm_stream: `stream` is the current stream while the op allocates its outputs (as
// the class method's _op_begin / _op_allocated), restored when the scope ends, also on an error.
// Only this thread's current stream changes (torch's are per thread), as torch.cuda.set_stream's.
class CurrentStream {
 public:
  explicit CurrentStream(const std::optional<c10::Stream>& stream) {
    if (stream) previous_.emplace(c10::impl::getDeviceGuardImpl(stream->device_type())->exchangeStream(*stream));
  }
  ~CurrentStream() {
    if (previous_) c10::impl::getDeviceGuardImpl(previous_->device_type())->exchangeStream(*previous_);
  }
  CurrentStream(const CurrentStream&) = delete;
  CurrentStream& operator=(const CurrentStream&) = delete;

 private:
  std::optional<c10::Stream> previous_;
};

// DeepEP's stream protocol of a normal op (layout, dispatch, combine) in its direct entry: what
// _streams.py's _op_begin / _op_end do around the class method's compiled call, per case:
// * previous_event: the comm stream waits for it (run()); without it, for the compute stream (kOrderBefore);
// * async_: end() returns an EventHandle recorded on the comm stream and record_stream's the op's
//   tensors on the comm stream; without it, the compute stream waits for the comm stream (kOrderAfter);
// * allocate_on_comm_stream (only with both: the class method raises otherwise): the comm stream is
//   current while the op runs (run(): it allocates then) and end() also record_stream's on the compute stream.
class OpStreams {
  // The most tensors an op's end() is given (a dispatch's 15); more are recorded without the check.
  static constexpr size_t kMaxRecorded = 16;

 public:
  // Reads the op's three arguments; false where the class method must run: a flag that is not a
  // bool, allocate_on_comm_stream without previous_event and async_ (the class method raises), a
  // previous_event it takes otherwise (previous_event_of), no events here (DirectBinding::comm), a
  // thread that cannot order the streams (another device current), or a recorded previous_event
  // during a graph capture (torch waits on an external event differently there; whether it is one
  // cannot be read).
  bool read(py::handle previous_event, py::handle async_finish, py::handle on_comm, const DirectBinding& binding,
            const StreamOrder& order, int device) {
    if (!is_bool(async_finish) || !is_bool(on_comm)) return false;
    async_ = async_finish.ptr() == Py_True;
    on_comm_ = on_comm.ptr() == Py_True;
    const bool previous = !previous_event.is_none();
    if (on_comm_ && (!previous || !async_)) return false;
    // (The plain case's op checks order.usable() itself.)
    if ((previous || async_) && (!binding.comm() || !order.usable())) return false;
    compute_.emplace(current_stream(device));
    if (previous && (!previous_event_of(*python_helpers(), previous_event, event_) ||
                     (event_ != 0 && order.capturing(stream_handle(*compute_)))))
      return false;
    flags_ = (async_ ? 0 : kOrderAfter) | (previous ? 0 : kOrderBefore);
    return true;
  }

  // The op's order flags (_fast_order.h) and its compute stream's handle.
  int flags() const { return flags_; }
  uintptr_t compute() const { return stream_handle(*compute_); }

  // Whether each tensor of `tensors` (None skipped) is a CUDA tensor, as end()'s record_stream
  // needs (else the class method raises what torch raises for it).
  bool cuda(std::initializer_list<py::handle> tensors) const {
    if (!async_) return true;
    for (const py::handle t : tensors)
      if (!t.is_none() && !THPVariable_Unpack(t.ptr()).is_cuda()) return false;
    return true;
  }

  // The op's result: op(), called as the class method calls it between _op_begin and _op_end:
  // after the comm stream's wait for previous_event (a failed wait raises), with the comm stream
  // current for allocate_on_comm_stream.
  template <typename Op>
  py::tuple run(const StreamOrder& order, const DirectBinding& binding, Op op) const {
    if (event_ != 0)
      if (const int error = order.wait_event(binding.comm_stream(), event_)) raise_failed(driver_error(error));
    const CurrentStream allocating(on_comm_ ? binding.comm() : std::nullopt);
    return op();
  }

  // After the op succeeded: the EventHandle, and each of `tensors` (the op's, None skipped)
  // record_stream'ed, as above; None without async_. record_stream acts on a tensor's storage (the
  // caching allocator's block), so each storage is recorded once: the handle's tensors and the
  // received ones are views of one allocation each, and a record costs 1-2 us. The record is what
  // aten::record_stream's CUDA kernel does (the allocator's recordStream of the storage's DataPtr),
  // through the device guard, without the dispatcher's round trip.
  py::object end(const DirectBinding& binding, std::initializer_list<py::handle> tensors) const {
    if (!async_) return py::none();
    py::object event = binding.comm_event();
    const c10::impl::DeviceGuardImplInterface* cuda = c10::impl::getDeviceGuardImpl(binding.comm()->device_type());
    std::array<const void*, kMaxRecorded> recorded;
    size_t num_recorded = 0;
    for (const py::handle t : tensors) {
      if (t.is_none()) continue;
      const at::Tensor& tensor = THPVariable_Unpack(t.ptr());
      if (!tensor.has_storage()) {  // no storage to record (not a strided tensor): torch's op decides
        tensor.record_stream(*binding.comm());
        if (on_comm_) tensor.record_stream(*compute_);
        continue;
      }
      const c10::Storage& storage = tensor.storage();
      const auto end = recorded.begin() + num_recorded;
      if (std::find(recorded.begin(), end, storage.unsafeGetStorageImpl()) != end) continue;
      if (num_recorded < recorded.size()) recorded[num_recorded++] = storage.unsafeGetStorageImpl();
      cuda->recordDataPtrOnStream(storage.data_ptr(), *binding.comm());
      if (on_comm_) cuda->recordDataPtrOnStream(storage.data_ptr(), *compute_);
    }
    return event;
  }

 private:
  bool async_ = false, on_comm_ = false;
  int flags_ = 0;
  uintptr_t event_ = 0;  // previous_event's cudaEvent_t; 0: none, or never recorded
  std::optional<c10::Stream> compute_;
};

}  // namespace deepep_fast
