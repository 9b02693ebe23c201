"""Host steps per call of the compiled host path, through deep_ep.Buffer's public API, on a CPU.

    python bench/host_steps_cpu.py [PACKAGE_DIR] [--calls N]
    python bench/host_steps_cpu.py --torch-calls [PACKAGE_DIR] [--calls N]   (needs a real torch)

A CPU proxy for bench_normal.py's host rows, bench_layout.py and bench_ll_host.py: the Python
between deep_ep.Buffer's entry and the compiled op's return, with ctypes_overhead_cpu.py's stand-in
torch and a stand-in of the compiled module (deep_ep_cpp/_fast.cpp) whose ops return their
outputs at once. Per op it counts what Python does that a GPU run pays for (C ABI calls through
ctypes, calls into the compiled module, CUDA event and current-stream calls, torch allocations,
record_stream) and times the rest. Where the package has direct entries (_fast_direct.h), they are bound as sync() binds them, so the
ops run deep_ep.Buffer's Python and then the stand-in entry. PACKAGE_DIR holds the deep_ep and deep_ep_cpp to measure
(default: compat/python of this checkout), e.g. an older version's from `git archive`. What the compiled module does inside (allocations, driver
calls, C ABI calls) is not seen here: see the module's sources.

--torch-calls: the LL ops (dispatch, combine, each with its hook, the hook call alone, and
clean_low_latency_buffer) with the real torch (CPU tensors; the stand-in compiled module and
streams as above), counting the torch calls made from Python: those a TorchFunctionMode sees
(what torch.set_default_device('cuda'), DeepEP's tests' default, makes cost ~1 us each), and all
of them (also those under the package's DisableTorchFunction). Times each op with and without
set_default_device('cuda') (no GPU needed: nothing on these paths allocates through it). The
ctypes path's C ABI calls are Python stand-ins here (clean_low_latency_buffer's too), so a real
ctypes call's cost (~0.5-1 us) is not in these times.

--torch-calls binds no direct entry: it measures the class methods (the direct entries' fallback,
and every call of a package without them).

--compiled: the same LL ops (bench_ll_host.py's: dispatch, dispatch + hook(), combine, combine +
hook(), the hooks alone, clean_low_latency_buffer) through deep_ep.Buffer's public API and the
real compiled module (its direct entries bound where it has them), built here from PACKAGE_DIR's deep_ep_cpp/_fast*.{cpp,h} against the real
(CPU) torch with two substitutions (CPU tensors pass its device check; it allocates on the CPU).
Below it, C stand-ins (compiled here) of the five C ABI entries of LlOps (each returns 0 at once)
and of the six CUDA driver entry points of _fast_streams.h (a libcuda.so.1 whose calls return 0).
So the times are the package's Python, pybind11, the compiled op and hook objects and torch's CPU
allocations (a small shape: no large malloc); the library's own work and a real launch are not in
them (bench_ll_host.py on a GPU has both)."""
import collections
import contextlib
import ctypes
import importlib.util
import os
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("ctypes_overhead_cpu", REPO / "bench" / "ctypes_overhead_cpu.py")
fakes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fakes)

COUNTS = collections.Counter()


def counted(name, fn):
    def call(*a, **k):
        COUNTS[name] += 1
        return fn(*a, **k)
    return call


class _Event:
    def __init__(self, *a, **k):
        COUNTS["torch.cuda.Event()"] += 1

    def record(self, stream=None):
        COUNTS["event record"] += 1

    def wait(self, stream=None):
        COUNTS["event wait"] += 1


class _Stream:
    def __init__(self, stream_id=0, device_index=0, device_type=1):
        self.cuda_stream = stream_id


def install_torch():
    torch = fakes.install_fake_torch()
    torch.empty = counted("torch.empty", torch.empty)
    torch.empty_strided = counted("torch.empty", torch.empty_strided)
    torch.cuda = types.SimpleNamespace(is_available=lambda: False, current_device=lambda: 0, Event=_Event, Stream=_Stream,
                                       set_stream=counted("set_stream", lambda s: None))
    torch._C = types.SimpleNamespace(
        DisableTorchFunction=contextlib.nullcontext, DisableTorchFunctionSubclass=contextlib.nullcontext,
        _cuda_getCurrentStream=counted("current stream", lambda d: (7, d, 1)), _CudaEventBase=_Event)
    torch.Tensor.record_stream = counted("record_stream", lambda self, s: None)
    torch.Tensor.size = lambda self, d=None: self.shape if d is None else self.shape[d]
    torch.dtype = fakes._Dtype
    dist = types.ModuleType("torch.distributed")
    dist.ProcessGroup = object
    torch.distributed = dist
    sys.modules["torch.distributed"] = dist
    return torch


