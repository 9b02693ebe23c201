//! Normal-mode dispatch in two calls, because the receive count is decided on
//! the GPU: [`prepare`] validates, launches the notify kernel and (non-cached,
//! without num_worst_tokens) waits on the host for the counts, as DeepEP does;
//! the caller allocates the outputs; [`launch`] runs the data kernel.
use std::os::raw::c_void;
use std::time::Instant;

use super::{plan_for, ChannelPlan};
use crate::buffer::{Buffer, NormalKernel};
use crate::config::DeepepConfig;
use crate::cuda;
use crate::ensure_arg;
use crate::error::{DeepepStatus, Error, Result};
use crate::kernels::{self, DispatchParams, NotifyParams, MAX_LOCAL_EXPERTS};
use crate::tensor::{check, check_aligned16, check_opt, check_shape, check_strided, DeepepDtype, DeepepDtype::*, DeepepTensor, TensorView};

/// Arguments of one intranode dispatch (both calls take the same struct).
/// Absent optional tensors have dtype 0.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DeepepIntranodeDispatchArgs {
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
    /// [T, R] bool.
    pub is_token_in_rank: DeepepTensor,
    /// [E] int32 (non-cached only); E / R local experts per rank.
    pub num_tokens_per_expert: DeepepTensor,
    /// [R, R] int32: written (non-cached) or the handle's (cached).
    pub rank_prefix_matrix: DeepepTensor,
    /// [R, C] int32, C = config.num_sms / 2: written (non-cached) or the handle's (cached).
    pub channel_prefix_matrix: DeepepTensor,
    /// [R, C] int32, written.
    pub recv_channel_prefix_matrix: DeepepTensor,
    /// [T, R] int32, written; optional in cached mode.
    pub send_head: DeepepTensor,
    pub config: DeepepConfig,
    /// Non-zero: reuse a handle's routing (no top-k, no host wait).
    pub cached: i32,
    /// num_recv_tokens_per_expert entries are rounded up to a multiple of this (>= 1).
    pub expert_alignment: i32,
    /// > 0: outputs have exactly this many rows and there is no host wait.
    pub num_worst_tokens: i32,
    pub reserved: i32,
}

/// Outputs of deepep_intranode_dispatch, allocated by the caller after
/// deepep_intranode_dispatch_prepare: N rows each.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DeepepIntranodeDispatchOutputs {
    /// [N, H], x's dtype.
    pub recv_x: DeepepTensor,
    /// [N, S] row-major, x_scales' dtype; present iff x_scales is.
    pub recv_x_scales: DeepepTensor,
    /// [N, K], topk_idx's dtype; present iff topk_idx is.
    pub recv_topk_idx: DeepepTensor,
    /// [N, K] float32; present iff topk_weights is.
    pub recv_topk_weights: DeepepTensor,
    /// [N] int32.
    pub recv_src_idx: DeepepTensor,
}

/// Everything the kernels need, checked.
struct Plan {
    channels: ChannelPlan,
    num_tokens: i64,
    hidden_bytes: i64,
    x_dtype: DeepepDtype,
    x: *const c_void,
    scales: Option<(DeepepDtype, *const c_void, i64, i64, i64)>, // dtype, ptr, S, strides
    topk: Option<(DeepepDtype, *const c_void, *const f32, i64)>,  // dtype, ids, weights, K
    num_experts: i32,
    is_token_in_rank: *const u8,
    num_tokens_per_rank: *const i32,
    num_tokens_per_expert: *const i32,
    rank_prefix_matrix: *mut i32,
    channel_prefix_matrix: *mut i32,
    recv_channel_prefix_matrix: *mut i32,
    send_head: *mut i32,
    cached: bool,
    expert_alignment: i32,
    num_worst_tokens: i32,
    slot_bytes: i64,
}

