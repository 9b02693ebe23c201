//! Low-latency (LL) mode: where each buffer half's regions lie inside the RDMA
//! region ([`LlLayout`]), the checks every LL op shares, and the ops in
//! [`dispatch`], [`combine`] and [`control`] (clean, masks, zero-copy view).
pub mod combine;
pub mod control;
pub mod dispatch;

use crate::buffer::{Buffer, Resources, LL_MAX_RANKS};
use crate::config::low_latency_rdma_size_hint;
use crate::ensure_arg;
use crate::error::{Error, Result};
use crate::kernels::{self, LlCommon, LL_MAX_TOPK, MAX_LOCAL_EXPERTS};

/// Largest `num_max_dispatch_tokens_per_rank` (row positions are 16-bit in the slot header).
pub(crate) const MAX_TOKENS_PER_RANK: i64 = 1024;
/// Expert ids travel as 16-bit values; 0xffff marks an empty top-k entry.
pub(crate) const MAX_EXPERTS: i64 = 0xffff;

fn align(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

/// The shape every LL op of one (M, H, E) configuration agrees on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlShape {
    pub max_tokens: i64,
    pub hidden: i64,
    pub num_experts: i64,
    pub num_ranks: i64,
}

impl LlShape {
    /// DeepEP's limits, widened: any H % 128 == 0, M <= 1024, E % R == 0.
    pub fn new(max_tokens: i64, hidden: i64, num_experts: i64, num_ranks: i64) -> Result<Self> {
        ensure_arg!(
            max_tokens > 0 && max_tokens <= MAX_TOKENS_PER_RANK,
            "num_max_dispatch_tokens_per_rank must be in [1, {MAX_TOKENS_PER_RANK}], got {max_tokens}"
        );
        check_hidden(hidden)?;
        ensure_arg!(num_ranks > 0, "num_ranks must be positive, got {num_ranks}");
        ensure_arg!(num_experts > 0, "num_experts must be positive, got {num_experts}");
        ensure_arg!(
            num_experts % num_ranks == 0,
            "num_experts ({num_experts}) must be divisible by the number of ranks ({num_ranks})"
        );
        ensure_arg!(
            num_experts / num_ranks <= MAX_LOCAL_EXPERTS as i64,
            "num_experts / num_ranks ({}) must be at most {MAX_LOCAL_EXPERTS} local experts",
            num_experts / num_ranks
        );
        ensure_arg!(num_experts <= MAX_EXPERTS, "num_experts must be at most {MAX_EXPERTS}, got {num_experts}");
        ensure_arg!(
            num_ranks <= LL_MAX_RANKS as i64,
            "low-latency mode supports up to {LL_MAX_RANKS} ranks, the buffer has {num_ranks}"
        );
        Ok(Self { max_tokens, hidden, num_experts, num_ranks })
    }

    pub fn local_experts(&self) -> i64 {
        self.num_experts / self.num_ranks
    }

    /// Rows per local expert in the packed outputs: M from each of the R ranks.
    pub fn rows(&self) -> i64 {
        self.num_ranks * self.max_tokens
    }
}

/// The hidden sizes LL ops take (also combine's output, which has no M or E to check).
pub(crate) fn check_hidden(hidden: i64) -> Result<()> {
    ensure_arg!(
        hidden > 0 && hidden % 128 == 0,
        "hidden must be a positive multiple of 128 (one FP8 scale per 128 channels), got {hidden}"
    );
    ensure_arg!(hidden <= 1 << 16, "hidden must be at most 65536, got {hidden}");
    Ok(())
}

/// Byte offsets (inside the window) of one buffer half's LL regions, for one op.
///
/// The RDMA region is DeepEP's `[signal_0][signal_1][send_0][send_1][recv_0][recv_1]`
/// sized by its hint formula. Half p's send part is the zero-copy combine view and
/// also holds the dispatch area (staging, receive slots, count messages); its recv
/// part holds the combine slots `[E][M]`. What does not fit there (small E, large
/// top-k) goes to an extra area after DeepEP's regions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlLayout {
    pub signal: u64,
    pub view: u64,
    pub combine_recv: u64,
    pub staging: u64,
    pub dispatch_recv: u64,
    pub count: u64,
    /// Bytes of the RDMA region this op needs (DeepEP's hint for M, H, E when everything fits).
    pub required: u64,
}

/// Slot sizes that place the regions. `combine_slot` is the combine area's bytes per
/// (expert, token): data and metadata, the same for BF16 and LogFMT.
#[derive(Clone, Copy, Debug)]
pub struct LlSlots {
    pub dispatch_slot: u64,
    pub count_bytes: u64,
    pub combine_slot: u64,
    pub remote: bool,
}

