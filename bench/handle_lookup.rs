//! Host cost of the buffer-handle check every C ABI call makes (src/handles.rs): a registry
//! lookup (one uncontended Mutex, one Arc clone and drop), alone and inside a whole C ABI
//! query, and with several threads looking up their own buffers at once; and the argument
//! validation of a whole dispatch (every op validates each tensor it is given, on every call).
//! Run: `cargo bench --bench handle_lookup` (no GPU needed: the buffers have no GPU resources).
use std::hint::black_box;
use std::time::Instant;

use deepep_nccl::buffer::BufferArgs;
use deepep_nccl::capi::{
    deepep_buffer_free, deepep_buffer_get_rank, deepep_intranode_dispatch_outputs, deepep_low_latency_check_shape, testing,
    DeepepBuffer,
};
use deepep_nccl::config::DeepepConfig;
use deepep_nccl::normal::dispatch::DeepepIntranodeDispatchArgs;
use deepep_nccl::outputs::DeepepOutputs;
use deepep_nccl::tensor::{DeepepDtype, DeepepTensor};

const ITERS: u32 = 10_000_000;

fn buffer(rank: i32) -> *mut DeepepBuffer {
    let args = BufferArgs {
        rank,
        num_ranks: 8,
        num_nvl_bytes: 1 << 30,
        num_rdma_bytes: 0,
        low_latency_mode: false,
        explicitly_destroy: false,
        enable_shrink: false,
    };
    testing::buffer_without_resources(args, 132)
}

/// Best of 5 runs of `ITERS` calls of `f`, in ns per call.
fn ns_per_call(f: impl FnMut()) -> f64 {
    ns_per_call_of(ITERS, f)
}

fn ns_per_call_of(iters: u32, mut f: impl FnMut()) -> f64 {
    (0..5)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..iters {
                f();
            }
            start.elapsed().as_nanos() as f64 / iters as f64
        })
        .fold(f64::INFINITY, f64::min)
}

/// Handles as usize (plain data) so threads can share them.
fn handle(b: *mut DeepepBuffer) -> usize {
    b as usize
}

/// A descriptor of `shape` with `strides` (elements) at `data`; only its address is read.
fn tensor(data: *mut u128, dtype: DeepepDtype, shape: &[i64], strides: &[i64]) -> DeepepTensor {
    let mut t = DeepepTensor { data: data.cast(), dtype: dtype as i32, ndim: shape.len() as i32, shape: [0; 4], strides: [0; 4] };
    t.shape[..shape.len()].copy_from_slice(shape);
    t.strides[..strides.len()].copy_from_slice(strides);
    t
}

/// The args of a cached FP8 dispatch as DeepEP's tests pass them (T = 128 tokens, hidden 7168,
/// column-major scales, 8 ranks, 24 SMs: 12 channels): 7 tensors for the validation to check.
fn cached_fp8_dispatch(data: *mut u128) -> DeepepIntranodeDispatchArgs {
    let (t, r, c) = (128, 8, 12);
    let absent = DeepepTensor { data: std::ptr::null_mut(), dtype: 0, ndim: 0, shape: [0; 4], strides: [0; 4] };
    DeepepIntranodeDispatchArgs {
        x: tensor(data, DeepepDtype::DEEPEP_DTYPE_FLOAT8_E4M3, &[t, 7168], &[7168, 1]),
        x_scales: tensor(data, DeepepDtype::DEEPEP_DTYPE_FLOAT32, &[t, 56], &[1, t]),
        topk_idx: absent,
        topk_weights: absent,
        num_tokens_per_rank: absent,
        is_token_in_rank: tensor(data, DeepepDtype::DEEPEP_DTYPE_BOOL, &[t, r], &[r, 1]),
        num_tokens_per_expert: absent,
        rank_prefix_matrix: tensor(data, DeepepDtype::DEEPEP_DTYPE_INT32, &[r, r], &[r, 1]),
        channel_prefix_matrix: tensor(data, DeepepDtype::DEEPEP_DTYPE_INT32, &[r, c], &[c, 1]),
        recv_channel_prefix_matrix: tensor(data, DeepepDtype::DEEPEP_DTYPE_INT32, &[r, c], &[c, 1]),
        send_head: tensor(data, DeepepDtype::DEEPEP_DTYPE_INT32, &[t, r], &[r, 1]),
        config: DeepepConfig::new(24, 6, 256, 6, 128).unwrap(),
        cached: 1,
        expert_alignment: 1,
        num_worst_tokens: 0,
        reserved: 0,
    }
}

fn main() {
    // A registry with a few live buffers, as a process with several Buffers has.
    let buffers: Vec<*mut DeepepBuffer> = (0..8).map(buffer).collect();
    let h = buffers[3];

    let lookup = ns_per_call(|| assert!(testing::lookup_buffer(black_box(h))));
    println!("registry lookup (lock, generation check, Arc clone/drop):      {lookup:6.1} ns");

    let mut rank = 0;
    let query = ns_per_call(|| {
        black_box(deepep_buffer_get_rank(black_box(h), &mut rank));
    });
    println!("deepep_buffer_get_rank (whole C ABI call: ffi wrapper + lookup): {query:6.1} ns");

    let no_handle = ns_per_call(|| {
        black_box(deepep_low_latency_check_shape(black_box(128), 7168, 8, 288));
    });
    println!("deepep_low_latency_check_shape (a C ABI call without a handle):  {no_handle:6.1} ns");

    let mut storage = vec![0u128; 4];
    let args = cached_fp8_dispatch(storage.as_mut_ptr());
    let mut described = DeepepOutputs::default();
    let validate = ns_per_call_of(ITERS / 10, || {
        let status = deepep_intranode_dispatch_outputs(black_box(h), black_box(&args), 256, &mut described);
        assert_eq!(status, deepep_nccl::DeepepStatus::DEEPEP_SUCCESS);
    });
    println!("deepep_intranode_dispatch_outputs (validates a cached FP8 dispatch): {validate:6.1} ns");

    // Threads beyond the cores measure time sharing, not the registry: at most the cores.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("({cores} cores)");
    for threads in [2, 4, 8].into_iter().filter(|t| *t <= cores) {
        for shared in [false, true] {
            let per_thread: Vec<f64> = std::thread::scope(|s| {
                let workers: Vec<_> = (0..threads)
                    .map(|t| {
                        let mine = handle(buffers[if shared { 0 } else { t % buffers.len() }]);
                        s.spawn(move || ns_per_call(|| assert!(testing::lookup_buffer(black_box(mine as *const DeepepBuffer)))))
                    })
                    .collect();
                workers.into_iter().map(|w| w.join().unwrap()).collect()
            });
            let worst = per_thread.iter().copied().fold(0.0, f64::max);
            let whose = if shared { "one buffer" } else { "own buffers" };
            println!("registry lookup, {threads} threads at once ({whose}), worst thread:    {worst:6.1} ns");
        }
    }

    for b in buffers {
        assert_eq!(deepep_buffer_free(b), deepep_nccl::DeepepStatus::DEEPEP_SUCCESS);
    }
}
