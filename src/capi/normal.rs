//! C ABI: normal-mode (intranode) dispatch and combine.
//!
//! Dispatch is two calls because the receive count is decided on the GPU:
//! `deepep_intranode_dispatch_prepare` (notify; for a non-cached dispatch
//! without num_worst_tokens it waits for the count), then the caller allocates
//! the outputs with N = num_recv_tokens (or num_worst_tokens, or the handle's
//! row count) rows and calls `deepep_intranode_dispatch`. Both take the same
//! args and must be issued back to back on the same stream. All ops of a
//! buffer must be ordered on one stream (NULL: the buffer's comm stream).
use std::os::raw::{c_int, c_void};

use super::{buffer::buffer_ref, ffi, out_ref};
use crate::error::Error;
use crate::normal::combine::{self, DeepepIntranodeCombineArgs};
use crate::normal::dispatch::{self, DeepepIntranodeDispatchArgs, DeepepIntranodeDispatchOutputs};

fn args_ref<'a, T>(name: &str, ptr: *const T) -> crate::error::Result<&'a T> {
    // SAFETY: callers pass a valid struct pointer or NULL; NULL is rejected.
    unsafe { ptr.as_ref() }.ok_or_else(|| Error::invalid(format!("{name} must not be NULL")))
}

/// Step 1 of DeepEP's intranode_dispatch. Writes the receive count to
/// `*num_recv_tokens` and E/R aligned per-expert counts to
/// `num_recv_tokens_per_expert` (capacity `per_expert_capacity`) when it waited
/// for them; writes -1 (and nothing to the list) in cached or num_worst_tokens mode.
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
        let list: &mut [i32] = if num_recv_tokens_per_expert.is_null() || per_expert_capacity <= 0 {
            &mut []
        } else {
            // SAFETY: the caller provides per_expert_capacity writable ints.
            unsafe { std::slice::from_raw_parts_mut(num_recv_tokens_per_expert, per_expert_capacity as usize) }
        };
        let prepared = dispatch::prepare(buffer_ref(buf)?, args_ref("args", args)?, stream, list)?;
        *out = prepared.num_recv_tokens;
        Ok(())
    })
}

/// Step 2 of DeepEP's intranode_dispatch: the data kernel into the caller's outputs.
#[no_mangle]
pub extern "C" fn deepep_intranode_dispatch(
    buf: *const super::DeepepBuffer,
    args: *const DeepepIntranodeDispatchArgs,
    outputs: *const DeepepIntranodeDispatchOutputs,
    stream: *mut c_void,
) -> crate::error::DeepepStatus {
    ffi(|| dispatch::launch(buffer_ref(buf)?, args_ref("args", args)?, args_ref("outputs", outputs)?, stream))
}

/// DeepEP's intranode_combine: sums each token's rows over the ranks it was
/// sent to (fp32, plus biases) into combined_x on its source rank.
#[no_mangle]
pub extern "C" fn deepep_intranode_combine(
    buf: *const super::DeepepBuffer,
    args: *const DeepepIntranodeCombineArgs,
    stream: *mut c_void,
) -> crate::error::DeepepStatus {
    ffi(|| combine::combine(buffer_ref(buf)?, args_ref("args", args)?, stream))
}
