//! The launch surface into the CUDA kernels. [`bindings`] is generated from
//! kernels/deepep_kernels.h (scripts/gen-kernel-bindings.sh) with compile-time checks of every
//! struct's size and field offsets; this module names its items for the crate and wraps the
//! pure functions.
use std::os::raw::c_int;

use crate::error::{Error, Result};

// include!() rather than a `mod` file so that cbindgen, which does not expand macros, never
// puts these internal items into include/deepep_nccl.h.
#[allow(non_camel_case_types, non_upper_case_globals, non_snake_case, clippy::all)]
mod bindings {
    include!("bindings.rs");
}
pub use bindings::*;

pub type StallRecord = DeepepStallRecord;
pub type WaitContext = DeepepWaitContext;
pub type LayoutParams = DeepepLayoutParams;
pub type FaultRecord = DeepepFaultRecord;
pub type RecvCounts = DeepepRecvCounts;
pub type NormalCommon = DeepepNormalCommon;
pub type NotifyParams = DeepepNotifyParams;
pub type DispatchParams = DeepepDispatchParams;
pub type CombineParams = DeepepCombineParams;
pub type LlCommon = DeepepLlCommon;
pub type LlDispatchParams = DeepepLlDispatchParams;
pub type LlCombineParams = DeepepLlCombineParams;
pub type LlCleanParams = DeepepLlCleanParams;
pub type DevCommInfo = DeepepDevCommInfo;
pub type InternodeCommon = DeepepInternodeCommon;
pub type InternodeNotifyParams = DeepepInternodeNotifyParams;
pub type InternodeDispatchParams = DeepepInternodeDispatchParams;
pub type InternodeCombineParams = DeepepInternodeCombineParams;

// The header's constants in the types the host code computes with.
pub(crate) const MAX_LOCAL_EXPERTS: usize = crate::capi::DEEPEP_MAX_LOCAL_EXPERTS as usize;
pub(crate) const MAX_NVL_RANKS: i32 = DEEPEP_MAX_NVL_RANKS;
pub(crate) const MAX_CHANNELS: i32 = DEEPEP_MAX_CHANNELS;
/// Bytes of one notify exchange slot.
pub(crate) const NOTIFY_SLOT_BYTES: usize = DEEPEP_NOTIFY_SLOT_INTS as usize * size_of::<i32>();
/// Shrink mode: the normal kernels' dropped-row counters (enum DeepepDroppedKind).
pub(crate) const DROPPED_KINDS: usize = DEEPEP_DROPPED_KINDS as usize;
/// Internode mode: the traffic counters (enum DeepepTrafficKind).
pub(crate) const TRAFFIC_KINDS: usize = DEEPEP_TRAFFIC_KINDS as usize;
pub(crate) const LL_MAX_TOPK: i64 = DEEPEP_LL_MAX_TOPK as i64;
pub(crate) const LL_PHASE_SEND: i32 = crate::capi::DEEPEP_LL_PHASE_SEND;
pub(crate) const LL_PHASE_RECV: i32 = crate::capi::DEEPEP_LL_PHASE_RECV;
pub(crate) const LL_MAX_BLOCKS: i32 = DEEPEP_LL_MAX_BLOCKS;
pub(crate) const LL_REMOTE_NONE: i32 = DEEPEP_LL_REMOTE_NONE as i32;
pub(crate) const LL_REMOTE_EMULATED: i32 = DEEPEP_LL_REMOTE_EMULATED as i32;
pub(crate) const LL_REMOTE_GIN: i32 = DEEPEP_LL_REMOTE_GIN as i32;
pub(crate) const LL_CLEAN_BANK: i32 = DEEPEP_LL_CLEAN_BANK;
pub(crate) const LL_SIGNAL_KINDS: i32 = DEEPEP_LL_SIGNAL_KINDS;
/// Bytes of a buffer half's LSA signal words per source rank: a u64 (generation, count) per signal kind.
pub(crate) const LL_SIGNAL_BYTES_PER_RANK: u64 = LL_SIGNAL_KINDS as u64 * size_of::<u64>() as u64;
pub(crate) const LL_GIN_SIGNALS_PER_RANK: i32 = DEEPEP_LL_GIN_SIGNALS_PER_RANK;
pub(crate) const INTERNODE_MAX_NODES: i32 = DEEPEP_INTERNODE_MAX_NODES;
pub(crate) const INTERNODE_MAX_NODE_SIZE: i32 = DEEPEP_INTERNODE_MAX_NODE_SIZE;

