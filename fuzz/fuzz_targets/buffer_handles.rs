//! Buffer handles as values. A pool of live handles (buffers without GPU resources: every op
//! runs its argument checks and stops at NOT_AVAILABLE), freed ones, twice-freed ones and made-up
//! values (random, an address, NULL, live or freed handles with their generation, slot, kind or
//! tag changed), passed to every C ABI entry that takes a handle (fuzz_common::entries) with
//! arbitrary other arguments but valid out-params and args pointers, so the handle decides:
//!
//! * a freed handle: INVALID_ARGUMENT, "buffer (0x..) was destroyed", for every call, free too;
//! * a made-up one: INVALID_ARGUMENT, "buffer (0x..) " and "was never created", "was destroyed"
//!   (a value that an earlier input's handle had) or "wrong kind"; NULL: "buffer must not be NULL";
//! * a live one: never refused as a handle; SUCCESS, INVALID_ARGUMENT, NOT_AVAILABLE or
//!   UNSUPPORTED, never INTERNAL (with -a an overflow in the checks a live handle reaches panics).
#![no_main]
use deepep_nccl::buffer::BufferArgs;
use deepep_nccl::capi::{deepep_buffer_free, deepep_check_buffer_args, testing, DeepepBuffer};
use deepep_nccl::DeepepStatus::{self, *};
use fuzz_common::entries::{self, Scratch};
use fuzz_common::*;
use libfuzzer_sys::fuzz_target;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Live,
    Freed,
    MadeUp,
}

/// The target's model of the handles it knows.
#[derive(Default)]
struct Pool {
    handles: Vec<(usize, State)>,
}

impl Pool {
    fn state(&self, h: usize) -> Option<State> {
        // A live handle wins: a made-up value may equal one.
        let states: Vec<State> = self.handles.iter().filter(|(v, _)| *v == h).map(|(_, s)| *s).collect();
        [State::Live, State::Freed, State::MadeUp].into_iter().find(|s| states.contains(s))
    }
    fn live(&self) -> usize {
        self.handles.iter().filter(|(_, s)| *s == State::Live).count()
    }
    fn pick(&self, u: &mut Unstructured) -> Option<usize> {
        if self.handles.is_empty() {
            return None;
        }
        Some(self.handles[u.choose_index(self.handles.len()).unwrap_or(0)].0)
    }
    fn set(&mut self, h: usize, state: State) {
        for entry in self.handles.iter_mut().filter(|(v, _)| *v == h) {
            entry.1 = state;
        }
    }
}

/// A value that is no live handle of this input's making, or that equals one by chance.
fn made_up(u: &mut Unstructured, pool: &Pool) -> usize {
    let local = 0u8;
    let base = pool.pick(u).unwrap_or(0x4445_0100_0001_0000);
    match u.int_in_range(0u8..=7).unwrap_or(0) {
        0 => u.arbitrary().unwrap_or(0),
        1 => &local as *const u8 as usize,
        2 => 0,
        3 => base ^ ((u.int_in_range(1u64..=(1 << 24) - 1).unwrap_or(1) as usize) << 16), // generation
        4 => base ^ u.int_in_range(1usize..=0xffff).unwrap_or(1),                          // slot
        5 => base ^ ((u.int_in_range(1u64..=0xff).unwrap_or(1) as usize) << 40),           // kind
        6 => base ^ ((u.int_in_range(1u64..=0xffff).unwrap_or(1) as usize) << 48),         // tag
        _ => base.wrapping_add(u.int_in_range(1usize..=3).unwrap_or(1)),
    }
}

