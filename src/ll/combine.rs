//! LL combine: checks the handle and inputs and launches `deepep::ll::combine`
//! for the send phase, the receive phase, or both.
use std::os::raw::c_void;

use super::{
    check_hidden, combine_layout, common, opt_ptr, phases_for, receive_half, recv_plan, LlHost, LlKind, LlShape, PlannedOp,
    RecvPlan, MAX_TOKENS_PER_RANK,
};
use crate::buffer::{Buffer, Resources};
use crate::ensure_arg;
use crate::error::Result;
use crate::kernels::{self, LlCombineParams, LlCommon, LL_MAX_TOPK, LL_PHASE_RECV, LL_PHASE_SEND};
use crate::outputs::{check_output, DeepepOutputs};
use crate::tensor::{check, check_aligned16, check_opt, check_shape, DeepepDtype::*, DeepepTensor};

/// Arguments of one LL combine (`Buffer::low_latency_combine`). Absent optional
/// tensors have dtype 0.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeepepLowLatencyCombineArgs {
    /// [E_l, R*M, H] bfloat16, contiguous: the experts' outputs in the dispatch's packed
    /// layout. With zero_copy the data is read from the zero-copy view instead.
    pub x: DeepepTensor,
    /// [T, K] int64 (or int32): the same top-k as the dispatch.
    pub topk_idx: DeepepTensor,
    /// [T, K] float32.
    pub topk_weights: DeepepTensor,
    /// The dispatch handle: src_info [E_l, R*M] int32 and layout_range [E_l, R] int64.
    pub src_info: DeepepTensor,
    pub layout_range: DeepepTensor,
    /// Optional [R] int64: GPU cycles waited per expert rank are added.
    pub combine_wait_recv_cost_stats: DeepepTensor,
    /// [T, H] bfloat16 output (deepep_low_latency_combine_outputs describes it).
    pub out: DeepepTensor,
    pub num_max_dispatch_tokens_per_rank: i32,
    pub num_experts: i32,
    pub use_logfmt: i32,
    pub zero_copy: i32,
    /// 1: send only (return_recv_hook), 2: receive only (the hook), 3: both.
    pub phases: i32,
    pub reserved: i32,
}

/// combine's output: combined_x [T, H] bfloat16, contiguous. T is at most
/// num_max_dispatch_tokens_per_rank, so at most [`MAX_TOKENS_PER_RANK`].
pub fn outputs(num_tokens: i64, hidden: i64) -> Result<DeepepOutputs> {
    ensure_arg!(
        (0..=MAX_TOKENS_PER_RANK).contains(&num_tokens),
        "num_tokens must be in [0, {MAX_TOKENS_PER_RANK}] (at most num_max_dispatch_tokens_per_rank), got {num_tokens}"
    );
    check_hidden(hidden)?;
    let mut o = DeepepOutputs::default();
    o.push(DEEPEP_DTYPE_BFLOAT16, &[num_tokens, hidden]);
    Ok(o)
}

impl PlannedOp for DeepepLowLatencyCombineArgs {
    type Params = LlCombineParams;
    const KIND: LlKind = LlKind::Combine;

    fn plans(host: &mut LlHost) -> &mut [Option<RecvPlan<Self, Self::Params>>; 2] {
        &mut host.combine_plans
    }

    fn common(params: &mut Self::Params) -> &mut LlCommon {
        &mut params.common
    }

    fn set_phases(&mut self, phases: i32) {
        self.phases = phases;
    }

    fn launch(res: &Resources, params: &Self::Params, stream: *mut c_void) -> Result<()> {
        let launch = kernels::entry(res.dev_comm.build().table().launch_ll_combine);
        // SAFETY: params point at validated tensors and this buffer's live window/workspace; the
        // launcher is of the devComm's build.
        let rc = unsafe { launch(res.dev_comm.as_ptr(), params, res.remote_kind, res.ll_blocks(), stream) };
        kernels::launch_result("deepep::ll::combine", rc)
    }
}

