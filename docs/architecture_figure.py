"""Draws docs/img/layers.png: the package's layers and the imports between them, counted from the code
(``python docs/architecture_figure.py``; the edges come from tests/unit/project/test_layers.py, the check that keeps
them one way)."""
from __future__ import annotations

import collections
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "unit" / "project"))
from test_layers import LAYERS, import_edges, layer_of  # noqa: E402

TIERS = [["core"], ["ops", "models", "parallel", "attention"], ["data", "media", "preprocess"], ["planning"],
         ["calibration", "simulation"], ["training"], ["inference", "integrations"], ["launch"], ["cli"]]
"""Rows of the picture, bottom (imported by everything) to top; within a row, left before right in LAYERS."""


def main(out: Path = HERE / "img" / "layers.png") -> Path:
    assert [name for row in TIERS for name in row] == list(LAYERS), "TIERS must list LAYERS in order"
    counts = collections.Counter((layer_of(a), layer_of(b)) for a, b, _, _ in import_edges()
                                 if layer_of(a) and layer_of(b) and layer_of(a) != layer_of(b))
    pos = {}
    for y, row in enumerate(TIERS):
        for i, name in enumerate(row):
            pos[name] = ((i + 1) / (len(row) + 1), y)
    fig, ax = plt.subplots(figsize=(9, 10))
    for (a, b), n in counts.items():
        (xa, ya), (xb, yb) = pos[a], pos[b]
        ax.add_patch(FancyArrowPatch((xa, ya - 0.18), (xb, yb + 0.18), arrowstyle="-|>", mutation_scale=9,
                                     lw=0.3 + 0.25 * n ** 0.5, color="#7a8ca3", alpha=0.55,
                                     connectionstyle="arc3,rad=0.08"))
    for name, (x, y) in pos.items():
        ax.add_patch(FancyBboxPatch((x - 0.085, y - 0.18), 0.17, 0.36, boxstyle="round,pad=0.01",
                                    fc="#e8f0fb", ec="#2c5aa0", lw=1.2))
        ax.text(x, y, name, ha="center", va="center", fontsize=10)
    ax.set_xlim(0, 1)
    ax.set_ylim(-0.6, len(TIERS) - 0.4)
    ax.axis("off")
    ax.set_title("ds_adaptive: layers and their imports (an arrow points at the imported layer; width ~ imports)",
                 fontsize=10)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    return out


if __name__ == "__main__":
    print(main())
