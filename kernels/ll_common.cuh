// Shared device code of the low-latency (LL) kernels: the transport (LSA stores
// for peers in the same node; the GIN protocol -- stage, put, strong signal --
// for the others, either over NCCL GIN or emulated over LSA for virtual nodes),
// the bounded signal wait with shrink-mode masking, and small helpers.
//
// Protocol of one LL op (dispatch or combine) between sender s and receiver r:
// s writes its data into r's half of the window, then stores its signal value into r's 64-bit
// signal word [s] of that half and op (release, after all of s's writes to r). The value is a
// generation: (clean generation << 32) | the number of sends of that op kind s made on that half
// since the clean (op_seq), XOR DEEPEP_LL_SIGNAL_KEY (so zeroed or overwritten words never match).
// Every rank takes part in every op, so r's own count for the op equals s's, and each receive
// block waits for exactly r's own value of its latest send on the half:
//   * a stale word (an earlier op, a late signal of a masked rank, one from before a clean)
//     never equals it, in counter and shrink mode alike (NCCL EP #2303);
//   * the receive keeps no count of its own, so a receive that never ran (a dropped hook) or ran
//     twice (a doubled hook: it reads the same op again) leaves nothing behind for later ops;
//   * a sender ahead of r (its next op on this half already signalled: r's receive came too late)
//     never matches either: a stall record, or a mask in shrink mode, instead of torn data.
// Nothing resets the words; the clean zeroes them and starts a new generation. A word is next
// written two LL calls later (the other half is used in between): DeepEP's "at most two results
// in flight". The half is host state (baked into CUDA graphs): two sends in a row on one half
// are a fault record (DEEPEP_FAULT_LL_SAME_HALF; see end_send).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include <cstdint>

#include "bounded_wait.cuh"
#include "deepep_kernels.h"
#include "launch.cuh"
#include "memory_order.cuh"
#include "stream_ops.cuh"
#include "warp_copy.cuh"

#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 7)
#define DEEPEP_HAVE_GIN 1
#else
#define DEEPEP_HAVE_GIN 0
#endif
#if __has_include("ll_logfmt.cuh")
#define DEEPEP_HAVE_LOGFMT 1
#else
#define DEEPEP_HAVE_LOGFMT 0
#endif

namespace deepep {
namespace ll {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / kWarp;
constexpr int kSignalDispatch = 0;
constexpr int kSignalCombine = 1;
constexpr int kStateWaiting = 0, kStateArrived = 1, kStateMasked = 2;

enum RemoteKind { kRemoteNone = DEEPEP_LL_REMOTE_NONE, kRemoteEmulated = DEEPEP_LL_REMOTE_EMULATED, kRemoteGin = DEEPEP_LL_REMOTE_GIN };
// The remote kinds this build launches (GIN's only with its headers): the launchers' kernel
// tables have one row per kind, indexed by its value.
constexpr int kRemoteKinds = DEEPEP_HAVE_GIN ? 3 : 2;
static_assert(kRemoteNone == 0 && kRemoteEmulated == 1 && kRemoteGin == 2, "kernel tables index by remote kind");

// Dispatch slot: header (source token, then one (expert, position) word per
// top-k entry), then the payload (FP8 + fp32 scales, or BF16).
__host__ __device__ constexpr int64_t dispatch_header_bytes(int num_topk) { return align16(16 + 4 * num_topk); }

// Count message: [per-expert counts: El][filled-slot bitmap: ceil(M / 32)].
__host__ __device__ constexpr int count_bitmap_words(int max_tokens) { return (max_tokens + 31) / 32; }
__host__ __device__ constexpr int64_t count_message_bytes(int local_experts, int max_tokens) {
  return align16(4 * int64_t(local_experts + count_bitmap_words(max_tokens)));
}

// Padded to 16 bytes so that every slot starts 16-byte aligned (H = 128: 128 + 4 scales).
__host__ __device__ constexpr int64_t dispatch_payload_bytes(int hidden, bool fp8) {
  return fp8 ? align16(int64_t(hidden) + 4 * (hidden / 128)) : 2 * int64_t(hidden);
}

// The combine area: E * M data slots of one BF16 row (2H bytes; a LogFMT row uses the same
// 256-byte block areas), then E * M metadata slots (4 bytes per 128-channel block, LogFMT only).
// Per (expert, token) that is 2H + 4H/128 bytes, DeepEP's combine message, for any H % 128 == 0.
__host__ __device__ constexpr int64_t combine_data_bytes(int hidden) { return 2 * int64_t(hidden); }
__host__ __device__ constexpr int64_t combine_meta_bytes(int hidden) { return 4 * int64_t(hidden / 128); }
// Bytes between rows of the zero-copy combine view: DeepEP's (H + H/64) BF16 elements.
__host__ __device__ constexpr int64_t view_row_bytes(int hidden) { return 2 * int64_t(hidden) + hidden / 32; }

// ---------------------------------------------------------------- top-k ids
// Top-k entry i, read as a 32-bit id (an int64 entry's low word, as DeepEP's kernels read it).
__device__ __forceinline__ int load_topk(const void* topk, bool is_int32, int64_t i) {
  return is_int32 ? __ldg(static_cast<const int32_t*>(topk) + i) : int(__ldg(static_cast<const int64_t*>(topk) + i));
}
// An id outside [0, num_experts) (-1 included) counts as -1: a bad id is skipped instead of
// addressing memory outside the window. Kept apart from the load so that a load issued before a
// wait does not stall the wait on its value.
__device__ __forceinline__ int valid_expert(int e, int num_experts) {
  return unsigned(e) < unsigned(num_experts) ? e : -1;
}
__device__ __forceinline__ int load_expert(const void* topk, bool is_int32, int64_t i, int num_experts) {
  return valid_expert(load_topk(topk, is_int32, i), num_experts);
}

// Makes the compiler compute the values here (before what follows, e.g. a wait's volatile
// loads) instead of sinking the arithmetic to their first use.
__device__ __forceinline__ void computed_here(int value) { asm volatile("" ::"r"(value)); }
template <typename... Ts>
__device__ __forceinline__ void computed_here(int value, Ts... values) {
  computed_here(value);
  computed_here(values...);
}

// ---------------------------------------------------------------- transport
// Peer addressing and signals for one call. `kRemote` selects how peers outside
// the sender's node are reached; peers inside it always get LSA stores.
template <int kRemote>
struct Transport {
  const DeepepLlCommon& c;
  ncclDevComm const& dev_comm;

