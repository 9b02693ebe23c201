"""Internode normal-mode dispatch and combine (docs/internode.md) as 2 virtual nodes: 2 GPUs as 2
nodes of 1, and where visible 4 GPUs as 2 of 2 and 8 as 2 of 4 (DEEPEP_VIRTUAL_NODE_SIZE: the
scale-out leg is the LSA emulation, kRemoteEmulated; the NVLink leg is real), against
the pure-torch oracle internode_reference.py (DeepEP V1's values of every output and handle entry).

Workers run as DeepEP's tests: default dtype BF16, default device CUDA, a deep_ep.Buffer over
dist.new_group(all ranks), sized by DeepEP's hints (the RDMA hint asked for nodes x 8 ranks: the
hints count nodes of 8). Cases: T in {0, 1, 4096}, hidden 2048/7168, top-k 1/8/16, random, skewed
(to one rank; every token to one expert), DeepEP's grouped (one node per token), an empty node
and -1-heavy routing, token-less ranks, BF16 and FP8 (column-major float32 scales); each checks the layout's
per-node counts, every dispatch output and all 10 handle entries exactly, a cached dispatch
bit-identical to the first, combine (with the received weights, with a bias tuple and without) bit for bit, the
two heads as combine rewrote them, and the traffic counters of the dispatch and of the combine
(Buffer.internode_query_traffic_buffer against internode_reference.traffic_rows: scale-out rows =
distinct other destination nodes per token, bytes = rows x the row; the NVLink leg's rows where a
node has more than one GPU). Then num_worst_tokens (defined
rows only), DeepEP's stream protocol (the comm stream waits for the current stream or
previous_event, async_finish's event, allocate_on_comm_stream), input the library refuses (the
same RuntimeError text on the compiled host path and on the ctypes path), and one low_latency_mode
buffer serving internode and LL ops (DeepEP's --test-ll-compatibility). Under DEEPEP_NCCL_FAST=1
(bench/gpu_suite.sh's test_internode) every dispatch and combine of a few round trips must be
run by the compiled host path (InternodeOps, _fast_internode.h), not handed to ctypes;
DEEPEP_NCCL_FAST=0 (test_internode_ctypes) runs everything on the ctypes path.

Run: python tests/gpu/test_internode.py (needs 2 GPUs; runs 2, 4 and 8 ranks as far as GPUs allow)."""
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

import deep_ep
from common import Checks, assert_same, expect_raises_match, finish, random_topk, skip, spawn
import internode_reference as ir
from normal_reference import gather_rows
from ll_reference import bf16_ulp_distance, ref_ll_combine, ref_ll_dispatch

E = 64
MAX_HIDDEN = 7168
SPIN_CYCLES = 20_000_000  # ~10 ms of GPU time: the host enqueues the call behind a delayed copy


