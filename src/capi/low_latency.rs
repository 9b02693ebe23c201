//! C ABI: low-latency mode. Dispatch and combine take the caller's outputs and a
//! `phases` field: 3 runs both phases; 1 runs the send phase only and writes the
//! buffer half it used to `*buffer_idx`; a later call with phases 2 and that
//! `*buffer_idx` runs the receive phase (DeepEP's return_recv_hook). Each send
//! flips the buffer's half, as DeepEP does per call.
use std::os::raw::{c_int, c_void};

use super::{buffer::buffer_ref, ffi, out_ref};
use crate::error::{DeepepStatus, Error};
use crate::ll::{combine::{self, DeepepLowLatencyCombineArgs}, control, dispatch::{self, DeepepLowLatencyDispatchArgs}, LlShape};
use crate::outputs::DeepepOutputs;
use crate::tensor::DeepepTensor;

fn args_ref<'a, T>(ptr: *const T) -> crate::error::Result<&'a T> {
    // SAFETY: callers pass a valid struct pointer or NULL; NULL is rejected.
    unsafe { ptr.as_ref() }.ok_or_else(|| Error::invalid("args must not be NULL"))
}

/// Checks a low-latency shape against the LL kernels' limits (M, hidden, experts per rank,
/// ranks) without a buffer, with the messages dispatch and combine give. Bindings that allocate
/// the outputs call it before allocating, so that an M of a million fails here, not in an
/// out-of-memory error.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer or a bad value, named in the
/// message); DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_low_latency_check_shape(
    num_max_dispatch_tokens_per_rank: i64,
    hidden: i64,
    num_ranks: c_int,
    num_experts: c_int,
) -> DeepepStatus {
    ffi(|| {
        crate::ensure_arg!(num_ranks > 0, "num_ranks must be positive, got {num_ranks}");
        LlShape::new(num_max_dispatch_tokens_per_rank, hidden, num_experts as i64, num_ranks as i64)?;
        Ok(())
    })
}

/// The outputs of an LL dispatch of this shape on this buffer (its rank count R), in DeepEP's
/// order: packed_recv_x, packed_recv_x_scales (absent without use_fp8), packed_recv_count,
/// packed_recv_src_info, packed_recv_layout_range. Allocate them as `DeepepOutputs` says and
/// pass them in `DeepepLowLatencyDispatchArgs` (use_ue8m0 needs use_fp8). The shape is checked
/// first, with deepep_low_latency_check_shape's limits, so an out-of-range M fails before
/// anything is allocated. On failure `*out` describes no outputs (count 0).
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer or a bad value, named in the
/// message); DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_low_latency_dispatch_outputs(
    buf: *const super::DeepepBuffer,
    num_max_dispatch_tokens_per_rank: i64,
    hidden: i64,
    num_experts: c_int,
    use_fp8: bool,
    use_ue8m0: bool,
    out: *mut DeepepOutputs,
) -> DeepepStatus {
    ffi(|| {
        let out = out_ref("out", out)?;
        *out = DeepepOutputs::default();
        let r = buffer_ref(buf)?.layout.num_ranks as i64;
        let shape = LlShape::new(num_max_dispatch_tokens_per_rank, hidden, num_experts as i64, r)?;
        *out = dispatch::outputs(shape, use_fp8, use_ue8m0)?;
        Ok(())
    })
}

/// The output of an LL combine of `num_tokens` tokens (the rows of its topk_idx; at most
/// num_max_dispatch_tokens_per_rank): combined_x [T, H] bfloat16, for `DeepepLowLatencyCombineArgs.out`.
/// On failure `*out` describes no outputs (count 0).
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer or a bad value, named in the
/// message); DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_low_latency_combine_outputs(
    buf: *const super::DeepepBuffer,
    num_tokens: i64,
    hidden: i64,
    out: *mut DeepepOutputs,
) -> DeepepStatus {
    ffi(|| {
        let out = out_ref("out", out)?;
        *out = DeepepOutputs::default();
        // The output does not depend on the buffer today; the handle keeps the LL queries alike.
        buffer_ref(buf)?;
        *out = combine::outputs(num_tokens, hidden)?;
        Ok(())
    })
}

/// DeepEP's low_latency_dispatch; see `DeepepLowLatencyDispatchArgs`.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer, a bad tensor or value, or bad
/// input a kernel found in an earlier op); DEEPEP_ERROR_NOT_AVAILABLE (destroyed, or unusable after a
/// timeout); DEEPEP_ERROR_TIMEOUT (a GPU wait expired, here or in an earlier op); DEEPEP_ERROR_CUDA;
/// DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_low_latency_dispatch(
    buf: *const super::DeepepBuffer,
    args: *const DeepepLowLatencyDispatchArgs,
    stream: *mut c_void,
    buffer_idx: *mut c_int,
) -> DeepepStatus {
    ffi(|| dispatch::dispatch(buffer_ref(buf)?.buffer(), args_ref(args)?, stream, out_ref("buffer_idx", buffer_idx)?))
}

