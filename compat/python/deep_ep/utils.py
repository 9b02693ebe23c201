import os
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist

# Megatron imports both names from here: `from deep_ep.utils import EventHandle, EventOverlap`.
from deep_ep_cpp import EventHandle

__all__ = ["EventHandle", "EventOverlap", "check_nvlink_connections"]


class EventOverlap:
    """A CUDA event (EventHandle) plus tensors to keep alive until it completes.

    `extra_tensors` stands in for record_stream, which keeps CUDA-graph capture usable.
    As a context manager it makes the current stream wait for the event on exit.
    """

    def __init__(
        self, event: Optional[EventHandle] = None, extra_tensors: Optional[Tuple[torch.Tensor]] = None
    ) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        assert self.event is not None
        self.event.current_stream_wait()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.event.current_stream_wait()


def check_nvlink_connections(group: dist.ProcessGroup) -> None:
    """DeepEP's check: PCIe GPUs (e.g. some A100 PCIE) have only pairwise NVLink, so at most EP2."""
    if "PCIE" not in torch.cuda.get_device_name():
        return
    assert group.size() <= 2, "PCIe GPUs only have pairwise NVLink connections"
    try:
        import pynvml
    except ImportError:
        # DeepEP requires pynvml here; without it only the group-size check applies.
        return

    pynvml.nvmlInit()
    try:
        devices = os.environ.get("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7").strip(",").split(",")
        physical_device_idx = int(devices[torch.cuda.current_device()])
        physical_device_indices = [0] * group.size()
        dist.all_gather_object(physical_device_indices, physical_device_idx, group)
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in physical_device_indices]
        for i in range(len(handles)):
            for j in range(i + 1, len(handles)):
                status = pynvml.nvmlDeviceGetP2PStatus(handles[i], handles[j], pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
                pair = f"GPU {physical_device_indices[i]} and GPU {physical_device_indices[j]}"
                assert status == pynvml.NVML_P2P_STATUS_OK, f"{pair} are not connected via NVLink"
    finally:
        pynvml.nvmlShutdown()
