// deepep-nccl from C++: low-latency (LL) dispatch and combine across 2 GPUs, driven by one
// process with one thread per GPU, checked against the host.
//
// Each rank sends T = 64 tokens of hidden 2048 (BF16, a function of a seed, the rank, the token
// and the channel, so every rank knows every rank's input without an all-gather) with top-4 of 16
// experts (8 per rank); some slots are -1 and token 5 mod 16 goes nowhere. Checks, in the terms of
// docs/low_latency.md: a BF16 dispatch (packed_recv_count, layout_range, src_info, every received
// row bit for bit, the cumulative stats); an FP8 dispatch run as send then receive on CUDA's
// default stream (counts, scales, dequantized rows within FP8 rounding); combine of the expert
// outputs y = bf16(row * factor(expert)) three times: in one call, with a hook on a stream of our
// own, and zero-copy (y written into the next combine view, args.x all zero), each against a host
// fp32 weighted sum within 1e-2 relative; then the shrink-mode mask calls.
// Exit codes: 0 ok, 1 failure, 2 no GPU/driver (a clean DEEPEP_ERROR_NO_DEVICE),
// 3 fewer than 2 GPUs (skipped).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "deepep_nccl.hpp"
#include "example_util.hpp"

namespace {

using namespace example;

constexpr int R = 2, T = 64, M = 128, H = 2048, E = 16, K = 4, EPR = E / R, RM = R * M, SCALES = H / 128;
constexpr uint32_t kSeed = 0x5eedu;

uint32_t mix(uint32_t a) {  // a 32-bit integer hash
  a ^= a >> 16;
  a *= 0x7feb352du;
  a ^= a >> 15;
  a *= 0x846ca68bu;
  a ^= a >> 16;
  return a;
}
float fp8_e4m3_to_float(uint8_t b) {
  const int exp = (b >> 3) & 15, man = b & 7;
  float v;
  if (exp == 15 && man == 7) v = std::numeric_limits<float>::quiet_NaN();
  else if (exp == 0) v = std::ldexp(static_cast<float>(man), -9);
  else v = std::ldexp(1.0f + static_cast<float>(man) / 8.0f, exp - 7);
  return (b & 0x80) ? -v : v;
}

// Rank s's input, token t, channel h: |x| < 2; the amplitude changes per 128-channel block so
// the FP8 scales differ.
uint16_t x_bits(int s, int t, int h) {
  const uint32_t u = mix(static_cast<uint32_t>((s * T + t) * H + h) ^ kSeed);
  const float amp = 0.25f * static_cast<float>(1 + (s + t + h / 128) % 8);
  return float_to_bf16(amp * (static_cast<float>(u % 2001) - 1000.0f) / 1000.0f);
}
// Expert of slot k of token t on rank s; -1 = none. Odd strides mod 16 keep the 4 experts distinct.
int64_t route(int s, int t, int k) {
  if (t % 16 == 5 || (s + t + k) % 7 == 3) return -1;
  const uint32_t h = mix(static_cast<uint32_t>(s * T + t) ^ (kSeed << 8));
  return static_cast<int64_t>((h % E + static_cast<uint32_t>(k) * (2 * ((h >> 8) % 8) + 1)) % E);
}
float weight(int s, int t, int k) { return 0.5f + 0.25f * static_cast<float>((s + 3 * t + 5 * k) % 4); }
float factor(int64_t expert) { return 0.5f + 0.125f * static_cast<float>(expert % 8); }

void sync(const char* what) { cuda_check(cudaDeviceSynchronize(), what); }

// A non-blocking stream of our own, destroyed on scope exit.
struct Stream {
  cudaStream_t s = nullptr;
  Stream() { cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags"); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream() { cudaStreamDestroy(s); }
};

void fill(const DeviceMemory& dst, int byte, size_t bytes) {
  cuda_check(cudaMemset(dst.ptr, byte, bytes), "cudaMemset");
}
void fill(const DeepepTensor& dst, int byte, size_t bytes) {
  cuda_check(cudaMemset(dst.data, byte, bytes), "cudaMemset");
}

// One received row: local expert e's row from source rank s, token t.
struct Row {
  int s, t;
};

int run_rank(int rank, const deepep::UniqueId& id) {
  cuda_check(cudaSetDevice(rank), "cudaSetDevice");
  cuda_check(cudaFree(nullptr), "cudaFree(0) (context init)");  // make the primary context current
  Checker chk{rank};

  deepep::low_latency_check_shape(M, H, R, E);  // throws naming the limit, before any allocation
  deepep::BufferOptions opts;
  opts.num_rdma_bytes = deepep::low_latency_rdma_size_hint(M, H, R, E);
  opts.low_latency_mode = true;
  opts.explicitly_destroy = true;  // a failed rank must not block in the destructor's teardown
  opts.enable_shrink = true;       // for the mask calls at the end
  deepep::Buffer buffer(rank, R, id, opts);  // collective: both threads are here at once
  buffer.set_gpu_timeout_ms(30000);          // fail well before a suite step's time limit
  buffer.clean_low_latency_buffer(M, H, E);  // collective; not needed on a fresh buffer, shown for the API

  // This rank's inputs, and what it receives: per local expert, blocks by source rank ascending,
  // tokens ascending inside a block (the experts of one token are distinct: one row each).
  std::vector<uint16_t> x(static_cast<size_t>(T) * H);
  std::vector<int64_t> topk(T * K);
  std::vector<float> weights(T * K);
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < H; ++h) x[static_cast<size_t>(t) * H + h] = x_bits(rank, t, h);
    for (int k = 0; k < K; ++k) {
      topk[t * K + k] = route(rank, t, k);
      weights[t * K + k] = weight(rank, t, k);
    }
  }
  std::vector<std::vector<Row>> want_rows(EPR);
  std::vector<int64_t> want_range(EPR * R);
  for (int e = 0; e < EPR; ++e)
    for (int s = 0; s < R; ++s) {
      const int64_t begin = static_cast<int64_t>(want_rows[e].size());
      for (int t = 0; t < T; ++t)
        for (int k = 0; k < K; ++k)
          if (route(s, t, k) == rank * EPR + e) want_rows[e].push_back({s, t});
      want_range[e * R + s] = (begin << 32) | (static_cast<int64_t>(want_rows[e].size()) - begin);
    }
  std::vector<int32_t> want_count(EPR);
  int total_rows = 0;
  for (int e = 0; e < EPR; ++e) total_rows += want_count[e] = static_cast<int32_t>(want_rows[e].size());

