//! Host cost of the buffer-handle check every C ABI call makes (src/handles.rs): a registry
//! lookup (one uncontended Mutex, one Arc clone and drop), alone and inside a whole C ABI
//! query, and with several threads looking up their own buffers at once.
//! Run: `cargo bench --bench handle_lookup` (no GPU needed: the buffers have no GPU resources).
use std::hint::black_box;
use std::time::Instant;

use deepep_nccl::buffer::BufferArgs;
use deepep_nccl::capi::{deepep_buffer_free, deepep_buffer_get_rank, deepep_low_latency_check_shape, testing, DeepepBuffer};

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
fn ns_per_call(mut f: impl FnMut()) -> f64 {
    (0..5)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..ITERS {
                f();
            }
            start.elapsed().as_nanos() as f64 / ITERS as f64
        })
        .fold(f64::INFINITY, f64::min)
}

/// Handles as usize (plain data) so threads can share them.
fn handle(b: *mut DeepepBuffer) -> usize {
    b as usize
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
