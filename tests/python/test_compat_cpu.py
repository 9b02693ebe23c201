"""The Python compat layer over libdeepep_nccl.so, on a machine with neither torch nor a GPU.

deep_ep_cpp must import and validate everything without torch; the few tests of the torch-only
`deep_ep` package skip themselves where torch is missing.
"""
import ctypes
import gc
import importlib.util
import inspect
import os
import re
import shutil
import struct
import subprocess
import sys
import types
from pathlib import Path

import pytest

import deep_ep_cpp
from deep_ep_cpp import Buffer, Config

MAGIC = b"DEEPEPNCCL2"
ARGS_BYTES = 18  # num_nvl_bytes, num_rdma_bytes (int64), low_latency_mode, enable_shrink (bool)
HIDDEN_BYTES = 7168 * 2  # DeepSeek-V3 hidden size, BF16 sizing as in DeepEP's README
HAS_TORCH = importlib.util.find_spec("torch") is not None


def _has_gpu():
    try:
        return deep_ep_cpp.device_count() > 0
    except RuntimeError:
        return False


HAS_GPU = _has_gpu()


def _buffer(rank=0, num_ranks=2, num_nvl_bytes=1 << 20, num_rdma_bytes=0, low_latency_mode=False):
    return Buffer(rank, num_ranks, num_nvl_bytes, num_rdma_bytes, low_latency_mode, False, False, False)


def _fields(config):
    return (
        config.num_sms,
        config.num_max_nvl_chunked_send_tokens,
        config.num_max_nvl_chunked_recv_tokens,
        config.num_max_rdma_chunked_send_tokens,
        config.num_max_rdma_chunked_recv_tokens,
    )


# --- Config ---------------------------------------------------------------------------------


def test_config_defaults_and_rdma_rounding():
    # rdma recv 256 is rounded up to a multiple of rdma send 6, as DeepEP's Config does.
    assert _fields(Config()) == (20, 6, 256, 6, 258)


def test_config_positional_forms_of_deepep_tests():
    assert _fields(Config(24, 8, 256)) == (24, 8, 256, 6, 258)  # test_intranode
    assert _fields(Config(24, 8, 512, 16, 128)) == (24, 8, 512, 16, 128)  # test_internode


def test_config_keywords_as_sglang_passes_them():
    json_config = {
        "num_sms": 24,
        "num_max_nvl_chunked_send_tokens": 16,
        "num_max_nvl_chunked_recv_tokens": 288,
        "num_max_rdma_chunked_send_tokens": 12,
        "num_max_rdma_chunked_recv_tokens": 128,
    }
    assert _fields(Config(**json_config)) == (24, 16, 288, 12, 132)
    assert _fields(Config(32, num_max_rdma_chunked_send_tokens=8)) == (32, 6, 256, 8, 256)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"num_sms": -2}, "num_sms"),
        ({"num_max_nvl_chunked_send_tokens": 256}, "num_max_nvl_chunked_send_tokens"),
        ({"num_max_nvl_chunked_send_tokens": 0}, "NVL chunk sizes must be positive"),
        ({"num_max_rdma_chunked_send_tokens": 300}, "num_max_rdma_chunked_send_tokens"),
        ({"num_max_rdma_chunked_send_tokens": 200}, "num_max_rdma_chunked_recv_tokens / 2"),
        ({"num_max_rdma_chunked_recv_tokens": -1}, "RDMA chunk sizes must be positive"),
    ],
)
def test_config_rejects_bad_values(kwargs, fragment):
    with pytest.raises(RuntimeError, match=re.escape(fragment)) as info:
        Config(**kwargs)
    assert "DEEPEP_ERROR_INVALID_ARGUMENT" in str(info.value)


def test_config_rejects_unknown_keyword():
    with pytest.raises(TypeError):
        Config(num_sm=20)


# --- Default tables and size hints -------------------------------------------------------------


@pytest.mark.parametrize(
    "num_ranks, dispatch, combine",
    [
        (2, (24, 256, 6, 132), (10, 256, 6, 132)),
        (8, (6, 256, 6, 132), (4, 256, 6, 132)),
        (16, (36, 288, 20, 140), (4, 288, 12, 132)),
        (160, (28, 720, 12, 132), (2, 720, 8, 128)),
    ],
)
def test_default_config_tables(num_ranks, dispatch, combine):
    assert _fields(deep_ep_cpp.get_default_config("dispatch", num_ranks, 24)) == (24, *dispatch)
    assert _fields(deep_ep_cpp.get_default_config("combine", num_ranks, 24)) == (24, *combine)


@pytest.mark.parametrize("num_ranks", [1, 3, 12, 40, 256])
def test_default_config_unsupported_ranks(num_ranks):
    with pytest.raises(RuntimeError, match="Unsupported number of EP ranks"):
        deep_ep_cpp.get_default_config("dispatch", num_ranks, 20)


def test_default_config_unknown_kind():
    with pytest.raises(ValueError, match="dispatch"):
        deep_ep_cpp.get_default_config("notify", 8, 20)


# (num_ranks, NVL bytes, RDMA bytes): max over the dispatch and combine configs, num_sms 20.
DEEPEP_BUFFER_SIZES = [
    (2, 83_927_552, 0),
    (4, 167_854_976, 0),
    (8, 335_709_824, 0),
    (16, 377_673_984, 91_887_744),
    (32, 377_675_264, 168_023_680),
    (64, 377_677_824, 336_047_360),
    (128, 734_372_864, 693_096_960),
    (160, 944_193_024, 866_371_200),
]


@pytest.mark.parametrize("num_ranks, nvl_bytes, rdma_bytes", DEEPEP_BUFFER_SIZES)
def test_buffer_size_hints_match_deepep(num_ranks, nvl_bytes, rdma_bytes):
    configs = [deep_ep_cpp.get_default_config(kind, num_ranks, 20) for kind in ("dispatch", "combine")]
    assert max(c.get_nvl_buffer_size_hint(HIDDEN_BYTES, num_ranks) for c in configs) == nvl_bytes
    assert max(c.get_rdma_buffer_size_hint(HIDDEN_BYTES, num_ranks) for c in configs) == rdma_bytes


def test_size_hint_rejects_bad_rank_count():
    with pytest.raises(RuntimeError, match="num_ranks"):
        Config().get_nvl_buffer_size_hint(HIDDEN_BYTES, 12)
    with pytest.raises(RuntimeError, match="hidden_bytes"):
        Config().get_rdma_buffer_size_hint(0, 16)


@pytest.mark.parametrize(
    "args, expected",
    [
        ((128, 7168, 8, 288), 2_146_961_792),
        ((128, 7168, 8, 256), 1_908_410_496),
        ((16, 5120, 8, 256), 170_395_776),
        ((256, 7168, 8, 256), 3_816_818_816),
    ],
)
def test_low_latency_rdma_size_hint(args, expected):
    assert deep_ep_cpp.get_low_latency_rdma_size_hint(*args) == expected


def test_low_latency_rdma_size_hint_keywords_and_errors():
    assert (
        deep_ep_cpp.get_low_latency_rdma_size_hint(
            num_max_dispatch_tokens_per_rank=128, hidden=7168, num_ranks=8, num_experts=288
        )
        == 2_146_961_792
    )
    with pytest.raises(RuntimeError, match="num_experts"):
        deep_ep_cpp.get_low_latency_rdma_size_hint(128, 7168, 8, 0)


# --- Module surface --------------------------------------------------------------------------


def test_is_sm90_compiled():
    assert deep_ep_cpp.is_sm90_compiled() is True


def test_versions():
    compiled = deep_ep_cpp.nccl_compiled_version()
    runtime = deep_ep_cpp.nccl_runtime_version()
    assert isinstance(compiled, int) and isinstance(runtime, int)
    assert compiled >= 22800
    # NCCL_VERSION_CODE = major * 10000 + minor * 100 + patch: the same major.minor.
    assert compiled // 100 == runtime // 100
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", deep_ep_cpp.library_version())


@pytest.mark.skipif(HAS_TORCH, reason="checks the torch-less behaviour")
def test_topk_idx_t_needs_torch():
    with pytest.raises(ModuleNotFoundError, match="PyTorch"):
        deep_ep_cpp.topk_idx_t
    with pytest.raises(ModuleNotFoundError):
        deep_ep_cpp.EventHandle()


def test_unknown_module_attribute():
    with pytest.raises(AttributeError, match="no_such_name"):
        deep_ep_cpp.no_such_name


@pytest.mark.skipif(HAS_GPU, reason="checks the behaviour without a GPU")
def test_device_count_without_gpu():
    with pytest.raises(RuntimeError, match="DEEPEP_ERROR_NO_DEVICE"):
        deep_ep_cpp.device_count()