impl LlLayout {
    /// `rdma_offset`: window offset of the RDMA region; `parity`: the half.
    /// Signals and combine slots depend only on the shape (both ops agree on them);
    /// extras go after DeepEP's regions as [signals x2][combine x2][dispatch x2].
    pub fn new(shape: LlShape, slots: LlSlots, rdma_offset: u64, parity: i32) -> Self {
        let (m, h, e, r) = (shape.max_tokens as u64, shape.hidden as u64, shape.num_experts as u64, shape.num_ranks as u64);
        let scales = h / 128;
        let dispatch_msg = 16 + (2 * h).max(h + 4 * scales);
        let combine_msg = 4 * scales + 2 * h;
        let send = (m * dispatch_msg).max(e * m * combine_msg);
        let recv = (e * m * dispatch_msg).max(e * m * combine_msg);
        let sig = align(4 * e, 128);
        let deepep_end = 2 * sig + 2 * send + 2 * recv;
        let p = parity as u64;

        let signal_bytes = kernels::LL_SIGNAL_BYTES_PER_RANK * r;
        let combine_bytes = e * m * slots.combine_slot;
        let staging_bytes = if slots.remote { m * slots.dispatch_slot + r * slots.count_bytes } else { 0 };
        let dispatch_bytes = staging_bytes + r * m * slots.dispatch_slot + r * slots.count_bytes;
        let extra_signal = if signal_bytes <= sig { 0 } else { align(signal_bytes, 128) };
        let extra_combine = if combine_bytes <= recv { 0 } else { align(combine_bytes, 128) };
        let extra_dispatch = if dispatch_bytes <= send { 0 } else { align(dispatch_bytes, 128) };

        let base = rdma_offset;
        let signal = base + if extra_signal == 0 { p * sig } else { deepep_end + p * extra_signal };
        let combine_recv = base
            + if extra_combine == 0 { 2 * sig + 2 * send + p * recv } else { deepep_end + 2 * extra_signal + p * extra_combine };
        let view = base + 2 * sig + p * send;
        let staging = if extra_dispatch == 0 {
            view
        } else {
            base + deepep_end + 2 * extra_signal + 2 * extra_combine + p * extra_dispatch
        };
        let dispatch_recv = staging + staging_bytes;
        let count = dispatch_recv + r * m * slots.dispatch_slot;
        let required = deepep_end + 2 * (extra_signal + extra_combine + extra_dispatch);
        Self { signal, view, combine_recv, staging, dispatch_recv, count, required }
    }
}

/// What the op needs from the buffer: the shape fits its rank count and its RDMA region.
pub fn check_region(buffer: &Buffer, op: &str, shape: LlShape, layout: &LlLayout) -> Result<()> {
    ensure_arg!(
        buffer.args.low_latency_mode,
        "{op} needs a buffer created with low_latency_mode=True (this one was created without it)"
    );
    let have = buffer.args.num_rdma_bytes as u64;
    if layout.required <= have {
        return Ok(());
    }
    // Only for the message: every LL call (clean twice) passes here.
    let hint = low_latency_rdma_size_hint(shape.max_tokens, shape.hidden, shape.num_ranks as i32, shape.num_experts as i32)?;
    Err(Error::invalid(format!(
        "num_rdma_bytes ({have}) is too small for this {op}: num_max_dispatch_tokens_per_rank={}, hidden={}, \
         num_experts={} need {} B (Buffer.get_low_latency_rdma_size_hint gives {hint})",
        shape.max_tokens,
        shape.hidden,
        shape.num_experts,
        layout.required
    )))
}

/// Slot sizes for a dispatch with `num_topk`/`use_fp8` (combine passes K = 16, BF16:
/// it uses no dispatch area). `use_logfmt` only checks that this build has LogFMT: both
/// combine formats use the same area.
pub(crate) fn slots(res: &Resources, shape: LlShape, num_topk: i64, use_fp8: bool, use_logfmt: bool) -> Result<LlSlots> {
    let combine_slot = kernels::ll_combine_slot_bytes(shape.hidden as i32, use_logfmt)
        .ok_or_else(|| Error::unsupported("use_logfmt: this build of deepep-nccl has no LogFMT combine"))?;
    Ok(LlSlots {
        dispatch_slot: kernels::ll_dispatch_slot_bytes(shape.hidden as i32, num_topk as i32, use_fp8) as u64,
        count_bytes: kernels::ll_count_bytes(shape.local_experts() as i32, shape.max_tokens as i32) as u64,
        combine_slot: combine_slot as u64,
        remote: res.remote_kind != kernels::LL_REMOTE_NONE,
    })
}

