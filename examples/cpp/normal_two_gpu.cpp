// deepep-nccl from C++: normal-mode (intranode) dispatch and combine across 2 GPUs,
// driven by one process with one thread per GPU, checked against the host.
//
// Each rank sends T tokens of hidden H bf16 (every element = rank + 1) with top-2 of 8
// experts (4 per rank), routed deterministically so both ranks can compute what every
// rank receives. Checks: the layout, the receive count and per-expert list, rows grouped
// by source rank in ascending token order (values, src_idx, local top-k ids and weights),
// the rank prefix matrix, and combine: combined_x[t] = (ranks t went to) * (rank + 1).
// Exit codes: 0 ok, 1 failure, 2 no GPU/driver (a clean DEEPEP_ERROR_NO_DEVICE),
// 3 fewer than 2 GPUs.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "deepep_nccl.hpp"
#include "example_util.hpp"

namespace {

using namespace example;

constexpr int R = 2, T = 64, H = 256, K = 2, E = 8, EPR = E / R, NUM_SMS = 8;

// Expert of slot k of token t on rank s; -1 = none. Experts [4r, 4r + 4) live on rank r.
// Token 5 mod 16 goes nowhere, token 9 mod 16 has one expert; the rest have two distinct.
int64_t route(int s, int t, int k) {
  if (t % 16 == 5 || (t % 16 == 9 && k == 1)) return -1;
  return k == 0 ? (t + s) % E : (t + s + 3) % E;
}
// Exactly representable, distinct per (source rank, token mod 8, slot).
float weight(int s, int t, int k) { return static_cast<float>(8 + 16 * s + 2 * k + t % 8) / 8.0f; }
bool sends_to(int s, int t, int r) {
  for (int k = 0; k < K; ++k) {
    const int64_t e = route(s, t, k);
    if (e >= 0 && e / EPR == r) return true;
  }
  return false;
}
int ranks_of(int s, int t) {
  int n = 0;
  for (int r = 0; r < R; ++r) n += sends_to(s, t, r);
  return n;
}

int run_rank(int rank, const deepep::UniqueId& id) {
  cuda_check(cudaSetDevice(rank), "cudaSetDevice");
  cuda_check(cudaFree(nullptr), "cudaFree(0) (context init)");  // make the primary context current
  Checker chk{rank};

  const deepep::Config cfg(NUM_SMS, 6, 256, 6, 128);
  deepep::BufferOptions opts;
  opts.num_nvl_bytes = cfg.nvl_buffer_size_hint(H * 2, R);
  opts.explicitly_destroy = true;  // a failed rank must not block in the destructor's teardown
  deepep::Buffer buffer(rank, R, id, opts);  // collective: both threads are here at once
  buffer.set_gpu_timeout_ms(30000);          // fail well before a suite step's time limit
  chk.expect(buffer.local_device_id() == rank, "buffer device " + std::to_string(buffer.local_device_id()));

  // Inputs and the host's expectations.
  std::vector<uint16_t> x(static_cast<size_t>(T) * H, float_to_bf16(static_cast<float>(rank + 1)));
  std::vector<int64_t> topk(T * K);
  std::vector<float> weights(T * K);
  std::vector<int32_t> want_per_rank(R, 0), want_per_expert(E, 0);
  std::vector<uint8_t> want_in_rank(T * R, 0);
  for (int t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) {
      topk[t * K + k] = route(rank, t, k);
      weights[t * K + k] = weight(rank, t, k);
      if (topk[t * K + k] >= 0) ++want_per_expert[topk[t * K + k]];
    }
    for (int r = 0; r < R; ++r) {
      want_in_rank[t * R + r] = sends_to(rank, t, r);
      want_per_rank[r] += sends_to(rank, t, r);
    }
  }

  DeviceMemory d_x(x.size() * 2), d_topk(topk.size() * 8), d_weights(weights.size() * 4);
  upload(d_x, x);
  upload(d_topk, topk);
  upload(d_weights, weights);
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize after uploads");  // the ops run on the comm stream

