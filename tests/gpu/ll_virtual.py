"""R virtual ranks of the LL kernels on one GPU (tests/gpu/ll_virtual_ranks.cu, driven by ctypes).

The LL kernels take every window pointer as a parameter (rank p's window at base + p * stride),
so R windows carved out of one allocation are, to them, R ranks of one LSA team. A call here
launches every rank's send, then every rank's receive, on the current stream: the multi-source
protocol (count messages, signals, per-source prefixes, the emulated remote path) runs on a
machine with one GPU, and each receive kernel reads only its own window, as on real hardware.
Outputs are torch tensors, one set per rank, to compare with tests/gpu/ll_reference.py.

The library is built by scripts/test.sh (target/ll_virtual/libll_virtual_ranks.so) or named by
DEEPEP_LL_VIRTUAL_LIBRARY."""
import argparse
import ctypes
import os
import re
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_LIBRARY = os.path.join(ROOT, 'target', 'll_virtual', 'libll_virtual_ranks.so')
PHASE_SEND, PHASE_RECV = 1, 2
REMOTE_NONE, REMOTE_EMULATED = 0, 1


def load_library(path=None):
    path = path or os.environ.get('DEEPEP_LL_VIRTUAL_LIBRARY', DEFAULT_LIBRARY)
    if not os.path.isfile(path):
        raise RuntimeError(f'{path} not found: build it with `bash scripts/test.sh` or set DEEPEP_LL_VIRTUAL_LIBRARY')
    lib = ctypes.CDLL(path)
    lib.llv_num_args.restype = ctypes.c_int
    lib.llv_arg_name.restype = ctypes.c_char_p
    lib.llv_arg_name.argtypes = [ctypes.c_int]
    for fn in (lib.llv_window_bytes, lib.llv_workspace_bytes, lib.llv_clean_barrier_offset,
               lib.llv_clean_epoch_offset, lib.llv_signal_offset):
        fn.restype = ctypes.c_int64
    lib.llv_window_bytes.argtypes = [ctypes.c_void_p]
    lib.llv_workspace_bytes.argtypes = [ctypes.c_int64]
    lib.llv_clean_barrier_offset.argtypes = [ctypes.c_void_p]
    lib.llv_clean_epoch_offset.argtypes = [ctypes.c_int64]
    lib.llv_signal_offset.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    if hasattr(lib, 'llv_fault_ll_same_half'):  # absent in a library built before the fault existed
        lib.llv_fault_ll_same_half.restype = ctypes.c_int
    if hasattr(lib, 'llv_workspace_layout'):  # a library built before it had none (see workspace_layout)
        lib.llv_workspace_layout.restype = None
        lib.llv_workspace_layout.argtypes = [ctypes.c_int64, ctypes.c_void_p]
    for fn in (lib.llv_dispatch, lib.llv_combine, lib.llv_clean):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    return lib


