"""The direct entries' Python side (no torch, no GPU): Config's `_address`, and sync()'s binding of
the compiled ops' entries (_fast_direct.h) as the Buffer's methods, with stand-in ops: which
names, which ops, the weak reference (no cycle), a subclass's override left in charge, and
setting them aside again."""
import ctypes
import gc
import types
import weakref

import pytest

import deep_ep_cpp
from deep_ep_cpp import Buffer, Config, get_default_config

NORMAL = ("get_dispatch_layout", "intranode_dispatch", "intranode_combine")
LL = ("low_latency_dispatch", "_ll_dispatch", "low_latency_combine", "_ll_combine")


def test_config_carries_its_c_structs_address():
    for config in (Config(), Config(24, 6, 256, 6, 128), get_default_config("dispatch", 8, 24)):
        assert config._address == ctypes.addressof(config._c)


class _Ops:
    """A compiled ops object's binding interface: bind_buffer records its arguments; each entry
    answers with its name."""

    def __init__(self, names):
        self.bound = None
        for name in names:
            setattr(self, name, types.MethodType(lambda self, *a, _n=name: (_n, a), self))

    def bind_buffer(self, *args):
        self.bound = args


def _bound(buffer, monkeypatch):
    """`buffer` as sync() leaves it (made-up handle and comm stream, stand-in ops), then bound."""
    fast = types.SimpleNamespace(NORMAL_DIRECT_ENTRIES=NORMAL, LL_DIRECT_ENTRIES=LL)
    monkeypatch.setattr(buffer, "_fast", fast, raising=False)
    monkeypatch.setattr(buffer, "_handle", 0x1234)
    monkeypatch.setattr(buffer, "_normal_fast", _Ops(NORMAL), raising=False)
    monkeypatch.setattr(buffer, "_ll_ops", _Ops(LL), raising=False)
    monkeypatch.setattr(buffer, "_stream_order", object(), raising=False)
    monkeypatch.setattr(buffer, "_comm_stream_ptr", 0x77, raising=False)
    monkeypatch.setattr(buffer, "_comm_stream", object(), raising=False)  # a torch.cuda.Stream there
    created = []
    monkeypatch.setattr(buffer, "get_comm_stream", lambda: created.append(1), raising=False)
    buffer._bind_direct_entries()
    assert created == [1]  # the comm stream exists before the entries launch on it
    return buffer


def test_sync_binds_the_direct_entries_as_instance_methods(monkeypatch):
    buffer = _bound(Buffer(0, 2, 1 << 20, 0, False, False, False, False), monkeypatch)
    normal, ll = buffer._normal_fast, buffer._ll_ops
    for ops, names in ((normal, NORMAL), (ll, LL)):
        for name in names:
            assert vars(buffer)[name] == getattr(ops, name)
            assert getattr(buffer, name)(1, 2) == (name, (1, 2))
            assert isinstance(getattr(Buffer, name), types.FunctionType)  # the fallback and the ctypes path
    # NormalOps: the weak reference, the handle, the comm stream (the torch stream object: the entries
    # record_stream on it and record their EventHandles there) and the stream order; LlOps has the
    # handle and the order already.
    ref, handle, comm, order = normal.bound
    assert isinstance(ref, weakref.ref) and ref() is buffer
    assert handle == 0x1234 and comm is buffer._comm_stream and order is buffer._stream_order
    assert ll.bound[0] is ref and ll.bound[1] is buffer._comm_stream and len(ll.bound) == 2
    buffer._handle = None  # nothing to free


def test_unbind_sets_the_entries_aside_and_update_rebinds(monkeypatch):
    """What tests and benches use to reach the class methods (tests/gpu/common.ctypes_launches,
    bench_common.host_paths)."""
    buffer = _bound(Buffer(0, 2, 1 << 20, 0, False, False, False, False), monkeypatch)
    bound = dict(vars(buffer))
    entries = buffer._unbind_direct_entries()
    assert set(entries) == set(NORMAL + LL) and not set(NORMAL + LL) & set(vars(buffer))
    assert buffer.intranode_dispatch.__func__ is Buffer.intranode_dispatch  # the class method now
    assert buffer._unbind_direct_entries() == {}
    vars(buffer).update(entries)
    assert all(vars(buffer)[name] == bound[name] for name in NORMAL + LL)
    buffer._handle = None


