"""Helpers shared by the multi-GPU tests: process spawning with a watchdog, an
independent torch reference for get_dispatch_layout, and PASS/FAIL reporting.

Workers append one JSON line per case event to a per-rank file; the driver reads
those files after the workers exit, so results survive a worker that crashes or
hangs (the case it was in is reported as not finished)."""
import contextlib
import gc
import json
import os
import re
import socket
import sys
import tempfile
import threading
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import deep_ep

# A GPU wait that never completes should fail the case, not eat the device budget.
os.environ.setdefault('DEEPEP_GPU_TIMEOUT_SECS', '60')

_results = []  # (name, ok), in the driver process


# ---------------------------------------------------------------- processes
def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def init_dist(rank, world):
    torch.cuda.set_device(rank)
    dist.init_process_group('nccl', rank=rank, world_size=world, device_id=torch.device('cuda', rank))
    return dist.group.WORLD


class Reporter:
    """Runs named cases in a worker and records their outcome for the driver."""

    def __init__(self, path, rank):
        self.rank = rank
        self._file = open(path, 'a', buffering=1)

    def _log(self, name, status, reason=''):
        self._file.write(json.dumps({'name': name, 'status': status, 'reason': reason}) + '\n')

    def run(self, name, fn, *args):
        self._log(name, 'start')
        try:
            fn(*args)
        except Exception as e:  # one case failing must not stop the others
            self._log(name, 'fail', _describe(e))
            return False
        self._log(name, 'pass')
        return True

    def info(self, msg):
        print(f'  [rank {self.rank}] {msg}', flush=True)


def _describe(e):
    frames = traceback.extract_tb(e.__traceback__)
    where = next((f'{os.path.basename(f.filename)}:{f.lineno}' for f in reversed(frames)
                  if 'tests/gpu' in f.filename.replace(os.sep, '/')), '')
    return f'{type(e).__name__}: {e}' + (f' ({where})' if where else '')


def _worker(rank, fn, world, port, out_dir, args):
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    rep = Reporter(os.path.join(out_dir, f'rank{rank}.jsonl'), rank)
    try:
        group = init_dist(rank, world)
        torch.manual_seed(1234 + rank)
        fn(rank, world, group, rep, *args)
        torch.cuda.synchronize()
    except Exception as e:
        rep._log('worker', 'fail', _describe(e))
        raise
    dist.destroy_process_group()


def timeout_scale():
    """DEEPEP_TEST_TIMEOUT_SCALE (default 1): multiplies the tests' spawn timeouts and watchdogs, for
    runs under a slow tool (compute-sanitizer's racecheck is 10-100x slower)."""
    value = os.environ.get('DEEPEP_TEST_TIMEOUT_SCALE', '1')
    try:
        scale = float(value)
    except ValueError:
        scale = 0.0
    if not scale > 0:
        raise ValueError(f'DEEPEP_TEST_TIMEOUT_SCALE must be a positive number, got {value!r}')
    return scale


def timing_wanted():
    """DEEPEP_SMOKE_TIMING=0 skips the smoke tests' short timings (runs under compute-sanitizer)."""
    return os.environ.get('DEEPEP_SMOKE_TIMING', '1') != '0'


