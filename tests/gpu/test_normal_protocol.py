"""Normal-mode protocol regressions on 2 GPUs (issue 24: review findings F2, F7, F8 and F9, item 3),
each case on fresh Buffers, run the way DeepEP's tests run (default dtype BF16, default device CUDA)
against the independent torch references of normal_reference.py.

* prefilled_flags_{dispatch,combine} (F2): before a fresh buffer's first dispatch (op epoch 0)
  or combine (epoch 1), every rank fills its NVL region with 0x7f bytes (huge BF16 rows) and
  puts, at every ring slot's flag address, the int32 pair (seq + 1, epoch): small integers, as
  stale top-k ids of another ring geometry can leave there. The outputs must still be exact.
* ring2_random_delays_sms{8,24} (F7, F8): dispatch, cached dispatch and combine on 2-slot rings
  (the smallest Config), random GPU delays per rank before each op; every output exact.
* handle_* (item 3): a cached dispatch or a combine with one handle entry corrupted on rank 1.
  Every output the library allocates lies between two guard regions (the ctypes host path,
  DEEPEP_NCCL_FAST=0, allocates through Python, which this test points at guarded memory);
  the guards must stay untouched on every rank, and some rank must report an error naming the
  corrupted entry. A peer may also stall (bounded) waiting for rows that were skipped.
  Entry 4 (is_token_in_rank, handle_is_token_in_rank_*) is checked against channel_prefix_matrix
  per channel: a channel whose count disagrees sends nothing and the fault names the entry; a
  token fewer shows as rank 0's stall too, tokens added for a rank expecting none do not reach it.
* graph_replay_after_stall_poisons_outputs (F9): dispatch + combine captured in a CUDA graph;
  rank 1 stops replaying. Rank 0's replays after its wait expired must leave NaN (BF16 rows)
  and -1 (top-k ids) in the outputs, not the last good results; is_available() (one host
  read, no other call) must say False, and its next call must raise the timeout naming rank 1.

Checks are collected (common.Checks) so that all ranks keep making the same collective calls.
Run: python tests/gpu/test_normal_protocol.py (2 GPUs); NORMAL_PROTOCOL_CASES="name ..." runs only
the cases named (the graph case, if named, still runs last)."""
import ctypes
import os

os.environ['DEEPEP_NCCL_FAST'] = '0'  # before deep_ep loads: the guarded allocation is the ctypes path's

import random
import re
import sys
import time

import torch
import torch.distributed as dist

import deep_ep
from common import Checks, assert_same, destroy_after_stall, expect_raises_match, finish, skip, spawn, watchdog
from deep_ep_cpp import _lib
from test_normal import (E, MAX_HIDDEN, check_cached, check_combine, check_dispatch, check_handle, expect_dispatch,
                         late_dispatch, layout_args, make_ctx, make_inputs, make_x, sent_weights, sleep_cycles)
from normal_reference import ref_combine

HIDDEN = 4096
CONFIG = deep_ep.Config(24, 6, 256, 6, 128)  # 12 channels, rings of 256 slots
NVL_BYTES = 256 << 20  # the rings of CONFIG at HIDDEN with top-8 take 51 MB
NUM_CHANNELS, RING = CONFIG.num_sms // 2, CONFIG.num_max_nvl_chunked_recv_tokens
CORRUPT_RANK = 1
STALL_MS = 1500
GUARD_BYTES = 4 << 20
GUARD_BYTE = 0x5a
ENTRY_NAMED = r'rank_prefix_matrix|channel_prefix_matrix|send_head|counts a peer sent'


def ring_slot_bytes(query, *geometry):
    """A ring slot's bytes as the library lays it out (a slot's flag is its first 8 bytes)."""
    out = ctypes.c_int64()
    _lib.check(query(*geometry, ctypes.byref(out)))
    return out.value


