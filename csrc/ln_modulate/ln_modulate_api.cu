// Host launchers of the fused LayerNorm-Modulate op: dtype dispatch, persistent-grid sizing,
// backward tiling plan and the finalize (tile-sum) kernel. No torch dependency.
#include <algorithm>
#include <mutex>
#include <unordered_map>

#include "ln_modulate_kernels.cuh"

namespace ds_adaptive {
namespace ln_modulate {

DS_LN_MOD_FOR_EACH_PAIR(DS_LN_MOD_EXTERN)

namespace {

// Resident CTAs of `fn` on the current device (occupancy x SMs), cached per (kernel, device).
int resident_ctas(const void* fn, int threads) {
  static std::mutex mu;
  static std::unordered_map<const void*, int> cache[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) dev = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache[dev].find(fn);
    if (it != cache[dev].end()) return it->second;
  }
  int sms = 0, occ = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms <= 0) sms = 1;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, fn, threads, 0) != cudaSuccess || occ <= 0) occ = 1;
  (void)cudaGetLastError();  // never leave a sticky error from the queries behind
  const int n = occ * sms;
  std::lock_guard<std::mutex> lock(mu);
  cache[dev][fn] = n;
  return n;
}

template <typename T, typename M>
FwdChoice fwd_choice(const FwdParams& p) {
  return fwd_select<T, M>(p);
}

FwdChoice fwd_dispatch(const FwdParams& p, DType x, DType mod) {
  switch (x) {
    case DType::kBFloat16:
      return mod == DType::kFloat32 ? fwd_choice<__nv_bfloat16, float>(p) : fwd_choice<__nv_bfloat16, __nv_bfloat16>(p);
    case DType::kFloat16:
      return mod == DType::kFloat32 ? fwd_choice<__half, float>(p) : fwd_choice<__half, __half>(p);
    case DType::kFloat32:
      return fwd_choice<float, float>(p);
  }
  return FwdChoice{};
}

BwdChoice bwd_dispatch(const BwdParams& p, DType x, DType mod) {
  switch (x) {
    case DType::kBFloat16:
      return mod == DType::kFloat32 ? bwd_select<__nv_bfloat16, float>(p) : bwd_select<__nv_bfloat16, __nv_bfloat16>(p);
    case DType::kFloat16:
      return mod == DType::kFloat32 ? bwd_select<__half, float>(p) : bwd_select<__half, __half>(p);
    case DType::kFloat32:
      return bwd_select<float, float>(p);
  }
  return BwdChoice{};
}

bool pair_supported(DType x, DType mod) { return mod == DType::kFloat32 || mod == x; }

// out[g, col] = sum over tiles [g * tiles_per_group, (g + 1) * tiles_per_group) of partial[t, q, col].
// Block (32, 8): 32 columns, 8 tile-strided partial sums each, combined in a fixed order.
__global__ void __launch_bounds__(256) ln_mod_finalize_kernel(const float* __restrict__ partial, int nq, int q, int D,
                                                             int64_t groups, int64_t tiles_per_group,
                                                             float* __restrict__ out) {
  __shared__ float sm[8][33];
  const int col = blockIdx.x * 32 + threadIdx.x;
  for (int64_t g = blockIdx.y; g < groups; g += gridDim.y) {
    float s = 0.f;
    if (col < D) {
      const int64_t t0 = g * tiles_per_group, t1 = t0 + tiles_per_group;
      for (int64_t t = t0 + threadIdx.y; t < t1; t += 8) s += partial[(t * nq + q) * (int64_t)D + col];
    }
    sm[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && col < D) {
      float r = 0.f;
#pragma unroll
      for (int k = 0; k < 8; ++k) r += sm[k][threadIdx.x];
      out[g * (int64_t)D + col] = r;
    }
    __syncthreads();
  }
}

cudaError_t launch_finalize(const float* partial, int nq, int q, int D, int64_t groups, int64_t tiles_per_group,
                            float* out, cudaStream_t stream) {
  if (out == nullptr || groups == 0) return cudaSuccess;
  dim3 block(32, 8);
  dim3 grid((unsigned)((D + 31) / 32), (unsigned)std::min<int64_t>(groups, 65535));
  ln_mod_finalize_kernel<<<grid, block, 0, stream>>>(partial, nq, q, D, groups, tiles_per_group, out);
  return cudaGetLastError();
}

}  // namespace

namespace {
int g_tuning[4] = {0, 0, 0, 0};
}  // namespace

int tuning_variant(int slot) { return (slot >= 0 && slot < 4) ? g_tuning[slot] : 0; }

