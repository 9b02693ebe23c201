//! LL housekeeping: clean_low_latency_buffer, the shrink-mode mask, and the
//! zero-copy combine view (get_next_low_latency_combine_buffer).
use std::os::raw::c_void;

use super::{slots, LlLayout, LlShape, LlSlots};
use crate::buffer::Buffer;
use crate::cuda;
use crate::ensure_arg;
use crate::error::Result;
use crate::tensor::{check, check_shape, DeepepDtype::*, DeepepTensor};

fn shape_of(buffer: &Buffer, max_tokens: i64, hidden: i64, num_experts: i64) -> Result<LlShape> {
    ensure_arg!(
        buffer.args.low_latency_mode,
        "low-latency calls need a buffer created with low_latency_mode=True (this one was created without it)"
    );
    LlShape::new(max_tokens, hidden, num_experts, buffer.layout.num_ranks as i64)
}

/// Collective (DeepEP's clean_low_latency_buffer): barrier, zero both halves'
/// signals and this rank's LL counters, barrier; the next LL call uses half 0.
pub fn clean(buffer: &Buffer, max_tokens: i64, hidden: i64, num_experts: i64) -> Result<()> {
    let shape = shape_of(buffer, max_tokens, hidden, num_experts)?;
    buffer.with_resources(|_| cuda::context_synchronize())?;
    buffer.barrier()?;
    buffer.with_resources(|res| {
        let (s, _) = slots(res, shape, 1, false, false)?;
        let s = LlSlots { dispatch_slot: 0, count_bytes: 0, ..s };
        for parity in 0..2 {
            let layout = LlLayout::new(shape, s, buffer.rdma_offset() as u64, parity);
            // SAFETY: the signal words lie inside this rank's window (checked by the layout's size).
            let ptr = unsafe { res.window.ptr().cast::<u8>().add(layout.signal as usize) };
            ensure_arg!(
                layout.required as i64 <= buffer.args.num_rdma_bytes,
                "num_rdma_bytes ({}) is too small for num_max_dispatch_tokens_per_rank={max_tokens}, hidden={hidden}, \
                 num_experts={num_experts}",
                buffer.args.num_rdma_bytes
            );
            cuda::memset_zero(ptr.cast(), 8 * shape.num_ranks as usize)?;
        }
        let (counters, bytes) = res.ll_counters();
        cuda::memset_zero(counters, bytes)?;
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
        let (s, _) = slots(res, shape, 1, false, false)?;
        let s = LlSlots { dispatch_slot: 0, count_bytes: 0, ..s };
        let layout = LlLayout::new(shape, s, buffer.rdma_offset() as u64, buffer.peek_ll_parity());
        ensure_arg!(
            layout.required as i64 <= buffer.args.num_rdma_bytes,
            "num_rdma_bytes ({}) is too small for num_max_dispatch_tokens_per_rank={max_tokens}, hidden={hidden}, \
             num_experts={num_experts}",
            buffer.args.num_rdma_bytes
        );
        // SAFETY: the view lies inside this rank's window (the layout fits num_rdma_bytes).
        Ok(unsafe { res.window.ptr().cast::<u8>().add(layout.view as usize) }.cast())
    })
}
