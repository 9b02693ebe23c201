// The LL ops of the compiled host path (low_latency_dispatch / _combine): outputs allocated with
// torch's C++ API, the C ABI's argument struct filled and called, in one Python call.
#pragma once

#include <type_traits>

#include "_fast_hook.h"
#include "_fast_streams.h"

namespace deepep_fast {

// The C ABI's functions as the header declares them (only their addresses come from Python).
using LlDispatchFn = decltype(&deepep_low_latency_dispatch);
using LlCombineFn = decltype(&deepep_low_latency_combine);
using LlCombineOutputsFn = decltype(&deepep_low_latency_combine_outputs);
using NextCombineBufferFn = decltype(&deepep_get_next_low_latency_combine_buffer);
static_assert(std::is_same_v<LlDispatchFn, LlRecvLaunch<DeepepLowLatencyDispatchArgs>::Fn> &&
              std::is_same_v<LlCombineFn, LlRecvLaunch<DeepepLowLatencyCombineArgs>::Fn>);

// deep_ep_cpp's raise_status (set once by set_status_raiser): a failed hook raises the library's
// error exactly as the ctypes path does. Never destroyed: no destructor may run at interpreter exit.
inline py::object*& status_raiser() {
  static py::object* raiser = nullptr;
  return raiser;
}

inline void set_status_raiser(py::object raiser) {
  if (status_raiser() == nullptr) status_raiser() = new py::object(std::move(raiser));
}

// DeepEP's `hook` of a return_recv_hook=True LL op: the receive launch of _fast_hook.h (see there
// why the protocol has three copies). Like DeepEP's, it keeps the op's tensors alive (the receive
// reads and writes them even if the caller dropped its references), and the deep_ep_cpp.Buffer
// (`owner`), whose handle must stay valid. Hidden, as pybind's own types are: it holds a py::object.
template <typename Args>
class __attribute__((visibility("hidden"))) LlRecvHook {
 public:
  LlRecvHook(LlRecvLaunch<Args> launch, py::object owner, std::vector<at::Tensor> tensors)
      : launch_(launch), owner_(std::move(owner)), tensors_(std::move(tensors)) {}

  void operator()() {
    const int status = launch_();
    if (status == 0) return;
    if (status_raiser() == nullptr) throw std::runtime_error("deepep-nccl: LL receive failed (no status raiser)");
    (*status_raiser())(status);
  }

 private:
  LlRecvLaunch<Args> launch_;
  py::object owner_;
  std::vector<at::Tensor> tensors_;
};

// The tensors among `all` that are present.
inline std::vector<at::Tensor> present(std::initializer_list<c10::optional<at::Tensor>> all) {
  std::vector<at::Tensor> out;
  for (const auto& t : all)
    if (t.has_value()) out.push_back(*t);
  return out;
}

using LlDispatchHook = LlRecvHook<DeepepLowLatencyDispatchArgs>;
using LlCombineHook = LlRecvHook<DeepepLowLatencyCombineArgs>;

// One dispatch shape (M, H, E, flags): its argument struct (the outputs' descriptors and the int
// fields filled by _low_latency.py) and the library's description of its outputs
// (deepep_low_latency_dispatch_outputs), copied: each call allocates them and sets their pointers.
class LlDispatchPlan {
 public:
  LlDispatchPlan(uintptr_t args, uintptr_t outputs, int64_t hidden, int device)
      : args_(at_address<DeepepLowLatencyDispatchArgs>(args)),
        outputs_(*at_address<const DeepepOutputs>(outputs)),
        hidden_(hidden),
        device_(device),
        on_device_(at::TensorOptions().device(at::kCUDA, device)) {}

  // (status, packed_recv_x, packed_recv_x_scales or None, packed_recv_count, packed_recv_src_info,
  // packed_recv_layout_range, hook or None): status is the C ABI's (nonzero: the caller raises);
  // or (kBadInput,), or (kDriverError, code). The launch on `stream` is ordered against `compute`
  // as `order_flags` say; a send-only launch (phases = kPhaseSend) returns its receive hook.
  py::tuple run(uintptr_t fn, uintptr_t buffer, const at::Tensor& x, const at::Tensor& topk_idx,
                const c10::optional<at::Tensor>& cumulative_local_expert_recv_stats,
                const c10::optional<at::Tensor>& dispatch_wait_recv_cost_stats, int phases, uintptr_t stream,
                uintptr_t buffer_idx, const StreamOrder& order, uintptr_t compute, int order_flags,
                py::object owner) {
    const Ordering ordering{&order, compute, order_flags};
    if (x.dim() != 2 || x.scalar_type() != at::kBFloat16 || !x.is_cuda() || x.get_device() != device_ ||
        x.size(1) != hidden_ || !ordering.usable())
      return py::make_tuple(kBadInput);
    DeepepLowLatencyDispatchArgs& a = *args_;
    if (!describe(a.x, x) || !describe(a.topk_idx, topk_idx) ||
        !describe(a.cumulative_local_expert_recv_stats, cumulative_local_expert_recv_stats) ||
        !describe(a.dispatch_wait_recv_cost_stats, dispatch_wait_recv_cost_stats))
      return py::make_tuple(kBadInput);
    if (const int error = ordering.before(stream)) return driver_error(error);
    const auto out = allocate(outputs_, on_device_);
    for (size_t i = 0; i < kOutputs.size(); ++i) (a.*kOutputs[i]).data = out[i] ? out[i]->data_ptr() : nullptr;
    a.phases = phases;
    const int status =
        reinterpret_cast<LlDispatchFn>(fn)(as_buffer(buffer), args_, as_stream(stream), at_address<int>(buffer_idx));
    if (status != 0) return py::make_tuple(status);
    if (const int error = ordering.after(stream)) return driver_error(error);
    py::object hook = py::none();
    if (phases == kPhaseSend)
      hook = py::cast(LlDispatchHook(
          {reinterpret_cast<LlDispatchFn>(fn), buffer, *args_, stream, *at_address<int>(buffer_idx)}, std::move(owner),
          present({x, topk_idx, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, out[0], out[1],
                   out[2], out[3], out[4]})));
    return py::make_tuple(status, optional_tensor(out[0]), optional_tensor(out[1]), optional_tensor(out[2]),
                          optional_tensor(out[3]), optional_tensor(out[4]), hook);
  }

