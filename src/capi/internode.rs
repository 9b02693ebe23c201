//! C ABI: internode normal-mode dispatch and combine (a buffer across nodes: the LSA team smaller
//! than the ranks, or DEEPEP_VIRTUAL_NODE_SIZE). The same call sequence as intranode
//! (src/capi/normal.rs): dispatch is handle_outputs, prepare, outputs, dispatch on one stream;
//! combine is one call.
use std::os::raw::{c_int, c_void};

use super::buffer::buffer_ref;
use super::normal::{args_query, args_ref};
use super::{ffi, out_ref};
use crate::internode::combine::{self, DeepepInternodeCombineArgs};
use crate::internode::dispatch::{self, DeepepInternodeDispatchArgs, DeepepInternodeDispatchOutputs};
use crate::outputs::DeepepOutputs;

/// Writes to `*out` the dispatch handle's int32 matrices the caller allocates before
/// deepep_internode_dispatch_prepare (they go into args). Reads args->x ([T, H]),
/// args->config.num_sms (C = num_sms / 2) and args->cached. out->tensors, in order, views of one
/// int32 allocation: rdma_channel_prefix_matrix [N, C] and gbl_channel_prefix_matrix [R, C]
/// (absent when cached: pass the handle's), recv_rdma_channel_prefix_matrix [N, C],
/// recv_rdma_rank_prefix_sum [N], recv_gbl_channel_prefix_matrix [R, C], recv_gbl_rank_prefix_sum
/// [R], send_rdma_head [T, N] (absent when cached). N = deepep_buffer_get_num_rdma_ranks.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer, a bad value or a buffer
/// within one node, named in the message); DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_internode_dispatch_handle_outputs(
    buf: *const super::DeepepBuffer,
    args: *const DeepepInternodeDispatchArgs,
    out: *mut DeepepOutputs,
) -> crate::error::DeepepStatus {
    args_query(buf, args, out, dispatch::handle_outputs_for)
}

/// Step 1 of DeepEP's internode_dispatch: the notify kernel. Writes the receive count to
/// `*num_recv_tokens`, the rows of this GPU's scale-out receive space to `*num_rdma_recv_tokens`
/// and E/R aligned per-expert counts to `num_recv_tokens_per_expert` (capacity
/// `per_expert_capacity`) when it waited for them; -1 (and no list) in cached or
/// num_worst_tokens mode.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer, a bad tensor or value, or bad
/// input a kernel found in an earlier op); DEEPEP_ERROR_NOT_AVAILABLE (destroyed, or unusable after a
/// timeout); DEEPEP_ERROR_TIMEOUT (a GPU wait expired, here or in an earlier op); DEEPEP_ERROR_CUDA;
/// DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_internode_dispatch_prepare(
    buf: *const super::DeepepBuffer,
    args: *const DeepepInternodeDispatchArgs,
    num_recv_tokens: *mut c_int,
    num_rdma_recv_tokens: *mut c_int,
    num_recv_tokens_per_expert: *mut c_int,
    per_expert_capacity: c_int,
    stream: *mut c_void,
) -> crate::error::DeepepStatus {
    ffi(|| {
        let out = out_ref("num_recv_tokens", num_recv_tokens)?;
        *out = -1;
        let out_rdma = out_ref("num_rdma_recv_tokens", num_rdma_recv_tokens)?;
        *out_rdma = -1;
        // SAFETY: the caller provides per_expert_capacity writable ints (or NULL).
        let list = unsafe { super::per_expert_list(num_recv_tokens_per_expert, per_expert_capacity) };
        let prepared = dispatch::prepare(buffer_ref(buf)?.buffer(), args_ref("args", args)?, stream, list)?;
        *out = prepared.num_recv_tokens;
        *out_rdma = prepared.num_rdma_recv_tokens;
        Ok(())
    })
}

