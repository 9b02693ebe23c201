"""deep_ep.Buffer: DeepEP V1's public Python API on deepep-nccl."""
import os
from typing import Callable, Optional, Tuple, Union

import torch
import torch.distributed as dist

import deep_ep_cpp
from deep_ep_cpp import Config, EventHandle

from .utils import EventOverlap, check_nvlink_connections

# Keyword arguments that DeepEP forks add (hybrid-ep, antgroup-opt), accepted so that callers
# written for those forks run: NCCL picks transports itself (allow_nvlink_for_normal_mode); the
# low-latency ones are ignored unless they ask for a feature we lack (use_nvfp4, overlap), which
# raises. Other names are TypeErrors.
_CONSTRUCTOR_EXTENSIONS = frozenset({"allow_nvlink_for_normal_mode"})
_LOW_LATENCY_DISPATCH_EXTENSIONS = frozenset({"use_nvfp4", "x_global_scale", "topk_weights", "use_ue8m0_for_sf"})
_LOW_LATENCY_COMBINE_EXTENSIONS = frozenset(
    {
        "overlap",
        "packed_recv_count",
        "comp_signal",
        "block_m",
        "threshold",
        "num_sms",
        "src_signals",
        "src_signal_expect_value",
    }
)


def _check_extension_kwargs(method: str, kwargs: dict, known: frozenset) -> None:
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(
            f"{method}() got unexpected keyword arguments {unknown} (DeepEP forks add only {sorted(known)})"
        )


# (kind, num_ranks, num_sms) -> Config: a dispatch/combine without config= asks for it every call,
# and a Config cannot change after construction.
_default_configs = {}


def _default_config(kind: str, num_ranks: int) -> Config:
    key = (kind, num_ranks, Buffer.num_sms)
    config = _default_configs.get(key)
    if config is None:
        try:
            config = deep_ep_cpp.get_default_config(kind, num_ranks, Buffer.num_sms)
        except RuntimeError as e:
            # DeepEP asserts here ('Unsupported number of EP ranks'); the library's text says which exist.
            raise AssertionError(str(e)) from e
        _default_configs[key] = config
    return config