class VirtualWorld:
    """num_ranks windows on the current GPU. node_size < num_ranks sends to ranks of other
    (virtual) nodes through the emulated remote path (stage, put, signal)."""

    def __init__(self, num_ranks, num_experts, max_tokens, hidden, node_size=None, num_blocks=None,
                 timeout_s=10.0, shrink=False, library=None):
        assert num_experts % num_ranks == 0, 'num_experts must divide evenly over the ranks'
        self.lib = load_library(library)
        self.names = [self.lib.llv_arg_name(i).decode() for i in range(self.lib.llv_num_args())]
        self.index = {n: i for i, n in enumerate(self.names)}
        self.num_ranks, self.num_experts, self.max_tokens, self.hidden = num_ranks, num_experts, max_tokens, hidden
        self.local_experts = num_experts // num_ranks
        node_size = node_size or num_ranks
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        self.base = dict(num_ranks=num_ranks, num_experts=num_experts, max_tokens=max_tokens, hidden=hidden,
                         node_size=node_size, remote_kind=REMOTE_NONE if node_size >= num_ranks else REMOTE_EMULATED,
                         num_blocks=num_blocks or min(props.multi_processor_count, 1024),
                         timeout_ns=int(timeout_s * 1e9), shrink=int(shrink))
        stride = (self.lib.llv_window_bytes(self._vector(self.base)) + (2 << 20) - 1) // (2 << 20) * (2 << 20)
        self.window = torch.zeros(num_ranks * stride, dtype=torch.uint8, device='cuda')
        self.workspace = torch.zeros(num_ranks * self.lib.llv_workspace_bytes(num_ranks), dtype=torch.uint8,
                                     device='cuda')
        self.stall = torch.zeros(8, dtype=torch.int64, device='cuda')  # DeepepStallRecord (40 bytes)
        self.stall_lock = torch.zeros(1, dtype=torch.int32, device='cuda')
        self.fault = torch.zeros(5, dtype=torch.int64, device='cuda')  # DeepepFaultRecord (40 bytes)
        self.fault_lock = torch.zeros(1, dtype=torch.int32, device='cuda')
        self.base.update(world_base=self.window.data_ptr(), world_stride=stride,
                         workspace_base=self.workspace.data_ptr(), stall_record=self.stall.data_ptr(),
                         stall_lock=self.stall_lock.data_ptr())
        if 'fault_record' in self.index:
            self.base['fault_record'] = self.fault.data_ptr()
        if 'fault_lock' in self.index:
            self.base['fault_lock'] = self.fault_lock.data_ptr()
        self.parity = 1  # flips before every send, as the product's buffer does
        self.stride = stride
        self.workspace_stride = self.lib.llv_workspace_bytes(num_ranks)

    def _vector(self, fields):
        unknown = set(fields) - set(self.index)
        assert not unknown, f'unknown llv arguments {unknown}'
        vec = (ctypes.c_int64 * len(self.names))()
        for name, value in fields.items():
            vec[self.index[name]] = int(value)
        return vec

    def _launch(self, fn, fields, stream=None):
        vec = self._vector({**self.base, **fields})
        stream = stream or torch.cuda.current_stream()
        rc = fn(vec, ctypes.c_void_p(stream.cuda_stream))
        if rc != 0:
            raise RuntimeError(f'{fn.__name__} returned cudaError {rc}')

    def check_no_stall(self):
        rec = self.stall.cpu()
        words = rec.view(torch.int32).tolist()
        if words[0] != 0:
            raise RuntimeError(f'stall recorded: rank {words[1]} waited on peer {words[2]} (op {words[3]}, '
                               f'counter {words[4]}, expected {rec[3].item()}, seen {rec[4].item()})')

    # ------------------------------------------------------------ dispatch
    def dispatch_outputs(self, use_fp8, use_ue8m0):
        el, rows, h = self.local_experts, self.num_ranks * self.max_tokens, self.hidden
        out = dict(
            x=torch.empty(el, rows, h, dtype=torch.float8_e4m3fn if use_fp8 else torch.bfloat16, device='cuda'),
            count=torch.empty(el, dtype=torch.int32, device='cuda'),
            src_info=torch.empty(el, rows, dtype=torch.int32, device='cuda'),
            layout_range=torch.empty(el, self.num_ranks, dtype=torch.int64, device='cuda'),
            stats=torch.zeros(el, dtype=torch.int32, device='cuda'),
            wait_stats=torch.zeros(self.num_ranks, dtype=torch.int64, device='cuda'),
            scales=None)
        if use_fp8:  # DeepEP's column-major [E_l, rows, groups] (stored [E_l, groups, rows])
            groups = h // 512 if use_ue8m0 else h // 128
            dtype = torch.int32 if use_ue8m0 else torch.float32
            out['scales'] = torch.empty(el, groups, rows, dtype=dtype, device='cuda').transpose(1, 2)
        return out

    def dispatch_fields(self, rank, phases, x, topk, out, use_fp8=False, round_scale=False, use_ue8m0=False):
        return dict(rank=rank, phases=phases, parity=self.parity, num_topk=topk.size(1), num_tokens=x.size(0),
                    x=x.data_ptr(), topk_idx=topk.data_ptr(), topk_idx_is_int32=topk.dtype == torch.int32,
                    use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
                    packed_recv_x=out['x'].data_ptr(),
                    packed_recv_x_scales=0 if out['scales'] is None else out['scales'].data_ptr(),
                    packed_recv_count=out['count'].data_ptr(), packed_recv_src_info=out['src_info'].data_ptr(),
                    packed_recv_layout_range=out['layout_range'].data_ptr(),
                    cumulative_stats=out['stats'].data_ptr(), wait_stats=out['wait_stats'].data_ptr())

    def dispatch_send(self, rank, x, topk, out, stream=None, **mode):
        self._launch(self.lib.llv_dispatch, self.dispatch_fields(rank, PHASE_SEND, x, topk, out, **mode), stream)

    def dispatch_recv(self, rank, x, topk, out, stream=None, **mode):
        self._launch(self.lib.llv_dispatch, self.dispatch_fields(rank, PHASE_RECV, x, topk, out, **mode), stream)

    def dispatch(self, all_x, all_topk, use_fp8=False, round_scale=False, use_ue8m0=False, outs=None):
        """Every rank sends, then every rank receives (hook mode: no kernel waits for a peer that
        has not launched). Returns one output dict per rank."""
        mode = dict(use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0)
        outs = outs or [self.dispatch_outputs(use_fp8, use_ue8m0) for _ in range(self.num_ranks)]
        self.parity ^= 1
        for r in range(self.num_ranks):
            self.dispatch_send(r, all_x[r], all_topk[r], outs[r], **mode)
        for r in range(self.num_ranks):
            self.dispatch_recv(r, all_x[r], all_topk[r], outs[r], **mode)
        return outs

    # ------------------------------------------------------------ combine
    def combine_fields(self, rank, phases, y, topk, weights, src_info, layout_range, out, use_logfmt=False,
                       wait_stats=None):
        return dict(rank=rank, phases=phases, parity=self.parity, num_topk=topk.size(1), num_tokens=topk.size(0),
                    x=y.data_ptr(), topk_idx=topk.data_ptr(), topk_idx_is_int32=topk.dtype == torch.int32,
                    topk_weights=weights.data_ptr(), src_info=src_info.data_ptr(),
                    layout_range=layout_range.data_ptr(), out=out.data_ptr(), use_logfmt=use_logfmt,
                    wait_stats=0 if wait_stats is None else wait_stats.data_ptr())

    def combine_rank(self, rank, phases, y, topk, weights, dispatch_out, out, use_logfmt=False, stream=None):
        """One rank's combine phases (send 1, receive 2) of the current half."""
        self._launch(self.lib.llv_combine,
                     self.combine_fields(rank, phases, y, topk, weights, dispatch_out['src_info'],
                                         dispatch_out['layout_range'], out, use_logfmt), stream)

    def combine(self, all_y, all_topk, all_weights, dispatch_outs, use_logfmt=False, outs=None):
        """Every rank sends its expert outputs all_y[r] [E_l, R*M, H] back, then every rank
        receives. dispatch_outs: the dispatch's per-rank outputs (src_info, layout_range)."""
        outs = outs or [torch.empty(t.size(0), self.hidden, dtype=torch.bfloat16, device='cuda') for t in all_topk]
        self.parity ^= 1
        for phases in (PHASE_SEND, PHASE_RECV):
            for r in range(self.num_ranks):
                self.combine_rank(r, phases, all_y[r], all_topk[r], all_weights[r], dispatch_outs[r], outs[r],
                                  use_logfmt)
        return outs

    # ------------------------------------------------------------ clean_low_latency_buffer
    def launch_clean(self, ranks):
        """Launches clean_low_latency_buffer of `ranks`, each on a stream of its own so that their
        barriers can meet, without waiting; returns the streams."""
        streams = [torch.cuda.Stream() for _ in ranks]
        for rank, stream in zip(ranks, streams):
            self._launch(self.lib.llv_clean, dict(rank=rank), stream)
        self.parity = 1  # the next send uses half 0, as in the product
        return streams

    def clean(self, ranks=None):
        """clean_low_latency_buffer on `ranks` (default: all), after the work so far; waits for it."""
        torch.cuda.synchronize()
        self.launch_clean(range(self.num_ranks) if ranks is None else ranks)
        torch.cuda.synchronize()

    def rank_window(self, rank):
        return self.window[rank * self.stride:(rank + 1) * self.stride]

    def halves_bytes(self):
        """Bytes of a rank's window the LL halves take (the clean barrier's words follow)."""
        return self.lib.llv_clean_barrier_offset(self._vector(self.base))

    def signal_words(self, rank, parity):
        """Half `parity`'s signal words of `rank`: [2 kinds][R] uint64 (as int64)."""
        offset = self.lib.llv_signal_offset(self._vector(self.base), parity)
        return self.rank_window(rank)[offset:offset + 16 * self.num_ranks].view(torch.int64)

    def arrival_words(self, rank):
        """The clean barrier's arrival counts at `rank`, one per source rank."""
        offset = self.halves_bytes()
        return self.rank_window(rank)[offset:offset + 4 * self.num_ranks].view(torch.int32)

    def rank_workspace(self, rank):
        return self.workspace[rank * self.workspace_stride:(rank + 1) * self.workspace_stride]

    def workspace_layout(self):
        """Offsets in a rank's workspace: done, source_state, ticket, mask, op_seq, gin_sent,
        clean_epoch, bytes (the library's; a library built before it had a layout of its own:
        [2R] done, [2R] source_state, [2] ticket, [R] mask, then recv_epoch)."""
        r = self.num_ranks
        if hasattr(self.lib, 'llv_workspace_layout'):
            out = (ctypes.c_int64 * 8)()
            self.lib.llv_workspace_layout(r, out)
            return dict(zip(('done', 'source_state', 'ticket', 'mask', 'op_seq', 'gin_sent', 'clean_epoch',
                             'bytes'), list(out)))
        return dict(done=0, source_state=8 * r, ticket=16 * r, mask=16 * r + 8, op_seq=None)

    def counters(self, rank):
        """What clean resets in the workspace, as int32 views: (done, source_state, ticket), op_seq
        (set to the new generation << 32), gin_sent."""
        at, ws = self.workspace_layout(), self.rank_workspace(rank)
        return (ws[:at['mask']].view(torch.int32), ws[at['op_seq']:at['gin_sent']].view(torch.int32),
                ws[at['gin_sent']:at['clean_epoch']].view(torch.int32))

    def op_seq(self, rank):
        """[2 kinds][2 halves][blocks] int64: (clean generation << 32) | sends on that half."""
        at = self.workspace_layout()
        return self.rank_workspace(rank)[at['op_seq']:at['gin_sent']].view(torch.int64).view(2, 2, -1)

    def mask(self, rank):
        at = self.workspace_layout()
        return self.rank_workspace(rank)[at['mask']:at['mask'] + 4 * self.num_ranks].view(torch.int32)

    def check_no_fault(self):
        rec = self.fault.cpu()
        if rec.view(torch.int32)[0].item() != 0:
            raise RuntimeError(f'fault recorded: code {rec.view(torch.int32)[1].item()}, a {rec[1].item()}, '
                               f'b {rec[2].item()}')

    def take_fault(self):
        """The recorded fault's (code, a, b), or None; clears it, as the product's host does."""
        torch.cuda.synchronize()
        rec = self.fault.cpu()
        self.fault.zero_()
        self.fault_lock.zero_()  # the record's `released` went back to 0 with it
        words = rec.view(torch.int32)
        return None if words[0].item() == 0 else (words[1].item(), rec[1].item(), rec[2].item())

    def clean_epoch(self, rank):
        at = self.lib.llv_clean_epoch_offset(self.num_ranks)
        return int(self.rank_workspace(rank)[at:at + 4].view(torch.int32).item())

    def reset_stall(self):
        self.stall.zero_()
        self.stall_lock.zero_()


