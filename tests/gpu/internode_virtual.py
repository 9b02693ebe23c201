"""R = N x G virtual ranks of the internode normal-mode kernels on one GPU
(tests/gpu/internode_virtual_ranks.cu, driven by ctypes).

The internode kernels take every window pointer as a parameter (rank p's window at base + p *
stride), so R windows carved out of one allocation are, to them, R ranks in N nodes of G: the
NVLink leg between GPUs of a node and the scale-out leg (its LSA emulation, kRemoteEmulated) both
run on one GPU. Each step (dispatch notify, dispatch, combine) launches every rank's kernel on a
stream of its own, since the kernels of a step wait on each other; every rank's grid must be
co-resident, so the world takes R x 2C <= SMs (C channels per rank: C = 1 for 64 ranks on 132
SMs, up to 4 for 16). Outputs are torch tensors, one set per rank, to compare with
tests/gpu/internode_reference.py.

The library is built by scripts/test.sh (target/internode_virtual/libinternode_virtual_ranks.so)
or named by DEEPEP_INTERNODE_VIRTUAL_LIBRARY."""
import ctypes
import os

# More hardware queues than the default 8 for the per-rank streams (read when CUDA starts; the
# steps are issued rank by rank, so fewer queues still make progress, only with less overlap).
os.environ.setdefault('CUDA_DEVICE_MAX_CONNECTIONS', '32')
# Every kernel loaded at start: a kernel loaded lazily on its first launch can wait for the
# running kernels, which wait on it (a rank's first combine after its peers' notify).
os.environ.setdefault('CUDA_MODULE_LOADING', 'EAGER')

import torch  # noqa: E402

from ll_virtual import SkipCase  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_LIBRARY = os.path.join(ROOT, 'target', 'internode_virtual', 'libinternode_virtual_ranks.so')
STATE_PARTS = ('op_epoch', 'ticket', 'stall_lock', 'fault_lock', 'totals', 'stall', 'fault', 'counts', 'traffic',
               'bytes')
WAIT_OPS = {9: 'notify', 10: 'rdma tail', 11: 'rdma head', 12: 'nvl slot', 13: 'nvl consumed'}  # DeepepWaitOp


def library_path():
    return os.environ.get('DEEPEP_INTERNODE_VIRTUAL_LIBRARY', DEFAULT_LIBRARY)


def load_library(path=None):
    path = path or library_path()
    if not os.path.isfile(path):
        raise RuntimeError(f'{path} not found: build it with `bash scripts/test.sh` or set '
                           'DEEPEP_INTERNODE_VIRTUAL_LIBRARY')
    lib = ctypes.CDLL(path)
    lib.inv_num_args.restype = ctypes.c_int
    lib.inv_arg_name.restype = ctypes.c_char_p
    lib.inv_arg_name.argtypes = [ctypes.c_int]
    lib.inv_window_bytes.restype = ctypes.c_int64
    lib.inv_window_bytes.argtypes = [ctypes.c_void_p]
    lib.inv_limits.restype = None
    lib.inv_limits.argtypes = [ctypes.c_void_p]
    lib.inv_state_layout.restype = None
    lib.inv_state_layout.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.inv_stream_create.restype = ctypes.c_void_p
    lib.inv_stream_destroy.restype = None
    lib.inv_stream_destroy.argtypes = [ctypes.c_void_p]
    for fn in (lib.inv_dispatch_notify, lib.inv_dispatch, lib.inv_combine_notify, lib.inv_combine):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    return lib


def _int64s(fn, n, *args):
    out = (ctypes.c_int64 * n)()
    fn(*args, out)
    return list(out)


def _ptr(t):
    return 0 if t is None else t.data_ptr()


def _zeros(*shape):
    return torch.zeros(*shape, dtype=torch.int32, device='cuda')


def _filled(rows, cols, dtype):
    """[rows, cols] of dtype, every byte 0xff: a row the kernels should write and did not shows."""
    return torch.full((rows, cols * dtype.itemsize), -1, dtype=torch.int8, device='cuda').view(dtype)