  const size_t packed = static_cast<size_t>(EPR) * RM * H;
  DeviceMemory d_x(x.size() * 2), d_topk(topk.size() * 8), d_weights(weights.size() * 4);
  DeviceMemory d_stats(EPR * 4), d_wait(R * 8);
  // The outputs, allocated as the library describes them for this shape and buffer.
  const OutputMemory recv(buffer.low_latency_dispatch_outputs(M, H, E, /*use_fp8=*/false));
  upload(d_x, x);
  upload(d_topk, topk);
  upload(d_weights, weights);
  fill(d_stats, 0, EPR * 4);
  fill(d_wait, 0, R * 8);
  sync("uploads");  // the LL calls below run on other streams

  using deepep::make_tensor;
  DeepepLowLatencyDispatchArgs args{};  // every tensor absent (dtype 0)
  args.x = make_tensor(d_x.ptr, DEEPEP_DTYPE_BFLOAT16, {T, H});
  args.topk_idx = make_tensor(d_topk.ptr, DEEPEP_DTYPE_INT64, {T, K});
  args.cumulative_local_expert_recv_stats = make_tensor(d_stats.ptr, DEEPEP_DTYPE_INT32, {EPR});
  args.dispatch_wait_recv_cost_stats = make_tensor(d_wait.ptr, DEEPEP_DTYPE_INT64, {R});
  args.packed_recv_x = recv[0];
  args.packed_recv_x_scales = recv[1];  // absent without FP8
  args.packed_recv_count = recv[2];
  args.packed_recv_src_info = recv[3];
  args.packed_recv_layout_range = recv[4];
  // The host checks below read these as contiguous [E_l, R*M, H], [E_l], [E_l, R*M], [E_l, R].
  chk.expect(args.packed_recv_x.shape[1] == RM && args.packed_recv_x.strides[1] == H && recv.elems(0) == packed &&
                 recv.elems(2) == EPR && recv.elems(3) == static_cast<size_t>(EPR) * RM && recv.elems(4) == EPR * R &&
                 args.packed_recv_x_scales.dtype == 0,
             "low_latency_dispatch_outputs (BF16): unexpected geometry");
  args.num_max_dispatch_tokens_per_rank = M;
  args.num_experts = E;

