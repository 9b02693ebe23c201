//! C ABI contract tests that need no GPU: status codes, last-error messages,
//! NULL handling, argument checks, version queries, config helpers.
use std::ffi::CStr;
use std::ptr;

use deepep_nccl::capi::*;
use deepep_nccl::config::DeepepConfig;
use deepep_nccl::error::DeepepStatus::{self, *};
use deepep_nccl::tensor::{DeepepDtype, DeepepTensor};

fn last_error() -> String {
    unsafe { CStr::from_ptr(deepep_last_error()) }.to_string_lossy().into_owned()
}

fn expect_err(status: DeepepStatus, expected: DeepepStatus, needle: &str) {
    assert_eq!(status, expected, "last error: {}", last_error());
    let msg = last_error();
    assert!(msg.contains(needle), "expected {needle:?} in {msg:?}");
}

fn gpu_present() -> bool {
    let mut n = 0;
    deepep_device_count(&mut n) == DEEPEP_SUCCESS && n > 0
}

#[test]
fn versions_are_reported_and_consistent() {
    assert_eq!(deepep_abi_version(), DEEPEP_ABI_VERSION);
    let lib = unsafe { CStr::from_ptr(deepep_library_version()) }.to_str().unwrap();
    assert_eq!(lib, env!("CARGO_PKG_VERSION"));
    let mut runtime = 0;
    assert_eq!(deepep_nccl_runtime_version(&mut runtime), DEEPEP_SUCCESS);
    let compiled = deepep_nccl_compiled_version();
    assert!(compiled >= 22800, "compiled NCCL {compiled}");
    assert_eq!(compiled / 100, runtime / 100, "kernels built for {compiled}, process has {runtime}");
    expect_err(deepep_nccl_runtime_version(ptr::null_mut()), DEEPEP_ERROR_INVALID_ARGUMENT, "out must not be NULL");
}

#[test]
fn last_error_is_set_on_failure_and_cleared_on_success() {
    expect_err(deepep_check_buffer_args(0, 4, 100, 0, false), DEEPEP_ERROR_INVALID_ARGUMENT, "num_nvl_bytes (100)");
    assert_eq!(deepep_check_buffer_args(0, 4, 128, 0, false), DEEPEP_SUCCESS);
    assert_eq!(last_error(), "");
}

#[test]
fn status_strings_name_every_code() {
    let name = |s: i32| unsafe { CStr::from_ptr(deepep_status_string(s)) }.to_str().unwrap().to_owned();
    assert_eq!(name(0), "DEEPEP_SUCCESS");
    assert_eq!(name(DEEPEP_ERROR_TIMEOUT as i32), "DEEPEP_ERROR_TIMEOUT");
    assert_eq!(name(9), "DEEPEP_ERROR_INTERNAL");
    assert_eq!(name(42), "DEEPEP_UNKNOWN_STATUS");
}

fn abi_constant(name: &str) -> Result<i64, DeepepStatus> {
    let c_name = std::ffi::CString::new(name).unwrap();
    let mut value = i64::MIN;
    match deepep_abi_constant(c_name.as_ptr(), &mut value) {
        DEEPEP_SUCCESS => Ok(value),
        status => Err(status),
    }
}

#[test]
fn abi_constants_are_readable_by_name() {
    assert_eq!(abi_constant("DEEPEP_ABI_VERSION"), Ok(DEEPEP_ABI_VERSION as i64));
    assert_eq!(abi_constant("DEEPEP_MAX_LOCAL_EXPERTS"), Ok(DEEPEP_MAX_LOCAL_EXPERTS as i64));
    assert_eq!(abi_constant("DEEPEP_NUM_MAX_NVL_PEERS"), Ok(8));
    assert_eq!(abi_constant("DEEPEP_LL_PHASE_BOTH"), Ok(3));
    assert_eq!(abi_constant("DEEPEP_ERROR_TIMEOUT"), Ok(DEEPEP_ERROR_TIMEOUT as i64));
    assert_eq!(abi_constant("DEEPEP_DTYPE_BFLOAT16"), Ok(DeepepDtype::DEEPEP_DTYPE_BFLOAT16 as i64));
    assert_eq!(abi_constant("DEEPEP_NO_SUCH_THING"), Err(DEEPEP_ERROR_INVALID_ARGUMENT));
    assert!(last_error().contains("\"DEEPEP_NO_SUCH_THING\""), "{}", last_error());
    let mut value = 0;
    expect_err(deepep_abi_constant(ptr::null(), &mut value), DEEPEP_ERROR_INVALID_ARGUMENT, "name must not be NULL");
    expect_err(
        deepep_abi_constant(c"DEEPEP_MAX_DIMS".as_ptr(), ptr::null_mut()),
        DEEPEP_ERROR_INVALID_ARGUMENT,
        "out must not be NULL",
    );
}

#[test]
fn every_constant_of_the_committed_header_is_readable() {
    let header = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/include/deepep_nccl.h")).unwrap();
    let mut checked = 0;
    for line in header.lines().map(str::trim) {
        // `#define NAME VALUE` (the include guard has no value) and enumerators `NAME = VALUE,`.
        let (name, value) = if let Some(define) = line.strip_prefix("#define ") {
            match define.split_once(' ') {
                Some(pair) => pair,
                None => continue,
            }
        } else if let Some((name, value)) = line.strip_suffix(',').and_then(|l| l.split_once(" = ")) {
            (name, value)
        } else {
            continue;
        };
        assert!(name.starts_with("DEEPEP_"), "unexpected public name {name}");
        let read = abi_constant(name).unwrap_or_else(|_| panic!("{name}: {}", last_error()));
        // Expressions such as (DEEPEP_LL_PHASE_SEND | DEEPEP_LL_PHASE_RECV) are checked by name only.
        if let Ok(literal) = value.parse::<i64>() {
            assert_eq!(read, literal, "{name}");
        }
        checked += 1;
    }
    // At least 8 #defines, 10 statuses, 8 dtypes, 2 config kinds: the parse found them.
    assert!(checked >= 28, "only {checked} constants found in the header");
}

