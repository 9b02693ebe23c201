// deepep-nccl C++ API: header-only RAII wrappers over the C ABI (deepep_nccl.h).
// Errors become deepep::Error exceptions carrying the status and message.
#ifndef DEEPEP_NCCL_HPP
#define DEEPEP_NCCL_HPP

#include <array>
#include <initializer_list>
#include <cstdint>
#include <functional>
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

// The same with explicit element strides (e.g. the column-major FP8 scales of LL dispatch).
inline DeepepTensor make_tensor(void* data, DeepepDtype dtype, std::initializer_list<int64_t> shape,
                               std::initializer_list<int64_t> strides) {
  if (strides.size() != shape.size())
    throw Error(DEEPEP_ERROR_INVALID_ARGUMENT, "make_tensor: " + std::to_string(shape.size()) + " dimensions but " +
                                                   std::to_string(strides.size()) + " strides");
  DeepepTensor t = make_tensor(data, dtype, shape);
  int i = 0;
  for (int64_t s : strides) t.strides[i++] = s;
  return t;
}

// The descriptor of an absent optional tensor in the argument structs (dtype 0).
inline DeepepTensor absent_tensor() noexcept { return DeepepTensor{}; }

// Output geometry: the library says what each op's caller allocates (Buffer::*_outputs, from
// deepep_*_outputs). Allocate allocation_bytes(o, g) bytes of device memory for every
// g < o.num_allocations, then place_outputs(o, bases) (or output_tensor for one output): o.tensors[i]
// then describes output i (absent ones keep dtype 0) and goes into the op's arguments as it is.

// Bytes per element of a DeepepDtype value (0 for an unknown one), as the library defines them.
inline int64_t dtype_size(int32_t dtype) noexcept { return deepep_dtype_size(dtype); }

// Bytes of allocation g of an op's outputs.
inline int64_t allocation_bytes(const DeepepOutputs& outputs, int g) {
  return outputs.allocation_elems[g] * dtype_size(outputs.allocation_dtype[g]);
}

// Output i's descriptor, placed in the caller's memory: allocations[g] is allocation g's base.
// An absent output stays absent (dtype 0).
inline DeepepTensor output_tensor(const DeepepOutputs& outputs, int i, void* const* allocations) {
  DeepepTensor t = outputs.tensors[i];
  const int g = outputs.allocation[i];
  if (g >= 0)
    t.data = static_cast<char*>(allocations[g]) + outputs.offset[i] * dtype_size(outputs.allocation_dtype[g]);
  return t;
}

// Places every output of `o` (output_tensor for each), in place.
inline void place_outputs(DeepepOutputs& o, void* const* bases) {
  for (int i = 0; i < o.count; ++i) o.tensors[i] = output_tensor(o, i, bases);
}

// Streams: every op takes a cudaStream_t as void* (this header needs no CUDA headers). As in the
// C ABI, nullptr means the buffer's comm stream, NOT CUDA's default stream (whose handle is also
// 0): pass default_stream() to run on the legacy default stream.
inline void* default_stream() noexcept { return reinterpret_cast<void*>(uintptr_t{1}); }  // == cudaStreamLegacy

// get_low_latency_rdma_size_hint: a num_rdma_bytes that always suffices for LL calls of this shape.
inline int64_t low_latency_rdma_size_hint(int64_t num_max_dispatch_tokens_per_rank, int64_t hidden, int num_ranks,
                                          int num_experts) {
  int64_t out = 0;
  check(deepep_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts, &out));
  return out;
}

// Throws if an LL shape is outside the kernels' limits; check before allocating the outputs.
inline void low_latency_check_shape(int64_t num_max_dispatch_tokens_per_rank, int64_t hidden, int num_ranks,
                                    int num_experts) {
  check(deepep_low_latency_check_shape(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts));
}

// Which phases an LL call runs (the C ABI's `phases`): send only is DeepEP's return_recv_hook,
// receive only is the hook.
enum class LowLatencyPhases : int32_t {
  send = DEEPEP_LL_PHASE_SEND,
  receive = DEEPEP_LL_PHASE_RECV,
  both = DEEPEP_LL_PHASE_BOTH,
};

