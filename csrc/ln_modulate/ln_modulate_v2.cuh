// Second-generation ("v2") kernels of the fused LayerNorm-Modulate op: staged row pipelines.
// Included by ln_modulate_kernels.cuh after the v1 kernels and the shared helpers (to_f, load_vec,
// store_vec, row_allreduce*).
//
// Why: the v1 kernels hold one row per CTA in registers and load the next row only after the
// current one is stored, so each row pays a full DRAM latency with only `resident CTAs` rows in
// flight per SM (measured on H100: 20 KB in flight per SM for the D = 5120 backward, 640x1 at one
// CTA per SM; per-token modulation loaded only after the row reduction, a second exposed latency).
// v2 keeps the same per-thread column ownership and the same arithmetic, but:
//   * rows stream through STAGES shared-memory stages with cp.async (sm_80+): the loads of the
//     next STAGES - 1 rows of x (forward), dy / x / mean / rstd (backward) and per-token shift /
//     scale are in flight while a row is reduced; bytes in flight no longer cost registers;
//   * each thread copies and reads back only its own 16-byte chunks (the same chunks the v1 thread
//     loads), so no barrier is needed for the stages: cp.async.wait_group makes a thread's own
//     copies visible to it. A stage is refilled one iteration after it was read, when the values
//     read from it have already been consumed by that thread's arithmetic (no write-after-read);
//   * the backward reads dy / x twice from shared memory (pass 1: sums and column partials,
//     pass 2: dx) instead of keeping them in registers across the row reduction: fewer registers,
//     more CTAs per SM;
//   * rows are dealt "sample-aware": the CTAs are split into groups per reduction segment (a
//     sample for per-sample modulation), and each group deals its segment's rows round-robin
//     (row = seg_start + j + k * tiles_per_seg), so all CTAs sweep memory together and a CTA
//     stays in one sample (its shift / scale row stays in L1). The backward's column partials are
//     per such interleaved tile, summed by a single-launch finalize in a fixed order
//     (deterministic, no atomics).
// Older architectures (sm_70 / sm_75) compile a synchronous copy in place of cp.async (same
// results); the host selects v1 there.
#pragma once

#include "ln_modulate_rows.h"

