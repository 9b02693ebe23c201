//! `get_dispatch_layout`: argument checks, the kernel launch, and a CPU
//! reference implementation of DeepEP's semantics used by the tests.
use std::os::raw::c_void;

use crate::buffer::Buffer;
use crate::config::{RankLayout, NUM_MAX_NVL_PEERS};
use crate::ensure_arg;
use crate::error::{Error, Result};
use crate::kernels::{self, LayoutParams};
use crate::outputs::{check_required, DeepepOutputs};
use crate::tensor::{check, DeepepDtype::*, DeepepTensor, TensorView, DTYPE_ABSENT};

/// Output and input descriptors of one layout call.
pub struct LayoutArgs<'a> {
    pub topk_idx: Option<&'a DeepepTensor>,
    pub num_experts: i32,
    pub num_tokens_per_rank: Option<&'a DeepepTensor>,
    pub num_tokens_per_rdma_rank: Option<&'a DeepepTensor>,
    pub num_tokens_per_expert: Option<&'a DeepepTensor>,
    pub is_token_in_rank: Option<&'a DeepepTensor>,
}

/// The layout's outputs, in DeepEP's order.
pub const LAYOUT_OUTPUTS: [&str; 4] =
    ["num_tokens_per_rank", "num_tokens_per_rdma_rank", "num_tokens_per_expert", "is_token_in_rank"];

/// Nodes the layout counts tokens for: num_ranks / 8 above 8 ranks, else none (DeepEP's
/// num_tokens_per_rdma_rank is None within one node).
pub fn layout_rdma_ranks(num_ranks: i32) -> i32 {
    layout_nodes(&RankLayout::one_node(0, num_ranks)).0
}

/// (nodes, GPUs per node) the layout counts tokens per node for: a buffer across nodes counts
/// its nodes; within one node, DeepEP's nodes of 8 above 8 ranks, else none (0).
pub fn layout_nodes(layout: &RankLayout) -> (i32, i32) {
    if layout.spans_nodes() || layout.num_ranks > NUM_MAX_NVL_PEERS {
        (layout.num_rdma_ranks(), layout.gpus_per_node())
    } else {
        (0, NUM_MAX_NVL_PEERS)
    }
}

/// What a layout caller allocates ([`LAYOUT_OUTPUTS`] order): num_tokens_per_rank int32 [R],
/// num_tokens_per_rdma_rank int32 [R / 8] (absent up to 8 ranks), num_tokens_per_expert int32
/// [E], these three in one allocation, and is_token_in_rank bool [T, R].
pub fn layout_outputs(num_ranks: i32, num_tokens: i64, num_experts: i32) -> Result<DeepepOutputs> {
    layout_outputs_in(&RankLayout::one_node(0, num_ranks), num_tokens, num_experts)
}

/// [`layout_outputs`] for a buffer's topology: num_tokens_per_rdma_rank has one entry per node
/// ([`layout_nodes`]).
pub fn layout_outputs_in(layout: &RankLayout, num_tokens: i64, num_experts: i32) -> Result<DeepepOutputs> {
    ensure_arg!(num_tokens >= 0, "num_tokens must be >= 0, got {num_tokens}");
    ensure_arg!(num_experts > 0, "num_experts must be positive, got {num_experts}");
    let (ranks, nodes) = (layout.num_ranks as i64, layout_nodes(layout).0 as i64);
    let mut o = DeepepOutputs::default();
    let per_rank = o.push(DEEPEP_DTYPE_INT32, &[ranks]);
    if nodes > 0 {
        o.push_after(per_rank, &[nodes]);
    } else {
        o.push_absent();
    }
    o.push_after(per_rank, &[num_experts as i64]);
    o.push(DEEPEP_DTYPE_BOOL, &[num_tokens, ranks]);
    o.checked(&LAYOUT_OUTPUTS)
}

/// Validates every argument against DeepEP's contract and builds kernel params
/// (workspace fields left for the caller).
pub fn build_params<'a>(num_ranks: i32, num_sms: i32, args: &LayoutArgs<'a>) -> Result<LayoutParams> {
    build_params_in(&RankLayout::one_node(0, num_ranks), num_sms, args)
}

