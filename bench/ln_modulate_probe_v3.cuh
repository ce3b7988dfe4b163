// Benchmark-only forward kernel ("v3": a register pipeline of G-thread row groups), swept by
// bench/ln_modulate_probe.cu next to the op's v1 / v2 kernels (issue 18, H200). Not shipped: it
// did not beat v2 (H200, read flush, bf16 x, fp32 modulation, ms; bench/RESULTS.md issue 18):
//   1x32760x1536: v3 32x6 0.0612 vs v2 96x2 s3 0.0619 (copy of the same bytes 0.0516);
//   16x1560x1536: v3 32x6 0.0577 vs v2 0.0493; 8x4096x1152: v3 8-byte 32x9 0.0618 vs v1 0.0564;
//   bounding the registers (__launch_bounds__ min CTAs) spilled and ran 1.5-4x slower.
// Uses the op's helpers (to_f, load_vec, store_vec, Raw): include after ln_modulate_kernels.cuh.
//
// Idea: v1's software prefetch (PF) loaded the next row inside a branch and converted it to fp32 at
// once, so each thread stalled on its own prefetch before reducing the current row; v2 pays a
// shared-memory round trip per element and a CTA-wide barrier per reduction. v3:
//   * a row belongs to G = 8, 16 or 32 consecutive lanes of one warp (NV accesses of VEC elements
//     each per lane, D = G * NV * VEC exactly): the row reduction is shuffles only, no barrier,
//     no shared memory;
//   * each group keeps the next row's x in flight as raw 16-bit words (NV * VEC / 2 registers): the
//     loads are issued unconditionally at the top of an iteration (the row index clamped to a
//     valid row, so they are not inside a branch) and consumed one iteration later; mean,
//     variance and output re-convert the current row's raw words (bf16 / fp16 -> fp32 is exact),
//     so no fp32 copy of a row is held;
//   * 256-thread CTAs, persistent grid, rows dealt round-robin over all groups (row = group +
//     k * groups): all groups sweep memory together, and the per-sample shift / scale rows that a
//     CTA reads at one time belong to one or two samples (they stay in L1);
//   * loop trip counts are uniform per warp (a group past the last row still runs the shuffles,
//     with its stores masked), so the full-warp shuffles never diverge.
// Numerics are v1's: fp32 statistics, the variance from the centred values, rsqrtf, one FMA per
// element, one rounding; the summation order within a row differs (G lanes, not TPR threads).
#pragma once

