"""The low-latency ops' C ABI as deep_ep_cpp sees it, without torch or a GPU: the ctypes structs
against the C header compiled by gcc, the output-geometry queries (deepep_low_latency_*_outputs,
the zero-copy view's descriptor) and how _low_latency.py packs what they describe, and the
receive-hook protocol, whose three copies (ctypes, the compiled path's _fast_hook.h,
deepep_nccl.hpp) must agree. Tests that need a GPU (a real buffer) skip themselves without one.
"""
import ctypes
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from deep_ep_cpp import _lib, _low_latency
from deep_ep_cpp._lib import DeepepOutputs, DeepepTensor, lib

ROOT = Path(__file__).resolve().parents[2]
HEADER_DIR = ROOT / "include"
PACKAGE_DIR = Path(_lib.__file__).parent  # the imported package: installed (its shipped headers) or compat/python
INVALID_ARGUMENT = 1
_devices = ctypes.c_int()
HAS_GPU = lib.deepep_device_count(ctypes.byref(_devices)) == 0 and _devices.value > 0


def _run_program(tmp_path, compiler, source, suffix, *flags):
    """Compiles and runs a program against include/; its stdout."""
    if shutil.which(compiler) is None:
        pytest.skip(f"no {compiler}")
    src = tmp_path / f"prog{suffix}"
    src.write_text(source)
    exe = tmp_path / "prog"
    subprocess.run([compiler, *flags, f"-I{HEADER_DIR}", str(src), "-o", str(exe)], check=True,
                   capture_output=True, text=True)
    return subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout


def _last_error():
    return lib.deepep_last_error().decode()


# --- struct layouts ------------------------------------------------------------------------------

# Struct layouts: tests/python/test_abi_layouts_cpu.py checks every struct deep_ep_cpp lays out.


COUNTER_QUERIES = ("deepep_normal_query_dropped", "deepep_internode_query_traffic")


def test_low_latency_and_counter_query_prototypes_match_the_header():
    header = (HEADER_DIR / "deepep_nccl.h").read_text()
    names = [n for n in _lib._PROTOTYPES if "low_latency" in n or n in COUNTER_QUERIES]
    assert {"deepep_low_latency_dispatch_outputs", "deepep_low_latency_combine_outputs"} <= set(names)
    for name in names:
        found = re.search(rf"\b{name}\(([^)]*)\);", header)
        assert found, f"{name} is not in deepep_nccl.h"
        params = [p.strip() for p in found.group(1).split(",") if p.strip() not in ("", "void")]
        assert len(params) == len(_lib._PROTOTYPES[name][1]), name
    view = re.search(r"deepep_get_next_low_latency_combine_buffer\(([^)]*)\);", header).group(1)
    assert "DeepepTensor *out" in view
    assert _lib._PROTOTYPES["deepep_get_next_low_latency_combine_buffer"][1][-1] == ctypes.POINTER(DeepepTensor)


# --- the output queries without a buffer ---------------------------------------------------------


@pytest.mark.parametrize("name", COUNTER_QUERIES)
def test_counter_queries_name_a_null_buffer_and_a_null_tensor(name):
    query = getattr(lib, name)
    out = DeepepTensor(data=0x1000, dtype=7, ndim=1)
    assert (query(None, ctypes.byref(out), None), _last_error()) == (INVALID_ARGUMENT, "buffer must not be NULL")
    status = query(0xdeadbeef, None, None)
    argument = "dropped" if "dropped" in name else "traffic"
    assert (status, _last_error()) == (INVALID_ARGUMENT, f"{argument} must not be NULL")


