// The LL ops of the compiled host path (low_latency_dispatch / _combine): outputs allocated with
// torch's C++ API, the C ABI's argument struct filled and called, in one Python call.
#pragma once

#include "_fast_streams.h"

namespace deepep_fast {

using LlDispatchFn = int (*)(const DeepepBuffer*, const DeepepLowLatencyDispatchArgs*, void*, int*);
using LlCombineFn = int (*)(const DeepepBuffer*, const DeepepLowLatencyCombineArgs*, void*, int*);

// Phases of an LL op (its args' `phases`): the send, the receive, or both.
constexpr int kPhaseSend = 1;
constexpr int kPhaseRecv = 2;

// deep_ep_cpp's raise_status (set once by set_status_raiser): a failed hook raises the library's
// error exactly as the ctypes path does. Never destroyed: no destructor may run at interpreter exit.
inline py::object*& status_raiser() {
  static py::object* raiser = nullptr;
  return raiser;
}

inline void set_status_raiser(py::object raiser) {
  if (status_raiser() == nullptr) status_raiser() = new py::object(std::move(raiser));
}

// DeepEP's `hook` of a return_recv_hook=True LL op: launches the receive phase with a copy of the
// op's arguments, on the stream its send ran on, into the buffer half the send used. Like DeepEP's,
// it keeps the op's tensors alive (the receive reads and writes them even if the caller dropped
// its references), and the deep_ep_cpp.Buffer (`owner`), whose handle must stay valid. Hidden,
// as pybind's own types are: it holds a py::object.
template <typename Args>
class __attribute__((visibility("hidden"))) LlRecvHook {
 public:
  using Fn = int (*)(const DeepepBuffer*, const Args*, void*, int*);

  LlRecvHook(Fn fn, uintptr_t buffer, const Args& args, uintptr_t stream, int buffer_idx, py::object owner,
             std::vector<at::Tensor> tensors)
      : fn_(fn),
        buffer_(buffer),
        args_(args),
        stream_(stream),
        buffer_idx_(buffer_idx),
        owner_(std::move(owner)),
        tensors_(std::move(tensors)) {
    args_.phases = kPhaseRecv;
  }

  void operator()() {
    const int status = fn_(as_buffer(buffer_), &args_, as_stream(stream_), &buffer_idx_);
    if (status == 0) return;
    if (status_raiser() == nullptr) throw std::runtime_error("deepep-nccl: LL receive failed (no status raiser)");
    (*status_raiser())(status);
  }

 private:
  Fn fn_;
  uintptr_t buffer_;
  Args args_;
  uintptr_t stream_;
  int buffer_idx_;
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

// One dispatch shape (M, H, E, flags): its outputs' allocation arguments and its argument struct.
class LlDispatchPlan {
 public:
  LlDispatchPlan(uintptr_t args, std::vector<int64_t> recv_x_shape, bool use_fp8, std::vector<int64_t> scales_shape,
                 std::vector<int64_t> scales_strides, bool use_ue8m0, int64_t local_experts, int64_t rows,
                 int64_t num_ranks, int device)
      : args_(at_address<DeepepLowLatencyDispatchArgs>(args)),
        recv_x_shape_(std::move(recv_x_shape)),
        scales_shape_(std::move(scales_shape)),
        scales_strides_(std::move(scales_strides)),
        use_fp8_(use_fp8),
        local_experts_(local_experts),
        rows_(rows),
        num_ranks_(num_ranks),
        device_(device) {
    const auto on_device = at::TensorOptions().device(at::kCUDA, device);
    recv_x_options_ = on_device.dtype(use_fp8 ? at::kFloat8_e4m3fn : at::kBFloat16);
    scales_options_ = on_device.dtype(use_ue8m0 ? at::kInt : at::kFloat);
    int32_options_ = on_device.dtype(at::kInt);
    int64_options_ = on_device.dtype(at::kLong);
  }

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
        x.size(1) != recv_x_shape_[2] || !ordering.usable())
      return py::make_tuple(kBadInput);
    DeepepLowLatencyDispatchArgs& a = *args_;
    if (!describe(a.x, x) || !describe(a.topk_idx, topk_idx) ||
        !describe(a.cumulative_local_expert_recv_stats, cumulative_local_expert_recv_stats) ||
        !describe(a.dispatch_wait_recv_cost_stats, dispatch_wait_recv_cost_stats))
      return py::make_tuple(kBadInput);
    if (const int error = ordering.before(stream)) return driver_error(error);
    at::Tensor recv_x = at::empty(recv_x_shape_, recv_x_options_);
    py::object scales_out = py::none();
    a.packed_recv_x.data = recv_x.data_ptr();
    c10::optional<at::Tensor> scales;
    if (use_fp8_) {
      scales = at::empty_strided(scales_shape_, scales_strides_, scales_options_);
      a.packed_recv_x_scales.data = scales->data_ptr();
      scales_out = py::cast(*scales);
    }
    at::Tensor count = at::empty({local_experts_}, int32_options_);
    at::Tensor src_info = at::empty({local_experts_, rows_}, int32_options_);
    at::Tensor layout_range = at::empty({local_experts_, num_ranks_}, int64_options_);
    a.packed_recv_count.data = count.data_ptr();
    a.packed_recv_src_info.data = src_info.data_ptr();
    a.packed_recv_layout_range.data = layout_range.data_ptr();
    a.phases = phases;
    const int status =
        reinterpret_cast<LlDispatchFn>(fn)(as_buffer(buffer), args_, as_stream(stream), at_address<int>(buffer_idx));
    if (status != 0) return py::make_tuple(status);
    if (const int error = ordering.after(stream)) return driver_error(error);
    py::object hook = py::none();
    if (phases == kPhaseSend)
      hook = py::cast(LlDispatchHook(
          reinterpret_cast<LlDispatchFn>(fn), buffer, *args_, stream, *at_address<int>(buffer_idx), std::move(owner),
          present({x, topk_idx, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, recv_x, scales,
                   count, src_info, layout_range})));
    return py::make_tuple(status, recv_x, scales_out, count, src_info, layout_range, hook);
  }

