//! C ABI: the buffer handle, its queries, and the layout op.
use std::os::raw::{c_int, c_void};

use super::{ffi, out_ref};
use crate::buffer::{Buffer, BufferArgs};
use crate::error::{DeepepStatus, Error, Result};
use crate::layout::{self, LayoutArgs};
use crate::outputs::DeepepOutputs;
use crate::tensor::DeepepTensor;

/// Opaque handle to one rank's buffer.
pub struct DeepepBuffer {
    inner: Buffer,
}

pub(super) fn buffer_ref<'a>(buf: *const DeepepBuffer) -> Result<&'a Buffer> {
    // SAFETY: callers pass a handle from deepep_buffer_create (not yet freed) or NULL.
    unsafe { buf.as_ref() }.map(|b| &b.inner).ok_or_else(|| Error::invalid("buffer must not be NULL"))
}

/// Collective: all `num_ranks` ranks call this with the same unique id (from
/// rank 0's deepep_get_unique_id). Uses the calling thread's current CUDA device.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (NULL pointer, bad sizes or ranks, a bad DEEPEP_*
/// environment variable); DEEPEP_ERROR_NO_DEVICE; DEEPEP_ERROR_CUDA; DEEPEP_ERROR_NCCL;
/// DEEPEP_ERROR_VERSION_MISMATCH (runtime NCCL minor differs from the build's); DEEPEP_ERROR_UNSUPPORTED
/// (ranks beyond NVLink without low_latency_mode or without GIN); DEEPEP_ERROR_TIMEOUT (a peer never
/// reached the creation check); DEEPEP_ERROR_INTERNAL (also: a peer check mismatch).
#[no_mangle]
pub extern "C" fn deepep_buffer_create(
    rank: c_int,
    num_ranks: c_int,
    unique_id: *const u8,
    unique_id_len: usize,
    num_nvl_bytes: i64,
    num_rdma_bytes: i64,
    low_latency_mode: bool,
    explicitly_destroy: bool,
    enable_shrink: bool,
    out: *mut *mut DeepepBuffer,
) -> DeepepStatus {
    ffi(|| {
        let out = out_ref("out", out)?;
        *out = std::ptr::null_mut();
        if unique_id.is_null() {
            return Err(Error::invalid("unique_id must not be NULL"));
        }
        // SAFETY: unique_id points to unique_id_len readable bytes (caller contract).
        let id = unsafe { std::slice::from_raw_parts(unique_id, unique_id_len) };
        let args = BufferArgs { rank, num_ranks, num_nvl_bytes, num_rdma_bytes, low_latency_mode, explicitly_destroy, enable_shrink };
        let inner = Buffer::create(args, id)?;
        *out = Box::into_raw(Box::new(DeepepBuffer { inner }));
        Ok(())
    })
}

/// Collective teardown (DeepEP's destroy()). The handle stays valid for
/// queries and must still be released with deepep_buffer_free.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (NULL buffer); DEEPEP_ERROR_NOT_AVAILABLE
/// (already destroyed); DEEPEP_ERROR_TIMEOUT (a peer never reached the teardown barrier);
/// DEEPEP_ERROR_CUDA; DEEPEP_ERROR_NCCL; DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_buffer_destroy(buf: *mut DeepepBuffer) -> DeepepStatus {
    ffi(|| buffer_ref(buf)?.destroy())
}

/// Releases the handle. Without a prior destroy: tears down collectively if
/// the buffer was created with explicitly_destroy=false, else warns and leaks.
/// NULL is a no-op.
///
/// Returns: DEEPEP_SUCCESS (a failed teardown is logged, see DEEPEP_LOG); DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_buffer_free(buf: *mut DeepepBuffer) -> DeepepStatus {
    ffi(|| {
        if !buf.is_null() {
            // SAFETY: buf came from Box::into_raw in deepep_buffer_create and is freed once.
            let owned = unsafe { Box::from_raw(buf) };
            owned.inner.release();
        }
        Ok(())
    })
}

fn int_query(buf: *const DeepepBuffer, out: *mut c_int, value: impl FnOnce(&Buffer) -> c_int) -> DeepepStatus {
    ffi(|| {
        let b = buffer_ref(buf)?;
        *out_ref("out", out)? = value(b);
        Ok(())
    })
}

/// This rank's index in [0, num_ranks).
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (NULL buffer or out); DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_buffer_get_rank(buf: *const DeepepBuffer, out: *mut c_int) -> DeepepStatus {
    int_query(buf, out, |b| b.layout.rank)
}

