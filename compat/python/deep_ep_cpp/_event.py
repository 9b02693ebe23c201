"""DeepEP's EventHandle: a CUDA event recorded at construction."""
from ._lib import require_torch


class EventHandle:
    """Records a CUDA event on `stream` (default: the current stream) at construction. The compiled
    path's direct entries make one without __init__ (object.__new__, then `event`: _fast_direct.h's
    recorded_event) and read `event` of a previous_event: `event` is its whole state."""

    __slots__ = ("event",)

    def __init__(self, stream=None):
        self.event = require_torch().cuda.Event()
        self.event.record(stream)

    def current_stream_wait(self):
        """Makes the current stream wait for the event."""
        self.event.wait()
