// The LL ops of the compiled host path (low_latency_dispatch / _combine, clean_low_latency_buffer,
// get_next_low_latency_combine_buffer), one LlOps per buffer: outputs allocated with torch's C++
// API, the C ABI's argument struct filled and called, in one Python call that needs no torch call
// from Python (x's shape is read here).
#pragma once

#include <cstring>
#include <new>
#include <type_traits>

#include "_fast_hook.h"
#include "_fast_direct.h"
#include "_fast_prof.h"

namespace deepep_fast {

// The C ABI's functions as the header declares them (only their addresses come from Python).
using LlDispatchFn = decltype(&deepep_low_latency_dispatch);
using LlCombineFn = decltype(&deepep_low_latency_combine);
using LlCombineOutputsFn = decltype(&deepep_low_latency_combine_outputs);
using NextCombineBufferFn = decltype(&deepep_get_next_low_latency_combine_buffer);
static_assert(std::is_same_v<LlDispatchFn, LlRecvLaunch<DeepepLowLatencyDispatchArgs>::Fn> &&
              std::is_same_v<LlCombineFn, LlRecvLaunch<DeepepLowLatencyCombineArgs>::Fn>);

// DeepEP's `hook` of a return_recv_hook=True LL op: the receive launch of _fast_hook.h (see there
// why the protocol has three copies). Like DeepEP's, it keeps the op's tensors alive (the receive
// reads and writes them even if the caller dropped its references), and the deep_ep_cpp.Buffer
// (`owner`), whose handle must stay valid. A Python type of its own, not a pybind class: pybind's
// instance registry (an insert per hook, an erase when it dies) and its call dispatch cost about
// 0.4 us per hook (bench/host_steps_cpu.py --compiled); this one is one allocation, its launch and
// a free. One type per Args (LlDispatchHook, LlCombineHook), made by add_to() at module import.
// Hidden, as pybind's own types are: it holds a py::object.
template <typename Args>
class __attribute__((visibility("hidden"))) LlRecvHook {
 public:
  // The most tensors a hook keeps (dispatch's: x, topk_idx, the two stats, the five outputs).
  static constexpr size_t kMaxTensors = 9;
  using Tensors = std::array<at::Tensor, kMaxTensors>;  // absent ones undefined

  // Makes the type `name` ("module.Type", static storage) and adds it to `m`. Once, at import.
  static void add_to(py::module_& m, const char* name) {
    PyType_Slot slots[] = {{Py_tp_call, reinterpret_cast<void*>(&call)},
                           {Py_tp_dealloc, reinterpret_cast<void*>(&dealloc)},
                           {Py_tp_new, reinterpret_cast<void*>(&refuse_new)},
                           {Py_tp_doc, const_cast<char*>("DeepEP's receive hook: call it once to launch the receive")},
                           {0, nullptr}};
    PyType_Spec spec{name, int(sizeof(Object)), 0, Py_TPFLAGS_DEFAULT, slots};
    PyObject* made = PyType_FromSpec(&spec);
    if (made == nullptr) throw py::error_already_set();
    type() = reinterpret_cast<PyTypeObject*>(made);  // never released: hooks may outlive the module's dict
    m.attr(std::strrchr(name, '.') + 1) = py::reinterpret_borrow<py::object>(made);
  }

  // A new hook launching `launch`, keeping `owner` and `tensors` until it dies.
  static py::object make(const LlRecvLaunch<Args>& launch, py::object owner, Tensors&& tensors) {
    void* memory = PyObject_Malloc(sizeof(Object));
    if (memory == nullptr) throw std::bad_alloc();
    PyObject* self = PyObject_Init(static_cast<PyObject*>(memory), type());  // holds a reference to the type
    new (state(self)) State{launch, std::move(owner), std::move(tensors)};
    return py::reinterpret_steal<py::object>(self);
  }

 private:
  struct State {
    LlRecvLaunch<Args> launch;
    py::object owner;
    Tensors tensors;
  };
  struct Object {
    PyObject head;
    alignas(State) unsigned char state[sizeof(State)];
  };

