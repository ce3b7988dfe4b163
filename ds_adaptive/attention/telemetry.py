"""Sparse-attention telemetry outputs (the density-per-layer/head PNG) and the trainer's hook, which also
hands the densities to the balancers (sampler re-plan, Ulysses head placement)."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from ds_adaptive.attention.runtime import attach_sparse_attention, effective_densities
from ds_adaptive.core.contracts import DensityMap
from ds_adaptive.core.figure import agg_figure
from ds_adaptive.parallel.head_placement import update_sparse_balance


def write_density_png(head_density: Union[torch.Tensor, Sequence[Sequence[float]]], path: Union[str, Path], *,
                      sparse_layers: Sequence[int] = (), title: str = "profiled attention density") -> Path:
    """Heatmap of density ``[layers, heads]`` (share of key blocks holding the softmax mass) -> PNG.

    Layers running sparse are marked on the y axis with '*'. Unprofiled entries (NaN) are blank.
    """
    d = torch.as_tensor(head_density, dtype=torch.float32)
    if d.dim() != 2:
        raise ValueError(f"head_density must be [layers, heads], got shape {list(d.shape)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = agg_figure(figsize=(1.0 + 0.35 * d.shape[1], 1.0 + 0.22 * d.shape[0]))
    ax = fig.subplots()
    im = ax.imshow(d.numpy(), aspect="auto", cmap="viridis", vmin=0.0, vmax=max(0.05, float(d.nan_to_num(0).max())))
    ax.set_xlabel("head")
    ax.set_ylabel("layer (* = sparse)")
    ax.set_yticks(range(d.shape[0]))
    ax.set_yticklabels([f"{i}{'*' if i in set(sparse_layers) else ''}" for i in range(d.shape[0])], fontsize=6)
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="density")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


class SparseTrainerHook:
    """What the trainer calls, in one place (so it moves as a unit into a Trainer class).

    ``attach(model, cfg, sp, device, log_dir, is_writer)`` -> None when sparse attention is off.
    Per optimizer step: :meth:`after_step` (predictor step, schedule); :meth:`log` on logged steps
    (``sparse.jsonl`` in the log dir + TensorBoard scalars through ``StepMetrics.log_scalars``);
    checkpoints: :meth:`client_state` / :meth:`load`; at the end :meth:`finish` adds the summary
    entry and writes ``sparse_density.png``.
    """

    KEY = "sparse_attention"

    def __init__(self, runtime, log_dir, is_writer: bool):
        self.runtime, self.is_writer = runtime, is_writer
        # the densities the balancers last got (all 1 = the sampler's initial, dense, cost)
        self.fed: list[list[float]] = [[1.0] * runtime.num_heads for _ in range(runtime.num_layers)]
        self.rebalances: list[dict] = []
        self.log_dir = Path(log_dir)
        self._jsonl = None
        if is_writer:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(self.log_dir / "sparse.jsonl", "a")

    @classmethod
    def attach(cls, model, cfg, *, layout=None, device=None, log_dir=".", is_writer: bool = True):
        rt = attach_sparse_attention(model, cfg, layout=layout, device=device)
        return None if rt is None else cls(rt, log_dir, is_writer)

    def after_step(self) -> None:
        self.runtime.step()

    def log(self, step: int, metrics=None) -> dict:
        """Write one ``sparse.jsonl`` record (call on every rank; the writer rank writes). It carries
        ``head_density`` [layers][heads] (all heads; unprofiled = 1.0) and ``dense_layers``, so
        ``ds_adaptive.planning.sparse_cost.load_densities(log_dir / "sparse.jsonl")`` reads it."""
        m = self.runtime.metrics()
        dens = torch.nan_to_num(self.runtime._all_head_density(), nan=1.0)
        if self._jsonl is not None:
            import json
            rec = {"step": step, **m, "head_density": dens.tolist(),
                   "dense_layers": sorted(self.runtime.schedule.dense_layers)}
            self._jsonl.write(json.dumps(rec) + "\n")
            self._jsonl.flush()
        if metrics is not None and hasattr(metrics, "log_scalars"):
            metrics.log_scalars(step, {k: v for k, v in m.items() if isinstance(v, (int, float))})
        return m

    def rebalance(self, sampler, *, model=None, layout=None, at_step: Optional[int] = None,
                  measured_at: Optional[int] = None) -> Optional[dict]:
        """After an optimizer step (every rank): when the densities the layers run at
        (:func:`effective_densities`) moved by more than ``rebalance_min_change`` since the last
        hand-over, give them to ``update_sparse_balance``: the sampler (if it plans with a sparse cost)
        re-plans from step ``at_step`` of the epoch (``rebalance: step``; None or ``epoch``: from the
        next epoch) and, under SP, the heads are re-placed. Checks that every rank handed over the same
        table and holds the same plan (a collective). Returns the record (None: nothing changed)."""
        cfg = self.runtime.cfg
        if cfg.rebalance == "off":
            return None
        table = effective_densities(self.runtime)
        change = max(abs(a - b) for ra, rb in zip(table, self.fed) for a, b in zip(ra, rb))
        if change <= cfg.rebalance_min_change:
            return None
        self.fed = table
        at = at_step if cfg.rebalance == "step" else None
        placement = self._apply(table, sampler, model, layout, at, measured_at)
        rec = {"step": measured_at, "at_step": at, "epoch": getattr(sampler, "epoch", None), "max_change": change,
               "sampler": bool(sampler is not None and sampler.cost.sparse is not None),
               "placement": None if placement is None else [list(p) if p is not None else None
                                                            for p in placement.perms],
               "fingerprint": _plan_fingerprint(sampler)}
        _check_same_on_all_ranks(table, rec["fingerprint"])
        self.rebalances.append(rec)
        return rec

    def _apply(self, table, sampler, model, layout, at_step, measured_at):
        dm = DensityMap(tuple(tuple(r) for r in table), dense_layers=tuple(sorted(self.runtime.schedule.dense_layers)),
                        step=measured_at, source="sparse-attention profiler")
        use_sampler = sampler if sampler is not None and sampler.cost.sparse is not None else None
        # a head placement permutes Ulysses heads; hybrid meshes keep contiguous heads (docs/CONTEXT_PARALLEL.md)
        sp_on = (model is not None and layout is not None and layout.sp_size > 1
                 and self.runtime.cfg.context_parallel == "heads")
        return update_sparse_balance(dm, model=model if sp_on else None, sp=layout if sp_on else None,
                                     sampler=use_sampler, at_step=at_step, measured_at=measured_at,
                                     head_ids_kwarg="head_ids")

    def client_state(self) -> dict:
        return {self.KEY: {**self.runtime.state_dict(), "fed": self.fed, "rebalances": list(self.rebalances)}}

    def load(self, client_state: dict, *, model=None, layout=None) -> None:
        """Restore the runtime and the densities the balancers last got; under SP re-apply the head
        placement they imply (the sampler restores its own plan from its state)."""
        state = (client_state or {}).get(self.KEY)
        if state is None:
            raise ValueError("adaptive_load.sparse_attention is enabled but the checkpoint has no sparse-attention "
                             "state (it was written without it): the predictor would restart from scratch. "
                             "Resume with sparse_attention disabled, or start a new run")
        self.runtime.load_state_dict(state)
        if "fed" in state:
            self.fed = [list(r) for r in state["fed"]]
            self.rebalances = list(state.get("rebalances", []))
        if self.runtime.cfg.rebalance != "off" and any(x != 1.0 for r in self.fed for x in r):
            self._apply(self.fed, None, model, layout, None, None)

    def finish(self, summary: dict) -> None:
        summary[self.KEY] = {**self.runtime.summary(), "rebalances": list(self.rebalances)}
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self.is_writer:
            dens, title = density_to_draw(self.runtime)
            write_density_png(dens, self.log_dir / "sparse_density.png",
                              sparse_layers=self.runtime.schedule.sparse_layers(), title=title)


def density_to_draw(runtime) -> tuple[torch.Tensor, str]:
    """``([layers, heads], title)`` for ``sparse_density.png``: the profiled densities (the same on every rank:
    all-reduced in ``step()``), or, where no head was profiled (``forced_density``, or a run that ended before
    its first profiling step), the densities the layers ran at (:func:`effective_densities`), titled as such
    instead of a blank map."""
    dens = runtime._all_head_density()
    if not bool(torch.isnan(dens).all()):
        return dens, "profiled attention density"
    forced = runtime.cfg.forced_density
    why = f"forced_density {forced:g}" if forced is not None else "no step profiled"
    return torch.tensor(effective_densities(runtime)), f"attention density run (not profiled: {why}; 1 = dense)"


def _plan_fingerprint(sampler) -> Optional[str]:
    """Hash of the sampler's current plan (sample ids and batch boundaries); None without a sampler."""
    if sampler is None:
        return None

    plan = sampler.plan
    h = hashlib.sha256(plan.sample_ids.tobytes())
    h.update(plan.batch_offsets.tobytes())
    return h.hexdigest()[:12]


def _check_same_on_all_ranks(table: list[list[float]], fingerprint: Optional[str]) -> None:
    """Raise unless every rank handed the same densities over and holds the same plan (a collective)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    t = torch.tensor(table, dtype=torch.float64)
    mine = torch.stack([t.sum(), t.square().sum(), torch.tensor(float(int(fingerprint or "0", 16)), dtype=torch.float64)])
    backend = dist.get_backend()
    dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    mine = mine.to(dev)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    for r, other in enumerate(every):
        if not torch.equal(other, mine):
            raise RuntimeError(f"sparse-attention rebalance: rank {dist.get_rank()} and rank {r} handed different "
                               f"densities or hold different plans ({mine.tolist()} vs {other.tolist()}); the "
                               "profiled densities must be all-reduced before they reach the balancers")