namespace ds_adaptive {
namespace ln_modulate {

// ----------------------------------------------------------------------------------------------
// cp.async helpers
// ----------------------------------------------------------------------------------------------
// One cp.async of N bytes (4, 8 or 16) from global to shared memory: 16-byte copies bypass L1 (.cg); 4- and
// 8-byte ones (mean / rstd; the 8-byte x accesses of the D = 1152 forward) take .ca, the only variant for them.
template <int N>
__device__ __forceinline__ void cp_async(void* smem, const void* gmem) {
  static_assert(N == 4 || N == 8 || N == 16, "cp.async copies 4, 8 or 16 bytes");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if constexpr (N == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(s), "l"(gmem), "n"(N) : "memory");
  }
#else
  using R = typename Raw<N>::type;
  *static_cast<R*>(smem) = __ldg(static_cast<const R*>(gmem));
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Wait until at most N of this thread's committed groups are pending (the older ones are complete
// and visible to this thread).
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#else
  __threadfence_block();
#endif
}

// VEC elements of U from shared memory: chunk k (C: uint4 = 16 bytes, uint2 = 8) at chunk0[k * chunk_stride].
template <int VEC, typename U, typename C>
__device__ __forceinline__ void smem_unpack(const C* chunk0, int chunk_stride, float (&out)[VEC]) {
  constexpr int EPC = (int)sizeof(C) / (int)sizeof(U);
  static_assert(VEC % EPC == 0, "an access must be whole chunks");
#pragma unroll
  for (int k = 0; k < VEC / EPC; ++k) {
    const C raw = chunk0[k * chunk_stride];
    const U* e = reinterpret_cast<const U*>(&raw);
#pragma unroll
    for (int j = 0; j < EPC; ++j) out[k * EPC + j] = to_f<U>(e[j]);
  }
}

// Dynamic shared memory of the v2 kernels (one declaration for all of them).
extern __shared__ uint4 lnm_v2_smem[];

// Shared-memory bytes of one stage (XB: bytes per x access, 16 or 8; 8 for per-sample rows only).
template <typename T, typename M, int NV, int TPR, bool TOK, int XB = 16>
constexpr int fwd_v2_stage_bytes() {
  return NV * TPR * XB * (1 + (TOK ? 2 * (16 / (int)sizeof(T)) * (int)sizeof(M) / 16 : 0));
}
template <typename T, typename M, int NV, int TPR, bool PER_SAMPLE>
constexpr int bwd_v2_stage_bytes() {
  return NV * TPR * 16 * (2 + (PER_SAMPLE ? 0 : (16 / (int)sizeof(T)) * (int)sizeof(M) / 16)) + (TPR / 32) * 8;
}

// ----------------------------------------------------------------------------------------------
// Forward v2. Per row as v1 (two passes over registers for mean and variance, one rounding of
// y); x (and, TOK = per-token modulation, shift and scale) arrive through the stages; per-sample
// shift / scale are read through L1 after the reduction (the CTA stays in one sample), or with
// MODC (per-sample only; the 16-bit configurations at D = 1152 .. 4096, issue 18) held in registers while
// consecutive rows of the CTA share a sample (2 * NV * VEC registers; reloaded when the sample
// changes, so any row dealing is correct). YCS: y stored with the streaming (evict-first) hint.
// XB: bytes per x access, 16 or 8 (8: per-sample only; D = 1152 on one warp, 9 accesses of 4 elements
// per lane, where 16-byte accesses leave half the lanes idle in the last of 5).
// ----------------------------------------------------------------------------------------------
template <typename T, typename M, int NV, int TPR, int STAGES, bool EVEN, bool TOK, bool MODC = false, bool YCS = false,
          int XB = 16>
__global__ void __launch_bounds__(TPR) ln_mod_fwd_v2_kernel(const FwdParams p) {
  static_assert(XB == 16 || (XB == 8 && !TOK), "8-byte x accesses: per-sample modulation only");
  using Chunk = typename Raw<XB>::type;  // one x access in a stage slot
  constexpr int VEC = XB / (int)sizeof(T);
  constexpr int MCH = TOK ? VEC * (int)sizeof(M) / 16 : 0;  // 16-byte chunks per access of shift (and scale)
  constexpr int EPM = 16 / (int)sizeof(M);                  // modulation elements per chunk
  constexpr int SLOTS = NV * (1 + 2 * MCH);                 // XB-byte slots per thread per stage
  static_assert(TPR % 32 == 0 && TPR <= 1024, "TPR: a multiple of 32, at most 1024");
  static_assert(STAGES >= 2 && STAGES <= 8, "STAGES: 2..8");
  static_assert(!TOK || (VEC * (int)sizeof(M)) % 16 == 0, "per-token modulation: whole 16-byte chunks");
  static_assert(!(TOK && MODC), "MODC: per-sample modulation only");
  __shared__ float red[2][32];
  float msh[MODC ? NV : 1][VEC], msc[MODC ? NV : 1][VEC];  // MODC: shift, scale of sample cached_b
  int cached_b = -1;
  const int t = threadIdx.x;
  const int N = (int)(p.B * p.S), S = (int)p.S;  // v2 runs only for N <= 2^30
  const int D = p.D;
  const int nvec = D / VEC;
  const float inv_d = 1.f / (float)D;
  const bool has_w = p.weight != nullptr, has_b = p.bias != nullptr;
  const int seg_len = (int)p.seg_len, tps = (int)p.tiles_per_seg, num_tiles = (int)p.num_tiles;
  const int grid = (int)gridDim.x;

  // Slot q of stage st of this thread (XB bytes; per-token modulation slots: 16 bytes, XB = 16).
  auto slot = [&](int st, int q) -> Chunk* {
    return reinterpret_cast<Chunk*>(lnm_v2_smem) + (st * SLOTS + q) * TPR + t;
  };

  auto issue = [&](const RowIter& it, int st) {
    if (it.valid()) {
      const int r = it.row;
      int b, s;
      split_row(r, S, b, s);
      const T* xr = static_cast<const T*>(p.x) + b * p.x_sb + s * p.x_ss;
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int c = i * TPR + t;
        if (EVEN || c < nvec) cp_async<XB>(slot(st, i), xr + (int64_t)c * VEC);
      }
      if constexpr (TOK) {
        const M* shr = static_cast<const M*>(p.shift) + b * p.shift_sb + s * p.shift_ss;
        const M* scr = static_cast<const M*>(p.scale) + b * p.scale_sb + s * p.scale_ss;
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          const int c = i * TPR + t;
          if (EVEN || c < nvec) {
#pragma unroll
            for (int k = 0; k < MCH; ++k) {
              cp_async<16>(slot(st, NV + i * MCH + k), shr + (int64_t)c * VEC + k * EPM);
              cp_async<16>(slot(st, NV + NV * MCH + i * MCH + k), scr + (int64_t)c * VEC + k * EPM);
            }
          }
        }
      }
    }
    cp_async_commit();  // always one group per issue (possibly empty): uniform group counting
  };

  RowIter cons;
  cons.start((int)blockIdx.x, grid, N, seg_len, tps, num_tiles);
  RowIter prod = cons;
