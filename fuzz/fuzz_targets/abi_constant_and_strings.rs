//! deepep_abi_constant with arbitrary names, deepep_status_string and deepep_dtype_size with
//! arbitrary codes: never INTERNAL, a known name round-trips, every code gets a NUL-terminated
//! name, a dtype code is 1-8 bytes or 0 (not a dtype).
#![no_main]
use std::ffi::{CStr, CString};

use deepep_nccl::capi::*;
use deepep_nccl::DeepepStatus;
use fuzz_common::*;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (head, rest) = data.split_at(data.len().min(4));
    let mut code = [0u8; 4];
    code[..head.len()].copy_from_slice(head);
    let code = i32::from_le_bytes(code);
    // SAFETY: the library returns a static NUL-terminated string.
    let name = unsafe { CStr::from_ptr(deepep_status_string(code)) }.to_str().expect("status names are ASCII");
    if (0..=9).contains(&code) {
        assert!(name.starts_with("DEEPEP_") && name != "DEEPEP_UNKNOWN_STATUS", "{code} -> {name}");
        // A status name is itself an ABI constant with that value.
        let mut v = -1i64;
        let n = CString::new(name).unwrap();
        assert_eq!(deepep_abi_constant(n.as_ptr(), &mut v), DeepepStatus::DEEPEP_SUCCESS, "{name}");
        assert_eq!(v, code as i64, "{name}");
    } else {
        assert_eq!(name, "DEEPEP_UNKNOWN_STATUS", "{code}");
    }

    let size = deepep_dtype_size(code);
    assert!(size == 0 || [1, 2, 4, 8].contains(&size), "dtype {code} -> {size} bytes");

    // The rest up to its first NUL is the name (CString adds the terminator).
    let bytes: Vec<u8> = rest.iter().copied().take_while(|b| *b != 0).collect();
    let cname = CString::new(bytes.clone()).unwrap();
    let mut v = i64::MIN;
    let s = deepep_abi_constant(cname.as_ptr(), &mut v);
    if ok_or_invalid("abi_constant", s) {
        assert!(bytes.starts_with(b"DEEPEP_"), "{:?} -> {v}", cname);
        assert!(v != i64::MIN, "SUCCESS without writing out");
    } else {
        assert_eq!(v, i64::MIN, "a refused name must leave out unwritten");
    }
    assert_eq!(deepep_abi_constant(std::ptr::null(), &mut v), DeepepStatus::DEEPEP_ERROR_INVALID_ARGUMENT);
    assert_eq!(deepep_abi_constant(cname.as_ptr(), std::ptr::null_mut()), DeepepStatus::DEEPEP_ERROR_INVALID_ARGUMENT);
});
