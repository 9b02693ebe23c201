// CPU test of the LL receives' work items (kernels/ll_work_items.cuh): for many shapes and
// grids, the dispatch items cover every (source, slot, chunk) exactly once, a slot's chunks tile
// its payload in whole 32-word groups, at most one load batch (kItemMaxGroups groups) each, the warps of a grid take every item exactly once
// (first_item, as both receives hand out items), a grid of 132 blocks gives each block's 16
// warps distinct slots and a mix of chunks at the benchmark shape, and when T < M the filled
// slots' items spread evenly over the blocks. Built and run by scripts/test.sh (no GPU).
#include <cstdio>
#include <vector>

#include "ll_work_items.cuh"

using deepep::ll::first_item;
using deepep::ll::item_place;
using deepep::ll::ItemPlace;
using deepep::ll::kItemGroupWords;
using deepep::ll::kItemMaxGroups;
using deepep::ll::receive_chunks;

static int failures = 0;

#define EXPECT(cond, ...)                                  \
  do {                                                     \
    if (!(cond)) {                                         \
      if (failures < 20) {                                 \
        std::printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
        std::printf(__VA_ARGS__);                          \
        std::printf("\n");                                 \
      }                                                    \
      ++failures;                                          \
    }                                                      \
  } while (0)

static constexpr int kWarpsPerBlock = 16;

// Calls f(block, q) for every item q < num_items that a grid of `grid` blocks hands out (each
// warp's first item, then every grid * kWarpsPerBlock), as the receive kernels loop.
template <typename F>
static void for_each_grid_item(int grid, unsigned num_items, F&& f) {
  for (int block = 0; block < grid; ++block)
    for (int warp = 0; warp < kWarpsPerBlock; ++warp)
      for (unsigned q = first_item(block, warp, grid); q < num_items; q += unsigned(grid * kWarpsPerBlock)) f(block, q);
}

static void check_shape(int R, int M, int H, bool fp8, int grid) {
  const int total_warps = grid * kWarpsPerBlock;
  const int payload_vec = fp8 ? H / 16 : H / 8;
  const int payload_groups = (payload_vec + kItemGroupWords - 1) / kItemGroupWords;
  const unsigned potential = unsigned(R) * unsigned(M);
  const unsigned chunks = receive_chunks(total_warps, potential, payload_groups);
  EXPECT(chunks >= 1 && chunks <= unsigned(payload_groups), "R=%d M=%d H=%d chunks=%u", R, M, H, chunks);
  // Fewer chunks than one round of the grid's warps needs only where a chunk would otherwise
  // exceed one load batch (kItemMaxGroups groups).
  const unsigned fewest = unsigned(payload_groups + kItemMaxGroups - 1) / kItemMaxGroups;
  if (potential <= unsigned(total_warps) && chunks > fewest)
    EXPECT(chunks * potential <= unsigned(total_warps), "R=%d M=%d H=%d: more items than warps", R, M, H);
  std::vector<int> seen(size_t(potential) * chunks, 0);
  std::vector<int> begin_of(seen.size(), -1), end_of(seen.size(), -1);
  for (unsigned w = 0; w < potential * chunks; ++w) {
    const ItemPlace it = item_place(w, chunks, potential, R, payload_groups, payload_vec);
    const bool in_range = it.j >= 0 && it.j < R && it.i >= 0 && it.i < M && it.chunk < chunks;
    EXPECT(in_range, "R=%d M=%d H=%d w=%u -> (%d, %d, %u)", R, M, H, w, it.j, it.i, it.chunk);
    if (!in_range) continue;
    const size_t key = (size_t(it.j) * M + it.i) * chunks + it.chunk;
    ++seen[key];
    begin_of[key] = it.v_begin;
    end_of[key] = it.v_end;
    EXPECT(it.v_begin % kItemGroupWords == 0 && it.v_begin < it.v_end && it.v_end <= payload_vec,
           "R=%d M=%d H=%d w=%u: words [%d, %d) of %d", R, M, H, w, it.v_begin, it.v_end, payload_vec);
    EXPECT(it.v_end - it.v_begin <= kItemMaxGroups * kItemGroupWords, "R=%d M=%d H=%d w=%u: chunk of %d words", R,
           M, H, w, it.v_end - it.v_begin);
  }
  for (size_t slot = 0; slot < potential; ++slot) {
    int expect_begin = 0;
    for (unsigned c = 0; c < chunks; ++c) {
      const size_t key = slot * chunks + c;
      EXPECT(seen[key] == 1, "R=%d M=%d H=%d slot %zu chunk %u taken %d times", R, M, H, slot, c, seen[key]);
      EXPECT(begin_of[key] == expect_begin, "R=%d M=%d H=%d slot %zu chunk %u begins at %d, not %d", R, M, H, slot,
             c, begin_of[key], expect_begin);
      expect_begin = end_of[key];
    }
    EXPECT(expect_begin == payload_vec, "R=%d M=%d H=%d slot %zu: chunks end at %d of %d", R, M, H, slot,
           expect_begin, payload_vec);
  }
  // The grid's warps (first item, then every total_warps) take each item exactly once.
  std::vector<int> taken(size_t(potential) * chunks, 0);
  for_each_grid_item(grid, potential * chunks, [&](int, unsigned q) { ++taken[q]; });
  for (size_t q = 0; q < taken.size(); ++q)
    EXPECT(taken[q] == 1, "R=%d M=%d H=%d grid %d: item %zu taken %d times", R, M, H, grid, q, taken[q]);
}

