// get_dispatch_layout and the normal-mode ops (intranode dispatch / combine) of the compiled host
// path: the same steps as the ctypes path in _buffer.py / _normal.py (ask the library what to
// allocate, allocate it, fill the C ABI's structs, call it), without the Python-level cost of each.
// The waits of DeepEP's stream protocol are done here (order flags, _fast_streams.h); the class
// methods do previous_event, async_finish and allocate_on_comm_stream in Python (_streams.py), the
// direct entries in C++ (OpStreams, _fast_direct.h).
#pragma once

#include <algorithm>
#include <vector>

#include "_fast_direct.h"
#include "_fast_prof.h"

namespace deepep_fast {

// The C ABI's functions as the header declares them (only their addresses come from Python).
using LayoutFn = decltype(&deepep_get_dispatch_layout);
using DispatchPrepareFn = decltype(&deepep_intranode_dispatch_prepare);
using DispatchFn = decltype(&deepep_intranode_dispatch);
using DispatchFusedFn = decltype(&deepep_intranode_dispatch_fused);
using CombineFn = decltype(&deepep_intranode_combine);
using LayoutOutputsFn = decltype(&deepep_get_dispatch_layout_outputs);
using HandleOutputsFn = decltype(&deepep_intranode_dispatch_handle_outputs);
using DispatchOutputsFn = decltype(&deepep_intranode_dispatch_outputs);
using CombineOutputsFn = decltype(&deepep_intranode_combine_outputs);

// NormalOps' direct entries: DeepEP's Buffer method names (the fallback's too).
constexpr const char* kGetDispatchLayout = "get_dispatch_layout";
constexpr const char* kIntranodeDispatch = "intranode_dispatch";
constexpr const char* kIntranodeCombine = "intranode_combine";

// One Buffer's layout, dispatch and combine. Holds the argument structs (each call refills the
// fields it uses) and the constants of the buffer; the C ABI is reached through the addresses of
// its functions in the libdeepep_nccl.so that deep_ep_cpp loaded. Hidden, as LlOps: it holds a
// py::object.
class __attribute__((visibility("hidden"))) NormalOps {
 public:
  NormalOps(uintptr_t layout_fn, uintptr_t prepare_fn, uintptr_t dispatch_fn, uintptr_t dispatch_fused_fn,
            uintptr_t combine_fn, uintptr_t layout_outputs_fn, uintptr_t handle_outputs_fn,
            uintptr_t dispatch_outputs_fn, uintptr_t combine_outputs_fn, int64_t num_ranks, int device)
      : layout_fn_(reinterpret_cast<LayoutFn>(layout_fn)),
        prepare_fn_(reinterpret_cast<DispatchPrepareFn>(prepare_fn)),
        dispatch_fn_(reinterpret_cast<DispatchFn>(dispatch_fn)),
        dispatch_fused_fn_(reinterpret_cast<DispatchFusedFn>(dispatch_fused_fn)),
        combine_fn_(reinterpret_cast<CombineFn>(combine_fn)),
        layout_outputs_fn_(reinterpret_cast<LayoutOutputsFn>(layout_outputs_fn)),
        handle_outputs_fn_(reinterpret_cast<HandleOutputsFn>(handle_outputs_fn)),
        dispatch_outputs_fn_(reinterpret_cast<DispatchOutputsFn>(dispatch_outputs_fn)),
        combine_outputs_fn_(reinterpret_cast<CombineOutputsFn>(combine_outputs_fn)),
        num_ranks_(num_ranks),
        device_(device),
        per_expert_(DEEPEP_MAX_LOCAL_EXPERTS) {
    on_device_ = at::TensorOptions().device(at::kCUDA, device);
  }

