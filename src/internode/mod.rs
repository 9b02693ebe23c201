//! Internode normal mode (docs/internode.md): a buffer across (virtual) nodes. The checks both
//! ops share (topology, config, the NVL and RDMA budgets), and the ops in [`dispatch`] and
//! [`combine`].
pub mod combine;
pub mod dispatch;

use std::os::raw::c_void;

use crate::buffer::{Buffer, BufferArgs, Resources, LL_MAX_RANKS};
use crate::config::{DeepepConfig, RankLayout};
use crate::cuda;
use crate::ensure_arg;
use crate::error::{Error, Result};
use crate::kernels;
use crate::normal::channel_plan;
use crate::tensor::{check, check_shape, DeepepDtype::*, DeepepTensor};

/// Channels and ring sizes of one internode op, from its `Config` and the buffer's RDMA region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InternodePlan {
    pub num_channels: i32,
    pub rdma_ring_tokens: i32,
    pub nvl_ring_tokens: i32,
}

impl InternodePlan {
    /// The kernels' common parameters for an op of this plan on `buffer`.
    pub(crate) fn common(&self, buffer: &Buffer, res: &Resources) -> kernels::InternodeCommon {
        res.internode_common(
            buffer.wait_context(res),
            &buffer.layout,
            buffer.rdma_offset(),
            self.num_channels,
            self.rdma_ring_tokens,
            self.nvl_ring_tokens,
            buffer.args.enable_shrink,
        )
    }
}

/// The topology the internode kernels take: across nodes, nodes of equal size up to
/// INTERNODE_MAX_NODE_SIZE GPUs (the NVLink domain: a lane per local GPU in the kernels' masks,
/// a receiver warp per other local GPU), at most INTERNODE_MAX_NODES of them (combine's final
/// receiver keeps two int32 per node in shared memory). Warp groups take nodes in turn, so
/// the number of nodes has no other bound; the counters grow the window and the GIN signals
/// at Buffer creation.
pub fn check_topology(layout: &RankLayout, args: &BufferArgs) -> Result<()> {
    ensure_arg!(
        layout.spans_nodes(),
        "internode dispatch/combine need a buffer across nodes; this one's {} ranks are one NVLink domain (use \
         intranode dispatch/combine, or DEEPEP_VIRTUAL_NODE_SIZE to split it into virtual nodes)",
        layout.num_ranks
    );
    // Shrink mode's mask is the LL workspace's, one int per rank.
    ensure_arg!(
        !args.enable_shrink || layout.num_ranks <= LL_MAX_RANKS,
        "internode dispatch/combine with enable_shrink=True support up to {LL_MAX_RANKS} ranks (the mask's), the \
         buffer has {}",
        layout.num_ranks
    );
    let (nodes, node_size) = (layout.num_ranks / layout.node_size, layout.node_size);
    ensure_arg!(
        layout.num_ranks % node_size == 0,
        "internode dispatch/combine need nodes of equal size: {node_size} GPUs per node do not divide the buffer's {} \
         ranks",
        layout.num_ranks
    );
    ensure_arg!(
        node_size <= kernels::INTERNODE_MAX_NODE_SIZE,
        "internode dispatch/combine support nodes of up to {} GPUs (an NVLink domain of DeepEP's size), the buffer's \
         have {node_size}",
        kernels::INTERNODE_MAX_NODE_SIZE
    );
    ensure_arg!(
        nodes <= kernels::INTERNODE_MAX_NODES,
        "internode dispatch/combine support up to {} nodes (combine keeps 8 bytes of shared memory per node), the \
         buffer has {nodes} ({} ranks in nodes of {node_size})",
        kernels::INTERNODE_MAX_NODES,
        layout.num_ranks
    );
    Ok(())
}

/// Bytes of the NVL region the NVLink rings of rows of `row_bytes` take: C x G rings of
/// nvl_ring_tokens slots (header + row) plus a consumed word per slot.
pub fn nvl_bytes_needed(plan: InternodePlan, node_size: i32, row_bytes: i64) -> Option<i64> {
    (plan.num_channels as i64)
        .checked_mul(node_size as i64)?
        .checked_mul(plan.nvl_ring_tokens as i64)?
        .checked_mul(row_bytes.checked_add(kernels::INTERNODE_NVL_HEADER_BYTES + 8)?)
}

