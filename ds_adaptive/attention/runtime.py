"""The sparse-attention runtime: one object per model that owns the predictor, the schedule and the
per-layer state, and is the model's attention function.

Usage (single GPU or DeepSpeed, after ``apply_ulysses`` if SP is used)::

    rt = SparseAttentionRuntime(cfg.sparse_attention, num_layers=30, num_heads=12, head_dim=128,
                                device="cuda", sp_rank=layout.sp_rank, sp_size=layout.sp_size)
    rt.install(model, layout)        # cube token order + per-layer attention (Ulysses-wrapped under SP)
    for step ...:
        loss.backward(); engine.step()
        rt.step()                    # predictor AdamW step (grads all-reduced), schedule, timings
        log(rt.metrics())

Per layer and forward, :meth:`attention` (q, k, v ``[B, S, Hl, Dh]``, head-local after the
all-to-all):

1. inside an activation-checkpointing recompute (we are in the autograd engine's backward) it
   reuses the selection the forward cached for this layer: same blocks, same numerics;
2. else, if the schedule makes the layer sparse, it scores blocks with the predictor and selects
   the top-k key blocks per query block (k per head from the head's profiled density), or runs
   dense SDPA when that selection is denser than ``dense_above``;
3. on profiling steps (stage 1: every step) it computes the exact logits of ``sample_rows`` query
   rows, measures per-head density (blocks for ``mass``) and the selection's recall, and trains the
   predictor on those rows (its own graph; gradients accumulate until :meth:`step`).
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional, Union

import torch

from ds_adaptive.core.config import SparseAttentionConfig
from ds_adaptive.attention.attention import dense_attention
from ds_adaptive.attention.cube_order import CubeOrder
from ds_adaptive.attention.decision import LayerDecision
from ds_adaptive.attention.density import DensityProfiler, clock
from ds_adaptive.attention.schedule import SparseSchedule
from ds_adaptive.attention.selection import BlockSelection
from ds_adaptive.attention.selection_cache import HostCopy, SelectionCache, SelectionEntry
from ds_adaptive.attention.selector import BlockSelector
from ds_adaptive.attention.scores import warm_pooled_lse_scores
from ds_adaptive.parallel.ulysses import make_ulysses_attention
from ds_adaptive.attention.backends import select_backend
from ds_adaptive.attention.context_parallel import ContextParallelAttention
from ds_adaptive.parallel.mesh import mesh_shapes

_HostCopy = HostCopy  # the old private name (tests, bench/sparse_select.py)


class LayerAttention:
    """``fn(q, k, v, **kwargs)`` bound to one layer of a runtime (what a block calls)."""

    def __init__(self, runtime: "SparseAttentionRuntime", layer: int):
        self.runtime, self.layer = runtime, layer

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.runtime.attention(self.layer, q, k, v, **kwargs)


class _UlyssesLayers:
    """``set_attention`` target under Ulysses: per layer, DistributedAttention around that layer's fn."""

    def __init__(self, runtime: "SparseAttentionRuntime", layout):
        self._fns = [make_ulysses_attention(layout, local_attention=runtime.for_layer(i))
                     for i in range(runtime.num_layers)]

    def for_layer(self, i: int):
        return self._fns[i]

    def __call__(self, *args, **kwargs):
        raise RuntimeError("per-layer attention: install with model.set_attention(obj) so each block gets obj.for_layer(i)")


