"""A stalled peer in internode normal mode without shrink (docs/internode.md, "Every wait is
bounded"; issue 24), on 2 GPUs as 2 virtual nodes of 1 (DEEPEP_VIRTUAL_NODE_SIZE=1, as
test_internode.py's 2-GPU run: each rank is its own node and forwarder, the scale-out leg the LSA
emulation). Rank 1 stalls, rank 0 survives. Default dtype BF16, default device CUDA, a deep_ep.Buffer
over dist.new_group(all ranks), as DeepEP's tests run.

Phases, each on its own buffer (test_internode.make_buffer: DeepEP's hints, across the virtual
nodes), after a healthy round trip on it (test_internode.roundtrip: every output, handle entry and
traffic counter exact against the torch oracle internode_reference.py), with a GPU timeout of
TIMEOUT_MS on every rank:
  dispatch              rank 1 never calls dispatch (it sleeps on the host past the timeout):
                        rank 0's notify waits for rank 1's notify counts; the dispatch call itself
                        (its host wait for the receive count) must raise, naming rank 1 as the rank
                        that never sent its internode notify counts (src/faults.rs,
                        DEEPEP_WAIT_OP_INTERNODE_NOTIFY).
  dispatch_data_kernel  rank 1 calls dispatch, its notify runs (the counts are exchanged, rank 0's
                        host wait returns), but its data kernel starts 3x the timeout late (the
                        ctypes path with a GPU sleep before deepep_internode_dispatch, the compiled
                        path off for that call: late_dispatch). Rank 0's data kernel waits for
                        rank 1's rows over the scale-out leg; its dispatch returns (no host wait on
                        the data kernel), and after a synchronize is_available() is False and the
                        next call raises naming rank 1 and the scale-out leg ("rank 1 never sent
                        its rows over the scale-out leg", DEEPEP_WAIT_OP_RDMA_TAIL; or "never freed
                        scale-out ring slots" should rank 0's rows not fit rank 1's ring).
On rank 0 the error must come within TIMEOUT_MS + SLACK_S of the call, and the buffer must then say
it is unusable (is_available() False). Then every rank destroys the buffer (under a watchdog; a
poisoned buffer may raise the stall again: tolerated, printed), creates a new one in the same
processes and runs a round trip on it, every result exact against the oracle: a stall leaves the
process usable, only the buffer is lost.

Each phase takes about 15 s (the stalled rank sleeps 3 x TIMEOUT_MS, then destroy and a new
buffer). Run: python tests/gpu/test_internode_stall.py (needs 2 GPUs; suite step
test_internode_stall)."""
import sys
import time

import torch
import torch.distributed as dist

from common import Checks, destroy_after_stall, expect_raises_match, finish, skip, spawn, watchdog
from test_internode import E, make_buffer, make_ctx, roundtrip, routed
from test_normal import sleep_cycles

STALLED = 1
TIMEOUT_MS = 2000
SLEEP_MS = 3 * TIMEOUT_MS  # the stalled rank's sleep: well past the survivor's timeout
SLACK_S = 5
TOKENS, HIDDEN = 256, 2048  # a channel's rows fit its rings: no sender waits for credits
PHASES = ('dispatch', 'dispatch_data_kernel')
# What the survivor's error must match (src/faults.rs, stall_error): the stalled rank as the one that
# never sent, and what it never sent (the notify counts, or its rows over the scale-out leg).
PATTERNS = {
    'dispatch': rf'\brank {STALLED} never sent its internode notify counts',
    'dispatch_data_kernel':
        rf'\brank {STALLED} never (?:sent its rows over the scale-out leg|freed scale-out ring slots)',
}


def case_name(phase):
    return f'internode_stalled_peer_{phase}_timeout'


