"""Loads libdeepep_nccl.so and declares the C ABI of include/deepep_nccl.h."""
import ctypes
import os
import struct
from ctypes import POINTER, c_bool, c_char_p, c_int, c_int32, c_int64, c_size_t, c_uint32, c_uint64, c_void_p
from pathlib import Path

try:
    # Loaded first so that our libnccl.so.2 dependency binds to the copy torch already uses.
    import torch
except ImportError:
    torch = None

ABI_VERSION = 1
UNIQUE_ID_BYTES = 128
MAX_DIMS = 4

ERROR_UNSUPPORTED = 8

DTYPE_BOOL = 1
DTYPE_UINT8 = 2
DTYPE_INT32 = 3
DTYPE_INT64 = 4
DTYPE_FLOAT32 = 5
DTYPE_BFLOAT16 = 6
DTYPE_FLOAT16 = 7
DTYPE_FLOAT8_E4M3 = 8

# torch dtype -> DeepepDtype code (empty without torch).
TORCH_DTYPE_CODES = (
    {}
    if torch is None
    else {
        torch.bool: DTYPE_BOOL,
        torch.uint8: DTYPE_UINT8,
        torch.int32: DTYPE_INT32,
        torch.int64: DTYPE_INT64,
        torch.float32: DTYPE_FLOAT32,
        torch.bfloat16: DTYPE_BFLOAT16,
        torch.float16: DTYPE_FLOAT16,
        torch.float8_e4m3fn: DTYPE_FLOAT8_E4M3,
    }
)

# torch dtype of each DeepepDtype code.
DTYPES_BY_CODE = {code: dtype for dtype, code in TORCH_DTYPE_CODES.items()}

CONFIG_DISPATCH = 0
CONFIG_COMBINE = 1


class DeepepConfig(ctypes.Structure):
    _fields_ = [
        ("num_sms", c_int32),
        ("num_max_nvl_chunked_send_tokens", c_int32),
        ("num_max_nvl_chunked_recv_tokens", c_int32),
        ("num_max_rdma_chunked_send_tokens", c_int32),
        ("num_max_rdma_chunked_recv_tokens", c_int32),
    ]


class DeepepTensor(ctypes.Structure):
    _fields_ = [
        ("data", c_void_p),
        ("dtype", c_int32),
        ("ndim", c_int32),
        ("shape", c_int64 * MAX_DIMS),
        ("strides", c_int64 * MAX_DIMS),
    ]


MAX_OP_OUTPUTS = 8


class DeepepOutputs(ctypes.Structure):
    """What an op's caller allocates, as the library describes it (src/outputs.rs)."""

    _fields_ = [
        ("count", c_int32),
        ("num_allocations", c_int32),
        ("tensors", DeepepTensor * MAX_OP_OUTPUTS),
        ("allocation", c_int32 * MAX_OP_OUTPUTS),
        ("offset", c_int64 * MAX_OP_OUTPUTS),
        ("allocation_dtype", c_int32 * MAX_OP_OUTPUTS),
        ("allocation_elems", c_int64 * MAX_OP_OUTPUTS),
    ]


# A whole DeepepOutputs in one unpack (much cheaper than reading ctypes fields one by one): count,
# num_allocations, 8 x the 11 DeepepTensor fields, then allocation, offset, allocation_dtype and
# allocation_elems (8 each).
_OUTPUTS_FORMAT = struct.Struct(f"@2i{'Pii4q4q' * MAX_OP_OUTPUTS}{MAX_OP_OUTPUTS}i{MAX_OP_OUTPUTS}q"
                                f"{MAX_OP_OUTPUTS}i{MAX_OP_OUTPUTS}q")
assert _OUTPUTS_FORMAT.size == ctypes.sizeof(DeepepOutputs)
_GROUP_AT = 2 + 11 * MAX_OP_OUTPUTS
_OFFSET_AT = _GROUP_AT + MAX_OP_OUTPUTS
_ALLOCATION_DTYPE_AT = _OFFSET_AT + MAX_OP_OUTPUTS
_ALLOCATION_ELEMS_AT = _ALLOCATION_DTYPE_AT + MAX_OP_OUTPUTS
_TENSORS_OFFSET = DeepepOutputs.tensors.offset
_TENSOR_BYTES = ctypes.sizeof(DeepepTensor)


def output_plan(outputs):
    """A DeepepOutputs read once into plain Python for allocate_planned: per output None (absent)
    or (shape, strides, contiguous, dtype code, shared allocation or -1 when alone, offset), and
    per allocation shared by several outputs (index, elements, dtype code)."""
    fields = _OUTPUTS_FORMAT.unpack_from(outputs)
    count = fields[0]
    groups = fields[_GROUP_AT:_GROUP_AT + count]
    shared = tuple(sorted({g for g in groups if g >= 0 and groups.count(g) > 1}))
    entries = []
    for i in range(count):
        g = groups[i]
        if g < 0:
            entries.append(None)
            continue
        at = 2 + 11 * i  # data, dtype, ndim, shape[4], strides[4]
        n = fields[at + 2]
        shape, strides = fields[at + 3:at + 3 + n], fields[at + 7:at + 7 + n]
        entries.append((shape, strides, strides == _row_major(shape), fields[at + 1], g if g in shared else -1,
                        fields[_OFFSET_AT + i]))
    shared_allocations = tuple((g, fields[_ALLOCATION_ELEMS_AT + g], fields[_ALLOCATION_DTYPE_AT + g]) for g in shared)
    return tuple(entries), shared_allocations


