"""DeepEP's EventHandle: a CUDA event recorded at construction."""
from ._lib import require_torch


# The compiled host path's current_stream_event (_fast_direct.h), once a Buffer loaded it with
# torch's event classes (_buffer.py): torch.cuda.Event() recorded on the current stream, as
# EventHandle() makes it below, in C++ (DeepEP's is C++: Megatron-style callers make one per op).
record_on_current_stream = None


class EventHandle:
    """Records a CUDA event on `stream` (default: the current stream) at construction. The compiled
    path's direct entries make one without __init__ (object.__new__, then `event`: _fast_direct.h's
    recorded_event) and read `event` of a previous_event: `event` is its whole state."""

    __slots__ = ("event",)

    def __init__(self, stream=None):
        record = record_on_current_stream
        if stream is None and record is not None:
            self.event = record()
        else:
            self.event = require_torch().cuda.Event()
            self.event.record(stream)

    def current_stream_wait(self):
        """Makes the current stream wait for the event."""
        self.event.wait()
