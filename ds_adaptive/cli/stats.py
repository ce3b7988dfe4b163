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
from pathlib import Path
from typing import Optional

from ds_adaptive.cli.preprocess import add_policy_args
from ds_adaptive.data.index import find_index
from ds_adaptive.preprocess.manifest import ManifestError
from ds_adaptive.preprocess.policy import PolicyError, policy_from_args
from ds_adaptive.preprocess.stats import collect, plot, shapes_json, table


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
