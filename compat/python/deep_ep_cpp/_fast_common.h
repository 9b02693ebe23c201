// Helpers shared by the compiled host path's ops (_fast.cpp is the module; one translation unit).
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "deepep_nccl.h"

namespace deepep_fast {

// Returned (alone in the tuple) for input this path does not take, always before anything is
// launched; the caller then runs the ctypes path, which raises the error naming the argument.
// No message is formatted here: c10::str of a tensor's sizes segfaulted on the GPU machines'
// torch 2.11, even in a module built with torch's compiler.
constexpr int kBadInput = -2;
// Returned (alone in the tuple) by LlOps::dispatch for a shape it has no plan for, before anything
// is launched: the caller describes the shape (deepep_low_latency_dispatch_outputs, which checks it
// first), adds it with add_dispatch_shape and calls again.
constexpr int kNewShape = -4;

inline int32_t dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kBool: return DEEPEP_DTYPE_BOOL;
    case at::kByte: return DEEPEP_DTYPE_UINT8;
    case at::kInt: return DEEPEP_DTYPE_INT32;
    case at::kLong: return DEEPEP_DTYPE_INT64;
    case at::kFloat: return DEEPEP_DTYPE_FLOAT32;
    case at::kBFloat16: return DEEPEP_DTYPE_BFLOAT16;
    case at::kHalf: return DEEPEP_DTYPE_FLOAT16;
    case at::kFloat8_e4m3fn: return DEEPEP_DTYPE_FLOAT8_E4M3;
    default: return 0;
  }
}

inline at::ScalarType scalar_type(int32_t code) {
  switch (code) {
    case DEEPEP_DTYPE_BOOL: return at::kBool;
    case DEEPEP_DTYPE_UINT8: return at::kByte;
    case DEEPEP_DTYPE_INT32: return at::kInt;
    case DEEPEP_DTYPE_INT64: return at::kLong;
    case DEEPEP_DTYPE_FLOAT32: return at::kFloat;
    case DEEPEP_DTYPE_BFLOAT16: return at::kBFloat16;
    case DEEPEP_DTYPE_FLOAT16: return at::kHalf;
    default: return at::kFloat8_e4m3fn;
  }
}

inline at::IntArrayRef dims(const DeepepTensor& t) { return at::IntArrayRef(t.shape, size_t(t.ndim)); }
inline at::IntArrayRef steps(const DeepepTensor& t) { return at::IntArrayRef(t.strides, size_t(t.ndim)); }

// Whether t's strides are the row-major ones of its shape (at::empty is the cheaper allocation).
inline bool row_major(const DeepepTensor& t) {
  int64_t step = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    if (t.strides[d] != step) return false;
    step *= std::max<int64_t>(t.shape[d], 1);
  }
  return true;
}

// The outputs a DeepepOutputs describes (deepep_*_outputs), allocated by torch; absent ones are
// empty optionals. An output alone in its allocation is one at::empty (or at::empty_strided);
// outputs sharing one are views of a single at::empty.
inline std::array<c10::optional<at::Tensor>, DEEPEP_MAX_OP_OUTPUTS> allocate(const DeepepOutputs& o,
                                                                          const at::TensorOptions& on_device) {
  std::array<int, DEEPEP_MAX_OP_OUTPUTS> members{};
  for (int i = 0; i < o.count; ++i)
    if (o.allocation[i] >= 0) ++members[o.allocation[i]];
  std::array<at::Tensor, DEEPEP_MAX_OP_OUTPUTS> bases;
  std::array<c10::optional<at::Tensor>, DEEPEP_MAX_OP_OUTPUTS> out;
  for (int i = 0; i < o.count; ++i) {
    const int g = o.allocation[i];
    if (g < 0) continue;
    const DeepepTensor& t = o.tensors[i];
    if (members[g] == 1) {
      const auto options = on_device.dtype(scalar_type(t.dtype));
      out[i] = row_major(t) ? at::empty(dims(t), options) : at::empty_strided(dims(t), steps(t), options);
      continue;
    }
    if (!bases[g].defined())
      bases[g] = at::empty({o.allocation_elems[g]}, on_device.dtype(scalar_type(o.allocation_dtype[g])));
    out[i] = bases[g].as_strided(dims(t), steps(t), o.offset[i]);
  }
  return out;
}