// T < M: the items of the filled slots (i < T at every source) are spread over the blocks: no
// block holds more than the even share of each chunk's run, rounded up.
static void check_spread(int R, int M, int T, int H, int grid) {
  const int payload_vec = H / 16, payload_groups = (payload_vec + kItemGroupWords - 1) / kItemGroupWords;
  const int total_warps = grid * kWarpsPerBlock;
  const unsigned potential = unsigned(R) * unsigned(M);
  const unsigned chunks = receive_chunks(total_warps, potential, payload_groups);
  std::vector<int> per_block(grid, 0);
  int filled = 0;
  for_each_grid_item(grid, potential * chunks, [&](int block, unsigned q) {
    if (item_place(q, chunks, potential, R, payload_groups, payload_vec).i < T) {
      ++per_block[block];
      ++filled;
    }
  });
  EXPECT(filled == int(unsigned(R * T) * chunks), "R=%d M=%d T=%d: %d filled items", R, M, T, filled);
  const int share = int(chunks) * ((R * T + grid - 1) / grid);
  for (int block = 0; block < grid; ++block)
    EXPECT(per_block[block] <= share, "R=%d M=%d T=%d grid %d: block %d holds %d filled items, even share %d", R, M,
           T, grid, block, per_block[block], share);
}

int main() {
  const int ranks[] = {1, 2, 3, 4, 8, 16, 32};
  const int tokens[] = {1, 2, 5, 16, 128, 1000, 1024};
  const int hiddens[] = {128, 512, 2048, 7168, 7296, 8192};
  const int grids[] = {1, 3, 132, 1024};  // blocks of 16 warps
  int shapes = 0;
  for (int R : ranks)
    for (int M : tokens)
      for (int H : hiddens)
        for (int fp8 = 0; fp8 < 2; ++fp8)
          for (int g : grids) {
            check_shape(R, M, H, fp8 != 0, g);
            ++shapes;
          }
  for (int R : {2, 4, 8})
    for (int M : {128, 256, 1024})
      for (int T : {1, 16, 64, 100})
        for (int g : {132, 78}) check_spread(R, M, T, 7168, g);
  // The benchmark shape (4 ranks, M = 128, FP8 H = 7168, 132 blocks): the 16 warps of a block
  // copy 16 different slots, so a block's stores are many slots' fan-outs, and hold every
  // chunk (chunks 0 and 1 carry the scales and src_info: one chunk per block would unbalance).
  {
    const int R = 4, M = 128, grid = 132, payload_vec = 7168 / 16, payload_groups = payload_vec / kItemGroupWords;
    const unsigned potential = R * M, chunks = receive_chunks(grid * kWarpsPerBlock, potential, payload_groups);
    for (int block = 0; block < grid; ++block) {
      std::vector<int> slots, chunk_seen(chunks, 0);
      for (int warp = 0; warp < kWarpsPerBlock; ++warp) {
        const unsigned q = first_item(block, warp, grid);
        if (q >= potential * chunks) continue;
        const ItemPlace it = item_place(q, chunks, potential, R, payload_groups, payload_vec);
        const int slot = it.j * M + it.i;
        for (int s : slots) EXPECT(s != slot, "block %d holds slot %d twice", block, slot);
        slots.push_back(slot);
        ++chunk_seen[it.chunk];
      }
      for (unsigned c = 0; c < chunks && slots.size() >= chunks; ++c)
        EXPECT(chunk_seen[c] > 0, "block %d holds no item of chunk %u", block, c);
    }
  }
  if (failures != 0) {
    std::printf("ll_work_items: %d failures over %d shapes\n", failures, shapes);
    return 1;
  }
  std::printf("ll_work_items: %d shapes ok\n", shapes);
  return 0;
}
