"""The hybrid context-parallel cost model and the per-layer mesh solver (pure functions, no torch).

An SP group of ``k`` ranks runs a layer's self-attention as an ``(h, s)`` mesh, ``h * s = k`` and ``h`` a
divisor of the heads (``ds_adaptive.parallel.mesh``): a head-wise all-to-all inside groups of ``h``
consecutive ranks, then sequence-wise sparse attention inside groups of ``s`` ranks that fetch only the key
blocks their queries selected (``ds_adaptive.attention.sequence_parallel``). ``(k, 1)`` is Ulysses.

Bytes per rank, per layer and sample (sent to other ranks; ``e`` bytes per element, ``D = H * Dh``, ``S`` the
padded sequence, every chunk whole blocks)::

    head-wise, per pass        4 * (S / k) * D * (h - 1) / h * e          q, k, v (one stacked all-to-all), out
    sequence-wise, per pass    2 * f * S * (s - 1) / s * (D / h) * e       K and V of the fetched blocks
                               (+ the same back as dK, dV in the backward)
    selection (once a step)    (s - 1) * nq_loc * (H / h) * r * e_s        query-block summaries (all-gather)
                               + (s - 1) * nq_loc^2 * (H / h) * 4          score rows (all-to-all, fp32)
    fetch plan, per pass       8 * (s - 1) + 8 * units                    counts, unit ids (int64)

``nq_loc = S / s / block`` query blocks per rank, ``units = f * (S / block) * (s - 1) / s * H / h`` fetched
(head, block) units, ``r, e_s`` the summary width and element size (``Dh`` and q's for ``pooled_lse``, the
predictor rank and 4 for the predictor's scores).

``f`` (the *fetch share*) is the share of the other ranks' (sample, head, key block) units that some query
block of this rank selected. The runtime counts it exactly; the planner estimates it from the density
``rho`` (share of key blocks one query block selects) and ``n`` query blocks per rank with
:func:`fetch_share`: ``f = 1 - (1 - rho) ** (1 + (n - 1) * (1 - overlap))``, ``overlap`` the share of
selected blocks adjacent query blocks have in common (DSV: > 0.9 on trained video DiTs; an assumption
until measured on a trained model).

Per training step a layer runs its forward ``passes`` times (2 with activation checkpointing: forward and
recomputed forward) and its backward once: the forward-direction bytes count ``passes`` times, the
gradient-direction ones (head-wise out / q, k, v gradients, dK / dV) once.

Time (ms) per layer and sample on one rank::

    attention = g(rho_busiest(h)) * a * S^2 / k          a = the layer's dense attention ms / token^2 at sp 1
    comm      = sum over groups of max(intra bytes / intra GB/s, inter bytes / inter GB/s) + latency per collective

``rho_busiest(h)``: the densest head-wise rank (its H / h heads' mean density, contiguous heads); a
sequence-wise group splits the queries evenly, so it adds no imbalance. ``g``: the kernel's efficiency
curve (sparse / dense time). A group's peers are intra-node when they share the rank's node
(``gpus_per_node`` consecutive ranks). Nothing here is measured: the link bandwidths and the overlap are
configured (``adaptive_load.sparse_attention.context_parallel_cost``), and no GPU run has checked the
times yet.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

__all__ = ["CPLinks", "MeshCost", "mesh_shapes", "fetch_share", "head_bytes", "sequence_bytes", "selection_bytes",
           "plan_bytes", "ContextParallelCost", "CP_MODES",
           "mesh_cost", "choose_mesh", "crossover_density", "ulysses_possible", "head_degree"]

CP_MODES = ("heads", "sequence", "auto")


@dataclass(frozen=True)
class CPLinks:
    """What the comm model needs about the machine and the selections (``context_parallel_cost``)."""

    intra_node_gbps: float = 150.0
    """All-to-all bandwidth per GPU between GPUs of one node, GB/s (the shipped profiles' estimate)."""
    inter_node_gbps: float = 25.0
    """All-to-all bandwidth per GPU between nodes, GB/s."""
    gpus_per_node: int = 8
    """GPUs per node (consecutive ranks)."""
    latency_us: float = 30.0
    """Fixed time per collective, microseconds."""
    query_block_overlap: float = 0.9
    """Share of selected key blocks two adjacent query blocks have in common (the fetch-share estimate)."""
    elem_bytes: int = 2
    """Bytes per activation element (bf16)."""
    passes: int = 2
    """Forward passes per step (2: activation checkpointing recomputes the forward)."""

    def __post_init__(self) -> None:
        if min(self.intra_node_gbps, self.inter_node_gbps) <= 0 or self.gpus_per_node < 1 or self.latency_us < 0:
            raise ValueError(f"context-parallel links need positive bandwidths and gpus_per_node >= 1, got {self}")
        if not 0.0 <= self.query_block_overlap <= 1.0:
            raise ValueError(f"query_block_overlap must be in [0, 1], got {self.query_block_overlap}")


def mesh_shapes(sp: int, num_heads: int) -> list[tuple[int, int]]:
    """Every ``(h, s)`` with ``h * s = sp`` and ``h`` dividing the heads, h descending."""
    return [(h, sp // h) for h in range(sp, 0, -1) if sp % h == 0 and num_heads % h == 0]


def ulysses_possible(sp: int, num_heads: int) -> bool:
    return num_heads % sp == 0


def head_degree(sp: int, num_heads: int) -> int:
    """The largest head-wise size an SP group of ``sp`` can have (``sp`` itself where Ulysses runs)."""
    return mesh_shapes(sp, num_heads)[0][0]


def fetch_share(rho: float, query_blocks: int, overlap: float) -> float:
    """Estimated share of the other ranks' key blocks that ``query_blocks`` consecutive query blocks of one
    rank select together, each selecting a share ``rho``: the union of ``1 + (n - 1) * (1 - overlap)``
    independent selections."""
    rho = min(1.0, max(0.0, float(rho)))
    n_eff = 1.0 + max(0, int(query_blocks) - 1) * (1.0 - overlap)
    return 1.0 - (1.0 - rho) ** n_eff


def head_bytes(seq_len: int, dim: int, sp: int, h: int, elem: int) -> tuple[float, float]:
    """(forward, backward) bytes one rank sends in the head-wise all-to-alls of one pass (q, k, v and out)."""
    one = 4.0 * seq_len / sp * dim * (h - 1) / h * elem
    return one, one


def sequence_bytes(seq_len: int, dim: int, h: int, s: int, share: float, elem: int) -> tuple[float, float]:
    """(forward, backward) K + V bytes one rank receives (forward) and sends back (dK, dV) for a fetch share."""
    one = 2.0 * share * seq_len * (s - 1) / s * dim / h * elem
    return one, one


def selection_bytes(seq_len: int, num_heads: int, h: int, s: int, block: int, summary_dim: int,
                    summary_elem: int) -> float:
    """Forward bytes one rank sends for the sequence-wise selection (once per step: the recompute reuses it):
    its query-block summaries to the ``s - 1`` others (all-gather) and the score rows of its key blocks for
    their query blocks (fp32 all-to-all)."""
    if s == 1:
        return 0.0
    nq_loc = seq_len // s // block
    heads = num_heads // h
    return (s - 1) * nq_loc * heads * summary_dim * summary_elem + (s - 1) * nq_loc * nq_loc * heads * 4


def plan_bytes(s: int, units: float) -> float:
    """Forward bytes of one fetch plan (per pass): a count to each other rank and the wanted unit ids (int64)."""
    return 0.0 if s == 1 else 8.0 * (s - 1) + 8.0 * units


@dataclass(frozen=True)
class MeshCost:
    """One layer's predicted cost on one rank under one mesh (per sample, per training step)."""

    heads: int
    seq: int
    attention_ms: float
    comm_ms: float
    bytes: float
    fetch_share: float
    extra_kv_bytes: float
    """Memory of the fetched K / V blocks held during the layer's forward and its backward."""

    @property
    def total_ms(self) -> float:
        return self.attention_ms + self.comm_ms

    @property
    def shape(self) -> tuple[int, int]:
        return (self.heads, self.seq)


def _intra_share(h: int, s: int, gpus_per_node: int) -> tuple[float, float]:
    """(head-wise, sequence-wise) share of a rank's group peers inside its node (``gpus_per_node`` consecutive
    ranks per node; a head-wise group is ``h`` consecutive ranks, a sequence-wise one strides by ``h``)."""
    g = gpus_per_node
    head = 1.0 if h <= 1 else (min(h, g) - 1) / (h - 1)
    if s <= 1:
        return head, 1.0
    same_node = max(1, min(s, g // h)) if h <= g else 1
    return head, (same_node - 1) / (s - 1)


def _group_ms(nbytes: float, intra_share: float, links: CPLinks) -> float:
    return max(nbytes * intra_share / (links.intra_node_gbps * 1e6),
               nbytes * (1.0 - intra_share) / (links.inter_node_gbps * 1e6))


def _busiest(densities: Sequence[float], h: int) -> float:
    n = len(densities) // h
    return max(sum(densities[i * n:(i + 1) * n]) / n for i in range(h))


def mesh_cost(h: int, s: int, *, seq_len: int, densities: Sequence[float], head_dim: int, block: int,
              attention_ms_per_token2: float, efficiency: Callable[[float], float], links: CPLinks,
              sparse: bool = True, summary_dim: Optional[int] = None) -> MeshCost:
    """The cost of one layer under mesh ``(h, s)`` (see the module docstring). ``densities``: the layer's per-head
    densities (all 1 for a dense layer; ``sparse=False`` prices dense attention); ``seq_len``: padded tokens;
    ``attention_ms_per_token2``: the layer's dense attention fwd+bwd ms / token^2 for one sample on one GPU."""
    heads = len(densities)
    sp = h * s
    dim = heads * head_dim
    e = links.elem_bytes
    g = efficiency(_busiest(densities, h)) if sparse else 1.0
    attention = g * attention_ms_per_token2 * float(seq_len) ** 2 / sp
    nq_loc = max(1, seq_len // s // block)
    share = 0.0 if s == 1 else (fetch_share(sum(densities) / heads, nq_loc, links.query_block_overlap)
                                if sparse else 1.0)
    hf, hb = head_bytes(seq_len, dim, sp, h, e)
    sf, sb = sequence_bytes(seq_len, dim, h, s, share, e)
    units = share * (seq_len // block) * (s - 1) / s * heads / h
    sel = selection_bytes(seq_len, heads, h, s, block, summary_dim or head_dim, e) if sparse else 0.0
    pb = plan_bytes(s, units)
    head_share, seq_share = _intra_share(h, s, links.gpus_per_node)
    p = links.passes
    comm = _group_ms(p * hf + hb, head_share, links) + _group_ms(sel + p * (pb + sf) + sb, seq_share, links)
    # head-wise: q/k/v and out per pass, their gradients; sequence-wise: summaries + scores once, counts, ids
    # and K/V per pass, dK/dV once
    collectives = (2 * p + 2 if h > 1 else 0) + ((2 if sparse else 0) + 3 * p + 1 if s > 1 else 0)
    comm += collectives * links.latency_us * 1e-3
    return MeshCost(h, s, attention, comm, p * (hf + pb + sf) + hb + sb + sel, share, sf)


def choose_mesh(*, sp: int, seq_len: int, densities: Sequence[float], head_dim: int, block: int,
                attention_ms_per_token2: float, efficiency: Callable[[float], float], links: CPLinks,
                mode: str = "auto", sparse: bool = True, memory_limit_bytes: Optional[float] = None) -> MeshCost:
    """The mesh of one layer: ``heads`` -> Ulysses; ``sequence`` -> ``(1, sp)`` where the layer runs sparse, else
    the largest head-wise size (Ulysses where the heads allow it); ``auto`` -> the cheapest of
    :func:`mesh_shapes` (ties: the larger head-wise size), among those whose fetched KV fits
    ``memory_limit_bytes`` (None: no limit). A pure function: the same inputs give the same mesh on every rank."""
    if mode not in CP_MODES:
        raise ValueError(f"context_parallel must be one of {CP_MODES}, got {mode!r}")
    heads = len(densities)
    shapes = mesh_shapes(sp, heads)
    kw = dict(seq_len=seq_len, densities=densities, head_dim=head_dim, block=block,
              attention_ms_per_token2=attention_ms_per_token2, efficiency=efficiency, links=links, sparse=sparse)
    if mode == "heads":
        if not ulysses_possible(sp, heads):
            raise ValueError(f"context_parallel 'heads' (Ulysses) needs sp ({sp}) to divide the {heads} heads")
        return mesh_cost(sp, 1, **kw)
    if mode == "sequence":
        h = 1 if sparse else shapes[0][0]
        return mesh_cost(h, sp // h, **kw)
    costs = [mesh_cost(h, s, **kw) for h, s in shapes]
    fits = [c for c in costs if memory_limit_bytes is None or c.extra_kv_bytes <= memory_limit_bytes] or costs[-1:]
    return min(fits, key=lambda c: (round(c.total_ms, 9), -c.heads))


def crossover_density(*, sp: int, seq_len: int, dim: int, block: int, links: CPLinks) -> float:
    """The density below which pure sequence-wise attention ``(1, sp)`` moves fewer bytes than Ulysses at the
    same degree (forward, K / V against q / k / v / out; the fetch share estimated by :func:`fetch_share`):
    ``2 f (sp - 1) / sp = 4 (sp - 1) / sp^2``, i.e. ``f = 2 / sp``. 0 when never, 1 when always."""
    target = 2.0 / sp
    nq_loc = max(1, seq_len // sp // block)
    lo, hi = 0.0, 1.0
    if target >= 1.0:
        return 1.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if fetch_share(mid, nq_loc, links.query_block_overlap) < target:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class ContextParallelCost:
    """The context-parallel part of a sparse-attention cost (``SparseAttentionCost.context_parallel``): the
    mode (``adaptive_load.sparse_attention.context_parallel``), the links and the head dim. Its methods take
    the sparse cost (densities, efficiency, the per-layer sparse decision) and give every layer its mesh."""

    mode: str = "heads"
    links: CPLinks = CPLinks()
    head_dim: int = 128
    summary_dim: Optional[int] = None
    """Width of a query-block summary (None: the head dim, ``pooled_lse``; the predictor rank otherwise)."""

    def __post_init__(self) -> None:
        if self.mode not in CP_MODES:
            raise ValueError(f"adaptive_load.sparse_attention.context_parallel must be one of {CP_MODES}, "
                             f"got {self.mode!r}")

    def layer_costs(self, sparse_cost, seq_len: int, sp: int,
                    sparse: Optional[Sequence[bool]] = None) -> tuple[MeshCost, ...]:
        """Every layer's chosen :class:`MeshCost` at ``seq_len`` (padded) tokens for one sample; ``sparse``: which
        layers run sparse (default: ``sparse_cost.layer_decisions``)."""
        dm = sparse_cost.densities
        runs_sparse = sparse_cost.layer_decisions(seq_len, sp)[0] if sparse is None else sparse
        att = sparse_cost.attention_ms_per_token2_per_layer
        att = 1.0 if att is None else att  # no profile: relative times (the mesh choice still follows the bytes)
        out = []
        for layer in range(dm.num_layers):
            sparse = bool(runs_sparse[layer])
            out.append(choose_mesh(sp=sp, seq_len=seq_len, densities=dm.density[layer] if sparse else
                                   (1.0,) * dm.num_heads, head_dim=self.head_dim, block=sparse_cost.block_size,
                                   attention_ms_per_token2=att, efficiency=sparse_cost.efficiency,
                                   links=self.links, mode=self.mode, sparse=sparse))
        return tuple(out)

    def describe(self) -> dict:
        lk = self.links
        return {"mode": self.mode, "head_dim": self.head_dim, "summary_dim": self.summary_dim,
                "links": {"intra_node_gbps": lk.intra_node_gbps, "inter_node_gbps": lk.inter_node_gbps,
                          "gpus_per_node": lk.gpus_per_node, "latency_us": lk.latency_us,
                          "query_block_overlap": lk.query_block_overlap, "elem_bytes": lk.elem_bytes,
                          "passes": lk.passes}}

    @classmethod
    def from_description(cls, d) -> "ContextParallelCost":
        return cls(mode=d["mode"], links=CPLinks(**d["links"]), head_dim=int(d["head_dim"]),
                   summary_dim=d.get("summary_dim"))

    @classmethod
    def from_config(cls, sa, head_dim: int) -> "ContextParallelCost":
        """From ``adaptive_load.sparse_attention`` (a SparseAttentionConfig) and the model's head dim."""
        c = sa.context_parallel_cost
        links = CPLinks(intra_node_gbps=c.intra_node_gbps, inter_node_gbps=c.inter_node_gbps,
                        gpus_per_node=c.gpus_per_node, latency_us=c.latency_us,
                        query_block_overlap=c.query_block_overlap)
        return cls(mode=sa.context_parallel, links=links, head_dim=head_dim,
                   summary_dim=None if sa.block_score == "pooled_lse" else sa.predictor_rank)
