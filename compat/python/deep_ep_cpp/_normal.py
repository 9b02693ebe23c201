"""deep_ep_cpp.Buffer's normal-mode ops: intranode_dispatch / intranode_combine with DeepEP's
positional signatures and tuple layouts, each a short translation to the C ABI: through the
compiled host path (_fast.py) when it loaded, else through ctypes (also for input the compiled
path does not take).

On both the library says what to allocate (deepep_intranode_*_outputs: shapes, dtypes, which
outputs share one allocation) and torch allocates it (its caching allocator stays in charge). On
the ctypes path descriptors are packed into preallocated argument structs with struct.pack_into."""
import ctypes
import struct

from ._lib import (MAX_LOCAL_EXPERTS, TENSOR_FIELDS, TENSOR_WORDS, ArgsLayout, OutputPlans, int_arg,
                   check_int32_fields, lib, raise_status, tensor_fields)
from ._streams import StreamProtocol, stream_handle, without_torch_function

_T = "tensor"
_DISPATCH = ArgsLayout("DeepepIntranodeDispatchArgs", (
    ("x", _T), ("x_scales", _T), ("topk_idx", _T), ("topk_weights", _T), ("num_tokens_per_rank", _T),
    ("is_token_in_rank", _T), ("num_tokens_per_expert", _T), ("rank_prefix_matrix", _T),
    ("channel_prefix_matrix", _T), ("recv_channel_prefix_matrix", _T), ("send_head", _T), ("config", "config"),
    ("cached", "int32"), ("expert_alignment", "int32"), ("num_worst_tokens", "int32"), ("reserved", "int32")))
_COMBINE = ArgsLayout("DeepepIntranodeCombineArgs", (
    ("x", _T), ("topk_weights", _T), ("bias_0", _T), ("bias_1", _T), ("src_idx", _T), ("rank_prefix_matrix", _T),
    ("channel_prefix_matrix", _T), ("send_head", _T), ("combined_x", _T), ("combined_topk_weights", _T),
    ("config", "config")))