def test_output_queries_reject_a_null_buffer_and_describe_nothing():
    outputs = DeepepOutputs()
    outputs.count = 3
    status = lib.deepep_low_latency_dispatch_outputs(None, 128, 7168, 288, True, False, ctypes.byref(outputs))
    assert (status, _last_error(), outputs.count) == (INVALID_ARGUMENT, "buffer must not be NULL", 0)
    outputs.count = 3
    status = lib.deepep_low_latency_combine_outputs(None, 17, 7168, ctypes.byref(outputs))
    assert (status, _last_error(), outputs.count) == (INVALID_ARGUMENT, "buffer must not be NULL", 0)
    view = DeepepTensor(data=0x1000, dtype=6, ndim=3)
    status = lib.deepep_get_next_low_latency_combine_buffer(None, 128, 7168, 288, ctypes.byref(view))
    assert (status, _last_error(), view.data, view.dtype, view.ndim) == (INVALID_ARGUMENT,
                                                                          "buffer must not be NULL", None, 0, 0)
    for status in (lib.deepep_low_latency_dispatch_outputs(None, 128, 7168, 288, True, False, None),
                   lib.deepep_low_latency_combine_outputs(None, 17, 7168, None),
                   lib.deepep_get_next_low_latency_combine_buffer(None, 128, 7168, 288, None)):
        assert (status, _last_error()) == (INVALID_ARGUMENT, "out must not be NULL")


# --- how _low_latency.py packs a description -----------------------------------------------------


def _described(*outputs):
    """A DeepepOutputs as the library writes one: (dtype code, shape, strides) per output, each in
    an allocation of its own, or None (absent)."""
    o = DeepepOutputs()
    o.count = len(outputs)
    for i, spec in enumerate(outputs):
        o.allocation[i] = -1
        if spec is None:
            continue
        code, shape, strides = spec
        t = o.tensors[i]
        t.dtype, t.ndim = code, len(shape)
        t.shape[:len(shape)], t.strides[:len(shape)] = shape, strides
        g = o.num_allocations
        o.allocation[i], o.allocation_dtype[g] = g, code
        o.allocation_elems[g] = 1 + sum((d - 1) * s for d, s in zip(shape, strides))
        o.num_allocations += 1
    return o


