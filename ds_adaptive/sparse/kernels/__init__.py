"""Block-sparse attention kernels over a compact :class:`~ds_adaptive.sparse.selection.BlockSelection`.

* :mod:`.triton_block_sparse`: our Triton kernels (forward, dQ, dK/dV without atomics), sequence length
  and batch at run time (no compile per S), tile configs from :mod:`.triton_configs` (a measured table);
* :mod:`.reference`: the masked dense reference (output and log-sum-exp) the tests compare with.

Importing this package never imports triton; the kernels compile at their first call.
"""
from ds_adaptive.sparse.kernels.reference import reference_attention
from ds_adaptive.sparse.kernels.triton_block_sparse import (compiled_kernels, triton_block_sparse_attention,
                                                            triton_status)
from ds_adaptive.sparse.kernels.triton_configs import KernelConfig, TileConfig, config_for, default_config

__all__ = ["KernelConfig", "TileConfig", "compiled_kernels", "config_for", "default_config", "reference_attention",
           "triton_block_sparse_attention", "triton_status"]
