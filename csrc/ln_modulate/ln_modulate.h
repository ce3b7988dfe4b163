// Fused LayerNorm-Modulate (adaLN): y = LayerNorm(x) * (1 + scale) + shift.
//
// Host-side interface of the CUDA kernels. Raw pointers and element strides only (no torch
// headers), so the .cu files compile standalone with nvcc; the torch binding lives in
// ln_modulate_torch.cpp.
//
// Shapes: x [B, S, D] with last-dim stride 1 and arbitrary (b, s) strides; shift/scale are
// addressed as [B, S, D] with strides (sb, ss, 1): per-sample modulation has ss = 0,
// per-token ss != 0, a batch-broadcast one sb = 0. Rows are r = b * S + s, N = B * S.
// Outputs (y, dx, per-token dshift/dscale) are contiguous [N, D]; mean/rstd are fp32 [N].
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace ds_adaptive {
namespace ln_modulate {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Hidden sizes the kernels hold in registers. Vectorised path (D % (16 / sizeof(x)) == 0 and
// 16-byte aligned rows): D <= 16384 for 16-bit x, D <= 8192 for fp32 x. Scalar path: D <= 8192.
constexpr int kMaxDVector16 = 16384;
constexpr int kMaxDVector32 = 8192;
constexpr int kMaxDScalar = 8192;

struct FwdParams {
  int64_t B = 0, S = 0;
  int D = 0;
  const void* x = nullptr;  // T
  int64_t x_sb = 0, x_ss = 0;
  const void* shift = nullptr;  // M
  int64_t shift_sb = 0, shift_ss = 0;
  const void* scale = nullptr;  // M
  int64_t scale_sb = 0, scale_ss = 0;
  const float* weight = nullptr;  // [D] fp32 or null (elementwise affine)
  const float* bias = nullptr;    // [D] fp32 or null
  void* y = nullptr;              // T, contiguous [N, D]
  float* mean = nullptr;          // [N]
  float* rstd = nullptr;          // [N]
  float eps = 1e-6f;
  bool vectorized = true;  // all rows/pointers aligned for 16-byte access of x
  // v2 row dealing, filled by ln_modulate_fwd: tile (seg, j) = rows seg * seg_len + j + k * tiles_per_seg
  int64_t seg_len = 0, tiles_per_seg = 0, num_tiles = 0;
};

struct BwdParams {
  int64_t B = 0, S = 0;
  int D = 0;
  const void* dy = nullptr;  // T
  int64_t dy_sb = 0, dy_ss = 0;
  const void* x = nullptr;  // T
  int64_t x_sb = 0, x_ss = 0;
  const float* mean = nullptr;
  const float* rstd = nullptr;
  const void* scale = nullptr;  // M
  int64_t scale_sb = 0, scale_ss = 0;
  const float* weight = nullptr;
  const float* bias = nullptr;
  void* dx = nullptr;          // T, contiguous [N, D]
  void* dshift_tok = nullptr;  // M, contiguous [N, D]; per-token only, may be null (caller aliases dy)
  void* dscale_tok = nullptr;  // M, contiguous [N, D]; per-token only
  bool per_sample = false;     // shift/scale have ss == 0: reduce their grads over s within b
  bool vectorized = true;
  // Reduction workspace, filled by ln_modulate_bwd_plan():
  float* partial = nullptr;  // [num_tiles, nq, D] fp32 (nq = 2 * per_sample + 2 * affine)
  int64_t seg_len = 0;       // rows that one reduction segment spans (S if per-sample, else N)
  int64_t tiles_per_seg = 0;
  int64_t rows_per_tile = 0;  // v1: a tile is rows_per_tile consecutive rows; v2: rows j + k * tiles_per_seg
  int64_t num_tiles = 0;
  int nq = 0;
  int grid = 0;
  int gen = 1;  // kernel generation the plan was made for (ln_modulate_bwd launches that one)
};

struct FinalizeParams {
  const float* partial = nullptr;  // [num_tiles, nq, D]
  int64_t num_tiles = 0, tiles_per_seg = 0;
  int nq = 0, D = 0;
  int64_t B = 0;
  float* dshift = nullptr;  // [B, D] or null (per-sample)
  float* dscale = nullptr;  // [B, D] or null
  float* dweight = nullptr; // [D] or null
  float* dbias = nullptr;   // [D] or null
  int q_mod = 0;            // index of dshift in nq (dscale = q_mod + 1)
  int q_aff = 0;            // index of dweight in nq (dbias = q_aff + 1)
};

// Kernel generation per (direction, modulation layout) and of the finalize: 1 = v1 (one row per
// CTA in registers, loads issued row by row), 2 = v2 (rows staged through shared memory with
// cp.async, sample-aware row dealing, two-pass backward, single-launch finalize). v2 falls back to
// v1 where it has no configuration (scalar path, D <= 512 x 16-bit / 256 x fp32, very large D,
// GPUs older than sm_80, or when its stages do not fit in shared memory).
// Defaults from H100 measurements (the kernel probe, git show c0c9b33:bench/ln_modulate_probe.cu, and bench/kernels/ln_modulate.py; ms, bf16 x,
// fp32 modulation, L2 flushed by a read before each run):
struct KernelPolicy {
  int fwd_sample = 2;  // forward, per-sample ([B, 1, D]): v2 0.0562 vs v1 0.0598 at 16x1560x1536 (H200: also B = 1)
  int fwd_token = 1;   // forward, per-token ([B, S, D]): v1 (one CTA per row) 0.195 vs v2 0.275 at 1x32760x1536
  int bwd_sample = 2;  // backward, per-sample: v2 0.111 vs v1 0.113 at 1x32760x1536
  int bwd_token = 1;   // backward, per-token: v1 (one CTA per row, 8-byte x) 0.306 vs v2 0.363 at 1x32760x1536
  int finalize = 2;    // tile-sum kernel of the backward's column partials
};

// Compiled-in defaults (the struct's initialisers), the current policy, and setting it (every field
// 1 or 2; returns false and changes nothing otherwise). Takes effect for the next launch.
KernelPolicy ln_modulate_default_policy();
KernelPolicy ln_modulate_get_policy();
bool ln_modulate_set_policy(const KernelPolicy& policy);

// Largest D the kernels accept for this x dtype and access path.
int ln_modulate_max_d(DType x, bool vectorized);

// Each returns cudaSuccess or the launch error. Work is queued on `stream`.
cudaError_t ln_modulate_fwd(const FwdParams& p, DType x, DType mod, cudaStream_t stream);

// Fills p.seg_len, tiles_per_seg, rows_per_tile, num_tiles, nq and grid for the current device
// (persistent grid = resident CTAs of the chosen backward kernel). Returns the number of floats the
// caller must allocate for p.partial (0: no reduction needed).
int64_t ln_modulate_bwd_plan(BwdParams& p, DType x, DType mod, int num_sms);

cudaError_t ln_modulate_bwd(const BwdParams& p, DType x, DType mod, cudaStream_t stream);

cudaError_t ln_modulate_finalize(const FinalizeParams& p, cudaStream_t stream);

// Benchmark hook: variant (0 = default) of the kernel configuration for x bf16 / modulation fp32.
// v1 slots: 0 fwd D=1536, 1 fwd D=5120, 2 bwd D=1536, 3 bwd D=5120; v2 slots 4..7 likewise.
// Returns false for a bad slot or variant.
constexpr int kTuningSlots = 8;
bool ln_modulate_set_tuning(int slot, int variant);

// Kernels that would run (for reports and tests): out[0] fwd threads/CTA, [1] fwd rows/CTA,
// [2] bwd threads/CTA, [3] fwd resident CTAs, [4] fwd generation, [5] bwd generation,
// [6] fwd dynamic shared memory, [7] bwd dynamic shared memory.
void ln_modulate_describe(const FwdParams& fp, const BwdParams& bp, DType x, DType mod, int out[8]);

}  // namespace ln_modulate
}  // namespace ds_adaptive
