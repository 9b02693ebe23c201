"""DeepEP's EventHandle: a CUDA event recorded at construction."""
from ._lib import require_torch


class EventHandle:
    """Records a CUDA event on `stream` (default: the current stream) at construction."""

    __slots__ = ("event",)

    def __init__(self, stream=None):
        self.event = require_torch().cuda.Event()
        self.event.record(stream)

    def current_stream_wait(self):
        """Makes the current stream wait for the event."""
        self.event.wait()
