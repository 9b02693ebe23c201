// Virtual ranks: the internode normal-mode kernels (notify, dispatch, combine) of R = N x G ranks
// on ONE GPU, without NCCL.
//
// The internode kernels form every window pointer from parameters (peer p's copy of the window
// at lsa_base + p * lsa_stride, DeepepInternodeCommon), so R windows carved out of one allocation
// at a fixed stride are, to the kernels, R ranks of N nodes of G: the NVLink leg (LSA stores
// between GPUs of a node) and the scale-out leg (kRemoteEmulated: the GIN ring protocol over LSA)
// both run on one GPU. Unlike the LL kernels, every internode kernel waits on its peers' kernels
// of the same step (notify is an all-to-all, the data kernels' rings need both ends), so the
// caller launches each rank's kernel on a stream of its own and every rank's grid of a step must
// be co-resident: R x 2C blocks (768 threads, one per SM at worst) and R notify blocks (1024
// threads) within the SMs (tests/gpu/internode_virtual.py checks R x 2C <= SMs).
//
// What the product's host (src/buffer.rs, src/internode) keeps per rank, the harness keeps in a
// per-rank state block (op epoch, ticket, running totals, stall and fault locks and records,
// receive counts, traffic counters), laid out here and read back by Python through inv_state_layout.
//
// Built into a shared library (scripts/test.sh) that tests/gpu/internode_virtual.py drives
// through ctypes; the argument vector is int64 slots named by inv_arg_name (Python takes the
// order from here, so the two cannot drift). Not part of the product.
#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "deepep_kernels.h"

#define INV_ARGS(X)                                                                                   \
  /* the virtual world (same for every call on it) */                                                \
  X(world_base) X(world_stride) X(state_base) X(timeout_ns) X(num_ranks) X(node_size) X(hidden)       \
  X(max_topk) X(num_channels) X(rdma_ring_tokens) X(nvl_ring_tokens)                                  \
  /* one call of one rank */                                                                          \
  X(rank) X(num_tokens) X(hidden_bytes) X(num_scales) X(num_topk) X(topk_idx_is_int32) X(num_experts)  \
  X(expert_alignment) X(num_worst_tokens) X(cached)                                                   \
  /* inputs (combine: x [Nr, H] bf16 and topk_weights [Nr, K], the rows to send back) */              \
  X(x) X(x_scales) X(scale_stride_token) X(scale_stride_scale) X(topk_idx) X(topk_weights)             \
  X(is_token_in_rank) X(num_tokens_per_rank) X(num_tokens_per_rdma_rank) X(num_tokens_per_expert)      \
  X(bias_0) X(bias_1)                                                                                 \
  /* the handle, by its dispatch names (combine reads the same tensors) */                            \
  X(rdma_channel_prefix_matrix) X(gbl_channel_prefix_matrix) X(recv_rdma_channel_prefix_matrix)        \
  X(recv_rdma_rank_prefix_sum) X(recv_gbl_channel_prefix_matrix) X(recv_gbl_rank_prefix_sum)           \
  X(recv_src_meta) X(send_rdma_head) X(send_nvl_head)                                                 \
  /* outputs; rows: of recv_* (combine: of x) and of send_nvl_head */                                 \
  X(recv_x) X(recv_x_scales) X(recv_topk_idx) X(recv_topk_weights) X(combined_x)                      \
  X(combined_topk_weights) X(num_recv_rows) X(num_rdma_recv_rows)

enum InvArg {
#define INV_ENUM(name) kArg_##name,
  INV_ARGS(INV_ENUM)
#undef INV_ENUM
      kNumArgs
};

