//! `Buffer`: the lifecycle of one rank's NCCL resources (communicator,
//! symmetric window, device communicator, comm stream, workspace) and the
//! host side of bounded GPU waits.
use std::os::raw::c_void;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::config::{check_buffer_args, RankLayout};
use crate::cuda::{self, DeviceMemory, HostMapped, PrimaryContext, Stream};
use crate::env::{Settings, VIRTUAL_NODE_ENV};
use crate::error::{Error, Result};
use crate::faults;
use crate::kernels::{self, StallRecord, WaitContext};
use crate::log::Level;
use crate::nccl::{self, Communicator, DevComm, LsaGeometry, SymmetricWindow};

/// Control region at the start of the window: peer-check slots at 0, the LL clean
/// barrier's arrival words at LL_CLEAN_BARRIER_OFFSET, the normal-mode notify exchange at
/// NOTIFY_OFFSET, room for later modes. No data path writes here.
const CONTROL_BYTES: usize = 1 << 20;
const LL_CLEAN_BARRIER_OFFSET: usize = 32 << 10;
const NOTIFY_OFFSET: usize = 64 << 10;
const _: () = assert!(LL_CLEAN_BARRIER_OFFSET + 4 * LL_MAX_RANKS as usize <= NOTIFY_OFFSET);
const _: () = assert!(NOTIFY_OFFSET + 2 * kernels::MAX_NVL_RANKS as usize * kernels::NOTIFY_SLOT_BYTES <= CONTROL_BYTES);
/// The internode control window words (kernels::internode_window_words of them, 8 bytes each);
/// a buffer across many nodes grows its control region past CONTROL_BYTES for them
/// ([`control_bytes`]).
const INTERNODE_CONTROL_OFFSET: usize = 256 << 10;
const _: () = assert!(NOTIFY_OFFSET + 2 * kernels::MAX_NVL_RANKS as usize * kernels::NOTIFY_SLOT_BYTES <= INTERNODE_CONTROL_OFFSET);
const WINDOW_ALIGN: usize = nccl_sys::NCCL_WIN_REQUIRED_ALIGNMENT;
/// Zeroed device scratch, as DeepEP's NUM_WORKSPACE_BYTES.
const WORKSPACE_BYTES: usize = 32 << 20;
const WS_LAYOUT_TICKET: usize = 0;
const WS_STALL_LOCK: usize = 128;
/// Faults claimed (kernels/deepep_kernels.h, DeepepFaultRecord): never reset, the host's
/// `released` count catches up instead.
const WS_FAULT_LOCK: usize = WS_STALL_LOCK + 4;
const WS_PEER_MISMATCHES: usize = 256;
const _: () = assert!(WS_FAULT_LOCK + 4 <= WS_PEER_MISMATCHES);
const WS_OP_EPOCH: usize = 512;
const WS_NOTIFY_EPOCH: usize = 516;
const WS_DATA_TICKET: usize = 520;
/// Barriers clean_low_latency_buffer has passed (never reset: the arrival words only grow).
const WS_LL_CLEAN_EPOCH: usize = 524;
/// Shrink mode, normal kernels: peer_gone [MAX_NVL_RANKS] i32, then dropped [DROPPED_KINDS] u64.
const WS_NORMAL_PEER_GONE: usize = 1024;
const WS_NORMAL_DROPPED: usize = 1088;
const _: () = assert!(WS_NORMAL_PEER_GONE + 4 * kernels::MAX_NVL_RANKS as usize <= WS_NORMAL_DROPPED);
/// Internode traffic counters, u64 [TRAFFIC_KINDS] (cumulative: never reset).
const WS_INTERNODE_TRAFFIC: usize = 1152;
const _: () = assert!(WS_NORMAL_DROPPED + 8 * kernels::DROPPED_KINDS <= WS_INTERNODE_TRAFFIC);
const _: () = assert!(WS_INTERNODE_TRAFFIC + 8 * kernels::TRAFFIC_KINDS <= WS_LAYOUT_ACCUMULATORS);
const WS_LAYOUT_ACCUMULATORS: usize = 4096;
/// Low-latency counters at the end of the workspace (see [`LlWorkspace`]).
const WS_LL: usize = WORKSPACE_BYTES - (128 << 10);
/// End of the layout accumulators (the internode running totals have an allocation of their
/// own, sized by the buffer's nodes: [`Resources::internode_totals`]).
const WS_LAYOUT_END: usize = WS_LL - (64 << 10);
/// Shrink mode, internode kernels: peer_gone [LL_MAX_RANKS] i32 (the mask's ranks; the internode
/// kernels share the normal kernels' dropped counters).
const WS_INTERNODE_PEER_GONE: usize = WS_LAYOUT_END;
const _: () = assert!(WS_INTERNODE_PEER_GONE + 4 * LL_RANKS <= WS_LL);
/// Largest rank count the LL workspace arrays hold.
pub(crate) const LL_MAX_RANKS: i32 = 1024;
/// Bytes of an LL workspace array of `per` bytes per (op kind, half, `n`).
const fn ll_array(n: usize, per: usize) -> usize {
    2 * 2 * n * per
}
const LL_RANKS: usize = LL_MAX_RANKS as usize;
/// The LL arrays (see [`LlWorkspace`]): done, source_state, ticket, op_seq, gin_sent, then mask.
const LL_DONE: usize = 0;
const LL_SOURCE_STATE: usize = LL_DONE + ll_array(LL_RANKS, 4);
const LL_TICKET: usize = LL_SOURCE_STATE + ll_array(LL_RANKS, 4);
const LL_OP_SEQ: usize = LL_TICKET + 128;
const LL_GIN_SENT: usize = LL_OP_SEQ + ll_array(kernels::LL_MAX_BLOCKS as usize, 8);
const LL_MASK: usize = LL_GIN_SENT + ll_array(LL_RANKS, 8);
const _: () = assert!(LL_MASK + 4 * LL_RANKS <= WORKSPACE_BYTES - WS_LL);
/// LSA barrier slot used by host-driven control kernels (create/destroy/checks).
const CONTROL_BARRIER_SLOT: i32 = 0;
/// Slot of the dispatch notify kernel; data kernels use one slot per block after it.
const NOTIFY_BARRIER_SLOT: i32 = 1;
const DATA_BARRIER_BASE: i32 = 2;

