//! C ABI tests of internode normal mode that need no GPU: a host-only buffer across (virtual)
//! nodes answers the topology queries, describes the layout's and the ops' outputs, checks every
//! argument, and reports DEEPEP_ERROR_NOT_AVAILABLE only once the arguments pass.
use std::ffi::CStr;
use std::ptr;

use deepep_nccl::buffer::BufferArgs;
use deepep_nccl::capi::*;
use deepep_nccl::config::DeepepConfig;
use deepep_nccl::error::DeepepStatus::{self, *};
use deepep_nccl::internode::combine::DeepepInternodeCombineArgs;
use deepep_nccl::internode::dispatch::{DeepepInternodeDispatchArgs, DeepepInternodeDispatchOutputs};
use deepep_nccl::outputs::DeepepOutputs;
use deepep_nccl::tensor::{DeepepDtype, DeepepDtype::*, DeepepTensor};

fn last_error() -> String {
    unsafe { CStr::from_ptr(deepep_last_error()) }.to_string_lossy().into_owned()
}

fn expect_err(status: DeepepStatus, needle: &str) {
    let error = last_error();
    assert_eq!(status, DEEPEP_ERROR_INVALID_ARGUMENT, "{error}");
    assert!(error.contains(needle), "{error:?} lacks {needle:?}");
}

/// A buffer of `num_ranks` in nodes of `node_size` without GPU resources.
fn buffer(rank: i32, num_ranks: i32, node_size: i32, num_rdma_bytes: i64) -> *mut DeepepBuffer {
    let args = BufferArgs {
        rank,
        num_ranks,
        num_nvl_bytes: 1 << 30,
        num_rdma_bytes,
        low_latency_mode: false,
        explicitly_destroy: false,
        enable_shrink: false,
    };
    testing::buffer_without_resources_in_nodes(args, 132, node_size)
}

fn described(dtype: DeepepDtype, shape: &[i64], address: usize) -> DeepepTensor {
    let mut t = DeepepTensor { data: address as *mut _, dtype: dtype as i32, ndim: shape.len() as i32, shape: [0; 4], strides: [0; 4] };
    let mut step = 1;
    for d in (0..shape.len()).rev() {
        t.shape[d] = shape[d];
        t.strides[d] = step;
        step *= shape[d].max(1);
    }
    t
}

const ABSENT: DeepepTensor = DeepepTensor { data: ptr::null_mut(), dtype: 0, ndim: 0, shape: [0; 4], strides: [0; 4] };

fn dims(t: &DeepepTensor) -> Vec<i64> {
    t.shape[..t.ndim as usize].to_vec()
}

fn config() -> DeepepConfig {
    let mut c = DeepepConfig::new(24, 8, 256, 16, 128).unwrap();
    assert_eq!(deepep_config_init(&mut c, 24, 8, 256, 16, 128), DEEPEP_SUCCESS, "{}", last_error());
    c
}

#[test]
fn topology_queries_count_the_buffers_nodes() {
    // Rank 5 of 12 in 3 nodes of 4; the same rank of a one-node buffer answers as DeepEP (8 per node).
    let inter = buffer(5, 12, 4, 1 << 30);
    let (mut n, mut r, mut root) = (0, 0, 0);
    assert_eq!(deepep_buffer_get_num_rdma_ranks(inter, &mut n), DEEPEP_SUCCESS);
    assert_eq!(deepep_buffer_get_rdma_rank(inter, &mut r), DEEPEP_SUCCESS);
    assert_eq!(deepep_buffer_get_root_rdma_rank(inter, true, &mut root), DEEPEP_SUCCESS);
    assert_eq!((n, r, root), (3, 1, 1));
    let mut o = DeepepOutputs::default();
    assert_eq!(deepep_get_dispatch_layout_outputs(inter, 64, 48, &mut o), DEEPEP_SUCCESS, "{}", last_error());
    assert_eq!((o.tensors[1].dtype, dims(&o.tensors[1])), (DEEPEP_DTYPE_INT32 as i32, vec![3]));

    let one = buffer(5, 8, 8, 0);
    assert_eq!(deepep_buffer_get_num_rdma_ranks(one, &mut n), DEEPEP_SUCCESS);
    assert_eq!(deepep_buffer_get_rdma_rank(one, &mut r), DEEPEP_SUCCESS);
    assert_eq!((n, r), (1, 0));
    assert_eq!(deepep_get_dispatch_layout_outputs(one, 64, 48, &mut o), DEEPEP_SUCCESS);
    assert_eq!(o.tensors[1].dtype, 0, "no per-node counts within one node");
    for b in [inter, one] {
        assert_eq!(deepep_buffer_free(b), DEEPEP_SUCCESS);
    }
}

