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
    void *d_topk, *d_out, *d_in_rank;
    cudaMalloc(&d_topk, topk.size() * sizeof(int64_t));
    cudaMalloc(&d_out, (1 + E) * sizeof(int32_t));
    cudaMalloc(&d_in_rank, T);
    cudaMemcpy(d_topk, topk.data(), topk.size() * sizeof(int64_t), cudaMemcpyHostToDevice);
    buffer.get_dispatch_layout(deepep::make_tensor(d_topk, DEEPEP_DTYPE_INT64, {T, K}), E,
                               deepep::make_tensor(d_out, DEEPEP_DTYPE_INT32, {1}), nullptr,
                               deepep::make_tensor(static_cast<int32_t*>(d_out) + 1, DEEPEP_DTYPE_INT32, {E}),
                               deepep::make_tensor(d_in_rank, DEEPEP_DTYPE_BOOL, {T, 1}));
    cudaDeviceSynchronize();
    std::vector<int32_t> got(1 + E);
    cudaMemcpy(got.data(), d_out, got.size() * sizeof(int32_t), cudaMemcpyDeviceToHost);
    const bool ok = std::vector<int32_t>(got.begin() + 1, got.end()) == want && got[0] == T;
    std::printf("layout: %d tokens to rank 0, per-expert counts %s\n", got[0], ok ? "match" : "MISMATCH");
    buffer.destroy();
    cudaFree(d_topk);
    cudaFree(d_out);
    cudaFree(d_in_rank);
    return ok ? 0 : 1;
  } catch (const deepep::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return e.status() == DEEPEP_ERROR_NO_DEVICE ? 2 : 1;
  }
}