fn validate(buffer: &Buffer, a: &DeepepIntranodeDispatchArgs) -> Result<Plan> {
    let r = buffer.layout.num_ranks as i64;
    let x = check("x", Some(&a.x), &[DEEPEP_DTYPE_BFLOAT16, DEEPEP_DTYPE_FLOAT16, DEEPEP_DTYPE_FLOAT32, DEEPEP_DTYPE_FLOAT8_E4M3], 2)?;
    check_aligned16("x", &x)?;
    let (t, h) = (x.dims()[0], x.dims()[1]);
    let hidden_bytes = h * x.dtype.size();
    ensure_arg!(
        hidden_bytes % 16 == 0 && hidden_bytes > 0,
        "x: hidden size {h} ({hidden_bytes} bytes per row) must give a positive multiple of 16 bytes per row \
         ({} {} elements)",
        16 / x.dtype.size(),
        x.dtype.name()
    );
    ensure_arg!(hidden_bytes <= i32::MAX as i64, "x: {hidden_bytes} bytes per row is too large");
    ensure_arg!(t <= i32::MAX as i64, "x has {t} tokens; at most {} are supported", i32::MAX);

    let scales = match a.x_scales.dtype {
        0 => None,
        _ => {
            let s = check_strided("x_scales", &a.x_scales, &[DEEPEP_DTYPE_FLOAT32, DEEPEP_DTYPE_INT32], 2)?;
            ensure_arg!(x.dtype.size() == 1, "x_scales needs x as float8_e4m3fn, got x as {}", x.dtype.name());
            ensure_arg!(s.dims()[0] == t, "x_scales must have {t} rows (one per token of x), got shape {:?}", s.dims());
            let n = s.dims()[1];
            ensure_arg!(n <= 1024, "x_scales has {n} scales per token; at most 1024 are supported");
            Some((s.dtype, s.ptr() as *const c_void, n, s.raw.strides[0], s.raw.strides[1]))
        }
    };

    let in_rank = check("is_token_in_rank", Some(&a.is_token_in_rank), &[DEEPEP_DTYPE_BOOL], 2)?;
    check_shape("is_token_in_rank", &in_rank, &[t, r])?;
    let cached = a.cached != 0;
    let plan = {
        let slot_probe = |scales: i64, topk: i64| kernels::dispatch_slot_bytes(hidden_bytes as i32, scales as i32, topk as i32);
        let topk_cols = if a.topk_idx.dtype == 0 { 0 } else { a.topk_idx.shape[1].clamp(0, 1024) };
        let slot = slot_probe(scales.map_or(0, |s| s.2), topk_cols);
        (plan_for(buffer, &a.config, "dispatch", slot)?, slot)
    };
    let (channels, slot_bytes) = plan;
    let c = channels.num_channels as i64;

    let topk_ids = check_opt("topk_idx", &a.topk_idx, &[DEEPEP_DTYPE_INT64, DEEPEP_DTYPE_INT32], 2)?;
    let topk_weights = check_opt("topk_weights", &a.topk_weights, &[DEEPEP_DTYPE_FLOAT32], 2)?;
    let (topk, num_experts, per_rank, per_expert) = if cached {
        ensure_arg!(topk_ids.is_none() && topk_weights.is_none(), "cached dispatch (handle given) takes no topk_idx/topk_weights");
        (None, 0, std::ptr::null(), std::ptr::null())
    } else {
        let per_rank = check("num_tokens_per_rank", Some(&a.num_tokens_per_rank), &[DEEPEP_DTYPE_INT32], 1)?;
        check_shape("num_tokens_per_rank", &per_rank, &[r])?;
        let per_expert = check("num_tokens_per_expert", Some(&a.num_tokens_per_expert), &[DEEPEP_DTYPE_INT32], 1)?;
        let e = per_expert.dims()[0];
        ensure_arg!(e > 0 && e % r == 0, "num_tokens_per_expert has {e} experts; it must be a positive multiple of the {r} ranks");
        ensure_arg!(
            e / r <= MAX_LOCAL_EXPERTS as i64,
            "{} experts per rank ({e} experts / {r} ranks); at most {MAX_LOCAL_EXPERTS} are supported",
            e / r
        );
        let topk = match (topk_ids, topk_weights) {
            (None, None) => None,
            (Some(ids), Some(w)) => {
                let k = ids.dims()[1];
                ensure_arg!(ids.dims()[0] == t, "topk_idx must have {t} rows, got shape {:?}", ids.dims());
                ensure_arg!(k > 0 && k <= 128, "topk_idx has {k} columns; 1 to 128 are supported");
                check_shape("topk_weights", &w, &[t, k])?;
                Some((ids.dtype, ids.ptr() as *const c_void, w.ptr() as *const f32, k))
            }
            (Some(_), None) => return Err(Error::invalid("topk_idx was given without topk_weights")),
            (None, Some(_)) => return Err(Error::invalid("topk_weights was given without topk_idx")),
        };
        (topk, e as i32, per_rank.ptr() as *const i32, per_expert.ptr() as *const i32)
    };

    let rank_prefix = check("rank_prefix_matrix", Some(&a.rank_prefix_matrix), &[DEEPEP_DTYPE_INT32], 2)?;
    check_shape("rank_prefix_matrix", &rank_prefix, &[r, r])?;
    let channel_prefix = check("channel_prefix_matrix", Some(&a.channel_prefix_matrix), &[DEEPEP_DTYPE_INT32], 2)?;
    ensure_arg!(
        channel_prefix.dims() == [r, c],
        "channel_prefix_matrix must have shape [{r}, {c}] ({r} ranks, config.num_sms / 2 = {c} channels), got {:?}{}",
        channel_prefix.dims(),
        if cached { "; a cached dispatch needs the config the handle was made with" } else { "" }
    );
    let recv_channel_prefix = check("recv_channel_prefix_matrix", Some(&a.recv_channel_prefix_matrix), &[DEEPEP_DTYPE_INT32], 2)?;
    check_shape("recv_channel_prefix_matrix", &recv_channel_prefix, &[r, c])?;
    let send_head = match check_opt("send_head", &a.send_head, &[DEEPEP_DTYPE_INT32], 2)? {
        Some(v) => {
            check_shape("send_head", &v, &[t, r])?;
            v.ptr() as *mut i32
        }
        None if cached => std::ptr::null_mut(),
        None => return Err(Error::invalid("send_head must be given (it is part of the handle)")),
    };
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
        num_tokens_per_rank: per_rank,
        num_tokens_per_expert: per_expert,
        rank_prefix_matrix: rank_prefix.ptr().cast(),
        channel_prefix_matrix: channel_prefix.ptr().cast(),
        recv_channel_prefix_matrix: recv_channel_prefix.ptr().cast(),
        send_head,
        cached,
        expert_alignment: a.expert_alignment,
        num_worst_tokens: a.num_worst_tokens,
        slot_bytes,
    })
}