def _row_major(shape):
    strides, step = [], 1
    for d in reversed(shape):
        strides.insert(0, step)
        step *= max(d, 1)
    return tuple(strides)


def allocate_planned(plan, device):
    """The outputs of an output_plan, allocated by torch (its caching allocator stays in charge):
    a list with None for absent outputs. An output alone in its allocation is one torch.empty
    (contiguous) or torch.empty_strided; outputs sharing one are views of a single torch.empty."""
    entries, shared = plan
    torch = require_torch()
    dtypes = DTYPES_BY_CODE
    bases = {g: torch.empty(elems, dtype=dtypes[code], device=device) for g, elems, code in shared}
    result = []
    for entry in entries:
        if entry is None:
            result.append(None)
            continue
        shape, strides, contiguous, code, g, offset = entry
        if g >= 0:
            result.append(bases[g].as_strided(shape, strides, offset))
        elif contiguous:
            result.append(torch.empty(shape, dtype=dtypes[code], device=device))
        else:
            result.append(torch.empty_strided(shape, strides, dtype=dtypes[code], device=device))
    return result


def allocate_outputs(outputs, device):
    """allocate_planned(output_plan(outputs)): for outputs described once per call."""
    return allocate_planned(output_plan(outputs), device)


def point_outputs(outputs, tensors):
    """Writes the address of each allocated output (allocate_outputs' list) into its descriptor in
    `outputs`: tensors[i] of the struct (at output_address(outputs, i)) then describes output i
    completely, ready for the op; absent ones stay all-zero."""
    for i, t in enumerate(tensors):
        if t is not None:
            _pack_pointer(outputs, _TENSORS_OFFSET + i * _TENSOR_BYTES, t.data_ptr())


def output_address(outputs, i):
    """The address of outputs.tensors[i], a DeepepTensor (for point_outputs' descriptors)."""
    return ctypes.addressof(outputs) + _TENSORS_OFFSET + i * _TENSOR_BYTES


_pack_pointer = struct.Struct("@P").pack_into


# Packs a whole DeepepTensor in one call: much cheaper than setting ctypes fields one by one.
TENSOR_FORMAT = struct.Struct("@Pii4q4q")
assert TENSOR_FORMAT.size == ctypes.sizeof(DeepepTensor)

_ABSENT_TENSOR = (0,) * 11
_ZERO_DIMS = (0, 0, 0, 0)


def tensor_fields(name, t):
    """The 11 DeepepTensor fields of t (strides in elements), or zeros for None (absent)."""
    if t is None:
        return _ABSENT_TENSOR
    code = TORCH_DTYPE_CODES.get(t.dtype)
    if code is None:
        raise RuntimeError(f"deepep-nccl: {name} has unsupported dtype {t.dtype}")
    shape = t.shape
    n = len(shape)
    if n > 4:
        raise RuntimeError(f"deepep-nccl: {name} must have at most 4 dimensions, got {n}")
    pad = _ZERO_DIMS[n:]
    return (t.data_ptr(), code, n, *shape, *pad, *t.stride(), *pad)