/// Fake, 16-byte aligned device addresses far apart (never dereferenced on the host).
fn at(i: usize) -> usize {
    (1usize << 32) + (i << 36)
}

/// A complete non-cached dispatch of 2 ranks as 2 nodes of 1: T tokens, hidden 2048 BF16, top-8
/// of 16 experts, with the handle's outputs as deepep_internode_dispatch_handle_outputs describes.
fn dispatch_args(buf: *mut DeepepBuffer, t: i64) -> DeepepInternodeDispatchArgs {
    // SAFETY: plain old data; all-zero descriptors are absent.
    let mut a: DeepepInternodeDispatchArgs = unsafe { std::mem::zeroed() };
    a.x = described(DEEPEP_DTYPE_BFLOAT16, &[t, 2048], at(0));
    a.topk_idx = described(DEEPEP_DTYPE_INT64, &[t, 8], at(1));
    a.topk_weights = described(DEEPEP_DTYPE_FLOAT32, &[t, 8], at(2));
    a.num_tokens_per_rank = described(DEEPEP_DTYPE_INT32, &[2], at(3));
    a.num_tokens_per_rdma_rank = described(DEEPEP_DTYPE_INT32, &[2], at(4));
    a.is_token_in_rank = described(DEEPEP_DTYPE_BOOL, &[t, 2], at(5));
    a.num_tokens_per_expert = described(DEEPEP_DTYPE_INT32, &[16], at(6));
    a.config = config();
    a.expert_alignment = 1;
    let mut o = DeepepOutputs::default();
    assert_eq!(deepep_internode_dispatch_handle_outputs(buf, &a, &mut o), DEEPEP_SUCCESS, "{}", last_error());
    let handle = [
        &mut a.rdma_channel_prefix_matrix,
        &mut a.gbl_channel_prefix_matrix,
        &mut a.recv_rdma_channel_prefix_matrix,
        &mut a.recv_rdma_rank_prefix_sum,
        &mut a.recv_gbl_channel_prefix_matrix,
        &mut a.recv_gbl_rank_prefix_sum,
        &mut a.send_rdma_head,
    ];
    for (i, slot) in handle.into_iter().enumerate() {
        *slot = o.tensors[i];
        slot.data = (at(20) + 4 * o.offset[i] as usize) as *mut _;
    }
    a
}

