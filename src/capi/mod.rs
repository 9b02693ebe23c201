//! The C ABI: the one door into the core. Every function returns a
//! `DeepepStatus`; on failure `deepep_last_error()` says what went wrong on this
//! thread. No panic crosses the boundary.
use std::ffi::CStr;
use std::os::raw::{c_char, c_int};
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::error::{clear_last_error, last_error_ptr, set_last_error, DeepepStatus, Error, Result};
use crate::outputs::DEEPEP_MAX_OP_OUTPUTS;
use crate::tensor::DeepepDtype;

mod buffer;
mod config;
mod internode;
mod low_latency;
mod normal;

pub use buffer::*;
pub use config::*;
pub use internode::*;
pub use low_latency::*;
pub use normal::*;

/// Bumped on any incompatible change to this header.
pub const DEEPEP_ABI_VERSION: u32 = 2;
/// Size of the NCCL unique id that bootstraps a buffer.
pub const DEEPEP_UNIQUE_ID_BYTES: usize = 128;
const _: () = assert!(DEEPEP_UNIQUE_ID_BYTES == nccl_sys::NCCL_UNIQUE_ID_BYTES);
/// Most dimensions of a `DeepepTensor`.
pub const DEEPEP_MAX_DIMS: usize = 4;
/// Most experts per rank: the capacity of a per-expert received-count list.
pub const DEEPEP_MAX_LOCAL_EXPERTS: i32 = 1024;
/// GPUs per NVLink domain (DeepEP's `NUM_MAX_NVL_PEERS`); normal mode runs within one.
pub const DEEPEP_NUM_MAX_NVL_PEERS: i32 = 8;
/// `phases` of a low-latency call: the send, the receive (DeepEP's hook), or both.
pub const DEEPEP_LL_PHASE_SEND: i32 = 1;
pub const DEEPEP_LL_PHASE_RECV: i32 = 2;
pub const DEEPEP_LL_PHASE_BOTH: i32 = DEEPEP_LL_PHASE_SEND | DEEPEP_LL_PHASE_RECV;

/// `(C name, value)` of each constant given, the name taken from the Rust identifier.
macro_rules! by_name {
    ($($name:ident),* $(,)?) => { [$((stringify!($name), $name as i64)),*] };
}

/// Every public `#define` of the header (a test checks the header has no other).
const PUBLIC_CONSTANTS: [(&str, i64); 9] = by_name!(
    DEEPEP_ABI_VERSION,
    DEEPEP_UNIQUE_ID_BYTES,
    DEEPEP_MAX_DIMS,
    DEEPEP_MAX_LOCAL_EXPERTS,
    DEEPEP_NUM_MAX_NVL_PEERS,
    DEEPEP_LL_PHASE_SEND,
    DEEPEP_LL_PHASE_RECV,
    DEEPEP_LL_PHASE_BOTH,
    DEEPEP_MAX_OP_OUTPUTS,
);

/// Runs `f`, converting errors and panics into a status plus last-error text.
pub(crate) fn ffi(f: impl FnOnce() -> Result<()>) -> DeepepStatus {
    clear_last_error();
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => DeepepStatus::DEEPEP_SUCCESS,
        Ok(Err(e)) => {
            set_last_error(&e.message);
            e.status
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            set_last_error(&format!("internal error in deepep-nccl (please report): {what}"));
            DeepepStatus::DEEPEP_ERROR_INTERNAL
        }
    }
}

/// Turns an out-pointer into a reference, naming it when NULL.
pub(crate) fn out_ref<'a, T>(name: &str, ptr: *mut T) -> Result<&'a mut T> {
    // SAFETY: callers pass pointers to writable T or NULL; NULL is rejected.
    unsafe { ptr.as_mut() }.ok_or_else(|| Error::invalid(format!("{name} must not be NULL")))
}

/// A dispatch prepare's per-expert received-count list: empty for NULL or a capacity <= 0, and
/// never longer than DEEPEP_MAX_LOCAL_EXPERTS (no more entries are ever written).
///
/// # Safety
/// `ptr` is NULL or points at `capacity` writable ints that outlive the returned slice.
pub(crate) unsafe fn per_expert_list<'a>(ptr: *mut c_int, capacity: c_int) -> &'a mut [i32] {
    if ptr.is_null() || capacity <= 0 {
        return &mut [];
    }
    // SAFETY: the caller's contract; len <= capacity.
    unsafe { std::slice::from_raw_parts_mut(ptr, capacity.min(DEEPEP_MAX_LOCAL_EXPERTS) as usize) }
}

/// ABI version of this library (`DEEPEP_ABI_VERSION` it was built with).
#[no_mangle]
pub extern "C" fn deepep_abi_version() -> u32 {
    DEEPEP_ABI_VERSION
}