def spawn(fn, world_size, *args, timeout=240):
    """Runs fn(rank, world, group, reporter, *args) on world_size GPUs, prints one
    PASS/FAIL line per case (a case passes only if it passed on every rank) and
    records the results for finish(). timeout (seconds) is scaled by DEEPEP_TEST_TIMEOUT_SCALE."""
    timeout *= timeout_scale()
    out_dir = tempfile.mkdtemp(prefix=f'deepep_w{world_size}_')
    ctx = mp.spawn(_worker, args=(fn, world_size, free_port(), out_dir, args), nprocs=world_size, join=False)
    deadline, crash = time.monotonic() + timeout, None
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                crash = f'timed out after {timeout} s (hang?); workers killed'
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                for p in ctx.processes:
                    p.join()
                break
    except Exception as e:  # a worker raised or died; join() has stopped the others
        lines = [line for line in str(e).splitlines() if line.strip()]
        crash = f'process {getattr(e, "error_index", "?")}: {lines[-1] if lines else type(e).__name__}'

    per_rank = []
    for rank in range(world_size):
        path = os.path.join(out_dir, f'rank{rank}.jsonl')
        events = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
        per_rank.append(events)
    names = dict.fromkeys(e['name'] for events in per_rank for e in events)  # first-seen order
    for name in names:
        reasons = []
        for rank, events in enumerate(per_rank):
            mine = [e for e in events if e['name'] == name]
            final = [e for e in mine if e['status'] in ('pass', 'fail')]
            if not mine:
                reasons.append(f'rank {rank}: no result')
            elif not final:
                reasons.append(f'rank {rank}: did not finish (crash or hang)')
            elif final[-1]['status'] == 'fail':
                reasons.append(f'rank {rank}: {final[-1]["reason"]}')
        report(f'w{world_size}/{name}', not reasons, '; '.join(reasons))
    if crash:
        report(f'w{world_size}/processes', False, crash)


def report(name, ok, reason=''):
    _results.append((name, ok))
    print(f'PASS {name}' if ok else f'FAIL {name}: {reason}', flush=True)


def skip(name, reason):
    print(f'SKIP {name}: {reason}', flush=True)


def finish():
    passed = sum(ok for _, ok in _results)
    failed = len(_results) - passed
    print(f'{passed} passed, {failed} failed', flush=True)
    sys.exit(1 if failed or not passed else 0)


