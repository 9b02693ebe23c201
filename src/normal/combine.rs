//! Normal-mode combine: reduces the rows a dispatch delivered back onto their
//! source ranks (unweighted sum over ranks in fp32, plus optional biases), with
//! the handle's routing. One kernel, no host wait.
use std::os::raw::c_void;

use super::{plan_for, ChannelPlan};
use crate::buffer::{Buffer, NormalKernel};
use crate::config::DeepepConfig;
use crate::ensure_arg;
use crate::error::Result;
use crate::kernels::{self, CombineParams};
use crate::outputs::{check_output, check_required, DeepepOutputs};
use crate::tensor::{check, check_aligned16, check_opt, check_shape, DeepepDtype, DeepepDtype::*, DeepepTensor, TensorView};

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

/// The combine's outputs, in DeepEP's order.
pub const COMBINE_OUTPUTS: [&str; 2] = ["combined_x", "combined_topk_weights"];

/// What a combine caller allocates ([`COMBINE_OUTPUTS`] order): combined_x [T, H] in x's dtype
/// and combined_topk_weights [T, K] float32 (absent without topk_weights), T = send_head's rows.
pub fn combine_outputs(num_tokens: i64, hidden: i64, x_dtype: DeepepDtype, num_topk: Option<i64>) -> Result<DeepepOutputs> {
    ensure_arg!(num_tokens >= 0, "num_tokens must be >= 0, got {num_tokens}");
    let mut o = DeepepOutputs::default();
    o.push(x_dtype, &[num_tokens, hidden]);
    match num_topk {
        Some(k) => o.push(DEEPEP_DTYPE_FLOAT32, &[num_tokens, k]),
        None => o.push_absent(),
    };
    o.checked(&COMBINE_OUTPUTS)
}

/// The outputs' geometry for these args (deepep_intranode_combine_outputs): the inputs are
/// validated as the op does; the output descriptors in the args are ignored.
pub fn combine_outputs_for(buffer: &Buffer, a: &DeepepIntranodeCombineArgs) -> Result<DeepepOutputs> {
    validate(buffer, a)?.outputs()
}

/// Everything the kernel needs but the outputs, checked.
struct Plan<'a> {
    x: TensorView<'a>,
    weights: Option<TensorView<'a>>,
    send_head: TensorView<'a>,
    rank_prefix: TensorView<'a>,
    channel_prefix: TensorView<'a>,
    bias_0: *const c_void,
    bias_1: *const c_void,
    channels: ChannelPlan,
    num_tokens: i64,
    num_recv_rows: i64,
    hidden: i64,
    num_topk: i64,
    slot_bytes: i64,
}

impl Plan<'_> {
    fn outputs(&self) -> Result<DeepepOutputs> {
        combine_outputs(self.num_tokens, self.hidden, self.x.dtype, self.weights.map(|_| self.num_topk))
    }
}

/// A combine's x (both modes): BF16 [rows, H], 16-byte rows; with its bytes per row.
pub(crate) fn check_combine_x(x: &DeepepTensor) -> Result<(TensorView<'_>, i64)> {
    let x = check("x", Some(x), &[DEEPEP_DTYPE_BFLOAT16], 2)?;
    check_aligned16("x", &x)?;
    let h = x.dims()[1];
    let hidden_bytes = h.checked_mul(2).unwrap_or(i64::MAX);
    ensure_arg!(
        hidden_bytes % 16 == 0 && h > 0,
        "x: hidden size {h} must be a positive multiple of 8 bfloat16 elements (16-byte rows)"
    );
    ensure_arg!(hidden_bytes <= i32::MAX as i64, "x: {hidden_bytes} bytes per row is too large");
    Ok((x, hidden_bytes))
}

/// A combine's optional topk_weights (both modes): float32 [rows, K], K <= 1024; with K (0 absent).
pub(crate) fn check_combine_weights(weights: &DeepepTensor, rows: i64) -> Result<(Option<TensorView<'_>>, i64)> {
    let weights = check_opt("topk_weights", weights, &[DEEPEP_DTYPE_FLOAT32], 2)?;
    let k = match &weights {
        Some(w) => {
            ensure_arg!(w.dims()[0] == rows, "topk_weights must have {rows} rows (one per row of x), got shape {:?}", w.dims());
            w.dims()[1]
        }
        None => 0,
    };
    ensure_arg!(k <= 1024, "topk_weights has {k} columns; at most 1024 are supported");
    Ok((weights, k))
}

