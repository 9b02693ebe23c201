//! NCCL resources with RAII: the communicator, a symmetric window over
//! `ncclMemAlloc` memory, and the device communicator. Also the check that the
//! NCCL loaded in this process matches the headers the kernels were built with.
use std::ffi::CStr;
use std::os::raw::c_void;

use nccl_sys as sys;

use crate::error::{DeepepStatus, Error, Result};
use crate::kernels;

fn nccl_error(what: &str, rc: sys::ncclResult_t, comm: sys::ncclComm_t) -> Error {
    // SAFETY: both return static or comm-owned NUL-terminated strings.
    let name = unsafe { CStr::from_ptr(sys::ncclGetErrorString(rc)) }.to_string_lossy().into_owned();
    let detail = unsafe { CStr::from_ptr(sys::ncclGetLastError(comm)) }.to_string_lossy().into_owned();
    let detail = if detail.is_empty() { String::new() } else { format!(": {detail}") };
    Error::nccl(format!("{what} failed: {name} (ncclResult {rc}){detail}"))
}

fn check(what: &str, rc: sys::ncclResult_t, comm: sys::ncclComm_t) -> Result<()> {
    if rc == sys::ncclSuccess {
        Ok(())
    } else {
        Err(nccl_error(what, rc, comm))
    }
}

fn format_version(code: i32) -> String {
    let (major, minor, patch) = sys::split_version(code);
    format!("{major}.{minor}.{patch}")
}

/// NCCL version of the `libnccl.so.2` this process loaded (torch's, if torch was first).
pub fn runtime_version() -> Result<i32> {
    let mut v = 0;
    // SAFETY: writes one int.
    check("ncclGetVersion", unsafe { sys::ncclGetVersion(&mut v) }, std::ptr::null_mut())?;
    Ok(v)
}

/// Device-API code is only valid against the NCCL minor it was compiled for
/// (the devComm layout changes between minors; 2.28 code is rejected by 2.29+).
pub fn check_version_match(compiled: i32, runtime: i32) -> Result<()> {
    let (cm, cn, _) = sys::split_version(compiled);
    let (rm, rn, _) = sys::split_version(runtime);
    if (cm, cn) == (rm, rn) {
        return Ok(());
    }
    Err(Error::new(
        DeepepStatus::DEEPEP_ERROR_VERSION_MISMATCH,
        format!(
            "NCCL version mismatch: deepep-nccl kernels were compiled against NCCL {} but this process loaded NCCL {} \
             (libnccl.so.2; with torch, it is torch's). Rebuild with NCCL_HOME pointing at NCCL {}.{}.x headers.",
            format_version(compiled),
            format_version(runtime),
            rm,
            rn
        ),
    ))
}

pub fn check_runtime_version() -> Result<()> {
    check_version_match(kernels::compiled_nccl_version(), runtime_version()?)
}

pub fn unique_id() -> Result<[u8; sys::NCCL_UNIQUE_ID_BYTES]> {
    let mut id = sys::ncclUniqueId { internal: [0; sys::NCCL_UNIQUE_ID_BYTES] };
    // SAFETY: writes 128 bytes into id.
    check("ncclGetUniqueId", unsafe { sys::ncclGetUniqueId(&mut id) }, std::ptr::null_mut())?;
    Ok(id.internal.map(|c| c as u8))
}

/// An NCCL communicator. Dropping it aborts (non-collective); [`Communicator::destroy`]
/// is the orderly, collective teardown.
pub struct Communicator {
    comm: sys::ncclComm_t,
}

// SAFETY: NCCL communicators may be used from any thread, one call at a time;
// the Buffer serialises access behind a mutex.
unsafe impl Send for Communicator {}
unsafe impl Sync for Communicator {}

impl Communicator {
    /// Collective over all `num_ranks` ranks holding the same `id`.
    pub fn init_rank(num_ranks: i32, id: &[u8; sys::NCCL_UNIQUE_ID_BYTES], rank: i32) -> Result<Self> {
        let unique = sys::ncclUniqueId { internal: id.map(|b| b as std::os::raw::c_char) };
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: writes the new communicator handle into comm.
        let rc = unsafe { sys::ncclCommInitRank(&mut comm, num_ranks, unique, rank) };
        check(&format!("ncclCommInitRank(rank {rank} of {num_ranks})"), rc, comm)?;
        Ok(Self { comm })
    }

    pub fn raw(&self) -> sys::ncclComm_t {
        self.comm
    }

    /// (nRanks, rank) of the LSA team: the GPUs reachable by loads/stores.
    pub fn lsa_team(&self) -> sys::ncclTeam_t {
        // SAFETY: comm is a live communicator.
        unsafe { sys::ncclTeamLsa(self.comm) }
    }

    /// Collective, orderly teardown.
    pub fn destroy(mut self) -> Result<()> {
        let comm = std::mem::replace(&mut self.comm, std::ptr::null_mut());
        // SAFETY: comm is live and is not used after this.
        check("ncclCommFinalize", unsafe { sys::ncclCommFinalize(comm) }, comm)?;
        check("ncclCommDestroy", unsafe { sys::ncclCommDestroy(comm) }, std::ptr::null_mut())
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        if !self.comm.is_null() {
            // SAFETY: error path only; abort is local and frees the communicator.
            unsafe { sys::ncclCommAbort(self.comm) };
        }
    }
}

/// `ncclMemAlloc` memory registered as one symmetric window on `comm`.
pub struct SymmetricWindow {
    ptr: *mut c_void,
    bytes: usize,
    window: sys::ncclWindow_t,
}

