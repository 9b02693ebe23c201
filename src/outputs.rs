//! Output geometry: the library says what each op's caller allocates (dtype, shape, strides,
//! and which outputs share one allocation), so the host paths (ctypes, the compiled path, C++)
//! only allocate and launch, and the op checks the caller's descriptors against the same
//! description ([`check_output`]).
use crate::ensure_arg;
use crate::error::{Error, Result};
use crate::tensor::{check_strided, DeepepDtype, DeepepTensor, TensorView, DEEPEP_MAX_DIMS, DTYPE_ABSENT};

/// Most outputs one op describes (the normal dispatch's handle has four, its receive five).
pub const DEEPEP_MAX_OP_OUTPUTS: usize = 8;

/// The outputs of one op, in the op's documented order. Each output is a view of one
/// allocation: allocate `allocation_elems[g]` elements of `allocation_dtype[g]` for every
/// g < num_allocations, then view output i as (shape, strides) at element `offset[i]` of
/// allocation `allocation[i]`. An output whose `tensors[i].dtype` is 0 is absent (None);
/// `tensors[i].data` is always NULL.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DeepepOutputs {
    /// Outputs described, absent ones included.
    pub count: i32,
    pub num_allocations: i32,
    pub tensors: [DeepepTensor; DEEPEP_MAX_OP_OUTPUTS],
    /// Allocation of each output (-1 for an absent one).
    pub allocation: [i32; DEEPEP_MAX_OP_OUTPUTS],
    /// Element offset of each output in its allocation.
    pub offset: [i64; DEEPEP_MAX_OP_OUTPUTS],
    /// A `DeepepDtype` value per allocation.
    pub allocation_dtype: [i32; DEEPEP_MAX_OP_OUTPUTS],
    /// Elements per allocation.
    pub allocation_elems: [i64; DEEPEP_MAX_OP_OUTPUTS],
}

const NO_TENSOR: DeepepTensor =
    DeepepTensor { data: std::ptr::null_mut(), dtype: DTYPE_ABSENT, ndim: 0, shape: [0; DEEPEP_MAX_DIMS], strides: [0; DEEPEP_MAX_DIMS] };

impl Default for DeepepOutputs {
    fn default() -> Self {
        Self {
            count: 0,
            num_allocations: 0,
            tensors: [NO_TENSOR; DEEPEP_MAX_OP_OUTPUTS],
            allocation: [-1; DEEPEP_MAX_OP_OUTPUTS],
            offset: [0; DEEPEP_MAX_OP_OUTPUTS],
            allocation_dtype: [0; DEEPEP_MAX_OP_OUTPUTS],
            allocation_elems: [0; DEEPEP_MAX_OP_OUTPUTS],
        }
    }
}

/// Row-major strides of `shape`, in elements.
pub fn contiguous_strides(shape: &[i64]) -> [i64; DEEPEP_MAX_DIMS] {
    let mut strides = [0; DEEPEP_MAX_DIMS];
    let mut step = 1i64;
    for d in (0..shape.len()).rev() {
        strides[d] = step;
        step = step.saturating_mul(shape[d].max(1));
    }
    strides
}

/// Elements an allocation needs to hold a view of `shape` with `strides` at offset 0; saturates
/// at i64::MAX instead of overflowing ([`DeepepOutputs::checked`] turns that into an error).
fn span(shape: &[i64], strides: &[i64]) -> i64 {
    if shape.iter().any(|d| *d == 0) {
        return 0;
    }
    shape.iter().zip(strides).fold(1i64, |n, (d, s)| n.saturating_add(d.saturating_sub(1).saturating_mul(*s)))
}

impl DeepepOutputs {
    /// The descriptor (data NULL) of a `dtype` view with `shape` and `strides` in elements.
    pub(crate) fn describe(dtype: DeepepDtype, shape: &[i64], strides: &[i64]) -> DeepepTensor {
        debug_assert!(shape.len() <= DEEPEP_MAX_DIMS && shape.len() == strides.len());
        let mut t = NO_TENSOR;
        t.dtype = dtype as i32;
        t.ndim = shape.len() as i32;
        t.shape[..shape.len()].copy_from_slice(shape);
        t.strides[..shape.len()].copy_from_slice(strides);
        t
    }

