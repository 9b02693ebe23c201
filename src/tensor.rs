//! Tensors cross the C ABI as small descriptors: pointer, dtype, shape, strides.
//! This module validates them and names the offending argument on failure.
// Defined with the C ABI's other constants; re-exported so `tensor::DEEPEP_MAX_DIMS` keeps working.
pub use crate::capi::DEEPEP_MAX_DIMS;
use crate::ensure_arg;
use crate::error::Result;

/// Element types known to the ABI. Values are stable.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeepepDtype {
    DEEPEP_DTYPE_BOOL = 1,
    DEEPEP_DTYPE_UINT8 = 2,
    DEEPEP_DTYPE_INT32 = 3,
    DEEPEP_DTYPE_INT64 = 4,
    DEEPEP_DTYPE_FLOAT32 = 5,
    DEEPEP_DTYPE_BFLOAT16 = 6,
    DEEPEP_DTYPE_FLOAT16 = 7,
    DEEPEP_DTYPE_FLOAT8_E4M3 = 8,
}

impl DeepepDtype {
    /// Every dtype (named as in C, so `{:?}` prints the C name).
    pub(crate) const ALL: [Self; 8] = [
        Self::DEEPEP_DTYPE_BOOL,
        Self::DEEPEP_DTYPE_UINT8,
        Self::DEEPEP_DTYPE_INT32,
        Self::DEEPEP_DTYPE_INT64,
        Self::DEEPEP_DTYPE_FLOAT32,
        Self::DEEPEP_DTYPE_BFLOAT16,
        Self::DEEPEP_DTYPE_FLOAT16,
        Self::DEEPEP_DTYPE_FLOAT8_E4M3,
    ];

    pub fn from_code(code: i32) -> Option<Self> {
        Self::ALL.into_iter().find(|d| *d as i32 == code)
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::DEEPEP_DTYPE_BOOL => "bool",
            Self::DEEPEP_DTYPE_UINT8 => "uint8",
            Self::DEEPEP_DTYPE_INT32 => "int32",
            Self::DEEPEP_DTYPE_INT64 => "int64",
            Self::DEEPEP_DTYPE_FLOAT32 => "float32",
            Self::DEEPEP_DTYPE_BFLOAT16 => "bfloat16",
            Self::DEEPEP_DTYPE_FLOAT16 => "float16",
            Self::DEEPEP_DTYPE_FLOAT8_E4M3 => "float8_e4m3fn",
        }
    }
}

/// A strided view of device memory. `strides` are in elements, like torch's.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeepepTensor {
    pub data: *mut std::os::raw::c_void,
    /// A `DeepepDtype` value.
    pub dtype: i32,
    pub ndim: i32,
    pub shape: [i64; DEEPEP_MAX_DIMS],
    pub strides: [i64; DEEPEP_MAX_DIMS],
}

/// A descriptor that passed [`check`]: dtype and dims are known-good, its element count and
/// its extent in bytes fit an i64, and a non-empty one's data is non-NULL, aligned to its
/// elements and does not run past the end of the address space.
#[derive(Clone, Copy, Debug)]
pub struct TensorView<'a> {
    pub raw: &'a DeepepTensor,
    pub dtype: DeepepDtype,
    numel: i64,
}

impl TensorView<'_> {
    pub fn dims(&self) -> &[i64] {
        &self.raw.shape[..self.raw.ndim as usize]
    }
    pub fn numel(&self) -> i64 {
        self.numel
    }
    pub fn ptr(&self) -> *mut std::os::raw::c_void {
        self.raw.data
    }
}

/// Validates a descriptor: non-null (unless empty), one of `dtypes`, `ndim`
/// dimensions, row-major contiguous. `name` is the argument name for errors.
pub fn check<'a>(
    name: &str,
    tensor: Option<&'a DeepepTensor>,
    dtypes: &[DeepepDtype],
    ndim: usize,
) -> Result<TensorView<'a>> {
    let Some(t) = tensor else {
        return Err(crate::error::Error::invalid(format!("{name} must not be NULL")));
    };
    let (dtype, numel) = check_dtype_and_dims(name, t, dtypes, ndim)?;
    let dims = &t.shape[..ndim];
    // numel fits an i64 (checked above), so no partial product below overflows.
    let mut expected = 1i64;
    for d in (0..ndim).rev() {
        // Size-1 dims may carry any stride (torch does this), as may empty tensors.
        ensure_arg!(
            t.shape[d] <= 1 || t.strides[d] == expected,
            "{name} must be contiguous (shape {dims:?}, strides {:?})",
            &t.strides[..ndim]
        );
        expected = expected.saturating_mul(t.shape[d].max(1));
    }
    in_memory(name, TensorView { raw: t, dtype, numel })
}

