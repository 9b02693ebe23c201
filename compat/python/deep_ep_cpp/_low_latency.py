"""deep_ep_cpp.Buffer's low-latency ops with DeepEP's positional signatures and tuples, each a
short translation to the C ABI (deepep_low_latency_*): through the compiled host path (_fast.py)
when it loaded, else through ctypes (also for input the compiled path does not take).

Streams as DeepEP: without a hook the kernel runs on the comm stream after the compute stream
(async: an EventHandle, else the compute stream waits); with return_recv_hook the send phase
runs on the compute stream and hook() launches the receive phase on that same stream."""
import ctypes
import struct

from ._event import EventHandle
from ._fast import LL_OPS_ENTRIES, entry_addresses
from ._lib import (DTYPES_BY_CODE, DeepepOutputs, DeepepTensor, OutputPlans, allocation_recipe, check, lib,
                   output_plan)
from ._lib import (LL_PHASE_BOTH, LL_PHASE_RECV, LL_PHASE_SEND, TENSOR_FIELDS, TENSOR_WORDS, ArgsLayout, int_arg,
                   check_int32_fields, raise_status, tensor_fields)
from ._lib import torch as _torch
from ._streams import (ORDER_AFTER, ORDER_BEFORE, StreamProtocol, stream_handle, stream_wait_stream,
                       without_torch_function)

_T, _I = "tensor", "int32"
_DISPATCH = ArgsLayout("DeepepLowLatencyDispatchArgs", (
    ("x", _T), ("topk_idx", _T), ("cumulative_local_expert_recv_stats", _T), ("dispatch_wait_recv_cost_stats", _T),
    ("packed_recv_x", _T), ("packed_recv_x_scales", _T), ("packed_recv_count", _T), ("packed_recv_src_info", _T),
    ("packed_recv_layout_range", _T), ("num_max_dispatch_tokens_per_rank", _I), ("num_experts", _I),
    ("use_fp8", _I), ("round_scale", _I), ("use_ue8m0", _I), ("phases", _I)))
_COMBINE = ArgsLayout("DeepepLowLatencyCombineArgs", (
    ("x", _T), ("topk_idx", _T), ("topk_weights", _T), ("src_info", _T), ("layout_range", _T),
    ("combine_wait_recv_cost_stats", _T), ("out", _T), ("num_max_dispatch_tokens_per_rank", _I),
    ("num_experts", _I), ("use_logfmt", _I), ("zero_copy", _I), ("phases", _I), ("reserved", _I)))
_DISPATCH_ARGS = _DISPATCH.struct
_COMBINE_ARGS = _COMBINE.struct
_SEND, _RECV, _BOTH = LL_PHASE_SEND, LL_PHASE_RECV, LL_PHASE_BOTH
_DISPATCH_PHASES_AT = _DISPATCH.offset("phases")
_COMBINE_PHASES_AT = _COMBINE.offset("phases")

_desc = tensor_fields

# A dispatch's args start with its 4 input descriptors (x, topk_idx, the two stats tensors); its 5
# output descriptors follow, in the order deepep_low_latency_dispatch_outputs describes them, and
# only their data pointers change between calls of one shape.
_DESC_BYTES = struct.calcsize("@" + TENSOR_FIELDS)
_DISPATCH_INPUTS = struct.Struct("@" + TENSOR_FIELDS * 4)
_DISPATCH_OUTPUTS_AT = _DISPATCH.offset("packed_recv_x")
_DISPATCH_OUTPUTS = 5
_MAX_DISPATCH_SHAPES = 64  # the compiled module's MAX_DISPATCH_SHAPES (asserted in _ll_init)
# LlOps.dispatch's status for a shape it has no copy of yet (the compiled module's NEW_SHAPE).
_NEW_SHAPE = -4


