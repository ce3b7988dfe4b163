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
import math
import time
from typing import Any, Optional, Union

import torch

from ds_adaptive.core.config import SparseAttentionConfig
from ds_adaptive.attention.attention import dense_attention
from ds_adaptive.attention.cube_order import CubeOrder
from ds_adaptive.attention.predictor import LowRankPredictor
from ds_adaptive.attention.profiler import exact_logits, profile_rows, sample_row_groups
from ds_adaptive.attention.schedule import SparseSchedule
from ds_adaptive.attention.selection import BlockSelection, blocks_for_density, select_blocks
from ds_adaptive.attention.scores import pooled_lse_scores, warm_pooled_lse_scores
from ds_adaptive.parallel.ulysses import make_ulysses_attention
from ds_adaptive.attention.backends import select_backend
from ds_adaptive.core.contracts import DensityMap


def _in_backward() -> bool:
    """True while the autograd engine runs a backward (where checkpointing recomputes forwards)."""
    return torch._C._current_graph_task_id() != -1


class _Entry:
    """One layer's selection of this step: ``selection`` (device tensors, for the forward itself),
    ``stored`` (the copy kept for the checkpoint recompute: the same selection, or a
    :class:`_HostCopy`), ``density`` (host-known selected share: the kernel-options bucket)."""
    __slots__ = ("key", "selection", "stored", "density")

    def __init__(self, key, selection, stored, density):
        self.key, self.selection, self.stored, self.density = key, selection, stored, density


