// deepep-nccl from C++: the same single-GPU layout check through deepep_nccl.hpp.
// Exit codes: 0 ok, 1 failure, 2 no GPU/driver (a clean DEEPEP_ERROR_NO_DEVICE).
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

#include "deepep_nccl.hpp"

int main() {
  constexpr int T = 128, K = 8, E = 32;
  try {
    std::printf("deepep-nccl %s, NCCL compiled %d\n", deepep_library_version(), deepep_nccl_compiled_version());
    deepep::BufferOptions opts;
    opts.num_nvl_bytes = 1 << 20;
    opts.explicitly_destroy = true;
    deepep::Buffer buffer(0, 1, deepep::get_unique_id(), opts);
    buffer.check_peers();

    std::vector<int64_t> topk(T * K);
    std::vector<int32_t> want(E, 0);
    for (int i = 0; i < T * K; ++i) {
      topk[i] = (i % 11 == 0) ? -1 : (i * 13) % E;
      if (topk[i] >= 0) ++want[topk[i]];
    }
    // The outputs as the library describes them: per rank [1] and per expert [E] share one int32
    // allocation (no per-rdma-rank counts on one rank), is_token_in_rank [T, 1] has its own.
    DeepepOutputs layout = buffer.dispatch_layout_outputs(T, E);
    std::vector<void*> allocations(static_cast<size_t>(layout.num_allocations));
    for (int g = 0; g < layout.num_allocations; ++g) cudaMalloc(&allocations[g], deepep::allocation_bytes(layout, g));
    deepep::place_outputs(layout, allocations.data());
    void* d_topk;
    cudaMalloc(&d_topk, topk.size() * sizeof(int64_t));
    cudaMemcpy(d_topk, topk.data(), topk.size() * sizeof(int64_t), cudaMemcpyHostToDevice);
    buffer.get_dispatch_layout(deepep::make_tensor(d_topk, DEEPEP_DTYPE_INT64, {T, K}), E, layout);
    cudaDeviceSynchronize();
    int32_t per_rank = 0;
    std::vector<int32_t> per_expert(E);
    cudaMemcpy(&per_rank, layout.tensors[0].data, sizeof per_rank, cudaMemcpyDeviceToHost);
    cudaMemcpy(per_expert.data(), layout.tensors[2].data, per_expert.size() * sizeof(int32_t), cudaMemcpyDeviceToHost);
    const bool ok = per_expert == want && per_rank == T;
    std::printf("layout: %d tokens to rank 0, per-expert counts %s\n", per_rank, ok ? "match" : "MISMATCH");
    buffer.destroy();
    cudaFree(d_topk);
    for (void* allocation : allocations) cudaFree(allocation);
    return ok ? 0 : 1;
  } catch (const deepep::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return e.status() == DEEPEP_ERROR_NO_DEVICE ? 2 : 1;
  }
}
