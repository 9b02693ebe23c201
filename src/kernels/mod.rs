//! The launch surface into the CUDA kernels. [`bindings`] is generated from
//! kernels/deepep_kernels.h (scripts/gen-kernel-bindings.sh) with compile-time checks of every
//! struct's size and field offsets; this module names its items for the crate and wraps the
//! pure functions.
use std::os::raw::c_int;

use crate::error::{Error, Result};

// include!() rather than a `mod` file so that cbindgen, which does not expand macros, never
// puts these internal items into include/deepep_nccl.h.
#[allow(non_camel_case_types, non_upper_case_globals, non_snake_case, clippy::all)]
mod bindings {
    include!("bindings.rs");
}
pub use bindings::*;

pub type StallRecord = DeepepStallRecord;
pub type WaitContext = DeepepWaitContext;
pub type LayoutParams = DeepepLayoutParams;
pub type FaultRecord = DeepepFaultRecord;
pub type RecvCounts = DeepepRecvCounts;
pub type NormalCommon = DeepepNormalCommon;
pub type NotifyParams = DeepepNotifyParams;
pub type DispatchParams = DeepepDispatchParams;
pub type CombineParams = DeepepCombineParams;
pub type LlCommon = DeepepLlCommon;
pub type LlDispatchParams = DeepepLlDispatchParams;
pub type LlCombineParams = DeepepLlCombineParams;
pub type LlCleanParams = DeepepLlCleanParams;
pub type DevCommInfo = DeepepDevCommInfo;

// The header's constants in the types the host code computes with.
pub(crate) const MAX_LOCAL_EXPERTS: usize = crate::capi::DEEPEP_MAX_LOCAL_EXPERTS as usize;
pub(crate) const MAX_NVL_RANKS: i32 = DEEPEP_MAX_NVL_RANKS;
pub(crate) const MAX_CHANNELS: i32 = DEEPEP_MAX_CHANNELS;
/// Bytes of one notify exchange slot.
pub(crate) const NOTIFY_SLOT_BYTES: usize = DEEPEP_NOTIFY_SLOT_INTS as usize * size_of::<i32>();
pub(crate) const LL_MAX_TOPK: i64 = DEEPEP_LL_MAX_TOPK as i64;
pub(crate) const LL_PHASE_SEND: i32 = crate::capi::DEEPEP_LL_PHASE_SEND;
pub(crate) const LL_MAX_BLOCKS: i32 = DEEPEP_LL_MAX_BLOCKS;
pub(crate) const LL_REMOTE_NONE: i32 = DEEPEP_LL_REMOTE_NONE as i32;
pub(crate) const LL_REMOTE_EMULATED: i32 = DEEPEP_LL_REMOTE_EMULATED as i32;
pub(crate) const LL_REMOTE_GIN: i32 = DEEPEP_LL_REMOTE_GIN as i32;
pub(crate) const LL_CLEAN_BANK: i32 = DEEPEP_LL_CLEAN_BANK;
pub(crate) const LL_SIGNAL_KINDS: i32 = DEEPEP_LL_SIGNAL_KINDS;
/// Bytes of a buffer half's LSA signal words per source rank: a u32 per signal kind.
pub(crate) const LL_SIGNAL_BYTES_PER_RANK: u64 = LL_SIGNAL_KINDS as u64 * size_of::<u32>() as u64;
pub(crate) const LL_GIN_SIGNALS_PER_RANK: i32 = DEEPEP_LL_GIN_SIGNALS_PER_RANK;

impl Default for RecvCounts {
    /// num_recv_tokens is -1 until the notify kernel has written the counts.
    fn default() -> Self {
        Self { num_recv_tokens: -1, reserved: 0, num_recv_tokens_per_expert: [0; MAX_LOCAL_EXPERTS] }
    }
}

/// NCCL version the kernels (and the devComm layout) were compiled against.
pub fn compiled_nccl_version() -> i32 {
    // SAFETY: pure function returning a compile-time constant.
    unsafe { deepep_kernels_nccl_version() }
}