    fn push_view(&mut self, tensor: DeepepTensor, allocation: i32, offset: i64) -> usize {
        let i = self.count as usize;
        assert!(i < DEEPEP_MAX_OP_OUTPUTS, "an op describes at most {DEEPEP_MAX_OP_OUTPUTS} outputs");
        self.tensors[i] = tensor;
        self.allocation[i] = allocation;
        self.offset[i] = offset;
        self.count += 1;
        i
    }

    /// An output with the given strides in an allocation of its own.
    pub fn push_strided(&mut self, dtype: DeepepDtype, shape: &[i64], strides: &[i64]) -> usize {
        let g = self.num_allocations as usize;
        self.allocation_dtype[g] = dtype as i32;
        self.allocation_elems[g] = span(shape, strides);
        self.num_allocations += 1;
        self.push_view(Self::describe(dtype, shape, strides), g as i32, 0)
    }

    /// A contiguous output in an allocation of its own.
    pub fn push(&mut self, dtype: DeepepDtype, shape: &[i64]) -> usize {
        self.push_strided(dtype, shape, &contiguous_strides(shape)[..shape.len()])
    }

    /// A contiguous output appended to the allocation of output `with` (same dtype): fewer
    /// allocations for small outputs that live together.
    pub fn push_after(&mut self, with: usize, shape: &[i64]) -> usize {
        let g = self.allocation[with] as usize;
        let dtype = DeepepDtype::from_code(self.allocation_dtype[g]).expect("allocations have known dtypes");
        let offset = self.allocation_elems[g];
        let t = Self::describe(dtype, shape, &contiguous_strides(shape)[..shape.len()]);
        self.allocation_elems[g] = offset.saturating_add(span(shape, &t.strides[..shape.len()]));
        self.push_view(t, g as i32, offset)
    }

    /// An absent output (None in Python).
    pub fn push_absent(&mut self) -> usize {
        self.push_view(NO_TENSOR, -1, 0)
    }

    pub fn get(&self, i: usize) -> &DeepepTensor {
        &self.tensors[i]
    }

    /// The description, once every output's dims are non-negative and its end in its allocation,
    /// in bytes, fits i64 (the builder saturates instead of overflowing). `names` are the
    /// outputs' names in order, for the error.
    pub fn checked(self, names: &[&str]) -> Result<Self> {
        for i in 0..self.count as usize {
            let t = &self.tensors[i];
            if t.dtype == DTYPE_ABSENT {
                continue;
            }
            let (dims, strides) = (want_dims(t), &t.strides[..t.ndim as usize]);
            let size = DeepepDtype::from_code(t.dtype).map_or(1, |d| d.size());
            let s = span(dims, strides);
            let end_bytes = self.offset[i].checked_add(s).and_then(|end| end.checked_mul(size));
            let name = names.get(i).copied().unwrap_or("an output");
            ensure_arg!(dims.iter().all(|d| *d >= 0), "{name} would have a negative dimension: {dims:?}");
            ensure_arg!(
                s < i64::MAX && end_bytes.is_some_and(|b| b < i64::MAX),
                "{name} would have shape {dims:?}: more bytes than a 64-bit size holds"
            );
        }
        Ok(self)
    }
}

/// Checks a caller's descriptor of output `name` against the library's description `want`:
/// same presence, dtype, shape and strides (strides of size-1 dims are free, as torch leaves
/// them). Returns the view of a present output.
pub fn check_output<'a>(name: &str, given: &'a DeepepTensor, want: &DeepepTensor) -> Result<Option<TensorView<'a>>> {
    if want.dtype == DTYPE_ABSENT {
        ensure_arg!(given.dtype == DTYPE_ABSENT, "{name} must be absent here (dtype 0), got dtype code {}", given.dtype);
        return Ok(None);
    }
    let dtype = DeepepDtype::from_code(want.dtype).expect("described outputs have known dtypes");
    ensure_arg!(given.dtype != DTYPE_ABSENT, "{name} must be given ({} {:?})", dtype.name(), want_dims(want));
    let ndim = want.ndim as usize;
    let view = check_strided(name, given, &[dtype], ndim)?;
    ensure_arg!(view.dims() == want_dims(want), "{name} must have shape {:?}, got {:?}", want_dims(want), view.dims());
    let strides_ok = (0..ndim).all(|d| given.shape[d] <= 1 || given.strides[d] == want.strides[d]);
    ensure_arg!(
        strides_ok,
        "{name} must have strides {:?} (elements), got {:?}",
        &want.strides[..ndim],
        &given.strides[..ndim]
    );
    Ok(Some(view))
}