def _dispatch_described(use_fp8, use_ue8m0, el=72, rows=512, hidden=7168, ranks=4):
    """What the Rust tests (ll::tests::dispatch_outputs_are_deepeps_geometry) hold the library to."""
    scales = None
    if use_fp8:
        cols, code = (hidden // 512, 3) if use_ue8m0 else (hidden // 128, 5)
        scales = (code, (el, rows, cols), (cols * rows, 1, rows))
    return _described((8 if use_fp8 else 6, (el, rows, hidden), (rows * hidden, hidden, 1)), scales,
                      (3, (el,), (1,)), (3, (el, rows), (rows, 1)), (4, (el, ranks), (ranks, 1)))


@pytest.mark.parametrize("use_fp8, use_ue8m0", [(True, False), (True, True), (False, False)])
def test_dispatch_shape_packs_the_described_outputs(use_fp8, use_ue8m0, monkeypatch):
    # Packed once per shape, then only re-pointed (by the allocation recipe, with a stand-in
    # torch): the descriptors are the library's, byte for byte, and re-pointing touches nothing else.
    import types

    outputs = _dispatch_described(use_fp8, use_ue8m0)
    shape = _low_latency._DispatchShape(outputs, 128, 288, use_fp8, use_fp8, use_ue8m0)
    pointers = (0x7F0000001000, 0x7F0000002000, 0x7F0000003000, 0x7F0000004000, 0x7F0000005000)
    made = iter(p for p, t in zip(pointers, outputs.tensors) if t.dtype)

    def empty(*args, **kwargs):
        ptr = next(made)
        return types.SimpleNamespace(data_ptr=lambda: ptr)

    monkeypatch.setattr(_lib, "torch", types.SimpleNamespace(empty=empty, empty_strided=empty))
    monkeypatch.setattr(_lib, "DTYPES_BY_CODE", {code: code for code in range(16)})
    allocate = _lib.allocation_recipe(shape.allocation, shape.args, _low_latency._DISPATCH_OUTPUTS_AT)
    assert [t is None for t in allocate("dev")] == [t.dtype == 0 for t in outputs.tensors[:5]]
    fields = _low_latency._DISPATCH_ARGS.unpack_from(shape.args, 0)
    descriptors = [fields[i * 11:(i + 1) * 11] for i in range(9)]
    assert descriptors[:4] == [(0,) * 11] * 4  # the inputs, packed per call
    for i in range(5):
        t = outputs.tensors[i]
        want = (pointers[i] if t.dtype else 0, t.dtype, t.ndim, *t.shape, *t.strides)
        assert descriptors[4 + i] == want, i
    assert fields[99:] == (128, 288, int(use_fp8), int(use_fp8), int(use_ue8m0), 0)
    entries, shared = shape.allocation
    assert shared == () and [e is None for e in entries] == [t.dtype == 0 for t in outputs.tensors[:5]]
    assert entries[0] == ((72, 512, 7168), (512 * 7168, 7168, 1), True, 8 if use_fp8 else 6, -1, 0)
    if use_fp8:
        assert entries[1][2] is False  # column-major scales: torch.empty_strided


def test_dispatch_shape_rejects_a_description_of_another_arity():
    with pytest.raises(RuntimeError, match="describes 4 dispatch outputs, expected 5"):
        _low_latency._DispatchShape(_described(None, None, None, None), 128, 288, False, False, False)


def test_output_plan_reads_shared_allocations():
    o = _described((3, (4, 4), (4, 1)), None, (5, (2, 6, 3), (18, 1, 6)))
    # Output 3 shares output 0's allocation, after it.
    o.count = 4
    t = o.tensors[3]
    t.dtype, t.ndim, t.shape[0], t.shape[1], t.strides[0], t.strides[1] = 3, 2, 4, 12, 12, 1
    o.allocation[3], o.offset[3] = 0, 16
    o.allocation_elems[0] = 64
    entries, shared = _lib.output_plan(o)
    assert shared == ((0, 64, 3, [16, 48]),)  # back to back in output order: split sizes
    assert entries == (((4, 4), (4, 1), True, 3, 0, 0), None, ((2, 6, 3), (18, 1, 6), False, 5, -1, 0),
                       ((4, 12), (12, 1), True, 3, 0, 16))


# --- the receive-hook protocol -------------------------------------------------------------------

_HOOK_PROGRAM = r"""
#include <cstdint>
#include <cstdio>

#include "deepep_nccl.hpp"
#include "_fast_hook.h"

// deepep::check's error path names these; no hook here fails, so the library need not be linked.
extern "C" const char* deepep_last_error(void) { return ""; }
extern "C" const char* deepep_status_string(int) { return ""; }

static uintptr_t seen[5];  // buffer, phases, num_experts, stream, buffer_idx of the last launch

template <typename Args>
int record(const DeepepBuffer* buf, const Args* args, void* stream, int* idx) {
  const uintptr_t call[5] = {uintptr_t(buf), uintptr_t(args->phases), uintptr_t(args->num_experts),
                             uintptr_t(stream), uintptr_t(*idx)};
  for (int i = 0; i < 5; ++i) seen[i] = call[i];
  return 0;
}
template <typename Args>
DeepepStatus record_status(const DeepepBuffer* buf, const Args* args, void* stream, int* idx) {
  record(buf, args, stream, idx);
  return DEEPEP_SUCCESS;
}

void print(const char* what) {
  std::printf("%s %lu %lu %lu %lu %lu\n", what, (unsigned long)seen[0], (unsigned long)seen[1],
              (unsigned long)seen[2], (unsigned long)seen[3], (unsigned long)seen[4]);
}

// The send ran with `args` (phases = send) on stream 0x2000 of buffer 0x1000 and reported half
// 1; the caller then reuses its args struct before the hook runs.
template <typename Args>
void both(const char* op) {
  Args args{};
  args.num_experts = 77;
  args.phases = 1;
  const auto buffer = reinterpret_cast<const DeepepBuffer*>(uintptr_t{0x1000});
  void* stream = reinterpret_cast<void*>(uintptr_t{0x2000});
  deepep::LowLatencyHook hpp = deepep::LowLatencyHook::receive(record_status<Args>, buffer, args, stream, 1);
  deepep_fast::LlRecvLaunch<Args> fast(record_status<Args>, 0x1000, args, 0x2000, 1);
  args.num_experts = 99;
  args.phases = 3;
  hpp();
  std::printf("hpp_%s", op);
  print("");
  seen[0] = 0;
  fast();
  std::printf("fast_%s", op);
  print("");
}

int main() {
  std::printf("phases hpp %d %d %d fast %d %d %d\n", int(deepep::LowLatencyPhases::send),
              int(deepep::LowLatencyPhases::receive), int(deepep::LowLatencyPhases::both), deepep_fast::kPhaseSend,
              deepep_fast::kPhaseRecv, deepep_fast::kPhaseBoth);
  both<DeepepLowLatencyDispatchArgs>("dispatch");
  both<DeepepLowLatencyCombineArgs>("combine");
  return 0;
}
"""


def _ctypes_hook_launch(args_struct, num_experts_at, phases_at):
    """The ctypes path's hook in the program's scenario: what its launch passes."""
    seen = {}
    fn_type = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)

    def record(buf, args, stream, idx):
        seen["call"] = (buf, ctypes.c_int32.from_address(args + phases_at).value,
                        ctypes.c_int32.from_address(args + num_experts_at).value, stream,
                        ctypes.c_int.from_address(idx).value)
        return 0

    fn = fn_type(record)
    args = ctypes.create_string_buffer(args_struct.size)
    struct.pack_into("@i", args, num_experts_at, 77)
    struct.pack_into("@i", args, phases_at, _low_latency._SEND)
    tensors = (object(),)
    hook = _low_latency._recv_hook(fn, lambda: 0x1000, args, phases_at, 0x2000, 1, tensors)
    struct.pack_into("@i", args, num_experts_at, 99)
    struct.pack_into("@i", args, phases_at, _low_latency._BOTH)
    hook()
    assert hook.tensors is tensors  # the hook keeps the op's tensors alive
    return seen["call"]


