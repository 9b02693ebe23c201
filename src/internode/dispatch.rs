//! Internode dispatch in two calls, as intranode ([`crate::normal::dispatch`]): [`prepare`]
//! validates, launches the notify kernel and (non-cached, without num_worst_tokens) waits on the
//! host for the receive counts; the caller allocates the outputs; [`launch`] runs the data kernel.
use std::os::raw::c_void;

use super::{plan_for, InternodeOp, InternodePlan};
use crate::buffer::Buffer;
use crate::config::DeepepConfig;
use crate::ensure_arg;
use crate::error::Result;
use crate::kernels::{self, InternodeDispatchParams, InternodeNotifyParams};
use crate::normal::dispatch::{check_routing, check_scales, received_rows, RecvCountsPlan, Scales, Topk};
use crate::outputs::{check_output, check_required, DeepepOutputs};
use crate::tensor::{
    check, check_aligned16, check_opt, check_shape, DeepepDtype, DeepepDtype::*, DeepepTensor, TensorView,
    DTYPE_ABSENT,
};

/// Arguments of one internode dispatch (both calls take the same struct). Absent optional
/// tensors have dtype 0. N = nodes, G = GPUs per node, C = config.num_sms / 2.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DeepepInternodeDispatchArgs {
    /// [T, H]: bf16 (fp16/fp32 also move), or float8_e4m3fn with `x_scales`.
    pub x: DeepepTensor,
    /// Optional [T, S] float32 or int32, any strides.
    pub x_scales: DeepepTensor,
    /// Optional [T, K] int64 or int32; -1 = no expert. Needs `topk_weights`.
    pub topk_idx: DeepepTensor,
    /// Optional [T, K] float32.
    pub topk_weights: DeepepTensor,
    /// [R] int32 (non-cached only).
    pub num_tokens_per_rank: DeepepTensor,
    /// [N] int32 (non-cached only).
    pub num_tokens_per_rdma_rank: DeepepTensor,
    /// [T, R] bool.
    pub is_token_in_rank: DeepepTensor,
    /// [E] int32 (non-cached only).
    pub num_tokens_per_expert: DeepepTensor,
    /// [N, C] int32: written (non-cached) or the handle's (cached).
    pub rdma_channel_prefix_matrix: DeepepTensor,
    /// [R, C] int32: written (non-cached) or the handle's (cached).
    pub gbl_channel_prefix_matrix: DeepepTensor,
    /// [N, C], [N], [R, C], [R] int32, written. Cached: the two prefix sums ([N], [R]) are the
    /// handle's, checked against the counts the peers send (a fault names an entry that differs,
    /// which is then rewritten); the handle's two matrices are checked against is_token_in_rank
    /// the same way.
    pub recv_rdma_channel_prefix_matrix: DeepepTensor,
    pub recv_rdma_rank_prefix_sum: DeepepTensor,
    pub recv_gbl_channel_prefix_matrix: DeepepTensor,
    pub recv_gbl_rank_prefix_sum: DeepepTensor,
    /// [T, N] int32, written (non-cached only).
    pub send_rdma_head: DeepepTensor,
    pub config: DeepepConfig,
    /// Non-zero: reuse a handle's routing (no top-k, no host wait).
    pub cached: i32,
    /// num_recv_tokens_per_expert entries are rounded up to a multiple of this (>= 1).
    pub expert_alignment: i32,
    /// > 0: outputs have exactly this many rows and there is no host wait.
    pub num_worst_tokens: i32,
    pub reserved: i32,
}

/// Outputs of deepep_internode_dispatch, as deepep_internode_dispatch_outputs describes them.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DeepepInternodeDispatchOutputs {
    /// [Nr, H], x's dtype.
    pub recv_x: DeepepTensor,
    /// [Nr, S] row-major, x_scales' dtype; present iff x_scales is.
    pub recv_x_scales: DeepepTensor,
    /// [Nr, K], topk_idx's dtype; present iff topk_idx is.
    pub recv_topk_idx: DeepepTensor,
    /// [Nr, K] float32; present iff topk_weights is.
    pub recv_topk_weights: DeepepTensor,
    /// [Nr, 8] uint8 (DeepEP's SourceMeta); absent when cached.
    pub recv_src_meta: DeepepTensor,
    /// [Nrdma, G] int32; absent when cached.
    pub send_nvl_head: DeepepTensor,
}