  __device__ Transport(const DeepepLlCommon& common, ncclDevComm const& dc) : c(common), dev_comm(dc) {}

  __device__ __forceinline__ ncclWindow_t window() const { return static_cast<ncclWindow_t>(c.window); }
  __device__ __forceinline__ bool direct(int peer) const {
    return kRemote == kRemoteNone || peer / c.node_size == c.rank / c.node_size;
  }
  // Peer's copy of window offset `offset`, through NVLink (LSA). Valid for direct
  // peers, and for every peer in the emulated mode (one physical node). The mapping comes
  // in the parameters (what ncclGetLsaPointer computes after loading the window struct).
  __device__ __forceinline__ uint8_t* lsa(uint64_t offset, int peer) const {
    return c.lsa_base + uint64_t(peer - c.wait.lsa_base_rank) * c.lsa_stride + offset;
  }
  __device__ __forceinline__ uint8_t* local(uint64_t offset) const { return c.local_base + offset; }
  // Source `src`'s signal word of op `kind` in this half (uint64).
  __device__ __forceinline__ uint64_t signal_offset(int kind, int src) const {
    return c.signal_offset + 8ull * (uint64_t(kind) * c.num_ranks + src);
  }
  // [kind][half] index of the workspace arrays.
  __device__ __forceinline__ int kind_half(int kind) const { return kind * 2 + c.parity; }
#if DEEPEP_HAVE_GIN
  __device__ __forceinline__ int gin_signal_id(int kind, int src) const {
    return (c.parity * DEEPEP_LL_SIGNAL_KINDS + kind) * c.num_ranks + src;
  }
  __device__ __forceinline__ int gin_context(int peer) const {
    return dev_comm.ginContextCount > 0 ? peer % dev_comm.ginContextCount : 0;
  }
#endif