  // Layout on the GPU (null stream: the buffer's comm stream, like every op below), into outputs
  // the library describes: per rank, per rdma rank (absent with 2 ranks), per expert, is_token_in_rank.
  using deepep::make_tensor;
  const DeepepTensor topk_idx = make_tensor(d_topk.ptr, DEEPEP_DTYPE_INT64, {T, K});
  const OutputMemory layout(buffer.dispatch_layout_outputs(T, E));
  buffer.get_dispatch_layout(topk_idx, E, layout.outputs);
  cuda_check(cudaDeviceSynchronize(), "get_dispatch_layout");
  chk.expect(download<int32_t>(layout[0]) == want_per_rank, "layout num_tokens_per_rank");
  chk.expect(download<int32_t>(layout[2]) == want_per_expert, "layout num_tokens_per_expert");
  chk.expect(download<uint8_t>(layout[3]) == want_in_rank, "layout is_token_in_rank");

  DeepepIntranodeDispatchArgs args{};  // every tensor absent (dtype 0)
  args.x = make_tensor(d_x.ptr, DEEPEP_DTYPE_BFLOAT16, {T, H});
  args.topk_idx = topk_idx;
  args.topk_weights = make_tensor(d_weights.ptr, DEEPEP_DTYPE_FLOAT32, {T, K});
  args.num_tokens_per_rank = layout[0];
  args.is_token_in_rank = layout[3];
  args.num_tokens_per_expert = layout[2];
  args.config = cfg.raw();
  args.cached = 0;
  args.expert_alignment = 1;
  args.num_worst_tokens = 0;
  // The handle's matrices (rank_prefix, channel_prefix, recv_channel_prefix, send_head), one allocation.
  const OutputMemory handle(buffer.intranode_dispatch_handle_outputs(args));
  args.rank_prefix_matrix = handle[0];
  args.channel_prefix_matrix = handle[1];
  args.recv_channel_prefix_matrix = handle[2];
  args.send_head = handle[3];

  // What this rank receives: from each source s, the tokens s sends here, in token order.
  std::vector<int> want_from(R, 0);
  std::vector<int32_t> want_recv_per_expert(EPR, 0);
  for (int s = 0; s < R; ++s)
    for (int t = 0; t < T; ++t) {
      want_from[s] += sends_to(s, t, rank);
      for (int k = 0; k < K; ++k) {
        const int64_t e = route(s, t, k);
        if (e >= 0 && e / EPR == rank) ++want_recv_per_expert[e % EPR];
      }
    }
  const int want_n = want_from[0] + want_from[1];

  std::vector<int> per_expert;
  const int n = buffer.intranode_dispatch_prepare(args, &per_expert);
  chk.expect(n == want_n, "num_recv_tokens " + std::to_string(n) + ", expected " + std::to_string(want_n));
  chk.expect(per_expert == std::vector<int>(want_recv_per_expert.begin(), want_recv_per_expert.end()),
             "num_recv_tokens_per_expert");
  if (n < 0) throw std::runtime_error("prepare returned no receive count");

  // N-row outputs: recv_x, recv_x_scales (absent: no FP8), recv_topk_idx, recv_topk_weights, recv_src_idx.
  const OutputMemory recv(buffer.intranode_dispatch_outputs(args, n));
  buffer.intranode_dispatch(args, recv.outputs);
  cuda_check(cudaDeviceSynchronize(), "intranode_dispatch");