#[test]
fn unique_id_needs_room_and_fills_it() {
    let mut id = [0u8; DEEPEP_UNIQUE_ID_BYTES];
    expect_err(deepep_get_unique_id(id.as_mut_ptr(), 16), DEEPEP_ERROR_INVALID_ARGUMENT, "len must be >= 128");
    expect_err(deepep_get_unique_id(ptr::null_mut(), 128), DEEPEP_ERROR_INVALID_ARGUMENT, "out must not be NULL");
    assert_eq!(deepep_get_unique_id(id.as_mut_ptr(), id.len()), DEEPEP_SUCCESS, "{}", last_error());
    assert!(id.iter().any(|b| *b != 0));
}

#[test]
fn buffer_create_checks_arguments_before_touching_the_gpu() {
    let id = [0u8; DEEPEP_UNIQUE_ID_BYTES];
    let mut buf = ptr::null_mut();
    let create = |rank, ranks, nvl, rdma, ll, id: *const u8, len, out| {
        deepep_buffer_create(rank, ranks, id, len, nvl, rdma, ll, false, false, out)
    };
    expect_err(create(0, 4, 1000, 0, false, id.as_ptr(), 128, &mut buf), DEEPEP_ERROR_INVALID_ARGUMENT, "multiple of 128");
    expect_err(create(5, 4, 0, 0, false, id.as_ptr(), 128, &mut buf), DEEPEP_ERROR_INVALID_ARGUMENT, "rank must be in [0, num_ranks=4)");
    expect_err(create(0, 12, 0, 0, false, id.as_ptr(), 128, &mut buf), DEEPEP_ERROR_INVALID_ARGUMENT, "multiple of 8");
    expect_err(create(0, 2, 0, 1 << 20, false, id.as_ptr(), 128, &mut buf), DEEPEP_ERROR_INVALID_ARGUMENT, "low_latency_mode");
    expect_err(create(0, 2, 0, 0, false, ptr::null(), 128, &mut buf), DEEPEP_ERROR_INVALID_ARGUMENT, "unique_id must not be NULL");
    expect_err(create(0, 2, 0, 0, false, id.as_ptr(), 64, &mut buf), DEEPEP_ERROR_INVALID_ARGUMENT, "unique_id must be 128 bytes");
    expect_err(create(0, 2, 0, 0, false, id.as_ptr(), 128, ptr::null_mut()), DEEPEP_ERROR_INVALID_ARGUMENT, "out must not be NULL");
    assert!(buf.is_null());
}

#[test]
fn buffer_create_without_a_gpu_is_a_clean_no_device_error() {
    if gpu_present() {
        eprintln!("GPU present: the no-GPU path is covered by the GPU suite instead");
        return;
    }
    let mut id = [0u8; DEEPEP_UNIQUE_ID_BYTES];
    assert_eq!(deepep_get_unique_id(id.as_mut_ptr(), id.len()), DEEPEP_SUCCESS);
    let mut buf = ptr::null_mut();
    let status = deepep_buffer_create(0, 1, id.as_ptr(), id.len(), 1 << 20, 0, false, true, false, &mut buf);
    expect_err(status, DEEPEP_ERROR_NO_DEVICE, "CUDA");
    assert!(buf.is_null());
    let mut n = -1;
    assert_eq!(deepep_device_count(&mut n), DEEPEP_ERROR_NO_DEVICE);
    assert_eq!(n, 0);
}

#[test]
fn null_buffer_handles_are_rejected_everywhere() {
    let mut i = 0;
    let mut b = false;
    let mut p = ptr::null_mut();
    let mut bytes = 0i64;
    let null = ptr::null_mut();
    for status in [
        deepep_buffer_get_rank(null, &mut i),
        deepep_buffer_get_num_ranks(null, &mut i),
        deepep_buffer_get_num_rdma_ranks(null, &mut i),
        deepep_buffer_get_rdma_rank(null, &mut i),
        deepep_buffer_get_root_rdma_rank(null, true, &mut i),
        deepep_buffer_get_local_device_id(null, &mut i),
        deepep_buffer_get_num_device_sms(null, &mut i),
        deepep_buffer_is_available(null, &mut b),
        deepep_buffer_get_local_buffer(null, false, &mut p, &mut bytes),
        deepep_buffer_get_comm_stream(null, &mut p),
        deepep_buffer_barrier(null),
        deepep_buffer_check_peers(null),
        deepep_buffer_set_gpu_timeout_ms(null, 10),
        deepep_buffer_destroy(null),
    ] {
        expect_err(status, DEEPEP_ERROR_INVALID_ARGUMENT, "buffer must not be NULL");
    }
    assert_eq!(deepep_buffer_free(null), DEEPEP_SUCCESS);
}

#[test]
fn layout_on_a_null_buffer_is_an_error_not_a_crash() {
    let t = DeepepTensor { data: ptr::null_mut(), dtype: DeepepDtype::DEEPEP_DTYPE_INT64 as i32, ndim: 2, shape: [0; 4], strides: [1; 4] };
    let status = deepep_get_dispatch_layout(ptr::null(), &t, 8, &t, ptr::null(), &t, &t, ptr::null_mut());
    expect_err(status, DEEPEP_ERROR_INVALID_ARGUMENT, "must not be NULL");
}