def make_ctx(group, rep):
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device('cuda')
    world = group.size()
    # Two virtual nodes, as DeepEP's smallest internode shape: 2 GPUs as 2x1, 4 as 2x2, 8 as 2x4.
    return SimpleNamespace(group=group, rank=group.rank(), world=world, node_size=world // 2, rep=rep, buffer=None)


def make_buffer(ctx, ll_shape=None):
    """A buffer across ctx.world / ctx.node_size virtual nodes, sized by DeepEP's hints for BF16 rows of
    MAX_HIDDEN with the default dispatch and combine configs; with ll_shape (M, H, E) also a
    low_latency_mode buffer for LL ops of that shape (DeepEP's --test-ll-compatibility)."""
    world, nodes = ctx.world, ctx.world // ctx.node_size
    configs = (deep_ep.Buffer.get_dispatch_config(world), deep_ep.Buffer.get_combine_config(world))
    nvl = max(c.get_nvl_buffer_size_hint(MAX_HIDDEN * 2, world) for c in configs)
    rdma = max(c.get_rdma_buffer_size_hint(MAX_HIDDEN * 2, nodes * 8) for c in configs)
    ll = {}
    if ll_shape is not None:
        m, h, e = ll_shape
        rdma = max(rdma, deep_ep.Buffer.get_low_latency_rdma_size_hint(m, h, world, e))
        ll = dict(low_latency_mode=True, num_qps_per_rank=max(1, e // world))
    os.environ['DEEPEP_VIRTUAL_NODE_SIZE'] = str(ctx.node_size)
    try:
        buffer = deep_ep.Buffer(ctx.group, num_nvl_bytes=nvl, num_rdma_bytes=rdma, explicitly_destroy=True, **ll)
    finally:
        del os.environ['DEEPEP_VIRTUAL_NODE_SIZE']
    assert buffer.runtime.get_num_rdma_ranks() == nodes, buffer.runtime.get_num_rdma_ranks()
    assert buffer.runtime.get_rdma_rank() == ctx.rank // ctx.node_size
    return buffer


def route(kind, num_tokens, num_topk, world):
    if kind == 'random':
        return random_topk(num_tokens, E, num_topk)
    if kind == 'skewed':  # every token to the last rank's experts
        per_rank = E // world
        local = torch.rand(num_tokens, per_rank, dtype=torch.float32).argsort(1)[:, :num_topk]
        return (local + (world - 1) * per_rank).to(deep_ep.topk_idx_t)
    if kind == 'one_expert':  # every slot of every token to the last expert (top-1)
        return torch.full((num_tokens, num_topk), E - 1, dtype=torch.int64).to(deep_ep.topk_idx_t)
    if kind in ('grouped', 'empty_node'):
        # DeepEP's grouped routing: each token's experts within its num_topk_groups best nodes (by
        # their best expert's score), here 1 of the 2 nodes; 'empty_node': node 1 receives nothing.
        nodes = 2
        scores = torch.randn(num_tokens, E, dtype=torch.float32).abs() + 1
        if kind == 'empty_node':
            scores[:, E // nodes:] = -1
        else:
            best = scores.view(num_tokens, nodes, -1).amax(-1).topk(1, dim=-1).indices
            keep = torch.zeros(num_tokens, nodes, dtype=torch.bool).scatter_(1, best, True)
            scores = scores.masked_fill(~keep.repeat_interleave(E // nodes, dim=1), -1)
        return scores.topk(num_topk, dim=-1, sorted=False).indices.to(deep_ep.topk_idx_t)
    if kind == 'minus_one_heavy':
        t = random_topk(num_tokens, E, num_topk)
        t[torch.rand(t.shape, dtype=torch.float32) < 0.9] = -1
        t[:num_tokens // 8] = -1
        return t
    raise ValueError(kind)


def layout(ctx, buffer, topk_idx, chk):
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    chk.expect(per_rdma is not None, 'get_dispatch_layout: num_tokens_per_rdma_rank is None across nodes')
    if per_rdma is not None:
        want = ir.in_node(in_rank, ctx.node_size).sum(0, dtype=torch.int32)
        chk(assert_same, 'num_tokens_per_rdma_rank', per_rdma, want)
    return per_rank, per_rdma, per_expert, in_rank


def query_traffic(buffer):
    """The buffer's traffic counters (enum DeepepTrafficKind), read in stream order."""
    out = torch.full((8,), -1, dtype=torch.int64)
    buffer.internode_query_traffic_buffer(out)
    return out.tolist()


def check_traffic(chk, op, before, after, want):
    got = [a - b for a, b in zip(after, before)]
    chk.expect(got == want, f'{op} traffic (DeepepTrafficKind order) {got}, expected {want}')


def roundtrip(ctx, tokens=4096, hidden=2048, topk=8, routing='random', fp8=False, num_worst_tokens=0):
    buffer, chk = ctx.buffer, Checks()
    if isinstance(tokens, tuple):  # per rank, cycled: ranks without tokens still receive and combine
        tokens = tokens[ctx.rank % len(tokens)]
    if num_worst_tokens == 'all':  # DeepEP's test: every rank's tokens could land here
        num_worst_tokens = tokens * ctx.world
    topk_idx = route(routing, tokens, topk, ctx.world)
    weights = torch.rand(tokens, topk, dtype=torch.float32)
    per_rank, per_rdma, per_expert, in_rank = layout(ctx, buffer, topk_idx, chk)
    chk.agree(ctx.group)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    if fp8:
        x_data = x.to(torch.float8_e4m3fn)
        scales = torch.rand(hidden // 128, tokens, dtype=torch.float32).T  # column-major, as test_internode
        x_in = (x_data, scales)
    else:
        x_in = x
    config = deep_ep.Buffer.get_dispatch_config(ctx.world)
    num_channels = config.num_sms // 2
    ref = ir.ref_internode_dispatch(ctx.group, x_in, in_rank, per_expert, topk_idx, weights, num_nvl_ranks=ctx.node_size,
                                    num_channels=num_channels, num_worst_tokens=num_worst_tokens)
    traffic_before = query_traffic(buffer)
    recv, recv_topk, recv_weights, per_expert_list, handle, _ = buffer.dispatch(
        x_in, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=weights, num_worst_tokens=num_worst_tokens,
        config=config)
    traffic_after = query_traffic(buffer)
    recv_x, recv_scales = recv if fp8 else (recv, None)
    # Rows per leg each way (internode_reference.traffic_rows): scale-out, this rank's tokens' other
    # destination nodes (dispatch) and the rows of its scale-out receive space from other nodes
    # (combine sends them back); NVLink, the rows forwarded to and reduced from the node's GPUs.
    dispatch_row = ir.dispatch_row_bytes(hidden * (1 if fp8 else 2), hidden // 128 if fp8 else 0, topk)
    combine_row = ir.combine_row_bytes(hidden * 2, topk)
    legs = ir.traffic_rows(gather_rows(in_rank, ctx.group), ctx.rank, ctx.node_size)
    check_traffic(chk, 'dispatch', traffic_before, traffic_after, ir.traffic(legs[:2] + [0, 0], dispatch_row, combine_row))
    n, nr = ref.num_recv, ref.num_rdma_recv
    rows = slice(0, n)
    chk(assert_same, 'recv_x', recv_x[rows], ref.recv_x[rows])
    if fp8:
        chk(assert_same, 'recv_x_scales', recv_scales[rows], ref.recv_x_scales[rows])
    chk(assert_same, 'recv_topk_idx', recv_topk, ref.recv_topk_idx)  # the tail is -1 with num_worst_tokens
    chk(assert_same, 'recv_topk_weights', recv_weights[rows], ref.recv_topk_weights[rows])
    chk.expect(per_expert_list == ref.num_recv_tokens_per_expert_list,
               f'num_recv_tokens_per_expert_list {per_expert_list}, expected {ref.num_recv_tokens_per_expert_list}')
    chk.expect(len(handle) == 10, f'the handle has {len(handle)} entries, expected 10')
    names = ('is_token_in_rank', 'rdma_channel_prefix_matrix', 'gbl_channel_prefix_matrix',
             'recv_rdma_channel_prefix_matrix', 'recv_rdma_rank_prefix_sum', 'recv_gbl_channel_prefix_matrix',
             'recv_gbl_rank_prefix_sum', 'recv_src_meta', 'send_rdma_head', 'send_nvl_head')
    defined = {'recv_src_meta': n, 'send_nvl_head': nr}
    for i, name in enumerate(names):
        got, want = handle[i], ref.handle[i]
        if name in defined:
            got, want = got[:defined[name]], want[:defined[name]]
        chk(assert_same, f'handle[{i}] {name}', got, want)
    chk.agree(ctx.group)

    # A cached dispatch with the handle: the same rows, bit for bit.
    if num_worst_tokens == 0:
        again, *_ = buffer.dispatch(x_in, handle=handle, config=config)
        again_x = again[0] if fp8 else again
        chk(assert_same, 'cached recv_x', again_x, recv_x)
        if fp8:
            chk(assert_same, 'cached recv_x_scales', again[1], recv_scales)

    # Combine an expert output with the received weights and a bias tuple.
    # As DeepEP, combine takes as many rows as dispatch returned (num_worst_tokens: the padded
    # rows, which no channel range covers).
    y = torch.randn(recv_x.size(0), hidden, dtype=torch.bfloat16)
    bias = (torch.randn(tokens, hidden, dtype=torch.bfloat16), torch.randn(tokens, hidden, dtype=torch.bfloat16))
    want_x, want_w = ir.ref_internode_combine(ctx.group, in_rank, y[rows], n, recv_weights[rows], bias,
                                              num_nvl_ranks=ctx.node_size)
    traffic_before = query_traffic(buffer)
    combined_x, combined_w, _ = buffer.combine(y, handle, topk_weights=recv_weights, bias=bias,
                                               config=deep_ep.Buffer.get_combine_config(ctx.world))
    check_traffic(chk, 'combine', traffic_before, query_traffic(buffer),
                  ir.traffic([0, 0] + legs[2:], dispatch_row, combine_row))
    chk(assert_same, 'combined_x', combined_x, want_x)
    chk(assert_same, 'combined_topk_weights', combined_w, want_w)
    after = ref.combined_handle(num_channels)
    chk(assert_same, 'send_rdma_head after combine', handle[8], after[8])
    chk(assert_same, 'send_nvl_head after combine', handle[9][:nr], after[9][:nr])
    # A second combine (heads already rewritten: idempotent) gives the same bits.
    again_x, _, _ = buffer.combine(y, handle, topk_weights=recv_weights, bias=bias,
                                   config=deep_ep.Buffer.get_combine_config(ctx.world))
    chk(assert_same, 'second combined_x', again_x, combined_x)
    # Without a bias (DeepEP's benchmark): a token's rows are summed from 0.0 (the receiver's
    # one- and two-row paths; with one GPU per node this rank's own row is read from x).
    want_x, want_w = ir.ref_internode_combine(ctx.group, in_rank, y[rows], n, recv_weights[rows], None,
                                              num_nvl_ranks=ctx.node_size)
    plain_x, plain_w, _ = buffer.combine(y, handle, topk_weights=recv_weights,
                                         config=deep_ep.Buffer.get_combine_config(ctx.world))
    chk(assert_same, 'combined_x without bias', plain_x, want_x)
    chk(assert_same, 'combined_topk_weights without bias', plain_w, want_w)
    chk.done()


def routed(ctx, tokens, topk=8, routing='random'):
    """(topk_idx, weights, layout args of dispatch): a routing and its layout (checked)."""
    chk = Checks()
    topk_idx = route(routing, tokens, topk, ctx.world)
    weights = torch.rand(tokens, topk, dtype=torch.float32)
    per_rank, per_rdma, per_expert, in_rank = layout(ctx, ctx.buffer, topk_idx, chk)
    chk.agree(ctx.group)
    chk.done()
    return topk_idx, weights, dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
                                   is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                                   topk_weights=weights)


def delayed(tensor, value):
    """Copies value into tensor behind ~10 ms of GPU work on the current stream: a call that does
    not wait for the current stream (or previous_event) reads the old contents."""
    torch.cuda._sleep(SPIN_CYCLES)
    tensor.copy_(value)


def stream_order(ctx, previous_event=False, async_=False, on_comm_stream=False):
    """The comm stream waits for the current stream (or previous_event), and the current stream
    for the op (or async_finish's event): dispatch, combine and cached dispatch read inputs
    written by a delayed copy just before the call. The references are computed first, so their
    gathers do not synchronise the copy away. The compiled path does these waits in C++
    (_fast_streams.h), the ctypes path in Python (_streams.py)."""
    buffer, chk = ctx.buffer, Checks()
    tokens, hidden = 512, 2048
    topk_idx, weights, args = routed(ctx, tokens)
    in_rank, per_expert = args['is_token_in_rank'], args['num_tokens_per_expert']
    config = deep_ep.Buffer.get_dispatch_config(ctx.world)
    combine_config = deep_ep.Buffer.get_combine_config(ctx.world)
    kwargs = dict(async_finish=async_, allocate_on_comm_stream=on_comm_stream)

    def call(fn, *call_args, **more):
        kw = dict(kwargs, **more)
        if previous_event:
            kw['previous_event'] = deep_ep.Buffer.capture()
        out = fn(*call_args, **kw)
        chk.expect((out[-1].event is not None) == async_, f'{fn.__name__}: an event iff async_finish')
        if out[-1].event is not None:
            out[-1].current_stream_wait()
        return out

    def reference(x):
        return ir.ref_internode_dispatch(ctx.group, x, in_rank, per_expert, topk_idx, weights,
                                         num_nvl_ranks=ctx.node_size, num_channels=config.num_sms // 2)

    x, new_x = (torch.randn(tokens, hidden, dtype=torch.bfloat16) for _ in range(2))
    ref = reference(new_x)
    n = ref.num_recv
    delayed(x, new_x)
    recv_x, _, recv_weights, _, handle, _ = call(buffer.dispatch, x, **args, config=config)
    chk(assert_same, 'recv_x', recv_x[:n], ref.recv_x[:n])
    chk(assert_same, 'recv_topk_weights', recv_weights[:n], ref.recv_topk_weights[:n])
    chk.agree(ctx.group)

    y, new_y = (torch.randn(recv_x.size(0), hidden, dtype=torch.bfloat16) for _ in range(2))
    want_x, want_w = ir.ref_internode_combine(ctx.group, in_rank, new_y[:n], n, recv_weights[:n], None,
                                              num_nvl_ranks=ctx.node_size)
    delayed(y, new_y)
    combined_x, combined_w, _ = call(buffer.combine, y, handle, topk_weights=recv_weights, config=combine_config)
    chk(assert_same, 'combined_x', combined_x, want_x)
    chk(assert_same, 'combined_topk_weights', combined_w, want_w)

    x, new_x = (torch.randn(tokens, hidden, dtype=torch.bfloat16) for _ in range(2))
    ref = reference(new_x)
    delayed(x, new_x)
    again, *_ = call(buffer.dispatch, x, handle=handle, config=config)
    chk(assert_same, 'cached recv_x', again[:n], ref.recv_x[:n])
    chk.done()


def same_error(what, runtime, fn, pattern):
    """fn() raises a RuntimeError matching pattern, with the same text as the Buffer is set up
    (the compiled path where it loaded) and on the ctypes path."""
    configured = str(expect_raises_match(f'{what} (as configured)', RuntimeError, fn, pattern))
    saved = runtime._internode_fast
    runtime._internode_fast = None  # the ctypes path for this call only
    try:
        ctypes_text = str(expect_raises_match(f'{what} (ctypes path)', RuntimeError, fn, pattern))
    finally:
        runtime._internode_fast = saved
    assert configured == ctypes_text, f'{what}: {configured!r} as configured, {ctypes_text!r} on the ctypes path'


def bad_input(ctx):
    """Input refused before anything is launched (so on this rank alone): each raises the same
    RuntimeError naming the argument on both paths (the compiled path hands input it does not
    take to the ctypes path, which names it; the library's own refusals carry the library's
    message on both). The buffer then still works."""
    buffer, runtime, chk = ctx.buffer, ctx.buffer.runtime, Checks()
    tokens, hidden = 64, 2048
    _, _, args = routed(ctx, tokens)
    config = deep_ep.Buffer.get_dispatch_config(ctx.world)
    combine_config = deep_ep.Buffer.get_combine_config(ctx.world)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    recv_x, _, recv_weights, _, handle, _ = buffer.dispatch(x, **args, config=config)
    y = torch.randn(recv_x.size(0), hidden, dtype=torch.bfloat16)
    odd = deep_ep.Config(config.num_sms - 1, config.num_max_nvl_chunked_send_tokens,
                         config.num_max_nvl_chunked_recv_tokens, config.num_max_rdma_chunked_send_tokens,
                         config.num_max_rdma_chunked_recv_tokens)
    partial_handle = tuple(None if i == 6 else h for i, h in enumerate(handle))  # no recv_gbl_rank_prefix_sum
    cases = {
        'dispatch x on the CPU': (lambda: buffer.dispatch(x.cpu(), **args, config=config), r'\bx\b'),
        'dispatch x float64': (lambda: buffer.dispatch(x.double(), **args, config=config), r'\bx\b'),
        'dispatch hidden 1001': (lambda: buffer.dispatch(torch.randn(tokens, 1001, dtype=torch.bfloat16), **args,
                                                         config=config), r'\bx\b|hidden'),
        'dispatch odd num_sms': (lambda: buffer.dispatch(x, **args, config=odd), r'num_sms'),
        'cached dispatch without recv_gbl_rank_prefix_sum': (
            lambda: buffer.dispatch(x, handle=partial_handle, config=config), r'cached'),
        'combine x on the CPU': (lambda: buffer.combine(y.cpu(), handle, topk_weights=recv_weights,
                                                        config=combine_config), r'\bx\b'),
        'combine x float32': (lambda: buffer.combine(y.float(), handle, topk_weights=recv_weights,
                                                     config=combine_config), r'\bx\b'),
    }
    for what, (fn, pattern) in cases.items():
        chk(same_error, what, runtime, fn, pattern)
    chk.agree(ctx.group)
    roundtrip(ctx, tokens=17)
    chk.done()


class PathSpy:
    """Stands in for a Buffer's InternodeOps and records each op's answer: 0 when the compiled
    path ran it, its BAD_INPUT or a TypeError (pybind refused an argument) when it handed the
    call to the ctypes path."""

    def __init__(self, ops):
        self.ops, self.answers = ops, []

    def __getattr__(self, name):
        op = getattr(self.ops, name)

        def run(*args):
            try:
                result = op(*args)
            except TypeError:
                self.answers.append((name, 'TypeError'))
                raise
            self.answers.append((name, result[0]))
            return result

        return run


def compiled_path_taken(ctx):
    """DEEPEP_NCCL_FAST=1: the compiled path runs every dispatch (non-cached, cached, FP8,
    num_worst_tokens) and combine of these round trips itself; =0: the Buffer has no
    InternodeOps (every op takes the ctypes path)."""
    setting = os.environ.get('DEEPEP_NCCL_FAST', '')
    runtime = ctx.buffer.runtime
    if setting == '0':
        assert runtime._internode_fast is None, 'DEEPEP_NCCL_FAST=0, yet the Buffer has InternodeOps'
        return
    if runtime._internode_fast is None:
        assert setting != '1', 'DEEPEP_NCCL_FAST=1, yet the Buffer has no InternodeOps'
        return
    spy = PathSpy(runtime._internode_fast)
    runtime._internode_fast = spy
    try:
        roundtrip(ctx, tokens=256)
        roundtrip(ctx, tokens=256, fp8=True, routing='skewed')
        roundtrip(ctx, tokens=256, num_worst_tokens='all')
    finally:
        runtime._internode_fast = spy.ops
    # Per round trip: dispatch, a cached dispatch (not with num_worst_tokens) and three combines.
    want = ([('dispatch', 0)] * 2 + [('combine', 0)] * 3) * 2 + [('dispatch', 0)] + [('combine', 0)] * 3
    assert spy.answers == want, f'the compiled path answered {spy.answers}, expected {want}'


LL_SHAPE = (64, 2048, 16)  # M, H, E of the LL ops on the shared buffer
LL_TOPK = 4


def ll_round(ctx, buffer, seed):
    """One low_latency_dispatch + low_latency_combine on `buffer`, both checked against
    ll_reference (every rank derives every rank's inputs from seeds)."""
    m, h, e = LL_SHAPE
    all_x, all_topk = [], []
    for r in range(ctx.world):
        g = torch.Generator().manual_seed(seed + r)
        t = m - 3 * r
        all_x.append(torch.randn(t, h, generator=g, device='cpu', dtype=torch.float32).to(torch.bfloat16).cuda())
        all_topk.append(torch.rand(t, e, generator=g, device='cpu', dtype=torch.float32).topk(LL_TOPK, dim=1).indices.cuda())
    g = torch.Generator().manual_seed(seed + 1000)
    ys = [torch.randn(e // ctx.world, ctx.world * m, h, generator=g, device='cpu', dtype=torch.float32).to(torch.bfloat16).cuda()
          for _ in range(ctx.world)]
    weights = torch.rand(all_topk[ctx.rank].shape, generator=g, device='cpu', dtype=torch.float32).cuda()
    recv_x, count, handle, _, _ = buffer.low_latency_dispatch(all_x[ctx.rank], all_topk[ctx.rank], m, e,
                                                              use_fp8=False)
    torch.cuda.synchronize()
    ref = ref_ll_dispatch(all_x, all_topk, ctx.rank, e, m)
    for name, got, want in (('recv_count', count, ref.count), ('layout_range', handle[1], ref.layout_range),
                            ('src_info', handle[0][ref.valid], ref.src_info[ref.valid]),
                            ('recv_x', recv_x[ref.valid], ref.x[ref.valid])):
        assert torch.equal(got, want), f'low_latency_dispatch: {name} differs from the reference'
    combined = buffer.low_latency_combine(ys[ctx.rank], all_topk[ctx.rank], weights, handle)[0]
    torch.cuda.synchronize()
    ulps = int(bf16_ulp_distance(combined, ref_ll_combine(ys, all_topk, ctx.rank, weights, e, m)).max())
    assert ulps <= 1, f'low_latency_combine: off by up to {ulps} BF16 ulp'


def ll_compatibility(ctx):
    """DeepEP's --test-ll-compatibility: one low_latency_mode buffer across the virtual nodes serves
    internode dispatch + combine, then (after clean_low_latency_buffer, as DeepEP requires) LL
    dispatch + combine, then internode again: every result checked."""
    shared = make_buffer(ctx, LL_SHAPE)
    plain, ctx.buffer = ctx.buffer, shared
    try:
        roundtrip(ctx, hidden=2048)
        shared.clean_low_latency_buffer(*LL_SHAPE)
        ll_round(ctx, shared, seed=77)
        ll_round(ctx, shared, seed=78)
        roundtrip(ctx, hidden=2048, routing='skewed')
    finally:
        ctx.buffer = plain
        torch.cuda.synchronize()
        shared.destroy()


CASES = {
    'random_T4096_H7168_top8': dict(hidden=7168),
    'random_T4096_H2048_top1': dict(topk=1),
    'random_T1_H2048': dict(tokens=1),
    'random_T0_H2048': dict(tokens=0),
    'even_ranks_T0_H2048': dict(tokens=(0, 4096)),
    'skewed_T4096_H2048': dict(routing='skewed'),
    'one_expert_T4096_H2048_top1': dict(routing='one_expert', topk=1),
    'grouped_T4096_H7168_top8': dict(routing='grouped', hidden=7168),
    'empty_node_T4096_H2048': dict(routing='empty_node'),
    'random_T4096_H2048_top16': dict(topk=16),
    'minus_one_heavy_T4096_H7168': dict(routing='minus_one_heavy', hidden=7168),
    'fp8_col_scales_T4096_H7168': dict(fp8=True, hidden=7168),
    'fp8_col_scales_T1_H2048_skewed': dict(fp8=True, tokens=1, routing='skewed'),
    'num_worst_tokens_T4096_H2048': dict(num_worst_tokens='all'),
}

STREAM_CASES = {
    'waits_for_compute_stream': dict(),
    'previous_event_sync': dict(previous_event=True),
    'async_finish': dict(async_=True),
    'previous_event_async_allocate_on_comm_stream': dict(previous_event=True, async_=True, on_comm_stream=True),
}


def worker(rank, world, group, rep):
    ctx = make_ctx(dist.new_group(list(range(world))), rep)
    if not rep.run('create_buffer_across_virtual_nodes', lambda: setattr(ctx, 'buffer', make_buffer(ctx))):
        return
    for name, spec in CASES.items():
        rep.run(name, lambda spec=spec: roundtrip(ctx, **spec))
    rep.run('compiled_path_as_asked', lambda: compiled_path_taken(ctx))
    for name, spec in STREAM_CASES.items():
        rep.run(name, lambda spec=spec: stream_order(ctx, **spec))
    rep.run('bad_input_same_error_both_paths', lambda: bad_input(ctx))
    rep.run('ll_compatibility', lambda: ll_compatibility(ctx))
    rep.run('destroy_buffer', ctx.buffer.destroy)


if __name__ == '__main__':
    num_gpus = torch.cuda.device_count()
    if num_gpus < 2:
        print(f'test_internode needs at least 2 GPUs, found {num_gpus}')
        sys.exit(1)
    for world in (2, 4, 8):
        if world > num_gpus:
            skip(f'w{world}', f'only {num_gpus} GPUs visible ({world} would run 2 nodes of {world // 2})')
            continue
        spawn(worker, world, timeout=300)
    finish()
