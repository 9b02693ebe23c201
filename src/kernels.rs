//! Rust mirror of kernels/deepep_kernels.h: the launch surface into the CUDA
//! C++ kernels. Struct layouts are checked against nvcc's sizeof() once per
//! process ([`check_struct_layouts`]).
use std::os::raw::{c_char, c_int, c_void};

use once_cell::sync::OnceCell;

use crate::error::{Error, Result};

pub const WAIT_OP_LSA_BARRIER: i32 = 1;

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

extern "C" {
    pub fn deepep_kernel_struct_size(which: c_int) -> usize;
    pub fn deepep_kernels_nccl_version() -> c_int;
    pub fn deepep_devcomm_requirements_init(reqs: *mut c_void, lsa_barrier_count: c_int);
    pub fn deepep_devcomm_info(dev_comm: *const c_void, out: *mut DevCommInfo);
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
