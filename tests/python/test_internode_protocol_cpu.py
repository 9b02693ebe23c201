"""The index arithmetic of this library's internode kernels (kernels/internode_{notify,dispatch,
combine}.cu), walked on the CPU and held against the oracle tests/gpu/internode_reference.py:
what each notify slot carries and how the receive side is derived from it, the sender's
per-node sequence numbers, the forwarder's per-GPU sequence numbers and NVLink ring (any
interleaving of source nodes), the receiver's row positions, and in combine the NVLink senders'
streams (segments of source nodes, the last one ending at x's rows), the forwarder's offsets
into them from the rewritten heads (its own GPU's rows straight from x), and the head rewrite itself. Each step mirrors a named
kernel function; a wrong offset there shows up as a row here that is not the oracle's.

Needs torch (CPU is enough); skipped where it is missing (the CI venv has none)."""
import random
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import internode_reference as ir  # noqa: E402
from test_internode_reference_cpu import Inputs, task_range  # noqa: E402

HEAD_NONE = 1 << 25


def notify(inp, C):
    """internode_notify_kernel: per rank, the slots it receives and the receive side."""
    R, N, G = inp.R, inp.N, inp.G
    gbl = [[[0] * C for _ in range(R)] for _ in range(R)]  # [src][dst rank][c] inclusive
    rdma = [[[0] * C for _ in range(N)] for _ in range(R)]  # [src][dst node][c] inclusive
    for s in range(R):
        m = inp.in_rank[s]
        for c in range(C):
            b, e = task_range(m.size(0), C, c)
            for r in range(R):
                gbl[s][r][c] = int(m[b:e, r].sum()) + (gbl[s][r][c - 1] if c else 0)
            for n in range(N):
                rdma[s][n][c] = int(m[b:e, n * G:(n + 1) * G].any(1).sum()) + (rdma[s][n][c - 1] if c else 0)
    out = []
    for me in range(R):
        my_gpu = me % G
        # Slot from source s: its gbl prefixes towards me, its rdma prefixes towards my node
        # (only from the same-GPU source), its expert counts.
        slots = [(gbl[s][me], rdma[s][me // G] if s % G == my_gpu else [0] * C) for s in range(R)]
        rank_prefix, acc = [], 0
        for s in range(R):
            acc += slots[s][0][C - 1]
            rank_prefix.append(acc)
        rdma_prefix, acc = [], 0
        for n in range(N):
            acc += slots[n * G + my_gpu][1][C - 1]
            rdma_prefix.append(acc)
        recv_gbl_cpm = [[(rank_prefix[s - 1] if s else 0) + (slots[s][0][c - 1] if c else 0) for c in range(C)]
                        for s in range(R)]
        recv_rdma_cpm = [list(slots[n * G + my_gpu][1]) for n in range(N)]
        out.append(dict(rdma_cpm=rdma[me], gbl_cpm=gbl[me], recv_rdma_cpm=recv_rdma_cpm, recv_rdma_prefix=rdma_prefix,
                        recv_gbl_cpm=recv_gbl_cpm, recv_gbl_prefix=rank_prefix))
    return out


def dispatch(inp, C, side, rng):
    """dispatch_send, dispatch_forward (source nodes drained in a random interleaving) and
    dispatch_receive. Rows are (source rank, token)."""
    R, N, G = inp.R, inp.N, inp.G
    rings = {}  # (forwarder rank, c, source node) -> rows (token, mask) in slot order
    rdma_head = []
    for s in range(R):
        m = inp.in_rank[s]
        head = [[-1] * N for _ in range(m.size(0))]
        for c in range(C):
            b, e = task_range(m.size(0), C, c)
            for n in range(N):
                k = 0
                for t in range(b, e):
                    mask = sum(1 << g for g in range(G) if m[t, n * G + g])
                    if mask:
                        head[t][n] = k
                        rings.setdefault((n * G + s % G, c, s // G), []).append((t, mask))
                        k += 1
        rdma_head.append(head)
    recv = [dict() for _ in range(R)]  # rank -> {row: (src, token, mask)}
    nvl_head = []
    for f in range(R):
        me_side, n, l = side[f], f // G, f % G
        nvl = [[-1] * G for _ in range(me_side["recv_rdma_prefix"][-1] if N else 0)]
        for c in range(C):
            streams = []
            for s_node in range(N):
                cpm = me_side["recv_rdma_cpm"][s_node]
                first = cpm[c - 1] if c else 0
                rows = rings.get((f, c, s_node), [])
                assert len(rows) == cpm[c] - first, "notify's count of a scale-out ring"
                row0 = (me_side["recv_rdma_prefix"][s_node - 1] if s_node else 0) + first
                streams.append((s_node, row0, rows))
            seq = {s_node: [0] * G for s_node in range(N)}
            pos = {s_node: 0 for s_node in range(N)}
            # Forwarder warps interleave source nodes as timing has them.
            while any(pos[s_node] < len(rows) for s_node, _, rows in streams):
                s_node, row0, rows = rng.choice([st for st in streams if pos[st[0]] < len(st[2])])
                i = pos[s_node]
                t, mask = rows[i]
                src = s_node * G + l
                for j in range(G):
                    if (mask >> j) & 1:
                        nvl[row0 + i][j] = seq[s_node][j]
                        # dispatch_receive on (n, j): the row's place from the prefix matrices.
                        dst = n * G + j
                        row = side[dst]["recv_gbl_cpm"][src][c] + seq[s_node][j]
                        assert row not in recv[dst], f"rank {dst}: row {row} written twice"
                        recv[dst][row] = (src, t, mask)
                        seq[s_node][j] += 1
                pos[s_node] += 1
        nvl_head.append(nvl)
    return rdma_head, nvl_head, recv


def rewrite(head, segments):
    """rewrite_segment over each (begin, end) segment, every column."""
    out = [list(r) for r in head]
    for begin, end in segments:
        for col in range(len(out[0]) if out else 0):
            nxt = HEAD_NONE
            for i in range(end - 1, begin - 1, -1):
                if out[i][col] >= 0:
                    nxt = out[i][col]
                else:
                    out[i][col] = -nxt - 1
    return out


def combine_rows(inp, C, side, rdma_head, nvl_head, recv):
    """combine_nvl_send's streams and combine_forward's offsets: for every forwarded row and GPU
    of its mask, the (source, token) of the row the GPU sent at the position the forwarder reads;
    and combine_receive's row per (token, node)."""
    R, N, G = inp.R, inp.N, inp.G
    # NVLink streams: (j rank, c, forwarder GPU l) -> rows (src, token) in stream order.
    streams = {}
    for j in range(R):
        num_recv = side[j]["recv_gbl_prefix"][-1]
        cpm = side[j]["recv_gbl_cpm"]
        for c in range(C):
            for fl in range(G):
                rows = []
                for s_node in range(N):
                    src = s_node * G + fl
                    start = cpm[src][c]
                    stop = cpm[src][c + 1] if c + 1 < C else (cpm[src + 1][0] if src + 1 < R else num_recv)
                    rows += [recv[j][r][:2] for r in range(start, stop)]
                streams[(j, c, fl)] = rows
    for f in range(R):
        n, l = f // G, f % G
        cpm, prefix = side[f]["recv_rdma_cpm"], side[f]["recv_rdma_prefix"]
        segs = []
        for s_node in range(N):
            for c in range(C):
                base = prefix[s_node - 1] if s_node else 0
                segs.append((base + (cpm[s_node][c - 1] if c else 0), base + cpm[s_node][c]))
        heads = rewrite(nvl_head[f], segs)
        for c in range(C):
            def segment(s_node):
                base = prefix[s_node - 1] if s_node else 0
                return base + (cpm[s_node][c - 1] if c else 0), base + cpm[s_node][c]
            for s_node in range(N):
                offset = [sum(1 for sn in range(s_node) for r in range(*segment(sn)) if heads[r][j] >= 0)
                          for j in range(G)]
                begin, end = segment(s_node)
                src = s_node * G + l
                tokens = [t for t in range(*task_range(inp.in_rank[src].size(0), C, c))
                          if inp.in_rank[src][t, n * G:(n + 1) * G].any()]
                assert len(tokens) == end - begin
                for i in range(end - begin):
                    for j in range(G):
                        h = heads[begin + i][j]
                        if h >= 0 and j == l:
                            # combine_forward reads its own GPU's rows straight from x.
                            got = recv[f][side[f]["recv_gbl_cpm"][src][c] + h][:2]
                            assert got == (src, tokens[i]), (f, c, s_node, i, j, got, (src, tokens[i]))
                        elif h >= 0:
                            got = streams[(n * G + j, c, l)][offset[j] + h]
                            assert got == (src, tokens[i]), (f, c, s_node, i, j, got, (src, tokens[i]))
                            offset_check = inp.in_rank[src][tokens[i], n * G + j]
                            assert offset_check
                        else:
                            assert not inp.in_rank[src][tokens[i], n * G + j]
        nvl_head[f] = heads
    # combine_receive: token t's row from node n is that forwarder's row head of its segment.
    for s in range(R):
        segs = [task_range(inp.in_rank[s].size(0), C, c) for c in range(C)]
        rdma_head[s] = rewrite(rdma_head[s], segs)
    return rdma_head, nvl_head


@pytest.mark.parametrize("nodes, gpus, tokens, channels, routing, holes", [
    (2, 1, 37, 3, "random", False),
    (2, 2, 50, 4, "random", True),
    (3, 4, [23, 0, 5, 40, 1, 17, 9, 30, 2, 11, 0, 8], 2, "random", True),
    (4, 2, 31, 5, "skewed", False),
    (2, 8, 16, 1, "empty_node", True),
    (33, 1, 12, 2, "random", True),  # past the old cap of 16 nodes, and more nodes than lanes
])
def test_kernel_index_arithmetic_matches_the_oracle(nodes, gpus, tokens, channels, routing, holes):
    inp = Inputs(nodes, gpus, tokens, topk=4, routing=routing, seed=nodes * 10 + gpus, holes=holes)
    # x carries (source rank, token) so the oracle's rows name themselves.
    inp.x = [torch.stack([torch.full((m.size(0),), r, dtype=torch.int64), torch.arange(m.size(0))], 1)
             for r, m in enumerate(inp.in_rank)]
    refs = ir.internode_dispatch_all(inp.x, inp.in_rank, inp.per_expert, num_nvl_ranks=gpus, num_channels=channels)
    side = notify(inp, channels)
    rdma_head, nvl_head, recv = dispatch(inp, channels, side, random.Random(1))
    as_t = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    for me, ref in enumerate(refs):
        h, sd = ref.handle, side[me]
        assert torch.equal(as_t(sd["rdma_cpm"]), h[1]) and torch.equal(as_t(sd["gbl_cpm"]), h[2])
        assert torch.equal(as_t(sd["recv_rdma_cpm"]), h[3]) and torch.equal(as_t(sd["recv_rdma_prefix"]), h[4])
        assert torch.equal(as_t(sd["recv_gbl_cpm"]), h[5]) and torch.equal(as_t(sd["recv_gbl_prefix"]), h[6])
        assert torch.equal(as_t(rdma_head[me]).reshape(-1, nodes), h[8])
        assert torch.equal(as_t(nvl_head[me]).reshape(-1, gpus), h[9])
        assert sorted(recv[me]) == list(range(ref.num_recv)), "every receive row written once"
        rows = [recv[me][r] for r in range(ref.num_recv)]
        assert [list(rc[:2]) for rc in rows] == ref.recv_x.tolist()
        node, mask = ir.decode_source_meta(ref.handle[7])
        assert [(rc[0] // gpus, rc[2]) for rc in rows] == list(zip(node.tolist(), mask.tolist()))
    rdma_after, nvl_after = combine_rows(inp, channels, side, rdma_head, nvl_head, recv)
    for me, ref in enumerate(refs):
        after = ref.combined_handle(channels)
        assert torch.equal(as_t(rdma_after[me]).reshape(-1, nodes), after[8])
        assert torch.equal(as_t(nvl_after[me]).reshape(-1, gpus), after[9])