/// dtype (one of `dtypes`), `ndim` dimensions, none negative, and a number of elements that
/// fits an i64 (returned with the dtype).
fn check_dtype_and_dims(name: &str, t: &DeepepTensor, dtypes: &[DeepepDtype], ndim: usize) -> Result<(DeepepDtype, i64)> {
    let dtype = DeepepDtype::from_code(t.dtype)
        .ok_or_else(|| crate::error::Error::invalid(format!("{name}: unknown dtype code {}", t.dtype)))?;
    ensure_arg!(
        dtypes.contains(&dtype),
        "{name} must have dtype {}, got {}",
        dtypes.iter().map(|d| d.name()).collect::<Vec<_>>().join(" or "),
        dtype.name()
    );
    ensure_arg!(t.ndim as usize == ndim, "{name} must be {ndim}-D, got {}-D", t.ndim);
    let dims = &t.shape[..ndim];
    ensure_arg!(dims.iter().all(|d| *d >= 0), "{name} has a negative dimension: {dims:?}");
    let numel = dims.iter().try_fold(1i64, |n, d| n.checked_mul(*d));
    let numel = numel.ok_or_else(|| {
        crate::error::Error::invalid(format!("{name} has shape {dims:?}: more elements than a 64-bit count holds"))
    })?;
    Ok((dtype, numel))
}

/// Bytes from the first element of a view to the end of its last (strides in elements, none
/// negative; 0 for an empty view), or None past i64.
fn extent_bytes(dims: &[i64], strides: &[i64], elem_bytes: i64) -> Option<i64> {
    if dims.contains(&0) {
        return Some(0);
    }
    let last = dims.iter().zip(strides).try_fold(0i64, |at, (d, s)| (d - 1).checked_mul(*s)?.checked_add(at))?;
    last.checked_add(1)?.checked_mul(elem_bytes)
}

/// A non-empty view's memory: its extent in bytes fits an i64, its data is non-NULL, aligned to
/// its elements (a misaligned access faults on the GPU) and its last byte lies inside the
/// address space.
fn in_memory<'a>(name: &str, view: TensorView<'a>) -> Result<TensorView<'a>> {
    let (dims, strides) = (view.dims(), &view.raw.strides[..view.raw.ndim as usize]);
    let size = view.dtype.size();
    let bytes = extent_bytes(dims, strides, size).ok_or_else(|| {
        crate::error::Error::invalid(format!(
            "{name} has shape {dims:?} and strides {strides:?}: it spans more bytes than a 64-bit size holds"
        ))
    })?;
    if view.numel() == 0 {
        return Ok(view);
    }
    let data = view.raw.data;
    ensure_arg!(!data.is_null(), "{name} has a NULL data pointer");
    check_alignment(name, &view, size, format_args!("an address aligned to its {size}-byte {} elements", view.dtype.name()))?;
    ensure_arg!(
        (data as usize).checked_add(bytes as usize).is_some(),
        "{name}: {bytes} bytes from {data:p} run past the end of the address space"
    );
    Ok(view)
}

/// dtype code 0 marks an absent tensor in argument structs that embed descriptors.
pub(crate) const DTYPE_ABSENT: i32 = 0;

/// [`check`] for an optional tensor embedded in an argument struct: `None` when absent.
pub fn check_opt<'a>(
    name: &str,
    tensor: &'a DeepepTensor,
    dtypes: &[DeepepDtype],
    ndim: usize,
) -> Result<Option<TensorView<'a>>> {
    if tensor.dtype == DTYPE_ABSENT {
        return Ok(None);
    }
    check(name, Some(tensor), dtypes, ndim).map(Some)
}

/// Like [`check`] but any strides are accepted (e.g. column-major FP8 scales);
/// strides must be non-negative.
pub fn check_strided<'a>(name: &str, t: &'a DeepepTensor, dtypes: &[DeepepDtype], ndim: usize) -> Result<TensorView<'a>> {
    let (dtype, numel) = check_dtype_and_dims(name, t, dtypes, ndim)?;
    ensure_arg!(t.strides[..ndim].iter().all(|s| *s >= 0), "{name} has a negative stride: {:?}", &t.strides[..ndim]);
    in_memory(name, TensorView { raw: t, dtype, numel })
}

