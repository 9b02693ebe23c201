"""deep_ep_cpp.Buffer's internode normal-mode ops (a buffer across nodes): internode_dispatch /
internode_combine with DeepEP's positional signatures and tuples, through the compiled host path
(_fast.py, _fast_internode.h) when it loaded, else through ctypes (also for input the compiled
path does not take), chosen as the intranode ops choose (StreamProtocol._fast_with_config). As
_normal.py: the library says what to allocate (deepep_internode_*_outputs), torch allocates it."""
import ctypes
import struct

from ._lib import (MAX_LOCAL_EXPERTS, TENSOR_FIELDS, TENSOR_WORDS, ArgsLayout, OutputPlans, check_int32_fields,
                   int_arg, lib, raise_status, tensor_fields)
from ._normal import _config_fields
from ._streams import StreamProtocol, stream_handle, without_torch_function

_T = "tensor"
_DISPATCH = ArgsLayout("DeepepInternodeDispatchArgs", (
    ("x", _T), ("x_scales", _T), ("topk_idx", _T), ("topk_weights", _T), ("num_tokens_per_rank", _T),
    ("num_tokens_per_rdma_rank", _T), ("is_token_in_rank", _T), ("num_tokens_per_expert", _T),
    ("rdma_channel_prefix_matrix", _T), ("gbl_channel_prefix_matrix", _T), ("recv_rdma_channel_prefix_matrix", _T),
    ("recv_rdma_rank_prefix_sum", _T), ("recv_gbl_channel_prefix_matrix", _T), ("recv_gbl_rank_prefix_sum", _T),
    ("send_rdma_head", _T), ("config", "config"), ("cached", "int32"), ("expert_alignment", "int32"),
    ("num_worst_tokens", "int32"), ("reserved", "int32")))
_COMBINE = ArgsLayout("DeepepInternodeCombineArgs", (
    ("x", _T), ("topk_weights", _T), ("bias_0", _T), ("bias_1", _T), ("src_meta", _T),
    ("is_combined_token_in_rank", _T), ("rdma_channel_prefix_matrix", _T), ("rdma_rank_prefix_sum", _T),
    ("gbl_channel_prefix_matrix", _T), ("combined_rdma_head", _T), ("combined_nvl_head", _T), ("combined_x", _T),
    ("combined_topk_weights", _T), ("config", "config")))
_DISPATCH_ARGS = _DISPATCH.struct
_COMBINE_ARGS = _COMBINE.struct
_DESC_BYTES = struct.calcsize("@" + TENSOR_FIELDS)
# The handle's 7 descriptors (rdma_channel_prefix_matrix .. send_rdma_head), contiguous in the args.
_HANDLE_AT = _DISPATCH.offset("rdma_channel_prefix_matrix")
_COMBINED_AT = _COMBINE.offset("combined_x")
_ABSENT = (0,) * TENSOR_WORDS
_memmove = ctypes.memmove
_desc = tensor_fields