# ---------------------------------------------------------------- guarded allocation
class _Span:
    """nbytes of `owner`'s device memory at ptr, for torch.as_tensor: a tensor with its own
    storage (the as_strided offsets of the library's allocation recipes count from ptr) that
    keeps owner alive."""

    def __init__(self, ptr, nbytes, owner):
        self.__cuda_array_interface__ = {'shape': (nbytes,), 'typestr': '|u1', 'data': (ptr, False),
                                         'version': 3, 'strides': None}
        self.owner = owner


class GuardedTorch:
    """Stands in for torch inside deep_ep_cpp._lib: torch.empty / empty_strided place every
    allocation between two GUARD_BYTES regions of GUARD_BYTE; violations() lists the ones
    whose guards changed."""

    def __init__(self):
        self.blocks = []

    def __getattr__(self, name):
        return getattr(torch, name)

    def _alloc(self, numel, dtype, device):
        nbytes = max(numel * torch.empty(0, dtype=dtype).element_size(), 16)
        block = torch.full((2 * GUARD_BYTES + nbytes,), GUARD_BYTE, dtype=torch.uint8, device=device)
        torch.cuda.current_stream().synchronize()  # the fill (of the whole block) lands before the op writes
        self.blocks.append((block, nbytes))
        inner = torch.as_tensor(_Span(block.data_ptr() + GUARD_BYTES, nbytes, block), device=block.device)
        return inner.view(dtype)

    # The allocation recipes call empty(shape, dtype=, device=) and empty_strided(shape, strides,
    # dtype=, device=); any other call (no device, more options) is torch's own.
    def empty(self, *size, dtype=None, device=None, **options):
        if device is None or options:
            return torch.empty(*size, dtype=dtype, device=device, **options)
        shape = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else size
        numel = 1
        for d in shape:
            numel *= d
        return self._alloc(numel, dtype, device)[:numel].view(shape)

    def empty_strided(self, size, stride, dtype=None, device=None, **options):
        if device is None or options:
            return torch.empty_strided(size, stride, dtype=dtype, device=device, **options)
        span = 0 if 0 in size else 1 + sum((d - 1) * s for d, s in zip(size, stride))
        return self._alloc(span, dtype, device)[:max(span, 1)].as_strided(tuple(size), tuple(stride))

    def violations(self):
        torch.cuda.synchronize()
        bad = []
        for block, nbytes in self.blocks:
            for where, guard in (('before', block[:GUARD_BYTES]), ('after', block[GUARD_BYTES + nbytes:])):
                changed = int((guard != GUARD_BYTE).sum())
                if changed:
                    bad.append(f'{changed} guard bytes {where} an allocation of {nbytes} B')
        return bad


GUARDS = GuardedTorch()