# ---------------------------------------------------------------- references
def ref_layout(topk_idx, num_experts, num_ranks):
    """DeepEP's get_dispatch_layout semantics (spec 6.1), computed with plain torch ops."""
    idx = topk_idx.long()
    num_tokens, valid = idx.size(0), idx >= 0
    per_expert = torch.bincount(idx[valid], minlength=num_experts).int()
    # Invalid slots scatter into an extra column that is dropped afterwards.
    rank_idx = torch.where(valid, idx // (num_experts // num_ranks), num_ranks)
    in_rank = torch.zeros(num_tokens, num_ranks + 1, dtype=torch.bool, device=idx.device)
    in_rank.scatter_(1, rank_idx, True)
    in_rank = in_rank[:, :num_ranks].contiguous()
    per_rank = in_rank.sum(0, dtype=torch.int32)
    per_rdma = None
    if num_ranks > 8:
        per_rdma = in_rank.view(num_tokens, num_ranks // 8, 8).any(2).sum(0, dtype=torch.int32)
    return per_rank, per_rdma, per_expert, in_rank


LAYOUT_NAMES = ('num_tokens_per_rank', 'num_tokens_per_rdma_rank', 'num_tokens_per_expert', 'is_token_in_rank')


def assert_layout(out, topk_idx, num_experts, num_ranks, is_async=False):
    """Checks a get_dispatch_layout result tuple against ref_layout: arity, dtypes,
    shapes, device, exact values and the event."""
    assert isinstance(out, tuple) and len(out) == 5, f'expected a 5-tuple, got {type(out).__name__} of {len(out)}'
    for name, got, want in zip(LAYOUT_NAMES, out, ref_layout(topk_idx, num_experts, num_ranks)):
        if want is None:
            assert got is None, f'{name} should be None with {num_ranks} ranks, got {got!r}'
            continue
        assert isinstance(got, torch.Tensor), f'{name} is {type(got).__name__}'
        assert got.dtype == want.dtype, f'{name} dtype {got.dtype}, expected {want.dtype}'
        assert got.shape == want.shape, f'{name} shape {tuple(got.shape)}, expected {tuple(want.shape)}'
        assert got.device == topk_idx.device, f'{name} on {got.device}, expected {topk_idx.device}'
        if not torch.equal(got, want):
            bad = (got != want).nonzero()
            raise AssertionError(f'{name}: {bad.size(0)} entries differ, first at {bad[0].tolist()}: '
                                 f'got {got[tuple(bad[0])].item()}, expected {want[tuple(bad[0])].item()}')
    event = out[4]
    assert isinstance(event, deep_ep.EventOverlap), f'5th item is {type(event).__name__}, not EventOverlap'
    assert (event.event is not None) == is_async, f'event.event is {event.event!r} with async_finish={is_async}'


def random_topk(num_tokens, num_experts, num_topk):
    """DeepEP's test routing: top-k of |randn| + 1 scores, as deep_ep.topk_idx_t."""
    scores = torch.randn(num_tokens, num_experts, device='cuda').abs() + 1
    return torch.topk(scores, num_topk, dim=-1, sorted=False).indices.to(deep_ep.topk_idx_t)


def expect_raises(what, exc, fn, *words):
    """fn() must raise exc with a message containing every word in words."""
    try:
        fn()
    except exc as e:
        missing = [w for w in words if w not in str(e)]
        assert not missing, f'{what}: {type(e).__name__} message does not name {missing}: {str(e)!r}'
        return e
    except Exception as e:
        raise AssertionError(f'{what}: expected {exc}, got {type(e).__name__}: {e}') from e
    raise AssertionError(f'{what}: expected {exc}, nothing was raised')


@contextlib.contextmanager
def make_buffer(group, **kwargs):
    """A Buffer destroyed on exit even when a check fails, so every rank keeps
    making the same collective calls."""
    buf = deep_ep.Buffer(group, explicitly_destroy=True, **kwargs)
    try:
        yield buf
    finally:
        buf.destroy()


def device_memory():
    """(free device bytes, torch-allocated bytes) after gc and with torch's cache emptied."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0], torch.cuda.memory_allocated()


def settled_device_memory(max_wait_s=5.0):
    """device_memory() once it stops changing: Buffer.destroy() returns before NCCL's own
    teardown of the buffer's communicator ends (a background thread, about 0.5 s), so a sample
    right after a destroy would count memory that is on its way back. A leak stays."""
    deadline = time.monotonic() + max_wait_s
    last = device_memory()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = device_memory()
        if abs(now[0] - last[0]) < 2**20 and now[1] == last[1]:
            return now
        last = now
    return last


def shrink_state(buf, world):
    """(mask [world], dropped [4]) of a shrink buffer as lists, read in stream order."""
    mask = torch.zeros(world, dtype=torch.int32)
    dropped = torch.zeros(4, dtype=torch.int64)
    buf.low_latency_query_mask_buffer(mask)
    buf.normal_query_dropped_buffer(dropped)
    torch.cuda.synchronize()
    return mask.tolist(), dropped.tolist()


# ---------------------------------------------------------------- multi-rank checks
_FP8_DTYPES = tuple(getattr(torch, n) for n in ('float8_e4m3fn', 'float8_e5m2') if hasattr(torch, n))


def assert_same(name, got, want):
    """got equals want exactly: a tensor of the same dtype, shape and device, torch.equal
    values (FP8 compared as bytes, which torch.equal may not support)."""
    assert isinstance(got, torch.Tensor), f'{name} is {type(got).__name__}, not a tensor'
    assert got.dtype == want.dtype, f'{name} dtype {got.dtype}, expected {want.dtype}'
    assert got.shape == want.shape, f'{name} shape {tuple(got.shape)}, expected {tuple(want.shape)}'
    assert got.device == want.device, f'{name} on {got.device}, expected {want.device}'
    if got.dtype in _FP8_DTYPES:
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    if torch.equal(got, want):
        return
    bad = (got != want).nonzero()
    if bad.size(0) == 0:
        raise AssertionError(f'{name}: not equal')
    first = tuple(bad[0].tolist())
    raise AssertionError(f'{name}: {bad.size(0)} of {got.numel()} entries differ, first at {list(first)}: '
                         f'got {got[first].item()}, expected {want[first].item()}')


def expect_raises_match(what, exc, fn, pattern):
    """fn() must raise exc (a class or a tuple) with a message matching the regular expression pattern."""
    try:
        fn()
    except exc as e:
        assert re.search(pattern, str(e)), f'{what}: {type(e).__name__} message does not match /{pattern}/: {str(e)!r}'
        return e
    except Exception as e:
        raise AssertionError(f'{what}: expected {exc}, got {type(e).__name__}: {e}') from e
    raise AssertionError(f'{what}: expected {exc}, nothing was raised')


class Checks:
    """Collects failed checks instead of stopping at the first, so that every rank keeps making
    the same collective calls (library calls, reference gathers) in the same order even when
    a check fails on one rank only. done() raises the collected failures."""

    def __init__(self):
        self.errors = []

    def __call__(self, fn, *args, **kwargs):
        """Runs a check function; an AssertionError is recorded, anything else propagates."""
        try:
            fn(*args, **kwargs)
        except AssertionError as e:
            # Name the line in the test module that failed, not the helper that raised.
            frames = [f for f in traceback.extract_tb(e.__traceback__)
                      if 'tests/gpu' in f.filename.replace(os.sep, '/')
                      and os.path.basename(f.filename) not in ('common.py', 'normal_reference.py')]
            where = f' ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})' if frames else ''
            self.errors.append(f'{e or "assertion failed"}{where}')
            return False
        return True

    def expect(self, condition, message):
        if not condition:
            self.errors.append(message)

    def agree(self, group):
        """Collective: raises on every rank if a check failed on any rank, so that no rank goes
        on to calls whose inputs came from a failed step (and the others do not wait for it)."""
        failed = torch.tensor([len(self.errors)], dtype=torch.int32, device='cuda')
        dist.all_reduce(failed, group=group)
        if failed.item():
            self._raise('a check failed on another rank')

    def done(self):
        if self.errors:
            self._raise()

    def _raise(self, default=None):
        if not self.errors:
            raise AssertionError(default)
        more = f' [+{len(self.errors) - 3} more]' if len(self.errors) > 3 else ''
        raise AssertionError(' | '.join(self.errors[:3]) + more)


@contextlib.contextmanager
def ctypes_launches(runtime):
    """Runs the block's normal ops through the ctypes path, so that a test's patch of a C ABI entry
    (deep_ep_cpp._normal.lib.*) is the launch taken: the compiled path answers None, and the direct
    entries sync() bound on the instance (deep_ep_cpp/_fast_direct.h) are set aside meanwhile."""
    bound = runtime._unbind_direct_entries()
    runtime._fast_with_config = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del runtime._fast_with_config
        vars(runtime).update(bound)


@contextlib.contextmanager
def watchdog(rep, name, seconds):
    """Fails case `name` and ends this worker if the block is still running after `seconds`,
    so a hang is reported as such within seconds instead of at the spawn timeout."""
    seconds *= timeout_scale()

    def expire():
        rep._log(name, 'fail', f'still running after {seconds:g} s (hang); worker ended')
        os._exit(3)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def destroy_after_stall(rep, name, destroy, chk=None, limit_s=20):
    """Runs `destroy` (a buffer's destroy) under a 60 s watchdog after a case that may have
    stalled: a poisoned buffer may report the stall again, which is logged, not failed. With
    `chk`, destroy must also return within limit_s."""
    start = time.monotonic()
    with watchdog(rep, name, 60):
        try:
            destroy()
        except RuntimeError as e:
            rep.info(f'destroy() after {name} raised: {e}')
    seconds = time.monotonic() - start
    if chk is not None:
        chk.expect(seconds < limit_s, f'destroy() after {name} took {seconds:.1f} s')