/// Launches the phases in `a.phases` on `stream` (NULL: the comm stream); the
/// buffer half works as in [`super::dispatch::dispatch`].
pub fn combine(buffer: &Buffer, a: &DeepepLowLatencyCombineArgs, stream: *mut c_void, buffer_idx: &mut i32) -> Result<()> {
    // The hook with its send's args: launch what the send kept.
    if a.phases == LL_PHASE_RECV && (*buffer_idx == 0 || *buffer_idx == 1) {
        if let Some(done) = super::receive_planned(buffer, a, *buffer_idx, stream) {
            return done;
        }
    }
    let phases = phases_for(a.phases)?;
    let r = buffer.layout.num_ranks as i64;
    let x = check("x", Some(&a.x), &[DEEPEP_DTYPE_BFLOAT16], 3)?;
    check_aligned16("x", &x)?; // rows read with 16-byte loads
    let (el, rows, h) = (x.dims()[0], x.dims()[1], x.dims()[2]);
    let m = a.num_max_dispatch_tokens_per_rank as i64;
    let shape = LlShape::new(m, h, a.num_experts as i64, r)?;
    check_shape("x", &x, &[shape.local_experts(), r * m, h])?;
    let topk = check("topk_idx", Some(&a.topk_idx), &[DEEPEP_DTYPE_INT64, DEEPEP_DTYPE_INT32], 2)?;
    let (t, k) = (topk.dims()[0], topk.dims()[1]);
    ensure_arg!(t <= m, "topk_idx has {t} tokens, more than num_max_dispatch_tokens_per_rank ({m})");
    ensure_arg!(k >= 1 && k <= LL_MAX_TOPK, "topk_idx has {k} columns; low-latency mode supports 1 to {LL_MAX_TOPK}");
    let weights = check("topk_weights", Some(&a.topk_weights), &[DEEPEP_DTYPE_FLOAT32], 2)?;
    check_shape("topk_weights", &weights, &[t, k])?;
    let src = check("src_info", Some(&a.src_info), &[DEEPEP_DTYPE_INT32], 2)?;
    check_shape("src_info", &src, &[el, rows])?;
    let range = check("layout_range", Some(&a.layout_range), &[DEEPEP_DTYPE_INT64], 2)?;
    check_shape("layout_range", &range, &[el, r])?;
    // The caller's out must be exactly what deepep_low_latency_combine_outputs describes; its
    // rows are written with 16-byte stores.
    if let Some(out) = check_output("out", &a.out, outputs(t, h)?.get(0))? {
        check_aligned16("out", &out)?;
    }
    if let Some(s) = check_opt("combine_wait_recv_cost_stats", &a.combine_wait_recv_cost_stats, &[DEEPEP_DTYPE_INT64], 1)? {
        check_shape("combine_wait_recv_cost_stats", &s, &[r])?;
    }
    let logfmt = a.use_logfmt != 0;
    ensure_arg!(!(logfmt && a.zero_copy != 0), "zero_copy cannot be combined with use_logfmt (as in DeepEP)");
    let receive_only_half = if phases & LL_PHASE_SEND == 0 { Some(receive_half(*buffer_idx)?) } else { None };
    match receive_only_half {
        Some(half) => super::check_receive(buffer, LlKind::Combine, half)?,
        None => super::before_send(buffer, shape, stream)?,
    }
    let plan = buffer.with_resources(|res| {
        let stream = res.stream_or_comm(stream);
        // The size check does not depend on the half: check before taking one.
        combine_layout(buffer, res, "low_latency_combine", shape, logfmt, 0)?;
        let parity = receive_only_half.unwrap_or_else(|| buffer.next_ll_parity());
        let layout = combine_layout(buffer, res, "low_latency_combine", shape, logfmt, parity)?;
        let params = LlCombineParams {
            common: common(buffer, res, shape, &layout, k, phases, parity),
            x: a.x.data,
            topk_idx: a.topk_idx.data,
            topk_weights: a.topk_weights.data.cast(),
            src_info: a.src_info.data.cast(),
            layout_range: a.layout_range.data.cast(),
            out: a.out.data,
            combine_wait_recv_cost_stats: opt_ptr(&a.combine_wait_recv_cost_stats),
            num_tokens: t as i32,
            topk_idx_is_int32: (topk.dtype == DEEPEP_DTYPE_INT32) as i32,
            zero_copy: a.zero_copy,
            use_logfmt: a.use_logfmt,
            reserved: [0; 2],
        };
        DeepepLowLatencyCombineArgs::launch(res, &params, stream)?;
        *buffer_idx = parity;
        Ok((phases == LL_PHASE_SEND).then(|| recv_plan(*a, params)))
    })?;
    match receive_only_half {
        Some(half) => super::after_receive(buffer, LlKind::Combine, half),
        None => super::after_send(buffer, shape, *buffer_idx, plan),
    }
    Ok(())
}

