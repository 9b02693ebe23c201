"""The LL protocol under lag, misuse and recovery: virtual ranks on ONE GPU (ll_virtual.py), one
stream per rank, hook-style send and receive kernels, GPU-side delays (torch.cuda._sleep) before
chosen kernels, and a grid of 8 blocks so that every rank's kernels are resident at once (a
waiting receive cannot starve its sender). Outputs against the torch reference (ll_reference.py).

The findings are those of the concurrency review (protocol-review.md, F1-F11). Each case says
what it shows with the LL signals as they were before they carried a generation (a count added
per op, receive-side epochs, shrink-mode flags reset by the receiver) and after (each source
stores (clean generation << 32) | its sends on that half; a receive waits for exactly its own).

  lag_*                      a rank 1-3 calls behind, or ahead: exact, both before and after (the
                             NCCL EP #2303 regression guard: counters already tagged counter mode)
  dropped_*_receive          F1: a send whose receive never ran (a dropped hook), then a later op on
                             that half whose peer is late: before, the receive passes at once on the
                             stale count and returns the dropped op's data; after, it waits: exact
  doubled_*_receive          F1: a receive run twice: before, the second waits for the next op's
                             signal (a deadlock, a stall record); after, it reads the same op again
  shrink_late_signal_rejoins F3: a masked rank's late signal lands after the receivers' reset, the
                             mask is cleared without a clean: before, the next op on that half takes
                             the stale flag and the old data; after, it waits: exact
  shrink_clean_while_masked  F3: the same with a clean while the rank is masked (it misses the clean):
                             before, stale data; after, it is masked again (out of step)
  shrink_agreed_state_wins   F4: a source the blocks agreed had arrived, while its mask is set: before,
                             every block skips it; after, every block follows the agreement
  two_sends_on_one_half      F5: two sends in a row on one half (a graph with one LL op, replayed):
                             before, nothing tells; after, a fault record on every rank
  concurrent_sends_both_halves F11: two dispatch sends in flight at once on the two halves: before,
                             they share the completion counters (stall or wrong data); after, exact

Usage: python tests/gpu/test_ll_generations.py [-k REGEX]; DEEPEP_LL_VIRTUAL_LIBRARY names the
virtual-rank library (default: target/ll_virtual/libll_virtual_ranks.so, built by scripts/test.sh)."""
import sys
from types import SimpleNamespace

import torch

from ll_reference import bf16_ulp_distance, ref_ll_combine, ref_ll_dispatch
from ll_virtual import PHASE_RECV, PHASE_SEND, run_cases
from test_ll_virtual_ranks import as_reference, check_equal, make_inputs

SLEEP = 20_000_000  # GPU cycles (~10 ms): a delayed rank's kernel starts well after its peers' receives
STATE_ARRIVED = 1  # kStateArrived (kernels/ll_common.cuh)


class Run:
    """LL ops of one VirtualWorld, each rank on its own stream."""

    def __init__(self, world, seed):
        self.w, self.seed = world, seed
        self.streams = [torch.cuda.Stream() for _ in range(world.num_ranks)]

    def delay(self, rank, cycles=SLEEP):
        with torch.cuda.stream(self.streams[rank]):
            torch.cuda._sleep(cycles)

    def dispatch_op(self, tokens=None, num_topk=4, inputs=None):
        """A dispatch (of `inputs`, another op's, when given); takes the next half."""
        self.seed += 1
        x, topk = inputs if inputs else make_inputs(self.w, self.seed, tokens or self.w.max_tokens, num_topk)
        op = SimpleNamespace(kind='dispatch', x=x, topk=topk, outs=self._dispatch_outs())
        return self._take_half(op)

    def combine_op(self, handle):
        """A combine of random expert outputs over dispatch op `handle` (received on every rank)."""
        self.seed += 1
        gen = torch.Generator(device='cuda').manual_seed(self.seed)
        w = self.w
        y = [torch.randn(w.local_experts, w.num_ranks * w.max_tokens, w.hidden, device='cuda',
                         generator=gen).to(torch.bfloat16) for _ in range(w.num_ranks)]
        weights = [torch.rand(t.shape, device='cuda', generator=gen) for t in handle.topk]
        op = SimpleNamespace(kind='combine', topk=handle.topk, y=y, weights=weights, handle=handle,
                             outs=self._combine_outs(handle))
        return self._take_half(op)

    def _dispatch_outs(self):
        return [self.w.dispatch_outputs(False, False) for _ in range(self.w.num_ranks)]

    def _combine_outs(self, handle):
        return [torch.full((t.size(0), self.w.hidden), float('nan'), dtype=torch.bfloat16, device='cuda')
                for t in handle.topk]

    def second_outs(self, op):
        """Another set of outputs for a second receive of `op`."""
        return self._dispatch_outs() if op.kind == 'dispatch' else self._combine_outs(op.handle)

    def _take_half(self, op):
        self.w.parity ^= 1  # as the product: every send takes the other half
        op.parity = self.w.parity
        return op

    def _phase(self, op, rank, phases, out, stream):
        stream = stream or self.streams[rank]
        saved, self.w.parity = self.w.parity, op.parity
        try:
            if op.kind == 'dispatch':
                fields = self.w.dispatch_fields(rank, phases, op.x[rank], op.topk[rank], out)
                self.w._launch(self.w.lib.llv_dispatch, fields, stream)
            else:
                self.w.combine_rank(rank, phases, op.y[rank], op.topk[rank], op.weights[rank],
                                    op.handle.outs[rank], out, stream=stream)
        finally:
            self.w.parity = saved

    def send(self, op, rank, stream=None):
        self._phase(op, rank, PHASE_SEND, op.outs[rank], stream)

    def recv(self, op, rank, out=None):
        self._phase(op, rank, PHASE_RECV, op.outs[rank] if out is None else out, None)

    def all(self, op, ranks=None, delayed=()):
        """`ranks` (default all) send, then receive, `op`; the `delayed` ones sleep first."""
        for r in ranks if ranks is not None else range(self.w.num_ranks):
            if r in delayed:
                self.delay(r)
            self.send(op, r)
            self.recv(op, r)

    def sync(self):
        torch.cuda.synchronize()