#[test]
fn config_helpers_follow_deepep() {
    let mut cfg = DeepepConfig { num_sms: 0, num_max_nvl_chunked_send_tokens: 0, num_max_nvl_chunked_recv_tokens: 0, num_max_rdma_chunked_send_tokens: 0, num_max_rdma_chunked_recv_tokens: 0 };
    assert_eq!(deepep_config_default(&mut cfg, DeepepConfigKind::DEEPEP_CONFIG_DISPATCH as i32, 4, 20), DEEPEP_SUCCESS);
    assert_eq!(cfg.num_max_nvl_chunked_send_tokens, 6);
    let mut hint = 0i64;
    assert_eq!(deepep_config_nvl_buffer_size_hint(&cfg, 14336, 4, &mut hint), DEEPEP_SUCCESS);
    assert_eq!(hint, 167_854_976); // DeepEP's worked value for EP4, hidden 7168 BF16
    assert_eq!(deepep_config_rdma_buffer_size_hint(&cfg, 14336, 4, &mut hint), DEEPEP_SUCCESS);
    assert_eq!(hint, 0);
    expect_err(deepep_config_default(&mut cfg, 7, 4, 20), DEEPEP_ERROR_INVALID_ARGUMENT, "kind must be");
    expect_err(deepep_config_default(&mut cfg, 0, 6, 20), DEEPEP_ERROR_INVALID_ARGUMENT, "Unsupported number of EP ranks: 6");
    expect_err(deepep_config_init(&mut cfg, 20, 8, 8, 6, 128), DEEPEP_ERROR_INVALID_ARGUMENT, "nvl_chunked_send_tokens (8)");
    assert_eq!(deepep_config_init(&mut cfg, 24, 8, 256, 16, 130), DEEPEP_SUCCESS);
    assert_eq!(cfg.num_max_rdma_chunked_recv_tokens, 144);
    expect_err(deepep_config_nvl_buffer_size_hint(ptr::null(), 1, 2, &mut hint), DEEPEP_ERROR_INVALID_ARGUMENT, "config must not be NULL");
    assert_eq!(deepep_low_latency_rdma_size_hint(128, 7168, 8, 288, &mut hint), DEEPEP_SUCCESS);
    assert_eq!(hint, 2_146_961_792);
    expect_err(deepep_low_latency_rdma_size_hint(0, 7168, 8, 288, &mut hint), DEEPEP_ERROR_INVALID_ARGUMENT, "num_max_dispatch_tokens_per_rank");
}

#[test]
fn normal_ring_slots_hold_a_row_on_whole_cache_lines() {
    // (hidden_bytes, num_scales, num_topk): BF16 and FP8 rows of hidden 7168, top-8; odd sizes.
    for (hidden, scales, topk) in [(14336i64, 0, 8), (7168, 56, 8), (2 * 4096, 0, 6), (100, 3, 1), (14336, 0, 0)] {
        let align16 = |n: i64| (n + 15) / 16 * 16;
        let mut dispatch = 0i64;
        assert_eq!(deepep_normal_dispatch_slot_bytes(hidden, scales, topk, &mut dispatch), DEEPEP_SUCCESS);
        let mut combine = 0i64;
        assert_eq!(deepep_normal_combine_slot_bytes(hidden, topk, &mut combine), DEEPEP_SUCCESS);
        // A 128-byte header (the flag), then the 16-byte-aligned payload; slots on 128-byte lines.
        let dispatch_payload = 128 + align16(hidden) + align16(scales as i64 * 4) + 2 * align16(topk as i64 * 4);
        let combine_payload = 128 + align16(hidden) + align16(topk as i64 * 4);
        for (slot, payload) in [(dispatch, dispatch_payload), (combine, combine_payload)] {
            assert_eq!(slot % 128, 0, "slot {slot} for {hidden} / {scales} / {topk}");
            assert!(slot >= payload && slot < payload + 128, "slot {slot}, payload {payload}");
        }
    }
    let mut out = 0i64;
    expect_err(deepep_normal_dispatch_slot_bytes(0, 0, 8, &mut out), DEEPEP_ERROR_INVALID_ARGUMENT, "hidden_bytes must be in [1, 2147483647], got 0");
    expect_err(deepep_normal_dispatch_slot_bytes(1 << 31, 0, 8, &mut out), DEEPEP_ERROR_INVALID_ARGUMENT, "hidden_bytes");
    expect_err(deepep_normal_dispatch_slot_bytes(14336, -1, 8, &mut out), DEEPEP_ERROR_INVALID_ARGUMENT, "num_scales must be in [0,");
    expect_err(deepep_normal_combine_slot_bytes(14336, -2, &mut out), DEEPEP_ERROR_INVALID_ARGUMENT, "num_topk must be in [0,");
    expect_err(deepep_normal_combine_slot_bytes(14336, 8, ptr::null_mut()), DEEPEP_ERROR_INVALID_ARGUMENT, "out must not be NULL");
}

#[test]
fn low_latency_shapes_are_checked_without_a_buffer() {
    assert_eq!(deepep_low_latency_check_shape(128, 7168, 4, 288), DEEPEP_SUCCESS);
    assert_eq!(deepep_low_latency_check_shape(1024, 6400, 32, 256), DEEPEP_SUCCESS);
    let limit = "num_max_dispatch_tokens_per_rank must be in [1, 1024], got";
    expect_err(deepep_low_latency_check_shape(1025, 7168, 4, 288), DEEPEP_ERROR_INVALID_ARGUMENT, limit);
    expect_err(deepep_low_latency_check_shape(1_000_000, 7168, 4, 288), DEEPEP_ERROR_INVALID_ARGUMENT, "got 1000000");
    expect_err(deepep_low_latency_check_shape(0, 7168, 4, 288), DEEPEP_ERROR_INVALID_ARGUMENT, limit);
    expect_err(deepep_low_latency_check_shape(128, 7000, 4, 288), DEEPEP_ERROR_INVALID_ARGUMENT, "multiple of 128");
    expect_err(deepep_low_latency_check_shape(128, 7168, 5, 288), DEEPEP_ERROR_INVALID_ARGUMENT, "divisible by the number of ranks");
    expect_err(deepep_low_latency_check_shape(128, 7168, 0, 288), DEEPEP_ERROR_INVALID_ARGUMENT, "num_ranks must be positive");
}

#[test]
fn committed_header_declares_every_exported_function() {
    let header = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/include/deepep_nccl.h")).unwrap();
    let source: String = ["mod.rs", "buffer.rs", "config.rs"]
        .iter()
        .map(|f| std::fs::read_to_string(format!("{}/src/capi/{f}", env!("CARGO_MANIFEST_DIR"))).unwrap())
        .collect();
    let exported: Vec<&str> = source
        .split("pub extern \"C\" fn ")
        .skip(1)
        .map(|rest| rest.split('(').next().unwrap())
        .collect();
    assert!(exported.len() >= 25, "found only {} exports", exported.len());
    for name in exported {
        assert!(header.contains(&format!("{name}(")), "include/deepep_nccl.h lacks {name}: rebuild to regenerate it");
    }
}