class Buffer:
    """
    The communication buffer for MoE expert parallelism: normal-mode dispatch/combine (high
    throughput) and low-latency mode, as in DeepEP, on NCCL's Device API.

    Attributes:
        num_sms: the SMs used by the normal kernels (class-wide, see set_num_sms).
        rank: the local rank number.
        group_size: the number of ranks in the group.
        group: the communication group (or the mpi4py communicator).
        num_nvl_bytes: the buffer size for intranode NVLink communication.
        num_rdma_bytes: the buffer size for internode (and low-latency) communication.
        runtime: the deep_ep_cpp runtime.
    """

    num_sms: int = 20

    def __init__(
        self,
        group: Optional[dist.ProcessGroup],
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        use_fabric: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm: Optional[object] = None,
        **kwargs,
    ) -> None:
        """
        Collective over `group` (an NCCL or Gloo process group) or, when group is None, over
        `comm` (mpi4py). num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl and
        use_fabric are DeepEP's NVSHMEM and memory-handle settings: accepted, while NCCL picks
        transports and handles itself. With explicitly_destroy, destroy() must be called;
        otherwise the buffer is torn down (collectively) when it is garbage collected.
        """
        _check_extension_kwargs("Buffer", kwargs, _CONSTRUCTOR_EXTENSIONS)
        if group is not None:
            check_nvlink_connections(group)
            self.rank = group.rank()
            self.group = group
            self.group_size = group.size()

            def all_gather_object(obj):
                object_list = [None] * self.group_size
                dist.all_gather_object(object_list, obj, group)
                return object_list

        elif comm is not None:
            self.rank = comm.Get_rank()
            self.group = comm
            self.group_size = comm.Get_size()
            all_gather_object = comm.allgather
        else:
            raise ValueError("Either 'group' or 'comm' must be provided.")

        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        self.runtime = deep_ep_cpp.Buffer(
            self.rank,
            self.group_size,
            num_nvl_bytes,
            num_rdma_bytes,
            low_latency_mode,
            explicitly_destroy,
            enable_shrink,
            use_fabric,
        )

        # Rank 0's IPC handle carries the NCCL unique id; the all-gather hands it to every rank.
        device_ids = all_gather_object(self.runtime.get_local_device_id())
        ipc_handles = all_gather_object(self.runtime.get_local_ipc_handle())
        if self.runtime.get_num_rdma_ranks() > 1 or low_latency_mode:
            assert num_qps_per_rank > 0
            # DeepEP's NVSHMEM queue depth, read by some consumers. No NVSHMEM here, so it bounds
            # nothing (DeepEP asserts (M + 1) * 2 <= depth, i.e. M <= 511; M may be up to 1024).
            self.nvshmem_qp_depth = int(os.environ.get("NVSHMEM_QP_DEPTH", "1024"))
        self.runtime.sync(device_ids, ipc_handles, None)
        assert self.runtime.is_available()

    def destroy(self) -> None:
        """Collective teardown; only for buffers created with explicitly_destroy=True."""
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        # DeepEP sets runtime to None here; keeping it turns later calls (and a second
        # destroy) into RuntimeErrors that say the buffer was destroyed, not AttributeErrors.
        self.runtime.destroy()

    @staticmethod
    def is_sm90_compiled() -> bool:
        return deep_ep_cpp.is_sm90_compiled()

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Sets the SMs used by the normal kernels (and the default configs); must be even."""
        assert new_num_sms % 2 == 0, "The SM count must be even"
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded on the current stream."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """The RDMA buffer size (bytes) low-latency mode needs, by DeepEP's formula."""
        return deep_ep_cpp.get_low_latency_rdma_size_hint(
            num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts
        )

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP's tuned dispatch config for num_ranks with Buffer.num_sms SMs."""
        return _default_config("dispatch", num_ranks)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP's tuned combine config for num_ranks with Buffer.num_sms SMs."""
        return _default_config("combine", num_ranks)

    @staticmethod
    def _unpack_bias(bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], None]):
        bias_0, bias_1 = None, None
        if isinstance(bias, torch.Tensor):
            bias_0 = bias
        elif isinstance(bias, tuple):
            assert len(bias) == 2
            bias_0, bias_1 = bias
        return bias_0, bias_1

    def get_comm_stream(self) -> torch.cuda.Stream:
        """The buffer's high-priority communication stream."""
        return self.runtime.get_comm_stream()

    def get_local_buffer_tensor(
        self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0, use_rdma_buffer: bool = False
    ) -> torch.Tensor:
        """A raw view of this rank's NVL (or RDMA) buffer from byte `offset`, reshaped to `size` if given."""
        tensor = self.runtime.get_local_buffer_tensor(dtype, offset, use_rdma_buffer)
        if size is None:
            return tensor
        assert tensor.numel() >= size.numel()
        return tensor[: size.numel()].view(size)

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, EventOverlap]:
        """
        Counts what dispatch will send, from `topk_idx` ([num_tokens, num_topk], topk_idx_t; -1 = none).

        Returns num_tokens_per_rank [num_ranks] int32, num_tokens_per_rdma_rank [num_ranks // 8]
        int32 (None within one node), num_tokens_per_expert [num_experts] int32,
        is_token_in_rank [num_tokens, num_ranks] bool, and an EventOverlap (its event is set only
        with async_finish). allocate_on_comm_stream requires previous_event and async_finish.
        """
        per_rank, per_rdma_rank, per_expert, in_rank, event = self.runtime.get_dispatch_layout(
            topk_idx, num_experts, getattr(previous_event, "event", None), async_finish, allocate_on_comm_stream
        )
        return per_rank, per_rdma_rank, per_expert, in_rank, EventOverlap(event)

    def dispatch(
        self,
        x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
        handle: Optional[Tuple] = None,
        num_tokens_per_rank: Optional[torch.Tensor] = None,
        num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
        is_token_in_rank: Optional[torch.Tensor] = None,
        num_tokens_per_expert: Optional[torch.Tensor] = None,
        topk_idx: Optional[torch.Tensor] = None,
        topk_weights: Optional[torch.Tensor] = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Optional[Config] = None,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """
        Sends each token once to every rank that holds one of its experts (normal mode).

        `x` is a BF16 tensor [num_tokens, hidden] or the FP8 tuple (e4m3 [num_tokens, hidden],
        scales [num_tokens, hidden // 128] float32/int32, any strides). Without `handle`, pass the
        layout tensors (num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert) and
        optionally topk_idx/topk_weights; this waits on the host for the receive count unless
        num_worst_tokens > 0. With `handle` (from an earlier dispatch) the routing is reused and
        there is no host wait; top-k cannot be given then.

        Returns (recv_x or (recv_x, recv_x_scales), recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle, EventOverlap). Received rows are grouped by
        source rank, then ordered by source token index. recv_topk_idx holds local expert ids
        (-1 for other ranks' experts, weight 0.0 there); the per-expert counts are rounded up to
        expert_alignment (empty list with num_worst_tokens or a handle).
        """
        config = self.get_dispatch_config(self.group_size) if config is None else config
        if self.runtime.get_num_rdma_ranks() > 1:
            return self.internode_dispatch(
                x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert,
                topk_idx, topk_weights, expert_alignment, num_worst_tokens, config, previous_event, async_finish,
                allocate_on_comm_stream)
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        previous = getattr(previous_event, "event", None)
        if handle is not None:
            assert topk_idx is None and topk_weights is None
            rank_prefix_matrix, channel_prefix_matrix, _, recv_src_idx, is_token_in_rank, _ = handle
            recv_x, recv_x_scales, *_, event = self.runtime.intranode_dispatch(
                x, x_scales, None, None, None, is_token_in_rank, None, recv_src_idx.size(0), rank_prefix_matrix,
                channel_prefix_matrix, expert_alignment, num_worst_tokens, config, previous, async_finish,
                allocate_on_comm_stream)
            recv = (recv_x, recv_x_scales) if x_scales is not None else recv_x
            return recv, None, None, None, None, EventOverlap(event)
        assert num_tokens_per_rank is not None and is_token_in_rank is not None and num_tokens_per_expert is not None
        (recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, rank_prefix_matrix,
         channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, send_head, event) = \
            self.runtime.intranode_dispatch(
                x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, 0,
                None, None, expert_alignment, num_worst_tokens, config, previous, async_finish,
                allocate_on_comm_stream)
        handle = (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
                  is_token_in_rank, send_head)
        recv = (recv_x, recv_x_scales) if x_scales is not None else recv_x
        return (recv, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle,
                EventOverlap(event))

    def combine(
        self,
        x: torch.Tensor,
        handle: Tuple,
        topk_weights: Optional[torch.Tensor] = None,
        bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], None] = None,
        config: Optional[Config] = None,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """
        Sums each token's rows back onto the rank it came from: combined_x[t] = bias_0[t] +
        bias_1[t] + the sum of x over the ranks t was dispatched to (fp32, rounded to BF16 once;
        no expert weights are applied). `x` is BF16 [num_recv_tokens, hidden] in the order the
        dispatch with `handle` returned; `bias` is None, a tensor or a 2-tuple of [num_tokens,
        hidden]; `topk_weights` [num_recv_tokens, num_topk] float32 is summed the same way.

        Returns (combined_x, combined_topk_weights or None, EventOverlap).
        """
        config = self.get_combine_config(self.group_size) if config is None else config
        if self.runtime.get_num_rdma_ranks() > 1:
            return self.internode_combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                                          allocate_on_comm_stream)
        rank_prefix_matrix, _, channel_prefix_matrix, src_idx, is_recv_token_in_rank, send_head = handle
        bias_0, bias_1 = Buffer._unpack_bias(bias)
        combined_x, combined_topk_weights, event = self.runtime.intranode_combine(
            x, topk_weights, bias_0, bias_1, src_idx, rank_prefix_matrix, channel_prefix_matrix, send_head, config,
            getattr(previous_event, "event", None), async_finish, allocate_on_comm_stream)
        return combined_x, combined_topk_weights, EventOverlap(event)

    def internode_dispatch(
        self,
        x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
        handle: Optional[Tuple] = None,
        num_tokens_per_rank: Optional[torch.Tensor] = None,
        num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
        is_token_in_rank: Optional[torch.Tensor] = None,
        num_tokens_per_expert: Optional[torch.Tensor] = None,
        topk_idx: Optional[torch.Tensor] = None,
        topk_weights: Optional[torch.Tensor] = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Optional[Config] = None,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """dispatch() on a buffer across nodes (get_num_rdma_ranks() > 1): the same arguments and
        returns; the handle is DeepEP's 10-tuple (is_token_in_rank, rdma_channel_prefix_matrix,
        gbl_channel_prefix_matrix, recv_rdma_channel_prefix_matrix, recv_rdma_rank_prefix_sum,
        recv_gbl_channel_prefix_matrix, recv_gbl_rank_prefix_sum, recv_src_meta, send_rdma_head,
        send_nvl_head)."""
        assert config is not None
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        previous = getattr(previous_event, "event", None)
        if handle is not None:
            assert topk_idx is None and topk_weights is None
            (is_token_in_rank, rdma_channel_prefix_matrix, gbl_channel_prefix_matrix, recv_rdma_channel_prefix_matrix,
             recv_rdma_rank_prefix_sum, recv_gbl_channel_prefix_matrix, recv_gbl_rank_prefix_sum, recv_src_meta,
             send_rdma_head, send_nvl_head) = handle
            num_recv_tokens = recv_src_meta.size(0)
            num_rdma_recv_tokens = send_nvl_head.size(0)
            recv_x, recv_x_scales, *_, event = self.runtime.internode_dispatch(
                x, x_scales, None, None, None, None, is_token_in_rank, None, num_recv_tokens, num_rdma_recv_tokens,
                rdma_channel_prefix_matrix, recv_rdma_rank_prefix_sum, gbl_channel_prefix_matrix,
                recv_gbl_rank_prefix_sum, expert_alignment, num_worst_tokens, config, previous, async_finish,
                allocate_on_comm_stream)
            recv = (recv_x, recv_x_scales) if x_scales is not None else recv_x
            return recv, None, None, None, None, EventOverlap(event)
        assert num_tokens_per_rank is not None and is_token_in_rank is not None and num_tokens_per_expert is not None
        (recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
         rdma_channel_prefix_matrix, gbl_channel_prefix_matrix, recv_rdma_channel_prefix_matrix,
         recv_rdma_rank_prefix_sum, recv_gbl_channel_prefix_matrix, recv_gbl_rank_prefix_sum, recv_src_meta,
         send_rdma_head, send_nvl_head, event) = self.runtime.internode_dispatch(
            x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
            num_tokens_per_expert, 0, 0, None, None, None, None, expert_alignment, num_worst_tokens, config, previous,
            async_finish, allocate_on_comm_stream)
        handle = (is_token_in_rank, rdma_channel_prefix_matrix, gbl_channel_prefix_matrix,
                  recv_rdma_channel_prefix_matrix, recv_rdma_rank_prefix_sum, recv_gbl_channel_prefix_matrix,
                  recv_gbl_rank_prefix_sum, recv_src_meta, send_rdma_head, send_nvl_head)
        recv = (recv_x, recv_x_scales) if x_scales is not None else recv_x
        return (recv, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle,
                EventOverlap(event))

    def internode_combine(
        self,
        x: torch.Tensor,
        handle: Union[tuple, list],
        topk_weights: Optional[torch.Tensor] = None,
        bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], None] = None,
        config: Optional[Config] = None,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """combine() on a buffer across nodes: DeepEP's order (bias_0 + bias_1, then the nodes'
        partial sums in ascending node, each a sum over the node's GPUs rounded to BF16). Rewrites
        the handle's two heads in place, as DeepEP does."""
        assert config is not None
        (is_combined_token_in_rank, _, _, rdma_channel_prefix_matrix, rdma_rank_prefix_sum, gbl_channel_prefix_matrix,
         _, src_meta, send_rdma_head, send_nvl_head) = handle
        bias_0, bias_1 = Buffer._unpack_bias(bias)
        combined_x, combined_topk_weights, event = self.runtime.internode_combine(
            x, topk_weights, bias_0, bias_1, src_meta, is_combined_token_in_rank, rdma_channel_prefix_matrix,
            rdma_rank_prefix_sum, gbl_channel_prefix_matrix, send_rdma_head, send_nvl_head, config,
            getattr(previous_event, "event", None), async_finish, allocate_on_comm_stream)
        return combined_x, combined_topk_weights, EventOverlap(event)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Collective: resets the low-latency signals (call it after normal-mode ops, before LL ops)."""
        self.runtime.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
        dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        **kwargs,
    ) -> Tuple[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], torch.Tensor, Tuple, EventOverlap, Callable]:
        """DeepEP's low-latency dispatch: one copy per (token, selected expert) into the packed
        [E_l, R*M, H] layout. Returns (recv_x, recv_count, handle, event, hook)."""
        if kwargs:  # a fork's keywords (the hot path has none)
            _check_extension_kwargs("low_latency_dispatch", kwargs, _LOW_LATENCY_DISPATCH_EXTENSIONS)
        if kwargs and kwargs.get("use_nvfp4"):
            raise RuntimeError("deepep-nccl: low_latency_dispatch(use_nvfp4=True) is not supported; use use_fp8")
        # The runtime's dispatch with x's hidden size: no torch call here (each costs ~1 us under a
        # TorchFunctionMode such as torch.set_default_device's).
        (packed_recv_x, packed_recv_x_scales, packed_recv_count, packed_recv_src_info, packed_recv_layout_range,
         event, hook, hidden) = self.runtime._ll_dispatch(
            x, topk_idx, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
            num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0, async_finish,
            return_recv_hook)
        handle = (packed_recv_src_info, packed_recv_layout_range, num_max_dispatch_tokens_per_rank, hidden,
                  num_experts)
        recv_x = (packed_recv_x, packed_recv_x_scales) if use_fp8 else packed_recv_x
        if not async_finish:
            return recv_x, packed_recv_count, handle, EventOverlap(event), hook
        tensors_to_record = (x, topk_idx, packed_recv_x, packed_recv_x_scales, packed_recv_count,
                             packed_recv_src_info, packed_recv_layout_range, cumulative_local_expert_recv_stats)
        return recv_x, packed_recv_count, handle, EventOverlap(event, tensors_to_record), hook

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: tuple,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: Optional[torch.Tensor] = None,
        combine_wait_recv_cost_stats: Optional[torch.Tensor] = None,
        **kwargs,
    ) -> Tuple[torch.Tensor, EventOverlap, Callable]:
        """DeepEP's low-latency combine: the top-k weighted sum (fp32, rounded to BF16) of each
        token's expert outputs. Returns (combined_x, event, hook)."""
        if kwargs:  # a fork's keywords (the hot path has none)
            _check_extension_kwargs("low_latency_combine", kwargs, _LOW_LATENCY_COMBINE_EXTENSIONS)
        if kwargs and kwargs.get("overlap"):
            raise RuntimeError("deepep-nccl: low_latency_combine(overlap=True) is not supported")
        src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts = handle
        # The runtime checks x's hidden size against the handle's (no torch call here).
        combined_x, event, hook = self.runtime._ll_combine(
            x, topk_idx, topk_weights, src_info, layout_range, combine_wait_recv_cost_stats,
            num_max_dispatch_tokens_per_rank, num_experts, use_logfmt, zero_copy, async_finish, return_recv_hook,
            out, hidden)
        if not async_finish:
            return combined_x, EventOverlap(event), hook
        tensors_to_record = (x, topk_idx, topk_weights, src_info, layout_range, combined_x)
        return combined_x, EventOverlap(event, tensors_to_record), hook

    def get_next_low_latency_combine_buffer(self, handle: object) -> torch.Tensor:
        """The BF16 [E_l, R*M, H] view the next combine can read with zero_copy=True."""
        src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts = handle
        return self.runtime.get_next_low_latency_combine_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Shrink mode: masks (or unmasks) a rank for later calls (low-latency and normal: one mask)."""
        self.runtime.low_latency_update_mask_buffer(rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Shrink mode: writes 1 for every masked rank into mask_status (int32 [num_ranks], CUDA)."""
        self.runtime.low_latency_query_mask_buffer(mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        """Shrink mode: unmasks every rank."""
        self.runtime.low_latency_clean_mask_buffer()

    def normal_query_dropped_buffer(self, dropped: torch.Tensor) -> None:
        """Shrink mode (not in DeepEP): writes the normal-mode dropped-row counters, cumulative
        since the buffer was created, into dropped (int64 [4], CUDA), in stream order: received
        rows left empty, tokens not sent, combine contributions left out, combine rows not sent
        (docs/normal_shrink.md). The mask (low_latency_*_mask_buffer) is the same in both modes."""
        self.runtime.normal_query_dropped_buffer(dropped)

    def internode_query_traffic_buffer(self, traffic: torch.Tensor) -> None:
        """Internode mode (not in DeepEP): writes this rank's traffic counters, cumulative since the
        buffer was created, into traffic (int64 [8], CUDA), in stream order (no host sync): rows
        and bytes sent over the scale-out leg (rows to other nodes), then over the NVLink leg
        (rows into other local GPUs' rings), for dispatch ([0:4]) and combine ([4:8]). A call's
        traffic is the difference of two queries (docs/internode.md, "Statistics")."""
        self.runtime.internode_query_traffic_buffer(traffic)
