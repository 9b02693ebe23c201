// Shared by the multi-GPU C++ examples: BF16 conversions, CUDA error checks, device memory,
// a counting checker, and a main() that runs one thread per GPU.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "deepep_nccl.hpp"

namespace example {

inline float bf16_to_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline uint16_t float_to_bf16(float f) {  // round to nearest even (finite inputs)
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline void cuda_check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

// A cudaMalloc'd block, freed on scope exit.
struct DeviceMemory {
  void* ptr = nullptr;
  explicit DeviceMemory(size_t bytes) { cuda_check(cudaMalloc(&ptr, bytes == 0 ? 1 : bytes), "cudaMalloc"); }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory() { cudaFree(ptr); }
};

template <typename V>
void upload(const DeviceMemory& dst, const std::vector<V>& src) {
  cuda_check(cudaMemcpy(dst.ptr, src.data(), src.size() * sizeof(V), cudaMemcpyHostToDevice), "cudaMemcpy H2D");
}
// `count` elements from device address `src`.
template <typename V>
std::vector<V> download_from(const void* src, size_t count) {
  std::vector<V> out(count);
  cuda_check(cudaMemcpy(out.data(), src, count * sizeof(V), cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
  return out;
}
template <typename V>
std::vector<V> download(const DeviceMemory& src, size_t count) {
  return download_from<V>(src.ptr, count);
}
// `count` elements from the start of a described tensor.
template <typename V>
std::vector<V> download(const DeepepTensor& src, size_t count) {
  return download_from<V>(src.data, count);
}

// An op's outputs as the library describes them (Buffer::*_outputs), in cudaMalloc'd memory freed on
// scope exit; outputs[i] goes into the op's arguments as it is.
struct OutputMemory {
  DeepepOutputs outputs;
  std::vector<std::unique_ptr<DeviceMemory>> allocations;
  explicit OutputMemory(const DeepepOutputs& described) : outputs(described) {
    std::vector<void*> bases;
    for (int g = 0; g < outputs.num_allocations; ++g) {
      allocations.push_back(std::make_unique<DeviceMemory>(static_cast<size_t>(deepep::allocation_bytes(outputs, g))));
      bases.push_back(allocations.back()->ptr);
    }
    deepep::place_outputs(outputs, bases.data());
  }
  const DeepepTensor& operator[](int i) const { return outputs.tensors[i]; }
  // Elements of output i's allocation (its whole span when it is alone there).
  size_t elems(int i) const { return static_cast<size_t>(outputs.allocation_elems[outputs.allocation[i]]); }
};

// The elements of a contiguous device tensor.
template <typename V>
std::vector<V> download(const DeepepTensor& src) {
  size_t count = 1;
  for (int d = 0; d < src.ndim; ++d) count *= static_cast<size_t>(src.shape[d]);
  return download<V>(src, count);
}

// Check failures are counted, not thrown, so every rank reaches every collective call.
struct Checker {
  int rank;
  int failures = 0;
  void expect(bool ok, const std::string& what) {
    if (ok) return;
    if (++failures <= 10) std::fprintf(stderr, "rank %d: MISMATCH: %s\n", rank, what.c_str());
  }
  // Prints one summary line per stage: whether it added failures.
  void stage(const char* name, int failures_before, const std::string& detail) const {
    std::printf("rank %d: %-22s %s%s\n", rank, name, failures == failures_before ? "PASS" : "FAIL", detail.c_str());
  }
};

// main() of an example: runs run_rank(rank, id) on one thread per GPU for ranks [0, num_ranks).
// Exit codes: 0 every rank passed, 1 a failure, 2 no GPU/driver (a clean DEEPEP_ERROR_NO_DEVICE),
// 3 fewer GPUs than ranks (skipped).
template <typename RunRank>
int run_ranks(const char* name, int num_ranks, RunRank run_rank) {
  try {
    std::printf("deepep-nccl %s, NCCL compiled %d\n", deepep_library_version(), deepep_nccl_compiled_version());
    const int devices = deepep::device_count();
    if (devices < num_ranks) {
      std::fprintf(stderr, "%s: skipped: needs %d GPUs, found %d\n", name, num_ranks, devices);
      return 3;
    }
    const deepep::UniqueId id = deepep::get_unique_id();
    std::vector<int> results(num_ranks, 1);
    std::vector<std::thread> threads;
    for (int rank = 0; rank < num_ranks; ++rank) {
      threads.emplace_back([rank, &id, &results, &run_rank] {
        try {
          results[rank] = run_rank(rank, id);
        } catch (const std::exception& e) {
          std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
          results[rank] = 1;
        }
      });
    }
    for (auto& t : threads) t.join();
    for (int r : results) {
      if (r != 0) {
        std::fprintf(stderr, "%s: FAIL\n", name);
        return 1;
      }
    }
    std::printf("%s: PASS\n", name);
    return 0;
  } catch (const deepep::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return e.status() == DEEPEP_ERROR_NO_DEVICE ? 2 : 1;
  }
}

}  // namespace example