#[test]
fn normal_mode_calls_reject_null_handles_and_arguments() {
    use deepep_nccl::normal::combine::DeepepIntranodeCombineArgs;
    use deepep_nccl::normal::dispatch::{DeepepIntranodeDispatchArgs, DeepepIntranodeDispatchOutputs};
    let absent = DeepepTensor { data: ptr::null_mut(), dtype: 0, ndim: 0, shape: [0; 4], strides: [0; 4] };
    let config = DeepepConfig::new(24, 6, 256, 6, 128).unwrap();
    let args = DeepepIntranodeDispatchArgs {
        x: absent,
        x_scales: absent,
        topk_idx: absent,
        topk_weights: absent,
        num_tokens_per_rank: absent,
        is_token_in_rank: absent,
        num_tokens_per_expert: absent,
        rank_prefix_matrix: absent,
        channel_prefix_matrix: absent,
        recv_channel_prefix_matrix: absent,
        send_head: absent,
        config,
        cached: 0,
        expert_alignment: 1,
        num_worst_tokens: 0,
        reserved: 0,
    };
    let outs = DeepepIntranodeDispatchOutputs {
        recv_x: absent,
        recv_x_scales: absent,
        recv_topk_idx: absent,
        recv_topk_weights: absent,
        recv_src_idx: absent,
    };
    let combine = DeepepIntranodeCombineArgs {
        x: absent,
        topk_weights: absent,
        bias_0: absent,
        bias_1: absent,
        src_idx: absent,
        rank_prefix_matrix: absent,
        channel_prefix_matrix: absent,
        send_head: absent,
        combined_x: absent,
        combined_topk_weights: absent,
        config,
    };
    let mut n = 7;
    expect_err(
        deepep_intranode_dispatch_prepare(ptr::null(), &args, &mut n, ptr::null_mut(), 0, ptr::null_mut()),
        DEEPEP_ERROR_INVALID_ARGUMENT,
        "buffer must not be NULL",
    );
    assert_eq!(n, -1, "num_recv_tokens is -1 unless the call waited for it");
    expect_err(
        deepep_intranode_dispatch_prepare(ptr::null(), &args, ptr::null_mut(), ptr::null_mut(), 0, ptr::null_mut()),
        DEEPEP_ERROR_INVALID_ARGUMENT,
        "num_recv_tokens must not be NULL",
    );
    expect_err(
        deepep_intranode_dispatch(ptr::null(), &args, &outs, ptr::null_mut()),
        DEEPEP_ERROR_INVALID_ARGUMENT,
        "buffer must not be NULL",
    );
    expect_err(
        deepep_intranode_dispatch_fused(ptr::null(), &args, &outs, ptr::null_mut()),
        DEEPEP_ERROR_INVALID_ARGUMENT,
        "buffer must not be NULL",
    );
    expect_err(deepep_intranode_combine(ptr::null(), &combine, ptr::null_mut()), DEEPEP_ERROR_INVALID_ARGUMENT, "buffer must not be NULL");
}

#[test]
fn low_latency_output_queries_reject_null_and_describe_nothing() {
    use deepep_nccl::outputs::DeepepOutputs;
    let mut o = DeepepOutputs { count: 3, ..DeepepOutputs::default() };
    expect_err(deepep_low_latency_dispatch_outputs(ptr::null(), 128, 7168, 288, true, false, &mut o), DEEPEP_ERROR_INVALID_ARGUMENT, "buffer must not be NULL");
    assert_eq!((o.count, o.num_allocations), (0, 0), "a failed query describes no outputs");
    o.count = 3;
    expect_err(deepep_low_latency_combine_outputs(ptr::null(), 17, 7168, &mut o), DEEPEP_ERROR_INVALID_ARGUMENT, "buffer must not be NULL");
    assert_eq!(o.count, 0);
    expect_err(deepep_low_latency_dispatch_outputs(ptr::null(), 128, 7168, 288, true, false, ptr::null_mut()), DEEPEP_ERROR_INVALID_ARGUMENT, "out must not be NULL");
    expect_err(deepep_low_latency_combine_outputs(ptr::null(), 17, 7168, ptr::null_mut()), DEEPEP_ERROR_INVALID_ARGUMENT, "out must not be NULL");
    // The zero-copy view is a whole descriptor now, all zero on failure.
    let mut view = DeepepTensor { data: 0x1000 as *mut _, dtype: 6, ndim: 3, shape: [1; 4], strides: [1; 4] };
    expect_err(deepep_get_next_low_latency_combine_buffer(ptr::null(), 128, 7168, 288, &mut view), DEEPEP_ERROR_INVALID_ARGUMENT, "buffer must not be NULL");
    assert!(view.data.is_null() && view.dtype == 0 && view.ndim == 0 && view.shape == [0; 4]);
    expect_err(deepep_get_next_low_latency_combine_buffer(ptr::null(), 128, 7168, 288, ptr::null_mut()), DEEPEP_ERROR_INVALID_ARGUMENT, "out must not be NULL");
}

#[test]
fn output_queries_name_null_arguments_and_zero_their_output() {
    use deepep_nccl::normal::combine::DeepepIntranodeCombineArgs;
    use deepep_nccl::normal::dispatch::DeepepIntranodeDispatchArgs;
    use deepep_nccl::outputs::DeepepOutputs;
    // SAFETY: both argument structs are plain old data (descriptors, ints); all-zero is all absent.
    let dispatch: DeepepIntranodeDispatchArgs = unsafe { std::mem::zeroed() };
    let combine: DeepepIntranodeCombineArgs = unsafe { std::mem::zeroed() };
    let null = ptr::null();
    let mut out = DeepepOutputs::default();
    let queries: [(&str, &dyn Fn(*mut DeepepOutputs, bool) -> DeepepStatus); 4] = [
        ("layout", &|o, _| deepep_get_dispatch_layout_outputs(null, 16, 8, o)),
        ("handle", &|o, with_args| deepep_intranode_dispatch_handle_outputs(null, if with_args { &dispatch } else { ptr::null() }, o)),
        ("dispatch", &|o, with_args| deepep_intranode_dispatch_outputs(null, if with_args { &dispatch } else { ptr::null() }, 5, o)),
        ("combine", &|o, with_args| deepep_intranode_combine_outputs(null, if with_args { &combine } else { ptr::null() }, o)),
    ];
    for (what, query) in queries {
        out.count = 3; // a failed query leaves count 0
        expect_err(query(&mut out, true), DEEPEP_ERROR_INVALID_ARGUMENT, "buffer must not be NULL");
        assert_eq!((out.count, out.num_allocations), (0, 0), "{what}");
        expect_err(query(ptr::null_mut(), true), DEEPEP_ERROR_INVALID_ARGUMENT, "out must not be NULL");
        if what != "layout" {
            expect_err(query(&mut out, false), DEEPEP_ERROR_INVALID_ARGUMENT, "args must not be NULL");
        }
    }
}

