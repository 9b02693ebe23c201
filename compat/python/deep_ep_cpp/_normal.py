"""deep_ep_cpp.Buffer's normal-mode ops: intranode_dispatch / intranode_combine with DeepEP's
positional signatures and tuple layouts, each a short translation to the C ABI: through the
compiled host path (_fast.py) when it loaded, else through ctypes (also for input the compiled
path does not take).

On the ctypes path descriptors are packed into one preallocated argument struct with a single
struct.pack_into call; outputs are allocated by torch on both (its caching allocator stays in
charge)."""
import ctypes
import struct

from ._lib import lib, raise_status, tensor_fields
from ._lib import torch as _torch
from ._streams import StreamProtocol, without_torch_function

_TENSOR = "Pii4q4q"
# DeepepIntranodeDispatchArgs: 11 tensors, Config (5 x int32), cached, expert_alignment,
# num_worst_tokens, reserved; "0P" pads the tail to the struct's 8-byte alignment.
_DISPATCH_ARGS = struct.Struct("@" + _TENSOR * 11 + "5i4i0P")
_DISPATCH_OUTPUTS = struct.Struct("@" + _TENSOR * 5)
_COMBINE_ARGS = struct.Struct("@" + _TENSOR * 10 + "5i0P")
_MAX_LOCAL_EXPERTS = 1024


_desc = tensor_fields


def _config_fields(config):
    c = config._c
    return (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
            c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens)