/// Locks ignoring poison: a panic inside an op is already reported as
/// DEEPEP_ERROR_INTERNAL by the C ABI, and the guarded state stays consistent
/// (each critical section either completes its take/store or changes nothing).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn align_up(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

/// Bytes of the window's control region for `layout` on a GPU of `num_device_sms` SMs: 1 MiB,
/// or more across nodes when the internode window words (2 Cb N + R + 1) need it. The NVL region
/// starts here.
pub(crate) fn control_bytes(layout: &RankLayout, num_device_sms: i32) -> usize {
    if !layout.spans_nodes() {
        return CONTROL_BYTES;
    }
    let (cb, n) = (kernels::internode_counter_channels(num_device_sms), layout.num_ranks / layout.node_size);
    let words = kernels::internode_window_words(cb, n, layout.num_ranks) as usize;
    CONTROL_BYTES.max(align_up(INTERNODE_CONTROL_OFFSET + 8 * words, WINDOW_ALIGN))
}

/// Which normal-mode kernel a [`Resources::normal_common`] is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormalKernel {
    Notify,
    /// Dispatch or combine: block b barriers on slot `barrier_slot() + b`.
    Data,
}

impl NormalKernel {
    pub fn barrier_slot(self) -> i32 {
        match self {
            Self::Notify => NOTIFY_BARRIER_SLOT,
            Self::Data => DATA_BARRIER_BASE,
        }
    }
}

/// Device addresses of the LL counters in the workspace.
#[derive(Clone, Copy, Debug)]
pub struct LlWorkspace {
    pub done: *mut i32,
    pub source_state: *mut i32,
    pub ticket: *mut u32,
    pub op_seq: *mut u64,
    pub gin_sent: *mut u64,
    pub mask: *mut i32,
}

/// Creation arguments, as DeepEP's `Buffer` constructor takes them.
#[derive(Clone, Copy, Debug)]
pub struct BufferArgs {
    pub rank: i32,
    pub num_ranks: i32,
    pub num_nvl_bytes: i64,
    pub num_rdma_bytes: i64,
    pub low_latency_mode: bool,
    pub explicitly_destroy: bool,
    pub enable_shrink: bool,
}

/// GPU/NCCL resources; `None` in [`Buffer`] after destroy.
/// Field order is drop order: the communicator is aborted before the window's
/// memory is freed, and the context is released last.
pub(crate) struct Resources {
    pub stream: Stream,
    pub workspace: DeviceMemory,
    /// Internode running totals, u64 [kernels::internode_totals_words] (one word within a node).
    pub internode_totals: DeviceMemory,
    /// The control region's bytes ([`control_bytes`]): where the NVL region starts.
    pub control_bytes: usize,
    pub stall: HostMapped<StallRecord>,
    pub fault: HostMapped<kernels::FaultRecord>,
    pub recv_counts: HostMapped<kernels::RecvCounts>,
    pub dev_comm: DevComm,
    pub comm: Communicator,
    pub window: SymmetricWindow,
    /// Where each LSA rank's copy of the window lies (the LL and internode kernels' pointers).
    pub lsa_geometry: LsaGeometry,
    pub lsa_base_rank: i32,
    pub lsa_size: i32,
    pub num_sms: i32,
    /// LL peers in the same node of `node_size` ranks get LSA stores; others `remote_kind`.
    pub node_size: i32,
    pub remote_kind: i32,
    pub ctx: PrimaryContext,
}

