// Host launchers of the fused LayerNorm-Modulate op: dtype dispatch, kernel-generation policy,
// persistent-grid sizing, backward tiling plan and the finalize (tile-sum) kernels. No torch
// dependency.
#include <algorithm>
#include <cstdint>
#include <atomic>
#include <mutex>
#include <type_traits>
#include <unordered_map>

#include "ln_modulate_kernels.cuh"

namespace ds_adaptive {
namespace ln_modulate {

DS_LN_MOD_FOR_EACH_PAIR(DS_LN_MOD_EXTERN)

namespace {

// Per-device facts, queried once.
struct DeviceInfo {
  int sms = 1;
  int major = 0;
  int smem_optin = 48 * 1024;  // largest dynamic shared memory a block may opt in to
};

int current_device() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) dev = 0;
  return dev;
}

const DeviceInfo& device_info(int dev) {
  static std::mutex mu;
  static DeviceInfo info[64];
  static bool have[64] = {};
  std::lock_guard<std::mutex> lock(mu);
  if (!have[dev]) {
    DeviceInfo d;
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess && v > 0) d.sms = v;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess) d.major = v;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) == cudaSuccess && v > 0)
      d.smem_optin = v;
    (void)cudaGetLastError();
    info[dev] = d;
    have[dev] = true;
  }
  return info[dev];
}

// Resident CTAs of `fn` on the current device (occupancy x SMs) with `smem` bytes of dynamic
// shared memory, cached per (kernel, device). Every kernel with dynamic shared memory gets its
// opt-in attribute set here, before the first query and launch (on the first, eager call: CUDA-graph
// captures then find it cached): the 48 KB default limit counts static shared memory too, so exactly
// 48 KB of stages plus the kernels' reduction buffer failed to launch ("invalid argument": v2
// per-token forward at D = 4096 with 16-bit modulation and at D = 1152 fp32, found by
// tests/gpu test_dit_widths, issue 18) while the old "> 48 KB" test skipped the attribute.
int resident_ctas(const void* fn, int threads, int smem) {
  static std::mutex mu;
  static std::unordered_map<const void*, int> cache[64];
  const int dev = current_device();
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache[dev].find(fn);
    if (it != cache[dev].end()) return it->second;
  }
  const DeviceInfo& d = device_info(dev);
  if (smem > 0) (void)cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  int occ = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, fn, threads, smem) != cudaSuccess || occ <= 0) occ = 1;
  (void)cudaGetLastError();  // never leave a sticky error from the queries behind
  const int n = occ * d.sms;
  std::lock_guard<std::mutex> lock(mu);
  cache[dev][fn] = n;
  return n;
}

// Kernel-generation policy (see ln_modulate.h). Atomics: set from Python between launches.
std::atomic<int> g_policy[5] = {KernelPolicy{}.fwd_sample, KernelPolicy{}.fwd_token, KernelPolicy{}.bwd_sample,
                                KernelPolicy{}.bwd_token, KernelPolicy{}.finalize};

KernelPolicy load_policy() {
  KernelPolicy k;
  k.fwd_sample = g_policy[0].load(std::memory_order_relaxed);
  k.fwd_token = g_policy[1].load(std::memory_order_relaxed);
  k.bwd_sample = g_policy[2].load(std::memory_order_relaxed);
  k.bwd_token = g_policy[3].load(std::memory_order_relaxed);
  k.finalize = g_policy[4].load(std::memory_order_relaxed);
  return k;
}

// v2 needs cp.async (sm_80+); older GPUs run v1.
int effective_gen(int requested) {
  if (requested != 2) return 1;
  return device_info(current_device()).major >= 8 ? 2 : 1;
}

// The dtype tag of a kernel element type.
template <typename U>
constexpr DType dtype_of() {
  return std::is_same<U, float>::value ? DType::kFloat32
                                       : (std::is_same<U, __half>::value ? DType::kFloat16 : DType::kBFloat16);
}

