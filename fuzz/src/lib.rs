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

/// Every C ABI entry that takes a buffer handle, callable by number with arguments drawn from the
/// fuzz input (shared by null_buffer_entries and buffer_handles).
pub mod entries {
    use std::mem::{size_of, MaybeUninit};
    use std::os::raw::c_void;
    use std::ptr::{null, null_mut};

    use deepep_nccl::capi::*;
    use deepep_nccl::config::DeepepConfig;
    use deepep_nccl::internode::combine::DeepepInternodeCombineArgs;
    use deepep_nccl::internode::dispatch::{DeepepInternodeDispatchArgs, DeepepInternodeDispatchOutputs};
    use deepep_nccl::ll::combine::DeepepLowLatencyCombineArgs;
    use deepep_nccl::ll::dispatch::DeepepLowLatencyDispatchArgs;
    use deepep_nccl::normal::combine::DeepepIntranodeCombineArgs;
    use deepep_nccl::normal::dispatch::{DeepepIntranodeDispatchArgs, DeepepIntranodeDispatchOutputs};
    use deepep_nccl::outputs::DeepepOutputs;
    use deepep_nccl::tensor::DeepepTensor;
    use deepep_nccl::DeepepStatus;

    use super::{bool_, i32_edge, i64_edge, Unstructured};

    /// Entries [`call`] knows: `which` in 0..COUNT; 1 is deepep_buffer_free.
    pub const COUNT: u8 = 41;
    pub const FREE: u8 = 1;