def bind_direct_entries(rt):
    """What sync() does last where the package has direct entries (_fast_direct.h): the compiled
    ops' entries become the runtime's methods. The comm stream is the made-up one set already."""
    if hasattr(rt, "_bind_direct_entries"):
        rt.get_comm_stream = lambda: rt._comm_stream
        rt._bind_direct_entries()


def mirror_ll_constants(module, low_latency):
    """The LL constants the package asserts the compiled module has, taken from the package
    (an older one, PACKAGE_DIR, may have none of them)."""
    for name in ("NEW_SHAPE", "MAX_DISPATCH_SHAPES"):
        if hasattr(low_latency, "_" + name):
            setattr(module, name, getattr(low_latency, "_" + name))


class FakeFast(types.ModuleType):
    """The compiled module's interface; each op returns (0, outputs...) at once."""

    def __init__(self, T, H, R, C, K, E):
        super().__init__("_deepep_fast")
        from deep_ep_cpp import _low_latency, _streams
        self.DISPATCH_ARGS_BYTES = _low_latency._DISPATCH_ARGS.size
        self.COMBINE_ARGS_BYTES = _low_latency._COMBINE_ARGS.size
        self.BAD_INPUT, self.DRIVER_ERROR = -2, -3
        self.ORDER_BEFORE, self.ORDER_AFTER = _streams.ORDER_BEFORE, _streams.ORDER_AFTER
        Tn, bf16, i32, f32 = fakes.Tensor, fakes._DTYPES["bfloat16"], fakes._DTYPES["int32"], fakes._DTYPES["float32"]
        per_rank, in_rank = Tn((R,), i32), Tn((T, R), fakes._DTYPES["bool"])
        recv_x, src_idx, handle = Tn((1000, H), bf16), Tn((1000,), i32), Tn((R, C), i32)
        combined = Tn((T, H), bf16)
        hook = counted("hook()", lambda: None)

        class NormalOps:
            def __init__(self, *a):
                pass

            def layout(self, *a):
                COUNTS["fast op"] += 1
                return 0, per_rank, None, Tn((E,), i32), in_rank

            def dispatch(self, *a):
                COUNTS["fast op"] += 1
                return 0, recv_x, None, None, None, [], handle, handle, handle, src_idx, handle

            def combine(self, *a):
                COUNTS["fast op"] += 1
                return 0, combined, Tn((T, K), f32)

            def bind_buffer(self, *a):
                pass

            # The direct entries (_fast_direct.h, bound on the Buffer by sync()): DeepEP's tuple at
            # once (event None); the current stream is read in C++.
            def get_dispatch_layout(self, *a):
                return self.layout()[1:] + (None,)

            def intranode_dispatch(self, *a):
                return self.dispatch()[1:] + (None,)

            def intranode_combine(self, *a):
                return self.combine()[1:] + (None,)

        def ll_combine(*a):
            COUNTS["fast op"] += 1
            return 0, combined, hook if a[16] == 1 else None  # phases: send only -> hook

        class LlOps:  # the interface since LlOps (older packages: ll_combine)
            def __init__(self, *a):
                pass

            def combine(self, *a):
                COUNTS["fast op"] += 1
                return 0, combined, hook if a[12] == 1 else None

            def bind_buffer(self, *a):
                pass

            def _ll_combine(self, *a):  # a direct entry; return_recv_hook is its 12th argument
                COUNTS["fast op"] += 1
                return combined, None, hook if a[11] else None

            low_latency_combine = _ll_combine

        self.NormalOps, self.InternodeOps = NormalOps, NormalOps
        self.ll_combine, self.LlOps = ll_combine, LlOps
        # The direct entries these stand-ins have (the LL dispatch is not timed here).
        self.NORMAL_DIRECT_ENTRIES = ("get_dispatch_layout", "intranode_dispatch", "intranode_combine")
        self.LL_DIRECT_ENTRIES = ("low_latency_combine", "_ll_combine")
        mirror_ll_constants(self, _low_latency)
        self.StreamOrder = lambda device: types.SimpleNamespace(usable=lambda: True)
        self.LlCombineOutputs = lambda fn: object()
        self.set_status_raiser = lambda fn: None