/// sizeof(ncclDevComm) in the NCCL headers the kernels were compiled against.
pub fn devcomm_size() -> usize {
    // SAFETY: pure function returning a compile-time constant.
    unsafe { deepep_devcomm_size() }
}

/// sizeof(ncclDevCommRequirements) in those headers.
pub fn devcomm_requirements_size() -> usize {
    // SAFETY: pure function returning a compile-time constant.
    unsafe { deepep_devcomm_requirements_size() }
}

/// Bytes of one dispatch ring slot (header, row, scales, top-k ids, weights).
pub fn dispatch_slot_bytes(hidden_bytes: i32, num_scales: i32, num_topk: i32) -> i64 {
    // SAFETY: pure arithmetic.
    unsafe { deepep_dispatch_slot_bytes(hidden_bytes, num_scales, num_topk) }
}

/// Bytes of one combine ring slot (header, row, weights).
pub fn combine_slot_bytes(hidden_bytes: i32, num_topk: i32) -> i64 {
    // SAFETY: pure arithmetic.
    unsafe { deepep_combine_slot_bytes(hidden_bytes, num_topk) }
}

/// Bytes of one LL dispatch slot (header with the top-k list, then the payload).
pub fn ll_dispatch_slot_bytes(hidden: i32, num_topk: i32, use_fp8: bool) -> i64 {
    // SAFETY: pure arithmetic.
    unsafe { deepep_ll_dispatch_slot_bytes(hidden, num_topk, use_fp8 as i32) }
}

/// Bytes of one LL dispatch count message (per-expert counts, then the filled-slot bitmap).
pub fn ll_count_bytes(num_local_experts: i32, max_tokens: i32) -> i64 {
    // SAFETY: pure arithmetic.
    unsafe { deepep_ll_count_bytes(num_local_experts, max_tokens) }
}

/// Bytes of one LL combine slot; None when this build has no LogFMT.
pub fn ll_combine_slot_bytes(hidden: i32, use_logfmt: bool) -> Option<i64> {
    // SAFETY: pure arithmetic.
    let v = unsafe { deepep_ll_combine_slot_bytes(hidden, use_logfmt as i32) };
    (v > 0).then_some(v)
}

/// Bytes between rows of the zero-copy combine view, as the combine kernel writes them.
pub fn ll_view_row_bytes(hidden: i32) -> i64 {
    // SAFETY: pure arithmetic.
    unsafe { deepep_ll_view_row_bytes(hidden) }
}

/// Whether the kernels were built with the NCCL GIN transport.
pub fn ll_gin_compiled() -> bool {
    // SAFETY: returns a compile-time constant.
    unsafe { deepep_ll_gin_compiled() != 0 }
}

/// Turns a launcher's cudaError_t into an error naming the kernel.
pub fn launch_result(kernel: &str, code: c_int) -> Result<()> {
    if code == 0 {
        return Ok(());
    }
    // SAFETY: cudaGetErrorString returns a static NUL-terminated string for any code.
    let what = unsafe { std::ffi::CStr::from_ptr(deepep_cuda_error_string(code)) }.to_string_lossy();
    Err(Error::cuda(format!("launching {kernel} failed: {what} (cudaError {code})")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devcomm_sizes_are_known_for_the_compiled_nccl() {
        let version = compiled_nccl_version();
        let size = devcomm_size();
        // 200 B on 2.28, 248 B on 2.31+ (the toolchain notes); never zero.
        assert!(size >= 200, "sizeof(ncclDevComm) = {size} for NCCL {version}");
        assert!(devcomm_requirements_size() >= 56);
    }

    #[test]
    fn recv_counts_start_unwritten() {
        let counts = RecvCounts::default();
        assert_eq!(counts.num_recv_tokens, -1);
        assert_eq!(counts.num_recv_tokens_per_expert.len(), MAX_LOCAL_EXPERTS);
    }
}