_DISPATCH_ARGS = _DISPATCH.struct
_COMBINE_ARGS = _COMBINE.struct
# The handle's 4 descriptors (rank_prefix_matrix .. send_head) and the combine's 2 outputs: their
# descriptors are copied from the library's description once its recipe pointed them.
_DESC_BYTES = struct.calcsize("@" + TENSOR_FIELDS)
_HANDLE_AT = _DISPATCH.offset("rank_prefix_matrix")
_COMBINED_AT = _COMBINE.offset("combined_x")
_memmove = ctypes.memmove
_ABSENT = (0,) * TENSOR_WORDS


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
        self._combine_args = ctypes.create_string_buffer(_COMBINE_ARGS.size)
        self._dispatch_args_addr = ctypes.addressof(self._dispatch_args)
        self._combine_args_addr = ctypes.addressof(self._combine_args)
        # What the library says each op's caller allocates (deepep_intranode_*_outputs). The
        # receive outputs' descriptors, re-pointed per call, are the DeepepIntranodeDispatchOutputs
        # the dispatch takes (same field order).
        self._handle_plans, self._recv_plans, self._combine_plans = OutputPlans(), OutputPlans(), OutputPlans()
        self._num_recv = ctypes.c_int()
        self._num_recv_addr = ctypes.addressof(self._num_recv)
        self._per_expert = (ctypes.c_int * MAX_LOCAL_EXPERTS)()
        self._per_expert_addr = ctypes.addressof(self._per_expert)

    def _check_device(self, name, t):
        if t.get_device() != self._device_id:
            raise RuntimeError(
                f"deepep-nccl: {name} must be a CUDA tensor on the buffer's device cuda:{self._device_id}, "
                f"got one on {t.device}"
            )

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
                self._normal_fast, "dispatch", config, order, handle, x, x_scales, topk_idx, topk_weights, num_tokens_per_rank,
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
            if allocate_on_comm_stream:
                self._op_allocated(compute, allocate_on_comm_stream)
        (recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, per_expert_list, rank_prefix, channel_prefix,
         recv_channel_prefix, recv_src_idx, send_head) = result
        event = None
        if async_ or order:  # else nothing is left to do (skips building the tensors' tuple)
            # recv_channel_prefix's storage is the handle's one int32 allocation (send_head's too).
            event = self._op_end(comm, compute, async_, allocate_on_comm_stream, (
                x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                recv_channel_prefix, rank_prefix, channel_prefix, recv_x, recv_x_scales, recv_topk_idx,
                recv_topk_weights, recv_src_idx), order)
        return (recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, per_expert_list, rank_prefix,
                channel_prefix, recv_channel_prefix, recv_src_idx, send_head, event)

    def _dispatch_ctypes(
        self, handle, x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
        num_tokens_per_expert, cached_num_recv_tokens, cached_rank_prefix_matrix, cached_channel_prefix_matrix,
        expert_alignment, num_worst_tokens, config,
    ):
        """The dispatch through ctypes: the compiled path's result (the outputs as the library
        describes them)."""
        self._check_device("x", x)
        cached = cached_rank_prefix_matrix is not None
        if cached:
            # The receive query takes it as an int32 (ctypes would truncate a larger one).
            int_arg("cached_num_recv_tokens", cached_num_recv_tokens)
            if cached_channel_prefix_matrix is None:
                raise RuntimeError("deepep-nccl: a cached dispatch needs cached_channel_prefix_matrix too")
            self._check_device("cached_rank_prefix_matrix", cached_rank_prefix_matrix)
        device = self._device
        args, args_addr, stream = self._dispatch_args, self._dispatch_args_addr, self._comm_stream_ptr
        config_fields = _config_fields(config)
        # The inputs first (with a cached dispatch's handle matrices): the handle's geometry is
        # read from x, the config and the mode.
        try:
            _DISPATCH_ARGS.pack_into(
                args, 0,
                *_desc("x", x), *_desc("x_scales", x_scales), *_desc("topk_idx", topk_idx),
                *_desc("topk_weights", topk_weights),
                *_desc("num_tokens_per_rank", None if cached else num_tokens_per_rank),
                *_desc("is_token_in_rank", is_token_in_rank),
                *_desc("num_tokens_per_expert", None if cached else num_tokens_per_expert),
                *_desc("rank_prefix_matrix", cached_rank_prefix_matrix if cached else None),
                *_desc("channel_prefix_matrix", cached_channel_prefix_matrix if cached else None),
                *(_ABSENT * 2), *config_fields, int(cached), expert_alignment, num_worst_tokens, 0,
            )
        except struct.error:  # an int32 field out of range: name it
            check_int32_fields(expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens)
            raise
        shape = x.shape
        key = (shape[0] if shape else 0, config_fields[0], cached)
        plans = self._handle_plans
        entry = plans.get(key)
        if entry is None:
            entry = plans.add(key, lib.deepep_intranode_dispatch_handle_outputs, handle, args_addr)
        allocate, addresses = entry
        rank_prefix, channel_prefix, recv_channel_prefix, send_head = allocate(device)
        # The handle's described (so allocated) outputs' descriptors into the args: all 4, or the
        # last 2 when the cached matrices, packed above, are the first 2.
        if cached:
            rank_prefix, channel_prefix = cached_rank_prefix_matrix, cached_channel_prefix_matrix
            _memmove(args_addr + _HANDLE_AT + 2 * _DESC_BYTES, addresses[2], 2 * _DESC_BYTES)
        else:
            _memmove(args_addr + _HANDLE_AT, addresses[0], 4 * _DESC_BYTES)
        # Without a host wait (cached, num_worst_tokens) N is known now: one fused call below.
        unwaited = cached or num_worst_tokens > 0
        if unwaited:
            counted, per_expert_list = -1, []
        else:
            status = lib.deepep_intranode_dispatch_prepare(
                handle, args_addr, self._num_recv_addr, self._per_expert_addr, MAX_LOCAL_EXPERTS, stream)
            if status:
                raise_status(status)
            counted = self._num_recv.value  # the count prepare waited for
            per_expert_list = (self._per_expert[: num_tokens_per_expert.shape[0] // self._num_ranks]
                               if counted >= 0 else [])

        # Everything the receive query reads: the row count and the received rows' layout.
        num_recv = cached_num_recv_tokens if cached else counted
        key = (num_recv, cached, num_worst_tokens, x.dtype, shape[1:],
               None if x_scales is None else (x_scales.dtype, x_scales.shape[1:]),
               None if topk_idx is None else (topk_idx.dtype, topk_idx.shape[1:]),
               None if topk_weights is None else (topk_weights.dtype, topk_weights.shape[1:]))
        plans = self._recv_plans
        entry = plans.get(key)
        if entry is None:
            entry = plans.add(key, lib.deepep_intranode_dispatch_outputs, handle, args_addr, num_recv)
        allocate, addresses = entry
        recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, recv_src_idx = allocate(device)
        # The receive outputs' descriptors, pointed by allocate, are the DeepepIntranodeDispatchOutputs.
        dispatch = lib.deepep_intranode_dispatch_fused if unwaited else lib.deepep_intranode_dispatch
        status = dispatch(handle, args_addr, addresses[0], stream)
        if status:
            raise_status(status)
        return (recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, per_expert_list, rank_prefix,
                channel_prefix, recv_channel_prefix, recv_src_idx, send_head)

    @without_torch_function
    def intranode_combine(
        self, x, topk_weights, bias_0, bias_1, src_idx, rank_prefix_matrix, channel_prefix_matrix, send_head,
        config, previous_event, async_, allocate_on_comm_stream,
    ):
        """DeepEP's (combined_x, combined_topk_weights, event)."""
        handle = self._live_handle()
        comm, compute, order = self._op_begin(previous_event, async_, allocate_on_comm_stream)
        try:
            result = self._fast_with_config(self._normal_fast, "combine", config, order, handle, x, topk_weights,
                                            bias_0, bias_1, src_idx, rank_prefix_matrix, channel_prefix_matrix,
                                            send_head)
            if result is not None:
                order = 0  # the compiled path did the waits
            else:
                self._order_before(order, comm, compute)
                result = self._combine_ctypes(handle, x, topk_weights, bias_0, bias_1, src_idx, rank_prefix_matrix,
                                              channel_prefix_matrix, send_head, config)
        finally:
            if allocate_on_comm_stream:
                self._op_allocated(compute, allocate_on_comm_stream)
        combined_x, combined_topk_weights = result
        event = None
        if async_ or order:  # else nothing is left to do
            event = self._op_end(comm, compute, async_, allocate_on_comm_stream, (
                x, topk_weights, bias_0, bias_1, src_idx, rank_prefix_matrix, channel_prefix_matrix, send_head,
                combined_x, combined_topk_weights), order)
        return combined_x, combined_topk_weights, event

    def _combine_ctypes(self, handle, x, topk_weights, bias_0, bias_1, src_idx, rank_prefix_matrix,
                        channel_prefix_matrix, send_head, config):
        """The combine through ctypes: (combined_x, combined_topk_weights or None)."""
        self._check_device("x", x)
        self._check_device("send_head", send_head)
        args, args_addr = self._combine_args, self._combine_args_addr
        _COMBINE_ARGS.pack_into(
            args, 0,
            *_desc("x", x), *_desc("topk_weights", topk_weights), *_desc("bias_0", bias_0), *_desc("bias_1", bias_1),
            *_desc("src_idx", src_idx), *_desc("rank_prefix_matrix", rank_prefix_matrix),
            *_desc("channel_prefix_matrix", channel_prefix_matrix), *_desc("send_head", send_head),
            *(_ABSENT * 2), *_config_fields(config),
        )
        key = (send_head.shape, x.dtype, x.shape[1:],
               None if topk_weights is None else (topk_weights.dtype, topk_weights.shape[1:]))
        plans = self._combine_plans
        entry = plans.get(key)
        if entry is None:
            entry = plans.add(key, lib.deepep_intranode_combine_outputs, handle, args_addr)
        allocate, addresses = entry
        combined_x, combined_topk_weights = allocate(self._device)
        _memmove(args_addr + _COMBINED_AT, addresses[0], 2 * _DESC_BYTES)
        status = lib.deepep_intranode_combine(handle, args_addr, self._comm_stream_ptr)
        if status:
            raise_status(status)
        return combined_x, combined_topk_weights

    @without_torch_function
    def normal_query_dropped_buffer(self, dropped):
        desc = ctypes.create_string_buffer(_DESC_BYTES)
        struct.pack_into("@" + TENSOR_FIELDS, desc, 0, *_desc("dropped", dropped))
        status = lib.deepep_normal_query_dropped(self._live_handle(), ctypes.addressof(desc),
                                                 stream_handle(self._current_stream()))
        if status:
            raise_status(status)