// The receive phase of a send-only LL call (DeepEP's hook). It keeps copies of the args, the
// stream and the buffer half, so the caller may reuse its struct; the Buffer and every tensor
// named in the args must outlive it. Call it once. This header stands alone, so deep_ep_cpp's
// ctypes path and compiled path (_fast_hook.h) keep their own copies of this protocol;
// tests/python/test_ll_abi_cpu.py holds the three equal.
class LowLatencyHook {
 public:
  LowLatencyHook() = default;
  void operator()() const {
    if (!recv_) throw Error(DEEPEP_ERROR_INVALID_ARGUMENT, "LowLatencyHook: empty hook");
    recv_();
  }
  int buffer_idx() const noexcept { return buffer_idx_; }
  // The hook of a send-only call of `fn` (deepep_low_latency_dispatch or _combine) that ran on
  // `stream` with `args` and reported `buffer_idx`: `fn` with a copy of args, phases = receive.
  template <typename Args>
  static LowLatencyHook receive(DeepepStatus (*fn)(const DeepepBuffer*, const Args*, void*, int*),
                                const DeepepBuffer* buf, Args args, void* stream, int buffer_idx) {
    args.phases = static_cast<int32_t>(LowLatencyPhases::receive);
    return LowLatencyHook([fn, buf, args, stream, buffer_idx] {
      int i = buffer_idx;
      check(fn(buf, &args, stream, &i));
    }, buffer_idx);
  }