# ---------------------------------------------------------------- F2
def prefill_flags(buf, ctx, slot_bytes, epoch):
    """This rank's NVL region as described in the module docstring, for rings of slot_bytes."""
    region = buf.get_local_buffer_tensor(torch.uint8)
    region.fill_(0x7f)
    words = region[:region.numel() // 8 * 8].view(torch.int64)
    ch = torch.arange(NUM_CHANNELS, dtype=torch.int64).view(-1, 1, 1)
    peer = torch.arange(ctx.world, dtype=torch.int64).view(1, -1, 1)
    seq = torch.arange(RING, dtype=torch.int64).view(1, 1, -1)
    offsets = ((ch * ctx.world + peer) * RING + seq) * slot_bytes  # kernels/normal_common.cuh RingLayout
    values = (epoch << 32) | (seq + 1)
    words[(offsets // 8).flatten()] = values.expand(NUM_CHANNELS, ctx.world, RING).flatten()
    torch.cuda.synchronize()
    dist.barrier(group=ctx.group)


def prefilled_flags(ctx, which):
    """F2: the first dispatch (epoch 0) or the first combine (epoch 1) of a fresh buffer whose
    ring headers hold small-integer pairs equal to what those flags used to be."""
    chk = Checks()
    buf = deep_ep.Buffer(ctx.group, num_nvl_bytes=NVL_BYTES, explicitly_destroy=True)
    try:
        inp = make_inputs(ctx, tokens=4096, hidden=HIDDEN)
        ref = expect_dispatch(ctx, inp, num_sms=CONFIG.num_sms)
        if which == 'dispatch':
            topk = inp.topk.size(1)
            prefill_flags(buf, ctx, ring_slot_bytes(_lib.lib.deepep_normal_dispatch_slot_bytes, HIDDEN * 2, 0, topk), epoch=0)
        out = buf.dispatch(inp.x, **layout_args(inp), config=CONFIG)
        torch.cuda.synchronize()
        chk(check_dispatch, out, ref, inp.in_rank)
        chk.agree(ctx.group)
        recv_x, recv_weights, handle = out[0], out[2], out[4]
        if which == 'combine':
            prefill_flags(buf, ctx, ring_slot_bytes(_lib.lib.deepep_normal_combine_slot_bytes, HIDDEN * 2, recv_weights.size(1)),
                          epoch=1)
        combined = buf.combine(recv_x, handle, topk_weights=recv_weights, config=CONFIG)
        torch.cuda.synchronize()
        chk(check_combine, combined, ref_combine(ctx.group, ref, recv_x, recv_weights))
    finally:
        buf.destroy()
    chk.done()


# ---------------------------------------------------------------- F7, F8
# The smallest rings a Config allows: num_max_nvl_chunked_send_tokens >= 1 and below
# num_max_nvl_chunked_recv_tokens (src/config.rs), which is the ring size (src/normal/mod.rs
# channel_plan; the kernels never read the send size): 2 slots per (channel, sender, receiver).
# 4 channels (combine batches its flag releases: normal_combine.cu, num_channels <= 6) and 12.
RING2_SMS = (8, 24)
RING2_TOKENS = 4096
RING2_ITERATIONS = 5  # the last one with FP8 x
RING2_MAX_DELAY_MS = 5
RING2_TIMEOUT_MS = 10_000  # a stall fails the case in seconds, not at the default 60 s


def ring2_case(num_sms):
    return f'ring2_random_delays_sms{num_sms}'


def ring2_random_delays(ctx, num_sms):
    """F7 and F8 (the stress run of the review's F7 and section 7): dispatch, a cached dispatch and
    combine on rings of 2 slots, the smallest a Config allows, 4096 tokens a rank at 7168 hidden,
    so each (channel, peer) ring wraps about 170 (12 channels) to 510 (4) times per op and every
    slot is rewritten by its sender as soon as the reader hands it back (F8: a relaxed store)
    while the reader's other warps poll and read the other slot. Before each op every rank sleeps
    a random number of GPU cycles (0 to RING2_MAX_DELAY_MS, seeded per config, iteration and rank), and the non-cached dispatch
    once more between its notify and its data kernel (late_dispatch: the ctypes path), so the
    ranks' kernels start in varying order. Random routing; BF16 x, FP8 (column-major scales) in the
    last iteration; the cached dispatch carries a new BF16 payload. Every output and the handle
    must equal normal_reference bit for bit, combine its reference sum.
    The combine reads ring slots with ld_ring, a coherent load, since F7's fix (before, ld.global.nc,
    whose data must stay read-only for the kernel's lifetime). On Hopper .nc worked in practice (each
    lane's flag acquire invalidates L1, the review says), so this case could not fail there before
    the fix: it guards the rings under maximal wrap, and would show F7 on an architecture where .nc
    does serve stale data."""
    name = ring2_case(num_sms)
    config = deep_ep.Config(num_sms, 1, 2)
    chk = Checks()
    with watchdog(ctx.rep, name, 120):
        buf = deep_ep.Buffer(ctx.group, num_nvl_bytes=NVL_BYTES, explicitly_destroy=True)
        try:
            buf.runtime.set_gpu_timeout_ms(RING2_TIMEOUT_MS)
            max_cycles = sleep_cycles(RING2_MAX_DELAY_MS)
            for it in range(RING2_ITERATIONS):
                rng = random.Random(f'{num_sms}/{it}/{ctx.rank}')
                delays = [rng.randint(0, max_cycles) for _ in range(4)]
                kind = 'fp8_col' if it == RING2_ITERATIONS - 1 else 'bf16'
                inp = make_inputs(ctx, tokens=RING2_TOKENS, hidden=MAX_HIDDEN, x=kind)
                ref = expect_dispatch(ctx, inp, num_sms=num_sms)
                torch.cuda._sleep(delays[0])  # before the notify
                out = late_dispatch(buf, inp, delays[1], config=config)  # and between it and the data kernel
                chk(check_dispatch, out, ref, inp.in_rank)
                chk.agree(ctx.group)

                x = make_x('bf16', inp.tokens, inp.hidden)  # the same routing, a new payload
                want = expect_dispatch(ctx, inp, with_topk=False, num_sms=num_sms, x=x)
                torch.cuda._sleep(delays[2])
                chk(check_cached, buf.dispatch(x, handle=out[4], config=config), want)

                y = torch.randn(ref.num_recv, inp.hidden, dtype=torch.bfloat16)  # stands in for the experts' output
                want = ref_combine(ctx.group, ref, y, out[2])
                torch.cuda._sleep(delays[3])
                got = buf.combine(y, out[4], topk_weights=out[2], config=config)
                chk(check_combine, got, want)
                chk(assert_same, 'combined_topk_weights vs the weights sent', got[1],
                    sent_weights(inp.topk, inp.weights))
                chk(check_handle, out[4], ref, inp.in_rank, after_combine=True)
                chk.agree(ctx.group)
        finally:
            buf.destroy()
    chk.done()


# ---------------------------------------------------------------- item 3
def self_row_past_end(handle, out, ctx):
    """send_head[t][us] for a token we keep: the value that puts our own row at N + 2."""
    send_head, recv_channel_prefix = handle[5], handle[2]
    mine = (send_head[:, ctx.rank] >= 0).nonzero()
    t = int(mine[0, 0])
    per = -(-send_head.size(0) // NUM_CHANNELS)
    base = int(recv_channel_prefix[ctx.rank, t // per])
    send_head[t, ctx.rank] = handle[3].numel() + 2 - base


# name: (op, rank 0's routing, corrupt(handle, out, ctx) on CORRUPT_RANK). What each one did
# before the bounds: the rank-prefix case wrote our own rows at negative rows (guards before
# the outputs); the channel-prefix one wrote rank 0's first received rows at rows -3..-1; the
# combine ones read x outside its rows and reported nothing.
HANDLE_CASES = {
    'handle_rank_prefix_cached_dispatch': ('dispatch', 'random', lambda h, o, ctx: h[0].__setitem__((0, 1), -5)),
    'handle_channel_prefix_cached_dispatch': ('dispatch', 'skewed', lambda h, o, ctx: h[1].__setitem__((0, 0), -3)),
    'handle_recv_channel_prefix_combine': ('combine', 'random', lambda h, o, ctx: h[2].__setitem__((0, 1), -2)),
    'handle_rank_prefix_combine': ('combine', 'random', lambda h, o, ctx: h[0].__setitem__((0, 1), -5)),
    'handle_send_head_combine': ('combine', 'random', self_row_past_end),
}


def corrupted_handle(ctx, name, op, routing, corrupt):
    chk = Checks()
    buf = deep_ep.Buffer(ctx.group, num_nvl_bytes=NVL_BYTES, explicitly_destroy=True)
    try:
        # 'skewed' on rank 0 only: it keeps none of its tokens, so rank 1's rows start its recv_x.
        inp = make_inputs(ctx, routing=routing if ctx.rank == 0 else 'random', tokens=256, hidden=HIDDEN)
        out = buf.dispatch(inp.x, **layout_args(inp), config=CONFIG)
        torch.cuda.synchronize()
        bad = GUARDS.violations()
        chk.expect(not bad, f'the healthy dispatch wrote outside its outputs: {bad}')
        chk.agree(ctx.group)
        buf.runtime.set_gpu_timeout_ms(STALL_MS)  # a peer waiting for skipped rows gives up soon
        handle = out[4]
        if ctx.rank == CORRUPT_RANK:
            corrupt(handle, out, ctx)
        torch.cuda.synchronize()
        dist.barrier(group=ctx.group)
        if op == 'dispatch':
            call = lambda: buf.dispatch(inp.x, handle=handle, config=CONFIG)  # noqa: E731
        else:
            call = lambda: buf.combine(out[0], handle, config=CONFIG)  # noqa: E731
        check_corrupted_call(ctx, chk, name, GUARDS, ENTRY_NAMED, call, lambda: buf.get_dispatch_layout(inp.topk, E))
    finally:
        destroy_after(ctx, buf, name, GUARDS)
    chk.done()


def check_corrupted_call(ctx, chk, name, guards, entry_named, call, next_call):
    """After a handle entry was corrupted: runs `call` over it, then `next_call` (which reports a
    fault a kernel recorded). No guard may have changed, and some rank's error must match
    `entry_named` (collective)."""
    errors = []
    for fn in (call, next_call):
        try:
            fn()
            torch.cuda.synchronize()
        except RuntimeError as e:
            errors.append(str(e))
    bad = guards.violations()
    chk.expect(not bad, f'{name}: rank {ctx.rank} has writes outside the outputs: {bad[:3]}')
    named = torch.tensor([int(any(re.search(entry_named, e) for e in errors))], device='cuda')
    dist.all_reduce(named, group=ctx.group)
    chk.expect(named.item() > 0, f'{name}: no rank named the corrupted entry (errors here: {errors})')


def destroy_after(ctx, buf, name, guards):
    """Destroys a case's buffer on every rank under a watchdog (a buffer that stalled may report it
    again) and forgets the case's guarded allocations."""
    dist.barrier(group=ctx.group)
    destroy_after_stall(ctx.rep, name, buf.destroy)
    guards.blocks.clear()


# ---------------------------------------------------------------- item 3, handle entry 4
# is_token_in_rank (handle[4]) is read by a cached dispatch only (intranode combine does not take
# it), and there by the data kernel's senders (kernels/normal_dispatch.cu send_channel): they number
# a channel's tokens for each destination by it. The cached notify sends peers the handle's
# channel_prefix_matrix instead, and a receiver takes exactly the rows those prefixes give. So each
# sender warp first counts the channel's marked tokens: if the count is not the prefixes' (a row
# more or fewer would shift or leave the peer's rows silently), the channel sends that destination
# nothing and the fault names the entry (DEEPEP_HANDLE_IS_TOKEN_IN_RANK) at the rank's next call.
def first_token_of_rank0_dropped(in_rank):
    in_rank[int(in_rank[:, 0].nonzero()[0, 0]), 0] = False


ENTRY4_NAMED = r'is_token_in_rank \(handle\[4\]\) against its channel_prefix_matrix'

# name: (CORRUPT_RANK's routing, corrupt(is_token_in_rank) on CORRUPT_RANK, whether rank 0 still
# gets every row it expects). With 2 ranks 'skewed' sends every token of CORRUPT_RANK (the last
# rank) to itself only; corrupted, every one is marked for rank 0 too, whose prefixes say 0 rows.
IN_RANK_CASES = {
    'handle_is_token_in_rank_fewer_cached_dispatch': ('random', first_token_of_rank0_dropped, False),
    'handle_is_token_in_rank_extra_cached_dispatch': ('skewed', lambda in_rank: in_rank[:, 0].fill_(True), True),
}


def corrupted_in_rank(ctx, name, routing, corrupt, rank0_whole):
    """Handle entry 4, is_token_in_rank, corrupted on CORRUPT_RANK before a cached dispatch (what
    the kernels do with it: above). On every rank no guard may change. CORRUPT_RANK's next call
    must name the entry. fewer: one channel of CORRUPT_RANK marks a token fewer for rank 0, sends it
    nothing, and rank 0's wait for that channel ends at its timeout: its error must name
    CORRUPT_RANK's dispatch data. extra: every token is marked for rank 0, whose prefixes say 0 rows
    from CORRUPT_RANK in every channel; nothing goes to rank 0, which must raise nothing and receive
    exactly the uncorrupted handle's rows. Over a build without the check, fewer names no entry
    and extra lets the marked tokens into rank 0's ring (both fail)."""
    chk = Checks()
    buf = deep_ep.Buffer(ctx.group, num_nvl_bytes=NVL_BYTES, explicitly_destroy=True)
    try:
        inp = make_inputs(ctx, routing=routing if ctx.rank == CORRUPT_RANK else 'random', tokens=256, hidden=HIDDEN)
        ref = expect_dispatch(ctx, inp, num_sms=CONFIG.num_sms)  # before the corruption: handle[4] is inp.in_rank
        out = buf.dispatch(inp.x, **layout_args(inp), config=CONFIG)
        torch.cuda.synchronize()
        chk(check_dispatch, out, ref, inp.in_rank)
        bad = GUARDS.violations()
        chk.expect(not bad, f'the healthy dispatch wrote outside its outputs: {bad}')
        chk.agree(ctx.group)
        buf.runtime.set_gpu_timeout_ms(STALL_MS)  # a peer waiting for a row never sent gives up soon
        handle = out[4]
        if ctx.rank == CORRUPT_RANK:
            corrupt(handle[4])
        torch.cuda.synchronize()
        dist.barrier(group=ctx.group)
        errors, got = [], None
        try:
            got = buf.dispatch(inp.x, handle=handle, config=CONFIG)
            torch.cuda.synchronize()
        except RuntimeError as e:
            errors.append(str(e))
        try:
            buf.get_dispatch_layout(inp.topk, E)  # reports a fault or stall the dispatch recorded
            torch.cuda.synchronize()
        except RuntimeError as e:
            errors.append(str(e))
        bad = GUARDS.violations()
        chk.expect(not bad, f'{name}: rank {ctx.rank} has writes outside the outputs: {bad[:3]}')
        if ctx.rank == CORRUPT_RANK:
            chk.expect(any(re.search(ENTRY4_NAMED, e) for e in errors), f'{name}: the entry is not named: {errors}')
        elif rank0_whole:
            chk.expect(not errors, f'{name}: rank {ctx.rank} raised: {errors}')
            if got is not None:
                chk(check_cached, got, ref)
        else:
            stalled = rf'\brank {CORRUPT_RANK} never sent its dispatch data'
            chk.expect(any(re.search(stalled, e) for e in errors), f'{name}: rank {CORRUPT_RANK} not named: {errors}')
    finally:
        destroy_after(ctx, buf, name, GUARDS)
    chk.done()


# ---------------------------------------------------------------- F9
def graph_replay_after_stall(ctx):
    chk = Checks()
    name = 'graph_replay_after_stall_poisons_outputs'
    buf = deep_ep.Buffer(ctx.group, num_nvl_bytes=NVL_BYTES, explicitly_destroy=True)
    graph = torch.cuda.CUDAGraph()
    try:
        buf.runtime.set_gpu_timeout_ms(STALL_MS)  # before capture: the graph keeps each launch's budget
        inp = make_inputs(ctx, tokens=256, hidden=HIDDEN)
        worst = inp.tokens * ctx.world

        def step():
            out = buf.dispatch(inp.x, **layout_args(inp), num_worst_tokens=worst, config=CONFIG)
            return out, buf.combine(out[0], out[4], topk_weights=out[2], config=CONFIG)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up outside capture, as torch recommends
            step()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph, capture_error_mode='thread_local'):
            out, combined = step()
        graph.replay()
        torch.cuda.synchronize()
        ref = expect_dispatch(ctx, inp, num_sms=CONFIG.num_sms)
        chk(check_dispatch, out, ref, inp.in_rank, worst=worst)
        chk(check_combine, combined, ref_combine(ctx.group, ref, out[0], out[2]))
        chk.agree(ctx.group)

        dist.barrier(group=ctx.group)
        if ctx.rank == 1:
            time.sleep(4 * STALL_MS / 1000)  # rank 1 stops replaying
        else:
            inp.x.mul_(2)  # new input: the last good outputs are now wrong
            for replay in ('the replay whose wait expired', 'a replay after the stall'):
                graph.replay()
                torch.cuda.synchronize()
                chk.expect(bool(out[0].isnan().all()), f'{replay}: recv_x is not all NaN')
                chk.expect(bool((out[2].isnan()).all()), f'{replay}: recv_topk_weights is not all NaN')
                chk.expect(bool((out[1] == -1).all()), f'{replay}: recv_topk_idx is not all -1')
                chk.expect(bool(combined[0].isnan().all()), f'{replay}: combined_x is not all NaN')
                chk.expect(not buf.runtime.is_available(), f'{replay}: is_available() is still True')
            chk(expect_raises_match, 'the next call after the stall', RuntimeError,
                lambda: buf.get_dispatch_layout(inp.topk, E), r'\brank\s*1\b')
    finally:
        dist.barrier(group=ctx.group)
        del graph
        destroy_after_stall(ctx.rep, name, buf.destroy)
    chk.done()


# ---------------------------------------------------------------- worker
GRAPH_CASE = 'graph_replay_after_stall_poisons_outputs'
CASES = ('prefilled_flags_dispatch', 'prefilled_flags_combine', *map(ring2_case, RING2_SMS), *HANDLE_CASES,
         *IN_RANK_CASES, GRAPH_CASE)


def wanted(name):
    """Whether case `name` runs: every case, or those NORMAL_PROTOCOL_CASES names (space-separated)."""
    only = os.environ.get('NORMAL_PROTOCOL_CASES', '').split()
    return not only or name in only


def worker(rank, world, group, rep):
    ctx = make_ctx(dist.new_group(list(range(world))), rep)

    def run(name, fn, *args):
        if wanted(name):
            rep.run(name, fn, *args)

    run('prefilled_flags_dispatch', prefilled_flags, ctx, 'dispatch')
    run('prefilled_flags_combine', prefilled_flags, ctx, 'combine')
    for num_sms in RING2_SMS:
        run(ring2_case(num_sms), ring2_random_delays, ctx, num_sms)
    _lib.torch = GUARDS  # every output the ctypes path allocates is guarded (not under capture: it syncs)
    try:
        for name, (op, routing, corrupt) in HANDLE_CASES.items():
            run(name, corrupted_handle, ctx, name, op, routing, corrupt)
        for name, (routing, corrupt, rank0_whole) in IN_RANK_CASES.items():
            run(name, corrupted_in_rank, ctx, name, routing, corrupt, rank0_whole)
    finally:
        _lib.torch = torch
    run(GRAPH_CASE, graph_replay_after_stall, ctx)  # last: leaves a stall


if __name__ == '__main__':
    unknown = [name for name in os.environ.get('NORMAL_PROTOCOL_CASES', '').split() if name not in CASES]
    if unknown:
        print(f'NORMAL_PROTOCOL_CASES names unknown cases {unknown}; the cases: {" ".join(CASES)}')
        sys.exit(2)
    if torch.cuda.device_count() < 2:
        skip('w2', f'test_normal_protocol needs 2 GPUs, found {torch.cuda.device_count()}')
        sys.exit(1)
    spawn(worker, 2, timeout=300)
    finish()
