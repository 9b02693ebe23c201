"""The compiled path's direct entries (deep_ep_cpp/_fast_direct.h) on 2 GPUs: DeepEP's Buffer
methods that sync() binds on the deep_ep_cpp.Buffer instance, so that a call goes straight into C++.

With DEEPEP_NCCL_FAST=1 (the first spawn):
* the instance's get_dispatch_layout, intranode_dispatch / _combine, low_latency_dispatch /
  _combine and _ll_dispatch / _ll_combine are the compiled ops' entries (the class methods stay);
* their results equal the ctypes path's (the class methods with the compiled ops hidden, what
  DEEPEP_NCCL_FAST=0 runs) bit for bit, and none falls back to the class method: layout, dispatch
  (BF16, FP8 with row- and column-major scales, cached), combine, LL dispatch
  (BF16, FP8, with a hook), LL combine (also with out= as a keyword);
* EventHandle() records through the compiled path (current_stream_event) on the current stream;
* DeepEP's events run in C++ too (the class methods raise meanwhile, so nothing fell back):
  previous_event (an EventHandle recorded on the compute stream after the inputs were written late,
  behind a sleep, and one never recorded) with async_, with and without allocate_on_comm_stream, and
  without async_; LL async_: the results bit for bit as the ctypes path's, the returned EventHandle
  (a torch.cuda.Event inside) orders the compute stream's reads after the op, the outputs come from
  the comm stream's pool with allocate_on_comm_stream (the compute stream's otherwise) and the
  compute stream is current again after the call;
* the cases they hand to the class method behave as before: allocate_on_comm_stream without
  previous_event or async_ (the class's error), LL async_ with return_recv_hook (the class's error),
  keywords, a wrong argument count (the class's TypeError), a Config subclass, a CPU tensor (the
  same RuntimeError text), a destroyed buffer (the same error);
* dropping the last reference frees the Buffer without the cycle collector, and a kept entry then
  raises instead of using the freed handle.
With DEEPEP_NCCL_FAST=0 (the second spawn) nothing is bound and the public API still runs.

Run: PYTHONPATH=compat/python python tests/gpu/test_direct_entry.py"""
import contextlib
import gc
import os
import sys
import weakref

import torch
import torch.distributed as dist

import deep_ep
import deep_ep_cpp
from common import assert_same, finish, spawn

E, T, H, K = 64, 512, 2048, 8
LL_M, LL_H, LL_E, LL_T, LL_K = 128, 2048, 16, 96, 4
NORMAL = ('get_dispatch_layout', 'intranode_dispatch', 'intranode_combine')
LL = ('low_latency_dispatch', '_ll_dispatch', 'low_latency_combine', '_ll_combine')


@contextlib.contextmanager
def ctypes_path(rt):
    """The class methods with the compiled ops hidden: the ctypes path, as DEEPEP_NCCL_FAST=0 runs."""
    saved = rt._normal_fast, rt._ll_ops
    rt._normal_fast = rt._ll_ops = None
    try:
        yield
    finally:
        rt._normal_fast, rt._ll_ops = saved


def class_call(rt, name, *args, **kwargs):
    return getattr(type(rt), name)(rt, *args, **kwargs)


def same(what, got, want):
    """Equal outputs (tensors bit for bit: dtype, shape, values; lists, None and ints as they are)."""
    if isinstance(want, torch.Tensor):
        assert_same(what, got, want)
    else:
        assert got == want, f'{what}: {got!r}, expected {want!r}'


def same_tuple(what, got, want, skip=()):
    assert isinstance(got, tuple) and len(got) == len(want), f'{what}: {len(got)}-tuple, expected {len(want)}'
    for i, (g, w) in enumerate(zip(got, want)):
        if i not in skip:
            same(f'{what}[{i}]', g, w)


def same_message(what, direct, cls):
    """direct() and cls() raise the same exception type and text."""
    errors = []
    for fn in (direct, cls):
        try:
            fn()
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - compared below
            errors.append((type(e), str(e)))
    assert errors[0] is not None and errors[0] == errors[1], f'{what}: direct {errors[0]}, class method {errors[1]}'