class InternodeMode(StreamProtocol):
    """Mixin for deep_ep_cpp.Buffer (needs _handle, _device, _num_ranks and the stream protocol)."""

    _internode_fast = None  # the compiled host path's InternodeOps (after sync), else the ctypes path

    def _internode_init(self):
        self._inter_dispatch_args = ctypes.create_string_buffer(_DISPATCH_ARGS.size)
        self._inter_combine_args = ctypes.create_string_buffer(_COMBINE_ARGS.size)
        self._inter_handle_plans, self._inter_recv_plans = OutputPlans(), OutputPlans()
        self._inter_combine_plans = OutputPlans()
        self._inter_num_recv, self._inter_num_rdma_recv = ctypes.c_int(), ctypes.c_int()
        self._inter_per_expert = (ctypes.c_int * MAX_LOCAL_EXPERTS)()

    @without_torch_function
    def internode_dispatch(
        self, x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
        num_tokens_per_expert, cached_num_recv_tokens, cached_num_rdma_recv_tokens,
        cached_rdma_channel_prefix_matrix, cached_recv_rdma_rank_prefix_sum, cached_gbl_channel_prefix_matrix,
        cached_recv_gbl_rank_prefix_sum, expert_alignment, num_worst_tokens, config, previous_event, async_,
        allocate_on_comm_stream,
    ):
        """DeepEP's 15-tuple: (recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, rdma_channel_prefix_matrix, gbl_channel_prefix_matrix,
        recv_rdma_channel_prefix_matrix, recv_rdma_rank_prefix_sum, recv_gbl_channel_prefix_matrix,
        recv_gbl_rank_prefix_sum, recv_src_meta, send_rdma_head, send_nvl_head, event); the
        optional entries are None in cached mode."""
        handle = self._live_handle()
        comm, compute, order = self._op_begin(previous_event, async_, allocate_on_comm_stream)
        try:
            result = self._fast_with_config(
                self._internode_fast, "dispatch", config, order, handle, x, x_scales, topk_idx, topk_weights,
                num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert,
                cached_num_recv_tokens, cached_num_rdma_recv_tokens, cached_rdma_channel_prefix_matrix,
                cached_recv_rdma_rank_prefix_sum, cached_gbl_channel_prefix_matrix, cached_recv_gbl_rank_prefix_sum,
                expert_alignment, num_worst_tokens)
            if result is not None:
                order = 0  # the compiled path did the waits
            else:
                self._order_before(order, comm, compute)
                result = self._internode_dispatch_ctypes(
                    handle, x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, num_tokens_per_rdma_rank,
                    is_token_in_rank, num_tokens_per_expert, cached_num_recv_tokens, cached_num_rdma_recv_tokens,
                    cached_rdma_channel_prefix_matrix, cached_recv_rdma_rank_prefix_sum,
                    cached_gbl_channel_prefix_matrix, cached_recv_gbl_rank_prefix_sum, expert_alignment,
                    num_worst_tokens, config)
        finally:
            self._op_allocated(compute, allocate_on_comm_stream)
        event = self._op_end(comm, compute, async_, allocate_on_comm_stream, (
            x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
            num_tokens_per_expert, cached_rdma_channel_prefix_matrix, cached_recv_rdma_rank_prefix_sum,
            cached_gbl_channel_prefix_matrix, cached_recv_gbl_rank_prefix_sum,
            *(t for t in result if not isinstance(t, list))), order)
        if cached_rdma_channel_prefix_matrix is not None:  # DeepEP's cached tuple: the handle's, or None
            result = result[:5] + (cached_rdma_channel_prefix_matrix, cached_gbl_channel_prefix_matrix, None,
                                   cached_recv_rdma_rank_prefix_sum, None, cached_recv_gbl_rank_prefix_sum,
                                   None, None, None)
        return (*result, event)

    def _internode_dispatch_ctypes(
        self, handle, x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, num_tokens_per_rdma_rank,
        is_token_in_rank, num_tokens_per_expert, cached_num_recv_tokens, cached_num_rdma_recv_tokens,
        cached_rdma_channel_prefix_matrix, cached_recv_rdma_rank_prefix_sum, cached_gbl_channel_prefix_matrix,
        cached_recv_gbl_rank_prefix_sum, expert_alignment, num_worst_tokens, config,
    ):
        """The dispatch through ctypes: the compiled path's result (InternodeOps.dispatch's, the
        outputs as the library describes them)."""
        self._check_device("x", x)
        cached = cached_rdma_channel_prefix_matrix is not None
        if cached:
            int_arg("cached_num_recv_tokens", cached_num_recv_tokens)
            int_arg("cached_num_rdma_recv_tokens", cached_num_rdma_recv_tokens)
            if (cached_gbl_channel_prefix_matrix is None or cached_recv_rdma_rank_prefix_sum is None
                    or cached_recv_gbl_rank_prefix_sum is None):
                raise RuntimeError("deepep-nccl: a cached dispatch needs the handle's cached_gbl_channel_prefix_matrix, "
                                   "cached_recv_rdma_rank_prefix_sum and cached_recv_gbl_rank_prefix_sum too")
        device = self._device
        args = self._inter_dispatch_args
        args_addr, stream = ctypes.addressof(args), self._comm_stream_ptr
        config_fields = _config_fields(config)
        try:
            _DISPATCH_ARGS.pack_into(
                args, 0,
                *_desc("x", x), *_desc("x_scales", x_scales), *_desc("topk_idx", topk_idx),
                *_desc("topk_weights", topk_weights),
                *_desc("num_tokens_per_rank", None if cached else num_tokens_per_rank),
                *_desc("num_tokens_per_rdma_rank", None if cached else num_tokens_per_rdma_rank),
                *_desc("is_token_in_rank", is_token_in_rank),
                *_desc("num_tokens_per_expert", None if cached else num_tokens_per_expert),
                *_desc("rdma_channel_prefix_matrix", cached_rdma_channel_prefix_matrix if cached else None),
                *_desc("gbl_channel_prefix_matrix", cached_gbl_channel_prefix_matrix if cached else None),
                # Cached: the handle's prefix sums (the kernel checks them); the rest comes from the plan.
                *_ABSENT, *_desc("recv_rdma_rank_prefix_sum", cached_recv_rdma_rank_prefix_sum if cached else None),
                *_ABSENT, *_desc("recv_gbl_rank_prefix_sum", cached_recv_gbl_rank_prefix_sum if cached else None),
                *_ABSENT, *config_fields, int(cached), expert_alignment, num_worst_tokens, 0,
            )
        except struct.error:  # an int32 field out of range: name it
            check_int32_fields(expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens)
            raise
        key = (x.shape[0] if x.dim() else 0, config_fields[0], cached)
        entry = self._inter_handle_plans.get(key)
        if entry is None:
            entry = self._inter_handle_plans.add(key, lib.deepep_internode_dispatch_handle_outputs, handle, args_addr)
        allocate, addresses = entry
        handle_tensors = list(allocate(device))
        if cached:
            handle_tensors[0], handle_tensors[1] = cached_rdma_channel_prefix_matrix, cached_gbl_channel_prefix_matrix
            handle_tensors[3], handle_tensors[5] = cached_recv_rdma_rank_prefix_sum, cached_recv_gbl_rank_prefix_sum
            for i in (2, 4):  # the receive matrices, recomputed
                _memmove(args_addr + _HANDLE_AT + i * _DESC_BYTES, addresses[i], _DESC_BYTES)
        else:
            _memmove(args_addr + _HANDLE_AT, addresses[0], 7 * _DESC_BYTES)
        status = lib.deepep_internode_dispatch_prepare(
            handle, args_addr, ctypes.addressof(self._inter_num_recv), ctypes.addressof(self._inter_num_rdma_recv),
            ctypes.addressof(self._inter_per_expert), MAX_LOCAL_EXPERTS, stream)
        if status:
            raise_status(status)
        counted, counted_rdma = self._inter_num_recv.value, self._inter_num_rdma_recv.value
        per_expert_list = (self._inter_per_expert[: num_tokens_per_expert.shape[0] // self._num_ranks]
                           if counted >= 0 else [])
        num_recv, num_rdma = (cached_num_recv_tokens, cached_num_rdma_recv_tokens) if cached else (counted, counted_rdma)
        key = (num_recv, num_rdma, cached, num_worst_tokens, x.dtype, x.shape[1:],
               None if x_scales is None else (x_scales.dtype, x_scales.shape[1:]),
               None if topk_idx is None else (topk_idx.dtype, topk_idx.shape[1:]),
               None if topk_weights is None else (topk_weights.dtype, topk_weights.shape[1:]))
        entry = self._inter_recv_plans.get(key)
        if entry is None:
            entry = self._inter_recv_plans.add(key, lib.deepep_internode_dispatch_outputs, handle, args_addr, num_recv,
                                               num_rdma)
        allocate, addresses = entry
        recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, recv_src_meta, send_nvl_head = allocate(device)
        status = lib.deepep_internode_dispatch(handle, args_addr, addresses[0], stream)
        if status:
            raise_status(status)
        (rdma_cpm, gbl_cpm, recv_rdma_cpm, recv_rdma_prefix, recv_gbl_cpm, recv_gbl_prefix,
         send_rdma_head) = handle_tensors
        return (recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, per_expert_list, rdma_cpm, gbl_cpm,
                recv_rdma_cpm, recv_rdma_prefix, recv_gbl_cpm, recv_gbl_prefix, recv_src_meta, send_rdma_head,
                send_nvl_head)

    @without_torch_function
    def internode_combine(
        self, x, topk_weights, bias_0, bias_1, src_meta, is_combined_token_in_rank, rdma_channel_prefix_matrix,
        rdma_rank_prefix_sum, gbl_channel_prefix_matrix, combined_rdma_head, combined_nvl_head, config,
        previous_event, async_, allocate_on_comm_stream,
    ):
        """DeepEP's (combined_x, combined_topk_weights, event); rewrites the two heads in place."""
        handle = self._live_handle()
        comm, compute, order = self._op_begin(previous_event, async_, allocate_on_comm_stream)
        try:
            result = self._fast_with_config(
                self._internode_fast, "combine", config, order, handle, x, topk_weights, bias_0, bias_1, src_meta,
                is_combined_token_in_rank, rdma_channel_prefix_matrix, rdma_rank_prefix_sum,
                gbl_channel_prefix_matrix, combined_rdma_head, combined_nvl_head)
            if result is not None:
                order = 0  # the compiled path did the waits
            else:
                self._order_before(order, comm, compute)
                result = self._internode_combine_ctypes(
                    handle, x, topk_weights, bias_0, bias_1, src_meta, is_combined_token_in_rank,
                    rdma_channel_prefix_matrix, rdma_rank_prefix_sum, gbl_channel_prefix_matrix, combined_rdma_head,
                    combined_nvl_head, config)
        finally:
            self._op_allocated(compute, allocate_on_comm_stream)
        combined_x, combined_topk_weights = result
        event = self._op_end(comm, compute, async_, allocate_on_comm_stream, (
            x, topk_weights, bias_0, bias_1, src_meta, is_combined_token_in_rank, rdma_channel_prefix_matrix,
            rdma_rank_prefix_sum, gbl_channel_prefix_matrix, combined_rdma_head, combined_nvl_head, combined_x,
            combined_topk_weights), order)
        return combined_x, combined_topk_weights, event

    def _internode_combine_ctypes(self, handle, x, topk_weights, bias_0, bias_1, src_meta, is_combined_token_in_rank,
                                  rdma_channel_prefix_matrix, rdma_rank_prefix_sum, gbl_channel_prefix_matrix,
                                  combined_rdma_head, combined_nvl_head, config):
        """The combine through ctypes: (combined_x, combined_topk_weights or None)."""
        self._check_device("x", x)
        args = self._inter_combine_args
        args_addr = ctypes.addressof(args)
        _COMBINE_ARGS.pack_into(
            args, 0,
            *_desc("x", x), *_desc("topk_weights", topk_weights), *_desc("bias_0", bias_0),
            *_desc("bias_1", bias_1), *_desc("src_meta", src_meta),
            *_desc("is_combined_token_in_rank", is_combined_token_in_rank),
            *_desc("rdma_channel_prefix_matrix", rdma_channel_prefix_matrix),
            *_desc("rdma_rank_prefix_sum", rdma_rank_prefix_sum),
            *_desc("gbl_channel_prefix_matrix", gbl_channel_prefix_matrix),
            *_desc("combined_rdma_head", combined_rdma_head), *_desc("combined_nvl_head", combined_nvl_head),
            *(_ABSENT * 2), *_config_fields(config),
        )
        key = (is_combined_token_in_rank.shape, x.dtype, x.shape[1:],
               None if topk_weights is None else (topk_weights.dtype, topk_weights.shape[1:]))
        entry = self._inter_combine_plans.get(key)
        if entry is None:
            entry = self._inter_combine_plans.add(key, lib.deepep_internode_combine_outputs, handle, args_addr)
        allocate, addresses = entry
        combined_x, combined_topk_weights = allocate(self._device)
        _memmove(args_addr + _COMBINED_AT, addresses[0], 2 * _DESC_BYTES)
        status = lib.deepep_internode_combine(handle, args_addr, self._comm_stream_ptr)
        if status:
            raise_status(status)
        return combined_x, combined_topk_weights

    @without_torch_function
    def internode_query_traffic_buffer(self, traffic):
        desc = ctypes.create_string_buffer(_DESC_BYTES)
        struct.pack_into("@" + TENSOR_FIELDS, desc, 0, *_desc("traffic", traffic))
        status = lib.deepep_internode_query_traffic(self._live_handle(), ctypes.addressof(desc),
                                                    stream_handle(self._current_stream()))
        if status:
            raise_status(status)
