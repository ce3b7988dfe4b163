// Row dealing of the v2 kernels: plain integer code, shared by the kernels (device), the launchers
// (host) and a CPU test that simulates the staged pipeline (tests/unit/ops/test_ln_modulate_rows.py). No CUDA
// headers needed.
//
// Rows r = b * S + s of N = B * S are grouped in `segments` of seg_len consecutive rows (a sample
// when the backward reduces per-sample modulation gradients, else all rows). Segment seg has
// tiles_per_seg tiles; tile tau = seg * tiles_per_seg + j holds the rows
//     seg * seg_len + j + k * tiles_per_seg  (k = 0, 1, ...)  below min((seg + 1) * seg_len, N),
// interleaved, so the CTAs of a segment sweep through memory together. CTA c takes the tiles
// c, c + grid, c + 2 * grid, ... (grid <= num_tiles). With 1 <= tiles_per_seg <= seg_len every tile
// holds at least one row (the backward writes one partial row per tile, the finalize sums the
// tiles [seg * tiles_per_seg, (seg + 1) * tiles_per_seg) of each segment).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define LNM_HD __host__ __device__ __forceinline__
#else
#define LNM_HD inline
#endif

namespace ds_adaptive {
namespace ln_modulate {

// v2 kernels use 32-bit row indices: the host runs them only for N <= kMaxRowsV2.
constexpr int64_t kMaxRowsV2 = int64_t(1) << 30;

struct RowIter {
  int row = 0, end = 0, tile = 0;

  // First row of the first non-empty tile t, t + grid, ... (invalid when there is none).
  LNM_HD void start(int t, int grid, int N, int seg_len, int tps, int num_tiles) {
    for (; t < num_tiles; t += grid) {
      const int seg = (int)((unsigned)t / (unsigned)tps);
      const int s0 = seg * seg_len;
      tile = t;
      row = s0 + (t - seg * tps);
      end = (seg_len < N - s0) ? s0 + seg_len : N;
      if (row < end) return;
    }
    tile = num_tiles;
    row = end = 0;
  }
  LNM_HD bool valid() const { return row < end; }
  // Next row of this tile, else the first row of the CTA's next tile.
  LNM_HD void advance(int grid, int N, int seg_len, int tps, int num_tiles) {
    row += tps;  // row < N, tps <= N <= 2^30: no overflow
    if (row >= end) start(tile + grid, grid, N, seg_len, tps, num_tiles);
  }
};

// b = r / S, s = r % S (32-bit; r < 2^30).
LNM_HD void split_row(int r, int S, int& b, int& s) {
  b = (int)((unsigned)r / (unsigned)S);
  s = r - b * S;
}

struct Tiling {
  int64_t seg_len = 0, tiles_per_seg = 0, num_tiles = 0;
  int grid = 0;
};

// Forward v2. Per-sample modulation with B > 1: the resident CTAs are split evenly over the
// samples (a CTA stays in one sample, whose shift / scale rows stay in its L1) when that keeps
// >= 90% of them busy; otherwise, and for per-token modulation or B = 1, one segment of all rows
// dealt round-robin over the CTAs.
inline Tiling fwd_v2_tiling(int64_t B, int64_t S, bool per_token, int64_t resident) {
  Tiling t;
  const int64_t N = B * S;
  if (N <= 0 || resident <= 0) return t;
  t.seg_len = N;
  t.tiles_per_seg = N < resident ? N : resident;
  if (!per_token && B > 1) {
    const int64_t per = resident / B;
    if (per >= 1 && B * per * 10 >= resident * 9) {
      t.seg_len = S;
      t.tiles_per_seg = per < S ? per : S;
    }
  }
  t.num_tiles = (N / t.seg_len) * t.tiles_per_seg;
  t.grid = (int)(t.num_tiles < resident ? t.num_tiles : resident);
  return t;
}

// Backward v2: one segment per sample when the modulation gradients are reduced per sample (else
// one of all rows), resident / segments interleaved tiles per segment (at least 1, at most its
// rows). rows_per_tile (the longest tile) is informational.
inline Tiling bwd_v2_tiling(int64_t B, int64_t S, bool per_sample, int64_t resident, int64_t* rows_per_tile) {
  Tiling t;
  const int64_t N = B * S;
  if (N <= 0 || resident <= 0) return t;
  const int64_t segs = per_sample ? B : 1;
  t.seg_len = per_sample ? S : N;
  int64_t tps = resident / segs;
  if (tps < 1) tps = 1;
  if (tps > t.seg_len) tps = t.seg_len;
  t.tiles_per_seg = tps;
  t.num_tiles = segs * tps;
  t.grid = (int)(t.num_tiles < resident ? t.num_tiles : resident);
  if (rows_per_tile) *rows_per_tile = (t.seg_len + tps - 1) / tps;
  return t;
}

}  // namespace ln_modulate
}  // namespace ds_adaptive