@contextlib.contextmanager
def class_methods_wrapped(rt, wrap):
    """The class methods of the direct entries' names replaced by wrap(name, method) while inside."""
    cls = type(rt)
    saved = {name: vars(cls).get(name) for name in NORMAL + LL}
    for name in saved:
        setattr(cls, name, wrap(name, getattr(cls, name, None)))
    try:
        yield
    finally:
        for name, method in saved.items():
            if method is None:
                delattr(cls, name)
            else:
                setattr(cls, name, method)


def no_fallback(rt):
    """The class methods of the direct entries' names raise inside: a call that fell back fails."""
    def refuse(name, method):
        def call(self, *args, **kwargs):
            raise AssertionError(f'the direct entry {name} fell back to the class method')
        return call
    return class_methods_wrapped(rt, refuse)


def ll_shape_described_once(rt, x, topk, use_fp8):
    """An LL dispatch shape's first call goes through the class method, which describes the shape to
    the compiled ops (by design: kNewShape); its second goes direct."""
    calls = []

    def counted(name, method):
        def call(self, *args, **kwargs):
            calls.append(name)
            return method(self, *args, **kwargs)
        return call
    args = (x, topk, None, None, LL_M, LL_E, use_fp8, False, False, False, False)
    for expected in (['_ll_dispatch'], []):
        calls.clear()
        with class_methods_wrapped(rt, counted):
            rt._ll_dispatch(*args)
        assert calls == expected, f'LL dispatch fp8={use_fp8}: class methods called {calls}, expected {expected}'


SLEEP_CYCLES = 20_000_000  # ~10 ms of torch.cuda._sleep: unordered work would see the zeros


def written_late(src):
    """A copy of src written on the compute stream behind a sleep (zeros until then), and an
    EventHandle recorded right after the write, as a training stack's previous_event."""
    dst = torch.zeros_like(src.view(torch.uint8)).view(src.dtype)  # (float8 has no zeros of its own everywhere)
    torch.cuda._sleep(SLEEP_CYCLES)
    dst.copy_(src)
    return dst, deep_ep_cpp.EventHandle()


def never_recorded():
    """An EventHandle whose event was never recorded (waiting on it does nothing, in torch too)."""
    handle = object.__new__(deep_ep_cpp.EventHandle)
    handle.event = torch.cuda.Event()
    return handle


def pool_stream(t):
    """The stream whose pool t's memory came from (the caching allocator's segment)."""
    for segment in torch.cuda.memory_snapshot():
        if segment['address'] <= t.data_ptr() < segment['address'] + segment['total_size']:
            return segment['stream']
    raise AssertionError('no segment holds the tensor')


def event_done(what, got_event, async_, t, allocated_on):
    """The returned event as the class method's (an EventHandle on async_, else None; the compute
    stream waits on it before the caller reads), the compute stream current again, and the outputs
    (t) from `allocated_on`'s pool."""
    if async_:
        assert type(got_event) is deep_ep_cpp.EventHandle and type(got_event.event) is torch.cuda.Event, \
            f'{what}: event {got_event!r}'
        assert got_event.event.cuda_event != 0, f'{what}: the event was never recorded'
        got_event.current_stream_wait()
    else:
        assert got_event is None, f'{what}: event {got_event!r}'
    assert torch.cuda.current_stream() == COMPUTE[0], f'{what}: the compute stream is not current again'
    assert pool_stream(t) == allocated_on.cuda_stream, f'{what}: allocated from the wrong stream\'s pool'


COMPUTE = []  # the worker's compute stream
# (previous_event, async_, allocate_on_comm_stream) of the events' cases the entries take
EVENT_CASES = (('recorded', True, False), ('recorded', True, True), ('recorded', False, False), ('none', True, False),
               ('never recorded', True, True))


def with_event(previous, src):
    """(input, previous_event) of an events' case: src written late with the EventHandle recorded
    after it; written late with none (the comm stream waits for the compute stream then); or src
    as it is, finished (the host waited), with an EventHandle never recorded (no wait at all)."""
    if previous == 'recorded':
        return written_late(src)
    if previous == 'none':
        return written_late(src)[0], None
    torch.cuda.synchronize()
    return src, never_recorded()


