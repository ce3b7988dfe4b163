// Kernel templates of the fused LayerNorm-Modulate op. Included by the per-dtype .cu files,
// which instantiate fwd_select / bwd_select for their (x, modulation) dtype pairs.
//
// Forward  (one pass): each row is held in registers, VEC elements per 16-byte load, NV loads
//   per thread in flight; mean and variance in fp32, two passes over the registers (no
//   E[x^2] - mean^2); y = fma(xhat [* w + b], 1 + scale, shift), rounded once to T.
// Backward (one pass over dy and x): dx per row, and column partials of sum dy (dshift) and
//   sum dy * ln (dscale) (per-sample modulation) and of sum dln * xhat / sum dln (affine weight /
//   bias) accumulated in registers over a tile of consecutive rows of one segment, written once
//   per tile, coalesced ("D-tile coalesced reduction"); a small finalize kernel sums the tiles.
//   No atomics: results are bitwise deterministic.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "ln_modulate.h"

namespace ds_adaptive {
namespace ln_modulate {

// ----------------------------------------------------------------------------------------------
// Element conversions and vector memory access
// ----------------------------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ float to_f(T v);
template <>
__device__ __forceinline__ float to_f<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_f<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <int BYTES>
struct Raw;
template <>
struct Raw<16> { using type = uint4; };
template <>
struct Raw<8> { using type = uint2; };
template <>
struct Raw<4> { using type = unsigned int; };
template <>
struct Raw<2> { using type = unsigned short; };

// Two floats -> the 4-byte pattern of two T (one cvt.rn.*x2 for 16-bit T).
template <typename T>
__device__ __forceinline__ unsigned int pack2(float a, float b);
template <>
__device__ __forceinline__ unsigned int pack2<__nv_bfloat16>(float a, float b) {
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<unsigned int*>(&h);
}
template <>
__device__ __forceinline__ unsigned int pack2<__half>(float a, float b) {
  __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<unsigned int*>(&h);
}

template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Load VEC consecutive U at p (aligned to min(16, VEC * sizeof(U)) bytes) into fp32.
// STREAM: evict-first (x, dy are read exactly once); otherwise through the read-only cache
// (modulation, weight: re-read by many rows).
template <int VEC, typename U, bool STREAM>
__device__ __forceinline__ void load_vec(const U* __restrict__ p, float (&out)[VEC]) {
  constexpr int BYTES = VEC * (int)sizeof(U);
  constexpr int CB = BYTES < 16 ? BYTES : 16;
  constexpr int NCH = BYTES / CB;
  constexpr int EPC = CB / (int)sizeof(U);
  using R = typename Raw<CB>::type;
#pragma unroll
  for (int k = 0; k < NCH; ++k) {
    const R* src = reinterpret_cast<const R*>(p) + k;
    R raw;
    if constexpr (STREAM) {
      raw = __ldcs(src);
    } else {
      raw = __ldg(src);
    }
    const U* e = reinterpret_cast<const U*>(&raw);
#pragma unroll
    for (int j = 0; j < EPC; ++j) out[k * EPC + j] = to_f<U>(e[j]);
  }
}

// Store VEC floats to VEC consecutive U at p, one rounding each.
template <int VEC, typename U, bool STREAM>
__device__ __forceinline__ void store_vec(U* __restrict__ p, const float (&in)[VEC]) {
  constexpr int BYTES = VEC * (int)sizeof(U);
  constexpr int CB = BYTES < 16 ? BYTES : 16;
  constexpr int NCH = BYTES / CB;
  constexpr int EPC = CB / (int)sizeof(U);
  using R = typename Raw<CB>::type;
#pragma unroll
  for (int k = 0; k < NCH; ++k) {
    R raw;
    if constexpr (sizeof(U) == 2 && EPC % 2 == 0) {
      unsigned int* w = reinterpret_cast<unsigned int*>(&raw);
#pragma unroll
      for (int j = 0; j < EPC / 2; ++j) w[j] = pack2<U>(in[k * EPC + 2 * j], in[k * EPC + 2 * j + 1]);
    } else {
      U* e = reinterpret_cast<U*>(&raw);
#pragma unroll
      for (int j = 0; j < EPC; ++j) e[j] = from_f<U>(in[k * EPC + j]);
    }
    R* dst = reinterpret_cast<R*>(p) + k;
    if constexpr (STREAM) {
      __stcs(dst, raw);
    } else {
      *dst = raw;
    }
  }
}

// ----------------------------------------------------------------------------------------------
// Row reductions. TPR == 32: a row is one warp (several rows per CTA, no barrier). TPR > 32: the
// CTA is one row; warp sums go through shared memory `red` (>= TPR / 32 floats per value).
// Butterfly shuffles leave the identical sum in every lane, so every thread of a row sees the
// same mean / rstd bit for bit.
// ----------------------------------------------------------------------------------------------
__device__ __forceinline__ float warp_allreduce(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <int TPR>
__device__ __forceinline__ float row_allreduce(float v, float* red) {
  v = warp_allreduce(v);
  if constexpr (TPR > 32) {
    constexpr int W = TPR / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < W ? red[lane] : 0.f;
    v = warp_allreduce(v);
  }
  return v;
}

template <int TPR>
__device__ __forceinline__ void row_allreduce2(float& a, float& b, float* red_a, float* red_b) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, o);
    b += __shfl_xor_sync(0xffffffffu, b, o);
  }
  if constexpr (TPR > 32) {
    constexpr int W = TPR / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
      red_a[warp] = a;
      red_b[warp] = b;
    }
    __syncthreads();
    a = lane < W ? red_a[lane] : 0.f;
    b = lane < W ? red_b[lane] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      a += __shfl_xor_sync(0xffffffffu, a, o);
      b += __shfl_xor_sync(0xffffffffu, b, o);
    }
  }
}

// Row statistics of the forward kernels (v1 and v2): mean, then the variance from the registers
// (never E[x^2] - mean^2): v is centred in place (v - mean; masked columns hold 0 and are skipped),
// rstd = rsqrt(var + eps). Every thread of the row returns the same bits.
template <int TPR, int NV, int VEC, bool EVEN>
__device__ __forceinline__ float2 row_mean_rstd(float (&v)[NV][VEC], int t, int nvec, float inv_d, float eps,
                                                float (&red)[2][32]) {
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i)
#pragma unroll
    for (int j = 0; j < VEC; ++j) sum += v[i][j];
  const float mean = row_allreduce<TPR>(sum, red[0]) * inv_d;
  float sq = 0.f;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int c = i * TPR + t;
    if (EVEN || c < nvec) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float d = v[i][j] - mean;
        v[i][j] = d;
        sq += d * d;
      }
    }
  }
  const float var = row_allreduce<TPR>(sq, red[1]) * inv_d;
  return make_float2(mean, rsqrtf(var + eps));
}