namespace {

const char* const kArgNames[] = {
#define INV_NAME(name) #name,
    INV_ARGS(INV_NAME)
#undef INV_NAME
};

int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// The counters' channel stride Cb: one more than the world's channels, so that a kernel indexing
// by C instead of Cb writes another channel's counter (the product's Cb is SMs / 2, usually > C).
int64_t counter_channels(const int64_t* a) { return a[kArg_num_channels] + 1; }
// Window words (the counters, then the arrival word) and running totals (words) of the world
// (kernels/deepep_kernels.h).
int64_t num_window_words(const int64_t* a) {
  return 2 * counter_channels(a) * (a[kArg_num_ranks] / a[kArg_node_size]) + a[kArg_num_ranks] + 1;
}
int64_t num_totals(const int64_t* a) { return 2 * counter_channels(a) * (a[kArg_num_ranks] / a[kArg_node_size]) + 1; }

// A rank's window: the counters' words, the NVL region, the RDMA region. Regions do not overlap
// and are sized for the largest row of the world (a BF16 dispatch row with FP8-sized scales, or a
// combine row); simpler than the product's packing, which the kernels do not depend on.
struct Window {
  int64_t control, nvl, rdma, end;
};

Window window_layout(const int64_t* a) {
  const int64_t R = a[kArg_num_ranks], G = a[kArg_node_size], N = R / G, C = a[kArg_num_channels];
  const int64_t H = a[kArg_hidden], K = a[kArg_max_topk];
  const int64_t row = std::max(deepep_internode_dispatch_row_bytes(int32_t(2 * H), int32_t(H / 128), int32_t(K)),
                               deepep_internode_combine_row_bytes(int32_t(2 * H), int32_t(K)));
  Window w{};
  w.control = 0;
  w.nvl = align_up(8 * num_window_words(a), 4096);
  // C x G rings of nvl_ring slots (flag header + row), then a consumed word per slot.
  w.rdma = w.nvl + align_up(C * G * a[kArg_nvl_ring_tokens] * (row + DEEPEP_INTERNODE_NVL_HEADER_BYTES + 8), 4096);
  // Notify slots and staging [2][2][R], then receive and (GIN) send rings [2][C][N][ring].
  w.end = w.rdma + align_up(4 * R * DEEPEP_INTERNODE_NOTIFY_SLOT_INTS * 4 + 2 * C * N * a[kArg_rdma_ring_tokens] * row, 4096);
  return w;
}

// Per-rank state, what the product keeps in its workspace and host-mapped records (world fields
// of `a`: the totals' size).
enum StatePart {
  kOpEpoch, kTicket, kStallLock, kFaultLock, kTotals, kStall, kFault, kCounts, kTraffic, kStateBytes, kStateParts
};
int64_t state_offset(const int64_t* a, int part) {
  const int64_t totals = 64, stall = totals + align_up(8 * num_totals(a), 64);
  const int64_t fault = stall + align_up(sizeof(DeepepStallRecord), 64);
  const int64_t counts = fault + align_up(sizeof(DeepepFaultRecord), 64);
  const int64_t traffic = counts + align_up(sizeof(DeepepRecvCounts), 64);
  const int64_t at[kStateParts] = {0, 4, 8, 12, totals, stall, fault, counts, traffic, traffic + 8 * DEEPEP_TRAFFIC_KINDS};
  return at[part];
}

template <typename T>
T* ptr(const int64_t* a, int i) {
  return reinterpret_cast<T*>(a[i]);
}

DeepepInternodeCommon common_for(const int64_t* a) {
  const int64_t rank = a[kArg_rank], stride = a[kArg_world_stride];
  auto* world = ptr<uint8_t>(a, kArg_world_base);
  auto* state = ptr<uint8_t>(a, kArg_state_base) + rank * state_offset(a, kStateBytes);
  const Window w = window_layout(a);
  DeepepInternodeCommon c;
  std::memset(&c, 0, sizeof(c));
  c.window = nullptr;  // only the GIN transport reads the window handle
  c.lsa_base = world;
  c.lsa_stride = uint64_t(stride);
  c.local_base = world + rank * stride;
  c.nvl_offset = uint64_t(w.nvl);
  c.rdma_offset = uint64_t(w.rdma);
  c.control_offset = uint64_t(w.control);
  c.op_epoch = reinterpret_cast<uint32_t*>(state + state_offset(a, kOpEpoch));
  c.ticket = reinterpret_cast<uint32_t*>(state + state_offset(a, kTicket));
  c.totals = reinterpret_cast<uint64_t*>(state + state_offset(a, kTotals));
  c.traffic = reinterpret_cast<uint64_t*>(state + state_offset(a, kTraffic));
  c.fault = reinterpret_cast<DeepepFaultRecord*>(state + state_offset(a, kFault));
  c.wait.stall = reinterpret_cast<DeepepStallRecord*>(state + state_offset(a, kStall));
  c.wait.stall_lock = reinterpret_cast<uint32_t*>(state + state_offset(a, kStallLock));
  c.wait.fault_lock = reinterpret_cast<uint32_t*>(state + state_offset(a, kFaultLock));
  c.wait.timeout_ns = uint64_t(a[kArg_timeout_ns]);
  c.wait.world_rank = int32_t(rank);
  c.wait.lsa_base_rank = 0;  // one flat world: every rank is an LSA peer
  c.rank = int32_t(rank);
  c.num_ranks = int32_t(a[kArg_num_ranks]);
  c.node_size = int32_t(a[kArg_node_size]);
  c.num_nodes = int32_t(a[kArg_num_ranks] / a[kArg_node_size]);
  c.num_channels = int32_t(a[kArg_num_channels]);
  c.rdma_ring_tokens = int32_t(a[kArg_rdma_ring_tokens]);
  c.nvl_ring_tokens = int32_t(a[kArg_nvl_ring_tokens]);
  c.gin_signal_base = 0;
  c.counter_channels = int32_t(counter_channels(a));
  return c;
}

// The kernel build for the NCCL headers this file is compiled against (kernels/nccl_builds.txt).
const DeepepNcclBuild& kernels() {
  static const DeepepNcclBuild& build = *DEEPEP_NCCL_BUILD_FN(NCCL_VERSION_CODE)();
  return build;
}

// The launchers copy an ncclDevComm by value into the kernel parameters; the emulated transport
// never reads it, so zeroed bytes of the build's size stand in for it.
const void* null_dev_comm() {
  static std::vector<uint8_t> bytes(kernels().devcomm_size, 0);
  return bytes.data();
}

// The notify round's fields common to dispatch and combine.
DeepepInternodeNotifyParams notify_for(const int64_t* a) {
  DeepepInternodeNotifyParams p;
  std::memset(&p, 0, sizeof(p));
  p.common = common_for(a);
  p.recv_rdma_channel_prefix_matrix = ptr<int32_t>(a, kArg_recv_rdma_channel_prefix_matrix);
  p.recv_rdma_rank_prefix_sum = ptr<int32_t>(a, kArg_recv_rdma_rank_prefix_sum);
  p.num_tokens = a[kArg_num_tokens];
  p.expert_alignment = 1;
  return p;
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) int inv_num_args() { return kNumArgs; }
__attribute__((visibility("default"))) const char* inv_arg_name(int i) {
  return i >= 0 && i < kNumArgs ? kArgNames[i] : nullptr;
}
// Bytes of one virtual rank's window (world fields only).
__attribute__((visibility("default"))) int64_t inv_window_bytes(const int64_t* a) { return window_layout(a).end; }
// Per-rank state layout (world fields only): offsets of op_epoch (u32), ticket (u32), stall_lock
// (u32), fault_lock (u32), totals (u64 [2 Cb N + 1]), the stall record, the fault record, the
// receive counts (DeepepRecvCounts), the traffic counters (u64 [DEEPEP_TRAFFIC_KINDS]), and the
// bytes of one rank's block (10 values into `out`).
__attribute__((visibility("default"))) void inv_state_layout(const int64_t* a, int64_t* out) {
  for (int part = 0; part < kStateParts; ++part) out[part] = state_offset(a, part);
}
// Notify and data kernels' limits (DEEPEP_INTERNODE_MAX_NODES, _MAX_NODE_SIZE, DEEPEP_MAX_CHANNELS,
// DEEPEP_MAX_LOCAL_EXPERTS: 4 values into `out`).
__attribute__((visibility("default"))) void inv_limits(int64_t* out) {
  out[0] = DEEPEP_INTERNODE_MAX_NODES;
  out[1] = DEEPEP_INTERNODE_MAX_NODE_SIZE;
  out[2] = DEEPEP_MAX_CHANNELS;
  out[3] = DEEPEP_MAX_LOCAL_EXPERTS;
}

// A stream of its own for one virtual rank. Not torch's: its pool has 32 streams per device, so a
// 33rd rank would share rank 0's stream and wait behind rank 0's kernel, which waits on it.
__attribute__((visibility("default"))) void* inv_stream_create() {
  cudaStream_t s = nullptr;
  return cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess ? s : nullptr;
}
__attribute__((visibility("default"))) void inv_stream_destroy(void* s) { cudaStreamDestroy(static_cast<cudaStream_t>(s)); }

// One rank's dispatch notify on `stream` (src/internode/dispatch.rs prepare): writes the handle's
// prefix matrices (non-cached) and the receive side; non-cached without num_worst_tokens, also
// the rank's receive counts (state's DeepepRecvCounts; set num_recv_tokens to -1 before).
// Returns a cudaError_t value.
__attribute__((visibility("default"))) int inv_dispatch_notify(const int64_t* a, void* stream) {
  DeepepInternodeNotifyParams p = notify_for(a);
  const bool cached = a[kArg_cached] != 0;
  p.is_token_in_rank = ptr<const uint8_t>(a, kArg_is_token_in_rank);
  p.num_tokens_per_rank = ptr<const int32_t>(a, kArg_num_tokens_per_rank);
  p.num_tokens_per_rdma_rank = ptr<const int32_t>(a, kArg_num_tokens_per_rdma_rank);
  p.num_tokens_per_expert = ptr<const int32_t>(a, kArg_num_tokens_per_expert);
  p.topk_idx = ptr<const void>(a, kArg_topk_idx);
  p.rdma_channel_prefix_matrix = ptr<int32_t>(a, kArg_rdma_channel_prefix_matrix);
  p.gbl_channel_prefix_matrix = ptr<int32_t>(a, kArg_gbl_channel_prefix_matrix);
  p.recv_gbl_channel_prefix_matrix = ptr<int32_t>(a, kArg_recv_gbl_channel_prefix_matrix);
  p.recv_gbl_rank_prefix_sum = ptr<int32_t>(a, kArg_recv_gbl_rank_prefix_sum);
  if (!cached && a[kArg_num_worst_tokens] == 0)
    p.counts = reinterpret_cast<DeepepRecvCounts*>(ptr<uint8_t>(a, kArg_state_base) +
                                                   a[kArg_rank] * state_offset(a, kStateBytes) + state_offset(a, kCounts));
  p.num_topk = int32_t(a[kArg_num_topk]);
  p.topk_idx_is_int32 = int32_t(a[kArg_topk_idx_is_int32]);
  p.num_experts = cached ? 0 : int32_t(a[kArg_num_experts]);
  p.expert_alignment = int32_t(a[kArg_expert_alignment]);
  p.cached = int32_t(cached);
  p.num_worst_tokens = int32_t(a[kArg_num_worst_tokens]);
  p.dispatch = 1;
  return kernels().launch_internode_notify(null_dev_comm(), &p, DEEPEP_LL_REMOTE_EMULATED, stream);
}

// One rank's dispatch data kernel on `stream` (src/internode/dispatch.rs launch).
__attribute__((visibility("default"))) int inv_dispatch(const int64_t* a, void* stream) {
  DeepepInternodeDispatchParams p;
  std::memset(&p, 0, sizeof(p));
  p.common = common_for(a);
  p.x = ptr<const void>(a, kArg_x);
  p.x_scales = ptr<const void>(a, kArg_x_scales);
  p.topk_idx = ptr<const void>(a, kArg_topk_idx);
  p.topk_weights = ptr<const float>(a, kArg_topk_weights);
  p.is_token_in_rank = ptr<const uint8_t>(a, kArg_is_token_in_rank);
  p.recv_rdma_channel_prefix_matrix = ptr<const int32_t>(a, kArg_recv_rdma_channel_prefix_matrix);
  p.recv_rdma_rank_prefix_sum = ptr<const int32_t>(a, kArg_recv_rdma_rank_prefix_sum);
  p.recv_gbl_channel_prefix_matrix = ptr<const int32_t>(a, kArg_recv_gbl_channel_prefix_matrix);
  p.recv_gbl_rank_prefix_sum = ptr<const int32_t>(a, kArg_recv_gbl_rank_prefix_sum);
  p.recv_x = ptr<void>(a, kArg_recv_x);
  p.recv_x_scales = ptr<void>(a, kArg_recv_x_scales);
  p.recv_topk_idx = ptr<void>(a, kArg_recv_topk_idx);
  p.recv_topk_weights = ptr<float>(a, kArg_recv_topk_weights);
  p.recv_src_meta = ptr<uint8_t>(a, kArg_recv_src_meta);
  p.send_rdma_head = ptr<int32_t>(a, kArg_send_rdma_head);
  p.send_nvl_head = ptr<int32_t>(a, kArg_send_nvl_head);
  p.num_tokens = a[kArg_num_tokens];
  p.num_recv_rows = a[kArg_num_recv_rows];
  p.num_rdma_recv_rows = a[kArg_num_rdma_recv_rows];
  p.scale_stride_token = a[kArg_scale_stride_token];
  p.scale_stride_scale = a[kArg_scale_stride_scale];
  p.hidden_bytes = int32_t(a[kArg_hidden_bytes]);
  p.num_scales = int32_t(a[kArg_num_scales]);
  p.num_topk = int32_t(a[kArg_num_topk]);
  p.topk_idx_is_int32 = int32_t(a[kArg_topk_idx_is_int32]);
  p.num_experts = int32_t(a[kArg_num_experts]);
  p.row_bytes = int32_t(deepep_internode_dispatch_row_bytes(p.hidden_bytes, p.num_scales, p.num_topk));
  return kernels().launch_internode_dispatch(null_dev_comm(), &p, DEEPEP_LL_REMOTE_EMULATED, stream);
}

// One rank's combine notify on `stream` (src/internode/combine.rs launches it and the data kernel
// back to back): a barrier, then the heads' rewrite in place. The harness launches every rank's
// notify before any data kernel: with more ranks than hardware queues (32), two ranks' streams
// share one, and a rank's data kernel queued before the other's notify would wait for its own
// notify, which waits for the other's.
__attribute__((visibility("default"))) int inv_combine_notify(const int64_t* a, void* stream) {
  DeepepInternodeNotifyParams n = notify_for(a);
  n.combined_rdma_head = ptr<int32_t>(a, kArg_send_rdma_head);
  n.combined_nvl_head = ptr<int32_t>(a, kArg_send_nvl_head);
  n.num_rdma_rows = a[kArg_num_rdma_recv_rows];
  return kernels().launch_internode_notify(null_dev_comm(), &n, DEEPEP_LL_REMOTE_EMULATED, stream);
}

// One rank's combine data kernel on `stream`, after its combine notify. x: [num_recv_rows, H] bf16.
__attribute__((visibility("default"))) int inv_combine(const int64_t* a, void* stream) {
  DeepepInternodeCombineParams p;
  std::memset(&p, 0, sizeof(p));
  p.common = common_for(a);
  p.x = ptr<const void>(a, kArg_x);
  p.topk_weights = ptr<const float>(a, kArg_topk_weights);
  p.bias_0 = ptr<const void>(a, kArg_bias_0);
  p.bias_1 = ptr<const void>(a, kArg_bias_1);
  p.rdma_channel_prefix_matrix = ptr<const int32_t>(a, kArg_recv_rdma_channel_prefix_matrix);
  p.rdma_rank_prefix_sum = ptr<const int32_t>(a, kArg_recv_rdma_rank_prefix_sum);
  p.gbl_channel_prefix_matrix = ptr<const int32_t>(a, kArg_recv_gbl_channel_prefix_matrix);
  p.combined_rdma_head = ptr<int32_t>(a, kArg_send_rdma_head);
  p.combined_nvl_head = ptr<int32_t>(a, kArg_send_nvl_head);
  p.src_meta = ptr<const int32_t>(a, kArg_recv_src_meta);
  p.combined_x = ptr<void>(a, kArg_combined_x);
  p.combined_topk_weights = ptr<float>(a, kArg_combined_topk_weights);
  p.num_tokens = a[kArg_num_tokens];
  p.num_recv_rows = a[kArg_num_recv_rows];
  p.num_rdma_recv_rows = a[kArg_num_rdma_recv_rows];
  p.hidden_bytes = int32_t(2 * a[kArg_hidden]);
  p.num_topk = int32_t(a[kArg_num_topk]);
  p.row_bytes = int32_t(deepep_internode_combine_row_bytes(p.hidden_bytes, p.num_topk));
  return kernels().launch_internode_combine(null_dev_comm(), &p, DEEPEP_LL_REMOTE_EMULATED, stream);
}

}  // extern "C"
