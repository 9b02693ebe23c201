"""Host overhead of the ctypes fallback path per call, without torch and without a GPU.

    python bench/ctypes_overhead_cpu.py [PACKAGE_DIR] [--calls N]

PACKAGE_DIR holds the deep_ep_cpp package to measure (default: compat/python of this checkout);
e.g. an older version's files from `git show REV:compat/python/deep_ep_cpp/...`. A stand-in
`torch` module (tensors with .shape/.dtype/.stride()/.data_ptr()/.dim(), constant-cost
torch.empty & co.) replaces torch, and a stand-in of the library replaces every C call that
needs a live buffer or a GPU: the ops return 0 and the output-geometry queries
(deepep_*_outputs, which need a live handle) fill a DeepepOutputs as src/outputs.rs does for
that shape. Everything else (ABI constants, configs) comes from the real libdeepep_nccl.so
(DEEPEP_NCCL_LIBRARY or target/release). What is timed is the Python between the op's entry on
the ctypes path and its return: what the package itself costs per call, torch's own costs
excluded (a real torch.empty is ~1-2 us more per output on both sides)."""
import contextlib
import ctypes
import os
import struct
import sys
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# --- a stand-in torch ------------------------------------------------------------------------


class _Dtype:
    def __init__(self, name, size):
        self.name, self.itemsize = name, size

    def __repr__(self):
        return f"torch.{self.name}"


_DTYPES = {n: _Dtype(n, s) for n, s in (("bool", 1), ("uint8", 1), ("int32", 4), ("int64", 8), ("float32", 4),
                                       ("bfloat16", 2), ("float16", 2), ("float8_e4m3fn", 1))}


def _contiguous(shape):
    strides, step = [], 1
    for d in reversed(shape):
        strides.insert(0, step)
        step *= max(d, 1)
    return tuple(strides)


class Size(tuple):
    """torch.Size: a tuple subclass (slicing one returns a Size, as torch's does)."""

    def __getitem__(self, i):
        r = tuple.__getitem__(self, i)
        return Size(r) if isinstance(i, slice) else r


class Tensor:
    __slots__ = ("shape", "dtype", "_strides", "_ptr", "device")

    def __init__(self, shape, dtype, strides=None, ptr=0x10000, device=None):
        self.shape = Size(shape)
        self.dtype = dtype
        self._strides = _contiguous(shape) if strides is None else tuple(strides)
        self._ptr, self.device = ptr, device

    def stride(self):
        return self._strides

    def data_ptr(self):
        return self._ptr

    def dim(self):
        return len(self.shape)

    def get_device(self):
        return 0

    def element_size(self):
        return self.dtype.itemsize

    def split_with_sizes(self, sizes):
        out, at = [], self._ptr
        for n in sizes:
            out.append(Tensor((n,), self.dtype, (1,), at, self.device))
            at += n * self.dtype.itemsize
        return out

    def view(self, *shape):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = shape[0]
        return Tensor(tuple(shape), self.dtype, None, self._ptr, self.device)

    def as_strided(self, shape, strides, offset=0):
        return Tensor(tuple(shape), self.dtype, strides, self._ptr + offset * self.dtype.itemsize, self.device)

    def record_stream(self, stream):
        pass


def _empty(*shape, dtype=None, device=None):
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = shape[0]
    return Tensor(tuple(shape), dtype, None, 0x10000, device)


def _empty_strided(shape, strides, dtype=None, device=None):
    return Tensor(tuple(shape), dtype, strides, 0x10000, device)


def pop_calls(args, default=20000):
    """`--calls N` taken out of the argument list `args`: N, else `default`."""
    if "--calls" not in args:
        return default
    i = args.index("--calls")
    calls = int(args[i + 1])
    del args[i:i + 2]
    return calls


