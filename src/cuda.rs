//! CUDA driver resources through cudarc (dynamically loaded libcuda): device
//! discovery, the primary context, streams, device and host-mapped memory.
//! cudarc panics when libcuda is missing, so [`ensure_driver`] runs first.
use std::os::raw::c_void;

use cudarc::driver::{result, sys};

use crate::error::{Error, Result};

fn cuda_err(what: &str, e: result::DriverError) -> Error {
    Error::cuda(format!("{what} failed: {e:?}"))
}

/// Loads libcuda and initialises it; a missing driver or zero devices is a
/// `DEEPEP_ERROR_NO_DEVICE`, never a panic.
pub fn ensure_driver() -> Result<i32> {
    // SAFETY: only probes whether libcuda can be dlopened.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::no_device(
            "no CUDA driver: libcuda.so.1 could not be loaded (is this a GPU machine with the NVIDIA driver installed?)",
        ));
    }
    result::init().map_err(|e| Error::no_device(format!("cuInit failed: {e:?} (no usable GPU)")))?;
    let count = result::device::get_count().map_err(|e| cuda_err("cuDeviceGetCount", e))?;
    if count <= 0 {
        return Err(Error::no_device("the CUDA driver reports no GPU devices"));
    }
    Ok(count)
}

/// The device of the calling thread's current context (what `cudaGetDevice`
/// reports after `torch.cuda.set_device`), or device 0 when none is current.
pub fn current_device() -> Result<i32> {
    ensure_driver()?;
    match result::ctx::get_current().map_err(|e| cuda_err("cuCtxGetCurrent", e))? {
        Some(_) => {
            let mut dev: sys::CUdevice = 0;
            // SAFETY: a context is current; cuCtxGetDevice writes one int.
            unsafe { sys::cuCtxGetDevice(&mut dev) }.result().map_err(|e| cuda_err("cuCtxGetDevice", e))?;
            Ok(dev)
        }
        None => Ok(0),
    }
}

/// A retained primary context, made current on this thread. Torch and NCCL use
/// the same primary context, so handles are shared with them.
pub struct PrimaryContext {
    device: sys::CUdevice,
    ctx: sys::CUcontext,
}

// SAFETY: CUcontext handles may be used from any thread.
unsafe impl Send for PrimaryContext {}
unsafe impl Sync for PrimaryContext {}

impl PrimaryContext {
    pub fn retain(ordinal: i32) -> Result<Self> {
        let device = result::device::get(ordinal).map_err(|e| cuda_err("cuDeviceGet", e))?;
        // SAFETY: the device handle is valid; retain is balanced by release in Drop.
        let ctx = unsafe { result::primary_ctx::retain(device) }.map_err(|e| cuda_err("cuDevicePrimaryCtxRetain", e))?;
        let this = Self { device, ctx };
        this.make_current()?;
        Ok(this)
    }

    pub fn make_current(&self) -> Result<()> {
        // SAFETY: ctx is a retained primary context, alive while self lives.
        unsafe { result::ctx::set_current(self.ctx) }.map_err(|e| cuda_err("cuCtxSetCurrent", e))
    }

    pub fn ordinal(&self) -> i32 {
        self.device
    }

    pub fn sm_count(&self) -> Result<i32> {
        // SAFETY: valid device handle and attribute enum.
        unsafe {
            result::device::get_attribute(self.device, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        }
        .map_err(|e| cuda_err("cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)", e))
    }
}

impl Drop for PrimaryContext {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `retain`.
        let _ = unsafe { result::primary_ctx::release(self.device) };
    }
}

/// An owned non-blocking stream at the highest priority (DeepEP's comm stream).
pub struct Stream(sys::CUstream);

// SAFETY: CUstream handles may be used from any thread.
unsafe impl Send for Stream {}
unsafe impl Sync for Stream {}

impl Stream {
    pub fn new_high_priority() -> Result<Self> {
        let (_least, greatest) = result::stream::get_priority_range().map_err(|e| cuda_err("cuCtxGetStreamPriorityRange", e))?;
        let s = result::stream::create_with_priority(result::stream::StreamKind::NonBlocking, greatest)
            .map_err(|e| cuda_err("cuStreamCreateWithPriority", e))?;
        Ok(Self(s))
    }
    pub fn raw(&self) -> *mut c_void {
        self.0.cast()
    }
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: the stream is alive while self lives.
        unsafe { result::stream::synchronize(self.0) }.map_err(|e| cuda_err("cuStreamSynchronize", e))
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: created in new_high_priority; destroyed once.
        let _ = unsafe { result::stream::destroy(self.0) };
    }
}

/// Plain device memory (cuMemAlloc), zeroed at allocation.
pub struct DeviceMemory {
    ptr: sys::CUdeviceptr,
    bytes: usize,
}

// SAFETY: device pointers are plain addresses valid in any thread of the context.
unsafe impl Send for DeviceMemory {}
unsafe impl Sync for DeviceMemory {}

