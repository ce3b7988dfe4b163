"""Sparse-attention cost: per-layer x head densities, the kernel's efficiency curve, rho_eff(S).

With block-sparse attention the calibrated per-sample cost (``ds_adaptive.planning.cost``)
``a*S + b*S^2`` becomes (per GPU, Ulysses degree ``sp``)::

    (a*S + b*S^2 * q(S) + sel(S)) / sp + comm(S)
    q(S)      = 1 - share * (1 - rho_eff(S))          only the attention part of b*S^2 scales
    rho_eff(S) = mean over layers l of r_l(S);  r_l = g(busiest_l(S)) where layer l runs sparse, else 1
    busiest_l(S) = max over SP ranks r of the mean density of r's heads in layer l under the head
                   placement (ds_adaptive.parallel.placement), each head in whole key blocks:
                   ceil(rho * nb) / nb with nb = ceil(S / block_size), at least min_blocks / nb
    g(rho)    = sparse time / dense time of the kernel at density rho (fwd+bwd): the chosen
                backend's curve (SparseAttentionBackend.efficiency: measured on this GPU, shipped, or
                the default from DSV.md's H100 anchors g(rho) = min(1, 1.45 * rho))
    sel(S)    = selection (block scoring, top-k) of the layers that run sparse, per sample:
                heads/sp * (t_token * S + t_logit * nq * S + t_pair * nq * nk) per such layer, ms,
                forward once; plus t_call per such layer once per micro-batch (``selection_call_ms``,
                which ``CostModel.batch_overhead`` adds to c0). ``ds_adaptive.planning.selection_cost``:
                the form, the shipped default, and the fit to this GPU's timings (``calibrate --sparse
                --selection``, stored in the profile's ``sparse_attention.selection``)

Layer l runs sparse at S (:meth:`SparseAttentionCost.layer_decisions`, the one decision the planner
and the runtime share) iff it is not a dense layer, ``busiest_l(S) <= dense_above``, and sparse
pays for one sample on one GPU: ``g * att(S) + sel_l(1, S) < att(S)`` with ``att(S) = share * b *
S^2 / layers / sp`` the layer's dense attention and ``sel_l(1, S)`` one layer's selection call for one
sample, its fixed part included (so images and short clips run dense where the selection would cost
more than the kernel saves; a micro-batch of several samples shares the fixed part: conservative).

Assumptions (stated because they shape every plan): ``share`` (the attention share of the
quadratic term) is 1.0 for Wan: its S^2 term is self-attention (the profile's depth rescaling makes
the same assumption); a layer that runs dense pays no selection; the SP group waits for its
busiest rank at every all-to-all, so that rank's density is the group's. With every density 1 (or
every layer dense) ``q = 1`` and ``sel = 0`` exactly: the dense model.

Density json (written by :meth:`DensityMap.save`, read by :func:`load_densities`)::

    {"num_layers": 30, "num_heads": 12, "density": [[0.1, ...12], ...30],
     "dense_layers": [0, 29], "step": 1200, "source": "..."}           # the last three optional

A run's ``metrics.jsonl`` works too: the last record with a ``head_density`` key (``[layers][heads]``,
optional ``dense_layers`` and ``step``) at or before ``--step`` is used.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from ds_adaptive.core.contracts import DensityError, DensityMap, KernelEfficiency
from ds_adaptive.parallel.placement import identity_placement, plan_head_placement
from ds_adaptive.planning.context_parallel import ContextParallelCost, MeshCost, head_degree
from ds_adaptive.planning.profile import PROFILES_DIR
from ds_adaptive.planning.selection_cost import DEFAULT_SELECTION, SelectionCost
from ds_adaptive.core.layout import heads_sp_problem

__all__ = ["SparseAttentionCost", "load_efficiency", "DEFAULT_SELECTION", "SPARSE_FORMAT"]

SPARSE_FORMAT = "ds_adaptive.sparse_attention/1"


def load_efficiency(src: Union[None, str, Path, Mapping[str, Any], KernelEfficiency]) -> KernelEfficiency:
    """A kernel efficiency curve: ``None``: the default; a KernelEfficiency; a dict; a json path (profile or
    sparse calibration); or a shipped profile name whose json has a ``sparse_attention`` section (else the
    default)."""
    if src is None:
        return KernelEfficiency.default()
    if isinstance(src, KernelEfficiency):
        return src
    if isinstance(src, Mapping):
        return KernelEfficiency.from_dict(src)
    path = Path(str(src))
    if not path.is_file():
        shipped = PROFILES_DIR / f"{src}.json"
        if not shipped.is_file():
            raise ValueError(f"sparse efficiency '{src}': not a file and not a shipped profile")
        data = json.loads(shipped.read_text())
        has = isinstance((data.get("sparse_attention") or {}).get("efficiency"), Mapping)
        return KernelEfficiency.from_dict(data, where=str(shipped)) if has else KernelEfficiency.default()
    return KernelEfficiency.from_dict(json.loads(path.read_text()), where=str(path))


@dataclass(frozen=True)
class SparseAttentionCost:
    """The sparse part of the cost model (see the module docstring).

    Args:
        densities: per layer x head densities (the profiler's latest).
        efficiency: the kernel's ``g(rho)`` (the chosen backend's curve:
            ``SparseAttentionBackend.efficiency``).
        head_placement: ``balanced`` (the run permutes heads with ds_adaptive.parallel.placement, as
            ``ds_adaptive.parallel.head_placement`` applies it) or ``identity`` (contiguous heads).
        attention_share: share of the calibrated ``b*S^2`` that is attention (1.0 for Wan).
        block_size, min_blocks: a head selects ``ceil(rho * nb)`` of the ``nb = ceil(S / block_size)``
            key blocks per query block, at least ``min_blocks`` (1 + ``keep_sink``), as the runtime's
            top-k does: the density it runs at. ``min_blocks = 0``: densities used as fractions.
        selection: the selection's cost (:class:`ds_adaptive.planning.selection_cost.SelectionCost`);
            None: the profile's measured one (``sparse_attention.selection``, taken by
            :meth:`for_profile` when measured for this ``block_size`` and ``block_score``), else the
            shipped default.
        block_score: the runtime's block scoring (``sparse_attention.block_score``): a measured
            selection counts only for the scoring it timed.
        attention_ms_per_token2_per_layer: dense attention fwd+bwd of one layer and one sample at
            sp = 1 (ms / token^2); ``CostModel`` fills it from the profile (``share * b / layers``).
            With it, a layer runs sparse at S only where that is faster than dense
            (:meth:`layer_decisions`); None: no such check.
        dense_above: a layer whose busiest rank's density is above this runs dense.
        pay_check: False: every eligible layer runs sparse, even where it is slower (a reference
            backend, whose point is exactness, not speed).
        context_parallel: the hybrid context-parallel model (``ds_adaptive.planning.context_parallel``);
            None or mode ``heads``: Ulysses. Otherwise the per-layer decision takes the busiest of the
            largest head-wise groups the SP degree allows (contiguous heads: no head placement), and
            :meth:`layer_meshes` gives every layer its ``(h, s)`` mesh.
    """

    densities: DensityMap
    efficiency: KernelEfficiency = field(default_factory=KernelEfficiency.default)
    head_placement: str = "balanced"
    attention_share: float = 1.0
    block_size: int = 128
    min_blocks: int = 1
    selection: Optional[SelectionCost] = None
    block_score: str = "pooled_lse"
    attention_ms_per_token2_per_layer: Optional[float] = None
    dense_above: float = 1.0
    pay_check: bool = True
    context_parallel: Optional[ContextParallelCost] = None

    def __post_init__(self) -> None:
        if self.head_placement not in ("balanced", "identity"):
            raise ValueError(f"head_placement must be 'balanced' or 'identity', got {self.head_placement!r}")
        if not 0.0 <= self.attention_share <= 1.0:
            raise ValueError(f"attention_share must be in [0, 1], got {self.attention_share}")
        if self.block_size < 1 or self.min_blocks < 0:
            raise ValueError(f"block_size >= 1 and min_blocks >= 0 needed, got {self.block_size}, {self.min_blocks}")
        if (self.attention_ms_per_token2_per_layer or 0.0) < 0:
            raise ValueError("attention_ms_per_token2_per_layer must be >= 0")

    # ------------------------------------------------------------------ placement
    def rank_density_tables(self, sp: int) -> np.ndarray:
        """``[layers, h, heads/h]`` densities of every head-wise rank's heads under the placement (``h = sp``
        under Ulysses; the largest head-wise size of the SP degree, contiguous heads, under hybrid context
        parallelism)."""
        if self.hybrid:
            return _rank_tables(self.densities, head_degree(sp, self.densities.num_heads), "identity")
        return _rank_tables(self.densities, sp, self.head_placement)

    @property
    def hybrid(self) -> bool:
        """Whether the context-parallel mode is not ``heads`` (meshes other than Ulysses may run)."""
        return self.context_parallel is not None and self.context_parallel.mode != "heads"

    def layer_meshes(self, seq_len: int, sp: int, sparse: Optional[Sequence[bool]] = None) -> tuple[MeshCost, ...]:
        """Every layer's mesh and its predicted cost at ``seq_len`` (padded) tokens, one sample: the solver's
        choice (``ds_adaptive.planning.context_parallel.choose_mesh``) at the layer's densities and whether it
        runs sparse (``sparse``: per layer, e.g. the runtime's schedule; default :meth:`layer_decisions`);
        Ulysses for every layer without a hybrid mode."""
        return _layer_meshes(self, int(seq_len), int(sp), None if sparse is None else tuple(bool(x) for x in sparse))

    def mesh_summary(self, seq_len: int, sp: int) -> str:
        """One line: which layers run on which ``h x s`` mesh at ``seq_len`` tokens (``config --check``, the dry run)."""
        meshes = [m.shape for m in self.layer_meshes(seq_len, sp)]
        runs, start = [], 0
        for i in range(1, len(meshes) + 1):
            if i == len(meshes) or meshes[i] != meshes[start]:
                span = f"{start}-{i - 1}" if i - 1 > start else f"{start}"
                runs.append(f"layers {span} {meshes[start][0]}x{meshes[start][1]}")
                start = i
        mode = self.context_parallel.mode if self.context_parallel is not None else "heads"
        return f"context_parallel {mode}, sp {sp}, {seq_len:,} tokens: " + ", ".join(runs) + " (head-wise x sequence-wise)"

    def context_parallel_comm_ms(self, seq_len: int, sp: int) -> float:
        """Predicted communication time of all layers for one sample on one rank (ms, fwd + recompute + bwd)."""
        return float(sum(m.comm_ms for m in self.layer_meshes(seq_len, sp)))

    def context_parallel_kv_gib(self, seq_len: int, sp: int) -> float:
        """The largest layer's fetched K / V (GiB) for one sample: held during that layer's forward and backward."""
        return max(m.extra_kv_bytes for m in self.layer_meshes(seq_len, sp)) / 2 ** 30

    # ------------------------------------------------------------------ the decision
    def layer_decisions(self, seq_len: int, sp: int) -> tuple[np.ndarray, np.ndarray]:
        """``(sparse [layers] bool, ratio [layers])`` at ``seq_len`` tokens (the sequence after the
        Ulysses padding): which layers run block-sparse, and their kernel time / dense time (1.0 for
        the dense ones). THE decision: the planner's cost (:meth:`quadratic_factor`,
        :meth:`selection_ms`) and the runtime (``SparseAttentionRuntime``) both call this.

        A layer runs sparse iff it is not in ``dense_layers``, its busiest SP rank's mean density (in
        whole blocks) is at most ``dense_above``, and (``pay_check``, with the attention coefficient
        known) ``g * dense + selection < dense`` for one sample on one GPU."""
        return _decisions(self, int(seq_len), int(sp))

    def layer_ratios(self, seq_len: int, sp: int) -> np.ndarray:
        """``[layers]`` kernel time / dense time at ``seq_len`` tokens (1.0 for layers that run dense)."""
        return self.layer_decisions(seq_len, sp)[1]

    def busiest_densities(self, seq_len: int, sp: int) -> np.ndarray:
        """``[layers]`` the busiest SP rank's mean density of each layer, in whole key blocks."""
        tables = self.rank_density_tables(sp)
        nb = max(1, -(-int(seq_len) // self.block_size))
        if self.min_blocks >= 1:  # whole blocks, as the runtime's top-k: ceil(rho * nb) in [min_blocks, nb]
            k = np.clip(np.ceil(tables * nb - 1e-9), min(self.min_blocks, nb), nb)
            return (k / nb).mean(axis=2).max(axis=1)
        return tables.mean(axis=2).max(axis=1)

    def rho_eff(self, seq_len: int, sp: int) -> float:
        """Mean over layers of the busiest rank's kernel time ratio (1.0: dense)."""
        return float(self.layer_ratios(seq_len, sp).mean())

    def quadratic_factor(self, seq_len: int, sp: int) -> float:
        """``q(S) = 1 - share * (1 - rho_eff(S))``: the factor on the calibrated ``b*S^2``; exactly 1.0
        when every layer runs dense."""
        return 1.0 - self.attention_share * (1.0 - self.rho_eff(seq_len, sp))

    @property
    def selection_cost(self) -> SelectionCost:
        """The selection's cost in use: :attr:`selection`, or the shipped default."""
        return self.selection if self.selection is not None else SelectionCost.default()

    def layer_selection_ms(self, seq_len: int, sp: int, num_heads: int, batch: int = 1) -> float:
        """One sparse layer's selection call for ``batch`` samples on one SP rank (``heads/sp`` heads), ms."""
        return float(self.selection_cost.call_ms(batch, float(seq_len), num_heads / sp, self.block_size))

    def selection_ms(self, seq_len: int, sp: int, num_heads: int) -> float:
        """Selection time each sample adds on one SP rank (ms): its share in every layer that runs sparse
        (the fixed part per call is :meth:`selection_call_ms`)."""
        n_sparse = int(np.sum(self.layer_decisions(seq_len, sp)[0]))
        if n_sparse == 0:
            return 0.0
        return n_sparse * float(self.selection_cost.per_sample_ms(float(seq_len), num_heads / sp, self.block_size))

    def selection_call_ms(self, seq_len: int, sp: int) -> float:
        """Fixed selection time of one micro-batch (ms): ``ms_per_call`` per layer that runs sparse."""
        n_sparse = int(np.sum(self.layer_decisions(seq_len, sp)[0]))
        return n_sparse * self.selection_cost.ms_per_call

    def with_densities(self, densities: DensityMap) -> "SparseAttentionCost":
        import dataclasses

        return dataclasses.replace(self, densities=densities)

    def for_profile(self, profile) -> "SparseAttentionCost":
        """With ``attention_ms_per_token2_per_layer`` from a calibrated profile (``share * b / layers``
        at sp = 1) and the profile's measured selection (``sparse_attention.selection``, else the shipped
        default), each unless already set; ``num_heads`` is the model's."""
        import dataclasses

        out = self
        if out.selection is None:
            out = dataclasses.replace(out, selection=SelectionCost.load_for(
                profile.raw, block_size=self.block_size, block_score=self.block_score, where=f"profile '{profile.name}'"))
        if out.attention_ms_per_token2_per_layer is None:
            per_layer = profile.b_ms_per_token2 * profile.sp * self.attention_share / profile.num_layers
            out = dataclasses.replace(out, attention_ms_per_token2_per_layer=per_layer)
        return out

    def describe(self) -> dict:
        """JSON-able description (resume state, logs): everything the cost depends on."""
        return {"densities": self.densities.as_dict(), "efficiency": self.efficiency.as_dict(),
                "head_placement": self.head_placement, "attention_share": self.attention_share,
                "block_size": self.block_size, "min_blocks": self.min_blocks,
                "selection": self.selection_cost.as_dict(), "block_score": self.block_score,
                "attention_ms_per_token2_per_layer": self.attention_ms_per_token2_per_layer,
                "dense_above": self.dense_above, "pay_check": self.pay_check,
                **({"context_parallel": self.context_parallel.describe()} if self.context_parallel else {})}

    @classmethod
    def from_description(cls, d: Mapping[str, Any]) -> "SparseAttentionCost":
        eff = d["efficiency"]
        att = d.get("attention_ms_per_token2_per_layer")
        return cls(densities=DensityMap.from_dict(d["densities"], where="sampler state"),
                   efficiency=KernelEfficiency(tuple(eff["density"]), tuple(eff["ratio"]), eff.get("source", "")),
                   head_placement=d["head_placement"], attention_share=float(d["attention_share"]),
                   block_size=int(d["block_size"]), min_blocks=int(d["min_blocks"]),
                   selection=_selection_from_description(d), block_score=str(d.get("block_score", "pooled_lse")),
                   attention_ms_per_token2_per_layer=None if att is None else float(att),
                   dense_above=float(d.get("dense_above", 1.0)), pay_check=bool(d.get("pay_check", True)),
                   context_parallel=(ContextParallelCost.from_description(d["context_parallel"])
                                     if d.get("context_parallel") else None))


def _selection_from_description(d: Mapping[str, Any]) -> SelectionCost:
    """The selection cost of a description; states written before the measured selection term carry
    per-head ``selection_ms_per_token(2)_per_head`` (per sample: ``a S + b S^2``) and a per-call term:
    the same time at the block size (``b S^2 ~ b * block * nq * S``)."""
    if "selection" in d:
        return SelectionCost.from_dict(d["selection"], where="sampler state")
    bs = int(d["block_size"])
    return SelectionCost(ms_per_call=float(d.get("selection_ms_per_layer_call", 0.0)),
                         ms_per_token=float(d["selection_ms_per_token_per_head"]),
                         ms_per_logit=float(d["selection_ms_per_token2_per_head"]) * bs,
                         ms_per_block_pair=0.0, block_size=bs, source="sampler state (per-head S, S^2 form)")


@lru_cache(maxsize=4096)
def _decisions(cost: SparseAttentionCost, seq_len: int, sp: int) -> tuple[np.ndarray, np.ndarray]:
    busiest = cost.busiest_densities(seq_len, sp)
    ratio = np.array([cost.efficiency(float(x)) for x in busiest])
    sparse = busiest <= cost.dense_above + 1e-12
    for layer in cost.densities.dense_layers:
        sparse[layer] = False
    if cost.pay_check:
        sparse &= ratio < 1.0
        if cost.attention_ms_per_token2_per_layer is not None:
            dense_ms = cost.attention_ms_per_token2_per_layer * float(seq_len) ** 2 / sp
            num_heads = cost.densities.num_heads
            sel = cost.layer_selection_ms(seq_len, sp, num_heads)
            sparse &= ratio * dense_ms + sel < dense_ms
    ratio = np.where(sparse, ratio, 1.0)
    sparse.setflags(write=False)
    ratio.setflags(write=False)
    return sparse, ratio


@lru_cache(maxsize=1024)
def _layer_meshes(cost: SparseAttentionCost, seq_len: int, sp: int, sparse) -> tuple[MeshCost, ...]:
    return (cost.context_parallel or ContextParallelCost()).layer_costs(cost, seq_len, sp, sparse)


@lru_cache(maxsize=64)
def _rank_tables(densities: DensityMap, sp: int, policy: str) -> np.ndarray:
    h = densities.num_heads

    problem = heads_sp_problem(h, sp, "the density table")
    if problem:
        raise DensityError(problem)
    d = np.array(densities.density, float)
    if policy == "balanced":
        placement = plan_head_placement(densities.density, sp, dense_layers=densities.dense_layers)
        perms = [placement.perm(layer, h) for layer in range(densities.num_layers)]
    else:
        perms = [identity_placement(h)] * densities.num_layers
    return np.stack([d[layer, perms[layer]].reshape(sp, h // sp) for layer in range(densities.num_layers)])
