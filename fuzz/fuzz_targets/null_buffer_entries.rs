//! Every C ABI entry that takes a buffer handle, called with a NULL handle and arbitrary other
//! arguments (descriptors over a small host scratch area or NULL, args structs filled from the
//! fuzz bytes, edge-biased ints): must return INVALID_ARGUMENT (free(NULL) is a documented
//! no-op: SUCCESS). Out-params are valid locals or NULL, never wild; streams are NULL (a wild
//! stream would be handed to CUDA only after the handle check, which this target proves first).
#![no_main]
use std::mem::{size_of, MaybeUninit};
use std::os::raw::c_void;
use std::ptr::{null, null_mut};

use deepep_nccl::capi::*;
use deepep_nccl::ll::combine::DeepepLowLatencyCombineArgs;
use deepep_nccl::ll::dispatch::DeepepLowLatencyDispatchArgs;
use deepep_nccl::normal::combine::DeepepIntranodeCombineArgs;
use deepep_nccl::normal::dispatch::{DeepepIntranodeDispatchArgs, DeepepIntranodeDispatchOutputs};
use deepep_nccl::outputs::DeepepOutputs;
use deepep_nccl::tensor::DeepepTensor;
use deepep_nccl::DeepepStatus;
use fuzz_common::*;
use libfuzzer_sys::fuzz_target;

