//! Rust mirror of kernels/deepep_kernels.h: the launch surface into the CUDA
//! C++ kernels. Struct layouts are checked against nvcc's sizeof() once per
//! process ([`check_struct_layouts`]).
use std::os::raw::{c_char, c_int, c_void};

use once_cell::sync::OnceCell;

use crate::error::{Error, Result};

pub const WAIT_OP_LSA_BARRIER: i32 = 1;
pub const WAIT_OP_DISPATCH_SLOT: i32 = 2;
pub const WAIT_OP_DISPATCH_CONSUMED: i32 = 3;
pub const WAIT_OP_COMBINE_SLOT: i32 = 4;
pub const WAIT_OP_COMBINE_CONSUMED: i32 = 5;
pub const WAIT_OP_LL_DISPATCH: i32 = 6;
pub const WAIT_OP_LL_COMBINE: i32 = 7;
pub const WAIT_OP_LL_CLEAN: i32 = 8;

/// `DEEPEP_LL_MAX_TOPK` and the LL phase bits.
pub const LL_MAX_TOPK: i64 = 16;
pub const LL_PHASE_SEND: i32 = 1;
pub const LL_PHASE_RECV: i32 = 2;
/// Grid limit of the LL kernels (DEEPEP_LL_MAX_BLOCKS: recv_epoch has a slot per block).
pub const LL_MAX_BLOCKS: i32 = 1024;
/// How LL kernels reach peers outside the sender's node (`remote_kind`).
pub const LL_REMOTE_NONE: i32 = 0;
pub const LL_REMOTE_EMULATED: i32 = 1;
pub const LL_REMOTE_GIN: i32 = 2;
/// `DEEPEP_LL_CLEAN_BANK`: the clean barrier's half number (GIN signal ids 4R + source).
pub const LL_CLEAN_BANK: i32 = 2;
/// GIN signals per source rank: (half, op kind) for the two halves, then the clean barrier.
pub const LL_GIN_SIGNALS_PER_RANK: i32 = 5;
/// `DEEPEP_LL_CLEAN_REGIONS`.
pub const LL_CLEAN_REGIONS: usize = 4;

pub const FAULT_TOPK_OUT_OF_RANGE: i32 = 1;
pub const FAULT_RANK_COUNT: i32 = 2;
pub const FAULT_WORST_TOO_SMALL: i32 = 3;

