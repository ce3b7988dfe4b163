"""The shape mix of a latent dataset, or the one a manifest / folder will give: ``ds-adaptive stats``
(``ds_adaptive/cli/stats.py``) prints :func:`table`, writes :func:`shapes_json` and :func:`plot`.

For a manifest or folder the shapes are predicted from the files' headers with the same shape
policy as ``preprocess``; files that would be rejected are counted per reason.
"""
from __future__ import annotations

from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Optional

import sys
import numpy as np

from ds_adaptive.core.figure import agg_figure
from ds_adaptive.core.shapes import SampleShape
from ds_adaptive.data.index import find_index
from ds_adaptive.data.shards import LatentShardDataset
from ds_adaptive.preprocess.manifest import MediaItem, read_inputs
from ds_adaptive.preprocess.policy import ShapePolicy
from ds_adaptive.preprocess.media import MediaError, planned_shapes, probe
from ds_adaptive.preprocess.run import _reason_kind


def _predict(job: tuple[MediaItem, ShapePolicy]) -> tuple[list[SampleShape], Optional[str]]:

    item, policy = job
    try:
        if item.problem:
            raise MediaError(item.problem)
        return planned_shapes(item, probe(item), policy), None
    except MediaError as exc:
        return [], str(exc)
    except Exception as exc:  # noqa: BLE001 - a bad file is counted, never the end of the command
        return [], f"unexpected error while probing ({type(exc).__name__}: {exc})"


def collect(source: str, policy: ShapePolicy, workers: int = 0) -> tuple[Counter, Counter, str]:
    """(samples per shape, rejects per reason kind, description) of a dataset dir or a manifest / folder."""
    src = Path(source)
    if src.is_dir() and find_index(src) is not None:
        ds = LatentShardDataset(src, verify="off", spec=policy.spec)
        counts = np.bincount(ds.shape_ids(), minlength=len(ds.unique_shapes()))
        shapes = Counter({s: int(n) for s, n in zip(ds.unique_shapes(), counts) if n})
        return shapes, Counter(), f"shape mix of the latent dataset {src}"
    items = read_inputs(src)
    jobs = [(it, policy) for it in items]
    if workers > 0:
        with ProcessPoolExecutor(workers) as pool:
            results = list(pool.map(_predict, jobs, chunksize=16))
    else:
        results = [_predict(j) for j in jobs]
    shapes, rejects = Counter(), Counter()
    for found, reason in results:
        shapes.update(found)
        if reason:
            rejects[_reason_kind(reason)] += 1
    desc = (f"shape mix predicted for {src} ({len(items)} items) with fps {policy.fps:g}, frames "
            f"{policy.frame_counts}, long clips {policy.long_clips}")
    return shapes, rejects, desc


def table(shapes: Counter) -> str:
    total_n = sum(shapes.values())
    total_t = sum(s.tokens * n for s, n in shapes.items())
    rows = [f"{'shape (FxHxW)':<16} {'samples':>8} {'% samples':>9} {'tokens':>7} {'% tokens':>8}"]
    for s in sorted(shapes):
        n = shapes[s]
        rows.append(f"{str(s):<16} {n:>8} {100 * n / total_n:>8.1f}% {s.tokens:>7} "
                    f"{100 * n * s.tokens / total_t:>7.1f}%")
    n_img = sum(n for s, n in shapes.items() if s.is_image)
    rows.append(f"{total_n} samples ({n_img} images, {total_n - n_img} videos), {total_t} tokens, "
                f"{len(shapes)} shapes")
    return "\n".join(rows)


def shapes_json(shapes: Counter, description: str) -> dict:
    """The shape-distribution format of ``ds_adaptive/data/default_shapes.json`` (weights = counts)."""
    return {"description": description,
            "shapes": [{**s.as_dict(), "weight": shapes[s]} for s in sorted(shapes)]}


def plot(shapes: Counter, path: Path, title: str) -> None:
    order = sorted(shapes)
    n = [shapes[s] for s in order]
    tok = [shapes[s] * s.tokens for s in order]
    fig = agg_figure(figsize=(max(8, 0.6 * len(order) + 4), 4.5))
    axes = fig.subplots(1, 2)
    for ax, vals, label in ((axes[0], n, "samples"), (axes[1], [t / 1e6 for t in tok], "tokens (millions)")):
        ax.bar(range(len(order)), vals, color=["tab:orange" if s.is_image else "tab:blue" for s in order])
        ax.set_xticks(range(len(order)), [str(s) for s in order], rotation=60, ha="right", fontsize=8)
        ax.set_ylabel(label)
    axes[0].set_title("samples per shape (orange: images)")
    axes[1].set_title("tokens per shape (what compute follows)")
    fig.suptitle(title[:120], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":   # the command moved to the cli layer: say where, never exit 0 having done nothing
    print("python -m ds_adaptive.preprocess.stats is no longer a command: run `ds-adaptive stats` (or python -m ds_adaptive.cli.stats) "
          "with the same arguments", file=sys.stderr)
    raise SystemExit(2)