/// The handle's int32 outputs, in DeepEP's handle order.
pub const HANDLE_OUTPUTS: [&str; 7] = [
    "rdma_channel_prefix_matrix",
    "gbl_channel_prefix_matrix",
    "recv_rdma_channel_prefix_matrix",
    "recv_rdma_rank_prefix_sum",
    "recv_gbl_channel_prefix_matrix",
    "recv_gbl_rank_prefix_sum",
    "send_rdma_head",
];
/// The receive outputs, in [`DeepepInternodeDispatchOutputs`]' field order.
pub const RECV_OUTPUTS: [&str; 6] =
    ["recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights", "recv_src_meta", "send_nvl_head"];

/// What a dispatch caller allocates for the handle ([`HANDLE_OUTPUTS`] order), int32 in one
/// allocation: rdma_channel_prefix_matrix [N, C] and gbl_channel_prefix_matrix [R, C],
/// recv_rdma_channel_prefix_matrix [N, C] (recomputed by a cached dispatch too),
/// recv_rdma_rank_prefix_sum [N], recv_gbl_channel_prefix_matrix [R, C] (recomputed too),
/// recv_gbl_rank_prefix_sum [R], send_rdma_head [T, N]. Cached: only the two recomputed ones; the
/// handle's are passed for the others but send_rdma_head (absent).
pub fn handle_outputs(num_ranks: i64, num_nodes: i64, num_tokens: i64, num_channels: i64, cached: bool) -> Result<DeepepOutputs> {
    ensure_arg!(num_tokens >= 0, "num_tokens must be >= 0, got {num_tokens}");
    let (r, n, c) = (num_ranks, num_nodes, num_channels);
    let mut o = DeepepOutputs::default();
    let first = if cached {
        o.push_absent();
        o.push_absent();
        o.push(DEEPEP_DTYPE_INT32, &[n, c])
    } else {
        let first = o.push(DEEPEP_DTYPE_INT32, &[n, c]);
        o.push_after(first, &[r, c]);
        o.push_after(first, &[n, c]);
        first
    };
    if cached {
        o.push_absent();
        o.push_after(first, &[r, c]);
        o.push_absent();
        o.push_absent();
    } else {
        o.push_after(first, &[n]);
        o.push_after(first, &[r, c]);
        o.push_after(first, &[r]);
        o.push_after(first, &[num_tokens, n]);
    }
    o.checked(&HANDLE_OUTPUTS)
}

/// What a dispatch caller allocates for the received rows ([`RECV_OUTPUTS`] order): recv_x
/// [Nr, H], recv_x_scales [Nr, S], recv_topk_idx [Nr, K], recv_topk_weights [Nr, K] float32 (as
/// intranode), recv_src_meta [Nr, 8] uint8 and send_nvl_head [Nrdma, G] int32 (both absent when
/// cached).
pub fn recv_outputs(
    rows: (i64, i64),
    node_size: i64,
    x: (DeepepDtype, i64),
    scales: Option<(DeepepDtype, i64)>,
    topk: Option<(DeepepDtype, i64)>,
    cached: bool,
) -> Result<DeepepOutputs> {
    let (num_rows, num_rdma_rows) = rows;
    ensure_arg!(num_rows >= 0, "the receive count must be >= 0, got {num_rows}");
    ensure_arg!(num_rdma_rows >= 0, "the scale-out receive count must be >= 0, got {num_rdma_rows}");
    let mut o = received_rows(num_rows, x, scales, topk);
    if cached {
        o.push_absent();
        o.push_absent();
    } else {
        o.push(DEEPEP_DTYPE_UINT8, &[num_rows, 8]);
        o.push(DEEPEP_DTYPE_INT32, &[num_rdma_rows, node_size]);
    }
    o.checked(&RECV_OUTPUTS)
}