#[test]
fn internode_dispatch_describes_deepeps_handle_and_outputs() {
    let buf = buffer(1, 2, 1, 1 << 30);
    let a = dispatch_args(buf, 100);
    // Handle: [N, C], [R, C], [N, C], [N], [R, C], [R], [T, N] with N = R = 2, C = 12.
    let handle = [&a.rdma_channel_prefix_matrix, &a.gbl_channel_prefix_matrix, &a.recv_rdma_channel_prefix_matrix,
        &a.recv_rdma_rank_prefix_sum, &a.recv_gbl_channel_prefix_matrix, &a.recv_gbl_rank_prefix_sum, &a.send_rdma_head];
    let shapes: Vec<Vec<i64>> = handle.iter().map(|t| dims(t)).collect();
    assert_eq!(shapes, [vec![2, 12], vec![2, 12], vec![2, 12], vec![2], vec![2, 12], vec![2], vec![100, 2]]);

    let mut o = DeepepOutputs::default();
    assert_eq!(deepep_internode_dispatch_outputs(buf, &a, 37, 29, &mut o), DEEPEP_SUCCESS, "{}", last_error());
    assert_eq!(o.count, 6);
    let got: Vec<(i32, Vec<i64>)> = o.tensors[..6].iter().map(|t| (t.dtype, dims(t))).collect();
    assert_eq!(
        got,
        [
            (DEEPEP_DTYPE_BFLOAT16 as i32, vec![37, 2048]),
            (0, vec![]),
            (DEEPEP_DTYPE_INT64 as i32, vec![37, 8]),
            (DEEPEP_DTYPE_FLOAT32 as i32, vec![37, 8]),
            (DEEPEP_DTYPE_UINT8 as i32, vec![37, 8]),
            (DEEPEP_DTYPE_INT32 as i32, vec![29, 1]),
        ]
    );
    // num_worst_tokens sizes both receive spaces.
    let worst = DeepepInternodeDispatchArgs { num_worst_tokens: 300, ..a };
    assert_eq!(deepep_internode_dispatch_outputs(buf, &worst, -1, -1, &mut o), DEEPEP_SUCCESS, "{}", last_error());
    assert_eq!((dims(&o.tensors[0]), dims(&o.tensors[5])), (vec![300, 2048], vec![300, 1]));

    // The op itself checks its outputs against the same description, then needs the GPU.
    let mut outs: DeepepInternodeDispatchOutputs = unsafe { std::mem::zeroed() };
    assert_eq!(deepep_internode_dispatch_outputs(buf, &a, 37, 29, &mut o), DEEPEP_SUCCESS);
    let fields = [&mut outs.recv_x, &mut outs.recv_x_scales, &mut outs.recv_topk_idx, &mut outs.recv_topk_weights,
        &mut outs.recv_src_meta, &mut outs.send_nvl_head];
    for (i, f) in fields.into_iter().enumerate() {
        *f = o.tensors[i];
        if f.dtype != 0 {
            f.data = at(40 + i) as *mut _;
        }
    }
    assert_eq!(deepep_internode_dispatch(buf, &a, &outs, ptr::null_mut()), DEEPEP_ERROR_NOT_AVAILABLE, "{}", last_error());
    let short = DeepepInternodeDispatchOutputs { send_nvl_head: described(DEEPEP_DTYPE_INT32, &[29, 2], at(50)), ..outs };
    expect_err(deepep_internode_dispatch(buf, &a, &short, ptr::null_mut()), "send_nvl_head must have shape [29, 1]");
    let (mut n, mut nr) = (0, 0);
    let mut list = [0i32; 8];
    let status = deepep_internode_dispatch_prepare(buf, &a, &mut n, &mut nr, list.as_mut_ptr(), 8, ptr::null_mut());
    assert_eq!(status, DEEPEP_ERROR_NOT_AVAILABLE, "{}", last_error());
    assert_eq!((n, nr), (-1, -1));
    assert_eq!(deepep_buffer_free(buf), DEEPEP_SUCCESS);
}

