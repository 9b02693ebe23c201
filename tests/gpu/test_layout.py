"""get_dispatch_layout on 1, 2 and 4 GPUs against an independent torch reference:
random and adversarial routing, every stream/event option, repeated launches,
CUDA-graph replay and argument errors. get_dispatch_layout is rank-local, so one
Buffer per world serves every case."""
import sys

import torch

import deep_ep
from common import assert_layout, expect_raises, finish, make_buffer, random_topk, skip, spawn

T, E, K = 4096, 256, 8
SPIN_CYCLES = 20_000_000  # ~10 ms of GPU time: long enough for the host to enqueue the layout call behind it


def worker(rank, world, group, rep):
    epr = E // world

    def skewed(num_tokens=T):
        # All tokens go to the last rank's experts: every other rank is empty.
        local = torch.rand(num_tokens, epr, device='cuda').argsort(1)[:, :K]
        return (local + (world - 1) * epr).to(deep_ep.topk_idx_t)

    def minus_one_heavy(num_tokens=T):
        t = random_topk(num_tokens, E, K)
        t[torch.rand(t.shape, device='cuda') < 0.9] = -1
        t[:64] = -1  # fully unrouted rows, at the start and at the end
        t[-7:] = -1
        return t

    def duplicates(num_tokens=T):
        t = torch.randint(0, E, (num_tokens, K), device='cuda', dtype=deep_ep.topk_idx_t)
        t[:, 1] = t[:, 0]
        t[::3] = t[::3, :1]  # every third row picks one expert K times
        return t

    with make_buffer(group, num_nvl_bytes=64 << 20) as buf:
        def layout(topk, num_experts=E):
            assert_layout(buf.get_dispatch_layout(topk, num_experts), topk, num_experts, world)

        def empty_tokens():
            topk = torch.empty(0, K, dtype=deep_ep.topk_idx_t, device='cuda')
            out = buf.get_dispatch_layout(topk, E)
            assert_layout(out, topk, E, world)
            assert out[0].count_nonzero() == 0 and out[2].count_nonzero() == 0, 'counts must be zero for T=0'
            assert out[3].shape == (0, world)

        def one_expert_per_rank():
            # E = num_ranks: expert id == rank id; duplicates and -1 slots mixed in.
            layout(torch.randint(-1, world, (T, K), device='cuda', dtype=deep_ep.topk_idx_t), world)

        def int64_topk():
            assert deep_ep.topk_idx_t == torch.int64, f'deep_ep.topk_idx_t is {deep_ep.topk_idx_t}'
            layout(random_topk(T, E, K).to(torch.int64))

        def async_finish():
            topk = random_topk(T, E, K)
            out = buf.get_dispatch_layout(topk, E, async_finish=True)
            assert out[4].event is not None, 'async_finish=True must return an event'
            out[4].current_stream_wait()
            assert_layout(out, topk, E, world, is_async=True)

        def waits_for_compute_stream():
            # The comm stream must wait on the current stream: if it did not, the
            # kernel would read topk before the delayed copy lands.
            topk, new = random_topk(T, E, K), skewed()
            torch.cuda._sleep(SPIN_CYCLES)
            topk.copy_(new)
            layout(topk)

        def previous_event_on_comm_stream():
            topk, new = random_topk(T, E, K), skewed()
            torch.cuda._sleep(SPIN_CYCLES)
            topk.copy_(new)
            prev = deep_ep.Buffer.capture()
            out = buf.get_dispatch_layout(topk, E, previous_event=prev, async_finish=True,
                                          allocate_on_comm_stream=True)
            out[4].current_stream_wait()
            assert_layout(out, new, E, world, is_async=True)

        def comm_stream_alloc_needs_event_and_async():
            topk = random_topk(T, E, K)
            for kwargs in (dict(async_finish=True), dict(previous_event=deep_ep.Buffer.capture())):
                expect_raises(f'allocate_on_comm_stream=True with {sorted(kwargs)} only',
                              (RuntimeError, AssertionError),
                              lambda: buf.get_dispatch_layout(topk, E, allocate_on_comm_stream=True, **kwargs))

        def repeated_launches():
            # 100 back-to-back async launches alternating two routings: catches
            # workspace or ticket state leaking from one call into the next.
            inputs = (random_topk(T, E, K), skewed())
            outs = [buf.get_dispatch_layout(inputs[i % 2], E, async_finish=True) for i in range(100)]
            for i, out in enumerate(outs):
                out[4].current_stream_wait()
                assert_layout(out, inputs[i % 2], E, world, is_async=True)

        def cuda_graph():
            static = random_topk(T, E, K)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm up outside capture, as torch recommends
                buf.get_dispatch_layout(static, E)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = buf.get_dispatch_layout(static, E)
            for topk in (random_topk(T, E, K), minus_one_heavy(), skewed()):
                static.copy_(topk)
                graph.replay()
                torch.cuda.synchronize()
                assert_layout(out, topk, E, world)

        def bad_inputs():
            good = random_topk(64, E, K)
            cases = (('float32 topk_idx', good.float(), E, 'topk_idx'),
                     ('1-D topk_idx', good.flatten(), E, 'topk_idx'),
                     ('non-contiguous topk_idx', good.t().contiguous().t(), E, 'topk_idx'),
                     ('CPU topk_idx', good.cpu(), E, 'topk_idx'),
                     ('num_experts == 0', good, 0, 'num_experts'),
                     ('num_experts < 0', good, -E, 'num_experts'))
            if world > 1:  # every count divides by one rank
                cases += (('num_experts % num_ranks != 0', good, E + 1, 'num_experts'),)
            for what, topk, num_experts, word in cases:
                expect_raises(what, RuntimeError, lambda: buf.get_dispatch_layout(topk, num_experts), word)
            layout(good)  # the buffer is still usable after rejected calls

        cases = {
            'random': lambda: layout(random_topk(T, E, K)),
            'skewed_one_rank': lambda: layout(skewed()),
            'minus_one_heavy': lambda: layout(minus_one_heavy()),
            'all_minus_one': lambda: layout(torch.full((T, K), -1, device='cuda', dtype=deep_ep.topk_idx_t)),
            'duplicates_in_row': lambda: layout(duplicates()),
            'tokens_1': lambda: layout(random_topk(1, E, K)),
            'tokens_0': empty_tokens,
            'tokens_1000': lambda: layout(random_topk(1000, E, K)),
            'tokens_32768': lambda: layout(random_topk(32768, E, K)),
            'topk_1': lambda: layout(random_topk(T, E, 1)),
            'topk_16': lambda: layout(random_topk(T, E, 16)),
            'one_expert_per_rank': one_expert_per_rank,
            'int64_topk': int64_topk,
            'async_finish': async_finish,
            'waits_for_compute_stream': waits_for_compute_stream,
            'previous_event_allocate_on_comm_stream': previous_event_on_comm_stream,
            'allocate_on_comm_stream_requires_event_and_async': comm_stream_alloc_needs_event_and_async,
            'repeated_100_launches': repeated_launches,
            'cuda_graph_replay': cuda_graph,
            'bad_inputs': bad_inputs,
        }
        for name, fn in cases.items():
            rep.run(name, fn)


if __name__ == '__main__':
    num_gpus = torch.cuda.device_count()
    if num_gpus < 1:
        print('test_layout needs a GPU')
        sys.exit(1)
    for world in (1, 2, 4):
        if world > num_gpus:
            skip(f'w{world}', f'only {num_gpus} GPUs visible')
            continue
        spawn(worker, world, timeout=120)
    finish()