impl Resources {
    fn workspace_at(&self, offset: usize) -> *mut c_void {
        // SAFETY: offsets are constants inside the 32 MiB workspace.
        unsafe { self.workspace.ptr().cast::<u8>().add(offset).cast() }
    }
    pub fn layout_ticket(&self) -> *mut u32 {
        self.workspace_at(WS_LAYOUT_TICKET).cast()
    }
    pub fn layout_accumulators(&self) -> (*mut i32, i64) {
        (self.workspace_at(WS_LAYOUT_ACCUMULATORS).cast(), ((WS_LAYOUT_END - WS_LAYOUT_ACCUMULATORS) / 4) as i64)
    }
    /// The LL state, per (op kind, half): done [R], source_state [R], ticket (then the sends per
    /// half), op_seq [LL_MAX_BLOCKS], gin_sent [R]; then mask [R] (kernels/deepep_kernels.h).
    pub fn ll_workspace(&self) -> LlWorkspace {
        LlWorkspace {
            done: self.workspace_at(WS_LL + LL_DONE).cast(),
            source_state: self.workspace_at(WS_LL + LL_SOURCE_STATE).cast(),
            ticket: self.workspace_at(WS_LL + LL_TICKET).cast(),
            op_seq: self.workspace_at(WS_LL + LL_OP_SEQ).cast(),
            gin_sent: self.workspace_at(WS_LL + LL_GIN_SENT).cast(),
            mask: self.workspace_at(WS_LL + LL_MASK).cast(),
        }
    }
    /// The LL state without the mask (what clean_low_latency_buffer zeroes; its kernel then
    /// writes the new generation into op_seq).
    pub fn ll_counters(&self) -> (*mut c_void, usize) {
        (self.workspace_at(WS_LL), LL_MASK)
    }
    /// Window offset of the clean barrier's arrival words [R], and this rank's count of
    /// barriers passed.
    pub fn ll_clean_barrier(&self) -> (u64, *mut u32) {
        (LL_CLEAN_BARRIER_OFFSET as u64, self.workspace_at(WS_LL_CLEAN_EPOCH).cast())
    }
    /// Grid of the LL kernels: one block per SM, at most the blocks op_seq has slots for.
    pub fn ll_blocks(&self) -> i32 {
        self.num_sms.min(kernels::LL_MAX_BLOCKS)
    }
    /// Window geometry and device counters shared by the normal-mode kernels;
    /// `barrier_base` is [`NormalKernel::barrier_slot`] of the kernel to launch.
    pub fn normal_common(
        &self,
        wait: WaitContext,
        args: &BufferArgs,
        num_channels: i32,
        ring_tokens: i32,
        kernel: NormalKernel,
    ) -> kernels::NormalCommon {
        kernels::NormalCommon {
            window: self.window.handle().cast(),
            nvl_offset: self.control_bytes as u64,
            notify_offset: NOTIFY_OFFSET as u64,
            op_epoch: self.workspace_at(WS_OP_EPOCH).cast(),
            notify_epoch: self.workspace_at(WS_NOTIFY_EPOCH).cast(),
            ticket: self.workspace_at(WS_DATA_TICKET).cast(),
            fault: self.fault.device_ptr(),
            mask: self.ll_workspace().mask,
            peer_gone: self.workspace_at(WS_NORMAL_PEER_GONE).cast(),
            dropped: self.normal_dropped(),
            wait,
            rank: args.rank,
            num_ranks: args.num_ranks,
            num_channels,
            ring_tokens,
            barrier_base: kernel.barrier_slot(),
            shrink: args.enable_shrink as i32,
        }
    }
    /// Shrink mode: the normal kernels' cumulative dropped-row counters, u64 [DROPPED_KINDS]
    /// (enum DeepepDroppedKind).
    pub fn normal_dropped(&self) -> *mut u64 {
        self.workspace_at(WS_NORMAL_DROPPED).cast()
    }
    /// The internode kernels' cumulative traffic counters, u64 [TRAFFIC_KINDS] (enum
    /// DeepepTrafficKind).
    pub fn internode_traffic(&self) -> *mut u64 {
        self.workspace_at(WS_INTERNODE_TRAFFIC).cast()
    }
    /// Window geometry, device counters and topology of the internode kernels.
    pub fn internode_common(
        &self,
        wait: WaitContext,
        layout: &crate::config::RankLayout,
        rdma_offset: usize,
        num_channels: i32,
        rdma_ring_tokens: i32,
        nvl_ring_tokens: i32,
        shrink: bool,
    ) -> kernels::InternodeCommon {
        kernels::InternodeCommon {
            window: self.window.handle().cast(),
            lsa_base: self.lsa_geometry.base as *mut u8,
            lsa_stride: self.lsa_geometry.stride,
            local_base: self.lsa_geometry.local() as *mut u8,
            nvl_offset: self.control_bytes as u64,
            rdma_offset: rdma_offset as u64,
            control_offset: INTERNODE_CONTROL_OFFSET as u64,
            op_epoch: self.workspace_at(WS_OP_EPOCH).cast(),
            ticket: self.workspace_at(WS_DATA_TICKET).cast(),
            totals: self.internode_totals.ptr().cast(),
            traffic: self.internode_traffic(),
            fault: self.fault.device_ptr(),
            mask: self.ll_workspace().mask,
            peer_gone: self.workspace_at(WS_INTERNODE_PEER_GONE).cast(),
            dropped: self.normal_dropped(),
            wait,
            rank: layout.rank,
            num_ranks: layout.num_ranks,
            node_size: layout.node_size,
            num_nodes: layout.num_ranks / layout.node_size,
            num_channels,
            rdma_ring_tokens,
            nvl_ring_tokens,
            gin_signal_base: kernels::LL_GIN_SIGNALS_PER_RANK * layout.num_ranks,
            counter_channels: kernels::internode_counter_channels(self.num_sms),
            shrink: shrink as i32,
        }
    }
    /// The stream an op launches on: the caller's, or the comm stream for NULL.
    pub fn stream_or_comm(&self, stream: *mut c_void) -> *mut c_void {
        if stream.is_null() {
            self.stream.raw()
        } else {
            stream
        }
    }
    fn wait_context(&self, rank: i32, timeout_ns: u64) -> WaitContext {
        WaitContext {
            stall: self.stall.device_ptr(),
            stall_lock: self.workspace_at(WS_STALL_LOCK).cast(),
            fault_lock: self.workspace_at(WS_FAULT_LOCK).cast(),
            timeout_ns,
            world_rank: rank,
            lsa_base_rank: self.lsa_base_rank,
        }
    }
}

