// Launch surface between the Rust core and the CUDA kernels: the one definition of these
// structs, enums and constants. Rust's view (src/kernels/bindings.rs, with compile-time
// size/offset checks) is generated from this file by scripts/gen-kernel-bindings.sh.
#ifndef DEEPEP_KERNELS_H
#define DEEPEP_KERNELS_H

#include <stddef.h>
#include <stdint.h>

// Constants the public C ABI exposes too (DEEPEP_MAX_LOCAL_EXPERTS, DEEPEP_NUM_MAX_NVL_PEERS,
// DEEPEP_LL_PHASE_*) are defined once in src/capi; build.rs writes this header before nvcc runs.
#include "../include/deepep_nccl.h"

#ifdef __cplusplus
extern "C" {
#endif

// What a bounded GPU wait was doing when it gave up.
enum DeepepWaitOp {
  DEEPEP_WAIT_OP_NONE = 0,
  DEEPEP_WAIT_OP_LSA_BARRIER = 1,
  DEEPEP_WAIT_OP_DISPATCH_SLOT = 2,      // receiver waiting for a peer's dispatch slot
  DEEPEP_WAIT_OP_DISPATCH_CONSUMED = 3,  // sender waiting for a peer to free a dispatch slot
  DEEPEP_WAIT_OP_COMBINE_SLOT = 4,
  DEEPEP_WAIT_OP_COMBINE_CONSUMED = 5,
  DEEPEP_WAIT_OP_LL_DISPATCH = 6,        // low-latency receiver waiting for a source rank's dispatch signal
  DEEPEP_WAIT_OP_LL_COMBINE = 7,         // low-latency receiver waiting for an expert rank's combine signal
  DEEPEP_WAIT_OP_LL_CLEAN = 8,           // clean_low_latency_buffer's barrier waiting for a rank to arrive
  // Internode normal mode; `counter` is the channel (the source rank for a notify wait).
  DEEPEP_WAIT_OP_INTERNODE_NOTIFY = 9,   // notify: waiting for a rank's counts (scale-out leg when remote)
  DEEPEP_WAIT_OP_RDMA_TAIL = 10,         // scale-out leg: waiting for a node's rows in a ring
  DEEPEP_WAIT_OP_RDMA_HEAD = 11,         // scale-out leg: waiting for a node to free ring slots
  DEEPEP_WAIT_OP_NVL_SLOT = 12,          // NVLink leg: waiting for a local peer's ring slot
  DEEPEP_WAIT_OP_NVL_CONSUMED = 13,      // NVLink leg: waiting for a local peer to free a slot
};

// Written by the first GPU thread whose wait expires; lives in host-mapped
// memory so the host can read it after the kernel has exited.
typedef struct DeepepStallRecord {
  uint32_t flag;     // 0 = no stall recorded, 1 = stalled
  int32_t rank;      // world rank of the waiting GPU
  int32_t peer;      // world rank it was waiting on (-1 if unknown)
  int32_t op;        // enum DeepepWaitOp
  int32_t counter;   // barrier index or counter slot
  int32_t reserved;
  int64_t expected;  // value waited for
  int64_t seen;      // last value observed
} DeepepStallRecord;

typedef struct DeepepWaitContext {
  DeepepStallRecord* stall;  // device view of the host-mapped record
  uint32_t* stall_lock;      // device memory, 0 until the first stall claims it
  uint32_t* fault_lock;      // device memory: faults claimed (DeepepFaultRecord.released while free)
  uint64_t timeout_ns;       // budget per wait, measured with %globaltimer
  int32_t world_rank;
  int32_t lsa_base_rank;     // world rank of LSA rank 0 (LSA teams are consecutive)
} DeepepWaitContext;

typedef struct DeepepLayoutParams {
  const void* topk_idx;            // [num_tokens, num_topk], contiguous
  int64_t num_tokens;
  int32_t num_topk;
  int32_t topk_idx_is_int32;       // 0: int64, 1: int32
  int32_t num_experts;
  int32_t num_ranks;
  int32_t num_rdma_ranks;          // 0 when num_tokens_per_rdma_rank is not produced
  int32_t num_ranks_per_rdma_rank; // GPUs per node (8 for DeepEP's topology)
  int32_t* num_tokens_per_rank;    // [num_ranks]
  int32_t* num_tokens_per_rdma_rank; // [num_rdma_ranks] or NULL
  int32_t* num_tokens_per_expert;  // [num_experts]
  uint8_t* is_token_in_rank;       // [num_tokens, num_ranks] bool
  int32_t* accumulators;           // workspace: one per counter, zero between launches
  uint32_t* ticket;                // workspace: zero between launches
  int64_t accumulators_capacity;   // int32 elements available at `accumulators`
  int32_t num_sms;
  int32_t reserved;
} DeepepLayoutParams;

// Bad input the GPU found (the host turns it into an error naming the argument).
enum DeepepFaultCode {
  DEEPEP_FAULT_NONE = 0,
  DEEPEP_FAULT_TOPK_OUT_OF_RANGE = 1,   // a = flat index, b = value, c = num_experts
  DEEPEP_FAULT_RANK_COUNT = 2,          // a = rank, b = num_tokens_per_rank[rank], c = is_token_in_rank count
  DEEPEP_FAULT_WORST_TOO_SMALL = 3,     // a = num_worst_tokens, b = tokens received
  DEEPEP_FAULT_DISPATCH_HANDLE = 4,     // a = enum DeepepHandleEntry, b = flat index, c = value
  DEEPEP_FAULT_COMBINE_HANDLE = 5,      // a = enum DeepepHandleEntry, b = flat index, c = value
  DEEPEP_FAULT_LL_SAME_HALF = 6,        // a = buffer half that took two LL sends in a row (a CUDA graph
                                        // with an odd number of LL ops replayed), b = rank
  DEEPEP_FAULT_LL_COMBINE_HANDLE = 7,   // a = enum DeepepHandleEntry, b = flat index, c = value
  DEEPEP_FAULT_RDMA_RANK_COUNT = 8,     // a = node, b = num_tokens_per_rdma_rank[node], c = is_token_in_rank count
  DEEPEP_FAULT_SHRINK_UNWRITTEN = 9,    // internode dispatch (shrink): recv row a left unwritten with its forwarder
                                        // live; b = source rank << 48 | channel << 32 | the group's slots taken but
                                        // not written << 16 | rows its end markers emptied (16 bits each), c = its
                                        // slots taken << 32 | its final slot total (markers included)
};

// Which index-bearing entry a kernel found out of range (a handle's, or one a peer sent).
enum DeepepHandleEntry {
  DEEPEP_HANDLE_RANK_PREFIX = 0,          // rank_prefix_matrix [R, R]
  DEEPEP_HANDLE_CHANNEL_PREFIX = 1,       // channel_prefix_matrix [R, C]
  DEEPEP_HANDLE_RECV_CHANNEL_PREFIX = 2,  // recv_channel_prefix_matrix [R, C]
  DEEPEP_HANDLE_SEND_HEAD = 3,            // send_head [T, R]
  DEEPEP_HANDLE_PEER_COUNTS = 4,          // counts a peer sent in notify: [R] totals, then [C] channel prefixes
  DEEPEP_HANDLE_LL_LAYOUT_RANGE = 5,      // LL handle's layout_range [E_l, R]: (first row << 32) | rows
  DEEPEP_HANDLE_LL_SRC_INFO = 6,          // LL handle's src_info [E_l, R*M]: source token index
  // Internode handle entries (DeepEP's handle index in brackets).
  DEEPEP_HANDLE_RDMA_CHANNEL_PREFIX = 7,       // [1] rdma_channel_prefix_matrix [N, C]
  DEEPEP_HANDLE_GBL_CHANNEL_PREFIX = 8,        // [2] gbl_channel_prefix_matrix [R, C]
  DEEPEP_HANDLE_RECV_RDMA_CHANNEL_PREFIX = 9,  // [3] recv_rdma_channel_prefix_matrix [N, C]
  DEEPEP_HANDLE_RECV_RDMA_RANK_PREFIX = 10,    // [4] recv_rdma_rank_prefix_sum [N]
  DEEPEP_HANDLE_RECV_GBL_CHANNEL_PREFIX = 11,  // [5] recv_gbl_channel_prefix_matrix [R, C]
  DEEPEP_HANDLE_RECV_GBL_RANK_PREFIX = 12,     // [6] recv_gbl_rank_prefix_sum [R]
  DEEPEP_HANDLE_SRC_META = 13,                 // [7] recv_src_meta as int32 [rows, 2]: source node, NVLink mask
  DEEPEP_HANDLE_SEND_RDMA_HEAD = 14,           // [8] send_rdma_head [T, N]
  DEEPEP_HANDLE_SEND_NVL_HEAD = 15,            // [9] send_nvl_head [rows, G]
  DEEPEP_HANDLE_IS_TOKEN_IN_RANK = 16,         // intranode is_token_in_rank [T, R] against channel_prefix_matrix
};

// Host-mapped: the first fault wins until the host has reported it. A fault is claimed by
// moving DeepepWaitContext.fault_lock (device memory: atomics on host-mapped memory are not
// guaranteed over PCIe) from `released` to released + 1; the host frees the record by clearing
// it, then bumping `released` (it cannot write the device word without a CUDA call).
typedef struct DeepepFaultRecord {
  uint32_t flag;      // 1 once the fields are written
  int32_t code;       // enum DeepepFaultCode
  int64_t a, b, c;
  uint32_t released;  // written by the host only: faults it has reported
  int32_t reserved;
} DeepepFaultRecord;

#define DEEPEP_MAX_NVL_RANKS DEEPEP_NUM_MAX_NVL_PEERS  // normal mode runs within one NVLink domain
#define DEEPEP_MAX_CHANNELS 128
// One notify exchange slot: R totals + C channel prefixes + local expert counts, then (shrink
// mode) the sender's notify tag in the last int.
#define DEEPEP_NOTIFY_SLOT_INTS (DEEPEP_MAX_NVL_RANKS + DEEPEP_MAX_CHANNELS + DEEPEP_MAX_LOCAL_EXPERTS + 1)

// Host-mapped receive counts of one non-cached dispatch: the notify kernel writes
// the per-expert list, then num_recv_tokens (the host spins on it, -1 before).
typedef struct DeepepRecvCounts {
  int32_t num_recv_tokens;
  int32_t num_rdma_recv_tokens;  // internode: rows of this GPU's scale-out receive space
  int32_t num_recv_tokens_per_expert[DEEPEP_MAX_LOCAL_EXPERTS];
} DeepepRecvCounts;

// Where normal-mode kernels meet their peers: the window, the region offsets
// inside it, and the per-buffer device counters that make every op's flags unique.
typedef struct DeepepNormalCommon {
  void* window;              // ncclWindow_t of the symmetric buffer
  uint64_t nvl_offset;       // byte offset of the NVL region (rings + consumed flags)
  uint64_t notify_offset;    // byte offset of the notify exchange slots (control region)
  uint32_t* op_epoch;        // workspace: bumped by the last block of every data kernel
  uint32_t* notify_epoch;    // workspace: bumped by every notify kernel
  uint32_t* ticket;          // workspace: last-block detection, zero between launches
  DeepepFaultRecord* fault;  // device view of the host-mapped fault record
  // Shrink mode (docs/normal_shrink.md). The mask is the buffer's one mask (the LL kernels' too):
  // kernels read it at their start and write it only at their end, so one op sees one mask.
  int32_t* mask;             // workspace [R]: 1 = rank masked
  int32_t* peer_gone;        // workspace [R]: a wait of this kernel on the rank expired (reset at its end)
  uint64_t* dropped;         // workspace [DEEPEP_DROPPED_KINDS]: rows dropped for masked ranks, cumulative
  DeepepWaitContext wait;
  int32_t rank;              // this rank (== LSA rank: the LSA team is the whole buffer)
  int32_t num_ranks;
  int32_t num_channels;      // config.num_sms / 2
  int32_t ring_tokens;       // slots per (channel, peer) ring = config.num_max_nvl_chunked_recv_tokens
  int32_t barrier_base;      // LSA barrier slot of the notify block, or of block 0 of a data kernel
  int32_t shrink;            // a silent peer is masked (its traffic dropped) instead of a stall
} DeepepNormalCommon;

// Shrink mode: what the normal kernels count in DeepepNormalCommon.dropped (rows, one per token
// and peer; read with deepep_normal_query_dropped).
enum DeepepDroppedKind {
  DEEPEP_DROPPED_DISPATCH_RECV = 0,  // received rows left empty: the source was masked after notify
  DEEPEP_DROPPED_DISPATCH_SEND = 1,  // tokens not sent to a masked destination
  DEEPEP_DROPPED_COMBINE_RECV = 2,   // contributions of a masked rank left out of a combined token
  DEEPEP_DROPPED_COMBINE_SEND = 3,   // rows not sent back to a masked source
  DEEPEP_DROPPED_KINDS = 4,
};

// Dispatch notify: exchanges counts and channel prefixes, one barrier.
typedef struct DeepepNotifyParams {
  DeepepNormalCommon common;
  const uint8_t* is_token_in_rank;     // [T, R] bool
  const int32_t* num_tokens_per_rank;  // [R] (non-cached) or NULL
  const int32_t* num_tokens_per_expert;// [E] (non-cached) or NULL
  const void* topk_idx;                // [T, K] for range checks, or NULL
  int32_t* rank_prefix_matrix;         // [R, R]: written (non-cached) or read (cached)
  int32_t* channel_prefix_matrix;      // [R, C]: written (non-cached) or read (cached)
  int32_t* recv_channel_prefix_matrix; // [R, C]: written
  DeepepRecvCounts* counts;            // device view of host-mapped counts, or NULL (no host wait)
  int64_t num_tokens;
  int32_t num_topk;
  int32_t topk_idx_is_int32;
  int32_t num_experts;                 // 0 in cached mode
  int32_t expert_alignment;
  int32_t cached;
  int32_t num_worst_tokens;
} DeepepNotifyParams;

typedef struct DeepepDispatchParams {
  DeepepNormalCommon common;
  const void* x;                 // [T, H] contiguous, hidden_bytes per row
  const void* x_scales;          // [T, S] 4-byte elements, strided, or NULL
  const void* topk_idx;          // [T, K] int64/int32 or NULL
  const float* topk_weights;     // [T, K] or NULL
  const uint8_t* is_token_in_rank;
  const int32_t* rank_prefix_matrix;
  const int32_t* channel_prefix_matrix;
  const int32_t* recv_channel_prefix_matrix;
  void* recv_x;                  // [N, H]
  void* recv_x_scales;           // [N, S] row-major or NULL
  void* recv_topk_idx;           // [N, K] same dtype as topk_idx, or NULL
  float* recv_topk_weights;      // [N, K] or NULL
  int32_t* recv_src_idx;         // [N]
  int32_t* send_head;            // [T, R]
  int64_t num_tokens;
  int64_t num_recv_rows;         // rows allocated in the outputs (N)
  int64_t scale_stride_token;    // x_scales strides, in elements
  int64_t scale_stride_scale;
  int32_t hidden_bytes;          // multiple of 16
  int32_t num_scales;
  int32_t num_topk;
  int32_t topk_idx_is_int32;
  int32_t num_experts;           // 0 without top-k
  int32_t slot_bytes;            // bytes of one ring slot
  int32_t cached;                // 1: is_token_in_rank and channel_prefix_matrix are a handle's
} DeepepDispatchParams;

typedef struct DeepepCombineParams {
  DeepepNormalCommon common;
  const void* x;                        // [N, H] bf16
  const float* topk_weights;            // [N, K] or NULL
  const void* bias_0;                   // [T, H] bf16 or NULL
  const void* bias_1;
  const int32_t* rank_prefix_matrix;    // [R, R]
  const int32_t* recv_channel_prefix_matrix;  // [R, C] (dispatch handle item 2)
  const int32_t* send_head;             // [T, R]
  void* combined_x;                     // [T, H] bf16
  float* combined_topk_weights;         // [T, K] or NULL
  int64_t num_tokens;                   // T
  int64_t num_recv_rows;                // N
  int32_t hidden_bytes;                 // H * 2, multiple of 16
  int32_t num_topk;
  int32_t slot_bytes;
  int32_t reserved;
} DeepepCombineParams;

// ---------------------------------------------------------------- internode normal mode
// docs/internode.md. N nodes of G GPUs; rank r is GPU r % G of node r / G. Any N up to
// DEEPEP_INTERNODE_MAX_NODES (combine's final receiver keeps two int32 per source node in shared
// memory: 32 KiB at the limit); G <= 8 (the NVLink domain, DeepEP's NUM_MAX_NVL_PEERS: a lane per
// local GPU in the masks and a receiver warp per other local GPU). A warp group takes several
// source or destination nodes in turn when there are more nodes than groups.
#define DEEPEP_INTERNODE_MAX_NODES 4096
#define DEEPEP_INTERNODE_MAX_NODE_SIZE 8
// Scale-out counters, uint64 words, for the buffer's Cb = common.counter_channels (the most
// channels an op of it can have: min(DEEPEP_MAX_CHANNELS, device SMs / 2)) and N nodes: tail
// [Cb][N] (rows a node put into this rank's ring (channel, node)), head [Cb][N] (rows a node
// consumed of this rank's rows to it), notify [R] (notify rounds a rank sent here): 2 Cb N + R
// counters. Window words for LSA-reached peers (8 bytes each at common.control_offset), GIN
// signals (from common.gin_signal_base, same order) for the others. They only grow. One more
// window word follows them (no GIN signal): arrival, the op epoch + 1 of the last shrink-mode
// dispatch data kernel this rank started, read by its NVLink peers (a receiver tells a forwarder
// that never started the op from one still waiting on its own source).
// Local running totals (common.totals, uint64): sent [Cb][N], received [Cb][N], then the
// notify rounds done: 2 Cb N + 1 words.
// One notify slot (int32, per source and parity): the source's gbl channel prefixes towards
// this rank [C], its rdma channel prefixes towards this node [C] (from the same-GPU source
// only), its token count for each local expert [E / R]; shrink mode: its notify tag in the last
// int (4 more keep the slot a multiple of 16 bytes).
#define DEEPEP_INTERNODE_NOTIFY_SLOT_INTS (2 * DEEPEP_MAX_CHANNELS + DEEPEP_MAX_LOCAL_EXPERTS + 4)
// Bytes of a dispatch row's header (source token, destination-GPU mask) and of an NVLink slot's
// header (flag, source rank, sequence) before its row.
#define DEEPEP_INTERNODE_ROW_HEADER_BYTES 16
#define DEEPEP_INTERNODE_NVL_HEADER_BYTES 16

// What the internode data kernels count in DeepepInternodeCommon.traffic, per sending rank and
// cumulative over the buffer's life (read with deepep_internode_query_traffic; a call's traffic
// is the difference of two reads). Scale-out: rows put into another node's scale-out ring (a
// row for this rank's own node passes through its own ring and is not counted), bytes = rows x
// the row (dispatch: header, x, scales, top-k ids and weights; combine: x and weights). NVLink:
// rows written into another local GPU's NVLink ring (dispatch: by a forwarder; combine: by a
// GPU, towards its local forwarder), bytes = rows x (the same row + the 16-byte slot header).
enum DeepepTrafficKind {
  DEEPEP_TRAFFIC_DISPATCH_SCALEOUT_ROWS = 0,
  DEEPEP_TRAFFIC_DISPATCH_SCALEOUT_BYTES = 1,
  DEEPEP_TRAFFIC_DISPATCH_NVL_ROWS = 2,
  DEEPEP_TRAFFIC_DISPATCH_NVL_BYTES = 3,
  DEEPEP_TRAFFIC_COMBINE_SCALEOUT_ROWS = 4,
  DEEPEP_TRAFFIC_COMBINE_SCALEOUT_BYTES = 5,
  DEEPEP_TRAFFIC_COMBINE_NVL_ROWS = 6,
  DEEPEP_TRAFFIC_COMBINE_NVL_BYTES = 7,
  DEEPEP_TRAFFIC_KINDS = 8,
};

typedef struct DeepepInternodeCommon {
  void* window;               // ncclWindow_t (only the GIN transport reads it)
  // The window's LSA mapping, as in DeepepLlCommon: peer p's copy at lsa_base + (p -
  // wait.lsa_base_rank) * lsa_stride, this rank's at local_base (no window-struct loads).
  uint8_t* lsa_base;
  uint64_t lsa_stride;
  uint8_t* local_base;
  uint64_t nvl_offset;        // NVL region: NVLink rings, then their consumed words
  uint64_t rdma_offset;       // RDMA region: notify slots [2][R] and staging [2][R], then the
                              // scale-out rings [C][N] of rdma_ring_tokens slots (+ GIN send rings)
  uint64_t control_offset;    // the counters' window words
  uint32_t* op_epoch;         // workspace: bumped by the last block of every data kernel
  uint32_t* ticket;           // workspace: last-block detection, zero between launches
  uint64_t* totals;           // 2 * counter_channels * num_nodes + 1 running totals (above)
  uint64_t* traffic;          // workspace [DEEPEP_TRAFFIC_KINDS]: rows and bytes sent per leg, cumulative
  DeepepFaultRecord* fault;
  // Shrink mode (docs/internode.md, "Shrink"): the buffer's one mask (shared with the LL and
  // intranode kernels), read at a kernel's start and written only at its end.
  int32_t* mask;              // workspace [R]: 1 = rank masked
  int32_t* peer_gone;         // workspace [R]: a wait of this kernel on the rank expired (reset at its end)
  uint64_t* dropped;          // DeepepNormalCommon.dropped: the same counters, the same meaning per index
  DeepepWaitContext wait;
  int32_t rank;
  int32_t num_ranks;
  int32_t node_size;          // G
  int32_t num_nodes;          // N
  int32_t num_channels;       // C = config.num_sms / 2
  int32_t rdma_ring_tokens;   // config.num_max_rdma_chunked_recv_tokens
  int32_t nvl_ring_tokens;    // config.num_max_nvl_chunked_recv_tokens
  int32_t gin_signal_base;    // first GIN signal of the counters (after the LL ones)
  int32_t counter_channels;   // Cb >= num_channels: the channel stride of the counters and totals
  int32_t shrink;             // a silent peer is masked (its traffic dropped) instead of a stall
} DeepepInternodeCommon;

// Notify: counts and channel prefixes to every rank, which derives its receive side. Also a
// combine's barrier (is_token_in_rank NULL): every data kernel starts after every rank has
// finished its previous one, so rings start empty.
typedef struct DeepepInternodeNotifyParams {
  DeepepInternodeCommon common;
  const uint8_t* is_token_in_rank;            // [T, R] bool (dispatch; NULL when T = 0)
  const int32_t* num_tokens_per_rank;         // [R] or NULL
  const int32_t* num_tokens_per_rdma_rank;    // [N] or NULL
  const int32_t* num_tokens_per_expert;       // [E] or NULL
  const void* topk_idx;                       // [T, K] for range checks, or NULL
  // Cached: the handle's, checked against is_token_in_rank (rewritten from it, after a fault, when not)
  int32_t* rdma_channel_prefix_matrix;        // [N, C]: written (non-cached) or the handle's (cached)
  int32_t* gbl_channel_prefix_matrix;         // [R, C]: written (non-cached) or the handle's (cached)
  int32_t* recv_rdma_channel_prefix_matrix;   // [N, C] written (combine: read, the heads' segments)
  int32_t* recv_rdma_rank_prefix_sum;         // [N] written (cached: the handle's, checked as above; combine: read)
  int32_t* recv_gbl_channel_prefix_matrix;    // [R, C] written
  int32_t* recv_gbl_rank_prefix_sum;          // [R] written (cached: the handle's, checked as above)
  int32_t* combined_rdma_head;                // combine: [T, N], rewritten in place, or NULL
  int32_t* combined_nvl_head;                 // combine: [num_rdma_rows, G], rewritten in place
  DeepepRecvCounts* counts;                   // host-mapped, or NULL (no host wait)
  int64_t num_tokens;
  int64_t num_rdma_rows;                      // combine: rows of combined_nvl_head
  int32_t num_topk;
  int32_t topk_idx_is_int32;
  int32_t num_experts;                        // 0 in cached mode
  int32_t expert_alignment;
  int32_t cached;
  int32_t num_worst_tokens;
  int32_t dispatch;                           // 1: a dispatch's round (counts, prefixes); 0: combine's
} DeepepInternodeNotifyParams;

typedef struct DeepepInternodeDispatchParams {
  DeepepInternodeCommon common;
  const void* x;                              // [T, H] contiguous
  const void* x_scales;                       // [T, S] 4-byte elements, strided, or NULL
  const void* topk_idx;                       // [T, K] or NULL
  const float* topk_weights;                  // [T, K] or NULL
  const uint8_t* is_token_in_rank;            // [T, R]
  const int32_t* recv_rdma_channel_prefix_matrix;  // [N, C]
  const int32_t* recv_rdma_rank_prefix_sum;   // [N]
  const int32_t* recv_gbl_channel_prefix_matrix;   // [R, C]
  const int32_t* recv_gbl_rank_prefix_sum;    // [R]
  void* recv_x;                               // [Nr, H]
  void* recv_x_scales;                        // [Nr, S] or NULL
  void* recv_topk_idx;                        // [Nr, K] or NULL
  float* recv_topk_weights;                   // [Nr, K] or NULL
  uint8_t* recv_src_meta;                     // [Nr, 8] or NULL (cached)
  int32_t* send_rdma_head;                    // [T, N] or NULL (cached)
  int32_t* send_nvl_head;                     // [Nrdma, G] or NULL (cached)
  int64_t num_tokens;
  int64_t num_recv_rows;                      // Nr, rows allocated in the recv outputs
  int64_t num_rdma_recv_rows;                 // rows allocated in send_nvl_head
  int64_t scale_stride_token;
  int64_t scale_stride_scale;
  int32_t hidden_bytes;
  int32_t num_scales;
  int32_t num_topk;
  int32_t topk_idx_is_int32;
  int32_t num_experts;
  int32_t row_bytes;                          // one row: header, x, scales, top-k ids and weights
} DeepepInternodeDispatchParams;

typedef struct DeepepInternodeCombineParams {
  DeepepInternodeCommon common;
  const void* x;                              // [Nr, H] bf16
  const float* topk_weights;                  // [Nr, K] or NULL
  const void* bias_0;                         // [T, H] bf16 or NULL
  const void* bias_1;
  const int32_t* rdma_channel_prefix_matrix;  // [N, C]: dispatch's recv_rdma_channel_prefix_matrix
  const int32_t* rdma_rank_prefix_sum;        // [N]: dispatch's recv_rdma_rank_prefix_sum
  const int32_t* gbl_channel_prefix_matrix;   // [R, C]: dispatch's recv_gbl_channel_prefix_matrix
  int32_t* combined_rdma_head;                // [T, N]: dispatch's send_rdma_head (read)
  int32_t* combined_nvl_head;                 // [Nrdma, G]: dispatch's send_nvl_head (read)
  const int32_t* src_meta;                    // [Nr, 2]: dispatch's recv_src_meta (checked only)
  void* combined_x;                           // [T, H] bf16
  float* combined_topk_weights;               // [T, K] or NULL
  int64_t num_tokens;                         // T
  int64_t num_recv_rows;                      // Nr
  int64_t num_rdma_recv_rows;                 // rows of combined_nvl_head
  int32_t hidden_bytes;
  int32_t num_topk;
  int32_t row_bytes;                          // one row: header, x, top-k weights
  int32_t reserved;
} DeepepInternodeCombineParams;

// ---------------------------------------------------------------- low-latency mode
#define DEEPEP_LL_MAX_TOPK 16
#define DEEPEP_LL_MAX_BLOCKS 1024  // grid limit of the LL kernels (op_seq has a slot per block)

// Where the LL kernels of one call meet their peers: byte offsets of this call's
// buffer half inside the window (identical on every rank), and local state.
typedef struct DeepepLlCommon {
  void* window;                   // ncclWindow_t
  // The window's LSA mapping, read once at creation (deepep_launch_window_geometry): peer p's
  // copy at lsa_base + p * lsa_stride, this rank's at local_base. Kernels form pointers from
  // these parameters instead of loading the window struct first (one memory round trip less).
  uint8_t* lsa_base;
  uint64_t lsa_stride;
  uint8_t* local_base;
  uint64_t signal_offset;         // uint64 words: [R] dispatch signals, then [R] combine signals; source s
                                  // stores its op_seq value of the op ^ DEEPEP_LL_SIGNAL_KEY (a generation:
                                  // stale ones never match)
  uint64_t combine_recv_offset;   // combine area: [E][M] data slots (2H), then [E][M] metadata (4H/128)
  uint64_t view_offset;           // send half: the zero-copy combine view [E_l][R*M] (also combine staging)
  uint64_t staging_offset;        // dispatch staging slots [M] (remote path only)
  uint64_t dispatch_recv_offset;  // dispatch slots [R][M] of dispatch_slot_bytes
  uint64_t count_offset;          // dispatch count messages [R] of count_bytes
  // Workspace, indexed [kind][half] (dispatch, combine; buffer half) so that LL kernels on the
  // two halves share nothing:
  int32_t* done;                  // [2][2][R]: per-destination completion counters
  int32_t* source_state;          // [2][2][R]: 0 waiting, 1 arrived, 2 masked (reset at a receive's end)
  uint32_t* ticket;               // [2][2]: last-block detection (shrink mode), then [2]: LL sends on
                                  // each half since the clean (the halves must alternate)
  uint64_t* op_seq;               // [2][2][DEEPEP_LL_MAX_BLOCKS]: the signal value of this rank's last
                                  // send of that kind on that half, (clean generation << 32) | sends
                                  // since the clean; one copy per block (no block waits for another)
  uint64_t* gin_sent;             // [2][2][R]: GIN signal value added to each peer since the clean
  int32_t* mask;                  // [R]: 1 = rank masked (shrink mode)
  DeepepFaultRecord* fault;       // device view of the host-mapped fault record
  DeepepWaitContext wait;
  int32_t rank;
  int32_t num_ranks;
  int32_t num_experts;
  int32_t num_local_experts;
  int32_t max_tokens;             // M
  int32_t hidden;                 // H
  int32_t num_topk;               // K
  int32_t node_size;              // peers in the same node of node_size ranks use LSA stores
  int32_t shrink;                 // mask a silent rank after the timeout instead of failing
  int32_t phases;                 // DEEPEP_LL_PHASE_* bits
  int32_t parity;                 // buffer half of this call (GIN signal ids)
  int32_t reserved;
} DeepepLlCommon;

typedef struct DeepepLlDispatchParams {
  DeepepLlCommon common;
  const void* x;                  // [T, H] bf16
  const void* topk_idx;           // [T, K] int64 or int32
  void* packed_recv_x;            // [E_l, R*M, H] bf16 or fp8
  void* packed_recv_x_scales;     // fp32 [E_l, H/128, R*M] or int32 [E_l, H/512, R*M] storage; NULL for bf16
  int32_t* packed_recv_count;     // [E_l]
  int32_t* packed_recv_src_info;  // [E_l, R*M]
  int64_t* packed_recv_layout_range;  // [E_l, R]
  int32_t* cumulative_local_expert_recv_stats;  // [E_l] or NULL
  int64_t* dispatch_wait_recv_cost_stats;       // [R] or NULL
  int32_t num_tokens;             // T
  int32_t topk_idx_is_int32;
  int32_t use_fp8;
  int32_t round_scale;
  int32_t use_ue8m0;
  int32_t dispatch_slot_bytes;
  int32_t count_bytes;
  int32_t reserved;
} DeepepLlDispatchParams;

typedef struct DeepepLlCombineParams {
  DeepepLlCommon common;
  const void* x;                  // [E_l, R*M, H] bf16 (contiguous), or NULL with zero_copy (the view is the source)
  const void* topk_idx;           // [T, K]
  const float* topk_weights;      // [T, K]
  const int32_t* src_info;        // [E_l, R*M]
  const int64_t* layout_range;    // [E_l, R]
  void* out;                      // [T, H] bf16
  int64_t* combine_wait_recv_cost_stats;  // [R] or NULL
  int32_t num_tokens;             // T (combine side)
  int32_t topk_idx_is_int32;
  int32_t zero_copy;
  int32_t use_logfmt;
  int32_t reserved[2];
} DeepepLlCombineParams;

// clean_low_latency_buffer: barrier, zero this rank's LL state, barrier (one block, stream-ordered).
#define DEEPEP_LL_CLEAN_BANK 2     // common.parity of the clean barrier: GIN signal ids 4R + source
#define DEEPEP_LL_CLEAN_REGIONS 4
// GIN signal ids: (bank * DEEPEP_LL_SIGNAL_KINDS + kind) * R + source rank, where bank is the
// buffer half (0, 1) or DEEPEP_LL_CLEAN_BANK (kind 0 only).
#define DEEPEP_LL_SIGNAL_KINDS 2   // dispatch, combine
// An LL signal word holds (clean generation << 32 | sends on that half) XOR this key, so that
// zeroed or overwritten words (normal-mode data, small integers) never equal a value sent.
#define DEEPEP_LL_SIGNAL_KEY 0x9e3779b97f4a7c15ULL
#define DEEPEP_LL_GIN_SIGNALS_PER_RANK (DEEPEP_LL_CLEAN_BANK * DEEPEP_LL_SIGNAL_KINDS + 1)
typedef struct DeepepLlCleanParams {
  DeepepLlCommon common;          // transport fields; signal_offset: the barrier's arrival words [R],
                                  // outside the LL halves and never zeroed; parity: DEEPEP_LL_CLEAN_BANK
  uint32_t* barrier_epoch;        // workspace: barriers this rank has passed (never zeroed)
  void* zero[DEEPEP_LL_CLEAN_REGIONS];            // local regions zeroed between the barriers (NULL: none)
  int64_t zero_bytes[DEEPEP_LL_CLEAN_REGIONS];    // multiples of 4
  int32_t num_gin_signals;        // GIN signals [0, n) reset between the barriers (GIN transport only)
  int32_t reserved;
} DeepepLlCleanParams;

typedef struct DeepepDevCommInfo {
  int32_t rank, num_ranks, lsa_rank, lsa_size;
} DeepepDevCommInfo;

// How the LL kernels reach peers outside the sender's (virtual) node (`remote_kind`).
enum DeepepLlRemoteKind {
  DEEPEP_LL_REMOTE_NONE = 0,      // every peer is in the node: LSA stores
  DEEPEP_LL_REMOTE_EMULATED = 1,  // the GIN protocol emulated over LSA (virtual nodes)
  DEEPEP_LL_REMOTE_GIN = 2,       // NCCL GIN
};

// ---- Entry points that do not depend on NCCL (compiled once) ----

// get_dispatch_layout. The caller validated shapes; see layout.cu for the grid.
int deepep_launch_dispatch_layout(const DeepepLayoutParams* params, void* stream);
// Number of int32 partial-histogram elements a launch with these params needs.
int64_t deepep_dispatch_layout_workspace_elems(const DeepepLayoutParams* params);
// Bytes of one normal-mode ring slot for a dispatch/combine row layout (both sides must agree).
int64_t deepep_dispatch_slot_bytes(int32_t hidden_bytes, int32_t num_scales, int32_t num_topk);
int64_t deepep_combine_slot_bytes(int32_t hidden_bytes, int32_t num_topk);
// Bytes of one internode row (a scale-out ring slot; an NVLink slot adds a flag header) of a
// dispatch (num_scales, num_topk) or a combine (num_scales 0, num_topk: the weights).
int64_t deepep_internode_dispatch_row_bytes(int32_t hidden_bytes, int32_t num_scales, int32_t num_topk);
int64_t deepep_internode_combine_row_bytes(int32_t hidden_bytes, int32_t num_topk);
// High word of every normal-mode ring flag of op `epoch` (normal_common.cuh flag_generation).
uint32_t deepep_normal_flag_generation(uint32_t epoch);
// LL: bytes of one dispatch slot (header + payload) and of one combine slot (-1: LogFMT asked
// for and not built).
int64_t deepep_ll_dispatch_slot_bytes(int32_t hidden, int32_t num_topk, int32_t use_fp8);
int64_t deepep_ll_combine_slot_bytes(int32_t hidden, int32_t use_logfmt);
// Bytes of one LL dispatch count message (per-expert counts and the filled-slot bitmap).
int64_t deepep_ll_count_bytes(int32_t num_local_experts, int32_t max_tokens);
// Bytes between rows of the zero-copy combine view (deepep_get_next_low_latency_combine_buffer).
int64_t deepep_ll_view_row_bytes(int32_t hidden);
const char* deepep_cuda_error_string(int error);

// ---- Entry points of one NCCL build ----
// The kernels that use the NCCL Device API are compiled once per line of kernels/nccl_builds.txt,
// against that NCCL's headers. A build's symbols are local to it (build.rs); the host reaches a
// build only through its table, DeepepNcclBuild. Each signature is declared once, as a function
// type: the table's field and, for the kernels' own translation units, the function.
// All launchers return a cudaError_t value (0 on success). `stream` is a cudaStream_t;
// `dev_comm` the buffer's ncclDevComm, made by this build's devcomm_requirements_init.

// Fills an ncclDevCommRequirements (of devcomm_requirements_size bytes) asking for
// `lsa_barrier_count` LSA barriers and, if gin_signal_count > 0, GIN to every rank with that many
// signals.
typedef void DeepepDevcommRequirementsInit(void* reqs, int lsa_barrier_count, int gin_signal_count);
typedef void DeepepDevcommInfoFn(const void* dev_comm, DeepepDevCommInfo* out);
// Barrier across the LSA team on barrier slot `index` (< the devComm's lsaBarrierCount).
typedef int DeepepLaunchLsaBarrier(const void* dev_comm, int index, DeepepWaitContext wait, void* stream);
// Each rank writes `tag ^ lsa_rank` into every LSA peer's slot of `window` at `slots_offset`,
// barriers, then counts slots that do not hold `tag ^ peer`.
typedef int DeepepLaunchLsaPeerCheck(const void* dev_comm, void* window, size_t slots_offset, uint32_t tag,
                                     int barrier_index, DeepepWaitContext wait, int32_t* mismatches, void* stream);
// Writes ncclGetLsaPointer(window, 0, p) for p < lsa_size to out[p], and
// ncclGetLocalPointer(window, 0) to out[lsa_size] (one block; out in device memory).
typedef int DeepepLaunchWindowGeometry(void* window, int lsa_size, uint64_t* out, void* stream);
// Normal mode (kernels/normal_*.cu).
typedef int DeepepLaunchNormalNotify(const void* dev_comm, const DeepepNotifyParams* params, void* stream);
typedef int DeepepLaunchNormalDispatch(const DeepepDispatchParams* params, void* stream);
typedef int DeepepLaunchNormalCombine(const void* dev_comm, const DeepepCombineParams* params, void* stream);
// Internode normal mode (kernels/internode_*.cu). remote_kind: an enum DeepepLlRemoteKind
// (EMULATED or GIN: how the scale-out leg reaches other nodes).
typedef int DeepepLaunchInternodeNotify(const void* dev_comm, const DeepepInternodeNotifyParams* params,
                                        int remote_kind, void* stream);
typedef int DeepepLaunchInternodeDispatch(const void* dev_comm, const DeepepInternodeDispatchParams* params,
                                          int remote_kind, void* stream);
typedef int DeepepLaunchInternodeCombine(const void* dev_comm, const DeepepInternodeCombineParams* params,
                                         int remote_kind, void* stream);
// Low-latency mode (kernels/ll_*.cu). remote_kind: an enum DeepepLlRemoteKind.
typedef int DeepepLaunchLlDispatch(const void* dev_comm, const DeepepLlDispatchParams* params, int remote_kind,
                                   int num_blocks, void* stream);
typedef int DeepepLaunchLlCombine(const void* dev_comm, const DeepepLlCombineParams* params, int remote_kind,
                                  int num_blocks, void* stream);
// clean_low_latency_buffer on `stream`: a barrier over the ranks (masked ones skipped in shrink
// mode), the params' regions and GIN signals zeroed, a second barrier.
typedef int DeepepLaunchLlClean(const void* dev_comm, const DeepepLlCleanParams* params, int remote_kind,
                                void* stream);
// Loads (on the current device) every kernel the build's launchers and the layout launcher can
// select, before any launch: with CUDA's lazy loading, a kernel's first launch loads its module,
// which may wait for running kernels, so a first launch of a kernel that a spinning kernel waits
// for could deadlock (CUDA programming guide, "Lazy Loading"). Idempotent.
typedef int DeepepPreloadKernels(void);

typedef struct DeepepNcclBuild {
  int32_t nccl_version;             // NCCL_VERSION_CODE of the headers this build was compiled against
  int32_t serves_below;             // the first NCCL_VERSION_CODE this build does not serve
  int32_t gin_compiled;             // whether it has the GIN transport (NCCL >= 2.28.7 headers)
  int32_t reserved;
  size_t devcomm_size;              // sizeof(ncclDevComm) in those headers
  size_t devcomm_requirements_size; // sizeof(ncclDevCommRequirements)
  DeepepDevcommRequirementsInit* devcomm_requirements_init;
  DeepepDevcommInfoFn* devcomm_info;
  DeepepLaunchLsaBarrier* launch_lsa_barrier;
  DeepepLaunchLsaPeerCheck* launch_lsa_peer_check;
  DeepepLaunchWindowGeometry* launch_window_geometry;
  DeepepLaunchNormalNotify* launch_normal_notify;
  DeepepLaunchNormalDispatch* launch_normal_dispatch;
  DeepepLaunchNormalCombine* launch_normal_combine;
  DeepepLaunchLlDispatch* launch_ll_dispatch;
  DeepepLaunchLlCombine* launch_ll_combine;
  DeepepLaunchLlClean* launch_ll_clean;
  DeepepLaunchInternodeNotify* launch_internode_notify;
  DeepepLaunchInternodeDispatch* launch_internode_dispatch;
  DeepepLaunchInternodeCombine* launch_internode_combine;
  DeepepPreloadKernels* preload_kernels;
} DeepepNcclBuild;

// A build's table is returned by deepep_nccl_build_<NCCL_VERSION_CODE of its headers>(); build.rs
// lists them for Rust. DEEPEP_NCCL_BUILD_FN(code) names it (e.g. for NCCL_VERSION_CODE).
#define DEEPEP_NCCL_BUILD_FN_(code) deepep_nccl_build_##code
#define DEEPEP_NCCL_BUILD_FN(code) DEEPEP_NCCL_BUILD_FN_(code)
#ifdef NCCL_VERSION_CODE
// The build of the NCCL headers included before this file (C++ code linking the kernels' archive).
const DeepepNcclBuild* DEEPEP_NCCL_BUILD_FN(NCCL_VERSION_CODE)(void);
#endif

#ifdef __CUDACC__
// The definitions in the kernels' translation units (one copy per build, local to it).
DeepepDevcommRequirementsInit deepep_devcomm_requirements_init;
DeepepDevcommInfoFn deepep_devcomm_info;
DeepepLaunchLsaBarrier deepep_launch_lsa_barrier;
DeepepLaunchLsaPeerCheck deepep_launch_lsa_peer_check;
DeepepLaunchWindowGeometry deepep_launch_window_geometry;
DeepepLaunchNormalNotify deepep_launch_normal_notify;
DeepepLaunchNormalDispatch deepep_launch_normal_dispatch;
DeepepLaunchNormalCombine deepep_launch_normal_combine;
DeepepLaunchLlDispatch deepep_launch_ll_dispatch;
DeepepLaunchLlCombine deepep_launch_ll_combine;
DeepepLaunchLlClean deepep_launch_ll_clean;
DeepepLaunchInternodeNotify deepep_launch_internode_notify;
DeepepLaunchInternodeDispatch deepep_launch_internode_dispatch;
DeepepLaunchInternodeCombine deepep_launch_internode_combine;
DeepepPreloadKernels deepep_preload_kernels;
// The layout kernels' share (kernels/layout.cu, NCCL-independent: one global copy).
DeepepPreloadKernels deepep_preload_layout_kernels;
#endif

#ifdef __cplusplus
}
#endif

#endif  // DEEPEP_KERNELS_H
