"""Block-sparse attention kernels over a compact :class:`~ds_adaptive.attention.selection.BlockSelection`.

* :mod:`.triton_block_sparse`: our Triton kernels (forward, dQ, dK/dV without atomics), sequence length
  and batch at run time (no compile per S), tile configs from :mod:`.triton_configs` (a measured table);
* :mod:`.triton_block_scores`: the fused pooled log-sum-exp block scores of the default selection (logits
  kept in registers); its reference is :func:`ds_adaptive.attention.scores.pooled_lse_scores_torch`, and
  :func:`ds_adaptive.attention.scores.pooled_lse_scores` dispatches between the two;
* :mod:`.reference`: the masked dense reference (output and log-sum-exp) the tests compare with.

Importing this package never imports triton; the kernels compile at their first call.
"""
from ds_adaptive.attention.kernels.reference import reference_attention
from ds_adaptive.attention.kernels.triton_block_sparse import (compiled_kernels, triton_block_sparse_attention,
                                                            triton_status)
from ds_adaptive.attention.kernels.triton_block_scores import ScoreTiles, scores_unsupported, triton_pooled_lse_scores
from ds_adaptive.attention.kernels.triton_configs import KernelConfig, TileConfig, config_for, default_config

__all__ = ["KernelConfig", "ScoreTiles", "TileConfig", "compiled_kernels", "config_for", "default_config",
           "reference_attention", "scores_unsupported", "triton_block_sparse_attention", "triton_pooled_lse_scores",
           "triton_status"]
