//! LL dispatch: checks DeepEP's contract (widened limits) and launches
//! `deepep::ll::dispatch` for the send phase, the receive phase, or both.
use std::os::raw::c_void;

use super::{
    check_region, common, opt_ptr, phases_for, receive_half, recv_plan, slots, LlHost, LlKind, LlLayout, LlShape, PlannedOp,
    RecvPlan,
};
use crate::buffer::{Buffer, Resources};
use crate::ensure_arg;
use crate::error::Result;
use crate::kernels::{self, LlCommon, LlDispatchParams, LL_MAX_TOPK, LL_PHASE_RECV, LL_PHASE_SEND};
use crate::outputs::{check_output, DeepepOutputs};
use crate::tensor::{check, check_aligned16, check_opt, check_shape, DeepepDtype, DeepepDtype::*, DeepepTensor};

/// Arguments of one LL dispatch (`Buffer::low_latency_dispatch`). The caller
/// allocates the outputs as deepep_low_latency_dispatch_outputs describes them; absent
/// optional tensors have dtype 0.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeepepLowLatencyDispatchArgs {
    /// [T, H] bfloat16, contiguous, T <= num_max_dispatch_tokens_per_rank.
    pub x: DeepepTensor,
    /// [T, K] int64 (or int32), K <= 16; -1 skips a slot.
    pub topk_idx: DeepepTensor,
    /// Optional [E_l] int32: received counts are added.
    pub cumulative_local_expert_recv_stats: DeepepTensor,
    /// Optional [R] int64: GPU cycles waited per source rank are added.
    pub dispatch_wait_recv_cost_stats: DeepepTensor,
    /// [E_l, R*M, H] bfloat16, or float8_e4m3fn with use_fp8.
    pub packed_recv_x: DeepepTensor,
    /// use_fp8: float32 [E_l, R*M, H/128] with strides (H/128*R*M, 1, R*M); with use_ue8m0
    /// int32 [E_l, R*M, H/512] with strides (H/512*R*M, 1, R*M). Absent without use_fp8.
    pub packed_recv_x_scales: DeepepTensor,
    /// [E_l] int32.
    pub packed_recv_count: DeepepTensor,
    /// [E_l, R*M] int32.
    pub packed_recv_src_info: DeepepTensor,
    /// [E_l, R] int64: (begin << 32) | count per source rank.
    pub packed_recv_layout_range: DeepepTensor,
    pub num_max_dispatch_tokens_per_rank: i32,
    pub num_experts: i32,
    pub use_fp8: i32,
    pub round_scale: i32,
    pub use_ue8m0: i32,
    /// 1: send only (return_recv_hook), 2: receive only (the hook), 3: both.
    pub phases: i32,
}

struct Checked {
    shape: LlShape,
    num_tokens: i64,
    num_topk: i64,
    topk_is_int32: bool,
}

/// The outputs of a dispatch of `shape`, in DeepEP's order (the order of the args' output
/// fields): packed_recv_x [E_l, R*M, H] (FP8 or BF16), packed_recv_x_scales (FP8 only, DeepEP's
/// column-major layout, else absent), packed_recv_count [E_l] int32, packed_recv_src_info
/// [E_l, R*M] int32, packed_recv_layout_range [E_l, R] int64. Each in an allocation of its own.
pub fn outputs(shape: LlShape, use_fp8: bool, use_ue8m0: bool) -> Result<DeepepOutputs> {
    let (el, rows, h) = (shape.local_experts(), shape.rows(), shape.hidden);
    let mut o = DeepepOutputs::default();
    o.push(if use_fp8 { DEEPEP_DTYPE_FLOAT8_E4M3 } else { DEEPEP_DTYPE_BFLOAT16 }, &[el, rows, h]);
    match scales(h, use_fp8, use_ue8m0)? {
        // Column-major in the last two dims: strides (cols*rows, 1, rows).
        Some((dtype, cols)) => o.push_strided(dtype, &[el, rows, cols], &[cols * rows, 1, rows]),
        None => o.push_absent(),
    };
    o.push(DEEPEP_DTYPE_INT32, &[el]);
    o.push(DEEPEP_DTYPE_INT32, &[el, rows]);
    o.push(DEEPEP_DTYPE_INT64, &[el, shape.num_ranks]);
    Ok(o)
}