def check_op(w, op, ranks=None, masked=(), outs=None):
    """`op`'s outputs on `ranks` (default all) against the reference with `masked` sources gone."""
    ref_topk = [as_reference(t, w.num_experts) for t in op.topk]
    outs = op.outs if outs is None else outs
    for r in ranks if ranks is not None else range(w.num_ranks):
        what = f'{op.kind} on half {op.parity}, rank {r}'
        if op.kind == 'dispatch':
            ref = ref_ll_dispatch(op.x, ref_topk, r, w.num_experts, w.max_tokens, masked_ranks=masked)
            check_equal(f'{what}: packed_recv_count', outs[r]['count'], ref.count)
            check_equal(f'{what}: layout_range', outs[r]['layout_range'], ref.layout_range)
            check_equal(f'{what}: src_info', outs[r]['src_info'], ref.src_info, ref.valid)
            check_equal(f'{what}: packed_recv_x', outs[r]['x'], ref.x, ref.valid)
        else:
            want = ref_ll_combine(op.y, ref_topk, r, op.weights[r], w.num_experts, w.max_tokens, masked_ranks=masked)
            got = outs[r]
            if not torch.equal(got, want):
                ulps = bf16_ulp_distance(got, want)
                if got.isnan().any() or int(ulps.max()) > 1:
                    raise AssertionError(f'{what}: combined_x has {int((ulps > 0).sum())} elements off, up to '
                                         f'{int(ulps.max())} BF16 ulp (NaN: never written)')


def no_stall(w):
    w.check_no_stall()


def warm_up(run, pairs=2):
    """Dispatch + combine pairs on every rank: both halves, both kinds, signals of earlier ops left."""
    for _ in range(pairs):
        d = run.dispatch_op()
        run.all(d)
        c = run.combine_op(d)
        run.all(c)
        run.sync()
        check_op(run.w, d)
        check_op(run.w, c)


# ---------------------------------------------------------------- cases
def lag(w, seed, slow, calls):
    """Ranks in `slow` start `calls` ops late and sleep before every send of 3 dispatch + combine
    pairs; the others launch everything at once and wait on the GPU. Every output exact."""
    run = Run(w, seed)
    warm_up(run)
    for r in slow:
        run.delay(r, calls * SLEEP)
    ops = []
    for _ in range(3):
        d = run.dispatch_op()
        run.all(d, delayed=slow)
        c = run.combine_op(d)
        run.all(c, delayed=slow)
        ops += [d, c]
    run.sync()
    no_stall(w)
    for op in ops:
        check_op(w, op)


def dropped_receive(w, seed, kind):
    """F1. Op B (half 1, `kind`): every rank sends, rank 0 never receives. Op C (half 0) as usual.
    Op D (half 1, `kind`): rank 1 sends late; rank 0's receive must wait for it. Then a healthy
    pair with rank 1 late again."""
    run = Run(w, seed)
    warm_up(run)
    a = run.dispatch_op()  # half 0
    run.all(a)
    b = run.dispatch_op() if kind == 'dispatch' else run.combine_op(a)  # half 1
    for r in range(w.num_ranks):
        run.send(b, r)
    for r in range(1, w.num_ranks):
        run.recv(b, r)
    c = run.dispatch_op(inputs=(a.x, a.topk))  # half 0
    run.all(c)
    d = run.dispatch_op() if kind == 'dispatch' else run.combine_op(c)  # half 1
    run.all(d, delayed=(1,))
    run.sync()
    no_stall(w)
    check_op(w, d)
    e = run.dispatch_op()
    run.all(e, delayed=(1,))
    f = run.combine_op(e)
    run.all(f, delayed=(1,))
    run.sync()
    no_stall(w)
    check_op(w, e)
    check_op(w, f)