/// DeepEP's low_latency_combine; see `DeepepLowLatencyCombineArgs`.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer, a bad tensor or value, or bad
/// input a kernel found in an earlier op); DEEPEP_ERROR_NOT_AVAILABLE (destroyed, or unusable after a
/// timeout); DEEPEP_ERROR_TIMEOUT (a GPU wait expired, here or in an earlier op); DEEPEP_ERROR_CUDA;
/// DEEPEP_ERROR_UNSUPPORTED (use_logfmt in a build without LogFMT); DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_low_latency_combine(
    buf: *const super::DeepepBuffer,
    args: *const DeepepLowLatencyCombineArgs,
    stream: *mut c_void,
    buffer_idx: *mut c_int,
) -> DeepepStatus {
    ffi(|| combine::combine(buffer_ref(buf)?.buffer(), args_ref(args)?, stream, out_ref("buffer_idx", buffer_idx)?))
}

/// Collective: zeroes both halves' signals and resets the half to 0 (call it after
/// normal-mode ops and before LL ops, as DeepEP requires). One kernel on `stream` (NULL: the
/// comm stream) with a device-side barrier before and after; the host does not wait.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer, a bad tensor or value, or bad
/// input a kernel found in an earlier op); DEEPEP_ERROR_NOT_AVAILABLE (destroyed, or unusable after a
/// timeout); DEEPEP_ERROR_TIMEOUT (a GPU wait expired, here or in an earlier op); DEEPEP_ERROR_CUDA;
/// DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_clean_low_latency_buffer(
    buf: *const super::DeepepBuffer,
    num_max_dispatch_tokens_per_rank: c_int,
    hidden: c_int,
    num_experts: c_int,
    stream: *mut c_void,
) -> DeepepStatus {
    ffi(|| {
        let (m, h, e) = (num_max_dispatch_tokens_per_rank as i64, hidden as i64, num_experts as i64);
        control::clean(buffer_ref(buf)?.buffer(), m, h, e, stream)
    })
}

/// The zero-copy combine view of the next LL call's half, as a full descriptor: data, BF16,
/// [E_l, R*M, H] and its element strides (rows H + H/64 apart, DeepEP's layout). Write the
/// experts' outputs there, then combine with zero_copy = 1. `*out` is all zero on failure.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer, a bad tensor or value, or bad
/// input a kernel found in an earlier op); DEEPEP_ERROR_NOT_AVAILABLE (destroyed, or unusable after a
/// timeout); DEEPEP_ERROR_TIMEOUT (a GPU wait expired in an earlier op); DEEPEP_ERROR_CUDA;
/// DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_get_next_low_latency_combine_buffer(
    buf: *const super::DeepepBuffer,
    num_max_dispatch_tokens_per_rank: c_int,
    hidden: c_int,
    num_experts: c_int,
    out: *mut DeepepTensor,
) -> DeepepStatus {
    ffi(|| {
        let out = out_ref("out", out)?;
        *out = DeepepOutputs::default().tensors[0];
        *out = control::next_combine_buffer(
            buffer_ref(buf)?.buffer(),
            num_max_dispatch_tokens_per_rank as i64,
            hidden as i64,
            num_experts as i64,
        )?;
        Ok(())
    })
}

/// Shrink mode: masks (mask=true) or unmasks a rank, in stream order.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer, a bad tensor or value, or bad
/// input a kernel found in an earlier op); DEEPEP_ERROR_NOT_AVAILABLE (destroyed, or unusable after a
/// timeout); DEEPEP_ERROR_TIMEOUT (a GPU wait expired, here or in an earlier op); DEEPEP_ERROR_CUDA;
/// DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_low_latency_update_mask_buffer(
    buf: *const super::DeepepBuffer,
    rank_to_mask: c_int,
    mask: bool,
    stream: *mut c_void,
) -> DeepepStatus {
    ffi(|| control::update_mask(buffer_ref(buf)?.buffer(), rank_to_mask, mask, stream))
}

/// Shrink mode: copies the mask (1 = masked) into `mask_status`, an int32 [R] device tensor.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer, a bad tensor or value, or bad
/// input a kernel found in an earlier op); DEEPEP_ERROR_NOT_AVAILABLE (destroyed, or unusable after a
/// timeout); DEEPEP_ERROR_TIMEOUT (a GPU wait expired, here or in an earlier op); DEEPEP_ERROR_CUDA;
/// DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_low_latency_query_mask_buffer(
    buf: *const super::DeepepBuffer,
    mask_status: *const DeepepTensor,
    stream: *mut c_void,
) -> DeepepStatus {
    ffi(|| {
        // SAFETY: a valid descriptor pointer or NULL (rejected).
        let t = unsafe { mask_status.as_ref() }.ok_or_else(|| Error::invalid("mask_status must not be NULL"))?;
        control::query_mask(buffer_ref(buf)?.buffer(), t, stream)
    })
}

/// Shrink mode: unmasks every rank, in stream order.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer, a bad tensor or value, or bad
/// input a kernel found in an earlier op); DEEPEP_ERROR_NOT_AVAILABLE (destroyed, or unusable after a
/// timeout); DEEPEP_ERROR_TIMEOUT (a GPU wait expired, here or in an earlier op); DEEPEP_ERROR_CUDA;
/// DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_low_latency_clean_mask_buffer(buf: *const super::DeepepBuffer, stream: *mut c_void) -> DeepepStatus {
    ffi(|| control::clean_mask(buffer_ref(buf)?.buffer(), stream))
}