impl DeepepDtype {
    /// Bytes per element.
    pub fn size(self) -> i64 {
        match self {
            Self::DEEPEP_DTYPE_BOOL | Self::DEEPEP_DTYPE_UINT8 | Self::DEEPEP_DTYPE_FLOAT8_E4M3 => 1,
            Self::DEEPEP_DTYPE_BFLOAT16 | Self::DEEPEP_DTYPE_FLOAT16 => 2,
            Self::DEEPEP_DTYPE_INT32 | Self::DEEPEP_DTYPE_FLOAT32 => 4,
            Self::DEEPEP_DTYPE_INT64 => 8,
        }
    }
}

/// Row copies use 16-byte vector and bulk (TMA) accesses: every op checks each tensor its
/// kernels move that way with this (normal mode's rows, LL mode's x, packed rows and outputs).
pub fn check_aligned16(name: &str, view: &TensorView<'_>) -> Result<()> {
    check_alignment(name, view, 16, "a 16-byte aligned address")
}

/// The one alignment check: a non-empty view's data is a multiple of `bytes`. `what` is formatted
/// only for the error: every tensor of every op passes here (an eager format! cost ~0.1 us each).
fn check_alignment(name: &str, view: &TensorView<'_>, bytes: i64, what: impl std::fmt::Display) -> Result<()> {
    ensure_arg!(
        view.numel() == 0 || (view.ptr() as usize) % bytes as usize == 0,
        "{name} must start at {what} (got {:p}); pass a fresh or .contiguous() tensor",
        view.ptr()
    );
    Ok(())
}

/// Checks an output tensor's exact shape after [`check`].
pub fn check_shape(name: &str, view: &TensorView<'_>, expected: &[i64]) -> Result<()> {
    ensure_arg!(view.dims() == expected, "{name} must have shape {expected:?}, got {:?}", view.dims());
    Ok(())
}

/// A contiguous 1-D tensor of `n` elements of `dtype` at `data` (unit tests of the query entries).
#[cfg(test)]
pub(crate) fn vector_at(data: *mut std::os::raw::c_void, dtype: DeepepDtype, n: i64) -> DeepepTensor {
    DeepepTensor { data, dtype: dtype as i32, ndim: 1, shape: [n, 0, 0, 0], strides: [1, 0, 0, 0] }
}

#[cfg(test)]
mod tests {
    use super::*;
    use DeepepDtype::*;

    fn tensor(dtype: DeepepDtype, shape: &[i64]) -> (Vec<u64>, DeepepTensor) {
        let mut buf = vec![0u64; 8];
        let mut t = DeepepTensor {
            data: buf.as_mut_ptr().cast(),
            dtype: dtype as i32,
            ndim: shape.len() as i32,
            shape: [0; 4],
            strides: [0; 4],
        };
        let mut s = 1;
        for d in (0..shape.len()).rev() {
            t.shape[d] = shape[d];
            t.strides[d] = s;
            s *= shape[d];
        }
        (buf, t)
    }

    #[test]
    fn accepts_contiguous_and_names_argument_on_error() {
        let (_b, t) = tensor(DEEPEP_DTYPE_INT64, &[4, 8]);
        assert_eq!(check("topk_idx", Some(&t), &[DEEPEP_DTYPE_INT64], 2).unwrap().numel(), 32);
        let err = check("topk_idx", Some(&t), &[DEEPEP_DTYPE_INT32], 2).unwrap_err();
        assert_eq!(err.message, "topk_idx must have dtype int32, got int64");
        let err = check("topk_idx", Some(&t), &[DEEPEP_DTYPE_INT64], 1).unwrap_err();
        assert_eq!(err.message, "topk_idx must be 1-D, got 2-D");
        assert!(check("topk_idx", None, &[DEEPEP_DTYPE_INT64], 2).unwrap_err().message.contains("NULL"));
    }