pub struct Buffer {
    pub args: BufferArgs,
    pub layout: RankLayout,
    pub device_id: i32,
    num_device_sms: i32,
    /// Ranks reachable by LSA loads/stores (the whole buffer within one node).
    pub lsa_size: i32,
    resources: Mutex<Option<Resources>>,
    /// Set when a GPU wait expired: the barrier epochs are no longer in step.
    failure: Mutex<Option<Error>>,
    timeout_ns: AtomicU64,
    check_tag: AtomicU32,
    /// Half of the LL region the next LL send uses (DeepEP's low_latency_buffer_idx).
    ll_parity: AtomicU32,
    ll_host: Mutex<crate::ll::LlHost>,
}

/// 32 bits (FNV-1a) of the arguments every rank must share, never 0 (0 is the plain check):
/// folded into the creation peer check's tag, so an LSA peer created with others fails it.
pub(crate) fn shared_args_digest(args: &BufferArgs) -> u32 {
    let bytes = args.num_nvl_bytes.to_le_bytes().into_iter().chain(args.num_rdma_bytes.to_le_bytes());
    let flags = [args.low_latency_mode as u8, args.enable_shrink as u8];
    let h = bytes.chain(flags).fold(0x811c_9dc5u32, |h, b| (h ^ b as u32).wrapping_mul(0x0100_0193));
    h.max(1)
}

impl Buffer {
    /// Collective over all ranks sharing the unique id `read_unique_id` returns (read after
    /// the argument and environment checks, so that those errors come first).
    pub fn create(
        args: BufferArgs,
        read_unique_id: impl FnOnce() -> Result<[u8; nccl_sys::NCCL_UNIQUE_ID_BYTES]>,
    ) -> Result<Self> {
        check_buffer_args(args.rank, args.num_ranks, args.num_nvl_bytes, args.num_rdma_bytes, args.low_latency_mode)?;
        // Before anything collective: every rank rejects a bad value the same way.
        let settings = Settings::from_env(args.num_ranks)?;
        let id = read_unique_id()?;
        let device_id = cuda::current_device()?;
        let build = nccl::kernel_build()?;
        let mut times = crate::log::PhaseTimes::start("Buffer creation");
        let resources = Self::create_resources(&args, device_id, &id, &settings, build, &mut times)?;
        let buffer = Self {
            args,
            layout: RankLayout { rank: args.rank, num_ranks: args.num_ranks, node_size: resources.node_size },
            device_id,
            num_device_sms: resources.num_sms,
            lsa_size: resources.lsa_size,
            resources: Mutex::new(Some(resources)),
            failure: Mutex::new(None),
            timeout_ns: AtomicU64::new((settings.gpu_timeout_secs * 1e9) as u64),
            check_tag: AtomicU32::new(0x5eed_0000),
            ll_parity: AtomicU32::new(0),
            ll_host: Mutex::default(),
        };
        // Every rank has its window and devComm: prove LSA loads/stores reach all peers, and that
        // they were created with this rank's sizes and modes (the C ABI has no other exchange).
        buffer.peer_check(shared_args_digest(&args))?;
        times.mark("peer check");
        times.report(args.rank);
        Ok(buffer)
    }

