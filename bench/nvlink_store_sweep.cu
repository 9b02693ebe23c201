// NVLink bandwidth of the ways a kernel can write a peer's memory, by CTA count: plain 16-byte SM
// stores (4 loads in flight per thread, 512 threads), TMA bulk copies (local HBM -> smem -> peer,
// one lane per warp driving `stages` smem stages of `chunk` bytes), and the copy engine. GPUs 0
// and 1 write to each other at once, as an all-to-all does; the figure is one-way GB/s per GPU
// (best of 5 of 256 MiB). Decides how HT/LL senders should move rows (bench/RESULTS.md).
// The "pull" rows read instead: each GPU copies the peer's memory into its own (plain 16-byte
// loads, or TMA bulk loads from the peer), as a receiver-driven dispatch would.
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -Ikernels -o nvlink_store_sweep bench/nvlink_store_sweep.cu
//   ./nvlink_store_sweep [pull]   (pull: the copy engine and the pull rows only)
// (bench/gpu_suite.sh step bench_nvlink builds and runs it.)
#include <cstdio>
#include <cstdint>
#include <string>
#include <vector>
#include <cuda_runtime.h>

#include "bulk_copy.cuh"  // the kernels' own TMA wrappers (kernels/, on the include path)
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void plain(const int4* __restrict__ src, int4* dst, size_t n) {
  const size_t per = (n + gridDim.x - 1) / gridDim.x, beg = blockIdx.x * per, end = beg + per < n ? beg + per : n;
  for (size_t i = beg + threadIdx.x; i < end; i += blockDim.x * 4) {
    int4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) if (i + u * blockDim.x < end) v[u] = src[i + u * blockDim.x];
#pragma unroll
    for (int u = 0; u < 4; ++u) if (i + u * blockDim.x < end) dst[i + u * blockDim.x] = v[u];
  }
}