def test_receive_hooks_agree_across_the_three_host_paths(tmp_path):
    out = _run_program(tmp_path, "g++", _HOOK_PROGRAM, ".cpp", "-std=c++17", "-Wall", "-Wextra", "-Werror",
                       f"-I{PACKAGE_DIR}")
    lines = {line.split()[0]: line.split()[1:] for line in out.splitlines()}
    phases = lines["phases"]
    assert phases[0] == "hpp" and phases[4] == "fast"
    hpp_phases, fast_phases = tuple(map(int, phases[1:4])), tuple(map(int, phases[5:8]))
    python_phases = (_low_latency._SEND, _low_latency._RECV, _low_latency._BOTH)
    assert hpp_phases == fast_phases == python_phases == (1, 2, 3)
    # The receive launch: the send's buffer, stream and half; the args as they were at the send
    # (later changes to the caller's struct do not leak in), with phases = receive.
    want = (0x1000, _low_latency._RECV, 77, 0x2000, 1)
    dispatch_num_experts_at = 9 * _low_latency._DESC_BYTES + 4
    combine_num_experts_at = 7 * _low_latency._DESC_BYTES + 4
    for op, args_struct, num_experts_at, phases_at in (
            ("dispatch", _low_latency._DISPATCH_ARGS, dispatch_num_experts_at, _low_latency._DISPATCH_PHASES_AT),
            ("combine", _low_latency._COMBINE_ARGS, combine_num_experts_at, _low_latency._COMBINE_PHASES_AT)):
        assert tuple(map(int, lines[f"hpp_{op}"])) == want, op
        assert tuple(map(int, lines[f"fast_{op}"])) == want, op
        assert _ctypes_hook_launch(args_struct, num_experts_at, phases_at) == want, op