 private:
  friend class Buffer;
  LowLatencyHook(std::function<void()> recv, int buffer_idx) : recv_(std::move(recv)), buffer_idx_(buffer_idx) {}
  std::function<void()> recv_;
  int buffer_idx_ = -1;
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
  // What get_dispatch_layout's caller allocates for num_tokens rows of topk_idx (in its order:
  // per rank, per rdma rank or absent, per expert, is_token_in_rank).
  DeepepOutputs dispatch_layout_outputs(int64_t num_tokens, int num_experts) const {
    return describe_outputs(deepep_get_dispatch_layout_outputs, num_tokens, num_experts);
  }
  // get_dispatch_layout into outputs placed with place_outputs.
  void get_dispatch_layout(const DeepepTensor& topk_idx, int num_experts, const DeepepOutputs& outputs,
                           void* stream = nullptr) const {
    const DeepepTensor* per_rdma = outputs.tensors[1].dtype != 0 ? &outputs.tensors[1] : nullptr;
    get_dispatch_layout(topk_idx, num_experts, outputs.tensors[0], per_rdma, outputs.tensors[2], outputs.tensors[3],
                        stream);
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
  // What the normal-mode caller allocates (see the deepep_intranode_*_outputs functions): the
  // handle's matrices (before prepare; reads args.x, args.config, args.cached), the receive
  // outputs (after prepare, with its return value or, cached, the handle's row count), the
  // combine's outputs.
  DeepepOutputs intranode_dispatch_handle_outputs(const DeepepIntranodeDispatchArgs& args) const {
    return describe_outputs(deepep_intranode_dispatch_handle_outputs, &args);
  }
  DeepepOutputs intranode_dispatch_outputs(const DeepepIntranodeDispatchArgs& args, int num_recv_tokens) const {
    return describe_outputs(deepep_intranode_dispatch_outputs, &args, num_recv_tokens);
  }
  DeepepOutputs intranode_combine_outputs(const DeepepIntranodeCombineArgs& args) const {
    return describe_outputs(deepep_intranode_combine_outputs, &args);
  }
  // Step 2 into receive outputs placed with place_outputs (their order is DeepepIntranodeDispatchOutputs').
  void intranode_dispatch(const DeepepIntranodeDispatchArgs& args, const DeepepOutputs& outputs,
                          void* stream = nullptr) const {
    const DeepepTensor* t = outputs.tensors;
    intranode_dispatch(args, DeepepIntranodeDispatchOutputs{t[0], t[1], t[2], t[3], t[4]}, stream);
  }

  // Internode normal mode (a buffer across nodes, get_num_rdma_ranks() > 1; draft, not yet run on
  // GPUs): the intranode sequence with the internode structs. prepare returns the receive count
  // N and writes the scale-out receive count to *num_rdma_recv (-1 both when cached or with
  // num_worst_tokens).
  int internode_dispatch_prepare(const DeepepInternodeDispatchArgs& args, int* num_rdma_recv,
                                 std::vector<int>* per_expert = nullptr, void* stream = nullptr) const {
    std::vector<int> scratch;
    std::vector<int>& list = per_expert != nullptr ? *per_expert : scratch;
    list.clear();
    const DeepepTensor& experts = args.num_tokens_per_expert;
    if (args.cached == 0 && experts.dtype != 0 && experts.ndim == 1 && experts.shape[0] > 0) {
      const int ranks = num_ranks();
      if (ranks > 0) list.assign(static_cast<size_t>(experts.shape[0] / ranks), 0);
    }
    int num_recv = -1, rdma = -1;
    check(deepep_internode_dispatch_prepare(buf_, &args, &num_recv, &rdma, list.empty() ? nullptr : list.data(),
                                            static_cast<int>(list.size()), stream));
    if (num_recv < 0) list.clear();
    if (num_rdma_recv != nullptr) *num_rdma_recv = rdma;
    return num_recv;
  }
  void internode_dispatch(const DeepepInternodeDispatchArgs& args, const DeepepInternodeDispatchOutputs& outputs,
                          void* stream = nullptr) const {
    check(deepep_internode_dispatch(buf_, &args, &outputs, stream));
  }
  void internode_combine(const DeepepInternodeCombineArgs& args, void* stream = nullptr) const {
    check(deepep_internode_combine(buf_, &args, stream));
  }
  DeepepOutputs internode_dispatch_handle_outputs(const DeepepInternodeDispatchArgs& args) const {
    return describe_outputs(deepep_internode_dispatch_handle_outputs, &args);
  }
  DeepepOutputs internode_dispatch_outputs(const DeepepInternodeDispatchArgs& args, int num_recv_tokens,
                                           int num_rdma_recv_tokens) const {
    return describe_outputs(deepep_internode_dispatch_outputs, &args, num_recv_tokens, num_rdma_recv_tokens);
  }
  DeepepOutputs internode_combine_outputs(const DeepepInternodeCombineArgs& args) const {
    return describe_outputs(deepep_internode_combine_outputs, &args);
  }
  // Step 2 into receive outputs placed with place_outputs (DeepepInternodeDispatchOutputs' order).
  void internode_dispatch(const DeepepInternodeDispatchArgs& args, const DeepepOutputs& outputs,
                          void* stream = nullptr) const {
    const DeepepTensor* t = outputs.tensors;
    internode_dispatch(args, DeepepInternodeDispatchOutputs{t[0], t[1], t[2], t[3], t[4], t[5]}, stream);
  }

  // Low-latency (LL) mode: needs a buffer created with low_latency_mode and num_rdma_bytes from
  // low_latency_rdma_size_hint. Every LL call flips the buffer half (DeepEP's double buffering).
  // Streams as everywhere here: nullptr = the comm stream, default_stream() = CUDA's default.

  // What an LL dispatch of this shape outputs, in args order (packed_recv_x, _x_scales, _count,
  // _src_info, _layout_range): allocate each allocation (allocation_bytes) and set args' output
  // fields with output_tensor. Throws for a shape outside the limits, before any allocation.
  DeepepOutputs low_latency_dispatch_outputs(int64_t num_max_dispatch_tokens_per_rank, int64_t hidden, int num_experts,
                                             bool use_fp8, bool use_ue8m0 = false) const {
    DeepepOutputs out{};
    check(deepep_low_latency_dispatch_outputs(buf_, num_max_dispatch_tokens_per_rank, hidden, num_experts, use_fp8,
                                              use_ue8m0, &out));
    return out;
  }
  // What an LL combine of num_tokens tokens outputs: args.out, [num_tokens, hidden] bfloat16.
  DeepepOutputs low_latency_combine_outputs(int64_t num_tokens, int64_t hidden) const {
    DeepepOutputs out{};
    check(deepep_low_latency_combine_outputs(buf_, num_tokens, hidden, &out));
    return out;
  }
  // LL dispatch into the caller-allocated outputs of `args` (`phases` replaces args.phases).
  // Returns the buffer half used: a receive-only call takes the half its send-only call
  // returned, and the same args and stream.
  int low_latency_dispatch(const DeepepLowLatencyDispatchArgs& args, void* stream = nullptr,
                           LowLatencyPhases phases = LowLatencyPhases::both, int buffer_idx = -1) const {
    DeepepLowLatencyDispatchArgs a = args;
    a.phases = static_cast<int32_t>(phases);
    check(deepep_low_latency_dispatch(buf_, &a, stream, &buffer_idx));
    return buffer_idx;
  }
  // Send phase now; the returned hook launches the receive phase on the same stream.
  LowLatencyHook low_latency_dispatch_send(const DeepepLowLatencyDispatchArgs& args, void* stream = nullptr) const {
    const int idx = low_latency_dispatch(args, stream, LowLatencyPhases::send);
    // buf_, not `this`: a moved Buffer keeps the handle.
    return LowLatencyHook::receive(deepep_low_latency_dispatch, buf_, args, stream, idx);
  }
  // LL combine of the experts' outputs (args.x, or the zero-copy view with args.zero_copy) into
  // args.out, with the dispatch handle (src_info, layout_range). Halves as low_latency_dispatch.
  int low_latency_combine(const DeepepLowLatencyCombineArgs& args, void* stream = nullptr,
                          LowLatencyPhases phases = LowLatencyPhases::both, int buffer_idx = -1) const {
    DeepepLowLatencyCombineArgs a = args;
    a.phases = static_cast<int32_t>(phases);
    check(deepep_low_latency_combine(buf_, &a, stream, &buffer_idx));
    return buffer_idx;
  }
  LowLatencyHook low_latency_combine_send(const DeepepLowLatencyCombineArgs& args, void* stream = nullptr) const {
    const int idx = low_latency_combine(args, stream, LowLatencyPhases::send);
    return LowLatencyHook::receive(deepep_low_latency_combine, buf_, args, stream, idx);
  }
  // Collective: call after normal-mode ops and before LL ops (or when (M, H, E) changes); the
  // next LL call uses half 0. One kernel on `stream` (nullptr: the comm stream); no host wait.
  void clean_low_latency_buffer(int num_max_dispatch_tokens_per_rank, int hidden, int num_experts,
                                void* stream = nullptr) const {
    check(deepep_clean_low_latency_buffer(buf_, num_max_dispatch_tokens_per_rank, hidden, num_experts, stream));
  }
  // The zero-copy view of the next LL call's half: BF16 [E / R, R * M, H] with the library's
  // strides (rows are longer than H). Write the experts' outputs there, then combine with
  // zero_copy = 1 as the next LL call.
  DeepepTensor get_next_low_latency_combine_buffer(int num_max_dispatch_tokens_per_rank, int hidden,
                                                   int num_experts) const {
    DeepepTensor view{};
    check(deepep_get_next_low_latency_combine_buffer(buf_, num_max_dispatch_tokens_per_rank, hidden, num_experts,
                                                     &view));
    return view;
  }
  // Shrink mode (enable_shrink), in stream order: mask or unmask one rank; copy the mask
  // (1 = masked) into an int32 [num_ranks] device tensor; unmask every rank.
  void low_latency_update_mask_buffer(int rank_to_mask, bool mask, void* stream = nullptr) const {
    check(deepep_low_latency_update_mask_buffer(buf_, rank_to_mask, mask, stream));
  }
  void low_latency_query_mask_buffer(const DeepepTensor& mask_status, void* stream = nullptr) const {
    check(deepep_low_latency_query_mask_buffer(buf_, &mask_status, stream));
  }
  void low_latency_clean_mask_buffer(void* stream = nullptr) const {
    check(deepep_low_latency_clean_mask_buffer(buf_, stream));
  }
  // Shrink mode, normal ops: copy the dropped-row counters into an int64 [4] device tensor
  // (docs/normal_shrink.md), in stream order.
  void normal_query_dropped(const DeepepTensor& dropped, void* stream = nullptr) const {
    check(deepep_normal_query_dropped(buf_, &dropped, stream));
  }
  // Internode mode: copy the traffic counters (enum DeepepTrafficKind: rows and bytes sent over
  // each leg, cumulative) into an int64 [8] device tensor (docs/internode.md), in stream order.
  void internode_query_traffic(const DeepepTensor& traffic, void* stream = nullptr) const {
    check(deepep_internode_query_traffic(buf_, &traffic, stream));
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
  template <typename Query, typename... Args>
  DeepepOutputs describe_outputs(Query query, Args... args) const {
    DeepepOutputs out{};
    check(query(buf_, args..., &out));
    return out;
  }
  DeepepBuffer* buf_ = nullptr;
};

}  // namespace deepep

#endif  // DEEPEP_NCCL_HPP
