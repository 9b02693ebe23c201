"""DeepEP's stream and event protocol of the normal-mode ops (layout, dispatch, combine):
kernels run on the comm stream after `previous_event` (or the compute stream); with async
the caller gets an EventHandle and every tensor is record_stream'ed, otherwise the compute
stream waits for the comm stream."""
import contextlib
import functools

from ._event import EventHandle
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


def without_torch_function(method):
    """Runs an op's Python path with torch-function modes (and subclass hooks) disabled."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with _no_torch_function():
            return method(*args, **kwargs)

    return wrapper


class StreamProtocol:
    """Mixin for deep_ep_cpp.Buffer; needs _device_id, _sync_event, get_comm_stream()."""

    _compute_key = None
    _compute_stream = None

    def _current_stream(self):
        """The device's current (compute) stream. torch.cuda.current_stream() builds a Stream
        object per call (about 1 us): keep the last one while the current stream stays the same."""
        key = _current_stream_key(self._device_id)
        if key != self._compute_key:
            self._compute_key = key
            self._compute_stream = _torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
        return self._compute_stream

    def _op_begin(self, previous_event, async_, allocate_on_comm_stream):
        """Orders the comm stream after the inputs; returns (comm, compute). When
        allocate_on_comm_stream, the comm stream is current until _op_allocated()."""
        comm = self._comm_stream
        if comm is None:
            comm = self.get_comm_stream()
        if allocate_on_comm_stream and (previous_event is None or not async_):
            raise RuntimeError("deepep-nccl: allocate_on_comm_stream requires previous_event and async")
        compute = self._current_stream()
        if previous_event is not None:
            previous_event.event.wait(comm)
        else:
            stream_wait_stream(self._sync_event, comm, compute)
        if allocate_on_comm_stream:
            _torch.cuda.set_stream(comm)
        return comm, compute

    @staticmethod
    def _op_allocated(compute, allocate_on_comm_stream):
        """Restores the compute stream after the outputs were allocated."""
        if allocate_on_comm_stream:
            _torch.cuda.set_stream(compute)

    def _op_end(self, comm, compute, async_, allocate_on_comm_stream, tensors):
        """Returns the EventHandle (async) or None after making compute wait for comm."""
        if async_:
            event = EventHandle(comm)
            for t in tensors:
                if t is not None:
                    t.record_stream(comm)
                    if allocate_on_comm_stream:
                        t.record_stream(compute)
            return event
        stream_wait_stream(self._sync_event, compute, comm)
        return None