  static PyTypeObject*& type() {
    static PyTypeObject* made = nullptr;
    return made;
  }

  static State* state(PyObject* self) {
    return std::launder(reinterpret_cast<State*>(reinterpret_cast<Object*>(self)->state));
  }

  // hook(): launches the receive; a failed launch raises the library's error (raise_status, as the
  // ctypes path does).
  static PyObject* call(PyObject* self, PyObject* args, PyObject* kwargs) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwargs != nullptr && PyDict_GET_SIZE(kwargs) != 0)) {
      PyErr_SetString(PyExc_TypeError, "a receive hook takes no arguments");
      return nullptr;
    }
    const int status = state(self)->launch();
    if (status == 0) Py_RETURN_NONE;
    if (python_helpers() == nullptr) {
      PyErr_SetString(PyExc_RuntimeError, "deepep-nccl: LL receive failed (no status raiser)");
      return nullptr;
    }
    return PyObject_CallFunction(python_helpers()->raise_status.ptr(), "i", status);  // raises: nullptr
  }

  static void dealloc(PyObject* self) {
    PyTypeObject* type = Py_TYPE(self);
    state(self)->~State();
    PyObject_Free(self);
    Py_DECREF(type);
  }

  static PyObject* refuse_new(PyTypeObject* type, PyObject*, PyObject*) {
    PyErr_Format(PyExc_TypeError, "cannot create '%s' instances (a return_recv_hook=True LL op returns one)",
                 type->tp_name);
    return nullptr;
  }
};

// t, or an undefined tensor when absent (a hook's slot for it stays empty).
inline at::Tensor held(const c10::optional<at::Tensor>& t) { return t.has_value() ? *t : at::Tensor(); }

using LlDispatchHook = LlRecvHook<DeepepLowLatencyDispatchArgs>;
using LlCombineHook = LlRecvHook<DeepepLowLatencyCombineArgs>;

// Dispatch shapes LlOps keeps (and the ctypes path's cache, which asserts the same number).
constexpr size_t kMaxDispatchShapes = 64;

// combined_x's description (deepep_low_latency_combine_outputs) for the last (T, H) a Buffer's
// combine allocated: the library is asked again only when they change.
class LlCombineOutputs {
 public:
  explicit LlCombineOutputs(uintptr_t fn) : fn_(reinterpret_cast<LlCombineOutputsFn>(fn)) {}

  // 0 with `*out` set, or the library's status.
  int get(uintptr_t buffer, int64_t tokens, int64_t hidden, const DeepepOutputs** out) {
    if (tokens != tokens_ || hidden != hidden_) {
      tokens_ = -1;  // no description until the query succeeds
      if (const int status = fn_(as_buffer(buffer), tokens, hidden, &outputs_)) return status;
      tokens_ = tokens;
      hidden_ = hidden;
    }
    *out = &outputs_;
    return 0;
  }

 private:
  LlCombineOutputsFn fn_;
  int64_t tokens_ = -1, hidden_ = -1;
  DeepepOutputs outputs_{};
};

// LlOps' direct entries: DeepEP's and deep_ep's Buffer method names (the fallback's too).
constexpr const char* kLowLatencyDispatch = "low_latency_dispatch";
constexpr const char* kLlDispatch = "_ll_dispatch";
constexpr const char* kLowLatencyCombine = "low_latency_combine";
constexpr const char* kLlCombine = "_ll_combine";

