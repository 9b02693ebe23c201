"""The CPU side of tests/gpu/test_internode_virtual_ranks.py (which needs a GPU): the driver's
get_dispatch_layout stand-in (internode_virtual.layout_of) against a per-token walk, the routings'
promises, and every case's inputs accepted by the oracle (token lists of R entries, num_worst_tokens
large enough, the heads' rewrite). Needs torch (CPU is enough); skipped where it is missing."""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
import internode_reference as ir  # noqa: E402
import test_internode_virtual_ranks as t  # noqa: E402
from internode_virtual import layout_of  # noqa: E402

CASES = t.cases()


def world_of(kw):
    n, g = kw["num_nodes"], kw["node_size"]
    return SimpleNamespace(num_nodes=n, node_size=g, num_ranks=n * g, num_experts=kw["num_experts"],
                           hidden=kw["hidden"], num_channels=kw.get("num_channels", 4))


@pytest.mark.parametrize("name", sorted(CASES))
def test_case_inputs_layout_and_oracle(name):
    kw, trip = CASES[name]
    w = world_of(kw)
    routing = trip.get("routing", "random")
    xs, topks, weights = t.make_inputs(w, trip["seed"], trip["tokens"], trip.get("num_topk", 8), routing,
                                       trip.get("fp8", False), trip.get("topk_int32", False), device="cpu")
    assert len(xs) == w.num_ranks
    per_rank_experts = w.num_experts // w.num_ranks
    layouts = []
    for topk in topks:
        in_rank, per_rank, per_node, per_expert = layout_of(topk, w.num_experts, w.num_ranks, w.node_size)
        want = torch.zeros(topk.size(0), w.num_ranks, dtype=torch.bool)
        for i, row in enumerate(topk.tolist()):
            for e in row:
                if e >= 0:
                    want[i, e // per_rank_experts] = True
        assert torch.equal(in_rank, want)
        assert per_rank.tolist() == want.sum(0).tolist()
        assert per_node.tolist() == want.view(-1, w.num_nodes, w.node_size).any(2).sum(0).tolist()
        assert per_expert.tolist() == torch.bincount(topk[topk >= 0].long(), minlength=w.num_experts).tolist()
        if routing == "skewed":  # the last rank's experts only
            assert bool(((topk < 0) | (topk >= w.num_experts - per_rank_experts)).all())
        if routing == "empty_node":  # never node 1
            assert not bool(in_rank[:, w.node_size:2 * w.node_size].any())
        layouts.append((in_rank, per_expert))
    refs = ir.internode_dispatch_all(xs, [lay[0] for lay in layouts], [lay[1] for lay in layouts], topks, weights,
                                     num_nvl_ranks=w.node_size, num_channels=w.num_channels,
                                     expert_alignment=trip.get("expert_alignment", 1),
                                     num_worst_tokens=trip.get("num_worst_tokens", 0))
    for ref in refs:
        ref.combined_handle(w.num_channels)
    ys = [torch.randn(ref.num_recv, w.hidden).to(torch.bfloat16) for ref in refs]
    ws = [ref.recv_topk_weights[:ref.num_recv] for ref in refs]
    out = ir.internode_combine_all([lay[0] for lay in layouts], ys, ws, num_nvl_ranks=w.node_size)
    assert [o[0].shape[0] for o in out] == [x.shape[0] if not isinstance(x, tuple) else x[0].shape[0] for x in xs]