def best_us_per_call(op, calls, rounds=5):
    """The best of `rounds` rounds of `calls` back-to-back calls of op(), in us per call."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            op()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def install_fake_torch():
    torch = types.ModuleType("torch")
    torch.__dict__.update(_DTYPES)
    torch.Tensor, torch.Size = Tensor, Size
    torch.empty, torch.empty_strided = _empty, _empty_strided
    torch.device = lambda *a: ("cuda", *a[1:])
    torch.cuda = types.SimpleNamespace(is_available=lambda: False, current_device=lambda: 0)
    torch.overrides = types.SimpleNamespace()
    torch._C = types.SimpleNamespace(DisableTorchFunction=contextlib.nullcontext,
                                   DisableTorchFunctionSubclass=contextlib.nullcontext)
    sys.modules["torch"] = torch
    return torch


# --- a stand-in library: the real one, with the calls that need a buffer or a GPU replaced ----


class _Outputs:
    """src/outputs.rs's push / push_after / push_absent / push_strided, into a DeepepOutputs."""

    def __init__(self, lib_module, out):
        self.L, self.o = lib_module, out

    def _view(self, code, shape, strides, g, offset):
        L, o = self.L, self.o
        i = o.count
        t = o.tensors[i]
        t.data, t.dtype, t.ndim = None, code, len(shape)
        for k, (d, s) in enumerate(zip(shape, strides)):
            t.shape[k], t.strides[k] = d, s
        o.allocation[i], o.offset[i] = g, offset
        o.count += 1
        return i

    def push_strided(self, code, shape, strides):
        o = self.o
        g = o.num_allocations
        o.allocation_dtype[g] = code
        o.allocation_elems[g] = 0 if 0 in shape else 1 + sum((d - 1) * s for d, s in zip(shape, strides))
        o.num_allocations += 1
        return self._view(code, shape, strides, g, 0)

    def push(self, code, shape):
        return self.push_strided(code, shape, _contiguous(shape))

    def push_after(self, first, shape):
        o = self.o
        g = o.allocation[first]
        offset = o.allocation_elems[g]
        n = 1
        for d in shape:
            n *= d
        o.allocation_elems[g] = offset + n
        return self._view(o.allocation_dtype[g], shape, _contiguous(shape), g, offset)

    def push_absent(self):
        o = self.o
        o.allocation[o.count] = -1
        o.count += 1


class FakeLib:
    """The real library (ctypes.CDLL), with deepep_abi_version answering what the package under
    test expects and the ops and output queries that need a live buffer replaced."""

    def __init__(self, real, abi_version):
        self._real = real
        self.deepep_abi_version = _Fn(lambda: abi_version)

    def __getattr__(self, name):  # once per name: the result is cached as an attribute
        try:
            fn = getattr(self._real, name)
        except AttributeError:  # an entry of another version: a stand-in that succeeds
            fn = _Fn(lambda *a: 0)
        setattr(self, name, fn)
        return fn

    def override(self, name, fn):
        setattr(self, name, _Fn(fn))


class _Fn:
    """A Python callable that takes restype/argtypes like a ctypes function (and ignores them)."""

    def __init__(self, fn):
        self.fn, self.restype, self.argtypes = fn, None, None

    def __call__(self, *a):
        return self.fn(*a)


_PRINTED = set()