def test_bound_entries_make_no_reference_cycle(monkeypatch):
    """The Buffer owns the ops and their entries; the ops hold only a weak reference to it, so
    dropping the last reference frees the Buffer (and its handle) without the cycle collector."""
    buffer = _bound(Buffer(0, 2, 1 << 20, 0, False, False, False, False), monkeypatch)
    ref = normal_ref = buffer._normal_fast.bound[0]
    entry = buffer.intranode_dispatch
    buffer._handle = None  # nothing to free
    monkeypatch.undo()  # drop monkeypatch's references to the buffer
    gc.disable()
    try:
        del buffer
        assert ref() is None and normal_ref() is None
    finally:
        gc.enable()
    assert entry(0) == ("intranode_dispatch", (0,))  # the ops outlive it (the real entry then raises)


def test_a_subclass_override_is_not_shadowed(monkeypatch):
    class Mine(Buffer):
        def intranode_combine(self, *args):
            return "mine"

    buffer = _bound(Mine(0, 2, 1 << 20, 0, False, False, False, False), monkeypatch)
    assert "intranode_combine" not in vars(buffer) and buffer.intranode_combine() == "mine"
    assert vars(buffer)["intranode_dispatch"] == buffer._normal_fast.intranode_dispatch
    buffer._handle = None


def test_the_module_names_its_entries_and_stream_constant_once():
    """The names sync() binds come from the module (NORMAL_DIRECT_ENTRIES, LL_DIRECT_ENTRIES), each
    a method of DeepEP's or deep_ep's that the Buffer class has (the fallback)."""
    for name in NORMAL + LL:
        assert callable(getattr(Buffer, name))
    from deep_ep_cpp import _streams
    assert _streams.CUDA_STREAM_LEGACY == 1  # _fast_direct.h's kCudaStreamLegacy (asserted at load)
    assert deep_ep_cpp.Buffer is Buffer


def test_without_the_compiled_path_nothing_is_bound():
    buffer = Buffer(0, 2, 1 << 20, 0, False, False, False, False)
    if buffer._fast is not None:
        pytest.skip("the compiled path loaded here")
    assert not set(NORMAL + LL) & set(vars(buffer))


def test_event_handle_records_through_the_compiled_path(monkeypatch):
    """Once a Buffer loaded the compiled path with torch's events (_buffer.py), EventHandle() takes
    its current_stream_event (_event.record_on_current_stream); EventHandle(stream) and a process
    without it keep torch.cuda.Event().record(stream)."""
    from types import SimpleNamespace

    from deep_ep_cpp import _event

    recorded = []

    class Event:
        def record(self, stream):
            recorded.append(stream)

    monkeypatch.setattr(_event, "require_torch", lambda: SimpleNamespace(cuda=SimpleNamespace(Event=Event)))
    monkeypatch.setattr(_event, "record_on_current_stream", None)
    assert type(_event.EventHandle().event) is Event and recorded == [None]
    monkeypatch.setattr(_event, "record_on_current_stream", lambda: "compiled")
    assert _event.EventHandle().event == "compiled" and recorded == [None]
    assert type(_event.EventHandle("side").event) is Event and recorded == [None, "side"]


def test_event_handle_takes_the_compiled_path_only_where_it_has_torch_events(monkeypatch):
    """A Buffer that loaded the compiled module hands it its helpers (_buffer.use_compiled_helpers):
    EventHandle() records through the module's current_stream_event only where set_python_helpers
    answered that it takes torch's events."""
    from types import SimpleNamespace

    from deep_ep_cpp import _buffer, _event

    def module(events):
        return SimpleNamespace(set_python_helpers=lambda *helpers: events, current_stream_event=lambda: "compiled")

    monkeypatch.setattr(_event, "record_on_current_stream", None)
    _buffer.use_compiled_helpers(module(False))
    assert _event.record_on_current_stream is None
    fast = module(True)
    _buffer.use_compiled_helpers(fast)
    assert _event.record_on_current_stream is fast.current_stream_event


def test_event_handle_is_what_the_compiled_path_makes():
    """The direct entries make an async op's EventHandle as object.__new__ with `event` set to a
    recorded torch.cuda.Event (_fast_direct.h's recorded_event), and read a previous_event's
    `event`: that slot is all an EventHandle holds, and its __init__ sets only it."""
    from deep_ep_cpp import _event

    assert deep_ep_cpp.EventHandle is _event.EventHandle
    assert _event.EventHandle.__slots__ == ("event",) and _event.EventHandle.__bases__ == (object,)
    assert "__new__" not in vars(_event.EventHandle)
    handle = object.__new__(_event.EventHandle)
    handle.event = "recorded"
    assert handle.event == "recorded" and not hasattr(handle, "__dict__")