// Forward / backward dispatch over the (x, modulation) dtype pairs, generated from the one list of
// instantiated pairs (DS_LN_MOD_FOR_EACH_PAIR, ln_modulate_kernels.cuh).
FwdChoice fwd_dispatch_gen(const FwdParams& p, DType x, DType mod, int gen) {
#define DS_LN_MOD_FWD_CASE(T, M) \
  if (x == dtype_of<T>() && mod == dtype_of<M>()) return fwd_select<T, M>(p, gen);
  DS_LN_MOD_FOR_EACH_PAIR(DS_LN_MOD_FWD_CASE)
#undef DS_LN_MOD_FWD_CASE
  return FwdChoice{};
}

BwdChoice bwd_dispatch_gen(const BwdParams& p, DType x, DType mod, int gen) {
#define DS_LN_MOD_BWD_CASE(T, M) \
  if (x == dtype_of<T>() && mod == dtype_of<M>()) return bwd_select<T, M>(p, gen);
  DS_LN_MOD_FOR_EACH_PAIR(DS_LN_MOD_BWD_CASE)
#undef DS_LN_MOD_BWD_CASE
  return BwdChoice{};
}

// A supported (x, modulation) pair: one of the instantiated ones.
bool pair_supported(DType x, DType mod) {
#define DS_LN_MOD_PAIR_CASE(T, M) \
  if (x == dtype_of<T>() && mod == dtype_of<M>()) return true;
  DS_LN_MOD_FOR_EACH_PAIR(DS_LN_MOD_PAIR_CASE)
#undef DS_LN_MOD_PAIR_CASE
  return false;
}

// v2 kernels index rows with 32-bit integers and need their stages, plus their static reduction
// buffers (< 1 KB), to fit in shared memory.
bool v2_ok(int smem, int64_t rows) {
  return rows <= kMaxRowsV2 && smem + 1024 <= device_info(current_device()).smem_optin;
}

// The forward kernel for p under the current policy (v2 -> v1 where v2 has no configuration or
// its stages do not fit in shared memory).
FwdChoice fwd_dispatch(const FwdParams& p, DType x, DType mod) {
  const bool tok = p.shift_ss != 0 || p.scale_ss != 0;
  const KernelPolicy pol = load_policy();
  const int gen = effective_gen(tok ? pol.fwd_token : pol.fwd_sample);
  // (Until issue 18 a per-sample forward of one sample ran v1 whatever the policy, from H100
  // measurements; on the H200 v2 is faster there too: 0.0624 vs 0.0657 ms at 1x32760x1536, 0.4197
  // vs 0.4225 ms at 1x75600x5120, the kernel probe at c0c9b33.)
  FwdChoice c = fwd_dispatch_gen(p, x, mod, gen);
  if (c.fn != nullptr && c.gen == 2 && !v2_ok(c.smem, p.B * p.S)) c = fwd_dispatch_gen(p, x, mod, 1);
  return c;
}

BwdChoice bwd_dispatch(const BwdParams& p, DType x, DType mod, int gen) {
  BwdChoice c = bwd_dispatch_gen(p, x, mod, gen);
  if (c.fn != nullptr && c.gen == 2 && !v2_ok(c.smem, p.B * p.S)) c = bwd_dispatch_gen(p, x, mod, 1);
  return c;
}

int bwd_policy_gen(const BwdParams& p) {
  const KernelPolicy pol = load_policy();
  return effective_gen(p.per_sample ? pol.bwd_sample : pol.bwd_token);
}

// v2 forward row dealing (ln_modulate_rows.h) into a copy of the parameters; returns the grid.
int fwd_v2_apply_tiling(FwdParams& q, int64_t resident) {
  const Tiling t = fwd_v2_tiling(q.B, q.S, q.shift_ss != 0 || q.scale_ss != 0, resident);
  q.seg_len = t.seg_len;
  q.tiles_per_seg = t.tiles_per_seg;
  q.num_tiles = t.num_tiles;
  return t.grid;
}


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