// One buffer's LL ops on the compiled host path (made by sync(): the handle is fixed from then on).
// Everything that is the same on every call lives here, so that a call passes only what changes
// and makes no torch call from Python: the C ABI's functions, the handle, the device, the stream
// ordering, the dispatch shapes' argument structs and output descriptions, combine's argument
// struct and output description, the buffer half the last send used. Hidden, as LlRecvHook: it
// holds a py::object.
class __attribute__((visibility("hidden"))) LlOps {
 public:
  LlOps(uintptr_t dispatch_fn, uintptr_t combine_fn, uintptr_t combine_outputs_fn, uintptr_t clean_fn,
        uintptr_t next_combine_fn, uintptr_t buffer, int device, py::object order)
      : dispatch_fn_(reinterpret_cast<LlDispatchFn>(dispatch_fn)),
        combine_fn_(reinterpret_cast<LlCombineFn>(combine_fn)),
        clean_fn_(reinterpret_cast<CleanFn>(clean_fn)),
        next_combine_fn_(next_combine_fn),
        buffer_(buffer),
        device_(device),
        on_device_(at::TensorOptions().device(at::kCUDA, device)),
        order_object_(std::move(order)),
        order_(order_object_.cast<const StreamOrder*>()),
        combine_outputs_(combine_outputs_fn) {}

  // Adds the dispatch shape (M, H, E, flags) with its args struct (the outputs' descriptors and
  // the int fields, packed by _low_latency.py) and the library's description of its outputs,
  // both copied. Past kMaxDispatchShapes shapes the oldest go (as the ctypes path's cache does).
  void add_dispatch_shape(int64_t m, int64_t hidden, int64_t experts, bool use_fp8, bool round_scale, bool use_ue8m0,
                          uintptr_t args, uintptr_t outputs) {
    if (shapes_.size() >= kMaxDispatchShapes) shapes_.clear();
    shapes_.push_back({{m, hidden, experts, flags(use_fp8, round_scale, use_ue8m0)},
                       *at_address<const DeepepLowLatencyDispatchArgs>(args),
                       *at_address<const DeepepOutputs>(outputs)});
    last_ = shapes_.size() - 1;
  }

  // low_latency_dispatch: (status, packed_recv_x, packed_recv_x_scales or None, packed_recv_count,
  // packed_recv_src_info, packed_recv_layout_range, hook or None, hidden): status is the C ABI's
  // (nonzero: the caller raises), hidden x's (deep_ep's handle holds it); or (kNewShape,),
  // (kBadInput,) or (kDriverError, code). The launch on `stream` is ordered against `compute` as
  // `order_flags` say; a send-only launch (phases = kPhaseSend) returns its receive hook.
  py::tuple dispatch(const at::Tensor& x, const at::Tensor& topk_idx,
                     const c10::optional<at::Tensor>& cumulative_local_expert_recv_stats,
                     const c10::optional<at::Tensor>& dispatch_wait_recv_cost_stats, int64_t m, int64_t experts,
                     bool use_fp8, bool round_scale, bool use_ue8m0, int phases, uintptr_t stream, uintptr_t compute,
                     int order_flags, py::object owner) {
    const Ordering ordering{order_, compute, order_flags};
    DEEPEP_FAST_VARIANT(phases == kPhaseSend);
    DEEPEP_FAST_MARK("arguments");
    if (x.dim() != 2 || x.scalar_type() != at::kBFloat16 || !on_device(x, device_) || !ordering.usable())
      return py::make_tuple(kBadInput);
    const int64_t hidden = x.size(1);
    DispatchShape* shape = find({m, hidden, experts, flags(use_fp8, round_scale, use_ue8m0)});
    if (shape == nullptr) return py::make_tuple(kNewShape);
    DeepepLowLatencyDispatchArgs& a = shape->args;
    if (!describe(a.x, x) || !describe(a.topk_idx, topk_idx) ||
        !describe(a.cumulative_local_expert_recv_stats, cumulative_local_expert_recv_stats) ||
        !describe(a.dispatch_wait_recv_cost_stats, dispatch_wait_recv_cost_stats))
      return py::make_tuple(kBadInput);
    DEEPEP_FAST_MARK("describe");
    if (const int error = ordering.before(stream)) return driver_error(error);
    DEEPEP_FAST_MARK("order before");
    const auto out = allocate(shape->outputs, on_device_);
    DEEPEP_FAST_MARK("alloc");
    for (size_t i = 0; i < kDispatchOutputs.size(); ++i)
      (a.*kDispatchOutputs[i]).data = out[i] ? out[i]->data_ptr() : nullptr;
    a.phases = phases;
    const int status = dispatch_fn_(as_buffer(buffer_), &a, as_stream(stream), &buffer_idx_);
    DEEPEP_FAST_MARK("library call");
    if (status != 0) return py::make_tuple(status);
    if (const int error = ordering.after(stream)) return driver_error(error);
    DEEPEP_FAST_MARK("order after");
    py::object hook = py::none();
    if (phases == kPhaseSend)
      hook = LlDispatchHook::make({dispatch_fn_, buffer_, a, stream, buffer_idx_}, std::move(owner),
                                  {x, topk_idx, held(cumulative_local_expert_recv_stats),
                                   held(dispatch_wait_recv_cost_stats), held(out[0]), held(out[1]), held(out[2]),
                                   held(out[3]), held(out[4])});
    return py::make_tuple(status, optional_tensor(out[0]), optional_tensor(out[1]), optional_tensor(out[2]),
                          optional_tensor(out[3]), optional_tensor(out[4]), hook, hidden);
  }