bool ln_modulate_set_tuning(int slot, int variant) {
  if (slot < 0 || slot >= 4 || variant < 0 || variant > 5) return false;
  g_tuning[slot] = variant;
  return true;
}

void ln_modulate_describe(const FwdParams& fp, const BwdParams& bp, DType x, DType mod, int out[4]) {
  const FwdChoice f = pair_supported(x, mod) ? fwd_dispatch(fp, x, mod) : FwdChoice{};
  const BwdChoice b = pair_supported(x, mod) ? bwd_dispatch(bp, x, mod) : BwdChoice{};
  out[0] = f.threads;
  out[1] = f.rows_per_cta;
  out[2] = b.threads;
  out[3] = f.fn ? resident_ctas((const void*)f.fn, f.threads) : 0;
}

int ln_modulate_max_d(DType x, bool vectorized) {
  if (!vectorized) return kMaxDScalar;
  return x == DType::kFloat32 ? kMaxDVector32 : kMaxDVector16;
}

cudaError_t ln_modulate_fwd(const FwdParams& p, DType x, DType mod, cudaStream_t stream) {
  const int64_t N = p.B * p.S;
  if (N == 0) return cudaSuccess;
  if (!pair_supported(x, mod) || p.D <= 0 || p.D > ln_modulate_max_d(x, p.vectorized)) return cudaErrorInvalidValue;
  const FwdChoice c = fwd_dispatch(p, x, mod);
  if (c.fn == nullptr) return cudaErrorInvalidValue;
  const int64_t needed = (N + c.rows_per_cta - 1) / c.rows_per_cta;
  const int grid = (int)std::min<int64_t>(needed, resident_ctas((const void*)c.fn, c.threads));
  c.fn<<<grid, c.threads, 0, stream>>>(p);
  return cudaGetLastError();
}

int64_t ln_modulate_bwd_plan(BwdParams& p, DType x, DType mod, int num_sms) {
  (void)num_sms;
  const int64_t N = p.B * p.S;
  const bool affine = p.weight != nullptr;
  p.nq = (p.per_sample ? 2 : 0) + (affine ? 2 : 0);
  p.num_tiles = 0;
  p.grid = 0;
  if (N == 0 || !pair_supported(x, mod)) return 0;
  const BwdChoice c = bwd_dispatch(p, x, mod);
  if (c.fn == nullptr) return 0;
  const int64_t resident = resident_ctas((const void*)c.fn, c.threads);
  const int64_t num_segs = p.per_sample ? p.B : 1;
  p.seg_len = p.per_sample ? p.S : N;
  int64_t tiles_per_seg = std::max<int64_t>(1, resident / num_segs);
  p.rows_per_tile = (p.seg_len + tiles_per_seg - 1) / tiles_per_seg;
  p.tiles_per_seg = (p.seg_len + p.rows_per_tile - 1) / p.rows_per_tile;
  p.num_tiles = num_segs * p.tiles_per_seg;
  p.grid = (int)std::min<int64_t>(p.num_tiles, resident);
  return p.nq > 0 ? p.num_tiles * p.nq * (int64_t)p.D : 0;
}

cudaError_t ln_modulate_bwd(const BwdParams& p, DType x, DType mod, cudaStream_t stream) {
  const int64_t N = p.B * p.S;
  if (N == 0) return cudaSuccess;
  if (!pair_supported(x, mod) || p.D <= 0 || p.D > ln_modulate_max_d(x, p.vectorized) || p.grid <= 0)
    return cudaErrorInvalidValue;
  if (p.nq > 0 && p.partial == nullptr) return cudaErrorInvalidValue;
  const BwdChoice c = bwd_dispatch(p, x, mod);
  if (c.fn == nullptr) return cudaErrorInvalidValue;
  c.fn<<<p.grid, c.threads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t ln_modulate_finalize(const FinalizeParams& p, cudaStream_t stream) {
  if (p.num_tiles == 0) return cudaSuccess;
  cudaError_t e = launch_finalize(p.partial, p.nq, p.q_mod, p.D, p.B, p.tiles_per_seg, p.dshift, stream);
  if (e != cudaSuccess) return e;
  e = launch_finalize(p.partial, p.nq, p.q_mod + 1, p.D, p.B, p.tiles_per_seg, p.dscale, stream);
  if (e != cudaSuccess) return e;
  e = launch_finalize(p.partial, p.nq, p.q_aff, p.D, 1, p.num_tiles, p.dweight, stream);
  if (e != cudaSuccess) return e;
  return launch_finalize(p.partial, p.nq, p.q_aff + 1, p.D, 1, p.num_tiles, p.dbias, stream);
}

}  // namespace ln_modulate
}  // namespace ds_adaptive
