//! Internode combine: reduces the rows a dispatch delivered back onto their source ranks, inside
//! each node first (docs/internode.md). Two kernels, no host wait: the notify round (every rank
//! has finished its previous op; DeepEP's in-place rewrite of the two heads), then the data kernel.
use std::os::raw::c_void;

use super::{plan_for, InternodeOp, InternodePlan};
use crate::buffer::Buffer;
use crate::config::DeepepConfig;
use crate::ensure_arg;
use crate::error::Result;
use crate::kernels::{self, InternodeCombineParams, InternodeNotifyParams};
use crate::normal::combine::{check_combine_weights, check_combine_x, combine_outputs};
use crate::outputs::{check_output, check_required, DeepepOutputs};
use crate::tensor::{check, check_aligned16, check_opt, check_shape, DeepepDtype::*, DeepepTensor, TensorView};

/// Arguments of one internode combine, DeepEP's: the handle entries under their combine names.
/// Absent optional tensors have dtype 0.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DeepepInternodeCombineArgs {
    /// [Nr, H] bfloat16: one row per token this rank received in the dispatch.
    pub x: DeepepTensor,
    /// Optional [Nr, K] float32.
    pub topk_weights: DeepepTensor,
    /// Optional [T, H] bfloat16 each.
    pub bias_0: DeepepTensor,
    pub bias_1: DeepepTensor,
    /// The handle's recv_src_meta [Nr, 8] uint8.
    pub src_meta: DeepepTensor,
    /// The handle's is_token_in_rank [T, R] bool (T: the combined rows).
    pub is_combined_token_in_rank: DeepepTensor,
    /// The handle's recv_rdma_channel_prefix_matrix [N, C], recv_rdma_rank_prefix_sum [N],
    /// recv_gbl_channel_prefix_matrix [R, C].
    pub rdma_channel_prefix_matrix: DeepepTensor,
    pub rdma_rank_prefix_sum: DeepepTensor,
    pub gbl_channel_prefix_matrix: DeepepTensor,
    /// The handle's send_rdma_head [T, N] and send_nvl_head [Nrdma, G] int32, rewritten in place
    /// as DeepEP's combine does.
    pub combined_rdma_head: DeepepTensor,
    pub combined_nvl_head: DeepepTensor,
    /// [T, H] bfloat16 output.
    pub combined_x: DeepepTensor,
    /// [T, K] float32 output; present iff topk_weights is.
    pub combined_topk_weights: DeepepTensor,
    pub config: DeepepConfig,
}

/// The combine's outputs, in DeepEP's order.
pub const COMBINE_OUTPUTS: [&str; 2] = ["combined_x", "combined_topk_weights"];

struct Plan<'a> {
    x: TensorView<'a>,
    weights: Option<TensorView<'a>>,
    handle: [TensorView<'a>; 5],
    src_meta: *const i32,
    bias: [*const c_void; 2],
    channels: InternodePlan,
    num_tokens: i64,
    num_rdma_rows: i64,
    hidden: i64,
    num_topk: i64,
    row_bytes: i64,
}

impl Plan<'_> {
    fn outputs(&self) -> Result<DeepepOutputs> {
        combine_outputs(self.num_tokens, self.hidden, self.x.dtype, self.weights.map(|_| self.num_topk))
    }
}

/// The outputs' geometry (deepep_internode_combine_outputs): combined_x [T, H] bfloat16,
/// combined_topk_weights [T, K] float32 (absent without topk_weights), T =
/// is_combined_token_in_rank's rows.
pub fn combine_outputs_for(buffer: &Buffer, a: &DeepepInternodeCombineArgs) -> Result<DeepepOutputs> {
    validate(buffer, a)?.outputs()
}

fn validate<'a>(buffer: &Buffer, a: &'a DeepepInternodeCombineArgs) -> Result<Plan<'a>> {
    let l = &buffer.layout;
    super::check_topology(l, &buffer.args)?;
    let (r, n, g) = (l.num_ranks as i64, (l.num_ranks / l.node_size) as i64, l.node_size as i64);
    let (x, hidden_bytes) = check_combine_x(&a.x)?;
    let (nr, h) = (x.dims()[0], x.dims()[1]);
    let (weights, k) = check_combine_weights(&a.topk_weights, nr)?;
    let row_bytes = kernels::internode_combine_row_bytes(hidden_bytes as i32, k as i32);
    let channels = plan_for(buffer, &a.config, InternodeOp::Combine, row_bytes)?;
    let c = channels.num_channels as i64;

    let meta = check("src_meta", Some(&a.src_meta), &[DEEPEP_DTYPE_UINT8], 2)?;
    check_shape("src_meta", &meta, &[nr, 8])?;
    let in_rank = check("is_combined_token_in_rank", Some(&a.is_combined_token_in_rank), &[DEEPEP_DTYPE_BOOL], 2)?;
    ensure_arg!(
        in_rank.dims()[1] == r,
        "is_combined_token_in_rank must have {r} columns (one per rank), got shape {:?}",
        in_rank.dims()
    );
    let t = in_rank.dims()[0];
    let matrix = |name: &str, tensor: &'a DeepepTensor, shape: &[i64]| -> Result<TensorView<'a>> {
        let v = check(name, Some(tensor), &[DEEPEP_DTYPE_INT32], shape.len())?;
        ensure_arg!(
            v.dims() == shape,
            "{name} must have shape {shape:?} ({r} ranks in {n} nodes, config.num_sms / 2 = {c} channels), got {:?}: \
             combine must use the num_sms of the dispatch that made the handle",
            v.dims()
        );
        Ok(v)
    };
    let rdma_cpm = matrix("rdma_channel_prefix_matrix", &a.rdma_channel_prefix_matrix, &[n, c])?;
    let rdma_prefix = matrix("rdma_rank_prefix_sum", &a.rdma_rank_prefix_sum, &[n])?;
    let gbl_cpm = matrix("gbl_channel_prefix_matrix", &a.gbl_channel_prefix_matrix, &[r, c])?;
    let rdma_head = matrix("combined_rdma_head", &a.combined_rdma_head, &[t, n])?;
    let nvl_head = check("combined_nvl_head", Some(&a.combined_nvl_head), &[DEEPEP_DTYPE_INT32], 2)?;
    ensure_arg!(nvl_head.dims()[1] == g, "combined_nvl_head must have {g} columns (GPUs per node), got shape {:?}", nvl_head.dims());
    let bias = |name: &str, b: &DeepepTensor| -> Result<*const c_void> {
        Ok(match check_opt(name, b, &[DEEPEP_DTYPE_BFLOAT16], 2)? {
            Some(v) => {
                check_shape(name, &v, &[t, h])?;
                check_aligned16(name, &v)?;
                v.ptr() as *const c_void
            }
            None => std::ptr::null(),
        })
    };
    let bias = [bias("bias_0", &a.bias_0)?, bias("bias_1", &a.bias_1)?];
    let num_rdma_rows = nvl_head.dims()[0];
    Ok(Plan {
        x,
        weights,
        handle: [rdma_cpm, rdma_prefix, gbl_cpm, rdma_head, nvl_head],
        // Read as int32 pairs by the kernel (checked there only); unaligned: not checked.
        src_meta: if meta.ptr() as usize % 4 == 0 { meta.ptr() as *const i32 } else { std::ptr::null() },
        bias,
        channels,
        num_tokens: t,
        num_rdma_rows,
        hidden: h,
        num_topk: k,
        row_bytes,
    })
}