  // low_latency_combine: (status, combined_x, hook or None), (status,), (kBadInput,) or
  // (kDriverError, code). `out` (or a new [T, H] bfloat16 tensor) receives the result. `hidden`:
  // the dispatch's (deep_ep's handle), which x's last dimension must be; -1: not checked. A
  // send-only launch returns its receive hook.
  py::tuple combine(const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_weights,
                    const at::Tensor& src_info, const at::Tensor& layout_range,
                    const c10::optional<at::Tensor>& combine_wait_recv_cost_stats, const c10::optional<at::Tensor>& out,
                    int64_t m, int64_t experts, bool use_logfmt, bool zero_copy, int64_t hidden, int phases,
                    uintptr_t stream, uintptr_t compute, int order_flags, py::object owner) {
    const Ordering ordering{order_, compute, order_flags};
    DEEPEP_FAST_VARIANT(phases == kPhaseSend);
    DEEPEP_FAST_MARK("arguments");
    if (x.dim() != 3 || (hidden >= 0 && x.size(2) != hidden) || topk_idx.dim() < 1 || !fits_int32(m) ||
        !fits_int32(experts) || !ordering.usable())
      return py::make_tuple(kBadInput);
    at::Tensor combined_x;
    if (out.has_value()) {
      combined_x = *out;
    } else {
      const DeepepOutputs* described = nullptr;
      if (const int status = combine_outputs_.get(buffer_, topk_idx.size(0), x.size(2), &described))
        return py::make_tuple(status);
      combined_x = *allocate(*described, on_device_)[0];
    }
    DEEPEP_FAST_MARK("alloc");
    DeepepLowLatencyCombineArgs& a = combine_args_;
    if (!describe(a.x, x) || !describe(a.topk_idx, topk_idx) || !describe(a.topk_weights, topk_weights) ||
        !describe(a.src_info, src_info) || !describe(a.layout_range, layout_range) ||
        !describe(a.combine_wait_recv_cost_stats, combine_wait_recv_cost_stats) || !describe(a.out, combined_x))
      return py::make_tuple(kBadInput);
    DEEPEP_FAST_MARK("describe");
    if (const int error = ordering.before(stream)) return driver_error(error);
    DEEPEP_FAST_MARK("order before");
    a.num_max_dispatch_tokens_per_rank = int32_t(m);
    a.num_experts = int32_t(experts);
    a.use_logfmt = use_logfmt ? 1 : 0;
    a.zero_copy = zero_copy ? 1 : 0;
    a.phases = phases;
    a.reserved = 0;
    const int status = combine_fn_(as_buffer(buffer_), &a, as_stream(stream), &buffer_idx_);
    DEEPEP_FAST_MARK("library call");
    if (status != 0) return py::make_tuple(status);
    if (const int error = ordering.after(stream)) return driver_error(error);
    DEEPEP_FAST_MARK("order after");
    py::object hook = py::none();
    if (phases == kPhaseSend)
      hook = LlCombineHook::make({combine_fn_, buffer_, a, stream, buffer_idx_}, std::move(owner),
                                 {x, topk_idx, topk_weights, src_info, layout_range,
                                  held(combine_wait_recv_cost_stats), combined_x});
    return py::make_tuple(status, combined_x, hook);
  }