/// Bytes of the RDMA region: notify slots and staging (2 x 2 x R slots), then receive and send
/// rings (2 x C x N x rdma_ring_tokens rows).
pub fn rdma_bytes_needed(plan: InternodePlan, num_ranks: i32, num_nodes: i32, row_bytes: i64) -> Option<i64> {
    let notify = notify_bytes(num_ranks);
    let rings = (2 * plan.num_channels as i64)
        .checked_mul(num_nodes as i64)?
        .checked_mul(plan.rdma_ring_tokens as i64)?
        .checked_mul(row_bytes)?;
    notify.checked_add(rings)
}

fn notify_bytes(num_ranks: i32) -> i64 {
    4 * num_ranks as i64 * kernels::INTERNODE_NOTIFY_SLOT_BYTES
}

/// Most rows a combine's scale-out ring grows to. On 4x H100 (2 nodes of 1, T=4096, H=7168,
/// 8-24 SMs) the combine took 753 / 518 / 401 / 333 / 300 us with the config's 128 rows, about
/// 636 / 450 / 357 / 320 / 287 grown to 438 / 292 / 219 / 175 / 146 rows, and 624 / 434 / 341 /
/// 290 / 259 with 1024; longer rings are unmeasured and cost memory linearly (a config asking for
/// more still gets it).
pub(crate) const RDMA_RING_CAP: i32 = 1024;

/// The internode op a plan is for: its name in errors, and whether its scale-out ring grows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InternodeOp {
    Dispatch,
    Combine,
}

impl InternodeOp {
    pub fn name(self) -> &'static str {
        match self {
            Self::Dispatch => "dispatch",
            Self::Combine => "combine",
        }
    }
    /// Only combine's ring grows (grown_rdma_ring): in the same runs dispatch gained nothing from a
    /// longer ring at 8-16 SMs and lost 4% at 24 SMs (345 -> 360 us with 146 or 1024 rows).
    fn grows_ring(self) -> bool {
        self == Self::Combine
    }
}

pub fn grown_rdma_ring(config_ring: i32, num_channels: i32, num_ranks: i32, num_nodes: i32, row_bytes: i64, num_rdma_bytes: i64) -> i32 {
    if config_ring >= RDMA_RING_CAP {
        return config_ring;
    }
    let per_row = (2 * num_channels as i64).checked_mul(num_nodes as i64).and_then(|v| v.checked_mul(row_bytes));
    let Some(per_row) = per_row.filter(|&b| b > 0) else {
        return config_ring;
    };
    let room = num_rdma_bytes.saturating_sub(notify_bytes(num_ranks)).max(0);
    (room / per_row).min(RDMA_RING_CAP as i64).max(config_ring as i64) as i32
}

