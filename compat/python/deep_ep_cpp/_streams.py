"""DeepEP's stream and event protocol of the normal-mode ops (layout, dispatch, combine):
kernels run on the comm stream after `previous_event` (or the compute stream); with async
the caller gets an EventHandle and every tensor is record_stream'ed, otherwise the compute
stream waits for the comm stream."""
import contextlib
import ctypes
import functools

from ._event import EventHandle
from ._lib import raise_driver_error, raise_status
from ._lib import torch as _torch

# (stream_id, device_index, device_type) of a device's current stream, without building a Stream.
_current_stream_key = getattr(_torch and _torch._C, "_cuda_getCurrentStream", None)


# Under torch.set_default_device('cuda') every torch call made from Python pays for a
# TorchFunctionMode; the ops allocate with explicit devices, so they run with torch-function
# handling off (measured on CPU: torch.empty 5.8 us with the mode, 2.4 us without).
_no_torch_function = _torch._C.DisableTorchFunction if _torch is not None else contextlib.nullcontext


# torch.cuda.Event.record/wait are Python wrappers that look the current stream up when given
# none; the ops always pass one, so they call the C methods underneath (one frame less each).
_event_base = getattr(_torch and _torch._C, "_CudaEventBase", None)
_event_record = _event_base.record if _event_base is not None else None
_event_wait = _event_base.wait if _event_base is not None else None


def stream_wait_stream(event, waiter, signaler):
    """Orders waiter's later work after signaler's work so far (through event)."""
    _event_record(event, signaler)
    _event_wait(event, waiter)


# The C ABI reads a NULL stream as "the buffer's comm stream"; torch's default stream has the
# handle 0, so it travels as cudaStreamLegacy (the same stream, spelled explicitly).
CUDA_STREAM_LEGACY = 1


def stream_handle(stream):
    """The C ABI's handle of a torch stream."""
    return stream.cuda_stream or CUDA_STREAM_LEGACY


# The waits of DeepEP's protocol an op still has to do (the compiled path's order flags, the same
# values as _fast_order.h's): the launch stream after the compute stream, and the compute stream
# after the launch. The compiled path does them around its launch through the CUDA driver (it must
# not call back into Python), the ctypes path here through torch events: two implementations, held
# to the same flags and waits by tests/python (test_stream_order_matches_the_compiled_path).
ORDER_BEFORE = 1
ORDER_AFTER = 2


def without_torch_function(method):
    """Runs an op's Python path with torch-function modes (and subclass hooks) disabled."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with _no_torch_function():
            return method(*args, **kwargs)

    return wrapper


class StreamProtocol:
    """Mixin for deep_ep_cpp.Buffer; needs _device_id, _sync_event, get_comm_stream() and (for the
    compiled path) _fast."""

    _compute_key = None
    _compute_stream = None
    _compute_handle = None

    def _current_stream(self):
        """The device's current (compute) stream. torch.cuda.current_stream() builds a Stream
        object per call (about 1 us): keep the last one (and its handle, _compute_handle) while the
        current stream stays the same."""
        key = _current_stream_key(self._device_id)
        if key != self._compute_key:
            self._compute_key = key
            self._compute_stream = _torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
            self._compute_handle = stream_handle(self._compute_stream)
        return self._compute_stream

    def _op_begin(self, previous_event, async_, allocate_on_comm_stream):
        """Orders the comm stream after previous_event if given; returns (comm, compute, order):
        `order` holds the waits still to do (ORDER_BEFORE without previous_event, ORDER_AFTER
        without async), by the compiled path or by _order_before() and _op_end(). When
        allocate_on_comm_stream, the comm stream is current until _op_allocated()."""
        comm = self._comm_stream
        if comm is None:
            comm = self.get_comm_stream()
        if allocate_on_comm_stream and (previous_event is None or not async_):
            raise RuntimeError("deepep-nccl: allocate_on_comm_stream requires previous_event and async")
        compute = self._current_stream()
        order = 0 if async_ else ORDER_AFTER
        if previous_event is not None:
            previous_event.event.wait(comm)
        else:
            order |= ORDER_BEFORE
        if allocate_on_comm_stream:
            _torch.cuda.set_stream(comm)
        return comm, compute, order

    def _order_before(self, order, stream, compute):
        """The ctypes path's ORDER_BEFORE wait: stream after compute's work so far."""
        if order & ORDER_BEFORE:
            stream_wait_stream(self._sync_event, stream, compute)

    @staticmethod
    def _op_allocated(compute, allocate_on_comm_stream):
        """Restores the compute stream after the outputs were allocated."""
        if allocate_on_comm_stream:
            _torch.cuda.set_stream(compute)

    def _op_end(self, comm, compute, async_, allocate_on_comm_stream, tensors, order):
        """Returns the EventHandle (async) or None, after making compute wait for comm if `order`
        still holds ORDER_AFTER (the compiled path did it: 0)."""
        if async_:
            event = EventHandle(comm)
            for t in tensors:
                if t is not None:
                    t.record_stream(comm)
                    if allocate_on_comm_stream:
                        t.record_stream(compute)
            return event
        if order & ORDER_AFTER:
            stream_wait_stream(self._sync_event, compute, comm)
        return None

    def _fast_with_config(self, ops, op_name, config, order, *args):
        """_fast_call of the compiled path's op `op_name` of `ops` (NormalOps, InternodeOps) with
        the config's C struct, the comm stream and the stream ordering (`order`: _op_begin's)
        appended; None without the compiled path (`ops` None) or for a config it cannot read. The
        one selection of intranode and internode normal ops: the caller takes the ctypes path on None."""
        c_config = getattr(config, "_c", None)
        if ops is None or c_config is None:
            return None
        return self._fast_call(getattr(ops, op_name), *args, ctypes.addressof(c_config), self._comm_stream_ptr,
                               self._stream_order, self._compute_handle, order)

    def _fast_call(self, op, *args):
        """Runs `op` of the compiled host path: its result without the status, or None for input
        it does not take (the ctypes path then names the argument, and nothing was launched or
        ordered); raises for a failed call."""
        try:
            result = op(*args)
        except TypeError:  # an argument pybind cannot convert (e.g. None for a tensor)
            return None
        return self._fast_result(result)

    def _fast_result(self, result):
        """_fast_call's answer for a compiled op's `result` (status first)."""
        status = result[0]
        if status == self._fast.BAD_INPUT:
            return None
        if status == self._fast.DRIVER_ERROR:
            raise_driver_error(result[1])
        if status:
            raise_status(status)
        return result[1:]