def doubled_receive(w, seed, kind):
    """F1. Op B (half 1, `kind`): rank 0 receives twice (a hook called twice), both reads give B's
    outputs; then ops C and D go on as usual, rank 1 late at D."""
    run = Run(w, seed)
    warm_up(run)
    a = run.dispatch_op()
    run.all(a)
    b = run.dispatch_op() if kind == 'dispatch' else run.combine_op(a)
    again = run.second_outs(b)
    run.all(b)
    run.recv(b, 0, again[0])
    c = run.dispatch_op(inputs=(a.x, a.topk))
    run.all(c)
    d = run.dispatch_op() if kind == 'dispatch' else run.combine_op(c)
    run.all(d, delayed=(1,))
    run.sync()
    no_stall(w)
    check_op(w, b)
    check_op(w, b, ranks=[0], outs=again)
    check_op(w, c)
    check_op(w, d)


def mask_rank_one(run, present):
    """Op X (dispatch, half 0 after an even number of ops): `present` send and receive, rank 1
    launches nothing; they mask it after the timeout."""
    x = run.dispatch_op()
    assert x.parity == 0
    run.all(x, ranks=present)
    run.sync()
    no_stall(run.w)
    check_op(run.w, x, ranks=present, masked=(1,))
    for r in present:
        want = [int(src == 1) for src in range(run.w.num_ranks)]
        assert run.w.mask(r).tolist() == want, f'rank {r}: mask {run.w.mask(r).tolist()} after op X, expected {want}'
    return x


def shrink_late_signal_rejoins(w, seed):
    """F3. After op X masks rank 1, its send of X arrives (after the receivers' end of X). The
    masks are cleared without a clean (low_latency_clean_mask_buffer). Op Y (half 1) as usual; op
    Z (half 0, X's half) with rank 1 late: every rank waits for it, exact, nobody masked."""
    run = Run(w, seed)
    warm_up(run)
    present = [r for r in range(w.num_ranks) if r != 1]
    x = mask_rank_one(run, present)
    run.send(x, 1)  # the late signal
    run.sync()
    for r in range(w.num_ranks):
        w.mask(r).zero_()
    y = run.dispatch_op()
    run.all(y)
    z = run.dispatch_op()
    run.all(z, delayed=(1,))
    run.sync()
    no_stall(w)
    check_op(w, y)
    check_op(w, z)
    for r in range(w.num_ranks):
        assert not w.mask(r).any(), f'rank {r}: mask {w.mask(r).tolist()} after op Z, expected none'


def shrink_clean_while_masked(w, seed):
    """F3. After op X masks rank 1, the others clean (rank 1 masked: their barrier skips it), then
    rank 1's send of X lands and every mask is cleared. Rank 1 missed the clean: at op Z (half 0
    after the clean, rank 1 late) the others mask it again and return exactly the data of the rest."""
    run = Run(w, seed)
    warm_up(run)
    present = [r for r in range(w.num_ranks) if r != 1]
    x = mask_rank_one(run, present)
    w.clean(present)
    run.send(x, 1)
    run.sync()
    for r in range(w.num_ranks):
        w.mask(r).zero_()
    z = run.dispatch_op()
    assert z.parity == 0
    run.all(z, delayed=(1,))
    run.sync()
    no_stall(w)
    check_op(w, z, ranks=present, masked=(1,))
    for r in present:
        want = [int(src == 1) for src in range(w.num_ranks)]
        assert w.mask(r).tolist() == want, f'rank {r}: mask {w.mask(r).tolist()} after op Z, expected {want}'


def shrink_agreed_state_wins(w, seed):
    """F4. Rank 0's blocks agreed (source_state) that source 1 arrived for the coming dispatch
    receive, while its mask is set (pre-set: what a late block met when another block's timeout set
    the mask at the moment the signal landed). Rank 1 sends; every block must read it: rank 0's
    outputs are the full reference."""
    run = Run(w, seed)
    warm_up(run)
    x = run.dispatch_op()
    layout, r_n = w.workspace_layout(), w.num_ranks
    slot = (0 * 2 + x.parity) * r_n + 1 if layout['op_seq'] is not None else 0 * r_n + 1  # [kind][half][R] or [kind][R]
    states = w.rank_workspace(0)[layout['source_state']:layout['source_state'] + 16 * r_n].view(torch.int32)
    states[slot] = STATE_ARRIVED
    w.mask(0)[1] = 1
    for r in range(w.num_ranks):
        run.send(x, r)
    run.recv(x, 0)
    run.sync()
    no_stall(w)
    check_op(w, x, ranks=[0])