# --- --torch-calls: the LL ops with the real torch --------------------------------------------


class FakeLlFast(types.ModuleType):
    """The compiled module's LL interface over real CPU tensors; each op returns at once. Both the
    interface before the LlOps object (LlDispatchPlan, ll_combine) and LlOps', so that an older
    package (PACKAGE_DIR) measures too. Its hooks are Python stand-ins of the C++ hook."""

    def __init__(self, torch, T, H, R, M, E, K):
        super().__init__("_deepep_fast")
        from deep_ep_cpp import _low_latency, _streams
        self.DISPATCH_ARGS_BYTES = _low_latency._DISPATCH_ARGS.size
        self.COMBINE_ARGS_BYTES = _low_latency._COMBINE_ARGS.size
        self.BAD_INPUT, self.DRIVER_ERROR = -2, -3
        mirror_ll_constants(self, _low_latency)
        self.ORDER_BEFORE, self.ORDER_AFTER = _streams.ORDER_BEFORE, _streams.ORDER_AFTER
        el = E // R
        recv = (torch.empty(el, R * M, H, dtype=torch.float8_e4m3fn), torch.empty(el, R * M, H // 128),
                torch.empty(el, dtype=torch.int32), torch.empty(el, R * M, dtype=torch.int32),
                torch.empty(el, R, dtype=torch.int64))
        combined = torch.empty(T, H, dtype=torch.bfloat16)
        hook = counted("hook()", lambda: None)
        known = set()

        def hook_if(phases):
            return hook if phases == 1 else None  # send only -> the receive hook

        class LlDispatchPlan:
            def __init__(self, *a):
                pass

            def run(self, *a):
                COUNTS["fast op"] += 1
                return (0, *recv, hook_if(a[6]))

        def ll_combine(*a):
            COUNTS["fast op"] += 1
            return 0, combined, hook_if(a[16])

        class LlOps:
            def __init__(self, *a):
                pass

            def dispatch(self, x, topk_idx, stats, cost, m, e, fp8, round_scale, ue8m0, phases, *a):
                COUNTS["fast op"] += 1
                key = (m, H, e, bool(fp8), bool(round_scale), bool(ue8m0))
                if key not in known:
                    return (-4,)
                return (0, *recv, hook_if(phases), H)

            def add_dispatch_shape(self, m, h, e, fp8, round_scale, ue8m0, *a):
                known.add((m, h, e, bool(fp8), bool(round_scale), bool(ue8m0)))

            def combine(self, *a):
                COUNTS["fast op"] += 1
                return 0, combined, hook_if(a[12])

            def clean(self, *a):
                COUNTS["fast op"] += 1
                return (0,)

        self.LlDispatchPlan, self.ll_combine, self.LlOps = LlDispatchPlan, ll_combine, LlOps
        self.StreamOrder = lambda device: types.SimpleNamespace(usable=lambda: True)
        self.LlCombineOutputs = lambda fn: object()
        self.set_status_raiser = lambda fn: None


def ll_dispatch_outputs(R, el):
    """A stand-in of deepep_low_latency_dispatch_outputs for R ranks of el local experts: DeepEP's
    five LL dispatch outputs (FP8 or BF16 rows, column-major scales, counts, src_info, layout_range)."""
    from deep_ep_cpp import _lib

    def dispatch_outputs(handle, m, hidden, num_experts, use_fp8, use_ue8m0, out):
        ctypes.memset(ctypes.addressof(out._obj), 0, ctypes.sizeof(out._obj))
        o = fakes._Outputs(_lib, out._obj)
        o.push(_lib.DTYPE_FLOAT8_E4M3 if use_fp8 else _lib.DTYPE_BFLOAT16, (el, R * m, hidden))
        o.push_strided(_lib.DTYPE_FLOAT32, (el, R * m, hidden // 128), (hidden // 128 * R * m, 1, R * m))
        o.push(_lib.DTYPE_INT32, (el,))
        o.push(_lib.DTYPE_INT32, (el, R * m))
        o.push(_lib.DTYPE_INT64, (el, R))
        return 0

    return dispatch_outputs


def ll_ops_to_time(buffer, x, topk_idx, topk_weights, stats, expert_out, handle, M, H, E, hooks):
    """The LL ops both proxies time, named as bench_ll_host.py names them; `hooks` holds a
    zero-argument callable per kind that calls one fresh receive hook."""
    return {
        "dispatch": lambda: buffer.low_latency_dispatch(x, topk_idx, M, E, cumulative_local_expert_recv_stats=stats),
        "dispatch hook (send + hook())": lambda: buffer.low_latency_dispatch(
            x, topk_idx, M, E, cumulative_local_expert_recv_stats=stats, return_recv_hook=True)[-1](),
        "dispatch hook() alone": hooks["dispatch"],
        "combine": lambda: buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle),
        "combine hook (send + hook())": lambda: buffer.low_latency_combine(
            expert_out, topk_idx, topk_weights, handle, return_recv_hook=True)[-1](),
        "combine hook() alone": hooks["combine"],
        "clean_low_latency_buffer": lambda: buffer.clean_low_latency_buffer(M, H, E),
    }


def torch_calls(pkg, calls):
    import torch
    from torch.overrides import TorchFunctionMode

    os.environ["DEEPEP_NCCL_FAST"] = "0"  # the stand-in is put in place below
    sys.path.insert(0, str(pkg))
    import deep_ep
    import deep_ep_cpp
    from deep_ep_cpp import _lib, _streams
    lib = _lib.lib

    R, E, T, H, K, M = 2, 288, 128, 7168, 8, 128
    el = E // R
    # No GPU: the current stream is a made-up one (its lookup is still a call into torch._C).
    _streams._current_stream_key = lambda device: (7, 0, 1)
    torch.cuda.Stream = _Stream
    torch.cuda.Event = _Event

    fast = FakeLlFast(torch, T, H, R, M, E, K)
    rt = deep_ep_cpp.Buffer(0, R, 0, 1 << 30, True, True, False, False)
    # CPU tensors: device -1 (what their get_device() says) passes the ctypes path's device check.
    rt._handle, rt._device_id, rt._device = 0x1234, -1, torch.device("cpu")
    rt._comm_stream, rt._comm_stream_ptr, rt._sync_event = _Stream(9), 9, _Event()
    rt._fast = fast
    rt._stream_order = fast.StreamOrder(0)
    rt._ll_init()
    if hasattr(rt, "_ll_sync"):
        rt._ll_sync()  # what sync() does for the LL ops
    lib.deepep_low_latency_dispatch_outputs = ll_dispatch_outputs(R, el)
    lib.deepep_clean_low_latency_buffer = counted("C ABI call (ctypes)", lambda *a: 0)
    buffer = object.__new__(deep_ep.Buffer)
    buffer.runtime, buffer.rank, buffer.group_size = rt, 0, R

    x = torch.empty(T, H, dtype=torch.bfloat16)
    topk_idx = torch.zeros(T, K, dtype=torch.int64)
    topk_weights = torch.ones(T, K)
    stats = torch.zeros(el, dtype=torch.int32)
    handle = buffer.low_latency_dispatch(x, topk_idx, M, E, cumulative_local_expert_recv_stats=stats)[2]
    expert_out = torch.empty(el, R * M, H, dtype=torch.bfloat16)
    # The hooks as deep_ep.Buffer returns them (the stand-in's here, so the count says whether
    # anything in Python wraps the compiled hook).
    hooks = {"dispatch": buffer.low_latency_dispatch(x, topk_idx, M, E, return_recv_hook=True)[-1],
             "combine": buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle,
                                                   return_recv_hook=True)[-1]}
    ops = ll_ops_to_time(buffer, x, topk_idx, topk_weights, stats, expert_out, handle, M, H, E, hooks)

    seen = collections.Counter()

    class Counting(TorchFunctionMode):
        def __torch_function__(self, func, types_, args=(), kwargs=None):
            seen[getattr(func, "__qualname__", None) or repr(func)] += 1
            return func(*args, **(kwargs or {}))

    def torch_calls_of(op, everywhere):
        """The torch calls one op makes from Python that a mode sees; `everywhere`: also those
        under the package's DisableTorchFunction (made a no-op for this count)."""
        saved = _streams._no_torch_function
        if everywhere:
            _streams._no_torch_function = contextlib.nullcontext
        try:
            seen.clear()
            with Counting():
                op()
            return sum(seen.values()), ", ".join(f"{k} {v}" for k, v in sorted(seen.items()))
        finally:
            _streams._no_torch_function = saved

    def timed(op):
        return fakes.best_us_per_call(op, calls)

    print(f"torch {torch.__version__}; {calls} calls per op, best of 5; torch calls from Python per call")
    print("| op | seen by a mode | all | us plain | us under set_default_device('cuda') | which (all) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, op in ops.items():
        op()
        n_mode, _ = torch_calls_of(op, False)
        n_all, which = torch_calls_of(op, True)
        plain = timed(op)
        torch.set_default_device("cuda")
        try:
            under = timed(op)
        finally:
            torch.set_default_device(None)
        print(f"| {name} | {n_mode} | {n_all} | {plain:.2f} | {under:.2f} | {which} |")
    rt._handle = None  # nothing to free


# --- --compiled: the LL ops through the real compiled module ---------------------------------

# C stand-ins of LlOps' C ABI entries (each returns 0 at once; a send flips the half as the library
# does) and of the CUDA driver entry points _fast_streams.h looks up in libcuda.so.1.
_STUB_ABI = r"""
#include "deepep_nccl.h"
static int half;
DeepepStatus deepep_low_latency_dispatch(const DeepepBuffer* b, const DeepepLowLatencyDispatchArgs* a, void* s,
                                         int* idx) {
  (void)b; (void)s;
  if (a->phases & DEEPEP_LL_PHASE_SEND) *idx = half ^= 1;
  return 0;
}
DeepepStatus deepep_low_latency_combine(const DeepepBuffer* b, const DeepepLowLatencyCombineArgs* a, void* s,
                                        int* idx) {
  (void)b; (void)s;
  if (a->phases & DEEPEP_LL_PHASE_SEND) *idx = half ^= 1;
  return 0;
}
DeepepStatus deepep_low_latency_combine_outputs(const DeepepBuffer* b, int64_t t, int64_t h, DeepepOutputs* o) {
  (void)b;
  DeepepOutputs z = {0};
  *o = z;
  o->count = o->num_allocations = 1;
  o->tensors[0].dtype = o->allocation_dtype[0] = DEEPEP_DTYPE_BFLOAT16;
  o->tensors[0].ndim = 2;
  o->tensors[0].shape[0] = t;
  o->tensors[0].shape[1] = o->tensors[0].strides[0] = h;
  o->tensors[0].strides[1] = 1;
  o->allocation_elems[0] = t * h;
  return 0;
}
DeepepStatus deepep_clean_low_latency_buffer(const DeepepBuffer* b, int m, int h, int e, void* s) {
  (void)b; (void)m; (void)h; (void)e; (void)s;
  half = 0;
  return 0;
}
DeepepStatus deepep_get_next_low_latency_combine_buffer(const DeepepBuffer* b, int m, int h, int e, DeepepTensor* o) {
  (void)b; (void)m; (void)h; (void)e; (void)o;
  return 1;
}
"""
_STUB_DRIVER = r"""
int cuEventCreate(void** e, unsigned f) { (void)f; *e = (void*)16; return 0; }
int cuEventDestroy_v2(void* e) { (void)e; return 0; }
int cuEventRecord(void* e, void* s) { (void)e; (void)s; return 0; }
int cuStreamWaitEvent(void* s, void* e, unsigned f) { (void)s; (void)e; (void)f; return 0; }
int cuStreamSynchronize(void* s) { (void)s; return 0; }
int cuCtxGetDevice(int* d) { *d = 0; return 0; }
"""
# What makes the module run on CPU tensors: (source, text, replacement), each found exactly as given.
_CPU_SUBSTITUTIONS = (
    ("_fast_common.h", "return t.is_cuda() && t.get_device() == device;", "return t.is_cpu() && device == 0;"),
    ("*", "at::kCUDA", "at::kCPU"),
    # The direct entries' current stream: none on a CPU (the CPU's default stream; handle 0, sent as
    # cudaStreamLegacy).
    ("_fast_direct.h", "c10::impl::getDeviceGuardImpl(on.type())->getStream(on)", "c10::Stream(c10::Stream::DEFAULT, on)"),
    ("_fast_direct.h", "reinterpret_cast<uintptr_t>(s.native_handle())", "uintptr_t(0)"),
)


def build_cpu_module(package_dir):
    """The compiled module of package_dir/deep_ep_cpp, with _CPU_SUBSTITUTIONS, built against the
    running torch (cached in the temporary directory by its sources); also loads the stand-in
    libcuda.so.1 first (_fast_streams.h finds it by its soname). Returns (module, the stand-in C
    ABI library)."""
    import hashlib
    import subprocess
    import sysconfig
    import tempfile
    from torch.utils import cpp_extension

    import torch
    from deep_ep_cpp import _fast, _fast_build

    src = package_dir / "deep_ep_cpp"
    header_dir = _fast._header_dir()
    texts = {}
    for name in _fast_build.SOURCES:
        text = (src / name).read_text()
        for target, old, new in _CPU_SUBSTITUTIONS:
            if target in (name, "*"):
                if target != "*":
                    assert text.count(old) == 1, (name, old)
                text = text.replace(old, new)
        texts[name] = text
    key = hashlib.sha256("\0".join((torch.__version__, sys.version, _STUB_ABI, _STUB_DRIVER,
                                    (header_dir / _fast_build.HEADER).read_text(), *texts.values())).encode())
    work = Path(tempfile.gettempdir()) / f"host_steps_compiled_{key.hexdigest()[:16]}"
    work.mkdir(exist_ok=True)
    for name, text in texts.items():
        (work / name).write_text(text)
    compiler = cpp_extension.get_cxx_compiler()

    def cc(source, target, *flags):
        (work / (target + ".c")).write_text(source)
        subprocess.run([compiler, "-x", "c", "-O2", "-shared", "-fPIC", f"-I{header_dir}", str(work / (target + ".c")),
                        "-o", str(work / target), *flags], check=True)
        return work / target

    ctypes.CDLL(str(cc(_STUB_DRIVER, "libcuda.so.1", "-Wl,-soname,libcuda.so.1")), mode=ctypes.RTLD_GLOBAL)
    abi = ctypes.CDLL(str(cc(_STUB_ABI, "libstub_abi.so")))
    target = work / (_fast_build.NAME + sysconfig.get_config_var("EXT_SUFFIX"))
    if target.is_file():
        return _fast._import(target), abi
    lib_dirs = cpp_extension.library_paths()
    partial = work / f"partial-{os.getpid()}.so"
    cmd = _fast_build.command(compiler, work / _fast_build.SOURCES[0], partial, header_dir=header_dir,
                              python_include=sysconfig.get_paths()["include"],
                              torch_includes=cpp_extension.include_paths(), cxx11_abi=torch._C._GLIBCXX_USE_CXX11_ABI,
                              lib_dirs=lib_dirs, rpaths=lib_dirs)
    subprocess.run(cmd, check=True)
    os.replace(partial, target)
    return _fast._import(target), abi


def compiled_ll_setup(pkg):
    """deep_ep.Buffer over the compiled module built from pkg (build_cpu_module), on CPU tensors of
    a small LL shape: a namespace of the buffer, its runtime, the inputs and the ops to time."""
    import torch

    os.environ["DEEPEP_NCCL_FAST"] = "0"  # the module built below is put in place by hand
    sys.path.insert(0, str(pkg))
    import deep_ep
    import deep_ep_cpp
    from deep_ep_cpp import _fast, _lib, _streams
    lib = _lib.lib

    # A small shape: the CPU allocator's cost stays small, as the CUDA caching allocator's does.
    R, E, T, H, K, M = 2, 8, 4, 256, 2, 8
    el = E // R
    fast, abi = build_cpu_module(pkg)
    for name in _fast.LL_OPS_ENTRIES:
        setattr(lib, name, getattr(abi, name))  # what _ll_sync() takes the addresses of

    lib.deepep_low_latency_dispatch_outputs = ll_dispatch_outputs(R, el)
    # No GPU: the current stream is a made-up one (its lookup is still a call).
    _streams._current_stream_key = lambda device: (7, 0, 1)
    torch.cuda.Stream = _Stream
    rt = deep_ep_cpp.Buffer(0, R, 0, 1 << 30, True, True, False, False)
    rt._handle, rt._device_id, rt._device = 0x1234, 0, torch.device("cpu")
    rt._comm_stream, rt._comm_stream_ptr, rt._sync_event = _Stream(9), 9, _Event()
    rt._fast = fast
    rt._stream_order = fast.StreamOrder(0)
    assert rt._stream_order.usable(), "the stand-in libcuda.so.1 was not found"
    rt._ll_init()
    rt._ll_sync()
    if hasattr(fast, "set_python_helpers"):  # what the constructor does when it loads the module itself
        helpers = (_lib.raise_status, _lib.raise_driver_error, deep_ep_cpp.Config)
        try:
            fast.set_python_helpers(*helpers, deep_ep_cpp.EventHandle)
        except TypeError:  # a package whose direct entries take no events
            fast.set_python_helpers(*helpers)
        rt._normal_fast = fast.NormalOps(*_fast.entry_addresses(lib, _fast.NORMAL_OPS_ENTRIES), R, 0)  # not timed
    bind_direct_entries(rt)
    rt._check_ll_x = lambda x: None  # a new dispatch shape's check (the CPU tensors are not on cuda:0)
    buffer = object.__new__(deep_ep.Buffer)
    buffer.runtime, buffer.rank, buffer.group_size = rt, 0, R

    x = torch.randn(T, H).to(torch.bfloat16)
    topk_idx = torch.randint(0, E, (T, K))
    topk_weights = torch.ones(T, K)
    stats = torch.zeros(el, dtype=torch.int32)
    handle = buffer.low_latency_dispatch(x, topk_idx, M, E, cumulative_local_expert_recv_stats=stats)[2]
    expert_out = torch.zeros(el, R * M, H, dtype=torch.bfloat16)

    def hooked(op):
        hook = op()[-1]
        assert type(hook).__module__ != __name__, "not the compiled hook"
        return hook

    hooks = {"dispatch": hooked(lambda: buffer.low_latency_dispatch(x, topk_idx, M, E, return_recv_hook=True)),
             "combine": hooked(lambda: buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle,
                                                                   return_recv_hook=True))}
    ll_ops = ll_ops_to_time(buffer, x, topk_idx, topk_weights, stats, expert_out, handle, M, H, E, hooks)
    return types.SimpleNamespace(torch=torch, fast=fast, buffer=buffer, rt=rt, x=x, topk_idx=topk_idx,
                                 topk_weights=topk_weights, stats=stats, handle=handle, expert_out=expert_out,
                                 shape=(R, E, T, H, K, M), ops=ll_ops)


def compiled_ll(pkg, calls):
    s = compiled_ll_setup(pkg)
    torch, ops = s.torch, s.ops
    print(f"torch {torch.__version__}; compiled module of {pkg}; {calls} calls per op, best of 5")
    print("| op | us plain | us under set_default_device('cuda') |")
    print("| --- | --- | --- |")
    for name, op in ops.items():
        op()
        plain = fakes.best_us_per_call(op, calls)
        torch.set_default_device("cuda")
        try:
            under = fakes.best_us_per_call(op, calls)
        finally:
            torch.set_default_device(None)
        print(f"| {name} | {plain:.2f} | {under:.2f} |")
    s.rt._handle = None  # nothing to free


def main():
    args = sys.argv[1:]
    calls = fakes.pop_calls(args)
    if "--compiled" in args:
        args.remove("--compiled")
        return compiled_ll(Path(args[0]).resolve() if args else REPO / "compat" / "python", calls)
    if "--torch-calls" in args:
        args.remove("--torch-calls")
        return torch_calls(Path(args[0]).resolve() if args else REPO / "compat" / "python", calls)
    pkg = Path(args[0]).resolve() if args else REPO / "compat" / "python"
    os.environ["DEEPEP_NCCL_FAST"] = "0"  # the module is put in place below
    torch = install_torch()
    sys.path.insert(0, str(pkg))
    import deep_ep
    import deep_ep_cpp
    from deep_ep_cpp import _lib
    lib = _lib.lib

    R, E, T, H, K, num_sms = 2, 256, 128, 7168, 8, 24
    C = num_sms // 2
    fast = FakeFast(T, H, R, C, K, E)
    rt = deep_ep_cpp.Buffer(0, R, 1 << 30, 1 << 30, True, True, False, False)
    # As sync() leaves it, with made-up handle, device and streams.
    rt._handle, rt._device_id, rt._device = 0x1234, 0, ("cuda", 0)
    rt._comm_stream, rt._comm_stream_ptr, rt._sync_event = "comm", 0x77, _Event()
    rt._fast = fast
    rt._stream_order = fast.StreamOrder(0)
    rt._normal_fast = fast.NormalOps()
    rt._internode_fast = fast.NormalOps()
    rt._ll_init()
    if hasattr(rt, "_ll_sync"):
        rt._ll_sync()
    bind_direct_entries(rt)
    if hasattr(deep_ep_cpp.Buffer, "_num_rdma_ranks"):
        rt._num_rdma_ranks = 1  # what sync() reads once
    # Every C ABI call that reaches ctypes from here on is counted (the query through
    # _query_int, whose ctypes out-argument needs the real library, answers 1).
    for name in dir(lib):
        if name.startswith("deepep_"):
            setattr(lib, name, counted("C ABI call (ctypes)", getattr(lib, name)))
    rt._query_int = counted("C ABI call (ctypes)", lambda fn: 1)

    buffer = object.__new__(deep_ep.Buffer)
    buffer.runtime, buffer.rank, buffer.group_size = rt, 0, R

    Tn, bf16, i32, i64, f32 = fakes.Tensor, torch.bfloat16, torch.int32, torch.int64, torch.float32
    topk_idx, topk_weights = Tn((T, K), i64), Tn((T, K), f32)
    x = Tn((T, H), bf16)
    in_rank = Tn((T, R), torch.bool)
    prefix, chan = Tn((R, R), i32), Tn((R, C), i32)
    handle = (prefix, chan, chan, Tn((1000,), i32), in_rank, Tn((T, R), i32))
    recv_x = Tn((1000, H), bf16)
    M, el = 128, E // R
    ll_handle = (Tn((el, R * M), i32), Tn((el, R), i64), M, H, E)
    expert_out = Tn((el, R * M, H), bf16)
    config = deep_ep_cpp.Config(num_sms, 6, 256, 6, 128)

    ops = {
        "get_dispatch_layout": lambda: buffer.get_dispatch_layout(topk_idx, E),
        "dispatch (cached)": lambda: buffer.dispatch(x, handle=handle, config=config),
        "combine": lambda: buffer.combine(recv_x, handle, config=config),
        "low_latency_combine": lambda: buffer.low_latency_combine(expert_out, topk_idx, topk_weights, ll_handle),
        "low_latency_combine hook (+ hook())": lambda: buffer.low_latency_combine(
            expert_out, topk_idx, topk_weights, ll_handle, return_recv_hook=True)[-1](),
    }
    # As Megatron-LM calls them: after a previous_event, async, allocating on the comm stream. With
    # direct entries they take these in C++ (stand-ins here: only deep_ep's Python is timed); the
    # class methods' rows below are the Python path they replace (the package's fallback, and every
    # call of a package without them).
    prior = deep_ep.utils.EventOverlap(deep_ep_cpp.EventHandle())
    events = dict(previous_event=prior, async_finish=True, allocate_on_comm_stream=True)
    async_ops = {
        "get_dispatch_layout": lambda: buffer.get_dispatch_layout(topk_idx, E, **events),
        "dispatch (cached)": lambda: buffer.dispatch(x, handle=handle, config=config, **events),
        "combine": lambda: buffer.combine(recv_x, handle, config=config, **events),
    }
    entries = fast.NORMAL_DIRECT_ENTRIES if "_bind_direct_entries" in vars(deep_ep_cpp.Buffer) else ()
    if entries:
        ops.update({f"{name}, async + previous_event (direct entry)": op for name, op in async_ops.items()})
    print(f"{calls} calls per op, best of 5; counts per call")

    def time_ops(ops):
        for name, op in ops.items():
            op()
            COUNTS.clear()
            op()
            steps = ", ".join(f"{k} {v}" for k, v in sorted(COUNTS.items()))
            print(f"  {name:58s} {fakes.best_us_per_call(op, calls):6.2f} us  [{steps}]")

    time_ops(ops)
    # The class methods from here on: the entries set aside as tests and benches do (a package of the
    # direct entries from before Buffer._unbind_direct_entries: by name).
    if hasattr(rt, "_unbind_direct_entries"):
        rt._unbind_direct_entries()
    else:
        for name in entries:
            vars(rt).pop(name, None)
    time_ops({f"{name}, async + previous_event (class method)": op for name, op in async_ops.items()})
    rt._handle = None  # nothing to free


if __name__ == "__main__":
    main()
