"""How long the first deep_ep.Buffer takes on a fresh box (issue 23: under 3 s, no compiler run),
with deep_ep from the installed wheel: the wall time of `import deep_ep`, of the first Buffer
(1 GPU, torch.distributed with world size 1) and of its first op (get_dispatch_layout, synchronized),
and which host path the ops took (the wheel's prebuilt compiled module, a build, or ctypes).

It installs nothing. The compiled host path's cache points at an empty temporary directory, as on a
fresh box, so only the wheel's prebuilt module can avoid a build (and a build happens only where
asked: DEEPEP_NCCL_FAST=build). Exit status 0 when the prebuilt module was used and the three steps
took under 3 s together.

Run (outside the repository, so that the installed deep_ep is imported):
  cd /tmp && python /path/to/bench/first_buffer_time.py
"""
import json
import os
import sys
import tempfile
import time
import warnings

BUDGET_S = 3.0


def main():
    os.environ["DEEPEP_NCCL_FAST_CACHE"] = tempfile.mkdtemp(prefix="deepep-fast-cache-")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    t0 = time.perf_counter()
    import torch
    import torch.distributed as dist
    t_torch = time.perf_counter() - t0

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    group = dist.group.WORLD

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t1 = time.perf_counter()
        import deep_ep
        from deep_ep_cpp import _fast
        t_import = time.perf_counter() - t1

        t2 = time.perf_counter()
        config = deep_ep.Config(deep_ep.Buffer.num_sms, 6, 256)
        buffer = deep_ep.Buffer(group, num_nvl_bytes=config.get_nvl_buffer_size_hint(7168 * 2, 1),
                                num_rdma_bytes=0, explicitly_destroy=True)
        torch.cuda.synchronize()
        t_buffer = time.perf_counter() - t2

        num_experts = 256
        topk_idx = torch.topk(torch.rand(4096, num_experts, device="cuda"), 8, dim=-1).indices.to(deep_ep.topk_idx_t)
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        num_tokens_per_rank, _, _, _, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        torch.cuda.synchronize()
        t_op = time.perf_counter() - t3
    assert num_tokens_per_rank.tolist() == [4096]

    choice = _fast.describe()
    prebuilt = choice.startswith("compiled host path: prebuilt")
    total = t_import + t_buffer + t_op
    result = {
        "deep_ep": os.path.dirname(deep_ep.__file__),
        "deep_ep_version": deep_ep.__version__,
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
        "gpu": torch.cuda.get_device_name(0),
        "torch_import_s": round(t_torch, 3),
        "deep_ep_import_s": round(t_import, 3), "first_buffer_s": round(t_buffer, 3),
        "first_op_s": round(t_op, 5), "import_buffer_op_s": round(total, 3),
        "host_path": choice, "prebuilt_used": prebuilt,
        "warnings": [str(w.message) for w in caught if "deepep" in str(w.message).lower()],
    }
    buffer.destroy()
    dist.destroy_process_group()
    print(json.dumps(result, indent=1))
    ok = prebuilt and total < BUDGET_S
    print(f"{'PASS' if ok else 'FAIL'}: import deep_ep + first Buffer + first op took {total:.2f} s "
          f"(budget {BUDGET_S:.0f} s); host path: {choice}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