namespace ds_adaptive {
namespace ln_modulate {

constexpr int kV3Threads = 256;

// Sum over the G consecutive lanes of a group (G a power of two <= 32); every lane of the group
// ends with the same bits.
template <int G>
__device__ __forceinline__ float group_allreduce(float v) {
#pragma unroll
  for (int o = G / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Element j of a raw access of VEC elements of T, as fp32 (exact for 16-bit T and fp32).
template <typename T, typename R>
__device__ __forceinline__ float raw_elem(const R& r, int j) {
  return to_f<T>(reinterpret_cast<const T*>(&r)[j]);
}

// G threads per row, NV accesses of VEC elements per thread (D == G * NV * VEC, no masks).
//   XCS: x loaded with the streaming (evict-first) hint, else through the read-only cache.
//   YCS: y stored with the streaming hint, else plain stores.
//   FENCE: the modulation of one access at a time (fewer registers, see below).
//   DIAG (diagnostics, not the op): 1 no modulation (y = xhat, no shift / scale loads), 2 no mean /
//        rstd stores, 3 x copied to y through the same registers and access pattern (no statistics).
//   MINB: CTAs per SM that the register allocation must allow (__launch_bounds__; 0: no bound).
template <typename T, typename M, int VEC, int NV, int G, bool XCS = true, bool YCS = false, int MINB = 0,
          bool FENCE = true, int DIAG = 0>
__global__ void __launch_bounds__(kV3Threads, MINB) ln_mod_fwd_v3_kernel(const FwdParams p) {
  static_assert(G == 8 || G == 16 || G == 32, "G: 8, 16 or 32 threads per row");
  constexpr int CB = VEC * (int)sizeof(T);
  static_assert(CB == 16 || CB == 8 || CB == 4, "an access is 4, 8 or 16 bytes");
  using R = typename Raw<CB>::type;
  constexpr int GPC = kV3Threads / G;  // row groups per CTA
  const int lane = (int)(threadIdx.x % G);
  const int64_t N = p.B * p.S;
  const int64_t groups = (int64_t)gridDim.x * GPC;
  const int64_t group = (int64_t)blockIdx.x * GPC + threadIdx.x / G;
  // first group of this warp: the warp-uniform loop bound
  const int64_t warp_group = (int64_t)blockIdx.x * GPC + (threadIdx.x / 32) * (32 / G);
  const float inv_d = 1.f / (float)(G * NV * VEC);

  auto load_raw = [&](int64_t r, R (&dst)[NV]) {
    const int64_t b = r / p.S, s = r - b * p.S;
    const R* xr = reinterpret_cast<const R*>(static_cast<const T*>(p.x) + b * p.x_sb + s * p.x_ss);
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      if constexpr (XCS) {
        dst[i] = __ldcs(xr + i * G + lane);
      } else {
        dst[i] = __ldg(xr + i * G + lane);
      }
    }
  };

  R cur[NV], nxt[NV];
  int64_t row = group;
  load_raw(row < N ? row : N - 1, cur);
  for (int64_t base = warp_group; base < N; base += groups, row += groups) {
    const int64_t next = row + groups;
    load_raw(next < N ? next : (row < N ? row : N - 1), nxt);  // in flight during this row

    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < NV; ++i)
#pragma unroll
      for (int j = 0; j < VEC; ++j) sum += raw_elem<T>(cur[i], j);
    const float mean = group_allreduce<G>(sum) * inv_d;
    float sq = 0.f;
#pragma unroll
    for (int i = 0; i < NV; ++i)
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float d = raw_elem<T>(cur[i], j) - mean;
        sq += d * d;
      }
    const float rstd = rsqrtf(group_allreduce<G>(sq) * inv_d + p.eps);

    if (DIAG == 3 && row < N) {
      R* yr = reinterpret_cast<R*>(static_cast<T*>(p.y) + row * (int64_t)(G * NV * VEC));
#pragma unroll
      for (int i = 0; i < NV; ++i) yr[i * G + lane] = cur[i];
    } else if (row < N) {
      const int64_t b = row / p.S, s = row - b * p.S;
      const M* shr = static_cast<const M*>(p.shift) + b * p.shift_sb + s * p.shift_ss;
      const M* scr = static_cast<const M*>(p.scale) + b * p.scale_sb + s * p.scale_ss;
      T* yr = static_cast<T*>(p.y) + row * (int64_t)(G * NV * VEC);
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int c = (i * G + lane) * VEC;  // first column of this access
        float sh[VEC], sc[VEC], out[VEC];
        if constexpr (DIAG == 1) {
#pragma unroll
          for (int j = 0; j < VEC; ++j) sh[j] = sc[j] = 0.f;
        } else {
          load_vec<VEC, M, false>(shr + c, sh);
          load_vec<VEC, M, false>(scr + c, sc);
        }
        if (p.weight != nullptr || p.bias != nullptr) {
          float w[VEC], bb[VEC];
          if (p.weight != nullptr) {
            load_vec<VEC, float, false>(p.weight + c, w);
          } else {
#pragma unroll
            for (int j = 0; j < VEC; ++j) w[j] = 1.f;
          }
          if (p.bias != nullptr) {
            load_vec<VEC, float, false>(p.bias + c, bb);
          } else {
#pragma unroll
            for (int j = 0; j < VEC; ++j) bb[j] = 0.f;
          }
#pragma unroll
          for (int j = 0; j < VEC; ++j)
            out[j] = fmaf(fmaf((raw_elem<T>(cur[i], j) - mean) * rstd, w[j], bb[j]), sc[j] + 1.f, sh[j]);
        } else {
#pragma unroll
          for (int j = 0; j < VEC; ++j) out[j] = fmaf((raw_elem<T>(cur[i], j) - mean) * rstd, sc[j] + 1.f, sh[j]);
        }
        store_vec<VEC, T, YCS>(yr + c, out);
        // one access group's shift / scale loads at a time (L1 hits): without this fence the
        // compiler issues all of a row's at once, 2 * NV * VEC registers (124 in place of ~80
        // registers at D = 1536, 32 x 6)
        if constexpr (FENCE) asm volatile("" ::: "memory");
      }
      if (DIAG != 2 && lane == 0) {
        p.mean[row] = mean;
        p.rstd[row] = rstd;
      }
    }
#pragma unroll
    for (int i = 0; i < NV; ++i) cur[i] = nxt[i];
  }
}

// Persistent grid of the v3 forward: resident CTAs, or (BALANCED) the fewest CTAs that give every
// row group the same number of rows as the resident grid would (rounds = ceil(rows / resident
// groups)), so that the last round is not a partial one.
inline int fwd_v3_grid(int64_t rows, int64_t resident_ctas, int groups_per_cta, bool balanced) {
  const int64_t res_groups = resident_ctas * groups_per_cta;
  if (!balanced || rows >= ((int64_t)1 << 40)) {
    const int64_t need = (rows + groups_per_cta - 1) / groups_per_cta;
    return (int)(need < resident_ctas ? need : resident_ctas);
  }
  const int64_t rounds = (rows + res_groups - 1) / res_groups;
  const int64_t groups = (rows + rounds - 1) / rounds;
  return (int)((groups + groups_per_cta - 1) / groups_per_cta);
}

}  // namespace ln_modulate
}  // namespace ds_adaptive