class _DispatchShape:
    """One dispatch shape (M, H, E, flags): the library's description of its outputs (`outputs`,
    from deepep_low_latency_dispatch_outputs), read once for allocating them (`allocation`), and
    an args buffer with their descriptors and the int fields already packed, and `allocate`
    (allocation_recipe's) allocating them and pointing those descriptors at them. The compiled
    path's LlOps keeps a copy of `args` and `outputs` (add_dispatch_shape)."""

    __slots__ = ("args", "outputs", "allocation", "allocate")

    def __init__(self, outputs, m, num_experts, use_fp8, round_scale, use_ue8m0):
        if outputs.count != _DISPATCH_OUTPUTS:
            raise RuntimeError(f"deepep-nccl: the library describes {outputs.count} dispatch outputs, expected "
                               f"{_DISPATCH_OUTPUTS}: a libdeepep_nccl.so of another version?")
        self.outputs = outputs
        self.allocation = output_plan(outputs)
        self.args = ctypes.create_string_buffer(_DISPATCH_ARGS.size)
        _DISPATCH_ARGS.pack_into(self.args, 0, *(0,) * (9 * TENSOR_WORDS), m, num_experts, int(use_fp8), int(round_scale),
                                 int(use_ue8m0), 0)
        # The output descriptors as the library wrote them (data NULL until a call allocates).
        ctypes.memmove(ctypes.addressof(self.args) + _DISPATCH_OUTPUTS_AT, ctypes.addressof(outputs.tensors),
                       _DISPATCH_OUTPUTS * _DESC_BYTES)
        self.allocate = None  # compiled on the ctypes path's first call (it needs torch)


def _recv_hook(fn, live_handle, args_buffer, phases_at, stream_ptr, buffer_idx, tensors):
    """DeepEP's hook of a send-only LL call of `fn` (deepep_low_latency_dispatch or _combine): a
    copy of its args with phases = receive, launched on the send's stream into the buffer half the
    send used (`buffer_idx`). It keeps `tensors` (the op's) alive until it is dropped, as DeepEP's
    does. The compiled path (_fast_hook.h) and deepep_nccl.hpp have their own copy of this protocol:
    this one must work without the compiled module, which is optional; test_ll_abi_cpu.py holds the
    three equal."""
    # The hook owns a copy of the arguments (the shared struct is reused by the next call).
    raw = args_buffer.raw
    saved = ctypes.create_string_buffer(raw, len(raw))
    struct.pack_into("@i", saved, phases_at, _RECV)
    idx = ctypes.c_int(buffer_idx)

    def hook():
        status = fn(live_handle(), ctypes.addressof(saved), stream_ptr, ctypes.addressof(idx))
        if status:
            raise_status(status)

    hook.tensors = tensors
    return hook


def _device_tensor(desc, owner, device):
    """A tensor over the device memory a DeepepTensor describes (its dtype, shape and strides);
    its storage keeps `owner` (whose memory it is) alive."""
    torch = _torch
    dtype = DTYPES_BY_CODE[desc.dtype]
    n = desc.ndim
    shape, strides = tuple(desc.shape[:n]), tuple(desc.strides[:n])
    elems = 0 if 0 in shape else 1 + sum((d - 1) * s for d, s in zip(shape, strides))
    num_bytes = elems * torch.empty(0, dtype=dtype).element_size()
    raw = torch.as_tensor(_DeviceView(desc.data, num_bytes, owner), device=device)
    return raw.view(dtype).as_strided(shape, strides)