  // 1. BF16 dispatch, both phases in one call (null stream: the buffer's comm stream).
  int before = chk.failures;
  buffer.low_latency_dispatch(args);
  sync("low_latency_dispatch (BF16)");
  const auto count = download<int32_t>(args.packed_recv_count, EPR);
  const auto src = download<int32_t>(args.packed_recv_src_info, static_cast<size_t>(EPR) * RM);
  const auto range = download<int64_t>(args.packed_recv_layout_range, static_cast<size_t>(EPR) * R);
  const auto recv_x = download<uint16_t>(args.packed_recv_x, packed);
  chk.expect(count == want_count, "packed_recv_count");
  chk.expect(range == want_range, "packed_recv_layout_range");
  chk.expect(download<int32_t>(d_stats, EPR) == want_count, "cumulative_local_expert_recv_stats");
  for (int64_t cycles : download<int64_t>(d_wait, R)) chk.expect(cycles >= 0, "dispatch_wait_recv_cost_stats < 0");
  for (int e = 0; e < EPR; ++e) {
    if (count[e] != want_count[e]) continue;
    for (int row = 0; row < want_count[e]; ++row) {
      const Row& w = want_rows[e][row];
      const size_t at = static_cast<size_t>(e) * RM + row;
      const std::string where = "local expert " + std::to_string(e) + " row " + std::to_string(row) +
                                " (source rank " + std::to_string(w.s) + ", token " + std::to_string(w.t) + ")";
      chk.expect(src[at] == w.t, where + ": src_info " + std::to_string(src[at]));
      bool ok = true;
      for (int h = 0; h < H; ++h) ok &= recv_x[at * H + h] == x_bits(w.s, w.t, h);
      chk.expect(ok, where + ": packed_recv_x differs from the source row");
    }
  }
  chk.stage("BF16 dispatch", before, " (" + std::to_string(total_rows) + " rows)");

  // 2. FP8 dispatch as send, then receive with the half the send returned (DeepEP's hook), on
  // CUDA's default stream: it must be spelled default_stream(), as nullptr is the comm stream.
  before = chk.failures;
  const OutputMemory recv8(buffer.low_latency_dispatch_outputs(M, H, E, /*use_fp8=*/true));
  DeepepLowLatencyDispatchArgs fargs = args;
  fargs.dispatch_wait_recv_cost_stats = deepep::absent_tensor();
  fargs.packed_recv_x = recv8[0];
  // DeepEP's layout: logical [E_l, R*M, H/128], column-major in the last two dims (its strides say).
  fargs.packed_recv_x_scales = recv8[1];
  fargs.packed_recv_count = recv8[2];
  fargs.packed_recv_src_info = recv8[3];
  fargs.packed_recv_layout_range = recv8[4];
  fargs.use_fp8 = 1;
  const int64_t* scale_step = fargs.packed_recv_x_scales.strides;
  chk.expect(fargs.packed_recv_x.dtype == DEEPEP_DTYPE_FLOAT8_E4M3 && recv8.elems(0) == packed &&
                 fargs.packed_recv_x_scales.dtype == DEEPEP_DTYPE_FLOAT32 && fargs.packed_recv_x_scales.shape[2] == SCALES &&
                 recv8.elems(1) == static_cast<size_t>(EPR) * SCALES * RM,
             "low_latency_dispatch_outputs (FP8): unexpected geometry");
  const int half = buffer.low_latency_dispatch(fargs, deepep::default_stream(), deepep::LowLatencyPhases::send);
  buffer.low_latency_dispatch(fargs, deepep::default_stream(), deepep::LowLatencyPhases::receive, half);
  sync("low_latency_dispatch (FP8, send + receive)");
  const auto count8 = download<int32_t>(fargs.packed_recv_count, EPR);
  const auto q = download<uint8_t>(fargs.packed_recv_x, packed);
  const auto scales = download<float>(fargs.packed_recv_x_scales, recv8.elems(1));
  chk.expect(count8 == want_count, "FP8 packed_recv_count");
  chk.expect(download<int64_t>(fargs.packed_recv_layout_range, static_cast<size_t>(EPR) * R) == want_range,
             "FP8 packed_recv_layout_range");
  chk.expect(download<int32_t>(fargs.packed_recv_src_info, static_cast<size_t>(EPR) * RM) == src,
             "FP8 packed_recv_src_info");
  std::vector<int32_t> twice(EPR);
  for (int e = 0; e < EPR; ++e) twice[e] = 2 * want_count[e];
  chk.expect(download<int32_t>(d_stats, EPR) == twice, "cumulative_local_expert_recv_stats after 2 dispatches");
  float worst = 0.0f;  // largest |dequantized - x| as a fraction of the FP8 rounding bound
  for (int e = 0; e < EPR; ++e) {
    if (count8[e] != want_count[e]) continue;
    for (int row = 0; row < want_count[e]; ++row) {
      const Row& w = want_rows[e][row];
      const size_t at = static_cast<size_t>(e) * RM + row;
      for (int b = 0; b < SCALES; ++b) {
        float amax = 1e-4f;
        for (int h = b * 128; h < (b + 1) * 128; ++h) amax = std::fmax(amax, std::fabs(bf16_to_float(x_bits(w.s, w.t, h))));
        const float scale_inv = scales[static_cast<size_t>(e * scale_step[0] + row * scale_step[1] + b * scale_step[2])];
        const float want_scale = amax * (1.0f / 448.0f);
        const std::string where = "FP8 local expert " + std::to_string(e) + " row " + std::to_string(row) +
                                  " block " + std::to_string(b);
        chk.expect(std::fabs(scale_inv - want_scale) <= 1e-6f * want_scale,
                   where + ": scale " + std::to_string(scale_inv) + ", expected " + std::to_string(want_scale));
        int bad = 0;
        for (int h = b * 128; h < (b + 1) * 128; ++h) {
          const float want = bf16_to_float(x_bits(w.s, w.t, h));
          const float got = fp8_e4m3_to_float(q[at * H + h]) * scale_inv;
          // e4m3 rounding: half an ulp is 1/16 of the value (normals) or 2^-10 scaled units (subnormals).
          const float limit = std::fabs(want) * (1.0f / 16.0f) * 1.0001f + scale_inv * (1.0f / 1024.0f);
          const float err = std::fabs(got - want);
          bad += !(err <= limit);
          worst = std::fmax(worst, err / limit);
        }
        chk.expect(bad == 0, where + ": " + std::to_string(bad) + " dequantized values off by more than FP8 rounding");
      }
    }
  }
  chk.stage("FP8 dispatch (hook)", before, " (worst error " + std::to_string(worst) + " of the FP8 rounding bound)");

