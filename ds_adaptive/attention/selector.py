"""The selection half of the sparse runtime: which heads a rank holds, k per head, block scores, top-k.

:class:`BlockSelector` owns the low-rank predictor (its parameters; the profiler trains them) and turns
head-local q, k ``[B, S, Hl, Dh]`` into a :class:`~ds_adaptive.attention.selection.BlockSelection` (or None:
the selection would be denser than ``dense_above``, run dense). Per-head state is indexed by the original
head ids (a Ulysses head placement passes them as ``head_ids``).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ds_adaptive.core.config import SparseAttentionConfig
from ds_adaptive.attention.predictor import LowRankPredictor
from ds_adaptive.attention.scores import pooled_lse_scores
from ds_adaptive.attention.selection import BlockSelection, blocks_for_density, select_blocks

__all__ = ["BlockSelector"]


class BlockSelector:
    """Scores and selects key blocks for one model (all layers). ``head_offset / local_heads``: this rank's
    contiguous head slice after the Ulysses all-to-all (the default when no ``head_ids`` come)."""

    def __init__(self, cfg: SparseAttentionConfig, *, num_layers: int, num_heads: int, head_dim: int,
                 local_heads: int, head_offset: int, device: torch.device):
        self.cfg = cfg
        self.num_heads, self.local_heads, self.head_offset = num_heads, local_heads, head_offset
        self.predictor = LowRankPredictor(num_layers, num_heads, head_dim, cfg.predictor_rank, seed=cfg.seed).to(device)

    @property
    def uses_predictor(self) -> bool:
        """Whether the selection scores with the low-rank predictor (``block_score`` ``lse`` / ``mean``):
        only then is it trained on profiling steps."""
        return self.cfg.block_score != "pooled_lse"

    def local_heads_of(self, layer: int, q: torch.Tensor, head_ids) -> tuple[int, ...]:
        """The original ids of the heads on dim 2 of ``q``: ``head_ids`` from a Ulysses head placement
        (``apply_head_placement(..., head_ids_kwarg="head_ids")``), else this rank's contiguous slice."""
        if head_ids is None:
            return tuple(range(self.head_offset, self.head_offset + self.local_heads))
        heads = tuple(int(h) for h in head_ids)
        if len(heads) != q.shape[2] or len(set(heads)) != len(heads) or not all(0 <= h < self.num_heads for h in heads):
            raise ValueError(f"layer {layer}: head_ids {list(heads)} must be {q.shape[2]} distinct head ids in "
                             f"0..{self.num_heads - 1} (one per head on dim 2 of q {list(q.shape)})")
        return heads

    def head_k(self, layer: int, nk: int, heads: tuple[int, ...], head_density: torch.Tensor) -> torch.Tensor:
        """``[len(heads)]`` int64 key blocks per query block: ``forced_density``, else each head's profiled
        density (``head_density [L, H]``, NaN = not profiled: dense) clamped to ``[min_density, max_density]``."""
        cfg = self.cfg
        if cfg.forced_density is not None:
            return blocks_for_density(torch.full((len(heads),), cfg.forced_density), nk)
        dens = head_density[layer, list(heads)]
        return blocks_for_density(torch.nan_to_num(dens, nan=1.0), nk,
                                  min_density=cfg.min_density, max_density=cfg.max_density)

    def head_arg(self, heads: tuple[int, ...]):
        """The predictor's head argument: the int offset for a contiguous slice (a view), else the ids."""
        h0 = heads[0]
        return h0 if heads == tuple(range(h0, h0 + len(heads))) else heads

    @torch.no_grad()
    def block_scores(self, layer: int, q: torch.Tensor, k: torch.Tensor, heads: tuple[int, ...]) -> torch.Tensor:
        """``[B, H, nq, nk]`` fp32 scores of ``cfg.block_score`` for q, k ``[B, S, Hl, Dh]``."""
        cfg = self.cfg
        if not self.uses_predictor:
            return pooled_lse_scores(q, k, cfg.block_size)
        return self.predictor.block_scores(layer, q, k, cfg.block_size, self.head_arg(heads), mode=cfg.block_score)

    @torch.no_grad()
    def select(self, layer: int, q: torch.Tensor, k: torch.Tensor, heads: tuple[int, ...],
               head_density: torch.Tensor) -> tuple[Optional[BlockSelection], float]:
        """(selection or None, its selected share known on the host: mean k / nk) over the S = q.shape[1]
        tokens; None when that share is above ``dense_above`` (the layer runs dense)."""
        cfg = self.cfg
        s = q.shape[1]
        nk = math.ceil(s / cfg.block_size)
        kph = self.head_k(layer, nk, heads, head_density)
        density = float(kph.float().mean()) / nk
        if density > cfg.dense_above:
            return None, density
        scores = self.block_scores(layer, q, k, heads)
        return select_blocks(scores, kph, seq_len=s, block_size=cfg.block_size, keep_sink=cfg.keep_sink,
                             inplace=True), density
