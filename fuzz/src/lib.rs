//! Helpers the fuzz targets share: integers biased toward the edges (where wraps live)
//! and the status checks every target applies.
pub use libfuzzer_sys::arbitrary::Unstructured;
use deepep_nccl::DeepepStatus;

/// An i64 that is often an edge value (0, +-1, the i32/i64 limits, powers of two), else raw.
pub fn i64_edge(u: &mut Unstructured) -> i64 {
    const EDGES: [i64; 16] = [
        0, 1, -1, 2, 8, 128, 7168, 1 << 16, 1 << 31, i32::MAX as i64, i32::MIN as i64,
        i64::MAX, i64::MIN, i64::MAX / 2, (1 << 62) + 1, u32::MAX as i64,
    ];
    match u.int_in_range(0u8..=3).unwrap_or(0) {
        0 => EDGES[u.choose_index(EDGES.len()).unwrap_or(0)],
        1 => u.int_in_range(-4i64..=1 << 17).unwrap_or(0),
        _ => u.arbitrary().unwrap_or(0),
    }
}

/// An i32 biased like [`i64_edge`].
pub fn i32_edge(u: &mut Unstructured) -> i32 {
    const EDGES: [i32; 12] = [0, 1, -1, 2, 7, 8, 16, 128, 160, 1024, i32::MAX, i32::MIN];
    match u.int_in_range(0u8..=3).unwrap_or(0) {
        0 => EDGES[u.choose_index(EDGES.len()).unwrap_or(0)],
        1 => u.int_in_range(-4i32..=4096).unwrap_or(0),
        _ => u.arbitrary().unwrap_or(0),
    }
}

pub fn bool_(u: &mut Unstructured) -> bool {
    u.arbitrary().unwrap_or(false)
}

/// INTERNAL means a panic was caught at the FFI boundary (or an overflow check fired): a finding.
pub fn no_internal(what: &str, s: DeepepStatus) {
    assert!(s != DeepepStatus::DEEPEP_ERROR_INTERNAL, "{what}: DEEPEP_ERROR_INTERNAL: {}", last_error());
}

/// A host-only validator returns SUCCESS or INVALID_ARGUMENT and nothing else.
pub fn ok_or_invalid(what: &str, s: DeepepStatus) -> bool {
    no_internal(what, s);
    assert!(
        matches!(s, DeepepStatus::DEEPEP_SUCCESS | DeepepStatus::DEEPEP_ERROR_INVALID_ARGUMENT),
        "{what}: unexpected status {s:?}: {}",
        last_error()
    );
    s == DeepepStatus::DEEPEP_SUCCESS
}

pub fn last_error() -> String {
    let p = deepep_nccl::capi::deepep_last_error();
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the library returns a NUL-terminated thread-local string, valid until the next call.
    unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// With DEEPEP_FUZZ_TRACE set, prints each call before it is made: libfuzzer-sys aborts at the
/// panic itself (before any catch_unwind, the library's included), so this is how a crash input
/// names its arguments (run the target binary on the input with the variable set).
pub fn trace(what: &str) {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *ON.get_or_init(|| std::env::var_os("DEEPEP_FUZZ_TRACE").is_some()) {
        eprintln!("call: {what}");
    }
}

/// Exact product for the lower bounds, saturating at the i128 limits (never overflows itself).
pub fn prod(xs: &[i128]) -> i128 {
    xs.iter().fold(1i128, |a, x| a.saturating_mul(*x))
}
