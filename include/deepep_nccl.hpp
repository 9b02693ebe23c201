// deepep-nccl C++ API: header-only RAII wrappers over the C ABI (deepep_nccl.h).
// Errors become deepep::Error exceptions carrying the status and message.
#ifndef DEEPEP_NCCL_HPP
#define DEEPEP_NCCL_HPP

#include <array>
#include <initializer_list>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "deepep_nccl.h"

namespace deepep {

class Error : public std::runtime_error {
 public:
  Error(DeepepStatus status, const std::string& message)
      : std::runtime_error(std::string(deepep_status_string(status)) + ": " + message), status_(status) {}
  DeepepStatus status() const noexcept { return status_; }

 private:
  DeepepStatus status_;
};

inline void check(DeepepStatus status) {
  if (status != DEEPEP_SUCCESS) throw Error(status, deepep_last_error());
}

using UniqueId = std::array<uint8_t, DEEPEP_UNIQUE_ID_BYTES>;

inline UniqueId get_unique_id() {
  UniqueId id{};
  check(deepep_get_unique_id(id.data(), id.size()));
  return id;
}

inline int device_count() {
  int n = 0;
  check(deepep_device_count(&n));
  return n;
}

// DeepEP's Config, validated on construction.
class Config {
 public:
  explicit Config(int num_sms = 20, int nvl_send = 6, int nvl_recv = 256, int rdma_send = 6, int rdma_recv = 256) {
    check(deepep_config_init(&cfg_, num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv));
  }
  static Config dispatch_default(int num_ranks, int num_sms = 20) { return from_table(DEEPEP_CONFIG_DISPATCH, num_ranks, num_sms); }
  static Config combine_default(int num_ranks, int num_sms = 20) { return from_table(DEEPEP_CONFIG_COMBINE, num_ranks, num_sms); }
  int64_t nvl_buffer_size_hint(int64_t hidden_bytes, int num_ranks) const {
    int64_t out = 0;
    check(deepep_config_nvl_buffer_size_hint(&cfg_, hidden_bytes, num_ranks, &out));
    return out;
  }
  int64_t rdma_buffer_size_hint(int64_t hidden_bytes, int num_ranks) const {
    int64_t out = 0;
    check(deepep_config_rdma_buffer_size_hint(&cfg_, hidden_bytes, num_ranks, &out));
    return out;
  }
  const DeepepConfig& raw() const noexcept { return cfg_; }

 private:
  Config(DeepepConfig cfg, int) : cfg_(cfg) {}
  static Config from_table(DeepepConfigKind kind, int num_ranks, int num_sms) {
    DeepepConfig cfg{};
    check(deepep_config_default(&cfg, kind, num_ranks, num_sms));
    return Config(cfg, 0);
  }
  DeepepConfig cfg_{};
};

struct BufferOptions {
  int64_t num_nvl_bytes = 0;
  int64_t num_rdma_bytes = 0;
  bool low_latency_mode = false;
  bool explicitly_destroy = false;
  bool enable_shrink = false;
};

// One rank's buffer. Construction and destroy() are collective.
class Buffer {
 public:
  Buffer(int rank, int num_ranks, const UniqueId& id, const BufferOptions& opts = {}) {
    check(deepep_buffer_create(rank, num_ranks, id.data(), id.size(), opts.num_nvl_bytes, opts.num_rdma_bytes,
                               opts.low_latency_mode, opts.explicitly_destroy, opts.enable_shrink, &buf_));
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& other) noexcept : buf_(std::exchange(other.buf_, nullptr)) {}
  ~Buffer() { deepep_buffer_free(buf_); }

  void destroy() { check(deepep_buffer_destroy(buf_)); }
  bool is_available() const { return query_bool(deepep_buffer_is_available); }
  int rank() const { return query(deepep_buffer_get_rank); }
  int num_ranks() const { return query(deepep_buffer_get_num_ranks); }
  int num_rdma_ranks() const { return query(deepep_buffer_get_num_rdma_ranks); }
  int rdma_rank() const { return query(deepep_buffer_get_rdma_rank); }
  int local_device_id() const { return query(deepep_buffer_get_local_device_id); }
  void check_peers() const { check(deepep_buffer_check_peers(buf_)); }
  void barrier() const { check(deepep_buffer_barrier(buf_)); }
  std::pair<void*, int64_t> local_buffer(bool use_rdma_buffer = false) const {
    void* ptr = nullptr;
    int64_t bytes = 0;
    check(deepep_buffer_get_local_buffer(buf_, use_rdma_buffer, &ptr, &bytes));
    return {ptr, bytes};
  }
  void* comm_stream() const {
    void* s = nullptr;
    check(deepep_buffer_get_comm_stream(buf_, &s));
    return s;
  }
  // Outputs are caller-allocated (see deepep_get_dispatch_layout); stream may be null (comm stream).
  void get_dispatch_layout(const DeepepTensor& topk_idx, int num_experts, const DeepepTensor& num_tokens_per_rank,
                           const DeepepTensor* num_tokens_per_rdma_rank, const DeepepTensor& num_tokens_per_expert,
                           const DeepepTensor& is_token_in_rank, void* stream = nullptr) const {
    check(deepep_get_dispatch_layout(buf_, &topk_idx, num_experts, &num_tokens_per_rank, num_tokens_per_rdma_rank,
                                     &num_tokens_per_expert, &is_token_in_rank, stream));
  }
  void set_gpu_timeout_ms(uint64_t timeout_ms) const { check(deepep_buffer_set_gpu_timeout_ms(buf_, timeout_ms)); }