#[test]
fn dtype_sizes_come_from_the_library() {
    assert_eq!(deepep_dtype_size(DeepepDtype::DEEPEP_DTYPE_BFLOAT16 as i32), 2);
    assert_eq!(deepep_dtype_size(DeepepDtype::DEEPEP_DTYPE_INT64 as i32), 8);
    assert_eq!(deepep_dtype_size(DeepepDtype::DEEPEP_DTYPE_FLOAT8_E4M3 as i32), 1);
    assert_eq!(deepep_dtype_size(0), 0);
    assert_eq!(deepep_dtype_size(99), 0);
}

// --- Buffer handles: values checked against the library's registry, never dereferenced ---------

use deepep_nccl::buffer::BufferArgs;

fn host_only_buffer(rank: i32, num_ranks: i32, low_latency_mode: bool) -> *mut DeepepBuffer {
    let args = BufferArgs {
        rank,
        num_ranks,
        num_nvl_bytes: 1 << 30,
        num_rdma_bytes: if low_latency_mode { 1 << 30 } else { 0 },
        low_latency_mode,
        explicitly_destroy: false,
        enable_shrink: true,
    };
    testing::buffer_without_resources(args, 132)
}

/// Every C ABI entry that takes a buffer handle except deepep_buffer_free, called with `buf` and
/// benign other arguments (valid out-params, all-absent args structs): (name, status, message).
fn every_buffer_entry(buf: *mut DeepepBuffer) -> Vec<(&'static str, DeepepStatus, String)> {
    use deepep_nccl::ll::combine::DeepepLowLatencyCombineArgs;
    use deepep_nccl::ll::dispatch::DeepepLowLatencyDispatchArgs;
    use deepep_nccl::normal::combine::DeepepIntranodeCombineArgs;
    use deepep_nccl::normal::dispatch::{DeepepIntranodeDispatchArgs, DeepepIntranodeDispatchOutputs};
    use deepep_nccl::outputs::DeepepOutputs;
    // SAFETY: plain old data of ints and descriptors; all-zero is all absent.
    let (ll_dispatch, ll_combine, dispatch, outputs, combine): (
        DeepepLowLatencyDispatchArgs,
        DeepepLowLatencyCombineArgs,
        DeepepIntranodeDispatchArgs,
        DeepepIntranodeDispatchOutputs,
        DeepepIntranodeCombineArgs,
    ) = unsafe { (std::mem::zeroed(), std::mem::zeroed(), std::mem::zeroed(), std::mem::zeroed(), std::mem::zeroed()) };
    let t = DeepepTensor { data: ptr::null_mut(), dtype: 0, ndim: 0, shape: [0; 4], strides: [0; 4] };
    let (mut i, mut flag, mut p, mut n, mut o, mut view, mut list) =
        (0i32, false, ptr::null_mut(), 0i64, DeepepOutputs::default(), t, [0i32; 4]);
    let s = ptr::null_mut();
    let mut calls = Vec::new();
    // Each call's status and this thread's message, read right after it.
    macro_rules! call {
        ($name:expr, $status:expr) => {{
            let status = $status;
            calls.push(($name, status, last_error()));
        }};
    }
    call!("destroy", deepep_buffer_destroy(buf));
    call!("get_rank", deepep_buffer_get_rank(buf, &mut i));
    call!("get_num_ranks", deepep_buffer_get_num_ranks(buf, &mut i));
    call!("get_num_rdma_ranks", deepep_buffer_get_num_rdma_ranks(buf, &mut i));
    call!("get_rdma_rank", deepep_buffer_get_rdma_rank(buf, &mut i));
    call!("get_local_device_id", deepep_buffer_get_local_device_id(buf, &mut i));
    call!("get_num_device_sms", deepep_buffer_get_num_device_sms(buf, &mut i));
    call!("get_root_rdma_rank", deepep_buffer_get_root_rdma_rank(buf, true, &mut i));
    call!("is_available", deepep_buffer_is_available(buf, &mut flag));
    call!("get_local_buffer", deepep_buffer_get_local_buffer(buf, false, &mut p, &mut n));
    call!("get_comm_stream", deepep_buffer_get_comm_stream(buf, &mut p));
    call!("barrier", deepep_buffer_barrier(buf));
    call!("check_peers", deepep_buffer_check_peers(buf));
    call!("set_gpu_timeout_ms", deepep_buffer_set_gpu_timeout_ms(buf, 10));
    call!("get_dispatch_layout", deepep_get_dispatch_layout(buf, &t, 8, &t, ptr::null(), &t, &t, s));
    call!("get_dispatch_layout_outputs", deepep_get_dispatch_layout_outputs(buf, 16, 8, &mut o));
    call!("low_latency_dispatch_outputs", deepep_low_latency_dispatch_outputs(buf, 128, 7168, 288, false, false, &mut o));
    call!("low_latency_combine_outputs", deepep_low_latency_combine_outputs(buf, 16, 7168, &mut o));
    call!("low_latency_dispatch", deepep_low_latency_dispatch(buf, &ll_dispatch, s, &mut i));
    call!("low_latency_combine", deepep_low_latency_combine(buf, &ll_combine, s, &mut i));
    call!("clean_low_latency_buffer", deepep_clean_low_latency_buffer(buf, 128, 7168, 288, s));
    call!("get_next_low_latency_combine_buffer", deepep_get_next_low_latency_combine_buffer(buf, 128, 7168, 288, &mut view));
    call!("low_latency_update_mask_buffer", deepep_low_latency_update_mask_buffer(buf, 0, true, s));
    call!("low_latency_query_mask_buffer", deepep_low_latency_query_mask_buffer(buf, &t, s));
    call!("low_latency_clean_mask_buffer", deepep_low_latency_clean_mask_buffer(buf, s));
    call!("normal_query_dropped", deepep_normal_query_dropped(buf, &t, s));
    call!("intranode_dispatch_prepare", deepep_intranode_dispatch_prepare(buf, &dispatch, &mut i, list.as_mut_ptr(), 4, s));
    call!("intranode_dispatch", deepep_intranode_dispatch(buf, &dispatch, &outputs, s));
    call!("intranode_dispatch_fused", deepep_intranode_dispatch_fused(buf, &dispatch, &outputs, s));
    call!("intranode_combine", deepep_intranode_combine(buf, &combine, s));
    call!("intranode_dispatch_handle_outputs", deepep_intranode_dispatch_handle_outputs(buf, &dispatch, &mut o));
    call!("intranode_dispatch_outputs", deepep_intranode_dispatch_outputs(buf, &dispatch, 5, &mut o));
    call!("intranode_combine_outputs", deepep_intranode_combine_outputs(buf, &combine, &mut o));
    {
        use deepep_nccl::internode::combine::DeepepInternodeCombineArgs;
        use deepep_nccl::internode::dispatch::{DeepepInternodeDispatchArgs, DeepepInternodeDispatchOutputs};
        // SAFETY: as above.
        let (dispatch, outputs, combine): (DeepepInternodeDispatchArgs, DeepepInternodeDispatchOutputs, DeepepInternodeCombineArgs) =
            unsafe { (std::mem::zeroed(), std::mem::zeroed(), std::mem::zeroed()) };
        let mut j = 0i32;
        call!("internode_dispatch_prepare", deepep_internode_dispatch_prepare(buf, &dispatch, &mut i, &mut j, list.as_mut_ptr(), 4, s));
        call!("internode_dispatch", deepep_internode_dispatch(buf, &dispatch, &outputs, s));
        call!("internode_combine", deepep_internode_combine(buf, &combine, s));
        call!("internode_dispatch_handle_outputs", deepep_internode_dispatch_handle_outputs(buf, &dispatch, &mut o));
        call!("internode_dispatch_outputs", deepep_internode_dispatch_outputs(buf, &dispatch, 5, 3, &mut o));
        call!("internode_combine_outputs", deepep_internode_combine_outputs(buf, &combine, &mut o));
        call!("internode_query_traffic", deepep_internode_query_traffic(buf, &t, s));
    }
    calls
}

