//! C ABI: normal-mode (intranode) dispatch and combine.
//!
//! Dispatch is two calls because the receive count is decided on the GPU:
//! `deepep_intranode_dispatch_prepare` (notify; for a non-cached dispatch
//! without num_worst_tokens it waits for the count), then the caller allocates
//! the outputs `deepep_intranode_dispatch_outputs` describes (N rows: the count,
//! num_worst_tokens or the handle's row count) and calls `deepep_intranode_dispatch`.
//! Both take the same args and must be issued back to back on the same stream. A dispatch
//! that does not wait (cached, or num_worst_tokens) may take one call instead:
//! `deepep_intranode_dispatch_fused`.
//! All ops of a buffer must be ordered on one stream (NULL: the buffer's comm
//! stream). The `*_outputs` queries say what each op's caller allocates.
use std::os::raw::{c_int, c_void};

use super::buffer::{buffer_ref, outputs_query};
use super::{ffi, out_ref};
use crate::buffer::Buffer;
use crate::error::{Error, Result};
use crate::normal::combine::{self, DeepepIntranodeCombineArgs};
use crate::normal::dispatch::{self, DeepepIntranodeDispatchArgs, DeepepIntranodeDispatchOutputs};
use crate::outputs::DeepepOutputs;

pub(super) fn args_ref<'a, T>(name: &str, ptr: *const T) -> crate::error::Result<&'a T> {
    // SAFETY: callers pass a valid struct pointer or NULL; NULL is rejected.
    unsafe { ptr.as_ref() }.ok_or_else(|| Error::invalid(format!("{name} must not be NULL")))
}

/// Step 1 of DeepEP's intranode_dispatch. Writes the receive count to
/// `*num_recv_tokens` and E/R aligned per-expert counts to
/// `num_recv_tokens_per_expert` (capacity `per_expert_capacity`) when it waited
/// for them; writes -1 (and nothing to the list) in cached or num_worst_tokens mode.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer, a bad tensor or value, or bad
/// input a kernel found in an earlier op); DEEPEP_ERROR_NOT_AVAILABLE (destroyed, or unusable after a
/// timeout); DEEPEP_ERROR_TIMEOUT (a GPU wait expired, e.g. waiting for the receive counts, or in an
/// earlier op); DEEPEP_ERROR_CUDA; DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_intranode_dispatch_prepare(
    buf: *const super::DeepepBuffer,
    args: *const DeepepIntranodeDispatchArgs,
    num_recv_tokens: *mut c_int,
    num_recv_tokens_per_expert: *mut c_int,
    per_expert_capacity: c_int,
    stream: *mut c_void,
) -> crate::error::DeepepStatus {
    ffi(|| {
        let out = out_ref("num_recv_tokens", num_recv_tokens)?;
        *out = -1;
        // SAFETY: the caller provides per_expert_capacity writable ints (or NULL).
        let list = unsafe { super::per_expert_list(num_recv_tokens_per_expert, per_expert_capacity) };
        let prepared = dispatch::prepare(buffer_ref(buf)?.buffer(), args_ref("args", args)?, stream, list)?;
        *out = prepared.num_recv_tokens;
        Ok(())
    })
}

/// Step 2 of DeepEP's intranode_dispatch: the data kernel into the caller's outputs.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer, a bad tensor or value, or bad
/// input a kernel found in an earlier op); DEEPEP_ERROR_NOT_AVAILABLE (destroyed, or unusable after a
/// timeout); DEEPEP_ERROR_TIMEOUT (a GPU wait expired, here or in an earlier op); DEEPEP_ERROR_CUDA;
/// DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_intranode_dispatch(
    buf: *const super::DeepepBuffer,
    args: *const DeepepIntranodeDispatchArgs,
    outputs: *const DeepepIntranodeDispatchOutputs,
    stream: *mut c_void,
) -> crate::error::DeepepStatus {
    ffi(|| dispatch::launch(buffer_ref(buf)?.buffer(), args_ref("args", args)?, args_ref("outputs", outputs)?, stream))
}

