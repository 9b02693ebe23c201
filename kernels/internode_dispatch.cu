// Internode dispatch data kernel (docs/internode.md, "Dispatch"). 2C blocks:
// * block c < C, the sender: a warp group per destination node n (with more nodes than groups,
//   a group takes nodes g, g + groups, ... in turn) walks channel c's tokens in
//   tiles and writes every token bound for node n into the scale-out ring (c, my node) of the
//   forwarder (n, my GPU), each warp every group-size-th row; after each tile the group syncs
//   and one thread publishes the tile's rows (tail += rows). Own-node tokens take the same ring
//   of this rank (LSA, local), except with one GPU per node (G == 1): then the group of this
//   rank's own node writes its tokens straight into the outputs (dispatch_own: what the
//   forwarder would write from that ring, with no ring, counter or wait), as intranode dispatch
//   does for its own rank.
// * block C + c: forwarder groups (one per source node s, or several in turn as the senders)
//   drain ring (c, s) in rounds; each row
//   goes to every local GPU in its mask with its sequence number in its (source rank, channel)
//   stream towards that GPU (send_nvl_head): straight into recv_x for this GPU, else into the
//   NVLink ring (c, my GPU) of that GPU. After each round the group returns its slots (one head
//   add). Receiver groups (one per other local GPU) drain this rank's NVLink rings into the
//   outputs at recv_gbl_channel_prefix_matrix[source][c] + sequence.
//
// No wait cycle when groups take nodes in turn. Name the scale-out ring of channel c from node
// s to forwarder rank (X, g) by (s, X). Its writer, a sender group of (s, g), reaches it after
// its rings (s, X') with X' < X are complete; its reader, a forwarder group of (X, g), after its
// rings (s', X) with s' < s; every rank takes its nodes in the same ascending order. Within one
// ring the writer waits only for the reader's credits and the reader only for the writer's
// rows (a chunk + a round <= ring + 1: both cannot hold out at once), and the NVLink leg never
// holds a forwarder for good (a receiver drains its ring in slot order, and a slot is taken only
// by a forwarder with its row in hand). By induction on s + X, every ring completes: the rings
// a ring waits behind have a smaller s + X. With G == 1 the rings (X, X) do not exist (no sender
// writes them, no forwarder group reads them: forwarder groups take the other nodes, ascending);
// dispatch_own waits for nothing, so the order of the remaining rings and the induction stand.
//
// Shrink mode (kShrink; docs/internode.md, "Shrink"): a sender skips a node whose forwarder is
// masked or gone (its tokens' destination ranks there counted as not sent); a forwarder skips
// local GPUs masked or gone (counted as not sent), and when its source goes silent leaves the
// source's remaining rows for this GPU empty (counted); it ends every source's stream towards
// each other local GPU with an end marker, from which that GPU's receiver empties the rows that
// never came (dispatch_receive_shrink); every wait expires into "gone".
#define DEEPEP_INTERNODE_OUTLINE 1  // Transport's slow paths out of line (internode_common.cuh)
#include "internode_common.cuh"
#include "launch.cuh"