#[test]
fn internode_dispatch_arguments_are_named() {
    let buf = buffer(0, 2, 1, 1 << 30);
    let a = dispatch_args(buf, 64);
    let mut o = DeepepOutputs::default();
    let query = |a: &DeepepInternodeDispatchArgs, o: &mut DeepepOutputs| deepep_internode_dispatch_outputs(buf, a, 10, 10, o);
    let bad = DeepepInternodeDispatchArgs { num_tokens_per_rdma_rank: described(DEEPEP_DTYPE_INT32, &[3], at(4)), ..a };
    expect_err(query(&bad, &mut o), "num_tokens_per_rdma_rank must have shape [2], got [3]");
    let bad = DeepepInternodeDispatchArgs { num_tokens_per_rdma_rank: ABSENT, ..a };
    expect_err(query(&bad, &mut o), "num_tokens_per_rdma_rank");
    let bad = DeepepInternodeDispatchArgs { send_rdma_head: described(DEEPEP_DTYPE_INT32, &[64, 1], at(20)), ..a };
    expect_err(query(&bad, &mut o), "send_rdma_head must have shape [64, 2], got [64, 1]");
    let bad = DeepepInternodeDispatchArgs { expert_alignment: 0, ..a };
    expect_err(query(&bad, &mut o), "expert_alignment must be >= 1");
    expect_err(deepep_internode_dispatch_outputs(buf, &a, -1, 5, &mut o), "num_recv_tokens and num_rdma_recv_tokens must be");
    // Cached: the handle's two sender matrices are inputs, of the handle's config.
    let cached = DeepepInternodeDispatchArgs { cached: 1, topk_idx: ABSENT, topk_weights: ABSENT, ..a };
    let mut c = DeepepOutputs::default();
    assert_eq!(deepep_internode_dispatch_handle_outputs(buf, &cached, &mut c), DEEPEP_SUCCESS, "{}", last_error());
    let absent: Vec<i32> = [0, 1, 3, 5, 6].iter().map(|&i| c.tensors[i].dtype).collect();
    assert_eq!(absent, [0; 5], "cached: the handle's prefix matrices and sums are passed, not allocated");
    let cached = DeepepInternodeDispatchArgs {
        recv_rdma_channel_prefix_matrix: c.tensors[2],
        recv_rdma_rank_prefix_sum: described(DEEPEP_DTYPE_INT32, &[2], 0),
        recv_gbl_channel_prefix_matrix: c.tensors[4],
        recv_gbl_rank_prefix_sum: described(DEEPEP_DTYPE_INT32, &[2], 0),
        send_rdma_head: ABSENT,
        ..cached
    };
    let fix = |t: &mut DeepepTensor, i: usize| t.data = at(60 + i) as *mut _;
    let mut cached = cached;
    fix(&mut cached.recv_rdma_channel_prefix_matrix, 0);
    fix(&mut cached.recv_rdma_rank_prefix_sum, 1);
    fix(&mut cached.recv_gbl_channel_prefix_matrix, 2);
    fix(&mut cached.recv_gbl_rank_prefix_sum, 3);
    assert_eq!(deepep_internode_dispatch_outputs(buf, &cached, 10, 7, &mut o), DEEPEP_SUCCESS, "{}", last_error());
    assert_eq!((o.tensors[2].dtype, o.tensors[4].dtype, o.tensors[5].dtype), (0, 0, 0), "cached: no top-k, meta or nvl head");
    let other_config = DeepepInternodeDispatchArgs { config: DeepepConfig { num_sms: 20, ..cached.config }, ..cached };
    expect_err(
        deepep_internode_dispatch_outputs(buf, &other_config, 10, 7, &mut o),
        "a cached dispatch needs the config the handle was made with",
    );
    assert_eq!(deepep_buffer_free(buf), DEEPEP_SUCCESS);
}

#[test]
fn cached_internode_dispatch_takes_the_handles_per_node_and_per_rank_entries() {
    // 4 ranks in 2 nodes of 2, where the handle's per-node entries ([N, C], [N]) and per-rank
    // ones ([R, C], [R]) differ in shape.
    let buf = buffer(1, 4, 2, 1 << 30);
    // SAFETY: plain old data; all-zero descriptors are absent.
    let mut a: DeepepInternodeDispatchArgs = unsafe { std::mem::zeroed() };
    a.x = described(DEEPEP_DTYPE_BFLOAT16, &[64, 2048], at(0));
    a.is_token_in_rank = described(DEEPEP_DTYPE_BOOL, &[64, 4], at(1));
    a.config = config();
    a.expert_alignment = 1;
    a.cached = 1;
    let c = (config().num_sms / 2) as i64;
    let mut o = DeepepOutputs::default();
    assert_eq!(deepep_internode_dispatch_handle_outputs(buf, &a, &mut o), DEEPEP_SUCCESS, "{}", last_error());
    a.rdma_channel_prefix_matrix = described(DEEPEP_DTYPE_INT32, &[2, c], at(2));
    a.gbl_channel_prefix_matrix = described(DEEPEP_DTYPE_INT32, &[4, c], at(3));
    a.recv_rdma_channel_prefix_matrix = DeepepTensor { data: at(4) as *mut _, ..o.tensors[2] };
    a.recv_rdma_rank_prefix_sum = described(DEEPEP_DTYPE_INT32, &[2], at(5));
    a.recv_gbl_channel_prefix_matrix = DeepepTensor { data: at(6) as *mut _, ..o.tensors[4] };
    a.recv_gbl_rank_prefix_sum = described(DEEPEP_DTYPE_INT32, &[4], at(7));
    assert_eq!(deepep_internode_dispatch_outputs(buf, &a, 10, 7, &mut o), DEEPEP_SUCCESS, "{}", last_error());
    let per_rank = DeepepInternodeDispatchArgs { recv_rdma_rank_prefix_sum: described(DEEPEP_DTYPE_INT32, &[4], at(5)), ..a };
    expect_err(deepep_internode_dispatch_outputs(buf, &per_rank, 10, 7, &mut o), "recv_rdma_rank_prefix_sum must have shape [2]");
    let per_node = DeepepInternodeDispatchArgs { gbl_channel_prefix_matrix: described(DEEPEP_DTYPE_INT32, &[2, c], at(3)), ..a };
    expect_err(deepep_internode_dispatch_outputs(buf, &per_node, 10, 7, &mut o), "gbl_channel_prefix_matrix must have shape [4, 12]");
    assert_eq!(deepep_buffer_free(buf), DEEPEP_SUCCESS);
}