/// Rows of the receive outputs and of send_nvl_head: in cached mode the handle's counts, else
/// num_worst_tokens when > 0 (both), else prepare's counts.
pub fn num_recv_rows(cached: bool, num_worst_tokens: i32, num_recv_tokens: i32, num_rdma_recv_tokens: i32) -> Result<(i64, i64)> {
    if !cached && num_worst_tokens > 0 {
        return Ok((num_worst_tokens as i64, num_worst_tokens as i64));
    }
    let what = if cached { "the handle's receive counts" } else { "the counts prepare returned" };
    ensure_arg!(
        num_recv_tokens >= 0 && (cached || num_rdma_recv_tokens >= 0),
        "num_recv_tokens and num_rdma_recv_tokens must be {what} (>= 0), got {num_recv_tokens} and {num_rdma_recv_tokens}"
    );
    Ok((num_recv_tokens as i64, num_rdma_recv_tokens.max(0) as i64))
}

/// The handle's geometry for these args (deepep_internode_dispatch_handle_outputs): reads x,
/// config.num_sms and cached only.
pub fn handle_outputs_for(buffer: &Buffer, a: &DeepepInternodeDispatchArgs) -> Result<DeepepOutputs> {
    super::check_topology(&buffer.layout, &buffer.args)?;
    let (x, _) = check_x(a)?;
    let channels = crate::normal::channel_plan(&a.config, buffer.num_device_sms())?;
    let l = &buffer.layout;
    handle_outputs(l.num_ranks as i64, (l.num_ranks / l.node_size) as i64, x.dims()[0], channels.num_channels as i64, a.cached != 0)
}

/// The receive geometry for complete args (deepep_internode_dispatch_outputs).
pub fn recv_outputs_for(buffer: &Buffer, a: &DeepepInternodeDispatchArgs, num_recv: i32, num_rdma_recv: i32) -> Result<DeepepOutputs> {
    let plan = validate(buffer, a)?;
    plan.recv_outputs(num_recv_rows(plan.cached, plan.num_worst_tokens, num_recv, num_rdma_recv)?, buffer.layout.node_size)
}

fn check_x(a: &DeepepInternodeDispatchArgs) -> Result<(TensorView<'_>, i64)> {
    let x = check("x", Some(&a.x), &[DEEPEP_DTYPE_BFLOAT16, DEEPEP_DTYPE_FLOAT16, DEEPEP_DTYPE_FLOAT32, DEEPEP_DTYPE_FLOAT8_E4M3], 2)?;
    check_aligned16("x", &x)?;
    let (t, h) = (x.dims()[0], x.dims()[1]);
    let hidden_bytes = h.checked_mul(x.dtype.size()).unwrap_or(i64::MAX);
    ensure_arg!(
        hidden_bytes % 16 == 0 && hidden_bytes > 0,
        "x: hidden size {h} ({hidden_bytes} bytes per row) must give a positive multiple of 16 bytes per row"
    );
    ensure_arg!(hidden_bytes <= i32::MAX as i64, "x: {hidden_bytes} bytes per row is too large");
    ensure_arg!(t <= i32::MAX as i64, "x has {t} tokens; at most {} are supported", i32::MAX);
    Ok((x, hidden_bytes))
}

/// Everything the kernels need, checked.
struct Plan {
    channels: InternodePlan,
    num_tokens: i64,
    hidden_bytes: i64,
    x_dtype: DeepepDtype,
    x: *const c_void,
    scales: Option<Scales>,
    topk: Option<Topk>,
    num_experts: i32,
    is_token_in_rank: *const u8,
    per_rank: *const i32,
    per_rdma_rank: *const i32,
    per_expert: *const i32,
    handle: [*mut i32; 7],
    cached: bool,
    expert_alignment: i32,
    num_worst_tokens: i32,
    row_bytes: i64,
}