 private:
  // The args' output fields, in the order of the outputs' description.
  static constexpr std::array<DeepepTensor DeepepLowLatencyDispatchArgs::*, 5> kOutputs{
      &DeepepLowLatencyDispatchArgs::packed_recv_x, &DeepepLowLatencyDispatchArgs::packed_recv_x_scales,
      &DeepepLowLatencyDispatchArgs::packed_recv_count, &DeepepLowLatencyDispatchArgs::packed_recv_src_info,
      &DeepepLowLatencyDispatchArgs::packed_recv_layout_range};

  DeepepLowLatencyDispatchArgs* args_;
  DeepepOutputs outputs_;
  int64_t hidden_;
  int device_;
  at::TensorOptions on_device_;
};

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

// (status, combined_x, hook or None), (status,), (kBadInput,) or (kDriverError, code): one LL
// combine through the argument struct at `args`; `out` (or a new [T, H] bfloat16 tensor on
// `device`) receives the result. A send-only launch returns its receive hook.
inline py::tuple ll_combine(uintptr_t fn, uintptr_t buffer, uintptr_t args, LlCombineOutputs& outputs, int device,
                            const at::Tensor& x,
                            const at::Tensor& topk_idx, const at::Tensor& topk_weights, const at::Tensor& src_info,
                            const at::Tensor& layout_range, const c10::optional<at::Tensor>& combine_wait_recv_cost_stats,
                            const c10::optional<at::Tensor>& out, int64_t num_max_dispatch_tokens_per_rank,
                            int64_t num_experts, bool use_logfmt, bool zero_copy, int phases, uintptr_t stream,
                            uintptr_t buffer_idx, const StreamOrder& order, uintptr_t compute, int order_flags,
                            py::object owner) {
  const Ordering ordering{&order, compute, order_flags};
  if (x.dim() != 3 || topk_idx.dim() < 1 || !fits_int32(num_max_dispatch_tokens_per_rank) ||
      !fits_int32(num_experts) || !ordering.usable())
    return py::make_tuple(kBadInput);
  at::Tensor combined_x;
  if (out.has_value()) {
    combined_x = *out;
  } else {
    const DeepepOutputs* described = nullptr;
    if (const int status = outputs.get(buffer, topk_idx.size(0), x.size(2), &described)) return py::make_tuple(status);
    combined_x = *allocate(*described, at::TensorOptions().device(at::kCUDA, device))[0];
  }
  DeepepLowLatencyCombineArgs& a = *at_address<DeepepLowLatencyCombineArgs>(args);
  if (!describe(a.x, x) || !describe(a.topk_idx, topk_idx) || !describe(a.topk_weights, topk_weights) ||
      !describe(a.src_info, src_info) || !describe(a.layout_range, layout_range) ||
      !describe(a.combine_wait_recv_cost_stats, combine_wait_recv_cost_stats) || !describe(a.out, combined_x))
    return py::make_tuple(kBadInput);
  if (const int error = ordering.before(stream)) return driver_error(error);
  a.num_max_dispatch_tokens_per_rank = int32_t(num_max_dispatch_tokens_per_rank);
  a.num_experts = int32_t(num_experts);
  a.use_logfmt = use_logfmt ? 1 : 0;
  a.zero_copy = zero_copy ? 1 : 0;
  a.phases = phases;
  a.reserved = 0;
  const int status =
      reinterpret_cast<LlCombineFn>(fn)(as_buffer(buffer), &a, as_stream(stream), at_address<int>(buffer_idx));
  if (status != 0) return py::make_tuple(status);
  if (const int error = ordering.after(stream)) return driver_error(error);
  py::object hook = py::none();
  if (phases == kPhaseSend)
    hook = py::cast(LlCombineHook(
        {reinterpret_cast<LlCombineFn>(fn), buffer, a, stream, *at_address<int>(buffer_idx)}, std::move(owner),
        present({x, topk_idx, topk_weights, src_info, layout_range, combine_wait_recv_cost_stats, combined_x})));
  return py::make_tuple(status, combined_x, hook);
}


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

}  // namespace deepep_fast