  // clean_low_latency_buffer on `stream`: (status,), or (kBadInput,) for a value the C ABI's int
  // does not hold (the ctypes path names it).
  py::tuple clean(int64_t m, int64_t hidden, int64_t experts, uintptr_t stream) {
    if (!fits_int32(m) || !fits_int32(hidden) || !fits_int32(experts)) return py::make_tuple(kBadInput);
    return py::make_tuple(
        int(clean_fn_(as_buffer(buffer_), int(m), int(hidden), int(experts), as_stream(stream))));
  }

  // get_next_low_latency_combine_buffer: ll_next_combine_buffer (below) on this buffer.
  py::tuple next_combine_buffer(int m, int hidden, int experts, py::object owner);

  // Once, by sync(), before the direct entries are bound: a weakref.ref to the Buffer and its comm
  // stream (a torch.cuda.Stream).
  void bind_buffer(py::object buffer_ref, py::object comm_stream) {
    direct_.bind(std::move(buffer_ref), std::move(comm_stream));
  }

  // The direct entries (_fast_direct.h). DeepEP's low_latency_dispatch(x, topk_idx,
  // cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
  // num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0, async_,
  // return_recv_hook): its 7-tuple (event: async_'s EventHandle, or None).
  py::object low_latency_dispatch(const py::args& args, const py::kwargs& kwargs) {
    return direct_dispatch(kLowLatencyDispatch, args, kwargs, false);
  }
  // deep_ep's _ll_dispatch (the same arguments): the 7-tuple and x's hidden size.
  py::object ll_dispatch(const py::args& args, const py::kwargs& kwargs) {
    return direct_dispatch(kLlDispatch, args, kwargs, true);
  }
  // DeepEP's low_latency_combine(x, topk_idx, topk_weights, src_info, layout_range,
  // combine_wait_recv_cost_stats, num_max_dispatch_tokens_per_rank, num_experts, use_logfmt,
  // zero_copy, async_, return_recv_hook, out=None): (combined_x, event or None, hook or None).
  py::object low_latency_combine(const py::args& args, const py::kwargs& kwargs) {
    return direct_combine(kLowLatencyCombine, args, kwargs, false);
  }
  // deep_ep's _ll_combine(the same up to return_recv_hook, out, hidden): the same 3-tuple, with x's
  // last dimension checked against `hidden` (the dispatch's; -1: not checked).
  py::object ll_combine(const py::args& args, const py::kwargs& kwargs) {
    return direct_combine(kLlCombine, args, kwargs, true);
  }

 private:
  // Where a direct entry's op runs, as _low_latency.py's _ll_streams / _ll_dispatch / _ll_combine:
  // a hook's send on the compute stream, unordered; otherwise both phases on the comm stream after
  // the compute stream, and without async_ the compute stream after them (with it, the op returns
  // an EventHandle recorded on the comm stream, event()).
  struct Launch {
    uintptr_t stream, compute;
    int phases, order_flags;
    bool async_;
  };
  // False where the class method must run: async_ or return_recv_hook not a bool, both set (the
  // class method raises), or async_ where the direct entries make no events (DirectBinding::comm).
  bool launch(py::handle async_flag, py::handle hook_flag, Launch& on) const {
    if (!is_bool(async_flag) || !is_bool(hook_flag)) return false;
    const bool async_ = async_flag.ptr() == Py_True, hook = hook_flag.ptr() == Py_True;
    if (async_ && (hook || !direct_.comm())) return false;
    const uintptr_t compute = stream_handle(current_stream(device_));
    on = hook ? Launch{compute, compute, kPhaseSend, 0, false}
              : Launch{direct_.comm_stream(), compute, kPhaseBoth, async_ ? kOrderBefore : kOrderBefore | kOrderAfter,
                       async_};
    return true;
  }
  py::object event(const Launch& on) const {
    return on.async_ ? direct_.comm_event() : py::none();
  }

