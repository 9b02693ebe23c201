//! C ABI: the buffer handle, its queries, and the layout op.
use std::mem::ManuallyDrop;
use std::ops::Deref;
use std::os::raw::{c_int, c_void};
use std::sync::Arc;

use super::{ffi, out_ref};
use crate::buffer::{Buffer, BufferArgs};
use crate::error::{DeepepStatus, Error, Result};
use crate::handles::{HandleKind, Registry};
use crate::layout::{self, LayoutArgs};
use crate::outputs::DeepepOutputs;
use crate::tensor::DeepepTensor;

/// Opaque handle to one rank's buffer. A `DeepepBuffer *` is a checked value, not an address:
/// the library never dereferences it, and a freed, twice-freed or made-up handle is a
/// DEEPEP_ERROR_INVALID_ARGUMENT naming it (never created, destroyed, or the wrong kind).
pub struct DeepepBuffer {
    _never_constructed: [u8; 0],
}

/// What a buffer handle refers to: the Buffer, released (Buffer::release) when the last
/// reference goes, i.e. at deepep_buffer_free or, if another thread is still inside a call
/// with the handle, when that call returns.
pub(crate) struct BufferEntry(ManuallyDrop<Buffer>);

impl BufferEntry {
    pub(super) fn buffer(&self) -> &Buffer {
        &self.0
    }
}

impl Deref for BufferEntry {
    type Target = Buffer;
    fn deref(&self) -> &Buffer {
        &self.0
    }
}

impl Drop for BufferEntry {
    fn drop(&mut self) {
        // SAFETY: the Buffer is taken once, here, and self.0 is not used afterwards.
        unsafe { ManuallyDrop::take(&mut self.0) }.release();
    }
}

static BUFFERS: Registry<BufferEntry> = Registry::new(HandleKind::Buffer);

/// The live buffer behind a handle (held for the call), or the error naming `buffer`.
pub(super) fn buffer_ref(buf: *const DeepepBuffer) -> Result<Arc<BufferEntry>> {
    BUFFERS.get("buffer", buf as usize)
}

/// Registers a buffer and returns its handle.
fn register(buffer: Buffer) -> Result<*mut DeepepBuffer> {
    Ok(BUFFERS.insert(BufferEntry(ManuallyDrop::new(buffer)))? as *mut DeepepBuffer)
}

/// Hooks for the CPU tests, fuzz targets and benches of the handle checks and argument
/// validation (not part of the C ABI: nothing here is in the header).
#[doc(hidden)]
pub mod testing {
    use super::*;

    /// A live buffer handle whose Buffer has no GPU resources (as after deepep_buffer_destroy):
    /// handle checks and argument validation run as for a real one, anything needing the GPU
    /// returns DEEPEP_ERROR_NOT_AVAILABLE. Release it with deepep_buffer_free.
    pub fn buffer_without_resources(args: BufferArgs, num_device_sms: i32) -> *mut DeepepBuffer {
        register(Buffer::without_resources(args, num_device_sms)).expect("room for a test buffer handle")
    }

    /// [`buffer_without_resources`] spanning nodes of `node_size` ranks (internode checks).
    pub fn buffer_without_resources_in_nodes(args: BufferArgs, num_device_sms: i32, node_size: i32) -> *mut DeepepBuffer {
        register(Buffer::without_resources_in_nodes(args, num_device_sms, node_size)).expect("room for a test buffer handle")
    }

    /// One registry lookup of a handle (what every call with a buffer handle does first), for
    /// bench/handle_lookup.rs: whether the handle is live.
    pub fn lookup_buffer(buf: *const DeepepBuffer) -> bool {
        buffer_ref(buf).is_ok()
    }

    /// Buffer handles alive now.
    pub fn live_buffers() -> usize {
        BUFFERS.live()
    }
}

