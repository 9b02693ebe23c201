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

// A contiguous descriptor for caller-owned device memory.
inline DeepepTensor make_tensor(void* data, DeepepDtype dtype, std::initializer_list<int64_t> shape) {
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

}  // namespace deepep

#endif  // DEEPEP_NCCL_HPP