/// The channel bound Cb of the internode counters of a buffer on a GPU of `num_device_sms` SMs:
/// no op of it has more channels (config.num_sms <= the GPU's SMs, channels = num_sms / 2).
pub(crate) fn internode_counter_channels(num_device_sms: i32) -> i32 {
    (num_device_sms / 2).clamp(1, MAX_CHANNELS)
}
/// GIN signals (and window words) of the internode counters (kernels/deepep_kernels.h): tail and
/// head [Cb][N], notify [R].
pub(crate) fn internode_counters(counter_channels: i32, num_nodes: i32, num_ranks: i32) -> i64 {
    2 * counter_channels as i64 * num_nodes as i64 + num_ranks as i64
}
/// Window words of the internode control region: the counters, then the arrival word (read by
/// LSA peers only, so it has no GIN signal; kernels/deepep_kernels.h).
pub(crate) fn internode_window_words(counter_channels: i32, num_nodes: i32, num_ranks: i32) -> i64 {
    internode_counters(counter_channels, num_nodes, num_ranks) + 1
}
/// Words of the internode running totals: sent and received [Cb][N], the notify rounds done.
pub(crate) fn internode_totals_words(counter_channels: i32, num_nodes: i32) -> i64 {
    2 * counter_channels as i64 * num_nodes as i64 + 1
}
/// Bytes of one internode notify slot (per source rank and parity).
pub(crate) const INTERNODE_NOTIFY_SLOT_BYTES: i64 = DEEPEP_INTERNODE_NOTIFY_SLOT_INTS as i64 * 4;
pub(crate) const INTERNODE_NVL_HEADER_BYTES: i64 = DEEPEP_INTERNODE_NVL_HEADER_BYTES as i64;

impl Default for RecvCounts {
    /// num_recv_tokens is -1 until the notify kernel has written the counts.
    fn default() -> Self {
        Self { num_recv_tokens: -1, num_rdma_recv_tokens: -1, num_recv_tokens_per_expert: [0; MAX_LOCAL_EXPERTS] }
    }
}

mod builds {
    use super::DeepepNcclBuild;
    include!(concat!(env!("OUT_DIR"), "/nccl_builds.rs"));
}

/// One NCCL build of the kernels (kernels/nccl_builds.txt): the NCCL-dependent entry points
/// compiled against one NCCL version's headers, valid for the runtimes it serves.
#[derive(Clone, Copy)]
pub struct NcclBuild(&'static DeepepNcclBuild);

impl std::fmt::Debug for NcclBuild {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclBuild({})", crate::nccl::format_version(self.0.nccl_version))
    }
}

/// An entry of a build's table: kernels/nccl_build.cu fills every one (a unit test checks).
pub fn entry<F>(f: Option<F>) -> F {
    f.expect("a DeepepNcclBuild entry is NULL: kernels/nccl_build.cu fills every one")
}

impl NcclBuild {
    /// Every build this library holds, oldest headers first.
    pub fn all() -> impl Iterator<Item = NcclBuild> {
        builds::NCCL_BUILD_TABLES.iter().map(|table| {
            // SAFETY: each accessor returns the address of its build's static, immutable table.
            NcclBuild(unsafe { &*table() })
        })
    }

    /// The build for an NCCL runtime version: the newest headers with headers <= runtime <
    /// serves_below; an error naming the runtime and every build's range when none serves it.
    pub fn for_runtime(runtime: i32) -> Result<NcclBuild> {
        Self::all()
            .filter(|b| b.0.nccl_version <= runtime && runtime < b.0.serves_below)
            .max_by_key(|b| b.0.nccl_version)
            .ok_or_else(|| {
                let served: Vec<String> = Self::all().map(Self::served).collect();
                Error::new(
                    crate::error::DeepepStatus::DEEPEP_ERROR_VERSION_MISMATCH,
                    format!(
                        "this process loaded NCCL {} (libnccl.so.2; with torch, it is torch's), which no kernel build of \
                         deepep-nccl serves: it has builds for NCCL {}. Load a served NCCL (e.g. pip install \
                         nvidia-nccl-cu13=={}).",
                        crate::nccl::format_version(runtime),
                        served.join(", "),
                        crate::nccl::format_version(Self::all().last().map_or(0, |b| b.0.nccl_version)),
                    ),
                )
            })
    }

    /// The runtimes this build serves, in words (serves_below is always a minor's first release).
    fn served(self) -> String {
        let headers = crate::nccl::format_version(self.0.nccl_version);
        let (major, minor, _) = nccl_sys::split_version(self.0.nccl_version);
        let (_, below_minor, _) = nccl_sys::split_version(self.0.serves_below);
        if below_minor == minor + 1 {
            format!("{headers} and later {major}.{minor}.x")
        } else {
            format!("{headers} up to {major}.{}.x", below_minor - 1)
        }
    }

    /// NCCL_VERSION_CODE of the headers this build was compiled against.
    pub fn nccl_version(self) -> i32 {
        self.0.nccl_version
    }