    fn create_resources(
        args: &BufferArgs,
        device_id: i32,
        id: &[u8; 128],
        settings: &Settings,
        build: kernels::NcclBuild,
        times: &mut crate::log::PhaseTimes,
    ) -> Result<Resources> {
        let ctx = PrimaryContext::retain(device_id)?;
        let num_sms = ctx.sm_count()?;
        times.mark("context");
        // Every kernel loaded before any launch (kernels::preload: lazy loading's first-launch
        // load may wait for a spinning kernel). Before the first collective: a failure every rank
        // shares (e.g. no kernel image for this GPU) then fails each rank before any waits for
        // another in ncclCommInitRank.
        kernels::preload(build, device_id)?;
        times.mark("kernel preload");
        let comm = Communicator::init_rank(args.num_ranks, id, args.rank)?;
        times.mark("ncclCommInitRank");
        let team = comm.lsa_team();
        let multi_node = team.nRanks != args.num_ranks;
        let virtual_node = settings.virtual_node_size;
        let (node_size, remote_kind) = if multi_node {
            (team.nRanks, kernels::LL_REMOTE_GIN)
        } else if virtual_node < args.num_ranks {
            (virtual_node, kernels::LL_REMOTE_EMULATED)
        } else {
            (args.num_ranks, kernels::LL_REMOTE_NONE)
        };
        let layout = RankLayout { rank: args.rank, num_ranks: args.num_ranks, node_size };
        let control_bytes = control_bytes(&layout, num_sms);
        let counter_channels = kernels::internode_counter_channels(num_sms);
        let nodes = args.num_ranks / node_size;
        let nvl_offset = control_bytes;
        let rdma_offset = nvl_offset + align_up(args.num_nvl_bytes as usize, WINDOW_ALIGN);
        let window_bytes = rdma_offset + align_up(args.num_rdma_bytes as usize, WINDOW_ALIGN);
        let window = SymmetricWindow::new(&comm, window_bytes)?;
        times.mark("window alloc+register");
        cuda::memset_zero(window.ptr(), window.bytes())?;
        // Control and notify slots, then one per SM so per-CTA barriers never share one.
        // The LL signals, then the internode counters (one buffer may serve both kinds of op).
        let gin_signals = if multi_node {
            let counters = kernels::internode_counters(counter_channels, nodes, args.num_ranks);
            let total = kernels::LL_GIN_SIGNALS_PER_RANK as i64 * args.num_ranks as i64 + counters;
            i32::try_from(total).map_err(|_| {
                Error::invalid(format!(
                    "{} ranks in {nodes} nodes need {total} GIN signals (low-latency and internode counters), more \
                     than NCCL's 32-bit signal count",
                    args.num_ranks
                ))
            })?
        } else {
            0
        };
        let dev_comm = DevComm::new(&comm, build, DATA_BARRIER_BASE + num_sms, gin_signals).map_err(|e| {
            if multi_node {
                Error::unsupported(format!(
                    "rank {} reaches only {} of {} ranks over NVLink/P2P; the others need NCCL GIN (GPU-initiated \
                     networking over an RDMA NIC), which NCCL cannot provide here ({}); ranks that all share one \
                     NVLink domain can emulate the scale-out leg instead with DEEPEP_VIRTUAL_NODE_SIZE=<GPUs per \
                     virtual node>",
                    args.rank, team.nRanks, args.num_ranks, e.message
                ))
            } else {
                e
            }
        })?;
        times.mark("memset+devComm");
        let info = dev_comm.info();
        let lsa_geometry = window.lsa_geometry(build, info.lsa_rank, info.lsa_size)?;
        if crate::log::enabled(Level::Info) {
            let report = CreationReport {
                args: *args,
                nccl_runtime: nccl::runtime_version()?,
                nccl_compiled: build.nccl_version(),
                nccl_builds: kernels::NcclBuild::all().count(),
                lsa_base_rank: info.rank - info.lsa_rank,
                lsa_size: info.lsa_size,
                node_size,
                remote_kind,
                virtual_node_env: crate::env::read(VIRTUAL_NODE_ENV).is_some(),
                num_sms,
                control_bytes,
                gpu_timeout_secs: settings.gpu_timeout_secs,
            };
            for (level, line) in report.lines() {
                crate::log::log_at!(level, Some(args.rank), "{line}");
            }
        }
        let resources = Resources {
            stream: Stream::new_high_priority()?,
            workspace: DeviceMemory::zeroed(WORKSPACE_BYTES)?,
            internode_totals: DeviceMemory::zeroed(if layout.spans_nodes() {
                8 * kernels::internode_totals_words(counter_channels, nodes) as usize
            } else {
                8
            })?,
            control_bytes,
            stall: HostMapped::new()?,
            fault: HostMapped::new()?,
            recv_counts: HostMapped::new()?,
            lsa_geometry,
            lsa_base_rank: info.rank - info.lsa_rank,
            lsa_size: info.lsa_size,
            num_sms,
            node_size,
            remote_kind,
            dev_comm,
            comm,
            window,
            ctx,
        };
        times.mark("stream+workspace+host memory");
        Ok(resources)
    }

    /// A Buffer with no GPU resources, as after destroy(): its queries answer from `args`, its
    /// ops check their arguments as for a real one and then report DEEPEP_ERROR_NOT_AVAILABLE.
    /// For the CPU tests, fuzz targets and benches (capi::testing), never for a user.
    #[doc(hidden)]
    pub fn without_resources(args: BufferArgs, num_device_sms: i32) -> Self {
        Self::without_resources_in_nodes(args, num_device_sms, args.num_ranks)
    }

    /// [`Buffer::without_resources`] spanning nodes of `node_size` ranks (internode checks).
    #[doc(hidden)]
    pub fn without_resources_in_nodes(args: BufferArgs, num_device_sms: i32, node_size: i32) -> Self {
        Self {
            args,
            layout: RankLayout { rank: args.rank, num_ranks: args.num_ranks, node_size },
            device_id: -1,
            num_device_sms,
            lsa_size: args.num_ranks,
            resources: Mutex::new(None),
            failure: Mutex::new(None),
            timeout_ns: AtomicU64::new(100_000_000_000),
            check_tag: AtomicU32::new(0),
            ll_parity: AtomicU32::new(0),
            ll_host: Mutex::default(),
        }
    }

    /// Half of the LL region for the next LL send; flips it (DeepEP flips per call).
    pub(crate) fn next_ll_parity(&self) -> i32 {
        self.ll_parity.fetch_xor(1, Ordering::Relaxed) as i32
    }

    /// The half the next LL call will use, without flipping.
    pub(crate) fn peek_ll_parity(&self) -> i32 {
        self.ll_parity.load(Ordering::Relaxed) as i32
    }

    pub(crate) fn reset_ll_parity(&self) {
        self.ll_parity.store(0, Ordering::Relaxed);
    }