  // Normal-mode (intranode) dispatch, step 1: validates `args` and launches the notify
  // kernel on `stream` (null: the comm stream). Non-cached without num_worst_tokens, it
  // waits on the host and returns the receive count N; `per_expert` (optional) is then
  // resized to E / num_ranks and filled with the aligned per-local-expert counts. Cached or
  // num_worst_tokens > 0: returns -1 and clears `per_expert` (N is the handle's row count
  // or num_worst_tokens). Allocate N-row outputs, then call intranode_dispatch with the
  // same args on the same stream.
  int intranode_dispatch_prepare(const DeepepIntranodeDispatchArgs& args, std::vector<int>* per_expert = nullptr,
                                 void* stream = nullptr) const {
    std::vector<int> scratch;
    std::vector<int>& list = per_expert != nullptr ? *per_expert : scratch;
    list.clear();
    const DeepepTensor& experts = args.num_tokens_per_expert;
    if (args.cached == 0 && experts.dtype != 0 && experts.ndim == 1 && experts.shape[0] > 0) {
      const int ranks = num_ranks();
      if (ranks > 0) list.assign(static_cast<size_t>(experts.shape[0] / ranks), 0);
    }
    int num_recv = -1;
    check(deepep_intranode_dispatch_prepare(buf_, &args, &num_recv, list.empty() ? nullptr : list.data(),
                                            static_cast<int>(list.size()), stream));
    if (num_recv < 0) list.clear();
    return num_recv;
  }
  // Step 2: the data kernel into caller-allocated N-row outputs (absent ones: dtype 0).
  void intranode_dispatch(const DeepepIntranodeDispatchArgs& args, const DeepepIntranodeDispatchOutputs& outputs,
                          void* stream = nullptr) const {
    check(deepep_intranode_dispatch(buf_, &args, &outputs, stream));
  }
  // Sums each token's received rows back onto its source rank into args.combined_x.
  void intranode_combine(const DeepepIntranodeCombineArgs& args, void* stream = nullptr) const {
    check(deepep_intranode_combine(buf_, &args, stream));
  }
  DeepepBuffer* raw() const noexcept { return buf_; }

 private:
  int query(DeepepStatus (*fn)(const DeepepBuffer*, int*)) const {
    int out = 0;
    check(fn(buf_, &out));
    return out;
  }
  bool query_bool(DeepepStatus (*fn)(const DeepepBuffer*, bool*)) const {
    bool out = false;
    check(fn(buf_, &out));
    return out;
  }
  DeepepBuffer* buf_ = nullptr;
};

// A contiguous (row-major) descriptor for caller-owned device memory, at most DEEPEP_MAX_DIMS dims.
inline DeepepTensor make_tensor(void* data, DeepepDtype dtype, std::initializer_list<int64_t> shape) {
  if (shape.size() > DEEPEP_MAX_DIMS)
    throw Error(DEEPEP_ERROR_INVALID_ARGUMENT, "make_tensor: at most " + std::to_string(DEEPEP_MAX_DIMS) +
                                                   " dimensions, got " + std::to_string(shape.size()));
  DeepepTensor t{};
  t.data = data;
  t.dtype = dtype;
  t.ndim = static_cast<int32_t>(shape.size());
  int i = 0;
  for (int64_t d : shape) t.shape[i++] = d;
  int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.strides[d] = stride;
    stride *= t.shape[d];
  }
  return t;
}

// The descriptor of an absent optional tensor in the argument structs (dtype 0).
inline DeepepTensor absent_tensor() noexcept { return DeepepTensor{}; }

}  // namespace deepep

#endif  // DEEPEP_NCCL_HPP