  py::object direct_dispatch(const char* name, const py::args& args, const py::kwargs& kwargs, bool with_hidden) {
    DEEPEP_FAST_BEGIN("low_latency_dispatch", "both phases", "send, hook made");
    py::object buffer = direct_.buffer();
    at::Tensor x, topk_idx;
    c10::optional<at::Tensor> recv_stats, wait_stats;
    int64_t m = 0, experts = 0;
    bool use_fp8 = false, round_scale = false, use_ue8m0 = false;
    Launch on{};
    if (args.size() == 11 && kwargs.empty() && launch(args[9], args[10], on) && load(args[0], x) &&
        load(args[1], topk_idx) && load(args[2], recv_stats) && load(args[3], wait_stats) && load(args[4], m) &&
        load(args[5], experts) && load(args[6], use_fp8) && load(args[7], round_scale) && load(args[8], use_ue8m0)) {
      const py::tuple result = dispatch(x, topk_idx, recv_stats, wait_stats, m, experts, use_fp8, round_scale,
                                        use_ue8m0, on.phases, on.stream, on.compute, on.order_flags, buffer);
      // result: (status, 5 outputs, hook, hidden)
      const auto made = [&] { return event(on); };
      py::object answered = with_hidden ? answer(result, {1, 2, 3, 4, 5, kEventSlot, 6, 7}, made)
                                        : answer(result, {1, 2, 3, 4, 5, kEventSlot, 6}, made);
      if (answered) {
        DEEPEP_FAST_END();
        return answered;
      }
    }
    return DirectBinding::fallback(buffer, name, args, kwargs);
  }

  // DeepEP's `out` may come 13th or as the keyword; deep_ep's _ll_combine passes out and hidden.
  py::object direct_combine(const char* name, const py::args& args, const py::kwargs& kwargs, bool with_hidden) {
    DEEPEP_FAST_BEGIN("low_latency_combine", "both phases", "send, hook made");
    py::object buffer = direct_.buffer();
    const size_t n = args.size();
    py::object out_arg = py::none();
    int64_t hidden = -1;
    bool shaped;
    if (with_hidden) {
      shaped = n == 14 && kwargs.empty() && load(args[13], hidden);
      if (shaped) out_arg = args[12];
    } else if (kwargs.empty()) {
      shaped = n == 12 || n == 13;
      if (n == 13) out_arg = args[12];
    } else {
      shaped = n == 12 && kwargs.size() == 1 && kwargs.contains("out");
      if (shaped) out_arg = kwargs["out"];
    }
    at::Tensor x, topk_idx, topk_weights, src_info, layout_range;
    c10::optional<at::Tensor> wait_stats, out;
    int64_t m = 0, experts = 0;
    bool use_logfmt = false, zero_copy = false;
    Launch on{};
    if (shaped && launch(args[10], args[11], on) && load(args[0], x) && load(args[1], topk_idx) &&
        load(args[2], topk_weights) && load(args[3], src_info) && load(args[4], layout_range) &&
        load(args[5], wait_stats) && load(args[6], m) && load(args[7], experts) && load(args[8], use_logfmt) &&
        load(args[9], zero_copy) && load(out_arg, out)) {
      const py::tuple result = combine(x, topk_idx, topk_weights, src_info, layout_range, wait_stats, out, m, experts,
                                       use_logfmt, zero_copy, hidden, on.phases, on.stream, on.compute,
                                       on.order_flags, buffer);
      // result: (status, combined_x, hook)
      if (py::object answered = answer(result, {1, kEventSlot, 2}, [&] { return event(on); })) {
        DEEPEP_FAST_END();
        return answered;
      }
    }
    return DirectBinding::fallback(buffer, name, args, kwargs);
  }

  using CleanFn = decltype(&deepep_clean_low_latency_buffer);