/// The regions combine and the control calls use (signals, combine slots, the view; no
/// dispatch area), checked against the buffer.
pub(crate) fn combine_layout(
    buffer: &Buffer,
    res: &Resources,
    op: &str,
    shape: LlShape,
    use_logfmt: bool,
    parity: i32,
) -> Result<LlLayout> {
    let s = slots(res, shape, LL_MAX_TOPK, false, use_logfmt)?;
    let s = LlSlots { dispatch_slot: 0, count_bytes: 0, ..s };
    let layout = LlLayout::new(shape, s, buffer.rdma_offset() as u64, parity);
    check_region(buffer, op, shape, &layout)?;
    Ok(layout)
}

/// Device pointer of an optional tensor (dtype 0 = absent: NULL).
pub(crate) fn opt_ptr<T>(t: &crate::tensor::DeepepTensor) -> *mut T {
    if t.dtype == 0 {
        std::ptr::null_mut()
    } else {
        t.data.cast()
    }
}

/// The fields of the kernels' common block for one call.
pub(crate) fn common(
    buffer: &Buffer,
    res: &Resources,
    shape: LlShape,
    layout: &LlLayout,
    num_topk: i64,
    phases: i32,
    parity: i32,
) -> LlCommon {
    let ws = res.ll_workspace();
    LlCommon {
        window: res.window.handle().cast(),
        lsa_base: res.lsa_geometry.base as *mut u8,
        lsa_stride: res.lsa_geometry.stride,
        local_base: res.lsa_geometry.local() as *mut u8,
        signal_offset: layout.signal,
        combine_recv_offset: layout.combine_recv,
        view_offset: layout.view,
        staging_offset: layout.staging,
        dispatch_recv_offset: layout.dispatch_recv,
        count_offset: layout.count,
        done: ws.done,
        source_state: ws.source_state,
        ticket: ws.ticket,
        op_seq: ws.op_seq,
        gin_sent: ws.gin_sent,
        mask: ws.mask,
        fault: res.fault.device_ptr(),
        wait: buffer.wait_context(res),
        rank: buffer.args.rank,
        num_ranks: buffer.args.num_ranks,
        num_experts: shape.num_experts as i32,
        num_local_experts: shape.local_experts() as i32,
        max_tokens: shape.max_tokens as i32,
        hidden: shape.hidden as i32,
        num_topk: num_topk as i32,
        node_size: res.node_size,
        shrink: buffer.args.enable_shrink as i32,
        phases,
        parity,
        reserved: 0,
    }
}

/// The LL op kinds, for the host's per-(kind, half) receive bookkeeping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LlKind {
    Dispatch = 0,
    Combine = 1,
}

/// What a send-only call keeps for its receive (the hook): the args it ran with (phases =
/// receive) are the key, the launch params (phases = receive) the plan. A receive with exactly
/// these args only launches: the send validated them and placed the half's regions.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RecvPlan<A, P> {
    pub args: A,
    pub params: P,
}

// SAFETY: the pointers are device addresses and handles of the buffer's resources, used only to
// launch under `with_resources` (which fails once they are gone).
unsafe impl<A, P> Send for RecvPlan<A, P> {}

type DispatchPlan = RecvPlan<dispatch::DeepepLowLatencyDispatchArgs, kernels::LlDispatchParams>;
type CombinePlan = RecvPlan<combine::DeepepLowLatencyCombineArgs, kernels::LlCombineParams>;

/// What the host keeps between LL calls besides the half (`Buffer::ll_parity`).
#[derive(Debug, Default)]
pub(crate) struct LlHost {
    /// Shape of the last LL send: the signal words move with (M, H, E).
    shape: Option<LlShape>,
    /// Bit 2 * kind + half: a send-only call whose receive has not run yet.
    pending_receive: u32,
    /// Per half, the plan of the pending receive (set only with its pending bit).
    dispatch_plans: [Option<DispatchPlan>; 2],
    combine_plans: [Option<CombinePlan>; 2],
}

impl LlHost {
    fn bit(kind: LlKind, half: i32) -> u32 {
        1 << (2 * kind as u32 + half as u32)
    }

    /// After clean_low_latency_buffer of `shape`.
    pub(crate) fn cleaned(&mut self, shape: LlShape) {
        *self = Self { shape: Some(shape), ..Self::default() };
    }

    fn clear_plan(&mut self, kind: LlKind, half: i32) {
        match kind {
            LlKind::Dispatch => self.dispatch_plans[half as usize] = None,
            LlKind::Combine => self.combine_plans[half as usize] = None,
        }
    }
}