def test_library_comes_from_environment_variable():
    path = os.environ.get("DEEPEP_NCCL_LIBRARY")
    if not path:
        pytest.skip("DEEPEP_NCCL_LIBRARY is not set")
    from deep_ep_cpp import _lib

    assert _lib.LIBRARY_PATH == Path(path)


def test_missing_library_names_every_path_tried(tmp_path):
    package = tmp_path / "deep_ep_cpp"
    package.mkdir()
    for source in Path(deep_ep_cpp.__file__).parent.glob("*.py"):
        shutil.copy(source, package)
    missing = tmp_path / "missing" / "libdeepep_nccl.so"
    env = dict(os.environ, DEEPEP_NCCL_LIBRARY=str(missing), PYTHONPATH=str(tmp_path))
    result = subprocess.run(
        [sys.executable, "-c", "import deep_ep_cpp"], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert "ImportError" in result.stderr and "not found" in result.stderr
    assert str(missing) in result.stderr
    assert str(package / "libdeepep_nccl.so") in result.stderr


def test_compiled_host_path_falls_back_without_torch(monkeypatch):
    from deep_ep_cpp import _fast

    if _fast.torch is not None:
        pytest.skip("torch is installed: the build is exercised by the GPU suite")
    for setting, expect_module in (("", None), ("0", None)):
        monkeypatch.setattr(_fast, "_tried", False)
        monkeypatch.setenv("DEEPEP_NCCL_FAST", setting)
        assert _fast.module() is expect_module
    # Required but unavailable: an ImportError that says why, not a silent fallback.
    monkeypatch.setattr(_fast, "_tried", False)
    monkeypatch.setenv("DEEPEP_NCCL_FAST", "1")
    for _ in range(2):  # every Buffer, not only the first
        with pytest.raises(ImportError, match="compiled host path is unavailable: no torch"):
            _fast.module()


def test_compiled_normal_ops_fall_back_or_raise():
    """How the normal ops treat the compiled path's answers (a stand-in for the module here; the
    GPU suite runs the real one): a result drops its status, input it does not take (BAD_INPUT,
    or arguments pybind cannot convert) sends the call down the ctypes path, a failed call raises
    the library's error."""
    from deep_ep_cpp import _lib, _normal

    class Ops:
        def __init__(self, answer):
            self.answer, self.calls = answer, []

        def dispatch(self, *args):
            self.calls.append(args)
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer

    class Module:
        BAD_INPUT = -2
        DRIVER_ERROR = -3

    class Runtime(_normal.NormalMode):
        _comm_stream_ptr = 77
        _stream_order = "order"
        _compute_handle = 5
        _fast = Module()

        def __init__(self, ops):
            self.ops = ops

        def _fast_with_config(self, op_name, config, order, *args):
            return super()._fast_with_config(self.ops, op_name, config, order, *args)

    config = Config(24, 6, 256)
    ops = Ops((0, "recv_x", None))
    assert Runtime(ops)._fast_with_config("dispatch", config, 3, "handle", "x") == ("recv_x", None)
    assert ops.calls == [("handle", "x", ctypes.addressof(config._c), 77, "order", 5, 3)]
    for answer in ((Module.BAD_INPUT,), TypeError("incompatible function arguments")):
        assert Runtime(Ops(answer))._fast_with_config("dispatch", config, 3, "handle") is None
    assert Runtime(None)._fast_with_config("dispatch", config, 3, "handle") is None
    assert Runtime(Ops((0,)))._fast_with_config("dispatch", object(), 3, "handle") is None  # not our Config
    status = _lib.lib.deepep_check_buffer_args(0, 2, 1000, 0, False)  # leaves a named error behind
    assert status != 0
    with pytest.raises(RuntimeError, match="num_nvl_bytes"):
        Runtime(Ops((status,)))._fast_with_config("dispatch", config, 3, "handle")
    with pytest.raises(RuntimeError, match="CUDA driver error 700 while ordering"):
        Runtime(Ops((Module.DRIVER_ERROR, 700)))._fast_with_config("dispatch", config, 3, "handle")


def _cpp_parameters(header, method):
    """The parameter names of `py::tuple method(...)` in the compiled path's header `header`."""
    from deep_ep_cpp import _fast

    text = (_fast._HERE / header).read_text()
    params = text[text.index(f"py::tuple {method}(") + len(f"py::tuple {method}("):]
    params = params[:params.index(") {")]
    return [re.findall(r"\w+", p)[-1] for p in params.split(",")]


def test_internode_ops_take_the_compiled_path_as_the_intranode_ops_do():
    """internode_dispatch / internode_combine go through the compiled path's InternodeOps when the
    Buffer has it (the same selection as the intranode ops: _fast_with_config, so DEEPEP_NCCL_FAST
    means the same), with their arguments in the order _fast_internode.h declares them; input it
    does not take (BAD_INPUT, or arguments pybind cannot convert) and a Buffer without it take
    the ctypes path, which does the ORDER_BEFORE wait itself. A stand-in module here; the GPU
    suite's test_internode runs the real one (and test_internode_ctypes the ctypes path)."""
    from deep_ep_cpp import _internode

    class Module:
        BAD_INPUT = -2
        DRIVER_ERROR = -3

    class Ops:
        def __init__(self, answer):
            self.answer, self.calls = answer, []

        def _answer(self, *args):
            self.calls.append(args)
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer

        dispatch = combine = _answer

    class Runtime(_internode.InternodeMode):
        _comm_stream_ptr = 77
        _stream_order = "order"
        _compute_handle = 5
        _fast = Module()

        def __init__(self, ops):
            self._internode_fast = ops
            self.ctypes_calls, self.waits_before, self.ended = [], [], []

        def _live_handle(self):
            return "handle"

        def _op_begin(self, previous_event, async_, allocate_on_comm_stream):
            return "comm", "compute", 3

        def _op_allocated(self, compute, allocate_on_comm_stream):
            pass

        def _order_before(self, order, stream, compute):
            self.waits_before.append(order)

        def _op_end(self, comm, compute, async_, allocate_on_comm_stream, tensors, order):
            self.ended.append(order)
            return "event"

        def _internode_dispatch_ctypes(self, *args):
            self.ctypes_calls.append(args)
            return tuple(f"ctypes_{i}" for i in range(14))

        def _internode_combine_ctypes(self, *args):
            self.ctypes_calls.append(args)
            return "ctypes_x", None

    config = Config(24, 6, 256)
    tail = (ctypes.addressof(config._c), 77, "order", 5, 3)  # config, stream, order, compute, order_flags
    ops_args = {"dispatch": ("x", "x_scales", "topk_idx", "topk_weights", "num_tokens_per_rank",
                             "num_tokens_per_rdma_rank", "is_token_in_rank", "num_tokens_per_expert",
                             "cached_num_recv_tokens", "cached_num_rdma_recv_tokens",
                             "cached_rdma_channel_prefix_matrix", "cached_recv_rdma_rank_prefix_sum",
                             "cached_gbl_channel_prefix_matrix", "cached_recv_gbl_rank_prefix_sum",
                             "expert_alignment", "num_worst_tokens"),
                "combine": ("x", "topk_weights", "bias_0", "bias_1", "src_meta", "is_combined_token_in_rank",
                            "rdma_channel_prefix_matrix", "rdma_rank_prefix_sum", "gbl_channel_prefix_matrix",
                            "combined_rdma_head", "combined_nvl_head")}
    for op, names in ops_args.items():
        # The Python op's parameters and the compiled op's, in the same order (pybind passes by position).
        python_params = list(inspect.signature(getattr(Runtime, f"internode_{op}")).parameters)
        assert python_params == ["self", *names, "config", "previous_event", "async_", "allocate_on_comm_stream"]
        assert _cpp_parameters("_fast_internode.h", op) == [
            "buffer", *names, "config", "stream", "order", "compute", "order_flags"]

    def call(runtime, op, **overrides):
        values = {name: name for name in ops_args[op]}
        values.update(overrides)
        return getattr(runtime, f"internode_{op}")(**values, config=config, previous_event=None, async_=False,
                                                    allocate_on_comm_stream=False)

    # Non-cached dispatch: the compiled path's 14 entries, as they come, and no ctypes call or wait.
    fast_result = tuple(f"fast_{i}" for i in range(14))
    ops = Ops((0, *fast_result))
    runtime = Runtime(ops)
    got = call(runtime, "dispatch", cached_rdma_channel_prefix_matrix=None)
    assert got == (*fast_result, "event")
    expect = tuple(None if n == "cached_rdma_channel_prefix_matrix" else n for n in ops_args["dispatch"])
    assert ops.calls == [("handle", *expect, *tail)]
    assert (runtime.ctypes_calls, runtime.waits_before, runtime.ended) == ([], [], [0])
    # Cached: DeepEP's cached tuple from the handle's tensors, whichever path ran.
    got = call(Runtime(Ops((0, *fast_result))), "dispatch")
    assert got == (*fast_result[:5], "cached_rdma_channel_prefix_matrix", "cached_gbl_channel_prefix_matrix", None,
                   "cached_recv_rdma_rank_prefix_sum", None, "cached_recv_gbl_rank_prefix_sum", None, None, None,
                   "event")
    # Combine: (combined_x, combined_topk_weights, event).
    ops = Ops((0, "fast_x", "fast_w"))
    runtime = Runtime(ops)
    assert call(runtime, "combine") == ("fast_x", "fast_w", "event")
    assert ops.calls == [("handle", *ops_args["combine"], *tail)]
    assert (runtime.ctypes_calls, runtime.waits_before, runtime.ended) == ([], [], [0])

    # The ctypes path: for input the compiled path does not take, and without it.
    for ops in (Ops((Module.BAD_INPUT,)), Ops(TypeError("incompatible function arguments")), None):
        runtime = Runtime(ops)
        got = call(runtime, "dispatch", cached_rdma_channel_prefix_matrix=None)
        assert got == (*(f"ctypes_{i}" for i in range(14)), "event")
        assert call(runtime, "combine") == ("ctypes_x", None, "event")
        assert runtime.ctypes_calls == [("handle", *expect, config), ("handle", *ops_args["combine"], config)]
        assert (runtime.waits_before, runtime.ended) == ([3, 3], [3, 3])
    # A failed compiled call raises the library's error (no ctypes retry).
    status = _internode.lib.deepep_check_buffer_args(0, 2, 1000, 0, False)  # leaves a named error behind
    runtime = Runtime(Ops((status,)))
    with pytest.raises(RuntimeError, match="num_nvl_bytes"):
        call(runtime, "combine")
    assert runtime.ctypes_calls == []


def test_stream_protocol_leaves_the_waits_to_the_op():
    """_op_begin's order flags (what the compiled path or the ctypes path must still wait for):
    without previous_event the comm stream waits for the compute stream (ORDER_BEFORE), with it
    only for the event; without async the compute stream waits for the op (ORDER_AFTER)."""
    from deep_ep_cpp._streams import ORDER_AFTER, ORDER_BEFORE, StreamProtocol

    waited = []

    class Event:
        def wait(self, stream):
            waited.append(stream)

    class Protocol(StreamProtocol):
        _comm_stream = "comm"

        def _current_stream(self):
            return "compute"

    protocol = Protocol()
    previous = type("EventHandleLike", (), {"event": Event()})()
    cases = [((None, False), ORDER_BEFORE | ORDER_AFTER, []), ((None, True), ORDER_BEFORE, []),
             ((previous, False), ORDER_AFTER, ["comm"]), ((previous, True), 0, ["comm"])]
    for (prev, async_), order, waits in cases:
        waited.clear()
        assert protocol._op_begin(prev, async_, False) == ("comm", "compute", order)
        assert waited == waits
    for prev, async_ in ((None, True), (previous, False)):
        with pytest.raises(RuntimeError, match="allocate_on_comm_stream requires previous_event and async"):
            protocol._op_begin(prev, async_, True)


def test_compiled_host_path_sources_ship_with_the_package():
    from deep_ep_cpp import _fast, _fast_build

    sources = [_fast._HERE / name for name in _fast_build.SOURCES]
    assert all(p.is_file() for p in sources)
    # Everything the module's source includes is hashed into the cache key and the prebuilt's digests.
    included = set(re.findall(r'#include "(_fast[^"]*)"', "".join(p.read_text() for p in sources)))
    assert included and included <= set(_fast_build.SOURCES)
    # A source checkout finds the C header in include/; an install gets a copy (quickstart.sh).
    assert _fast._header_dir() is not None and (_fast._header_dir() / "deepep_nccl.h").is_file()
    pyproject = (REPO / "compat" / "python" / "pyproject.toml").read_text()
    assert '"*.cpp"' in pyproject and '"*.h"' in pyproject


# --- Buffer: constructor checks ----------------------------------------------------------------


@pytest.mark.parametrize(
    "args, fragments",
    [
        ((0, 2, 1000, 0, False), ["num_nvl_bytes", "128"]),
        ((0, 16, 0, 1000, False), ["num_rdma_bytes", "128"]),
        ((2, 2, 0, 0, False), ["rank must be in [0, num_ranks=2)"]),
        ((-1, 2, 0, 0, False), ["rank must be in"]),
        ((0, 12, 0, 0, False), ["num_ranks (12)", "multiple of 8"]),
        ((0, 168, 0, 0, False), ["num_ranks (168)", "160"]),
        ((0, 8, 0, 1024, False), ["num_rdma_bytes (1024)", "low_latency_mode"]),
        ((0, 2, -128, 0, False), ["num_nvl_bytes must be >= 0"]),
    ],
)
def test_buffer_constructor_rejects(args, fragments):
    with pytest.raises(RuntimeError) as info:
        Buffer(*args, False, False, False)
    message = str(info.value)
    assert "DEEPEP_ERROR_INVALID_ARGUMENT" in message
    for fragment in fragments:
        assert fragment in message


@pytest.mark.parametrize(
    "args",
    [
        (0, 8, int(2e9), 0, False),  # DeepEP's tests allocate 2e9 NVL bytes
        (7, 8, 0, 1 << 20, True),  # RDMA bytes within one node need low-latency mode
        (15, 16, 1 << 20, 1 << 20, False),
        (0, 168, 0, 1 << 20, True),  # beyond 160 ranks only in low-latency mode
        (0, 1, 0, 0, False),
    ],
)
def test_buffer_constructor_accepts(args):
    buffer = Buffer(*args, False, False, False)
    assert not buffer.is_available()


def test_buffer_takes_deepeps_eight_positional_arguments():
    params = list(inspect.signature(Buffer).parameters)
    assert params == [
        "rank",
        "num_ranks",
        "num_nvl_bytes",
        "num_rdma_bytes",
        "low_latency_mode",
        "explicitly_destroy",
        "enable_shrink",
        "use_fabric",
    ]


def test_unsynced_buffer_queries():
    buffer = _buffer(rank=11, num_ranks=16, num_rdma_bytes=1 << 20)
    assert buffer.get_num_rdma_ranks() == 2
    assert buffer.get_rdma_rank() == 1
    assert buffer.get_root_rdma_rank(True) == 3
    assert buffer.get_root_rdma_rank(False) == 0
    assert not buffer.is_available()
    nvshmem_id = buffer.get_local_nvshmem_unique_id()
    assert isinstance(nvshmem_id, bytearray) and len(nvshmem_id) == 128
    assert _buffer(rank=3, num_ranks=4).get_num_rdma_ranks() == 1
    if not HAS_TORCH:
        assert buffer.get_local_device_id() == -1


def test_ipc_handle_of_rank_zero_carries_a_unique_id():
    handle = _buffer(rank=0).get_local_ipc_handle()
    assert isinstance(handle, bytearray)
    assert len(handle) == len(MAGIC) + 128 + ARGS_BYTES
    assert handle.startswith(MAGIC)
    assert any(handle[len(MAGIC) : len(MAGIC) + 128])


def test_ipc_handle_is_stable_and_other_ranks_carry_none():
    buffer = _buffer(rank=0)
    assert buffer.get_local_ipc_handle() == buffer.get_local_ipc_handle()
    other = _buffer(rank=1).get_local_ipc_handle()
    assert other[: len(MAGIC) + 128] == MAGIC + bytes(128)
    # Every rank's handle ends with its Buffer arguments (little-endian), for sync() to compare.
    args = struct.unpack("<qq??", bytes(other[len(MAGIC) + 128 :]))
    assert args == (1 << 20, 0, False, False)


@pytest.mark.parametrize(
    "method, args",
    [
        ("get_comm_stream", ()),
        ("get_local_buffer_tensor", (None, 0, False)),
        ("get_dispatch_layout", (None, 8, None, False, False)),
        ("intranode_dispatch", (None,) * 16),
        ("intranode_combine", (None,) * 12),
        ("destroy", ()),
        ("barrier", ()),
        ("check_peers", ()),
        ("set_gpu_timeout_ms", (1000,)),
        ("get_num_device_sms", ()),
        ("normal_query_dropped_buffer", (None,)),
        ("internode_query_traffic_buffer", (None,)),
    ],
)
def test_methods_need_a_synced_buffer(method, args):
    with pytest.raises(RuntimeError, match=r"call sync\(\) first"):
        getattr(_buffer(), method)(*args)


# DeepEP's positional parameter counts of the internode methods (csrc/deep_ep.hpp).
INTERNODE = [("internode_dispatch", 20), ("internode_combine", 15)]

# DeepEP's positional parameter counts of the low-latency methods (csrc/deep_ep.hpp).
LOW_LATENCY = [
    ("clean_low_latency_buffer", 3),
    ("low_latency_dispatch", 11),
    ("low_latency_combine", 13),
    ("get_next_low_latency_combine_buffer", 3),
    ("low_latency_update_mask_buffer", 2),
    ("low_latency_query_mask_buffer", 1),
    ("low_latency_clean_mask_buffer", 0),
]


@pytest.mark.parametrize("method, num_args", LOW_LATENCY)
def test_low_latency_methods_keep_deepeps_arity_and_need_sync(method, num_args):
    bound = getattr(_buffer(), method)
    assert len(inspect.signature(bound).parameters) == num_args
    with pytest.raises(RuntimeError, match=r"call sync\(\) first"):
        bound(*([None] * num_args))


def test_low_latency_argument_structs_match_the_c_abi():
    # DeepepLowLatencyDispatchArgs: 9 tensors + 6 int32; DeepepLowLatencyCombineArgs: 7 + 6.
    from deep_ep_cpp import _low_latency

    assert _low_latency._DISPATCH_ARGS.size == 9 * 80 + 24
    assert _low_latency._COMBINE_ARGS.size == 7 * 80 + 24
    assert _low_latency._DISPATCH_PHASES_AT == 9 * 80 + 20
    assert _low_latency._COMBINE_PHASES_AT == 7 * 80 + 16


@pytest.mark.parametrize("method, num_args", INTERNODE)
def test_internode_methods_keep_deepeps_arity_and_need_sync(method, num_args):
    bound = getattr(_buffer(), method)
    assert len(inspect.signature(bound).parameters) == num_args
    with pytest.raises(RuntimeError, match=r"call sync\(\) first"):
        bound(*([None] * num_args))


@pytest.mark.parametrize("method, num_args", [("intranode_dispatch", 16), ("intranode_combine", 12)])
def test_normal_mode_methods_keep_deepeps_arity(method, num_args):
    assert len(inspect.signature(getattr(_buffer(), method)).parameters) == num_args


def test_normal_mode_argument_structs_match_the_c_abi():
    # Sizes of the C structs (include/deepep_nccl.h): 80-byte tensor descriptors, the
    # 20-byte Config, then int32 flags, padded to 8 bytes.
    from deep_ep_cpp import _normal

    assert _normal._DISPATCH_ARGS.size == 11 * 80 + 20 + 16 + 4
    assert _normal._COMBINE_ARGS.size == 10 * 80 + 20 + 4


def test_low_latency_combine_out_is_optional():
    out = inspect.signature(_buffer().low_latency_combine).parameters["out"]
    assert out.default is None


# --- Buffer: sync ------------------------------------------------------------------------------


def test_sync_needs_one_entry_per_rank():
    buffer = _buffer(num_ranks=2)
    handle = buffer.get_local_ipc_handle()
    with pytest.raises(RuntimeError, match="one per rank"):
        buffer.sync([0], [handle], None)


@pytest.mark.parametrize(
    "root, fragment",
    [
        (None, "not a deepep-nccl IPC handle"),
        (bytearray(b"x" * 72), "not a deepep-nccl IPC handle"),
        (bytearray(MAGIC + b"\x01" * 127), "not a deepep-nccl IPC handle"),
        (bytearray(b"DEEPEPNCCL0" + b"\x01" * (128 + ARGS_BYTES)), "not a deepep-nccl IPC handle"),
        (bytearray(b"DEEPEPNCCL1" + b"\x01" * 128), "not a deepep-nccl IPC handle"),  # the format before the arguments
        (bytearray(MAGIC + bytes(128 + ARGS_BYTES)), "must be rank 0's handle"),
    ],
)
def test_sync_checks_the_root_handle(root, fragment):
    buffer = _buffer(rank=1)
    with pytest.raises(RuntimeError, match=re.escape(fragment)):
        buffer.sync([0, 0], [root, buffer.get_local_ipc_handle()], None)
    assert not buffer.is_available()


@pytest.mark.parametrize(
    "theirs, fragment",
    [
        ({"num_rdma_bytes": 1 << 30}, "num_rdma_bytes=1073741824, this rank (1) with num_rdma_bytes=536870912"),
        ({"num_nvl_bytes": 1 << 21}, "num_nvl_bytes=2097152, this rank (1) with num_nvl_bytes=1048576"),
        ({"low_latency_mode": True}, "low_latency_mode=True, this rank (1) with low_latency_mode=False"),
        (
            {"num_rdma_bytes": 1 << 30, "enable_shrink": True},
            "num_rdma_bytes=1073741824, enable_shrink=True, this rank (1) with num_rdma_bytes=536870912, "
            "enable_shrink=False",
        ),
    ],
)
def test_sync_names_the_first_rank_whose_buffer_arguments_differ(theirs, fragment):
    # The internode rings grow into num_rdma_bytes: ranks that disagree must fail at sync, every
    # one of them, before anything collective (so no rank waits for the others in ncclCommInitRank).
    def make(rank, **kw):
        base = dict(num_nvl_bytes=1 << 20, num_rdma_bytes=1 << 29, low_latency_mode=False, enable_shrink=False)
        base.update(kw)
        return Buffer(rank, 16, base["num_nvl_bytes"], base["num_rdma_bytes"], base["low_latency_mode"], False,
                      base["enable_shrink"], False)

    root, me, odd = make(0), make(1), make(2, **theirs)
    handles = [root.get_local_ipc_handle(), me.get_local_ipc_handle(), odd.get_local_ipc_handle()]
    handles += [make(r).get_local_ipc_handle() for r in range(3, 16)]
    with pytest.raises(RuntimeError, match=re.escape(f"rank 2 created its Buffer with {fragment}")):
        me.sync([0] * 16, handles, None)
    assert not me.is_available()
    # The odd rank fails too, naming rank 0 (the first that differs from it).
    with pytest.raises(RuntimeError, match=r"rank 0 created its Buffer with .*, this rank \(2\) with"):
        odd.sync([0] * 16, handles, None)
    # A handle of another format (another library version) is named by its index.
    old = bytearray(b"DEEPEPNCCL1" + bytes(128))
    with pytest.raises(RuntimeError, match=re.escape("all_gathered_handles[5] is not a deepep-nccl IPC handle")):
        me.sync([0] * 16, handles[:2] + [make(2).get_local_ipc_handle()] + handles[3:5] + [old] + handles[6:], None)


@pytest.mark.skipif(HAS_GPU, reason="checks the behaviour without a GPU")
def test_sync_without_gpu_is_a_clean_error():
    buffer = _buffer(rank=0, num_ranks=1, num_nvl_bytes=0)
    handle = buffer.get_local_ipc_handle()
    for _ in range(2):  # a failed sync leaves the buffer uncreated, and it may be retried
        with pytest.raises(RuntimeError, match="DEEPEP_ERROR_NO_DEVICE") as info:
            buffer.sync([buffer.get_local_device_id()], [handle], None)
        assert "CUDA driver" in str(info.value) or "GPU" in str(info.value)
        assert not buffer.is_available()


def test_garbage_collection_raises_nothing(monkeypatch):
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    buffer = _buffer()
    buffer.get_local_ipc_handle()
    del buffer
    with pytest.raises(RuntimeError):
        _buffer(num_nvl_bytes=1)  # __del__ also runs on a Buffer whose constructor raised
    gc.collect()
    assert unraisable == []


# --- deep_ep (needs torch, not a GPU) ------------------------------------------------------------


def test_deep_ep_exports():
    torch = pytest.importorskip("torch")
    import deep_ep
    from deep_ep.utils import EventHandle, EventOverlap

    assert deep_ep.Config is Config
    assert deep_ep.EventOverlap is EventOverlap
    assert EventHandle is deep_ep_cpp.EventHandle
    assert deep_ep.topk_idx_t is torch.int64
    assert not hasattr(deep_ep, "EventHandle")
    assert deep_ep.__version__ == "1.2.1+567632d"  # what DeepEP V1 at 567632d reports


def test_deep_ep_buffer_signatures_match_deepep():
    pytest.importorskip("torch")
    from deep_ep import Buffer as PyBuffer

    def defaults(fn):
        return [(p.name, p.default) for p in inspect.signature(fn).parameters.values() if p.kind != p.VAR_KEYWORD]

    empty = inspect.Parameter.empty
    assert defaults(PyBuffer.__init__) == [
        ("self", empty),
        ("group", empty),
        ("num_nvl_bytes", 0),
        ("num_rdma_bytes", 0),
        ("low_latency_mode", False),
        ("num_qps_per_rank", 24),
        ("allow_nvlink_for_low_latency_mode", True),
        ("allow_mnnvl", False),
        ("use_fabric", False),
        ("explicitly_destroy", False),
        ("enable_shrink", False),
        ("comm", None),
    ]
    assert defaults(PyBuffer.get_dispatch_layout)[1:] == [
        ("topk_idx", empty),
        ("num_experts", empty),
        ("previous_event", None),
        ("async_finish", False),
        ("allocate_on_comm_stream", False),
    ]
    assert [name for name, _ in defaults(PyBuffer.dispatch)][1:] == [
        "x",
        "handle",
        "num_tokens_per_rank",
        "num_tokens_per_rdma_rank",
        "is_token_in_rank",
        "num_tokens_per_expert",
        "topk_idx",
        "topk_weights",
        "expert_alignment",
        "num_worst_tokens",
        "config",
        "previous_event",
        "async_finish",
        "allocate_on_comm_stream",
    ]
    assert defaults(PyBuffer.low_latency_combine)[5:] == [
        ("use_logfmt", False),
        ("zero_copy", False),
        ("async_finish", False),
        ("return_recv_hook", False),
        ("out", None),
        ("combine_wait_recv_cost_stats", None),
    ]


def test_deep_ep_static_api():
    pytest.importorskip("torch")
    from deep_ep import Buffer as PyBuffer

    assert PyBuffer.is_sm90_compiled()
    assert PyBuffer.num_sms == 20
    assert _fields(PyBuffer.get_dispatch_config(8)) == (20, 6, 256, 6, 132)
    assert _fields(PyBuffer.get_combine_config(8)) == (20, 4, 256, 6, 132)
    with pytest.raises(AssertionError, match="Unsupported number of EP ranks"):
        PyBuffer.get_dispatch_config(12)
    with pytest.raises(AssertionError):
        PyBuffer.set_num_sms(23)
    try:
        PyBuffer.set_num_sms(24)
        assert PyBuffer.get_combine_config(16).num_sms == 24
    finally:
        PyBuffer.set_num_sms(20)
    assert (
        PyBuffer.get_low_latency_rdma_size_hint(
            num_max_dispatch_tokens_per_rank=16, hidden=5120, num_ranks=8, num_experts=256
        )
        == 170_395_776
    )
    with pytest.raises(ValueError, match="group"):
        PyBuffer(None)


def test_deep_ep_helpers():
    torch = pytest.importorskip("torch")
    from deep_ep import Buffer as PyBuffer
    from deep_ep import EventOverlap

    b0, b1 = torch.zeros(1), torch.ones(1)
    assert PyBuffer._unpack_bias(None) == (None, None)
    assert PyBuffer._unpack_bias(b0) == (b0, None)
    assert PyBuffer._unpack_bias((b0, b1)) == (b0, b1)
    with EventOverlap() as overlap:
        assert overlap.event is None and overlap.extra_tensors is None
    with pytest.raises(AssertionError):
        overlap.current_stream_wait()


def test_deep_ep_extension_kwargs():
    pytest.importorskip("torch")
    from deep_ep import Buffer as PyBuffer

    buffer = PyBuffer.__new__(PyBuffer)  # no group needed to reach the argument checks
    # Extensions of newer DeepEP that ask for a feature this package lacks fail before any GPU work.
    with pytest.raises(RuntimeError, match=r"low_latency_dispatch\(use_nvfp4=True\) is not supported"):
        buffer.low_latency_dispatch(None, None, 128, 256, use_nvfp4=True, x_global_scale=None)
    with pytest.raises(RuntimeError, match=r"low_latency_combine\(overlap=True\) is not supported"):
        buffer.low_latency_combine(None, None, None, None, overlap=True, block_m=64, src_signals=None)
    with pytest.raises(TypeError, match="use_fp16"):
        buffer.low_latency_dispatch(None, None, 128, 256, use_fp16=True)
    with pytest.raises(AssertionError):  # DeepEP's: internode_dispatch needs a config
        buffer.internode_dispatch(None)


# --- Output geometry (DeepepOutputs) and the stream order, against the C and C++ sources ----------

REPO = Path(__file__).resolve().parents[2]


def _run_compiled(tmp_path, compiler, source, *flags):
    """Builds and runs a small C/C++ program; skips without the compiler."""
    path = shutil.which(compiler)
    if path is None:
        pytest.skip(f"no {compiler}")
    src = tmp_path / ("probe.c" if compiler == "gcc" else "probe.cpp")
    src.write_text(source)
    exe = tmp_path / "probe"
    subprocess.run([path, *flags, str(src), "-o", str(exe)], check=True, capture_output=True, text=True)
    return subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split("\n")


def test_allocate_planned_follows_the_description(monkeypatch):
    """allocate_planned(output_plan(...)) (with a stand-in torch): outputs sharing an allocation are
    parts of one torch.empty (split when they lie back to back in output order, else views at
    their offsets), the others one torch.empty each, absent ones None; allocation_recipe with the
    description also writes each address into its descriptor."""
    import types

    from deep_ep_cpp import _lib

    made = []

    class Tensor(tuple):
        def __new__(cls, fields, ptr):
            t = super().__new__(cls, fields)
            t.ptr = ptr
            return t

        def data_ptr(self):
            return self.ptr

    class Storage:
        def __init__(self, elems, dtype):
            self.elems, self.dtype = elems, dtype

        def as_strided(self, shape, strides, offset):
            return Tensor((self.dtype, shape, strides, offset), 0x1000 + offset)

        def split_with_sizes(self, sizes):
            offsets = [sum(sizes[:i]) for i in range(len(sizes))]
            return [Tensor((self.dtype, (n,), "part", at), 0x1000 + at) for n, at in zip(sizes, offsets)]

    def empty(elems, dtype, device):
        made.append((elems, dtype, device))
        if isinstance(elems, tuple):  # a contiguous output alone in its allocation
            return Tensor((dtype, elems, device), 0x2000)
        return Storage(elems, dtype)

    fake = types.SimpleNamespace(empty=empty, empty_strided=lambda shape, strides, dtype, device: Tensor(
        (dtype, shape, strides, device), 0x2000))
    monkeypatch.setattr(_lib, "torch", fake)
    monkeypatch.setattr(_lib, "DTYPES_BY_CODE", {_lib.DTYPE_INT32: "int32", _lib.DTYPE_BOOL: "bool"})

    def describe(layout):
        o = _lib.DeepepOutputs()
        o.count, o.num_allocations = len(layout), 2
        for i, desc in enumerate(layout):
            if desc is None:
                o.allocation[i] = -1
                continue
            code, shape, strides, group, offset = desc
            pad = (0,) * (_lib.MAX_DIMS - len(shape))
            _lib.TENSOR_FORMAT.pack_into(o, _lib.DeepepOutputs.tensors.offset + i * _lib.TENSOR_FORMAT.size, 0, code,
                                         len(shape), *shape, *pad, *strides, *pad)
            o.allocation[i], o.offset[i] = group, offset
        o.allocation_dtype[0], o.allocation_elems[0] = _lib.DTYPE_INT32, 20
        o.allocation_dtype[1], o.allocation_elems[1] = _lib.DTYPE_BOOL, 32
        return o

    # The layout's description with 4 ranks, 16 experts, 8 tokens: counts [4] + [16] back to back
    # in one int32 allocation, no rdma counts, is_token_in_rank [8, 4] alone.
    o = describe([(_lib.DTYPE_INT32, (4,), (1,), 0, 0), None, (_lib.DTYPE_INT32, (16,), (1,), 0, 4),
                  (_lib.DTYPE_BOOL, (8, 4), (4, 1), 1, 0)])
    tensors = _lib.allocate_planned(_lib.output_plan(o), "dev")
    assert made == [(20, "int32", "dev"), ((8, 4), "bool", "dev")]
    assert tensors == [("int32", (4,), "part", 0), None, ("int32", (16,), "part", 4), ("bool", (8, 4), "dev")]
    assert [o.tensors[i].data or 0 for i in range(4)] == [0, 0, 0, 0]  # without `outputs`: no pointers
    # The recipe with `outputs` allocates the same and writes each address into its descriptor.
    made.clear()
    assert list(_lib.allocation_recipe(_lib.output_plan(o), o)("dev")) == tensors
    assert made == [(20, "int32", "dev"), ((8, 4), "bool", "dev")]
    assert [o.tensors[i].data or 0 for i in range(4)] == [0x1000, 0, 0x1004, 0x2000]
    assert _lib.output_address(o, 3) == ctypes.addressof(o.tensors[3])
    assert (o.tensors[3].ndim, tuple(o.tensors[3].shape[:2])) == (2, (8, 4))  # only the address changed
    # Not in output order: views at their offsets.
    o = describe([(_lib.DTYPE_INT32, (4,), (1,), 0, 16), (_lib.DTYPE_INT32, (16,), (1,), 0, 0)])
    assert _lib.allocate_planned(_lib.output_plan(o), "dev") == [("int32", (4,), (1,), 16), ("int32", (16,), (1,), 0)]


def test_stream_order_matches_the_compiled_path(tmp_path, monkeypatch):
    """The two implementations of DeepEP's stream order (_streams.py through torch events, the
    compiled path's _fast_order.h through the driver) have the same flags, and each set of flags
    makes the same waits in the same order around a launch."""
    from deep_ep_cpp import _streams

    source = """#include <cstdio>
#include "_fast_order.h"
static const char* name(uintptr_t s) { return s == 1 ? "comm" : "compute"; }
struct Recorder {
  bool usable() const { return true; }
  int wait(uintptr_t waiter, uintptr_t signaler) const {
    std::printf(" %s<-%s", name(waiter), name(signaler));
    return 0;
  }
  void synchronize(uintptr_t) const {}
};
int main() {
  std::printf("%d %d\\n", deepep_fast::kOrderBefore, deepep_fast::kOrderAfter);
  const Recorder recorder;
  for (int flags = 0; flags < 4; ++flags) {
    const deepep_fast::OrderingOf<Recorder> ordering{&recorder, 2, flags};
    std::printf("%d:", flags);
    ordering.before(1);  // the launch on the comm stream (1) comes here
    ordering.after(1);
    std::printf("\\n");
  }
}
"""
    compiled = _run_compiled(tmp_path, "g++", source, "-std=c++17", "-Wall", "-Wextra", "-Werror",
                             f"-I{Path(_streams.__file__).parent}")  # the imported package: installed or compat/python
    assert compiled[0] == f"{_streams.ORDER_BEFORE} {_streams.ORDER_AFTER}"

    waits = []
    monkeypatch.setattr(_streams, "stream_wait_stream", lambda event, waiter, signaler: waits.append(
        f" {waiter}<-{signaler}"))
    protocol = _streams.StreamProtocol()
    protocol._sync_event = "event"
    python = []
    for flags in range(4):
        waits.clear()
        protocol._order_before(flags, "comm", "compute")  # the ctypes path's launch comes here
        protocol._op_end("comm", "compute", False, False, (), flags)
        python.append(f"{flags}:" + "".join(waits))
    assert compiled[1:5] == python
    assert python[3] == "3: comm<-compute compute<-comm"


def test_output_plans_query_once_per_key():
    """OutputPlans runs the library's query once per key, raises its error naming the argument, and
    stays bounded."""
    from deep_ep_cpp import _lib

    calls = []

    def query(key):
        def run(pointer):
            calls.append(key)
            out = pointer._obj
            out.count, out.num_allocations = 1, 1
            out.allocation[0], out.allocation_dtype[0], out.allocation_elems[0] = 0, _lib.DTYPE_INT32, key
            out.tensors[0].dtype, out.tensors[0].ndim = _lib.DTYPE_INT32, 1
            out.tensors[0].shape[0], out.tensors[0].strides[0] = key, 1
            return 0
        return run

    def get(plans, key):
        entry = plans.get(key)
        return plans.add(key, query(key)) if entry is None else entry

    plans = _lib.OutputPlans(limit=2)
    assert plans.get(5) is None
    first = get(plans, 5)
    assert get(plans, 5) is first and plans.get(5) is first and calls == [5]
    allocate, addresses = first
    assert callable(allocate) and len(addresses) == 1 and addresses[0] is not None
    get(plans, 6)
    get(plans, 7)  # the third key clears the two held
    get(plans, 5)
    assert calls == [5, 6, 7, 5]
    with pytest.raises(RuntimeError, match="buffer must not be NULL"):
        plans.add(8, _lib.lib.deepep_get_dispatch_layout_outputs, None, 8, 8)


@pytest.mark.parametrize("name, args", [
    ("deepep_get_dispatch_layout_outputs", (None, 8, 8)),
    ("deepep_intranode_dispatch_handle_outputs", (None, ctypes.c_void_p(8))),
    ("deepep_intranode_dispatch_outputs", (None, ctypes.c_void_p(8), 5)),
    ("deepep_intranode_combine_outputs", (None, ctypes.c_void_p(8))),
    ("deepep_low_latency_dispatch_outputs", (None, 128, 7168, 288, True, False)),
    ("deepep_low_latency_combine_outputs", (None, 17, 7168)),
])
def test_every_output_query_takes_what_output_plans_passes(name, args):
    """Each query's ctypes prototype takes the pointer OutputPlans passes (the ctypes path's only
    way to call them); with no buffer, the library's error is raised."""
    from deep_ep_cpp import _lib

    query = getattr(_lib.lib, name)
    with pytest.raises(RuntimeError, match="buffer must not be NULL"):
        _lib.OutputPlans().add("key", query, *args)


# --- ints from the caller that do not fit the C ABI's types: named errors, never truncated -----

INT32_RANGE = r"must fit the C ABI's int32, i.e. be in \[-2147483648, 2147483647\]"
INT64_RANGE = r"must fit the C ABI's int64, i.e. be in \[-9223372036854775808, 9223372036854775807\]"


@pytest.mark.parametrize("call, message", [
    # 2**32 + 20 used to reach the library as 20 (ctypes truncates): a valid Config, silently.
    (lambda: Config(num_sms=2**32 + 20), f"num_sms {INT32_RANGE}; got 4294967316"),
    (lambda: Config(24, 6, 256, 6, -2**31 - 1), f"num_max_rdma_chunked_recv_tokens {INT32_RANGE}"),
    (lambda: Config().get_nvl_buffer_size_hint(2**63, 8), f"hidden_bytes {INT64_RANGE}; got 9223372036854775808"),
    (lambda: Config().get_rdma_buffer_size_hint(7168, 2**32 + 8), f"num_ranks {INT32_RANGE}"),
    (lambda: deep_ep_cpp.get_default_config("dispatch", 2**32 + 8, 24), f"num_ranks {INT32_RANGE}"),
    (lambda: deep_ep_cpp.get_default_config("combine", 8, -2**40), f"num_sms {INT32_RANGE}"),
    (lambda: deep_ep_cpp.get_low_latency_rdma_size_hint(2**64, 7168, 8, 288),
     f"num_max_dispatch_tokens_per_rank {INT64_RANGE}"),
    (lambda: deep_ep_cpp.get_low_latency_rdma_size_hint(128, 7168, 8, 2**32 + 288), f"num_experts {INT32_RANGE}"),
    (lambda: _buffer(rank=2**32), f"rank {INT32_RANGE}"),
    (lambda: _buffer(num_ranks=2**32 + 2), f"num_ranks {INT32_RANGE}"),
    (lambda: _buffer(num_nvl_bytes=2**64 + 128), f"num_nvl_bytes {INT64_RANGE}"),
    (lambda: _buffer(num_rdma_bytes=-2**63 - 1), f"num_rdma_bytes {INT64_RANGE}"),
])
def test_out_of_range_ints_are_named_value_errors(call, message):
    with pytest.raises(ValueError, match=r"^deepep-nccl: " + message):
        call()


def test_ints_must_be_integers_and_edges_pass():
    with pytest.raises(TypeError, match="deepep-nccl: num_sms must be an integer, got float"):
        Config(num_sms=20.0)
    # The edges themselves reach the library unchanged, which checks their meaning.
    assert Config(num_sms=2**31 - 1).num_sms == 2**31 - 1
    with pytest.raises(RuntimeError, match=r"DEEPEP_ERROR_INVALID_ARGUMENT: .*num_sms must be >= 0, got -2147483648"):
        Config(num_sms=-2**31)
    assert Config(num_sms=True + 23).num_sms == 24  # anything with __index__ is an int


def _synced(monkeypatch, low_latency_mode=False):
    """A Buffer as if sync() had made it, with a handle the library never gave out: a call that
    reaches the library fails naming the handle, so an int check must come first to be seen."""
    buffer = _buffer(low_latency_mode=low_latency_mode, num_rdma_bytes=1 << 20 if low_latency_mode else 0)
    monkeypatch.setattr(buffer, "_handle", 0xdeadbeef)
    monkeypatch.setattr(buffer, "_current_stream", lambda: None, raising=False)
    monkeypatch.setattr(buffer, "_device", None, raising=False)
    monkeypatch.setattr(buffer, "_device_id", -1, raising=False)  # the stubs' get_device(), GPU or not
    return buffer


class _Stub:
    """A tensor stand-in for the ctypes paths without torch: shape and dim(), nothing else."""

    def __init__(self, *shape):
        self.shape = shape

    def dim(self):
        return len(self.shape)

    def get_device(self):
        return -1


@pytest.mark.parametrize("method, args, name", [
    ("clean_low_latency_buffer", (2**32 + 128, 7168, 288), "num_max_dispatch_tokens_per_rank"),
    ("clean_low_latency_buffer", (128, 7168, -2**31 - 288), "num_experts"),
    ("get_next_low_latency_combine_buffer", (128, 2**32 + 7168, 288), "hidden"),
    ("low_latency_update_mask_buffer", (2**32 + 1, True), "rank_to_mask"),
])
def test_buffer_methods_name_out_of_range_ints(monkeypatch, method, args, name):
    buffer = _synced(monkeypatch, low_latency_mode=True)
    with pytest.raises(ValueError, match=f"^deepep-nccl: {name} {INT32_RANGE}"):
        getattr(buffer, method)(*args)
    buffer._handle = None


def test_set_gpu_timeout_ms_names_a_value_past_uint64(monkeypatch):
    buffer = _synced(monkeypatch)
    with pytest.raises(ValueError, match=r"^deepep-nccl: ms must fit the C ABI's uint64, i.e. be in \[0, 18446744073709551615\]"):
        buffer.set_gpu_timeout_ms(2**64)
    with pytest.raises(RuntimeError, match=r"buffer \(0xdeadbeef\) was never created"):
        buffer.set_gpu_timeout_ms(2**64 - 1)  # fits: the library sees it (and the made-up handle)
    buffer._handle = None


def test_ll_ops_name_out_of_range_ints_on_the_ctypes_path(monkeypatch):
    from deep_ep_cpp import _lib, _low_latency

    buffer = _synced(monkeypatch, low_latency_mode=True)
    x = _Stub(17, 7168)
    # A new dispatch shape checks M and E before the library's query (which takes E as an int32).
    for m, e, name in ((2**32 + 128, 288, "num_max_dispatch_tokens_per_rank"), (128, 2**32 + 288, "num_experts")):
        with pytest.raises(ValueError, match=f"^deepep-nccl: {name} {INT32_RANGE}"):
            buffer.low_latency_dispatch(x, _Stub(17, 8), None, None, m, e, False, False, False, False, False)
    # Combine packs them into its args struct: struct.pack's refusal is named.
    monkeypatch.setattr(_low_latency, "_desc", lambda name, t: (0,) * _lib.TENSOR_WORDS)
    monkeypatch.setattr(buffer, "_ll_ops", None)
    for m, e, name in ((2**31, 288, "num_max_dispatch_tokens_per_rank"), (128, -2**31 - 1, "num_experts")):
        with pytest.raises(ValueError, match=f"^deepep-nccl: {name} {INT32_RANGE}"):
            buffer.low_latency_combine(_Stub(36, 1024, 7168), _Stub(17, 8), None, None, None, None, m, e, False,
                                       False, False, False, out=_Stub(17, 7168))
    buffer._handle = None


def test_normal_ops_name_out_of_range_ints_on_the_ctypes_path(monkeypatch):
    from deep_ep_cpp import _lib, _normal

    buffer = _synced(monkeypatch)
    monkeypatch.setattr(_normal, "_desc", lambda name, t: (0,) * _lib.TENSOR_WORDS)
    x, config = _Stub(17, 7168), Config()
    for alignment, worst, name in ((2**31, 0, "expert_alignment"), (1, 2**32, "num_worst_tokens")):
        with pytest.raises(ValueError, match=f"^deepep-nccl: {name} {INT32_RANGE}"):
            buffer._dispatch_ctypes(buffer._handle, x, None, None, None, None, None, None, 0, None, None, alignment,
                                    worst, config)
    with pytest.raises(ValueError, match=f"^deepep-nccl: cached_num_recv_tokens {INT32_RANGE}"):
        buffer._dispatch_ctypes(buffer._handle, x, None, None, None, None, None, None, 2**32 + 5, _Stub(2, 2),
                                _Stub(2, 12), 1, 0, config)
    with pytest.raises(ValueError, match=f"^deepep-nccl: num_experts {INT32_RANGE}"):
        buffer._layout_ctypes(buffer._handle, _Stub(17, 8), 2**32 + 64)
    buffer._handle = None


def test_compiled_path_refuses_out_of_range_ints_instead_of_truncating():
    """The compiled path gets ints through pybind11, whose int casters refuse a value that does
    not fit (TypeError, which _fast_call turns into the ctypes path); int64 counts it narrows to
    the C ABI's int32 it checks (fits_int32: BAD_INPUT, the ctypes path too). The ctypes path then
    names the argument (the tests above). Needs torch with CUDA and the built module."""
    from deep_ep_cpp import _fast

    torch = _fast.torch
    if torch is None or not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA (the GPU suite's test_python step runs it)")
    fast = _fast.module()
    if fast is None:
        pytest.skip("the compiled host path did not build here")
    # Never called: every call below is refused before it reaches a function pointer.
    null_fn = 0
    order = fast.StreamOrder(0)
    ll_ops = fast.LlOps(*(null_fn,) * len(_fast.LL_OPS_ENTRIES), 0x4445_0100_0001_0000, 0, order)
    for m, hidden, experts in ((2**32 + 128, 7168, 288), (128, -2**31 - 1, 288), (128, 7168, 2**63)):
        with pytest.raises(TypeError, match="incompatible function arguments"):
            ll_ops.next_combine_buffer(m, hidden, experts, None)
        assert ll_ops.clean(m, hidden, experts if experts < 2**63 else 2**40, 0) == (fast.BAD_INPUT,)
    ops = fast.NormalOps(*(null_fn,) * len(_fast.NORMAL_OPS_ENTRIES), 2, 0)
    topk = torch.zeros(4, 2, dtype=torch.int64, device="cuda:0")
    assert ops.layout(0x4445_0100_0001_0000, topk, 2**32 + 8, 0, order, 0, 0) == (fast.BAD_INPUT,)
    with pytest.raises(TypeError, match="incompatible function arguments"):
        ops.layout(0x4445_0100_0001_0000, topk, 2**64, 0, order, 0, 0)
    # The internode ops: the same refusals, and a cached dispatch without the whole handle.
    inter = fast.InternodeOps(*(null_fn,) * len(_fast.INTERNODE_OPS_ENTRIES), 2, 0)
    x = torch.zeros(4, 16, dtype=torch.bfloat16, device="cuda:0")
    in_rank = torch.zeros(4, 2, dtype=torch.bool, device="cuda:0")
    matrix = torch.zeros(2, 12, dtype=torch.int32, device="cuda:0")

    def dispatch(num_recv=0, num_rdma_recv=0, handle=(None,) * 4, alignment=1, worst=0):
        return inter.dispatch(0x4445_0100_0001_0000, x, None, None, None, None, None, in_rank, None, num_recv,
                              num_rdma_recv, *handle, alignment, worst, 0, 0, order, 0, 0)

    for kwargs in (dict(num_recv=2**32 + 5), dict(num_rdma_recv=-2**31 - 1), dict(alignment=2**31), dict(worst=2**40),
                   dict(handle=(matrix, None, matrix, None))):
        assert dispatch(**kwargs) == (fast.BAD_INPUT,), kwargs
    with pytest.raises(TypeError, match="incompatible function arguments"):
        dispatch(alignment=2**64)
    cpu_x = x.cpu()
    assert inter.combine(0x4445_0100_0001_0000, cpu_x, None, None, None, in_rank, in_rank, matrix, matrix, matrix,
                         matrix, matrix, 0, 0, order, 0, 0) == (fast.BAD_INPUT,)


# --- the LL ops: no torch call from Python on the compiled path ---------------------------------


def _ll_synced(monkeypatch, ops):
    """_synced's LL buffer with `ops` as its compiled LlOps and made-up streams."""
    buffer = _synced(monkeypatch, low_latency_mode=True)
    monkeypatch.setattr(buffer, "_ll_ops", ops)
    monkeypatch.setattr(buffer, "_compute_handle", 7, raising=False)
    monkeypatch.setattr(buffer, "_comm_stream", object(), raising=False)
    monkeypatch.setattr(buffer, "_comm_stream_ptr", 9, raising=False)
    return buffer


def test_deep_ep_ll_ops_make_no_torch_call_from_python(monkeypatch):
    """deep_ep.Buffer's LL dispatch, combine (with hooks) and clean on the compiled path: under a
    TorchFunctionMode (torch.set_default_device's) each torch call from Python costs ~1 us, so
    none may be made between the entry and the compiled op; the handle's hidden size comes from
    the op, and combine hands the handle's to the op, which checks x against it."""
    torch = pytest.importorskip("torch")
    from torch.overrides import TorchFunctionMode

    import deep_ep
    from deep_ep_cpp import _fast

    calls = []
    outs = (torch.zeros(2, 16, 256), None, torch.zeros(2, dtype=torch.int32), torch.zeros(2, 16, dtype=torch.int32),
            torch.zeros(2, 2, dtype=torch.int64))

    class Ops:  # LlOps' interface (_fast_ll.h), answering at once
        def dispatch(self, *a):
            calls.append(("dispatch", a))
            return (0, *outs, "dispatch hook" if a[9] == 1 else None, 256)

        def combine(self, *a):
            calls.append(("combine", a))
            return 0, "combined_x", "combine hook" if a[12] == 1 else None

        def clean(self, *a):
            calls.append(("clean", a))
            return (0,)

    runtime = _ll_synced(monkeypatch, Ops())
    monkeypatch.setattr(runtime, "_fast", types.SimpleNamespace(BAD_INPUT=-2, DRIVER_ERROR=-3))
    buffer = object.__new__(deep_ep.Buffer)
    buffer.runtime = runtime
    x, topk_idx, weights = torch.zeros(3, 256, dtype=torch.bfloat16), torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2)
    y = torch.zeros(2, 16, 256, dtype=torch.bfloat16)
    seen = []

    class Counting(TorchFunctionMode):
        def __torch_function__(self, func, types_, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Counting():
        recv_x, count, handle, event, hook = buffer.low_latency_dispatch(x, topk_idx, 8, 4, use_fp8=False,
                                                                         return_recv_hook=True)
        combined_x, combine_event, combine_hook = buffer.low_latency_combine(y, topk_idx, weights, handle,
                                                                             return_recv_hook=True)
        buffer.clean_low_latency_buffer(8, 256, 4)
    assert seen == []
    assert recv_x is outs[0] and count is outs[2] and hook == "dispatch hook" and event.event is None
    assert handle[0] is outs[3] and handle[1] is outs[4] and handle[2:] == (8, 256, 4)
    assert (combined_x, combine_event.event, combine_hook) == ("combined_x", None, "combine hook")
    (_, dispatch_args), (_, combine_args), (_, clean_args) = calls
    assert dispatch_args[0] is x and dispatch_args[4:6] == (8, 4) and dispatch_args[9:13] == (1, 7, 7, 0)
    # combine: x, M, E, the handle's hidden size, send only on the compute stream, no waits.
    assert combine_args[0] is y and combine_args[7:9] == (8, 4) and combine_args[11:15] == (256, 1, 7, 7)
    assert clean_args == (8, 256, 4, 7)
    assert _fast.torch is torch


def _compiled_ll_buffer(monkeypatch):
    """(torch, an LL _synced buffer, its compiled module), or a skip where the module cannot be had."""
    from deep_ep_cpp import _fast

    if _fast.torch is None:
        pytest.skip("needs torch (and a C++ compiler for the compiled host path)")
    buffer = _synced(monkeypatch, low_latency_mode=True)
    if buffer._fast is None:
        pytest.skip("the compiled host path did not build here")
    return _fast.torch, buffer, buffer._fast


def test_ll_combine_names_a_hidden_size_other_than_the_handles_on_the_ctypes_path(monkeypatch):
    buffer = _synced(monkeypatch, low_latency_mode=True)
    with pytest.raises(RuntimeError, match=r"^deepep-nccl: x has hidden size 7168, the dispatch \(handle\) had 4096$"):
        buffer._ll_combine(_Stub(36, 1024, 7168), _Stub(17, 8), None, None, None, None, 128, 288, False, False, False,
                           False, None, 4096)
    buffer._handle = None


def test_compiled_ll_hook_launches_the_receive_once_per_call_and_raises_the_librarys_error(tmp_path, monkeypatch):
    """The compiled path's receive hook (_fast_ll.h's LlRecvHook, a Python type of its own): a
    send-only combine returns it; each call launches the receive phase with the send's args, stream
    and half; a failed launch raises the library's error through raise_status (as a doubled hook's
    "runs once" does on a GPU); it takes no arguments, cannot be made from Python, and keeps the
    Buffer alive until it dies. On CPU tensors, under a C stand-in of deepep_low_latency_combine: its
    send takes half 1, its receive is recorded, then handed to `forward` when set (the library)."""
    from deep_ep_cpp import _fast, _lib

    torch, buffer, fast = _compiled_ll_buffer(monkeypatch)
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("no gcc")
    source = tmp_path / "stub.c"
    source.write_text("""#include "deepep_nccl.h"
typedef DeepepStatus (*Combine)(const DeepepBuffer*, const DeepepLowLatencyCombineArgs*, void*, int*);
Combine forward;
long receives[5];  /* count, then the last receive's buffer, stream, half and x address */
DeepepStatus deepep_low_latency_combine(const DeepepBuffer* b, const DeepepLowLatencyCombineArgs* a, void* s,
                                        int* idx) {
  if (a->phases == DEEPEP_LL_PHASE_SEND) {
    *idx = 1;
    return DEEPEP_SUCCESS;
  }
  receives[0] += a->phases == DEEPEP_LL_PHASE_RECV;
  receives[1] = (long)b;
  receives[2] = (long)s;
  receives[3] = *idx;
  receives[4] = (long)a->x.data;
  return forward ? forward(b, a, s, idx) : DEEPEP_SUCCESS;
}
""")
    stub_path = tmp_path / "libstub.so"
    subprocess.run([gcc, "-shared", "-fPIC", f"-I{_fast._header_dir()}", str(source), "-o", str(stub_path)],
                   check=True)
    stub = ctypes.CDLL(str(stub_path))
    combine_fn = ctypes.cast(stub.deepep_low_latency_combine, ctypes.c_void_p).value
    handle = 0x4445_0100_0001_0000
    ops = fast.LlOps(0, combine_fn, 0, 0, 0, handle, 0, fast.StreamOrder(0))
    y = torch.zeros(2, 4, 256, dtype=torch.bfloat16)
    topk_idx, weights = torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2)
    src_info, layout_range = torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int64)
    out = torch.zeros(3, 256, dtype=torch.bfloat16)
    owner = object()
    owned = sys.getrefcount(owner)
    status, combined_x, hook = ops.combine(y, topk_idx, weights, src_info, layout_range, None, out, 2, 4, False, False,
                                           256, 1, 77, 77, 0, owner)
    assert status == 0 and combined_x is out and sys.getrefcount(owner) == owned + 1
    assert type(hook).__name__ == "LlCombineHook" and type(hook) is fast.LlCombineHook
    receives = (ctypes.c_long * 5).in_dll(stub, "receives")
    assert receives[0] == 0  # the send alone
    assert hook() is None and hook() is None  # the library, not the hook, says a receive runs once
    assert list(receives) == [2, handle, 77, 1, y.data_ptr()]
    with pytest.raises(TypeError, match="takes no arguments"):
        hook(1)
    with pytest.raises(TypeError, match="cannot create"):
        type(hook)()
    # A failed receive: the library's status and message, as raise_status gives them.
    ctypes.c_void_p.in_dll(stub, "forward").value = ctypes.cast(_lib.lib.deepep_low_latency_combine,
                                                                 ctypes.c_void_p).value
    with pytest.raises(RuntimeError, match=r"\(0x4445010000010000\) was never created") as failed:
        hook()
    with pytest.raises(RuntimeError) as direct:
        _lib.raise_status(_lib.lib.deepep_low_latency_combine(handle, None, None, None))
    assert failed.value.args[0].split(":")[0] == direct.value.args[0].split(":")[0]
    assert receives[0] == 3
    del hook
    gc.collect()
    assert sys.getrefcount(owner) == owned
    buffer._handle = None