impl Plan {
    fn recv_outputs(&self, rows: (i64, i64), node_size: i32) -> Result<DeepepOutputs> {
        recv_outputs(
            rows,
            node_size as i64,
            (self.x_dtype, self.hidden_bytes / self.x_dtype.size()),
            self.scales.map(|(dtype, _, s, _, _)| (dtype, s)),
            self.topk.map(|(dtype, _, _, k)| (dtype, k)),
            self.cached,
        )
    }
}

fn validate(buffer: &Buffer, a: &DeepepInternodeDispatchArgs) -> Result<Plan> {
    let l = &buffer.layout;
    super::check_topology(l, &buffer.args)?;
    let (r, n) = (l.num_ranks as i64, (l.num_ranks / l.node_size) as i64);
    let (x, hidden_bytes) = check_x(a)?;
    let t = x.dims()[0];
    let scales = check_scales(&a.x_scales, x.dtype, t)?;
    let in_rank = check("is_token_in_rank", Some(&a.is_token_in_rank), &[DEEPEP_DTYPE_BOOL], 2)?;
    check_shape("is_token_in_rank", &in_rank, &[t, r])?;
    let cached = a.cached != 0;
    let topk_cols = if a.topk_idx.dtype == 0 { 0 } else { a.topk_idx.shape[1].clamp(0, 1024) };
    let row_bytes = kernels::internode_dispatch_row_bytes(hidden_bytes as i32, scales.map_or(0, |s| s.2) as i32, topk_cols as i32);
    let channels = plan_for(buffer, &a.config, InternodeOp::Dispatch, row_bytes)?;
    let c = channels.num_channels as i64;

    let topk_ids = check_opt("topk_idx", &a.topk_idx, &[DEEPEP_DTYPE_INT64, DEEPEP_DTYPE_INT32], 2)?;
    let topk_weights = check_opt("topk_weights", &a.topk_weights, &[DEEPEP_DTYPE_FLOAT32], 2)?;
    let (topk, num_experts, per_rank, per_rdma_rank, per_expert) = if cached {
        ensure_arg!(topk_ids.is_none() && topk_weights.is_none(), "cached dispatch (handle given) takes no topk_idx/topk_weights");
        (None, 0, std::ptr::null(), std::ptr::null(), std::ptr::null())
    } else {
        let per_rank = check("num_tokens_per_rank", Some(&a.num_tokens_per_rank), &[DEEPEP_DTYPE_INT32], 1)?;
        check_shape("num_tokens_per_rank", &per_rank, &[r])?;
        let per_rdma = check("num_tokens_per_rdma_rank", Some(&a.num_tokens_per_rdma_rank), &[DEEPEP_DTYPE_INT32], 1)?;
        check_shape("num_tokens_per_rdma_rank", &per_rdma, &[n])?;
        let (topk, e, per_expert) = check_routing(&a.num_tokens_per_expert, topk_ids, topk_weights, t, r)?;
        (topk, e, per_rank.ptr() as *const i32, per_rdma.ptr() as *const i32, per_expert)
    };

    let want = handle_outputs(r, n, t, c, cached)?;
    // The handle a non-cached dispatch makes: the shapes a cached one's handle entries must have.
    let made = handle_outputs(r, n, t, c, false)?;
    let given = [
        &a.rdma_channel_prefix_matrix,
        &a.gbl_channel_prefix_matrix,
        &a.recv_rdma_channel_prefix_matrix,
        &a.recv_rdma_rank_prefix_sum,
        &a.recv_gbl_channel_prefix_matrix,
        &a.recv_gbl_rank_prefix_sum,
        &a.send_rdma_head,
    ];
    let mut handle = [std::ptr::null_mut(); 7];
    for (i, tensor) in given.iter().enumerate() {
        let name = HANDLE_OUTPUTS[i];
        handle[i] = if cached && matches!(i, 0 | 1 | 3 | 5) {
            // The handle's own: the routing the handle was made with, checked by the notify kernel.
            let spec = made.get(i);
            let shape = &spec.shape[..spec.ndim as usize];
            let m = check(name, Some(tensor), &[DEEPEP_DTYPE_INT32], shape.len())?;
            ensure_arg!(
                m.dims() == shape,
                "{name} must have shape {shape:?} (the handle of {r} ranks in {n} nodes, config.num_sms / 2 = {c} \
                 channels), got {:?}; a cached dispatch needs the config the handle was made with",
                m.dims()
            );
            m.ptr().cast()
        } else {
            check_output(name, tensor, want.get(i))?.map_or(std::ptr::null_mut(), |v| v.ptr().cast())
        };
    }
    ensure_arg!(a.expert_alignment >= 1, "expert_alignment must be >= 1, got {}", a.expert_alignment);
    ensure_arg!(a.num_worst_tokens >= 0, "num_worst_tokens must be >= 0, got {}", a.num_worst_tokens);
    Ok(Plan {
        channels,
        num_tokens: t,
        hidden_bytes,
        x_dtype: x.dtype,
        x: x.ptr(),
        scales,
        topk,
        num_experts,
        is_token_in_rank: in_rank.ptr() as *const u8,
        per_rank,
        per_rdma_rank,
        per_expert,
        handle,
        cached,
        expert_alignment: a.expert_alignment,
        num_worst_tokens: a.num_worst_tokens,
        row_bytes,
    })
}

