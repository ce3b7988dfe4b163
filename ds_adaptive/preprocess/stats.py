"""``ds-adaptive stats``: the shape mix of a latent dataset, or the one a manifest / folder will give.

    ds-adaptive stats data/my_latents                       # a dataset directory (reads its index only)
    ds-adaptive stats videos.jsonl --json shapes.json --png shapes.png [shape-policy flags]

Prints a table (samples and tokens per shape), writes a shapes json in the shape-distribution
format (``{"description", "shapes": [{"frames", "height", "width", "weight"}]}``, weight = sample
count) that ``simulate --shapes``, ``dry-run --shapes``, ``train --shapes`` and the synthetic
dataset accept, and a PNG bar chart (needs matplotlib). For a manifest or folder the shapes are
predicted from the files' headers with the same shape policy as ``preprocess`` (pass the same
policy flags); files that would be rejected are counted per reason.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Optional

import numpy as np

from ds_adaptive.core.shapes import SampleShape
from ds_adaptive.data.index import find_index
from ds_adaptive.data.shards import LatentShardDataset
from ds_adaptive.preprocess.manifest import ManifestError, MediaItem, read_inputs
from ds_adaptive.preprocess.policy import PolicyError, ShapePolicy, add_policy_args, policy_from_args
from ds_adaptive.preprocess.media import MediaError, planned_shapes, probe
from ds_adaptive.preprocess.run import _reason_kind
from ds_adaptive.data.shards import LatentShardDataset


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = sorted(shapes)
    n = [shapes[s] for s in order]
    tok = [shapes[s] * s.tokens for s in order]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 0.6 * len(order) + 4), 4.5))
    for ax, vals, label in ((axes[0], n, "samples"), (axes[1], [t / 1e6 for t in tok], "tokens (millions)")):
        ax.bar(range(len(order)), vals, color=["tab:orange" if s.is_image else "tab:blue" for s in order])
        ax.set_xticks(range(len(order)), [str(s) for s in order], rotation=60, ha="right", fontsize=8)
        ax.set_ylabel(label)
    axes[0].set_title("samples per shape (orange: images)")
    axes[1].set_title("tokens per shape (what compute follows)")
    fig.suptitle(title[:120], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds-adaptive stats", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="a latent dataset directory (index.arrow or index.json), a manifest, or a media "
                   "folder")
    p.add_argument("--json", default=None, help="write the shapes json here (default: SOURCE_shapes.json for a "
                   "manifest, DIR/shapes.json for a dataset)")
    p.add_argument("--png", default=None, help="write the histogram here (default: beside the json, .png)")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                   help="probing processes for a manifest / folder (0: in this process)")
    add_policy_args(p)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        policy = policy_from_args(args)
        shapes, rejects, desc = collect(args.source, policy, args.workers)
    except (PolicyError, ManifestError) as exc:
        print(f"ds-adaptive stats: {exc}", file=sys.stderr)
        return 2
    src = Path(args.source)
    if args.json:
        out_json = Path(args.json)
    elif src.is_dir() and find_index(src) is not None:
        out_json = src / "shapes.json"
    else:
        out_json = src.with_name(src.name.rstrip("/") + "_shapes.json")
    print(desc)
    for kind, n in sorted(rejects.items()):
        print(f"  would be rejected, {kind}: {n}")
    if not shapes:
        print("ds-adaptive stats: no sample: nothing to tabulate (see the reasons above)", file=sys.stderr)
        return 1
    print(table(shapes))
    out_json.write_text(json.dumps(shapes_json(shapes, desc), indent=1) + "\n")
    print(f"shapes json: {out_json} (use with simulate/dry-run/train --shapes)")
    png = Path(args.png) if args.png else out_json.with_suffix(".png")
    try:
        plot(shapes, png, desc)
        print(f"histogram: {png}")
    except ImportError:
        print("histogram: skipped (matplotlib is not installed: pip install 'ds_adaptive[plots]')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