/// Writes to `*out` the outputs of deepep_internode_dispatch, after prepare with the same
/// (complete) args. out->tensors are laid out as DeepepInternodeDispatchOutputs: recv_x [Nr, H],
/// recv_x_scales [Nr, S], recv_topk_idx [Nr, K], recv_topk_weights [Nr, K] float32 (as
/// intranode), recv_src_meta [Nr, 8] uint8 and send_nvl_head [Nrdma, G] int32 (both absent when
/// cached). Nr, Nrdma: the handle's counts when cached (num_rdma_recv_tokens unused), else
/// args->num_worst_tokens when > 0, else prepare's counts.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer or a bad value, named in the
/// message); DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_internode_dispatch_outputs(
    buf: *const super::DeepepBuffer,
    args: *const DeepepInternodeDispatchArgs,
    num_recv_tokens: c_int,
    num_rdma_recv_tokens: c_int,
    out: *mut DeepepOutputs,
) -> crate::error::DeepepStatus {
    args_query(buf, args, out, |buffer, args| dispatch::recv_outputs_for(buffer, args, num_recv_tokens, num_rdma_recv_tokens))
}

/// Step 2 of DeepEP's internode_dispatch: the data kernel into the caller's outputs.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT; DEEPEP_ERROR_NOT_AVAILABLE; DEEPEP_ERROR_TIMEOUT
/// (a GPU wait expired, here or in an earlier op); DEEPEP_ERROR_CUDA; DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_internode_dispatch(
    buf: *const super::DeepepBuffer,
    args: *const DeepepInternodeDispatchArgs,
    outputs: *const DeepepInternodeDispatchOutputs,
    stream: *mut c_void,
) -> crate::error::DeepepStatus {
    ffi(|| dispatch::launch(buffer_ref(buf)?.buffer(), args_ref("args", args)?, args_ref("outputs", outputs)?, stream))
}

/// Writes to `*out` the outputs of deepep_internode_combine for these args (validated as the op
/// does; the output descriptors are ignored): combined_x [T, H] bfloat16 with T =
/// is_combined_token_in_rank's rows, combined_topk_weights [T, K] float32, absent without
/// topk_weights.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer or a bad value, named in the
/// message); DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_internode_combine_outputs(
    buf: *const super::DeepepBuffer,
    args: *const DeepepInternodeCombineArgs,
    out: *mut DeepepOutputs,
) -> crate::error::DeepepStatus {
    args_query(buf, args, out, combine::combine_outputs_for)
}

/// DeepEP's internode_combine: sums each token's rows inside each node, then over nodes (fp32,
/// DeepEP's order, biases first) into combined_x on its source rank. Rewrites the two heads in
/// place as DeepEP does.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT; DEEPEP_ERROR_NOT_AVAILABLE; DEEPEP_ERROR_TIMEOUT
/// (a GPU wait expired, here or in an earlier op); DEEPEP_ERROR_CUDA; DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_internode_combine(
    buf: *const super::DeepepBuffer,
    args: *const DeepepInternodeCombineArgs,
    stream: *mut c_void,
) -> crate::error::DeepepStatus {
    ffi(|| combine::combine(buffer_ref(buf)?.buffer(), args_ref("args", args)?, stream))
}

/// Copies the internode kernels' cumulative traffic counters into `traffic`, an int64 [8] device
/// tensor, in stream order (no host sync): rows and bytes this rank sent, enum DeepepTrafficKind:
/// [0] dispatch scale-out rows, [1] their bytes, [2] dispatch NVLink rows, [3] their bytes, [4]
/// combine scale-out rows, [5] their bytes, [6] combine NVLink rows, [7] their bytes. Scale-out
/// rows go to another node (own-node rows are not counted); bytes = rows x the row size (NVLink:
/// plus its 16-byte slot header). A call's traffic is the difference of two queries
/// (docs/internode.md, "Statistics").
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer, a bad tensor, or a
/// buffer within one node); DEEPEP_ERROR_NOT_AVAILABLE (destroyed, or unusable after a timeout);
/// DEEPEP_ERROR_TIMEOUT (a GPU wait expired in an earlier op); DEEPEP_ERROR_CUDA; DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_internode_query_traffic(
    buf: *const super::DeepepBuffer,
    traffic: *const crate::tensor::DeepepTensor,
    stream: *mut c_void,
) -> crate::error::DeepepStatus {
    ffi(|| {
        let t = args_ref("traffic", traffic)?;
        crate::internode::query_traffic(buffer_ref(buf)?.buffer(), t, stream)
    })
}