class _HostCopy:
    """A selection parked in pinned host buffers (reused per layer across steps): the device->host
    and host->device copies are asynchronous and ordered on the current stream, so nothing waits
    and no GPU memory is held between a layer's forward and its recompute."""

    def __init__(self):
        self._bufs: dict[int, tuple] = {}
        self.meta: dict[int, tuple] = {}

    def put(self, layer: int, sel: BlockSelection) -> None:
        bufs = self._bufs.get(layer)
        if bufs is None or any(b.shape != t.shape or b.dtype != t.dtype for b, t in zip(bufs, (sel.kv_num, sel.kv_idx))):
            bufs = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda) for t in (sel.kv_num, sel.kv_idx))
            self._bufs[layer] = bufs
        for b, t in zip(bufs, (sel.kv_num, sel.kv_idx)):
            b.copy_(t, non_blocking=True)
        self.meta[layer] = (sel.block_size, sel.seq_len, sel.kv_idx.device)

    def get(self, layer: int) -> BlockSelection:
        bs, s, dev = self.meta[layer]
        num, idx = (b.to(dev, non_blocking=True) for b in self._bufs[layer])
        return BlockSelection(kv_num=num, kv_idx=idx, block_size=bs, seq_len=s)


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
    the predictor's gradient all-reduce (default: the world = DP x SP)."""

    def __init__(self, cfg: Union[SparseAttentionConfig, dict, None], *, num_layers: int, num_heads: int,
                 head_dim: int, device: Union[str, torch.device, None] = None, sp_rank: int = 0, sp_size: int = 1,
                 group=None, sp_group=None, backend=None, decision=None):
        cfg = cfg if isinstance(cfg, SparseAttentionConfig) else SparseAttentionConfig.model_validate(cfg or {})
        if cfg.predictor_rank > head_dim:
            raise ValueError(f"adaptive_load.sparse_attention.predictor_rank = {cfg.predictor_rank} is larger than "
                             f"the head dim {head_dim}; use <= {head_dim} (default 16)")
        if num_heads % sp_size:
            raise ValueError(f"num_heads {num_heads} is not divisible by the SP degree {sp_size}")
        self.cfg = cfg
        self.num_layers, self.num_heads, self.head_dim = num_layers, num_heads, head_dim
        self.local_heads = num_heads // sp_size
        self.head_offset = sp_rank * self.local_heads
        self.group = group
        self.sp_group, self.sp_size, self.sp_rank = sp_group, sp_size, sp_rank
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.predictor = LowRankPredictor(num_layers, num_heads, head_dim, cfg.predictor_rank, seed=cfg.seed).to(self.device)
        self.optimizer = torch.optim.AdamW(self.predictor.parameters(), lr=cfg.predictor_lr, weight_decay=0.0)
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
        # "sparse only where it pays": a balance.sparse.SparseAttentionCost (the planner's decision, its
        # densities replaced by the ones the layers run at after every step); None: no cost check
        self._decision_template = decision
        self.decision = None
        self._decided: dict = {}
        self.warmup_s = 0.0
        self._force_dense = False
        self._gen = torch.Generator().manual_seed(cfg.seed + 1 + 7919 * sp_rank)
        nan = float("nan")
        # profiled density of every head [L, H] (original head ids), the same on every rank: each rank
        # profiles the heads it holds, step() all-reduces the sums over the group (DP x SP)
        self.head_density = torch.full((num_layers, num_heads), nan)
        self._cache: dict[int, _Entry] = {}
        self._host = _HostCopy()
        self._reset_step_stats()
        # select_ms: the selection's CUDA-event time per layer (mean over this step's calls); select_ms_predicted:
        # the decision cost's selection time for the same calls (its measured or default SelectionCost)
        self.last: dict[str, Any] = {"loss": [nan] * num_layers, "recall": [nan] * num_layers,
                                     "selected_density": [nan] * num_layers, "select_ms": [nan] * num_layers,
                                     "select_ms_predicted": [nan] * num_layers}
        # layer calls of the schedule's sparse layers that ran sparse / dense (the cost check), whole run
        self.calls = {"sparse": 0, "dense_by_cost": 0}
        self._refresh_decision()

    # ------------------------------------------------------------------ installation
    def for_layer(self, i: int) -> LayerAttention:
        return LayerAttention(self, i)

    def install(self, model, layout=None) -> None:
        """Cube token order + this runtime as every block's attention (Ulysses-wrapped when
        ``layout.sp_enabled``; call after ``apply_ulysses``)."""
        model.set_token_order(self.order)
        model.set_attention(_UlyssesLayers(self, layout) if layout is not None and layout.sp_enabled else self)

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

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                  valid_len: Optional[int] = None, head_ids=None, **_: Any) -> torch.Tensor:
        if self._force_dense:
            return dense_attention(q, k, v, valid_len=valid_len)
        heads = self._local_heads(layer, q, head_ids)
        key = (tuple(q.shape), valid_len, heads)
        entry = self._cache.get(layer)
        if _in_backward() and entry is not None and entry.key == key:
            # the checkpoint recompute: the forward's selection (from the host buffers, or kept)
            selection = self.cached_selection(layer)
        else:
            entry = self._forward_entry(layer, q, k, key, valid_len, heads)
            self._cache[layer] = entry
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
        if self.decision is None:
            return True
        row = self._decided.get(seq_len)
        if row is None:  # once per sequence length and density table (hashing the cost per call is not free)
            row = self._decided[seq_len] = self.decision.layer_decisions(seq_len, self.sp_size)[0]
        ok = bool(row[layer])
        self.calls["sparse" if ok else "dense_by_cost"] += 1
        return ok

    def _refresh_decision(self) -> None:
        """The decision cost at the densities the layers run at now (after a step or a resume)."""
        if self._decision_template is None:
            return

        table = tuple(tuple(r) for r in effective_densities(self))
        if self.decision is not None and self.decision.densities.density == table:
            return  # unchanged (most stage-2 steps): keep the cost object and its cached decisions
        self._decided = {}
        self.decision = self._decision_template.with_densities(
            DensityMap(table, dense_layers=tuple(sorted(self.schedule.dense_layers)), source="sparse runtime"))

    def warmup(self, shapes, *, dtype: torch.dtype, backward: bool = True) -> float:
        """Before step 1: let the backend prepare (compile) for the ``(B, S)`` micro-batches of the plan
        (S: the full, Ulysses-padded sequence) where a layer can run sparse at all (at the lowest
        density it may run at); returns seconds spent (also added to ``warmup_s``)."""
        cfg = self.cfg
        low = cfg.forced_density if cfg.forced_density is not None else max(cfg.min_density, 1e-4)
        probe = None
        if self._decision_template is not None:

            n, h = self.num_layers, self.num_heads
            probe = self._decision_template.with_densities(
                DensityMap(tuple((low,) * h for _ in range(n)), dense_layers=tuple(sorted(self.schedule.dense_layers))))
        todo = sorted({(int(b), int(s)) for b, s in shapes
                       if probe is None or bool(probe.layer_decisions(int(s), self.sp_size)[0].any())})
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
        entry = self._cache.get(layer)
        if entry is None or entry.stored is None:
            return None
        return self._host.get(layer) if isinstance(entry.stored, _HostCopy) else entry.stored

    def _local_heads(self, layer: int, q: torch.Tensor, head_ids) -> tuple[int, ...]:
        """The original ids of the heads on dim 2 of ``q``: ``head_ids`` from a Ulysses head placement
        (``apply_head_placement(..., head_ids_kwarg="head_ids")``), else this rank's contiguous slice.
        Per-head state (predictor weights, densities, k) is indexed by them."""
        if head_ids is None:
            return tuple(range(self.head_offset, self.head_offset + self.local_heads))
        heads = tuple(int(h) for h in head_ids)
        if len(heads) != q.shape[2] or len(set(heads)) != len(heads) or not all(0 <= h < self.num_heads for h in heads):
            raise ValueError(f"layer {layer}: head_ids {list(heads)} must be {q.shape[2]} distinct head ids in "
                             f"0..{self.num_heads - 1} (one per head on dim 2 of q {list(q.shape)})")
        return heads

    def _head_k(self, layer: int, nk: int, heads: tuple[int, ...]) -> torch.Tensor:
        cfg = self.cfg
        if cfg.forced_density is not None:
            dens = torch.full((len(heads),), cfg.forced_density)
            return blocks_for_density(dens, nk)
        dens = self.head_density[layer, list(heads)]
        return blocks_for_density(torch.nan_to_num(dens, nan=1.0), nk,
                                  min_density=cfg.min_density, max_density=cfg.max_density)

    @torch.no_grad()
    def select(self, layer: int, q: torch.Tensor, k: torch.Tensor, heads: Optional[tuple[int, ...]] = None):
        """The block selection of this layer for q, k ``[B, S, Hl, Dh]`` (None: run dense); ``heads``:
        the original ids of q's heads (default: this rank's contiguous slice)."""
        return self._select(layer, q, k, heads)[0]

    @torch.no_grad()
    def _select(self, layer: int, q: torch.Tensor, k: torch.Tensor, heads: Optional[tuple[int, ...]] = None):
        """(selection or None, its selected share known on the host: mean k / nk)."""
        cfg = self.cfg
        heads = self._local_heads(layer, q, None) if heads is None else heads
        s = q.shape[1]
        nk = math.ceil(s / cfg.block_size)
        kph = self._head_k(layer, nk, heads)
        density = float(kph.float().mean()) / nk
        if density > cfg.dense_above:
            return None, density
        scores = self.block_scores(layer, q, k, heads)
        return select_blocks(scores, kph, seq_len=s, block_size=cfg.block_size, keep_sink=cfg.keep_sink,
                             inplace=True), density

    @property
    def uses_predictor(self) -> bool:
        """Whether the selection scores with the low-rank predictor (``block_score`` ``lse`` / ``mean``):
        only then is it trained on profiling steps."""
        return self.cfg.block_score != "pooled_lse"

    @torch.no_grad()
    def block_scores(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                     heads: Optional[tuple[int, ...]] = None) -> torch.Tensor:
        """``[B, H, nq, nk]`` fp32 scores of ``cfg.block_score`` for q, k ``[B, S, Hl, Dh]``."""
        cfg = self.cfg
        if not self.uses_predictor:
            return pooled_lse_scores(q, k, cfg.block_size)
        heads = self._local_heads(layer, q, None) if heads is None else heads
        return self.predictor.block_scores(layer, q, k, cfg.block_size, self._head_arg(heads), mode=cfg.block_score)

    def _head_arg(self, heads: tuple[int, ...]):
        """The predictor's head argument: the int offset for a contiguous slice (a view), else the ids."""
        h0 = heads[0]
        return h0 if heads == tuple(range(h0, h0 + len(heads))) else heads

    def _forward_entry(self, layer, q, k, key, valid_len, heads) -> _Entry:
        selection, stored, density = None, None, None
        if self.schedule.is_sparse(layer) and self.runs_sparse(layer, q.shape[1]):
            t0 = self._clock(q.device)
            selection, density = self._select(layer, q, k, heads)
            self._select_events[layer].append((t0, self._clock(q.device)))
            self._select_shapes[layer].append((q.shape[0], q.shape[1]))  # host ints: the predicted time in step()
            if selection is not None:  # a device tensor: read in step(), no sync per layer here
                self._selected[layer] = selection.density().mean()
                stored = selection
                if q.is_cuda and self.cfg.selection_cache == "host":
                    self._host.put(layer, selection)
                    stored = self._host
        if torch.is_grad_enabled() and self.schedule.profile_now() and q.requires_grad:
            self._profile_and_train(layer, q, k, selection, valid_len, heads)
        return _Entry(key, selection, stored, density)

    def _profile_and_train(self, layer, q, k, selection, valid_len, heads) -> None:
        cfg = self.cfg
        rows, per_block = sample_row_groups(q.shape[1], cfg.sample_rows, cfg.block_size, generator=self._gen,
                                            valid_len=valid_len, device=q.device)
        qd, kd = q.detach(), k.detach()
        with torch.no_grad():
            logits = exact_logits(qd, kd, rows, valid_len=valid_len)
            stats = profile_rows(logits, rows, cfg.block_size, cfg.mass, selection, per_block=per_block)
        if self.uses_predictor:
            # the predictor's own graph: identity saved-tensor hooks shield it from an enclosing
            # activation-checkpoint region (whose hooks would otherwise pack these tensors)
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                loss = self.predictor.loss(layer, qd[:, rows], kd, logits, self._head_arg(heads), valid_len,
                                           cos_weight=cfg.predictor_cos_weight)
                loss.backward()
            self._loss_sum[layer] += loss.detach().to(self._loss_sum.device, torch.float64)
            self._loss_n[layer] += 1
        idx = list(heads)
        self._density_sum[layer, idx] += stats.density.detach().to(self._density_sum.device, torch.float64)
        self._density_n[layer, idx] += 1
        if stats.recall is not None:  # a device tensor: read in step(), no sync per layer here
            self._recall[layer] = stats.recall.mean()

    @staticmethod
    def _clock(device: torch.device):
        if device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _reset_step_stats(self) -> None:
        L = self.num_layers
        self._loss_sum = torch.zeros(L, dtype=torch.float64, device=self.device)
        self._loss_n = torch.zeros(L, dtype=torch.float64, device=self.device)
        self._density_sum = torch.zeros(L, self.num_heads, dtype=torch.float64, device=self.device)
        self._density_n = torch.zeros(L, self.num_heads, dtype=torch.float64, device=self.device)
        self._select_events: list[list] = [[] for _ in range(L)]
        self._select_shapes: list[list] = [[] for _ in range(L)]
        self._selected: dict[int, torch.Tensor] = {}
        self._recall: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------ per optimizer step
    def step(self) -> None:
        """After the DiT's optimizer step: on a profiling step, all-reduce the profiled head densities
        (and, when the selection uses it, the predictor's gradients and losses) over the group (DP x
        SP: every rank ends with the same densities) and step the predictor's AdamW; then record, advance
        the schedule, read the selection timers. Steps that did not profile exchange nothing (the
        schedule, the same on every rank, says which: stage 2 profiles every ``profile_interval``)."""
        mean_loss, layer_density = None, [None] * self.num_layers
        if self.schedule.profile_now():
            mean_loss, layer_density = self._exchange()
        for i, d in self._selected.items():
            self.last["selected_density"][i] = float(d)
        for i, r in self._recall.items():
            self.last["recall"][i] = float(r)
        for i, evs in enumerate(self._select_events):
            if evs:
                self.last["select_ms"][i] = sum(self._elapsed(a, b) for a, b in evs) / len(evs)
        for i, calls in enumerate(self._select_shapes):
            if calls and self.decision is not None:
                self.last["select_ms_predicted"][i] = sum(
                    self.decision.layer_selection_ms(s, self.sp_size, self.num_heads, batch=b) for b, s in calls) / len(calls)
        self.schedule.end_step(mean_loss, layer_density)
        self._refresh_decision()
        self._reset_step_stats()
        self._cache.clear()

    def _exchange(self):
        """One all-reduce of densities (+ predictor gradients and losses); the predictor's step.
        Returns ``(mean predictor loss or None, per-layer mean density or None)``."""
        params = [p for p in self.predictor.parameters()] if self.uses_predictor else []
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        dsum, dn = self._density_sum.to(self._loss_sum.device), self._density_n.to(self._loss_sum.device)
        flat = torch.cat([g.reshape(-1).double() for g in grads]
                         + [dsum.reshape(-1), dn.reshape(-1), self._loss_sum, self._loss_n])
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(flat, group=self.group)
        L, LH = self.num_layers, self.num_layers * self.num_heads
        n_total = flat[-L:]
        loss_sum = flat[-2 * L:-L]
        dens = flat[-2 * L - 2 * LH:-2 * L].view(2, L, self.num_heads).cpu()
        trained = n_total > 0
        if bool(trained.any()):
            # each rank's loss is the mean over its local heads: a head's summed gradient / n_total is
            # its share of the mean over all heads and contributions (the same for any SP degree)
            per_layer = n_total.clamp_min(1.0)
            off = 0
            for p in params:
                n = p.numel()
                g = flat[off:off + n].view(p.shape) / per_layer.view(-1, *([1] * (p.dim() - 1)))
                p.grad = g.to(p.dtype)
                off += n
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        layer_loss = torch.where(trained, loss_sum / n_total.clamp_min(1.0), torch.nan).cpu()
        for i in range(self.num_layers):
            if bool(trained[i]):
                self.last["loss"][i] = float(layer_loss[i])
        measured = dens[1] > 0
        self.head_density[measured] = (dens[0][measured] / dens[1][measured]).float()
        layer_density = [float(self.head_density[i].mean()) if bool(measured[i].any()) else None
                         for i in range(self.num_layers)]
        mean_loss = float(layer_loss[trained.cpu()].mean()) if bool(trained.any()) else None
        return mean_loss, layer_density

    @staticmethod
    def _elapsed(a, b) -> float:
        if isinstance(a, float):
            return (b - a) * 1e3
        b.synchronize()
        return a.elapsed_time(b)

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
                "generator": self._gen.get_state(), "last": {k: list(v) for k, v in self.last.items()}}

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
        self._gen.set_state(state["generator"])
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
                "warmup_s": self.warmup_s, "layer_calls": dict(self.calls)}


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