// The last description an output query (deepep_*_outputs) gave, by what it reads: a repeated
// shape skips the query, a C ABI call that validates every argument, as the op then does again
// (bad input still fails there, naming the argument, only after the outputs were allocated).
template <size_t N>
class OutputsCache {
 public:
  using Key = std::array<int64_t, N>;

  // 0 with `o` describing the outputs for `key` (query(&o) asked only on a new key), or the query's
  // status. `o` is the caller's, refilled by the query; each call re-points only its data fields.
  template <typename Query>
  int get(const Key& key, DeepepOutputs& o, Query query) {
    if (valid_ && key == key_) return 0;
    valid_ = false;  // no description until the query succeeds
    if (const int status = query(&o)) return status;
    key_ = key;
    valid_ = true;
    return 0;
  }

 private:
  Key key_{};
  bool valid_ = false;
};

// allocate(), plus each present output's address written into its descriptor: o.tensors[i] then
// describes output i completely, ready for the op (absent ones stay all-zero).
inline std::array<c10::optional<at::Tensor>, DEEPEP_MAX_OP_OUTPUTS> allocate_placed(DeepepOutputs& o,
                                                                                  const at::TensorOptions& on_device) {
  auto out = allocate(o, on_device);
  for (int i = 0; i < o.count; ++i)
    if (out[i].has_value()) o.tensors[i].data = out[i]->data_ptr();
  return out;
}

// The C ABI's descriptor of t (strides in elements); false for a dtype or rank it cannot carry.
// The Rust side checks shapes and dtypes against the op.
inline bool describe(DeepepTensor& d, const at::Tensor& t) {
  const int32_t code = dtype_code(t.scalar_type());
  const int64_t n = t.dim();
  if (code == 0 || n > DEEPEP_MAX_DIMS) return false;
  std::memset(&d, 0, sizeof d);
  d.data = t.data_ptr();
  d.dtype = code;
  d.ndim = int32_t(n);
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  for (int64_t i = 0; i < n; ++i) {
    d.shape[i] = sizes[i];
    d.strides[i] = strides[i];
  }
  return true;
}

// An absent optional tensor is the all-zero descriptor, as the C ABI expects.
inline bool describe(DeepepTensor& d, const c10::optional<at::Tensor>& t) {
  if (t.has_value()) return describe(d, *t);
  std::memset(&d, 0, sizeof d);
  return true;
}

inline bool on_device(const at::Tensor& t, int device) { return t.is_cuda() && t.get_device() == device; }

// Whether v survives the C ABI's int32 fields (the ctypes path rejects the rest by name).
inline bool fits_int32(int64_t v) { return v >= INT32_MIN && v <= INT32_MAX; }

template <typename T>
T* at_address(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

// DeepEP's num_recv_tokens_per_expert_list: the E / R counts a prepare that waited filled (a
// count >= 0; num_tokens_per_expert then passed its checks, 1-D [E]), else empty. The dispatch
// entries build it after the data kernel's launch: between the host wait and that launch its
// Python ints took 2.5-3 us (session 22's entry timers, 128 local experts).
inline py::list per_expert_list(int num_recv, const c10::optional<at::Tensor>& num_tokens_per_expert,
                                int64_t num_ranks, const std::vector<int>& counts) {
  py::list list;
  if (num_recv < 0 || !num_tokens_per_expert.has_value()) return list;
  const int64_t local = std::min<int64_t>(num_tokens_per_expert->size(0) / num_ranks, int64_t(counts.size()));
  for (int64_t e = 0; e < local; ++e) list.append(counts[e]);
  return list;
}

// A buffer handle as Python holds it (an int): a value the library checks, never an address.
inline const DeepepBuffer* as_buffer(uintptr_t handle) { return reinterpret_cast<const DeepepBuffer*>(handle); }

inline void* as_stream(uintptr_t address) { return reinterpret_cast<void*>(address); }

inline py::object optional_tensor(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? py::cast(*t) : py::none();
}

}  // namespace deepep_fast