// shift / scale of one modulation row at this thread's columns (the forwards' MODC variants, which
// keep them in registers while consecutive rows share a sample); masked columns are left as they are.
template <int NV, int VEC, int TPR, bool EVEN, typename M>
__device__ __forceinline__ void load_thread_mod(const M* shr, const M* scr, int t, int nvec, float (&msh)[NV][VEC],
                                                float (&msc)[NV][VEC]) {
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int c = i * TPR + t;
    if (EVEN || c < nvec) {
      load_vec<VEC, M, false>(shr + (int64_t)c * VEC, msh[i]);
      load_vec<VEC, M, false>(scr + (int64_t)c * VEC, msc[i]);
    }
  }
}

// ----------------------------------------------------------------------------------------------
// Forward
//   VEC: elements per access (16 / sizeof(T), or 1 on the scalar path)
//   NV : accesses per thread per row; TPR: threads per row; ROWS: rows per CTA (TPR == 32 only)
//   EVEN: D == VEC * NV * TPR (no column masks)
//   PF : software prefetch: the next row's x is loaded before this row is reduced (2x bytes in
//        flight per thread, NV * VEC more registers)
//   MODC: per-sample shift / (1 + scale) stay in registers while consecutive rows share a sample
//   HOIST: the row's shift / scale are loaded before its reduction (in flight with x; costs
//        2 * NV * VEC registers), instead of after it
//   XCS: x is loaded with the streaming (evict-first) hint, else through the read-only cache
//   MODCS: (HOIST only) shift / scale are loaded with the streaming hint (per-token rows are read
//        once), else through the read-only cache (per-sample rows are re-read by every row)
// Persistent grid: CTA c takes rows c * ROWS + rg, c * ROWS + rg + gridDim.x * ROWS, ... (with
// MODC: the contiguous rows [c * chunk, (c + 1) * chunk), its ROWS row groups interleaved).
// Measured on H100 (bf16 x, fp32 modulation, bench/kernels/ln_modulate.py --tune): PF and MODC cost more
// (registers, occupancy) than they save, so the defaults use neither; they stay as tuning variants.
// ----------------------------------------------------------------------------------------------
template <typename T, typename M, int VEC, int NV, int TPR, int ROWS, bool EVEN, bool PF, bool MODC,
          bool HOIST = false, bool XCS = true, bool MODCS = false>
__global__ void __launch_bounds__(TPR* ROWS) ln_mod_fwd_kernel(const FwdParams p) {
  static_assert(!(HOIST && MODC), "HOIST and MODC are alternatives");
  static_assert(TPR % 32 == 0 && TPR <= 1024, "TPR: a multiple of 32, at most 1024");
  static_assert(ROWS == 1 || TPR == 32, "several rows per CTA only with one warp per row");
  __shared__ float red[2][32];
  const int t = (ROWS == 1) ? (int)threadIdx.x : (int)(threadIdx.x & 31);
  const int rg = (ROWS == 1) ? 0 : (int)(threadIdx.x >> 5);
  const int64_t N = p.B * p.S;
  const int D = p.D;
  const int nvec = D / VEC;
  const float inv_d = 1.f / (float)D;
  const bool has_w = p.weight != nullptr, has_b = p.bias != nullptr;
  const bool mod_per_row = p.shift_ss != 0 || p.scale_ss != 0;
  // MODC: contiguous chunk of rows per CTA (consecutive rows share a sample). Otherwise rows are
  // dealt round-robin, so that all CTAs sweep through memory together (measured ~5% faster on
  // H100 than chunks: better DRAM page locality).
  int64_t row, end, step;
  if constexpr (MODC) {
    const int64_t chunk = (N + gridDim.x - 1) / gridDim.x;
    row = (int64_t)blockIdx.x * chunk + rg;
    end = ((int64_t)blockIdx.x + 1) * chunk < N ? ((int64_t)blockIdx.x + 1) * chunk : N;
    step = ROWS;
  } else {
    row = (int64_t)blockIdx.x * ROWS + rg;
    end = N;
    step = (int64_t)gridDim.x * ROWS;
  }

  auto load_x = [&](int64_t r, float (&dst)[NV][VEC]) {
    const int64_t b = r / p.S, s = r - b * p.S;
    const T* xr = static_cast<const T*>(p.x) + b * p.x_sb + s * p.x_ss;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int c = i * TPR + t;
      if (EVEN || c < nvec) {
        load_vec<VEC, T, XCS>(xr + (int64_t)c * VEC, dst[i]);
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) dst[i][j] = 0.f;
      }
    }
  };

  float v[NV][VEC], vn[NV][VEC];
  float msh[NV][VEC], msc[NV][VEC];  // MODC: shift, 1 + scale of sample cached_b
  int64_t cached_b = -1;
  if (row < end) load_x(row, v);
  for (; row < end; row += step) {
    const int64_t next = row + step;
    if (PF && next < end) load_x(next, vn);  // in flight while this row is reduced
    const int64_t b = row / p.S, s = row - b * p.S;
    const M* shr = static_cast<const M*>(p.shift) + b * p.shift_sb + s * p.shift_ss;
    const M* scr = static_cast<const M*>(p.scale) + b * p.scale_sb + s * p.scale_ss;
    if constexpr (HOIST) {  // in flight while the row is reduced
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int c = i * TPR + t;
        if (EVEN || c < nvec) {
          load_vec<VEC, M, MODCS>(shr + (int64_t)c * VEC, msh[i]);
          load_vec<VEC, M, MODCS>(scr + (int64_t)c * VEC, msc[i]);
        }
      }
    }

    const float2 stats = row_mean_rstd<TPR, NV, VEC, EVEN>(v, t, nvec, inv_d, p.eps, red);
    const float mean = stats.x, rstd = stats.y;

    if constexpr (MODC) {
      if (mod_per_row || b != cached_b) {
        cached_b = b;
        load_thread_mod<NV, VEC, TPR, EVEN>(shr, scr, t, nvec, msh, msc);
#pragma unroll
        for (int i = 0; i < NV; ++i)
          if (EVEN || i * TPR + t < nvec)
#pragma unroll
            for (int j = 0; j < VEC; ++j) msc[i][j] += 1.f;
      }
    }

    T* yr = static_cast<T*>(p.y) + row * (int64_t)D;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int c = i * TPR + t;
      if (EVEN || c < nvec) {
        if constexpr (!MODC) {  // modulation loaded per access group (few registers live)
          if constexpr (!HOIST) {
            load_vec<VEC, M, false>(shr + (int64_t)c * VEC, msh[i]);
            load_vec<VEC, M, false>(scr + (int64_t)c * VEC, msc[i]);
          }
#pragma unroll
          for (int j = 0; j < VEC; ++j) msc[i][j] += 1.f;
        }
        float out[VEC];
        if (has_w || has_b) {
          float w[VEC], bb[VEC];
          if (has_w) {
            load_vec<VEC, float, false>(p.weight + c * VEC, w);
          } else {
#pragma unroll
            for (int j = 0; j < VEC; ++j) w[j] = 1.f;
          }
          if (has_b) {
            load_vec<VEC, float, false>(p.bias + c * VEC, bb);
          } else {
#pragma unroll
            for (int j = 0; j < VEC; ++j) bb[j] = 0.f;
          }
#pragma unroll
          for (int j = 0; j < VEC; ++j) out[j] = fmaf(fmaf(v[i][j] * rstd, w[j], bb[j]), msc[i][j], msh[i][j]);
        } else {
#pragma unroll
          for (int j = 0; j < VEC; ++j) out[j] = fmaf(v[i][j] * rstd, msc[i][j], msh[i][j]);
        }
        store_vec<VEC, T, false>(yr + (int64_t)c * VEC, out);
      }
    }
    if (t == 0) {
      p.mean[row] = mean;
      p.rstd[row] = rstd;
    }
    if constexpr (PF) {
#pragma unroll
      for (int i = 0; i < NV; ++i)
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[i][j] = vn[i][j];
    } else {
      if (next < end) load_x(next, v);
    }
  }
}