/// A plain-old-data value (ints and descriptor pointers only) with every byte from the fuzz input.
fn pod<T: Copy>(u: &mut Unstructured) -> T {
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

struct Ctx {
    scratch: Box<[u64; 64]>,
}

impl Ctx {
    /// NULL or the host scratch area, never a wild pointer.
    fn data(&mut self, u: &mut Unstructured) -> *mut c_void {
        if bool_(u) { self.scratch.as_mut_ptr().cast() } else { null_mut() }
    }
    fn tensor(&mut self, u: &mut Unstructured) -> DeepepTensor {
        let mut t: DeepepTensor = pod(u);
        t.data = self.data(u);
        t
    }
}

macro_rules! fix {
    ($ctx:ident, $u:ident, $a:ident: $($f:ident),*) => { $( $a.$f.data = $ctx.data(&mut $u); )* };
}

fn invalid(what: &str, s: DeepepStatus) {
    no_internal(what, s);
    assert_eq!(s, DeepepStatus::DEEPEP_ERROR_INVALID_ARGUMENT, "{what}(NULL buffer): {}", last_error());
}

/// A valid local or NULL for an out-param.
fn out<T>(u: &mut Unstructured, v: &mut T) -> *mut T {
    if u.ratio(1u8, 8).unwrap_or(false) { null_mut() } else { v }
}

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let mut ctx = Ctx { scratch: Box::new([0; 64]) };
    let (b, bm) = (null::<DeepepBuffer>(), null_mut::<DeepepBuffer>());
    let s = null_mut::<c_void>();
    let (mut i, mut flag, mut p, mut n) = (0i32, false, null_mut::<c_void>(), 0i64);
    let mut outs = DeepepOutputs::default();
    while !u.is_empty() {
        let which = u.int_in_range(0u8..=31).unwrap_or(0);
        match which {
            0 => invalid("destroy", deepep_buffer_destroy(bm)),
            1 => assert_eq!(deepep_buffer_free(bm), DeepepStatus::DEEPEP_SUCCESS, "free(NULL) is a no-op"),
            2 => invalid("get_rank", deepep_buffer_get_rank(b, out(&mut u, &mut i))),
            3 => invalid("get_num_ranks", deepep_buffer_get_num_ranks(b, out(&mut u, &mut i))),
            4 => invalid("get_num_rdma_ranks", deepep_buffer_get_num_rdma_ranks(b, out(&mut u, &mut i))),
            5 => invalid("get_rdma_rank", deepep_buffer_get_rdma_rank(b, out(&mut u, &mut i))),
            6 => invalid("get_local_device_id", deepep_buffer_get_local_device_id(b, out(&mut u, &mut i))),
            7 => invalid("get_num_device_sms", deepep_buffer_get_num_device_sms(b, out(&mut u, &mut i))),
            8 => invalid("get_root_rdma_rank", deepep_buffer_get_root_rdma_rank(b, bool_(&mut u), out(&mut u, &mut i))),
            9 => invalid("is_available", deepep_buffer_is_available(b, out(&mut u, &mut flag))),
            10 => invalid("get_local_buffer", deepep_buffer_get_local_buffer(b, bool_(&mut u), out(&mut u, &mut p), out(&mut u, &mut n))),
            11 => invalid("get_comm_stream", deepep_buffer_get_comm_stream(b, out(&mut u, &mut p))),
            12 => invalid("barrier", deepep_buffer_barrier(b)),
            13 => invalid("check_peers", deepep_buffer_check_peers(b)),
            14 => invalid("set_gpu_timeout_ms", deepep_buffer_set_gpu_timeout_ms(b, u.arbitrary().unwrap_or(0))),
            15 => {
                let ts = [ctx.tensor(&mut u), ctx.tensor(&mut u), ctx.tensor(&mut u), ctx.tensor(&mut u), ctx.tensor(&mut u)];
                let e = i32_edge(&mut u);
                invalid("get_dispatch_layout", deepep_get_dispatch_layout(b, &ts[0], e, &ts[1], &ts[2], &ts[3], &ts[4], s));
            }
            16 => invalid("get_dispatch_layout_outputs", deepep_get_dispatch_layout_outputs(b, i64_edge(&mut u), i32_edge(&mut u), out(&mut u, &mut outs))),
            17 => {
                let (m, h, e, f8, ue) = (i64_edge(&mut u), i64_edge(&mut u), i32_edge(&mut u), bool_(&mut u), bool_(&mut u));
                invalid("ll_dispatch_outputs", deepep_low_latency_dispatch_outputs(b, m, h, e, f8, ue, out(&mut u, &mut outs)));
            }
            18 => invalid("ll_combine_outputs", deepep_low_latency_combine_outputs(b, i64_edge(&mut u), i64_edge(&mut u), out(&mut u, &mut outs))),
            19 => {
                let mut a: DeepepLowLatencyDispatchArgs = pod(&mut u);
                fix!(ctx, u, a: x, topk_idx, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, packed_recv_x,
                     packed_recv_x_scales, packed_recv_count, packed_recv_src_info, packed_recv_layout_range);
                let ap = if u.ratio(1u8, 8).unwrap_or(false) { null() } else { &a as *const _ };
                invalid("ll_dispatch", deepep_low_latency_dispatch(b, ap, s, out(&mut u, &mut i)));
            }
            20 => {
                let mut a: DeepepLowLatencyCombineArgs = pod(&mut u);
                fix!(ctx, u, a: x, topk_idx, topk_weights, src_info, layout_range, combine_wait_recv_cost_stats, out);
                let ap = if u.ratio(1u8, 8).unwrap_or(false) { null() } else { &a as *const _ };
                invalid("ll_combine", deepep_low_latency_combine(b, ap, s, out(&mut u, &mut i)));
            }
            21 => invalid("clean_ll_buffer", deepep_clean_low_latency_buffer(b, i32_edge(&mut u), i32_edge(&mut u), i32_edge(&mut u), s)),
            22 => {
                let mut t = ctx.tensor(&mut u);
                let (m, h, e) = (i32_edge(&mut u), i32_edge(&mut u), i32_edge(&mut u));
                invalid("next_ll_combine_buffer", deepep_get_next_low_latency_combine_buffer(b, m, h, e, out(&mut u, &mut t)));
            }
            23 => invalid("ll_update_mask", deepep_low_latency_update_mask_buffer(b, i32_edge(&mut u), bool_(&mut u), s)),
            24 => {
                let t = ctx.tensor(&mut u);
                let tp = if bool_(&mut u) { null() } else { &t as *const _ };
                invalid("ll_query_mask", deepep_low_latency_query_mask_buffer(b, tp, s));
            }
            25 => invalid("ll_clean_mask", deepep_low_latency_clean_mask_buffer(b, s)),
            26..=29 => {
                let mut a: DeepepIntranodeDispatchArgs = pod(&mut u);
                fix!(ctx, u, a: x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                     rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, send_head);
                let ap = if u.ratio(1u8, 8).unwrap_or(false) { null() } else { &a as *const _ };
                match which {
                    26 => {
                        let mut per_expert = [0i32; 16];
                        let cap = u.int_in_range(-2i32..=16).unwrap_or(0);
                        let pe = if bool_(&mut u) { null_mut() } else { per_expert.as_mut_ptr() };
                        // cap > 16 would let the library write past the local array: never passed.
                        invalid("dispatch_prepare", deepep_intranode_dispatch_prepare(b, ap, out(&mut u, &mut i), pe, cap.min(16), s));
                    }
                    27 => {
                        let mut o: DeepepIntranodeDispatchOutputs = pod(&mut u);
                        fix!(ctx, u, o: recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, recv_src_idx);
                        let op = if u.ratio(1u8, 8).unwrap_or(false) { null() } else { &o as *const _ };
                        invalid("intranode_dispatch", deepep_intranode_dispatch(b, ap, op, s));
                    }
                    28 => invalid("dispatch_handle_outputs", deepep_intranode_dispatch_handle_outputs(b, ap, out(&mut u, &mut outs))),
                    _ => invalid("dispatch_outputs", deepep_intranode_dispatch_outputs(b, ap, i32_edge(&mut u), out(&mut u, &mut outs))),
                }
            }
            _ => {
                let mut a: DeepepIntranodeCombineArgs = pod(&mut u);
                fix!(ctx, u, a: x, topk_weights, bias_0, bias_1, src_idx, rank_prefix_matrix, channel_prefix_matrix, send_head,
                     combined_x, combined_topk_weights);
                let ap = if u.ratio(1u8, 8).unwrap_or(false) { null() } else { &a as *const _ };
                if which == 30 {
                    invalid("intranode_combine", deepep_intranode_combine(b, ap, s));
                } else {
                    invalid("combine_outputs", deepep_intranode_combine_outputs(b, ap, out(&mut u, &mut outs)));
                }
            }
        }
    }
});