    /// The build's entry points; call them through [`entry`].
    pub fn table(self) -> &'static DeepepNcclBuild {
        self.0
    }
}

/// Bytes of one dispatch ring slot (header, row, scales, top-k ids, weights).
pub fn dispatch_slot_bytes(hidden_bytes: i32, num_scales: i32, num_topk: i32) -> i64 {
    // SAFETY: pure arithmetic.
    unsafe { deepep_dispatch_slot_bytes(hidden_bytes, num_scales, num_topk) }
}

/// Bytes of one combine ring slot (header, row, weights).
pub fn combine_slot_bytes(hidden_bytes: i32, num_topk: i32) -> i64 {
    // SAFETY: pure arithmetic.
    unsafe { deepep_combine_slot_bytes(hidden_bytes, num_topk) }
}

/// Bytes of one internode dispatch row (a scale-out ring slot).
pub fn internode_dispatch_row_bytes(hidden_bytes: i32, num_scales: i32, num_topk: i32) -> i64 {
    // SAFETY: pure arithmetic.
    unsafe { deepep_internode_dispatch_row_bytes(hidden_bytes, num_scales, num_topk) }
}

/// Bytes of one internode combine row (a scale-out ring slot).
pub fn internode_combine_row_bytes(hidden_bytes: i32, num_topk: i32) -> i64 {
    // SAFETY: pure arithmetic.
    unsafe { deepep_internode_combine_row_bytes(hidden_bytes, num_topk) }
}

/// High word of the normal-mode ring flags of op `epoch`.
pub fn normal_flag_generation(epoch: u32) -> u32 {
    // SAFETY: pure arithmetic.
    unsafe { deepep_normal_flag_generation(epoch) }
}

/// Bytes of one LL dispatch slot (header with the top-k list, then the payload).
pub fn ll_dispatch_slot_bytes(hidden: i32, num_topk: i32, use_fp8: bool) -> i64 {
    // SAFETY: pure arithmetic.
    unsafe { deepep_ll_dispatch_slot_bytes(hidden, num_topk, use_fp8 as i32) }
}

/// Bytes of one LL dispatch count message (per-expert counts, then the filled-slot bitmap).
pub fn ll_count_bytes(num_local_experts: i32, max_tokens: i32) -> i64 {
    // SAFETY: pure arithmetic.
    unsafe { deepep_ll_count_bytes(num_local_experts, max_tokens) }
}

/// Bytes of one LL combine slot; None when this build has no LogFMT.
pub fn ll_combine_slot_bytes(hidden: i32, use_logfmt: bool) -> Option<i64> {
    // SAFETY: pure arithmetic.
    let v = unsafe { deepep_ll_combine_slot_bytes(hidden, use_logfmt as i32) };
    (v > 0).then_some(v)
}

/// Bytes between rows of the zero-copy combine view, as the combine kernel writes them.
pub fn ll_view_row_bytes(hidden: i32) -> i64 {
    // SAFETY: pure arithmetic.
    unsafe { deepep_ll_view_row_bytes(hidden) }
}

/// Loads every kernel of `build` (each launcher's table, and the layout kernels) into the current
/// context, on `device_id`, before any launch. CUDA's lazy loading (the default since CUDA 12.2)
/// loads a kernel's module at its first launch, and that load may wait for the device's running
/// kernels: the first launch of a kernel that a spinning kernel of ours waits for (one process
/// driving several GPUs from one thread, or a first op while another spins) could deadlock.
/// Idempotent: a second call only queries the loaded kernels.
pub fn preload(build: NcclBuild, device_id: i32) -> Result<()> {
    // SAFETY: takes no arguments and acts on the current context, which the caller made current.
    let code = unsafe { entry(build.table().preload_kernels)() };
    preload_result(build, device_id, code)
}

/// Turns deepep_preload_kernels's cudaError_t into an error naming the CUDA error.
fn preload_result(build: NcclBuild, device_id: i32, code: c_int) -> Result<()> {
    if code == 0 {
        return Ok(());
    }
    // SAFETY: cudaGetErrorString returns a static NUL-terminated string for any code.
    let what = unsafe { std::ffi::CStr::from_ptr(deepep_cuda_error_string(code)) }.to_string_lossy();
    Err(Error::cuda(format!(
        "loading the kernels (NCCL {} build) on device {device_id} failed: {what} (cudaError {code})",
        crate::nccl::format_version(build.nccl_version())
    )))
}