  // (status, per_rank, per_rdma_rank or None, per_expert, is_token_in_rank), (status,), (kBadInput,)
  // or (kDriverError, code); the outputs as deepep_get_dispatch_layout_outputs describes them (the
  // three count vectors are views of one allocation). Each op launches on `stream` (the comm
  // stream), ordered against `compute` as `order_flags` say.
  py::tuple layout(uintptr_t buffer, const at::Tensor& topk_idx, int64_t num_experts, uintptr_t stream,
                   const StreamOrder& order, uintptr_t compute, int order_flags) {
    const Ordering ordering{&order, compute, order_flags};
    const auto idx_type = topk_idx.scalar_type();
    if ((idx_type != at::kLong && idx_type != at::kInt) || !on_device(topk_idx, device_) ||
        !fits_int32(num_experts) || !ordering.usable())
      return py::make_tuple(kBadInput);
    DeepepTensor topk;
    if (!describe(topk, topk_idx)) return py::make_tuple(kBadInput);
    DeepepOutputs& o = layout_outputs_;
    const int64_t num_tokens = topk_idx.dim() > 0 ? topk_idx.size(0) : 0;
    int status = layout_cache_.get({num_tokens, num_experts}, o, [&](DeepepOutputs* out) {
      return layout_outputs_fn_(as_buffer(buffer), num_tokens, int(num_experts), out);
    });
    if (status != 0) return py::make_tuple(status);
    if (const int error = ordering.before(stream)) return driver_error(error);
    const auto out = allocate_placed(o, on_device_);
    status = layout_fn_(as_buffer(buffer), &topk, int(num_experts), &o.tensors[0],
                        out[1].has_value() ? &o.tensors[1] : nullptr, &o.tensors[2], &o.tensors[3], as_stream(stream));
    if (status != 0) return py::make_tuple(status);
    if (const int error = ordering.after(stream)) return driver_error(error);
    return py::make_tuple(status, *out[0], optional_tensor(out[1]), *out[2], *out[3]);
  }

  // (status, recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
  // rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, send_head)
  // with None for absent outputs, (status,) for a failed call, (kBadInput,) or (kDriverError, code).
  // The outputs are as deepep_intranode_dispatch_handle_outputs / _outputs describe them.
  // `config` is the address of a DeepepConfig.
  py::tuple dispatch(uintptr_t buffer, const at::Tensor& x, const c10::optional<at::Tensor>& x_scales,
                     const c10::optional<at::Tensor>& topk_idx, const c10::optional<at::Tensor>& topk_weights,
                     const c10::optional<at::Tensor>& num_tokens_per_rank, const at::Tensor& is_token_in_rank,
                     const c10::optional<at::Tensor>& num_tokens_per_expert, int64_t cached_num_recv_tokens,
                     const c10::optional<at::Tensor>& cached_rank_prefix_matrix,
                     const c10::optional<at::Tensor>& cached_channel_prefix_matrix, int64_t expert_alignment,
                     int64_t num_worst_tokens, uintptr_t config, uintptr_t stream, const StreamOrder& order,
                     uintptr_t compute, int order_flags) {
    const Ordering ordering{&order, compute, order_flags};
    const bool cached = cached_rank_prefix_matrix.has_value();
    // Without a host wait (cached, num_worst_tokens) N is known now: one fused call below
    // (prepare's count would be -1).
    const bool unwaited = cached || num_worst_tokens > 0;
    DEEPEP_FAST_VARIANT(!unwaited);
    DEEPEP_FAST_MARK("arguments");
    // Everything that could send this call down the ctypes path is checked before the first
    // launch: the notify kernel must run once per call.
    if (!on_device(x, device_) || (cached && !cached_channel_prefix_matrix.has_value()) ||
        (cached && !on_device(*cached_rank_prefix_matrix, device_)) || !fits_int32(expert_alignment) ||
        !fits_int32(num_worst_tokens) || !fits_int32(cached_num_recv_tokens) || !ordering.usable())
      return py::make_tuple(kBadInput);
    DeepepIntranodeDispatchArgs& a = dispatch_args_;
    std::memcpy(&a.config, at_address<const DeepepConfig>(config), sizeof a.config);
    const c10::optional<at::Tensor> none;
    if (!describe(a.x, x) || !describe(a.x_scales, x_scales) || !describe(a.topk_idx, topk_idx) ||
        !describe(a.topk_weights, topk_weights) || !describe(a.num_tokens_per_rank, cached ? none : num_tokens_per_rank) ||
        !describe(a.is_token_in_rank, is_token_in_rank) ||
        !describe(a.num_tokens_per_expert, cached ? none : num_tokens_per_expert) ||
        !describe(a.rank_prefix_matrix, cached ? cached_rank_prefix_matrix : none) ||
        !describe(a.channel_prefix_matrix, cached ? cached_channel_prefix_matrix : none))
      return py::make_tuple(kBadInput);
    a.cached = cached ? 1 : 0;
    a.expert_alignment = int32_t(expert_alignment);
    a.num_worst_tokens = int32_t(num_worst_tokens);
    a.reserved = 0;
    DEEPEP_FAST_MARK("describe");

    // The handle: what the library says (read from x, the config and the mode), one allocation.
    DeepepOutputs& h = handle_outputs_;
    // The handle's geometry reads x's rows, config.num_sms and cached.
    int status = handle_cache_.get({a.x.ndim, a.x.shape[0], a.config.num_sms, a.cached}, h,
                                   [&](DeepepOutputs* out) { return handle_outputs_fn_(as_buffer(buffer), &a, out); });
    if (status != 0) return py::make_tuple(status);
    if (const int error = ordering.before(stream)) return driver_error(error);
    DEEPEP_FAST_MARK("order before");
    const auto handle = allocate_placed(h, on_device_);
    DEEPEP_FAST_MARK("handle alloc");
    if (!cached) {
      a.rank_prefix_matrix = h.tensors[0];
      a.channel_prefix_matrix = h.tensors[1];
    }
    a.recv_channel_prefix_matrix = h.tensors[2];
    a.send_head = h.tensors[3];

    int num_recv = -1;
    if (!unwaited) {
      // This call waits on the host for the receive counts: other Python threads may run meanwhile.
      py::gil_scoped_release unlocked;
      status = prepare_fn_(as_buffer(buffer), &a, &num_recv, per_expert_.data(), DEEPEP_MAX_LOCAL_EXPERTS, as_stream(stream));
      DEEPEP_FAST_MARK("prepare + host wait");
    }
    if (status != 0) return py::make_tuple(status);

    DeepepOutputs& r = recv_outputs_;
    const int rows = cached ? int(cached_num_recv_tokens) : num_recv;
    // The receive geometry reads the row count (with cached and num_worst_tokens) and the
    // received rows' dtypes and widths.
    status = recv_cache_.get({a.cached, a.num_worst_tokens, rows, a.x.dtype, a.x.ndim, a.x.shape[1], a.x_scales.dtype,
                              a.x_scales.shape[1], a.topk_idx.dtype, a.topk_idx.shape[1], a.topk_weights.dtype},
                             r, [&](DeepepOutputs* out) { return dispatch_outputs_fn_(as_buffer(buffer), &a, rows, out); });
    if (status != 0) return py::make_tuple(status);
    DEEPEP_FAST_MARK("recv describe");
    const auto recv = allocate_placed(r, on_device_);
    DEEPEP_FAST_MARK("recv alloc");
    const DeepepIntranodeDispatchOutputs outputs{r.tensors[0], r.tensors[1], r.tensors[2], r.tensors[3], r.tensors[4]};
    status = (unwaited ? dispatch_fused_fn_ : dispatch_fn_)(as_buffer(buffer), &a, &outputs, as_stream(stream));
    DEEPEP_FAST_MARK("library call");
    if (status != 0) return py::make_tuple(status);
    if (const int error = ordering.after(stream)) return driver_error(error);
    DEEPEP_FAST_MARK("order after");
    const at::Tensor& rank_prefix = cached ? *cached_rank_prefix_matrix : *handle[0];
    const at::Tensor& channel_prefix = cached ? *cached_channel_prefix_matrix : *handle[1];
    return py::make_tuple(status, *recv[0], optional_tensor(recv[1]), optional_tensor(recv[2]),
                          optional_tensor(recv[3]),
                          per_expert_list(num_recv, num_tokens_per_expert, num_ranks_, per_expert_), rank_prefix,
                          channel_prefix, *handle[2], *recv[4], *handle[3]);
  }