/// Config, topology and both regions' budgets for rows of `row_bytes`.
pub fn plan_for_layout(
    layout: &RankLayout,
    args: &BufferArgs,
    num_device_sms: i32,
    config: &DeepepConfig,
    op: InternodeOp,
    row_bytes: i64,
) -> Result<InternodePlan> {
    let name = op.name();
    check_topology(layout, args)?;
    let channels = channel_plan(config, num_device_sms)?;
    let rdma_ring = config.num_max_rdma_chunked_recv_tokens;
    ensure_arg!(rdma_ring > 0, "config.num_max_rdma_chunked_recv_tokens must be positive, got {rdma_ring}");
    ensure_arg!(
        row_bytes <= i32::MAX as i64,
        "x: an internode {name} row of {row_bytes} bytes (its hidden size, scales and top-k) is more than the kernels' \
         32-bit row size holds"
    );
    let (g, n) = (layout.node_size, layout.num_ranks / layout.node_size);
    let ring = if op.grows_ring() {
        grown_rdma_ring(rdma_ring, channels.num_channels, layout.num_ranks, n, row_bytes, args.num_rdma_bytes)
    } else {
        rdma_ring
    };
    let plan = InternodePlan {
        num_channels: channels.num_channels,
        rdma_ring_tokens: ring,
        nvl_ring_tokens: channels.ring_tokens,
    };
    let too_big = || {
        Error::invalid(format!(
            "this internode {name} needs more bytes than a 64-bit size holds ({} channels, rings of {} and {} rows of \
             {row_bytes} B)",
            plan.num_channels, plan.nvl_ring_tokens, plan.rdma_ring_tokens
        ))
    };
    let nvl = nvl_bytes_needed(plan, g, row_bytes).ok_or_else(too_big)?;
    ensure_arg!(
        nvl <= args.num_nvl_bytes,
        "num_nvl_bytes ({}) is too small for this internode {name}: {} channels x {g} GPUs per node x {} slots \
         (config.num_max_nvl_chunked_recv_tokens) of {} B need {nvl} B; size the buffer with \
         Config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks)",
        args.num_nvl_bytes,
        plan.num_channels,
        plan.nvl_ring_tokens,
        row_bytes + kernels::INTERNODE_NVL_HEADER_BYTES + 8
    );
    let rdma = rdma_bytes_needed(plan, layout.num_ranks, n, row_bytes).ok_or_else(too_big)?;
    ensure_arg!(
        rdma <= args.num_rdma_bytes,
        "num_rdma_bytes ({}) is too small for this internode {name}: notify slots and 2 x {} channels x {n} nodes x {} \
         rows (config.num_max_rdma_chunked_recv_tokens) of {row_bytes} B need {rdma} B; size the buffer with \
         Config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks)",
        args.num_rdma_bytes,
        plan.num_channels,
        plan.rdma_ring_tokens
    );
    Ok(plan)
}

/// Copies the internode kernels' cumulative traffic counters (enum DeepepTrafficKind: rows and
/// bytes this rank sent over the scale-out and the NVLink leg, dispatch then combine) into
/// `traffic`, an int64 [TRAFFIC_KINDS] device tensor, in `stream` order (no host sync: a CUDA
/// graph can hold it). A call's traffic is the difference of two queries.
pub fn query_traffic(buffer: &Buffer, traffic: &DeepepTensor, stream: *mut c_void) -> Result<()> {
    ensure_arg!(
        buffer.layout.spans_nodes(),
        "traffic counters exist only on a buffer across nodes (internode mode); this one's {} ranks are one NVLink \
         domain",
        buffer.layout.num_ranks
    );
    let out = check("traffic", Some(traffic), &[DEEPEP_DTYPE_INT64], 1)?;
    check_shape("traffic", &out, &[kernels::TRAFFIC_KINDS as i64])?;
    buffer.with_resources(|res| {
        let stream = res.stream_or_comm(stream);
        cuda::copy_device_async(out.ptr(), res.internode_traffic().cast(), 8 * kernels::TRAFFIC_KINDS, stream)
    })
}