  // Remote path, data: `bytes` staged at local window offset `src_offset` go to
  // the peer's `dst_offset`. The whole warp calls; the stage is complete and
  // visible to this warp (syncthreads/syncwarp before).
  __device__ __forceinline__ void put(int peer, uint64_t dst_offset, uint64_t src_offset, int64_t bytes,
                                      int lane) const {
    if constexpr (kRemote == kRemoteEmulated) {
      warp_copy<4, CopyLoad::kCg>(reinterpret_cast<int4*>(lsa(dst_offset, peer)),
                                  reinterpret_cast<const int4*>(local(src_offset)), int(bytes / 16), lane);
    } else if constexpr (kRemote == kRemoteGin) {
#if DEEPEP_HAVE_GIN
      if (lane == 0) {
        ncclGin gin(dev_comm, gin_context(peer));
        gin.put(ncclTeamWorld(dev_comm), peer, window(), dst_offset, window(), src_offset, size_t(bytes));
      }
#endif
    }
  }

  // put() for byte counts that need not be a multiple of 16 (small metadata).
  __device__ __forceinline__ void put_bytes(int peer, uint64_t dst_offset, uint64_t src_offset, int64_t bytes,
                                            int lane) const {
    if constexpr (kRemote == kRemoteEmulated) {
      uint8_t* dst = lsa(dst_offset, peer);
      const uint8_t* src = local(src_offset);
      for (int64_t i = lane; i < bytes; i += kWarp) dst[i] = __ldcg(src + i);
    } else {
      put(peer, dst_offset, src_offset, bytes, lane);
    }
  }

  // Tells `peer` that all of this rank's writes of op `kind` to it are done: its signal word
  // becomes `value` (this op's signal_of). Every writer released its writes (gpu scope) before
  // counting itself done, and the caller acquired that count; this sys-scope release carries all
  // of them to the peer (cumulativity), as DeepEP's LL kernels do: no full fence.sc.sys is needed.
  // One thread per (op, peer) calls it.
  __device__ __forceinline__ void signal(int peer, int kind, uint64_t value) const {
    if (kRemote == kRemoteGin && !direct(peer)) {
#if DEEPEP_HAVE_GIN
      // GIN signals only add: add what brings the peer's signal (zeroed with gin_sent by the clean)
      // to `value`.
      uint64_t* sent = c.gin_sent + kind_half(kind) * c.num_ranks + peer;
      const uint64_t delta = value - *sent;
      *sent = value;
      ncclGin gin(dev_comm, gin_context(peer));
      gin.signal(ncclTeamWorld(dev_comm), peer, ncclGin_SignalAdd{unsigned(gin_signal_id(kind, c.rank)), delta});
#endif
      return;
    }
    st_release_sys(reinterpret_cast<uint64_t*>(lsa(signal_offset(kind, c.rank), peer)), value);
  }

  __device__ __forceinline__ uint64_t read_signal(int kind, int src) const {
    if (kRemote == kRemoteGin && !direct(src)) {
#if DEEPEP_HAVE_GIN
      ncclGin gin(dev_comm, 0);
      return uint64_t(gin.readSignal(gin_signal_id(kind, src)));
#endif
    }
    return ld_acquire_sys(reinterpret_cast<const uint64_t*>(local(signal_offset(kind, src))));
  }

  // The clean barrier's arrival counts (uint32 [R] at signal_offset, bank DEEPEP_LL_CLEAN_BANK):
  // adds, never reset.
  __device__ __forceinline__ void arrive(int peer) const {
    if (kRemote == kRemoteGin && !direct(peer)) {
#if DEEPEP_HAVE_GIN
      ncclGin gin(dev_comm, gin_context(peer));
      gin.signal(ncclTeamWorld(dev_comm), peer, ncclGin_SignalAdd{unsigned(gin_signal_id(0, c.rank)), 1});
#endif
      return;
    }
    red_add_release_sys(reinterpret_cast<uint32_t*>(lsa(c.signal_offset + 4ull * c.rank, peer)), 1u);
  }
  __device__ __forceinline__ uint32_t read_arrivals(int src) const {
    if (kRemote == kRemoteGin && !direct(src)) {
#if DEEPEP_HAVE_GIN
      ncclGin gin(dev_comm, 0);
      return uint32_t(gin.readSignal(gin_signal_id(0, src)));
#endif
    }
    return ld_acquire_sys(reinterpret_cast<const uint32_t*>(local(c.signal_offset + 4ull * src)));
  }