class NormalMode(StreamProtocol):
    """Mixin for deep_ep_cpp.Buffer (needs _handle, _device_id, _num_ranks and the stream protocol)."""

    _dispatch_args = None

    def _normal_init(self):
        self._dispatch_args = ctypes.create_string_buffer(_DISPATCH_ARGS.size)
        self._dispatch_outputs = ctypes.create_string_buffer(_DISPATCH_OUTPUTS.size)
        self._combine_args = ctypes.create_string_buffer(_COMBINE_ARGS.size)
        self._dispatch_args_addr = ctypes.addressof(self._dispatch_args)
        self._dispatch_outputs_addr = ctypes.addressof(self._dispatch_outputs)
        self._combine_args_addr = ctypes.addressof(self._combine_args)
        self._num_recv = ctypes.c_int()
        self._num_recv_addr = ctypes.addressof(self._num_recv)
        self._per_expert = (ctypes.c_int * _MAX_LOCAL_EXPERTS)()
        self._per_expert_addr = ctypes.addressof(self._per_expert)

    def _check_device(self, name, t):
        if t.get_device() != self._device_id:
            raise RuntimeError(
                f"deepep-nccl: {name} must be a CUDA tensor on the buffer's device cuda:{self._device_id}, "
                f"got one on {t.device}"
            )

    def _fast_with_config(self, op_name, config, order, *args):
        """_fast_call of the compiled path's normal op `op_name` with the config's C struct, the comm
        stream and the stream ordering (`order`: _op_begin's) appended; None without the compiled
        path or for a config it cannot read."""
        fast = self._normal_fast
        c_config = getattr(config, "_c", None)
        if fast is None or c_config is None:
            return None
        return self._fast_call(getattr(fast, op_name), *args, ctypes.addressof(c_config), self._comm_stream_ptr,
                               self._stream_order, self._compute_handle, order)

    @without_torch_function
    def intranode_dispatch(
        self, x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
        cached_num_recv_tokens, cached_rank_prefix_matrix, cached_channel_prefix_matrix, expert_alignment,
        num_worst_tokens, config, previous_event, async_, allocate_on_comm_stream,
    ):
        """DeepEP's 11-tuple: (recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, rank_prefix_matrix, channel_prefix_matrix,
        recv_channel_prefix_matrix, recv_src_idx, send_head, event)."""
        handle = self._live_handle()
        comm, compute, order = self._op_begin(previous_event, async_, allocate_on_comm_stream)
        try:
            result = self._fast_with_config(
                "dispatch", config, order, handle, x, x_scales, topk_idx, topk_weights, num_tokens_per_rank,
                is_token_in_rank, num_tokens_per_expert, cached_num_recv_tokens, cached_rank_prefix_matrix,
                cached_channel_prefix_matrix, expert_alignment, num_worst_tokens)
            if result is not None:
                order = 0  # the compiled path did the waits
            else:
                self._order_before(order, comm, compute)
                result = self._dispatch_ctypes(
                    handle, x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                    num_tokens_per_expert, cached_num_recv_tokens, cached_rank_prefix_matrix,
                    cached_channel_prefix_matrix, expert_alignment, num_worst_tokens, config)
        finally:
            self._op_allocated(compute, allocate_on_comm_stream)
        (recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, per_expert_list, rank_prefix, channel_prefix,
         recv_channel_prefix, recv_src_idx, send_head, ints) = result
        event = self._op_end(comm, compute, async_, allocate_on_comm_stream, (
            x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
            ints, rank_prefix, channel_prefix, recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, recv_src_idx),
            order)
        return (recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, per_expert_list, rank_prefix,
                channel_prefix, recv_channel_prefix, recv_src_idx, send_head, event)

    def _dispatch_ctypes(
        self, handle, x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
        num_tokens_per_expert, cached_num_recv_tokens, cached_rank_prefix_matrix, cached_channel_prefix_matrix,
        expert_alignment, num_worst_tokens, config,
    ):
        """The dispatch through ctypes: the compiled path's result (outputs, then the int32
        allocation behind the handle's matrices)."""
        torch = _torch
        self._check_device("x", x)
        cached = cached_rank_prefix_matrix is not None
        if cached:
            if cached_channel_prefix_matrix is None:
                raise RuntimeError("deepep-nccl: a cached dispatch needs cached_channel_prefix_matrix too")
            self._check_device("cached_rank_prefix_matrix", cached_rank_prefix_matrix)
        num_ranks = self._num_ranks
        num_channels = config.num_sms // 2
        num_tokens = x.shape[0] if x.dim() > 0 else 0
        device = self._device
        # Handle matrices and send_head in one int32 allocation.
        if cached:
            rank_prefix, channel_prefix = cached_rank_prefix_matrix, cached_channel_prefix_matrix
            ints = torch.empty(num_ranks * num_channels + num_tokens * num_ranks, dtype=torch.int32, device=device)
            recv_channel_prefix, send_head = ints.split_with_sizes((num_ranks * num_channels, num_tokens * num_ranks))
        else:
            ints = torch.empty(num_ranks * num_ranks + 2 * num_ranks * num_channels + num_tokens * num_ranks,
                               dtype=torch.int32, device=device)
            rank_prefix, channel_prefix, recv_channel_prefix, send_head = ints.split_with_sizes(
                (num_ranks * num_ranks, num_ranks * num_channels, num_ranks * num_channels, num_tokens * num_ranks))
            rank_prefix = rank_prefix.view(num_ranks, num_ranks)
            channel_prefix = channel_prefix.view(num_ranks, num_channels)
        recv_channel_prefix = recv_channel_prefix.view(num_ranks, num_channels)
        send_head = send_head.view(num_tokens, num_ranks)

        _DISPATCH_ARGS.pack_into(
            self._dispatch_args, 0,
            *_desc("x", x), *_desc("x_scales", x_scales), *_desc("topk_idx", topk_idx),
            *_desc("topk_weights", topk_weights),
            *_desc("num_tokens_per_rank", None if cached else num_tokens_per_rank),
            *_desc("is_token_in_rank", is_token_in_rank),
            *_desc("num_tokens_per_expert", None if cached else num_tokens_per_expert),
            *_desc("rank_prefix_matrix", rank_prefix), *_desc("channel_prefix_matrix", channel_prefix),
            *_desc("recv_channel_prefix_matrix", recv_channel_prefix), *_desc("send_head", send_head),
            *_config_fields(config), int(cached), expert_alignment, num_worst_tokens, 0,
        )
        status = lib.deepep_intranode_dispatch_prepare(
            handle, self._dispatch_args_addr, self._num_recv_addr, self._per_expert_addr, _MAX_LOCAL_EXPERTS,
            self._comm_stream_ptr)
        if status:
            raise_status(status)
        if cached:
            num_recv, per_expert_list = cached_num_recv_tokens, []
        elif num_worst_tokens > 0:
            num_recv, per_expert_list = num_worst_tokens, []
        else:
            num_recv = self._num_recv.value
            per_expert_list = self._per_expert[: num_tokens_per_expert.shape[0] // num_ranks]

        recv_x = torch.empty((num_recv, *x.shape[1:]), dtype=x.dtype, device=device)
        recv_x_scales = recv_topk_idx = recv_topk_weights = None
        if x_scales is not None:
            recv_x_scales = torch.empty((num_recv, x_scales.shape[1]), dtype=x_scales.dtype, device=device)
        if topk_idx is not None and not cached:
            num_topk = topk_idx.shape[1]
            recv_topk_idx = torch.empty((num_recv, num_topk), dtype=topk_idx.dtype, device=device)
            recv_topk_weights = torch.empty((num_recv, num_topk), dtype=torch.float32, device=device)
        recv_src_idx = torch.empty(num_recv, dtype=torch.int32, device=device)
        _DISPATCH_OUTPUTS.pack_into(
            self._dispatch_outputs, 0,
            *_desc("recv_x", recv_x), *_desc("recv_x_scales", recv_x_scales), *_desc("recv_topk_idx", recv_topk_idx),
            *_desc("recv_topk_weights", recv_topk_weights), *_desc("recv_src_idx", recv_src_idx),
        )
        status = lib.deepep_intranode_dispatch(handle, self._dispatch_args_addr, self._dispatch_outputs_addr,
                                               self._comm_stream_ptr)
        if status:
            raise_status(status)
        return (recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, per_expert_list, rank_prefix,
                channel_prefix, recv_channel_prefix, recv_src_idx, send_head, ints)

    @without_torch_function
    def intranode_combine(
        self, x, topk_weights, bias_0, bias_1, src_idx, rank_prefix_matrix, channel_prefix_matrix, send_head,
        config, previous_event, async_, allocate_on_comm_stream,
    ):
        """DeepEP's (combined_x, combined_topk_weights, event)."""
        handle = self._live_handle()
        comm, compute, order = self._op_begin(previous_event, async_, allocate_on_comm_stream)
        try:
            result = self._fast_with_config("combine", config, order, handle, x, topk_weights, bias_0, bias_1,
                                            src_idx, rank_prefix_matrix, channel_prefix_matrix, send_head)
            if result is not None:
                order = 0  # the compiled path did the waits
            else:
                self._order_before(order, comm, compute)
                result = self._combine_ctypes(handle, x, topk_weights, bias_0, bias_1, src_idx, rank_prefix_matrix,
                                              channel_prefix_matrix, send_head, config)
        finally:
            self._op_allocated(compute, allocate_on_comm_stream)
        combined_x, combined_topk_weights = result
        event = self._op_end(comm, compute, async_, allocate_on_comm_stream, (
            x, topk_weights, bias_0, bias_1, src_idx, rank_prefix_matrix, channel_prefix_matrix, send_head,
            combined_x, combined_topk_weights), order)
        return combined_x, combined_topk_weights, event

    def _combine_ctypes(self, handle, x, topk_weights, bias_0, bias_1, src_idx, rank_prefix_matrix,
                        channel_prefix_matrix, send_head, config):
        """The combine through ctypes: (combined_x, combined_topk_weights or None)."""
        torch = _torch
        self._check_device("x", x)
        self._check_device("send_head", send_head)
        num_tokens = send_head.shape[0]
        device = self._device
        combined_x = torch.empty((num_tokens, *x.shape[1:]), dtype=x.dtype, device=device)
        combined_topk_weights = None
        if topk_weights is not None:
            combined_topk_weights = torch.empty((num_tokens, topk_weights.shape[1]), dtype=torch.float32,
                                                device=device)
        _COMBINE_ARGS.pack_into(
            self._combine_args, 0,
            *_desc("x", x), *_desc("topk_weights", topk_weights), *_desc("bias_0", bias_0), *_desc("bias_1", bias_1),
            *_desc("src_idx", src_idx), *_desc("rank_prefix_matrix", rank_prefix_matrix),
            *_desc("channel_prefix_matrix", channel_prefix_matrix), *_desc("send_head", send_head),
            *_desc("combined_x", combined_x), *_desc("combined_topk_weights", combined_topk_weights),
            *_config_fields(config),
        )
        status = lib.deepep_intranode_combine(handle, self._combine_args_addr, self._comm_stream_ptr)
        if status:
            raise_status(status)
        return combined_x, combined_topk_weights
