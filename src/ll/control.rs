//! LL housekeeping: clean_low_latency_buffer, the shrink-mode mask, and the
//! zero-copy combine view (get_next_low_latency_combine_buffer).
use std::os::raw::c_void;

use super::{combine_layout, LlShape};
use crate::buffer::Buffer;
use crate::cuda;
use crate::ensure_arg;
use crate::error::Result;
use crate::kernels;
use crate::outputs::DeepepOutputs;
use crate::tensor::{check, check_shape, DeepepDtype::*, DeepepTensor};

fn shape_of(buffer: &Buffer, max_tokens: i64, hidden: i64, num_experts: i64) -> Result<LlShape> {
    LlShape::new(max_tokens, hidden, num_experts, buffer.layout.num_ranks as i64)
}

/// Collective (DeepEP's clean_low_latency_buffer), in `stream` order: one kernel barriers over
/// the ranks (shrink mode skips masked ones), zeroes both halves' signals (LSA words and, across
/// nodes, the GIN signals) and this rank's LL counters, and barriers again. Nothing waits on the
/// host (graph-capturable); a rank that never arrives is reported by the next call. The next LL
/// call uses half 0.
pub fn clean(buffer: &Buffer, max_tokens: i64, hidden: i64, num_experts: i64, stream: *mut c_void) -> Result<()> {
    let shape = shape_of(buffer, max_tokens, hidden, num_experts)?;
    buffer.with_resources(|res| {
        let op = "clean_low_latency_buffer";
        let halves = [combine_layout(buffer, res, op, shape, false, 0)?, combine_layout(buffer, res, op, shape, false, 1)?];
        // SAFETY: the signal words lie inside this rank's window (combine_layout checked the size).
        let signals = halves.map(|half| unsafe { res.window.ptr().cast::<u8>().add(half.signal as usize) });
        let (barrier_offset, barrier_epoch) = res.ll_clean_barrier();
        let (counters, counter_bytes) = res.ll_counters();
        let mut common = super::common(buffer, res, shape, &halves[0], 0, 0, kernels::LL_CLEAN_BANK);
        common.signal_offset = barrier_offset;
        let signal_bytes = kernels::LL_SIGNAL_BYTES_PER_RANK as i64 * shape.num_ranks;
        let gin = res.remote_kind == kernels::LL_REMOTE_GIN;
        // The halves' GIN signal ids: the banks before the clean barrier's.
        let gin_signals = kernels::LL_CLEAN_BANK * kernels::LL_SIGNAL_KINDS * shape.num_ranks as i32;
        let params = kernels::LlCleanParams {
            common,
            barrier_epoch,
            zero: [signals[0].cast(), signals[1].cast(), counters, std::ptr::null_mut()],
            zero_bytes: [signal_bytes, signal_bytes, counter_bytes as i64, 0],
            num_gin_signals: if gin { gin_signals } else { 0 },
            reserved: 0,
        };
        // SAFETY: dev_comm is this buffer's live device communicator; every pointer in params is
        // this rank's window or workspace, sized by the checks above and the workspace layout.
        let launch = kernels::entry(res.dev_comm.build().table().launch_ll_clean);
        let rc = unsafe { launch(res.dev_comm.as_ptr(), &params, res.remote_kind, res.stream_or_comm(stream)) };
        kernels::launch_result("deepep::ll::clean", rc)
    })?;
    buffer.reset_ll_parity();
    buffer.ll_host().cleaned(shape);
    Ok(())
}

/// Shrink mode: sets (mask=true) or clears a rank's mask, in `stream` order.
pub fn update_mask(buffer: &Buffer, rank: i32, mask: bool, stream: *mut c_void) -> Result<()> {
    ensure_arg!(buffer.args.enable_shrink, "the mask buffer exists only with enable_shrink=True");
    let r = buffer.layout.num_ranks;
    ensure_arg!((0..r).contains(&rank), "rank_to_mask must be in [0, {r}), got {rank}");
    buffer.with_resources(|res| {
        let stream = res.stream_or_comm(stream);
        // SAFETY: mask has LL_MAX_RANKS >= num_ranks ints.
        let slot = unsafe { res.ll_workspace().mask.add(rank as usize) };
        cuda::write_i32_async(slot.cast(), mask as i32, stream)
    })
}

/// Shrink mode: copies the mask (1 = masked) into an int32 [R] device tensor, in `stream` order.
pub fn query_mask(buffer: &Buffer, mask_status: &DeepepTensor, stream: *mut c_void) -> Result<()> {
    ensure_arg!(buffer.args.enable_shrink, "the mask buffer exists only with enable_shrink=True");
    let out = check("mask_status", Some(mask_status), &[DEEPEP_DTYPE_INT32], 1)?;
    let r = buffer.layout.num_ranks as i64;
    check_shape("mask_status", &out, &[r])?;
    buffer.with_resources(|res| {
        let stream = res.stream_or_comm(stream);
        cuda::copy_device_async(out.ptr(), res.ll_workspace().mask.cast(), 4 * r as usize, stream)
    })
}

/// Shrink mode: clears every rank's mask, in `stream` order.
pub fn clean_mask(buffer: &Buffer, stream: *mut c_void) -> Result<()> {
    ensure_arg!(buffer.args.enable_shrink, "the mask buffer exists only with enable_shrink=True");
    buffer.with_resources(|res| {
        let stream = res.stream_or_comm(stream);
        cuda::memset_zero_async(res.ll_workspace().mask.cast(), 4 * buffer.layout.num_ranks as usize, stream)
    })
}

/// The zero-copy combine view of `shape` (data NULL): BF16 [E_l, R*M, H] whose rows lie as far
/// apart as the combine kernel writes them (H + H/64 elements, DeepEP's layout). Hosts take shape
/// and strides from here (deepep_get_next_low_latency_combine_buffer).
pub fn combine_view(shape: LlShape) -> DeepepTensor {
    let (el, rows, h) = (shape.local_experts(), shape.rows(), shape.hidden);
    // LlShape bounds hidden to an int32 multiple of 128.
    let row = kernels::ll_view_row_bytes(h as i32) / DEEPEP_DTYPE_BFLOAT16.size();
    DeepepOutputs::describe(DEEPEP_DTYPE_BFLOAT16, &[el, rows, h], &[rows * row, row, 1])
}

/// The zero-copy combine view ([`combine_view`]) of the half the next LL call uses.
pub fn next_combine_buffer(buffer: &Buffer, max_tokens: i64, hidden: i64, num_experts: i64) -> Result<DeepepTensor> {
    let shape = shape_of(buffer, max_tokens, hidden, num_experts)?;
    buffer.with_resources(|res| {
        let parity = buffer.peek_ll_parity();
        let layout = combine_layout(buffer, res, "get_next_low_latency_combine_buffer", shape, false, parity)?;
        let mut view = combine_view(shape);
        // SAFETY: the view lies inside this rank's window (combine_layout checked the size).
        view.data = unsafe { res.window.ptr().cast::<u8>().add(layout.view as usize) }.cast();
        Ok(view)
    })
}
