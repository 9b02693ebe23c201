"""CPU check of test_normal_shrink.py's survivor references (no GPU: 2 gloo processes, any torch).

alone_ref (a peer absent at notify) must equal normal_reference's dispatch when that peer routes
nothing (send_head aside: the kernel writes -1 for a masked destination), alone_combine must put
each own row back at its token, and emptied_ref must empty exactly the peer's rows. Run it after
changing those references: `PYTHONPATH=compat/python python tests/gpu/check_shrink_references.py`
(with DEEPEP_NCCL_LIBRARY and NCCL on LD_LIBRARY_PATH, as deep_ep needs at import)."""
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def inputs(tokens, hidden, num_experts, empty=False, keep=None):
    """keep: a rank whose experts alone take the first quarter of the tokens (then each rank
    sends itself and its peer different counts, as the GPU run's inputs may: a reference that
    takes rank_prefix_matrix's column of the wrong rank shows)."""
    scores = torch.randn(tokens, num_experts, dtype=torch.float32).abs() + 1
    if keep is not None:
        per_rank = num_experts // 2
        scores[:tokens // 4] = 0
        scores[:tokens // 4, keep * per_rank:(keep + 1) * per_rank] = 1
    topk = torch.topk(scores, 8, dim=-1, sorted=False).indices
    topk[torch.rand(tokens, 8) < 0.1] = -1
    if empty:
        topk.fill_(-1)
    from common import ref_layout
    per_rank, _, per_expert, in_rank = ref_layout(topk, num_experts, 2)
    return SimpleNamespace(x=torch.randn(tokens, hidden, dtype=torch.bfloat16), topk=topk,
                           weights=torch.randn(tokens, 8, dtype=torch.float32), per_rank=per_rank,
                           per_expert=per_expert, in_rank=in_rank, tokens=tokens, hidden=hidden)


def run(rank, port):
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    dist.init_process_group('gloo', rank=rank, world_size=2)
    torch.set_default_dtype(torch.bfloat16)
    torch.manual_seed(rank + 7)
    import deep_ep
    import test_normal_shrink as t
    from normal_reference import ref_dispatch
    from test_normal import E, check_dispatch

    group, channels = dist.group.WORLD, 10
    for keep in (None, rank, 1 - rank):
        check(rank, group, channels, inputs(t.TOKENS, t.HIDDEN, E, keep=keep), t, ref_dispatch, E, check_dispatch,
              deep_ep)
    dist.barrier()


def check(rank, group, channels, inp, t, ref_dispatch, E, check_dispatch, deep_ep):
    ref = ref_dispatch(group, inp.x, inp.in_rank, inp.per_expert, inp.topk, inp.weights, num_channels=channels)
    for me in (0, 1):
        other = 1 - me
        sent = inputs(t.TOKENS, t.HIDDEN, E, empty=True) if rank == other else inp
        absent = ref_dispatch(group, inp.x, sent.in_rank, sent.per_expert, sent.topk, sent.weights,
                              num_channels=channels)
        if rank != me:
            continue
        send_head = absent.handle[5].clone()
        send_head[:, other] = -1
        out = (absent.recv_x, absent.recv_topk_idx, absent.recv_topk_weights, absent.num_recv_tokens_per_expert_list,
               absent.handle[:5] + (send_head,), deep_ep.EventOverlap(None))
        alone = t.alone_ref(ref, inp, me, other)
        check_dispatch(out, alone, inp.in_rank)
        y = torch.randn(alone.num_recv, t.HIDDEN, dtype=torch.bfloat16)
        x, _ = t.alone_combine(ref, inp, me, y, alone.recv_topk_weights)
        mine = inp.in_rank[:, me]
        assert torch.equal(x[mine.nonzero().squeeze(1)], y) and bool((x[~mine] == 0).all()), 'alone_combine'
        # emptied_ref: every row that is not one of me's own is other's, and is empty; me's own rows
        # are those of the reference with other absent (independent of rank_prefix_matrix's columns).
        emptied = t.emptied_ref(ref, me, other)
        lo, hi = t.own_rows(ref, me)
        mine = torch.zeros(ref.num_recv, dtype=torch.bool)
        mine[lo:hi] = True
        assert torch.equal(emptied.recv_x[mine], alone.recv_x) and torch.equal(emptied.handle[3][mine], alone.handle[3])
        assert bool((emptied.recv_topk_idx[~mine] == -1).all()) and bool((emptied.handle[3][~mine] == -1).all())
        assert bool((emptied.recv_x[~mine] == 0).all()) and bool((emptied.recv_topk_weights[~mine] == 0).all()), \
            'emptied_ref'
        assert t.rows_from(ref, other, me) == ((hi, ref.num_recv) if me == 0 else (0, lo)), 'rows_from'
        sent_self, sent_other = (int(inp.in_rank[:, r].sum()) for r in (me, other))
        print(f'rank {rank}: the references with rank {other} absent or emptied agree (sends {sent_self} to '
              f'itself, {sent_other} to rank {other})', flush=True)


if __name__ == '__main__':
    from common import free_port
    mp.spawn(run, args=(free_port(),), nprocs=2)