def event_handle_compiled(rt, world):
    """EventHandle() takes the compiled path's current_stream_event once a Buffer loaded it (the
    Python path made to raise meanwhile), and its event is what torch.cuda.Event().record() makes:
    recorded on the current stream of the moment (a side stream, the compute stream, the side stream
    again: the kept stream object follows it), so a wait on it orders the work before it, and on
    that stream only; and on the current device (another GPU's default stream has the same id)."""
    from deep_ep_cpp import _event
    assert _event.record_on_current_stream == rt._fast.current_stream_event
    with python_events_raise():
        compiled_event_handle_cases(world)


@contextlib.contextmanager
def python_events_raise():
    """EventHandle()'s Python path (torch.cuda.Event via _event.require_torch) raises while inside."""
    from deep_ep_cpp import _event
    def refuse():
        raise AssertionError("EventHandle() took its Python path")
    saved, _event.require_torch = _event.require_torch, refuse
    try:
        yield
    finally:
        _event.require_torch = saved


def compiled_event_handle_cases(world):
    me = torch.cuda.current_device()
    peer = (me + 1) % world
    for device in (peer, me, peer, me):
        with torch.cuda.device(device):
            handle = deep_ep_cpp.EventHandle()
        assert handle.event.device == torch.device('cuda', device), (handle.event.device, device)
        handle.event.synchronize()
    side = torch.cuda.Stream()
    for stream in (side, torch.cuda.current_stream(), side):
        with torch.cuda.stream(stream):
            src = torch.arange(1 << 20, dtype=torch.int32)
            dst, handle = written_late(src)
        assert type(handle.event) is torch.cuda.Event and not handle.event.query()
        reader = torch.cuda.Stream()
        with torch.cuda.stream(reader):
            handle.current_stream_wait()
            got = dst.clone()
        reader.synchronize()
        assert handle.event.query() and torch.equal(got, src)
    torch.cuda._sleep(SLEEP_CYCLES)  # the compute stream busy, the side stream idle
    with torch.cuda.stream(side):
        handle = deep_ep_cpp.EventHandle()
    handle.event.synchronize()
    assert not torch.cuda.current_stream().query(), 'EventHandle() recorded on another stream than the current one'
    torch.cuda.synchronize()


def topk_of(num_tokens, num_experts, num_topk):
    # contiguous: the library takes topk_idx row-major only (argsort's column slice is a strided view)
    return torch.rand(num_tokens, num_experts, dtype=torch.float32).argsort(1)[:, :num_topk].contiguous().to(
        deep_ep.topk_idx_t)


# ---------------------------------------------------------------- cases
def entries_bound(rt, fast):
    for ops, names in ((rt._normal_fast, NORMAL), (rt._ll_ops, LL)):
        for name in names:
            entry = vars(rt).get(name)
            assert entry is not None and entry.__self__ is ops and entry.__name__ == name, f'{name}: {entry!r}'
            assert getattr(type(rt), name) is getattr(deep_ep_cpp.Buffer, name)
    assert fast.NORMAL_DIRECT_ENTRIES == NORMAL and fast.LL_DIRECT_ENTRIES == LL


def layout_equal(rt):
    topk = topk_of(T, E, K)
    with no_fallback(rt):
        got = rt.get_dispatch_layout(topk, E, None, False, False)
    with ctypes_path(rt):
        want = class_call(rt, 'get_dispatch_layout', topk, E, None, False, False)
    same_tuple('layout', got, want)
    same('event', got[4], None)