/// What [`prepare`] learned: the receive count and per-expert list, when the
/// host waited for them (non-cached, num_worst_tokens == 0); -1 otherwise.
pub struct Prepared {
    pub num_recv_tokens: i32,
    pub num_local_experts: usize,
}

/// Validates, launches the notify kernel on `stream` (NULL: the comm stream)
/// and, for a non-cached dispatch without num_worst_tokens, waits for the
/// receive counts. `per_expert_out` receives E / R aligned counts then.
pub fn prepare(
    buffer: &Buffer,
    args: &DeepepIntranodeDispatchArgs,
    stream: *mut c_void,
    per_expert_out: &mut [i32],
) -> Result<Prepared> {
    let plan = validate(buffer, args)?;
    let num_ranks = buffer.layout.num_ranks;
    let wait_for_counts = !plan.cached && plan.num_worst_tokens == 0;
    let num_local_experts = if plan.cached { 0 } else { (plan.num_experts / num_ranks) as usize };
    if wait_for_counts {
        ensure_arg!(
            per_expert_out.len() >= num_local_experts,
            "num_recv_tokens_per_expert needs room for {num_local_experts} entries, got {}",
            per_expert_out.len()
        );
    }
    buffer.with_resources(|res| {
        let stream = res.stream_or_comm(stream);
        if wait_for_counts && cuda::stream_is_capturing(stream)? {
            return Err(Error::invalid(
                "a non-cached dispatch waits on the host for the receive counts and cannot be captured in a CUDA \
                 graph; pass num_worst_tokens > 0 (or a handle) to capture it",
            ));
        }
        let counts = res.recv_counts.host_ptr();
        if wait_for_counts {
            // SAFETY: counts is the live host-mapped record; the GPU writes it only in the launch below.
            unsafe { std::ptr::addr_of_mut!((*counts).num_recv_tokens).write_volatile(-1) };
        }
        let common = res.normal_common(
            buffer.wait_context(res),
            &buffer.args,
            plan.channels.num_channels,
            plan.channels.ring_tokens,
            NormalKernel::Notify,
        );
        let (topk_ptr, topk_k, topk_i32) = match plan.topk {
            Some((dtype, ids, _, k)) => (ids, k as i32, (dtype == DEEPEP_DTYPE_INT32) as i32),
            None => (std::ptr::null(), 0, 0),
        };
        let params = NotifyParams {
            common,
            is_token_in_rank: plan.is_token_in_rank,
            num_tokens_per_rank: plan.num_tokens_per_rank,
            num_tokens_per_expert: plan.num_tokens_per_expert,
            topk_idx: topk_ptr,
            rank_prefix_matrix: plan.rank_prefix_matrix,
            channel_prefix_matrix: plan.channel_prefix_matrix,
            recv_channel_prefix_matrix: plan.recv_channel_prefix_matrix,
            counts: if wait_for_counts { res.recv_counts.device_ptr() } else { std::ptr::null_mut() },
            num_tokens: plan.num_tokens,
            num_topk: topk_k,
            topk_idx_is_int32: topk_i32,
            num_experts: plan.num_experts,
            expert_alignment: plan.expert_alignment,
            cached: plan.cached as i32,
            num_worst_tokens: plan.num_worst_tokens,
        };
        // SAFETY: params point at validated tensors, the live window and workspace.
        let rc = unsafe { kernels::deepep_launch_normal_notify(res.dev_comm.as_ptr(), &params, stream) };
        kernels::launch_result("dispatch notify", rc)?;
        if !wait_for_counts {
            return Ok(Prepared { num_recv_tokens: -1, num_local_experts });
        }
        let num_recv = wait_for_recv_count(buffer, res, counts)?;
        // SAFETY: the GPU finished writing the list before num_recv_tokens (system fence).
        let list = unsafe { &(*counts).num_recv_tokens_per_expert };
        per_expert_out[..num_local_experts].copy_from_slice(&list[..num_local_experts]);
        Ok(Prepared { num_recv_tokens: num_recv, num_local_experts })
    })
}