    /// The LL ops' other host state (last shape, receives pending).
    pub(crate) fn ll_host(&self) -> MutexGuard<'_, crate::ll::LlHost> {
        lock(&self.ll_host)
    }

    /// Window offset of the RDMA region (where the LL halves live).
    pub(crate) fn rdma_offset(&self) -> usize {
        control_bytes(&self.layout, self.num_device_sms) + align_up(self.args.num_nvl_bytes as usize, WINDOW_ALIGN)
    }

    pub fn num_device_sms(&self) -> i32 {
        self.num_device_sms
    }

    /// False once destroyed or once a GPU wait expired. The stall is read from its host-mapped
    /// record, not only from an error already reported: a loop of CUDA-graph replays makes no
    /// other call, and this costs one host read (no synchronisation).
    pub fn is_available(&self) -> bool {
        let resources = lock(&self.resources);
        resources.as_ref().is_some_and(|res| res.stall.read().flag == 0) && lock(&self.failure).is_none()
    }

    pub fn set_timeout_ns(&self, ns: u64) {
        self.timeout_ns.store(ns, Ordering::Relaxed);
    }

    /// Runs `f` with live resources, the buffer's context current, and any
    /// stall reported by an earlier asynchronous kernel turned into an error.
    pub(crate) fn with_resources<T>(&self, f: impl FnOnce(&Resources) -> Result<T>) -> Result<T> {
        let guard = lock(&self.resources);
        let Some(res) = guard.as_ref() else {
            return Err(Error::not_available("the buffer was destroyed; create a new one"));
        };
        self.check_stall(res)?;
        res.ctx.make_current()?;
        f(res)
    }

    /// Reports an expired GPU wait (the buffer becomes unusable) or bad input
    /// a kernel found (reported once; the buffer stays usable).
    pub(crate) fn check_stall(&self, res: &Resources) -> Result<()> {
        if let Some(err) = lock(&self.failure).clone() {
            return Err(err);
        }
        // SAFETY: the buffer's live fault record; only its kernels and this take write it.
        if let Some(fault) = unsafe { faults::take_fault(res.fault.host_ptr()) } {
            return Err(faults::fault_error(&fault));
        }
        let record = res.stall.read();
        if record.flag == 0 {
            return Ok(());
        }
        let err = faults::stall_error(&record, self.timeout_ns.load(Ordering::Relaxed));
        *lock(&self.failure) = Some(err.clone());
        Err(err)
    }

    /// Synchronises the comm stream, then reports any expired GPU wait.
    fn sync_and_check(&self, res: &Resources) -> Result<()> {
        res.stream.synchronize()?;
        self.check_stall(res)
    }

    pub(crate) fn wait_context(&self, res: &Resources) -> WaitContext {
        res.wait_context(self.args.rank, self.timeout_ns.load(Ordering::Relaxed))
    }

    pub(crate) fn timeout_ns(&self) -> u64 {
        self.timeout_ns.load(Ordering::Relaxed)
    }

    /// Collective: every rank writes a tag into every peer's window through
    /// LSA pointers, barriers, and verifies what it received.
    pub fn check_peers(&self) -> Result<()> {
        self.peer_check(0)
    }

    /// check_peers with `agree` folded into the tag: a peer whose `agree` differs fails it.
    fn peer_check(&self, agree: u32) -> Result<()> {
        self.with_resources(|res| {
            let tag = self.check_tag.fetch_add(1, Ordering::Relaxed) ^ agree;
            let mismatches = res.workspace_at(WS_PEER_MISMATCHES);
            // SAFETY: devComm/window are live; the mismatch counter is in our workspace.
            let launch = kernels::entry(res.dev_comm.build().table().launch_lsa_peer_check);
            let rc = unsafe {
                launch(
                    res.dev_comm.as_ptr(),
                    res.window.handle().cast(),
                    0,
                    tag,
                    CONTROL_BARRIER_SLOT,
                    self.wait_context(res),
                    mismatches.cast(),
                    res.stream.raw(),
                )
            };
            kernels::launch_result("lsa_peer_check", rc)?;
            self.sync_and_check(res)?;
            let bad = cuda::copy_to_host::<i32>(mismatches, 1)?[0];
            cuda::memset_zero(mismatches, 4)?;
            if bad != 0 && agree != 0 {
                // The kernel leaves each peer's word at window offset 0: name the first that differs.
                let words = cuda::copy_to_host::<u32>(res.window.ptr(), res.lsa_size as usize)?;
                let peer = (0..res.lsa_size).find(|&p| words[p as usize] != tag ^ p as u32).unwrap_or(0);
                let a = &self.args;
                return Err(Error::internal(format!(
                    "Buffer creation's peer check failed on rank {}: rank {} created its buffer with other \
                     num_nvl_bytes, num_rdma_bytes, low_latency_mode or enable_shrink than this rank's ({}, {}, {}, {}; \
                     every rank must pass the same: the internode rings are sized from num_rdma_bytes), or its write \
                     did not arrive ({bad} of {} peers differ)",
                    a.rank,
                    res.lsa_base_rank + peer,
                    a.num_nvl_bytes,
                    a.num_rdma_bytes,
                    a.low_latency_mode,
                    a.enable_shrink,
                    res.lsa_size
                )));
            }
            if bad != 0 {
                return Err(Error::internal(format!(
                    "LSA peer check failed on rank {}: {bad} of {} peers' writes did not arrive",
                    self.args.rank, res.lsa_size
                )));
            }
            Ok(())
        })
    }

    /// Collective barrier over the LSA team on the comm stream, bounded.
    pub fn barrier(&self) -> Result<()> {
        self.with_resources(|res| self.control_barrier(res))
    }

    fn control_barrier(&self, res: &Resources) -> Result<()> {
        let launch = kernels::entry(res.dev_comm.build().table().launch_lsa_barrier);
        // SAFETY: devComm is live (of this build); the control slot is within lsaBarrierCount.
        let rc = unsafe { launch(res.dev_comm.as_ptr(), CONTROL_BARRIER_SLOT, self.wait_context(res), res.stream.raw()) };
        kernels::launch_result("lsa_barrier", rc)?;
        self.sync_and_check(res)
    }

    /// (pointer, bytes) of the local NVL or RDMA region.
    pub fn local_buffer(&self, use_rdma_buffer: bool) -> Result<(*mut c_void, i64)> {
        self.with_resources(|res| {
            let nvl = self.args.num_nvl_bytes;
            let (offset, bytes) = if use_rdma_buffer {
                (self.rdma_offset(), self.args.num_rdma_bytes)
            } else {
                (res.control_bytes, nvl)
            };
            // SAFETY: the offset lies inside the window allocation (sized from the same args).
            Ok((unsafe { res.window.ptr().cast::<u8>().add(offset).cast() }, bytes))
        })
    }

    pub fn comm_stream(&self) -> Result<*mut c_void> {
        self.with_resources(|res| Ok(res.stream.raw()))
    }

    /// Collective, orderly teardown. A second call is an error, as in DeepEP.
    pub fn destroy(&self) -> Result<()> {
        let mut guard = lock(&self.resources);
        let Some(res) = guard.take() else {
            return Err(Error::not_available("destroy() was already called on this buffer"));
        };
        res.ctx.make_current()?;
        let mut times = crate::log::PhaseTimes::start("Buffer destroy");
        // Peers may still be reading our window: barrier before releasing it,
        // unless the barriers are already out of step after a timeout.
        if lock(&self.failure).is_none() {
            self.control_barrier(&res)?;
        }
        times.mark("barrier");
        let Resources { stream, workspace, stall, fault, recv_counts, dev_comm, comm, window, ctx, .. } = res;
        dev_comm.destroy(&comm)?;
        times.mark("devComm");
        window.destroy(&comm)?;
        times.mark("window");
        comm.destroy()?;
        times.mark("ncclCommFinalize");
        drop((stream, workspace, stall, fault, recv_counts, ctx));
        times.mark("stream+memory");
        times.report(self.args.rank);
        Ok(())
    }

    /// Called when the handle is released without destroy().
    pub fn release(self) {
        if lock(&self.resources).is_none() {
            return;
        }
        if self.args.explicitly_destroy {
            crate::log::log_warn!(
                self.args.rank,
                "Buffer released with explicitly_destroy=True but destroy() was never called; its GPU resources are \
                 leaked"
            );
            std::mem::forget(self);
        } else if let Err(e) = self.destroy() {
            crate::log::log_error!(self.args.rank, "Buffer teardown failed: {e}");
        }
    }
}