 private:
  DeepepLowLatencyDispatchArgs* args_;
  std::vector<int64_t> recv_x_shape_, scales_shape_, scales_strides_;
  bool use_fp8_;
  int64_t local_experts_, rows_, num_ranks_;
  int device_;
  at::TensorOptions recv_x_options_, scales_options_, int32_options_, int64_options_;
};

// (status, combined_x, hook or None), (status,), (kBadInput,) or (kDriverError, code): one LL
// combine through the argument struct at `args`; `out` (or a new [T, H] bfloat16 tensor on
// `device`) receives the result. A send-only launch returns its receive hook.
inline py::tuple ll_combine(uintptr_t fn, uintptr_t buffer, uintptr_t args, int device, const at::Tensor& x,
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
  at::Tensor combined_x =
      out.has_value() ? *out
                      : at::empty({topk_idx.size(0), x.size(2)}, at::TensorOptions().dtype(at::kBFloat16).device(
                                                                      at::kCUDA, device));
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
        reinterpret_cast<LlCombineFn>(fn), buffer, a, stream, *at_address<int>(buffer_idx), std::move(owner),
        present({x, topk_idx, topk_weights, src_info, layout_range, combine_wait_recv_cost_stats, combined_x})));
  return py::make_tuple(status, combined_x, hook);
}

using NextCombineBufferFn = int (*)(const DeepepBuffer*, int, int, int, void**);

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

// (0, view) or (status,): get_next_low_latency_combine_buffer's BF16 [E_l, R*M, H] view of the
// buffer's memory, strides (R*M*S, S, 1) with S = H + H/64 (DeepEP's). Its storage keeps `owner`
// (the deep_ep_cpp.Buffer, whose memory it is) alive.
inline py::tuple ll_next_combine_buffer(uintptr_t fn, uintptr_t buffer, int m, int hidden, int num_experts,
                                        int num_ranks, int device, py::object owner) {
  void* ptr = nullptr;
  const int status = reinterpret_cast<NextCombineBufferFn>(fn)(as_buffer(buffer), m, hidden, num_experts, &ptr);
  if (status != 0) return py::make_tuple(status);
  const int64_t local = num_experts / num_ranks, rows = int64_t(num_ranks) * m, stride = hidden + hidden / 64;
  at::Tensor view = at::for_blob(ptr, {local, rows, int64_t(hidden)})
                        .strides(at::IntArrayRef{rows * stride, stride, 1})
                        .context(new py::object(std::move(owner)), release_owner)
                        .target_device(at::Device(at::kCUDA, device))
                        .options(at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA, device))
                        .make_tensor();
  return py::make_tuple(0, view);
}

}  // namespace deepep_fast