/// DeepEP's one host wait: spins on the host-mapped counter, giving up with the
/// stalled peer's name if a GPU wait expired, or after the GPU timeout.
fn wait_for_recv_count(buffer: &Buffer, res: &crate::buffer::Resources, counts: *mut kernels::RecvCounts) -> Result<i32> {
    let start = Instant::now();
    let budget = std::time::Duration::from_nanos(buffer.timeout_ns()) + std::time::Duration::from_secs(5);
    let mut spins = 0u32;
    loop {
        // SAFETY: live host-mapped record; the GPU writes this field once.
        let n = unsafe { std::ptr::addr_of!((*counts).num_recv_tokens).read_volatile() };
        if n >= 0 {
            buffer.check_stall(res)?; // bad input found by the notify kernel
            return Ok(n);
        }
        spins = spins.wrapping_add(1);
        if spins % 1024 == 0 {
            if res.stall.read().flag != 0 {
                buffer.check_stall(res)?;
            }
            if start.elapsed() > budget {
                return Err(Error::new(
                    DeepepStatus::DEEPEP_ERROR_TIMEOUT,
                    format!(
                        "dispatch CPU recv timeout on rank {}: the notify kernel did not report the receive count \
                         within {:.1} s",
                        buffer.layout.rank,
                        budget.as_secs_f64()
                    ),
                ));
            }
        }
        std::hint::spin_loop();
    }
}

fn check_rows<'a>(name: &str, t: &'a DeepepTensor, dtypes: &[DeepepDtype], cols: Option<i64>, rows: i64) -> Result<TensorView<'a>> {
    let v = check(name, Some(t), dtypes, if cols.is_some() { 2 } else { 1 })?;
    match cols {
        Some(c) => check_shape(name, &v, &[rows, c])?,
        None => check_shape(name, &v, &[rows])?,
    }
    Ok(v)
}