/// `DEEPEP_MAX_LOCAL_EXPERTS`, `DEEPEP_MAX_NVL_RANKS`, `DEEPEP_MAX_CHANNELS`.
pub const MAX_LOCAL_EXPERTS: usize = 1024;
pub const MAX_NVL_RANKS: i32 = 8;
pub const MAX_CHANNELS: i32 = 128;
/// Bytes of one notify exchange slot (kernels/normal_notify.cu).
pub const NOTIFY_SLOT_BYTES: usize = (MAX_NVL_RANKS as usize + MAX_CHANNELS as usize + MAX_LOCAL_EXPERTS) * 4;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct StallRecord {
    pub flag: u32,
    pub rank: i32,
    pub peer: i32,
    pub op: i32,
    pub counter: i32,
    pub reserved: i32,
    pub expected: i64,
    pub seen: i64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct WaitContext {
    pub stall: *mut StallRecord,
    pub stall_lock: *mut u32,
    pub timeout_ns: u64,
    pub world_rank: i32,
    pub lsa_base_rank: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct LayoutParams {
    pub topk_idx: *const c_void,
    pub num_tokens: i64,
    pub num_topk: i32,
    pub topk_idx_is_int32: i32,
    pub num_experts: i32,
    pub num_ranks: i32,
    pub num_rdma_ranks: i32,
    pub num_ranks_per_rdma_rank: i32,
    pub num_tokens_per_rank: *mut i32,
    pub num_tokens_per_rdma_rank: *mut i32,
    pub num_tokens_per_expert: *mut i32,
    pub is_token_in_rank: *mut u8,
    pub accumulators: *mut i32,
    pub ticket: *mut u32,
    pub accumulators_capacity: i64,
    pub num_sms: i32,
    pub reserved: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct FaultRecord {
    pub flag: u32,
    pub code: i32,
    pub a: i64,
    pub b: i64,
    pub c: i64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RecvCounts {
    pub num_recv_tokens: i32,
    pub reserved: i32,
    pub num_recv_tokens_per_expert: [i32; MAX_LOCAL_EXPERTS],
}

impl Default for RecvCounts {
    fn default() -> Self {
        Self { num_recv_tokens: -1, reserved: 0, num_recv_tokens_per_expert: [0; MAX_LOCAL_EXPERTS] }
    }
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct NormalCommon {
    pub window: *mut c_void,
    pub nvl_offset: u64,
    pub notify_offset: u64,
    pub op_epoch: *mut u32,
    pub notify_epoch: *mut u32,
    pub ticket: *mut u32,
    pub fault: *mut FaultRecord,
    pub wait: WaitContext,
    pub rank: i32,
    pub num_ranks: i32,
    pub num_channels: i32,
    pub ring_tokens: i32,
    pub barrier_base: i32,
    pub reserved: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct NotifyParams {
    pub common: NormalCommon,
    pub is_token_in_rank: *const u8,
    pub num_tokens_per_rank: *const i32,
    pub num_tokens_per_expert: *const i32,
    pub topk_idx: *const c_void,
    pub rank_prefix_matrix: *mut i32,
    pub channel_prefix_matrix: *mut i32,
    pub recv_channel_prefix_matrix: *mut i32,
    pub counts: *mut RecvCounts,
    pub num_tokens: i64,
    pub num_topk: i32,
    pub topk_idx_is_int32: i32,
    pub num_experts: i32,
    pub expert_alignment: i32,
    pub cached: i32,
    pub num_worst_tokens: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DispatchParams {
    pub common: NormalCommon,
    pub x: *const c_void,
    pub x_scales: *const c_void,
    pub topk_idx: *const c_void,
    pub topk_weights: *const f32,
    pub is_token_in_rank: *const u8,
    pub rank_prefix_matrix: *const i32,
    pub channel_prefix_matrix: *const i32,
    pub recv_channel_prefix_matrix: *const i32,
    pub recv_x: *mut c_void,
    pub recv_x_scales: *mut c_void,
    pub recv_topk_idx: *mut c_void,
    pub recv_topk_weights: *mut f32,
    pub recv_src_idx: *mut i32,
    pub send_head: *mut i32,
    pub num_tokens: i64,
    pub num_recv_rows: i64,
    pub scale_stride_token: i64,
    pub scale_stride_scale: i64,
    pub hidden_bytes: i32,
    pub num_scales: i32,
    pub num_topk: i32,
    pub topk_idx_is_int32: i32,
    pub num_experts: i32,
    pub slot_bytes: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CombineParams {
    pub common: NormalCommon,
    pub x: *const c_void,
    pub topk_weights: *const f32,
    pub bias_0: *const c_void,
    pub bias_1: *const c_void,
    pub rank_prefix_matrix: *const i32,
    pub recv_channel_prefix_matrix: *const i32,
    pub send_head: *const i32,
    pub combined_x: *mut c_void,
    pub combined_topk_weights: *mut f32,
    pub num_tokens: i64,
    pub num_recv_rows: i64,
    pub hidden_bytes: i32,
    pub num_topk: i32,
    pub slot_bytes: i32,
    pub reserved: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct LlCommon {
    pub window: *mut c_void,
    pub lsa_base: *mut u8,
    pub lsa_stride: u64,
    pub local_base: *mut u8,
    pub signal_offset: u64,
    pub combine_recv_offset: u64,
    pub view_offset: u64,
    pub staging_offset: u64,
    pub dispatch_recv_offset: u64,
    pub count_offset: u64,
    pub done: *mut i32,
    pub source_state: *mut i32,
    pub ticket: *mut u32,
    pub recv_epoch: *mut u32,
    pub mask: *mut i32,
    pub wait: WaitContext,
    pub rank: i32,
    pub num_ranks: i32,
    pub num_experts: i32,
    pub num_local_experts: i32,
    pub max_tokens: i32,
    pub hidden: i32,
    pub num_topk: i32,
    pub node_size: i32,
    pub shrink: i32,
    pub phases: i32,
    pub parity: i32,
    pub reserved: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct LlDispatchParams {
    pub common: LlCommon,
    pub x: *const c_void,
    pub topk_idx: *const c_void,
    pub packed_recv_x: *mut c_void,
    pub packed_recv_x_scales: *mut c_void,
    pub packed_recv_count: *mut i32,
    pub packed_recv_src_info: *mut i32,
    pub packed_recv_layout_range: *mut i64,
    pub cumulative_local_expert_recv_stats: *mut i32,
    pub dispatch_wait_recv_cost_stats: *mut i64,
    pub num_tokens: i32,
    pub topk_idx_is_int32: i32,
    pub use_fp8: i32,
    pub round_scale: i32,
    pub use_ue8m0: i32,
    pub dispatch_slot_bytes: i32,
    pub count_bytes: i32,
    pub reserved: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct LlCombineParams {
    pub common: LlCommon,
    pub x: *const c_void,
    pub topk_idx: *const c_void,
    pub topk_weights: *const f32,
    pub src_info: *const i32,
    pub layout_range: *const i64,
    pub out: *mut c_void,
    pub combine_wait_recv_cost_stats: *mut i64,
    pub num_tokens: i32,
    pub topk_idx_is_int32: i32,
    pub zero_copy: i32,
    pub use_logfmt: i32,
    pub reserved: [i32; 2],
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct LlCleanParams {
    pub common: LlCommon,
    pub barrier_epoch: *mut u32,
    pub zero: [*mut c_void; LL_CLEAN_REGIONS],
    pub zero_bytes: [i64; LL_CLEAN_REGIONS],
    pub num_gin_signals: i32,
    pub reserved: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct DevCommInfo {
    pub rank: i32,
    pub num_ranks: i32,
    pub lsa_rank: i32,
    pub lsa_size: i32,
}

const STRUCT_STALL_RECORD: c_int = 0;
const STRUCT_WAIT_CONTEXT: c_int = 1;
const STRUCT_LAYOUT_PARAMS: c_int = 2;
pub const STRUCT_DEV_COMM: c_int = 3;
pub const STRUCT_DEV_COMM_REQUIREMENTS: c_int = 4;
const STRUCT_NOTIFY_PARAMS: c_int = 5;
const STRUCT_DISPATCH_PARAMS: c_int = 6;
const STRUCT_COMBINE_PARAMS: c_int = 7;
const STRUCT_RECV_COUNTS: c_int = 8;
const STRUCT_FAULT_RECORD: c_int = 9;
const STRUCT_LL_DISPATCH_PARAMS: c_int = 10;
const STRUCT_LL_COMBINE_PARAMS: c_int = 11;
const STRUCT_LL_CLEAN_PARAMS: c_int = 12;

extern "C" {
    pub fn deepep_kernel_struct_size(which: c_int) -> usize;
    pub fn deepep_kernels_nccl_version() -> c_int;
    pub fn deepep_devcomm_requirements_init(reqs: *mut c_void, lsa_barrier_count: c_int, gin_signal_count: c_int);
    pub fn deepep_devcomm_info(dev_comm: *const c_void, out: *mut DevCommInfo);
    pub fn deepep_launch_window_geometry(window: *mut c_void, lsa_size: c_int, out: *mut u64, stream: *mut c_void) -> c_int;
    pub fn deepep_launch_lsa_barrier(dev_comm: *const c_void, index: c_int, wait: WaitContext, stream: *mut c_void) -> c_int;
    pub fn deepep_launch_lsa_peer_check(
        dev_comm: *const c_void,
        window: *mut c_void,
        slots_offset: usize,
        tag: u32,
        barrier_index: c_int,
        wait: WaitContext,
        mismatches: *mut i32,
        stream: *mut c_void,
    ) -> c_int;
    pub fn deepep_launch_dispatch_layout(params: *const LayoutParams, stream: *mut c_void) -> c_int;
    pub fn deepep_dispatch_layout_workspace_elems(params: *const LayoutParams) -> i64;
    pub fn deepep_launch_normal_notify(dev_comm: *const c_void, params: *const NotifyParams, stream: *mut c_void) -> c_int;
    pub fn deepep_launch_normal_dispatch(params: *const DispatchParams, stream: *mut c_void) -> c_int;
    pub fn deepep_launch_normal_combine(dev_comm: *const c_void, params: *const CombineParams, stream: *mut c_void) -> c_int;
    pub fn deepep_dispatch_slot_bytes(hidden_bytes: i32, num_scales: i32, num_topk: i32) -> i64;
    pub fn deepep_combine_slot_bytes(hidden_bytes: i32, num_topk: i32) -> i64;
    pub fn deepep_launch_ll_dispatch(
        dev_comm: *const c_void,
        params: *const LlDispatchParams,
        remote_kind: c_int,
        num_blocks: c_int,
        stream: *mut c_void,
    ) -> c_int;
    pub fn deepep_launch_ll_combine(
        dev_comm: *const c_void,
        params: *const LlCombineParams,
        remote_kind: c_int,
        num_blocks: c_int,
        stream: *mut c_void,
    ) -> c_int;
    pub fn deepep_ll_dispatch_slot_bytes(hidden: i32, num_topk: i32, use_fp8: i32) -> i64;
    pub fn deepep_ll_count_bytes(num_local_experts: i32, max_tokens: i32) -> i64;
    pub fn deepep_ll_combine_slot_bytes(hidden: i32, use_logfmt: i32) -> i64;
    pub fn deepep_ll_gin_compiled() -> c_int;
    pub fn deepep_launch_ll_clean(
        dev_comm: *const c_void,
        params: *const LlCleanParams,
        remote_kind: c_int,
        stream: *mut c_void,
    ) -> c_int;
    pub fn deepep_cuda_error_string(error: c_int) -> *const c_char;
}

/// NCCL version the kernels (and the devComm layout) were compiled against.
pub fn compiled_nccl_version() -> i32 {
    // SAFETY: pure function returning a compile-time constant.
    unsafe { deepep_kernels_nccl_version() }
}

/// Size of an NCCL struct as compiled into the kernels.
pub fn nccl_struct_size(which: c_int) -> usize {
    // SAFETY: pure function returning sizeof() of a known struct.
    unsafe { deepep_kernel_struct_size(which) }
}

/// Verifies the Rust mirrors match nvcc's layout; cached after the first call.
pub fn check_struct_layouts() -> Result<()> {
    static CHECKED: OnceCell<std::result::Result<(), String>> = OnceCell::new();
    CHECKED
        .get_or_init(|| {
            let pairs = [
                ("DeepepStallRecord", STRUCT_STALL_RECORD, std::mem::size_of::<StallRecord>()),
                ("DeepepWaitContext", STRUCT_WAIT_CONTEXT, std::mem::size_of::<WaitContext>()),
                ("DeepepLayoutParams", STRUCT_LAYOUT_PARAMS, std::mem::size_of::<LayoutParams>()),
                ("DeepepNotifyParams", STRUCT_NOTIFY_PARAMS, std::mem::size_of::<NotifyParams>()),
                ("DeepepDispatchParams", STRUCT_DISPATCH_PARAMS, std::mem::size_of::<DispatchParams>()),
                ("DeepepCombineParams", STRUCT_COMBINE_PARAMS, std::mem::size_of::<CombineParams>()),
                ("DeepepRecvCounts", STRUCT_RECV_COUNTS, std::mem::size_of::<RecvCounts>()),
                ("DeepepFaultRecord", STRUCT_FAULT_RECORD, std::mem::size_of::<FaultRecord>()),
                ("DeepepLlDispatchParams", STRUCT_LL_DISPATCH_PARAMS, std::mem::size_of::<LlDispatchParams>()),
                ("DeepepLlCombineParams", STRUCT_LL_COMBINE_PARAMS, std::mem::size_of::<LlCombineParams>()),
                ("DeepepLlCleanParams", STRUCT_LL_CLEAN_PARAMS, std::mem::size_of::<LlCleanParams>()),
            ];
            for (name, id, rust_size) in pairs {
                let c_size = nccl_struct_size(id);
                if c_size != rust_size {
                    return Err(format!("{name}: kernels were built with sizeof {c_size}, Rust expects {rust_size}"));
                }
            }
            Ok(())
        })
        .clone()
        .map_err(Error::internal)
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
    fn rust_mirrors_match_nvcc_layouts() {
        check_struct_layouts().unwrap();
    }

    #[test]
    fn devcomm_sizes_are_known_for_the_compiled_nccl() {
        let version = compiled_nccl_version();
        let size = nccl_struct_size(STRUCT_DEV_COMM);
        // 200 B on 2.28, 248 B on 2.31+ (the toolchain notes); never zero.
        assert!(size >= 200, "sizeof(ncclDevComm) = {size} for NCCL {version}");
        assert!(nccl_struct_size(STRUCT_DEV_COMM_REQUIREMENTS) >= 56);
        assert_eq!(nccl_struct_size(99), 0);
    }
}