# --- with a GPU: the queries on a real one-rank buffer -------------------------------------------


@pytest.fixture
def ll_handle():
    if not HAS_GPU:
        pytest.skip("needs a GPU (a real buffer)")
    m, hidden, experts = 8, 256, 4
    rdma = ctypes.c_int64()
    assert lib.deepep_low_latency_rdma_size_hint(m, hidden, 1, experts, ctypes.byref(rdma)) == 0, _last_error()
    uid = ctypes.create_string_buffer(_lib.UNIQUE_ID_BYTES)
    assert lib.deepep_get_unique_id(uid, len(uid)) == 0, _last_error()
    handle = ctypes.c_void_p()
    status = lib.deepep_buffer_create(0, 1, uid.raw, len(uid), 0, rdma.value, True, True, False, ctypes.byref(handle))
    assert status == 0, _last_error()
    try:
        yield handle.value, (m, hidden, experts)
    finally:
        lib.deepep_buffer_destroy(handle.value)
        lib.deepep_buffer_free(handle.value)


def _tensor(t):
    n = t.ndim
    return t.dtype, tuple(t.shape[:n]), tuple(t.strides[:n])


def test_queries_on_a_buffer_describe_deepeps_geometry(ll_handle):
    handle, (m, hidden, experts) = ll_handle
    outputs = DeepepOutputs()
    for use_fp8, use_ue8m0 in ((False, False), (True, False), (True, True)):
        hidden_here = 512 if use_ue8m0 else hidden
        status = lib.deepep_low_latency_dispatch_outputs(handle, m, hidden_here, experts, use_fp8, use_ue8m0,
                                                         ctypes.byref(outputs))
        assert status == 0, _last_error()
        want = _dispatch_described(use_fp8, use_ue8m0, el=experts, rows=m, hidden=hidden_here, ranks=1)
        assert [_tensor(outputs.tensors[i]) for i in range(5)] == [_tensor(want.tensors[i]) for i in range(5)]
    assert lib.deepep_low_latency_combine_outputs(handle, 5, hidden, ctypes.byref(outputs)) == 0, _last_error()
    assert (outputs.count, _tensor(outputs.tensors[0])) == (1, (6, (5, hidden), (hidden, 1)))
    view = DeepepTensor()
    assert lib.deepep_get_next_low_latency_combine_buffer(handle, m, hidden, experts, ctypes.byref(view)) == 0
    row = hidden + hidden // 64  # DeepEP's view rows
    assert view.data and _tensor(view) == (6, (experts, m, hidden), (m * row, row, 1))
    if _lib.torch is not None:
        torch = _lib.torch

        tensor = _low_latency._device_tensor(view, object(), torch.device("cuda", 0))
        assert (tensor.dtype, tuple(tensor.shape), tensor.stride()) == (torch.bfloat16, (experts, m, hidden),
                                                                      (m * row, row, 1))
        assert tensor.data_ptr() == view.data


@pytest.mark.parametrize(
    "m, hidden, experts, use_fp8, use_ue8m0, message",
    [
        (1025, 256, 4, False, False, r"num_max_dispatch_tokens_per_rank must be in \[1, 1024\], got 1025"),
        (10**10, 256, 4, False, False, r"got 10000000000"),
        (8, 200, 4, False, False, r"hidden must be a positive multiple of 128"),
        (8, 256, 0, False, False, r"num_experts must be positive"),
        (8, 640, 4, True, True, r"hidden \(640\) must be a multiple of 512"),
        (8, 256, 4, False, True, r"use_ue8m0 require use_fp8=True"),
    ],
)
def test_dispatch_outputs_check_the_limits_before_anything_is_allocated(ll_handle, m, hidden, experts, use_fp8,
                                                                        use_ue8m0, message):
    handle, _ = ll_handle
    outputs = DeepepOutputs()
    status = lib.deepep_low_latency_dispatch_outputs(handle, m, hidden, experts, use_fp8, use_ue8m0,
                                                     ctypes.byref(outputs))
    assert status == INVALID_ARGUMENT and re.search(message, _last_error()) and outputs.count == 0


