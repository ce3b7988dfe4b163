"""The decision half of the sparse runtime: "sparse only where it pays", at the densities the layers run at.

:class:`LayerDecision` holds the planner's decision cost (a ``planning.sparse_cost.SparseAttentionCost``,
duck-typed: ``with_densities``, ``layer_decisions``, ``layer_selection_ms``, ``densities``) with its
densities replaced by the runtime's effective ones after every step, caches its per-sequence-length rows
and counts the layer calls that ran sparse / dense by cost.
"""
from __future__ import annotations

from typing import Optional, Sequence

from ds_adaptive.core.contracts import DensityMap

__all__ = ["LayerDecision"]


class LayerDecision:
    """``template``: the planner's decision cost (None: no cost check, every scheduled layer runs sparse)."""

    def __init__(self, template=None, *, sp_size: int = 1):
        self.template = template
        self.sp_size = sp_size
        self.cost = None
        self._decided: dict = {}
        # layer calls of the schedule's sparse layers that ran sparse / dense (the cost check), whole run
        self.calls = {"sparse": 0, "dense_by_cost": 0}

    def runs_sparse(self, layer: int, seq_len: int) -> bool:
        """Whether a sparse layer of the schedule runs block-sparse at ``seq_len`` tokens (the full,
        Ulysses-padded sequence): the planner's decision (``SparseAttentionCost.layer_decisions``) at
        the densities the layers run at; True without a decision cost. Counts the call."""
        if self.cost is None:
            return True
        row = self._decided.get(seq_len)
        if row is None:  # once per sequence length and density table (hashing the cost per call is not free)
            row = self._decided[seq_len] = self.cost.layer_decisions(seq_len, self.sp_size)[0]
        ok = bool(row[layer])
        self.calls["sparse" if ok else "dense_by_cost"] += 1
        return ok

    def refresh(self, table: Sequence[Sequence[float]], dense_layers: Sequence[int]) -> None:
        """The decision cost at ``table`` (``[layers][heads]`` effective densities; after a step or a resume)."""
        if self.template is None:
            return
        table = tuple(tuple(r) for r in table)
        if self.cost is not None and self.cost.densities.density == table:
            return  # unchanged (most stage-2 steps): keep the cost object and its cached decisions
        self._decided = {}
        self.cost = self.template.with_densities(
            DensityMap(table, dense_layers=tuple(sorted(dense_layers)), source="sparse runtime"))

    def warm_shapes(self, shapes, *, low: float, num_layers: int, num_heads: int,
                    dense_layers: Sequence[int]) -> list[tuple[int, int]]:
        """The ``(B, S)`` pairs of ``shapes`` where some layer runs sparse at all at density ``low`` (every
        pair without a decision cost), sorted and unique."""
        probe: Optional[object] = None
        if self.template is not None:
            probe = self.template.with_densities(
                DensityMap(tuple((low,) * num_heads for _ in range(num_layers)), dense_layers=tuple(sorted(dense_layers))))
        return sorted({(int(b), int(s)) for b, s in shapes
                       if probe is None or bool(probe.layer_decisions(int(s), self.sp_size)[0].any())})