_PROTOTYPES = {
    "deepep_abi_version": (c_uint32, []),
    "deepep_library_version": (c_char_p, []),
    "deepep_nccl_compiled_version": (c_int, []),
    "deepep_nccl_runtime_version": (c_int, [POINTER(c_int)]),
    "deepep_last_error": (c_char_p, []),
    "deepep_status_string": (c_char_p, [c_int]),
    "deepep_device_count": (c_int, [POINTER(c_int)]),
    "deepep_get_unique_id": (c_int, [c_char_p, c_size_t]),
    "deepep_buffer_create": (
        c_int,
        [c_int, c_int, c_char_p, c_size_t, c_int64, c_int64, c_bool, c_bool, c_bool, POINTER(c_void_p)],
    ),
    "deepep_buffer_destroy": (c_int, [c_void_p]),
    "deepep_buffer_free": (c_int, [c_void_p]),
    "deepep_buffer_get_local_device_id": (c_int, [c_void_p, POINTER(c_int)]),
    "deepep_buffer_get_num_device_sms": (c_int, [c_void_p, POINTER(c_int)]),
    "deepep_buffer_is_available": (c_int, [c_void_p, POINTER(c_bool)]),
    "deepep_buffer_get_local_buffer": (c_int, [c_void_p, c_bool, POINTER(c_void_p), POINTER(c_int64)]),
    "deepep_buffer_barrier": (c_int, [c_void_p]),
    "deepep_buffer_check_peers": (c_int, [c_void_p]),
    "deepep_buffer_set_gpu_timeout_ms": (c_int, [c_void_p, c_uint64]),
    # Descriptors and the stream travel as plain addresses (ints): the cheapest ctypes conversion.
    "deepep_get_dispatch_layout": (
        c_int,
        [c_void_p, c_void_p, c_int, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p],
    ),
    "deepep_intranode_dispatch_prepare": (c_int, [c_void_p, c_void_p, c_void_p, c_void_p, c_int, c_void_p]),
    "deepep_intranode_dispatch": (c_int, [c_void_p, c_void_p, c_void_p, c_void_p]),
    "deepep_intranode_combine": (c_int, [c_void_p, c_void_p, c_void_p]),
    "deepep_low_latency_check_shape": (c_int, [c_int64, c_int64, c_int, c_int]),
    "deepep_low_latency_dispatch": (c_int, [c_void_p, c_void_p, c_void_p, c_void_p]),
    "deepep_low_latency_combine": (c_int, [c_void_p, c_void_p, c_void_p, c_void_p]),
    "deepep_clean_low_latency_buffer": (c_int, [c_void_p, c_int, c_int, c_int, c_void_p]),
    "deepep_get_next_low_latency_combine_buffer": (c_int, [c_void_p, c_int, c_int, c_int, POINTER(DeepepTensor)]),
    "deepep_low_latency_update_mask_buffer": (c_int, [c_void_p, c_int, c_bool, c_void_p]),
    "deepep_low_latency_query_mask_buffer": (c_int, [c_void_p, c_void_p, c_void_p]),
    "deepep_low_latency_clean_mask_buffer": (c_int, [c_void_p, c_void_p]),
    "deepep_config_init": (c_int, [POINTER(DeepepConfig), c_int, c_int, c_int, c_int, c_int]),
    "deepep_config_default": (c_int, [POINTER(DeepepConfig), c_int, c_int, c_int]),
    "deepep_config_nvl_buffer_size_hint": (c_int, [POINTER(DeepepConfig), c_int64, c_int, POINTER(c_int64)]),
    "deepep_config_rdma_buffer_size_hint": (c_int, [POINTER(DeepepConfig), c_int64, c_int, POINTER(c_int64)]),
    "deepep_low_latency_rdma_size_hint": (c_int, [c_int64, c_int64, c_int, c_int, POINTER(c_int64)]),
    "deepep_check_buffer_args": (c_int, [c_int, c_int, c_int64, c_int64, c_bool]),
    "deepep_low_latency_dispatch_outputs": (
        c_int,
        [c_void_p, c_int64, c_int64, c_int, c_bool, c_bool, POINTER(DeepepOutputs)],
    ),
    "deepep_low_latency_combine_outputs": (c_int, [c_void_p, c_int64, c_int64, POINTER(DeepepOutputs)]),
    # Output geometry of the layout and the normal-mode ops (writes a DeepepOutputs).
    "deepep_get_dispatch_layout_outputs": (c_int, [c_void_p, c_int64, c_int, c_void_p]),
    "deepep_intranode_dispatch_handle_outputs": (c_int, [c_void_p, c_void_p, c_void_p]),
    "deepep_intranode_dispatch_outputs": (c_int, [c_void_p, c_void_p, c_int, c_void_p]),
    "deepep_intranode_combine_outputs": (c_int, [c_void_p, c_void_p, c_void_p]),
}


def _candidates():
    here = Path(__file__).resolve().parent
    env = os.environ.get("DEEPEP_NCCL_LIBRARY")
    paths = [Path(env)] if env else []
    paths.append(here / "libdeepep_nccl.so")
    # A source checkout: compat/python/deep_ep_cpp -> <repo>/target/release.
    if len(here.parents) > 2:
        paths.append(here.parents[2] / "target" / "release" / "libdeepep_nccl.so")
    return paths


def _load():
    tried = _candidates()
    for path in tried:
        if not path.is_file():
            continue
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            raise ImportError(f"deepep-nccl: cannot load {path}: {e}") from e
        for name, (restype, argtypes) in _PROTOTYPES.items():
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
        version = lib.deepep_abi_version()
        if version != ABI_VERSION:
            raise ImportError(f"deepep-nccl: {path} has C ABI version {version}; this package needs {ABI_VERSION}")
        return lib, path
    raise ImportError(
        "deepep-nccl: libdeepep_nccl.so not found; tried (set DEEPEP_NCCL_LIBRARY to its path): "
        + ", ".join(str(p) for p in tried)
    )


lib, LIBRARY_PATH = _load()


def raise_status(status):
    """Raises the exception for a failed call; reads this thread's last error at once."""
    message = lib.deepep_last_error().decode(errors="replace")
    if status == ERROR_UNSUPPORTED:
        raise NotImplementedError(message)
    raise RuntimeError(f"{lib.deepep_status_string(status).decode()}: {message}")


def raise_driver_error(code):
    """Raises for a failed CUDA driver call of the compiled host path's stream ordering."""
    raise RuntimeError(f"deepep-nccl: CUDA driver error {code} while ordering the comm and compute streams")


def check(status):
    if status:
        raise_status(status)


def require_torch():
    if torch is None:
        raise ModuleNotFoundError("deepep-nccl: this needs PyTorch (import torch failed)", name="torch")
    return torch