#[test]
fn internode_ops_refuse_buffers_within_one_node_and_small_regions() {
    let one = buffer(0, 2, 2, 1 << 30);
    let a = dispatch_args_unchecked(2);
    let mut o = DeepepOutputs::default();
    expect_err(deepep_internode_dispatch_handle_outputs(one, &a, &mut o), "internode dispatch/combine need a buffer across nodes");
    assert_eq!(deepep_buffer_free(one), DEEPEP_SUCCESS);

    let small = buffer(0, 2, 1, 1 << 20);
    let a = dispatch_args(small, 64);
    expect_err(deepep_internode_dispatch_outputs(small, &a, 1, 1, &mut o), "num_rdma_bytes (1048576) is too small");
    assert_eq!(deepep_buffer_free(small), DEEPEP_SUCCESS);
}

fn dispatch_args_unchecked(t: i64) -> DeepepInternodeDispatchArgs {
    // SAFETY: plain old data; all-zero descriptors are absent.
    let mut a: DeepepInternodeDispatchArgs = unsafe { std::mem::zeroed() };
    a.x = described(DEEPEP_DTYPE_BFLOAT16, &[t, 2048], at(0));
    a.config = config();
    a
}

#[test]
fn internode_combine_describes_its_outputs_and_checks_the_handle() {
    let buf = buffer(0, 4, 2, 1 << 30);
    let (nr, t, n, g, r, c, k) = (50i64, 40i64, 2i64, 2i64, 4i64, 12i64, 8i64);
    let args = DeepepInternodeCombineArgs {
        x: described(DEEPEP_DTYPE_BFLOAT16, &[nr, 2048], at(0)),
        topk_weights: described(DEEPEP_DTYPE_FLOAT32, &[nr, k], at(1)),
        bias_0: described(DEEPEP_DTYPE_BFLOAT16, &[t, 2048], at(2)),
        bias_1: ABSENT,
        src_meta: described(DEEPEP_DTYPE_UINT8, &[nr, 8], at(3)),
        is_combined_token_in_rank: described(DEEPEP_DTYPE_BOOL, &[t, r], at(4)),
        rdma_channel_prefix_matrix: described(DEEPEP_DTYPE_INT32, &[n, c], at(5)),
        rdma_rank_prefix_sum: described(DEEPEP_DTYPE_INT32, &[n], at(6)),
        gbl_channel_prefix_matrix: described(DEEPEP_DTYPE_INT32, &[r, c], at(7)),
        combined_rdma_head: described(DEEPEP_DTYPE_INT32, &[t, n], at(8)),
        combined_nvl_head: described(DEEPEP_DTYPE_INT32, &[33, g], at(9)),
        combined_x: ABSENT,
        combined_topk_weights: ABSENT,
        config: config(),
    };
    let mut o = DeepepOutputs::default();
    assert_eq!(deepep_internode_combine_outputs(buf, &args, &mut o), DEEPEP_SUCCESS, "{}", last_error());
    assert_eq!((dims(&o.tensors[0]), dims(&o.tensors[1])), (vec![t, 2048], vec![t, k]));
    let filled = DeepepInternodeCombineArgs {
        combined_x: DeepepTensor { data: at(10) as *mut _, ..o.tensors[0] },
        combined_topk_weights: DeepepTensor { data: at(11) as *mut _, ..o.tensors[1] },
        ..args
    };
    assert_eq!(deepep_internode_combine(buf, &filled, ptr::null_mut()), DEEPEP_ERROR_NOT_AVAILABLE, "{}", last_error());
    let bad = DeepepInternodeCombineArgs { combined_nvl_head: described(DEEPEP_DTYPE_INT32, &[33, 8], at(9)), ..filled };
    expect_err(deepep_internode_combine(buf, &bad, ptr::null_mut()), "combined_nvl_head must have 2 columns");
    let bad = DeepepInternodeCombineArgs { gbl_channel_prefix_matrix: described(DEEPEP_DTYPE_INT32, &[r, 10], at(7)), ..filled };
    expect_err(deepep_internode_combine(buf, &bad, ptr::null_mut()), "combine must use the num_sms of the dispatch");
    let bad = DeepepInternodeCombineArgs { bias_0: described(DEEPEP_DTYPE_BFLOAT16, &[t + 1, 2048], at(2)), ..filled };
    expect_err(deepep_internode_combine(buf, &bad, ptr::null_mut()), "bias_0 must have shape");
    let bad = DeepepInternodeCombineArgs { src_meta: described(DEEPEP_DTYPE_UINT8, &[nr, 4], at(3)), ..filled };
    expect_err(deepep_internode_combine(buf, &bad, ptr::null_mut()), "src_meta must have shape [50, 8]");
    assert_eq!(deepep_buffer_free(buf), DEEPEP_SUCCESS);
}