/// Number of ranks in the buffer's communicator.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (NULL buffer or out); DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_buffer_get_num_ranks(buf: *const DeepepBuffer, out: *mut c_int) -> DeepepStatus {
    int_query(buf, out, |b| b.layout.num_ranks)
}

/// max(1, num_ranks / 8), as DeepEP.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (NULL buffer or out); DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_buffer_get_num_rdma_ranks(buf: *const DeepepBuffer, out: *mut c_int) -> DeepepStatus {
    int_query(buf, out, |b| b.layout.num_rdma_ranks())
}

/// rank / 8, as DeepEP.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (NULL buffer or out); DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_buffer_get_rdma_rank(buf: *const DeepepBuffer, out: *mut c_int) -> DeepepStatus {
    int_query(buf, out, |b| b.layout.rdma_rank())
}

/// CUDA device ordinal the buffer lives on.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (NULL buffer or out); DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_buffer_get_local_device_id(buf: *const DeepepBuffer, out: *mut c_int) -> DeepepStatus {
    int_query(buf, out, |b| b.device_id)
}

/// Streaming multiprocessors on the buffer's device.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (NULL buffer or out); DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_buffer_get_num_device_sms(buf: *const DeepepBuffer, out: *mut c_int) -> DeepepStatus {
    int_query(buf, out, |b| b.num_device_sms())
}

/// DeepEP's get_root_rdma_rank(global): global ? rank % 8 : 0.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (NULL buffer or out); DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_buffer_get_root_rdma_rank(buf: *const DeepepBuffer, global: bool, out: *mut c_int) -> DeepepStatus {
    ffi(|| {
        *out_ref("out", out)? = buffer_ref(buf)?.layout.root_rdma_rank(global);
        Ok(())
    })
}

/// True after a successful create and until destroy (or a GPU wait timeout).
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (NULL buffer or out); DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_buffer_is_available(buf: *const DeepepBuffer, out: *mut bool) -> DeepepStatus {
    ffi(|| {
        *out_ref("out", out)? = buffer_ref(buf)?.is_available();
        Ok(())
    })
}

/// Device pointer and size of the local NVL (or RDMA) region of the symmetric buffer.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer, a bad tensor or value, or bad
/// input a kernel found in an earlier op); DEEPEP_ERROR_NOT_AVAILABLE (destroyed, or unusable after a
/// timeout); DEEPEP_ERROR_TIMEOUT (a GPU wait expired in an earlier op); DEEPEP_ERROR_CUDA;
/// DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_buffer_get_local_buffer(buf: *const DeepepBuffer, use_rdma_buffer: bool, out_ptr: *mut *mut c_void, out_bytes: *mut i64) -> DeepepStatus {
    ffi(|| {
        let (ptr, bytes) = buffer_ref(buf)?.local_buffer(use_rdma_buffer)?;
        *out_ref("out_ptr", out_ptr)? = ptr;
        *out_ref("out_bytes", out_bytes)? = bytes;
        Ok(())
    })
}

/// The buffer's high-priority communication stream (a cudaStream_t).
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer, a bad tensor or value, or bad
/// input a kernel found in an earlier op); DEEPEP_ERROR_NOT_AVAILABLE (destroyed, or unusable after a
/// timeout); DEEPEP_ERROR_TIMEOUT (a GPU wait expired in an earlier op); DEEPEP_ERROR_CUDA;
/// DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_buffer_get_comm_stream(buf: *const DeepepBuffer, out: *mut *mut c_void) -> DeepepStatus {
    ffi(|| {
        *out_ref("out", out)? = buffer_ref(buf)?.comm_stream()?;
        Ok(())
    })
}

/// Collective barrier across the ranks (blocks the host until it completes or times out).
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer, a bad tensor or value, or bad
/// input a kernel found in an earlier op); DEEPEP_ERROR_NOT_AVAILABLE (destroyed, or unusable after a
/// timeout); DEEPEP_ERROR_TIMEOUT (a GPU wait expired, here or in an earlier op); DEEPEP_ERROR_CUDA;
/// DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_buffer_barrier(buf: *const DeepepBuffer) -> DeepepStatus {
    ffi(|| buffer_ref(buf)?.barrier())
}

/// Collective health check: every rank writes to every peer through NVLink
/// (LSA) and verifies what arrived.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer, a bad tensor or value, or bad
/// input a kernel found in an earlier op); DEEPEP_ERROR_NOT_AVAILABLE (destroyed, or unusable after a
/// timeout); DEEPEP_ERROR_TIMEOUT (a GPU wait expired, here or in an earlier op); DEEPEP_ERROR_CUDA;
/// DEEPEP_ERROR_INTERNAL (also: a peer's window does not match).
#[no_mangle]
pub extern "C" fn deepep_buffer_check_peers(buf: *const DeepepBuffer) -> DeepepStatus {
    ffi(|| buffer_ref(buf)?.check_peers())
}