  // This block's op_seq slot of op `kind` in this half.
  __device__ __forceinline__ uint64_t* seq_slot(int kind) const {
    return c.op_seq + kind_half(kind) * DEEPEP_LL_MAX_BLOCKS + blockIdx.x;
  }
  // A send's state, loaded at its start and used at its end (signal_of, end_send), so that no
  // thread waits for these loads on the way to its first data:
  //   seq: this block's op_seq slot (every thread; before the phase's first block barrier);
  //   sent, other: block 0 counts the send on its half and reads the other half's count.
  struct SendState {
    uint64_t seq;
    uint32_t sent, other;
  };
  // The count of LL sends on `half` (after the [kind][half] last-block tickets).
  __device__ __forceinline__ uint32_t* half_sends(int half) const {
    return c.ticket + 2 * DEEPEP_LL_SIGNAL_KINDS + half;
  }
  __device__ __forceinline__ SendState begin_send(int kind) const {
    SendState s{*reinterpret_cast<volatile uint64_t*>(seq_slot(kind)), 0u, 0u};
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      s.sent = atomicAdd(half_sends(c.parity), 1u) + 1u;
      s.other = *reinterpret_cast<volatile uint32_t*>(half_sends(1 - c.parity));
    }
    return s;
  }
  // This send's op_seq: one send more on this half, same generation (the count wraps inside its
  // 32 bits); and the signal value that carries it.
  __device__ __forceinline__ static uint64_t seq_of(const SendState& s) {
    return (s.seq & ~0xffffffffull) | uint32_t(uint32_t(s.seq) + 1u);
  }
  __device__ __forceinline__ static uint64_t signal_of(const SendState& s) { return seq_of(s) ^ DEEPEP_LL_SIGNAL_KEY; }
  // The whole block calls, at the end of the send phase (after its signals). Alternating halves
  // keep the two counts within one of each other, also with a send of each half in flight at
  // once; two sends in a row on one half (a CUDA graph with an odd number of LL ops, replayed
  // back to back) put this half's two ahead: a fault record, and the count is set back so that
  // the next sends are judged afresh.
  __device__ __forceinline__ void end_send(int kind, const SendState& s) const {
    if (threadIdx.x != 0) return;
    *seq_slot(kind) = seq_of(s);
    if (blockIdx.x == 0 && int32_t(s.sent - s.other) >= 2) {
      record_fault(c, DEEPEP_FAULT_LL_SAME_HALF, c.parity, c.rank, 0);
      atomicSub(half_sends(c.parity), 1u);
    }
  }
  // The value a receive block waits for: its own latest send's (stream order, or the block
  // barrier between the phases of one kernel).
  __device__ __forceinline__ uint64_t expected_signal(int kind) const {
    return *seq_slot(kind) ^ DEEPEP_LL_SIGNAL_KEY;
  }

  // One thread: waits for source `src`'s signal of op `kind` to equal `expected` and agrees
  // with the other blocks on the outcome (source_state). Returns whether it arrived; false if
  // the source is masked (before the kernel or, in shrink mode, by a block's timeout). A timeout
  // outside shrink mode records a stall and also returns false. The mask changes only between
  // kernels (a timeout's mask is written by the receive's last block), so every block and the
  // send phase see one mask. `value` is the caller's first poll, issued before `expected` was loaded.
  __device__ bool wait_source(int kind, int src, uint64_t expected, uint64_t value, int64_t* wait_cycles) const {
    int* state = c.source_state + kind_half(kind) * c.num_ranks + src;
    // A masked source is skipped, unless the blocks already agreed it arrived (then this block
    // waits for the signal too, which is there): every block follows the agreement.
    if (c.shrink && __ldcg(c.mask + src) != 0 && atomicCAS(state, kStateWaiting, kStateMasked) != kStateArrived)
      return false;
    const long long start_clock = clock64();
    if (value != expected) {
      const uint64_t start = global_time_ns();
      while (true) {
        if (*reinterpret_cast<volatile int*>(state) == kStateMasked) break;
        if (global_time_ns() - start > c.wait.timeout_ns) {
          if (!c.shrink)
            record_stall(c.wait, src, kind == kSignalDispatch ? DEEPEP_WAIT_OP_LL_DISPATCH : DEEPEP_WAIT_OP_LL_COMBINE,
                         src, int64_t(expected), int64_t(value));
          break;
        }
        value = read_signal(kind, src);
        if (value == expected) break;
      }
    }
    if (wait_cycles != nullptr) *wait_cycles = clock64() - start_clock;
    const bool got = value == expected;
    // Outside shrink mode an arrived signal needs no agreement between blocks (only a timeout
    // could disagree, and that is reported as a stall): skip the contended CAS.
    if (!c.shrink && got) return true;
    const int outcome = atomicCAS(state, kStateWaiting, got ? kStateArrived : kStateMasked);
    const int final_state = outcome == kStateWaiting ? (got ? kStateArrived : kStateMasked) : outcome;
    // Following another block's arrival after this one's wait ended: acquire the signal it saw.
    if (final_state == kStateArrived && !got) read_signal(kind, src);
    return final_state == kStateArrived;
  }