/// Steps 1 and 2 in one call, for a dispatch whose step 1 does not wait for the receive count
/// (cached, or num_worst_tokens > 0): the caller allocates the outputs first (N rows: the
/// handle's count, or num_worst_tokens). The args are checked once, with the outputs, before
/// either kernel launches. Any other dispatch is refused (prepare and dispatch take it).
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer, a bad tensor or value, a
/// dispatch that waits for its count, or bad input a kernel found in an earlier op);
/// DEEPEP_ERROR_NOT_AVAILABLE (destroyed, or unusable after a timeout); DEEPEP_ERROR_TIMEOUT (a GPU
/// wait expired in an earlier op); DEEPEP_ERROR_CUDA; DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_intranode_dispatch_fused(
    buf: *const super::DeepepBuffer,
    args: *const DeepepIntranodeDispatchArgs,
    outputs: *const DeepepIntranodeDispatchOutputs,
    stream: *mut c_void,
) -> crate::error::DeepepStatus {
    ffi(|| dispatch::launch_unwaited(buffer_ref(buf)?.buffer(), args_ref("args", args)?, args_ref("outputs", outputs)?, stream))
}

/// DeepEP's intranode_combine: sums each token's rows over the ranks it was
/// sent to (fp32, plus biases) into combined_x on its source rank.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer, a bad tensor or value, or bad
/// input a kernel found in an earlier op); DEEPEP_ERROR_NOT_AVAILABLE (destroyed, or unusable after a
/// timeout); DEEPEP_ERROR_TIMEOUT (a GPU wait expired, here or in an earlier op); DEEPEP_ERROR_CUDA;
/// DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_intranode_combine(
    buf: *const super::DeepepBuffer,
    args: *const DeepepIntranodeCombineArgs,
    stream: *mut c_void,
) -> crate::error::DeepepStatus {
    ffi(|| combine::combine(buffer_ref(buf)?.buffer(), args_ref("args", args)?, stream))
}

/// An output query of an op's args (checked before the buffer, so that each NULL is named).
pub(super) fn args_query<T>(
    buf: *const super::DeepepBuffer,
    args: *const T,
    out: *mut DeepepOutputs,
    describe: impl FnOnce(&Buffer, &T) -> Result<DeepepOutputs>,
) -> crate::error::DeepepStatus {
    outputs_query(out, || {
        let args = args_ref("args", args)?;
        describe(buffer_ref(buf)?.buffer(), args)
    })
}

/// Writes to `*out` the dispatch handle's int32 matrices the caller allocates, before
/// deepep_intranode_dispatch_prepare (they go into args). Reads args->x ([T, H], checked as the
/// op does), args->config.num_sms (C = num_sms / 2 channels) and args->cached; the other fields
/// may still be unset. out->tensors, in order, all views of one int32 allocation:
/// rank_prefix_matrix [R, R] and channel_prefix_matrix [R, C], both absent (dtype 0) when cached
/// (pass the handle's), recv_channel_prefix_matrix [R, C], send_head [T, R].
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer or a bad value, named in the
/// message); DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_intranode_dispatch_handle_outputs(
    buf: *const super::DeepepBuffer,
    args: *const DeepepIntranodeDispatchArgs,
    out: *mut DeepepOutputs,
) -> crate::error::DeepepStatus {
    args_query(buf, args, out, dispatch::handle_outputs_for)
}

/// Writes to `*out` the outputs of deepep_intranode_dispatch, after prepare with the same
/// (complete) args, which are validated as the op does. out->tensors are laid out as
/// DeepepIntranodeDispatchOutputs, each with N rows and its own allocation: recv_x [N, H] in
/// x's dtype; recv_x_scales [N, S] row-major in x_scales' dtype, absent without x_scales;
/// recv_topk_idx [N, K] in topk_idx's dtype and recv_topk_weights [N, K] float32, both absent
/// without top-k (always in cached mode); recv_src_idx [N] int32. N is num_recv_tokens in
/// cached mode (the handle's count, as DeepEP), else args->num_worst_tokens when > 0, else
/// num_recv_tokens (the count prepare returned); it must then be >= 0.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer or a bad value, named in the
/// message); DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_intranode_dispatch_outputs(
    buf: *const super::DeepepBuffer,
    args: *const DeepepIntranodeDispatchArgs,
    num_recv_tokens: c_int,
    out: *mut DeepepOutputs,
) -> crate::error::DeepepStatus {
    args_query(buf, args, out, |buffer, args| dispatch::recv_outputs_for(buffer, args, num_recv_tokens))
}