// ----------------------------------------------------------------------------------------------
// Backward. One CTA = one row (TPR threads); CTAs loop over tiles of consecutive rows of one
// segment (a sample when PER_SAMPLE). Per row, with ln = xhat [* w + b]:
//   dln = dy * (1 + scale);  g = dln [* w];  dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
//   PER_SAMPLE: acc += dy, dy * ln (columns)    else: dshift = dy, dscale = dy * ln (elementwise)
//   AFFINE:     acc += dln * xhat, dln          (columns)
// PER_SAMPLE keeps 1 + scale of the tile's sample in registers; PF prefetches the next row's dy
// and x before this row is reduced. STST: dx (and per-token dshift / dscale) are stored with the
// streaming (evict-first) hint, else with plain stores. LDCS: dy and x are loaded with the
// streaming hint, else through the read-only cache.
// ----------------------------------------------------------------------------------------------
template <typename T, typename M, int VEC, int NV, int TPR, bool EVEN, bool PER_SAMPLE, bool AFFINE, bool PF,
          bool STST = true, bool LDCS = true>
__global__ void __launch_bounds__(TPR) ln_mod_bwd_kernel(const BwdParams p) {
  static_assert(TPR % 32 == 0 && TPR <= 1024, "TPR: a multiple of 32, at most 1024");
  __shared__ float red[2][2][32];
  const int t = threadIdx.x;
  const int64_t N = p.B * p.S;
  const int D = p.D;
  const int nvec = D / VEC;
  const float inv_d = 1.f / (float)D;
  const bool has_b = p.bias != nullptr;
  const bool write_dshift = p.dshift_tok != nullptr;
  // Reduction buffer alternates per row across tiles too: consecutive rows never share one, so a
  // single barrier per row suffices (a thread can only overwrite buffer k after every thread has
  // passed the next row's barrier, i.e. finished reading buffer k).
  int buf = 0;

  auto load_rows = [&](int64_t r, float (&dy)[NV][VEC], float (&x)[NV][VEC]) {
    const int64_t b = r / p.S, s = r - b * p.S;
    const T* dyr = static_cast<const T*>(p.dy) + b * p.dy_sb + s * p.dy_ss;
    const T* xr = static_cast<const T*>(p.x) + b * p.x_sb + s * p.x_ss;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int c = i * TPR + t;
      if (EVEN || c < nvec) {
        load_vec<VEC, T, LDCS>(dyr + (int64_t)c * VEC, dy[i]);
        load_vec<VEC, T, LDCS>(xr + (int64_t)c * VEC, x[i]);
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) dy[i][j] = x[i][j] = 0.f;
      }
    }
  };

  for (int64_t tile = blockIdx.x; tile < p.num_tiles; tile += gridDim.x) {
    const int64_t seg = tile / p.tiles_per_seg;
    const int64_t seg_start = seg * p.seg_len;
    const int64_t seg_end = (seg_start + p.seg_len < N) ? seg_start + p.seg_len : N;
    const int64_t r0 = seg_start + (tile - seg * p.tiles_per_seg) * p.rows_per_tile;
    const int64_t r1 = (r0 + p.rows_per_tile < seg_end) ? r0 + p.rows_per_tile : seg_end;

    float acc_sh[NV][VEC], acc_sc[NV][VEC], acc_w[NV][VEC], acc_b[NV][VEC], opc[NV][VEC];
#pragma unroll
    for (int i = 0; i < NV; ++i)
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc_sh[i][j] = acc_sc[i][j] = acc_w[i][j] = acc_b[i][j] = 0.f;
    if constexpr (PER_SAMPLE) {  // the tile lies in one sample: 1 + scale[b] once per tile
      if (r0 < r1) {
        const M* scr = static_cast<const M*>(p.scale) + seg * p.scale_sb;
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          const int c = i * TPR + t;
          if (EVEN || c < nvec) {
            load_vec<VEC, M, false>(scr + (int64_t)c * VEC, opc[i]);
#pragma unroll
            for (int j = 0; j < VEC; ++j) opc[i][j] += 1.f;
          }
        }
      }
    }

    float dy[NV][VEC], xh[NV][VEC], dyn[NV][VEC], xn[NV][VEC];
    if (r0 < r1) load_rows(r0, dy, xh);
    for (int64_t row = r0; row < r1; ++row, buf ^= 1) {
      const int64_t next = row + 1;
      if (PF && next < r1) load_rows(next, dyn, xn);
      const int64_t b = row / p.S, s = row - b * p.S;
      const float mean = p.mean[row];
      const float rstd = p.rstd[row];
      const M* scr = static_cast<const M*>(p.scale) + b * p.scale_sb + s * p.scale_ss;

      float s1 = 0.f, s2 = 0.f;
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int c = i * TPR + t;
        if (EVEN || c < nvec) {
          float sc[VEC], w[VEC], bb[VEC], tok_sc[VEC];
          if constexpr (PER_SAMPLE) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) sc[j] = opc[i][j];
          } else {
            load_vec<VEC, M, false>(scr + (int64_t)c * VEC, sc);
#pragma unroll
            for (int j = 0; j < VEC; ++j) sc[j] += 1.f;
            if (write_dshift) {
              store_vec<VEC, M, STST>(static_cast<M*>(p.dshift_tok) + row * (int64_t)D + (int64_t)c * VEC, dy[i]);
            }
          }
          if constexpr (AFFINE) {
            load_vec<VEC, float, false>(p.weight + c * VEC, w);
            if (has_b) {
              load_vec<VEC, float, false>(p.bias + c * VEC, bb);
            } else {
#pragma unroll
              for (int j = 0; j < VEC; ++j) bb[j] = 0.f;
            }
          }
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const float xhat = (xh[i][j] - mean) * rstd;
            xh[i][j] = xhat;
            float ln = xhat;
            if constexpr (AFFINE) ln = fmaf(xhat, w[j], bb[j]);
            const float dln = dy[i][j] * sc[j];
            if constexpr (PER_SAMPLE) {
              acc_sh[i][j] += dy[i][j];
              acc_sc[i][j] = fmaf(dy[i][j], ln, acc_sc[i][j]);
            } else {
              tok_sc[j] = dy[i][j] * ln;
            }
            float g = dln;
            if constexpr (AFFINE) {
              acc_w[i][j] = fmaf(dln, xhat, acc_w[i][j]);
              acc_b[i][j] += dln;
              g = dln * w[j];
            }
            dy[i][j] = g;  // dy is dead from here on: keep g in its registers
            s1 += g;
            s2 = fmaf(g, xhat, s2);
          }
          if constexpr (!PER_SAMPLE) {
            store_vec<VEC, M, STST>(static_cast<M*>(p.dscale_tok) + row * (int64_t)D + (int64_t)c * VEC, tok_sc);
          }
        }
      }
      row_allreduce2<TPR>(s1, s2, red[buf][0], red[buf][1]);
      const float m1 = s1 * inv_d, m2 = s2 * inv_d;
      T* dxr = static_cast<T*>(p.dx) + row * (int64_t)D;
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int c = i * TPR + t;
        if (EVEN || c < nvec) {
          float o[VEC];
#pragma unroll
          for (int j = 0; j < VEC; ++j) o[j] = rstd * (dy[i][j] - fmaf(xh[i][j], m2, m1));
          store_vec<VEC, T, STST>(dxr + (int64_t)c * VEC, o);
        }
      }
      if constexpr (PF) {
#pragma unroll
        for (int i = 0; i < NV; ++i)
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            dy[i][j] = dyn[i][j];
            xh[i][j] = xn[i][j];
          }
      } else {
        if (next < r1) load_rows(next, dy, xh);
      }
    }

    if constexpr (PER_SAMPLE || AFFINE) {
      float* pt = p.partial + tile * (int64_t)p.nq * D;
      constexpr int q_aff = PER_SAMPLE ? 2 : 0;
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int c = i * TPR + t;
        if (EVEN || c < nvec) {
          if constexpr (PER_SAMPLE) {
            store_vec<VEC, float, false>(pt + 0 * D + c * VEC, acc_sh[i]);
            store_vec<VEC, float, false>(pt + 1 * D + c * VEC, acc_sc[i]);
          }
          if constexpr (AFFINE) {
            store_vec<VEC, float, false>(pt + (q_aff + 0) * D + c * VEC, acc_w[i]);
            store_vec<VEC, float, false>(pt + (q_aff + 1) * D + c * VEC, acc_b[i]);
          }
        }
      }
    }
  }
}

