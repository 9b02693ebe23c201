"""deep_ep_cpp.Buffer: DeepEP's pybind Buffer (positional C++ signatures) over the C ABI."""
import contextlib
import ctypes
import struct
import sys
import warnings
import weakref
from ctypes import byref, c_bool, c_int, c_int64, c_void_p

from . import _event, _fast, _lib
from ._fast import INTERNODE_OPS_ENTRIES, NORMAL_OPS_ENTRIES, entry_addresses
from ._internode import InternodeMode
from ._low_latency import LowLatencyMode
from ._normal import NormalMode
from ._config import Config
from ._event import EventHandle
from ._streams import CUDA_STREAM_LEGACY, without_torch_function
from ._lib import (
    INT32,
    INT64,
    UINT64,
    MAX_DIMS,
    NUM_MAX_NVL_PEERS,
    UNIQUE_ID_BYTES,
    DeepepTensor,
    OutputPlans,
    check,
    int_arg,
    int_range_error,
    lib,
    raise_driver_error,
    raise_status,
    require_torch,
)

# get_local_ipc_handle() bytes: the magic, rank 0's ncclUniqueId (zeros on other ranks), then this
# rank's Buffer arguments, which every rank must share: the internode rings are sized from
# num_rdma_bytes, so a rank with other values would hang or corrupt the ops (sync() checks them).
_HANDLE_MAGIC = b"DEEPEPNCCL2"
_HANDLE_ARGS = struct.Struct("<qq??")  # num_nvl_bytes, num_rdma_bytes, low_latency_mode, enable_shrink
_HANDLE_ARG_NAMES = ("num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "enable_shrink")
_HANDLE_BYTES = len(_HANDLE_MAGIC) + UNIQUE_ID_BYTES + _HANDLE_ARGS.size

_pack_tensor = _lib.TENSOR_FORMAT.pack_into
_ZERO_DIMS = (0,) * MAX_DIMS

_torch = _lib.torch
_INT32_LOW, _INT32_HIGH = INT32
_DTYPE_CODES = _lib.TORCH_DTYPE_CODES


def _current_device():
    """torch's current CUDA device, or -1 without torch or CUDA (the C ABI then reports why at sync)."""
    if _torch is not None and _torch.cuda.is_available():
        return _torch.cuda.current_device()
    return -1


@contextlib.contextmanager
def _on_device(device_id):
    """Makes device_id's primary context current: the C ABI creates on the thread's current context."""
    if _torch is None or device_id < 0:
        yield
        return
    with _torch.cuda.device(device_id):
        # torch creates contexts lazily; a device synchronize forces this device's into existence.
        _torch.cuda.synchronize()
        yield


class _DeviceBytes:
    """Zero-copy uint8 view source for torch.as_tensor; torch keeps it, and so the Buffer, alive."""

    def __init__(self, ptr, num_bytes, owner):
        self.__cuda_array_interface__ = {
            "shape": (num_bytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }
        self.owner = owner


def use_compiled_helpers(fast):
    """Gives the compiled module what it raises for a failed call, the configs it reads and the
    events it waits on and returns (_fast_direct.h); where it takes torch's events, EventHandle()
    records through it from now on (_event.record_on_current_stream)."""
    if fast.set_python_helpers(raise_status, raise_driver_error, Config, EventHandle):
        _event.record_on_current_stream = fast.current_stream_event


class Buffer(NormalMode, InternodeMode, LowLatencyMode):
    """One rank's communication buffer. The constructor only validates; sync() creates it."""

    # Class-level defaults so that __del__ works when __init__ raised.
    _handle = None
    _normal_fast = None  # the compiled host path's NormalOps (after sync), else the ctypes path
    _stream_order = None  # the compiled host path's StreamOrder (after sync)
    _num_rdma_ranks = None  # the library's, read once at sync (fixed for the buffer's life)

    def __init__(
        self,
        rank,
        num_ranks,
        num_nvl_bytes,
        num_rdma_bytes,
        low_latency_mode,
        explicitly_destroy,
        enable_shrink,
        use_fabric,
    ):
        rank, num_ranks = int_arg("rank", rank), int_arg("num_ranks", num_ranks)
        num_nvl_bytes = int_arg("num_nvl_bytes", num_nvl_bytes, INT64)
        num_rdma_bytes = int_arg("num_rdma_bytes", num_rdma_bytes, INT64)
        check(lib.deepep_check_buffer_args(rank, num_ranks, num_nvl_bytes, num_rdma_bytes, low_latency_mode))
        # use_fabric needs no handling: NCCL picks the memory handle type itself.
        self._rank = rank
        self._num_ranks = num_ranks
        self._num_nvl_bytes = num_nvl_bytes
        self._num_rdma_bytes = num_rdma_bytes
        self._low_latency_mode = bool(low_latency_mode)
        self._explicitly_destroy = bool(explicitly_destroy)
        self._enable_shrink = bool(enable_shrink)
        self._device_id = _current_device()
        self._ipc_handle = None
        self._comm_stream = None
        self._comm_stream_ptr = None

        # The layout's descriptors live as long as the Buffer: topk_idx's, and the outputs' as the
        # library describes them (deepep_get_dispatch_layout_outputs) per shape, re-pointed per call.
        self._topk_desc = DeepepTensor()
        self._topk_addr = ctypes.addressof(self._topk_desc)
        self._layout_plans = OutputPlans()
        self._layout_fn = lib.deepep_get_dispatch_layout
        self._layout_outputs_fn = lib.deepep_get_dispatch_layout_outputs
        self._sync_event = None
        # The compiled host path: built (once per machine) or loaded here, in the collective
        # constructor, not in a first op that peers may already wait on.
        self._fast = _fast.module()
        if self._fast is not None:
            assert self._fast.CUDA_STREAM_LEGACY == CUDA_STREAM_LEGACY
            use_compiled_helpers(self._fast)
        self._normal_init()
        self._internode_init()
        self._ll_init()

    def __del__(self, _free=lib.deepep_buffer_free, _finalizing=sys.is_finalizing):
        handle = self._handle
        # At interpreter exit peers may be gone, so a collective teardown could block; the
        # driver reclaims everything with the process anyway.
        if handle is None or _finalizing():
            return
        self._handle = None
        try:
            if self._comm_stream is not None:
                self._comm_stream.synchronize()  # its kernels may still use the buffer's memory
        finally:
            _free(handle)  # never fails; the library prints teardown problems itself

    def _live_handle(self):
        if self._handle is None:
            raise RuntimeError("deepep-nccl: the buffer is not created yet: call sync() first")
        return self._handle

    def _query_int(self, fn):
        out = c_int()
        check(fn(self._live_handle(), byref(out)))
        return out.value

    # --- DeepEP's bound methods -------------------------------------------------------------

    def is_available(self):
        if self._handle is None:
            return False
        out = c_bool()
        check(lib.deepep_buffer_is_available(self._handle, byref(out)))
        return out.value

    # Node topology: after sync() the library's (nodes of the LSA team or DEEPEP_VIRTUAL_NODE_SIZE);
    # before it, DeepEP's nodes of 8 (the node size is known only once the buffer exists).
    def get_num_rdma_ranks(self):
        # deep_ep's dispatch and combine ask every call: a ctypes query (~1 us) each time otherwise.
        if self._num_rdma_ranks is not None:
            return self._num_rdma_ranks
        if self._handle is not None:
            return self._query_int(lib.deepep_buffer_get_num_rdma_ranks)
        return max(1, self._num_ranks // NUM_MAX_NVL_PEERS)

    def get_rdma_rank(self):
        if self._handle is not None:
            return self._query_int(lib.deepep_buffer_get_rdma_rank)
        return self._rank // NUM_MAX_NVL_PEERS

    def get_root_rdma_rank(self, global_):
        if self._handle is not None:
            out = c_int()
            check(lib.deepep_buffer_get_root_rdma_rank(self._handle, bool(global_), byref(out)))
            return out.value
        return self._rank % NUM_MAX_NVL_PEERS if global_ else 0

    def get_local_device_id(self):
        return self._device_id

    def _shared_args(self):
        return (self._num_nvl_bytes, self._num_rdma_bytes, self._low_latency_mode, self._enable_shrink)

    def get_local_ipc_handle(self):
        """Rank 0's handle carries a fresh ncclUniqueId; DeepEP's all-gather delivers it to all ranks.
        Every rank's carries its Buffer arguments, for sync() to check that all ranks agree."""
        if self._ipc_handle is None:
            unique_id = ctypes.create_string_buffer(UNIQUE_ID_BYTES)
            if self._rank == 0:
                check(lib.deepep_get_unique_id(unique_id, UNIQUE_ID_BYTES))
            self._ipc_handle = _HANDLE_MAGIC + unique_id.raw + _HANDLE_ARGS.pack(*self._shared_args())
        return bytearray(self._ipc_handle)

    def get_local_nvshmem_unique_id(self):
        # NVSHMEM is not used; the bytes only let DeepEP's own buffer.py run its all-gather.
        return bytearray(UNIQUE_ID_BYTES)

    def get_local_buffer_tensor(self, dtype, offset, use_rdma_buffer):
        handle = self._live_handle()
        torch = require_torch()
        ptr, num_bytes = c_void_p(), c_int64()
        check(lib.deepep_buffer_get_local_buffer(handle, use_rdma_buffer, byref(ptr), byref(num_bytes)))
        element_size = torch.empty(0, dtype=dtype).element_size()
        # As DeepEP: num_bytes / element_size elements from byte `offset` (the size ignores the offset).
        view_bytes = num_bytes.value // element_size * element_size
        return torch.as_tensor(_DeviceBytes((ptr.value or 0) + offset, view_bytes, self)).view(dtype)

    def get_comm_stream(self):
        self._live_handle()
        if not self.is_available():
            raise RuntimeError("deepep-nccl: get_comm_stream: the buffer was destroyed or is unusable")
        if self._comm_stream is None:
            # As DeepEP's: a high-priority stream from torch's pool. Pool streams live as long as
            # the process, so record_stream() on them stays valid after destroy(); the library's
            # own stream (which destroy() frees) serves only its internal, host-synchronous work.
            self._comm_stream = require_torch().cuda.Stream(device=self._device_id, priority=-1)
            self._comm_stream_ptr = self._comm_stream.cuda_stream
        return self._comm_stream

    def sync(self, device_ids, all_gathered_handles, root_unique_id_opt):
        """Creates the buffer (collective). root_unique_id_opt is NVSHMEM's and is ignored."""
        if self._handle is not None:
            raise RuntimeError("deepep-nccl: sync() was already called on this buffer")
        if len(device_ids) != self._num_ranks or len(all_gathered_handles) != self._num_ranks:
            raise RuntimeError(
                f"deepep-nccl: sync() needs {self._num_ranks} device ids and IPC handles (one per rank), "
                f"got {len(device_ids)} and {len(all_gathered_handles)}"
            )
        root = all_gathered_handles[0]
        if root is None or len(root) != _HANDLE_BYTES or root[: len(_HANDLE_MAGIC)] != _HANDLE_MAGIC:
            raise RuntimeError(
                "deepep-nccl: all_gathered_handles[0] is not a deepep-nccl IPC handle "
                f"(expected {_HANDLE_BYTES} bytes from rank 0's get_local_ipc_handle())"
            )
        unique_id = bytes(root[len(_HANDLE_MAGIC) : len(_HANDLE_MAGIC) + UNIQUE_ID_BYTES])
        if not any(unique_id):
            raise RuntimeError(
                "deepep-nccl: all_gathered_handles[0] carries no NCCL unique id: it must be rank 0's handle "
                "(the handles must be in rank order)"
            )
        self._check_shared_args(all_gathered_handles)
        out = c_void_p()
        with _on_device(self._device_id):
            status = lib.deepep_buffer_create(
                self._rank,
                self._num_ranks,
                unique_id,
                len(unique_id),
                self._num_nvl_bytes,
                self._num_rdma_bytes,
                self._low_latency_mode,
                self._explicitly_destroy,
                self._enable_shrink,
                byref(out),
            )
        check(status)
        self._handle = out.value
        self._device_id = self._query_int(lib.deepep_buffer_get_local_device_id)
        self._num_rdma_ranks = self._query_int(lib.deepep_buffer_get_num_rdma_ranks)
        if _torch is not None:
            self._device = _torch.device("cuda", self._device_id)
            self._sync_event = _torch.cuda.Event()
        if self._fast is not None:
            with _on_device(self._device_id):  # the event of the compiled path's stream ordering
                self._stream_order = self._fast.StreamOrder(self._device_id)
                orderable = self._stream_order.usable()
                if not orderable:  # no libcuda entry points or no event
                    warnings.warn("deepep-nccl: the compiled host path cannot order streams through the CUDA "
                                  "driver; the ops take the ctypes path", RuntimeWarning, stacklevel=2)
            self._normal_fast = self._fast.NormalOps(*entry_addresses(lib, NORMAL_OPS_ENTRIES),
                                                     self._num_ranks, self._device_id)
            self._internode_fast = self._fast.InternodeOps(*entry_addresses(lib, INTERNODE_OPS_ENTRIES),
                                                           self._num_ranks, self._device_id)
            self._ll_sync()
            if orderable:  # else every op takes the ctypes path
                self._bind_direct_entries()

    def _bind_direct_entries(self):
        """Makes the compiled ops' direct entries (_fast_direct.h) this buffer's methods of DeepEP's
        names: a call then goes from Python straight into C++, without the class method's 4-9 us.
        They take the fast case and DeepEP's events (previous_event, async_, allocate_on_comm_stream)
        and call the class method for anything else; a subclass's override stays in charge."""
        self.get_comm_stream()  # as DeepEP's constructor: the direct entries launch on it
        # A weak reference: the buffer owns the ops, so a strong one would be a cycle.
        buffer_ref = weakref.ref(self)
        # The comm stream as its torch.cuda.Stream: the entries launch on it, record_stream on it and
        # record their EventHandles there.
        self._normal_fast.bind_buffer(buffer_ref, self._handle, self._comm_stream, self._stream_order)
        self._ll_ops.bind_buffer(buffer_ref, self._comm_stream)
        cls = type(self)
        for ops, names in ((self._normal_fast, self._fast.NORMAL_DIRECT_ENTRIES),
                           (self._ll_ops, self._fast.LL_DIRECT_ENTRIES)):
            for name in names:
                if getattr(cls, name) is getattr(Buffer, name):
                    setattr(self, name, getattr(ops, name))

    def _unbind_direct_entries(self):
        """Sets the bound direct entries aside, so that calls reach the class methods (for tests and
        benches that patch or time what those take); returns them: vars(self).update() rebinds."""
        fast = self._fast
        names = (*fast.NORMAL_DIRECT_ENTRIES, *fast.LL_DIRECT_ENTRIES) if fast is not None else ()
        return {name: vars(self).pop(name) for name in names if name in vars(self)}

    def _check_shared_args(self, handles):
        """Before anything collective: every rank sees the same handles, so either all raise or none."""
        mine = self._shared_args()
        for rank, h in enumerate(handles):
            if h is None or len(h) != _HANDLE_BYTES or h[: len(_HANDLE_MAGIC)] != _HANDLE_MAGIC:
                raise RuntimeError(
                    f"deepep-nccl: all_gathered_handles[{rank}] is not a deepep-nccl IPC handle of this version "
                    f"(expected {_HANDLE_BYTES} bytes from get_local_ipc_handle(); every rank must load the same library)"
                )
            theirs = _HANDLE_ARGS.unpack_from(bytes(h), _HANDLE_BYTES - _HANDLE_ARGS.size)
            if theirs != mine:
                fields = [(n, t, m) for n, t, m in zip(_HANDLE_ARG_NAMES, theirs, mine) if t != m]
                raise RuntimeError(
                    f"deepep-nccl: rank {rank} created its Buffer with "
                    + ", ".join(f"{n}={t}" for n, t, _ in fields)
                    + f", this rank ({self._rank}) with "
                    + ", ".join(f"{n}={m}" for n, _, m in fields)
                    + ": every rank must pass the same num_nvl_bytes, num_rdma_bytes, low_latency_mode and "
                    "enable_shrink (the internode rings are sized from num_rdma_bytes)"
                )

    def destroy(self):
        handle = self._live_handle()
        if _torch is not None:
            # As DeepEP: kernels still running may use the buffer's memory.
            _torch.cuda.synchronize(self._device_id)
        check(lib.deepep_buffer_destroy(handle))

    @without_torch_function
    def get_dispatch_layout(self, topk_idx, num_experts, previous_event, async_, allocate_on_comm_stream):
        """DeepEP's layout with its stream protocol; returns (per rank, per rdma rank or None,
        per expert, is_token_in_rank, EventHandle or None)."""
        handle = self._live_handle()
        comm, compute, order = self._op_begin(previous_event, async_, allocate_on_comm_stream)
        try:
            result = None
            fast = self._normal_fast
            if fast is not None:
                result = self._fast_call(fast.layout, handle, topk_idx, num_experts, self._comm_stream_ptr,
                                         self._stream_order, self._compute_handle, order)
            if result is None:
                self._order_before(order, comm, compute)
                result = self._layout_ctypes(handle, topk_idx, num_experts)
            else:
                order = 0  # the compiled path did the waits
        finally:
            if allocate_on_comm_stream:
                self._op_allocated(compute, allocate_on_comm_stream)
        per_rank, per_rdma, per_expert, in_rank = result
        # per_rank's storage is the one allocation of the three count vectors.
        event = None
        if async_ or order:  # else nothing is left to do (the common case: skip building the tuple)
            event = self._op_end(comm, compute, async_, allocate_on_comm_stream, (topk_idx, per_rank, in_rank),
                                 order)
        return per_rank, per_rdma, per_expert, in_rank, event

    def _layout_ctypes(self, handle, topk_idx, num_experts):
        """The layout through ctypes: (per rank, per rdma rank or None, per expert,
        is_token_in_rank) as the library describes them, as the compiled path's."""
        if not _INT32_LOW <= num_experts <= _INT32_HIGH:  # ctypes would pass it truncated
            raise int_range_error("num_experts", num_experts)
        self._check_device("topk_idx", topk_idx)
        code = _DTYPE_CODES.get(topk_idx.dtype)
        if code is None:
            raise RuntimeError(
                f"deepep-nccl: topk_idx must have dtype torch.int64 or torch.int32, got {topk_idx.dtype}"
            )
        shape = topk_idx.shape
        num_tokens = shape[0] if shape else 0
        key = (num_tokens, num_experts)
        plans = self._layout_plans
        entry = plans.get(key)
        if entry is None:
            entry = plans.add(key, self._layout_outputs_fn, handle, num_tokens, num_experts)
        allocate, (rank_addr, rdma_addr, expert_addr, in_rank_addr) = entry
        tensors = allocate(self._device)  # also points the outputs' descriptors at them
        # topk_idx's descriptor (strides in elements). Dims past MAX_DIMS are dropped: the C ABI
        # rejects any topk_idx that is not 2-D by its ndim anyway.
        dims = (*shape, *_ZERO_DIMS)[:MAX_DIMS]
        strides = (*topk_idx.stride(), *_ZERO_DIMS)[:MAX_DIMS]
        _pack_tensor(self._topk_desc, 0, topk_idx.data_ptr(), code, len(shape), *dims, *strides)
        # rdma_addr is None where the library describes no per-rdma-rank counts.
        status = self._layout_fn(handle, self._topk_addr, num_experts, rank_addr, rdma_addr, expert_addr,
                                 in_rank_addr, self._comm_stream_ptr)
        if status:
            raise_status(status)
        return tensors

    def check_peers(self):
        """Collective: every rank writes to every peer over NVLink/P2P and verifies what arrived."""
        check(lib.deepep_buffer_check_peers(self._live_handle()))

    def barrier(self):
        """Collective barrier; blocks the host until every rank arrives (or the GPU timeout)."""
        check(lib.deepep_buffer_barrier(self._live_handle()))

    def set_gpu_timeout_ms(self, ms):
        """Budget of every GPU-side wait of this buffer (default 100 s)."""
        # A negative value becomes 0, which the library rejects, instead of wrapping to a huge u64.
        check(lib.deepep_buffer_set_gpu_timeout_ms(self._live_handle(), int_arg("ms", max(0, ms), UINT64)))

    def get_num_device_sms(self):
        return self._query_int(lib.deepep_buffer_get_num_device_sms)