/// Value of a public constant of this header by its C name: a `#define` (e.g.
/// "DEEPEP_MAX_LOCAL_EXPERTS") or a value of `DeepepStatus`, `DeepepDtype` or `DeepepConfigKind`
/// (e.g. "DEEPEP_DTYPE_BFLOAT16"). Lets bindings read them from the library instead of copying them.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (NULL pointer, or no constant of that name);
/// DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_abi_constant(name: *const c_char, out: *mut i64) -> DeepepStatus {
    ffi(|| {
        if name.is_null() {
            return Err(Error::invalid("name must not be NULL"));
        }
        // SAFETY: name is non-NULL and the caller passes a NUL-terminated string.
        let name = unsafe { CStr::from_ptr(name) }.to_string_lossy();
        let out = out_ref("out", out)?;
        *out = abi_constant(&name).ok_or_else(|| Error::invalid(format!("no ABI constant is named {name:?}")))?;
        Ok(())
    })
}

fn abi_constant(name: &str) -> Option<i64> {
    // The enums' variants carry their C names.
    let statuses = DeepepStatus::ALL.map(|s| (format!("{s:?}"), s as i64));
    let dtypes = DeepepDtype::ALL.map(|d| (format!("{d:?}"), d as i64));
    let config_kinds = DeepepConfigKind::ALL.map(|k| (format!("{k:?}"), k as i64));
    PUBLIC_CONSTANTS
        .into_iter()
        .map(|(n, v)| (n.to_string(), v))
        .chain(statuses)
        .chain(dtypes)
        .chain(config_kinds)
        .find_map(|(n, v)| (n == name).then_some(v))
}

/// Library version string, e.g. "0.1.0".
#[no_mangle]
pub extern "C" fn deepep_library_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// NCCL_VERSION_CODE of the headers of the kernel build that serves the NCCL this process loaded
/// (the library holds one build per NCCL device-API layout, kernels/nccl_builds.txt); 0 when no
/// build serves it or NCCL cannot be queried (Buffer creation then fails naming both).
#[no_mangle]
pub extern "C" fn deepep_nccl_compiled_version() -> c_int {
    crate::nccl::kernel_build().map_or(0, |b| b.nccl_version())
}

/// NCCL version of the libnccl.so.2 loaded in this process (ncclGetVersion).
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (NULL out); DEEPEP_ERROR_NCCL;
/// DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_nccl_runtime_version(out: *mut c_int) -> DeepepStatus {
    ffi(|| {
        *out_ref("out", out)? = crate::nccl::runtime_version()?;
        Ok(())
    })
}

/// Message of the last failed call on this thread ("" if the last call succeeded).
/// Valid until the next deepep_* call on this thread.
#[no_mangle]
pub extern "C" fn deepep_last_error() -> *const c_char {
    last_error_ptr()
}

/// Bytes per element of a `DeepepDtype` value; 0 for a code that is not one.
#[no_mangle]
pub extern "C" fn deepep_dtype_size(dtype: i32) -> i64 {
    DeepepDtype::from_code(dtype).map_or(0, DeepepDtype::size)
}

/// Name of a status code, e.g. "DEEPEP_ERROR_INVALID_ARGUMENT".
#[no_mangle]
pub extern "C" fn deepep_status_string(status: c_int) -> *const c_char {
    match DeepepStatus::from_code(status) {
        Some(s) => s.c_name().as_ptr(),
        None => c"DEEPEP_UNKNOWN_STATUS".as_ptr(),
    }
}

/// Number of CUDA devices; DEEPEP_ERROR_NO_DEVICE when there is no driver or no GPU.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (NULL out); DEEPEP_ERROR_NO_DEVICE (no driver or
/// no GPU); DEEPEP_ERROR_CUDA; DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_device_count(out: *mut c_int) -> DeepepStatus {
    ffi(|| {
        let out = out_ref("out", out)?;
        *out = 0;
        *out = crate::cuda::ensure_driver()?;
        Ok(())
    })
}

/// Writes a fresh ncclUniqueId (DEEPEP_UNIQUE_ID_BYTES bytes) for rank 0 to share.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (NULL out or len too small); DEEPEP_ERROR_NCCL;
/// DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_get_unique_id(out: *mut u8, len: usize) -> DeepepStatus {
    ffi(|| {
        if out.is_null() {
            return Err(Error::invalid("out must not be NULL"));
        }
        if len < DEEPEP_UNIQUE_ID_BYTES {
            return Err(Error::invalid(format!("len must be >= {DEEPEP_UNIQUE_ID_BYTES}, got {len}")));
        }
        let id = crate::nccl::unique_id()?;
        // SAFETY: out has at least DEEPEP_UNIQUE_ID_BYTES writable bytes (checked above).
        unsafe { std::ptr::copy_nonoverlapping(id.as_ptr(), out, id.len()) };
        Ok(())
    })
}