/// [`build_params`] for a buffer's topology (nodes of [`layout_nodes`]).
pub fn build_params_in<'a>(layout: &RankLayout, num_sms: i32, args: &LayoutArgs<'a>) -> Result<LayoutParams> {
    let num_ranks = layout.num_ranks;
    let topk = check("topk_idx", args.topk_idx, &[DEEPEP_DTYPE_INT64, DEEPEP_DTYPE_INT32], 2)?;
    let (num_tokens, num_topk) = (topk.dims()[0], topk.dims()[1]);
    let num_experts = args.num_experts;
    let want = layout_outputs_in(layout, num_tokens, num_experts)?;
    ensure_arg!(
        num_experts % num_ranks == 0,
        "num_experts ({num_experts}) must be divisible by the number of ranks ({num_ranks})"
    );
    ensure_arg!(num_topk <= 1024, "topk_idx has {num_topk} columns; at most 1024 are supported");
    // Shared-memory histograms: experts + ranks + nodes counters plus a 32-token row tile.
    let (num_rdma_ranks, gpus_per_node) = layout_nodes(layout);
    let smem = 4 * (num_experts as i64 + num_ranks as i64 + num_rdma_ranks as i64) + 32 * num_ranks as i64;
    ensure_arg!(
        smem <= 96 * 1024,
        "num_experts ({num_experts}) with {num_ranks} ranks needs {smem} B of shared memory; the limit is 98304 B"
    );

    // Output i against layout_outputs' description; NULL only for an absent one.
    let output = |i: usize, given: Option<&'a DeepepTensor>| -> Result<TensorView<'a>> {
        let name = LAYOUT_OUTPUTS[i];
        check_required(name, given.ok_or_else(|| Error::invalid(format!("{name} must not be NULL")))?, want.get(i))
    };
    let per_rank = output(0, args.num_tokens_per_rank)?;
    let per_expert = output(2, args.num_tokens_per_expert)?;
    let in_rank = output(3, args.is_token_in_rank)?;
    let per_rdma_ptr = if want.get(1).dtype != DTYPE_ABSENT {
        output(1, args.num_tokens_per_rdma_rank)?.ptr().cast()
    } else {
        ensure_arg!(
            args.num_tokens_per_rdma_rank.is_none(),
            "num_tokens_per_rdma_rank must be NULL with {num_ranks} ranks in one node (it exists only above \
             {NUM_MAX_NVL_PEERS} ranks or across nodes)"
        );
        std::ptr::null_mut()
    };

    Ok(LayoutParams {
        topk_idx: topk.ptr() as *const c_void,
        num_tokens,
        num_topk: num_topk as i32,
        topk_idx_is_int32: (topk.dtype == DEEPEP_DTYPE_INT32) as i32,
        num_experts,
        num_ranks,
        num_rdma_ranks,
        num_ranks_per_rdma_rank: gpus_per_node,
        num_tokens_per_rank: per_rank.ptr().cast(),
        num_tokens_per_rdma_rank: per_rdma_ptr,
        num_tokens_per_expert: per_expert.ptr().cast(),
        is_token_in_rank: in_rank.ptr().cast(),
        accumulators: std::ptr::null_mut(),
        ticket: std::ptr::null_mut(),
        accumulators_capacity: 0,
        num_sms,
        reserved: 0,
    })
}

/// Launches the layout kernel on `stream` (NULL: the buffer's comm stream).
pub fn get_dispatch_layout(buffer: &Buffer, args: &LayoutArgs<'_>, stream: *mut c_void) -> Result<()> {
    let mut params = build_params_in(&buffer.layout, buffer.num_device_sms(), args)?;
    buffer.with_resources(|res| {
        let (accumulators, capacity) = res.layout_accumulators();
        params.accumulators = accumulators;
        params.accumulators_capacity = capacity;
        params.ticket = res.layout_ticket();
        // SAFETY: params points at validated tensors and our workspace.
        let needed = unsafe { kernels::deepep_dispatch_layout_workspace_elems(&params) };
        ensure_arg!(
            needed <= capacity,
            "get_dispatch_layout needs {needed} workspace counters, the workspace holds {capacity}"
        );
        let stream = res.stream_or_comm(stream);
        // SAFETY: all pointers in params were validated; stream belongs to this device.
        let rc = unsafe { kernels::deepep_launch_dispatch_layout(&params, stream) };
        kernels::launch_result("dispatch_layout", rc)
    })
}

