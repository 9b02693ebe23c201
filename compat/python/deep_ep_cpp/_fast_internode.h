// The internode normal-mode ops (a buffer across nodes) of the compiled host path: the same steps
// as the ctypes path in _internode.py (ask the library what to allocate, allocate it, fill the C
// ABI's structs, call it), without the Python-level cost of each. As _fast_normal.h: the waits of
// DeepEP's stream protocol are done here, events for async_finish and allocate_on_comm_stream stay
// in Python (_streams.py), and input this path does not take returns kBadInput before anything is
// launched (the ctypes path then raises the error naming the argument).
#pragma once

#include <algorithm>
#include <vector>

#include "_fast_streams.h"

namespace deepep_fast {

// The C ABI's functions as the header declares them (only their addresses come from Python).
using InterHandleOutputsFn = decltype(&deepep_internode_dispatch_handle_outputs);
using InterDispatchPrepareFn = decltype(&deepep_internode_dispatch_prepare);
using InterDispatchOutputsFn = decltype(&deepep_internode_dispatch_outputs);
using InterDispatchFn = decltype(&deepep_internode_dispatch);
using InterCombineOutputsFn = decltype(&deepep_internode_combine_outputs);
using InterCombineFn = decltype(&deepep_internode_combine);

// One Buffer's internode dispatch and combine. Holds the argument structs (each call refills the
// fields it uses); the C ABI is reached through the addresses of its functions in the
// libdeepep_nccl.so that deep_ep_cpp loaded.
class InternodeOps {
 public:
  InternodeOps(uintptr_t handle_outputs_fn, uintptr_t prepare_fn, uintptr_t dispatch_outputs_fn, uintptr_t dispatch_fn,
               uintptr_t combine_outputs_fn, uintptr_t combine_fn, int64_t num_ranks, int device)
      : handle_outputs_fn_(reinterpret_cast<InterHandleOutputsFn>(handle_outputs_fn)),
        prepare_fn_(reinterpret_cast<InterDispatchPrepareFn>(prepare_fn)),
        dispatch_outputs_fn_(reinterpret_cast<InterDispatchOutputsFn>(dispatch_outputs_fn)),
        dispatch_fn_(reinterpret_cast<InterDispatchFn>(dispatch_fn)),
        combine_outputs_fn_(reinterpret_cast<InterCombineOutputsFn>(combine_outputs_fn)),
        combine_fn_(reinterpret_cast<InterCombineFn>(combine_fn)),
        num_ranks_(num_ranks),
        device_(device),
        per_expert_(DEEPEP_MAX_LOCAL_EXPERTS) {
    on_device_ = at::TensorOptions().device(at::kCUDA, device);
  }

