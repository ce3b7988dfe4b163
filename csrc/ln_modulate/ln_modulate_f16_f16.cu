// Instantiates the LayerNorm-Modulate kernels for x = __half, shift/scale = __half.
#include "ln_modulate_kernels.cuh"

namespace ds_adaptive {
namespace ln_modulate {
DS_LN_MOD_INSTANTIATE(__half, __half)
}  // namespace ln_modulate
}  // namespace ds_adaptive