def main():
    args = sys.argv[1:]
    calls = pop_calls(args)
    pkg = Path(args[0]).resolve() if args else REPO / "compat" / "python"
    os.environ["DEEPEP_NCCL_FAST"] = "0"  # the ctypes path
    torch = install_fake_torch()

    real_path = os.environ.get("DEEPEP_NCCL_LIBRARY") or str(REPO / "target" / "release" / "libdeepep_nccl.so")
    real = ctypes.CDLL(real_path)
    version_file = pkg / "deep_ep_cpp" / "_abi_version.py"
    if version_file.is_file():
        ns = {}
        exec(version_file.read_text(), ns)
        abi = ns["ABI_VERSION"]
    else:  # older packages spell it in _lib.py
        import re
        abi = int(re.search(r"^ABI_VERSION = (\d+)", (pkg / "deep_ep_cpp" / "_lib.py").read_text(), re.M).group(1))
    fake = FakeLib(real, abi)
    real_cdll = ctypes.CDLL
    ctypes.CDLL = lambda path, *a, **k: fake if str(path).endswith("libdeepep_nccl.so") else real_cdll(path, *a, **k)
    os.environ["DEEPEP_NCCL_LIBRARY"] = real_path
    sys.path.insert(0, str(pkg))
    import deep_ep_cpp
    from deep_ep_cpp import _lib
    ctypes.CDLL = real_cdll
    assert _lib.lib is fake
    L = _lib

    R, E, T, H, K, S = 8, 256, 128, 7168, 8, 56
    num_sms = 20
    C = num_sms // 2

    def outputs_of(pointer):
        out = pointer._obj if hasattr(pointer, "_obj") else L.DeepepOutputs.from_address(pointer)
        ctypes.memset(ctypes.addressof(out), 0, ctypes.sizeof(out))
        return _Outputs(L, out)

    def layout_outputs(handle, num_tokens, num_experts, out):
        o = outputs_of(out)
        first = o.push(L.DTYPE_INT32, (R,))
        o.push_absent()
        o.push_after(first, (num_experts,))
        o.push(L.DTYPE_BOOL, (num_tokens, R))
        return 0

    def read_int(addr, at):
        return struct.unpack_from("@i", (ctypes.c_char * (at + 4)).from_address(addr), at)[0]

    def handle_outputs(handle, args_addr, out):
        o = outputs_of(out)
        cached = num_tokens = None
        if hasattr(L, "ArgsLayout"):
            from deep_ep_cpp import _normal
            cached = read_int(args_addr, _normal._DISPATCH.offset("cached"))
            num_tokens = struct.unpack_from("@q", (ctypes.c_char * 64).from_address(args_addr), 16)[0]
        if cached:
            o.push_absent()
            o.push_absent()
            first = o.push(L.DTYPE_INT32, (R, C))
        else:
            first = o.push(L.DTYPE_INT32, (R, R))
            o.push_after(first, (R, C))
            o.push_after(first, (R, C))
        o.push_after(first, (num_tokens, R))
        return 0

    def recv_outputs(handle, args_addr, num_recv, out):
        from deep_ep_cpp import _normal
        o = outputs_of(out)
        cached = read_int(args_addr, _normal._DISPATCH.offset("cached"))
        o.push(L.DTYPE_BFLOAT16, (num_recv, H))
        o.push(L.DTYPE_FLOAT32, (num_recv, S))
        if cached:
            o.push_absent()
            o.push_absent()
        else:
            o.push(L.DTYPE_INT64, (num_recv, K))
            o.push(L.DTYPE_FLOAT32, (num_recv, K))
        o.push(L.DTYPE_INT32, (num_recv,))
        return 0

    def combine_outputs(handle, args_addr, out):
        o = outputs_of(out)
        o.push(L.DTYPE_BFLOAT16, (T, H))
        o.push(L.DTYPE_FLOAT32, (T, K))
        return 0

    ll_m, ll_el = 128, E // R

    def ll_dispatch_outputs(handle, m, hidden, num_experts, use_fp8, use_ue8m0, out):
        o = outputs_of(out)
        rows = R * m
        o.push(L.DTYPE_FLOAT8_E4M3 if use_fp8 else L.DTYPE_BFLOAT16, (ll_el, rows, hidden))
        if use_fp8:
            cols = hidden // 128
            o.push_strided(L.DTYPE_FLOAT32, (ll_el, rows, cols), (cols * rows, 1, rows))
        else:
            o.push_absent()
        o.push(L.DTYPE_INT32, (ll_el,))
        o.push(L.DTYPE_INT32, (ll_el, rows))
        o.push(L.DTYPE_INT64, (ll_el, R))
        return 0

    def ll_combine_outputs(handle, num_tokens, hidden, out):
        o = outputs_of(out)
        o.push(L.DTYPE_BFLOAT16, (num_tokens, hidden))
        return 0

    def prepare(handle, args_addr, num_recv_addr, per_expert_addr, max_experts, stream):
        cached = read_int(args_addr, struct.calcsize("@" + "Pii4q4q" * 11 + "5i"))
        ctypes.c_int.from_address(num_recv_addr).value = -1 if cached else 1000
        return 0

    from deep_ep_cpp import _low_latency
    _low_latency.stream_wait_stream = lambda *a: None
    b = deep_ep_cpp.Buffer(0, R, 1 << 30, 1 << 30, True, False, False, False)
    b._handle, b._device_id, b._device, b._comm_stream_ptr = 0x1234, 0, ("cuda", 0), 0
    b._comm_stream, b._sync_event = "comm", None
    b._num_layout_rdma_ranks = 0  # older packages read it (set at sync)
    b._current_stream = lambda: "compute"
    b._order_before = lambda *a: None
    b._ll_fast = b._ll_ops = None  # the ctypes path (older packages: _ll_fast)
    for name, fn in (("deepep_get_dispatch_layout_outputs", layout_outputs),
                     ("deepep_intranode_dispatch_handle_outputs", handle_outputs),
                     ("deepep_intranode_dispatch_outputs", recv_outputs),
                     ("deepep_intranode_combine_outputs", combine_outputs),
                     ("deepep_low_latency_dispatch_outputs", ll_dispatch_outputs),
                     ("deepep_low_latency_combine_outputs", ll_combine_outputs),
                     ("deepep_intranode_dispatch_prepare", prepare)):
        fake.override(name, fn)
    for name in ("deepep_get_dispatch_layout", "deepep_intranode_dispatch", "deepep_intranode_dispatch_fused",
                 "deepep_intranode_combine", "deepep_low_latency_dispatch", "deepep_low_latency_combine"):
        fake.override(name, lambda *a: 0)

    if hasattr(b, "_layout_fn"):
        b._layout_fn = fake.deepep_get_dispatch_layout
    if hasattr(b, "_layout_outputs_fn"):
        b._layout_outputs_fn = fake.deepep_get_dispatch_layout_outputs
    config = deep_ep_cpp.Config(num_sms, 6, 256, 6, 128)

    bf16, f32, i64, i32 = torch.bfloat16, torch.float32, torch.int64, torch.int32
    topk_idx = Tensor((T, K), i64)
    x = Tensor((T, H), bf16)
    x_scales = Tensor((T, S), f32)
    topk_weights = Tensor((T, K), f32)
    per_rank = Tensor((R,), i32)
    per_expert = Tensor((E,), i32)
    in_rank = Tensor((T, R), torch.bool)
    rank_prefix, channel_prefix = Tensor((R, R), i32), Tensor((R, C), i32)
    send_head = Tensor((T, R), i32)
    recv_x, recv_w, src_idx = Tensor((1000, H), bf16), Tensor((1000, K), f32), Tensor((1000,), i32)

    handle = b._handle
    ops = {
        "get_dispatch_layout": lambda: b._layout_ctypes(handle, topk_idx, E),
        "dispatch (non-cached)": lambda: b._dispatch_ctypes(
            handle, x, x_scales, topk_idx, topk_weights, per_rank, in_rank, per_expert, 0, None, None, 1, 0, config),
        "dispatch (cached)": lambda: b._dispatch_ctypes(
            handle, x, x_scales, None, None, None, in_rank, None, 1000, rank_prefix, channel_prefix, 1, 0, config),
        "combine": lambda: b._combine_ctypes(handle, recv_x, recv_w, None, None, src_idx, rank_prefix,
                                             channel_prefix, send_head, config),
        "low_latency_dispatch": lambda: b.low_latency_dispatch(
            x, topk_idx, None, None, ll_m, E, False, False, False, False, False),
        "low_latency_combine": lambda: b.low_latency_combine(
            Tensor((ll_el, R * ll_m, H), bf16), topk_idx, topk_weights, Tensor((ll_el, R * ll_m), i32),
            Tensor((ll_el, R), i64), None, ll_m, E, False, False, False, False),
    }
    print(f"package: {pkg}  ({calls} calls per op, best of 5)")
    for name, op in ops.items():
        try:
            op()
        except Exception as e:  # noqa: BLE001  (an op this version does not have)
            print(f"  {name:24s} n/a ({type(e).__name__}: {e})")
            continue
        print(f"  {name:24s} {best_us_per_call(op, calls):7.2f} us/call")
    b._handle = None  # nothing to free


if __name__ == "__main__":
    main()
