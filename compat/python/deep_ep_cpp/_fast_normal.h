// get_dispatch_layout and the normal-mode ops (intranode dispatch / combine) of the compiled host
// path: the same steps as the ctypes path in _buffer.py / _normal.py (allocate the outputs, fill
// the C ABI's structs, call it), without the Python-level cost of each. The waits of DeepEP's stream
// protocol are done here (order flags, _fast_streams.h); events for async_finish and
// allocate_on_comm_stream stay in Python (_streams.py).
#pragma once

#include <vector>

#include "_fast_streams.h"

namespace deepep_fast {

using LayoutFn = int (*)(const DeepepBuffer*, const DeepepTensor*, int, const DeepepTensor*, const DeepepTensor*,
                         const DeepepTensor*, const DeepepTensor*, void*);
using DispatchPrepareFn = int (*)(const DeepepBuffer*, const DeepepIntranodeDispatchArgs*, int*, int*, int, void*);
using DispatchFn = int (*)(const DeepepBuffer*, const DeepepIntranodeDispatchArgs*,
                           const DeepepIntranodeDispatchOutputs*, void*);
using CombineFn = int (*)(const DeepepBuffer*, const DeepepIntranodeCombineArgs*, void*);

// One Buffer's layout, dispatch and combine. Holds the argument structs (each call refills the
// fields it uses) and the constants of the buffer; the C ABI is reached through the addresses of
// its functions in the libdeepep_nccl.so that deep_ep_cpp loaded.
class NormalOps {
 public:
  // The most local experts a non-cached dispatch reports counts for (as the ctypes path).
  static constexpr int kMaxLocalExperts = 1024;

  NormalOps(uintptr_t layout_fn, uintptr_t prepare_fn, uintptr_t dispatch_fn, uintptr_t combine_fn,
            int64_t num_ranks, int64_t num_layout_rdma_ranks, int device)
      : layout_fn_(reinterpret_cast<LayoutFn>(layout_fn)),
        prepare_fn_(reinterpret_cast<DispatchPrepareFn>(prepare_fn)),
        dispatch_fn_(reinterpret_cast<DispatchFn>(dispatch_fn)),
        combine_fn_(reinterpret_cast<CombineFn>(combine_fn)),
        num_ranks_(num_ranks),
        num_rdma_ranks_(num_layout_rdma_ranks),
        device_(device),
        per_expert_(kMaxLocalExperts) {
    on_device_ = at::TensorOptions().device(at::kCUDA, device);
  }

  // (status, per_rank, per_rdma_rank or None, per_expert, is_token_in_rank, counts), (status,),
  // (kBadInput,) or (kDriverError, code). The three count vectors are views of `counts`, one
  // allocation. Each op launches on `stream` (the comm stream), ordered against `compute` as
  // `order_flags` say.
  py::tuple layout(uintptr_t buffer, const at::Tensor& topk_idx, int64_t num_experts, uintptr_t stream,
                   const StreamOrder& order, uintptr_t compute, int order_flags) {
    const Ordering ordering{&order, compute, order_flags};
    const auto idx_type = topk_idx.scalar_type();
    if ((idx_type != at::kLong && idx_type != at::kInt) || !on_device(topk_idx, device_) || num_experts <= 0 ||
        !fits_int32(num_experts) || !ordering.usable())
      return py::make_tuple(kBadInput);
    DeepepTensor topk, per_rank_desc, per_rdma_desc, per_expert_desc, in_rank_desc;
    if (!describe(topk, topk_idx)) return py::make_tuple(kBadInput);
    if (const int error = ordering.before(stream)) return driver_error(error);
    const int64_t num_tokens = topk_idx.dim() > 0 ? topk_idx.size(0) : 0;
    at::Tensor counts = at::empty({num_ranks_ + num_rdma_ranks_ + num_experts}, on_device_.dtype(at::kInt));
    at::Tensor in_rank = at::empty({num_tokens, num_ranks_}, on_device_.dtype(at::kBool));
    at::Tensor per_rank = counts.narrow(0, 0, num_ranks_);
    at::Tensor per_expert = counts.narrow(0, num_ranks_ + num_rdma_ranks_, num_experts);
    py::object per_rdma = py::none();
    describe(per_rank_desc, per_rank);
    describe(per_expert_desc, per_expert);
    describe(in_rank_desc, in_rank);
    if (num_rdma_ranks_ > 0) {
      at::Tensor rdma = counts.narrow(0, num_ranks_, num_rdma_ranks_);
      describe(per_rdma_desc, rdma);
      per_rdma = py::cast(rdma);
    }
    const int status = layout_fn_(as_buffer(buffer), &topk, int(num_experts), &per_rank_desc,
                                  num_rdma_ranks_ > 0 ? &per_rdma_desc : nullptr, &per_expert_desc, &in_rank_desc,
                                  as_stream(stream));
    if (status != 0) return py::make_tuple(status);
    if (const int error = ordering.after(stream)) return driver_error(error);
    return py::make_tuple(status, per_rank, per_rdma, per_expert, in_rank, counts);
  }