/// What [`prepare`] learned (-1 when the host did not wait for the counts).
pub struct Prepared {
    pub num_recv_tokens: i32,
    pub num_rdma_recv_tokens: i32,
    pub num_local_experts: usize,
}

/// Validates, launches the notify kernel on `stream` (NULL: the comm stream) and, for a
/// non-cached dispatch without num_worst_tokens, waits for the receive counts.
pub fn prepare(buffer: &Buffer, args: &DeepepInternodeDispatchArgs, stream: *mut c_void, per_expert_out: &mut [i32]) -> Result<Prepared> {
    let plan = validate(buffer, args)?;
    let counts_plan = RecvCountsPlan::new(buffer, plan.cached, plan.num_worst_tokens, plan.num_experts, per_expert_out)?;
    let (wait_for_counts, num_local_experts) = (counts_plan.wait, counts_plan.num_local_experts);
    buffer.with_resources(|res| {
        let stream = res.stream_or_comm(stream);
        counts_plan.arm(res, stream)?;
        let common = plan.channels.common(buffer, res);
        let (topk_ptr, topk_k, topk_i32) = match plan.topk {
            Some((dtype, ids, _, k)) => (ids, k as i32, (dtype == DEEPEP_DTYPE_INT32) as i32),
            None => (std::ptr::null(), 0, 0),
        };
        let h = plan.handle;
        let params = InternodeNotifyParams {
            common,
            is_token_in_rank: plan.is_token_in_rank,
            num_tokens_per_rank: plan.per_rank,
            num_tokens_per_rdma_rank: plan.per_rdma_rank,
            num_tokens_per_expert: plan.per_expert,
            topk_idx: topk_ptr,
            rdma_channel_prefix_matrix: h[0],
            gbl_channel_prefix_matrix: h[1],
            recv_rdma_channel_prefix_matrix: h[2],
            recv_rdma_rank_prefix_sum: h[3],
            recv_gbl_channel_prefix_matrix: h[4],
            recv_gbl_rank_prefix_sum: h[5],
            combined_rdma_head: std::ptr::null_mut(),
            combined_nvl_head: std::ptr::null_mut(),
            counts: if wait_for_counts { res.recv_counts.device_ptr() } else { std::ptr::null_mut() },
            num_tokens: plan.num_tokens,
            num_rdma_rows: 0,
            num_topk: topk_k,
            topk_idx_is_int32: topk_i32,
            num_experts: plan.num_experts,
            expert_alignment: plan.expert_alignment,
            cached: plan.cached as i32,
            num_worst_tokens: plan.num_worst_tokens,
            dispatch: 1,
        };
        let launch = kernels::entry(res.dev_comm.build().table().launch_internode_notify);
        // SAFETY: params point at validated tensors, the live window and workspace; the launcher
        // is of the devComm's build; remote_kind is the buffer's.
        let rc = unsafe { launch(res.dev_comm.as_ptr(), &params, res.remote_kind, stream) };
        kernels::launch_result("internode dispatch notify", rc)?;
        let num_recv_tokens = counts_plan.collect(buffer, res, per_expert_out)?;
        let num_rdma_recv_tokens = match wait_for_counts {
            // SAFETY: the GPU wrote the scale-out count before num_recv_tokens (system fence).
            true => unsafe { std::ptr::addr_of!((*res.recv_counts.host_ptr()).num_rdma_recv_tokens).read_volatile() },
            false => -1,
        };
        Ok(Prepared { num_recv_tokens, num_rdma_recv_tokens, num_local_experts })
    })
}