/// Turns a launcher's cudaError_t into an error naming the kernel.
pub fn launch_result(kernel: &str, code: c_int) -> Result<()> {
    if code == 0 {
        return Ok(());
    }
    // SAFETY: cudaGetErrorString returns a static NUL-terminated string for any code.
    let what = unsafe { std::ffi::CStr::from_ptr(deepep_cuda_error_string(code)) }.to_string_lossy();
    Err(Error::cuda(format!("launching {kernel} failed: {what} (cudaError {code})")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_build_has_its_minors_devcomm_layout_and_a_full_table() {
        let mut count = 0;
        for build in NcclBuild::all() {
            let t = build.table();
            let (_, minor, _) = nccl_sys::split_version(t.nccl_version);
            // The devComm sizes of NCCL 2.28, 2.29, 2.30 and 2.31+ (nccl-device-api.md).
            let expected = match minor {
                28 => 200,
                29 => 224,
                30 => 240,
                _ => 248,
            };
            assert_eq!(t.devcomm_size, expected, "sizeof(ncclDevComm) in {build:?}");
            assert!(t.devcomm_requirements_size >= 56, "{build:?}");
            assert!(t.serves_below > t.nccl_version, "{build:?}");
            assert!(t.gin_compiled != 0, "{build:?}: every served NCCL has GIN headers");
            assert!(
                t.devcomm_requirements_init.is_some()
                    && t.devcomm_info.is_some()
                    && t.launch_lsa_barrier.is_some()
                    && t.launch_lsa_peer_check.is_some()
                    && t.launch_window_geometry.is_some()
                    && t.launch_normal_notify.is_some()
                    && t.launch_normal_dispatch.is_some()
                    && t.launch_normal_combine.is_some()
                    && t.launch_ll_dispatch.is_some()
                    && t.launch_ll_combine.is_some()
                    && t.launch_ll_clean.is_some()
                    && t.launch_internode_notify.is_some()
                    && t.launch_internode_dispatch.is_some()
                    && t.launch_internode_combine.is_some()
                    && t.preload_kernels.is_some(),
                "{build:?}"
            );
            count += 1;
        }
        assert!(count >= 1);
    }

    #[test]
    fn a_failed_preload_is_a_cuda_error_naming_the_cuda_error() {
        let build = NcclBuild::all().next().expect("a build");
        assert_eq!(preload_result(build, 3, 0), Ok(()));
        // cudaErrorNoKernelImageForDevice: a GPU the build has no image for.
        let e = preload_result(build, 3, 209).unwrap_err();
        assert_eq!(e.status, crate::error::DeepepStatus::DEEPEP_ERROR_CUDA);
        assert!(
            e.message.starts_with("loading the kernels (NCCL ")
                && e.message.contains(" build) on device 3 failed: ")
                && e.message.ends_with("(cudaError 209)"),
            "{}",
            e.message
        );
    }

    #[test]
    fn builds_are_oldest_first_and_each_serves_its_own_version() {
        let versions: Vec<i32> = NcclBuild::all().map(|b| b.nccl_version()).collect();
        assert!(versions.windows(2).all(|w| w[0] < w[1]), "{versions:?}");
        for v in versions {
            assert_eq!(NcclBuild::for_runtime(v).unwrap().nccl_version(), v);
        }
    }

    #[test]
    fn the_runtime_picks_the_newest_build_not_newer_than_it() {
        let versions: Vec<i32> = NcclBuild::all().map(|b| b.nccl_version()).collect();
        if versions != [22809, 22907, 23007, 23102, 23203] {
            return; // a DEEPEP_NCCL_BUILDS subset: the full table is what CI builds
        }
        let pick = |runtime| NcclBuild::for_runtime(runtime).map(|b| b.nccl_version());
        assert_eq!(pick(22810).unwrap(), 22809);
        assert_eq!(pick(22999).unwrap(), 22907);
        assert_eq!(pick(23104).unwrap(), 23102); // 2.31.4: the 2.31 headers
        assert_eq!(pick(23100).unwrap(), 23007); // 2.31.0: older than the 2.31.2 headers
        assert_eq!(pick(23202).unwrap(), 23102);
        assert_eq!(pick(23209).unwrap(), 23203);
        for outside in [22807, 22903, 23004, 23300, 22700] {
            let err = pick(outside).unwrap_err();
            assert_eq!(err.status, crate::error::DeepepStatus::DEEPEP_ERROR_VERSION_MISMATCH);
            assert!(err.message.contains(&crate::nccl::format_version(outside)), "{}", err.message);
            assert!(err.message.contains("2.28.9 and later 2.28.x"), "{}", err.message);
            assert!(err.message.contains("2.30.7 up to 2.32.x"), "{}", err.message);
        }
    }

    #[test]
    fn recv_counts_start_unwritten() {
        let counts = RecvCounts::default();
        assert_eq!(counts.num_recv_tokens, -1);
        assert_eq!(counts.num_recv_tokens_per_expert.len(), MAX_LOCAL_EXPERTS);
    }
}
