/* deepep-nccl from C: one rank on the current GPU, get_dispatch_layout on a
 * small routing, checked against a host computation.
 * Exit codes: 0 ok, 1 failure, 2 no GPU/driver (a clean DEEPEP_ERROR_NO_DEVICE). */
#include <cuda_runtime.h>
#include <stdio.h>
#include <string.h>

#include "deepep_nccl.h"

enum { T = 64, K = 4, E = 16 };

static int fail(const char* what, DeepepStatus st) {
  fprintf(stderr, "%s failed: %s: %s\n", what, deepep_status_string(st), deepep_last_error());
  return st == DEEPEP_ERROR_NO_DEVICE ? 2 : 1;
}

static size_t dtype_size(int32_t dtype) {
  switch (dtype) {
    case DEEPEP_DTYPE_INT64: return 8;
    case DEEPEP_DTYPE_INT32: case DEEPEP_DTYPE_FLOAT32: return 4;
    case DEEPEP_DTYPE_BFLOAT16: case DEEPEP_DTYPE_FLOAT16: return 2;
    default: return 1;
  }
}

static DeepepTensor tensor(void* data, DeepepDtype dtype, int ndim, int64_t d0, int64_t d1) {
  DeepepTensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.dtype = dtype;
  t.ndim = ndim;
  t.shape[0] = d0;
  t.shape[1] = d1;
  t.strides[0] = ndim == 2 ? d1 : 1;
  t.strides[1] = 1;
  return t;
}

int main(void) {
  int runtime = 0;
  DeepepStatus st = deepep_nccl_runtime_version(&runtime);
  if (st != DEEPEP_SUCCESS) return fail("deepep_nccl_runtime_version", st);
  printf("deepep-nccl %s (ABI %u), NCCL compiled %d, loaded %d\n", deepep_library_version(), deepep_abi_version(),
         deepep_nccl_compiled_version(), runtime);

  uint8_t id[DEEPEP_UNIQUE_ID_BYTES];
  if ((st = deepep_get_unique_id(id, sizeof id)) != DEEPEP_SUCCESS) return fail("deepep_get_unique_id", st);
  DeepepBuffer* buf = NULL;
  st = deepep_buffer_create(0, 1, id, sizeof id, 1 << 20, 0, false, true, false, &buf);
  if (st != DEEPEP_SUCCESS) return fail("deepep_buffer_create", st);

  int64_t topk[T * K];
  int32_t want_expert[E] = {0}, want_rank = 0;
  for (int t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) {
      int64_t e = (t % 5 == 0 && k > 1) ? -1 : (t * 7 + k * 3) % E; /* some -1 slots */
      topk[t * K + k] = e;
      if (e >= 0) want_expert[e]++;
    }
    want_rank += topk[t * K] >= 0; /* slot 0 is always valid here */
  }

  /* The outputs as the library describes them: per rank [1] and per expert [E] share one int32
   * allocation (no per-rdma-rank counts on one rank: tensors[1] is absent), is_token_in_rank
   * [T, 1] has its own. */
  DeepepOutputs layout;
  if ((st = deepep_get_dispatch_layout_outputs(buf, T, E, &layout)) != DEEPEP_SUCCESS)
    return fail("deepep_get_dispatch_layout_outputs", st);
  void* allocations[DEEPEP_MAX_OP_OUTPUTS] = {NULL};
  for (int g = 0; g < layout.num_allocations; ++g)
    cudaMalloc(&allocations[g], (size_t)layout.allocation_elems[g] * dtype_size(layout.allocation_dtype[g]));
  for (int i = 0; i < layout.count; ++i) /* each output's address: its allocation plus its offset */
    if (layout.allocation[i] >= 0)
      layout.tensors[i].data = (char*)allocations[layout.allocation[i]] + layout.offset[i] * dtype_size(layout.tensors[i].dtype);

  void* d_topk;
  cudaMalloc(&d_topk, sizeof topk);
  cudaMemcpy(d_topk, topk, sizeof topk, cudaMemcpyHostToDevice);
  DeepepTensor t_topk = tensor(d_topk, DEEPEP_DTYPE_INT64, 2, T, K);
  st = deepep_get_dispatch_layout(buf, &t_topk, E, &layout.tensors[0], NULL, &layout.tensors[2], &layout.tensors[3], NULL);
  if (st != DEEPEP_SUCCESS) return fail("deepep_get_dispatch_layout", st);
  cudaDeviceSynchronize();

  int32_t per_rank = 0, per_expert[E];
  cudaMemcpy(&per_rank, layout.tensors[0].data, sizeof per_rank, cudaMemcpyDeviceToHost);
  cudaMemcpy(per_expert, layout.tensors[2].data, sizeof per_expert, cudaMemcpyDeviceToHost);
  int ok = per_rank == want_rank && memcmp(per_expert, want_expert, sizeof want_expert) == 0;
  printf("layout: tokens to rank 0 = %d (expected %d), experts %s\n", per_rank, want_rank, ok ? "match" : "MISMATCH");

  if ((st = deepep_buffer_destroy(buf)) != DEEPEP_SUCCESS) return fail("deepep_buffer_destroy", st);
  deepep_buffer_free(buf);
  cudaFree(d_topk);
  for (int g = 0; g < layout.num_allocations; ++g) cudaFree(allocations[g]);
  return ok ? 0 : 1;
}