/// Launches the data kernel into the caller's outputs.
pub fn launch(buffer: &Buffer, args: &DeepepInternodeDispatchArgs, outs: &DeepepInternodeDispatchOutputs, stream: *mut c_void) -> Result<()> {
    let plan = validate(buffer, args)?;
    // Nr is recv_x's rows, Nrdma send_nvl_head's (cached: none); every output as described.
    let nr = check("recv_x", Some(&outs.recv_x), &[plan.x_dtype], 2)?.dims()[0];
    let nrdma = match plan.cached {
        true => 0,
        false => check("send_nvl_head", Some(&outs.send_nvl_head), &[DEEPEP_DTYPE_INT32], 2)?.dims()[0],
    };
    let want = plan.recv_outputs((nr, nrdma), buffer.layout.node_size)?;
    let recv_x = check_required(RECV_OUTPUTS[0], &outs.recv_x, want.get(0))?;
    check_aligned16("recv_x", &recv_x)?;
    let ptr = |view: Option<TensorView<'_>>| view.map_or(std::ptr::null_mut(), |v| v.ptr());
    let recv_scales = ptr(check_output(RECV_OUTPUTS[1], &outs.recv_x_scales, want.get(1))?);
    let recv_topk = ptr(check_output(RECV_OUTPUTS[2], &outs.recv_topk_idx, want.get(2))?);
    let recv_weights = ptr(check_output(RECV_OUTPUTS[3], &outs.recv_topk_weights, want.get(3))?);
    let src_meta = ptr(check_output(RECV_OUTPUTS[4], &outs.recv_src_meta, want.get(4))?);
    let nvl_head = ptr(check_output(RECV_OUTPUTS[5], &outs.send_nvl_head, want.get(5))?);
    debug_assert!(plan.cached || outs.send_nvl_head.dtype != DTYPE_ABSENT);
    buffer.with_resources(|res| {
        let stream = res.stream_or_comm(stream);
        let common = plan.channels.common(buffer, res);
        let (scales_ptr, num_scales, st_tok, st_scale) = plan.scales.map_or((std::ptr::null(), 0, 0, 0), |s| (s.1, s.2, s.3, s.4));
        let (topk_ptr, weights_ptr, k, i32_ids) = plan
            .topk
            .map_or((std::ptr::null(), std::ptr::null(), 0, 0), |t| (t.1, t.2, t.3, (t.0 == DEEPEP_DTYPE_INT32) as i32));
        let h = plan.handle;
        let params = InternodeDispatchParams {
            common,
            x: plan.x,
            x_scales: scales_ptr,
            topk_idx: topk_ptr,
            topk_weights: weights_ptr,
            is_token_in_rank: plan.is_token_in_rank,
            recv_rdma_channel_prefix_matrix: h[2],
            recv_rdma_rank_prefix_sum: h[3],
            recv_gbl_channel_prefix_matrix: h[4],
            recv_gbl_rank_prefix_sum: h[5],
            recv_x: recv_x.ptr(),
            recv_x_scales: recv_scales,
            recv_topk_idx: recv_topk,
            recv_topk_weights: recv_weights.cast(),
            recv_src_meta: src_meta.cast(),
            send_rdma_head: h[6],
            send_nvl_head: nvl_head.cast(),
            num_tokens: plan.num_tokens,
            num_recv_rows: nr,
            num_rdma_recv_rows: nrdma,
            scale_stride_token: st_tok,
            scale_stride_scale: st_scale,
            hidden_bytes: plan.hidden_bytes as i32,
            num_scales: num_scales as i32,
            num_topk: k as i32,
            topk_idx_is_int32: i32_ids,
            num_experts: plan.num_experts,
            row_bytes: plan.row_bytes as i32,
        };
        let launch = kernels::entry(res.dev_comm.build().table().launch_internode_dispatch);
        // SAFETY: params point at validated tensors, the live window, devComm and workspace.
        let rc = unsafe { launch(res.dev_comm.as_ptr(), &params, res.remote_kind, stream) };
        kernels::launch_result("internode dispatch", rc)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outputs::DEEPEP_MAX_OP_OUTPUTS;

    fn dims(o: &DeepepOutputs, i: usize) -> Vec<i64> {
        o.get(i).shape[..o.get(i).ndim as usize].to_vec()
    }

    #[test]
    fn handle_outputs_are_one_int32_allocation_in_deepeps_order() {
        let (r, n, t, c) = (16, 2, 100, 12);
        let o = handle_outputs(r, n, t, c, false).unwrap();
        assert_eq!((o.count, o.num_allocations), (7, 1));
        let shapes: Vec<Vec<i64>> = (0..7).map(|i| dims(&o, i)).collect();
        assert_eq!(shapes, [vec![n, c], vec![r, c], vec![n, c], vec![n], vec![r, c], vec![r], vec![t, n]]);
        assert_eq!(o.allocation_elems[0], 2 * n * c + 2 * r * c + n + r + t * n);
        let cached = handle_outputs(r, n, t, c, true).unwrap();
        let absent: Vec<i32> = [0, 1, 3, 5, 6].iter().map(|&i| cached.get(i).dtype).collect();
        assert_eq!(absent, [0; 5], "the handle's are passed");
        assert_eq!(cached.allocation_elems[0], n * c + r * c, "the receive matrices, recomputed");
        assert!(handle_outputs(r, n, -1, c, false).unwrap_err().message.contains("num_tokens must be >= 0"));
    }

    #[test]
    fn recv_outputs_add_source_meta_and_nvl_head() {
        let o = recv_outputs((50, 30), 8, (DEEPEP_DTYPE_FLOAT8_E4M3, 7168), Some((DEEPEP_DTYPE_FLOAT32, 56)), Some((DEEPEP_DTYPE_INT64, 8)), false)
            .unwrap();
        assert_eq!(o.count, 6);
        assert_eq!((o.get(4).dtype, dims(&o, 4)), (DEEPEP_DTYPE_UINT8 as i32, vec![50, 8]));
        assert_eq!((o.get(5).dtype, dims(&o, 5)), (DEEPEP_DTYPE_INT32 as i32, vec![30, 8]));
        let cached = recv_outputs((50, 0), 8, (DEEPEP_DTYPE_BFLOAT16, 4096), None, None, true).unwrap();
        assert_eq!((cached.get(2).dtype, cached.get(4).dtype, cached.get(5).dtype), (0, 0, 0));
        assert!(recv_outputs((-1, 0), 8, (DEEPEP_DTYPE_BFLOAT16, 4096), None, None, true).is_err());
        // The host paths pass &outputs.tensors[0] as a DeepepInternodeDispatchOutputs.
        assert!(RECV_OUTPUTS.len() <= DEEPEP_MAX_OP_OUTPUTS && HANDLE_OUTPUTS.len() <= DEEPEP_MAX_OP_OUTPUTS);
        assert_eq!(std::mem::size_of::<DeepepInternodeDispatchOutputs>(), RECV_OUTPUTS.len() * std::mem::size_of::<DeepepTensor>());
    }

    #[test]
    fn receive_rows_follow_deepeps_rule() {
        assert_eq!(num_recv_rows(false, 0, 37, 20).unwrap(), (37, 20));
        assert_eq!(num_recv_rows(false, 512, -1, -1).unwrap(), (512, 512));
        assert_eq!(num_recv_rows(true, 512, 20, 0).unwrap(), (20, 0));
        assert!(num_recv_rows(false, 0, 37, -1).unwrap_err().message.contains("the counts prepare returned"));
    }
}
