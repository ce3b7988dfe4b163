"""Start-up checks of a sparse-attention config against the model and the device: pure functions,
for the one validation pass (``config --check``, the dry run, the trainer) to call.

    problems = check_sparse_config(cfg, num_layers=30, device_type="cuda", head_dim=128)   # errors
    notes = sparse_config_notes(cfg, num_layers=30)                                         # one-liners

Each entry is one line naming the key, the expected and actual value, and what to do.
"""
from __future__ import annotations

from typing import Optional

import torch

from ds_adaptive.attention.backends.registry import backend_names, get_backend

__all__ = ["check_sparse_config", "sparse_config_notes"]

KEY = "adaptive_load.sparse_attention"


def _dense_layers(cfg, num_layers: int) -> list[int]:
    return list(cfg.dense_layers) if cfg.dense_layers is not None else sorted({0, num_layers - 1})


def check_sparse_config(cfg, num_layers: int, device_type: str, *, head_dim: Optional[int] = None,
                        dtype: Optional[torch.dtype] = None, max_tokens: Optional[int] = None,
                        training: bool = True) -> list[str]:
    """What the trainer would reject, as one line each (empty: fine). ``cfg``: a
    :class:`~ds_adaptive.core.config.SparseAttentionConfig`; ``device_type``: ``cuda`` / ``cpu`` /
    ``meta`` (a dry run of a GPU launch); ``max_tokens``: the longest sequence of the data (checked
    against a backend's limit). Disabled sparse attention has no problems."""
    if not cfg.enabled:
        return []
    if cfg.backend != "auto" and cfg.backend not in backend_names():
        return [f"{KEY}.backend: unknown sparse-attention backend '{cfg.backend}'; use 'auto' or one of {backend_names()}"]
    out = []
    bad = [i for i in _dense_layers(cfg, num_layers) if not 0 <= i < num_layers]
    if bad:
        out.append(f"{KEY}.dense_layers has {bad}, outside the model's layers 0..{num_layers - 1}; use indices in that "
                   "range (or leave dense_layers out: first and last layer)")
    if head_dim is not None and cfg.predictor_rank > head_dim:
        out.append(f"{KEY}.predictor_rank = {cfg.predictor_rank} is larger than the head dim {head_dim}; use <= {head_dim}")
    kw = dict(dtype=dtype, head_dim=head_dim, block_size=cfg.block_size, backward=training)
    if cfg.backend != "auto":
        b = get_backend(cfg.backend)
        why = b.unsupported(device_type, **kw)
        if why is not None:
            fits = [n for n in backend_names() if get_backend(n).unsupported(device_type, **kw) is None]
            out.append(f"{KEY}.backend is '{cfg.backend}' but {why}; use 'auto' or one that runs on {device_type} "
                       f"({', '.join(fits) or 'none'})")
            return out
        chosen = b
    else:
        ok = [get_backend(n) for n in backend_names() if get_backend(n).unsupported(device_type, **kw) is None]
        if not ok:
            out.append(f"{KEY}.backend is 'auto' but no sparse-attention backend runs on {device_type} with block_size "
                       f"{cfg.block_size}" + (f", head dim {head_dim}" if head_dim else "") + "; check block_size")
            return out
        fused = [b for b in ok if not b.support.materialises_scores]
        chosen = fused[0] if fused else ok[0]
    limit = chosen.support.max_tokens
    if max_tokens is not None and limit is not None and max_tokens > limit:
        out.append(f"{KEY}.backend '{cfg.backend}' runs '{chosen.name}' on {device_type}, which takes at most "
                   f"{limit:,} tokens; the data has samples of {max_tokens:,}: run on a GPU with a block-sparse backend "
                   "or use shorter samples")
    return out


def sparse_config_notes(cfg, num_layers: int) -> list[str]:
    """Lines for start-up where sparse attention will not run where it was asked (not errors)."""
    if not cfg.enabled:
        return []
    out = []
    dense = {i for i in _dense_layers(cfg, num_layers) if 0 <= i < num_layers}
    if len(dense) >= num_layers:
        out.append(f"note: {KEY} is enabled but every layer of the {num_layers}-layer model is in dense_layers "
                   f"({sorted(dense)}): every layer runs dense attention (set dense_layers, or train more layers)")
    if cfg.forced_density is not None and cfg.forced_density > cfg.dense_above:
        out.append(f"note: {KEY}.forced_density {cfg.forced_density} is above dense_above {cfg.dense_above}: every "
                   "layer runs dense attention")
    return out
