//! Normal-mode dispatch in two calls, because the receive count is decided on
//! the GPU: [`prepare`] validates, launches the notify kernel and (non-cached,
//! without num_worst_tokens) waits on the host for the counts, as DeepEP does;
//! the caller allocates the outputs; [`launch`] runs the data kernel.
use std::os::raw::c_void;
use std::time::Instant;

use super::{channel_plan, plan_for, ChannelPlan};
use crate::buffer::{Buffer, NormalKernel};
use crate::config::DeepepConfig;
use crate::cuda;
use crate::ensure_arg;
use crate::error::{DeepepStatus, Error, Result};
use crate::kernels::{self, DispatchParams, NotifyParams, MAX_LOCAL_EXPERTS};
use crate::outputs::{check_output, check_required, DeepepOutputs};
use crate::tensor::{
    check, check_aligned16, check_opt, check_shape, check_strided, DeepepDtype, DeepepDtype::*, DeepepTensor, TensorView,
    DTYPE_ABSENT,
};

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
/// deepep_intranode_dispatch_prepare as deepep_intranode_dispatch_outputs
/// describes them (same order): N rows each.
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
    scales: Option<Scales>,
    topk: Option<Topk>,
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

/// The handle's outputs, in DeepEP's handle order.
pub const HANDLE_OUTPUTS: [&str; 4] = ["rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "send_head"];
/// The receive outputs, in [`DeepepIntranodeDispatchOutputs`]' field order.
pub const RECV_OUTPUTS: [&str; 5] = ["recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights", "recv_src_idx"];

/// What a dispatch caller allocates for the handle ([`HANDLE_OUTPUTS`] order), int32 in one
/// allocation: rank_prefix_matrix [R, R], channel_prefix_matrix [R, C] (both absent when cached:
/// the handle's are passed), recv_channel_prefix_matrix [R, C], send_head [T, R].
pub fn handle_outputs(num_ranks: i64, num_tokens: i64, num_channels: i64, cached: bool) -> Result<DeepepOutputs> {
    ensure_arg!(num_tokens >= 0, "num_tokens must be >= 0, got {num_tokens}");
    let (r, c) = (num_ranks, num_channels);
    let mut o = DeepepOutputs::default();
    let first = if cached {
        o.push_absent();
        o.push_absent();
        o.push(DEEPEP_DTYPE_INT32, &[r, c])
    } else {
        let first = o.push(DEEPEP_DTYPE_INT32, &[r, r]);
        o.push_after(first, &[r, c]);
        o.push_after(first, &[r, c]);
        first
    };
    o.push_after(first, &[num_tokens, r]);
    o.checked(&HANDLE_OUTPUTS)
}

/// What a dispatch caller allocates for the received rows ([`RECV_OUTPUTS`] order), N rows each:
/// recv_x [N, H] in x's dtype, recv_x_scales [N, S] row-major in the scales' dtype (absent
/// without scales), recv_topk_idx [N, K] in topk_idx's dtype and recv_topk_weights [N, K] float32
/// (both absent without top-k, as in cached mode), recv_src_idx [N] int32.
pub fn recv_outputs(
    num_rows: i64,
    x: (DeepepDtype, i64),
    scales: Option<(DeepepDtype, i64)>,
    topk: Option<(DeepepDtype, i64)>,
) -> Result<DeepepOutputs> {
    ensure_arg!(num_rows >= 0, "the receive count must be >= 0, got {num_rows}");
    let mut o = received_rows(num_rows, x, scales, topk);
    o.push(DEEPEP_DTYPE_INT32, &[num_rows]);
    o.checked(&RECV_OUTPUTS)
}

/// The received rows' outputs both modes share, N = num_rows rows: recv_x [N, H] in x's dtype,
/// recv_x_scales [N, S] (absent without scales), recv_topk_idx [N, K] in topk_idx's dtype and
/// recv_topk_weights [N, K] float32 (both absent without top-k).
pub(crate) fn received_rows(
    num_rows: i64,
    x: (DeepepDtype, i64),
    scales: Option<(DeepepDtype, i64)>,
    topk: Option<(DeepepDtype, i64)>,
) -> DeepepOutputs {
    let mut o = DeepepOutputs::default();
    o.push(x.0, &[num_rows, x.1]);
    match scales {
        Some((dtype, s)) => o.push(dtype, &[num_rows, s]),
        None => o.push_absent(),
    };
    match topk {
        Some((dtype, k)) => {
            o.push(dtype, &[num_rows, k]);
            o.push(DEEPEP_DTYPE_FLOAT32, &[num_rows, k])
        }
        None => {
            o.push_absent();
            o.push_absent()
        }
    };
    o
}

/// Rows of the receive outputs: in cached mode the handle's count (as DeepEP, whatever
/// num_worst_tokens says), else num_worst_tokens when > 0, else prepare's count.
pub fn num_recv_rows(cached: bool, num_worst_tokens: i32, num_recv_tokens: i32) -> Result<i64> {
    if !cached && num_worst_tokens > 0 {
        return Ok(num_worst_tokens as i64);
    }
    let what = if cached { "the handle's receive count" } else { "the count prepare returned" };
    ensure_arg!(num_recv_tokens >= 0, "num_recv_tokens must be {what} (>= 0), got {num_recv_tokens}");
    Ok(num_recv_tokens as i64)
}

/// The handle's geometry for these args (deepep_intranode_dispatch_handle_outputs): reads x,
/// config.num_sms and cached only, so the handle's descriptors may still be unset.
pub fn handle_outputs_for(buffer: &Buffer, a: &DeepepIntranodeDispatchArgs) -> Result<DeepepOutputs> {
    let (x, _) = check_x(a)?;
    let channels = channel_plan(&a.config, buffer.num_device_sms())?;
    handle_outputs(buffer.layout.num_ranks as i64, x.dims()[0], channels.num_channels as i64, a.cached != 0)
}

/// The receive geometry for complete args (deepep_intranode_dispatch_outputs): the args are
/// validated as the op does, the outputs' rows follow [`num_recv_rows`].
pub fn recv_outputs_for(buffer: &Buffer, a: &DeepepIntranodeDispatchArgs, num_recv_tokens: i32) -> Result<DeepepOutputs> {
    let plan = validate(buffer, a)?;
    plan.recv_outputs(num_recv_rows(plan.cached, plan.num_worst_tokens, num_recv_tokens)?)
}

/// x as both calls and the handle query read it: [T, H] contiguous, 16-byte aligned rows of a
/// positive multiple of 16 bytes; with the bytes per row.
fn check_x(a: &DeepepIntranodeDispatchArgs) -> Result<(TensorView<'_>, i64)> {
    let x = check("x", Some(&a.x), &[DEEPEP_DTYPE_BFLOAT16, DEEPEP_DTYPE_FLOAT16, DEEPEP_DTYPE_FLOAT32, DEEPEP_DTYPE_FLOAT8_E4M3], 2)?;
    check_aligned16("x", &x)?;
    let (t, h) = (x.dims()[0], x.dims()[1]);
    let hidden_bytes = h.checked_mul(x.dtype.size()).unwrap_or(i64::MAX);
    ensure_arg!(
        hidden_bytes % 16 == 0 && hidden_bytes > 0,
        "x: hidden size {h} ({hidden_bytes} bytes per row) must give a positive multiple of 16 bytes per row \
         ({} {} elements)",
        16 / x.dtype.size(),
        x.dtype.name()
    );
    ensure_arg!(hidden_bytes <= i32::MAX as i64, "x: {hidden_bytes} bytes per row is too large");
    ensure_arg!(t <= i32::MAX as i64, "x has {t} tokens; at most {} are supported", i32::MAX);
    Ok((x, hidden_bytes))
}

/// x_scales of an FP8 dispatch (both modes): (dtype, data, scales per token, token stride, scale
/// stride), or None when absent.
pub(crate) type Scales = (DeepepDtype, *const c_void, i64, i64, i64);
/// Top-k of a dispatch (both modes): (ids dtype, ids, weights, K).
pub(crate) type Topk = (DeepepDtype, *const c_void, *const f32, i64);

pub(crate) fn check_scales(x_scales: &DeepepTensor, x_dtype: DeepepDtype, t: i64) -> Result<Option<Scales>> {
    if x_scales.dtype == 0 {
        return Ok(None);
    }
    let s = check_strided("x_scales", x_scales, &[DEEPEP_DTYPE_FLOAT32, DEEPEP_DTYPE_INT32], 2)?;
    ensure_arg!(x_dtype.size() == 1, "x_scales needs x as float8_e4m3fn, got x as {}", x_dtype.name());
    ensure_arg!(s.dims()[0] == t, "x_scales must have {t} rows (one per token of x), got shape {:?}", s.dims());
    let n = s.dims()[1];
    ensure_arg!(n <= 1024, "x_scales has {n} scales per token; at most 1024 are supported");
    Ok(Some((s.dtype, s.ptr() as *const c_void, n, s.raw.strides[0], s.raw.strides[1])))
}

/// A non-cached dispatch's routing (both modes): num_tokens_per_expert (E a positive multiple of
/// the R ranks, at most MAX_LOCAL_EXPERTS per rank) and the optional top-k pair of T tokens.
/// Returns (top-k, E, num_tokens_per_expert).
pub(crate) fn check_routing(
    per_expert: &DeepepTensor,
    topk_ids: Option<TensorView<'_>>,
    topk_weights: Option<TensorView<'_>>,
    t: i64,
    r: i64,
) -> Result<(Option<Topk>, i32, *const i32)> {
    let per_expert = check("num_tokens_per_expert", Some(per_expert), &[DEEPEP_DTYPE_INT32], 1)?;
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
    Ok((topk, e as i32, per_expert.ptr() as *const i32))
}

fn validate(buffer: &Buffer, a: &DeepepIntranodeDispatchArgs) -> Result<Plan> {
    let r = buffer.layout.num_ranks as i64;
    let (x, hidden_bytes) = check_x(a)?;
    let t = x.dims()[0];

    let scales = check_scales(&a.x_scales, x.dtype, t)?;

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
        let (topk, e, per_expert) = check_routing(&a.num_tokens_per_expert, topk_ids, topk_weights, t, r)?;
        (topk, e, per_rank.ptr() as *const i32, per_expert)
    };

    // The handle: outputs as handle_outputs describes them; cached, its first two are inputs.
    let handle = handle_outputs(r, t, c, cached)?;
    let (rank_prefix, channel_prefix) = if cached {
        let rank_prefix = check("rank_prefix_matrix", Some(&a.rank_prefix_matrix), &[DEEPEP_DTYPE_INT32], 2)?;
        check_shape("rank_prefix_matrix", &rank_prefix, &[r, r])?;
        let channel_prefix = check("channel_prefix_matrix", Some(&a.channel_prefix_matrix), &[DEEPEP_DTYPE_INT32], 2)?;
        ensure_arg!(
            channel_prefix.dims() == [r, c],
            "channel_prefix_matrix must have shape [{r}, {c}] ({r} ranks, config.num_sms / 2 = {c} channels), got {:?}; \
             a cached dispatch needs the config the handle was made with",
            channel_prefix.dims()
        );
        (rank_prefix, channel_prefix)
    } else {
        (
            check_required(HANDLE_OUTPUTS[0], &a.rank_prefix_matrix, handle.get(0))?,
            check_required(HANDLE_OUTPUTS[1], &a.channel_prefix_matrix, handle.get(1))?,
        )
    };
    let recv_channel_prefix = check_required(HANDLE_OUTPUTS[2], &a.recv_channel_prefix_matrix, handle.get(2))?;
    // A cached dispatch may leave send_head out (DeepEP's cached calls do not return it).
    let send_head = if cached && a.send_head.dtype == DTYPE_ABSENT {
        std::ptr::null_mut()
    } else {
        check_required(HANDLE_OUTPUTS[3], &a.send_head, handle.get(3))?.ptr().cast()
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
    let counts_plan = RecvCountsPlan::new(buffer, plan.cached, plan.num_worst_tokens, plan.num_experts, per_expert_out)?;
    let num_local_experts = counts_plan.num_local_experts;
    buffer.with_resources(|res| {
        let stream = res.stream_or_comm(stream);
        counts_plan.arm(res, stream)?;
        notify(buffer, res, &plan, counts_plan.wait, stream)?;
        let num_recv_tokens = counts_plan.collect(buffer, res, per_expert_out)?;
        Ok(Prepared { num_recv_tokens, num_local_experts })
    })
}

/// Launches the notify kernel of `plan`; `wait_for_counts`: it reports the receive counts.
fn notify(buffer: &Buffer, res: &crate::buffer::Resources, plan: &Plan, wait_for_counts: bool, stream: *mut c_void) -> Result<()> {
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
    let launch = kernels::entry(res.dev_comm.build().table().launch_normal_notify);
    // SAFETY: params point at validated tensors, the live window and workspace; the launcher
    // is of the devComm's build.
    let rc = unsafe { launch(res.dev_comm.as_ptr(), &params, stream) };
    kernels::launch_result("dispatch notify", rc)
}

/// The host side of a notify that reports the receive counts (intranode and internode): a
/// non-cached dispatch without num_worst_tokens waits for them on the host.
pub(crate) struct RecvCountsPlan {
    pub wait: bool,
    pub num_local_experts: usize,
}

impl RecvCountsPlan {
    pub fn new(buffer: &Buffer, cached: bool, num_worst_tokens: i32, num_experts: i32, per_expert_out: &[i32]) -> Result<Self> {
        let wait = !cached && num_worst_tokens == 0;
        let num_local_experts = if cached { 0 } else { (num_experts / buffer.layout.num_ranks) as usize };
        if wait {
            ensure_arg!(
                per_expert_out.len() >= num_local_experts,
                "num_recv_tokens_per_expert needs room for {num_local_experts} entries, got {}",
                per_expert_out.len()
            );
        }
        Ok(Self { wait, num_local_experts })
    }

    /// Before the notify launch on `stream`: refuses graph capture of a host wait, and marks the
    /// count as not yet written.
    pub fn arm(&self, res: &crate::buffer::Resources, stream: *mut c_void) -> Result<()> {
        if !self.wait {
            return Ok(());
        }
        if cuda::stream_is_capturing(stream)? {
            return Err(Error::invalid(
                "a non-cached dispatch waits on the host for the receive counts and cannot be captured in a CUDA \
                 graph; pass num_worst_tokens > 0 (or a handle) to capture it",
            ));
        }
        // SAFETY: the live host-mapped record; the GPU writes it only in the launch that follows.
        unsafe { std::ptr::addr_of_mut!((*res.recv_counts.host_ptr()).num_recv_tokens).write_volatile(-1) };
        Ok(())
    }

    /// After the notify launch: the receive count (-1 when not waited for), the local experts'
    /// counts copied into `per_expert_out`.
    pub fn collect(&self, buffer: &Buffer, res: &crate::buffer::Resources, per_expert_out: &mut [i32]) -> Result<i32> {
        if !self.wait {
            return Ok(-1);
        }
        let counts = res.recv_counts.host_ptr();
        let num_recv = wait_for_recv_count(buffer, res, counts)?;
        // SAFETY: the GPU finished writing the list before num_recv_tokens (system fence).
        let list = unsafe { &(*counts).num_recv_tokens_per_expert };
        per_expert_out[..self.num_local_experts].copy_from_slice(&list[..self.num_local_experts]);
        Ok(num_recv)
    }
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

impl Plan {
    /// [`recv_outputs`] of this dispatch with `num_rows` rows.
    fn recv_outputs(&self, num_rows: i64) -> Result<DeepepOutputs> {
        recv_outputs(
            num_rows,
            (self.x_dtype, self.hidden_bytes / self.x_dtype.size()),
            self.scales.map(|(dtype, _, s, _, _)| (dtype, s)),
            self.topk.map(|(dtype, _, _, k)| (dtype, k)),
        )
    }
}

/// Launches the data kernel into the caller's outputs (N rows; rows past the
/// received count stay as allocated, except recv_topk_idx = -1 there).
pub fn launch(buffer: &Buffer, args: &DeepepIntranodeDispatchArgs, outs: &DeepepIntranodeDispatchOutputs, stream: *mut c_void) -> Result<()> {
    let plan = validate(buffer, args)?;
    let recv = check_recv(&plan, outs)?;
    buffer.with_resources(|res| data(buffer, res, &plan, &recv, res.stream_or_comm(stream)))
}

/// Prepare and launch in one call, for a dispatch whose prepare does not wait on the host (cached,
/// or num_worst_tokens > 0): the outputs' N is known beforehand, so the args are validated once
/// and nothing launches unless the outputs pass too.
pub fn launch_unwaited(
    buffer: &Buffer,
    args: &DeepepIntranodeDispatchArgs,
    outs: &DeepepIntranodeDispatchOutputs,
    stream: *mut c_void,
) -> Result<()> {
    let plan = validate(buffer, args)?;
    ensure_arg!(
        plan.cached || plan.num_worst_tokens > 0,
        "deepep_intranode_dispatch_fused takes a dispatch that does not wait for the receive count (cached, or \
         num_worst_tokens > 0); else call deepep_intranode_dispatch_prepare, then deepep_intranode_dispatch"
    );
    let recv = check_recv(&plan, outs)?;
    buffer.with_resources(|res| {
        let stream = res.stream_or_comm(stream);
        notify(buffer, res, &plan, false, stream)?;
        data(buffer, res, &plan, &recv, stream)
    })
}

/// The receive outputs' pointers, checked against `plan`; `n`: their rows.
struct Recv {
    n: i64,
    x: *mut c_void,
    scales: *mut c_void,
    topk: *mut c_void,
    weights: *mut c_void,
    src_idx: *mut c_void,
}

fn check_recv(plan: &Plan, outs: &DeepepIntranodeDispatchOutputs) -> Result<Recv> {
    // N is recv_src_idx's length; every output must then be as recv_outputs describes.
    let src_idx = check("recv_src_idx", Some(&outs.recv_src_idx), &[DEEPEP_DTYPE_INT32], 1)?;
    let n = src_idx.dims()[0];
    let want = plan.recv_outputs(n)?;
    let recv_x = check_required(RECV_OUTPUTS[0], &outs.recv_x, want.get(0))?;
    check_aligned16("recv_x", &recv_x)?;
    let ptr = |view: Option<TensorView<'_>>| view.map_or(std::ptr::null_mut(), |v| v.ptr());
    Ok(Recv {
        n,
        x: recv_x.ptr(),
        scales: ptr(check_output(RECV_OUTPUTS[1], &outs.recv_x_scales, want.get(1))?),
        topk: ptr(check_output(RECV_OUTPUTS[2], &outs.recv_topk_idx, want.get(2))?),
        weights: ptr(check_output(RECV_OUTPUTS[3], &outs.recv_topk_weights, want.get(3))?),
        src_idx: src_idx.ptr(),
    })
}

/// Launches the data kernel of `plan` into `recv` on `stream`.
fn data(buffer: &Buffer, res: &crate::buffer::Resources, plan: &Plan, recv: &Recv, stream: *mut c_void) -> Result<()> {
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
        recv_x: recv.x,
        recv_x_scales: recv.scales,
        recv_topk_idx: recv.topk,
        recv_topk_weights: recv.weights.cast(),
        recv_src_idx: recv.src_idx.cast(),
        send_head: plan.send_head,
        num_tokens: plan.num_tokens,
        num_recv_rows: recv.n,
        scale_stride_token: st_tok,
        scale_stride_scale: st_scale,
        hidden_bytes: plan.hidden_bytes as i32,
        num_scales: num_scales as i32,
        num_topk: k as i32,
        topk_idx_is_int32: i32_ids,
        num_experts: plan.num_experts,
        slot_bytes: plan.slot_bytes as i32,
        cached: plan.cached as i32,
    };
    let launch = kernels::entry(res.dev_comm.build().table().launch_normal_dispatch);
    // SAFETY: params point at validated tensors, the live window and workspace.
    let rc = unsafe { launch(&params, stream) };
    kernels::launch_result("dispatch", rc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outputs::DEEPEP_MAX_OP_OUTPUTS;

    fn dims(o: &DeepepOutputs, i: usize) -> Vec<i64> {
        o.get(i).shape[..o.get(i).ndim as usize].to_vec()
    }

    #[test]
    fn handle_outputs_are_one_int32_allocation() {
        for (r, t, c) in [(2, 64, 12), (8, 0, 10), (16, 4096, 4)] {
            let o = handle_outputs(r, t, c, false).unwrap();
            assert_eq!((o.count, o.num_allocations, o.allocation_dtype[0]), (4, 1, DEEPEP_DTYPE_INT32 as i32));
            assert_eq!((0..4).map(|i| dims(&o, i)).collect::<Vec<_>>(), [vec![r, r], vec![r, c], vec![r, c], vec![t, r]]);
            assert_eq!(o.offset[..4], [0, r * r, r * r + r * c, r * r + 2 * r * c]);
            assert_eq!(o.allocation[..4], [0; 4]);
            assert_eq!(o.allocation_elems[0], r * r + 2 * r * c + t * r);

            let cached = handle_outputs(r, t, c, true).unwrap();
            assert_eq!((cached.count, cached.num_allocations), (4, 1));
            assert_eq!((cached.get(0).dtype, cached.get(1).dtype, cached.allocation[0], cached.allocation[1]), (0, 0, -1, -1));
            assert_eq!((dims(&cached, 2), dims(&cached, 3)), (vec![r, c], vec![t, r]));
            assert_eq!((cached.offset[2], cached.offset[3], cached.allocation_elems[0]), (0, r * c, r * c + t * r));
        }
        assert!(handle_outputs(2, -1, 4, false).unwrap_err().message.contains("num_tokens must be >= 0"));
        assert!(handle_outputs(8, i64::MAX / 4, 4, false).unwrap_err().message.starts_with("send_head would have shape"));
    }

    #[test]
    fn recv_outputs_follow_the_inputs() {
        // BF16 with int64 top-k, no scales.
        let o = recv_outputs(100, (DEEPEP_DTYPE_BFLOAT16, 7168), None, Some((DEEPEP_DTYPE_INT64, 8))).unwrap();
        assert_eq!((o.count, o.num_allocations), (5, 4));
        let codes: Vec<i32> = (0..5).map(|i| o.get(i).dtype).collect();
        assert_eq!(codes, [DEEPEP_DTYPE_BFLOAT16 as i32, 0, DEEPEP_DTYPE_INT64 as i32, DEEPEP_DTYPE_FLOAT32 as i32, DEEPEP_DTYPE_INT32 as i32]);
        assert_eq!((dims(&o, 0), dims(&o, 2), dims(&o, 3), dims(&o, 4)), (vec![100, 7168], vec![100, 8], vec![100, 8], vec![100]));
        // FP8 with float32 scales (row-major even when x_scales is not) and int32 top-k.
        let o = recv_outputs(7, (DEEPEP_DTYPE_FLOAT8_E4M3, 7168), Some((DEEPEP_DTYPE_FLOAT32, 56)), Some((DEEPEP_DTYPE_INT32, 4))).unwrap();
        assert_eq!((o.get(1).dtype, dims(&o, 1), &o.get(1).strides[..2]), (DEEPEP_DTYPE_FLOAT32 as i32, vec![7, 56], &[56, 1][..]));
        assert_eq!((o.get(0).dtype, o.get(2).dtype), (DEEPEP_DTYPE_FLOAT8_E4M3 as i32, DEEPEP_DTYPE_INT32 as i32));
        assert_eq!(o.num_allocations, 5);
        // Cached (no top-k), no rows.
        let o = recv_outputs(0, (DEEPEP_DTYPE_BFLOAT16, 256), None, None).unwrap();
        assert_eq!((o.get(2).dtype, o.get(3).dtype, dims(&o, 0), dims(&o, 4)), (0, 0, vec![0, 256], vec![0]));
        assert_eq!(o.allocation_elems[..2], [0, 0]);
        assert!(recv_outputs(-1, (DEEPEP_DTYPE_BFLOAT16, 256), None, None).is_err());
    }

    #[test]
    fn receive_rows_follow_deepeps_rule() {
        assert_eq!(num_recv_rows(false, 0, 37).unwrap(), 37);
        assert_eq!(num_recv_rows(false, 512, -1).unwrap(), 512, "num_worst_tokens: prepare returns -1");
        assert_eq!(num_recv_rows(true, 0, 20).unwrap(), 20);
        assert_eq!(num_recv_rows(true, 512, 20).unwrap(), 20, "cached: the handle's count, as DeepEP");
        let err = num_recv_rows(true, 0, -1).unwrap_err();
        assert_eq!(err.message, "num_recv_tokens must be the handle's receive count (>= 0), got -1");
        assert!(num_recv_rows(false, 0, -1).unwrap_err().message.contains("the count prepare returned"));
    }

    #[test]
    fn described_receive_outputs_are_laid_out_as_the_outputs_struct() {
        // The host paths pass &outputs.tensors[0] as a DeepepIntranodeDispatchOutputs.
        assert!(RECV_OUTPUTS.len() <= DEEPEP_MAX_OP_OUTPUTS);
        assert_eq!(std::mem::size_of::<DeepepIntranodeDispatchOutputs>(), RECV_OUTPUTS.len() * std::mem::size_of::<DeepepTensor>());
        let fields = [
            std::mem::offset_of!(DeepepIntranodeDispatchOutputs, recv_x),
            std::mem::offset_of!(DeepepIntranodeDispatchOutputs, recv_x_scales),
            std::mem::offset_of!(DeepepIntranodeDispatchOutputs, recv_topk_idx),
            std::mem::offset_of!(DeepepIntranodeDispatchOutputs, recv_topk_weights),
            std::mem::offset_of!(DeepepIntranodeDispatchOutputs, recv_src_idx),
        ];
        assert_eq!(fields, [0, 80, 160, 240, 320]);
    }

    /// Fake, 16-byte aligned device addresses far apart (never dereferenced on the host).
    fn at(i: usize) -> *mut c_void {
        ((1usize << 32) + (i << 36)) as *mut c_void
    }

    fn described(dtype: DeepepDtype, shape: &[i64], i: usize) -> DeepepTensor {
        let mut o = DeepepOutputs::default();
        o.push(dtype, shape);
        DeepepTensor { data: at(i), ..*o.get(0) }
    }

    /// `o`'s present tensors at fake addresses from `first` on.
    fn placed(o: &DeepepOutputs, first: usize) -> Vec<DeepepTensor> {
        (0..o.count as usize).map(|i| DeepepTensor { data: if o.get(i).dtype == 0 { std::ptr::null_mut() } else { at(first + i) }, ..*o.get(i) }).collect()
    }

    fn recv(o: &DeepepOutputs) -> DeepepIntranodeDispatchOutputs {
        let t = placed(o, 20);
        DeepepIntranodeDispatchOutputs { recv_x: t[0], recv_x_scales: t[1], recv_topk_idx: t[2], recv_topk_weights: t[3], recv_src_idx: t[4] }
    }

    #[test]
    fn the_one_call_dispatch_takes_unwaited_ones_and_checks_everything_before_a_launch() {
        let args = crate::buffer::BufferArgs {
            rank: 0,
            num_ranks: 2,
            num_nvl_bytes: 1 << 30,
            num_rdma_bytes: 0,
            low_latency_mode: false,
            explicitly_destroy: true,
            enable_shrink: false,
        };
        // No resources: a call whose checks all pass ends at the launch with "destroyed".
        let buffer = Buffer::without_resources(args, 132);
        let launched = |a: &DeepepIntranodeDispatchArgs, o: &DeepepIntranodeDispatchOutputs| {
            let err = launch_unwaited(&buffer, a, o, std::ptr::null_mut()).unwrap_err().message;
            assert!(err.contains("the buffer was destroyed"), "{err}");
        };
        let t = 64;
        // SAFETY: plain old data; all-zero descriptors are absent.
        let mut a: DeepepIntranodeDispatchArgs = unsafe { std::mem::zeroed() };
        a.x = described(DEEPEP_DTYPE_BFLOAT16, &[t, 2048], 0);
        a.is_token_in_rank = described(DEEPEP_DTYPE_BOOL, &[t, 2], 1);
        a.num_tokens_per_rank = described(DEEPEP_DTYPE_INT32, &[2], 2);
        a.topk_idx = described(DEEPEP_DTYPE_INT64, &[t, 8], 3);
        a.topk_weights = described(DEEPEP_DTYPE_FLOAT32, &[t, 8], 4);
        a.num_tokens_per_expert = described(DEEPEP_DTYPE_INT32, &[16], 5);
        a.config = DeepepConfig::new(24, 8, 256, 16, 128).unwrap();
        a.expert_alignment = 1;
        let h = placed(&handle_outputs_for(&buffer, &a).unwrap(), 10);
        (a.rank_prefix_matrix, a.channel_prefix_matrix, a.recv_channel_prefix_matrix, a.send_head) = (h[0], h[1], h[2], h[3]);
        // A dispatch that waits for its count is refused before anything runs.
        let outs = recv(&recv_outputs_for(&buffer, &a, 37).unwrap());
        let err = launch_unwaited(&buffer, &a, &outs, std::ptr::null_mut()).unwrap_err().message;
        assert!(err.starts_with("deepep_intranode_dispatch_fused takes a dispatch that does not wait"), "{err}");
        // num_worst_tokens: N = num_worst_tokens rows; outputs checked before the notify launches.
        a.num_worst_tokens = 100;
        let mut outs = recv(&recv_outputs_for(&buffer, &a, -1).unwrap());
        launched(&a, &outs);
        outs.recv_x.shape[1] = 1024;
        let err = launch_unwaited(&buffer, &a, &outs, std::ptr::null_mut()).unwrap_err().message;
        assert!(err.starts_with("recv_x must have shape [100, 2048]"), "{err}");
        // Cached: the handle's matrices are inputs, N its count.
        a.num_worst_tokens = 0;
        a.cached = 1;
        let absent = DeepepOutputs::default().tensors[0];
        (a.num_tokens_per_rank, a.topk_idx, a.topk_weights, a.num_tokens_per_expert) = (absent, absent, absent, absent);
        let outs = recv(&recv_outputs_for(&buffer, &a, 37).unwrap());
        launched(&a, &outs);
        a.channel_prefix_matrix = described(DEEPEP_DTYPE_INT32, &[2, 4], 11);
        let err = launch_unwaited(&buffer, &a, &outs, std::ptr::null_mut()).unwrap_err().message;
        assert!(err.starts_with("channel_prefix_matrix must have shape [2, 12]"), "{err}");
    }
}