  // (status, recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
  // rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, send_head,
  // the int32 allocation behind the matrices) with None for absent outputs, (status,) for a failed
  // call, (kBadInput,) or (kDriverError, code). `config` is the address of a DeepepConfig.
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
    // Everything that could send this call down the ctypes path is checked before the first
    // launch: the notify kernel must run once per call.
    if (!on_device(x, device_) || x.dim() < 1 || (cached && !cached_channel_prefix_matrix.has_value()) ||
        (cached && !on_device(*cached_rank_prefix_matrix, device_)) || (x_scales.has_value() && x_scales->dim() != 2) ||
        (topk_idx.has_value() && topk_idx->dim() != 2) || (topk_weights.has_value() && topk_weights->dim() != 2) ||
        (!cached && num_tokens_per_expert.has_value() && num_tokens_per_expert->dim() != 1) ||
        !fits_int32(expert_alignment) || !fits_int32(num_worst_tokens) || !fits_int32(cached_num_recv_tokens) ||
        !ordering.usable())
      return py::make_tuple(kBadInput);
    DeepepIntranodeDispatchArgs& a = dispatch_args_;
    std::memcpy(&a.config, at_address<const DeepepConfig>(config), sizeof a.config);
    const int64_t num_channels = a.config.num_sms / 2;
    const int64_t num_tokens = x.size(0);
    const int64_t matrix = num_ranks_ * num_channels;
    if (num_channels < 0) return py::make_tuple(kBadInput);

    // The handle's matrices and send_head in one int32 allocation.
    const int64_t total = (cached ? 0 : num_ranks_ * num_ranks_ + matrix) + matrix + num_tokens * num_ranks_;
    at::Tensor ints = at::empty({total}, on_device_.dtype(at::kInt));
    at::Tensor rank_prefix, channel_prefix;
    int64_t at = 0;
    if (cached) {
      rank_prefix = *cached_rank_prefix_matrix;
      channel_prefix = *cached_channel_prefix_matrix;
    } else {
      rank_prefix = ints.narrow(0, 0, num_ranks_ * num_ranks_).view({num_ranks_, num_ranks_});
      at = num_ranks_ * num_ranks_;
      channel_prefix = ints.narrow(0, at, matrix).view({num_ranks_, num_channels});
      at += matrix;
    }
    at::Tensor recv_channel_prefix = ints.narrow(0, at, matrix).view({num_ranks_, num_channels});
    at::Tensor send_head = ints.narrow(0, at + matrix, num_tokens * num_ranks_).view({num_tokens, num_ranks_});

    const c10::optional<at::Tensor> none;
    if (!describe(a.x, x) || !describe(a.x_scales, x_scales) || !describe(a.topk_idx, topk_idx) ||
        !describe(a.topk_weights, topk_weights) || !describe(a.num_tokens_per_rank, cached ? none : num_tokens_per_rank) ||
        !describe(a.is_token_in_rank, is_token_in_rank) ||
        !describe(a.num_tokens_per_expert, cached ? none : num_tokens_per_expert) ||
        !describe(a.rank_prefix_matrix, rank_prefix) || !describe(a.channel_prefix_matrix, channel_prefix))
      return py::make_tuple(kBadInput);
    describe(a.recv_channel_prefix_matrix, recv_channel_prefix);
    describe(a.send_head, send_head);
    a.cached = cached ? 1 : 0;
    a.expert_alignment = int32_t(expert_alignment);
    a.num_worst_tokens = int32_t(num_worst_tokens);
    a.reserved = 0;
    if (const int error = ordering.before(stream)) return driver_error(error);

    int num_recv = 0;
    int status;
    if (cached || num_worst_tokens > 0) {
      status = prepare_fn_(as_buffer(buffer), &a, &num_recv, per_expert_.data(), kMaxLocalExperts, as_stream(stream));
    } else {
      // This call waits on the host for the receive counts: other Python threads may run meanwhile.
      py::gil_scoped_release unlocked;
      status = prepare_fn_(as_buffer(buffer), &a, &num_recv, per_expert_.data(), kMaxLocalExperts, as_stream(stream));
    }
    if (status != 0) return py::make_tuple(status);

    py::list per_expert_list;
    if (cached) {
      num_recv = int(cached_num_recv_tokens);
    } else if (num_worst_tokens > 0) {
      num_recv = int(num_worst_tokens);
    } else {
      const int64_t local = num_tokens_per_expert.has_value() ? num_tokens_per_expert->size(0) / num_ranks_ : 0;
      for (int64_t e = 0; e < std::min<int64_t>(local, kMaxLocalExperts); ++e) per_expert_list.append(per_expert_[e]);
    }