/// What Buffer creation decided, as DEEPEP_LOG=info prints it (pure, so a CPU test
/// can show the lines without a GPU).
#[derive(Clone, Copy, Debug)]
pub(crate) struct CreationReport {
    pub args: BufferArgs,
    pub nccl_runtime: i32,
    pub nccl_compiled: i32,
    pub nccl_builds: usize,
    pub lsa_base_rank: i32,
    pub lsa_size: i32,
    pub node_size: i32,
    pub remote_kind: i32,
    pub virtual_node_env: bool,
    pub num_sms: i32,
    pub control_bytes: usize,
    pub gpu_timeout_secs: f64,
}

impl CreationReport {
    /// How this rank reaches `peer` in low-latency mode.
    fn ll_transport(&self, peer: i32) -> &'static str {
        let node = |r: i32| r / self.node_size;
        if node(peer) == node(self.args.rank) {
            "LSA (NVLink/P2P loads and stores)"
        } else if self.remote_kind == kernels::LL_REMOTE_GIN {
            "GIN (NCCL GPU-initiated networking)"
        } else {
            "remote protocol emulated over NVLink (virtual node)"
        }
    }

    pub fn lines(&self) -> Vec<(Level, String)> {
        let a = &self.args;
        let v = nccl::format_version;
        let nvl_offset = self.control_bytes;
        let rdma_offset = nvl_offset + align_up(a.num_nvl_bytes as usize, WINDOW_ALIGN);
        let window = rdma_offset + align_up(a.num_rdma_bytes as usize, WINDOW_ALIGN);
        let mut lines = vec![
            (Level::Info, format!(
                "Buffer created: {} ranks, low_latency_mode={}, {} SMs, GPU wait timeout {} s",
                a.num_ranks, a.low_latency_mode, self.num_sms, self.gpu_timeout_secs
            )),
            (Level::Info, format!(
                "NCCL runtime {}: kernels of the NCCL {} build (of {} builds in this library; kernels/nccl_builds.txt)",
                v(self.nccl_runtime), v(self.nccl_compiled), self.nccl_builds
            )),
            (Level::Info, format!(
                "LSA team (NVLink domain): ranks {}..{} ({} ranks)",
                self.lsa_base_rank, self.lsa_base_rank + self.lsa_size - 1, self.lsa_size
            )),
            (Level::Info, format!(
                "window {window} bytes: control [0, {nvl_offset}), NVL [{nvl_offset}, +{}), RDMA [{rdma_offset}, +{}) \
                 (LL halves placed per op shape); workspace {WORKSPACE_BYTES} bytes",
                a.num_nvl_bytes, a.num_rdma_bytes
            )),
        ];
        if self.node_size < a.num_ranks {
            let how = if self.remote_kind == kernels::LL_REMOTE_GIN { "LSA teams" } else { "DEEPEP_VIRTUAL_NODE_SIZE" };
            lines.push((Level::Info, format!("nodes of {} ranks (from {how})", self.node_size)));
        } else if self.virtual_node_env {
            lines.push((Level::Info, format!("{VIRTUAL_NODE_ENV}={} = all ranks: one node", self.node_size)));
        }
        if self.lsa_size == a.num_ranks {
            lines.push((Level::Info, format!("normal-mode transport: LSA to all {} ranks", a.num_ranks)));
        }
        if a.low_latency_mode {
            // Runs of consecutive peers with one transport.
            let mut runs: Vec<(i32, i32, &str)> = Vec::new();
            for p in 0..a.num_ranks {
                let t = self.ll_transport(p);
                match runs.last_mut() {
                    Some(run) if run.2 == t => run.1 = p,
                    _ => runs.push((p, p, t)),
                }
            }
            let text: Vec<String> = runs.iter().map(|(s, e, t)| format!("ranks {s}..{e}: {t}")).collect();
            lines.push((Level::Info, format!("low-latency transport per peer: {}", text.join("; "))));
            lines.extend((0..a.num_ranks).map(|p| (Level::Debug, format!("peer {p}: {}", self.ll_transport(p)))));
        }
        lines
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The creation peer check's digest: what every rank must share changes it, nothing else does.
    #[test]
    fn shared_args_digest_covers_sizes_and_modes_only() {
        let a = BufferArgs {
            rank: 0,
            num_ranks: 4,
            num_nvl_bytes: 1 << 30,
            num_rdma_bytes: 1 << 29,
            low_latency_mode: false,
            explicitly_destroy: false,
            enable_shrink: false,
        };
        let d = shared_args_digest(&a);
        assert_ne!(d, 0);
        assert_eq!(d, shared_args_digest(&BufferArgs { rank: 3, explicitly_destroy: true, ..a }));
        for other in [
            BufferArgs { num_nvl_bytes: (1 << 30) + 1, ..a },
            BufferArgs { num_rdma_bytes: 1 << 30, ..a },
            BufferArgs { num_rdma_bytes: (1 << 29) - 4096, ..a },
            BufferArgs { low_latency_mode: true, ..a },
            BufferArgs { enable_shrink: true, ..a },
        ] {
            assert_ne!(shared_args_digest(&other), d, "{other:?}");
        }
    }

    /// The DEEPEP_LOG=info lines of a 4-rank LL buffer with DEEPEP_VIRTUAL_NODE_SIZE=2
    /// (`cargo test creation_report -- --nocapture` prints them).
    #[test]
    fn creation_report_lines() {
        let report = CreationReport {
            args: BufferArgs {
                rank: 1,
                num_ranks: 4,
                num_nvl_bytes: 1 << 30,
                num_rdma_bytes: 1 << 29,
                low_latency_mode: true,
                explicitly_destroy: false,
                enable_shrink: false,
            },
            nccl_runtime: 22909,
            nccl_compiled: 22907,
            nccl_builds: 5,
            lsa_base_rank: 0,
            lsa_size: 4,
            node_size: 2,
            remote_kind: kernels::LL_REMOTE_EMULATED,
            virtual_node_env: true,
            num_sms: 132,
            control_bytes: CONTROL_BYTES,
            gpu_timeout_secs: 100.0,
        };
        let lines: Vec<String> = report
            .lines()
            .into_iter()
            .map(|(level, line)| crate::log::format_line(level, Some(1), format_args!("{line}")))
            .collect();
        for line in &lines {
            println!("{line}");
        }
        let text = lines.join("\n");
        assert!(lines[..7].iter().all(|l| l.starts_with("[deepep-nccl rank 1] info: ")));
        assert_eq!(lines[7..].len(), 4, "one debug line per peer");
        assert!(lines[9].ends_with("debug: peer 2: remote protocol emulated over NVLink (virtual node)"));
        assert!(text.contains("NCCL runtime 2.29.9: kernels of the NCCL 2.29.7 build (of 5 builds"), "{text}");
        assert!(text.contains("ranks 0..1: LSA (NVLink/P2P loads and stores); ranks 2..3: remote protocol emulated"));
        assert!(text.contains("nodes of 2 ranks (from DEEPEP_VIRTUAL_NODE_SIZE)"));
        assert!(text.contains("NVL [1048576, +1073741824), RDMA [1074790400, +536870912)"));
        assert!(text.contains("normal-mode transport: LSA to all 4 ranks"));
    }

    /// The control region grows with the nodes only where the internode window words need it:
    /// 1 MiB up to about 700 nodes on 132 SMs (66 channels), then 8 bytes a word.
    #[test]
    fn control_region_holds_the_internode_counters() {
        let nodes = |n: i32, g: i32| RankLayout { rank: 0, num_ranks: n * g, node_size: g };
        assert_eq!(control_bytes(&RankLayout::one_node(0, 8), 132), CONTROL_BYTES);
        assert_eq!(control_bytes(&nodes(16, 8), 132), CONTROL_BYTES);
        assert_eq!(control_bytes(&nodes(64, 8), 132), CONTROL_BYTES);
        for (n, g) in [(2, 1), (64, 8), (1000, 8), (4096, 8), (4096, 1)] {
            let bytes = control_bytes(&nodes(n, g), 132);
            let words = kernels::internode_window_words(66, n, n * g) as usize;
            assert!(bytes >= INTERNODE_CONTROL_OFFSET + 8 * words && bytes % WINDOW_ALIGN == 0, "{n}x{g}: {bytes}");
        }
        assert!(control_bytes(&nodes(4096, 8), 132) > CONTROL_BYTES);
        // The counters' channel stride: every op's channels (config.num_sms / 2 <= SMs / 2).
        assert_eq!(kernels::internode_counter_channels(132), 66);
        assert_eq!(kernels::internode_counter_channels(1024), kernels::MAX_CHANNELS);
    }
}