#pragma unroll
  for (int k = 0; k < STAGES - 1; ++k) {
    issue(prod, k);
    if (prod.valid()) prod.advance(grid, N, seg_len, tps, num_tiles);
  }
  int st = 0, pst = STAGES - 1;
  while (cons.valid()) {
    // Refill the stage read in the previous iteration, then wait for this row's stage.
    issue(prod, pst);
    if (prod.valid()) prod.advance(grid, N, seg_len, tps, num_tiles);
    pst = (pst + 1 == STAGES) ? 0 : pst + 1;
    cp_async_wait<STAGES - 1>();

    const int row = cons.row;
    int b, s;
    split_row(row, S, b, s);
    float v[NV][VEC];
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int c = i * TPR + t;
      if (EVEN || c < nvec) {
        smem_unpack<VEC, T>(slot(st, i), TPR, v[i]);
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[i][j] = 0.f;
      }
    }
    const float2 stats = row_mean_rstd<TPR, NV, VEC, EVEN>(v, t, nvec, inv_d, p.eps, red);
    const float mean = stats.x, rstd = stats.y;

    const M* shr = static_cast<const M*>(p.shift) + b * p.shift_sb + s * p.shift_ss;
    const M* scr = static_cast<const M*>(p.scale) + b * p.scale_sb + s * p.scale_ss;
    T* yr = static_cast<T*>(p.y) + row * (int64_t)D;
    if constexpr (MODC) {
      if (b != cached_b) {
        cached_b = b;
        load_thread_mod<NV, VEC, TPR, EVEN>(shr, scr, t, nvec, msh, msc);
      }
    }
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int c = i * TPR + t;
      if (EVEN || c < nvec) {
        float sh[VEC], sc[VEC];
        if constexpr (MODC) {
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            sh[j] = msh[i][j];
            sc[j] = msc[i][j];
          }
        } else if constexpr (TOK) {
          smem_unpack<VEC, M>(slot(st, NV + i * MCH), TPR, sh);
          smem_unpack<VEC, M>(slot(st, NV + NV * MCH + i * MCH), TPR, sc);
        } else {
          load_vec<VEC, M, false>(shr + (int64_t)c * VEC, sh);
          load_vec<VEC, M, false>(scr + (int64_t)c * VEC, sc);
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
          for (int j = 0; j < VEC; ++j) out[j] = fmaf(fmaf(v[i][j] * rstd, w[j], bb[j]), sc[j] + 1.f, sh[j]);
        } else {
#pragma unroll
          for (int j = 0; j < VEC; ++j) out[j] = fmaf(v[i][j] * rstd, sc[j] + 1.f, sh[j]);
        }
        store_vec<VEC, T, YCS>(yr + (int64_t)c * VEC, out);
      }
    }
    if (t == 0) {
      p.mean[row] = mean;
      p.rstd[row] = rstd;
    }
    cons.advance(grid, N, seg_len, tps, num_tiles);
    st = (st + 1 == STAGES) ? 0 : st + 1;
  }
  cp_async_wait<0>();
}

// ----------------------------------------------------------------------------------------------
// Backward v2. Per row (ln = xhat [* w + b], sc = 1 + scale):
//   pass 1 (dy, x from the stage): dln = dy * sc, g = dln [* w]; row sums of g and g * xhat;
//     PER_SAMPLE: acc += dy, dy * ln (columns)   else: dscale = dy * ln, dshift = dy (elementwise)
//     AFFINE:     acc += dln * xhat, dln          (columns)
//   row reduction (one barrier, alternating buffers);
//   pass 2 (dy, x re-read from the stage): dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).
// Products that feed a later subtraction are rounded explicitly (__fmul_rn), so both passes see
// bit-identical g. Column partials are written once per tile (interleaved rows of one segment).
// mean / rstd of the row travel through the stage too (lane 0 of each warp copies them and
// broadcasts with a shuffle). STST: outputs stored with the streaming hint, else plain stores.
// ----------------------------------------------------------------------------------------------
template <typename T, typename M, int NV, int TPR, int STAGES, bool EVEN, bool PER_SAMPLE, bool AFFINE,
          bool STST = true>