class _DeviceView:
    """__cuda_array_interface__ over the window (the zero-copy combine view); keeps the Buffer alive."""

    def __init__(self, ptr, num_bytes, owner):
        self.__cuda_array_interface__ = {
            "shape": (num_bytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None,
        }
        self.owner = owner


class LowLatencyMode(StreamProtocol):
    """Mixin for deep_ep_cpp.Buffer (needs _handle, _device_id, _num_ranks, _low_latency_mode and the
    stream protocol).

    The compiled path (LlOps, made by sync()) makes no torch call from Python between the op's
    entry and its return: under a TorchFunctionMode (torch.set_default_device's, in DeepEP's
    tests) each one costs about 1 us. Only the ctypes path (and a new dispatch shape) runs with
    torch functions disabled, which costs a little itself."""

    _ll_ops = None  # the compiled path's LlOps (after sync), else the ctypes path

    def _ll_init(self):
        fast = self._fast  # loaded by the constructor; None: the ctypes path
        if fast is not None:
            assert fast.DISPATCH_ARGS_BYTES == _DISPATCH_ARGS.size
            assert fast.COMBINE_ARGS_BYTES == _COMBINE_ARGS.size
            assert (fast.ORDER_BEFORE, fast.ORDER_AFTER, fast.NEW_SHAPE, fast.MAX_DISPATCH_SHAPES) == (
                ORDER_BEFORE, ORDER_AFTER, _NEW_SHAPE, _MAX_DISPATCH_SHAPES)
        self._ll_dispatch_shapes = {}
        self._ll_combine_args = ctypes.create_string_buffer(_COMBINE_ARGS.size)
        # combined_x's description per (T, H) on the ctypes path; LlOps keeps its own.
        self._ll_combine_plans = OutputPlans()
        self._ll_idx = ctypes.c_int()
        self._ll_idx_addr = ctypes.addressof(self._ll_idx)

    def _ll_sync(self):
        """Called by sync() once the buffer exists: the compiled path's LlOps on its handle."""
        if self._fast is not None:
            self._ll_ops = self._fast.LlOps(*entry_addresses(lib, LL_OPS_ENTRIES),
                                            self._handle, self._device_id, self._stream_order)

    def _ll_streams(self, async_, return_recv_hook):
        """(compute stream, launch stream, its C ABI handle, phases, order) of an LL call: a hook's
        send runs on the compute stream, otherwise the comm stream waits for the compute stream
        (ORDER_BEFORE) and, without async, the compute stream for the launch (ORDER_AFTER); the
        compiled path does these waits around its launch, the ctypes path here."""
        if async_ and return_recv_hook:
            raise RuntimeError("deepep-nccl: async_finish and return_recv_hook cannot both be set (as in DeepEP)")
        compute = self._current_stream()
        if return_recv_hook:
            return compute, compute, self._compute_handle, _SEND, 0
        stream = self._comm_stream if self._comm_stream is not None else self.get_comm_stream()
        return compute, stream, self._comm_stream_ptr, _BOTH, ORDER_BEFORE if async_ else ORDER_BEFORE | ORDER_AFTER

    def _ll_launch(self, handle, fn, args_buffer, phases_at, async_, return_recv_hook, tensors):
        """The ctypes path: runs fn's send (hook) or both phases; returns (event, hook). The hook
        keeps `tensors` (the op's) alive until it is dropped, as DeepEP's does."""
        compute, stream, stream_ptr, phases, order = self._ll_streams(async_, return_recv_hook)
        struct.pack_into("@i", args_buffer, phases_at, phases)
        self._order_before(order, stream, compute)
        status = fn(handle, ctypes.addressof(args_buffer), stream_ptr, self._ll_idx_addr)
        if status:
            raise_status(status)
        event = hook = None
        if async_:
            event = EventHandle(stream)
        elif order & ORDER_AFTER:
            stream_wait_stream(self._sync_event, compute, stream)
        if return_recv_hook:
            hook = _recv_hook(fn, self._live_handle, args_buffer, phases_at, stream_ptr, self._ll_idx.value, tensors)
        return event, hook

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        # DeepEP's: one kernel on the current stream (barrier, zero, barrier); the host does not wait.
        ops = self._ll_ops
        if ops is not None:
            self._current_stream()  # sets _compute_handle
            try:
                result = ops.clean(num_max_dispatch_tokens_per_rank, hidden, num_experts, self._compute_handle)
            except TypeError:  # an argument pybind cannot convert: the ctypes path names it
                result = None
            if result is not None and (not result[0] or self._fast_result(result) is not None):
                return  # launched (a failed launch raised in _fast_result)
            # A value the C ABI's int does not hold: the ctypes path names it.
        check(lib.deepep_clean_low_latency_buffer(
            self._live_handle(), int_arg("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
            int_arg("hidden", hidden), int_arg("num_experts", num_experts), stream_handle(self._current_stream())))

    def low_latency_dispatch(self, x, topk_idx, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
                             num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0, async_,
                             return_recv_hook):
        """DeepEP's 7-tuple: (packed_recv_x, packed_recv_x_scales, packed_recv_count, packed_recv_src_info,
        packed_recv_layout_range, event, hook)."""
        return self._ll_dispatch(x, topk_idx, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
                                 num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0,
                                 async_, return_recv_hook)[:7]

    def _ll_dispatch(self, x, topk_idx, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
                     num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0, async_,
                     return_recv_hook):
        """low_latency_dispatch's 7-tuple and x's hidden size (deep_ep's handle holds it)."""
        ops = self._ll_ops
        if ops is not None:
            compute, stream, stream_ptr, phases, order = self._ll_streams(async_, return_recv_hook)
            try:
                for described in (False, True):  # a new shape is described once, then the call is made again
                    result = ops.dispatch(x, topk_idx, cumulative_local_expert_recv_stats,
                                          dispatch_wait_recv_cost_stats, num_max_dispatch_tokens_per_rank,
                                          num_experts, use_fp8, round_scale, use_ue8m0, phases, stream_ptr,
                                          self._compute_handle, order, self)
                    if result[0] != _NEW_SHAPE or described:  # NEW_SHAPE twice: _fast_result raises it
                        break
                    key, shape = self._ll_dispatch_shape(x, num_max_dispatch_tokens_per_rank, num_experts, use_fp8,
                                                         round_scale, use_ue8m0)  # through the ctypes path's query
                    ops.add_dispatch_shape(*key, ctypes.addressof(shape.args), ctypes.addressof(shape.outputs))
            except TypeError:  # an argument pybind cannot convert: the ctypes path names it
                result = None
            if result is not None and (not result[0] or self._fast_result(result) is not None):
                # The compiled path did the waits and made the hook; a failed call raised above.
                return result[1:6] + (EventHandle(stream) if async_ else None,) + result[6:]
            # Input the compiled path does not take: the ctypes path below names the argument.
        return self._ll_dispatch_ctypes(x, topk_idx, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
                                        num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0,
                                        async_, return_recv_hook)

    @without_torch_function
    def _ll_dispatch_shape(self, x, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0):
        """(key, _DispatchShape) of a dispatch: key = (M, H, E, use_fp8, round_scale, use_ue8m0), H
        x's. A new shape is described by the library, which checks the limits first (an
        out-of-range M fails here, before anything is allocated)."""
        shapes = self._ll_dispatch_shapes
        hidden = x.shape[1] if x.dim() == 2 else -1  # -1: a new key, where x is checked
        key = (num_max_dispatch_tokens_per_rank, hidden, num_experts, bool(use_fp8), bool(round_scale),
               bool(use_ue8m0))
        shape = shapes.get(key)
        if shape is None:
            # M and E are int32 fields of the args (ctypes would pass E truncated to the query):
            # checked once per shape.
            check_int32_fields(num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
                               num_experts=num_experts)
            self._check_ll_x(x)
            outputs = DeepepOutputs()
            check(lib.deepep_low_latency_dispatch_outputs(self._live_handle(), num_max_dispatch_tokens_per_rank,
                                                          hidden, num_experts, key[3], key[5], ctypes.byref(outputs)))
            if len(shapes) >= _MAX_DISPATCH_SHAPES:
                shapes.clear()
            shape = _DispatchShape(outputs, num_max_dispatch_tokens_per_rank, num_experts, *key[3:])
            shapes[key] = shape
        return key, shape

    @without_torch_function
    def _ll_dispatch_ctypes(self, x, topk_idx, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
                            num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0, async_,
                            return_recv_hook):
        handle = self._live_handle()
        key, shape = self._ll_dispatch_shape(x, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale,
                                             use_ue8m0)
        self._check_ll_x(x)
        allocate = shape.allocate
        if allocate is None:
            allocate = shape.allocate = allocation_recipe(shape.allocation, shape.args, _DISPATCH_OUTPUTS_AT)
        outputs = allocate(self._device)  # also points the args' output descriptors at them
        args = shape.args
        _DISPATCH_INPUTS.pack_into(
            args, 0,
            *_desc("x", x), *_desc("topk_idx", topk_idx),
            *_desc("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats),
            *_desc("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats),
        )
        event, hook = self._ll_launch(handle, lib.deepep_low_latency_dispatch, args, _DISPATCH_PHASES_AT, async_,
                                      return_recv_hook, (x, topk_idx, cumulative_local_expert_recv_stats,
                                                         dispatch_wait_recv_cost_stats, *outputs))
        return (*outputs, event, hook, key[1])

    def _check_ll_x(self, x):
        if x.dim() != 2 or x.dtype != _torch.bfloat16:
            raise RuntimeError(f"deepep-nccl: x must be a 2-D bfloat16 tensor [T, H], got {x.dtype} of shape "
                               f"{tuple(x.shape)}")
        if x.get_device() != self._device_id:
            raise RuntimeError(f"deepep-nccl: x must be on the buffer's device cuda:{self._device_id}, got {x.device}")

    def low_latency_combine(self, x, topk_idx, topk_weights, src_info, layout_range, combine_wait_recv_cost_stats,
                            num_max_dispatch_tokens_per_rank, num_experts, use_logfmt, zero_copy, async_,
                            return_recv_hook, out=None):
        """DeepEP's (combined_x, event, hook)."""
        return self._ll_combine(x, topk_idx, topk_weights, src_info, layout_range, combine_wait_recv_cost_stats,
                                num_max_dispatch_tokens_per_rank, num_experts, use_logfmt, zero_copy, async_,
                                return_recv_hook, out, -1)

    def _ll_combine(self, x, topk_idx, topk_weights, src_info, layout_range, combine_wait_recv_cost_stats,
                    num_max_dispatch_tokens_per_rank, num_experts, use_logfmt, zero_copy, async_, return_recv_hook, out,
                    hidden):
        """low_latency_combine, where x's last dimension must be `hidden` (the dispatch's, which
        deep_ep's handle holds; -1: not checked)."""
        ops = self._ll_ops
        if ops is not None:
            compute, stream, stream_ptr, phases, order = self._ll_streams(async_, return_recv_hook)
            try:
                result = ops.combine(x, topk_idx, topk_weights, src_info, layout_range, combine_wait_recv_cost_stats,
                                     out, num_max_dispatch_tokens_per_rank, num_experts, use_logfmt, zero_copy, hidden,
                                     phases, stream_ptr, self._compute_handle, order, self)
            except TypeError:  # an argument pybind cannot convert: the ctypes path names it
                result = None
            if result is not None and (not result[0] or self._fast_result(result) is not None):
                # The compiled path did the waits and made the hook; a failed call raised above.
                return result[1], EventHandle(stream) if async_ else None, result[2]
            # Input the compiled path does not take: the ctypes path below names the argument.
        return self._ll_combine_ctypes(x, topk_idx, topk_weights, src_info, layout_range, combine_wait_recv_cost_stats,
                                       num_max_dispatch_tokens_per_rank, num_experts, use_logfmt, zero_copy, async_,
                                       return_recv_hook, out, hidden)

    @without_torch_function
    def _ll_combine_ctypes(self, x, topk_idx, topk_weights, src_info, layout_range, combine_wait_recv_cost_stats,
                           num_max_dispatch_tokens_per_rank, num_experts, use_logfmt, zero_copy, async_,
                           return_recv_hook, out, hidden):
        handle = self._live_handle()
        args = self._ll_combine_args
        if x.dim() != 3:
            raise RuntimeError(f"deepep-nccl: x must be [E_l, R*M, H], got shape {tuple(x.shape)}")
        if hidden != -1 and x.shape[2] != hidden:
            raise RuntimeError(f"deepep-nccl: x has hidden size {x.shape[2]}, the dispatch (handle) had {hidden}")
        if out is None:
            num_tokens, hidden = topk_idx.shape[0], x.shape[2]
            key = (num_tokens, hidden)
            plans = self._ll_combine_plans
            entry = plans.get(key)
            if entry is None:
                entry = plans.add(key, lib.deepep_low_latency_combine_outputs, handle, num_tokens, hidden)
            combined_x = entry[0](self._device)[0]
        else:
            combined_x = out
        try:
            _COMBINE_ARGS.pack_into(
                args, 0,
                *_desc("x", x), *_desc("topk_idx", topk_idx), *_desc("topk_weights", topk_weights),
                *_desc("src_info", src_info), *_desc("layout_range", layout_range),
                *_desc("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats), *_desc("out", combined_x),
                num_max_dispatch_tokens_per_rank, num_experts, int(use_logfmt), int(zero_copy), 0, 0,
            )
        except struct.error:  # an int32 field out of range: name it
            check_int32_fields(num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
                               num_experts=num_experts)
            raise
        event, hook = self._ll_launch(handle, lib.deepep_low_latency_combine, args, _COMBINE_PHASES_AT, async_,
                                      return_recv_hook, (x, topk_idx, topk_weights, src_info, layout_range,
                                                         combine_wait_recv_cost_stats, combined_x))
        return combined_x, event, hook

    @without_torch_function
    def get_next_low_latency_combine_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        ops = self._ll_ops
        if ops is not None:
            try:
                result = ops.next_combine_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts, self)
            except TypeError:  # arguments pybind cannot convert: the ctypes path below names them
                result = None
            if result is not None:
                check(result[0])
                return result[1]
        view = DeepepTensor()
        check(lib.deepep_get_next_low_latency_combine_buffer(
            self._live_handle(), int_arg("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
            int_arg("hidden", hidden), int_arg("num_experts", num_experts), ctypes.byref(view)))
        return _device_tensor(view, self, self._device)

    def low_latency_update_mask_buffer(self, rank_to_mask, mask):
        check(lib.deepep_low_latency_update_mask_buffer(self._live_handle(), int_arg("rank_to_mask", rank_to_mask),
                                                        bool(mask), stream_handle(self._current_stream())))

    @without_torch_function
    def low_latency_query_mask_buffer(self, mask_status):
        desc = ctypes.create_string_buffer(_DESC_BYTES)
        struct.pack_into("@" + TENSOR_FIELDS, desc, 0, *_desc("mask_status", mask_status))
        check(lib.deepep_low_latency_query_mask_buffer(self._live_handle(), ctypes.addressof(desc),
                                                       stream_handle(self._current_stream())))

    def low_latency_clean_mask_buffer(self):
        check(lib.deepep_low_latency_clean_mask_buffer(self._live_handle(), stream_handle(self._current_stream())))