#[test]
fn every_entry_taking_a_buffer_handle_is_exercised() {
    let header = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/include/deepep_nccl.h")).unwrap();
    let in_header = header.matches("(const DeepepBuffer *buf").count() + header.matches("(DeepepBuffer *buf").count();
    // every_buffer_entry calls all of them but deepep_buffer_free, which the tests below call.
    assert_eq!(every_buffer_entry(ptr::null_mut()).len() + 1, in_header, "a new entry takes a buffer handle: add it");
}

#[test]
fn null_made_up_freed_and_twice_freed_handles_are_named_errors_everywhere() {
    let live = host_only_buffer(1, 4, true);
    let mut rank = -1;
    assert_eq!(deepep_buffer_get_rank(live, &mut rank), DEEPEP_SUCCESS, "{}", last_error());
    assert_eq!(rank, 1);
    let freed = host_only_buffer(0, 2, false);
    assert_eq!(deepep_buffer_free(freed), DEEPEP_SUCCESS, "{}", last_error());
    let local = 0u64;
    let live_bits = live as usize;
    let made_up: [(usize, &str); 7] = [
        (0x1, "was never created: it is not a deepep-nccl handle"),
        (0xdead_beef, "was never created: it is not a deepep-nccl handle"),
        (&local as *const u64 as usize, "was never created: it is not a deepep-nccl handle"),
        (usize::MAX, "was never created: it is not a deepep-nccl handle"),
        // A live handle's tag and kind with a generation its slot never had.
        (live_bits + (1 << 20), "was never created: deepep_buffer_create gave out no buffer handle"),
        // ... with a slot never used.
        ((live_bits & !0xffff) | 0xfff0, "was never created: deepep_buffer_create gave out no buffer handle"),
        // ... with a kind byte that is no handle kind.
        (live_bits ^ (0x80 << 40), "was never created: it has no valid handle kind"),
    ];
    let mut cases: Vec<(usize, String)> = vec![(0, "buffer must not be NULL".into())];
    cases.push((freed as usize, format!("buffer ({:#x}) was destroyed: deepep_buffer_free released this buffer handle", freed as usize)));
    cases.extend(made_up.iter().map(|(h, m)| (*h, format!("buffer ({h:#x}) {m}"))));
    for (handle, message) in &cases {
        let handle = *handle as *mut DeepepBuffer;
        for (name, status, error) in every_buffer_entry(handle) {
            assert_eq!(status, DEEPEP_ERROR_INVALID_ARGUMENT, "{name}({handle:p}): {error}");
            let message = if handle.is_null() { "buffer must not be NULL" } else { message };
            assert!(error.contains(message), "{name}({handle:p}): {error:?} lacks {message:?}");
        }
        if handle.is_null() {
            assert_eq!(deepep_buffer_free(handle), DEEPEP_SUCCESS, "free(NULL) is a no-op");
        } else {
            expect_err(deepep_buffer_free(handle), DEEPEP_ERROR_INVALID_ARGUMENT, message);
        }
    }
    // None of that touched the live handle.
    assert_eq!(deepep_buffer_get_rank(live, &mut rank), DEEPEP_SUCCESS, "{}", last_error());
    assert_eq!(deepep_buffer_free(live), DEEPEP_SUCCESS);
    expect_err(deepep_buffer_free(live), DEEPEP_ERROR_INVALID_ARGUMENT, "was destroyed");
}