/// Launches the data kernel into the caller's outputs (N rows; rows past the
/// received count stay as allocated, except recv_topk_idx = -1 there).
pub fn launch(buffer: &Buffer, args: &DeepepIntranodeDispatchArgs, outs: &DeepepIntranodeDispatchOutputs, stream: *mut c_void) -> Result<()> {
    let plan = validate(buffer, args)?;
    let src_idx = check("recv_src_idx", Some(&outs.recv_src_idx), &[DEEPEP_DTYPE_INT32], 1)?;
    let n = src_idx.dims()[0];
    let recv_x = check_rows("recv_x", &outs.recv_x, &[plan.x_dtype], Some(plan.hidden_bytes / plan.x_dtype.size()), n)?;
    check_aligned16("recv_x", &recv_x)?;
    let recv_scales = match plan.scales {
        Some((dtype, _, s, _, _)) => check_rows("recv_x_scales", &outs.recv_x_scales, &[dtype], Some(s), n)?.ptr(),
        None => {
            ensure_arg!(outs.recv_x_scales.dtype == 0, "recv_x_scales must be absent without x_scales");
            std::ptr::null_mut()
        }
    };
    let (recv_topk, recv_weights) = match plan.topk {
        Some((dtype, _, _, k)) => (
            check_rows("recv_topk_idx", &outs.recv_topk_idx, &[dtype], Some(k), n)?.ptr(),
            check_rows("recv_topk_weights", &outs.recv_topk_weights, &[DEEPEP_DTYPE_FLOAT32], Some(k), n)?.ptr(),
        ),
        None => {
            ensure_arg!(
                outs.recv_topk_idx.dtype == 0 && outs.recv_topk_weights.dtype == 0,
                "recv_topk_idx/recv_topk_weights must be absent without topk_idx"
            );
            (std::ptr::null_mut(), std::ptr::null_mut())
        }
    };
    buffer.with_resources(|res| {
        let stream = res.stream_or_comm(stream);
        let common = res.normal_common(
            buffer.wait_context(res),
            &buffer.args,
            plan.channels.num_channels,
            plan.channels.ring_tokens,
            NormalKernel::Data,
        );
        let (scales_ptr, num_scales, st_tok, st_scale) = plan.scales.map_or((std::ptr::null(), 0, 0, 0), |s| (s.1, s.2, s.3, s.4));
        let (topk_ptr, weights_ptr, k, i32_ids) = plan
            .topk
            .map_or((std::ptr::null(), std::ptr::null(), 0, 0), |t| (t.1, t.2, t.3, (t.0 == DEEPEP_DTYPE_INT32) as i32));
        let params = DispatchParams {
            common,
            x: plan.x,
            x_scales: scales_ptr,
            topk_idx: topk_ptr,
            topk_weights: weights_ptr,
            is_token_in_rank: plan.is_token_in_rank,
            rank_prefix_matrix: plan.rank_prefix_matrix,
            channel_prefix_matrix: plan.channel_prefix_matrix,
            recv_channel_prefix_matrix: plan.recv_channel_prefix_matrix,
            recv_x: recv_x.ptr(),
            recv_x_scales: recv_scales,
            recv_topk_idx: recv_topk,
            recv_topk_weights: recv_weights.cast(),
            recv_src_idx: src_idx.ptr().cast(),
            send_head: plan.send_head,
            num_tokens: plan.num_tokens,
            num_recv_rows: n,
            scale_stride_token: st_tok,
            scale_stride_scale: st_scale,
            hidden_bytes: plan.hidden_bytes as i32,
            num_scales: num_scales as i32,
            num_topk: k as i32,
            topk_idx_is_int32: i32_ids,
            num_experts: plan.num_experts,
            slot_bytes: plan.slot_bytes as i32,
        };
        // SAFETY: params point at validated tensors, the live window and workspace.
        let rc = unsafe { kernels::deepep_launch_normal_dispatch(&params, stream) };
        kernels::launch_result("dispatch", rc)
    })
}
