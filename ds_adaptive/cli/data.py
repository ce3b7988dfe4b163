"""``ds-adaptive data``: the dataset index of a latent dataset directory.

    ds-adaptive data convert DIR [--model M] [--keep-json]   # index.json (version 1) -> index.arrow
    ds-adaptive data check DIR [--model M]                   # every shard's header against the index

``convert`` reads the old JSON index once, checks it for the model, writes ``DIR/index.arrow``, compares it
with the JSON's table and renames ``index.json`` to ``index.json.bak`` (``--keep-json``: leave it for older
ds_adaptive versions; the Arrow index is the one read when both exist). Shards are not touched.
``check`` opens every shard (headers only, no tensor read), which training does lazily, shard by shard:
run it once after copying a dataset to find a missing or corrupt shard before a job does.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Optional

import numpy as np

from ds_adaptive.core.shapes import ShapeError
from ds_adaptive.data.convert import convert_dataset
from ds_adaptive.data.shards import LatentShardDataset
from ds_adaptive.data.synthetic import DataError
from ds_adaptive.models.family import ModelError
from ds_adaptive.models.registry import default_model, get_model


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds-adaptive data", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="action", required=True)
    for name, help_ in (("convert", "write DIR/index.arrow from DIR/index.json"),
                        ("check", "check every shard of DIR against its index")):
        s = sub.add_parser(name, help=help_, description=help_)
        s.add_argument("dir", help="the dataset directory")
        s.add_argument("--model", default=None, help="the model the latents are for (default: the default model; "
                       "`ds-adaptive train --help` lists them)")
        if name == "convert":
            s.add_argument("--keep-json", action="store_true", help="keep index.json (default: renamed to .bak)")
            s.add_argument("--overwrite", action="store_true", help="rewrite an existing index.arrow from index.json")
    return p


def _convert(args, spec) -> str:
    r = convert_dataset(args.dir, spec=spec, keep_json=args.keep_json, overwrite=args.overwrite)
    filled = (f"; {', '.join(r['filled_from_model'])} not in the JSON, taken from the model"
              if r["filled_from_model"] else "")
    return (f"converted {r['root']}: {r['samples']} samples, {r['shards']} shards, {r['shapes']} shapes; "
            f"index.json {r['json_bytes'] / 2**20:.1f} MiB (read in {r['read_json_s']:.1f} s) -> index.arrow "
            f"{r['arrow_bytes'] / 2**20:.1f} MiB, {r['seconds']:.1f} s in all; the JSON is now {r['json_now']}"
            + filled)


def _check(args, spec) -> str:
    t0 = time.perf_counter()
    ds = LatentShardDataset(args.dir, verify="off", spec=spec)
    ds.verify()
    counts = np.bincount(ds.shape_ids(), minlength=len(ds.unique_shapes()))
    mix = ", ".join(f"{s} x{n}" for s, n in zip(ds.unique_shapes(), counts))
    return (f"{ds.describe()}; index {ds.index_path.name}; all {len(ds.index.shard_files)} shards hold every "
            f"sample's tensors with the indexed shapes ({time.perf_counter() - t0:.1f} s). Shapes: {mix}")


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        spec = get_model(args.model or default_model()).input_spec
        print((_convert if args.action == "convert" else _check)(args, spec))
    except (DataError, ShapeError, ModelError) as exc:
        print(f"ds-adaptive data {args.action}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