namespace deepep {
namespace internode {

__device__ __forceinline__ int64_t load_topk(const void* topk, bool is_int32, int64_t i) {
  return is_int32 ? int64_t(static_cast<const int32_t*>(topk)[i]) : static_cast<const int64_t*>(topk)[i];
}
__device__ __forceinline__ void store_topk(void* topk, bool is_int32, int64_t i, int64_t v) {
  if (is_int32) static_cast<int32_t*>(topk)[i] = int32_t(v);
  else static_cast<int64_t*>(topk)[i] = v;
}

// G == 1, this rank's own node (its only GPU is this one): the channel's tokens for this rank,
// straight from the inputs into the outputs, exactly what dispatch_forward and write_recv_row
// would write from this rank's own scale-out ring (the ring is not used: its counters and
// running totals stay as they are on both sides, which are this rank). A token's place in the
// stream is its sequence number k among the channel's tokens for this rank (send_rdma_head),
// its send_nvl_head entry the same k (every row of the stream goes to GPU 0), its output row
// recv_gbl_channel_prefix_matrix[me][ch] + k. Member m of the group takes the rows with
// k % warps == m (no group barrier: nothing is published). The rows the forwarder would have
// taken are the first recv_rdma_channel_prefix_matrix's count of them (notify made it equal
// to the tokens sent); every index is bounded as there.
__device__ __forceinline__ void dispatch_own(const DeepepInternodeDispatchParams& p, int ch, const WarpGroup group,
                                             int lane) {
  const DeepepInternodeCommon& c = p.common;
  const int R = c.num_ranks, N = c.num_nodes, C = c.num_channels, me = c.rank;  // G == 1: node me
  const int K = p.num_topk, S = p.num_scales, epr = p.num_experts > 0 ? p.num_experts / R : 0;
  const int32_t* cpm = p.recv_rdma_channel_prefix_matrix + me * C;
  const int64_t first = ch > 0 ? cpm[ch - 1] : 0, count = cpm[ch] - first;
  const int64_t rdma_row0 = (me > 0 ? p.recv_rdma_rank_prefix_sum[me - 1] : 0) + first;
  const int64_t own_row0 = p.recv_gbl_channel_prefix_matrix[me * C + ch];
  int64_t begin, end;
  channel_range(p.num_tokens, C, ch, begin, end);
  int64_t k = 0;
  for (int64_t tile = begin, tile_idx = 0; tile < end; tile += kWarp, ++tile_idx) {
    const int64_t t_lane = tile + lane;
    const bool in = t_lane < end && p.is_token_in_rank[t_lane * R + me] != 0;
    const uint32_t mask = __ballot_sync(0xffffffffu, in);
    if (p.send_rdma_head != nullptr && t_lane < end && tile_idx % group.warps == group.member)
      p.send_rdma_head[t_lane * N + me] = in ? int32_t(k + __popc(mask & ((1u << lane) - 1u))) : -1;
    int i = 0;
    for (uint32_t rest = mask; rest; rest &= rest - 1, ++i) {
      const int64_t s = k + i;
      if (s % group.warps != group.member || s >= count) continue;
      const int64_t t = tile + __ffs(rest) - 1, rdma_row = rdma_row0 + s, out = own_row0 + s;
      if (p.send_nvl_head != nullptr && lane == 0 && uint64_t(rdma_row) < uint64_t(p.num_rdma_recv_rows))
        p.send_nvl_head[rdma_row] = int32_t(s);
      if (uint64_t(out) >= uint64_t(p.num_recv_rows)) continue;
      warp_copy<4, CopyLoad::kStream>(reinterpret_cast<int4*>(static_cast<uint8_t*>(p.recv_x) + out * p.hidden_bytes),
                                      reinterpret_cast<const int4*>(static_cast<const uint8_t*>(p.x) + t * p.hidden_bytes),
                                      p.hidden_bytes / 16, lane);
      if (p.recv_x_scales != nullptr)
        for (int j = lane; j < S; j += kWarp)
          static_cast<int32_t*>(p.recv_x_scales)[out * S + j] =
              static_cast<const int32_t*>(p.x_scales)[t * p.scale_stride_token + j * p.scale_stride_scale];
      if (p.recv_topk_idx != nullptr) {
        for (int j = lane; j < K; j += kWarp) {
          // As the ring carries them: ids as int32, weights 0.0 without topk_weights.
          const int64_t e = p.topk_idx != nullptr ? int64_t(int32_t(load_topk(p.topk_idx, p.topk_idx_is_int32, t * K + j))) : -1;
          const int64_t first_expert = int64_t(me) * epr;
          const int64_t local = (e >= first_expert && e < first_expert + epr) ? e - first_expert : -1;
          store_topk(p.recv_topk_idx, p.topk_idx_is_int32, out * K + j, local);
          if (p.recv_topk_weights != nullptr)
            p.recv_topk_weights[out * K + j] = local >= 0 && p.topk_weights != nullptr ? p.topk_weights[t * K + j] : 0.0f;
        }
      }
      // SourceMeta {source node (me), destination-GPU mask (GPU 0)}.
      if (p.recv_src_meta != nullptr && lane < 2) reinterpret_cast<int32_t*>(p.recv_src_meta + out * 8)[lane] = lane == 0 ? me : 1;
    }
    k += __popc(mask);
  }
}

// The roles take p and dc, the kernel's __grid_constant__ parameters, by reference (never
// copied); Transport's slow paths are out of line (DEEPEP_INTERNODE_OUTLINE).
template <int kRemote, bool kShrink>
__device__ __forceinline__ void dispatch_send(const DeepepInternodeDispatchParams& p, const ncclDevComm& dc, int ch,
                                           int node, const WarpGroup group, int lane) {
  const DeepepInternodeCommon& c = p.common;
  const Transport<kRemote> tr(c, dc);
  const int R = c.num_ranks, N = c.num_nodes, G = c.node_size, C = c.num_channels, me = c.rank;
  const int my_node = me / G, dst = node * G + me % G;
  if (G == 1 && node == my_node) return dispatch_own(p, ch, group, lane);
  const DispatchRow row{p.hidden_bytes, p.num_scales, p.num_topk};
  const RdmaLayout rdma{p.row_bytes, c.rdma_ring_tokens, N, C, R};
  const int K = p.num_topk, S = p.num_scales;
  // A tile's tokens bound for the node are a chunk of at most send_chunk rows.
  const int tile_tokens = send_chunk(c.rdma_ring_tokens);
  const uint64_t sent = c.totals[sent_total(c, ch, node)];
  uint64_t freed = 0;  // head counter, last read
  bool ok = true;      // false after a wait expired: the warp still meets its group's barriers
  int64_t begin, end;
  channel_range(p.num_tokens, C, ch, begin, end);
  int64_t k = 0;
  // Shrink mode: nothing goes to a masked forwarder; destination ranks of the rows this warp
  // did not send (its rows: every group-size-th).
  const bool live = !skipped_warp<kShrink>(c, dst);
  if (kShrink && !live) ok = false;
  int64_t not_sent = 0;
  for (int64_t tile = begin, tile_idx = 0; tile < end; tile += tile_tokens, ++tile_idx) {
    const int64_t t_lane = tile + lane;
    const bool valid = lane < tile_tokens && t_lane < end;
    uint32_t gpu_mask = 0;
    if (valid)
      for (int g = 0; g < G; ++g) gpu_mask |= uint32_t(p.is_token_in_rank[t_lane * R + node * G + g] != 0) << g;
    const uint32_t in = __ballot_sync(0xffffffffu, gpu_mask != 0);
    if (p.send_rdma_head != nullptr && valid && tile_idx % group.warps == group.member)
      p.send_rdma_head[t_lane * N + node] =
          gpu_mask != 0 && (!kShrink || live) ? int32_t(k + __popc(in & ((1u << lane) - 1u))) : -1;
    int i = 0;
    for (uint32_t rest = in; rest; rest &= rest - 1, ++i) {
      if (kShrink && !ok && i % group.warps == group.member)
        not_sent += __popc(__shfl_sync(0xffffffffu, gpu_mask, __ffs(rest) - 1));
      if (!ok || i % group.warps != group.member) continue;
      const int bit = __ffs(rest) - 1;
      const int64_t t = tile + bit, slot = k + i;
      const uint32_t mask = __shfl_sync(0xffffffffu, gpu_mask, bit);
      // Credits: slot `slot % ring` is free once the forwarder returned row slot - ring.
      if constexpr (kShrink) {
        if (slot >= c.rdma_ring_tokens &&
            !tr.wait_or_gone(dst, head_counter(c, ch, node), sent + slot + 1 - c.rdma_ring_tokens, freed)) {
          ok = false;
          not_sent += __popc(mask);
          continue;
        }
      } else if (slot >= c.rdma_ring_tokens &&
                 !tr.wait_counter(dst, head_counter(c, ch, node), sent + slot + 1 - c.rdma_ring_tokens, freed,
                                  DEEPEP_WAIT_OP_RDMA_HEAD, ch)) {
        ok = false;
        continue;
      }
      uint8_t* out = tr.row_target(dst, c.rdma_offset + rdma.recv_slot(ch, my_node, slot),
                                   c.rdma_offset + rdma.send_slot(ch, node, slot));
      if (lane == 0) {
        reinterpret_cast<int32_t*>(out)[0] = int32_t(t);
        reinterpret_cast<int32_t*>(out)[1] = int32_t(mask);
      }
      warp_copy<4, CopyLoad::kStream>(reinterpret_cast<int4*>(out + row.x_off()),
                                      reinterpret_cast<const int4*>(static_cast<const uint8_t*>(p.x) + t * p.hidden_bytes),
                                      p.hidden_bytes / 16, lane);
      for (int s = lane; s < S; s += kWarp)
        reinterpret_cast<int32_t*>(out + row.scales_off())[s] =
            static_cast<const int32_t*>(p.x_scales)[t * p.scale_stride_token + s * p.scale_stride_scale];
      if (p.topk_idx != nullptr) {
        for (int e = lane; e < K; e += kWarp) {
          reinterpret_cast<int32_t*>(out + row.topk_off())[e] = int32_t(load_topk(p.topk_idx, p.topk_idx_is_int32, t * K + e));
          reinterpret_cast<float*>(out + row.weights_off())[e] = p.topk_weights != nullptr ? p.topk_weights[t * K + e] : 0.0f;
        }
      }
    }
    group.sync();
    if (ok && group.leader(lane)) tr.publish(dst, rdma, ch, k, __popc(in), tail_counter(c, ch, my_node));
    k += __popc(in);
  }
  if (kShrink && lane == 0) count_dropped(c, DEEPEP_DROPPED_DISPATCH_SEND, not_sent);
  if (kShrink && !live) return;  // no ring: the totals with a masked peer stay as they were
  if (group.leader(lane)) {
    c.totals[sent_total(c, ch, node)] = sent + k;
    if (node != my_node) count_traffic(c, DEEPEP_TRAFFIC_DISPATCH_SCALEOUT_ROWS, k, p.row_bytes);
  }
}

// Shrink mode: output row `out` of source rank `src` left empty (its source went silent after
// notify): x and scales 0, top-k ids -1, weights 0, SourceMeta {its node, this GPU} (what a row
// of it here holds; combine never sends it back while src is masked).
__device__ __noinline__ void empty_recv_row(const DeepepInternodeDispatchParams& p, int64_t out, int src, int lane) {
  const DeepepInternodeCommon& c = p.common;
  int4* x = reinterpret_cast<int4*>(static_cast<uint8_t*>(p.recv_x) + out * p.hidden_bytes);
  for (int i = lane; i < p.hidden_bytes / 16; i += kWarp) x[i] = make_int4(0, 0, 0, 0);
  if (p.recv_x_scales != nullptr)
    for (int s = lane; s < p.num_scales; s += kWarp) static_cast<int32_t*>(p.recv_x_scales)[out * p.num_scales + s] = 0;
  if (p.recv_topk_idx != nullptr)
    for (int i = lane; i < p.num_topk; i += kWarp) {
      store_topk(p.recv_topk_idx, p.topk_idx_is_int32, out * p.num_topk + i, -1);
      if (p.recv_topk_weights != nullptr) p.recv_topk_weights[out * p.num_topk + i] = 0.0f;
    }
  if (p.recv_src_meta != nullptr && lane < 2)
    reinterpret_cast<int32_t*>(p.recv_src_meta + out * 8)[lane] = lane == 0 ? src / c.node_size : int32_t(1u << (c.rank % c.node_size));
}

// A dispatched row (`in`: DispatchRow without its x offset applied) of source rank `src` into
// output row `out` (bounds-checked by the caller).
__device__ void write_recv_row(const DeepepInternodeDispatchParams& p, int64_t out, const uint8_t* in, int src,
                               int lane) {
  const DeepepInternodeCommon& c = p.common;
  const DispatchRow row{p.hidden_bytes, p.num_scales, p.num_topk};
  const int K = p.num_topk, epr = p.num_experts > 0 ? p.num_experts / c.num_ranks : 0;
  warp_copy<4, CopyLoad::kCg>(reinterpret_cast<int4*>(static_cast<uint8_t*>(p.recv_x) + out * p.hidden_bytes),
                              reinterpret_cast<const int4*>(in + row.x_off()), p.hidden_bytes / 16, lane);
  if (p.recv_x_scales != nullptr)
    for (int s = lane; s < p.num_scales; s += kWarp)
      static_cast<int32_t*>(p.recv_x_scales)[out * p.num_scales + s] = reinterpret_cast<const int32_t*>(in + row.scales_off())[s];
  if (p.recv_topk_idx != nullptr) {
    for (int i = lane; i < K; i += kWarp) {
      const int64_t e = reinterpret_cast<const int32_t*>(in + row.topk_off())[i];
      const int64_t first = int64_t(c.rank) * epr;
      const int64_t local = (e >= first && e < first + epr) ? e - first : -1;
      store_topk(p.recv_topk_idx, p.topk_idx_is_int32, out * K + i, local);
      if (p.recv_topk_weights != nullptr)
        p.recv_topk_weights[out * K + i] = local >= 0 ? reinterpret_cast<const float*>(in + row.weights_off())[i] : 0.0f;
    }
  }
  // SourceMeta {int src_rdma_rank; int is_token_in_nvl_rank_bits}.
  if (p.recv_src_meta != nullptr && lane < 2)
    reinterpret_cast<int32_t*>(p.recv_src_meta + out * 8)[lane] = lane == 0 ? src / c.node_size : reinterpret_cast<const int32_t*>(in)[1];
}

// Forwarder group of source node `src_node`: its rows of channel ch, to the local GPUs in
// their masks. Every warp reads a round's masks (the sequence numbers); member m forwards the
// round's rows m, m + warps, ...
template <int kRemote, bool kShrink>
__device__ __forceinline__ void dispatch_forward(const DeepepInternodeDispatchParams& p, const ncclDevComm& dc, int ch,
                                              int src_node, const WarpGroup group, int lane, int* nvl_alloc,
                                              uint32_t generation) {
  const DeepepInternodeCommon& c = p.common;
  const Transport<kRemote> tr(c, dc);
  const int R = c.num_ranks, N = c.num_nodes, G = c.node_size, C = c.num_channels, me = c.rank;
  const int my_node = me / G, my_gpu = me % G, src = src_node * G + my_gpu;
  const RdmaLayout rdma{p.row_bytes, c.rdma_ring_tokens, N, C, R};
  const int64_t nvl_slot_bytes = kNvlHeaderBytes + p.row_bytes;
  const normal::RingLayout nvl = nvl_rings(c, nvl_slot_bytes);
  const int32_t* cpm = p.recv_rdma_channel_prefix_matrix + src_node * C;
  const int64_t first = ch > 0 ? cpm[ch - 1] : 0, count = cpm[ch] - first;
  const int64_t rdma_row0 = (src_node > 0 ? p.recv_rdma_rank_prefix_sum[src_node - 1] : 0) + first;
  const int64_t own_row0 = p.recv_gbl_channel_prefix_matrix[src * C + ch];
  const int round = min(kWarp, recv_round(c.rdma_ring_tokens));
  const uint64_t received = c.totals[recv_total(c, ch, src_node)];
  uint8_t* my_nvl = tr.local(c.nvl_offset);
  uint64_t tail = 0;  // tail counter, last read
  int64_t seq_base = 0;  // lane j < G: rows of earlier rounds towards GPU j
  bool ok = true;
  for (int64_t i0 = 0; i0 < count; i0 += round) {
    const int n = int(min(int64_t(round), count - i0));
    // Shrink mode: the group decides together whether the round came (one member's wait may
    // expire while another's sees the tail), so every member walks the same rows and member 0's
    // seq_base, which the end markers and the own-GPU emptying use, counts exactly the rows sent.
    if constexpr (kShrink) ok = group.all(ok && !skipped_warp<kShrink>(c, src) &&
                                          tr.wait_or_gone(src, tail_counter(c, ch, src_node), received + i0 + n, tail));
    else ok = ok && tr.wait_counter(src, tail_counter(c, ch, src_node), received + i0 + n, tail, DEEPEP_WAIT_OP_RDMA_TAIL, ch);
    const uint32_t lane_mask =
        ok && lane < n ? uint32_t(reinterpret_cast<const int32_t*>(tr.local(c.rdma_offset + rdma.recv_slot(ch, src_node, i0 + lane)))[1]) : 0u;
    uint32_t towards = 0;  // lane j < G: which of the round's rows go to GPU j
    for (int j = 0; j < G; ++j) {
      const uint32_t b = __ballot_sync(0xffffffffu, (lane_mask >> j) & 1u);
      if (lane == j) towards = b;
    }
    // Shrink mode: a warp whose source went silent still walks its rows, to mark them in
    // send_nvl_head as sent to no GPU (-1): combine's notify checks and rewrites every entry.
    for (int b = group.member; (kShrink || ok) && b < n; b += group.warps) {
      if (kShrink && !ok) {
        const int64_t gone_row = rdma_row0 + i0 + b;
        if (p.send_nvl_head != nullptr && lane < G && uint64_t(gone_row) < uint64_t(p.num_rdma_recv_rows))
          p.send_nvl_head[gone_row * G + lane] = -1;
        continue;
      }
      const uint8_t* in = tr.local(c.rdma_offset + rdma.recv_slot(ch, src_node, i0 + b));
      const uint32_t mask = __shfl_sync(0xffffffffu, lane_mask, b);
      const int64_t seq = seq_base + __popc(towards & ((1u << b) - 1u));  // lane j: towards GPU j
      const int64_t rdma_row = rdma_row0 + i0 + b;
      if (p.send_nvl_head != nullptr && lane < G && uint64_t(rdma_row) < uint64_t(p.num_rdma_recv_rows))
        p.send_nvl_head[rdma_row * G + lane] = (mask >> lane) & 1u ? int32_t(seq) : -1;
      // The row's GPUs, ascending (not unrolled: one copy of the NVLink path).
      for (uint32_t gpus = G < kWarp ? mask & ((1u << G) - 1u) : mask; gpus != 0; gpus &= gpus - 1) {
        const int j = __ffs(gpus) - 1;
        const int64_t s = __shfl_sync(0xffffffffu, seq, j);
        if (j == my_gpu) {
          if (uint64_t(own_row0 + s) < uint64_t(p.num_recv_rows)) write_recv_row(p, own_row0 + s, in, src, lane);
          continue;
        }
        if (kShrink && skipped_warp<kShrink>(c, my_node * G + j)) {  // a masked or gone local GPU: not sent
          if (lane == 0) count_dropped(c, DEEPEP_DROPPED_DISPATCH_SEND, 1);
          continue;
        }
        int k = 0;
        if (lane == 0) k = atomicAdd(&nvl_alloc[j], 1);
        k = __shfl_sync(0xffffffffu, k, 0);
        if (k >= nvl.ring) {
          const uint64_t* consumed = reinterpret_cast<const uint64_t*>(my_nvl + nvl.consumed_offset(C, ch, j, k % nvl.ring));
          if (!nvl_wait_relaxed<kShrink>(consumed, make_flag(generation, k - nvl.ring), c, my_node * G + j,
                                         DEEPEP_WAIT_OP_NVL_CONSUMED, ch)) {
            if (kShrink) {  // j is gone now: this row and its later ones are not sent to it
              if (lane == 0) count_dropped(c, DEEPEP_DROPPED_DISPATCH_SEND, 1);
              continue;
            }
            ok = false;
            break;
          }
        }
        uint8_t* slot = nvl_of(tr, j) + nvl.slot_offset(ch, my_gpu, k % nvl.ring);
        if (lane == 0) {
          reinterpret_cast<int32_t*>(slot)[2] = src;
          reinterpret_cast<int32_t*>(slot)[3] = int32_t(s);
        }
        warp_copy<4, CopyLoad::kCg>(reinterpret_cast<int4*>(slot + kNvlHeaderBytes), reinterpret_cast<const int4*>(in),
                                    int(p.row_bytes / 16), lane);
        __syncwarp();
        if (lane == 0) {
          fence_acq_rel_sys();
          st_relaxed_sys(reinterpret_cast<uint64_t*>(slot), make_flag(generation, k));
        }
      }
    }
    seq_base += __popc(towards);
    // The round's slots read: credits to the source.
    group.sync();
    if (ok && group.leader(lane)) tr.add(src, head_counter(c, ch, my_node), uint64_t(n));
  }
  if constexpr (kShrink) {
    // End of the source's stream towards every other local GPU j (live or silent source alike):
    // one NVLink slot, allocated as a row's, whose sequence word is -1 - (rows sent to j), lane
    // j's seq_base (a round's rows are forwarded only once the whole round came, so the rows with
    // seq < seq_base all went). Every member's slots of this source precede the marker in j's
    // ring: each round ends with group.sync(), so every member's atomicAdds on nvl_alloc[j] are
    // done before the first warp gets here. The receiver empties the rows that never came and
    // counts one slot for it (dispatch_receive_shrink). Every source gets a marker, not only a
    // silent one: the receiver then counts N markers from the start and its slot total only
    // falls (a marker of a source whose rows for j all came would otherwise raise the total
    // after a member had already stopped at it, and a row slot past it would go unread).
    if (group.member == 0)
      for (int j = 0; j < G; ++j) {
        if (j == my_gpu || skipped_warp<kShrink>(c, my_node * G + j)) continue;
        int k = 0;
        if (lane == 0) k = atomicAdd(&nvl_alloc[j], 1);
        k = __shfl_sync(0xffffffffu, k, 0);
        if (k >= nvl.ring) {
          const uint64_t* consumed = reinterpret_cast<const uint64_t*>(my_nvl + nvl.consumed_offset(C, ch, j, k % nvl.ring));
          if (!nvl_wait_relaxed<kShrink>(consumed, make_flag(generation, k - nvl.ring), c, my_node * G + j,
                                         DEEPEP_WAIT_OP_NVL_CONSUMED, ch))
            continue;  // j is gone now
        }
        const int64_t sent = __shfl_sync(0xffffffffu, seq_base, j);
        uint8_t* slot = nvl_of(tr, j) + nvl.slot_offset(ch, my_gpu, k % nvl.ring);
        if (lane == 0) {
          reinterpret_cast<int32_t*>(slot)[2] = src;
          reinterpret_cast<int32_t*>(slot)[3] = int32_t(-1 - sent);
          fence_acq_rel_sys();
          st_relaxed_sys(reinterpret_cast<uint64_t*>(slot), make_flag(generation, k));
        }
      }
    // The source went silent: its rows of this channel for this GPU that did not come are left
    // empty (lane my_gpu's seq_base: those that came), by the group's first warp.
    if (!ok && group.member == 0) {
      const int64_t came = __shfl_sync(0xffffffffu, seq_base, my_gpu);
      const int64_t stop = ch + 1 < C ? p.recv_gbl_channel_prefix_matrix[src * C + ch + 1] : p.recv_gbl_rank_prefix_sum[src];
      for (int64_t r = own_row0 + came; r < min(stop, p.num_recv_rows); ++r) empty_recv_row(p, r, src, lane);
      if (lane == 0) count_dropped(c, DEEPEP_DROPPED_DISPATCH_RECV, max(stop - own_row0 - came, int64_t(0)));
    }
    if (!ok) return;  // the totals with a gone peer stay as they were
  }
  if (group.leader(lane)) c.totals[recv_total(c, ch, src_node)] = received + count;
  // seq_base, lane j < G: the group's rows towards GPU j; other GPUs' took the NVLink leg.
  const int nvl_rows = __reduce_add_sync(0xffffffffu, lane < G && lane != my_gpu ? int(seq_base) : 0);
  if (group.leader(lane)) count_traffic(c, DEEPEP_TRAFFIC_DISPATCH_NVL_ROWS, nvl_rows, nvl_slot_bytes);
}

// A shrink-mode dispatch's arrival word value: the op epoch + 1 (window words start at 0). Every
// rank that runs each op has the same epoch; one that skipped an op lags.
__device__ __forceinline__ uint64_t arrival_of_this_op(const DeepepInternodeCommon& c) { return uint64_t(*c.op_epoch) + 1; }

// Whether a forwarder that sent nothing for `waited` ns is given up on (wait_slot_or_end): after
// one timeout if it never started this op (its arrival word, read only then, is not `arrival`),
// else after two.
__device__ __forceinline__ bool forwarder_silent_for(uint64_t waited, const DeepepInternodeCommon& c,
                                                     const uint64_t* peer_arrival, uint64_t arrival) {
  if (waited <= c.wait.timeout_ns) return false;
  return waited > 2 * c.wait.timeout_ns || ld_relaxed_sys(peer_arrival) != arrival;
}

// Shrink mode, receiver: slot k's wait, which also ends once the group's slot total (`total`,
// shared memory, lowered by end markers) is <= k (no slot k comes then). 1: the slot came
// (read with acquire); 0: no slot k; -1: the forwarder `peer` is gone (given up already, or its
// ring made no progress for one timeout while the forwarder's arrival word, `peer_arrival`, does
// not show this op (it never started it), or for twice the timeout when it does; marked gone as
// nvl_wait<true> does). Progress is a change of the total or of `taken`, the slots the group's
// members took (rows and markers alike: a marker with no row missing leaves the total as it is).
// Why twice the timeout covers a live forwarder: each of its waits on a source ends within one
// timeout (an expiry gives the source up, and its end marker, a slot here, follows at once), so
// between two slots of this ring at most one timeout passes at a live forwarder, however many
// silent sources a group takes in turn; the second covers the skew between this wait's start and
// the forwarder's. (Today a group takes several sources only when receiver groups have one warp,
// whose wait starts anew at each of its slots; `taken` keeps the bound for any split. Edge,
// G > 2: a forwarder's wait for the NVLink credits of another local GPU gone silent can add one
// timeout, once.) Once for a forwarder that never started: a receiver that waited twice would
// reach the next op a timeout after the other survivors, whose waits on it could then expire.
// Lane 0 polls; the answer is the warp's.
__device__ __noinline__ int wait_slot_or_end(const uint64_t* flag, uint64_t expected, const volatile int64_t* total,
                                             const volatile int64_t* taken, int64_t k, const DeepepInternodeCommon& c,
                                             int peer, const uint64_t* peer_arrival, uint64_t arrival) {
  int r = 1;
  if ((threadIdx.x & 31) == 0) {
    uint64_t start = global_time_ns();
    int64_t seen = *total, seen_taken = *taken;
    for (int spin = 1;; ++spin) {
      if (ld_relaxed_sys(flag) == expected) break;
      const int64_t now_total = *total, now_taken = *taken;
      if (now_total <= k) {
        r = 0;
        break;
      }
      if (now_total != seen || now_taken != seen_taken) {  // the ring moved: the forwarder is alive
        seen = now_total;
        seen_taken = now_taken;
        start = global_time_ns();
      }
      if (spin > 4) __nanosleep(128);
      if ((spin & 15) == 15 && (normal::buffer_failed(c.wait) || gone<true>(c, peer) ||
                                forwarder_silent_for(global_time_ns() - start, c, peer_arrival, arrival))) {
        if (!normal::buffer_failed(c.wait)) atomicExch(c.peer_gone + peer, 1);
        r = -1;
        break;
      }
    }
  }
  r = __shfl_sync(0xffffffffu, r, 0);
  if (r == 1) (void)ld_acquire_sys(flag);
  return r;
}

// Shrink mode, receiver group of local forwarder GPU `fwd` (dispatch_receive's roles). Its ring
// carries, besides the rows, one end marker per source node (dispatch_forward): the group's slot
// total starts at the rows expected (this rank's prefix matrices) plus N markers, and a marker
// of source S that sent `came` rows lowers it by the rows of S that will not come (emptied here,
// counted in DEEPEP_DROPPED_DISPATCH_RECV). The total only falls, to the slots that do come, so
// a member stops at k >= total for good. Only a slot that never comes (the forwarder itself
// gone) ends the group early: then every row of the group still holding the sentinel that was
// written before any slot was read is emptied and counted; a cached dispatch (no recv_src_meta,
// no sentinel) empties every row of the group and counts those its markers did not.
template <int kRemote>
__device__ __noinline__ void dispatch_receive_shrink(const DeepepInternodeDispatchParams& p, const ncclDevComm& dc, int ch,
                                                     int fwd, const WarpGroup group, int lane, uint32_t generation) {
  constexpr int32_t kUnwritten = -2;  // recv_src_meta word 0: never a node, never kPaddingMeta
  // Per receiver group (index fwd): the slot total, the slots taken (wait_slot_or_end's progress),
  // the rows the markers counted, whether a member gave the forwarder up, and the row slots taken
  // but not written (a source unknown or its row out of its range here; a diagnostic).
  __shared__ int64_t totals[kMaxNodeSize], taken[kMaxNodeSize], marked[kMaxNodeSize];
  __shared__ int gave_up[kMaxNodeSize], unplaced[kMaxNodeSize];
  const DeepepInternodeCommon& c = p.common;
  const Transport<kRemote> tr(c, dc);
  const int R = c.num_ranks, N = c.num_nodes, G = c.node_size, C = c.num_channels, me = c.rank;
  const int my_gpu = me % G, peer = (me / G) * G + fwd;
  const normal::RingLayout nvl = nvl_rings(c, kNvlHeaderBytes + p.row_bytes);
  const auto row_range = [&](int src, int64_t& start, int64_t& stop) {
    start = p.recv_gbl_channel_prefix_matrix[src * C + ch];
    stop = ch + 1 < C ? p.recv_gbl_channel_prefix_matrix[src * C + ch + 1] : p.recv_gbl_rank_prefix_sum[src];
  };
  int64_t count = 0;
  for (int s = 0; s < N; ++s) {
    int64_t start, stop;
    row_range(s * G + fwd, start, stop);
    count += max(stop - start, int64_t(0));
    if (p.recv_src_meta != nullptr)
      for (int64_t r = max(start, int64_t(0)) + group.member * kWarp + lane; r < min(stop, p.num_recv_rows);
           r += group.warps * kWarp)
        reinterpret_cast<int32_t*>(p.recv_src_meta + r * 8)[0] = kUnwritten;
  }
  // A forwarder masked here at the start sends this rank nothing it reads (notify left its
  // sources' rows absent): no markers are waited for.
  if (group.leader(lane)) {
    totals[fwd] = count + (masked<true>(c, peer) ? 0 : N);
    taken[fwd] = 0;
    marked[fwd] = 0;
    gave_up[fwd] = 0;
    unplaced[fwd] = 0;
  }
  group.sync();
  volatile int64_t* total = totals + fwd;
  const auto* peer_arrival = reinterpret_cast<const uint64_t*>(tr.lsa(c.control_offset + 8ull * arrival_word(c), peer));
  const uint64_t arrival = arrival_of_this_op(c);
  uint8_t* my_nvl = tr.local(c.nvl_offset);
  uint8_t* fwd_nvl = nvl_of(tr, fwd);
  for (int64_t k = group.member;; k += group.warps) {
    // The total, one answer per warp (another member may lower it between the lanes' reads).
    const int64_t t = __shfl_sync(0xffffffffu, lane == 0 ? *total : 0, 0);
    if (k >= t) break;
    const uint8_t* slot = my_nvl + nvl.slot_offset(ch, fwd, k % nvl.ring);
    const int w = wait_slot_or_end(reinterpret_cast<const uint64_t*>(slot), make_flag(generation, k), total,
                                   taken + fwd, k, c, peer, peer_arrival, arrival);
    if (w == 0) break;
    if (w < 0) {
      if (lane == 0) gave_up[fwd] = 1;
      break;
    }
    const int src = reinterpret_cast<const int32_t*>(slot)[2], seq = reinterpret_cast<const int32_t*>(slot)[3];
    const bool known = unsigned(src) < unsigned(R) && src % G == fwd;
    int64_t start = 0, stop = 0;
    if (known) row_range(src, start, stop);
    if (seq < 0) {
      // End marker: rows [start + came, stop) of src never come through fwd. Rows missing mean
      // src went silent (the forwarder's wait on it expired, or it is masked there): this rank
      // masks it too, so the mask names it on every survivor it sent rows to.
      const int64_t missing = known ? max(stop - start - (-1 - int64_t(seq)), int64_t(0)) : 0;
      for (int64_t r = max(stop - missing, int64_t(0)); r < min(stop, p.num_recv_rows); ++r) empty_recv_row(p, r, src, lane);
      if (lane == 0) {
        if (missing > 0 && !normal::buffer_failed(c.wait)) atomicExch(c.peer_gone + src, 1);
        count_dropped(c, DEEPEP_DROPPED_DISPATCH_RECV, missing);
        atomicAdd(reinterpret_cast<unsigned long long*>(marked + fwd), static_cast<unsigned long long>(missing));
        atomicAdd(reinterpret_cast<unsigned long long*>(const_cast<int64_t*>(total)),
                  static_cast<unsigned long long>(-missing));
      }
    } else if (known && start + seq < stop && uint64_t(start + seq) < uint64_t(p.num_recv_rows)) {
      // Masks are per rank: a row of a source absent here (at notify) may still come; its range
      // here is empty, so it is dropped, never written over another source's rows.
      write_recv_row(p, start + seq, slot + kNvlHeaderBytes, src, lane);
    } else if (lane == 0) {
      atomicAdd(unplaced + fwd, 1);
    }
    if (lane == 0) atomicAdd(reinterpret_cast<unsigned long long*>(taken + fwd), 1ull);
    normal::warp_release_slot(reinterpret_cast<uint64_t*>(fwd_nvl + nvl.consumed_offset(C, ch, my_gpu, k % nvl.ring)),
                              make_flag(generation, k), lane);
  }
  // The forwarder gone: every member is out of the loop (each wait is bounded) before the rows
  // are scanned.
  group.sync();
  if (p.recv_src_meta == nullptr) {
    // Cached (no sentinel): nothing tells which rows came, so once a member gave up (a slot never
    // came) every row of the group is emptied, also those that came (they could not be told from
    // stale ones), and counted, less the rows its markers counted already. A group that took
    // every slot has every row, written or emptied by a marker.
    if (!gave_up[fwd]) return;
    for (int s = 0; s < N; ++s) {
      int64_t start, stop;
      row_range(s * G + fwd, start, stop);
      for (int64_t r = max(start, int64_t(0)) + group.member; r < min(stop, p.num_recv_rows); r += group.warps)
        empty_recv_row(p, r, s * G + fwd, lane);
    }
    if (group.leader(lane)) count_dropped(c, DEEPEP_DROPPED_DISPATCH_RECV, count - marked[fwd]);
    return;
  }
  // The forwarder gone: rows still unwritten are emptied (the next combine's check_src_meta then
  // sees a valid SourceMeta, and the mask leaves them out). Otherwise every slot came and none may
  // be left unwritten: one that is (a protocol fault, not a silent peer) is recorded with the
  // group's tallies (DEEPEP_FAULT_SHRINK_UNWRITTEN; the first such row of the launch) and left as
  // it is, so the op fails here, naming it, rather than at the next combine's check.
  const bool forwarder_gone = gone<true>(c, peer);
  if (!forwarder_gone && normal::buffer_failed(c.wait)) return;  // the op fails as it is
  int64_t emptied = 0;
  for (int s = 0; s < N; ++s) {
    int64_t start, stop;
    row_range(s * G + fwd, start, stop);
    for (int64_t r = max(start, int64_t(0)) + group.member; r < min(stop, p.num_recv_rows); r += group.warps) {
      if (reinterpret_cast<const volatile int32_t*>(p.recv_src_meta + r * 8)[0] != kUnwritten) continue;
      if (!forwarder_gone) {
        if (lane == 0) {
          const auto field = [](int64_t v, int bits) { return min(max(v, int64_t(0)), (int64_t(1) << bits) - 1); };
          record_fault(c, DEEPEP_FAULT_SHRINK_UNWRITTEN, r,
                       field(s * G + fwd, 16) << 48 | field(ch, 16) << 32 | field(unplaced[fwd], 16) << 16 |
                           field(marked[fwd], 16),
                       field(taken[fwd], 32) << 32 | field(*total, 32));
        }
        continue;
      }
      empty_recv_row(p, r, s * G + fwd, lane);
      ++emptied;
    }
  }
  if (lane == 0) count_dropped(c, DEEPEP_DROPPED_DISPATCH_RECV, emptied);
}

// Receiver group of local forwarder GPU `fwd` (not this GPU): the rows of sources (s, fwd) for
// every node s, channel ch; member m takes slots m, m + warps, ... (shrink mode:
// dispatch_receive_shrink).
template <int kRemote, bool kShrink>
__device__ __forceinline__ void dispatch_receive(const DeepepInternodeDispatchParams& p, const ncclDevComm& dc, int ch,
                                              int fwd, const WarpGroup group, int lane, uint32_t generation) {
  if constexpr (kShrink) {
    dispatch_receive_shrink<kRemote>(p, dc, ch, fwd, group, lane, generation);
    return;
  }
  const DeepepInternodeCommon& c = p.common;
  const Transport<kRemote> tr(c, dc);
  const int R = c.num_ranks, N = c.num_nodes, G = c.node_size, C = c.num_channels, me = c.rank;
  const int my_gpu = me % G;
  const normal::RingLayout nvl = nvl_rings(c, kNvlHeaderBytes + p.row_bytes);
  int64_t count = 0;
  for (int s = 0; s < N; ++s) {
    const int src = s * G + fwd;
    const int64_t stop = ch + 1 < C ? p.recv_gbl_channel_prefix_matrix[src * C + ch + 1] : p.recv_gbl_rank_prefix_sum[src];
    count += max(stop - p.recv_gbl_channel_prefix_matrix[src * C + ch], int64_t(0));
  }
  uint8_t* my_nvl = tr.local(c.nvl_offset);
  uint8_t* fwd_nvl = nvl_of(tr, fwd);
  for (int64_t k = group.member; k < count; k += group.warps) {
    const uint8_t* slot = my_nvl + nvl.slot_offset(ch, fwd, k % nvl.ring);
    if (!nvl_wait<kShrink>(reinterpret_cast<const uint64_t*>(slot), make_flag(generation, k), c,
                           (me / G) * G + fwd, DEEPEP_WAIT_OP_NVL_SLOT, ch))
      return;
    const int src = reinterpret_cast<const int32_t*>(slot)[2], seq = reinterpret_cast<const int32_t*>(slot)[3];
    const int64_t out = unsigned(src) < unsigned(R) ? int64_t(p.recv_gbl_channel_prefix_matrix[src * C + ch]) + seq : -1;
    if (uint64_t(out) < uint64_t(p.num_recv_rows)) write_recv_row(p, out, slot + kNvlHeaderBytes, src, lane);
    normal::warp_release_slot(reinterpret_cast<uint64_t*>(fwd_nvl + nvl.consumed_offset(C, ch, my_gpu, k % nvl.ring)),
                              make_flag(generation, k), lane);
  }
}

template <int kRemote, bool kShrink>
__global__ void __launch_bounds__(kThreads, 1) internode_dispatch_kernel(
    const __grid_constant__ ncclDevComm dev_comm, const __grid_constant__ DeepepInternodeDispatchParams p) {
  const DeepepInternodeCommon& c = p.common;
  const int C = c.num_channels, N = c.num_nodes, G = c.node_size, my_gpu = c.rank % G;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  __shared__ int nvl_alloc[kMaxNodeSize];
  if (threadIdx.x < kMaxNodeSize) nvl_alloc[threadIdx.x] = 0;
  __syncthreads();
  const uint32_t generation = flag_generation(*c.op_epoch);
  if (kShrink && blockIdx.x == 0 && threadIdx.x == 0)  // this rank started the op (wait_slot_or_end)
    st_relaxed_sys(reinterpret_cast<uint64_t*>(c.local_base + c.control_offset + 8ull * arrival_word(c)),
                   arrival_of_this_op(c));
  if (!normal::buffer_failed(c.wait)) {
    if (int(blockIdx.x) < C) {
      const WarpGroup group(warp, N);
      if (group.role < group.groups)
        for (int node = group.role; node < N; node += group.groups) dispatch_send<kRemote, kShrink>(p, dev_comm, blockIdx.x, node, group, lane);
    } else {
      // Roles: F forwarders (all source nodes when the block has the warps, else each in turn),
      // then a receiver per other local GPU. With G == 1 this rank's own node has no ring
      // (dispatch_own): the forwarders take the other N - 1 nodes, ascending, with all the warps.
      const int own = G == 1 ? 1 : 0, nodes = N - own, my_node = c.rank / G;
      const int F = min(nodes, kWarps - (G - 1));
      const WarpGroup group(warp, F + G - 1);
      if (group.role < F) {
        for (int i = group.role; i < nodes; i += F)
          dispatch_forward<kRemote, kShrink>(p, dev_comm, blockIdx.x - C, own && i >= my_node ? i + 1 : i, group, lane, nvl_alloc,
                                              generation);
      } else if (group.role < F + G - 1) {
        const int r = group.role - F;
        dispatch_receive<kRemote, kShrink>(p, dev_comm, blockIdx.x - C, r < my_gpu ? r : r + 1, group, lane, generation);
      }
    }
  }
  // num_worst_tokens: rows past the received ones carry no expert, and their SourceMeta is the
  // padding mark combine stops at (kPaddingMeta).
  if (p.recv_topk_idx != nullptr) {
    const int R = c.num_ranks;
    const int64_t num_recv = min(max(int64_t(p.recv_gbl_rank_prefix_sum[R - 1]), int64_t(0)), p.num_recv_rows);
    const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, step = int64_t(gridDim.x) * blockDim.x;
    for (int64_t i = num_recv * p.num_topk + first; i < p.num_recv_rows * p.num_topk; i += step)
      store_topk(p.recv_topk_idx, p.topk_idx_is_int32, i, -1);
    if (p.recv_src_meta != nullptr)
      for (int64_t i = num_recv + first; i < p.num_recv_rows; i += step)
        reinterpret_cast<int2*>(p.recv_src_meta)[i] = make_int2(kPaddingMeta, 0);
  }
  if (normal::buffer_failed(c.wait)) {
    const int64_t n = p.num_recv_rows, k = p.num_topk;
    normal::poison_output(p.recv_x, n * p.hidden_bytes);
    normal::poison_output(p.recv_x_scales, n * p.num_scales * 4);
    normal::poison_output(p.recv_topk_idx, n * k * (p.topk_idx_is_int32 ? 4 : 8));
    normal::poison_output(p.recv_topk_weights, n * k * 4);
  }
  finish_op<kShrink>(c);
}

// The launcher's kernels, by [remote kind: emulated, GIN][shrink]. The GIN row is compiled in
// every build, as before; the launcher selects it only where DEEPEP_HAVE_GIN.
constexpr void (*kDispatchKernels[2][2])(ncclDevComm, DeepepInternodeDispatchParams) = {
    {internode_dispatch_kernel<ll::kRemoteEmulated, false>, internode_dispatch_kernel<ll::kRemoteEmulated, true>},
    {internode_dispatch_kernel<ll::kRemoteGin, false>, internode_dispatch_kernel<ll::kRemoteGin, true>},
};

}  // namespace internode

cudaError_t preload_internode_dispatch_kernels() { return load_kernels(internode::kDispatchKernels); }

}  // namespace deepep

extern "C" int deepep_launch_internode_dispatch(const void* dev_comm, const DeepepInternodeDispatchParams* params,
                                                int remote_kind, void* stream) {
  using namespace deepep::internode;
  const ncclDevComm& dc = *static_cast<const ncclDevComm*>(dev_comm);
  const auto s = static_cast<cudaStream_t>(stream);
  const int blocks = 2 * params->common.num_channels;
  const bool shrink = params->common.shrink != 0;
  const int by_remote = remote_kind == DEEPEP_LL_REMOTE_EMULATED ? 0
                        : remote_kind == DEEPEP_LL_REMOTE_GIN && DEEPEP_HAVE_GIN ? 1
                                                                               : -1;
  if (by_remote < 0) return int(cudaErrorInvalidValue);
  return deepep::launch_kernel(kDispatchKernels[by_remote][shrink ? 1 : 0], blocks, kThreads, 0, s, dc, *params);
}
