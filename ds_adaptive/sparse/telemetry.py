"""Sparse-attention telemetry outputs: the density-per-layer/head PNG."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence, Union

import torch


def write_density_png(head_density: Union[torch.Tensor, Sequence[Sequence[float]]], path: Union[str, Path], *,
                      sparse_layers: Sequence[int] = (), title: str = "profiled attention density") -> Path:
    """Heatmap of density ``[layers, heads]`` (share of key blocks holding the softmax mass) -> PNG.

    Layers running sparse are marked on the y axis with '*'. Unprofiled entries (NaN) are blank.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = torch.as_tensor(head_density, dtype=torch.float32)
    if d.dim() != 2:
        raise ValueError(f"head_density must be [layers, heads], got shape {list(d.shape)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(1.0 + 0.35 * d.shape[1], 1.0 + 0.22 * d.shape[0]))
    im = ax.imshow(d.numpy(), aspect="auto", cmap="viridis", vmin=0.0, vmax=max(0.05, float(d.nan_to_num(0).max())))
    ax.set_xlabel("head")
    ax.set_ylabel("layer (* = sparse)")
    ax.set_yticks(range(d.shape[0]))
    ax.set_yticklabels([f"{i}{'*' if i in set(sparse_layers) else ''}" for i in range(d.shape[0])], fontsize=6)
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="density")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
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
        self.log_dir = Path(log_dir)
        self._jsonl = None
        if is_writer:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(self.log_dir / "sparse.jsonl", "a")

    @classmethod
    def attach(cls, model, cfg, *, layout=None, device=None, log_dir=".", is_writer: bool = True):
        from ds_adaptive.sparse.runtime import attach_sparse_attention
        rt = attach_sparse_attention(model, cfg, layout=layout, device=device)
        return None if rt is None else cls(rt, log_dir, is_writer)

    def after_step(self) -> None:
        self.runtime.step()

    def log(self, step: int, metrics=None) -> dict:
        """Write one ``sparse.jsonl`` record (a collective under SP: call on every rank). It carries
        ``head_density`` [layers][heads] (all heads; unprofiled = 1.0) and ``dense_layers``, so
        ``ds_adaptive.balance.sparse.load_densities(log_dir / "sparse.jsonl")`` reads it (issue 15)."""
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

    def client_state(self) -> dict:
        return {self.KEY: self.runtime.state_dict()}

    def load(self, client_state: dict) -> None:
        state = (client_state or {}).get(self.KEY)
        if state is None:
            raise ValueError("adaptive_load.sparse_attention is enabled but the checkpoint has no sparse-attention "
                             "state (it was written without it): the predictor would restart from scratch. "
                             "Resume with sparse_attention disabled, or start a new run")
        self.runtime.load_state_dict(state)

    def finish(self, summary: dict) -> None:
        summary[self.KEY] = self.runtime.summary()
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        dens = self.runtime._all_head_density()  # a collective under SP: every rank calls finish
        if self.is_writer:
            write_density_png(dens, self.log_dir / "sparse_density.png",
                              sparse_layers=self.runtime.schedule.sparse_layers())
