"""Host steps per call of the compiled host path, through deep_ep.Buffer's public API, on a CPU.

    python bench/host_steps_cpu.py [PACKAGE_DIR] [--calls N]

A CPU proxy for bench_normal.py's host rows, bench_layout.py and bench_ll_host.py: the Python
between deep_ep.Buffer's entry and the compiled op's return, with ctypes_overhead_cpu.py's stand-in
torch and a stand-in of the compiled module (deep_ep_cpp/_fast.cpp) whose ops return their
outputs at once. Per op it counts what Python does that a GPU run pays for (C ABI calls through
ctypes, calls into the compiled module, CUDA event and current-stream calls, torch allocations,
record_stream) and times the rest. PACKAGE_DIR holds the deep_ep and deep_ep_cpp to measure
(default: compat/python of this checkout), e.g. an older version's from `git archive`. What the compiled module does inside (allocations, driver
calls, C ABI calls) is not seen here: see the module's sources."""
import collections
import contextlib
import importlib.util
import os
import sys
import time
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

        def ll_combine(*a):
            COUNTS["fast op"] += 1
            return 0, combined, hook if a[16] == 1 else None  # phases: send only -> hook

        self.NormalOps, self.InternodeOps = NormalOps, NormalOps
        self.ll_combine = ll_combine
        self.StreamOrder = lambda device: types.SimpleNamespace(usable=lambda: True)
        self.LlCombineOutputs = lambda fn: object()
        self.set_status_raiser = lambda fn: None


def main():
    args = sys.argv[1:]
    calls = 20000
    if "--calls" in args:
        i = args.index("--calls")
        calls = int(args[i + 1])
        del args[i:i + 2]
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
    print(f"{calls} calls per op, best of 5; counts per call")
    for name, op in ops.items():
        op()
        COUNTS.clear()
        op()
        steps = ", ".join(f"{k} {v}" for k, v in sorted(COUNTS.items()))
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls):
                op()
            best = min(best, (time.perf_counter() - t0) / calls)
        print(f"  {name:38s} {best * 1e6:6.2f} us  [{steps}]")
    rt._handle = None  # nothing to free


if __name__ == "__main__":
    main()