  // (status, recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
  // rdma_channel_prefix_matrix, gbl_channel_prefix_matrix, recv_rdma_channel_prefix_matrix,
  // recv_rdma_rank_prefix_sum, recv_gbl_channel_prefix_matrix, recv_gbl_rank_prefix_sum, recv_src_meta,
  // send_rdma_head, send_nvl_head) with None for absent outputs (cached: the handle's matrices and
  // prefix sums in their places, no send_rdma_head, recv_src_meta or send_nvl_head): the ctypes
  // path's _internode_dispatch_ctypes result. (status,) for a failed call, (kBadInput,) or
  // (kDriverError, code). The outputs are as deepep_internode_dispatch_handle_outputs / _outputs
  // describe them. `config` is the address of a DeepepConfig.
  py::tuple dispatch(uintptr_t buffer, const at::Tensor& x, const c10::optional<at::Tensor>& x_scales,
                     const c10::optional<at::Tensor>& topk_idx, const c10::optional<at::Tensor>& topk_weights,
                     const c10::optional<at::Tensor>& num_tokens_per_rank,
                     const c10::optional<at::Tensor>& num_tokens_per_rdma_rank, const at::Tensor& is_token_in_rank,
                     const c10::optional<at::Tensor>& num_tokens_per_expert, int64_t cached_num_recv_tokens,
                     int64_t cached_num_rdma_recv_tokens,
                     const c10::optional<at::Tensor>& cached_rdma_channel_prefix_matrix,
                     const c10::optional<at::Tensor>& cached_recv_rdma_rank_prefix_sum,
                     const c10::optional<at::Tensor>& cached_gbl_channel_prefix_matrix,
                     const c10::optional<at::Tensor>& cached_recv_gbl_rank_prefix_sum, int64_t expert_alignment,
                     int64_t num_worst_tokens, uintptr_t config, uintptr_t stream, const StreamOrder& order,
                     uintptr_t compute, int order_flags) {
    const Ordering ordering{&order, compute, order_flags};
    const bool cached = cached_rdma_channel_prefix_matrix.has_value();
    // Everything that could send this call down the ctypes path is checked before the first
    // launch: the notify kernel must run once per call.
    if (!on_device(x, device_) ||
        (cached && (!cached_gbl_channel_prefix_matrix.has_value() || !cached_recv_rdma_rank_prefix_sum.has_value() ||
                    !cached_recv_gbl_rank_prefix_sum.has_value())) ||
        !fits_int32(expert_alignment) || !fits_int32(num_worst_tokens) || !fits_int32(cached_num_recv_tokens) ||
        !fits_int32(cached_num_rdma_recv_tokens) || !ordering.usable())
      return py::make_tuple(kBadInput);
    DeepepInternodeDispatchArgs& a = dispatch_args_;
    std::memcpy(&a.config, at_address<const DeepepConfig>(config), sizeof a.config);
    const c10::optional<at::Tensor> none;
    // Cached: the handle's matrices and prefix sums (the kernel checks them); the rest of the
    // handle's descriptors come from the library's description below.
    if (!describe(a.x, x) || !describe(a.x_scales, x_scales) || !describe(a.topk_idx, topk_idx) ||
        !describe(a.topk_weights, topk_weights) ||
        !describe(a.num_tokens_per_rank, cached ? none : num_tokens_per_rank) ||
        !describe(a.num_tokens_per_rdma_rank, cached ? none : num_tokens_per_rdma_rank) ||
        !describe(a.is_token_in_rank, is_token_in_rank) ||
        !describe(a.num_tokens_per_expert, cached ? none : num_tokens_per_expert) ||
        !describe(a.rdma_channel_prefix_matrix, cached ? cached_rdma_channel_prefix_matrix : none) ||
        !describe(a.gbl_channel_prefix_matrix, cached ? cached_gbl_channel_prefix_matrix : none) ||
        !describe(a.recv_rdma_channel_prefix_matrix, none) ||
        !describe(a.recv_rdma_rank_prefix_sum, cached ? cached_recv_rdma_rank_prefix_sum : none) ||
        !describe(a.recv_gbl_channel_prefix_matrix, none) ||
        !describe(a.recv_gbl_rank_prefix_sum, cached ? cached_recv_gbl_rank_prefix_sum : none) ||
        !describe(a.send_rdma_head, none))
      return py::make_tuple(kBadInput);
    a.cached = cached ? 1 : 0;
    a.expert_alignment = int32_t(expert_alignment);
    a.num_worst_tokens = int32_t(num_worst_tokens);
    a.reserved = 0;

    // The handle: what the library says (read from x, the config and the mode), one allocation;
    // cached, only the two receive matrices (recomputed).
    DeepepOutputs& h = handle_outputs_;
    int status = handle_outputs_fn_(as_buffer(buffer), &a, &h);
    if (status != 0) return py::make_tuple(status);
    if (const int error = ordering.before(stream)) return driver_error(error);
    const auto handle = allocate_placed(h, on_device_);
    DeepepTensor* const handle_args[7] = {&a.rdma_channel_prefix_matrix,      &a.gbl_channel_prefix_matrix,
                                          &a.recv_rdma_channel_prefix_matrix, &a.recv_rdma_rank_prefix_sum,
                                          &a.recv_gbl_channel_prefix_matrix,  &a.recv_gbl_rank_prefix_sum,
                                          &a.send_rdma_head};
    for (int i = 0; i < 7; ++i)
      if (!cached || i == 2 || i == 4) *handle_args[i] = h.tensors[i];

    int num_recv = 0, num_rdma_recv = 0;
    if (cached || num_worst_tokens > 0) {
      status = prepare_fn_(as_buffer(buffer), &a, &num_recv, &num_rdma_recv, per_expert_.data(),
                           DEEPEP_MAX_LOCAL_EXPERTS, as_stream(stream));
    } else {
      // This call waits on the host for the receive counts: other Python threads may run meanwhile.
      py::gil_scoped_release unlocked;
      status = prepare_fn_(as_buffer(buffer), &a, &num_recv, &num_rdma_recv, per_expert_.data(),
                           DEEPEP_MAX_LOCAL_EXPERTS, as_stream(stream));
    }
    if (status != 0) return py::make_tuple(status);

    DeepepOutputs& r = recv_outputs_;
    status = dispatch_outputs_fn_(as_buffer(buffer), &a, cached ? int(cached_num_recv_tokens) : num_recv,
                                  cached ? int(cached_num_rdma_recv_tokens) : num_rdma_recv, &r);
    if (status != 0) return py::make_tuple(status);
    const auto recv = allocate_placed(r, on_device_);
    const DeepepInternodeDispatchOutputs outputs{r.tensors[0], r.tensors[1], r.tensors[2],
                                                 r.tensors[3], r.tensors[4], r.tensors[5]};
    status = dispatch_fn_(as_buffer(buffer), &a, &outputs, as_stream(stream));
    if (status != 0) return py::make_tuple(status);
    if (const int error = ordering.after(stream)) return driver_error(error);
    const auto handle_entry = [&](int i, const c10::optional<at::Tensor>& cached_tensor) {
      return optional_tensor(cached ? cached_tensor : handle[i]);
    };
    return py::make_tuple(status, *recv[0], optional_tensor(recv[1]), optional_tensor(recv[2]),
                          optional_tensor(recv[3]),
                          per_expert_list(num_recv, num_tokens_per_expert, num_ranks_, per_expert_),
                          handle_entry(0, cached_rdma_channel_prefix_matrix),
                          handle_entry(1, cached_gbl_channel_prefix_matrix), optional_tensor(handle[2]),
                          handle_entry(3, cached_recv_rdma_rank_prefix_sum), optional_tensor(handle[4]),
                          handle_entry(5, cached_recv_gbl_rank_prefix_sum), optional_tensor(recv[4]),
                          optional_tensor(handle[6]), optional_tensor(recv[5]));
  }