#[test]
fn a_live_handle_reaches_argument_checks_and_never_the_gpu() {
    for low_latency in [false, true] {
        let buf = host_only_buffer(0, 8, low_latency);
        let mut n = 0;
        assert_eq!(deepep_buffer_get_num_ranks(buf, &mut n), DEEPEP_SUCCESS);
        assert_eq!(n, 8);
        let mut available = true;
        assert_eq!(deepep_buffer_is_available(buf, &mut available), DEEPEP_SUCCESS);
        assert!(!available, "a buffer without resources is not available");
        for (name, status, error) in every_buffer_entry(buf) {
            // Only answers from the host: success, a refused argument, or "no resources".
            assert!(
                matches!(status, DEEPEP_SUCCESS | DEEPEP_ERROR_INVALID_ARGUMENT | DEEPEP_ERROR_NOT_AVAILABLE),
                "{name}: {status:?}: {error}"
            );
            assert!(!error.contains("buffer ("), "{name}: a live handle was refused: {error}");
        }
        assert_eq!(deepep_buffer_free(buf), DEEPEP_SUCCESS);
    }
}

#[test]
fn handles_are_released_once_and_slots_reused_with_new_generations() {
    let first = host_only_buffer(0, 2, false);
    assert!(testing::live_buffers() >= 1);
    assert_eq!(deepep_buffer_free(first), DEEPEP_SUCCESS);
    let mut handles = Vec::new();
    for _ in 0..64 {
        let b = host_only_buffer(0, 2, false);
        assert_ne!(b, first, "a reused slot never gives out a freed handle's value again");
        handles.push(b);
    }
    let mut rank = 0;
    expect_err(deepep_buffer_get_rank(first, &mut rank), DEEPEP_ERROR_INVALID_ARGUMENT, "was destroyed");
    for b in handles {
        assert_eq!(deepep_buffer_get_rank(b, &mut rank), DEEPEP_SUCCESS);
        assert_eq!(deepep_buffer_free(b), DEEPEP_SUCCESS);
    }
}

#[test]
fn sizes_that_overflow_are_errors_naming_the_argument() {
    use deepep_nccl::ll::dispatch::DeepepLowLatencyDispatchArgs;
    use deepep_nccl::normal::dispatch::DeepepIntranodeDispatchArgs;
    use deepep_nccl::outputs::DeepepOutputs;
    let normal = host_only_buffer(0, 8, false);
    let ll = host_only_buffer(0, 8, true);
    let huge = |dtype: DeepepDtype| DeepepTensor {
        data: 0x10000 as *mut _,
        dtype: dtype as i32,
        ndim: 2,
        shape: [1 << 40, 1 << 40, 0, 0],
        strides: [1 << 40, 1, 0, 0],
    };
    let absent = DeepepTensor { data: ptr::null_mut(), dtype: 0, ndim: 0, shape: [0; 4], strides: [0; 4] };
    let elements = "has shape [1099511627776, 1099511627776]: more elements than a 64-bit count holds";

    let topk = huge(DeepepDtype::DEEPEP_DTYPE_INT64);
    let status = deepep_get_dispatch_layout(normal, &topk, 64, &absent, ptr::null(), &absent, &absent, ptr::null_mut());
    expect_err(status, DEEPEP_ERROR_INVALID_ARGUMENT, &format!("topk_idx {elements}"));

    let mut o = DeepepOutputs::default();
    expect_err(
        deepep_get_dispatch_layout_outputs(normal, i64::MAX, 64, &mut o),
        DEEPEP_ERROR_INVALID_ARGUMENT,
        "is_token_in_rank would have shape [9223372036854775807, 8]: more bytes than a 64-bit size holds",
    );

    // SAFETY: plain old data; all-zero is all absent.
    let mut dispatch: DeepepIntranodeDispatchArgs = unsafe { std::mem::zeroed() };
    dispatch.x = huge(DeepepDtype::DEEPEP_DTYPE_BFLOAT16);
    expect_err(deepep_intranode_dispatch_handle_outputs(normal, &dispatch, &mut o), DEEPEP_ERROR_INVALID_ARGUMENT, &format!("x {elements}"));
    // Elements that fit, bytes that do not (2^62 bfloat16 elements = 2^63 bytes).
    dispatch.x.shape[..2].copy_from_slice(&[1 << 31, 1 << 31]);
    dispatch.x.strides[..2].copy_from_slice(&[1 << 31, 1]);
    expect_err(deepep_intranode_dispatch_handle_outputs(normal, &dispatch, &mut o), DEEPEP_ERROR_INVALID_ARGUMENT, "x has shape [2147483648, 2147483648] and strides [2147483648, 1]: it spans more bytes");

    // SAFETY: as above.
    let mut ll_args: DeepepLowLatencyDispatchArgs = unsafe { std::mem::zeroed() };
    ll_args.x = huge(DeepepDtype::DEEPEP_DTYPE_BFLOAT16);
    ll_args.phases = 3;
    let mut idx = 0;
    expect_err(deepep_low_latency_dispatch(ll, &ll_args, ptr::null_mut(), &mut idx), DEEPEP_ERROR_INVALID_ARGUMENT, &format!("x {elements}"));

    expect_err(deepep_buffer_set_gpu_timeout_ms(normal, u64::MAX), DEEPEP_ERROR_INVALID_ARGUMENT, "timeout_ms (18446744073709551615) must be in [1, 86400000]");
    expect_err(deepep_buffer_set_gpu_timeout_ms(normal, 86_400_001), DEEPEP_ERROR_INVALID_ARGUMENT, "timeout_ms (86400001) must be in [1, 86400000]");
    expect_err(deepep_buffer_set_gpu_timeout_ms(normal, 0), DEEPEP_ERROR_INVALID_ARGUMENT, "timeout_ms (0) must be in [1, 86400000]");
    assert_eq!(deepep_buffer_set_gpu_timeout_ms(normal, 86_400_000), DEEPEP_SUCCESS);

    // A unique id length no slice is built over.
    let id = [0u8; DEEPEP_UNIQUE_ID_BYTES];
    let mut buf = ptr::null_mut();
    let status = deepep_buffer_create(0, 2, id.as_ptr(), usize::MAX, 1 << 20, 0, false, false, false, &mut buf);
    expect_err(status, DEEPEP_ERROR_INVALID_ARGUMENT, "unique_id must be 128 bytes (an ncclUniqueId), got 18446744073709551615");
    assert!(buf.is_null());

    assert_eq!(deepep_buffer_free(normal), DEEPEP_SUCCESS);
    assert_eq!(deepep_buffer_free(ll), DEEPEP_SUCCESS);
}

