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
