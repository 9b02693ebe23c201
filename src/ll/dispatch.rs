//! LL dispatch: checks DeepEP's contract (widened limits) and launches
//! `deepep::ll::dispatch` for the send phase, the receive phase, or both.
use std::os::raw::c_void;

use super::{check_region, common, opt_ptr, phases_for, receive_half, slots, LlLayout, LlShape};
use crate::buffer::Buffer;
use crate::ensure_arg;
use crate::error::Result;
use crate::kernels::{self, LlDispatchParams, LL_MAX_TOPK, LL_PHASE_SEND};
use crate::tensor::{check, check_opt, check_shape, check_strided, DeepepDtype::*, DeepepTensor, TensorView};

/// Arguments of one LL dispatch (`Buffer::low_latency_dispatch`). The caller
/// allocates the outputs; absent optional tensors have dtype 0.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
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

fn check_args(buffer: &Buffer, a: &DeepepLowLatencyDispatchArgs) -> Result<Checked> {
    let r = buffer.layout.num_ranks as i64;
    let x = check("x", Some(&a.x), &[DEEPEP_DTYPE_BFLOAT16], 2)?;
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
    ensure_arg!(a.use_ue8m0 == 0 || h % 512 == 0, "use_ue8m0 packs 4 scales per int32: hidden ({h}) must be a multiple of 512");
    let el = shape.local_experts();
    let rows = r * m;
    let recv_x = check("packed_recv_x", Some(&a.packed_recv_x), &[if fp8 { DEEPEP_DTYPE_FLOAT8_E4M3 } else { DEEPEP_DTYPE_BFLOAT16 }], 3)?;
    check_shape("packed_recv_x", &recv_x, &[el, rows, h])?;
    if fp8 {
        let (dtype, cols) = if a.use_ue8m0 != 0 { (DEEPEP_DTYPE_INT32, h / 512) } else { (DEEPEP_DTYPE_FLOAT32, h / 128) };
        let scales = check_strided("packed_recv_x_scales", &a.packed_recv_x_scales, &[dtype], 3)?;
        check_shape("packed_recv_x_scales", &scales, &[el, rows, cols])?;
        check_column_major("packed_recv_x_scales", &scales, rows, cols)?;
    } else {
        ensure_arg!(a.packed_recv_x_scales.dtype == 0, "packed_recv_x_scales must be absent without use_fp8");
    }
    let count = check("packed_recv_count", Some(&a.packed_recv_count), &[DEEPEP_DTYPE_INT32], 1)?;
    check_shape("packed_recv_count", &count, &[el])?;
    let src = check("packed_recv_src_info", Some(&a.packed_recv_src_info), &[DEEPEP_DTYPE_INT32], 2)?;
    check_shape("packed_recv_src_info", &src, &[el, rows])?;
    let range = check("packed_recv_layout_range", Some(&a.packed_recv_layout_range), &[DEEPEP_DTYPE_INT64], 2)?;
    check_shape("packed_recv_layout_range", &range, &[el, r])?;
    if let Some(s) = check_opt("cumulative_local_expert_recv_stats", &a.cumulative_local_expert_recv_stats, &[DEEPEP_DTYPE_INT32], 1)? {
        check_shape("cumulative_local_expert_recv_stats", &s, &[el])?;
    }
    if let Some(s) = check_opt("dispatch_wait_recv_cost_stats", &a.dispatch_wait_recv_cost_stats, &[DEEPEP_DTYPE_INT64], 1)? {
        check_shape("dispatch_wait_recv_cost_stats", &s, &[r])?;
    }
    Ok(Checked { shape, num_tokens: t, num_topk: k, topk_is_int32: topk.dtype == DEEPEP_DTYPE_INT32 })
}

/// DeepEP's scale layout: column-major in the last two dims, i.e. strides (cols*rows, 1, rows).
fn check_column_major(name: &str, t: &TensorView<'_>, rows: i64, cols: i64) -> Result<()> {
    let s = &t.raw.strides[..3];
    ensure_arg!(
        s == [cols * rows, 1, rows],
        "{name} must be column-major in its last two dims (strides ({}, 1, {rows}), DeepEP's layout), got strides {:?}",
        cols * rows,
        s
    );
    Ok(())
}

/// Launches the phases in `a.phases` on `stream` (NULL: the comm stream). A send
/// (phases 1 or 3) takes the next buffer half and writes it to `buffer_idx`; a
/// receive-only call (2) uses the half in `buffer_idx` from its send.
pub fn dispatch(buffer: &Buffer, a: &DeepepLowLatencyDispatchArgs, stream: *mut c_void, buffer_idx: &mut i32) -> Result<()> {
    let phases = phases_for(a.phases)?;
    let checked = check_args(buffer, a)?;
    let receive_only_half = if phases & LL_PHASE_SEND == 0 { Some(receive_half(*buffer_idx)?) } else { None };
    let fp8 = a.use_fp8 != 0;
    buffer.with_resources(|res| {
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
        // SAFETY: params point at validated tensors and this buffer's live window/workspace;
        // the devComm outlives the launch (resources are held by the lock).
        let rc = unsafe {
            kernels::deepep_launch_ll_dispatch(res.dev_comm.as_ptr(), &params, res.remote_kind, res.ll_blocks(), stream)
        };
        kernels::launch_result("deepep::ll::dispatch", rc)?;
        *buffer_idx = parity;
        Ok(())
    })
}