  // (status, combined_x, combined_topk_weights or None), (status,) for a failed call, (kBadInput,)
  // or (kDriverError, code); the outputs as deepep_internode_combine_outputs describes them. The
  // two heads are rewritten in place, as DeepEP's combine does.
  py::tuple combine(uintptr_t buffer, const at::Tensor& x, const c10::optional<at::Tensor>& topk_weights,
                    const c10::optional<at::Tensor>& bias_0, const c10::optional<at::Tensor>& bias_1,
                    const at::Tensor& src_meta, const at::Tensor& is_combined_token_in_rank,
                    const at::Tensor& rdma_channel_prefix_matrix, const at::Tensor& rdma_rank_prefix_sum,
                    const at::Tensor& gbl_channel_prefix_matrix, const at::Tensor& combined_rdma_head,
                    const at::Tensor& combined_nvl_head, uintptr_t config, uintptr_t stream, const StreamOrder& order,
                    uintptr_t compute, int order_flags) {
    const Ordering ordering{&order, compute, order_flags};
    if (!on_device(x, device_) || !ordering.usable()) return py::make_tuple(kBadInput);
    DeepepInternodeCombineArgs& a = combine_args_;
    if (!describe(a.x, x) || !describe(a.topk_weights, topk_weights) || !describe(a.bias_0, bias_0) ||
        !describe(a.bias_1, bias_1) || !describe(a.src_meta, src_meta) ||
        !describe(a.is_combined_token_in_rank, is_combined_token_in_rank) ||
        !describe(a.rdma_channel_prefix_matrix, rdma_channel_prefix_matrix) ||
        !describe(a.rdma_rank_prefix_sum, rdma_rank_prefix_sum) ||
        !describe(a.gbl_channel_prefix_matrix, gbl_channel_prefix_matrix) ||
        !describe(a.combined_rdma_head, combined_rdma_head) || !describe(a.combined_nvl_head, combined_nvl_head))
      return py::make_tuple(kBadInput);
    std::memset(&a.combined_x, 0, sizeof a.combined_x);
    std::memset(&a.combined_topk_weights, 0, sizeof a.combined_topk_weights);
    std::memcpy(&a.config, at_address<const DeepepConfig>(config), sizeof a.config);
    DeepepOutputs& o = combine_outputs_;
    int status = combine_outputs_fn_(as_buffer(buffer), &a, &o);
    if (status != 0) return py::make_tuple(status);
    if (const int error = ordering.before(stream)) return driver_error(error);
    const auto out = allocate_placed(o, on_device_);
    a.combined_x = o.tensors[0];
    a.combined_topk_weights = o.tensors[1];
    status = combine_fn_(as_buffer(buffer), &a, as_stream(stream));
    if (status != 0) return py::make_tuple(status);
    if (const int error = ordering.after(stream)) return driver_error(error);
    return py::make_tuple(status, *out[0], optional_tensor(out[1]));
  }

 private:
  InterHandleOutputsFn handle_outputs_fn_;
  InterDispatchPrepareFn prepare_fn_;
  InterDispatchOutputsFn dispatch_outputs_fn_;
  InterDispatchFn dispatch_fn_;
  InterCombineOutputsFn combine_outputs_fn_;
  InterCombineFn combine_fn_;
  int64_t num_ranks_;
  int device_;
  std::vector<int> per_expert_;
  at::TensorOptions on_device_;
  // The argument structs and the output geometry each call refills.
  DeepepInternodeDispatchArgs dispatch_args_{};
  DeepepInternodeCombineArgs combine_args_{};
  DeepepOutputs handle_outputs_{}, recv_outputs_{}, combine_outputs_{};
};

}  // namespace deepep_fast