    std::vector<int64_t> recv_x_shape(x.sizes().begin(), x.sizes().end());
    recv_x_shape[0] = num_recv;
    at::Tensor recv_x = at::empty(recv_x_shape, on_device_.dtype(x.scalar_type()));
    DeepepIntranodeDispatchOutputs& o = dispatch_outputs_;
    std::memset(&o, 0, sizeof o);
    describe(o.recv_x, recv_x);
    py::object recv_x_scales = py::none(), recv_topk_idx = py::none(), recv_topk_weights = py::none();
    if (x_scales.has_value()) {
      at::Tensor t = at::empty({num_recv, x_scales->size(1)}, on_device_.dtype(x_scales->scalar_type()));
      describe(o.recv_x_scales, t);
      recv_x_scales = py::cast(t);
    }
    if (topk_idx.has_value() && !cached) {
      const int64_t num_topk = topk_idx->size(1);
      at::Tensor idx = at::empty({num_recv, num_topk}, on_device_.dtype(topk_idx->scalar_type()));
      at::Tensor weights = at::empty({num_recv, num_topk}, on_device_.dtype(at::kFloat));
      describe(o.recv_topk_idx, idx);
      describe(o.recv_topk_weights, weights);
      recv_topk_idx = py::cast(idx);
      recv_topk_weights = py::cast(weights);
    }
    at::Tensor recv_src_idx = at::empty({num_recv}, on_device_.dtype(at::kInt));
    describe(o.recv_src_idx, recv_src_idx);
    status = dispatch_fn_(as_buffer(buffer), &a, &o, as_stream(stream));
    if (status != 0) return py::make_tuple(status);
    if (const int error = ordering.after(stream)) return driver_error(error);
    return py::make_tuple(status, recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, per_expert_list,
                          rank_prefix, channel_prefix, recv_channel_prefix, recv_src_idx, send_head, ints);
  }

  // (status, combined_x, combined_topk_weights or None), (status,) for a failed call, (kBadInput,)
  // or (kDriverError, code).
  py::tuple combine(uintptr_t buffer, const at::Tensor& x, const c10::optional<at::Tensor>& topk_weights,
                    const c10::optional<at::Tensor>& bias_0, const c10::optional<at::Tensor>& bias_1,
                    const at::Tensor& src_idx, const at::Tensor& rank_prefix_matrix,
                    const at::Tensor& channel_prefix_matrix, const at::Tensor& send_head, uintptr_t config,
                    uintptr_t stream, const StreamOrder& order, uintptr_t compute, int order_flags) {
    const Ordering ordering{&order, compute, order_flags};
    if (!on_device(x, device_) || !on_device(send_head, device_) || x.dim() < 1 || send_head.dim() < 1 ||
        (topk_weights.has_value() && topk_weights->dim() != 2) || !ordering.usable())
      return py::make_tuple(kBadInput);
    std::vector<int64_t> combined_shape(x.sizes().begin(), x.sizes().end());
    combined_shape[0] = send_head.size(0);
    at::Tensor combined_x = at::empty(combined_shape, on_device_.dtype(x.scalar_type()));
    c10::optional<at::Tensor> combined_topk_weights;
    if (topk_weights.has_value())
      combined_topk_weights = at::empty({send_head.size(0), topk_weights->size(1)}, on_device_.dtype(at::kFloat));
    DeepepIntranodeCombineArgs& a = combine_args_;
    if (!describe(a.x, x) || !describe(a.topk_weights, topk_weights) || !describe(a.bias_0, bias_0) ||
        !describe(a.bias_1, bias_1) || !describe(a.src_idx, src_idx) ||
        !describe(a.rank_prefix_matrix, rank_prefix_matrix) ||
        !describe(a.channel_prefix_matrix, channel_prefix_matrix) || !describe(a.send_head, send_head) ||
        !describe(a.combined_x, combined_x) || !describe(a.combined_topk_weights, combined_topk_weights))
      return py::make_tuple(kBadInput);
    std::memcpy(&a.config, at_address<const DeepepConfig>(config), sizeof a.config);
    if (const int error = ordering.before(stream)) return driver_error(error);
    const int status = combine_fn_(as_buffer(buffer), &a, as_stream(stream));
    if (status != 0) return py::make_tuple(status);
    if (const int error = ordering.after(stream)) return driver_error(error);
    return py::make_tuple(status, combined_x, optional_tensor(combined_topk_weights));
  }

 private:
  LayoutFn layout_fn_;
  DispatchPrepareFn prepare_fn_;
  DispatchFn dispatch_fn_;
  CombineFn combine_fn_;
  int64_t num_ranks_, num_rdma_ranks_;
  int device_;
  std::vector<int> per_expert_;
  at::TensorOptions on_device_;
  DeepepIntranodeDispatchArgs dispatch_args_{};
  DeepepIntranodeDispatchOutputs dispatch_outputs_{};
  DeepepIntranodeCombineArgs combine_args_{};
};

}  // namespace deepep_fast
