// Benchmark-only kernel-configuration alternatives for x = bf16, modulation = fp32 at D = 1536 and
// D = 5120 (the Wan 2.1 1.3B / 14B hidden sizes), selected with ln_modulate_set_tuning(slot,
// variant); variant 0 of every slot is the shipped default (an empty choice here, so that
// fwd_select / bwd_select use their own table). Names: bench/kernels/ln_modulate.py TUNE.
// A translation unit of its own so that it compiles in parallel with the dtype pairs; no kernel
// instantiated here is also instantiated in a pair unit (each kernel is registered by one module).
#include "ln_modulate_kernels.cuh"

namespace ds_adaptive {
namespace ln_modulate {

using BF = __nv_bfloat16;

FwdChoice fwd_tuned_bf16_f32(const FwdParams& p, int gen) {
  if (!p.vectorized) return FwdChoice{};
  if (gen == 1 && p.D == 1536) {
    switch (tuning_variant(0)) {
      case 1: return fwd_make<BF, float, 8, 6, 32, 4, true>();
      case 2: return fwd_make<BF, float, 8, 1, 192, 1, true>();
      case 3: return fwd_make<BF, float, 8, 3, 64, 1, true>();
      case 4: return fwd_make<BF, float, 8, 2, 96, 1, true, true, false>();
      case 5: return fwd_make<BF, float, 8, 2, 96, 1, true, true, true>();
      default: break;
    }
  }
  if (gen == 1 && p.D == 5120) {
    switch (tuning_variant(1)) {
      case 1: return fwd_make<BF, float, 8, 4, 160, 1, true>();
      case 2: return fwd_make<BF, float, 8, 2, 320, 1, true>();
      case 3: return fwd_make<BF, float, 8, 1, 640, 1, true>();
      case 4: return fwd_make<BF, float, 8, 4, 160, 1, true, true, false>();
      case 5: return fwd_make<BF, float, 8, 5, 128, 1, true, false, true>();
      default: break;
    }
  }
  // v2: TPRxNV, stages per-sample / per-token
  if (gen == 2 && p.D == 1536) {
    switch (tuning_variant(4)) {
      case 1: return fwd_make_v2<BF, float, 2, 96, 3, 3, true>(p);
      case 2: return fwd_make_v2<BF, float, 1, 192, 4, 2, true>(p);
      case 3: return fwd_make_v2<BF, float, 3, 64, 4, 2, true>(p);
      case 4: return fwd_make_v2<BF, float, 2, 96, 2, 3, true>(p);
      case 5: return fwd_make_v2<BF, float, 6, 32, 4, 2, true>(p);
      default: break;
    }
  }
  if (gen == 2 && p.D == 5120) {
    switch (tuning_variant(5)) {
      case 1: return fwd_make_v2<BF, float, 4, 160, 3, 2, true>(p);
      case 2: return fwd_make_v2<BF, float, 5, 128, 4, 3, true>(p);
      case 3: return fwd_make_v2<BF, float, 2, 320, 3, 2, true>(p);
      case 4: return fwd_make_v2<BF, float, 5, 128, 2, 3, true>(p);
      case 5: return fwd_make_v2<BF, float, 1, 640, 3, 2, true>(p);
      default: break;
    }
  }
  return FwdChoice{};
}

BwdChoice bwd_tuned_bf16_f32(const BwdParams& p, int gen) {
  if (!p.vectorized) return BwdChoice{};
  if (gen == 1 && p.D == 1536) {
    switch (tuning_variant(2)) {
      case 1: return bwd_make_noaffine<BF, float, 8, 2, 96, true>(p);
      case 2: return bwd_make_noaffine<BF, float, 8, 3, 64, true>(p);
      case 3: return bwd_make_noaffine<BF, float, 8, 6, 32, true>(p);
      case 4: return bwd_make_noaffine<BF, float, 8, 1, 192, true, true>(p);
      case 5: return bwd_make_noaffine<BF, float, 8, 2, 96, true, true>(p);
      default: break;
    }
  }
  if (gen == 1 && p.D == 5120) {
    switch (tuning_variant(3)) {
      case 1: return bwd_make_noaffine<BF, float, 8, 2, 320, true>(p);
      case 2: return bwd_make_noaffine<BF, float, 8, 4, 160, true>(p);
      case 3: return bwd_make_noaffine<BF, float, 8, 1, 640, true>(p);  // the v1 default before 128x5
      case 4: return bwd_make_noaffine<BF, float, 8, 1, 640, true, true>(p);
      case 5: return bwd_make_noaffine<BF, float, 8, 2, 320, true, true>(p);
      default: break;
    }
  }
  if (gen == 2 && p.D == 1536) {
    switch (tuning_variant(6)) {
      case 1: return bwd_make_v2_noaffine<BF, float, 2, 96, 4, 3>(p);
      case 2: return bwd_make_v2_noaffine<BF, float, 1, 192, 3, 2>(p);
      case 3: return bwd_make_v2_noaffine<BF, float, 3, 64, 4, 3>(p);
      case 4: return bwd_make_v2_noaffine<BF, float, 1, 192, 6, 4>(p);
      case 5: return bwd_make_v2_noaffine<BF, float, 2, 96, 3, 2>(p);
      default: break;
    }
  }
  if (gen == 2 && p.D == 5120) {
    switch (tuning_variant(7)) {
      case 1: return bwd_make_v2_noaffine<BF, float, 1, 640, 3, 2>(p);
      case 2: return bwd_make_v2_noaffine<BF, float, 5, 128, 3, 2>(p);
      case 3: return bwd_make_v2_noaffine<BF, float, 1, 640, 4, 3>(p);
      case 4: return bwd_make_v2_noaffine<BF, float, 4, 160, 3, 2>(p);
      case 5: return bwd_make_v2_noaffine<BF, float, 2, 320, 4, 3>(p);
      default: break;
    }
  }
  return BwdChoice{};
}

}  // namespace ln_modulate
}  // namespace ds_adaptive