/// CPU reference of DeepEP's layout semantics: (per rank, per rdma rank, per expert, is_token_in_rank).
pub fn reference_layout(
    topk_idx: &[i64],
    num_topk: usize,
    num_experts: i32,
    num_ranks: i32,
) -> (Vec<i32>, Option<Vec<i32>>, Vec<i32>, Vec<bool>) {
    reference_layout_in(&RankLayout::one_node(0, num_ranks), topk_idx, num_topk, num_experts)
}

/// [`reference_layout`] for a buffer's topology.
pub fn reference_layout_in(
    layout: &RankLayout,
    topk_idx: &[i64],
    num_topk: usize,
    num_experts: i32,
) -> (Vec<i32>, Option<Vec<i32>>, Vec<i32>, Vec<bool>) {
    let num_ranks = layout.num_ranks;
    let (nodes, gpus) = layout_nodes(layout);
    let (nodes, gpus) = (nodes as usize, gpus as usize);
    let num_tokens = if num_topk == 0 { 0 } else { topk_idx.len() / num_topk };
    let experts_per_rank = (num_experts / num_ranks) as i64;
    let mut per_rank = vec![0; num_ranks as usize];
    let mut per_expert = vec![0; num_experts as usize];
    let mut in_rank = vec![false; num_tokens * num_ranks as usize];
    let mut per_node = vec![0; nodes];
    for t in 0..num_tokens {
        let row = &mut in_rank[t * num_ranks as usize..(t + 1) * num_ranks as usize];
        for &e in &topk_idx[t * num_topk..(t + 1) * num_topk] {
            if e >= 0 && e < num_experts as i64 {
                per_expert[e as usize] += 1;
                row[(e / experts_per_rank) as usize] = true;
            }
        }
        for (r, hit) in row.iter().enumerate() {
            per_rank[r] += *hit as i32;
        }
        for (n, count) in per_node.iter_mut().enumerate() {
            let span = n * gpus..(n + 1) * gpus;
            *count += row[span].iter().any(|h| *h) as i32;
        }
    }
    (per_rank, (nodes > 0).then_some(per_node), per_expert, in_rank)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::DeepepDtype;

    #[test]
    fn reference_counts_duplicates_per_expert_once_per_rank_and_skips_negatives() {
        // 2 ranks, 4 experts (2 per rank); token 0 picks experts 0,0 (dup), token 1 picks 3,-1.
        let (per_rank, per_node, per_expert, in_rank) = reference_layout(&[0, 0, 3, -1], 2, 4, 2);
        assert_eq!(per_expert, vec![2, 0, 0, 1]);
        assert_eq!(per_rank, vec![1, 1]);
        assert_eq!(in_rank, vec![true, false, false, true]);
        assert!(per_node.is_none());
    }

    #[test]
    fn across_nodes_the_layout_counts_the_buffers_nodes() {
        // 2 ranks as 2 nodes of 1, 2 experts each: token 0 -> expert 2 (rank 1), token 1 -> experts
        // 0 and 3 (ranks 0 and 1).
        let two = RankLayout { rank: 0, num_ranks: 2, node_size: 1 };
        assert_eq!(layout_nodes(&two), (2, 1));
        let (_, per_node, _, _) = reference_layout_in(&two, &[2, -1, 0, 3], 2, 4);
        assert_eq!(per_node, Some(vec![1, 2]));
        let o = layout_outputs_in(&two, 16, 4).unwrap();
        assert_eq!((o.get(1).dtype, o.get(1).shape[0], o.offset[1]), (DEEPEP_DTYPE_INT32 as i32, 2, 2));
        // 12 ranks as 3 nodes of 4; within one node the answers stay DeepEP's.
        assert_eq!(layout_nodes(&RankLayout { rank: 0, num_ranks: 12, node_size: 4 }), (3, 4));
        assert_eq!(layout_nodes(&RankLayout::one_node(0, 8)), (0, 8));
        assert_eq!(layout_nodes(&RankLayout::one_node(0, 16)), (2, 8));
        let topk = desc(0x1000 as *mut c_void, DEEPEP_DTYPE_INT64, &[16, 2]);
        let (ranks, nodes) = (desc(0x1000 as *mut c_void, DEEPEP_DTYPE_INT32, &[2]), desc(0x1000 as *mut c_void, DEEPEP_DTYPE_INT32, &[2]));
        let (experts, in_rank) = (desc(0x1000 as *mut c_void, DEEPEP_DTYPE_INT32, &[4]), desc(0x1000 as *mut c_void, DEEPEP_DTYPE_BOOL, &[16, 2]));
        let args = LayoutArgs {
            topk_idx: Some(&topk),
            num_experts: 4,
            num_tokens_per_rank: Some(&ranks),
            num_tokens_per_rdma_rank: Some(&nodes),
            num_tokens_per_expert: Some(&experts),
            is_token_in_rank: Some(&in_rank),
        };
        let p = build_params_in(&two, 132, &args).unwrap();
        assert_eq!((p.num_rdma_ranks, p.num_ranks_per_rdma_rank), (2, 1));
        let one = build_params(2, 132, &args).unwrap_err();
        assert!(one.message.contains("num_tokens_per_rdma_rank must be NULL with 2 ranks in one node"), "{}", one.message);
    }

    #[test]
    fn reference_counts_nodes_above_eight_ranks() {
        // 16 ranks, 16 experts: token 0 -> ranks 1 and 9 (nodes 0, 1), token 1 -> ranks 2, 3 (node 0).
        let (_, per_node, _, _) = reference_layout(&[1, 9, 2, 3], 2, 16, 16);
        assert_eq!(per_node, Some(vec![2, 1]));
    }

    fn desc(ptr: *mut c_void, dtype: DeepepDtype, shape: &[i64]) -> DeepepTensor {
        let mut t = DeepepTensor { data: ptr, dtype: dtype as i32, ndim: shape.len() as i32, shape: [0; 4], strides: [0; 4] };
        let mut stride = 1;
        for d in (0..shape.len()).rev() {
            t.shape[d] = shape[d];
            t.strides[d] = stride;
            stride *= shape[d];
        }
        t
    }

    /// (dtype, shape, allocation, offset) of output i.
    fn geometry(o: &DeepepOutputs, i: usize) -> (i32, Vec<i64>, i32, i64) {
        let t = o.get(i);
        (t.dtype, t.shape[..t.ndim as usize].to_vec(), o.allocation[i], o.offset[i])
    }

    #[test]
    fn layout_outputs_share_one_count_allocation() {
        let (i32_, bool_) = (DEEPEP_DTYPE_INT32 as i32, DEEPEP_DTYPE_BOOL as i32);
        for (ranks, tokens) in [(2, 16), (8, 0), (16, 4096)] {
            let o = layout_outputs(ranks, tokens, 64).unwrap();
            let r = ranks as i64;
            assert_eq!(o.count, 4);
            assert_eq!(geometry(&o, 0), (i32_, vec![r], 0, 0));
            assert_eq!(geometry(&o, 3), (bool_, vec![tokens, r], 1, 0));
            assert_eq!(&o.get(3).strides[..2], &[r, 1]);
            if ranks > 8 {
                assert_eq!(geometry(&o, 1), (i32_, vec![r / 8], 0, r));
                assert_eq!(geometry(&o, 2), (i32_, vec![64], 0, r + r / 8));
            } else {
                assert_eq!((o.get(1).dtype, o.allocation[1]), (0, -1), "no rdma counts within a node");
                assert_eq!(geometry(&o, 2), (i32_, vec![64], 0, r));
            }
            assert_eq!(o.num_allocations, 2);
            assert_eq!(o.allocation_elems[..2], [r + layout_rdma_ranks(ranks) as i64 + 64, tokens * r]);
            assert_eq!(o.allocation_dtype[..2], [i32_, bool_]);
        }
        assert_eq!(layout_outputs(4, 16, 0).unwrap_err().message, "num_experts must be positive, got 0");
        assert_eq!(layout_outputs(4, -1, 8).unwrap_err().message, "num_tokens must be >= 0, got -1");
        let huge = layout_outputs(8, i64::MAX / 4, 8).unwrap_err();
        assert!(huge.message.starts_with("is_token_in_rank would have shape"), "{}", huge.message);
    }

    #[test]
    fn build_params_validates_every_argument() {
        let p = 0x1000 as *mut c_void;
        let topk = desc(p, DEEPEP_DTYPE_INT64, &[16, 8]);
        let ranks = desc(p, DEEPEP_DTYPE_INT32, &[4]);
        let experts = desc(p, DEEPEP_DTYPE_INT32, &[64]);
        let in_rank = desc(p, DEEPEP_DTYPE_BOOL, &[16, 4]);
        fn with<'a>(topk: &'a DeepepTensor, num_experts: i32, outs: [&'a DeepepTensor; 3]) -> LayoutArgs<'a> {
            LayoutArgs {
                topk_idx: Some(topk),
                num_experts,
                num_tokens_per_rank: Some(outs[0]),
                num_tokens_per_rdma_rank: None,
                num_tokens_per_expert: Some(outs[1]),
                is_token_in_rank: Some(outs[2]),
            }
        }
        let outs = [&ranks, &experts, &in_rank];
        let args = |topk, num_experts| with(topk, num_experts, outs);
        let ok = build_params(4, 132, &args(&topk, 64)).unwrap();
        assert_eq!((ok.num_tokens, ok.num_topk, ok.topk_idx_is_int32, ok.num_rdma_ranks), (16, 8, 0, 0));

        let err = build_params(4, 132, &args(&topk, 62)).unwrap_err();
        assert!(err.message.contains("num_experts (62) must be divisible by the number of ranks (4)"), "{}", err.message);
        let f32_topk = desc(p, DEEPEP_DTYPE_FLOAT32, &[16, 8]);
        assert!(build_params(4, 132, &args(&f32_topk, 64)).unwrap_err().message.contains("topk_idx must have dtype int64 or int32"));
        let mut strided = topk;
        strided.strides = [16, 1, 0, 0];
        assert!(build_params(4, 132, &args(&strided, 64)).unwrap_err().message.contains("contiguous"));
        let err = build_params(8, 132, &args(&topk, 64)).unwrap_err();
        assert_eq!(err.message, "num_tokens_per_rank must have shape [8], got [4]");
        let huge = build_params(4, 132, &args(&topk, 1 << 20)).unwrap_err();
        assert!(huge.message.contains("shared memory"), "{}", huge.message);

        // 16 ranks: the rdma counts are an output too, and strides must be as described.
        let (ranks, nodes) = (desc(p, DEEPEP_DTYPE_INT32, &[16]), desc(p, DEEPEP_DTYPE_INT32, &[2]));
        let in_rank = desc(p, DEEPEP_DTYPE_BOOL, &[16, 16]);
        let mut transposed = in_rank;
        transposed.strides = [1, 16, 0, 0];
        let nodes_of = |in_rank, rdma| {
            let args = LayoutArgs { num_tokens_per_rdma_rank: rdma, ..with(&topk, 64, [&ranks, &experts, in_rank]) };
            build_params(16, 132, &args).map(|p| p.num_rdma_ranks)
        };
        assert_eq!(nodes_of(&in_rank, Some(&nodes)).unwrap(), 2);
        assert_eq!(nodes_of(&in_rank, None).unwrap_err().message, "num_tokens_per_rdma_rank must not be NULL");
        let strided = nodes_of(&transposed, Some(&nodes)).unwrap_err();
        assert!(strided.message.contains("is_token_in_rank must have strides [16, 1]"), "{}", strided.message);
    }
}