// ----------------------------------------------------------------------------------------------
// Second-generation kernels (staged cp.async pipelines, sample-aware row dealing)
// ----------------------------------------------------------------------------------------------
}  // namespace ln_modulate
}  // namespace ds_adaptive

#include "ln_modulate_v2.cuh"

namespace ds_adaptive {
namespace ln_modulate {

// ----------------------------------------------------------------------------------------------
// Kernel selection: specialisations for D in {1536, 3072, 5120}, generic masked paths otherwise.
// `gen` (1 = v1, 2 = v2) comes from the kernel policy (ln_modulate_set_policy); a v2 request falls
// back to v1 where no v2 configuration exists (scalar path, small or very large D).
// ----------------------------------------------------------------------------------------------
struct FwdChoice {
  void (*fn)(FwdParams) = nullptr;
  int threads = 0;
  int rows_per_cta = 1;
  int smem = 0;  // dynamic shared memory (bytes)
  int gen = 1;
  bool per_row_grid = false;  // v1: one CTA per row group (grid = rows), not a persistent grid
};
struct BwdChoice {
  void (*fn)(BwdParams) = nullptr;
  int threads = 0;
  int smem = 0;
  int gen = 1;
  bool per_row = false;  // v1 per-token without affine: one row per tile, one CTA per tile
};

template <typename T, typename M, int VEC, int NV, int TPR, int ROWS, bool EVEN, bool PF = false, bool MODC = false>
FwdChoice fwd_make() {
  return FwdChoice{&ln_mod_fwd_kernel<T, M, VEC, NV, TPR, ROWS, EVEN, PF, MODC>, TPR * ROWS, ROWS, 0, 1};
}

// v1 per-token forward (measured on H100, the kernel probe at c0c9b33): one CTA per row (grid =
// rows; the persistent grid was 2-3% slower), shift / scale loaded before the row reduction with
// the streaming hint (they are read once) when that costs at most 32 registers, x through the
// read-only cache.
template <typename T, typename M, int VEC, int NV, int TPR, bool EVEN>
FwdChoice fwd_make_tok() {
  constexpr bool HOIST = NV * VEC <= 16 && TPR < 1024;  // 1024 threads: 64 registers, HOIST would spill
  FwdChoice c{&ln_mod_fwd_kernel<T, M, VEC, NV, TPR, 1, EVEN, false, false, HOIST, false, HOIST>, TPR, 1, 0, 1};
  c.per_row_grid = true;
  return c;
}

template <typename T, typename M, int VEC, int NV, bool EVEN>
FwdChoice fwd_generic_tok(int nvec) {
  if (nvec <= 32 * NV) return fwd_make<T, M, VEC, NV, 32, 4, EVEN>();  // several rows per CTA
  if (nvec <= 64 * NV) return fwd_make_tok<T, M, VEC, NV, 64, EVEN>();
  if (nvec <= 128 * NV) return fwd_make_tok<T, M, VEC, NV, 128, EVEN>();
  if (nvec <= 256 * NV) return fwd_make_tok<T, M, VEC, NV, 256, EVEN>();
  if (nvec <= 512 * NV) return fwd_make_tok<T, M, VEC, NV, 512, EVEN>();
  if (nvec <= 1024 * NV) return fwd_make_tok<T, M, VEC, NV, 1024, EVEN>();
  return FwdChoice{};
}

// v1 per-token forward / backward of 16-bit x with fp32 modulation: 8-byte x accesses (VEC = 4), so
// that every warp access of the fp32 shift / scale (forward) or scale, dshift, dscale (backward)
// covers whole 32-byte sectors (16-byte x accesses make each warp instruction touch half of 32
// sectors); measured 0.311 vs 0.344 ms for the 1x32760x1536 backward on H100.
template <typename T, typename M>
constexpr bool tok_narrow() {
  return sizeof(T) == 2 && sizeof(M) == 4;
}

// v2 forward: ST_PS stages for per-sample modulation, ST_TOK for per-token (rows 5x larger with
// fp32 modulation of 16-bit x). MODC: per-sample shift / scale held in registers (see the kernel).
// XB: bytes per x access of the per-sample kernel (16, or 8 for D = 1152); per-token rows always 16.
template <typename T, typename M, int NV, int TPR, int ST_PS, int ST_TOK, bool EVEN, bool MODC = false, int XB = 16>
FwdChoice fwd_make_v2(const FwdParams& p) {
  if (p.shift_ss != 0 || p.scale_ss != 0) {
    if constexpr (XB != 16) {
      return FwdChoice{};  // per-token rows: 16-byte x accesses only (callers select XB = 8 per-sample only)
    } else {
      constexpr int smem = ST_TOK * fwd_v2_stage_bytes<T, M, NV, TPR, true>();
      return FwdChoice{&ln_mod_fwd_v2_kernel<T, M, NV, TPR, ST_TOK, EVEN, true>, TPR, 1, smem, 2};
    }
  }
  constexpr int smem = ST_PS * fwd_v2_stage_bytes<T, M, NV, TPR, false, XB>();
  return FwdChoice{&ln_mod_fwd_v2_kernel<T, M, NV, TPR, ST_PS, EVEN, false, MODC, false, XB>, TPR, 1, smem, 2};
}

template <typename T, typename M, int VEC, int NV, bool EVEN>
FwdChoice fwd_generic(int nvec) {
  if (nvec <= 32 * NV) return fwd_make<T, M, VEC, NV, 32, 4, EVEN>();
  if (nvec <= 64 * NV) return fwd_make<T, M, VEC, NV, 64, 1, EVEN>();
  if (nvec <= 128 * NV) return fwd_make<T, M, VEC, NV, 128, 1, EVEN>();
  if (nvec <= 256 * NV) return fwd_make<T, M, VEC, NV, 256, 1, EVEN>();
  if (nvec <= 512 * NV) return fwd_make<T, M, VEC, NV, 512, 1, EVEN>();
  if (nvec <= 1024 * NV) return fwd_make<T, M, VEC, NV, 1024, 1, EVEN>();
  return FwdChoice{};
}

// v2 on the generic vector path: the same TPR as v1 (NV = 4), only for 128..512 threads per row
// (D of 513..16384 for 16-bit x); smaller rows stay on v1's multi-row warps, larger on v1.
template <typename T, typename M, int NV>
FwdChoice fwd_generic_v2(const FwdParams& p, int nvec) {
  if (nvec <= 64 * NV) return FwdChoice{};
  if (nvec <= 128 * NV) return fwd_make_v2<T, M, NV, 128, 3, 2, false>(p);
  // Per-sample rows wider than 128 threads x NV vectors failed to launch on an H100 (D=8192 bf16,
  // "invalid argument", 2026-11-22) while per-token ones ran: keep them on v1 until measured. (Most
  // likely cause: 3 stages x 16 KB = exactly 48 KB of dynamic shared memory without the opt-in, fixed
  // in resident_ctas in issue 18; not re-tested on a GPU.)
  if (p.shift_ss == 0 && p.scale_ss == 0) return FwdChoice{};
  if (nvec <= 256 * NV) return fwd_make_v2<T, M, NV, 256, 3, 2, false>(p);
  if (nvec <= 512 * NV) return fwd_make_v2<T, M, NV, 512, 3, 2, false>(p);
  return FwdChoice{};
}

// Tuning alternatives (benchmark only) for x bf16 / modulation fp32, D in {1536, 5120}: a variant
// index other than 0 (set through ln_modulate_set_tuning) picks another configuration. Slots:
// v1: 0 fwd 1536, 1 fwd 5120, 2 bwd 1536, 3 bwd 5120; v2: 4 fwd 1536, 5 fwd 5120, 6 bwd 1536,
// 7 bwd 5120. Names in bench/kernels/ln_modulate.py (TUNE). Compiled in ln_modulate_tune.cu.
int tuning_variant(int slot);
FwdChoice fwd_tuned_bf16_f32(const FwdParams& p, int gen);
BwdChoice bwd_tuned_bf16_f32(const BwdParams& p, int gen);

template <typename T, typename M>
FwdChoice fwd_select(const FwdParams& p, int gen) {
  constexpr int V = 16 / (int)sizeof(T);
  if constexpr (std::is_same<T, __nv_bfloat16>::value && std::is_same<M, float>::value) {
    if (const FwdChoice c = fwd_tuned_bf16_f32(p, gen); c.fn != nullptr) return c;
  }
  if (!p.vectorized) return fwd_generic<T, M, 1, 8, false>(p.D);
  const bool tok = p.shift_ss != 0 || p.scale_ss != 0;
  if (tok && gen == 1) {
    if constexpr (tok_narrow<T, M>()) {
      switch (p.D) {
        case 1536: return fwd_make_tok<T, M, 4, 2, 192, true>();
        case 3072: return fwd_make_tok<T, M, 4, 2, 384, true>();
        case 5120: return fwd_make_tok<T, M, 4, 4, 320, true>();
        default: return fwd_generic_tok<T, M, 4, 4, false>(p.D / 4);
      }
    } else if constexpr (V == 8) {
      switch (p.D) {
        case 1536: return fwd_make_tok<T, M, 8, 2, 96, true>();
        case 3072: return fwd_make_tok<T, M, 8, 2, 192, true>();
        case 5120: return fwd_make_tok<T, M, 8, 5, 128, true>();
        default: return fwd_generic_tok<T, M, 8, 4, false>(p.D / 8);
      }
    } else {
      switch (p.D) {
        case 1536: return fwd_make_tok<T, M, 4, 2, 192, true>();
        case 3072: return fwd_make_tok<T, M, 4, 2, 384, true>();
        case 5120: return fwd_make_tok<T, M, 4, 5, 256, true>();
        default: return fwd_generic_tok<T, M, 4, 4, false>(p.D / 4);
      }
    }
  }
  if (gen == 2) {
    if constexpr (V == 8) {
      switch (p.D) {
        // s3: 0.0555 vs s4 0.0560 ms (16x1560, H100). Per-sample shift / scale in registers (MODC; H200,
        // the kernel probe at c0c9b33, read flush): 0.0584 vs 0.0620 ms at 1x32760, 0.0446 vs 0.0496 at
        // 16x1560 (reading them from L1 for every row was most of the gap to a copy: without any
        // modulation the same kernel shape ran 0.0542 / 0.0417)
        // Issue 18, fourth round: per-sample rows on one warp each (32x6: 6 vectors per lane, the row
        // reductions shuffles only, no CTA barrier), shift / scale in registers, 4 stages. H200 probe (read
        // flush, ms): 1x32760 0.0539 vs 0.0589 for 96x2 s3 MODC (1.136x vs 1.241x of the floor), 16x1560
        // 0.0424 vs 0.0449 (1.170x vs 1.239x); 211 registers, 9 warps per SM. Per-token rows keep 96x2
        // (their stages hold the modulation too: 32x6 would need 15 KB per stage and warp).
        case 1536:
          if (p.shift_ss == 0 && p.scale_ss == 0) return fwd_make_v2<T, M, 6, 32, 4, 2, true, true>(p);
          return fwd_make_v2<T, M, 2, 96, 3, 2, true>(p);
        // H200 (the kernel probe, git show c0c9b33:bench/ln_modulate_probe.cu, read flush, ms): 8x4096x2304 96x3 0.0929 (v1 0.0914);
        // 8x4096x3072 96x4 0.1164 vs 192x2 s4 > 0.122; 4x4096x4096 128x4 0.0811 vs 256x2 0.0886.
        // Issue 18, fourth round: per-sample rows with the modulation in registers (MODC), one warp per row at
        // 2304 (32x9 s3: 0.0799 vs 0.0936 for 96x3 s3, 1.117x of the floor; 4x1024x2304 0.0142 vs 0.0183), two
        // at 3072 (64x6 s4: 0.1075 vs 0.1177, 1.127x), 128x4 s3 at 4096 (0.0750 vs 0.0808, 1.179x; 64x8 0.0741
        // needs all 255 registers). Per-token rows keep the shapes above.
        case 2304:
          if (p.shift_ss == 0 && p.scale_ss == 0) return fwd_make_v2<T, M, 9, 32, 3, 2, true, true>(p);
          return fwd_make_v2<T, M, 3, 96, 3, 2, true>(p);
        case 3072:
          if (p.shift_ss == 0 && p.scale_ss == 0) return fwd_make_v2<T, M, 6, 64, 4, 2, true, true>(p);
          return fwd_make_v2<T, M, 4, 96, 3, 2, true>(p);
        case 4096: return fwd_make_v2<T, M, 4, 128, 3, 2, true, true>(p);
        case 5120: return fwd_make_v2<T, M, 5, 128, 3, 2, true>(p);
        // D = 1152 (D / 8 = 144 vectors, no multiple of 32), per-sample: one warp per row with 8-byte x
        // accesses, 9 per lane (no masks), shift / scale in registers, 3 stages. H200 probe (8x4096x1152,
        // read flush, ms): 0.0415 (1.159x of the floor) vs 0.0439 for 16-byte accesses, 5 per lane with
        // the last half of the lanes masked (the third round's kernel), and 0.0569 for the v1 4-byte 96x6
        // below (docs/RESULTS.md; the probe at c0c9b33). Per-token rows keep the generic path.
        case 1152:
          if (p.shift_ss == 0 && p.scale_ss == 0) return fwd_make_v2<T, M, 9, 32, 3, 2, true, true, 8>(p);
          break;
        default: break;
      }
    } else {
      switch (p.D) {
        case 1536: return fwd_make_v2<T, M, 2, 192, 4, 2, true>(p);
        case 3072: return fwd_make_v2<T, M, 2, 384, 3, 2, true>(p);
        case 5120: return fwd_make_v2<T, M, 5, 256, 3, 2, true>(p);
        default: break;
      }
    }
    if (const FwdChoice c = fwd_generic_v2<T, M, 4>(p, p.D / V); c.fn != nullptr) return c;
  }
  FwdChoice c;
  if constexpr (V == 8) {
    switch (p.D) {
      // D = 1152: D / 8 = 144 is no multiple of 32, so narrower x accesses, unmasked: 4-byte (VEC 2)
      // 96x6 (H200, 8x4096x1152, read flush: 0.0564 / 0.0566 ms in two runs vs 0.0580 for 8-byte
      // 96x3 and ~0.07 for the generic masked 64x4 kernel)
      case 1152: c = fwd_make<T, M, 2, 6, 96, 1, true>(); break;
      case 1536: c = fwd_make<T, M, 8, 2, 96, 1, true>(); break;
      case 2304: c = fwd_make<T, M, 8, 3, 96, 1, true>(); break;
      case 3072: c = fwd_make<T, M, 8, 3, 128, 1, true>(); break;  // H200: 128x3 0.0154 vs 192x2 0.0168 (2x1536)
      case 4096: c = fwd_make<T, M, 8, 4, 128, 1, true>(); break;
      case 5120: c = fwd_make<T, M, 8, 5, 128, 1, true>(); break;
      default: c = fwd_generic<T, M, V, 4, false>(p.D / V); break;
    }
  } else {
    switch (p.D) {
      case 1536: c = fwd_make<T, M, 4, 2, 192, 1, true>(); break;
      case 3072: c = fwd_make<T, M, 4, 2, 384, 1, true>(); break;
      case 5120: c = fwd_make<T, M, 4, 5, 256, 1, true>(); break;
      default: c = fwd_generic<T, M, V, 4, false>(p.D / V); break;
    }
  }
  // Per-sample modulation of one sample: one CTA per row (measured on H100: 0.0779 vs 0.0795 ms at
  // 1x32760x1536, 0.527 vs 0.557 ms at 1x75600x5120); with several samples the persistent grid
  // (or v2's sample-aware dealing) is faster (0.0632 vs 0.0682 ms at 16x1560x1536).
  c.per_row_grid = !tok && p.B == 1 && c.rows_per_cta == 1;
  return c;
}

template <typename T, typename M, int VEC, int NV, int TPR, bool EVEN, bool PF = false>
BwdChoice bwd_make(const BwdParams& p) {
  const bool affine = p.weight != nullptr;
  if (p.per_sample) {
    if (affine) return BwdChoice{&ln_mod_bwd_kernel<T, M, VEC, NV, TPR, EVEN, true, true, PF>, TPR, 0, 1};
    return BwdChoice{&ln_mod_bwd_kernel<T, M, VEC, NV, TPR, EVEN, true, false, PF>, TPR, 0, 1};
  }
  if (affine) return BwdChoice{&ln_mod_bwd_kernel<T, M, VEC, NV, TPR, EVEN, false, true, PF>, TPR, 0, 1};
  return BwdChoice{&ln_mod_bwd_kernel<T, M, VEC, NV, TPR, EVEN, false, false, PF>, TPR, 0, 1};
}

// v1 with elementwise affine only (the D = 5120 affine kernel of 16-bit x; its non-affine
// instantiations live in the tuning unit).
template <typename T, typename M, int VEC, int NV, int TPR, bool EVEN>
BwdChoice bwd_make_affine(const BwdParams& p) {
  if (p.weight == nullptr) return BwdChoice{};
  if (p.per_sample) return BwdChoice{&ln_mod_bwd_kernel<T, M, VEC, NV, TPR, EVEN, true, true, false>, TPR, 0, 1};
  return BwdChoice{&ln_mod_bwd_kernel<T, M, VEC, NV, TPR, EVEN, false, true, false>, TPR, 0, 1};
}

// v1 without elementwise affine only (configurations whose affine kernel would spill); affine
// calls get an empty choice.
template <typename T, typename M, int VEC, int NV, int TPR, bool EVEN, bool PF = false>
BwdChoice bwd_make_noaffine(const BwdParams& p) {
  if (p.weight != nullptr) return BwdChoice{};
  if (p.per_sample) return BwdChoice{&ln_mod_bwd_kernel<T, M, VEC, NV, TPR, EVEN, true, false, PF>, TPR, 0, 1};
  return BwdChoice{&ln_mod_bwd_kernel<T, M, VEC, NV, TPR, EVEN, false, false, PF>, TPR, 0, 1};
}

// v1 per-token backward (measured on H100, the kernel probe at c0c9b33): plain stores (the
// streaming hint was 1-4% slower), dy / x through the read-only cache, and without elementwise
// affine one CTA per row (per_row: the plan makes every row a tile; 0.344 vs 0.387 ms for the
// persistent contiguous tiles at 1x32760x1536). Affine keeps the persistent tiles: per-row tiles
// would need a [rows, 2, D] partial buffer for dweight / dbias.
template <typename T, typename M, int VEC, int NV, int TPR, bool EVEN>
BwdChoice bwd_make_tok(const BwdParams& p) {
  if (p.weight != nullptr)
    return BwdChoice{&ln_mod_bwd_kernel<T, M, VEC, NV, TPR, EVEN, false, true, false, false, false>, TPR, 0, 1};
  BwdChoice c{&ln_mod_bwd_kernel<T, M, VEC, NV, TPR, EVEN, false, false, false, false, false>, TPR, 0, 1};
  c.per_row = true;
  return c;
}

template <typename T, typename M, int VEC, int NV, bool EVEN>
BwdChoice bwd_generic_tok(const BwdParams& p, int nvec) {
  if (nvec <= 32 * NV) return bwd_make_tok<T, M, VEC, NV, 32, EVEN>(p);
  if (nvec <= 64 * NV) return bwd_make_tok<T, M, VEC, NV, 64, EVEN>(p);
  if (nvec <= 128 * NV) return bwd_make_tok<T, M, VEC, NV, 128, EVEN>(p);
  if (nvec <= 256 * NV) return bwd_make_tok<T, M, VEC, NV, 256, EVEN>(p);
  if (nvec <= 512 * NV) return bwd_make_tok<T, M, VEC, NV, 512, EVEN>(p);
  if (nvec <= 1024 * NV) return bwd_make_tok<T, M, VEC, NV, 1024, EVEN>(p);
  return BwdChoice{};
}

template <typename T, typename M, int NV, int TPR, int ST_PS, int ST_TOK, bool EVEN>
BwdChoice bwd_make_v2(const BwdParams& p) {
  const bool affine = p.weight != nullptr;
  if (p.per_sample) {
    constexpr int smem = ST_PS * bwd_v2_stage_bytes<T, M, NV, TPR, true>();
    if (affine) return BwdChoice{&ln_mod_bwd_v2_kernel<T, M, NV, TPR, ST_PS, EVEN, true, true>, TPR, smem, 2};
    return BwdChoice{&ln_mod_bwd_v2_kernel<T, M, NV, TPR, ST_PS, EVEN, true, false>, TPR, smem, 2};
  }
  constexpr int smem = ST_TOK * bwd_v2_stage_bytes<T, M, NV, TPR, false>();
  if (affine) return BwdChoice{&ln_mod_bwd_v2_kernel<T, M, NV, TPR, ST_TOK, EVEN, false, true>, TPR, smem, 2};
  return BwdChoice{&ln_mod_bwd_v2_kernel<T, M, NV, TPR, ST_TOK, EVEN, false, false>, TPR, smem, 2};
}

// The same without elementwise affine (tuning variants).
template <typename T, typename M, int NV, int TPR, int ST_PS, int ST_TOK>
BwdChoice bwd_make_v2_noaffine(const BwdParams& p) {
  if (p.weight != nullptr) return BwdChoice{};
  if (p.per_sample) {
    constexpr int smem = ST_PS * bwd_v2_stage_bytes<T, M, NV, TPR, true>();
    return BwdChoice{&ln_mod_bwd_v2_kernel<T, M, NV, TPR, ST_PS, true, true, false>, TPR, smem, 2};
  }
  constexpr int smem = ST_TOK * bwd_v2_stage_bytes<T, M, NV, TPR, false>();
  return BwdChoice{&ln_mod_bwd_v2_kernel<T, M, NV, TPR, ST_TOK, true, false, false>, TPR, smem, 2};
}

template <typename T, typename M, int VEC, int NV, bool EVEN>
BwdChoice bwd_generic(const BwdParams& p, int nvec) {
  if (nvec <= 32 * NV) return bwd_make<T, M, VEC, NV, 32, EVEN>(p);
  if (nvec <= 64 * NV) return bwd_make<T, M, VEC, NV, 64, EVEN>(p);
  if (nvec <= 128 * NV) return bwd_make<T, M, VEC, NV, 128, EVEN>(p);
  if (nvec <= 256 * NV) return bwd_make<T, M, VEC, NV, 256, EVEN>(p);
  if (nvec <= 512 * NV) return bwd_make<T, M, VEC, NV, 512, EVEN>(p);
  if (nvec <= 1024 * NV) return bwd_make<T, M, VEC, NV, 1024, EVEN>(p);
  return BwdChoice{};
}

template <typename T, typename M, int NV>
BwdChoice bwd_generic_v2(const BwdParams& p, int nvec) {
  if (nvec <= 64 * NV) return BwdChoice{};
  if (nvec <= 128 * NV) return bwd_make_v2<T, M, NV, 128, 3, 2, false>(p);
  if (nvec <= 256 * NV) return bwd_make_v2<T, M, NV, 256, 3, 2, false>(p);
  if (nvec <= 512 * NV) return bwd_make_v2<T, M, NV, 512, 3, 2, false>(p);
  return BwdChoice{};
}

template <typename T, typename M>
BwdChoice bwd_select(const BwdParams& p, int gen) {
  constexpr int V = 16 / (int)sizeof(T);
  if constexpr (std::is_same<T, __nv_bfloat16>::value && std::is_same<M, float>::value) {
    if (const BwdChoice c = bwd_tuned_bf16_f32(p, gen); c.fn != nullptr) return c;
  }
  if (!p.vectorized) return bwd_generic<T, M, 1, 8, false>(p, p.D);
  if (!p.per_sample && gen == 1) {
    if constexpr (tok_narrow<T, M>()) {
      switch (p.D) {
        case 1536: return bwd_make_tok<T, M, 4, 1, 384, true>(p);
        case 3072: return bwd_make_tok<T, M, 4, 2, 384, true>(p);
        case 5120: return bwd_make_tok<T, M, 4, 2, 640, true>(p);
        default:
          // up to 1024 threads x 2 accesses of 4 elements (D <= 8192); wider rows take the
          // 16-byte generic kernels below
          if (p.D / 4 <= 1024 * 2) return bwd_generic_tok<T, M, 4, 2, false>(p, p.D / 4);
          break;
      }
    } else if constexpr (V == 8) {
      switch (p.D) {
        case 1536: return bwd_make_tok<T, M, 8, 1, 192, true>(p);
        case 3072: return bwd_make_tok<T, M, 8, 1, 384, true>(p);
        case 5120: return bwd_make_tok<T, M, 8, 1, 640, true>(p);
        default: return bwd_generic_tok<T, M, 8, 2, false>(p, p.D / 8);
      }
    } else {
      switch (p.D) {
        case 1536: return bwd_make_tok<T, M, 4, 1, 384, true>(p);
        case 3072: return bwd_make_tok<T, M, 4, 2, 384, true>(p);
        case 5120: return bwd_make_tok<T, M, 4, 2, 640, true>(p);
        default: return bwd_generic_tok<T, M, 4, 2, false>(p, p.D / 4);
      }
    }
  }
  if (gen == 2) {
    if constexpr (V == 8) {
      switch (p.D) {
        // 96x2 s3: 0.0838 vs 192x1 s4 0.0871 ms at 16x1560, 0.1084 vs 0.1112 at 1x32760 (H100, probe)
        case 1536: return bwd_make_v2<T, M, 2, 96, 3, 3, true>(p);
        // H200 (probe, read flush, ms): 8x4096x1152 v1 32x9 (8-byte x) 0.0695 (no unmasked v2 shape);
        // 8x4096x2304 96x3 s2 0.1169 vs v1 0.1391; 8x4096x3072 128x3 s3 0.1574 vs 384x1 0.1778;
        // 4x4096x4096 128x4 s3 0.1088 vs 256x2 0.1104
        case 1152: return bwd_make<T, M, 4, 9, 32, true>(p);
        case 2304: return bwd_make_v2<T, M, 3, 96, 2, 2, true>(p);
        case 3072: return bwd_make_v2<T, M, 3, 128, 3, 2, true>(p);
        case 4096: return bwd_make_v2<T, M, 4, 128, 3, 2, true>(p);
        case 5120: return bwd_make_v2<T, M, 2, 320, 3, 2, true>(p);  // 2 CTAs/SM (640x1: 1)
        default: break;
      }
    } else {
      switch (p.D) {
        case 1536: return bwd_make_v2<T, M, 1, 384, 3, 2, true>(p);
        case 3072: return bwd_make_v2<T, M, 2, 384, 3, 2, true>(p);
        case 5120: return bwd_make_v2<T, M, 2, 640, 3, 2, true>(p);
        default: break;
      }
    }
    if (const BwdChoice c = bwd_generic_v2<T, M, 2>(p, p.D / V); c.fn != nullptr) return c;
  }
  if constexpr (V == 8) {
    switch (p.D) {
      case 1152: return bwd_make<T, M, 4, 9, 32, true>(p);  // 8-byte x, one warp per row (H200: 0.0695 ms)
      case 1536: return bwd_make<T, M, 8, 1, 192, true>(p);
      case 2304: return bwd_make<T, M, 8, 3, 96, true>(p);
      case 3072: return bwd_make<T, M, 8, 1, 384, true>(p);
      case 4096: return bwd_make<T, M, 8, 2, 256, true>(p);
      case 5120:
        // 128x5 (4-warp CTAs, two per SM) measured 0.88 ms vs 1.10 ms for 640x1 on the 14B shape
        // (H100); its affine kernel would spill (four column accumulators), so affine keeps 640x1.
        if (p.weight == nullptr) return bwd_make_noaffine<T, M, 8, 5, 128, true>(p);
        return bwd_make_affine<T, M, 8, 1, 640, true>(p);
      default: break;
    }
  } else {
    switch (p.D) {
      case 1536: return bwd_make<T, M, 4, 1, 384, true>(p);
      case 3072: return bwd_make<T, M, 4, 2, 384, true>(p);
      case 5120: return bwd_make<T, M, 4, 2, 640, true>(p);
      default: break;
    }
  }
  return bwd_generic<T, M, V, 2, false>(p, p.D / V);
}

// Each (x, modulation) dtype pair is instantiated in its own .cu file (parallel compilation);
// everyone else sees extern declarations.
#define DS_LN_MOD_INSTANTIATE(T, M)                                 \
  template FwdChoice fwd_select<T, M>(const FwdParams& p, int gen); \
  template BwdChoice bwd_select<T, M>(const BwdParams& p, int gen);

#define DS_LN_MOD_EXTERN(T, M)                                             \
  extern template FwdChoice fwd_select<T, M>(const FwdParams& p, int gen); \
  extern template BwdChoice bwd_select<T, M>(const BwdParams& p, int gen);

#define DS_LN_MOD_FOR_EACH_PAIR(X)       \
  X(__nv_bfloat16, float)                \
  X(__nv_bfloat16, __nv_bfloat16)        \
  X(__half, float)                       \
  X(__half, __half)                      \
  X(float, float)

}  // namespace ln_modulate
}  // namespace ds_adaptive