def layout_of(topk, num_experts, num_ranks, node_size):
    """get_dispatch_layout in torch: is_token_in_rank [T, R] bool, num_tokens_per_rank [R],
    num_tokens_per_rdma_rank [N], num_tokens_per_expert [E] (int32; -1 ids skipped)."""
    t, valid = topk.size(0), topk >= 0
    rank_of = torch.where(valid, topk // (num_experts // num_ranks), torch.full_like(topk, num_ranks))
    in_rank = torch.zeros(t, num_ranks + 1, dtype=torch.bool, device=topk.device)
    in_rank.scatter_(1, rank_of.long(), True)
    in_rank = in_rank[:, :num_ranks].contiguous()
    per_node = in_rank.view(t, num_ranks // node_size, node_size).any(2)
    per_expert = torch.bincount(topk[valid].long(), minlength=num_experts)
    return in_rank, in_rank.sum(0).int(), per_node.sum(0).int(), per_expert.int()


class InternodeWorld:
    """num_nodes x node_size virtual ranks on the current GPU, C = num_channels per rank (default:
    the most, up to 4, that keep every rank's grid co-resident)."""

    def __init__(self, num_nodes, node_size, hidden, num_experts, max_topk=8, num_channels=None,
                 rdma_ring_tokens=32, nvl_ring_tokens=32, timeout_s=10.0, library=None):
        self.lib = load_library(library)
        self.names = [self.lib.inv_arg_name(i).decode() for i in range(self.lib.inv_num_args())]
        self.index = {n: i for i, n in enumerate(self.names)}
        r = num_nodes * node_size
        max_nodes, max_node_size, max_channels, max_local = _int64s(self.lib.inv_limits, 4)
        assert num_nodes <= max_nodes and node_size <= max_node_size, (num_nodes, node_size)
        assert num_experts % r == 0 and num_experts // r <= max_local, num_experts
        sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        num_channels = num_channels or max(1, min(4, sms // (2 * r)))
        if r * 2 * num_channels > sms or num_channels > max_channels:
            raise SkipCase(f'{r} ranks x {2 * num_channels} blocks do not fit co-resident on {sms} SMs: the '
                             'kernels of a step wait on each other (at most SMs / 2 ranks, with 1 channel)')
        self.num_ranks, self.num_nodes, self.node_size = r, num_nodes, node_size
        self.hidden, self.num_experts, self.num_channels = hidden, num_experts, num_channels
        self.base = dict(num_ranks=r, node_size=node_size, hidden=hidden, max_topk=max_topk,
                         num_channels=num_channels, rdma_ring_tokens=rdma_ring_tokens,
                         nvl_ring_tokens=nvl_ring_tokens, timeout_ns=int(timeout_s * 1e9))
        self.stride = (self.lib.inv_window_bytes(self._vector(self.base)) + (1 << 20) - 1) >> 20 << 20
        self.window = torch.zeros(r * self.stride, dtype=torch.uint8, device='cuda')
        layout = _int64s(self.lib.inv_state_layout, len(STATE_PARTS), self._vector(self.base))
        self.at = dict(zip(STATE_PARTS, layout))
        self.state = torch.zeros(r * self.at['bytes'], dtype=torch.uint8, device='cuda')
        self.base.update(world_base=self.window.data_ptr(), world_stride=self.stride,
                         state_base=self.state.data_ptr())
        # A CUDA stream per rank from the library (torch's pool repeats after 32 streams).
        self._raw_streams = [self.lib.inv_stream_create() for _ in range(r)]
        if not all(self._raw_streams):
            raise RuntimeError(f'cudaStreamCreate failed for one of {r} virtual ranks')
        self.streams = [torch.cuda.ExternalStream(s) for s in self._raw_streams]

    def __del__(self):
        if getattr(self, '_raw_streams', None):
            torch.cuda.synchronize()
            for s in self._raw_streams:
                self.lib.inv_stream_destroy(s)

    def _vector(self, fields):
        unknown = set(fields) - set(self.index)
        assert not unknown, f'unknown inv arguments {unknown}'
        vec = (ctypes.c_int64 * len(self.names))()
        for name, value in fields.items():
            vec[self.index[name]] = int(value)
        return vec

    def _step(self, fn, fields):
        """Every rank's kernel(s) of one step, each on its own stream (fields[r]: rank r's call),
        then a wait for all of them and a check of every rank's stall and fault records."""
        current = torch.cuda.current_stream()
        for rank, f in enumerate(fields):
            stream = self.streams[rank]
            stream.wait_stream(current)
            rc = fn(self._vector({**self.base, **f, 'rank': rank}), ctypes.c_void_p(stream.cuda_stream))
            if rc != 0:
                raise RuntimeError(f'{fn.__name__} of rank {rank} returned cudaError {rc}')
        for stream in self.streams:
            current.wait_stream(stream)
        torch.cuda.synchronize()
        self.check_records()

    # ------------------------------------------------------------ per-rank state
    def rank_state(self, rank, part, nbytes):
        start = rank * self.at['bytes'] + self.at[part]
        return self.state[start:start + nbytes]

    def check_records(self):
        """Raises naming every rank whose stall or fault record is set."""
        problems = []
        for r in range(self.num_ranks):
            stall = self.rank_state(r, 'stall', 40).cpu()
            w = stall[:24].view(torch.int32).tolist()
            if w[0]:
                e, s = stall[24:40].view(torch.int64).tolist()
                problems.append(f'rank {r} stalled waiting on rank {w[2]} ({WAIT_OPS.get(w[3], w[3])}, channel or '
                                f'source {w[4]}: expected {e}, saw {s})')
            fault = self.rank_state(r, 'fault', 32).cpu()
            if fault[:4].view(torch.int32).item():
                code = fault[4:8].view(torch.int32).item()
                problems.append(f'rank {r} fault {code} {fault[8:32].view(torch.int64).tolist()}')
        if problems:  # the world is out of step: only a fresh one is usable
            raise RuntimeError('; '.join(problems[:8]) + (f' (+{len(problems) - 8} more)' if len(problems) > 8 else ''))

    def counts(self, rank, local_experts):
        """(num_recv_tokens, num_rdma_recv_tokens, per-expert list) of rank's last notify."""
        words = self.rank_state(rank, 'counts', 8 + 4 * local_experts).view(torch.int32).tolist()
        return words[0], words[1], words[2:]

    def traffic(self, rank):
        """Rank's traffic counters (enum DeepepTrafficKind, cumulative; as
        Buffer.internode_query_traffic_buffer): dispatch scale-out rows, bytes, NVLink rows,
        bytes, then the same four of combine."""
        return self.rank_state(rank, 'traffic', 64).view(torch.int64).tolist()

    # ------------------------------------------------------------ dispatch
    def dispatch(self, xs, topks=None, weights=None, handles=None, expert_alignment=1, num_worst_tokens=0):
        """Every rank's internode dispatch. xs[r]: [T_r, H] BF16, or (FP8 [T_r, H], float32 scales
        [T_r, S] any strides); topks[r] / weights[r]: [T_r, K] int64 or int32 / float32 (non-cached);
        handles: the handles of an earlier dispatch (cached: rows only). Returns per rank a dict:
        recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, per_expert (list), handle (DeepEP's
        10-tuple), num_recv, num_rdma_recv."""
        r_, n_, c_ = self.num_ranks, self.num_nodes, self.num_channels
        cached = handles is not None
        calls = []
        for r in range(r_):
            x, scales = xs[r] if isinstance(xs[r], tuple) else (xs[r], None)
            t = x.size(0)
            f = dict(num_tokens=t, hidden_bytes=x.size(1) * x.element_size(), cached=int(cached),
                     num_worst_tokens=num_worst_tokens, expert_alignment=expert_alignment,
                     x=_ptr(x), x_scales=_ptr(scales), num_scales=0 if scales is None else scales.size(1),
                     scale_stride_token=0 if scales is None else scales.stride(0),
                     scale_stride_scale=0 if scales is None else scales.stride(1))
            call = dict(x=x, scales=scales, fields=f)
            if cached:
                h = handles[r]
                # The handle's prefix sums, as DeepEP passes them (notify checks them).
                call['handle'] = [h[0], h[1], h[2], _zeros(n_, c_), h[4].clone(), _zeros(r_, c_), h[6].clone()]
            else:
                topk, w = topks[r], weights[r]
                assert topk.size(1) <= self.base['max_topk'], 'the windows are sized for max_topk columns'
                in_rank, per_rank, per_node, per_expert = layout_of(topk, self.num_experts, r_, self.node_size)
                call['handle'] = [in_rank, _zeros(n_, c_), _zeros(r_, c_), _zeros(n_, c_), _zeros(n_), _zeros(r_, c_),
                                  _zeros(r_), _zeros(t, n_)]
                call.update(topk=topk, weights=w, keep=(per_rank, per_node, per_expert))
                f.update(num_topk=topk.size(1), topk_idx_is_int32=int(topk.dtype == torch.int32),
                         num_experts=self.num_experts, topk_idx=_ptr(topk), topk_weights=_ptr(w),
                         num_tokens_per_rank=_ptr(per_rank), num_tokens_per_rdma_rank=_ptr(per_node),
                         num_tokens_per_expert=_ptr(per_expert), send_rdma_head=_ptr(call['handle'][7]))
                self.rank_state(r, 'counts', 4).view(torch.int32).fill_(-1)
            h = call['handle']
            f.update(is_token_in_rank=_ptr(h[0]), rdma_channel_prefix_matrix=_ptr(h[1]),
                     gbl_channel_prefix_matrix=_ptr(h[2]), recv_rdma_channel_prefix_matrix=_ptr(h[3]),
                     recv_rdma_rank_prefix_sum=_ptr(h[4]), recv_gbl_channel_prefix_matrix=_ptr(h[5]),
                     recv_gbl_rank_prefix_sum=_ptr(h[6]))
            calls.append(call)
        self._step(self.lib.inv_dispatch_notify, [c['fields'] for c in calls])

        local = self.num_experts // r_
        out = []
        for r, call in enumerate(calls):
            f, h = call['fields'], call['handle']
            per_expert = []
            if cached:  # the handle's counts (no send_nvl_head written)
                num_recv, num_rdma = int(handles[r][6][-1]), int(handles[r][4][-1])
                rows = (num_recv, 0)
            elif num_worst_tokens > 0:
                num_recv, num_rdma = int(h[6][-1]), int(h[4][-1])
                rows = (num_worst_tokens, num_worst_tokens)
            else:
                num_recv, num_rdma, per_expert = self.counts(r, local)
                assert num_recv >= 0, f'rank {r}: notify wrote no receive count'
                rows = (num_recv, num_rdma)
            x, scales = call['x'], call['scales']
            recv = dict(recv_x=_filled(rows[0], x.size(1), x.dtype),
                        recv_x_scales=None if scales is None else _filled(rows[0], scales.size(1), scales.dtype))
            if not cached:
                k = call['topk'].size(1)
                recv.update(recv_topk_idx=_filled(rows[0], k, call['topk'].dtype),
                            recv_topk_weights=_filled(rows[0], k, torch.float32),
                            recv_src_meta=_filled(rows[0], 8, torch.uint8),
                            send_nvl_head=_filled(rows[1], self.node_size, torch.int32))
            f.update(num_recv_rows=rows[0], num_rdma_recv_rows=rows[1], **{name: _ptr(t) for name, t in recv.items()})
            handle = None
            if not cached:
                handle = tuple(h[:7]) + (recv['recv_src_meta'], h[7], recv['send_nvl_head'])
            out.append(dict(recv_x=recv['recv_x'], recv_x_scales=recv['recv_x_scales'],
                            recv_topk_idx=recv.get('recv_topk_idx'), recv_topk_weights=recv.get('recv_topk_weights'),
                            per_expert=per_expert, handle=handle, num_recv=num_recv, num_rdma_recv=num_rdma))
        self._step(self.lib.inv_dispatch, [c['fields'] for c in calls])
        return out

    # ------------------------------------------------------------ combine
    def combine(self, xs, handles, weights=None, biases=None):
        """Every rank's internode combine: xs[r] [Nr, H] BF16 (the rows rank r received, in its
        receive order), handles[r] its dispatch's handle (the two heads are rewritten in place, as
        DeepEP does), weights[r] [Nr, K] float32 or None, biases[r] None or (bias_0, bias_1) of
        [T_r, H] BF16 (either may be None). Returns per rank (combined_x, combined_topk_weights)."""
        calls, out = [], []
        for r in range(self.num_ranks):
            h, x = handles[r], xs[r]
            w = None if weights is None else weights[r]
            b0, b1 = (None, None) if biases is None or biases[r] is None else biases[r]
            t = h[0].size(0)
            combined = torch.empty(t, self.hidden, dtype=torch.bfloat16, device='cuda')
            combined_w = None if w is None else torch.empty(t, w.size(1), dtype=torch.float32, device='cuda')
            out.append((combined, combined_w))
            calls.append(dict(num_tokens=t, num_topk=0 if w is None else w.size(1), x=_ptr(x), topk_weights=_ptr(w),
                              bias_0=_ptr(b0), bias_1=_ptr(b1), recv_rdma_channel_prefix_matrix=_ptr(h[3]),
                              recv_rdma_rank_prefix_sum=_ptr(h[4]), recv_gbl_channel_prefix_matrix=_ptr(h[5]),
                              recv_src_meta=_ptr(h[7]), send_rdma_head=_ptr(h[8]), send_nvl_head=_ptr(h[9]), combined_x=_ptr(combined),
                              combined_topk_weights=_ptr(combined_w), num_recv_rows=x.size(0),
                              num_rdma_recv_rows=h[9].size(0)))
        self._step(self.lib.inv_combine_notify, calls)
        self._step(self.lib.inv_combine, calls)
        return out