  // (status, combined_x, combined_topk_weights or None), (status,) for a failed call, (kBadInput,)
  // or (kDriverError, code); the outputs as deepep_intranode_combine_outputs describes them.
  py::tuple combine(uintptr_t buffer, const at::Tensor& x, const c10::optional<at::Tensor>& topk_weights,
                    const c10::optional<at::Tensor>& bias_0, const c10::optional<at::Tensor>& bias_1,
                    const at::Tensor& src_idx, const at::Tensor& rank_prefix_matrix,
                    const at::Tensor& channel_prefix_matrix, const at::Tensor& send_head, uintptr_t config,
                    uintptr_t stream, const StreamOrder& order, uintptr_t compute, int order_flags) {
    const Ordering ordering{&order, compute, order_flags};
    if (!on_device(x, device_) || !on_device(send_head, device_) || !ordering.usable())
      return py::make_tuple(kBadInput);
    DEEPEP_FAST_MARK("arguments");
    DeepepIntranodeCombineArgs& a = combine_args_;
    if (!describe(a.x, x) || !describe(a.topk_weights, topk_weights) || !describe(a.bias_0, bias_0) ||
        !describe(a.bias_1, bias_1) || !describe(a.src_idx, src_idx) ||
        !describe(a.rank_prefix_matrix, rank_prefix_matrix) ||
        !describe(a.channel_prefix_matrix, channel_prefix_matrix) || !describe(a.send_head, send_head))
      return py::make_tuple(kBadInput);
    std::memcpy(&a.config, at_address<const DeepepConfig>(config), sizeof a.config);
    DeepepOutputs& o = combine_outputs_;
    // The outputs' geometry reads send_head's rows, x's dtype and width, topk_weights' width.
    int status = combine_cache_.get({a.x.dtype, a.x.ndim, a.x.shape[1], a.send_head.ndim, a.send_head.shape[0],
                                     a.topk_weights.dtype, a.topk_weights.shape[1]},
                                    o, [&](DeepepOutputs* out) { return combine_outputs_fn_(as_buffer(buffer), &a, out); });
    if (status != 0) return py::make_tuple(status);
    DEEPEP_FAST_MARK("describe");
    if (const int error = ordering.before(stream)) return driver_error(error);
    DEEPEP_FAST_MARK("order before");
    const auto out = allocate_placed(o, on_device_);
    DEEPEP_FAST_MARK("alloc");
    a.combined_x = o.tensors[0];
    a.combined_topk_weights = o.tensors[1];
    status = combine_fn_(as_buffer(buffer), &a, as_stream(stream));
    DEEPEP_FAST_MARK("library call");
    if (status != 0) return py::make_tuple(status);
    if (const int error = ordering.after(stream)) return driver_error(error);
    DEEPEP_FAST_MARK("order after");
    return py::make_tuple(status, *out[0], optional_tensor(out[1]));
  }