/// Budget of every GPU wait of this buffer (default 100 s, or DEEPEP_GPU_TIMEOUT_SECS).
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (NULL buffer or timeout_ms 0);
/// DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_buffer_set_gpu_timeout_ms(buf: *const DeepepBuffer, timeout_ms: u64) -> DeepepStatus {
    ffi(|| {
        if timeout_ms == 0 {
            return Err(Error::invalid("timeout_ms must be positive"));
        }
        buffer_ref(buf)?.set_timeout_ns(timeout_ms.saturating_mul(1_000_000));
        Ok(())
    })
}

fn opt<'a>(t: *const DeepepTensor) -> Option<&'a DeepepTensor> {
    // SAFETY: callers pass valid descriptors or NULL.
    unsafe { t.as_ref() }
}

/// DeepEP's get_dispatch_layout. Outputs are caller-allocated, as
/// deepep_get_dispatch_layout_outputs describes them: num_tokens_per_rank
/// int32 [num_ranks], num_tokens_per_rdma_rank int32 [num_ranks/8] (only when
/// num_ranks > 8, else NULL), num_tokens_per_expert int32 [num_experts],
/// is_token_in_rank bool [num_tokens, num_ranks]. topk_idx is int64 (or int32)
/// [num_tokens, num_topk]; negative entries mean "no expert". Launches on
/// `stream` (NULL: the buffer's comm stream) without host synchronisation.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer, a bad tensor or value, or bad
/// input a kernel found in an earlier op); DEEPEP_ERROR_NOT_AVAILABLE (destroyed, or unusable after a
/// timeout); DEEPEP_ERROR_TIMEOUT (a GPU wait expired in an earlier op); DEEPEP_ERROR_CUDA;
/// DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_get_dispatch_layout(
    buf: *const DeepepBuffer,
    topk_idx: *const DeepepTensor,
    num_experts: c_int,
    num_tokens_per_rank: *const DeepepTensor,
    num_tokens_per_rdma_rank: *const DeepepTensor,
    num_tokens_per_expert: *const DeepepTensor,
    is_token_in_rank: *const DeepepTensor,
    stream: *mut c_void,
) -> DeepepStatus {
    ffi(|| {
        let args = LayoutArgs {
            topk_idx: opt(topk_idx),
            num_experts,
            num_tokens_per_rank: opt(num_tokens_per_rank),
            num_tokens_per_rdma_rank: opt(num_tokens_per_rdma_rank),
            num_tokens_per_expert: opt(num_tokens_per_expert),
            is_token_in_rank: opt(is_token_in_rank),
        };
        layout::get_dispatch_layout(buffer_ref(buf)?, &args, stream)
    })
}

/// Writes to `*out` what a deepep_get_dispatch_layout caller allocates for `num_tokens` rows of
/// topk_idx and `num_experts` experts (R = the buffer's ranks). out->tensors, in order:
/// num_tokens_per_rank int32 [R]; num_tokens_per_rdma_rank int32 [R / 8], absent (dtype 0)
/// up to 8 ranks, when the op takes NULL for it; num_tokens_per_expert int32 [E]; these three
/// are views of one int32 allocation; is_token_in_rank bool [num_tokens, R], an allocation of
/// its own. Allocate as DeepepOutputs says, set each present tensors[i].data and pass
/// &out->tensors[i] to the op. Errors name num_tokens (< 0) or num_experts (<= 0); on any error
/// *out is zeroed (count 0).
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL pointer or a bad value, named in the
/// message); DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_get_dispatch_layout_outputs(
    buf: *const DeepepBuffer,
    num_tokens: i64,
    num_experts: c_int,
    out: *mut DeepepOutputs,
) -> DeepepStatus {
    outputs_query(out, || layout::layout_outputs(buffer_ref(buf)?.layout.num_ranks, num_tokens, num_experts))
}

/// The output queries' common part: zeroes `*out` (a failed query leaves count 0), then writes
/// `describe`'s geometry.
pub(super) fn outputs_query(out: *mut DeepepOutputs, describe: impl FnOnce() -> Result<DeepepOutputs>) -> DeepepStatus {
    ffi(|| {
        let out = out_ref("out", out)?;
        *out = DeepepOutputs::default();
        *out = describe()?;
        Ok(())
    })
}