  const auto recv_x = download<uint16_t>(recv[0]);
  const auto recv_topk = download<int64_t>(recv[2]);
  const auto recv_weights = download<float>(recv[3]);
  const auto recv_src = download<int32_t>(recv[4]);
  const auto rank_prefix = download<int32_t>(handle[0]);
  if (n == want_n) {
    int row = 0, cumulative = 0;
    for (int s = 0; s < R; ++s) {
      cumulative += want_from[s];
      chk.expect(rank_prefix[s * R + rank] == cumulative,
                 "rank_prefix_matrix[" + std::to_string(s) + "][" + std::to_string(rank) + "] = " +
                     std::to_string(rank_prefix[s * R + rank]) + ", expected " + std::to_string(cumulative));
      for (int t = 0; t < T; ++t) {
        if (!sends_to(s, t, rank)) continue;
        const std::string at = "row " + std::to_string(row) + " (source rank " + std::to_string(s) + ", token " +
                               std::to_string(t) + ")";
        chk.expect(recv_src[row] == t, at + ": recv_src_idx " + std::to_string(recv_src[row]));
        bool values_ok = true;
        for (int h = 0; h < H; ++h) values_ok &= bf16_to_float(recv_x[static_cast<size_t>(row) * H + h]) == static_cast<float>(s + 1);
        chk.expect(values_ok, at + ": recv_x is not " + std::to_string(s + 1));
        for (int k = 0; k < K; ++k) {
          const int64_t e = route(s, t, k);
          const int64_t local = (e >= 0 && e / EPR == rank) ? e % EPR : -1;
          chk.expect(recv_topk[row * K + k] == local, at + ": recv_topk_idx[" + std::to_string(k) + "] = " +
                                                          std::to_string(recv_topk[row * K + k]) + ", expected " +
                                                          std::to_string(local));
          chk.expect(recv_weights[row * K + k] == (local >= 0 ? weight(s, t, k) : 0.0f),
                     at + ": recv_topk_weights[" + std::to_string(k) + "]");
        }
        ++row;
      }
    }
  }

  // Combine the received rows back (with their top-k weights) using the dispatch handle.
  DeepepIntranodeCombineArgs cargs{};
  cargs.x = recv[0];
  cargs.topk_weights = recv[3];
  cargs.bias_0 = deepep::absent_tensor();
  cargs.bias_1 = deepep::absent_tensor();
  cargs.src_idx = recv[4];
  cargs.rank_prefix_matrix = args.rank_prefix_matrix;
  cargs.channel_prefix_matrix = args.recv_channel_prefix_matrix;  // the handle's receive-side matrix
  cargs.send_head = args.send_head;
  cargs.config = cfg.raw();
  const OutputMemory combined_out(buffer.intranode_combine_outputs(cargs));  // [T, H] bf16, [T, K] f32
  cargs.combined_x = combined_out[0];
  cargs.combined_topk_weights = combined_out[1];
  buffer.intranode_combine(cargs);
  cuda_check(cudaDeviceSynchronize(), "intranode_combine");

  const auto combined = download<uint16_t>(combined_out[0]);
  const auto combined_weights = download<float>(combined_out[1]);
  for (int t = 0; t < T; ++t) {
    const float want = static_cast<float>(ranks_of(rank, t) * (rank + 1));
    bool ok = true;
    for (int h = 0; h < H; ++h) ok &= bf16_to_float(combined[static_cast<size_t>(t) * H + h]) == want;
    chk.expect(ok, "combined_x[" + std::to_string(t) + "] is not " + std::to_string(want) + " (first element " +
                       std::to_string(bf16_to_float(combined[static_cast<size_t>(t) * H])) + ")");
    for (int k = 0; k < K; ++k) {  // each expert lives on exactly one rank: the weight comes back once
      const float w = route(rank, t, k) >= 0 ? weight(rank, t, k) : 0.0f;
      chk.expect(combined_weights[t * K + k] == w, "combined_topk_weights[" + std::to_string(t) + "][" +
                                                       std::to_string(k) + "] = " +
                                                       std::to_string(combined_weights[t * K + k]));
    }
  }

  buffer.destroy();  // collective
  std::printf("rank %d: received %d tokens (%d from rank 0, %d from rank 1), %d mismatches\n", rank, n,
              want_from[0], want_from[1], chk.failures);
  return chk.failures == 0 ? 0 : 1;
}

}  // namespace

int main() { return example::run_ranks("normal_two_gpu", R, run_rank); }