  // The receive's wait, block-wide: thread j waits for source j (then j + kThreads, ...) and
  // sets active[j]; block 0 adds each wait's cycles to `stats` (if not NULL). Returns whether
  // this thread found the receive failed (the caller ORs it over the block): outside shrink
  // mode, a source it waited for did not arrive, or (thread 0) a stall was recorded before
  // (review F9: the receive then poisons its outputs; ll_dispatch.cu poison_dispatch).
  __device__ bool wait_sources(int kind, int* active, int64_t* stats) const;

  // End of a receive of op `kind` (the whole block calls, after its last read of the half).
  __device__ void finish_receive(int kind) const;
};

// Stats counters: a fire-and-forget add (no round trip on the path to the data).
__device__ __forceinline__ void add_stat(int64_t* p, int64_t v) {
  atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
}

template <int kRemote>
__device__ bool Transport<kRemote>::wait_sources(int kind, int* active, int64_t* stats) const {
  // After a stall (this buffer's, any op) a receive fails even if its own peers all signalled:
  // an earlier timeout leaves source_state masked and later waits break at once, so whether a
  // block saw a signal is down to timing. Loaded first, beside the polls: no round trip added.
  bool failed = !c.shrink && threadIdx.x == 0 && buffer_failed(c.wait);
  // Each thread's first poll goes out before the block's expected value is loaded, so that the
  // two loads are in flight together: in hook mode the signal is already there, one round trip.
  const uint64_t first = threadIdx.x < c.num_ranks ? read_signal(kind, threadIdx.x) : 0u;
  const uint64_t expected = expected_signal(kind);
  for (int j = threadIdx.x; j < c.num_ranks; j += kThreads) {
    int64_t cycles = 0;
    const bool got = wait_source(kind, j, expected, j == threadIdx.x ? first : read_signal(kind, j), &cycles);
    active[j] = got;
    failed |= !c.shrink && !got;  // shrink mode skips a masked source instead
    if (blockIdx.x == 0 && stats != nullptr) add_stat(stats + j, cycles);
  }
  return failed;
}

// Whether `peer` takes part in this call (shrink mode skips masked ranks).
__device__ __forceinline__ bool peer_active(const DeepepLlCommon& c, int peer) {
  return !c.shrink || __ldcg(c.mask + peer) == 0;
}

// Last block of a kernel (`ticket`: its kind and half): resets the ticket and returns true once.
__device__ __forceinline__ bool last_block(uint32_t* ticket) {
  __shared__ int is_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const uint32_t t = atomicAdd(ticket, 1u);
    is_last = (t == gridDim.x - 1);
    if (is_last) *ticket = 0;
  }
  __syncthreads();
  return is_last != 0;
}

// Shrink mode: the receive's last block masks the sources the blocks agreed were missing (from
// the next kernel on: the mask stays fixed during a kernel) and resets the agreement. Nothing
// else: the signals carry their generation, so no receive state is kept outside shrink mode.
template <int kRemote>
__device__ void Transport<kRemote>::finish_receive(int kind) const {
  if (!c.shrink) return;
  if (last_block(c.ticket + kind_half(kind))) {
    int* states = c.source_state + kind_half(kind) * c.num_ranks;
    for (int j = threadIdx.x; j < c.num_ranks; j += kThreads) {
      if (states[j] == kStateMasked) c.mask[j] = 1;
      states[j] = kStateWaiting;
    }
  }
}

// Which phases an LL kernel runs: a runtime argument, so that one kernel per op serves both phases,
// as in DeepEP. Profilers then see one kernel named `dispatch` (`combine`) per op, launched once
// per phase in hook mode: DeepEP's test_low_latency.py (bench_kineto) requires exactly that.
__device__ __forceinline__ bool runs_phase(const DeepepLlCommon& c, int phase) { return (c.phases & phase) != 0; }
__device__ __forceinline__ bool runs_both_phases(const DeepepLlCommon& c) {
  return c.phases == (DEEPEP_LL_PHASE_SEND | DEEPEP_LL_PHASE_RECV);
}

}  // namespace ll
}  // namespace deepep
