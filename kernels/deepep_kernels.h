// Launch surface between the Rust core and the CUDA kernels.
// Plain C structs: Rust mirrors them in src/kernels.rs and checks their sizes
// against deepep_kernel_struct_size() when the library is first used.
#ifndef DEEPEP_KERNELS_H
#define DEEPEP_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// What a bounded GPU wait was doing when it gave up.
enum DeepepWaitOp {
  DEEPEP_WAIT_OP_NONE = 0,
  DEEPEP_WAIT_OP_LSA_BARRIER = 1,
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

enum DeepepKernelStruct {
  DEEPEP_STRUCT_STALL_RECORD = 0,
  DEEPEP_STRUCT_WAIT_CONTEXT = 1,
  DEEPEP_STRUCT_LAYOUT_PARAMS = 2,
  DEEPEP_STRUCT_DEV_COMM = 3,
  DEEPEP_STRUCT_DEV_COMM_REQUIREMENTS = 4,
};

// sizeof() of each struct above as compiled by nvcc (0 for an unknown id).
size_t deepep_kernel_struct_size(int which);
// NCCL_VERSION_CODE of the headers the kernels were compiled against.
int deepep_kernels_nccl_version(void);

// Fills an ncclDevCommRequirements (of deepep_kernel_struct_size(DEV_COMM_REQUIREMENTS)
// bytes) asking for `lsa_barrier_count` LSA barriers and nothing else.
void deepep_devcomm_requirements_init(void* reqs, int lsa_barrier_count);

typedef struct DeepepDevCommInfo {
  int32_t rank, num_ranks, lsa_rank, lsa_size;
} DeepepDevCommInfo;
void deepep_devcomm_info(const void* dev_comm, DeepepDevCommInfo* out);

// All launchers return a cudaError_t value (0 on success). `stream` is a cudaStream_t.
// Barrier across the LSA team on barrier slot `index` (< the devComm's lsaBarrierCount).
int deepep_launch_lsa_barrier(const void* dev_comm, int index, DeepepWaitContext wait, void* stream);
// Each rank writes `tag ^ lsa_rank` into every LSA peer's slot of `window` at
// `slots_offset`, barriers, then counts slots that do not hold `tag ^ peer`.
int deepep_launch_lsa_peer_check(const void* dev_comm, void* window, size_t slots_offset, uint32_t tag,
                                 int barrier_index, DeepepWaitContext wait, int32_t* mismatches, void* stream);
// get_dispatch_layout. The caller validated shapes; see layout.cu for the grid.
int deepep_launch_dispatch_layout(const DeepepLayoutParams* params, void* stream);
// Number of int32 partial-histogram elements a launch with these params needs.
int64_t deepep_dispatch_layout_workspace_elems(const DeepepLayoutParams* params);

const char* deepep_cuda_error_string(int error);

#ifdef __cplusplus
}
#endif

#endif  // DEEPEP_KERNELS_H
