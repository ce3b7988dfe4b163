"""DSV dynamic sparse attention for the Wan DiT (docs/SPARSE.md).

cube_order (token permutation into 3D cubes), predictor (rank-r q/k projections), selection (block
top-k), profiler (exact density / recall on sampled rows), backends (the block-sparse kernels behind
one interface: flex, reference, ...), attention (shared op pieces, dense SDPA), schedule (two
stages), runtime (the per-model attention fn), telemetry (density PNG).
"""
from ds_adaptive.sparse.attention import SparseKernelError, dense_attention
from ds_adaptive.sparse.backends.flex import block_mask_from_selection, flex_block_sparse_attention
from ds_adaptive.sparse.backends.reference import masked_attention_reference
from ds_adaptive.sparse.cube_order import CubeOrder, CubeOrderError, cube_permutation, inverse_permutation
from ds_adaptive.sparse.predictor import LowRankPredictor
from ds_adaptive.sparse.runtime import SparseAttentionRuntime
from ds_adaptive.sparse.schedule import SparseSchedule
from ds_adaptive.sparse.selection import BlockSelection, blocks_for_density, pool_blocks, select_blocks

__all__ = ["BlockSelection", "CubeOrder", "CubeOrderError", "LowRankPredictor", "SparseAttentionRuntime",
           "SparseKernelError", "SparseSchedule", "block_mask_from_selection", "blocks_for_density",
           "cube_permutation", "dense_attention", "flex_block_sparse_attention", "inverse_permutation",
           "masked_attention_reference", "pool_blocks", "select_blocks"]
