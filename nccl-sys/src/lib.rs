//! Raw FFI declarations for the NCCL host API used by deepep-nccl.
//!
//! Only what the project calls is declared. Structs whose layout changes between
//! NCCL minors (`ncclDevComm`, `ncclDevCommRequirements`) are opaque here: the
//! kernel-side C++ (compiled against the same headers) reports their sizes and
//! fills them, so Rust never hard-codes a layout that could drift.
#![allow(non_camel_case_types, non_snake_case, non_upper_case_globals)]

use std::os::raw::{c_char, c_int, c_void};

pub type ncclResult_t = c_int;
pub const ncclSuccess: ncclResult_t = 0;
pub const ncclUnhandledCudaError: ncclResult_t = 1;
pub const ncclSystemError: ncclResult_t = 2;
pub const ncclInternalError: ncclResult_t = 3;
pub const ncclInvalidArgument: ncclResult_t = 4;
pub const ncclInvalidUsage: ncclResult_t = 5;
pub const ncclRemoteError: ncclResult_t = 6;
pub const ncclInProgress: ncclResult_t = 7;

pub const NCCL_UNIQUE_ID_BYTES: usize = 128;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclUniqueId {
    pub internal: [c_char; NCCL_UNIQUE_ID_BYTES],
}

#[repr(C)]
pub struct ncclComm {
    _opaque: [u8; 0],
}
pub type ncclComm_t = *mut ncclComm;

#[repr(C)]
pub struct ncclWindow_vidmem {
    _opaque: [u8; 0],
}
/// A device pointer to NCCL's window descriptor (usable in kernels only).
pub type ncclWindow_t = *mut ncclWindow_vidmem;

/// Layout depends on the NCCL minor version: allocate the size reported by the
/// kernel library compiled against the same headers.
#[repr(C)]
pub struct ncclDevComm {
    _opaque: [u8; 0],
}
#[repr(C)]
pub struct ncclDevCommRequirements {
    _opaque: [u8; 0],
}

/// `struct ncclTeam { int nRanks, rank, stride; }` (stable since 2.28.3).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ncclTeam_t {
    pub nRanks: c_int,
    pub rank: c_int,
    pub stride: c_int,
}

pub const NCCL_WIN_DEFAULT: c_int = 0x00;
pub const NCCL_WIN_COLL_SYMMETRIC: c_int = 0x01;
/// Required alignment of a window's offset inside its cuMem allocation.
pub const NCCL_WIN_REQUIRED_ALIGNMENT: usize = 4096;

extern "C" {
    pub fn ncclGetVersion(version: *mut c_int) -> ncclResult_t;
    pub fn ncclGetUniqueId(uniqueId: *mut ncclUniqueId) -> ncclResult_t;
    pub fn ncclGetErrorString(result: ncclResult_t) -> *const c_char;
    pub fn ncclGetLastError(comm: ncclComm_t) -> *const c_char;

    pub fn ncclCommInitRank(
        comm: *mut ncclComm_t,
        nranks: c_int,
        commId: ncclUniqueId,
        rank: c_int,
    ) -> ncclResult_t;
    pub fn ncclCommFinalize(comm: ncclComm_t) -> ncclResult_t;
    pub fn ncclCommDestroy(comm: ncclComm_t) -> ncclResult_t;
    pub fn ncclCommAbort(comm: ncclComm_t) -> ncclResult_t;
    pub fn ncclCommGetAsyncError(comm: ncclComm_t, asyncError: *mut ncclResult_t) -> ncclResult_t;
    pub fn ncclCommCount(comm: ncclComm_t, count: *mut c_int) -> ncclResult_t;
    pub fn ncclCommCuDevice(comm: ncclComm_t, device: *mut c_int) -> ncclResult_t;
    pub fn ncclCommUserRank(comm: ncclComm_t, rank: *mut c_int) -> ncclResult_t;

    pub fn ncclGroupStart() -> ncclResult_t;
    pub fn ncclGroupEnd() -> ncclResult_t;

    pub fn ncclMemAlloc(ptr: *mut *mut c_void, size: usize) -> ncclResult_t;
    pub fn ncclMemFree(ptr: *mut c_void) -> ncclResult_t;

    pub fn ncclCommWindowRegister(
        comm: ncclComm_t,
        buff: *mut c_void,
        size: usize,
        win: *mut ncclWindow_t,
        winFlags: c_int,
    ) -> ncclResult_t;
    pub fn ncclCommWindowDeregister(comm: ncclComm_t, win: ncclWindow_t) -> ncclResult_t;

    pub fn ncclDevCommCreate(
        comm: ncclComm_t,
        reqs: *const ncclDevCommRequirements,
        outDevComm: *mut ncclDevComm,
    ) -> ncclResult_t;
    pub fn ncclDevCommDestroy(comm: ncclComm_t, devComm: *const ncclDevComm) -> ncclResult_t;

    pub fn ncclTeamWorld(comm: ncclComm_t) -> ncclTeam_t;
    pub fn ncclTeamLsa(comm: ncclComm_t) -> ncclTeam_t;
    pub fn ncclTeamRail(comm: ncclComm_t) -> ncclTeam_t;
}

/// `NCCL_VERSION(X,Y,Z)` as defined by nccl.h for 2.9+.
pub const fn nccl_version_code(major: i32, minor: i32, patch: i32) -> i32 {
    major * 10000 + minor * 100 + patch
}

/// Splits a version code into (major, minor, patch).
pub const fn split_version(code: i32) -> (i32, i32, i32) {
    (code / 10000, (code % 10000) / 100, code % 100)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_code_round_trip() {
        assert_eq!(nccl_version_code(2, 28, 9), 22809);
        assert_eq!(split_version(23203), (2, 32, 3));
    }

    #[test]
    fn runtime_version_is_readable_without_a_gpu() {
        let mut v = 0;
        // SAFETY: ncclGetVersion only writes one int through the valid pointer.
        let rc = unsafe { ncclGetVersion(&mut v) };
        assert_eq!(rc, ncclSuccess);
        assert!(v >= nccl_version_code(2, 28, 0), "runtime NCCL {v} is older than 2.28");
    }
}