/// Collective: all `num_ranks` ranks call this with the same unique id (from
/// rank 0's deepep_get_unique_id). Uses the calling thread's current CUDA device.
///
/// Every rank must pass the same num_nvl_bytes, num_rdma_bytes, low_latency_mode and
/// enable_shrink (as DeepEP requires). The internode combine sizes its scale-out rings from
/// num_rdma_bytes (the config's num_max_rdma_chunked_recv_tokens grown into the region's room,
/// up to 1024 rows), so ranks that differ would hang or corrupt them. The creation check catches
/// a difference among the ranks of one NVLink domain (all of them with
/// DEEPEP_VIRTUAL_NODE_SIZE): DEEPEP_ERROR_INTERNAL naming the first such rank. Across real
/// nodes nothing checks it: exchange the values before this call (deep_ep_cpp's IPC handles
/// carry them, and its sync() raises on a difference).
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (NULL pointer, bad sizes or ranks, a bad DEEPEP_*
/// environment variable); DEEPEP_ERROR_NO_DEVICE; DEEPEP_ERROR_CUDA; DEEPEP_ERROR_NCCL;
/// DEEPEP_ERROR_VERSION_MISMATCH (runtime NCCL minor differs from the build's); DEEPEP_ERROR_UNSUPPORTED
/// (ranks beyond NVLink without low_latency_mode or without GIN); DEEPEP_ERROR_TIMEOUT (a peer never
/// reached the creation check); DEEPEP_ERROR_INTERNAL (also: a peer check mismatch, or a peer of
/// this NVLink domain created with other sizes or modes).
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
        if !BUFFERS.has_room() {
            return Err(Error::invalid(format!(
                "too many buffer handles alive ({}); free some with deepep_buffer_free first",
                crate::handles::MAX_SLOTS
            )));
        }
        let args = BufferArgs { rank, num_ranks, num_nvl_bytes, num_rdma_bytes, low_latency_mode, explicitly_destroy, enable_shrink };
        // Read only once its length is the id's: a slice is never built over a length the caller got wrong.
        let read_id = || {
            let id = nccl_sys::NCCL_UNIQUE_ID_BYTES;
            crate::ensure_arg!(unique_id_len == id, "unique_id must be {id} bytes (an ncclUniqueId), got {unique_id_len}");
            let mut bytes = [0u8; nccl_sys::NCCL_UNIQUE_ID_BYTES];
            // SAFETY: unique_id is non-NULL and points to unique_id_len (= id) readable bytes (caller contract).
            unsafe { std::ptr::copy_nonoverlapping(unique_id, bytes.as_mut_ptr(), id) };
            Ok(bytes)
        };
        *out = register(Buffer::create(args, read_id)?)?;
        Ok(())
    })
}

/// Collective teardown (DeepEP's destroy()). The handle stays valid for
/// queries and must still be released with deepep_buffer_free.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (NULL, freed or made-up buffer); DEEPEP_ERROR_NOT_AVAILABLE
/// (already destroyed); DEEPEP_ERROR_TIMEOUT (a peer never reached the teardown barrier);
/// DEEPEP_ERROR_CUDA; DEEPEP_ERROR_NCCL; DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_buffer_destroy(buf: *mut DeepepBuffer) -> DeepepStatus {
    ffi(|| buffer_ref(buf)?.destroy())
}

/// Releases the handle; any later use of it (a second free included) is an error naming it.
/// Without a prior destroy: tears down collectively if the buffer was created with
/// explicitly_destroy=false, else warns and leaks. NULL is a no-op. If another thread is still
/// inside a call with this handle, the teardown runs when that call returns.
///
/// Returns: DEEPEP_SUCCESS (a failed teardown is logged, see DEEPEP_LOG); DEEPEP_ERROR_INVALID_ARGUMENT
/// (an already freed or made-up buffer; nothing is released); DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_buffer_free(buf: *mut DeepepBuffer) -> DeepepStatus {
    ffi(|| {
        if !buf.is_null() {
            drop(BUFFERS.remove("buffer", buf as usize)?);
        }
        Ok(())
    })
}

fn int_query(buf: *const DeepepBuffer, out: *mut c_int, value: impl FnOnce(&Buffer) -> c_int) -> DeepepStatus {
    ffi(|| {
        let b = buffer_ref(buf)?;
        *out_ref("out", out)? = value(b.buffer());
        Ok(())
    })
}

/// This rank's index in [0, num_ranks).
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL, freed or made-up buffer; NULL out);
/// DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_buffer_get_rank(buf: *const DeepepBuffer, out: *mut c_int) -> DeepepStatus {
    int_query(buf, out, |b| b.layout.rank)
}

/// Number of ranks in the buffer's communicator.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL, freed or made-up buffer; NULL out);
/// DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_buffer_get_num_ranks(buf: *const DeepepBuffer, out: *mut c_int) -> DeepepStatus {
    int_query(buf, out, |b| b.layout.num_ranks)
}