  // Once, by sync(), before the direct entries are bound: a weakref.ref to the Buffer, its handle,
  // its comm stream (a torch.cuda.Stream) and its StreamOrder (kept alive here).
  void bind_buffer(py::object buffer_ref, uintptr_t handle, py::object comm_stream, py::object order) {
    order_ = order.cast<const StreamOrder*>();
    order_object_ = std::move(order);
    handle_ = handle;
    direct_.bind(std::move(buffer_ref), std::move(comm_stream));
  }

  // The direct entries (_fast_direct.h), DeepEP's signatures and tuples; each records the tensors
  // that the class method's _op_end records (for async_), from the same objects.
  // get_dispatch_layout(topk_idx, num_experts, previous_event, async_, allocate_on_comm_stream).
  py::object get_dispatch_layout(const py::args& args, const py::kwargs& kwargs) {
    py::object buffer = direct_.buffer();
    at::Tensor topk_idx;
    int64_t num_experts = 0;
    OpStreams streams;
    if (args.size() == 5 && kwargs.empty() &&
        streams.read(args[2], args[3], args[4], direct_, *order_, device_) && load(args[0], topk_idx) &&
        load(args[1], num_experts) && streams.cuda({args[0]})) {
      const py::tuple result = streams.run(*order_, direct_, [&] {
        return layout(handle_, topk_idx, num_experts, direct_.comm_stream(), *order_, streams.compute(),
                      streams.flags());
      });
      // result: (status, per_rank, per_rdma_rank, per_expert, is_token_in_rank); per_rank's storage
      // is the one allocation of the three count vectors.
      if (py::object answered = answer(result, {1, 2, 3, 4, kEventSlot},
                                       [&] { return streams.end(direct_, {args[0], result[1], result[4]}); }))
        return answered;
    }
    return DirectBinding::fallback(buffer, kGetDispatchLayout, args, kwargs);
  }

  // intranode_dispatch(x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
  // num_tokens_per_expert, cached_num_recv_tokens, cached_rank_prefix_matrix,
  // cached_channel_prefix_matrix, expert_alignment, num_worst_tokens, config, previous_event,
  // async_, allocate_on_comm_stream).
  py::object intranode_dispatch(const py::args& args, const py::kwargs& kwargs) {
    py::object buffer = direct_.buffer();
    at::Tensor x, is_token_in_rank;
    c10::optional<at::Tensor> x_scales, topk_idx, topk_weights, per_rank, per_expert, cached_rank_prefix,
        cached_channel_prefix;
    int64_t cached_num_recv = 0, expert_alignment = 0, num_worst_tokens = 0;
    uintptr_t config = 0;
    DEEPEP_FAST_BEGIN("intranode_dispatch", "no host wait", "host wait");
    OpStreams streams;
    if (args.size() == 16 && kwargs.empty() && streams.read(args[13], args[14], args[15], direct_, *order_, device_) &&
        load(args[0], x) && load(args[1], x_scales) && load(args[2], topk_idx) && load(args[3], topk_weights) &&
        load(args[4], per_rank) && load(args[5], is_token_in_rank) && load(args[6], per_expert) &&
        load(args[7], cached_num_recv) && load(args[8], cached_rank_prefix) && load(args[9], cached_channel_prefix) &&
        load(args[10], expert_alignment) && load(args[11], num_worst_tokens) &&
        (config = config_address(args[12])) != 0 &&
        streams.cuda({args[0], args[1], args[2], args[3], args[4], args[5], args[6], args[8], args[9]})) {
      const py::tuple result = streams.run(*order_, direct_, [&] {
        return dispatch(handle_, x, x_scales, topk_idx, topk_weights, per_rank, is_token_in_rank, per_expert,
                        cached_num_recv, cached_rank_prefix, cached_channel_prefix, expert_alignment,
                        num_worst_tokens, config, direct_.comm_stream(), *order_, streams.compute(), streams.flags());
      });
      // result: (status, recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, per_expert_list,
      // rank_prefix, channel_prefix, recv_channel_prefix, recv_src_idx, send_head); send_head's
      // storage is recv_channel_prefix's (the handle's one int32 allocation).
      const auto end = [&] {
        return streams.end(direct_, {args[0], args[1], args[2], args[3], args[4], args[5], args[6], result[8],
                                     result[6], result[7], result[1], result[2], result[3], result[4], result[9]});
      };
      if (py::object answered = answer(result, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, kEventSlot}, end)) {
        DEEPEP_FAST_END();
        return answered;
      }
    }
    return DirectBinding::fallback(buffer, kIntranodeDispatch, args, kwargs);
  }

