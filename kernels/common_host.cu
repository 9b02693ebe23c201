// Host functions that do not depend on the NCCL build: the ring and slot sizes both sides of a
// transfer agree on, and CUDA error strings. Compiled once (build.rs), against the first build's
// NCCL headers only because the layout headers include them.
#include <cuda_runtime.h>

#include "deepep_kernels.h"
#include "ll_common.cuh"
#include "internode_common.cuh"
#include "normal_common.cuh"

extern "C" int64_t deepep_dispatch_slot_bytes(int32_t hidden_bytes, int32_t num_scales, int32_t num_topk) {
  using deepep::align16;
  return deepep::normal::align_slot(deepep::normal::kSlotHeaderBytes + align16(hidden_bytes) +
                                    align16(int64_t(num_scales) * 4) + 2 * align16(int64_t(num_topk) * 4));
}

extern "C" int64_t deepep_combine_slot_bytes(int32_t hidden_bytes, int32_t num_topk) {
  using deepep::align16;
  return deepep::normal::align_slot(deepep::normal::kSlotHeaderBytes + align16(hidden_bytes) +
                                    align16(int64_t(num_topk) * 4));
}

extern "C" uint32_t deepep_normal_flag_generation(uint32_t epoch) { return deepep::normal::flag_generation(epoch); }

extern "C" int64_t deepep_ll_dispatch_slot_bytes(int32_t hidden, int32_t num_topk, int32_t use_fp8) {
  return deepep::ll::dispatch_header_bytes(num_topk) + deepep::ll::dispatch_payload_bytes(hidden, use_fp8 != 0);
}

extern "C" int64_t deepep_ll_combine_slot_bytes(int32_t hidden, int32_t use_logfmt) {
  if (use_logfmt && !DEEPEP_HAVE_LOGFMT) return -1;
  return deepep::ll::combine_data_bytes(hidden) + deepep::ll::combine_meta_bytes(hidden);
}

extern "C" int64_t deepep_ll_count_bytes(int32_t num_local_experts, int32_t max_tokens) {
  return deepep::ll::count_message_bytes(num_local_experts, max_tokens);
}

// Bytes of the combine area per (expert, token): data slot plus metadata slot.
extern "C" int64_t deepep_ll_view_row_bytes(int32_t hidden) { return deepep::ll::view_row_bytes(hidden); }

extern "C" const char* deepep_cuda_error_string(int error) {
  return cudaGetErrorString(static_cast<cudaError_t>(error));
}

extern "C" int64_t deepep_internode_dispatch_row_bytes(int32_t hidden_bytes, int32_t num_scales, int32_t num_topk) {
  return deepep::internode::DispatchRow{hidden_bytes, num_scales, num_topk}.bytes();
}

extern "C" int64_t deepep_internode_combine_row_bytes(int32_t hidden_bytes, int32_t num_topk) {
  return deepep::internode::CombineRow{hidden_bytes, num_topk}.bytes();
}