def dispatch_combine_equal(rt, world):
    config, combine_config = deep_ep.Buffer.get_dispatch_config(world), deep_ep.Buffer.get_combine_config(world)
    topk = topk_of(T, E, K)
    weights = torch.rand(T, K, dtype=torch.float32)
    per_rank, _, per_expert, in_rank, _ = rt.get_dispatch_layout(topk, E, None, False, False)
    x = torch.randn(T, H, dtype=torch.bfloat16)
    x_fp8 = x.to(torch.float8_e4m3fn)
    scales = torch.rand(T, H // 128, dtype=torch.float32)
    # Column-major scales are what DeepEP's tests (and DeepGEMM's casts) pass.
    for name, xs, sc in (('bf16', x, None), ('fp8', x_fp8, scales), ('fp8 column-major scales', x_fp8, scales.T.contiguous().T)):
        args = (xs, sc, topk, weights, per_rank, in_rank, per_expert, 0, None, None, 1, 0, config, None, False, False)
        with no_fallback(rt):
            got = rt.intranode_dispatch(*args)
        with ctypes_path(rt):
            want = class_call(rt, 'intranode_dispatch', *args)
        same_tuple(f'dispatch {name}', got, want)
        (recv_x, recv_scales, recv_topk, recv_weights, _, rank_prefix, channel_prefix, recv_channel_prefix, src_idx,
         send_head, _) = got
        # cached: the handle of the dispatch above
        cached = (xs, sc, None, None, None, in_rank, None, recv_x.size(0), rank_prefix, channel_prefix, 1, 0, config,
                  None, False, False)
        with no_fallback(rt):
            got_cached = rt.intranode_dispatch(*cached)
        with ctypes_path(rt):
            want_cached = class_call(rt, 'intranode_dispatch', *cached)
        same_tuple(f'cached dispatch {name}', got_cached, want_cached)
    y = recv_x.to(torch.bfloat16) if recv_x.dtype != torch.bfloat16 else recv_x
    # DeepEP's combine takes the receive side's channel prefixes (its handle[2])
    combine = (y, recv_weights, None, None, src_idx, rank_prefix, recv_channel_prefix, send_head, combine_config, None,
               False, False)
    with no_fallback(rt):
        got = rt.intranode_combine(*combine)
    with ctypes_path(rt):
        want = class_call(rt, 'intranode_combine', *combine)
    same_tuple('combine', got, want)


def valid_rows_equal(what, got, want, count):
    """LL packed outputs: only the first count[e] rows of expert e are written."""
    for e in range(count.numel()):
        n = int(count[e])
        same(f'{what} expert {e}', got[e, :n], want[e, :n])


def ll_equal(rt):
    topk = topk_of(LL_T, LL_E, LL_K)
    weights = torch.rand(LL_T, LL_K, dtype=torch.float32)
    x = torch.randn(LL_T, LL_H, dtype=torch.bfloat16)
    for use_fp8 in (False, True):
        ll_shape_described_once(rt, x, topk, use_fp8)
        for hook in (False, True):
            args = (x, topk, None, None, LL_M, LL_E, use_fp8, False, False, False, hook)
            with no_fallback(rt):
                got = rt._ll_dispatch(*args)
                if hook:
                    got[6]()
                public = rt.low_latency_dispatch(*args)
                if hook:
                    public[6]()
            with ctypes_path(rt):
                want = class_call(rt, '_ll_dispatch', *args)
                if hook:
                    want[6]()
            name = f'LL dispatch fp8={use_fp8} hook={hook}'
            assert (got[6] is not None) == hook and type(got[6]).__name__ in ('LlDispatchHook', 'NoneType')
            assert len(public) == 7 and got[7] == want[7] == LL_H
            for out in (got, public):
                same(f'{name} count', out[2], want[2])
                same(f'{name} layout_range', out[4], want[4])
                same(f'{name} event', out[5], None)
                valid_rows_equal(f'{name} recv_x', out[0], want[0], want[2])
                valid_rows_equal(f'{name} src_info', out[3], want[3], want[2])
                if use_fp8:
                    valid_rows_equal(f'{name} scales', out[1], want[1], want[2])
    # The combines' handle: a BF16 dispatch just before; the received rows are the expert output.
    y, _, _, src_info, layout_range = rt._ll_dispatch(x, topk, None, None, LL_M, LL_E, False, False, False, False,
                                                      False)[:5]
    for hook in (False, True):
        args = (y, topk, weights, src_info, layout_range, None, LL_M, LL_E, False, False, False, hook)
        out = torch.empty(LL_T, LL_H, dtype=torch.bfloat16)
        with no_fallback(rt):
            got = rt._ll_combine(*args, None, LL_H)
            if hook:
                got[2]()
            public = rt.low_latency_combine(*args, out=out)
            if hook:
                public[2]()
        with ctypes_path(rt):
            want = class_call(rt, '_ll_combine', *args, None, LL_H)
            if hook:
                want[2]()
        same(f'LL combine hook={hook}', got[0], want[0])
        same(f'LL combine out= hook={hook}', public[0], want[0])
        assert public[0] is out and got[1] is None and (got[2] is not None) == hook


def direct_case(rt, what, name, args, case, allocated_on):
    """rt.<name>(*args, events of `case`) with args[0] written late (with_event), through the direct
    entry (nothing falls back), against the ctypes path's call without events; returns the latter."""
    previous, async_, on_comm = case
    with ctypes_path(rt):
        want = class_call(rt, name, *args, None, False, False)
    late, prior = with_event(previous, args[0])
    with no_fallback(rt):
        got = getattr(rt, name)(late, *args[1:], prior, async_, on_comm)
    event_at = len(got) - 1  # DeepEP's event comes last
    event_done(what, got[event_at], async_, got[0], allocated_on)
    same_tuple(what, got, want, skip=(event_at,))
    if async_:
        outputs = [t for t in got if isinstance(t, torch.Tensor)]
        del got
        freed_outputs_wait(what, outputs, COMPUTE[0] if on_comm else rt.get_comm_stream())
    return want


def freed_outputs_wait(what, outputs, other):
    """async_: each output's allocation was record_stream'ed on the stream it was not allocated on
    (`other`), once per storage (the entries record views of one allocation once): freed while
    `other` is busy, its caching-allocator block stays pending (active_pending_free) instead of free
    for reuse. Blocks still referenced elsewhere (a cached dispatch's own handle inputs) are skipped.
    Empties `outputs`."""
    blocks = {t.untyped_storage().data_ptr() for t in outputs if t.untyped_storage().nbytes() > 0}
    with torch.cuda.stream(other):
        torch.cuda._sleep(SLEEP_CYCLES)  # the allocator's event on `other` stays pending meanwhile
    outputs.clear()
    states = {b['address']: b['state'] for segment in torch.cuda.memory_snapshot() for b in segment['blocks']}
    free = sorted(hex(p) for p in blocks if states.get(p) == 'inactive')
    assert not free, f'{what}: outputs freed for reuse at once (never record_stream\'ed): {free}'
    assert all(states.get(p) in ('active_pending_free', 'active_allocated') for p in blocks), \
        f'{what}: output blocks {[(hex(p), states.get(p)) for p in blocks]}'
    other.synchronize()


def events_equal(rt, world):
    """previous_event / async_ / allocate_on_comm_stream through the direct entries, in C++ (the
    class methods raise meanwhile): as the ctypes path's results, ordered by the events."""
    comm = rt.get_comm_stream()
    config, combine_config = deep_ep.Buffer.get_dispatch_config(world), deep_ep.Buffer.get_combine_config(world)
    topk = topk_of(T, E, K)
    weights = torch.rand(T, K, dtype=torch.float32)
    x = torch.randn(T, H, dtype=torch.bfloat16)
    scales = torch.rand(T, H // 128, dtype=torch.float32)
    for case in EVENT_CASES:
        what = 'previous_event {} async={} on_comm={}'.format(*case)
        allocated_on = comm if case[2] else COMPUTE[0]
        per_rank, _, per_expert, in_rank, _ = direct_case(rt, f'layout {what}', 'get_dispatch_layout', (topk, E),
                                                          case, allocated_on)
        for name, xs, sc in (('bf16', x, None), ('fp8', x.to(torch.float8_e4m3fn), scales)):
            args = (xs, sc, topk, weights, per_rank, in_rank, per_expert, 0, None, None, 1, 0, config)
            want = direct_case(rt, f'dispatch {name} {what}', 'intranode_dispatch', args, case, allocated_on)
            recv_x, _, _, recv_weights, _, rank_prefix, channel_prefix, recv_channel_prefix, src_idx, send_head, _ = want
            cached = (xs, sc, None, None, None, in_rank, None, recv_x.size(0), rank_prefix, channel_prefix, 1, 0, config)
            direct_case(rt, f'cached dispatch {name} {what}', 'intranode_dispatch', cached, case, allocated_on)
        y = recv_x.to(torch.bfloat16) if recv_x.dtype != torch.bfloat16 else recv_x
        combine = (y, recv_weights, None, None, src_idx, rank_prefix, recv_channel_prefix, send_head, combine_config)
        direct_case(rt, f'combine {what}', 'intranode_combine', combine, case, allocated_on)
    # What the class method raises, it raises (the entry hands these to it).
    prior = deep_ep_cpp.EventHandle()
    for prior_, async_ in ((None, True), (prior, False), (None, False)):
        same_message(f'allocate_on_comm_stream previous_event={prior_} async_={async_}',
                     lambda: rt.get_dispatch_layout(topk, E, prior_, async_, True),
                     lambda: class_call(rt, 'get_dispatch_layout', topk, E, prior_, async_, True))


def ll_events_equal(rt):
    """LL async_ through the direct entries, in C++: the ctypes path's results, an EventHandle on
    the comm stream that orders the compute stream's reads; with return_recv_hook the class's error."""
    topk = topk_of(LL_T, LL_E, LL_K)
    weights = torch.rand(LL_T, LL_K, dtype=torch.float32)
    x = torch.randn(LL_T, LL_H, dtype=torch.bfloat16)
    for use_fp8 in (False, True):
        args = (topk, None, None, LL_M, LL_E, use_fp8, False, False)
        with ctypes_path(rt):
            want = class_call(rt, '_ll_dispatch', x, *args, False, False)
        for name in ('_ll_dispatch', 'low_latency_dispatch'):
            late_x, _ = written_late(x)  # no previous_event in LL: the comm stream waits for the compute stream
            with no_fallback(rt):
                got = getattr(rt, name)(late_x, *args, True, False)
            what = f'LL {name} fp8={use_fp8} async'
            event_done(what, got[5], True, got[0], COMPUTE[0])
            assert got[6] is None and len(got) == (8 if name == '_ll_dispatch' else 7)
            same(f'{what} count', got[2], want[2])
            valid_rows_equal(f'{what} recv_x', got[0], want[0], want[2])
            valid_rows_equal(f'{what} src_info', got[3], want[3], want[2])
    same_message('LL dispatch async_ with return_recv_hook', lambda: rt._ll_dispatch(x, *args, True, True),
                 lambda: class_call(rt, '_ll_dispatch', x, *args, True, True))
    y, _, _, src_info, layout_range = rt._ll_dispatch(x, topk, None, None, LL_M, LL_E, False, False, False, False,
                                                      False)[:5]
    args = (topk, weights, src_info, layout_range, None, LL_M, LL_E, False, False)
    with ctypes_path(rt):
        want = class_call(rt, '_ll_combine', y, *args, False, False, None, LL_H)
    late_y, _ = written_late(y)
    with no_fallback(rt):
        got = rt._ll_combine(late_y, *args, True, False, None, LL_H)
    event_done('LL _ll_combine async', got[1], True, got[0], COMPUTE[0])
    same('LL _ll_combine async', got[0], want[0])
    late_y, _ = written_late(y)
    out = torch.empty(LL_T, LL_H, dtype=torch.bfloat16)
    with no_fallback(rt):
        got = rt.low_latency_combine(late_y, *args, True, False, out=out)
    event_done('LL low_latency_combine async out=', got[1], True, got[0], COMPUTE[0])
    assert got[0] is out and got[2] is None
    same('LL low_latency_combine async out=', got[0], want[0])
    same_message('LL combine async_ with return_recv_hook', lambda: rt._ll_combine(y, *args, True, True, None, LL_H),
                 lambda: class_call(rt, '_ll_combine', y, *args, True, True, None, LL_H))


def fallbacks(rt, world):
    topk = topk_of(T, E, K)
    want = rt.get_dispatch_layout(topk, E, None, False, False)
    # keywords, a wrong argument count
    same_tuple('keywords', rt.get_dispatch_layout(topk, E, previous_event=None, async_=False,
                                                  allocate_on_comm_stream=False), want)
    same_message('two arguments', lambda: rt.get_dispatch_layout(topk, E),
                 lambda: class_call(rt, 'get_dispatch_layout', topk, E))
    # a CPU tensor: the ctypes path names it
    same_message('CPU topk_idx', lambda: rt.get_dispatch_layout(topk.cpu(), E, None, False, False),
                 lambda: class_call(rt, 'get_dispatch_layout', topk.cpu(), E, None, False, False))
    x = torch.randn(T, H, dtype=torch.bfloat16)
    per_rank, _, per_expert, in_rank, _ = want
    config = deep_ep.Buffer.get_dispatch_config(world)
    args = (None, topk, torch.ones(T, K, dtype=torch.float32), per_rank, in_rank, per_expert, 0, None, None, 1, 0,
            config, None, False, False)
    same_message('CPU x', lambda: rt.intranode_dispatch(x.cpu(), *args),
                 lambda: class_call(rt, 'intranode_dispatch', x.cpu(), *args))

    # a Config subclass: the class method (which reads its C struct)
    class MyConfig(deep_ep_cpp.Config):
        pass

    mine = MyConfig(config.num_sms, config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens,
                    config.num_max_rdma_chunked_send_tokens, config.num_max_rdma_chunked_recv_tokens)
    got = rt.intranode_dispatch(x, *args[:11], mine, None, False, False)
    same_tuple('Config subclass', got, rt.intranode_dispatch(x, *args))


def destroyed_buffer(group):
    """A destroyed buffer: the library's error, as through the class method."""
    buf = deep_ep.Buffer(group, num_nvl_bytes=1 << 26, explicitly_destroy=True)
    rt = buf.runtime
    topk = topk_of(T, E, K)
    buf.destroy()
    same_message('destroyed layout', lambda: rt.get_dispatch_layout(topk, E, None, False, False),
                 lambda: class_call(rt, 'get_dispatch_layout', topk, E, None, False, False))


def freed_without_gc(group):
    """No reference cycle: the last reference's drop frees the runtime (and its handle); an entry
    kept past it raises."""
    buf = deep_ep.Buffer(group, num_nvl_bytes=1 << 26)
    rt = buf.runtime
    ref, entry = weakref.ref(rt), rt.get_dispatch_layout
    topk = topk_of(T, E, K)
    torch.cuda.synchronize()
    gc.collect()
    gc.disable()
    try:
        del buf, rt
        alive = ref() is not None
    finally:
        gc.enable()
    dist.barrier(group)
    assert not alive, 'the runtime outlived its last reference (a cycle)'
    try:
        entry(topk, E, None, False, False)
    except RuntimeError as e:
        assert 'was deleted' in str(e), str(e)
    else:
        raise AssertionError('an entry of a freed Buffer ran')


def worker(rank, world, group, rep):
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device('cuda')
    hint = max(deep_ep.Buffer.get_dispatch_config(world).get_nvl_buffer_size_hint(H * 2, world),
               deep_ep.Buffer.get_combine_config(world).get_nvl_buffer_size_hint(H * 2, world))
    buf = deep_ep.Buffer(group, num_nvl_bytes=hint, explicitly_destroy=True)
    rt, fast = buf.runtime, buf.runtime._fast
    COMPUTE[:] = [torch.cuda.current_stream()]
    rep.run('entries_bound', entries_bound, rt, fast)
    rep.run('layout_equal', layout_equal, rt)
    rep.run('dispatch_combine_equal', dispatch_combine_equal, rt, world)
    rep.run('events_equal', events_equal, rt, world)
    rep.run('event_handle_compiled', event_handle_compiled, rt, world)
    rep.run('fallbacks', fallbacks, rt, world)
    buf.destroy()
    ll_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(LL_M, LL_H, world, LL_E)
    ll = deep_ep.Buffer(group, num_rdma_bytes=ll_bytes, low_latency_mode=True, num_qps_per_rank=LL_E // world,
                        explicitly_destroy=True)
    rep.run('ll_equal', ll_equal, ll.runtime)
    rep.run('ll_events_equal', ll_events_equal, ll.runtime)
    ll.destroy()
    rep.run('destroyed_buffer', destroyed_buffer, group)
    rep.run('freed_without_gc', freed_without_gc, group)


def ctypes_worker(rank, world, group, rep):
    torch.set_default_device('cuda')  # as DeepEP's tests run
    def nothing_bound():
        buf = deep_ep.Buffer(group, num_nvl_bytes=1 << 26, explicitly_destroy=True)
        try:
            assert buf.runtime._fast is None and not set(NORMAL + LL) & set(vars(buf.runtime))
            assert deep_ep_cpp._event.record_on_current_stream is None  # EventHandle() stays Python
            topk = topk_of(T, E, K)
            buf.get_dispatch_layout(topk, E)
        finally:
            buf.destroy()

    rep.run('ctypes_nothing_bound', nothing_bound)


if __name__ == '__main__':
    if torch.cuda.device_count() < 2:
        print('test_direct_entry needs 2 GPUs')
        sys.exit(1)
    os.environ['DEEPEP_NCCL_FAST'] = '1'  # the spawned workers inherit it
    spawn(worker, 2, timeout=240)
    os.environ['DEEPEP_NCCL_FAST'] = '0'
    spawn(ctypes_worker, 2, timeout=120)
    finish()
