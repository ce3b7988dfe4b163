// Instantiates the LayerNorm-Modulate kernels for x = __nv_bfloat16, shift/scale = __nv_bfloat16.
#include "ln_modulate_kernels.cuh"

namespace ds_adaptive {
namespace ln_modulate {
DS_LN_MOD_INSTANTIATE(__nv_bfloat16, __nv_bfloat16)
}  // namespace ln_modulate
}  // namespace ds_adaptive
