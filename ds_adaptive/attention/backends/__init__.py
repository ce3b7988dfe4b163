"""Block-sparse attention kernels behind one interface (:mod:`.base`), chosen by name or measured
speed (:mod:`.registry`), with their efficiency curves (:mod:`.measure`) and the start-up checks of
a sparse-attention config (:mod:`.check`).

    from ds_adaptive.attention.backends import get_backend, select_backend, check_sparse_config
    out = get_backend("flex").attention(q, k, v, selection, valid_len=None, density=0.1)

Shipped: ``flex`` (compiled FlexAttention, dynamic shapes; CUDA fwd+bwd, CPU forward) and
``reference`` (masked dense torch, S^2: the exactness reference and the CPU path). A new kernel is
one file here with a registered :class:`SparseAttentionBackend` subclass (add its module name to
``registry.BUILTIN_MODULES``) plus its tests.
"""
from ds_adaptive.attention.backends.base import BackendSupport, SparseAttentionBackend, SparseBackendError, WarmupShape
from ds_adaptive.attention.backends.registry import (BackendChoice, backend_names, get_backend, register_backend,
                                                  select_backend)

__all__ = ["BackendChoice", "BackendSupport", "SparseAttentionBackend", "SparseBackendError", "WarmupShape",
           "backend_names", "get_backend", "register_backend", "select_backend"]