// v2 finalize: both outputs of a pair (dshift + dscale, or dweight + dbias) in one launch
// (blockIdx.z), blockDim.y (8 or 32) partial sums per column with four independent accumulators
// each (more loads in flight than v1's single chain), combined by a fixed-order tree: the result
// depends only on (tiles_per_group, blockDim.y), not on timing.
__global__ void __launch_bounds__(1024) ln_mod_finalize_v2_kernel(const float* __restrict__ partial, int nq, int q0,
                                                                  int D, int64_t groups, int64_t tiles_per_group,
                                                                  float* __restrict__ out0, float* __restrict__ out1) {
  __shared__ float sm[32][33];
  float* const out = blockIdx.z == 0 ? out0 : out1;
  if (out == nullptr) return;  // uniform per block
  const int q = q0 + (int)blockIdx.z;
  const int tx = threadIdx.x, ty = threadIdx.y, ry = blockDim.y;
  const int col = blockIdx.x * 32 + tx;
  const int64_t tile_stride = (int64_t)nq * D;
  for (int64_t g = blockIdx.y; g < groups; g += gridDim.y) {
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
    if (col < D) {
      const float* base = partial + (int64_t)q * D + col;
      const int64_t t1 = (g + 1) * tiles_per_group;
      int64_t t = g * tiles_per_group + ty;
      for (; t + 3 * ry < t1; t += 4 * ry) {
        a0 += base[t * tile_stride];
        a1 += base[(t + ry) * tile_stride];
        a2 += base[(t + 2 * ry) * tile_stride];
        a3 += base[(t + 3 * ry) * tile_stride];
      }
      for (; t < t1; t += ry) a0 += base[t * tile_stride];
    }
    sm[ty][tx] = (a0 + a1) + (a2 + a3);
    __syncthreads();
    for (int h = ry >> 1; h > 0; h >>= 1) {
      if (ty < h) sm[ty][tx] += sm[ty + h][tx];
      __syncthreads();
    }
    if (ty == 0 && col < D) out[g * (int64_t)D + col] = sm[0][tx];
    __syncthreads();
  }
}

cudaError_t launch_finalize_v2(const float* partial, int nq, int q0, int D, int64_t groups, int64_t tiles_per_group,
                               float* out0, float* out1, cudaStream_t stream) {
  if ((out0 == nullptr && out1 == nullptr) || groups == 0) return cudaSuccess;
  const int ry = tiles_per_group >= 128 ? 32 : 8;
  dim3 block(32, ry);
  dim3 grid((unsigned)((D + 31) / 32), (unsigned)std::min<int64_t>(groups, 65535), 2);
  ln_mod_finalize_v2_kernel<<<grid, block, 0, stream>>>(partial, nq, q0, D, groups, tiles_per_group, out0, out1);
  return cudaGetLastError();
}

}  // namespace

namespace {
std::atomic<int> g_tuning[kTuningSlots] = {};
}  // namespace

int tuning_variant(int slot) {
  return (slot >= 0 && slot < kTuningSlots) ? g_tuning[slot].load(std::memory_order_relaxed) : 0;
}

bool ln_modulate_set_tuning(int slot, int variant) {
  if (slot < 0 || slot >= kTuningSlots || variant < 0 || variant > 5) return false;
  g_tuning[slot].store(variant, std::memory_order_relaxed);
  return true;
}

KernelPolicy ln_modulate_default_policy() { return KernelPolicy{}; }

KernelPolicy ln_modulate_get_policy() { return load_policy(); }

bool ln_modulate_set_policy(const KernelPolicy& k) {
  const int v[5] = {k.fwd_sample, k.fwd_token, k.bwd_sample, k.bwd_token, k.finalize};
  for (int i = 0; i < 5; ++i)
    if (v[i] != 1 && v[i] != 2) return false;
  for (int i = 0; i < 5; ++i) g_policy[i].store(v[i], std::memory_order_relaxed);
  return true;
}

