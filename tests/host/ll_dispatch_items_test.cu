// CPU test of the LL dispatch receive's work items (kernels/ll_dispatch_items.cuh): for many
// shapes and grids, the items cover every (source, slot, chunk) exactly once, a slot's chunks
// tile its payload in whole 32-word groups, and a grid of 132 blocks gives each block's 16
// warps distinct slots at the benchmark shape. Built and run by scripts/test.sh (no GPU).
#include <cstdio>
#include <vector>

#include "ll_dispatch_items.cuh"

using deepep::ll::item_place;
using deepep::ll::ItemPlace;
using deepep::ll::kItemGroupWords;
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

static void check_shape(int R, int M, int H, bool fp8, int total_warps) {
  const int payload_vec = fp8 ? H / 16 : H / 8;
  const int payload_groups = (payload_vec + kItemGroupWords - 1) / kItemGroupWords;
  const unsigned potential = unsigned(R) * unsigned(M);
  const unsigned chunks = receive_chunks(total_warps, potential, payload_groups);
  EXPECT(chunks >= 1 && chunks <= unsigned(payload_groups), "R=%d M=%d H=%d chunks=%u", R, M, H, chunks);
  if (potential <= unsigned(total_warps))
    EXPECT(chunks * potential <= unsigned(total_warps), "R=%d M=%d H=%d: more items than warps", R, M, H);
  std::vector<int> seen(size_t(potential) * chunks, 0);
  std::vector<int> begin_of(seen.size(), -1), end_of(seen.size(), -1);
  for (unsigned w = 0; w < potential * chunks; ++w) {
    const ItemPlace it = item_place(w, chunks, potential, M, payload_groups, payload_vec);
    const bool in_range = it.j >= 0 && it.j < R && it.i >= 0 && it.i < M && it.chunk < chunks;
    EXPECT(in_range, "R=%d M=%d H=%d w=%u -> (%d, %d, %u)", R, M, H, w, it.j, it.i, it.chunk);
    if (!in_range) continue;
    const size_t key = (size_t(it.j) * M + it.i) * chunks + it.chunk;
    ++seen[key];
    begin_of[key] = it.v_begin;
    end_of[key] = it.v_end;
    EXPECT(it.v_begin % kItemGroupWords == 0 && it.v_begin < it.v_end && it.v_end <= payload_vec,
           "R=%d M=%d H=%d w=%u: words [%d, %d) of %d", R, M, H, w, it.v_begin, it.v_end, payload_vec);
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
            check_shape(R, M, H, fp8 != 0, g * 16);
            ++shapes;
          }
  // The benchmark shape (4 ranks, M = 128, FP8 H = 7168, 132 blocks): the 16 warps of a block
  // copy 16 different slots, so a block's stores are many slots' fan-outs.
  {
    const int R = 4, M = 128, payload_vec = 7168 / 16, payload_groups = payload_vec / kItemGroupWords;
    const unsigned potential = R * M, chunks = receive_chunks(132 * 16, potential, payload_groups);
    for (unsigned block = 0; block * 16 < potential * chunks; ++block) {
      std::vector<int> slots;
      for (unsigned w = block * 16; w < block * 16 + 16 && w < potential * chunks; ++w) {
        const ItemPlace it = item_place(w, chunks, potential, M, payload_groups, payload_vec);
        const int slot = it.j * M + it.i;
        for (int s : slots) EXPECT(s != slot, "block %u holds slot %d twice", block, slot);
        slots.push_back(slot);
      }
    }
  }
  if (failures != 0) {
    std::printf("ll_dispatch_items: %d failures over %d shapes\n", failures, shapes);
    return 1;
  }
  std::printf("ll_dispatch_items: %d shapes ok\n", shapes);
  return 0;
}
