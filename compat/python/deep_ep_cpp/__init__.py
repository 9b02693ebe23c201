"""deepep-nccl's `deep_ep_cpp`: the names of DeepEP's pybind module, over libdeepep_nccl.so.

Importing needs no torch and no GPU (configs, size hints, argument checks work anywhere);
Buffer.sync(), EventHandle and the tensor methods need PyTorch with CUDA.
"""
from ctypes import byref, c_int

from ._buffer import Buffer
from ._config import Config, get_default_config, get_low_latency_rdma_size_hint
from ._event import EventHandle
from ._lib import check, lib, require_torch

__all__ = [
    "Buffer",
    "Config",
    "EventHandle",
    "device_count",
    "get_default_config",
    "get_low_latency_rdma_size_hint",
    "is_sm90_compiled",
    "library_version",
    "nccl_compiled_version",
    "nccl_runtime_version",
    "topk_idx_t",
]


def is_sm90_compiled():
    return True


def library_version():
    """Version of libdeepep_nccl.so, e.g. '0.1.0'."""
    return lib.deepep_library_version().decode()


def nccl_compiled_version():
    """NCCL_VERSION_CODE (major*10000 + minor*100 + patch) of the headers the kernels were built with."""
    return lib.deepep_nccl_compiled_version()


def nccl_runtime_version():
    """NCCL version code of the libnccl.so.2 loaded in this process."""
    out = c_int()
    check(lib.deepep_nccl_runtime_version(byref(out)))
    return out.value


def device_count():
    """Number of CUDA devices; RuntimeError (DEEPEP_ERROR_NO_DEVICE) without a driver or GPU."""
    out = c_int()
    check(lib.deepep_device_count(byref(out)))
    return out.value


def __getattr__(name):
    # torch.int64 on demand, so that importing this module needs no torch.
    if name == "topk_idx_t":
        return require_torch().int64
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