def test_combine_outputs_check_tokens_and_hidden(ll_handle):
    handle, _ = ll_handle
    outputs = DeepepOutputs()
    for tokens, hidden, message in ((-1, 256, r"num_tokens must be in \[0, 1024\]"),
                                    (8, 200, r"hidden must be a positive multiple of 128")):
        assert lib.deepep_low_latency_combine_outputs(handle, tokens, hidden, ctypes.byref(outputs)) == INVALID_ARGUMENT
        assert re.search(message, _last_error())


# --- buffer handles: checked values, so a bad one is a named error, never a crash ---------------


@pytest.mark.parametrize("handle, fragment", [
    (0xdeadbeef, "was never created: it is not a deepep-nccl handle"),
    (2**64 - 1, "was never created: it is not a deepep-nccl handle"),
    # The library's tag and the buffer kind, with a slot and generation it never gave out.
    (0x4445_0100_00ff_fff0, "was never created: deepep_buffer_create gave out no buffer handle"),
    (0x4445_7700_0000_0001, "was never created: it has no valid handle kind"),
])
def test_made_up_buffer_handles_are_named_errors(handle, fragment):
    out = ctypes.c_int()
    for status in (lib.deepep_buffer_get_rank(handle, ctypes.byref(out)), lib.deepep_buffer_barrier(handle),
                   lib.deepep_buffer_free(handle)):
        assert status == INVALID_ARGUMENT
        assert _last_error().startswith(f"buffer ({handle:#x}) {fragment}"), _last_error()


def test_a_made_up_handle_in_a_buffer_object_raises(monkeypatch):
    from deep_ep_cpp import Buffer

    buffer = Buffer(0, 2, 1 << 20, 0, False, False, False, False)
    buffer._handle = 0xdeadbeef  # as if sync() had made it
    with pytest.raises(RuntimeError, match=r"DEEPEP_ERROR_INVALID_ARGUMENT: buffer \(0xdeadbeef\) was never created"):
        buffer.barrier()
    with pytest.raises(RuntimeError, match="was never created"):
        buffer.is_available()
    buffer._handle = None


def test_a_freed_handle_is_destroyed_for_every_later_call():
    if not HAS_GPU:
        pytest.skip("needs a GPU (a real buffer)")
    uid = ctypes.create_string_buffer(_lib.UNIQUE_ID_BYTES)
    assert lib.deepep_get_unique_id(uid, len(uid)) == 0, _last_error()
    handle = ctypes.c_void_p()
    status = lib.deepep_buffer_create(0, 1, uid.raw, len(uid), 1 << 22, 0, False, True, False, ctypes.byref(handle))
    assert status == 0, _last_error()
    # A registry handle is a 64-bit value: passed as a bare int, ctypes would truncate it to a C int.
    h, hp = handle.value, ctypes.c_void_p(handle.value)
    out = ctypes.c_int()
    assert lib.deepep_buffer_get_rank(hp, ctypes.byref(out)) == 0 and out.value == 0
    assert lib.deepep_buffer_destroy(hp) == 0, _last_error()
    assert lib.deepep_buffer_get_rank(hp, ctypes.byref(out)) == 0, "destroy() leaves the handle valid for queries"
    assert lib.deepep_buffer_free(hp) == 0, _last_error()
    for status in (lib.deepep_buffer_get_rank(hp, ctypes.byref(out)), lib.deepep_buffer_destroy(hp),
                   lib.deepep_buffer_barrier(hp), lib.deepep_buffer_free(hp), lib.deepep_buffer_free(hp)):
        assert status == INVALID_ARGUMENT
        assert _last_error().startswith(f"buffer ({h:#x}) was destroyed: deepep_buffer_free released"), _last_error()