__global__ void __launch_bounds__(TPR) ln_mod_bwd_v2_kernel(const BwdParams p) {
  constexpr int VEC = 16 / (int)sizeof(T);
  constexpr int MCH = PER_SAMPLE ? 0 : VEC * (int)sizeof(M) / 16;  // per-token scale chunks per access
  constexpr int EPM = 16 / (int)sizeof(M);
  constexpr int SLOTS = NV * (2 + MCH);
  constexpr int W = TPR / 32;
  static_assert(TPR % 32 == 0 && TPR <= 1024, "TPR: a multiple of 32, at most 1024");
  static_assert(STAGES >= 2 && STAGES <= 8, "STAGES: 2..8");
  static_assert(PER_SAMPLE || (VEC * (int)sizeof(M)) % 16 == 0, "per-token scale: whole 16-byte chunks");
  __shared__ float red[2][2][32];
  const int t = threadIdx.x;
  const int lane = t & 31, warp = t >> 5;
  const int N = (int)(p.B * p.S), S = (int)p.S;  // v2 runs only for N <= 2^30
  const int D = p.D;
  const int nvec = D / VEC;
  const float inv_d = 1.f / (float)D;
  const bool has_b = p.bias != nullptr;
  const bool write_dshift = p.dshift_tok != nullptr;
  const int seg_len = (int)p.seg_len, tps = (int)p.tiles_per_seg, num_tiles = (int)p.num_tiles;
  const int grid = (int)gridDim.x;
  float2* stats = reinterpret_cast<float2*>(lnm_v2_smem + (int64_t)STAGES * SLOTS * TPR);  // [STAGES][W]

  auto slot = [&](int st, int q) -> uint4* { return lnm_v2_smem + (st * SLOTS + q) * TPR + t; };

  auto issue = [&](const RowIter& it, int st) {
    if (it.valid()) {
      const int r = it.row;
      int b, s;
      split_row(r, S, b, s);
      const T* dyr = static_cast<const T*>(p.dy) + b * p.dy_sb + s * p.dy_ss;
      const T* xr = static_cast<const T*>(p.x) + b * p.x_sb + s * p.x_ss;
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int c = i * TPR + t;
        if (EVEN || c < nvec) {
          cp_async<16>(slot(st, i), dyr + (int64_t)c * VEC);
          cp_async<16>(slot(st, NV + i), xr + (int64_t)c * VEC);
        }
      }
      if constexpr (!PER_SAMPLE) {
        const M* scr = static_cast<const M*>(p.scale) + b * p.scale_sb + s * p.scale_ss;
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          const int c = i * TPR + t;
          if (EVEN || c < nvec) {
#pragma unroll
            for (int k = 0; k < MCH; ++k) cp_async<16>(slot(st, 2 * NV + i * MCH + k), scr + (int64_t)c * VEC + k * EPM);
          }
        }
      }
      if (lane == 0) {
        float2* sl = stats + st * W + warp;
        cp_async<4>(&sl->x, p.mean + r);
        cp_async<4>(&sl->y, p.rstd + r);
      }
    }
    cp_async_commit();
  };

  RowIter cons;
  cons.start((int)blockIdx.x, grid, N, seg_len, tps, num_tiles);
  RowIter prod = cons;