void ln_modulate_describe(const FwdParams& fp, const BwdParams& bp, DType x, DType mod, int out[8]) {
  const FwdChoice f = pair_supported(x, mod) ? fwd_dispatch(fp, x, mod) : FwdChoice{};
  const BwdChoice b = pair_supported(x, mod) ? bwd_dispatch(bp, x, mod, bwd_policy_gen(bp)) : BwdChoice{};
  out[0] = f.threads;
  out[1] = f.rows_per_cta;
  out[2] = b.threads;
  out[3] = f.fn ? resident_ctas((const void*)f.fn, f.threads, f.smem) : 0;
  out[4] = f.fn ? f.gen : 0;
  out[5] = b.fn ? b.gen : 0;
  out[6] = f.smem;
  out[7] = b.smem;
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
  const int64_t resident = resident_ctas((const void*)c.fn, c.threads, c.smem);
  if (c.gen == 2) {
    FwdParams q = p;
    const int grid = fwd_v2_apply_tiling(q, resident);
    c.fn<<<grid, c.threads, c.smem, stream>>>(q);
    return cudaGetLastError();
  }
  const int64_t needed = (N + c.rows_per_cta - 1) / c.rows_per_cta;
  const int grid = (int)std::min<int64_t>(needed, c.per_row_grid ? (int64_t)INT32_MAX : resident);
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
  const BwdChoice c = bwd_dispatch(p, x, mod, bwd_policy_gen(p));
  if (c.fn == nullptr) return 0;
  p.gen = c.gen;
  const int64_t resident = resident_ctas((const void*)c.fn, c.threads, c.smem);
  if (c.gen == 2) {  // interleaved tiles (ln_modulate_rows.h)
    const Tiling t = bwd_v2_tiling(p.B, p.S, p.per_sample, resident, &p.rows_per_tile);
    p.seg_len = t.seg_len;
    p.tiles_per_seg = t.tiles_per_seg;
    p.num_tiles = t.num_tiles;
    p.grid = t.grid;
  } else if (c.per_row) {  // one row per tile, one CTA per tile (per-token, no column partials)
    p.seg_len = N;
    p.rows_per_tile = 1;
    p.tiles_per_seg = N;
    p.num_tiles = N;
    p.grid = (int)std::min<int64_t>(N, INT32_MAX);
  } else {  // contiguous tiles of rows_per_tile rows
    const int64_t num_segs = p.per_sample ? p.B : 1;
    p.seg_len = p.per_sample ? p.S : N;
    const int64_t tiles_per_seg = std::max<int64_t>(1, resident / num_segs);
    p.rows_per_tile = (p.seg_len + tiles_per_seg - 1) / tiles_per_seg;
    p.tiles_per_seg = (p.seg_len + p.rows_per_tile - 1) / p.rows_per_tile;
    p.num_tiles = num_segs * p.tiles_per_seg;
    p.grid = (int)std::min<int64_t>(p.num_tiles, resident);
  }
  return p.nq > 0 ? p.num_tiles * p.nq * (int64_t)p.D : 0;
}

cudaError_t ln_modulate_bwd(const BwdParams& p, DType x, DType mod, cudaStream_t stream) {
  const int64_t N = p.B * p.S;
  if (N == 0) return cudaSuccess;
  if (!pair_supported(x, mod) || p.D <= 0 || p.D > ln_modulate_max_d(x, p.vectorized) || p.grid <= 0)
    return cudaErrorInvalidValue;
  if (p.nq > 0 && p.partial == nullptr) return cudaErrorInvalidValue;
  const BwdChoice c = bwd_dispatch(p, x, mod, p.gen);  // the generation the plan was made for
  if (c.fn == nullptr || c.gen != p.gen) return cudaErrorInvalidValue;
  c.fn<<<p.grid, c.threads, c.smem, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t ln_modulate_finalize(const FinalizeParams& p, cudaStream_t stream) {
  if (p.num_tiles == 0) return cudaSuccess;
  if (load_policy().finalize == 2) {
    cudaError_t e = launch_finalize_v2(p.partial, p.nq, p.q_mod, p.D, p.B, p.tiles_per_seg, p.dshift, p.dscale, stream);
    if (e != cudaSuccess) return e;
    return launch_finalize_v2(p.partial, p.nq, p.q_aff, p.D, 1, p.num_tiles, p.dweight, p.dbias, stream);
  }
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