def two_sends_on_one_half(w, seed):
    """F5. Alternating halves record no fault; two dispatches in a row on one half (what a CUDA
    graph holding one LL op does when replayed twice) record DEEPEP_FAULT_LL_SAME_HALF on every rank
    (the host reports it at the next call). The data itself is not checked: it may be torn."""
    run = Run(w, seed)
    warm_up(run)
    assert w.take_fault() is None, 'a fault with alternating halves'
    a = run.dispatch_op()
    run.all(a)
    run.sync()
    w.parity ^= 1  # the next op takes a's half again
    b = run.dispatch_op()
    assert b.parity == a.parity
    for r in range(w.num_ranks):
        run.send(b, r)
    for r in range(w.num_ranks):
        run.recv(b, r)
    fault = w.take_fault()
    assert fault is not None, 'no fault record after two sends in a row on one half'
    same_half = w.lib.llv_fault_ll_same_half() if hasattr(w.lib, 'llv_fault_ll_same_half') else None
    assert fault[0] == same_half and fault[1] == a.parity, f'fault {fault}, expected ({same_half}, {a.parity}, _)'


def concurrent_sends_both_halves(w, seed, rounds=10):
    """F11. Every rank sends dispatch n (half 0) and n + 1 (half 1) on two streams at once, then
    receives both: 10 rounds of large sends (T = M = 512, H = 7168) so that the kernels overlap."""
    run = Run(w, seed)
    warm_up(run, pairs=1)
    other = [torch.cuda.Stream() for _ in range(w.num_ranks)]
    for _ in range(rounds):
        first, second = run.dispatch_op(), run.dispatch_op()
        for r in range(w.num_ranks):
            other[r].wait_stream(run.streams[r])
            run.send(first, r)
            run.send(second, r, stream=other[r])
            run.streams[r].wait_stream(other[r])
            run.recv(first, r)
            run.recv(second, r)
        run.sync()
        no_stall(w)
        check_op(w, first)
        check_op(w, second)
    assert w.take_fault() is None, 'a fault record with sends in flight on both halves'


def cases():
    r2 = dict(num_ranks=2, num_experts=16, max_tokens=32, hidden=1024, num_blocks=8, timeout_s=5)
    r4 = dict(num_ranks=4, num_experts=32, max_tokens=32, hidden=1024, num_blocks=8, timeout_s=5)
    shrink = dict(r4, shrink=True, timeout_s=0.3)
    # name: (world kwargs, check, check kwargs)
    out = {}
    for calls in (1, 2, 3):
        out[f'lag_rank1_{calls}_calls_behind'] = (r4, lag, dict(seed=100 + calls, slow=(1,), calls=calls))
    out['lag_ranks023_ahead_of_rank1'] = (r4, lag, dict(seed=104, slow=(0, 2, 3), calls=1))
    out['lag_virtual_nodes_of_2'] = (dict(r4, node_size=2), lag, dict(seed=105, slow=(1,), calls=2))
    for kind in ('dispatch', 'combine'):
        out[f'dropped_{kind}_receive'] = (r2, dropped_receive, dict(seed=110, kind=kind))
        out[f'dropped_{kind}_receive_r4_virtual_nodes'] = (dict(r4, node_size=2), dropped_receive,
                                                           dict(seed=111, kind=kind))
        out[f'doubled_{kind}_receive'] = (dict(r2, timeout_s=2), doubled_receive, dict(seed=120, kind=kind))
    out['shrink_late_signal_rejoins'] = (shrink, shrink_late_signal_rejoins, dict(seed=130))
    out['shrink_clean_while_masked'] = (shrink, shrink_clean_while_masked, dict(seed=131))
    out['shrink_agreed_state_wins'] = (shrink, shrink_agreed_state_wins, dict(seed=140))
    out['two_sends_on_one_half'] = (r2, two_sends_on_one_half, dict(seed=150))
    out['concurrent_sends_both_halves'] = (dict(num_ranks=2, num_experts=16, max_tokens=512, hidden=7168,
                                                num_blocks=8, timeout_s=5),
                                           concurrent_sends_both_halves, dict(seed=160))
    return out


def main():
    return run_cases('test_ll_generations', __doc__.split('\n')[0], cases())


if __name__ == '__main__':
    sys.exit(main())
