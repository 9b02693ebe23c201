//! One error type for the crate, its C status code, and the thread-local
//! last-error message the C ABI exposes.
use std::cell::RefCell;
use std::ffi::{CStr, CString};
use std::fmt;

/// Status codes returned by every C ABI function that returns a status; on any
/// code but DEEPEP_SUCCESS, deepep_last_error() says what went wrong. Each
/// function's "Returns:" line lists the codes it can return.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeepepStatus {
    /// The call did what it says; deepep_last_error() is "".
    DEEPEP_SUCCESS = 0,
    /// An argument is null, out of range (a size or count whose arithmetic would overflow
    /// included), misaligned, or has the wrong dtype/shape; a handle that was freed, never
    /// created or is of another kind; also a bad DEEPEP_* environment variable at Buffer
    /// creation, and bad input a kernel found (reported by the next op on the buffer, which
    /// stays usable).
    DEEPEP_ERROR_INVALID_ARGUMENT = 1,
    /// No CUDA driver or no CUDA device.
    DEEPEP_ERROR_NO_DEVICE = 2,
    /// A CUDA driver or runtime call (or a kernel launch) failed; the message names it.
    DEEPEP_ERROR_CUDA = 3,
    /// An NCCL call failed (communicator, window or device communicator); the message names it.
    DEEPEP_ERROR_NCCL = 4,
    /// The NCCL loaded at run time does not match the headers the kernels were built with.
    DEEPEP_ERROR_VERSION_MISMATCH = 5,
    /// The buffer was destroyed, or is unusable after an earlier failure.
    DEEPEP_ERROR_NOT_AVAILABLE = 6,
    /// A bounded GPU wait expired; the message names the rank, peer and counter.
    DEEPEP_ERROR_TIMEOUT = 7,
    /// The feature exists in DeepEP but is not implemented here yet.
    DEEPEP_ERROR_UNSUPPORTED = 8,
    /// A bug in deepep-nccl (including a caught panic).
    DEEPEP_ERROR_INTERNAL = 9,
}

impl DeepepStatus {
    /// The C name, NUL-terminated so the C ABI can hand it out directly.
    pub fn c_name(self) -> &'static CStr {
        match self {
            Self::DEEPEP_SUCCESS => c"DEEPEP_SUCCESS",
            Self::DEEPEP_ERROR_INVALID_ARGUMENT => c"DEEPEP_ERROR_INVALID_ARGUMENT",
            Self::DEEPEP_ERROR_NO_DEVICE => c"DEEPEP_ERROR_NO_DEVICE",
            Self::DEEPEP_ERROR_CUDA => c"DEEPEP_ERROR_CUDA",
            Self::DEEPEP_ERROR_NCCL => c"DEEPEP_ERROR_NCCL",
            Self::DEEPEP_ERROR_VERSION_MISMATCH => c"DEEPEP_ERROR_VERSION_MISMATCH",
            Self::DEEPEP_ERROR_NOT_AVAILABLE => c"DEEPEP_ERROR_NOT_AVAILABLE",
            Self::DEEPEP_ERROR_TIMEOUT => c"DEEPEP_ERROR_TIMEOUT",
            Self::DEEPEP_ERROR_UNSUPPORTED => c"DEEPEP_ERROR_UNSUPPORTED",
            Self::DEEPEP_ERROR_INTERNAL => c"DEEPEP_ERROR_INTERNAL",
        }
    }

    pub fn name(self) -> &'static str {
        self.c_name().to_str().expect("status names are ASCII")
    }

    /// Every status (named as in C, so `{:?}` prints the C name).
    pub(crate) const ALL: [Self; 10] = [
        Self::DEEPEP_SUCCESS,
        Self::DEEPEP_ERROR_INVALID_ARGUMENT,
        Self::DEEPEP_ERROR_NO_DEVICE,
        Self::DEEPEP_ERROR_CUDA,
        Self::DEEPEP_ERROR_NCCL,
        Self::DEEPEP_ERROR_VERSION_MISMATCH,
        Self::DEEPEP_ERROR_NOT_AVAILABLE,
        Self::DEEPEP_ERROR_TIMEOUT,
        Self::DEEPEP_ERROR_UNSUPPORTED,
        Self::DEEPEP_ERROR_INTERNAL,
    ];

    pub fn from_code(code: i32) -> Option<Self> {
        Self::ALL.into_iter().find(|s| *s as i32 == code)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub status: DeepepStatus,
    pub message: String,
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn new(status: DeepepStatus, message: impl Into<String>) -> Self {
        Self { status, message: message.into() }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(DeepepStatus::DEEPEP_ERROR_INVALID_ARGUMENT, message)
    }
    pub fn cuda(message: impl Into<String>) -> Self {
        Self::new(DeepepStatus::DEEPEP_ERROR_CUDA, message)
    }
    pub fn nccl(message: impl Into<String>) -> Self {
        Self::new(DeepepStatus::DEEPEP_ERROR_NCCL, message)
    }
    pub fn no_device(message: impl Into<String>) -> Self {
        Self::new(DeepepStatus::DEEPEP_ERROR_NO_DEVICE, message)
    }
    pub fn not_available(message: impl Into<String>) -> Self {
        Self::new(DeepepStatus::DEEPEP_ERROR_NOT_AVAILABLE, message)
    }
    pub fn unsupported(message: impl Into<String>) -> Self {
        Self::new(DeepepStatus::DEEPEP_ERROR_UNSUPPORTED, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(DeepepStatus::DEEPEP_ERROR_INTERNAL, message)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.status.name(), self.message)
    }
}

impl std::error::Error for Error {}

/// `ensure!(cond, "message {}", x)` returns an InvalidArgument error when `cond` is false.
#[macro_export]
macro_rules! ensure_arg {
    ($cond:expr, $($fmt:tt)+) => {
        if !($cond) {
            return Err($crate::error::Error::invalid(format!($($fmt)+)));
        }
    };
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

pub fn set_last_error(message: &str) {
    // Interior NULs would truncate the C string; replace them.
    let clean = CString::new(message.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = clean);
}

pub fn clear_last_error() {
    // Every C ABI call starts here: no allocation when the text is already empty (the usual case).
    LAST_ERROR.with(|e| {
        let mut e = e.borrow_mut();
        if !e.as_bytes().is_empty() {
            *e = CString::default();
        }
    });
}

/// Pointer valid until the next C ABI call on this thread.
pub fn last_error_ptr() -> *const std::os::raw::c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

pub fn last_error_string() -> String {
    LAST_ERROR.with(|e| e.borrow().to_string_lossy().into_owned())
}
