// Instantiates the LayerNorm-Modulate kernels for x = float, shift/scale = float.
#include "ln_modulate_kernels.cuh"

namespace ds_adaptive {
namespace ln_modulate {
DS_LN_MOD_INSTANTIATE(float, float)
}  // namespace ln_modulate
}  // namespace ds_adaptive
