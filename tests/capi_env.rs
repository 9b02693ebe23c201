//! A bad environment variable fails Buffer creation with INVALID_ARGUMENT naming it.
//! Its own test binary (process): the environment is process-global, and buffers
//! created by tests/capi.rs must not see these values.
use std::ffi::CStr;

use deepep_nccl::capi::*;
use deepep_nccl::error::DeepepStatus::*;

/// A 5-byte unique id: the environment is checked before it, and the id check after
/// it stops creation before any GPU or NCCL call (so this never hangs on a GPU machine).
fn create() -> (deepep_nccl::DeepepStatus, String) {
    let id = [0u8; 5];
    let mut buf = std::ptr::null_mut();
    let status = deepep_buffer_create(0, 1, id.as_ptr(), id.len(), 1 << 20, 0, false, false, false, &mut buf);
    assert!(buf.is_null());
    // SAFETY: deepep_last_error returns a NUL-terminated string valid until the next call.
    (status, unsafe { CStr::from_ptr(deepep_last_error()) }.to_string_lossy().into_owned())
}

#[test]
fn bad_values_fail_buffer_creation_naming_the_variable() {
    for (name, value) in [
        ("DEEPEP_GPU_TIMEOUT_SECS", "inf"),
        ("DEEPEP_GPU_TIMEOUT_SECS", "0"),
        ("DEEPEP_GPU_TIMEOUT_SECS", "abc"),
        ("DEEPEP_VIRTUAL_NODE_SIZE", "0"),
        ("DEEPEP_LOG", "verbose"),
    ] {
        // Race-free: this binary runs this one test; no other thread reads the env.
        std::env::set_var(name, value);
        let (status, msg) = create();
        std::env::remove_var(name);
        assert_eq!(status, DEEPEP_ERROR_INVALID_ARGUMENT, "{name}={value}: {msg}");
        assert!(msg.contains(name) && msg.contains(&format!("{value:?}")) && msg.contains("accepted"), "{msg}");
    }
    // Good values pass the environment check and reach the unique-id check.
    for (name, value) in [("DEEPEP_GPU_TIMEOUT_SECS", "20"), ("DEEPEP_VIRTUAL_NODE_SIZE", "1"), ("DEEPEP_LOG", "info")] {
        std::env::set_var(name, value);
    }
    let (status, msg) = create();
    assert_eq!(status, DEEPEP_ERROR_INVALID_ARGUMENT);
    assert!(msg.contains("unique_id must be 128 bytes"), "{msg}");
}