fn validate<'a>(buffer: &Buffer, a: &'a DeepepIntranodeCombineArgs) -> Result<Plan<'a>> {
    let r = buffer.layout.num_ranks as i64;
    let (x, hidden_bytes) = check_combine_x(&a.x)?;
    let (n, h) = (x.dims()[0], x.dims()[1]);
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
    let (weights, k) = check_combine_weights(&a.topk_weights, n)?;
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
    Ok(Plan {
        x,
        weights,
        send_head,
        rank_prefix,
        channel_prefix,
        bias_0,
        bias_1,
        channels: plan,
        num_tokens: t,
        num_recv_rows: n,
        hidden: h,
        num_topk: k,
        slot_bytes: slot,
    })
}

/// Validates and launches the combine kernel on `stream` (NULL: the comm stream).
pub fn combine(buffer: &Buffer, a: &DeepepIntranodeCombineArgs, stream: *mut c_void) -> Result<()> {
    let plan = validate(buffer, a)?;
    let want = plan.outputs()?;
    let out = check_required(COMBINE_OUTPUTS[0], &a.combined_x, want.get(0))?;
    check_aligned16("combined_x", &out)?;
    let out_weights = check_output(COMBINE_OUTPUTS[1], &a.combined_topk_weights, want.get(1))?
        .map_or(std::ptr::null_mut(), |o| o.ptr().cast::<f32>());

    buffer.with_resources(|res| {
        let stream = res.stream_or_comm(stream);
        let channels = plan.channels;
        let common = res.normal_common(
            buffer.wait_context(res),
            &buffer.args,
            channels.num_channels,
            channels.ring_tokens,
            NormalKernel::Data,
        );
        let params = CombineParams {
            common,
            x: plan.x.ptr(),
            topk_weights: plan.weights.map_or(std::ptr::null(), |w| w.ptr() as *const f32),
            bias_0: plan.bias_0,
            bias_1: plan.bias_1,
            rank_prefix_matrix: plan.rank_prefix.ptr() as *const i32,
            recv_channel_prefix_matrix: plan.channel_prefix.ptr() as *const i32,
            send_head: plan.send_head.ptr() as *const i32,
            combined_x: out.ptr(),
            combined_topk_weights: out_weights,
            num_tokens: plan.num_tokens,
            num_recv_rows: plan.num_recv_rows,
            hidden_bytes: (plan.hidden * 2) as i32,
            num_topk: plan.num_topk as i32,
            slot_bytes: plan.slot_bytes as i32,
            reserved: 0,
        };
        let launch = kernels::entry(res.dev_comm.build().table().launch_normal_combine);
        // SAFETY: params point at validated tensors, the live window, devComm and workspace; the
        // launcher is of the devComm's build.
        let rc = unsafe { launch(res.dev_comm.as_ptr(), &params, stream) };
        kernels::launch_result("combine", rc)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn combine_outputs_follow_send_head_rows_and_weights() {
        let o = combine_outputs(128, 7168, DEEPEP_DTYPE_BFLOAT16, Some(8)).unwrap();
        assert_eq!((o.count, o.num_allocations), (2, 2));
        assert_eq!((o.get(0).dtype, &o.get(0).shape[..2], &o.get(0).strides[..2]), (DEEPEP_DTYPE_BFLOAT16 as i32, &[128, 7168][..], &[7168, 1][..]));
        assert_eq!((o.get(1).dtype, &o.get(1).shape[..2]), (DEEPEP_DTYPE_FLOAT32 as i32, &[128, 8][..]));
        assert_eq!(o.allocation_elems[..2], [128 * 7168, 128 * 8]);
        let o = combine_outputs(0, 2048, DEEPEP_DTYPE_BFLOAT16, None).unwrap();
        assert_eq!((o.count, o.num_allocations, o.allocation_elems[0]), (2, 1, 0));
        assert_eq!((o.get(1).dtype, o.allocation[1]), (0, -1));
        assert_eq!(&o.get(0).shape[..2], &[0, 2048]);
        let huge = combine_outputs(i64::MAX / 2, 4096, DEEPEP_DTYPE_BFLOAT16, None).unwrap_err();
        assert!(huge.message.starts_with("combined_x would have shape"), "{}", huge.message);
    }
}