/// A contiguous descriptor of `shape` at a fake device address (never read on the host).
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

#[test]
fn low_latency_ops_check_16_byte_alignment_of_the_rows_they_move() {
    use deepep_nccl::ll::combine::DeepepLowLatencyCombineArgs;
    use deepep_nccl::ll::dispatch::DeepepLowLatencyDispatchArgs;
    use deepep_nccl::outputs::DeepepOutputs;
    use DeepepDtype::*;
    let buf = host_only_buffer(0, 8, true);
    let (m, h, e, r, t, k) = (128i64, 7168i64, 288i32, 8i64, 17i64, 8i64);
    let el = e as i64 / r;
    let base = 1usize << 32; // fake, 16-byte aligned device addresses, far apart
    let at = |i: usize| base + (i << 36);

    let mut o = DeepepOutputs::default();
    assert_eq!(deepep_low_latency_dispatch_outputs(buf, m, h, e, false, false, &mut o), DEEPEP_SUCCESS, "{}", last_error());
    let mut outs = o.tensors;
    for (i, d) in outs.iter_mut().enumerate().filter(|(_, d)| d.dtype != 0) {
        d.data = at(10 + i) as *mut _;
    }
    let dispatch = DeepepLowLatencyDispatchArgs {
        x: described(DEEPEP_DTYPE_BFLOAT16, &[t, h], at(0)),
        topk_idx: described(DEEPEP_DTYPE_INT64, &[t, k], at(1)),
        cumulative_local_expert_recv_stats: described(DEEPEP_DTYPE_INT32, &[el], at(2)),
        dispatch_wait_recv_cost_stats: described(DEEPEP_DTYPE_INT64, &[r], at(3)),
        packed_recv_x: outs[0],
        packed_recv_x_scales: outs[1],
        packed_recv_count: outs[2],
        packed_recv_src_info: outs[3],
        packed_recv_layout_range: outs[4],
        num_max_dispatch_tokens_per_rank: m as i32,
        num_experts: e,
        use_fp8: 0,
        round_scale: 0,
        use_ue8m0: 0,
        phases: 3,
    };
    let mut idx = 0;
    // Everything valid: the call gets past every check, to the missing GPU resources.
    expect_err(deepep_low_latency_dispatch(buf, &dispatch, ptr::null_mut(), &mut idx), DEEPEP_ERROR_NOT_AVAILABLE, "destroyed");
    let misaligned = |mut a: DeepepLowLatencyDispatchArgs, edit: fn(&mut DeepepLowLatencyDispatchArgs)| {
        edit(&mut a);
        a
    };
    for (args, name) in [
        (misaligned(dispatch, |a| a.x.data = (a.x.data as usize + 8) as *mut _), "x"),
        (misaligned(dispatch, |a| a.packed_recv_x.data = (a.packed_recv_x.data as usize + 2) as *mut _), "packed_recv_x"),
    ] {
        expect_err(
            deepep_low_latency_dispatch(buf, &args, ptr::null_mut(), &mut idx),
            DEEPEP_ERROR_INVALID_ARGUMENT,
            &format!("{name} must start at a 16-byte aligned address"),
        );
    }
    // Per-element tensors need only their elements' alignment.
    let a = misaligned(dispatch, |a| a.topk_idx.data = (a.topk_idx.data as usize + 8) as *mut _);
    expect_err(deepep_low_latency_dispatch(buf, &a, ptr::null_mut(), &mut idx), DEEPEP_ERROR_NOT_AVAILABLE, "destroyed");
    let a = misaligned(dispatch, |a| a.topk_idx.data = (a.topk_idx.data as usize + 4) as *mut _);
    expect_err(deepep_low_latency_dispatch(buf, &a, ptr::null_mut(), &mut idx), DEEPEP_ERROR_INVALID_ARGUMENT, "topk_idx must start at an address aligned to its 8-byte int64 elements");

    let combine = DeepepLowLatencyCombineArgs {
        x: described(DEEPEP_DTYPE_BFLOAT16, &[el, r * m, h], at(20)),
        topk_idx: described(DEEPEP_DTYPE_INT64, &[t, k], at(21)),
        topk_weights: described(DEEPEP_DTYPE_FLOAT32, &[t, k], at(22)),
        src_info: described(DEEPEP_DTYPE_INT32, &[el, r * m], at(23)),
        layout_range: described(DEEPEP_DTYPE_INT64, &[el, r], at(24)),
        combine_wait_recv_cost_stats: described(DEEPEP_DTYPE_INT64, &[r], at(25)),
        out: described(DEEPEP_DTYPE_BFLOAT16, &[t, h], at(26)),
        num_max_dispatch_tokens_per_rank: m as i32,
        num_experts: e,
        use_logfmt: 0,
        zero_copy: 0,
        phases: 3,
        reserved: 0,
    };
    expect_err(deepep_low_latency_combine(buf, &combine, ptr::null_mut(), &mut idx), DEEPEP_ERROR_NOT_AVAILABLE, "destroyed");
    for name in ["x", "out"] {
        let mut a = combine;
        let d = if name == "x" { &mut a.x } else { &mut a.out };
        d.data = (d.data as usize + 2) as *mut _; // aligned for bfloat16, not for 16-byte rows
        expect_err(
            deepep_low_latency_combine(buf, &a, ptr::null_mut(), &mut idx),
            DEEPEP_ERROR_INVALID_ARGUMENT,
            &format!("{name} must start at a 16-byte aligned address"),
        );
    }
    assert_eq!(deepep_buffer_free(buf), DEEPEP_SUCCESS);
}