  struct DispatchKey {
    int64_t m, hidden, experts;
    int flags;
    bool operator==(const DispatchKey& o) const {
      return m == o.m && hidden == o.hidden && experts == o.experts && flags == o.flags;
    }
  };
  struct DispatchShape {
    DispatchKey key;
    DeepepLowLatencyDispatchArgs args;
    DeepepOutputs outputs;
  };

  static int flags(bool use_fp8, bool round_scale, bool use_ue8m0) {
    return int(use_fp8) | int(round_scale) << 1 | int(use_ue8m0) << 2;
  }

  // The shape of `key`, the last one used first (a model runs one or a few).
  DispatchShape* find(const DispatchKey& key) {
    if (last_ < shapes_.size() && shapes_[last_].key == key) return &shapes_[last_];
    for (size_t i = 0; i < shapes_.size(); ++i)
      if (shapes_[i].key == key) {
        last_ = i;
        return &shapes_[i];
      }
    return nullptr;
  }

  // The args' output fields, in the order of the outputs' description.
  static constexpr std::array<DeepepTensor DeepepLowLatencyDispatchArgs::*, 5> kDispatchOutputs{
      &DeepepLowLatencyDispatchArgs::packed_recv_x, &DeepepLowLatencyDispatchArgs::packed_recv_x_scales,
      &DeepepLowLatencyDispatchArgs::packed_recv_count, &DeepepLowLatencyDispatchArgs::packed_recv_src_info,
      &DeepepLowLatencyDispatchArgs::packed_recv_layout_range};

  LlDispatchFn dispatch_fn_;
  LlCombineFn combine_fn_;
  CleanFn clean_fn_;
  uintptr_t next_combine_fn_;
  uintptr_t buffer_;
  int device_;
  at::TensorOptions on_device_;
  py::object order_object_;  // keeps order_ alive
  const StreamOrder* order_;
  std::vector<DispatchShape> shapes_;
  size_t last_ = 0;
  DeepepLowLatencyCombineArgs combine_args_{};
  LlCombineOutputs combine_outputs_;
  int buffer_idx_ = 0;  // the half the last send used (the C ABI writes it)
  DirectBinding direct_;
};

// Drops the owner reference a zero-copy view held (its storage's context). Leaked once Python is
// gone: a view may outlive the interpreter's teardown.
inline void release_owner(void* owner) {
#if PY_VERSION_HEX >= 0x030D0000
  if (!Py_IsInitialized() || Py_IsFinalizing()) return;
#else
  if (!Py_IsInitialized() || _Py_IsFinalizing()) return;
#endif
  py::gil_scoped_acquire gil;
  delete static_cast<py::object*>(owner);
}

// (0, view) or (status,): get_next_low_latency_combine_buffer's view of the buffer's memory, as
// the library's descriptor says (dtype, shape, strides). Its storage keeps `owner` (the
// deep_ep_cpp.Buffer, whose memory it is) alive.
inline py::tuple ll_next_combine_buffer(uintptr_t fn, uintptr_t buffer, int m, int hidden, int num_experts, int device,
                                        py::object owner) {
  DeepepTensor t{};
  const int status = reinterpret_cast<NextCombineBufferFn>(fn)(as_buffer(buffer), m, hidden, num_experts, &t);
  if (status != 0) return py::make_tuple(status);
  at::Tensor view = at::for_blob(t.data, dims(t))
                        .strides(steps(t))
                        .context(new py::object(std::move(owner)), release_owner)
                        .target_device(at::Device(at::kCUDA, device))
                        .options(at::TensorOptions().dtype(scalar_type(t.dtype)).device(at::kCUDA, device))
                        .make_tensor();
  return py::make_tuple(0, view);
}

inline py::tuple LlOps::next_combine_buffer(int m, int hidden, int experts, py::object owner) {
  return ll_next_combine_buffer(next_combine_fn_, buffer_, m, hidden, experts, device_, std::move(owner));
}

}  // namespace deepep_fast
