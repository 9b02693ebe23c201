"""tests/gpu/internode_reference.py against a brute-force simulation of DeepEP V1's internode
normal mode (csrc/kernels/internode.cu at 567632d): tokens walk channel by channel through the
senders (per-node RDMA streams), the forwarders (which drain their source nodes in a random
interleaving, standing in for timing) and the NVLink receivers, and combine walks back the
same way using the rewritten heads. Plus the invariants DeepEP's test_internode.py checks.

Needs torch (CPU is enough); skipped where it is missing (the CI venv has none)."""
import random
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
import internode_reference as ir  # noqa: E402

HIDDEN = 16  # BF16: 32 bytes a row, a multiple of DeepEP's 16
EXPERTS_PER_RANK = 8


# ---------------------------------------------------------------- inputs
class Inputs:
    """Every rank's dispatch inputs, as get_dispatch_layout would give them."""

    def __init__(self, nodes, gpus, tokens, topk, routing="random", seed=0, rank_valued=False, holes=False):
        self.N, self.G, self.R = nodes, gpus, nodes * gpus
        self.rank_valued = rank_valued
        self.E = self.R * EXPERTS_PER_RANK
        gen = torch.Generator().manual_seed(seed)
        counts = tokens if isinstance(tokens, list) else [tokens] * self.R
        allowed = torch.arange(self.E)
        if routing == "skewed":  # every token to node 0 only
            allowed = allowed[:self.G * EXPERTS_PER_RANK]
        elif routing == "empty_node":  # nobody sends to the last node
            allowed = allowed[:(self.N - 1) * self.G * EXPERTS_PER_RANK]
        self.x, self.topk_idx, self.topk_weights, self.in_rank, self.per_expert = [], [], [], [], []
        for r, t in enumerate(counts):
            pick = torch.rand(t, allowed.numel(), generator=gen).argsort(1)[:, :topk]
            idx = allowed[pick]
            if holes and t:  # -1 slots, some tokens with no destination at all
                idx[torch.rand(t, topk, generator=gen) < 0.3] = -1
                idx[::5] = -1
            self.topk_idx.append(idx)
            if rank_valued:
                self.x.append(torch.full((t, HIDDEN), float(r)).bfloat16())
                self.topk_weights.append(torch.full((t, topk), float(r)))
            else:
                self.x.append(torch.randn(t, HIDDEN, generator=gen).bfloat16())
                self.topk_weights.append(torch.randn(t, topk, generator=gen))
            m = torch.zeros(t, self.R + 1, dtype=torch.bool)
            m.scatter_(1, torch.where(idx >= 0, idx // EXPERTS_PER_RANK, self.R), True)
            self.in_rank.append(m[:, :self.R].contiguous())
            valid = idx[idx >= 0]
            self.per_expert.append(torch.bincount(valid, minlength=self.E).int())


def dispatch_ref(inp, channels, with_topk=True, alignment=1, worst=0):
    return ir.internode_dispatch_all(
        inp.x, inp.in_rank, inp.per_expert, inp.topk_idx if with_topk else None,
        inp.topk_weights if with_topk else None, num_nvl_ranks=inp.G, num_channels=channels,
        expert_alignment=alignment, num_worst_tokens=worst)


# ---------------------------------------------------------------- brute-force simulation
def task_range(num_tokens, channels, c):
    """get_channel_task_range."""
    per = (num_tokens + channels - 1) // channels
    start = min(per * c, num_tokens)
    return start, min(start + per, num_tokens)


def rewrite_backwards(values, segments):
    """The combine notify's rewrite, walked as DeepEP walks it: each segment backwards,
    remembering the last non-negative head seen (1 << 25 at the segment's end)."""
    out = [list(row) for row in values]
    for start, end in segments:
        for col in range(len(out[0]) if out else 0):
            last = 1 << 25
            for i in range(end - 1, start - 1, -1):
                if out[i][col] < 0:
                    out[i][col] = -last - 1
                else:
                    last = out[i][col]
    return out


def simulate(inp, C, with_topk=True, alignment=1, seed=0):
    """Per rank: dict of what DeepEP's kernels write, and the combine's results."""
    rng = random.Random(seed)
    R, G, N = inp.R, inp.G, inp.N
    routes = [m.tolist() for m in inp.in_rank]
    T = [len(r) for r in routes]
    E_l = inp.E // R

    # notify_dispatch's metadata pass: counts per (channel, rank) and per (channel, node), then prefix.
    gbl_cpm = [[[0] * C for _ in range(R)] for _ in range(R)]
    rdma_cpm = [[[0] * C for _ in range(N)] for _ in range(R)]
    for s in range(R):
        for c in range(C):
            a, b = task_range(T[s], C, c)
            for t in range(a, b):
                for d in range(R):
                    gbl_cpm[s][d][c] += routes[s][t][d]
                for n in range(N):
                    rdma_cpm[s][n][c] += any(routes[s][t][n * G:(n + 1) * G])
        for row in gbl_cpm[s] + rdma_cpm[s]:
            for c in range(1, C):
                row[c] += row[c - 1]
    sent = [[sum(routes[s][t][d] for t in range(T[s])) for d in range(R)] for s in range(R)]
    node_sent = [[rdma_cpm[s][n][-1] if C else 0 for n in range(N)] for s in range(R)]

    # RDMA senders: per channel, one stream per destination node; the slot is the send_rdma_head.
    send_rdma_head = [[[-1] * N for _ in range(T[s])] for s in range(R)]
    rdma_ring = {}  # (forwarder rank, channel, source node) -> [(source, token, mask)]
    scale_out = [0] * R  # rows each source puts into another node's ring
    for s in range(R):
        for c in range(C):
            tail = [0] * N
            a, b = task_range(T[s], C, c)
            for t in range(a, b):
                for n in range(N):
                    local = routes[s][t][n * G:(n + 1) * G]
                    if any(local):
                        send_rdma_head[s][t][n] = tail[n]
                        tail[n] += 1
                        mask = sum(1 << g for g in range(G) if local[g])
                        rdma_ring.setdefault((n * G + s % G, c, s // G), []).append((s, t, mask))
                        scale_out[s] += n != s // G

    # notify: what each rank receives, and each forwarder's RDMA receive space.
    recv_gbl_prefix = [[sum(sent[q][d] for q in range(s + 1)) for s in range(R)] for d in range(R)]
    recv_rdma_prefix = [[sum(node_sent[k * G + f % G][f // G] for k in range(n + 1)) for n in range(N)]
                        for f in range(R)]

    # Forwarders: drain the source nodes' rings in a random interleaving, fan out over NVLink.
    send_nvl_head = [[[-1] * G for _ in range(recv_rdma_prefix[f][-1])] for f in range(R)]
    nvl_ring = {}  # (receiver, channel, forwarder's local rank) -> [(source, token, mask)] in arrival order
    nvl_out = [0] * R  # rows a forwarder wrote into other local GPUs' NVLink rings
    for f in range(R):
        m, l = divmod(f, G)
        for c in range(C):
            queues = {n: list(enumerate(rdma_ring.get((f, c, n), []))) for n in range(N)}
            nvl_count = {}
            while any(queues.values()):
                n = rng.choice([k for k, q in queues.items() if q])
                i, (s, t, mask) = queues[n].pop(0)
                src = n * G + l
                row = (recv_rdma_prefix[f][n - 1] if n else 0) + (rdma_cpm[src][m][c - 1] if c else 0) + i
                for g in range(G):
                    if mask >> g & 1:
                        send_nvl_head[f][row][g] = nvl_count.get((n, g), 0)
                        nvl_count[(n, g)] = send_nvl_head[f][row][g] + 1
                        nvl_ring.setdefault((m * G + g, c, l), []).append((s, t, mask))
                        nvl_out[f] += g != l

    # NVL receivers: place each arriving row by its source's running offset.
    out = []
    for d in range(R):
        m = d // G
        rows = [None] * recv_gbl_prefix[d][-1]
        recv_gbl_cpm = [[0] * C for _ in range(R)]
        for c in range(C):
            for l in range(G):
                offset = {}
                for n in range(N):
                    src = n * G + l
                    offset[n] = (recv_gbl_prefix[d][src - 1] if src else 0) + (gbl_cpm[src][d][c - 1] if c else 0)
                    recv_gbl_cpm[src][c] = offset[n]
                for s, t, mask in nvl_ring.get((d, c, l), []):
                    assert rows[offset[s // G]] is None
                    rows[offset[s // G]] = (s, t, mask)
                    offset[s // G] += 1
        assert all(r is not None for r in rows)
        meta = [list((s // G).to_bytes(4, "little") + mask.to_bytes(4, "little")) for s, t, mask in rows]
        res = dict(
            rows=rows,
            recv_x=torch.stack([inp.x[s][t] for s, t, _ in rows]) if rows else torch.empty(0, HIDDEN).bfloat16(),
            rdma_channel_prefix_matrix=rdma_cpm[d], gbl_channel_prefix_matrix=gbl_cpm[d],
            recv_rdma_channel_prefix_matrix=[rdma_cpm[n * G + d % G][m] for n in range(N)],
            recv_rdma_rank_prefix_sum=recv_rdma_prefix[d], recv_gbl_channel_prefix_matrix=recv_gbl_cpm,
            recv_gbl_rank_prefix_sum=recv_gbl_prefix[d], recv_src_meta=meta,
            send_rdma_head=send_rdma_head[d], send_nvl_head=send_nvl_head[d], scale_out_rows=scale_out[d],
            nvl_out_rows=nvl_out[d],
            per_expert=[-(-sum(int(inp.per_expert[s][d * E_l + e]) for s in range(R)) // alignment) * alignment
                        for e in range(E_l)])
        if with_topk:
            idx, w = [], []
            for s, t, _ in rows:
                k_idx = [int(e) - d * E_l if d * E_l <= int(e) < (d + 1) * E_l else -1 for e in inp.topk_idx[s][t]]
                idx.append(k_idx)
                w.append([float(v) if k >= 0 else 0.0 for k, v in zip(k_idx, inp.topk_weights[s][t].tolist())])
            res["recv_topk_idx"], res["recv_topk_weights"] = idx, w
        # The combine notify's rewrite, over DeepEP's own segments.
        res["combined_rdma_head"] = rewrite_backwards(send_rdma_head[d], [task_range(T[d], C, c) for c in range(C)])
        res["combined_nvl_head"] = rewrite_backwards(send_nvl_head[d], [
            ((recv_rdma_prefix[d][n - 1] if n else 0) + (res["recv_rdma_channel_prefix_matrix"][n][c - 1] if c else 0),
             (recv_rdma_prefix[d][n - 1] if n else 0) + res["recv_rdma_channel_prefix_matrix"][n][c])
            for n in range(N) for c in range(C)])
        out.append(res)
    return out


def simulate_combine(inp, sim, C, x, weights, bias):
    """Combine through the streams, with the rewritten heads: NVL senders send their rows back
    per (forwarder, source node, channel); forwarders reduce per RDMA row; sources reduce per token."""
    R, G, N = inp.R, inp.G, inp.N
    nvl_stream = {}
    for d in range(R):
        cpm = sim[d]["recv_gbl_channel_prefix_matrix"]
        flat = [cpm[src][c] for src in range(R) for c in range(C)] + [sim[d]["recv_gbl_rank_prefix_sum"][-1]]
        for src in range(R):
            for c in range(C):
                i = src * C + c
                nvl_stream[(d, src % G, src // G, c)] = list(range(flat[i], flat[i + 1]))
    rdma_stream = {}
    for f in range(R):
        m, l = divmod(f, G)
        heads, prefix = sim[f]["combined_nvl_head"], sim[f]["recv_rdma_rank_prefix_sum"]
        rcpm = sim[f]["recv_rdma_channel_prefix_matrix"]
        for n in range(N):
            for c in range(C):
                start = (prefix[n - 1] if n else 0) + (rcpm[n][c - 1] if c else 0)
                end = (prefix[n - 1] if n else 0) + rcpm[n][c]
                stream = rdma_stream.setdefault((f, n, c), [])
                for row in range(start, end):
                    acc, acc_w = torch.zeros(HIDDEN), torch.zeros(weights[0].size(1)) if weights else None
                    for g in range(G):
                        h = heads[row][g]
                        if h >= 0:
                            r = nvl_stream[(m * G + g, l, n, c)][h]
                            acc = acc + x[m * G + g][r].float()
                            if weights:
                                acc_w = acc_w + weights[m * G + g][r]
                    stream.append((acc.bfloat16(), acc_w))
    out = []
    for s in range(R):
        n0, l = divmod(s, G)
        heads = sim[s]["combined_rdma_head"]
        b0, b1 = bias[s]
        rows, rows_w = [], []
        for c in range(C):
            a, b = task_range(inp.in_rank[s].size(0), C, c)
            for t in range(a, b):
                acc = b0[t].float() + b1[t].float()
                acc_w = torch.zeros(weights[0].size(1)) if weights else None
                for n in range(N):
                    h = heads[t][n]
                    if h >= 0:
                        part, part_w = rdma_stream[(n * G + l, n0, c)][h]
                        acc = acc + part.float()
                        if weights:
                            acc_w = acc_w + part_w
                rows.append(acc.bfloat16())
                rows_w.append(acc_w)
        combined = torch.stack(rows) if rows else torch.empty(0, HIDDEN).bfloat16()
        combined_w = (torch.stack(rows_w) if rows else torch.empty(0, weights[0].size(1))) if weights else None
        out.append((combined, combined_w))
    return out


# ---------------------------------------------------------------- comparison
def t32(values, shape):
    return torch.tensor(values, dtype=torch.int32).reshape(shape)


def assert_matches(inp, refs, sim, C, with_topk=True):
    N, R, G = inp.N, inp.R, inp.G
    for d, (ref, exp) in enumerate(zip(refs, sim)):
        h = ref.handle
        assert h[0] is inp.in_rank[d]
        assert torch.equal(h[1], t32(exp["rdma_channel_prefix_matrix"], (N, C)))
        assert torch.equal(h[2], t32(exp["gbl_channel_prefix_matrix"], (R, C)))
        assert torch.equal(h[3], t32(exp["recv_rdma_channel_prefix_matrix"], (N, C)))
        assert torch.equal(h[4], t32(exp["recv_rdma_rank_prefix_sum"], (N,)))
        assert torch.equal(h[5], t32(exp["recv_gbl_channel_prefix_matrix"], (R, C)))
        assert torch.equal(h[6], t32(exp["recv_gbl_rank_prefix_sum"], (R,)))
        nrecv, nrdma = ref.num_recv, ref.num_rdma_recv
        assert torch.equal(h[7][:nrecv], torch.tensor(exp["recv_src_meta"], dtype=torch.uint8).reshape(-1, 8))
        assert torch.equal(h[8], t32(exp["send_rdma_head"], (-1, N)))
        assert torch.equal(h[9][:nrdma], t32(exp["send_nvl_head"], (-1, G)))
        combined = ref.combined_handle(C)
        assert torch.equal(combined[8], t32(exp["combined_rdma_head"], (-1, N)))
        assert torch.equal(combined[9][:nrdma], t32(exp["combined_nvl_head"], (-1, G)))
        assert torch.equal(ref.recv_x[:nrecv], exp["recv_x"])
        if with_topk:
            k = inp.topk_idx[0].size(1)
            assert torch.equal(ref.recv_topk_idx[:nrecv], torch.tensor(exp["recv_topk_idx"]).reshape(-1, k))
            assert torch.equal(ref.recv_topk_weights[:nrecv], torch.tensor(exp["recv_topk_weights"]).reshape(-1, k))
        else:
            assert ref.recv_topk_idx is None and ref.recv_topk_weights is None


def check_deepep_invariants(inp, refs, C, alignment=1):
    """What test_internode.py asserts, plus the handle's internal consistency."""
    G, N, R = inp.G, inp.N, inp.R
    E_l = inp.E // R
    gbl_per_rank = torch.stack([m.sum(0) for m in inp.in_rank]).sum(0)
    gbl_per_expert = torch.stack(inp.per_expert).sum(0).view(R, -1)
    for d, ref in enumerate(refs):
        h = ref.handle
        m = inp.in_rank[d]
        # Sender side: the last channel column is the layout's per-rank / per-node count.
        assert torch.equal(h[2][:, -1], m.sum(0).int())
        assert torch.equal(h[1][:, -1], ir.in_node(m, G).sum(0).int())
        assert (h[1].diff(dim=1) >= 0).all() and (h[2].diff(dim=1) >= 0).all()
        assert h[8].shape == (m.size(0), N) and h[8].dtype == torch.int32
        # Receive side.
        assert ref.num_recv == int(gbl_per_rank[d]) == int(h[6][-1]) == ref.recv_x.size(0) == h[7].size(0)
        assert ref.num_rdma_recv == int(h[4][-1]) == h[9].size(0)
        assert h[7].dtype == torch.uint8 and h[7].shape[1] == 8 and h[9].shape[1] == G
        assert torch.equal(h[5][:, 0], (h[6] - torch.stack([x.sum(0) for x in inp.in_rank])[:, d]).int())
        assert (h[5].diff(dim=1) >= 0).all() and (h[3].diff(dim=1) >= 0).all()
        aligned = [-(-c // alignment) * alignment for c in gbl_per_expert[d].tolist()]
        assert ref.num_recv_tokens_per_expert_list == aligned
        src_node, mask = ir.decode_source_meta(h[7])
        assert ((mask >> (d % G)) & 1).all()  # I am in every row's mask
        sources = torch.repeat_interleave(torch.arange(R), (h[6] - torch.cat([h[6].new_zeros(1), h[6][:-1]])).long())
        assert torch.equal(src_node, sources // G)
        # test_internode's check_data on rank-valued x: rows [prefix[i-1], prefix[i]) hold i.
        start = 0
        for i in range(R):
            end = int(h[-4][i])
            if inp.rank_valued:
                assert (ref.recv_x[start:end].float() == i).all()
            start = end
        if ref.recv_topk_idx is not None:
            k = ref.recv_topk_idx
            assert ((k == -1) | ((k >= 0) & (k < E_l))).all()
            if alignment == 1:
                assert [int((k == i).sum()) for i in range(E_l)] == ref.num_recv_tokens_per_expert_list
            assert (ref.recv_topk_weights[k == -1] == 0).all()
    # Each forwarder's NVL heads count exactly the rows its local peers receive from its sources.
    for m in range(N):
        for g in range(G):
            fwd_rows = sum(int((refs[m * G + l].handle[9][:, g] >= 0).sum()) for l in range(G))
            assert fwd_rows == refs[m * G + g].num_recv


# ---------------------------------------------------------------- tests
SHAPES = [(2, 1), (2, 8), (3, 4), (16, 4), (1, 8)]


@pytest.mark.parametrize("nodes,gpus", SHAPES)
@pytest.mark.parametrize("tokens", [0, 1, 17, 300])
def test_dispatch_and_combine_match_simulation(nodes, gpus, tokens):
    inp = Inputs(nodes, gpus, tokens, topk=8, seed=nodes * 100 + gpus * 10 + tokens)
    channels = 5
    refs = dispatch_ref(inp, channels)
    sim = simulate(inp, channels, seed=tokens)
    assert_matches(inp, refs, sim, channels)
    check_deepep_invariants(inp, refs, channels)
    check_combine(inp, refs, sim, channels)


def wide_bf16(rows, cols, gen):
    """Random BF16 over 2^-20..2^20: fp32 sums of such values round, so summation order shows."""
    scale = torch.exp2(torch.randint(-20, 21, (rows, cols), generator=gen).float())
    return (torch.randn(rows, cols, generator=gen) * scale).bfloat16()


def check_combine(inp, refs, sim, channels, with_weights=True):
    """Bit-exact against the simulation on inputs whose fp32 sums depend on order; then
    DeepEP's own check: combining recv_topk_weights gives back the original weights."""
    gen = torch.Generator().manual_seed(7)
    bias = [(torch.ones(m.size(0), HIDDEN).bfloat16(), wide_bf16(m.size(0), HIDDEN, gen)) for m in inp.in_rank]
    x = [wide_bf16(r.num_recv, HIDDEN, gen) for r in refs]
    k = inp.topk_idx[0].size(1)
    w = [wide_bf16(r.num_recv, k, gen).float() for r in refs] if with_weights else None
    got = ir.internode_combine_all(inp.in_rank, x, w, bias, num_nvl_ranks=inp.G)
    exp = simulate_combine(inp, sim, channels, x, w, bias)
    for s, ((cx, cw), (ex, ew)) in enumerate(zip(got, exp)):
        assert cx.dtype == torch.bfloat16 and cx.shape == (inp.in_rank[s].size(0), HIDDEN)
        assert torch.equal(cx, ex)
        assert cw is None if not with_weights else torch.equal(cw, ew)
    if with_weights:
        got = ir.internode_combine_all(inp.in_rank, x, [r.recv_topk_weights for r in refs], None, num_nvl_ranks=inp.G)
        for s, (_, cw) in enumerate(got):
            # Dispatch zeroes non-local weights, so each slot sums one weight and zeros.
            orig = torch.where(inp.topk_idx[s] >= 0, inp.topk_weights[s], torch.zeros(()))
            assert torch.equal(cw, orig)


@pytest.mark.parametrize("routing", ["skewed", "empty_node"])
@pytest.mark.parametrize("nodes,gpus", [(2, 8), (3, 4), (16, 4)])
def test_skewed_and_empty_node(routing, nodes, gpus):
    inp = Inputs(nodes, gpus, 40, topk=8, routing=routing, seed=3)
    refs = dispatch_ref(inp, 4)
    sim = simulate(inp, 4, seed=1)
    assert_matches(inp, refs, sim, 4)
    check_deepep_invariants(inp, refs, 4)
    check_combine(inp, refs, sim, 4)
    last = range((nodes - 1) * gpus, nodes * gpus)
    if routing == "empty_node":
        assert all(refs[r].num_recv == 0 and refs[r].num_rdma_recv == 0 for r in last)
        assert all((r.handle[8][:, -1] == -1).all() for r in refs)
    else:
        assert all(refs[r].num_recv == 0 for r in range(gpus, inp.R))
        # Only node 0 is ever a destination: own-node tokens of node 0 never leave it.
        assert all(ir.scale_out_rows(inp.in_rank[r], r, gpus) == 0 for r in range(gpus))


@pytest.mark.parametrize("nodes,gpus,topk", [(2, 8, 1), (3, 4, 1), (3, 4, 8), (2, 1, 8)])
def test_holes_ragged_tokens_and_alignment(nodes, gpus, topk):
    """-1 top-k slots (and tokens that go nowhere), a different T on every rank, expert alignment."""
    inp = Inputs(nodes, gpus, [(7 * r + 3) % 23 for r in range(nodes * gpus)], topk=topk, holes=True, seed=11)
    refs = dispatch_ref(inp, 3, alignment=16)
    sim = simulate(inp, 3, alignment=16, seed=5)
    assert_matches(inp, refs, sim, 3)
    check_deepep_invariants(inp, refs, 3, alignment=16)
    check_combine(inp, refs, sim, 3)


def test_rank_valued_data_check_and_no_topk():
    """test_internode's check_data (handle[-4] bounds each source's block) without top-k, and
    combine without weights: (combined - b0 - b1) / count == x, as its calc_diff checks."""
    inp = Inputs(3, 4, 50, topk=8, rank_valued=True, seed=2)
    refs = dispatch_ref(inp, 6, with_topk=False)
    sim = simulate(inp, 6, with_topk=False, seed=9)
    assert_matches(inp, refs, sim, 6, with_topk=False)
    check_deepep_invariants(inp, refs, 6)
    check_combine(inp, refs, sim, 6, with_weights=False)
    bias = [(torch.ones(m.size(0), HIDDEN).bfloat16(), torch.zeros(m.size(0), HIDDEN).bfloat16()) for m in inp.in_rank]
    got = ir.internode_combine_all(inp.in_rank, [r.recv_x for r in refs], None, bias, num_nvl_ranks=inp.G)
    for s, (cx, cw) in enumerate(got):
        count = inp.in_rank[s].sum(1, keepdim=True)
        assert cw is None and (count > 0).all()  # top-8 of 96 experts always lands somewhere
        assert torch.equal((cx.float() - 1) / count, inp.x[s].float())  # exact: small integer sums


def test_forwarder_interleaving_does_not_change_anything():
    inp = Inputs(3, 4, 60, topk=8, seed=4)
    a, b = simulate(inp, 4, seed=1), simulate(inp, 4, seed=2)
    for ra, rb in zip(a, b):
        for key in ("rows", "send_nvl_head", "recv_gbl_channel_prefix_matrix", "combined_nvl_head"):
            assert ra[key] == rb[key]


def test_num_worst_tokens():
    inp = Inputs(2, 4, 30, topk=8, seed=6)
    normal = dispatch_ref(inp, 4)
    worst = dispatch_ref(inp, 4, worst=30 * inp.R)
    for n, w in zip(normal, worst):
        assert w.num_recv_tokens_per_expert_list == [] and w.recv_x.size(0) == 30 * inp.R
        assert w.handle[9].size(0) == 30 * inp.R and w.handle[7].size(0) == 30 * inp.R
        for a, b in ((n.recv_x, w.recv_x), (n.recv_topk_idx, w.recv_topk_idx),
                     (n.recv_topk_weights, w.recv_topk_weights), (n.handle[7], w.handle[7])):
            assert torch.equal(a, b[:n.num_recv])
        assert (w.recv_topk_idx[n.num_recv:] == -1).all()
        assert torch.equal(n.handle[9], w.handle[9][:n.num_rdma_recv])
        for i in range(1, 7):
            assert torch.equal(n.handle[i], w.handle[i])
        assert torch.equal(n.combined_handle(4)[9], w.combined_handle(4)[9][:n.num_rdma_recv])


def test_fp8_payload_with_column_major_scales():
    inp = Inputs(2, 4, 33, topk=8, seed=8)
    gen = torch.Generator().manual_seed(1)
    fp8 = [x.float().to(torch.float8_e4m3fn) for x in inp.x]
    # Column-major scales, as test_internode passes them.
    scales = [torch.rand(x.size(0), 3, generator=gen).T.contiguous().T for x in inp.x]
    refs = ir.internode_dispatch_all(list(zip(fp8, scales)), inp.in_rank, inp.per_expert, inp.topk_idx,
                                     inp.topk_weights, num_nvl_ranks=4, num_channels=4)
    sim = simulate(inp, 4, seed=3)
    for ref, exp in zip(refs, sim):
        assert ref.recv_x.dtype == torch.float8_e4m3fn and ref.recv_x_scales.is_contiguous()
        rows = exp["rows"]
        want_x = (torch.stack([fp8[s][t].view(torch.uint8) for s, t, _ in rows]) if rows
                  else torch.empty(0, HIDDEN, dtype=torch.uint8))
        want_s = torch.stack([scales[s][t] for s, t, _ in rows]) if rows else torch.empty(0, 3)
        assert torch.equal(ref.recv_x.view(torch.uint8), want_x)
        assert torch.equal(ref.recv_x_scales, want_s)


def test_source_meta_bytes():
    meta = ir.encode_source_meta(torch.tensor([0, 1, 19, 258]), torch.tensor([0b1, 0xff, 0x80, 0xffffffff]))
    assert meta.tolist() == [[0, 0, 0, 0, 1, 0, 0, 0], [1, 0, 0, 0, 255, 0, 0, 0],
                             [19, 0, 0, 0, 128, 0, 0, 0], [2, 1, 0, 0, 255, 255, 255, 255]]
    node, mask = ir.decode_source_meta(meta)
    assert node.tolist() == [0, 1, 19, 258] and mask.tolist() == [1, 255, 128, 0xffffffff]


def test_head_rewrite_encoding_and_idempotence():
    head = torch.tensor([[-1, 0], [2, -1], [-1, -1], [5, 1], [-1, -1], [0, -1], [-1, 3]], dtype=torch.int32)
    ends = torch.tensor([5, 5, 5, 5, 5, 7, 7])  # segments [0, 5) and [5, 7)
    none = -(1 << 25) - 1
    want = [[-3, 0], [2, -2], [-6, -2], [5, 1], [none, none], [0, -4], [none, 3]]
    once = ir.rewrite_heads(head, ends)
    assert once.tolist() == want and once.dtype == torch.int32
    assert torch.equal(ir.rewrite_heads(once, ends), once)
    assert once.tolist() == rewrite_backwards(head.tolist(), [(0, 5), (5, 7)])


def test_two_stage_rounding_differs_from_one_stage():
    """Two nodes: node 0's forwarder sums 1 + 2^-8 (GPUs 0, 1), a BF16 tie that rounds to 1;
    node 1 adds 2^-8. DeepEP's two stages give 1.0; one fp32 sum would give 1 + 2^-7."""
    in_rank = [torch.tensor([[True, True, True, False]])] + [torch.zeros(0, 4, dtype=torch.bool)] * 3
    x = [torch.tensor([[1.0] * HIDDEN]).bfloat16(), torch.tensor([[2.0 ** -8] * HIDDEN]).bfloat16(),
         torch.tensor([[2.0 ** -8] * HIDDEN]).bfloat16(), torch.zeros(0, HIDDEN).bfloat16()]
    (cx, _), *_ = ir.internode_combine_all(in_rank, x, num_nvl_ranks=2)
    assert (cx.float() == 1.0).all()
    assert ((x[0].float() + x[1].float() + x[2].float()).bfloat16().float() == 1.0 + 2.0 ** -7).all()


def test_scale_out_statistic():
    inp = Inputs(3, 4, 25, topk=8, seed=12)
    sim = simulate(inp, 2, seed=0)
    for s in range(inp.R):
        assert ir.scale_out_rows(inp.in_rank[s], s, inp.G) == sim[s]["scale_out_rows"] > 0
        assert ir.scale_out_bytes(inp.in_rank[s], s, inp.G, 144) == 144 * sim[s]["scale_out_rows"]
    # DeepEP's row: 7168 BF16 + SourceMeta + 8 ids + 8 weights = 14,416 B; FP8 with 56 scales 7,472 B.
    assert ir.deepep_row_bytes(14336, 0, 8) == 14416 and ir.deepep_row_bytes(7168, 56, 8) == 7472


def test_traffic_rows_follow_the_simulated_legs():
    """traffic_rows against the per-token walk: dispatch as walked; combine sends back each row
    of the scale-out receive space from another node, and over NVLink each received row whose
    source is another GPU of the node."""
    for nodes, gpus, seed in ((3, 4, 12), (2, 1, 13), (2, 8, 14)):
        inp = Inputs(nodes, gpus, 25, topk=8, seed=seed)
        sim = simulate(inp, 2, seed=0)
        for d in range(inp.R):
            prefix, node = sim[d]["recv_rdma_rank_prefix_sum"], d // inp.G
            own = prefix[node] - (prefix[node - 1] if node else 0)
            combine_nvl = sum(s % inp.G != d % inp.G for s, _, _ in sim[d]["rows"])
            want = [sim[d]["scale_out_rows"], sim[d]["nvl_out_rows"], prefix[-1] - own, combine_nvl]
            assert ir.traffic_rows(inp.in_rank, d, inp.G) == want, (nodes, gpus, d)
            if inp.G == 1:
                assert want[1] == want[3] == 0
    assert ir.traffic([1, 2, 3, 4], 100, 10) == [1, 100, 2, 232, 3, 30, 4, 104]
    # The implementation's rows (src/internode/mod.rs pins the same sizes).
    assert ir.dispatch_row_bytes(7168 * 2, 0, 8) == 16 + 14336 + 32 + 32
    assert ir.dispatch_row_bytes(7168, 56, 8) == 16 + 7168 + 224 + 32 + 32
    assert ir.combine_row_bytes(4096, 9) == 4096 + 48


def _collective_worker(rank, world, store, out_dir):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        inp = Inputs(2, 2, [5, 0, 9, 4], topk=2, holes=True, seed=13)
        gen = torch.Generator().manual_seed(rank)
        scales = torch.rand(inp.in_rank[rank].size(0), 2, generator=gen)
        ref = ir.ref_internode_dispatch(
            dist.group.WORLD, (inp.x[rank].float().to(torch.float8_e4m3fn), scales.T.contiguous().T),
            inp.in_rank[rank], inp.per_expert[rank], inp.topk_idx[rank], inp.topk_weights[rank],
            num_nvl_ranks=2, num_channels=2)
        x = wide_bf16(ref.num_recv + 3, HIDDEN, gen)  # 3 rows of num_worst_tokens-style padding
        bias = wide_bf16(inp.in_rank[rank].size(0), HIDDEN, gen)
        combined = ir.ref_internode_combine(dist.group.WORLD, inp.in_rank[rank], x, ref.num_recv,
                                            ref.recv_topk_weights, bias, num_nvl_ranks=2)
        torch.save({"ref": ref, "scales": scales, "x": x, "bias": bias, "combined": combined},
                   f"{out_dir}/{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_collective_wrappers_match(tmp_path):
    """ref_internode_dispatch / ref_internode_combine over a 4-process gloo group (2 nodes x 2)
    give this rank's entry of the all-ranks functions."""
    import torch.multiprocessing as mp
    mp.spawn(_collective_worker, args=(4, str(tmp_path / "store"), str(tmp_path)), nprocs=4)
    got = [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(4)]
    inp = Inputs(2, 2, [5, 0, 9, 4], topk=2, holes=True, seed=13)
    fp8 = [(x.float().to(torch.float8_e4m3fn), g["scales"]) for x, g in zip(inp.x, got)]
    refs = ir.internode_dispatch_all(fp8, inp.in_rank, inp.per_expert, inp.topk_idx, inp.topk_weights,
                                     num_nvl_ranks=2, num_channels=2)
    combined = ir.internode_combine_all(inp.in_rank, [g["x"] for g in got], [r.recv_topk_weights for r in refs],
                                        [g["bias"] for g in got], num_nvl_ranks=2)
    for r, (g, ref) in enumerate(zip(got, refs)):
        c = g["ref"]
        assert torch.equal(c.recv_x.view(torch.uint8), ref.recv_x.view(torch.uint8))
        assert torch.equal(c.recv_x_scales, ref.recv_x_scales) and torch.equal(c.recv_topk_idx, ref.recv_topk_idx)
        assert c.num_recv_tokens_per_expert_list == ref.num_recv_tokens_per_expert_list
        assert all(torch.equal(a, b) for a, b in zip(c.handle, ref.handle))
        assert torch.equal(g["combined"][0], combined[r][0]) and torch.equal(g["combined"][1], combined[r][1])
