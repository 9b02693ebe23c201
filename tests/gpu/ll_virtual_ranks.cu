// Virtual ranks: the LL kernels of R ranks on ONE GPU, without NCCL.
//
// The LL kernels form every window pointer from parameters (peer p's copy of the window at
// lsa_base + p * lsa_stride), so R windows carved out of one allocation at a fixed stride are,
// to the kernels, R ranks of one LSA team. Launching every rank's send, then every rank's
// receive, runs the multi-source protocol (count messages, signals, per-source prefixes, the
// emulated remote path) where only one GPU is available; each receive kernel reads its own
// window, as on real hardware, so its time is the one-rank-of-R kernel time (hook mode).
//
// Built into a shared library (scripts/test.sh) that tests/gpu/ll_virtual.py drives through
// ctypes; the argument vector is int64 slots named by llv_arg_name (Python takes the order from
// here, so the two cannot drift). Not part of the product.
#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "deepep_kernels.h"

#define LLV_ARGS(X)                                                                                    \
  /* the virtual world (same for every call on it) */                                                 \
  X(world_base) X(world_stride) X(workspace_base) X(stall_record) X(stall_lock) X(fault_record)        \
  X(fault_lock) X(timeout_ns)                                                                          \
  X(num_ranks) X(num_experts) X(max_tokens) X(hidden) X(node_size) X(remote_kind) X(num_blocks)         \
  X(shrink)                                                                                            \
  /* one call of one rank */                                                                           \
  X(rank) X(phases) X(parity) X(num_topk) X(num_tokens) X(x) X(topk_idx) X(topk_idx_is_int32)          \
  /* dispatch */                                                                                       \
  X(use_fp8) X(round_scale) X(use_ue8m0) X(packed_recv_x) X(packed_recv_x_scales) X(packed_recv_count)  \
  X(packed_recv_src_info) X(packed_recv_layout_range) X(cumulative_stats) X(wait_stats)                \
  /* combine (x: the expert outputs; src_info / layout_range: the dispatch's) */                       \
  X(topk_weights) X(src_info) X(layout_range) X(out) X(use_logfmt)

enum LlvArg {
#define LLV_ENUM(name) kArg_##name,
  LLV_ARGS(LLV_ENUM)
#undef LLV_ENUM
      kNumArgs
};