class SkipCase(Exception):
    """Raised by a world that this GPU cannot hold (run_cases reports the case as skipped)."""


def run_cases(title, description, checks, make_world=None):
    """The command line of a virtual-rank test: every case of `checks` ({name: (world kwargs,
    check(world, **kwargs), kwargs)}) whose name matches -k, each on a fresh world
    (make_world(**world kwargs), default VirtualWorld), every failure reported; returns the exit
    status."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument('-k', dest='pattern', default='', help='run only the cases whose name matches this regex')
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(f'{title} needs a GPU, found none')
        return 1
    torch.cuda.set_device(0)
    passed, failed, skipped = 0, [], 0
    for name, (world_kw, check, check_kw) in checks.items():
        if not re.search(args.pattern, name):
            continue
        start = time.monotonic()
        try:
            world = (make_world or VirtualWorld)(**world_kw)
            check(world, **check_kw)
            torch.cuda.synchronize()
            del world
            passed += 1
            print(f'PASS {name} ({time.monotonic() - start:.1f} s)', flush=True)
        except SkipCase as e:
            skipped += 1
            print(f'SKIP {name}: {e}', flush=True)
        except Exception as e:  # report every case
            failed.append(name)
            print(f'FAIL {name}: {e}', flush=True)
            traceback.print_exc()
            torch.cuda.synchronize()
    print(f'{title}: {passed} passed, {len(failed)} failed' + (f' ({", ".join(failed)})' if failed else '')
          + (f', {skipped} skipped' if skipped else ''))
    return 1 if failed or passed == 0 else 0