  // 3. Combine. The experts' outputs: y = bf16(received BF16 row * factor(expert)), packed as received.
  std::vector<uint16_t> y(packed, 0);
  for (int e = 0; e < EPR; ++e)
    for (int row = 0; row < count[e] && row < RM; ++row)
      for (int h = 0; h < H; ++h) {
        const size_t at = (static_cast<size_t>(e) * RM + row) * H + h;
        y[at] = float_to_bf16(bf16_to_float(recv_x[at]) * factor(rank * EPR + e));
      }
  DeviceMemory d_y(packed * 2);
  const OutputMemory combined(buffer.low_latency_combine_outputs(T, H));  // out: [T, H] BF16
  upload(d_y, y);
  // out[t] = sum over k of w * bf16(x[t] * factor(expert)), in fp32 (the kernel's fma chain).
  std::vector<float> want_out(static_cast<size_t>(T) * H), bound(static_cast<size_t>(T) * H);
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h) {
      float acc = 0.0f, abs_sum = 0.0f;
      for (int k = 0; k < K; ++k) {
        const int64_t e = route(rank, t, k);
        if (e < 0) continue;
        const float yk = bf16_to_float(float_to_bf16(bf16_to_float(x_bits(rank, t, h)) * factor(e)));
        acc = std::fma(yk, weight(rank, t, k), acc);
        abs_sum += std::fabs(yk * weight(rank, t, k));
      }
      want_out[static_cast<size_t>(t) * H + h] = acc;
      bound[static_cast<size_t>(t) * H + h] = 1e-2f * abs_sum;
    }

  DeepepLowLatencyCombineArgs cargs{};
  cargs.x = make_tensor(d_y.ptr, DEEPEP_DTYPE_BFLOAT16, {EPR, RM, H});
  cargs.topk_idx = args.topk_idx;
  cargs.topk_weights = make_tensor(d_weights.ptr, DEEPEP_DTYPE_FLOAT32, {T, K});
  cargs.src_info = args.packed_recv_src_info;  // the BF16 dispatch's handle
  cargs.layout_range = args.packed_recv_layout_range;
  cargs.combine_wait_recv_cost_stats = deepep::absent_tensor();
  cargs.out = combined[0];
  cargs.num_max_dispatch_tokens_per_rank = M;
  cargs.num_experts = E;

  auto check_combined = [&](const char* name, int failures_before) {
    const auto out = download<uint16_t>(cargs.out, static_cast<size_t>(T) * H);
    int bad = 0, exact = 0;
    for (size_t i = 0; i < out.size(); ++i) {
      const float got = bf16_to_float(out[i]);
      if (!(std::fabs(got - want_out[i]) <= bound[i] + 1e-6f)) {
        if (++bad <= 3)
          chk.expect(false, std::string(name) + ": out[" + std::to_string(i / H) + "][" + std::to_string(i % H) +
                                "] = " + std::to_string(got) + ", expected " + std::to_string(want_out[i]));
      }
      exact += out[i] == float_to_bf16(want_out[i]);
    }
    chk.expect(bad == 0, std::string(name) + ": " + std::to_string(bad) + " elements outside 1e-2 relative");
    chk.stage(name, failures_before,
              " (" + std::to_string(exact) + " of " + std::to_string(out.size()) + " bit-exact vs the fp32 fma chain)");
  };

  // 3a. One call, comm stream. out starts as NaN (0xffff) so an unwritten row shows.
  before = chk.failures;
  fill(cargs.out, 0xff, static_cast<size_t>(T) * H * 2);
  sync("cudaMemset out");
  buffer.low_latency_combine(cargs);
  sync("low_latency_combine");
  check_combined("combine", before);

  // 3b. Hook mode on our own stream: send now, receive when the hook runs.
  before = chk.failures;
  fill(cargs.out, 0xff, static_cast<size_t>(T) * H * 2);
  sync("cudaMemset out");
  {
    Stream stream;
    const deepep::LowLatencyHook hook = buffer.low_latency_combine_send(cargs, stream.s);
    hook();
    cuda_check(cudaStreamSynchronize(stream.s), "low_latency_combine (hook)");
  }
  check_combined("combine (hook)", before);

  // 3c. Zero-copy: y goes into the next call's combine view and args.x is zeroed, so the result
  // can only come from the view.
  before = chk.failures;
  const DeepepTensor view = buffer.get_next_low_latency_combine_buffer(M, H, E);
  const int64_t view_row = view.strides[1];  // the library's row pitch (rows are longer than H)
  chk.expect(view.dtype == DEEPEP_DTYPE_BFLOAT16 && view.ndim == 3 && view.shape[0] == EPR && view.shape[1] == RM &&
                 view.shape[2] == H && view_row >= H && view.strides[0] == RM * view_row && view.strides[2] == 1,
             "get_next_low_latency_combine_buffer view dtype, shape or strides");
  cuda_check(cudaMemcpy2D(view.data, static_cast<size_t>(view_row) * 2, d_y.ptr, static_cast<size_t>(H) * 2,
                          static_cast<size_t>(H) * 2, static_cast<size_t>(EPR) * RM, cudaMemcpyDeviceToDevice),
             "cudaMemcpy2D into the zero-copy view");
  fill(d_y, 0, packed * 2);
  fill(cargs.out, 0xff, static_cast<size_t>(T) * H * 2);
  sync("zero-copy setup");
  DeepepLowLatencyCombineArgs zargs = cargs;
  zargs.zero_copy = 1;
  buffer.low_latency_combine(zargs);
  sync("low_latency_combine (zero-copy)");
  check_combined("combine (zero-copy)", before);

  // 4. Shrink-mode masks (local, in stream order): none masked, mask the peer, clear all.
  before = chk.failures;
  DeviceMemory d_mask(R * 4);
  const DeepepTensor mask = make_tensor(d_mask.ptr, DEEPEP_DTYPE_INT32, {R});
  auto query_mask = [&] {
    buffer.low_latency_query_mask_buffer(mask);
    sync("low_latency_query_mask_buffer");
    return download<int32_t>(d_mask, R);
  };
  const int peer = 1 - rank;
  chk.expect(query_mask() == std::vector<int32_t>(R, 0), "mask before update: a rank was masked during the run");
  buffer.low_latency_update_mask_buffer(peer, true);
  std::vector<int32_t> want_mask(R, 0);
  want_mask[peer] = 1;
  chk.expect(query_mask() == want_mask, "mask after masking rank " + std::to_string(peer));
  buffer.low_latency_clean_mask_buffer();
  chk.expect(query_mask() == std::vector<int32_t>(R, 0), "mask after low_latency_clean_mask_buffer");
  chk.stage("shrink masks", before, "");

  buffer.destroy();  // collective
  std::printf("rank %d: %d mismatches\n", rank, chk.failures);
  return chk.failures == 0 ? 0 : 1;
}

}  // namespace

int main() {
  if (deepep::default_stream() != static_cast<void*>(cudaStreamLegacy)) {
    std::fprintf(stderr, "ll_two_gpu: deepep::default_stream() is not cudaStreamLegacy\n");
    return 1;
  }
  return example::run_ranks("ll_two_gpu", R, run_rank);
}