/// [`check_output`] of an output the description has: its view.
pub fn check_required<'a>(name: &str, given: &'a DeepepTensor, want: &DeepepTensor) -> Result<TensorView<'a>> {
    check_output(name, given, want)?.ok_or_else(|| Error::internal(format!("{name} is described as absent")))
}

fn want_dims(t: &DeepepTensor) -> &[i64] {
    &t.shape[..t.ndim as usize]
}

#[cfg(test)]
mod tests {
    use super::*;
    use DeepepDtype::*;

    #[test]
    fn allocations_offsets_and_spans() {
        let mut o = DeepepOutputs::default();
        let a = o.push(DEEPEP_DTYPE_INT32, &[4, 4]);
        let b = o.push_after(a, &[4, 12]);
        let none = o.push_absent();
        let s = o.push_strided(DEEPEP_DTYPE_FLOAT32, &[2, 6, 3], &[18, 1, 6]);
        assert_eq!((o.count, o.num_allocations), (4, 2));
        assert_eq!((o.allocation[b], o.offset[b], o.allocation_elems[0]), (0, 16, 64));
        assert_eq!((o.allocation[none], o.tensors[none].dtype), (-1, 0));
        assert_eq!((o.allocation[s], o.allocation_elems[1], o.allocation_dtype[1]), (1, 36, DEEPEP_DTYPE_FLOAT32 as i32));
        assert_eq!(&o.tensors[b].strides[..2], &[12, 1]);
        let mut e = DeepepOutputs::default();
        e.push(DEEPEP_DTYPE_BOOL, &[0, 8]);
        assert_eq!(e.allocation_elems[0], 0);
    }

    #[test]
    fn sizes_past_64_bits_are_errors_not_overflows() {
        let mut o = DeepepOutputs::default();
        let a = o.push(DEEPEP_DTYPE_INT32, &[4]);
        o.push_after(a, &[1 << 40, 1 << 40]);
        o.push_after(a, &[2]);
        let err = o.checked(&["counts", "big", "tail"]).unwrap_err();
        assert_eq!(err.message, "big would have shape [1099511627776, 1099511627776]: more bytes than a 64-bit size holds");
        let mut bytes = DeepepOutputs::default();
        bytes.push(DEEPEP_DTYPE_INT64, &[1 << 61]);
        assert!(bytes.checked(&["wide"]).unwrap_err().message.starts_with("wide would have shape"));
        let mut fine = DeepepOutputs::default();
        fine.push(DEEPEP_DTYPE_BOOL, &[0, i64::MAX]);
        fine.push_absent();
        assert!(fine.checked(&["empty"]).is_ok());
    }

    #[test]
    fn check_output_names_the_mismatch() {
        let mut o = DeepepOutputs::default();
        o.push(DEEPEP_DTYPE_INT32, &[3, 2]);
        o.push_absent();
        let mut storage = [0i32; 6];
        let mut given = *o.get(0);
        given.data = storage.as_mut_ptr().cast();
        assert!(check_output("send_head", &given, o.get(0)).unwrap().is_some());
        given.shape[0] = 4;
        assert_eq!(check_output("send_head", &given, o.get(0)).unwrap_err().message, "send_head must have shape [3, 2], got [4, 2]");
        given.shape[0] = 3;
        given.strides = [1, 3, 0, 0];
        assert!(check_output("send_head", &given, o.get(0)).unwrap_err().message.contains("strides [2, 1]"));
        assert!(check_output("x_scales", &given, o.get(1)).unwrap_err().message.contains("must be absent"));
        assert!(check_output("recv_x", o.get(1), o.get(0)).unwrap_err().message.contains("must be given"));
    }
}