/// The buffer's nodes: num_ranks / node size across (virtual) nodes (the LSA team, or
/// DEEPEP_VIRTUAL_NODE_SIZE); within one node max(1, num_ranks / 8), as DeepEP.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL, freed or made-up buffer; NULL out);
/// DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_buffer_get_num_rdma_ranks(buf: *const DeepepBuffer, out: *mut c_int) -> DeepepStatus {
    int_query(buf, out, |b| b.layout.num_rdma_ranks())
}

/// This rank's node: rank / node size across nodes; within one node rank / 8, as DeepEP.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL, freed or made-up buffer; NULL out);
/// DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_buffer_get_rdma_rank(buf: *const DeepepBuffer, out: *mut c_int) -> DeepepStatus {
    int_query(buf, out, |b| b.layout.rdma_rank())
}

/// CUDA device ordinal the buffer lives on.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL, freed or made-up buffer; NULL out);
/// DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_buffer_get_local_device_id(buf: *const DeepepBuffer, out: *mut c_int) -> DeepepStatus {
    int_query(buf, out, |b| b.device_id)
}

/// Streaming multiprocessors on the buffer's device.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL, freed or made-up buffer; NULL out);
/// DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_buffer_get_num_device_sms(buf: *const DeepepBuffer, out: *mut c_int) -> DeepepStatus {
    int_query(buf, out, |b| b.num_device_sms())
}

/// DeepEP's get_root_rdma_rank(global): global ? rank % node size (8 within one node) : 0.
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL, freed or made-up buffer; NULL out);
/// DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_buffer_get_root_rdma_rank(buf: *const DeepepBuffer, global: bool, out: *mut c_int) -> DeepepStatus {
    ffi(|| {
        *out_ref("out", out)? = buffer_ref(buf)?.layout.root_rdma_rank(global);
        Ok(())
    })
}

/// True after a successful create and until destroy or a GPU wait timeout (seen as soon as the
/// GPU recorded it: after CUDA-graph replays, synchronize, then ask).
///
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL, freed or made-up buffer; NULL out);
/// DEEPEP_ERROR_INTERNAL.
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
/// Returns: DEEPEP_SUCCESS; DEEPEP_ERROR_INVALID_ARGUMENT (a NULL, freed or made-up buffer; timeout_ms 0,
/// or more than one day, 86400000, the most DEEPEP_GPU_TIMEOUT_SECS accepts too); DEEPEP_ERROR_INTERNAL.
#[no_mangle]
pub extern "C" fn deepep_buffer_set_gpu_timeout_ms(buf: *const DeepepBuffer, timeout_ms: u64) -> DeepepStatus {
    ffi(|| {
        let buffer = buffer_ref(buf)?;
        let max_ms = (crate::env::MAX_GPU_TIMEOUT_SECS * 1000.0) as u64;
        if timeout_ms == 0 || timeout_ms > max_ms {
            return Err(Error::invalid(format!(
                "timeout_ms ({timeout_ms}) must be in [1, {max_ms}] (at most one day, as DEEPEP_GPU_TIMEOUT_SECS)"
            )));
        }
        buffer.set_timeout_ns(timeout_ms * 1_000_000);
        Ok(())
    })
}

fn opt<'a>(t: *const DeepepTensor) -> Option<&'a DeepepTensor> {
    // SAFETY: callers pass valid descriptors or NULL.
    unsafe { t.as_ref() }
}

/// DeepEP's get_dispatch_layout. Outputs are caller-allocated, as
/// deepep_get_dispatch_layout_outputs describes them: num_tokens_per_rank
/// int32 [num_ranks], num_tokens_per_rdma_rank int32 [nodes] (a buffer across nodes: its
/// nodes; within one node num_ranks/8 when num_ranks > 8, else NULL), num_tokens_per_expert int32 [num_experts],
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
        layout::get_dispatch_layout(buffer_ref(buf)?.buffer(), &args, stream)
    })
}

/// Writes to `*out` what a deepep_get_dispatch_layout caller allocates for `num_tokens` rows of
/// topk_idx and `num_experts` experts (R = the buffer's ranks). out->tensors, in order:
/// num_tokens_per_rank int32 [R]; num_tokens_per_rdma_rank int32 [nodes] (deepep_buffer_get_num_rdma_ranks
/// across nodes; R / 8 within one node), absent (dtype 0) within one node up to 8 ranks, when the op takes NULL for it; num_tokens_per_expert int32 [E]; these three
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
    outputs_query(out, || layout::layout_outputs_in(&buffer_ref(buf)?.layout, num_tokens, num_experts))
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