def late_dispatch(buf, x, args, cycles):
    """A dispatch whose data kernel starts `cycles` after its notify (prepare + host wait): the
    ctypes path (the compiled path, InternodeOps, off for this call), with a GPU sleep on the comm
    stream before deepep_internode_dispatch, the data kernel's launch. Returns (dispatch's 6-tuple,
    whether the delay was put in)."""
    from deep_ep_cpp import _internode

    runtime, launch, calls = buf.runtime, _internode.lib.deepep_internode_dispatch, []

    def delayed(handle, args_addr, outs, stream):
        calls.append(stream)
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            torch.cuda._sleep(cycles)
        return launch(handle, args_addr, outs, stream)

    compiled, runtime._internode_fast = runtime._internode_fast, None
    _internode.lib.deepep_internode_dispatch = delayed
    try:
        return buf.dispatch(x, **args), bool(calls)
    finally:
        _internode.lib.deepep_internode_dispatch = launch
        runtime._internode_fast = compiled


def stalled_peer(ctx, phase):
    chk = Checks()
    name = case_name(phase)
    buf = ctx.buffer = make_buffer(ctx)
    try:
        chk(roundtrip, ctx, tokens=TOKENS, hidden=HIDDEN)  # healthy first, every result exact
        chk.agree(ctx.group)  # a failed healthy round fails the case on every rank, before the stall
        topk_idx, _, args = routed(ctx, TOKENS)
        x = torch.randn(TOKENS, HIDDEN, dtype=torch.bfloat16)
        stops_inside = ctx.rank == STALLED and phase == 'dispatch_data_kernel'
        cycles = sleep_cycles(SLEEP_MS) if stops_inside else 0
        buf.runtime.set_gpu_timeout_ms(TIMEOUT_MS)
        torch.cuda.synchronize()
        dist.barrier(group=ctx.group)
        with watchdog(ctx.rep, name, 60):
            if stops_inside:
                _, delayed = late_dispatch(buf, x, args, cycles)
                chk.expect(delayed, 'the late dispatch did not take deepep_internode_dispatch: not delayed')
                torch.cuda.synchronize()
            elif ctx.rank == STALLED:
                time.sleep(SLEEP_MS / 1000)  # never calls dispatch
            else:
                start = time.monotonic()

                def stalled_op():
                    buf.dispatch(x, **args)
                    if phase != 'dispatch':  # no host wait on the data kernel: the stall surfaces at the next call
                        torch.cuda.synchronize()
                        chk.expect(not buf.runtime.is_available(), f'is_available() is True after the stalled {phase}')
                        buf.get_dispatch_layout(topk_idx, E)

                raised = chk(expect_raises_match, f'{phase} while rank {STALLED} stalls', RuntimeError, stalled_op,
                             PATTERNS[phase])
                seconds = time.monotonic() - start
                ctx.rep.info(f'{phase}: the survivor\'s error came after {seconds:.1f} s')
                chk.expect(seconds < TIMEOUT_MS / 1000 + SLACK_S,
                           f'the stalled {phase} failed only after {seconds:.1f} s (GPU timeout {TIMEOUT_MS} ms)')
                if raised:
                    chk.expect(not buf.runtime.is_available(), f'is_available() is True after the {phase} stall error')
    finally:
        torch.cuda.synchronize()
        dist.barrier(group=ctx.group)
        destroy_after_stall(ctx.rep, name, buf.destroy, chk)
        ctx.buffer = None
    # Every rank goes on in the same processes with a new buffer: every result exact.
    ctx.buffer = make_buffer(ctx)
    try:
        with watchdog(ctx.rep, name, 60):
            chk(roundtrip, ctx, tokens=TOKENS, hidden=HIDDEN)
    finally:
        torch.cuda.synchronize()
        dist.barrier(group=ctx.group)
        ctx.buffer.destroy()
        ctx.buffer = None
    chk.done()


def worker(rank, world, group, rep):
    ctx = make_ctx(dist.new_group(list(range(world))), rep)
    assert ctx.node_size == 1, f'written for 2 nodes of 1, got nodes of {ctx.node_size}'
    for phase in PHASES:
        rep.run(case_name(phase), stalled_peer, ctx, phase)


if __name__ == '__main__':
    num_gpus = torch.cuda.device_count()
    if num_gpus < 2:
        skip('w2/internode_stall', f'test_internode_stall needs 2 GPUs, found {num_gpus}')
        sys.exit(1)
    spawn(worker, 2, timeout=240)
    finish()
