//! NCCL resources with RAII: the communicator, a symmetric window over
//! `ncclMemAlloc` memory, and the device communicator. Also the check that the
//! NCCL loaded in this process matches the headers the kernels were built with.
use std::ffi::CStr;
use std::os::raw::c_void;

use nccl_sys as sys;

use crate::error::{Error, Result};
use crate::cuda::{self, DeviceMemory};
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

pub(crate) fn format_version(code: i32) -> String {
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

/// The kernel build for the NCCL this process loaded (kernels::NcclBuild::for_runtime).
pub fn kernel_build() -> Result<kernels::NcclBuild> {
    kernels::NcclBuild::for_runtime(runtime_version()?)
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

    /// Orderly teardown: ncclCommFinalize here (its errors are this call's), then
    /// ncclCommDestroy on a background thread. Destroy is local after finalize, and it joins
    /// NCCL's proxy threads, one of which notices the stop only when its 500 ms poll ends: done
    /// inline, that made every Buffer destroy take half a second.
    pub fn destroy(mut self) -> Result<()> {
        let comm = std::mem::replace(&mut self.comm, std::ptr::null_mut());
        // SAFETY: comm is live; it is used only by the destroy below after this.
        if let Err(e) = check("ncclCommFinalize", unsafe { sys::ncclCommFinalize(comm) }, comm) {
            self.comm = comm; // Drop aborts it.
            return Err(e);
        }
        background_destroy::spawn(Finalized(comm));
        Ok(())
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

/// A finalized communicator, handed to the thread that destroys it.
struct Finalized(sys::ncclComm_t);
// SAFETY: a finalized communicator is touched by one thread only: the one destroying it.
unsafe impl Send for Finalized {}

/// ncclCommDestroy off the caller's thread. Pending destroys are joined at process exit (an
/// atexit hook, so NCCL's threads never outlive the process's CUDA teardown) and reaped as new
/// ones start.
/// cbindgen:ignore
mod background_destroy {
    use super::{sys, Finalized};
    use std::sync::{Mutex, Once};
    use std::thread::JoinHandle;

    static PENDING: Mutex<Vec<JoinHandle<()>>> = Mutex::new(Vec::new());
    static AT_EXIT: Once = Once::new();

    extern "C" {
        fn atexit(hook: extern "C" fn()) -> std::os::raw::c_int;
    }

    extern "C" fn join_all_at_exit() {
        let pending = std::mem::take(&mut *PENDING.lock().unwrap_or_else(|e| e.into_inner()));
        for handle in pending {
            let _ = handle.join();
        }
    }

    fn destroy_now(comm: Finalized) {
        // SAFETY: finalized, and this is its only user.
        let rc = unsafe { sys::ncclCommDestroy(comm.0) };
        if rc != sys::ncclSuccess {
            crate::log::log_at!(crate::log::Level::Error, None, "ncclCommDestroy after ncclCommFinalize returned {rc}");
        }
    }

    pub(super) fn spawn(comm: Finalized) {
        // SAFETY: registers a plain function once; it only joins threads.
        AT_EXIT.call_once(|| unsafe {
            atexit(join_all_at_exit);
        });
        let mut pending = PENDING.lock().unwrap_or_else(|e| e.into_inner());
        pending.retain(|h| !h.is_finished());
        let raw = comm.0;
        match std::thread::Builder::new().name("deepep-nccl destroy".into()).spawn(move || destroy_now(comm)) {
            Ok(handle) => pending.push(handle),
            // No thread to be had (the closure was dropped unrun): destroy inline.
            Err(_) => destroy_now(Finalized(raw)),
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

    /// Where the window's LSA mapping puts each LSA rank's copy, read from the device API
    /// itself (once, synchronously) so that the LL and internode kernels can form pointers
    /// without loading the window struct. NCCL maps the team's copies at a fixed stride;
    /// anything else is an error here rather than a wrong address in a kernel.
    pub fn lsa_geometry(&self, build: kernels::NcclBuild, lsa_rank: i32, lsa_size: i32) -> Result<LsaGeometry> {
        let n = lsa_size as usize;
        let out = DeviceMemory::zeroed(8 * (n + 1))?;
        let launch = kernels::entry(build.table().launch_window_geometry);
        // SAFETY: the window is registered; out holds lsa_size + 1 u64s; default stream, synced below.
        let rc = unsafe { launch(self.window.cast(), lsa_size, out.ptr().cast(), std::ptr::null_mut()) };
        kernels::launch_result("window_geometry", rc)?;
        cuda::context_synchronize()?;
        let ptrs = cuda::copy_to_host::<u64>(out.ptr(), n + 1)?;
        LsaGeometry::from_pointers(&ptrs[..n], ptrs[n], lsa_rank)
    }

    /// Collective deregistration, then free.
    pub fn destroy(mut self, comm: &Communicator) -> Result<()> {
        let window = std::mem::replace(&mut self.window, std::ptr::null_mut());
        // SAFETY: window was registered on comm and is not used after this.
        check("ncclCommWindowDeregister", unsafe { sys::ncclCommWindowDeregister(comm.raw(), window) }, comm.raw())
        // Drop frees the memory.
    }
}

/// The window's LSA mapping: LSA rank p's copy at `base + p * stride`; this rank is `lsa_rank`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LsaGeometry {
    pub base: u64,
    pub stride: u64,
    pub lsa_rank: i32,
}

impl LsaGeometry {
    /// From the device API's pointers: `peers[p]` for every LSA rank, `local` for this rank.
    pub fn from_pointers(peers: &[u64], local: u64, lsa_rank: i32) -> Result<Self> {
        let base = *peers.first().ok_or_else(|| Error::internal("LSA team has no ranks"))?;
        let stride = if peers.len() > 1 { peers[1].wrapping_sub(base) } else { 0 };
        for (p, &ptr) in peers.iter().enumerate() {
            let want = base.wrapping_add(stride.wrapping_mul(p as u64));
            if ptr != want {
                return Err(Error::internal(format!(
                    "NCCL's LSA window mapping is not evenly strided: LSA rank {p} at {ptr:#x}, expected {want:#x} \
                     (base {base:#x}, stride {stride:#x}); the LL and internode kernels need NCCL's flat mapping"
                )));
            }
        }
        if peers.get(lsa_rank as usize) != Some(&local) {
            return Err(Error::internal(format!(
                "NCCL's local window pointer {local:#x} is not LSA rank {lsa_rank}'s copy in the flat mapping"
            )));
        }
        Ok(Self { base, stride, lsa_rank })
    }

    /// This rank's copy of the window.
    pub fn local(&self) -> u64 {
        self.base.wrapping_add(self.stride.wrapping_mul(self.lsa_rank as u64))
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

/// An `ncclDevComm` (opaque; its layout is that of the kernel build it was made by) created with
/// the LSA barriers the kernels use. Only that build's kernels may be given it: [`DevComm::build`].
pub struct DevComm {
    storage: Vec<u64>,
    build: kernels::NcclBuild,
}

impl DevComm {
    /// Collective.
    /// `gin_signals` > 0 also asks for GIN to every rank with that many signals.
    pub fn new(comm: &Communicator, build: kernels::NcclBuild, lsa_barrier_count: i32, gin_signals: i32) -> Result<Self> {
        let words = |bytes: usize| bytes.div_ceil(8);
        let table = build.table();
        let mut reqs = vec![0u64; words(table.devcomm_requirements_size)];
        let init = kernels::entry(table.devcomm_requirements_init);
        // SAFETY: reqs holds sizeof(ncclDevCommRequirements) bytes of this build's headers, 8-aligned.
        unsafe { init(reqs.as_mut_ptr().cast(), lsa_barrier_count, gin_signals) };
        let mut storage = vec![0u64; words(table.devcomm_size)];
        // SAFETY: both blobs have the sizes this build's NCCL headers define, which the runtime
        // accepts (the build serves it: kernels::NcclBuild::for_runtime).
        let rc = unsafe { sys::ncclDevCommCreate(comm.raw(), reqs.as_ptr().cast(), storage.as_mut_ptr().cast()) };
        check(&format!("ncclDevCommCreate(lsaBarrierCount={lsa_barrier_count})"), rc, comm.raw())?;
        Ok(Self { storage, build })
    }

    pub fn as_ptr(&self) -> *const c_void {
        self.storage.as_ptr().cast()
    }

    /// The kernel build whose layout this devComm has.
    pub fn build(&self) -> kernels::NcclBuild {
        self.build
    }

    pub fn info(&self) -> kernels::DevCommInfo {
        let mut info = kernels::DevCommInfo::default();
        let read = kernels::entry(self.build.table().devcomm_info);
        // SAFETY: storage holds a devComm of this build's layout, filled by ncclDevCommCreate.
        unsafe { read(self.as_ptr(), &mut info) };
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
    fn lsa_geometry_accepts_a_strided_mapping_and_names_a_broken_one() {
        let g = LsaGeometry::from_pointers(&[0x1000, 0x5000, 0x9000], 0x5000, 1).unwrap();
        assert_eq!(g, LsaGeometry { base: 0x1000, stride: 0x4000, lsa_rank: 1 });
        assert_eq!(g.local(), 0x5000);
        assert_eq!(LsaGeometry::from_pointers(&[0x7000], 0x7000, 0).unwrap().stride, 0);
        let uneven = LsaGeometry::from_pointers(&[0x1000, 0x5000, 0xa000], 0x1000, 0).unwrap_err();
        assert!(uneven.message.contains("LSA rank 2 at 0xa000, expected 0x9000"), "{}", uneven.message);
        let local = LsaGeometry::from_pointers(&[0x1000, 0x5000], 0x1000, 1).unwrap_err();
        assert!(local.message.contains("not LSA rank 1's copy"), "{}", local.message);
    }

    #[test]
    fn a_build_serves_the_linked_nccl() {
        // The linked NCCL is the one a build's headers come from (toolchain.sh), so this must
        // hold; scripts/test.sh runs it under NCCL 2.32.3 too.
        let build = kernel_build().unwrap();
        assert!(build.nccl_version() <= runtime_version().unwrap());
        // scripts/test.sh loads another NCCL and names the build it must pick.
        if let Ok(expected) = std::env::var("DEEPEP_EXPECT_NCCL_BUILD") {
            assert_eq!(format_version(build.nccl_version()), expected, "runtime {}", format_version(runtime_version().unwrap()));
        }
    }

    #[test]
    fn unique_id_works_without_a_gpu() {
        let a = unique_id().unwrap();
        assert!(a.iter().any(|b| *b != 0));
    }
}