/// Validates, then launches the notify round and the data kernel on `stream` (NULL: the comm stream).
pub fn combine(buffer: &Buffer, a: &DeepepInternodeCombineArgs, stream: *mut c_void) -> Result<()> {
    let plan = validate(buffer, a)?;
    let want = plan.outputs()?;
    let out = check_required(COMBINE_OUTPUTS[0], &a.combined_x, want.get(0))?;
    check_aligned16("combined_x", &out)?;
    let out_weights = check_output(COMBINE_OUTPUTS[1], &a.combined_topk_weights, want.get(1))?
        .map_or(std::ptr::null_mut(), |o| o.ptr().cast::<f32>());
    let [rdma_cpm, rdma_prefix, gbl_cpm, rdma_head, nvl_head] = plan.handle;
    buffer.with_resources(|res| {
        let stream = res.stream_or_comm(stream);
        let common = plan.channels.common(buffer, res);
        let notify = InternodeNotifyParams {
            common,
            is_token_in_rank: std::ptr::null(),
            num_tokens_per_rank: std::ptr::null(),
            num_tokens_per_rdma_rank: std::ptr::null(),
            num_tokens_per_expert: std::ptr::null(),
            topk_idx: std::ptr::null(),
            rdma_channel_prefix_matrix: std::ptr::null_mut(),
            gbl_channel_prefix_matrix: std::ptr::null_mut(),
            recv_rdma_channel_prefix_matrix: rdma_cpm.ptr().cast(),
            recv_rdma_rank_prefix_sum: rdma_prefix.ptr().cast(),
            recv_gbl_channel_prefix_matrix: std::ptr::null_mut(),
            recv_gbl_rank_prefix_sum: std::ptr::null_mut(),
            combined_rdma_head: rdma_head.ptr().cast(),
            combined_nvl_head: nvl_head.ptr().cast(),
            counts: std::ptr::null_mut(),
            num_tokens: plan.num_tokens,
            num_rdma_rows: plan.num_rdma_rows,
            num_topk: 0,
            topk_idx_is_int32: 0,
            num_experts: 0,
            expert_alignment: 1,
            cached: 0,
            num_worst_tokens: 0,
            dispatch: 0,
        };
        let table = res.dev_comm.build().table();
        // SAFETY: params point at validated tensors, the live window and workspace; the launcher
        // is of the devComm's build; remote_kind is the buffer's.
        let rc = unsafe { kernels::entry(table.launch_internode_notify)(res.dev_comm.as_ptr(), &notify, res.remote_kind, stream) };
        kernels::launch_result("internode combine notify", rc)?;
        let params = InternodeCombineParams {
            common,
            x: plan.x.ptr(),
            topk_weights: plan.weights.map_or(std::ptr::null(), |w| w.ptr() as *const f32),
            bias_0: plan.bias[0],
            bias_1: plan.bias[1],
            rdma_channel_prefix_matrix: rdma_cpm.ptr() as *const i32,
            rdma_rank_prefix_sum: rdma_prefix.ptr() as *const i32,
            gbl_channel_prefix_matrix: gbl_cpm.ptr() as *const i32,
            combined_rdma_head: rdma_head.ptr().cast(),
            combined_nvl_head: nvl_head.ptr().cast(),
            src_meta: plan.src_meta,
            combined_x: out.ptr(),
            combined_topk_weights: out_weights,
            num_tokens: plan.num_tokens,
            num_recv_rows: plan.x.dims()[0],
            num_rdma_recv_rows: plan.num_rdma_rows,
            hidden_bytes: (plan.hidden * 2) as i32,
            num_topk: plan.num_topk as i32,
            row_bytes: plan.row_bytes as i32,
            reserved: 0,
        };
        // SAFETY: as the notify launch above.
        let rc = unsafe { kernels::entry(table.launch_internode_combine)(res.dev_comm.as_ptr(), &params, res.remote_kind, stream) };
        kernels::launch_result("internode combine", rc)
    })
}