#[test]
fn traffic_query_checks_its_tensor_and_needs_a_buffer_across_nodes() {
    let across = buffer(0, 4, 2, 1 << 30);
    let s = ptr::null_mut();
    let traffic = described(DEEPEP_DTYPE_INT64, &[8], at(0));
    // Valid arguments reach the resources, which this buffer has none of.
    assert_eq!(deepep_internode_query_traffic(across, &traffic, s), DEEPEP_ERROR_NOT_AVAILABLE, "{}", last_error());
    expect_err(deepep_internode_query_traffic(across, ptr::null(), s), "traffic");
    expect_err(deepep_internode_query_traffic(across, &described(DEEPEP_DTYPE_INT32, &[8], at(0)), s), "traffic");
    expect_err(deepep_internode_query_traffic(across, &described(DEEPEP_DTYPE_INT64, &[4], at(0)), s), "traffic");
    expect_err(deepep_internode_query_traffic(across, &described(DEEPEP_DTYPE_INT64, &[2, 4], at(0)), s), "traffic");
    let within = buffer(0, 4, 4, 1 << 30);
    expect_err(deepep_internode_query_traffic(within, &traffic, s), "only on a buffer across nodes");
    expect_err(deepep_internode_query_traffic(ptr::null(), &traffic, s), "buffer");
    assert_eq!(deepep_buffer_free(across), DEEPEP_SUCCESS);
    assert_eq!(deepep_buffer_free(within), DEEPEP_SUCCESS);
}

#[test]
fn internode_topology_limits_past_the_old_cap_and_errors_naming_the_limit() {
    // Past the old cap of 16 nodes (DeepEP's 20): nodes of 1 to 8 GPUs, as many as divide the world.
    for (n, g) in [(32, 1), (24, 2), (20, 3), (17, 8), (64, 8)] {
        let buf = buffer(0, n * g, g, 1 << 30);
        let a = dispatch_args_unchecked(16);
        let mut o = DeepepOutputs::default();
        assert_eq!(deepep_internode_dispatch_handle_outputs(buf, &a, &mut o), DEEPEP_SUCCESS, "{n}x{g}: {}", last_error());
        assert_eq!(dims(&o.tensors[0]), vec![n as i64, 12], "{n}x{g}: rdma_channel_prefix_matrix [N, C]");
        assert_eq!(deepep_buffer_free(buf), DEEPEP_SUCCESS);
    }
    let mut o = DeepepOutputs::default();
    let wide = buffer(0, 18, 9, 1 << 30);
    expect_err(
        deepep_internode_dispatch_handle_outputs(wide, &dispatch_args_unchecked(16), &mut o),
        "support nodes of up to 8 GPUs (an NVLink domain of DeepEP's size), the buffer's have 9",
    );
    assert_eq!(deepep_buffer_free(wide), DEEPEP_SUCCESS);
    let many = buffer(0, 4097, 1, 1 << 30);
    expect_err(
        deepep_internode_dispatch_handle_outputs(many, &dispatch_args_unchecked(16), &mut o),
        "support up to 4096 nodes (combine keeps 8 bytes of shared memory per node), the buffer has 4097",
    );
    assert_eq!(deepep_buffer_free(many), DEEPEP_SUCCESS);
}