/// dtype and columns of the FP8 scales: one float32 per 128 channels, or with UE8M0 four
/// packed exponents per int32 (one per 512 channels). None without FP8.
fn scales(hidden: i64, use_fp8: bool, use_ue8m0: bool) -> Result<Option<(DeepepDtype, i64)>> {
    ensure_arg!(use_fp8 || !use_ue8m0, "round_scale and use_ue8m0 require use_fp8=True");
    if !use_fp8 {
        return Ok(None);
    }
    if !use_ue8m0 {
        return Ok(Some((DEEPEP_DTYPE_FLOAT32, hidden / 128)));
    }
    ensure_arg!(hidden % 512 == 0, "use_ue8m0 packs 4 scales per int32: hidden ({hidden}) must be a multiple of 512");
    Ok(Some((DEEPEP_DTYPE_INT32, hidden / 512)))
}

/// The args' output fields, in [`outputs`]' order.
fn output_fields(a: &DeepepLowLatencyDispatchArgs) -> [(&'static str, &DeepepTensor); 5] {
    [
        ("packed_recv_x", &a.packed_recv_x),
        ("packed_recv_x_scales", &a.packed_recv_x_scales),
        ("packed_recv_count", &a.packed_recv_count),
        ("packed_recv_src_info", &a.packed_recv_src_info),
        ("packed_recv_layout_range", &a.packed_recv_layout_range),
    ]
}

/// The caller's outputs must be exactly what [`outputs`] (deepep_low_latency_dispatch_outputs)
/// describes for the args' shape and flags; packed_recv_x, whose rows the receive writes with
/// 16-byte stores, 16-byte aligned (the others are written per element).
fn check_outputs(a: &DeepepLowLatencyDispatchArgs, shape: LlShape) -> Result<()> {
    let want = outputs(shape, a.use_fp8 != 0, a.use_ue8m0 != 0)?;
    for (i, (name, given)) in output_fields(a).into_iter().enumerate() {
        let view = check_output(name, given, want.get(i))?;
        if let (0, Some(rows)) = (i, view) {
            check_aligned16(name, &rows)?;
        }
    }
    Ok(())
}

fn check_args(buffer: &Buffer, a: &DeepepLowLatencyDispatchArgs) -> Result<Checked> {
    let r = buffer.layout.num_ranks as i64;
    let x = check("x", Some(&a.x), &[DEEPEP_DTYPE_BFLOAT16], 2)?;
    check_aligned16("x", &x)?; // the send reads its rows with 16-byte loads
    let (t, h) = (x.dims()[0], x.dims()[1]);
    let m = a.num_max_dispatch_tokens_per_rank as i64;
    let shape = LlShape::new(m, h, a.num_experts as i64, r)?;
    ensure_arg!(t <= m, "x has {t} tokens, more than num_max_dispatch_tokens_per_rank ({m})");
    let topk = check("topk_idx", Some(&a.topk_idx), &[DEEPEP_DTYPE_INT64, DEEPEP_DTYPE_INT32], 2)?;
    ensure_arg!(topk.dims()[0] == t, "topk_idx must have {t} rows (one per token of x), got shape {:?}", topk.dims());
    let k = topk.dims()[1];
    ensure_arg!(k >= 1 && k <= LL_MAX_TOPK, "topk_idx has {k} columns; low-latency mode supports 1 to {LL_MAX_TOPK}");
    let fp8 = a.use_fp8 != 0;
    ensure_arg!(a.use_ue8m0 == 0 || a.round_scale != 0, "use_ue8m0 requires round_scale=True");
    ensure_arg!(fp8 || (a.round_scale == 0 && a.use_ue8m0 == 0), "round_scale and use_ue8m0 require use_fp8=True");
    check_outputs(a, shape)?;
    let el = shape.local_experts();
    if let Some(s) = check_opt("cumulative_local_expert_recv_stats", &a.cumulative_local_expert_recv_stats, &[DEEPEP_DTYPE_INT32], 1)? {
        check_shape("cumulative_local_expert_recv_stats", &s, &[el])?;
    }
    if let Some(s) = check_opt("dispatch_wait_recv_cost_stats", &a.dispatch_wait_recv_cost_stats, &[DEEPEP_DTYPE_INT64], 1)? {
        check_shape("dispatch_wait_recv_cost_stats", &s, &[r])?;
    }
    Ok(Checked { shape, num_tokens: t, num_topk: k, topk_is_int32: topk.dtype == DEEPEP_DTYPE_INT32 })
}

impl PlannedOp for DeepepLowLatencyDispatchArgs {
    type Params = LlDispatchParams;
    const KIND: LlKind = LlKind::Dispatch;

    fn plans(host: &mut LlHost) -> &mut [Option<RecvPlan<Self, Self::Params>>; 2] {
        &mut host.dispatch_plans
    }

    fn common(params: &mut Self::Params) -> &mut LlCommon {
        &mut params.common
    }

    fn set_phases(&mut self, phases: i32) {
        self.phases = phases;
    }

    fn launch(res: &Resources, params: &Self::Params, stream: *mut c_void) -> Result<()> {
        // SAFETY: params point at validated tensors and this buffer's live window/workspace;
        // the devComm outlives the launch (resources are held by the lock).
        let launch = kernels::entry(res.dev_comm.build().table().launch_ll_dispatch);
        let rc = unsafe { launch(res.dev_comm.as_ptr(), params, res.remote_kind, res.ll_blocks(), stream) };
        kernels::launch_result("deepep::ll::dispatch", rc)
    }
}

/// Launches the phases in `a.phases` on `stream` (NULL: the comm stream). A send
/// (phases 1 or 3) takes the next buffer half and writes it to `buffer_idx`; a
/// receive-only call (2) uses the half in `buffer_idx` from its send.
pub fn dispatch(buffer: &Buffer, a: &DeepepLowLatencyDispatchArgs, stream: *mut c_void, buffer_idx: &mut i32) -> Result<()> {
    // The hook with its send's args: launch what the send kept.
    if a.phases == LL_PHASE_RECV && (*buffer_idx == 0 || *buffer_idx == 1) {
        if let Some(done) = super::receive_planned(buffer, a, *buffer_idx, stream) {
            return done;
        }
    }
    let phases = phases_for(a.phases)?;
    let checked = check_args(buffer, a)?;
    let receive_only_half = if phases & LL_PHASE_SEND == 0 { Some(receive_half(*buffer_idx)?) } else { None };
    match receive_only_half {
        Some(half) => super::check_receive(buffer, LlKind::Dispatch, half)?,
        None => super::before_send(buffer, checked.shape, stream)?,
    }
    let fp8 = a.use_fp8 != 0;
    let plan = buffer.with_resources(|res| {
        let stream = res.stream_or_comm(stream);
        let slots = slots(res, checked.shape, checked.num_topk, fp8, false)?;
        // Check the size before taking a half, so that a rejected call leaves the parity alone.
        let probe = LlLayout::new(checked.shape, slots, buffer.rdma_offset() as u64, 0);
        check_region(buffer, "low_latency_dispatch", checked.shape, &probe)?;
        let parity = receive_only_half.unwrap_or_else(|| buffer.next_ll_parity());
        let layout = LlLayout::new(checked.shape, slots, buffer.rdma_offset() as u64, parity);
        let params = LlDispatchParams {
            common: common(buffer, res, checked.shape, &layout, checked.num_topk, phases, parity),
            x: a.x.data,
            topk_idx: a.topk_idx.data,
            packed_recv_x: a.packed_recv_x.data,
            packed_recv_x_scales: opt_ptr(&a.packed_recv_x_scales),
            packed_recv_count: a.packed_recv_count.data.cast(),
            packed_recv_src_info: a.packed_recv_src_info.data.cast(),
            packed_recv_layout_range: a.packed_recv_layout_range.data.cast(),
            cumulative_local_expert_recv_stats: opt_ptr(&a.cumulative_local_expert_recv_stats),
            dispatch_wait_recv_cost_stats: opt_ptr(&a.dispatch_wait_recv_cost_stats),
            num_tokens: checked.num_tokens as i32,
            topk_idx_is_int32: checked.topk_is_int32 as i32,
            use_fp8: fp8 as i32,
            round_scale: a.round_scale,
            use_ue8m0: a.use_ue8m0,
            dispatch_slot_bytes: slots.dispatch_slot as i32,
            count_bytes: slots.count_bytes as i32,
            reserved: 0,
        };
        DeepepLowLatencyDispatchArgs::launch(res, &params, stream)?;
        *buffer_idx = parity;
        Ok((phases == LL_PHASE_SEND).then(|| recv_plan(*a, params)))
    })?;
    match receive_only_half {
        Some(half) => super::after_receive(buffer, LlKind::Dispatch, half),
        None => super::after_send(buffer, checked.shape, *buffer_idx, plan),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Args whose outputs are `outputs(shape, fp8, ue8m0)` at a fake non-NULL address.
    fn args_with_outputs(shape: LlShape, fp8: bool, ue8m0: bool) -> DeepepLowLatencyDispatchArgs {
        let o = outputs(shape, fp8, ue8m0).unwrap();
        let mut described = o.tensors;
        for t in described.iter_mut().filter(|t| t.dtype != 0) {
            t.data = 0x1000 as *mut c_void;
        }
        let absent = DeepepOutputs::default().tensors[0];
        DeepepLowLatencyDispatchArgs {
            x: absent,
            topk_idx: absent,
            cumulative_local_expert_recv_stats: absent,
            dispatch_wait_recv_cost_stats: absent,
            packed_recv_x: described[0],
            packed_recv_x_scales: described[1],
            packed_recv_count: described[2],
            packed_recv_src_info: described[3],
            packed_recv_layout_range: described[4],
            num_max_dispatch_tokens_per_rank: shape.max_tokens as i32,
            num_experts: shape.num_experts as i32,
            use_fp8: fp8 as i32,
            round_scale: ue8m0 as i32,
            use_ue8m0: ue8m0 as i32,
            phases: 3,
        }
    }

    #[test]
    fn outputs_as_described_pass_and_others_are_named() {
        let shape = LlShape::new(128, 7168, 288, 4).unwrap();
        for (fp8, ue8m0) in [(false, false), (true, false), (true, true)] {
            check_outputs(&args_with_outputs(shape, fp8, ue8m0), shape).unwrap();
        }
        let mut a = args_with_outputs(shape, true, false);
        a.packed_recv_x_scales.strides = [56 * 512, 56, 1, 0]; // row-major: not DeepEP's layout
        assert!(check_outputs(&a, shape).unwrap_err().message.starts_with("packed_recv_x_scales must have strides [28672, 1, 512]"));
        let mut a = args_with_outputs(shape, false, false);
        a.packed_recv_layout_range.shape[1] = 8;
        assert!(check_outputs(&a, shape).unwrap_err().message.starts_with("packed_recv_layout_range must have shape [72, 4]"));
        let mut a = args_with_outputs(shape, true, false);
        a.use_fp8 = 0;
        assert!(check_outputs(&a, shape).unwrap_err().message.starts_with("packed_recv_x must have dtype bfloat16"));
        let mut a = args_with_outputs(shape, true, false);
        a.packed_recv_count.data = std::ptr::null_mut();
        assert!(check_outputs(&a, shape).unwrap_err().message.contains("packed_recv_count has a NULL data pointer"));
        // Rows written with 16-byte stores: 16-byte aligned; the per-element outputs: their elements'.
        let mut a = args_with_outputs(shape, false, false);
        a.packed_recv_x.data = 0x1008 as *mut c_void;
        let err = check_outputs(&a, shape).unwrap_err().message;
        assert!(err.starts_with("packed_recv_x must start at a 16-byte aligned address (got 0x1008)"), "{err}");
        let mut a = args_with_outputs(shape, false, false);
        a.packed_recv_layout_range.data = 0x1008 as *mut c_void;
        a.packed_recv_count.data = 0x1004 as *mut c_void;
        check_outputs(&a, shape).unwrap();
        a.packed_recv_layout_range.data = 0x1004 as *mut c_void;
        let err = check_outputs(&a, shape).unwrap_err().message;
        assert!(err.starts_with("packed_recv_layout_range must start at an address aligned to its 8-byte int64"), "{err}");
    }
}
