"""DSV dynamic sparse attention for the Wan DiT (docs/SPARSE.md).

cube_order (token permutation into 3D cubes), predictor (rank-r q/k projections), selection (block
top-k), profiler (exact density / recall on sampled rows), backends (the block-sparse kernels behind
one interface: flex, reference, ...), attention (shared op pieces, dense SDPA), schedule (two
stages), runtime (the per-model attention fn), telemetry (density PNG).
"""
import importlib

# Loaded on first use (PEP 562), so that the kernels (``ds_adaptive.attention.backends``) import with torch
# alone: the runtime needs the config (pydantic), a GPU probe of a backend does not.
_EXPORTS = {
    "SparseKernelError": "attention", "dense_attention": "attention",
    "block_mask_from_selection": "backends.flex", "flex_block_sparse_attention": "backends.flex",
    "masked_attention_reference": "backends.reference",
    "CubeOrder": "cube_order", "CubeOrderError": "cube_order", "cube_permutation": "cube_order",
    "inverse_permutation": "cube_order",
    "LowRankPredictor": "predictor", "SparseAttentionRuntime": "runtime", "SparseSchedule": "schedule",
    "BlockSelection": "selection", "blocks_for_density": "selection", "pool_blocks": "selection",
    "select_blocks": "selection",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{mod}"), name)
