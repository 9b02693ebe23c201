// Work items of the LL receive kernels: how the grid's warps take items (first_item, both
// receives), and the dispatch receive's items: every potential slot (source j, slot i < M) split
// into chunks of whole 32-word groups of the payload. Host and device, so that CPU tests check
// the mapping (tests/host/ll_work_items_test.cu).
#pragma once

namespace deepep {
namespace ll {

constexpr int kItemGroupWords = 32;  // 16-byte words per group: one per lane of a warp

// Groups a warp copies per load batch (8 16-byte words per lane in flight): the most a chunk holds.
constexpr int kItemMaxGroups = 8;

// Chunks per slot: every warp of the grid gets at most one item per slot round, and a chunk
// holds at least one group and at most kItemMaxGroups (one round trip of loads). Without that
// cap, many potential slots (R*M >= the grid's warps) made one chunk per slot, and a token's
// copy two dependent load batches on one warp: with T much smaller than M that was the whole
// receive (4 ranks, T=1, M=512: 6.5 us against 4.5 with M=256).
__host__ __device__ inline unsigned receive_chunks(int total_warps, unsigned potential, int payload_groups) {
  const unsigned per_slot = unsigned(total_warps) / potential;
  const unsigned chunks = per_slot < unsigned(payload_groups) ? per_slot : unsigned(payload_groups);
  const unsigned fewest = unsigned(payload_groups + kItemMaxGroups - 1) / unsigned(kItemMaxGroups);
  return chunks > fewest ? chunks : (fewest > 1u ? fewest : 1u);
}

// Where work item q < potential * chunks lies: source j, slot i, and its chunk's 16-byte words
// [v_begin, v_end) of the payload (whole groups). Items run chunk-major, then slot-major (i,
// then the source j): each chunk's filled slots (i < T of every source) are one run of items
// whatever M is.
struct ItemPlace {
  int j, i, v_begin, v_end;
  unsigned chunk;
};
__host__ __device__ __forceinline__ ItemPlace item_place(unsigned q, unsigned chunks, unsigned potential,
                                                         int num_sources, int payload_groups, int payload_vec) {
  const unsigned chunk = q / potential, base = q - chunk * potential;
  const unsigned i = base / unsigned(num_sources);
  ItemPlace it;
  it.i = int(i);
  it.j = int(base - i * unsigned(num_sources));
  it.chunk = chunk;
  it.v_begin = int(chunk * unsigned(payload_groups) / chunks) * kItemGroupWords;
  const int end = int((chunk + 1) * unsigned(payload_groups) / chunks) * kItemGroupWords;
  it.v_end = end < payload_vec ? end : payload_vec;
  return it;
}

// The first item of warp `warp` of block `block` in a grid of `grid` blocks; a warp's later
// items follow every grid * warps_per_block. Warp k of the blocks takes items [k*G, (k+1)*G),
// block b the one at k*G + b:
//   * every run of items spreads evenly over the blocks: with T < M the filled slots are one
//     run per chunk, which the earlier block-major order crowded onto a few blocks (4 ranks,
//     T=16, M=512: 12 us instead of 7);
//   * a block's warps take items G apart, across the chunks' runs: different slots and a mix of
//     chunks, so the scale and src_info stores of chunks 0 and 1 spread over the blocks.
__host__ __device__ __forceinline__ unsigned first_item(int block, int warp, int grid) {
  return unsigned(warp) * unsigned(grid) + unsigned(block);
}

}  // namespace ll
}  // namespace deepep