/// An LL op whose send-only call keeps a [`RecvPlan`] for its receive.
pub(crate) trait PlannedOp: Copy + PartialEq + Sized {
    type Params: Copy;
    const KIND: LlKind;
    fn plans(host: &mut LlHost) -> &mut [Option<RecvPlan<Self, Self::Params>>; 2];
    fn common(params: &mut Self::Params) -> &mut LlCommon;
    fn set_phases(&mut self, phases: i32);
    /// Launches `params` with this build's launcher on `stream`.
    fn launch(res: &Resources, params: &Self::Params, stream: *mut std::ffi::c_void) -> Result<()>;
}

/// The plan a send-only call keeps: its args and params with phases = receive.
pub(crate) fn recv_plan<O: PlannedOp>(mut args: O, mut params: O::Params) -> RecvPlan<O, O::Params> {
    args.set_phases(kernels::LL_PHASE_RECV);
    O::common(&mut params).phases = kernels::LL_PHASE_RECV;
    RecvPlan { args, params }
}

/// The pending receive's plan of `O` on `half` when `args` are its key (the args of its send);
/// taken, with its pending bit. None otherwise: the caller validates as for any call (a doubled
/// or stale hook gets the errors it always got).
pub(crate) fn take_plan<O: PlannedOp>(buffer: &Buffer, args: &O, half: i32) -> Option<RecvPlan<O, O::Params>> {
    let mut host = buffer.ll_host();
    let slot = &mut O::plans(&mut host)[half as usize];
    if !matches!(slot, Some(p) if p.args == *args) {
        return None;
    }
    let plan = slot.take();
    host.pending_receive &= !LlHost::bit(O::KIND, half);
    plan
}

/// Puts back a taken plan whose launch failed (the hook may be called again, as before), unless
/// a send replaced it meanwhile.
fn restore_plan<O: PlannedOp>(buffer: &Buffer, plan: RecvPlan<O, O::Params>, half: i32) {
    let mut host = buffer.ll_host();
    if host.pending_receive & LlHost::bit(O::KIND, half) == 0 {
        O::plans(&mut host)[half as usize] = Some(plan);
        host.pending_receive |= LlHost::bit(O::KIND, half);
    }
}

/// A receive-only call (phases = receive, `buffer_idx` 0 or 1) whose args are its send's: the
/// kept launch, with the buffer's current wait limits. None: no plan for these args.
pub(crate) fn receive_planned<O: PlannedOp>(buffer: &Buffer, args: &O, half: i32, stream: *mut std::ffi::c_void) -> Option<Result<()>> {
    let plan = take_plan(buffer, args, half)?;
    let result = buffer.with_resources(|res| {
        let mut params = plan.params;
        O::common(&mut params).wait = buffer.wait_context(res); // set_timeout may have run since
        O::launch(res, &params, res.stream_or_comm(stream))
    });
    if result.is_err() {
        restore_plan(buffer, plan, half);
    }
    Some(result)
}

/// Before an LL send of `shape`: when the shape differs from the last LL send's, the signal words
/// have moved and the old shape's data may lie under the new ones, so the buffer is cleaned first
/// (clean_low_latency_buffer: collective, but so is the op, and every rank changes shape at the
/// same op). DeepEP leaves this to the caller; here a forgotten clean cannot stall or pass early.
pub(crate) fn before_send(buffer: &Buffer, shape: LlShape, stream: *mut std::ffi::c_void) -> Result<()> {
    let last = buffer.ll_host().shape;
    match last {
        Some(last) if last != shape => {
            crate::log::log_at!(
                crate::log::Level::Info,
                Some(buffer.args.rank),
                "LL shape (M, H, E) changed from ({}, {}, {}) to ({}, {}, {}): clean_low_latency_buffer runs first",
                last.max_tokens,
                last.hidden,
                last.num_experts,
                shape.max_tokens,
                shape.hidden,
                shape.num_experts
            );
            control::clean(buffer, shape.max_tokens, shape.hidden, shape.num_experts, stream)
        }
        _ => Ok(()),
    }
}

/// After a launched send (phases 1 or 3) of `O` on `half`; `plan`: a send-only call's, for its
/// receive.
pub(crate) fn after_send<O: PlannedOp>(buffer: &Buffer, shape: LlShape, half: i32, plan: Option<RecvPlan<O, O::Params>>) {
    let mut host = buffer.ll_host();
    host.shape = Some(shape);
    // A send on a half whose receive never ran (a dropped hook) needs nothing: the kernels'
    // signals carry the op's generation, so the next receive waits for this send's. Its plan
    // replaces the dropped one's.
    if plan.is_some() {
        host.pending_receive |= LlHost::bit(O::KIND, half);
    } else {
        host.pending_receive &= !LlHost::bit(O::KIND, half);
    }
    O::plans(&mut host)[half as usize] = plan;
}