// Each warp's lane 0 streams its slice in `chunk`-byte pieces through `stages` smem stages.
template <int kStages>
__global__ void tma(const char* __restrict__ src, char* dst, size_t bytes, int chunk) {
  extern __shared__ __align__(128) char sm[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  uint64_t* bars = reinterpret_cast<uint64_t*>(sm) + warp * kStages;
  char* stage = sm + 1024 + size_t(warp) * kStages * chunk;
  if (lane != 0) return;
  const size_t W = size_t(gridDim.x) * warps, wid = size_t(blockIdx.x) * warps + warp;
  const size_t nchunks_total = bytes / chunk, per = (nchunks_total + W - 1) / W;
  const size_t c0 = wid * per, c1 = c0 + per < nchunks_total ? c0 + per : nchunks_total;
  if (c0 >= c1) return;
  const size_t n = c1 - c0;
  uint32_t phase[kStages];
  for (int s = 0; s < kStages; ++s) {
    deepep::mbarrier_init(&bars[s]);
    phase[s] = 0;
  }
  for (size_t i = 0; i < n && i < kStages; ++i) deepep::bulk_load(stage + i * chunk, src + (c0 + i) * chunk, chunk, &bars[i]);
  for (size_t i = 0; i < n; ++i) {
    const int s = int(i % kStages);
    deepep::mbarrier_wait(&bars[s], phase[s]);
    deepep::bulk_store(dst + (c0 + i) * chunk, stage + size_t(s) * chunk, chunk);
    if (i >= 1 && i - 1 + kStages < n) {  // refill the previous chunk's stage once its store read it
      deepep::bulk_wait_smem_read<1>();
      const int sp = int((i - 1) % kStages);
      deepep::bulk_load(stage + size_t(sp) * chunk, src + (c0 + i - 1 + kStages) * chunk, chunk, &bars[sp]);
    }
  }
  deepep::bulk_wait_all();
}

int main(int argc, char** argv) {
  int ng; CK(cudaGetDeviceCount(&ng));
  if (ng < 2) { printf("need 2 GPUs\n"); return 1; }
  const size_t bytes = 256ull << 20, n16 = bytes / 16;
  std::vector<char*> src(2), recv(2);
  std::vector<cudaStream_t> st(2); std::vector<cudaEvent_t> e0(2), e1(2);
  for (int g = 0; g < 2; ++g) {
    CK(cudaSetDevice(g));
    cudaDeviceEnablePeerAccess(1 - g, 0);
    CK(cudaMalloc(&src[g], bytes)); CK(cudaMalloc(&recv[g], bytes)); CK(cudaMemset(src[g], 1 + g, bytes));
    CK(cudaStreamCreate(&st[g])); CK(cudaEventCreate(&e0[g])); CK(cudaEventCreate(&e1[g]));
    CK(cudaFuncSetAttribute(tma<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    CK(cudaFuncSetAttribute(tma<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  }
  auto run = [&](const char* name, int blocks, auto launch) -> int {
    float best = 1e9;
    for (int it = 0; it < 5; ++it) {
      for (int g = 0; g < 2; ++g) { CK(cudaSetDevice(g)); CK(cudaDeviceSynchronize()); }
      for (int g = 0; g < 2; ++g) {
        CK(cudaSetDevice(g)); CK(cudaEventRecord(e0[g], st[g])); launch(g); CK(cudaGetLastError()); CK(cudaEventRecord(e1[g], st[g]));
      }
      float worst = 0;
      for (int g = 0; g < 2; ++g) { CK(cudaSetDevice(g)); CK(cudaEventSynchronize(e1[g])); float ms; CK(cudaEventElapsedTime(&ms, e0[g], e1[g])); worst = ms > worst ? ms : worst; }
      best = worst < best ? worst : best;
    }
    printf("%-28s ctas %3d  %6.1f GB/s one way per GPU\n", name, blocks, bytes / (best * 1e-3) / 1e9);
    return 0;
  };
  run("copy engine", 0, [&](int g) { cudaMemcpyPeerAsync(recv[1 - g], 1 - g, src[g], g, bytes, st[g]); });
  // GPU g copies src[g] into the peer's recv (push: NVLink writes) or the peer's src into its own
  // recv (pull: NVLink reads).
  auto from = [&](int g, bool pull) { return src[pull ? 1 - g : g]; };
  auto to = [&](int g, bool pull) { return recv[pull ? g : 1 - g]; };
  auto run_plain = [&](int blocks, bool pull) {
    return run(pull ? "pull: plain ld.v4 x4 (512 thr)" : "plain st.v4 x4 (512 thr)", blocks, [&](int g) {
      plain<<<blocks, 512, 0, st[g]>>>((const int4*)from(g, pull), (int4*)to(g, pull), n16);
    });
  };
  auto run_tma = [&](int blocks, int warps, int stages, int chunk, bool pull) {
    const size_t smem = 1024 + size_t(warps) * stages * chunk;
    if (smem > 200 * 1024) return 0;
    char name[64];
    snprintf(name, sizeof name, "%stma %dKB x%d %s, %d warps", pull ? "pull: " : "", chunk / 1024, stages, pull ? "ld" : "st", warps);
    return run(name, blocks, [&](int g) {
      if (stages == 4) tma<4><<<blocks, 32 * warps, smem, st[g]>>>(from(g, pull), to(g, pull), bytes, chunk);
      else tma<2><<<blocks, 32 * warps, smem, st[g]>>>(from(g, pull), to(g, pull), bytes, chunk);
    });
  };
  for (int blocks : {8, 12, 16, 24, 32}) {
    run_plain(blocks, true);
    for (int warps : {1, 4, 12}) run_tma(blocks, warps, warps == 12 ? 2 : 4, 4096, true);  // 12 x 2: the dispatch receiver's shape
  }
  const bool pull_only = argc > 1 && std::string(argv[1]) == "pull";
  if (!pull_only) {
    for (int blocks : {8, 12, 16, 24, 32, 66, 132}) {
      run_plain(blocks, false);
      for (int chunk : {4096, 8192, 16384})
        for (int warps : {1, 4}) run_tma(blocks, warps, chunk <= 8192 ? 4 : 2, chunk, false);
    }
  }
  // Check: recv[1] holds GPU 0's bytes (1), recv[0] GPU 1's (2).
  for (int g = 0; g < 2; ++g) {
    std::vector<unsigned char> h(1 << 20);
    CK(cudaSetDevice(g)); CK(cudaMemcpy(h.data(), recv[g] + bytes - h.size(), h.size(), cudaMemcpyDeviceToHost));
    int bad = 0; for (auto c : h) bad += c != (unsigned char)(2 - g);
    printf("gpu %d recv tail check: %d bad bytes\n", g, bad);
  }
  return 0;
}