def test_compiled_ll_ops_check_ints_and_hidden_before_the_library(monkeypatch):
    """The compiled LlOps on CPU tensors and a made-up handle: what it refuses (BAD_INPUT: the
    ctypes path then names it) and what it hands to the library (which names the handle)."""
    torch, buffer, fast = _compiled_ll_buffer(monkeypatch)
    monkeypatch.setattr(buffer, "_stream_order", fast.StreamOrder(0), raising=False)
    buffer._ll_sync()
    monkeypatch.setattr(buffer, "_compute_handle", 1, raising=False)
    ops = buffer._ll_ops
    assert ops.clean(2**32 + 128, 7168, 288, 1) == (fast.BAD_INPUT,)
    with pytest.raises(ValueError, match=f"^deepep-nccl: num_experts {INT32_RANGE}"):
        buffer.clean_low_latency_buffer(128, 7168, -2**31 - 288)
    with pytest.raises(RuntimeError, match=r"buffer \(0xdeadbeef\) was never created"):
        buffer.clean_low_latency_buffer(128, 7168, 288)
    # combine, send only (no stream waits): x's hidden size against the handle's, then the library.
    y = torch.zeros(2, 4, 256, dtype=torch.bfloat16)
    topk_idx, weights = torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2)
    src_info, layout_range = torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int64)
    out = torch.zeros(3, 256, dtype=torch.bfloat16)

    def combine(hidden):
        return ops.combine(y, topk_idx, weights, src_info, layout_range, None, out, 2, 4, False, False, hidden, 1, 1,
                           1, 0, None)

    assert combine(128) == (fast.BAD_INPUT,)
    reached = combine(256)
    assert reached[0] not in (0, fast.BAD_INPUT) and combine(-1) == reached
    with pytest.raises(RuntimeError, match=r"^deepep-nccl: x has hidden size 256, the dispatch \(handle\) had 128$"):
        buffer._ll_combine(y, topk_idx, weights, src_info, layout_range, None, 2, 4, False, False, False, True, out,
                           128)
    # dispatch: x off the buffer's device is not taken.
    assert ops.dispatch(torch.zeros(3, 256, dtype=torch.bfloat16), topk_idx, None, None, 8, 4, False, False, False, 1,
                        1, 1, 0, None) == (fast.BAD_INPUT,)
    buffer._handle = None