  // intranode_combine(x, topk_weights, bias_0, bias_1, src_idx, rank_prefix_matrix,
  // channel_prefix_matrix, send_head, config, previous_event, async_, allocate_on_comm_stream).
  py::object intranode_combine(const py::args& args, const py::kwargs& kwargs) {
    py::object buffer = direct_.buffer();
    at::Tensor x, src_idx, rank_prefix, channel_prefix, send_head;
    c10::optional<at::Tensor> topk_weights, bias_0, bias_1;
    uintptr_t config = 0;
    DEEPEP_FAST_BEGIN("intranode_combine", "all", nullptr);
    OpStreams streams;
    if (args.size() == 12 && kwargs.empty() && streams.read(args[9], args[10], args[11], direct_, *order_, device_) &&
        load(args[0], x) && load(args[1], topk_weights) && load(args[2], bias_0) && load(args[3], bias_1) &&
        load(args[4], src_idx) && load(args[5], rank_prefix) && load(args[6], channel_prefix) &&
        load(args[7], send_head) && (config = config_address(args[8])) != 0 &&
        streams.cuda({args[0], args[1], args[2], args[3], args[4], args[5], args[6], args[7]})) {
      const py::tuple result = streams.run(*order_, direct_, [&] {
        return combine(handle_, x, topk_weights, bias_0, bias_1, src_idx, rank_prefix, channel_prefix, send_head,
                       config, direct_.comm_stream(), *order_, streams.compute(), streams.flags());
      });
      // result: (status, combined_x, combined_topk_weights)
      const auto end = [&] {
        return streams.end(direct_, {args[0], args[1], args[2], args[3], args[4], args[5], args[6], args[7],
                                     result[1], result[2]});
      };
      if (py::object answered = answer(result, {1, 2, kEventSlot}, end)) {
        DEEPEP_FAST_END();
        return answered;
      }
    }
    return DirectBinding::fallback(buffer, kIntranodeCombine, args, kwargs);
  }

 private:
  LayoutFn layout_fn_;
  DispatchPrepareFn prepare_fn_;
  DispatchFn dispatch_fn_;
  DispatchFusedFn dispatch_fused_fn_;
  CombineFn combine_fn_;
  LayoutOutputsFn layout_outputs_fn_;
  HandleOutputsFn handle_outputs_fn_;
  DispatchOutputsFn dispatch_outputs_fn_;
  CombineOutputsFn combine_outputs_fn_;
  int64_t num_ranks_;
  int device_;
  std::vector<int> per_expert_;
  at::TensorOptions on_device_;
  // The argument structs and the output geometry each call refills.
  DeepepIntranodeDispatchArgs dispatch_args_{};
  DeepepIntranodeCombineArgs combine_args_{};
  DeepepOutputs layout_outputs_{}, handle_outputs_{}, recv_outputs_{}, combine_outputs_{};
  OutputsCache<2> layout_cache_;
  OutputsCache<4> handle_cache_;
  OutputsCache<11> recv_cache_;
  OutputsCache<7> combine_cache_;
  // What bind_buffer gave (the direct entries only).
  uintptr_t handle_ = 0;
  py::object order_object_;  // keeps order_ alive
  const StreamOrder* order_ = nullptr;
  DirectBinding direct_;
};

}  // namespace deepep_fast