fn plan_for(buffer: &Buffer, config: &DeepepConfig, op: InternodeOp, row_bytes: i64) -> Result<InternodePlan> {
    plan_for_layout(&buffer.layout, &buffer.args, buffer.num_device_sms(), config, op, row_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{default_config, ConfigKind};

    fn args(num_ranks: i32, nvl: i64, rdma: i64) -> BufferArgs {
        BufferArgs {
            rank: 0,
            num_ranks,
            num_nvl_bytes: nvl,
            num_rdma_bytes: rdma,
            low_latency_mode: false,
            explicitly_destroy: false,
            enable_shrink: false,
        }
    }

    #[test]
    fn topology_limits_name_the_value() {
        let normal = args(2, 0, 0);
        let within = RankLayout::one_node(0, 8);
        assert!(check_topology(&within, &normal).unwrap_err().message.contains("one NVLink domain"));
        let two = RankLayout { rank: 0, num_ranks: 2, node_size: 1 };
        check_topology(&two, &normal).unwrap();
        // One buffer serves internode and low-latency ops (clean_low_latency_buffer between, as DeepEP).
        check_topology(&two, &BufferArgs { low_latency_mode: true, ..normal }).unwrap();
        // Shrink mode: up to the mask's ranks (the LL workspace's), named with the buffer's.
        let shrink = BufferArgs { enable_shrink: true, ..normal };
        check_topology(&two, &shrink).unwrap();
        check_topology(&RankLayout { rank: 0, num_ranks: LL_MAX_RANKS, node_size: 8 }, &shrink).unwrap();
        let past = RankLayout { rank: 0, num_ranks: LL_MAX_RANKS + 8, node_size: 8 };
        let err = check_topology(&past, &shrink).unwrap_err().message;
        assert!(err.contains("enable_shrink=True") && err.contains(&format!("{}", LL_MAX_RANKS + 8)), "{err}");
        // Past the old cap of 16 nodes (and DeepEP's 20): any node count up to the shared-memory bound.
        for (n, g) in [(17, 2), (32, 1), (24, 2), (20, 3), (64, 8), (4096, 8), (4096, 1)] {
            check_topology(&RankLayout { rank: 0, num_ranks: n * g, node_size: g }, &normal)
                .unwrap_or_else(|e| panic!("{n}x{g}: {}", e.message));
        }
        let many = RankLayout { rank: 0, num_ranks: 4097 * 2, node_size: 2 };
        let err = check_topology(&many, &normal).unwrap_err().message;
        assert!(err.contains("up to 4096 nodes") && err.contains("the buffer has 4097 (8194 ranks in nodes of 2)"), "{err}");
        let wide = RankLayout { rank: 0, num_ranks: 32, node_size: 16 };
        let err = check_topology(&wide, &normal).unwrap_err().message;
        assert!(err.contains("nodes of up to 8 GPUs") && err.contains("the buffer's have 16"), "{err}");
        let uneven = RankLayout { rank: 0, num_ranks: 12, node_size: 8 };
        let err = check_topology(&uneven, &normal).unwrap_err().message;
        assert!(err.contains("8 GPUs per node do not divide the buffer's 12 ranks"), "{err}");
    }

    /// DeepEP's hints suffice: a buffer sized by get_{nvl,rdma}_buffer_size_hint fits every
    /// internode op of DeepEP's shape (hidden 7168, FP8 scales, top-8) with its default configs,
    /// for 2 to 256 nodes of 8 (the hints count nodes of 8: with nodes of G the caller asks for
    /// nodes x 8 ranks). Past DeepEP's tuned tables (160 ranks) the configs of 160 ranks.
    #[test]
    fn deepeps_hints_fit_the_rings() {
        for nodes in [2, 4, 8, 16, 20, 32, 64, 128, 256] {
            let r = nodes * 8;
            for kind in [ConfigKind::Dispatch, ConfigKind::Combine] {
                let config = default_config(kind, r.min(160), 132).unwrap();
                let nvl = config.nvl_buffer_size_hint(7168 * 2, r).unwrap();
                let rdma = config.rdma_buffer_size_hint(7168 * 2, r).unwrap();
                let layout = RankLayout { rank: 0, num_ranks: r, node_size: 8 };
                let dispatch_row = kernels::internode_dispatch_row_bytes(7168, 56, 8);
                let combine_row = kernels::internode_combine_row_bytes(7168 * 2, 8);
                for row in [dispatch_row, combine_row] {
                    plan_for_layout(&layout, &args(r, nvl, rdma), 132, &config, InternodeOp::Dispatch, row)
                        .unwrap_or_else(|e| panic!("{nodes} nodes, {kind:?}: {}", e.message));
                }
                // 2 GPUs as 2 nodes of 1, sized by the 16-rank hints (2 nodes of 8).
                let two = RankLayout { rank: 0, num_ranks: 2, node_size: 1 };
                let small = default_config(kind, 16, 132).unwrap();
                let (nvl, rdma) = (small.nvl_buffer_size_hint(7168 * 2, 16).unwrap(), small.rdma_buffer_size_hint(7168 * 2, 16).unwrap());
                plan_for_layout(&two, &args(2, nvl, rdma), 132, &small, InternodeOp::Dispatch, dispatch_row).unwrap();
            }
        }
    }

    #[test]
    fn small_regions_name_the_argument_and_the_hint() {
        let layout = RankLayout { rank: 0, num_ranks: 2, node_size: 1 };
        let config = default_config(ConfigKind::Dispatch, 16, 132).unwrap();
        let row = kernels::internode_dispatch_row_bytes(4096, 0, 8);
        let err = plan_for_layout(&layout, &args(2, 1 << 20, 1 << 30), 132, &config, InternodeOp::Dispatch, row).unwrap_err();
        assert!(err.message.starts_with("num_nvl_bytes (1048576) is too small for this internode dispatch"), "{}", err.message);
        assert!(err.message.contains("get_nvl_buffer_size_hint"), "{}", err.message);
        let err = plan_for_layout(&layout, &args(2, 1 << 30, 1 << 20), 132, &config, InternodeOp::Combine, row).unwrap_err();
        assert!(err.message.starts_with("num_rdma_bytes (1048576) is too small for this internode combine"), "{}", err.message);
        assert!(err.message.contains("get_rdma_buffer_size_hint"), "{}", err.message);
        let huge = InternodePlan { num_channels: 64, rdma_ring_tokens: i32::MAX, nvl_ring_tokens: i32::MAX };
        assert!(rdma_bytes_needed(huge, 2, 2, i64::MAX / 2).is_none());
        assert!(nvl_bytes_needed(huge, 8, i64::MAX).is_none());
    }

    #[test]
    fn the_scale_out_ring_grows_into_the_rdma_region_up_to_the_cap() {
        let (r, n, c, row) = (2, 2, 4, 14_416i64);
        let notify = 4 * r as i64 * kernels::INTERNODE_NOTIFY_SLOT_BYTES;
        let per_row = 2 * c as i64 * n as i64 * row;
        let ring = |bytes| grown_rdma_ring(128, c, r, n, row, bytes);
        // No room past the config's ring, or too little for it: the config's (the budget check errs).
        assert_eq!(ring(notify + 128 * per_row), 128);
        assert_eq!(ring(notify + 129 * per_row - 1), 128);
        assert_eq!(ring(0), 128);
        assert_eq!(ring(notify - 1), 128);
        // Exact fit, one byte short of the next row, then the cap.
        assert_eq!(ring(notify + 300 * per_row), 300);
        assert_eq!(ring(notify + 301 * per_row - 1), 300);
        assert_eq!(ring(notify + 512 * per_row), 512);
        assert_eq!(ring(notify + RDMA_RING_CAP as i64 * per_row), RDMA_RING_CAP);
        assert_eq!(ring(i64::MAX), RDMA_RING_CAP);
        // A config at or past the cap keeps its ring; a zero or overflowing row size keeps the config's.
        assert_eq!(grown_rdma_ring(2 * RDMA_RING_CAP, c, r, n, row, i64::MAX), 2 * RDMA_RING_CAP);
        assert_eq!(grown_rdma_ring(128, c, r, n, 0, i64::MAX), 128);
        assert_eq!(grown_rdma_ring(128, 64, r, i32::MAX, i64::MAX, i64::MAX), 128);
        // Whatever it picks fits: rdma_bytes_needed <= num_rdma_bytes.
        for bytes in [notify + 128 * per_row, notify + 200 * per_row + 7, 1 << 30, 1_000_000_000] {
            let plan = InternodePlan { num_channels: c, rdma_ring_tokens: ring(bytes), nvl_ring_tokens: 256 };
            assert!(rdma_bytes_needed(plan, r, n, row).unwrap() <= bytes, "{bytes}");
        }
    }

    /// DeepEP's test shape on 2 GPUs as 2 nodes of 1, the buffer sized by the 24-SM hint (16
    /// ranks): fewer SMs get longer combine rings; dispatch keeps the config's.
    #[test]
    fn a_hint_for_more_sms_leaves_room_for_longer_combine_rings() {
        let two = RankLayout { rank: 0, num_ranks: 2, node_size: 1 };
        let hint = DeepepConfig::new(24, 8, 256, 16, 128).unwrap();
        let rdma = hint.rdma_buffer_size_hint(7168 * 2, 16).unwrap();
        let dispatch_row = kernels::internode_dispatch_row_bytes(7168 * 2, 0, 8);
        let combine_row = kernels::internode_combine_row_bytes(7168 * 2, 8);
        let ring = |sms, op, row, bytes| {
            let config = DeepepConfig::new(sms, 8, 256, 16, 128).unwrap();
            plan_for_layout(&two, &args(2, 1 << 30, bytes), 132, &config, op, row).unwrap().rdma_ring_tokens
        };
        let combine: Vec<i32> = [8, 12, 16, 20, 24].iter().map(|&s| ring(s, InternodeOp::Combine, combine_row, rdma)).collect();
        for (i, &c) in combine.iter().enumerate() {
            assert!((128..=RDMA_RING_CAP).contains(&c), "{combine:?}");
            assert!(i == 0 || c <= combine[i - 1], "{combine:?}");
        }
        assert!(combine[0] >= 3 * 128 && combine[1] >= 2 * 128, "{combine:?}");
        for sms in [8, 24] {
            assert_eq!(ring(sms, InternodeOp::Dispatch, dispatch_row, rdma), 128);
            assert_eq!(ring(sms, InternodeOp::Dispatch, dispatch_row, 1_000_000_000), 128);
        }
        // DeepEP's own test passes 1e9 bytes: the cap at every SM count.
        assert_eq!(ring(24, InternodeOp::Combine, combine_row, 1_000_000_000), RDMA_RING_CAP);
    }

    #[test]
    fn traffic_counters_need_a_buffer_across_nodes_and_an_int64_vector_of_eight() {
        use crate::error::DeepepStatus;
        let across = Buffer::without_resources_in_nodes(args(2, 1 << 30, 1 << 30), 132, 1);
        let within = Buffer::without_resources(args(2, 1 << 30, 0), 132);
        let mut storage = [0i64; 8];
        let data = storage.as_mut_ptr().cast();
        let vector = |dtype, n| crate::tensor::vector_at(data, dtype, n);
        let null = std::ptr::null_mut();
        let plain = query_traffic(&within, &vector(DEEPEP_DTYPE_INT64, 8), null).unwrap_err();
        assert!(plain.message.contains("across nodes"), "{}", plain.message);
        let dtype = query_traffic(&across, &vector(DEEPEP_DTYPE_INT32, 8), null).unwrap_err();
        assert!(dtype.message.contains("traffic"), "{}", dtype.message);
        let shape = query_traffic(&across, &vector(DEEPEP_DTYPE_INT64, 4), null).unwrap_err();
        assert!(shape.message.contains("traffic"), "{}", shape.message);
        // Valid arguments reach the resources, which this buffer has none of.
        let valid = query_traffic(&across, &vector(DEEPEP_DTYPE_INT64, 8), null).unwrap_err();
        assert_eq!(valid.status, DeepepStatus::DEEPEP_ERROR_NOT_AVAILABLE, "{}", valid.message);
    }

    #[test]
    fn row_sizes_are_16_byte_multiples_with_room_for_every_part() {
        // Header 16 + x + scales + ids + weights, each part padded to 16 bytes.
        assert_eq!(kernels::internode_dispatch_row_bytes(7168 * 2, 0, 8), 16 + 14336 + 0 + 32 + 32);
        assert_eq!(kernels::internode_dispatch_row_bytes(7168, 56, 8), 16 + 7168 + 224 + 32 + 32);
        assert_eq!(kernels::internode_dispatch_row_bytes(4096, 0, 1), 16 + 4096 + 16 + 16);
        assert_eq!(kernels::internode_combine_row_bytes(4096, 0), 4096);
        assert_eq!(kernels::internode_combine_row_bytes(4096, 9), 4096 + 48);
    }
}