// SAFETY: the pointers are device addresses/handles valid from any thread.
unsafe impl Send for SymmetricWindow {}
unsafe impl Sync for SymmetricWindow {}

impl SymmetricWindow {
    /// Collective. All ranks must pass the same `bytes`.
    pub fn new(comm: &Communicator, bytes: usize) -> Result<Self> {
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes the allocation into ptr.
        check(&format!("ncclMemAlloc({bytes} bytes)"), unsafe { sys::ncclMemAlloc(&mut ptr, bytes) }, comm.raw())?;
        let mut this = Self { ptr, bytes, window: std::ptr::null_mut() };
        // SAFETY: ptr/bytes is the cuMem allocation above; writes the window handle.
        let rc = unsafe {
            sys::ncclCommWindowRegister(comm.raw(), ptr, bytes, &mut this.window, sys::NCCL_WIN_COLL_SYMMETRIC)
        };
        check("ncclCommWindowRegister", rc, comm.raw())?;
        if this.window.is_null() {
            // NCCL returns success with a null window when the communicator has
            // no symmetric-memory support (e.g. GPUs not all P2P-connected).
            return Err(Error::nccl(
                "ncclCommWindowRegister returned a NULL window: this communicator has no symmetric-memory support \
                 (needs all GPUs in one NVLink/P2P domain, cuMem enabled and NCCL_WIN_ENABLE=1)",
            ));
        }
        Ok(this)
    }

    pub fn ptr(&self) -> *mut c_void {
        self.ptr
    }
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    pub fn handle(&self) -> sys::ncclWindow_t {
        self.window
    }

    /// Collective deregistration, then free.
    pub fn destroy(mut self, comm: &Communicator) -> Result<()> {
        let window = std::mem::replace(&mut self.window, std::ptr::null_mut());
        // SAFETY: window was registered on comm and is not used after this.
        check("ncclCommWindowDeregister", unsafe { sys::ncclCommWindowDeregister(comm.raw(), window) }, comm.raw())
        // Drop frees the memory.
    }
}

impl Drop for SymmetricWindow {
    fn drop(&mut self) {
        // A still-registered window is released by ncclCommAbort/Destroy of its
        // communicator; the memory itself is ours to free.
        if !self.ptr.is_null() {
            // SAFETY: allocated by ncclMemAlloc, freed once.
            unsafe { sys::ncclMemFree(self.ptr) };
        }
    }
}

/// An `ncclDevComm` (opaque, version-dependent size) created with the LSA
/// barriers the kernels use.
pub struct DevComm {
    storage: Vec<u64>,
}

impl DevComm {
    /// Collective.
    /// `gin_signals` > 0 also asks for GIN to every rank with that many signals.
    pub fn new(comm: &Communicator, lsa_barrier_count: i32, gin_signals: i32) -> Result<Self> {
        let words = |bytes: usize| bytes.div_ceil(8);
        let mut reqs = vec![0u64; words(kernels::nccl_struct_size(kernels::STRUCT_DEV_COMM_REQUIREMENTS))];
        // SAFETY: reqs holds sizeof(ncclDevCommRequirements) bytes, 8-aligned.
        unsafe { kernels::deepep_devcomm_requirements_init(reqs.as_mut_ptr().cast(), lsa_barrier_count, gin_signals) };
        let mut storage = vec![0u64; words(kernels::nccl_struct_size(kernels::STRUCT_DEV_COMM))];
        // SAFETY: both blobs have the sizes the NCCL headers define.
        let rc = unsafe { sys::ncclDevCommCreate(comm.raw(), reqs.as_ptr().cast(), storage.as_mut_ptr().cast()) };
        check(&format!("ncclDevCommCreate(lsaBarrierCount={lsa_barrier_count})"), rc, comm.raw())?;
        Ok(Self { storage })
    }

    pub fn as_ptr(&self) -> *const c_void {
        self.storage.as_ptr().cast()
    }

    pub fn info(&self) -> kernels::DevCommInfo {
        let mut info = kernels::DevCommInfo::default();
        // SAFETY: storage holds a devComm filled by ncclDevCommCreate.
        unsafe { kernels::deepep_devcomm_info(self.as_ptr(), &mut info) };
        info
    }

    /// Collective.
    pub fn destroy(self, comm: &Communicator) -> Result<()> {
        // SAFETY: created on comm by ncclDevCommCreate; not used after this.
        check("ncclDevCommDestroy", unsafe { sys::ncclDevCommDestroy(comm.raw(), self.as_ptr().cast()) }, comm.raw())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_minor_matches_and_other_minors_name_both_versions() {
        assert!(check_version_match(22809, 22809).is_ok());
        assert!(check_version_match(22809, 22803).is_ok());
        let err = check_version_match(22809, 23203).unwrap_err();
        assert_eq!(err.status, DeepepStatus::DEEPEP_ERROR_VERSION_MISMATCH);
        assert!(err.message.contains("compiled against NCCL 2.28.9"), "{}", err.message);
        assert!(err.message.contains("loaded NCCL 2.32.3"), "{}", err.message);
    }

    #[test]
    fn the_linked_nccl_matches_the_compiled_headers() {
        // CI builds against the wheel it links, so this must hold there.
        check_runtime_version().unwrap();
    }

    #[test]
    fn unique_id_works_without_a_gpu() {
        let a = unique_id().unwrap();
        assert!(a.iter().any(|b| *b != 0));
    }
}
