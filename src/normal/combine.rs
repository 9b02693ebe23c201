//! Normal-mode combine: reduces the rows a dispatch delivered back onto their
//! source ranks (unweighted sum over ranks in fp32, plus optional biases), with
//! the handle's routing. One kernel, no host wait.
use std::os::raw::c_void;

use super::plan_for;
use crate::buffer::{Buffer, NormalKernel};
use crate::config::DeepepConfig;
use crate::ensure_arg;
use crate::error::{Error, Result};
use crate::kernels::{self, CombineParams};
use crate::tensor::{check, check_aligned16, check_opt, check_shape, DeepepTensor, DeepepDtype::*};

/// Arguments of one intranode combine. Absent optional tensors have dtype 0.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DeepepIntranodeCombineArgs {
    /// [N, H] bfloat16: one row per token this rank received in the dispatch.
    pub x: DeepepTensor,
    /// Optional [N, K] float32, summed like x into combined_topk_weights.
    pub topk_weights: DeepepTensor,
    /// Optional [T, H] bfloat16 each, added once per token.
    pub bias_0: DeepepTensor,
    pub bias_1: DeepepTensor,
    /// The dispatch handle: src_idx [N] int32, rank_prefix_matrix [R, R],
    /// channel_prefix_matrix = the handle's recv_channel_prefix_matrix [R, C], send_head [T, R].
    pub src_idx: DeepepTensor,
    pub rank_prefix_matrix: DeepepTensor,
    pub channel_prefix_matrix: DeepepTensor,
    pub send_head: DeepepTensor,
    /// [T, H] bfloat16 output.
    pub combined_x: DeepepTensor,
    /// [T, K] float32 output; present iff topk_weights is.
    pub combined_topk_weights: DeepepTensor,
    pub config: DeepepConfig,
}

/// Validates and launches the combine kernel on `stream` (NULL: the comm stream).
pub fn combine(buffer: &Buffer, a: &DeepepIntranodeCombineArgs, stream: *mut c_void) -> Result<()> {
    let r = buffer.layout.num_ranks as i64;
    let x = check("x", Some(&a.x), &[DEEPEP_DTYPE_BFLOAT16], 2)?;
    check_aligned16("x", &x)?;
    let (n, h) = (x.dims()[0], x.dims()[1]);
    let hidden_bytes = h * 2;
    ensure_arg!(
        hidden_bytes % 16 == 0 && h > 0,
        "x: hidden size {h} must be a positive multiple of 8 bfloat16 elements (16-byte rows)"
    );
    let src_idx = check("src_idx", Some(&a.src_idx), &[DEEPEP_DTYPE_INT32], 1)?;
    ensure_arg!(
        src_idx.dims()[0] == n,
        "x has {n} rows but the handle's recv_src_idx has {}: combine takes one row per received token",
        src_idx.dims()[0]
    );
    let send_head = check("send_head", Some(&a.send_head), &[DEEPEP_DTYPE_INT32], 2)?;
    ensure_arg!(
        send_head.dims()[1] == r,
        "send_head must have {r} columns (one per rank), got shape {:?}: the handle is from a buffer with another rank count",
        send_head.dims()
    );
    let t = send_head.dims()[0];
    let weights = check_opt("topk_weights", &a.topk_weights, &[DEEPEP_DTYPE_FLOAT32], 2)?;
    let k = match &weights {
        Some(w) => {
            ensure_arg!(w.dims()[0] == n, "topk_weights must have {n} rows (one per row of x), got shape {:?}", w.dims());
            w.dims()[1]
        }
        None => 0,
    };
    ensure_arg!(k <= 1024, "topk_weights has {k} columns; at most 1024 are supported");
    let slot = kernels::combine_slot_bytes(hidden_bytes as i32, k as i32);
    let plan = plan_for(buffer, &a.config, "combine", slot)?;
    let c = plan.num_channels as i64;
    let rank_prefix = check("rank_prefix_matrix", Some(&a.rank_prefix_matrix), &[DEEPEP_DTYPE_INT32], 2)?;
    ensure_arg!(
        rank_prefix.dims() == [r, r],
        "rank_prefix_matrix must have shape [{r}, {r}], got {:?}: the handle is from a buffer with another rank count",
        rank_prefix.dims()
    );
    let channel_prefix = check("channel_prefix_matrix", Some(&a.channel_prefix_matrix), &[DEEPEP_DTYPE_INT32], 2)?;
    ensure_arg!(
        channel_prefix.dims() == [r, c],
        "the handle's channel matrix has shape {:?} but config.num_sms / 2 = {c} channels with {r} ranks: combine \
         must use the num_sms of the dispatch that made the handle",
        channel_prefix.dims()
    );
    let bias = |name: &str, t_: &DeepepTensor| -> Result<*const c_void> {
        Ok(match check_opt(name, t_, &[DEEPEP_DTYPE_BFLOAT16], 2)? {
            Some(b) => {
                check_shape(name, &b, &[t, h])?;
                check_aligned16(name, &b)?;
                b.ptr() as *const c_void
            }
            None => std::ptr::null(),
        })
    };
    let bias_0 = bias("bias_0", &a.bias_0)?;
    let bias_1 = bias("bias_1", &a.bias_1)?;
    let out = check("combined_x", Some(&a.combined_x), &[DEEPEP_DTYPE_BFLOAT16], 2)?;
    check_shape("combined_x", &out, &[t, h])?;
    check_aligned16("combined_x", &out)?;
    let out_weights = match (&weights, check_opt("combined_topk_weights", &a.combined_topk_weights, &[DEEPEP_DTYPE_FLOAT32], 2)?) {
        (Some(_), Some(o)) => {
            check_shape("combined_topk_weights", &o, &[t, k])?;
            o.ptr().cast::<f32>()
        }
        (None, None) => std::ptr::null_mut(),
        (Some(_), None) => return Err(Error::invalid("combined_topk_weights must be given with topk_weights")),
        (None, Some(_)) => return Err(Error::invalid("combined_topk_weights must be absent without topk_weights")),
    };

    buffer.with_resources(|res| {
        let stream = res.stream_or_comm(stream);
        let common =
            res.normal_common(buffer.wait_context(res), &buffer.args, plan.num_channels, plan.ring_tokens, NormalKernel::Data);
        let params = CombineParams {
            common,
            x: x.ptr(),
            topk_weights: weights.map_or(std::ptr::null(), |w| w.ptr() as *const f32),
            bias_0,
            bias_1,
            rank_prefix_matrix: rank_prefix.ptr() as *const i32,
            recv_channel_prefix_matrix: channel_prefix.ptr() as *const i32,
            send_head: send_head.ptr() as *const i32,
            combined_x: out.ptr(),
            combined_topk_weights: out_weights,
            num_tokens: t,
            num_recv_rows: n,
            hidden_bytes: hidden_bytes as i32,
            num_topk: k as i32,
            slot_bytes: slot as i32,
            reserved: 0,
        };
        // SAFETY: params point at validated tensors, the live window, devComm and workspace.
        let rc = unsafe { kernels::deepep_launch_normal_combine(res.dev_comm.as_ptr(), &params, stream) };
        kernels::launch_result("combine", rc)
    })
}