    /// A plain-old-data value (ints and descriptor pointers only) with every byte from the fuzz input.
    pub fn pod<T: Copy>(u: &mut Unstructured) -> T {
        let mut v = MaybeUninit::<T>::zeroed();
        let n = size_of::<T>();
        let bytes = u.bytes(n.min(u.len())).unwrap_or(&[]);
        // SAFETY: T is repr(C) of ints and raw pointers (any bit pattern is valid); the pointers are
        // replaced with scratch/NULL by the caller before use.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), v.as_mut_ptr().cast::<u8>(), bytes.len());
            v.assume_init()
        }
    }

    /// Host memory the descriptors point at: NULL or this, never a wild pointer (the library
    /// only reads descriptors on the host; a live handle without GPU resources launches nothing).
    pub struct Scratch {
        scratch: Box<[u64; 64]>,
        /// Whether out-params and args structs may be NULL (drawn from the input) or always valid.
        nullable: bool,
    }

    impl Scratch {
        pub fn new(nullable: bool) -> Self {
            Self { scratch: Box::new([0; 64]), nullable }
        }
        fn data(&mut self, u: &mut Unstructured) -> *mut c_void {
            if bool_(u) { self.scratch.as_mut_ptr().cast() } else { null_mut() }
        }
        fn tensor(&mut self, u: &mut Unstructured) -> DeepepTensor {
            let t: DeepepTensor = pod(u);
            self.field(u, t)
        }
        /// An args struct's descriptor drawn as pod bytes: its data fixed to scratch or NULL, or
        /// (not nullable, 3 in 4) replaced by a [`Self::structured`] one.
        fn field(&mut self, u: &mut Unstructured, mut t: DeepepTensor) -> DeepepTensor {
            if !self.nullable && u.ratio(3u8, 4).unwrap_or(false) {
                return self.structured(u);
            }
            t.data = self.data(u);
            t
        }
        /// A descriptor the ops' checks get far with: a known dtype, 1 to 4 dims (edge-biased, so
        /// that their products overflow), row-major strides multiplied out wrapping (so that a
        /// huge shape still looks contiguous), sometimes one stride changed; data at the scratch
        /// area, or NULL, a few bytes off alignment, or near the end of the address space.
        fn structured(&mut self, u: &mut Unstructured) -> DeepepTensor {
            const SIZES: [i64; 10] = [1, 2, 8, 16, 17, 128, 288, 1024, 7168, 1 << 31];
            // SAFETY: a descriptor is ints and a pointer: all-zero is valid (absent).
            let mut t: DeepepTensor = unsafe { std::mem::zeroed() };
            t.dtype = u.int_in_range(1i32..=8).unwrap_or(1);
            t.ndim = u.int_in_range(1i32..=4).unwrap_or(1);
            let n = t.ndim as usize;
            for d in 0..n {
                t.shape[d] = match u.int_in_range(0u8..=3).unwrap_or(0) {
                    0 => u.int_in_range(0i64..=8).unwrap_or(0),
                    1 | 2 => SIZES[u.choose_index(SIZES.len()).unwrap_or(0)],
                    _ => i64_edge(u),
                };
            }
            let mut step = 1i64;
            for d in (0..n).rev() {
                t.strides[d] = step;
                step = step.wrapping_mul(t.shape[d].max(1));
            }
            if u.ratio(1u8, 8).unwrap_or(false) {
                t.strides[u.choose_index(n).unwrap_or(0)] = i64_edge(u);
            }
            let base = self.scratch.as_mut_ptr() as usize;
            t.data = match u.int_in_range(0u8..=9).unwrap_or(0) {
                0 => null_mut(),
                1 => (base + u.int_in_range(1usize..=15).unwrap_or(1)) as *mut c_void,
                2 => (usize::MAX - u.int_in_range(0usize..=4096).unwrap_or(0) * 16 - 15) as *mut c_void,
                _ => base as *mut c_void,
            };
            t
        }
        /// An i32 args field: kept from the pod bytes, or (not nullable, 1 in 2) one of `likely`
        /// or an edge value.
        fn int(&self, u: &mut Unstructured, raw: i32, likely: &[i32]) -> i32 {
            if self.nullable || !u.ratio(1u8, 2).unwrap_or(false) {
                return raw;
            }
            if u.ratio(3u8, 4).unwrap_or(false) { likely[u.choose_index(likely.len()).unwrap_or(0)] } else { i32_edge(u) }
        }
        /// A valid local or (when nullable, 1 in 8) NULL for an out-param.
        fn out<T>(&self, u: &mut Unstructured, v: &mut T) -> *mut T {
            if self.nullable && u.ratio(1u8, 8).unwrap_or(false) { null_mut() } else { v }
        }
        /// An args struct's address or (when nullable, 1 in 8) NULL.
        fn args<T>(&self, u: &mut Unstructured, a: &T) -> *const T {
            if self.nullable && u.ratio(1u8, 8).unwrap_or(false) { null() } else { a }
        }
    }

    macro_rules! fix {
        ($ctx:ident, $u:ident, $a:ident: $($f:ident),*) => { $( $a.$f = $ctx.field($u, $a.$f); )* };
    }

    /// Likely values of the args structs' int fields (buffer_handles only).
    const TOKENS: [i32; 6] = [1, 8, 17, 128, 1024, 0];
    const EXPERTS: [i32; 6] = [8, 16, 64, 256, 288, 1024];
    const FLAGS: [i32; 2] = [0, 1];
    const PHASES: [i32; 3] = [1, 2, 3];

    /// A normal-mode config: the pod bytes', or (not nullable, 1 in 2) a valid one (DeepEP's
    /// checks) with an edge-biased ring size and SM count.
    fn config(ctx: &Scratch, u: &mut Unstructured, raw: DeepepConfig) -> DeepepConfig {
        if ctx.nullable || !u.ratio(1u8, 2).unwrap_or(false) {
            return raw;
        }
        let sms = ctx.int(u, 24, &[2, 20, 24, 64, 132, 256]);
        let ring = ctx.int(u, 256, &[8, 256, 4096, i32::MAX]);
        DeepepConfig::new(sms, 6, ring.max(7), 6, 128).unwrap_or(raw)
    }

    /// Calls entry `which` (< COUNT) with handle `bm` and arguments from `u`; its name and status.
    pub fn call(u: &mut Unstructured, ctx: &mut Scratch, which: u8, bm: *mut DeepepBuffer) -> (&'static str, DeepepStatus) {
        let b = bm as *const DeepepBuffer;
        let s = null_mut::<c_void>();
        let (mut i, mut flag, mut p, mut n) = (0i32, false, null_mut::<c_void>(), 0i64);
        let mut outs = DeepepOutputs::default();
        match which {
            0 => ("destroy", deepep_buffer_destroy(bm)),
            1 => ("free", deepep_buffer_free(bm)),
            2 => ("get_rank", deepep_buffer_get_rank(b, ctx.out(u, &mut i))),
            3 => ("get_num_ranks", deepep_buffer_get_num_ranks(b, ctx.out(u, &mut i))),
            4 => ("get_num_rdma_ranks", deepep_buffer_get_num_rdma_ranks(b, ctx.out(u, &mut i))),
            5 => ("get_rdma_rank", deepep_buffer_get_rdma_rank(b, ctx.out(u, &mut i))),
            6 => ("get_local_device_id", deepep_buffer_get_local_device_id(b, ctx.out(u, &mut i))),
            7 => ("get_num_device_sms", deepep_buffer_get_num_device_sms(b, ctx.out(u, &mut i))),
            8 => ("get_root_rdma_rank", deepep_buffer_get_root_rdma_rank(b, bool_(u), ctx.out(u, &mut i))),
            9 => ("is_available", deepep_buffer_is_available(b, ctx.out(u, &mut flag))),
            10 => {
                let rdma = bool_(u);
                let pp = ctx.out(u, &mut p);
                ("get_local_buffer", deepep_buffer_get_local_buffer(b, rdma, pp, ctx.out(u, &mut n)))
            }
            11 => ("get_comm_stream", deepep_buffer_get_comm_stream(b, ctx.out(u, &mut p))),
            12 => ("barrier", deepep_buffer_barrier(b)),
            13 => ("check_peers", deepep_buffer_check_peers(b)),
            14 => ("set_gpu_timeout_ms", deepep_buffer_set_gpu_timeout_ms(b, u.arbitrary().unwrap_or(0))),
            15 => {
                let ts = [ctx.tensor(u), ctx.tensor(u), ctx.tensor(u), ctx.tensor(u), ctx.tensor(u)];
                let e = i32_edge(u);
                ("get_dispatch_layout", deepep_get_dispatch_layout(b, &ts[0], e, &ts[1], &ts[2], &ts[3], &ts[4], s))
            }
            16 => {
                let (t, e) = (i64_edge(u), i32_edge(u));
                ("get_dispatch_layout_outputs", deepep_get_dispatch_layout_outputs(b, t, e, ctx.out(u, &mut outs)))
            }
            17 => {
                let (m, h, e, f8, ue) = (i64_edge(u), i64_edge(u), i32_edge(u), bool_(u), bool_(u));
                ("ll_dispatch_outputs", deepep_low_latency_dispatch_outputs(b, m, h, e, f8, ue, ctx.out(u, &mut outs)))
            }
            18 => {
                let (t, h) = (i64_edge(u), i64_edge(u));
                ("ll_combine_outputs", deepep_low_latency_combine_outputs(b, t, h, ctx.out(u, &mut outs)))
            }
            19 => {
                let mut a: DeepepLowLatencyDispatchArgs = pod(u);
                fix!(ctx, u, a: x, topk_idx, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, packed_recv_x,
                     packed_recv_x_scales, packed_recv_count, packed_recv_src_info, packed_recv_layout_range);
                a.num_max_dispatch_tokens_per_rank = ctx.int(u, a.num_max_dispatch_tokens_per_rank, &TOKENS);
                a.num_experts = ctx.int(u, a.num_experts, &EXPERTS);
                a.use_fp8 = ctx.int(u, a.use_fp8, &FLAGS);
                a.round_scale = ctx.int(u, a.round_scale, &FLAGS);
                a.use_ue8m0 = ctx.int(u, a.use_ue8m0, &FLAGS);
                a.phases = ctx.int(u, a.phases, &PHASES);
                let ap = ctx.args(u, &a);
                ("ll_dispatch", deepep_low_latency_dispatch(b, ap, s, ctx.out(u, &mut i)))
            }
            20 => {
                let mut a: DeepepLowLatencyCombineArgs = pod(u);
                fix!(ctx, u, a: x, topk_idx, topk_weights, src_info, layout_range, combine_wait_recv_cost_stats, out);
                a.num_max_dispatch_tokens_per_rank = ctx.int(u, a.num_max_dispatch_tokens_per_rank, &TOKENS);
                a.num_experts = ctx.int(u, a.num_experts, &EXPERTS);
                a.use_logfmt = ctx.int(u, a.use_logfmt, &FLAGS);
                a.zero_copy = ctx.int(u, a.zero_copy, &FLAGS);
                a.phases = ctx.int(u, a.phases, &PHASES);
                let ap = ctx.args(u, &a);
                ("ll_combine", deepep_low_latency_combine(b, ap, s, ctx.out(u, &mut i)))
            }
            21 => {
                let (m, h, e) = (i32_edge(u), i32_edge(u), i32_edge(u));
                ("clean_ll_buffer", deepep_clean_low_latency_buffer(b, m, h, e, s))
            }
            22 => {
                let mut t = ctx.tensor(u);
                let (m, h, e) = (i32_edge(u), i32_edge(u), i32_edge(u));
                ("next_ll_combine_buffer", deepep_get_next_low_latency_combine_buffer(b, m, h, e, ctx.out(u, &mut t)))
            }
            23 => {
                let (r, mask) = (i32_edge(u), bool_(u));
                ("ll_update_mask", deepep_low_latency_update_mask_buffer(b, r, mask, s))
            }
            24 => {
                let t = ctx.tensor(u);
                let null_mask = bool_(u) && ctx.nullable;
                let tp = if null_mask { null() } else { &t as *const _ };
                ("ll_query_mask", deepep_low_latency_query_mask_buffer(b, tp, s))
            }
            25 => ("ll_clean_mask", deepep_low_latency_clean_mask_buffer(b, s)),
            26..=29 | 40 => {
                let mut a: DeepepIntranodeDispatchArgs = pod(u);
                fix!(ctx, u, a: x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                     rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, send_head);
                a.config = config(ctx, u, a.config);
                a.cached = ctx.int(u, a.cached, &FLAGS);
                a.expert_alignment = ctx.int(u, a.expert_alignment, &[1, 128]);
                a.num_worst_tokens = ctx.int(u, a.num_worst_tokens, &TOKENS);
                let ap = ctx.args(u, &a);
                match which {
                    26 => {
                        let mut per_expert = [0i32; 16];
                        let cap = u.int_in_range(-2i32..=16).unwrap_or(0);
                        let pe = if bool_(u) { null_mut() } else { per_expert.as_mut_ptr() };
                        // cap > 16 would let the library write past the local array: never passed.
                        ("dispatch_prepare", deepep_intranode_dispatch_prepare(b, ap, ctx.out(u, &mut i), pe, cap.min(16), s))
                    }
                    27 | 40 => {
                        let mut o: DeepepIntranodeDispatchOutputs = pod(u);
                        fix!(ctx, u, o: recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, recv_src_idx);
                        let op = ctx.args(u, &o);
                        if which == 27 {
                            ("intranode_dispatch", deepep_intranode_dispatch(b, ap, op, s))
                        } else {
                            ("intranode_dispatch_fused", deepep_intranode_dispatch_fused(b, ap, op, s))
                        }
                    }
                    28 => ("dispatch_handle_outputs", deepep_intranode_dispatch_handle_outputs(b, ap, ctx.out(u, &mut outs))),
                    _ => {
                        let n = i32_edge(u);
                        ("dispatch_outputs", deepep_intranode_dispatch_outputs(b, ap, n, ctx.out(u, &mut outs)))
                    }
                }
            }
            32 => {
                let t = ctx.tensor(u);
                let tp = if bool_(u) && ctx.nullable { null() } else { &t as *const _ };
                ("normal_query_dropped", deepep_normal_query_dropped(b, tp, s))
            }
            33..=36 => {
                let mut a: DeepepInternodeDispatchArgs = pod(u);
                fix!(ctx, u, a: x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, num_tokens_per_rdma_rank,
                     is_token_in_rank, num_tokens_per_expert, rdma_channel_prefix_matrix, gbl_channel_prefix_matrix,
                     recv_rdma_channel_prefix_matrix, recv_rdma_rank_prefix_sum, recv_gbl_channel_prefix_matrix,
                     recv_gbl_rank_prefix_sum, send_rdma_head);
                a.config = config(ctx, u, a.config);
                a.cached = ctx.int(u, a.cached, &FLAGS);
                a.expert_alignment = ctx.int(u, a.expert_alignment, &[1, 128]);
                a.num_worst_tokens = ctx.int(u, a.num_worst_tokens, &TOKENS);
                let ap = ctx.args(u, &a);
                match which {
                    33 => {
                        let (mut per_expert, mut rdma_recv) = ([0i32; 16], 0i32);
                        let cap = u.int_in_range(-2i32..=16).unwrap_or(0);
                        let pe = if bool_(u) { null_mut() } else { per_expert.as_mut_ptr() };
                        let (recv, rdma) = (ctx.out(u, &mut i), ctx.out(u, &mut rdma_recv));
                        // cap > 16 would let the library write past the local array: never passed.
                        ("internode_dispatch_prepare", deepep_internode_dispatch_prepare(b, ap, recv, rdma, pe, cap.min(16), s))
                    }
                    34 => {
                        let mut o: DeepepInternodeDispatchOutputs = pod(u);
                        fix!(ctx, u, o: recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, recv_src_meta, send_nvl_head);
                        let op = ctx.args(u, &o);
                        ("internode_dispatch", deepep_internode_dispatch(b, ap, op, s))
                    }
                    35 => (
                        "internode_dispatch_handle_outputs",
                        deepep_internode_dispatch_handle_outputs(b, ap, ctx.out(u, &mut outs)),
                    ),
                    _ => {
                        let (recv, rdma) = (i32_edge(u), i32_edge(u));
                        ("internode_dispatch_outputs", deepep_internode_dispatch_outputs(b, ap, recv, rdma, ctx.out(u, &mut outs)))
                    }
                }
            }
            37 | 38 => {
                let mut a: DeepepInternodeCombineArgs = pod(u);
                fix!(ctx, u, a: x, topk_weights, bias_0, bias_1, src_meta, is_combined_token_in_rank, rdma_channel_prefix_matrix,
                     rdma_rank_prefix_sum, gbl_channel_prefix_matrix, combined_rdma_head, combined_nvl_head, combined_x,
                     combined_topk_weights);
                a.config = config(ctx, u, a.config);
                let ap = ctx.args(u, &a);
                if which == 37 {
                    ("internode_combine", deepep_internode_combine(b, ap, s))
                } else {
                    ("internode_combine_outputs", deepep_internode_combine_outputs(b, ap, ctx.out(u, &mut outs)))
                }
            }
            39 => {
                let t = ctx.tensor(u);
                let tp = if bool_(u) && ctx.nullable { null() } else { &t as *const _ };
                ("internode_query_traffic", deepep_internode_query_traffic(b, tp, s))
            }
            _ => {
                let mut a: DeepepIntranodeCombineArgs = pod(u);
                fix!(ctx, u, a: x, topk_weights, bias_0, bias_1, src_idx, rank_prefix_matrix, channel_prefix_matrix, send_head,
                     combined_x, combined_topk_weights);
                a.config = config(ctx, u, a.config);
                let ap = ctx.args(u, &a);
                if which == 30 {
                    ("intranode_combine", deepep_intranode_combine(b, ap, s))
                } else {
                    ("combine_outputs", deepep_intranode_combine_outputs(b, ap, ctx.out(u, &mut outs)))
                }
            }
        }
    }
}