class SparseAttentionRuntime:
    """See the module docstring. ``sp_rank / sp_size``: this rank's heads are
    ``[sp_rank * H/sp, (sp_rank+1) * H/sp)`` after the all-to-all; ``group``: the process group of
    the predictor's gradient all-reduce (default: the world = DP x SP).

    Collaborators, one job each: ``selector`` (:class:`BlockSelector`: predictor, k per head, scores,
    top-k), ``profiler`` (:class:`DensityProfiler`: densities, recall, timers, the predictor's AdamW),
    ``decider`` (:class:`LayerDecision`: sparse only where it pays), ``selections``
    (:class:`SelectionCache`: what a checkpoint recompute reuses) and ``schedule``."""

    def __init__(self, cfg: Union[SparseAttentionConfig, dict, None], *, num_layers: int, num_heads: int,
                 head_dim: int, device: Union[str, torch.device, None] = None, sp_rank: int = 0, sp_size: int = 1,
                 group=None, sp_group=None, backend=None, decision=None):
        cfg = cfg if isinstance(cfg, SparseAttentionConfig) else SparseAttentionConfig.model_validate(cfg or {})
        if cfg.predictor_rank > head_dim:
            raise ValueError(f"adaptive_load.sparse_attention.predictor_rank = {cfg.predictor_rank} is larger than "
                             f"the head dim {head_dim}; use <= {head_dim} (default 16)")
        hybrid = cfg.context_parallel != "heads"  # per-layer meshes: a layer's heads come from its mesh
        if num_heads % sp_size and not hybrid:
            raise ValueError(f"num_heads {num_heads} is not divisible by the SP degree {sp_size}")
        self.cfg = cfg
        self.num_layers, self.num_heads, self.head_dim = num_layers, num_heads, head_dim
        self.local_heads = num_heads // (mesh_shapes(sp_size, num_heads)[0][0] if hybrid else sp_size)
        self.head_offset = sp_rank * self.local_heads
        self.group = group
        self.sp_group, self.sp_size, self.sp_rank = sp_group, sp_size, sp_rank
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.selector = BlockSelector(cfg, num_layers=num_layers, num_heads=num_heads, head_dim=head_dim,
                                      local_heads=self.local_heads, head_offset=self.head_offset, device=self.device)
        self.profiler = DensityProfiler(cfg, self.selector.predictor, num_layers=num_layers, num_heads=num_heads,
                                        device=self.device, train_predictor=self.selector.uses_predictor,
                                        group=group, seed_rank=sp_rank)
        self.schedule = SparseSchedule(num_layers, warmup_steps=cfg.warmup_steps, loss_threshold=cfg.loss_threshold,
                                       profile_interval=cfg.profile_interval,
                                       layer_density_threshold=cfg.layer_density_threshold,
                                       dense_layers=cfg.dense_layers, forced_density=cfg.forced_density,
                                       forced_after_warmup=cfg.forced_after_warmup)
        self.order = CubeOrder(tuple(cfg.cube))
        # the block-sparse kernel (ds_adaptive.attention.backends); None: chosen on first use from
        # cfg.backend for the device and dtype of q (build_run chooses it up front and says why)
        self.sparse_backend = backend
        self.backend_choice = None
        # "sparse only where it pays": a planning.sparse_cost.SparseAttentionCost (the planner's decision, its
        # densities replaced by the ones the layers run at after every step); None: no cost check
        self.decider = LayerDecision(decision, sp_size=sp_size)
        self.warmup_s = 0.0
        self._force_dense = False
        self.selections = SelectionCache(host=cfg.selection_cache == "host")
        self.context_parallel: Optional[ContextParallelAttention] = None  # install() under a hybrid mode
        nan = float("nan")
        # select_ms: the selection's CUDA-event time per layer (mean over this step's calls); select_ms_predicted:
        # the decision cost's selection time for the same calls (its measured or default SelectionCost)
        self.last: dict[str, Any] = {"loss": [nan] * num_layers, "recall": [nan] * num_layers,
                                     "selected_density": [nan] * num_layers, "select_ms": [nan] * num_layers,
                                     "select_ms_predicted": [nan] * num_layers}
        self._refresh_decision()

    # ------------------------------------------------------------------ the collaborators' state, by its old names
    predictor = property(lambda self: self.selector.predictor)
    optimizer = property(lambda self: self.profiler.optimizer)
    uses_predictor = property(lambda self: self.selector.uses_predictor)
    calls = property(lambda self: self.decider.calls)
    decision = property(lambda self: self.decider.cost)
    _decision_template = property(lambda self: self.decider.template)

    @property
    def head_density(self) -> torch.Tensor:
        """``[L, H]`` profiled density of every head by original head id (NaN: not profiled yet)."""
        return self.profiler.head_density

    @head_density.setter
    def head_density(self, value: torch.Tensor) -> None:
        self.profiler.head_density = value

    # ------------------------------------------------------------------ installation
    def for_layer(self, i: int) -> LayerAttention:
        return LayerAttention(self, i)

    def install(self, model, layout=None) -> None:
        """Cube token order + this runtime as every block's attention (Ulysses-wrapped when
        ``layout.sp_enabled``; under ``context_parallel`` ``sequence`` / ``auto`` the per-layer meshes of
        :class:`ContextParallelAttention`, which also tells the sequence runner how to pad; call after
        ``apply_ulysses``; a collective under a hybrid mode: its process groups)."""
        model.set_token_order(self.order)
        sp_on = layout is not None and layout.sp_enabled
        if sp_on and self.cfg.context_parallel != "heads":
            self.context_parallel = ContextParallelAttention(self, layout)
            model.set_attention(self.context_parallel)
            if model.sequence_parallel is not None:  # (a dry run on the meta device has no runner)
                model.sequence_parallel.token_multiple = self.context_parallel.token_multiple
            return
        model.set_attention(_UlyssesLayers(self, layout) if sp_on else self)

    def backend_for(self, q: torch.Tensor):
        """The block-sparse backend (chosen from ``cfg.backend`` for q's device and dtype on first use)."""
        if self.sparse_backend is None:
            self.backend_choice = select_backend(self.cfg.backend, q.device, dtype=q.dtype, head_dim=q.shape[-1],
                                                 block_size=self.cfg.block_size, backward=True)
            self.sparse_backend = self.backend_choice.backend
        if hasattr(self.sparse_backend, "max_graphs"):
            self.sparse_backend.max_graphs = self.cfg.max_compiled_graphs
        return self.sparse_backend

    # ------------------------------------------------------------------ the attention fn
    @contextlib.contextmanager
    def dense_only(self):
        """Inside, every layer runs dense SDPA (no selection, no profiling): e.g. the held-out loss of a
        model trained with sparse attention, evaluated with full attention."""
        old, self._force_dense = self._force_dense, True
        try:
            yield self
        finally:
            self._force_dense = old

    @property
    def dense_forced(self) -> bool:
        """Inside :meth:`dense_only`."""
        return self._force_dense

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                  valid_len: Optional[int] = None, head_ids=None, **_: Any) -> torch.Tensor:
        if self._force_dense:
            return dense_attention(q, k, v, valid_len=valid_len)
        heads = self._local_heads(layer, q, head_ids)
        key = (tuple(q.shape), valid_len, heads)
        if self.selections.recompute_hit(layer, key):
            # the checkpoint recompute: the forward's selection (from the host buffers, or kept)
            entry, selection = self.selections.entry(layer), self.selections.selection(layer)
        else:
            entry = self._forward_entry(layer, q, k, key, valid_len, heads)
            selection, entry.selection = entry.selection, None  # the forward's own reference only
        if selection is None:
            return dense_attention(q, k, v, valid_len=valid_len)
        # (flex builds its BlockMask inside the op from the compact selection: a few kernels, no
        # sync; the q side, O(nq * nk), only with autograd on; never cached)
        return self.backend_for(q).attention(q, k, v, selection, valid_len=valid_len, density=entry.density)

    def runs_sparse(self, layer: int, seq_len: int) -> bool:
        """Whether a sparse layer of the schedule runs block-sparse at ``seq_len`` tokens (the full,
        Ulysses-padded sequence): the planner's decision (``SparseAttentionCost.layer_decisions``) at
        the densities the layers run at; True without a decision cost."""
        return self.decider.runs_sparse(layer, seq_len)

    def _refresh_decision(self) -> None:
        """The decision cost at the densities the layers run at now (after a step or a resume)."""
        self.decider.refresh(effective_densities(self), self.schedule.dense_layers)

    def warmup(self, shapes, *, dtype: torch.dtype, backward: bool = True) -> float:
        """Before step 1: let the backend prepare (compile) for the ``(B, S)`` micro-batches of the plan
        (S: the full, Ulysses-padded sequence) where a layer can run sparse at all (at the lowest
        density it may run at); returns seconds spent (also added to ``warmup_s``)."""
        cfg = self.cfg
        low = cfg.forced_density if cfg.forced_density is not None else max(cfg.min_density, 1e-4)
        todo = self.decider.warm_shapes(shapes, low=low, num_layers=self.num_layers, num_heads=self.num_heads,
                                        dense_layers=self.schedule.dense_layers)
        if not todo or len(self.schedule.dense_layers) >= self.num_layers:
            return 0.0
        backend = self.backend_for(torch.empty(0, 0, 0, self.head_dim, device=self.device, dtype=dtype))
        spent = backend.warmup(todo, num_heads=self.local_heads, head_dim=self.head_dim, dtype=dtype,
                               device=self.device, block_size=cfg.block_size, backward=backward)
        if not self.uses_predictor:  # the block-scores kernel of the selection (compiled once, whatever S and B)
            spent += warm_pooled_lse_scores(self.device, dtype, self.local_heads, self.head_dim, cfg.block_size)
        self.warmup_s += spent
        return spent

    def cached_selection(self, layer: int) -> Optional[BlockSelection]:
        """The selection this step's forward made for ``layer`` (what its recompute reuses); None:
        the layer ran dense or has not run since the last :meth:`step`."""
        return self.selections.selection(layer)

    def _local_heads(self, layer: int, q: torch.Tensor, head_ids) -> tuple[int, ...]:
        """The original ids of the heads on dim 2 of ``q`` (``BlockSelector.local_heads_of``)."""
        return self.selector.local_heads_of(layer, q, head_ids)

    @torch.no_grad()
    def select(self, layer: int, q: torch.Tensor, k: torch.Tensor, heads: Optional[tuple[int, ...]] = None):
        """The block selection of this layer for q, k ``[B, S, Hl, Dh]`` (None: run dense); ``heads``:
        the original ids of q's heads (default: this rank's contiguous slice)."""
        return self._select(layer, q, k, heads)[0]

    @torch.no_grad()
    def _select(self, layer: int, q: torch.Tensor, k: torch.Tensor, heads: Optional[tuple[int, ...]] = None):
        """(selection or None, its selected share known on the host: mean k / nk)."""
        heads = self._local_heads(layer, q, None) if heads is None else heads
        return self.selector.select(layer, q, k, heads, self.head_density)

    @torch.no_grad()
    def block_scores(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                     heads: Optional[tuple[int, ...]] = None) -> torch.Tensor:
        """``[B, H, nq, nk]`` fp32 scores of ``cfg.block_score`` for q, k ``[B, S, Hl, Dh]``."""
        heads = self._local_heads(layer, q, None) if heads is None else heads
        return self.selector.block_scores(layer, q, k, heads)

    def _forward_entry(self, layer, q, k, key, valid_len, heads) -> SelectionEntry:
        selection, density = None, None
        if self.schedule.is_sparse(layer) and self.runs_sparse(layer, q.shape[1]):
            t0 = clock(q.device)
            selection, density = self._select(layer, q, k, heads)
            self.profiler.record_selection(layer, t0, q.device, (q.shape[0], q.shape[1]), selection)
        if torch.is_grad_enabled() and self.schedule.profile_now() and q.requires_grad:
            self.profiler.profile_and_train(layer, q, k, selection, valid_len, heads, self.selector.head_arg(heads))
        return self.selections.store(layer, key, selection, density)

    # ------------------------------------------------------------------ per optimizer step
    def step(self) -> None:
        """After the DiT's optimizer step: on a profiling step, all-reduce the profiled head densities
        (and, when the selection uses it, the predictor's gradients and losses) over the group (DP x
        SP: every rank ends with the same densities) and step the predictor's AdamW; then record, advance
        the schedule, read the selection timers. Steps that did not profile exchange nothing (the
        schedule, the same on every rank, says which: stage 2 profiles every ``profile_interval``)."""
        mean_loss, layer_density = None, [None] * self.num_layers
        if self.schedule.profile_now():
            mean_loss, layer_density, layer_loss = self.profiler.exchange()
            for i, x in layer_loss.items():
                self.last["loss"][i] = x
        self.profiler.step_figures(self.last, self.decision, self.sp_size)
        self.schedule.end_step(mean_loss, layer_density)
        self._refresh_decision()
        self.profiler.reset()
        self.selections.clear()
        if self.context_parallel is not None:
            self.context_parallel.end_step()

    # ------------------------------------------------------------------ telemetry / state
    def metrics(self) -> dict[str, Any]:
        """Flat scalars for JSONL / TensorBoard (``sparse/...``) plus per-layer lists (``sparse/layers``)."""
        def mean(xs):
            xs = [x for x in xs if x == x]
            return sum(xs) / len(xs) if xs else float("nan")
        sparse = self.schedule.sparse_layers()
        dens = [float(self.head_density[i].mean()) for i in range(self.num_layers)]
        return {
            "sparse/stage": self.schedule.stage,
            "sparse/sparse_layers": len(sparse),
            "sparse/density": mean(dens),
            "sparse/selected_density": mean([self.last["selected_density"][i] for i in sparse]),
            "sparse/recall": mean([self.last["recall"][i] for i in sparse]),
            "sparse/predictor_loss": mean(self.last["loss"]),
            "sparse/select_ms": sum(x for x in self.last["select_ms"] if x == x),
            "sparse/select_ms_predicted": sum(x for x in self.last["select_ms_predicted"] if x == x),
            "sparse/layers": {"density": dens, "recall": list(self.last["recall"]),
                              "selected_density": list(self.last["selected_density"]),
                              "predictor_loss": list(self.last["loss"]), "select_ms": list(self.last["select_ms"]),
                              "select_ms_predicted": list(self.last["select_ms_predicted"]),
                              "sparse": sparse},
        }

    def _all_head_density(self) -> torch.Tensor:
        """[L, H] densities of all heads by original head id (NaN: not profiled yet); the same on
        every rank (step() all-reduces them), so no collective here."""
        return self.head_density.clone()

    def state_dict(self) -> dict:
        """Checkpoint state. The predictor, its optimizer, the schedule and the head densities are
        replicated (the same on every rank)."""
        return {"predictor": self.predictor.state_dict(), "optimizer": self.optimizer.state_dict(),
                "schedule": self.schedule.state_dict(), "head_density": self._all_head_density(),
                "generator": self.profiler.generator.get_state(), "last": {k: list(v) for k, v in self.last.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (any SP degree or head placement: densities are kept for all heads;
        the row sampler continues exactly where the saved rank's did, so SP > 1 resumes exactly on
        SP rank 0)."""
        full = state["head_density"]
        if tuple(full.shape) != (self.num_layers, self.num_heads):
            raise ValueError(f"sparse state has head densities {list(full.shape)}, this run needs "
                             f"[{self.num_layers}, {self.num_heads}] (layers, heads): a checkpoint of another model")
        self.predictor.load_state_dict(state["predictor"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        self.head_density = full.clone().float()
        self.profiler.generator.set_state(state["generator"])
        self.last = {**self.last, **{k: list(v) for k, v in state["last"].items()}}  # keys added since the save kept
        self._refresh_decision()

    def summary(self) -> dict[str, Any]:
        """For the run summary: stage, when stage 2 began, sparse layers, per-layer figures."""
        m = self.metrics()
        be = self.sparse_backend
        return {"stage": self.schedule.stage, "stage2_from_step": self.schedule.switched_at,
                "config": self.cfg.model_dump(mode="json"), **{k.split("/", 1)[1]: v for k, v in m.items()},
                "backend": None if be is None else {"name": be.name, **be.stats()},
                "backend_line": None if self.backend_choice is None else self.backend_choice.line,
                "warmup_s": self.warmup_s, "layer_calls": dict(self.calls),
                "context_parallel": self.cfg.context_parallel if self.context_parallel is None else
                {"mode": self.cfg.context_parallel, "last_step_bytes": self.context_parallel.last_bytes}}


def attach_sparse_attention(model, cfg: SparseAttentionConfig, *, layout=None, device=None, choice=None,
                            decision=None) -> Optional[SparseAttentionRuntime]:
    """None when ``cfg.enabled`` is false, else a runtime installed on ``model`` (after
    ``apply_ulysses``: the selection runs on the local heads after the all-to-all); ``build_run``
    calls it. ``layout``: the run's :class:`ds_adaptive.core.layout.Layout` (None: one process, no SP);
    ``choice``: a :class:`ds_adaptive.attention.backends.BackendChoice` (None: chosen on first use);
    ``decision``: the planner's :class:`ds_adaptive.planning.sparse_cost.SparseAttentionCost` (sparse only
    where it pays; None: no cost check)."""
    if not cfg.enabled:
        return None
    mc = model.config
    sp_on = layout is not None and layout.sp_enabled
    rt = SparseAttentionRuntime(cfg, num_layers=mc.num_layers, num_heads=mc.num_heads, head_dim=mc.head_dim,
                                device=device, sp_rank=layout.sp_rank if layout is not None else 0,
                                sp_size=layout.sp_size if layout is not None else 1,
                                sp_group=layout.sp_group if sp_on else None,
                                backend=None if choice is None else choice.backend, decision=decision)
    rt.backend_choice = choice
    rt.install(model, layout)
    return rt


def effective_densities(runtime) -> list[list[float]]:
    """``[layers][heads]`` densities the layers run at now: 1 for a dense layer (stage 1, ``dense_layers``,
    a layer above ``layer_density_threshold`` or whose selection would exceed ``dense_above``), else
    ``forced_density`` or the head's profiled density clamped to ``[min_density, max_density]`` (at least
    1e-4). The same on every rank: the runtime's densities are all-reduced in ``step()``."""
    cfg, sched = runtime.cfg, runtime.schedule
    heads = runtime.num_heads
    out = []
    for layer in range(runtime.num_layers):
        row = [1.0] * heads
        if sched.is_sparse(layer):
            if cfg.forced_density is not None:
                d = torch.full((heads,), float(cfg.forced_density))
            else:
                d = torch.nan_to_num(runtime.head_density[layer].float(), nan=1.0)
                d = d.clamp(cfg.min_density, cfg.max_density)
            if float(d.mean()) <= cfg.dense_above:
                row = [max(1e-4, float(x)) for x in d]
        out.append(row)
    return out