/// Writes to `*out` the outputs of deepep_intranode_combine for these args (inputs and handle
/// validated as the op does; args->combined_x and args->combined_topk_weights are ignored).
/// out->tensors, in order, each its own allocation: combined_x [T, H] in x's dtype with
/// T = send_head's rows; combined_topk_weights [T, K] float32, absent without topk_weights.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer or a bad value, named in the
/// message); DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_intranode_combine_outputs(
    buf: *const super::DeepepBuffer,
    args: *const DeepepIntranodeCombineArgs,
    out: *mut DeepepOutputs,
) -> crate::error::DeepepStatus {
    args_query(buf, args, out, combine::combine_outputs_for)
}

/// Shrink mode (enable_shrink): copies the normal kernels' cumulative dropped-row counters into
/// `dropped`, an int64 [4] device tensor, in stream order: [0] received rows left empty (source
/// masked after notify), [1] tokens not sent to a masked rank, [2] combine contributions of a
/// masked rank left out, [3] combine rows not sent to a masked rank (docs/normal_shrink.md).
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer, a bad tensor, or no
/// enable_shrink); DEEPEP_ERROR_NOT_AVAILABLE (destroyed, or unusable after a timeout);
/// DEEPEP_ERROR_TIMEOUT (a GPU wait expired in an earlier op); DEEPEP_ERROR_CUDA; DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_normal_query_dropped(
    buf: *const super::DeepepBuffer,
    dropped: *const crate::tensor::DeepepTensor,
    stream: *mut c_void,
) -> crate::error::DeepepStatus {
    ffi(|| {
        let t = args_ref("dropped", dropped)?;
        crate::normal::query_dropped(buffer_ref(buf)?.buffer(), t, stream)
    })
}

/// A ring-geometry argument as the kernels' i32, in [min, i32::MAX]; an error naming it otherwise.
fn ring_extent(name: &str, value: i64, min: i64) -> Result<i32> {
    i32::try_from(value)
        .ok()
        .filter(|v| i64::from(*v) >= min)
        .ok_or_else(|| Error::invalid(format!("{name} must be in [{min}, {}], got {value}", i32::MAX)))
}

/// Bytes of one normal-mode dispatch ring slot for rows of `hidden_bytes` with `num_scales` FP8
/// scales (0: BF16) and `num_topk` top-k entries: the stride of the NVL receive rings (a flag
/// header, the row, scales, top-k ids and weights). For tools that read the rings.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer or a bad value, named in the
/// message); DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_normal_dispatch_slot_bytes(hidden_bytes: i64, num_scales: c_int, num_topk: c_int, out: *mut i64) -> crate::error::DeepepStatus {
    ffi(|| {
        let hidden = ring_extent("hidden_bytes", hidden_bytes, 1)?;
        let scales = ring_extent("num_scales", num_scales.into(), 0)?;
        let topk = ring_extent("num_topk", num_topk.into(), 0)?;
        *out_ref("out", out)? = crate::kernels::dispatch_slot_bytes(hidden, scales, topk);
        Ok(())
    })
}

/// Bytes of one normal-mode combine ring slot for rows of `hidden_bytes` with `num_topk` weights:
/// the stride of the combine's NVL receive rings (a flag header, the row, the weights).
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer or a bad value, named in the
/// message); DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_normal_combine_slot_bytes(hidden_bytes: i64, num_topk: c_int, out: *mut i64) -> crate::error::DeepepStatus {
    ffi(|| {
        let hidden = ring_extent("hidden_bytes", hidden_bytes, 1)?;
        let topk = ring_extent("num_topk", num_topk.into(), 0)?;
        *out_ref("out", out)? = crate::kernels::combine_slot_bytes(hidden, topk);
        Ok(())
    })
}
