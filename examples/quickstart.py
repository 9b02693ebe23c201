"""deepep-nccl quickstart: one process per visible GPU creates a deep_ep.Buffer
exactly as DeepEP users do, computes the dispatch layout of a random MoE routing
(4096 tokens, ~256 experts, top-8) and checks it against plain torch.

`--preflight` only checks for torch with CUDA and a GPU (one line and exit 1 without them).

Run from the repo root:
  PYTHONPATH=compat/python DEEPEP_NCCL_LIBRARY=target/release/libdeepep_nccl.so python examples/quickstart.py
"""
import importlib
import os
import socket
import sys

NUM_TOKENS, HIDDEN, NUM_TOPK = 4096, 7168, 8


def worker(rank, world, port):
    import torch
    import torch.distributed as dist
    import deep_ep
    from deep_ep import Buffer

    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group('nccl', rank=rank, world_size=world, device_id=torch.device('cuda', rank))
    group = dist.group.WORLD

    # Size the buffer the way Megatron-LM and SGLang do: the largest hint of the
    # tuned dispatch/combine configs for BF16 rows (DeepEP tunes 2, 4 and 8 ranks).
    hidden_bytes = HIDDEN * 2
    configs = ((Buffer.get_dispatch_config(world), Buffer.get_combine_config(world)) if world in (2, 4, 8)
               else (deep_ep.Config(Buffer.num_sms, 6, 256),))
    num_nvl_bytes = max(c.get_nvl_buffer_size_hint(hidden_bytes, world) for c in configs)
    buffer = Buffer(group, num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=0, explicitly_destroy=True)

    # Random routing: experts must split evenly over ranks, so round 256 up to a multiple of world.
    num_experts = -(-256 // world) * world
    scores = torch.randn(NUM_TOKENS, num_experts, device='cuda').abs() + 1
    topk_idx = torch.topk(scores, NUM_TOPK, dim=-1).indices.to(deep_ep.topk_idx_t)
    num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = \
        buffer.get_dispatch_layout(topk_idx, num_experts)

    # Reference: a token goes to a rank if any of its experts lives there.
    ref_in_rank = torch.zeros(NUM_TOKENS, world, dtype=torch.bool, device='cuda')
    ref_in_rank.scatter_(1, topk_idx // (num_experts // world), True)
    ok = (torch.equal(is_token_in_rank, ref_in_rank)
          and torch.equal(num_tokens_per_rank, ref_in_rank.sum(0, dtype=torch.int32))
          and torch.equal(num_tokens_per_expert, torch.bincount(topk_idx.flatten(), minlength=num_experts).int()))
    print(f'rank {rank}: {NUM_TOKENS} tokens -> tokens sent to each rank {num_tokens_per_rank.tolist()}, '
          f'{num_tokens_per_expert.sum().item()} expert slots; layout {"matches" if ok else "DIFFERS FROM"} torch',
          flush=True)

    buffer.destroy()  # collective: every rank calls it
    all_ok = torch.tensor(int(ok), device='cuda')
    dist.all_reduce(all_ok, op=dist.ReduceOp.MIN)
    dist.destroy_process_group()
    if not all_ok.item():
        raise SystemExit(1)
    if rank == 0:
        print(f'quickstart OK ({world} GPU{"s" if world > 1 else ""}, {num_experts} experts, '
              f'{num_nvl_bytes / 2**20:.0f} MiB NVL buffer per rank)', flush=True)


def main():
    try:
        import torch
        import torch.multiprocessing as mp
    except ImportError:
        print('PyTorch with CUDA is required to run the quickstart: install a CUDA build of torch '
              '(https://pytorch.org/get-started/locally/) and retry.')
        sys.exit(1)
    num_gpus = torch.cuda.device_count()
    if num_gpus == 0:
        cpu_only = f'; torch {torch.__version__} is a CPU-only build' if torch.version.cuda is None else ''
        print('No CUDA GPU visible: deepep-nccl needs at least one NVIDIA GPU '
              f'(check nvidia-smi and CUDA_VISIBLE_DEVICES{cpu_only}).')
        sys.exit(1)
    if '--preflight' in sys.argv[1:]:  # scripts/quickstart.sh: torch and a GPU, checked before the build
        return
    try:
        importlib.import_module('deep_ep')  # fail here, with a hint, rather than in every worker
    except Exception as e:
        print(f'Cannot import deep_ep ({type(e).__name__}: {e}). Run from the repo root with '
              'PYTHONPATH=compat/python DEEPEP_NCCL_LIBRARY=target/release/libdeepep_nccl.so')
        sys.exit(1)

    world = min(num_gpus, 8)  # one NVLink domain; more ranks would need the internode transport
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(worker, args=(world, port), nprocs=world)
    except Exception as e:
        print(f'quickstart FAILED: {e}')
        sys.exit(1)


if __name__ == '__main__':
    main()