impl DeviceMemory {
    pub fn zeroed(bytes: usize) -> Result<Self> {
        // SAFETY: allocation of `bytes` bytes; freed in Drop.
        let ptr = unsafe { result::malloc_sync(bytes) }.map_err(|e| cuda_err("cuMemAlloc", e))?;
        let mem = Self { ptr, bytes };
        // SAFETY: ptr points to `bytes` bytes just allocated.
        unsafe { result::memset_d8_sync(ptr, 0, bytes) }.map_err(|e| cuda_err("cuMemsetD8", e))?;
        Ok(mem)
    }
    pub fn ptr(&self) -> *mut c_void {
        self.ptr as *mut c_void
    }
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed`, freed once.
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

/// Zeroes device memory synchronously (used once at buffer creation).
pub fn memset_zero(ptr: *mut c_void, bytes: usize) -> Result<()> {
    // SAFETY: caller passes a live device allocation of at least `bytes` bytes.
    unsafe { result::memset_d8_sync(ptr as sys::CUdeviceptr, 0, bytes) }.map_err(|e| cuda_err("cuMemsetD8", e))
}

pub fn copy_to_host<T: Copy + Default>(src: *const c_void, count: usize) -> Result<Vec<T>> {
    let mut out = vec![T::default(); count];
    // SAFETY: caller passes a live device allocation of at least `count` T's.
    unsafe { result::memcpy_dtoh_sync(&mut out, src as sys::CUdeviceptr) }.map_err(|e| cuda_err("cuMemcpyDtoH", e))?;
    Ok(out)
}

/// Pinned host memory mapped into the device address space, for records the
/// GPU writes and the host reads after a kernel (stall reports).
pub struct HostMapped<T: Copy> {
    host: *mut T,
    device: sys::CUdeviceptr,
}

// SAFETY: pinned host memory is accessible from any thread.
unsafe impl<T: Copy> Send for HostMapped<T> {}
unsafe impl<T: Copy> Sync for HostMapped<T> {}

impl<T: Copy + Default> HostMapped<T> {
    pub fn new() -> Result<Self> {
        let mut host: *mut c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: allocates size_of::<T>() pinned bytes; freed in Drop.
        unsafe { sys::cuMemHostAlloc(&mut host, std::mem::size_of::<T>(), flags) }
            .result()
            .map_err(|e| cuda_err("cuMemHostAlloc", e))?;
        let mut this = Self { host: host.cast(), device: 0 };
        // SAFETY: host points to a writable T-sized pinned allocation.
        unsafe { this.host.write_volatile(T::default()) };
        // SAFETY: host was allocated with DEVICEMAP.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut this.device, host, 0) }
            .result()
            .map_err(|e| cuda_err("cuMemHostGetDevicePointer", e))?;
        Ok(this)
    }
    pub fn device_ptr(&self) -> *mut T {
        self.device as *mut T
    }
    /// Host address, for volatile field reads while the GPU writes other fields.
    pub fn host_ptr(&self) -> *mut T {
        self.host
    }
    /// Volatile read: the GPU may have written it behind the compiler's back.
    pub fn read(&self) -> T {
        // SAFETY: host is a live, aligned T allocation.
        unsafe { self.host.read_volatile() }
    }
    pub fn write(&self, value: T) {
        // SAFETY: host is a live, aligned T allocation.
        unsafe { self.host.write_volatile(value) }
    }
}

impl<T: Copy> Drop for HostMapped<T> {
    fn drop(&mut self) {
        if !self.host.is_null() {
            // SAFETY: allocated by cuMemHostAlloc in `new`, freed once.
            let _ = unsafe { sys::cuMemFreeHost(self.host.cast()) };
        }
    }
}

/// (free, total) bytes on the current device.
pub fn mem_info() -> Result<(usize, usize)> {
    result::mem_get_info().map_err(|e| cuda_err("cuMemGetInfo", e))
}

/// Whether `stream` (a cudaStream_t/CUstream; NULL is the legacy stream) is
/// being captured into a CUDA graph.
pub fn stream_is_capturing(stream: *mut c_void) -> Result<bool> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: stream is a live stream handle of the current context; writes one enum.
    unsafe { sys::cuStreamIsCapturing(stream as sys::CUstream, &mut status) }
        .result()
        .map_err(|e| cuda_err("cuStreamIsCapturing", e))?;
    Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// Zeroes device memory in `stream` order.
pub fn memset_zero_async(ptr: *mut c_void, bytes: usize, stream: *mut c_void) -> Result<()> {
    // SAFETY: caller passes a live device allocation of at least `bytes` bytes and a live stream.
    unsafe { sys::cuMemsetD8Async(ptr as sys::CUdeviceptr, 0, bytes, stream as sys::CUstream) }
        .result()
        .map_err(|e| cuda_err("cuMemsetD8Async", e))
}

/// Device-to-device copy in `stream` order.
pub fn copy_device_async(dst: *mut c_void, src: *const c_void, bytes: usize, stream: *mut c_void) -> Result<()> {
    // SAFETY: caller passes live device allocations of at least `bytes` bytes and a live stream.
    unsafe { sys::cuMemcpyDtoDAsync_v2(dst as sys::CUdeviceptr, src as sys::CUdeviceptr, bytes, stream as sys::CUstream) }
        .result()
        .map_err(|e| cuda_err("cuMemcpyDtoDAsync", e))
}

/// Host-to-device copy of one value in `stream` order (the value is copied out before return).
pub fn write_i32_async(dst: *mut c_void, value: i32, stream: *mut c_void) -> Result<()> {
    // SAFETY: dst is a live device allocation of at least 4 bytes; cuMemsetD32Async copies the value.
    unsafe { sys::cuMemsetD32Async(dst as sys::CUdeviceptr, value as u32, 1, stream as sys::CUstream) }
        .result()
        .map_err(|e| cuda_err("cuMemsetD32Async", e))
}

/// Waits for all work of the current context.
pub fn context_synchronize() -> Result<()> {
    // SAFETY: no arguments; blocks until the current context is idle.
    unsafe { sys::cuCtxSynchronize() }.result().map_err(|e| cuda_err("cuCtxSynchronize", e))
}
