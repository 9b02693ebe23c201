// Work items of the LL dispatch receive: every potential slot (source j, slot i < M) split
// into chunks of whole 32-word groups of the payload. Host and device, so that CPU tests check
// the mapping (tests/host/ll_dispatch_items_test.cu).
#pragma once

namespace deepep {
namespace ll {

constexpr int kItemGroupWords = 32;  // 16-byte words per group: one per lane of a warp

// Chunks per slot: every warp of the grid gets at most one item per slot round, and a chunk
// holds at least one group.
__host__ __device__ inline unsigned receive_chunks(int total_warps, unsigned potential, int payload_groups) {
  const unsigned per_slot = unsigned(total_warps) / potential;
  const unsigned chunks = per_slot < unsigned(payload_groups) ? per_slot : unsigned(payload_groups);
  return chunks > 1u ? chunks : 1u;
}

// Where work item w lies: source j, slot i, and its chunk's 16-byte words [v_begin, v_end) of
// the payload (whole groups).
struct ItemPlace {
  int j, i, v_begin, v_end;
  unsigned chunk;
};
__host__ __device__ __forceinline__ ItemPlace item_place(unsigned w, unsigned chunks, unsigned potential,
                                                         int max_tokens, int payload_groups, int payload_vec) {
  // Chunk c of the items takes the slots shifted by c * potential / chunks (a bijection per
  // chunk), so the warps of one block copy different slots: a block's stores are the sum of
  // many slots' fan-outs, not one slot's four chunks (balances the SMs' store traffic).
  const unsigned base = w / chunks, chunk = w - base * chunks;
  unsigned slot_idx = base + chunk * (potential / chunks);
  if (slot_idx >= potential) slot_idx -= potential;
  const unsigned j = slot_idx / unsigned(max_tokens);
  ItemPlace it;
  it.j = int(j);
  it.i = int(slot_idx - j * unsigned(max_tokens));
  it.chunk = chunk;
  it.v_begin = int(chunk * unsigned(payload_groups) / chunks) * kItemGroupWords;
  const int end = int((chunk + 1) * unsigned(payload_groups) / chunks) * kItemGroupWords;
  it.v_end = end < payload_vec ? end : payload_vec;
  return it;
}

}  // namespace ll
}  // namespace deepep