#pragma unroll
  for (int k = 0; k < STAGES - 1; ++k) {
    issue(prod, k);
    if (prod.valid()) prod.advance(grid, N, seg_len, tps, num_tiles);
  }
  int st = 0, pst = STAGES - 1, buf = 0;

  while (cons.valid()) {
    const int tile = cons.tile;
    const int seg = (int)((unsigned)tile / (unsigned)tps);
    float acc_sh[NV][VEC], acc_sc[NV][VEC], acc_w[NV][VEC], acc_b[NV][VEC], opc[NV][VEC];
#pragma unroll
    for (int i = 0; i < NV; ++i)
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc_sh[i][j] = acc_sc[i][j] = acc_w[i][j] = acc_b[i][j] = opc[i][j] = 0.f;
    if constexpr (PER_SAMPLE) {  // the tile lies in one sample (segment = sample): 1 + scale[seg]
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

    do {
      issue(prod, pst);
      if (prod.valid()) prod.advance(grid, N, seg_len, tps, num_tiles);
      pst = (pst + 1 == STAGES) ? 0 : pst + 1;
      cp_async_wait<STAGES - 1>();

      const int row = cons.row;
      float2 ms = make_float2(0.f, 0.f);
      if (lane == 0) ms = stats[st * W + warp];
      const float mean = __shfl_sync(0xffffffffu, ms.x, 0);
      const float rstd = __shfl_sync(0xffffffffu, ms.y, 0);

      // ---- pass 1 ----
      float s1 = 0.f, s2 = 0.f;
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int c = i * TPR + t;
        if (EVEN || c < nvec) {
          float dyv[VEC], xv[VEC], sc[VEC], w[VEC], bb[VEC];
          smem_unpack<VEC, T>(slot(st, i), TPR, dyv);
          smem_unpack<VEC, T>(slot(st, NV + i), TPR, xv);
          if constexpr (PER_SAMPLE) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) sc[j] = opc[i][j];
          } else {
            smem_unpack<VEC, M>(slot(st, 2 * NV + i * MCH), TPR, sc);
#pragma unroll
            for (int j = 0; j < VEC; ++j) sc[j] += 1.f;
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
          float tok_sc[VEC];
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const float xhat = (xv[j] - mean) * rstd;
            float ln = xhat;
            if constexpr (AFFINE) ln = fmaf(xhat, w[j], bb[j]);
            const float dln = __fmul_rn(dyv[j], sc[j]);
            if constexpr (PER_SAMPLE) {
              acc_sh[i][j] += dyv[j];
              acc_sc[i][j] = fmaf(dyv[j], ln, acc_sc[i][j]);
            } else {
              tok_sc[j] = dyv[j] * ln;
            }
            float g = dln;
            if constexpr (AFFINE) {
              acc_w[i][j] = fmaf(dln, xhat, acc_w[i][j]);
              acc_b[i][j] += dln;
              g = __fmul_rn(dln, w[j]);
            }
            s1 += g;
            s2 = fmaf(g, xhat, s2);
          }
          if constexpr (!PER_SAMPLE) {
            M* const dsc = static_cast<M*>(p.dscale_tok) + row * (int64_t)D + (int64_t)c * VEC;
            store_vec<VEC, M, STST>(dsc, tok_sc);
            if (write_dshift) {
              store_vec<VEC, M, STST>(static_cast<M*>(p.dshift_tok) + row * (int64_t)D + (int64_t)c * VEC, dyv);
            }
          }
        }
      }
      row_allreduce2<TPR>(s1, s2, red[buf][0], red[buf][1]);
      buf ^= 1;
      const float m1 = s1 * inv_d, m2 = s2 * inv_d;

      // ---- pass 2 ----
      T* dxr = static_cast<T*>(p.dx) + row * (int64_t)D;
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int c = i * TPR + t;
        if (EVEN || c < nvec) {
          float dyv[VEC], xv[VEC], sc[VEC], w[VEC];
          smem_unpack<VEC, T>(slot(st, i), TPR, dyv);
          smem_unpack<VEC, T>(slot(st, NV + i), TPR, xv);
          if constexpr (PER_SAMPLE) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) sc[j] = opc[i][j];
          } else {
            smem_unpack<VEC, M>(slot(st, 2 * NV + i * MCH), TPR, sc);
#pragma unroll
            for (int j = 0; j < VEC; ++j) sc[j] += 1.f;
          }
          if constexpr (AFFINE) load_vec<VEC, float, false>(p.weight + c * VEC, w);
          float o[VEC];
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const float xhat = (xv[j] - mean) * rstd;
            float g = __fmul_rn(dyv[j], sc[j]);
            if constexpr (AFFINE) g = __fmul_rn(g, w[j]);
            o[j] = rstd * (g - fmaf(xhat, m2, m1));
          }
          store_vec<VEC, T, STST>(dxr + (int64_t)c * VEC, o);
        }
      }
      cons.advance(grid, N, seg_len, tps, num_tiles);
      st = (st + 1 == STAGES) ? 0 : st + 1;
    } while (cons.valid() && cons.tile == tile);

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
  cp_async_wait<0>();
}

}  // namespace ln_modulate
}  // namespace ds_adaptive