    #[test]
    fn rejects_non_contiguous_and_unknown_dtype() {
        let (_b, mut t) = tensor(DEEPEP_DTYPE_INT64, &[4, 8]);
        t.strides = [1, 4, 0, 0]; // transposed view
        let err = check("topk_idx", Some(&t), &[DEEPEP_DTYPE_INT64], 2).unwrap_err();
        assert!(err.message.contains("contiguous"), "{}", err.message);
        t.dtype = 99;
        assert!(check("x", Some(&t), &[DEEPEP_DTYPE_INT64], 2).unwrap_err().message.contains("unknown dtype"));
    }

    #[test]
    fn sizes_past_64_bits_are_errors_naming_the_tensor() {
        let (_b, mut t) = tensor(DEEPEP_DTYPE_INT64, &[4, 8]);
        // Elements: 2^40 * 2^40 (contiguous strides saturate; the count is what overflows).
        t.shape[..2].copy_from_slice(&[1 << 40, 1 << 40]);
        t.strides[..2].copy_from_slice(&[1 << 40, 1]);
        let err = check("topk_idx", Some(&t), &[DEEPEP_DTYPE_INT64], 2).unwrap_err();
        assert_eq!(err.message, "topk_idx has shape [1099511627776, 1099511627776]: more elements than a 64-bit count holds");
        // Few elements, but strides that put the last one past i64.
        t.shape[..2].copy_from_slice(&[2, 2]);
        t.strides[..2].copy_from_slice(&[i64::MAX, 1]);
        let err = check_strided("x_scales", &t, &[DEEPEP_DTYPE_INT64], 2).unwrap_err();
        assert_eq!(err.message, "x_scales has shape [2, 2] and strides [9223372036854775807, 1]: it spans more bytes than a 64-bit size holds");
        // Elements that fit, bytes that do not: 2^61 int64s.
        t.shape[..2].copy_from_slice(&[1 << 30, 1 << 31]);
        t.strides[..2].copy_from_slice(&[1 << 31, 1]);
        assert!(check("x", Some(&t), &[DEEPEP_DTYPE_INT64], 2).unwrap_err().message.contains("spans more bytes than a 64-bit size"));
        // An empty view spans nothing, whatever its other dims.
        t.shape[..2].copy_from_slice(&[0, i64::MAX]);
        t.strides[..2].copy_from_slice(&[i64::MAX, 1]);
        assert_eq!(check("x", Some(&t), &[DEEPEP_DTYPE_INT64], 2).unwrap().numel(), 0);
    }

    #[test]
    fn data_must_be_aligned_to_its_elements_and_inside_the_address_space() {
        let (_b, mut t) = tensor(DEEPEP_DTYPE_INT64, &[2, 2]);
        let base = t.data as usize;
        t.data = (base + 4) as *mut _;
        let err = check("layout_range", Some(&t), &[DEEPEP_DTYPE_INT64], 2).unwrap_err();
        assert!(err.message.starts_with("layout_range must start at an address aligned to its 8-byte int64 elements (got 0x"), "{}", err.message);
        t.dtype = DEEPEP_DTYPE_INT32 as i32;
        assert!(check("src_info", Some(&t), &[DEEPEP_DTYPE_INT32], 2).is_ok(), "4 bytes in: aligned for int32");
        let v = check("src_info", Some(&t), &[DEEPEP_DTYPE_INT32], 2).unwrap();
        assert!(check_aligned16("src_info", &v).unwrap_err().message.contains("must start at a 16-byte aligned address"));
        t.data = (usize::MAX - 7) as *mut _;
        let err = check("src_info", Some(&t), &[DEEPEP_DTYPE_INT32], 2).unwrap_err();
        assert!(err.message.contains("16 bytes from 0xfffffffffffffff8 run past the end of the address space"), "{}", err.message);
        t.shape[..2].copy_from_slice(&[0, 2]);
        t.data = 0x3 as *mut _;
        assert!(check("src_info", Some(&t), &[DEEPEP_DTYPE_INT32], 2).is_ok(), "an empty view's address is not used");
    }

    #[test]
    fn shape_check_reports_both_shapes() {
        let (_b, t) = tensor(DEEPEP_DTYPE_INT32, &[3]);
        let v = check("num_tokens_per_rank", Some(&t), &[DEEPEP_DTYPE_INT32], 1).unwrap();
        let err = check_shape("num_tokens_per_rank", &v, &[4]).unwrap_err();
        assert_eq!(err.message, "num_tokens_per_rank must have shape [4], got [3]");
    }
}