namespace {

const char* const kArgNames[] = {
#define LLV_NAME(name) #name,
    LLV_ARGS(LLV_NAME)
#undef LLV_NAME
};

int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// One half of a virtual rank's window. Regions do not overlap, so any layout the kernels are
// given must work; this one is simpler than the product's (which packs into DeepEP's sizes).
struct Half {
  int64_t signal, count, dispatch_recv, staging, combine_recv, view, end;
};

Half half_layout(const int64_t* a, int64_t base) {
  const int64_t R = a[kArg_num_ranks], E = a[kArg_num_experts], M = a[kArg_max_tokens], H = a[kArg_hidden];
  const int64_t slot = deepep_ll_dispatch_slot_bytes(int32_t(H), DEEPEP_LL_MAX_TOPK, 0);  // the largest slot
  const int64_t cslot = 2 * H + 4 * (H / 128);
  Half h{};
  h.signal = base;
  h.count = h.signal + align_up(16 * R, 128);  // uint64 words [2 kinds][R]
  const int64_t counts = R * deepep_ll_count_bytes(int32_t(E / R), int32_t(M));
  h.dispatch_recv = h.count + align_up(counts, 128);
  h.staging = h.dispatch_recv + align_up(R * M * slot, 128);
  h.combine_recv = h.staging + align_up(M * slot + counts, 128);
  h.view = h.combine_recv + align_up(E * M * cslot, 128);
  h.end = h.view + align_up(E * M * (2 * H + H / 32), 128);
  return h;
}

// Half `parity` of a rank's window (the halves lie back to back).
Half half_of(const int64_t* a, int64_t parity) { return half_layout(a, parity * half_layout(a, 0).end); }

// After both halves: the clean barrier's arrival words [R] (never zeroed, as the product's).
int64_t clean_barrier_offset(const int64_t* a) { return half_of(a, 1).end; }

// Per-rank workspace (arrays per [kind][half], as in DeepepLlCommon): done [4R], source_state
// [4R], ticket [8], mask [R], then op_seq [4][DEEPEP_LL_MAX_BLOCKS] and gin_sent [4R] (uint64),
// then the clean barrier's count of barriers passed. What clean zeroes: everything before the
// mask, and op_seq + gin_sent.
enum WsPart { kWsDone, kWsSourceState, kWsTicket, kWsMask, kWsOpSeq, kWsGinSent, kWsCleanEpoch, kWsBytes, kWsParts };
int64_t ws_offset(int64_t R, int part) {
  const int64_t at[kWsParts] = {0, 16 * R, 32 * R, 32 * R + 32, align_up(36 * R + 32, 128),
                                align_up(36 * R + 32, 128) + 8 * 4 * DEEPEP_LL_MAX_BLOCKS,
                                align_up(36 * R + 32, 128) + 8 * 4 * DEEPEP_LL_MAX_BLOCKS + 32 * R,
                                align_up(36 * R + 32, 128) + 8 * 4 * DEEPEP_LL_MAX_BLOCKS + 32 * R + 128};
  return at[part];
}
int64_t clean_epoch_offset(int64_t R) { return ws_offset(R, kWsCleanEpoch); }
int64_t workspace_bytes(int64_t R) { return ws_offset(R, kWsBytes); }

DeepepLlCommon common_for(const int64_t* a) {
  const int64_t R = a[kArg_num_ranks], rank = a[kArg_rank];
  const int64_t stride = a[kArg_world_stride];
  auto* world = reinterpret_cast<uint8_t*>(a[kArg_world_base]);
  const Half h = half_of(a, a[kArg_parity]);
  auto* ws = reinterpret_cast<uint8_t*>(a[kArg_workspace_base]) + rank * workspace_bytes(R);
  DeepepLlCommon c;
  std::memset(&c, 0, sizeof(c));
  c.window = nullptr;  // only the GIN transport reads the window handle
  c.lsa_base = world;
  c.lsa_stride = uint64_t(stride);
  c.local_base = world + rank * stride;
  c.signal_offset = uint64_t(h.signal);
  c.combine_recv_offset = uint64_t(h.combine_recv);
  c.view_offset = uint64_t(h.view);
  c.staging_offset = uint64_t(h.staging);
  c.dispatch_recv_offset = uint64_t(h.dispatch_recv);
  c.count_offset = uint64_t(h.count);
  c.done = reinterpret_cast<int32_t*>(ws + ws_offset(R, kWsDone));
  c.source_state = reinterpret_cast<int32_t*>(ws + ws_offset(R, kWsSourceState));
  c.ticket = reinterpret_cast<uint32_t*>(ws + ws_offset(R, kWsTicket));
  c.mask = reinterpret_cast<int32_t*>(ws + ws_offset(R, kWsMask));
  c.op_seq = reinterpret_cast<uint64_t*>(ws + ws_offset(R, kWsOpSeq));
  c.gin_sent = reinterpret_cast<uint64_t*>(ws + ws_offset(R, kWsGinSent));
  c.fault = reinterpret_cast<DeepepFaultRecord*>(a[kArg_fault_record]);
  c.wait.stall = reinterpret_cast<DeepepStallRecord*>(a[kArg_stall_record]);
  c.wait.stall_lock = reinterpret_cast<uint32_t*>(a[kArg_stall_lock]);
  c.wait.fault_lock = reinterpret_cast<uint32_t*>(a[kArg_fault_lock]);
  c.wait.timeout_ns = uint64_t(a[kArg_timeout_ns]);
  c.wait.world_rank = int32_t(rank);
  c.wait.lsa_base_rank = 0;
  c.rank = int32_t(rank);
  c.num_ranks = int32_t(R);
  c.num_experts = int32_t(a[kArg_num_experts]);
  c.num_local_experts = int32_t(a[kArg_num_experts] / R);
  c.max_tokens = int32_t(a[kArg_max_tokens]);
  c.hidden = int32_t(a[kArg_hidden]);
  c.num_topk = int32_t(a[kArg_num_topk]);
  c.node_size = int32_t(a[kArg_node_size]);
  c.shrink = int32_t(a[kArg_shrink]);
  c.phases = int32_t(a[kArg_phases]);
  c.parity = int32_t(a[kArg_parity]);
  return c;
}

// The kernel build for the NCCL headers this file is compiled against (kernels/nccl_builds.txt).
const DeepepNcclBuild& kernels() {
  static const DeepepNcclBuild& build = *DEEPEP_NCCL_BUILD_FN(NCCL_VERSION_CODE)();
  return build;
}

// The launchers copy an ncclDevComm by value into the kernel parameters; the LSA and emulated
// transports never read it, so zeroed bytes of the build's size stand in for it.
const void* null_dev_comm() {
  static std::vector<uint8_t> bytes(kernels().devcomm_size, 0);
  return bytes.data();
}

template <typename T>
T* ptr(const int64_t* a, int i) {
  return reinterpret_cast<T*>(a[i]);
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) int llv_num_args() { return kNumArgs; }
__attribute__((visibility("default"))) const char* llv_arg_name(int i) {
  return i >= 0 && i < kNumArgs ? kArgNames[i] : nullptr;
}
// Bytes of one virtual rank's window (both halves) and of one rank's workspace.
__attribute__((visibility("default"))) int64_t llv_window_bytes(const int64_t* a) {
  return clean_barrier_offset(a) + align_up(4 * a[kArg_num_ranks], 128);
}
__attribute__((visibility("default"))) int64_t llv_workspace_bytes(int64_t num_ranks) {
  return workspace_bytes(num_ranks);
}
// Where the LL halves end in a rank's window (the clean barrier's words follow), and where the
// workspace's clean-barrier count lies: what the tests scribble over and read back.
__attribute__((visibility("default"))) int64_t llv_clean_barrier_offset(const int64_t* a) {
  return clean_barrier_offset(a);
}
// The fault code of two LL sends in a row on one half (the tests read it here, not as a literal).
__attribute__((visibility("default"))) int llv_fault_ll_same_half() { return DEEPEP_FAULT_LL_SAME_HALF; }
__attribute__((visibility("default"))) int64_t llv_clean_epoch_offset(int64_t num_ranks) {
  return clean_epoch_offset(num_ranks);
}
// Per-rank workspace layout: offsets of done, source_state, ticket, mask, op_seq, gin_sent, the
// clean's barrier count, and the bytes (8 values into `out`).
__attribute__((visibility("default"))) void llv_workspace_layout(int64_t num_ranks, int64_t* out) {
  for (int part = 0; part < kWsParts; ++part) out[part] = ws_offset(num_ranks, part);
}
// Window offset of half `parity`'s signal words (16R bytes: uint64 [2 kinds][R]).
__attribute__((visibility("default"))) int64_t llv_signal_offset(const int64_t* a, int64_t parity) {
  return half_of(a, parity).signal;
}

// One rank's dispatch phases (a[phases]) on `stream`; returns a cudaError_t value.
__attribute__((visibility("default"))) int llv_dispatch(const int64_t* a, void* stream) {
  DeepepLlDispatchParams p;
  std::memset(&p, 0, sizeof(p));
  p.common = common_for(a);
  p.x = ptr<const void>(a, kArg_x);
  p.topk_idx = ptr<const void>(a, kArg_topk_idx);
  p.packed_recv_x = ptr<void>(a, kArg_packed_recv_x);
  p.packed_recv_x_scales = ptr<void>(a, kArg_packed_recv_x_scales);
  p.packed_recv_count = ptr<int32_t>(a, kArg_packed_recv_count);
  p.packed_recv_src_info = ptr<int32_t>(a, kArg_packed_recv_src_info);
  p.packed_recv_layout_range = ptr<int64_t>(a, kArg_packed_recv_layout_range);
  p.cumulative_local_expert_recv_stats = ptr<int32_t>(a, kArg_cumulative_stats);
  p.dispatch_wait_recv_cost_stats = ptr<int64_t>(a, kArg_wait_stats);
  p.num_tokens = int32_t(a[kArg_num_tokens]);
  p.topk_idx_is_int32 = int32_t(a[kArg_topk_idx_is_int32]);
  p.use_fp8 = int32_t(a[kArg_use_fp8]);
  p.round_scale = int32_t(a[kArg_round_scale]);
  p.use_ue8m0 = int32_t(a[kArg_use_ue8m0]);
  p.dispatch_slot_bytes =
      int32_t(deepep_ll_dispatch_slot_bytes(p.common.hidden, p.common.num_topk, p.use_fp8));
  p.count_bytes = int32_t(deepep_ll_count_bytes(p.common.num_local_experts, p.common.max_tokens));
  return kernels().launch_ll_dispatch(null_dev_comm(), &p, int(a[kArg_remote_kind]), int(a[kArg_num_blocks]),
                                      stream);
}

// One rank's combine phases on `stream`.
__attribute__((visibility("default"))) int llv_combine(const int64_t* a, void* stream) {
  DeepepLlCombineParams p;
  std::memset(&p, 0, sizeof(p));
  p.common = common_for(a);
  p.x = ptr<const void>(a, kArg_x);
  p.topk_idx = ptr<const void>(a, kArg_topk_idx);
  p.topk_weights = ptr<const float>(a, kArg_topk_weights);
  p.src_info = ptr<const int32_t>(a, kArg_src_info);
  p.layout_range = ptr<const int64_t>(a, kArg_layout_range);
  p.out = ptr<void>(a, kArg_out);
  p.combine_wait_recv_cost_stats = ptr<int64_t>(a, kArg_wait_stats);
  p.num_tokens = int32_t(a[kArg_num_tokens]);
  p.topk_idx_is_int32 = int32_t(a[kArg_topk_idx_is_int32]);
  p.zero_copy = 0;
  p.use_logfmt = int32_t(a[kArg_use_logfmt]);
  return kernels().launch_ll_combine(null_dev_comm(), &p, int(a[kArg_remote_kind]), int(a[kArg_num_blocks]), stream);
}

// One rank's clean_low_latency_buffer on `stream`: it barriers with the other ranks' cleans, so
// every participating rank's clean must be in flight at once (one stream each).
__attribute__((visibility("default"))) int llv_clean(const int64_t* a, void* stream) {
  const int64_t R = a[kArg_num_ranks];
  DeepepLlCleanParams p;
  std::memset(&p, 0, sizeof(p));
  p.common = common_for(a);
  p.common.parity = DEEPEP_LL_CLEAN_BANK;
  p.common.signal_offset = uint64_t(clean_barrier_offset(a));
  auto* ws = reinterpret_cast<uint8_t*>(p.common.done);
  p.barrier_epoch = reinterpret_cast<uint32_t*>(ws + clean_epoch_offset(R));
  for (int half = 0; half < 2; ++half) {
    p.zero[half] = p.common.local_base + half_of(a, half).signal;
    p.zero_bytes[half] = 16 * R;
  }
  p.zero[2] = p.common.done;  // done, source_state, ticket (the mask after them stays)
  p.zero_bytes[2] = ws_offset(R, kWsMask);
  p.zero[3] = p.common.op_seq;  // op_seq and gin_sent (the kernel then writes the generation)
  p.zero_bytes[3] = ws_offset(R, kWsCleanEpoch) - ws_offset(R, kWsOpSeq);
  return kernels().launch_ll_clean(null_dev_comm(), &p, int(a[kArg_remote_kind]), stream);
}

// Timing builds: a copy of a kernel file with per-block timestamps defines deepep_stamps_copy,
// and the library is compiled with -DDEEPEP_STAMPS (not part of the product or its tests).
#ifdef DEEPEP_STAMPS
int deepep_stamps_copy(void* dst, size_t bytes);
__attribute__((visibility("default"))) int llv_stamps(void* dst, size_t bytes) { return deepep_stamps_copy(dst, bytes); }
#endif
}  // extern "C"