/// A receive-only call (the hook) of `kind` on `half` needs its send-only call, once.
pub(crate) fn check_receive(buffer: &Buffer, kind: LlKind, half: i32) -> Result<()> {
    let op = if kind == LlKind::Dispatch { "low_latency_dispatch" } else { "low_latency_combine" };
    ensure_arg!(
        buffer.ll_host().pending_receive & LlHost::bit(kind, half) != 0,
        "the receive of this {op} (buffer half {half}) already ran, or no send-only {op} on that half preceded it: \
         a receive hook runs once"
    );
    Ok(())
}

/// After a launched receive-only call.
pub(crate) fn after_receive(buffer: &Buffer, kind: LlKind, half: i32) {
    let mut host = buffer.ll_host();
    host.pending_receive &= !LlHost::bit(kind, half);
    host.clear_plan(kind, half);
}

/// `return_recv_hook`: send now, receive later with the same half; else both phases now.
pub fn phases_for(phases: i32) -> Result<i32> {
    ensure_arg!(
        (1..=3).contains(&phases),
        "phases must be 1 (send), 2 (receive) or 3 (both), got {phases}"
    );
    Ok(phases)
}

/// The half a receive-only call uses: the one its send reported in `buffer_idx`.
pub fn receive_half(buffer_idx: i32) -> Result<i32> {
    ensure_arg!(buffer_idx == 0 || buffer_idx == 1, "buffer_idx must be 0 or 1 (from the send), got {buffer_idx}");
    Ok(buffer_idx)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots_for(h: u64, k: u64, fp8: bool, remote: bool, el: i64, m: i64) -> LlSlots {
        let header = (16 + 4 * k).div_ceil(16) * 16;
        let payload = if fp8 { (h + 4 * (h / 128)).div_ceil(16) * 16 } else { 2 * h };
        LlSlots {
            dispatch_slot: header + payload,
            count_bytes: kernels::ll_count_bytes(el as i32, m as i32) as u64,
            combine_slot: 2 * h + 4 * (h / 128),
            remote,
        }
    }

    #[test]
    fn check_region_passes_a_fitting_layout_and_names_the_hint_otherwise() {
        let (m, h, e, r) = (128, 7168, 288, 4);
        let shape = LlShape::new(m, h, e, r).unwrap();
        let hint = low_latency_rdma_size_hint(m, h, r as i32, e as i32).unwrap();
        let buffer = |num_rdma_bytes| {
            let args = crate::buffer::BufferArgs {
                rank: 0,
                num_ranks: r as i32,
                num_nvl_bytes: 0,
                num_rdma_bytes,
                low_latency_mode: true,
                explicitly_destroy: false,
                enable_shrink: false,
            };
            Buffer::without_resources(args, 132)
        };
        let layout = LlLayout::new(shape, slots_for(h as u64, 8, true, false, e / r, m), 0, 1);
        check_region(&buffer(hint), "low_latency_dispatch", shape, &layout).unwrap();
        let small = layout.required as i64 - 1;
        let err = check_region(&buffer(small), "low_latency_dispatch", shape, &layout).unwrap_err().message;
        let want = format!(
            "num_rdma_bytes ({small}) is too small for this low_latency_dispatch: num_max_dispatch_tokens_per_rank=128, \
             hidden=7168, num_experts=288 need {} B (Buffer.get_low_latency_rdma_size_hint gives {hint})",
            layout.required
        );
        assert_eq!(err, want);
    }

    #[test]
    fn deepep_hint_sized_buffers_suffice() {
        for (m, h, e, r, k) in
            [(128, 7168, 288, 4, 8), (128, 7168, 256, 8, 8), (1024, 2048, 64, 4, 16), (1, 128, 8, 2, 1), (128, 6400, 288, 4, 8)]
        {
            let shape = LlShape::new(m, h, e, r).unwrap();
            let hint = low_latency_rdma_size_hint(m, h, r as i32, e as i32).unwrap() as u64;
            for fp8 in [false, true] {
                for remote in [false, true] {
                    let l = LlLayout::new(shape, slots_for(h as u64, k, fp8, remote, e / r, m), 0, 1);
                    assert!(l.required <= hint, "{m} {h} {e} {r} {k}: {} > {hint}", l.required);
                }
            }
        }
    }

    #[test]
    fn halves_do_not_overlap_and_dispatch_area_sits_in_the_view() {
        let shape = LlShape::new(128, 7168, 288, 4).unwrap();
        let s = slots_for(7168, 8, true, true, 72, 128);
        let (a, b) = (LlLayout::new(shape, s, 4096, 0), LlLayout::new(shape, s, 4096, 1));
        assert!(a.signal < b.signal && a.view < b.view && a.combine_recv < b.combine_recv);
        assert_eq!(a.staging, a.view);
        assert!(a.count + 4 * s.count_bytes <= b.view);
        assert!(b.combine_recv + 288 * 128 * s.combine_slot <= 4096 + a.required);
    }

    fn ll_buffer() -> Buffer {
        let args = crate::buffer::BufferArgs {
            rank: 0,
            num_ranks: 2,
            num_nvl_bytes: 0,
            num_rdma_bytes: 1 << 20,
            low_latency_mode: true,
            explicitly_destroy: true,
            enable_shrink: false,
        };
        Buffer::without_resources(args, 132)
    }

    type DispatchArgs = dispatch::DeepepLowLatencyDispatchArgs;
    type CombineArgs = combine::DeepepLowLatencyCombineArgs;

    /// A send-only call's args (phases = send) told apart by `tag` (x's address), and its plan.
    fn sent<O: PlannedOp>(tag: usize, set_x: impl Fn(&mut O, usize)) -> (O, RecvPlan<O, O::Params>) {
        // SAFETY: plain C structs of integers and pointers: all-zero is a valid value.
        let (mut args, params): (O, O::Params) = unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
        set_x(&mut args, tag);
        args.set_phases(kernels::LL_PHASE_SEND);
        (args, recv_plan(args, params))
    }

    fn combine_sent(tag: usize) -> (CombineArgs, CombinePlan) {
        sent(tag, |a: &mut CombineArgs, t| a.x.data = t as *mut _)
    }

    /// The args a hook passes: its send's, with phases = receive.
    fn hook_args<O: PlannedOp>(mut a: O) -> O {
        a.set_phases(kernels::LL_PHASE_RECV);
        a
    }

    #[test]
    fn a_receive_hook_runs_once_per_send() {
        let buffer = ll_buffer();
        let shape = LlShape::new(128, 7168, 16, 2).unwrap();
        let once = |kind, half| check_receive(&buffer, kind, half);
        let dispatch_plan = || sent(0x1000, |a: &mut DispatchArgs, t| a.x.data = t as *mut _).1;
        assert!(once(LlKind::Dispatch, 0).unwrap_err().message.contains("a receive hook runs once"));
        after_send(&buffer, shape, 0, Some(dispatch_plan()));
        after_send::<CombineArgs>(&buffer, shape, 1, None); // both phases: no hook
        once(LlKind::Dispatch, 0).unwrap();
        assert!(once(LlKind::Dispatch, 1).is_err() && once(LlKind::Combine, 1).is_err() && once(LlKind::Combine, 0).is_err());
        after_receive(&buffer, LlKind::Dispatch, 0);
        let doubled = once(LlKind::Dispatch, 0).unwrap_err().message;
        assert!(doubled.starts_with("the receive of this low_latency_dispatch (buffer half 0) already ran"), "{doubled}");
        // A dropped hook: the next send on that half leaves one receive pending, as before.
        after_send(&buffer, shape, 1, Some(combine_sent(1).1));
        after_send(&buffer, shape, 1, Some(combine_sent(2).1));
        once(LlKind::Combine, 1).unwrap();
        buffer.ll_host().cleaned(shape);
        assert!(once(LlKind::Combine, 1).is_err());
    }

    #[test]
    fn a_receive_launches_only_the_plan_of_its_own_send() {
        let buffer = ll_buffer();
        let shape = LlShape::new(128, 7168, 16, 2).unwrap();
        let (a, plan_a) = combine_sent(0xa00);
        assert_eq!((plan_a.args.phases, plan_a.params.common.phases), (kernels::LL_PHASE_RECV, kernels::LL_PHASE_RECV));
        after_send(&buffer, shape, 0, Some(plan_a));
        // Not this send's args (a stale hook's), another half, the send's own args unchanged
        // (phases = send): no plan; the full path checks them as before.
        let (b, _) = combine_sent(0xb00);
        assert!(take_plan(&buffer, &hook_args(b), 0).is_none());
        assert!(take_plan(&buffer, &hook_args(a), 1).is_none());
        assert!(take_plan(&buffer, &a, 0).is_none());
        check_receive(&buffer, LlKind::Combine, 0).unwrap(); // still pending
        // Its own hook takes it once; a doubled hook finds none and gets the full path's error.
        let taken = take_plan(&buffer, &hook_args(a), 0).unwrap();
        assert_eq!(taken.args, hook_args(a));
        assert!(take_plan(&buffer, &hook_args(a), 0).is_none());
        let doubled = check_receive(&buffer, LlKind::Combine, 0).unwrap_err().message;
        assert!(doubled.contains("a receive hook runs once"), "{doubled}");
        // A dropped hook, then a new send on that half: only the new send's args find a plan.
        after_send(&buffer, shape, 0, Some(combine_sent(0xa00).1));
        after_send(&buffer, shape, 0, Some(combine_sent(0xc00).1));
        assert!(take_plan(&buffer, &hook_args(a), 0).is_none());
        let (c, _) = combine_sent(0xc00);
        assert_eq!(take_plan(&buffer, &hook_args(c), 0).unwrap().args.x.data as usize, 0xc00);
        // A send with both phases, a full-path receive and a clean drop the half's plan.
        after_send(&buffer, shape, 1, Some(combine_sent(0xa00).1));
        after_send::<CombineArgs>(&buffer, shape, 1, None);
        assert!(take_plan(&buffer, &hook_args(a), 1).is_none());
        after_send(&buffer, shape, 1, Some(combine_sent(0xa00).1));
        after_receive(&buffer, LlKind::Combine, 1);
        assert!(take_plan(&buffer, &hook_args(a), 1).is_none());
        after_send(&buffer, shape, 1, Some(combine_sent(0xa00).1));
        buffer.ll_host().cleaned(shape);
        assert!(take_plan(&buffer, &hook_args(a), 1).is_none());
        // Plans are per kind: a dispatch's args never find a combine's plan.
        after_send(&buffer, shape, 1, Some(combine_sent(0xa00).1));
        let (d, _) = sent(0xa00, |x: &mut DispatchArgs, t| x.x.data = t as *mut _);
        assert!(take_plan(&buffer, &hook_args(d), 1).is_none());
    }

    #[test]
    fn a_planned_receive_that_cannot_launch_stays_pending() {
        // No resources (as after destroy): the launch fails, and the hook may be called again.
        let buffer = ll_buffer();
        let shape = LlShape::new(128, 7168, 16, 2).unwrap();
        let (a, plan) = combine_sent(0xa00);
        after_send(&buffer, shape, 1, Some(plan));
        let err = receive_planned(&buffer, &hook_args(a), 1, std::ptr::null_mut()).unwrap().unwrap_err();
        assert!(err.message.contains("the buffer was destroyed"), "{}", err.message);
        check_receive(&buffer, LlKind::Combine, 1).unwrap();
        assert!(take_plan(&buffer, &hook_args(a), 1).is_some());
        assert!(receive_planned(&buffer, &hook_args(a), 1, std::ptr::null_mut()).is_none());
    }

    #[test]
    fn phases_and_receive_half_are_checked() {
        assert!(phases_for(0).unwrap_err().message.contains("phases must be 1 (send), 2 (receive) or 3 (both)"));
        assert!(phases_for(4).is_err());
        assert_eq!(phases_for(2).unwrap(), 2);
        assert!(receive_half(-1).unwrap_err().message.contains("buffer_idx must be 0 or 1"));
        assert!(receive_half(2).is_err());
        assert_eq!(receive_half(1).unwrap(), 1);
    }

    fn dims(t: &crate::tensor::DeepepTensor) -> (i32, Vec<i64>, Vec<i64>) {
        let n = t.ndim as usize;
        (t.dtype, t.shape[..n].to_vec(), t.strides[..n].to_vec())
    }

    #[test]
    fn dispatch_outputs_are_deepeps_geometry() {
        use crate::tensor::DeepepDtype::*;
        for r in [1i64, 2, 8, 32] {
            let (m, h, e) = (128, 7168, 32 * 9);
            let shape = LlShape::new(m, h, e, r).unwrap();
            let (el, rows) = (e / r, r * m);
            for (fp8, ue8m0) in [(false, false), (true, false), (true, true)] {
                let o = dispatch::outputs(shape, fp8, ue8m0).unwrap();
                assert_eq!((o.count, o.num_allocations), (5, if fp8 { 5 } else { 4 }));
                let x_dtype = if fp8 { DEEPEP_DTYPE_FLOAT8_E4M3 } else { DEEPEP_DTYPE_BFLOAT16 };
                assert_eq!(dims(o.get(0)), (x_dtype as i32, vec![el, rows, h], vec![rows * h, h, 1]));
                let scales = match (fp8, ue8m0) {
                    (false, _) => (0, vec![], vec![]),
                    (true, false) => (DEEPEP_DTYPE_FLOAT32 as i32, vec![el, rows, h / 128], vec![h / 128 * rows, 1, rows]),
                    (true, true) => (DEEPEP_DTYPE_INT32 as i32, vec![el, rows, h / 512], vec![h / 512 * rows, 1, rows]),
                };
                assert_eq!(dims(o.get(1)), scales);
                assert_eq!(o.allocation[1], if fp8 { 1 } else { -1 });
                assert_eq!(dims(o.get(2)), (DEEPEP_DTYPE_INT32 as i32, vec![el], vec![1]));
                assert_eq!(dims(o.get(3)), (DEEPEP_DTYPE_INT32 as i32, vec![el, rows], vec![rows, 1]));
                assert_eq!(dims(o.get(4)), (DEEPEP_DTYPE_INT64 as i32, vec![el, r], vec![r, 1]));
                // Every present output alone in an allocation that holds exactly it.
                for i in 0..5 {
                    let g = o.allocation[i];
                    if g >= 0 {
                        let t = o.get(i);
                        let numel: i64 = t.shape[..t.ndim as usize].iter().product();
                        assert_eq!((o.offset[i], o.allocation_elems[g as usize], o.allocation_dtype[g as usize]), (0, numel, t.dtype));
                    }
                }
            }
        }
    }

    #[test]
    fn dispatch_outputs_check_the_scale_flags() {
        let shape = LlShape::new(128, 6400, 288, 4).unwrap();
        assert!(dispatch::outputs(shape, true, true).unwrap_err().message.contains("hidden (6400) must be a multiple of 512"));
        assert!(dispatch::outputs(shape, false, true).unwrap_err().message.contains("require use_fp8=True"));
        assert!(dispatch::outputs(shape, true, false).is_ok());
    }

    #[test]
    fn combine_outputs_are_t_by_h_bf16() {
        let o = combine::outputs(17, 7168).unwrap();
        assert_eq!((o.count, o.num_allocations, o.allocation_elems[0]), (1, 1, 17 * 7168));
        assert_eq!(dims(o.get(0)), (crate::tensor::DeepepDtype::DEEPEP_DTYPE_BFLOAT16 as i32, vec![17, 7168], vec![7168, 1]));
        assert_eq!(combine::outputs(0, 128).unwrap().allocation_elems[0], 0);
        assert!(combine::outputs(-1, 7168).unwrap_err().message.contains("num_tokens must be in [0, 1024]"));
        assert!(combine::outputs(1025, 7168).unwrap_err().message.contains("got 1025"));
        assert!(combine::outputs(8, 7000).unwrap_err().message.contains("hidden must be a positive multiple of 128"));
        assert!(combine::outputs(8, 1 << 17).unwrap_err().message.contains("hidden must be at most 65536"));
    }

    #[test]
    fn combine_view_rows_are_one_combine_message_apart_and_fit_the_half() {
        for (m, h, e, r) in [(128, 7168, 288, 4), (1, 128, 2, 1), (64, 2048, 256, 8), (128, 6400, 256, 32)] {
            let shape = LlShape::new(m, h, e, r).unwrap();
            let v = control::combine_view(shape);
            let (el, rows, row) = (e / r, r * m, h + h / 64);
            assert_eq!(dims(&v), (crate::tensor::DeepepDtype::DEEPEP_DTYPE_BFLOAT16 as i32, vec![el, rows, h], vec![rows * row, row, 1]));
            assert!(v.data.is_null());
            // The view of half 0 ends before half 1's begins (BF16: 2 bytes an element).
            let s = slots_for(h as u64, 8, true, true, el, m);
            let (a, b) = (LlLayout::new(shape, s, 0, 0), LlLayout::new(shape, s, 0, 1));
            let span = ((el - 1) * rows * row + (rows - 1) * row + h) as u64 * 2;
            assert!(a.view + span <= b.view, "{m} {h} {e} {r}: view {span} B, half {}", b.view - a.view);
        }
    }

    #[test]
    fn limits_name_the_argument() {
        assert!(LlShape::new(2048, 7168, 288, 4).unwrap_err().message.contains("num_max_dispatch_tokens_per_rank"));
        assert!(LlShape::new(128, 7000, 288, 4).unwrap_err().message.contains("hidden must be a positive multiple of 128"));
        assert!(LlShape::new(128, 7168, 289, 4).unwrap_err().message.contains("divisible by the number of ranks"));
        assert!(LlShape::new(128, 1536, 256, 8).is_ok());
    }
}
