//! LL housekeeping: clean_low_latency_buffer, the shrink-mode mask, and the
//! zero-copy combine view (get_next_low_latency_combine_buffer).
use std::os::raw::c_void;

use super::{combine_layout, LlShape};
use crate::buffer::Buffer;
use crate::cuda;
use crate::ensure_arg;
use crate::error::Result;
use crate::kernels;
use crate::tensor::{check, check_shape, DeepepDtype::*, DeepepTensor};

fn shape_of(buffer: &Buffer, max_tokens: i64, hidden: i64, num_experts: i64) -> Result<LlShape> {
    LlShape::new(max_tokens, hidden, num_experts, buffer.layout.num_ranks as i64)
}

/// Collective (DeepEP's clean_low_latency_buffer): waits for the device, barrier, zeroes both
/// halves' signals (LSA words and, across nodes, the GIN signals) and this rank's LL counters,
/// barrier; the next LL call uses half 0.
pub fn clean(buffer: &Buffer, max_tokens: i64, hidden: i64, num_experts: i64) -> Result<()> {
    let shape = shape_of(buffer, max_tokens, hidden, num_experts)?;
    let signals = buffer.with_resources(|res| {
        let mut signals = [std::ptr::null_mut::<u8>(); 2];
        for (parity, ptr) in signals.iter_mut().enumerate() {
            let layout = combine_layout(buffer, res, "clean_low_latency_buffer", shape, false, parity as i32)?;
            // SAFETY: the signal words lie inside this rank's window (combine_layout checked the size).
            *ptr = unsafe { res.window.ptr().cast::<u8>().add(layout.signal as usize) };
        }
        cuda::context_synchronize()?;
        Ok(signals)
    })?;
    buffer.barrier()?;
    buffer.with_resources(|res| {
        for ptr in signals {
            cuda::memset_zero(ptr.cast(), 8 * shape.num_ranks as usize)?;
        }
        let (counters, bytes) = res.ll_counters();
        cuda::memset_zero(counters, bytes)?;
        if res.remote_kind == kernels::LL_REMOTE_GIN {
            // Signal ids (parity * 2 + kind) * R + source: 4R of them (DevComm::new asked for 4R).
            let stream = res.stream_or_comm(std::ptr::null_mut());
            // SAFETY: dev_comm is this buffer's live device communicator; the kernel only
            // resets signal ids below the count it was created with.
            let rc = unsafe {
                kernels::deepep_launch_ll_reset_gin_signals(res.dev_comm.as_ptr(), 4 * shape.num_ranks as i32, stream)
            };
            kernels::launch_result("deepep::ll::reset_gin_signals", rc)?;
            cuda::context_synchronize()?;
        }
        Ok(())
    })?;
    buffer.reset_ll_parity();
    buffer.barrier()
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

/// The zero-copy combine view of the half the next LL call uses: BF16
/// [E_l, R*M, H] with strides (R*M*(H + H/64), H + H/64, 1). Returns its base pointer.
pub fn next_combine_buffer(buffer: &Buffer, max_tokens: i64, hidden: i64, num_experts: i64) -> Result<*mut c_void> {
    let shape = shape_of(buffer, max_tokens, hidden, num_experts)?;
    buffer.with_resources(|res| {
        let parity = buffer.peek_ll_parity();
        let layout = combine_layout(buffer, res, "get_next_low_latency_combine_buffer", shape, false, parity)?;
        // SAFETY: the view lies inside this rank's window (combine_layout checked the size).
        Ok(unsafe { res.window.ptr().cast::<u8>().add(layout.view as usize) }.cast())
    })
}