/// The status and message a call with `h` must give, as the model says.
fn check(what: &str, h: usize, state: State, s: DeepepStatus) {
    no_internal(what, s);
    let msg = last_error();
    let name = format!("buffer ({h:#x}) ");
    match state {
        State::Live => {
            assert!(
                matches!(s, DEEPEP_SUCCESS | DEEPEP_ERROR_INVALID_ARGUMENT | DEEPEP_ERROR_NOT_AVAILABLE | DEEPEP_ERROR_UNSUPPORTED),
                "{what}(live {h:#x}): {s:?}: {msg}"
            );
            assert!(!msg.starts_with(&name), "{what}: a live handle was refused: {msg}");
        }
        State::Freed => {
            assert_eq!(s, DEEPEP_ERROR_INVALID_ARGUMENT, "{what}(freed {h:#x}): {msg}");
            assert!(msg.starts_with(&format!("{name}was destroyed")), "{what}(freed {h:#x}): {msg}");
        }
        State::MadeUp if h == 0 => {
            if what == "free" {
                assert_eq!(s, DEEPEP_SUCCESS, "free(NULL) is a no-op");
            } else {
                assert_eq!((s, msg.as_str()), (DEEPEP_ERROR_INVALID_ARGUMENT, "buffer must not be NULL"), "{what}");
            }
        }
        State::MadeUp => {
            assert_eq!(s, DEEPEP_ERROR_INVALID_ARGUMENT, "{what}(made-up {h:#x}): {msg}");
            let why = ["was never created", "was destroyed", "(wrong kind)"];
            assert!(msg.starts_with(&name) && why.iter().any(|w| msg.contains(w)), "{what}(made-up {h:#x}): {msg}");
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let mut ctx = Scratch::new(false);
    let mut pool = Pool::default();
    while !u.is_empty() {
        match u.int_in_range(0u8..=7).unwrap_or(0) {
            0 if pool.live() < 8 => {
                let (rank, num_ranks) = (i32_edge(&mut u), i32_edge(&mut u));
                let (nvl, rdma, ll) = (i64_edge(&mut u), i64_edge(&mut u), bool_(&mut u));
                trace(&format!("create rank={rank} num_ranks={num_ranks} nvl={nvl} rdma={rdma} ll={ll}"));
                // Only buffers DeepEP's constructor checks accept (what deepep_buffer_create requires).
                if deepep_check_buffer_args(rank, num_ranks, nvl, rdma, ll) != DEEPEP_SUCCESS {
                    continue;
                }
                let args = BufferArgs {
                    rank,
                    num_ranks,
                    num_nvl_bytes: nvl,
                    num_rdma_bytes: rdma,
                    low_latency_mode: ll,
                    explicitly_destroy: bool_(&mut u),
                    enable_shrink: bool_(&mut u),
                };
                let sms = [0, 2, 24, 132][u.choose_index(4).unwrap_or(3)];
                // Some span (virtual) nodes, so that the internode ops get past their topology check.
                let node_size = [1, 2, 4, 8][u.choose_index(4).unwrap_or(0)];
                let h = if num_ranks > node_size && num_ranks % node_size == 0 && bool_(&mut u) {
                    testing::buffer_without_resources_in_nodes(args, sms, node_size) as usize
                } else {
                    testing::buffer_without_resources(args, sms) as usize
                };
                assert!(testing::lookup_buffer(h as *const DeepepBuffer));
                pool.handles.push((h, State::Live));
            }
            1 | 2 => {
                let h = if u.ratio(1u8, 4).unwrap_or(false) { made_up(&mut u, &pool) } else { pool.pick(&mut u).unwrap_or(0) };
                let state = pool.state(h).unwrap_or(State::MadeUp);
                trace(&format!("free {h:#x} ({state:?})"));
                check("free", h, state, deepep_buffer_free(h as *mut DeepepBuffer));
                if state == State::Live {
                    assert!(!testing::lookup_buffer(h as *const DeepepBuffer), "{h:#x} still resolves after free");
                    pool.set(h, State::Freed);
                }
            }
            3 => {
                let h = made_up(&mut u, &pool);
                if pool.state(h).is_none() {
                    pool.handles.push((h, State::MadeUp));
                }
            }
            _ => {
                let Some(h) = pool.pick(&mut u) else { continue };
                let state = pool.state(h).expect("picked from the pool");
                let which = u.int_in_range(0u8..=entries::COUNT - 1).unwrap_or(0);
                if which == entries::FREE {
                    continue; // frees go through the model above
                }
                trace(&format!("entry {which} with {h:#x} ({state:?})"));
                let (what, s) = entries::call(&mut u, &mut ctx, which, h as *mut DeepepBuffer);
                check(what, h, state, s);
            }
        }
    }
    for (h, state) in pool.handles {
        if state == State::Live {
            assert_eq!(deepep_buffer_free(h as *mut DeepepBuffer), DEEPEP_SUCCESS, "{}", last_error());
        }
    }
});
