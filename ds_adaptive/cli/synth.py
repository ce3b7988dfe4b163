"""``ds-adaptive synth``: write the synthetic latent dataset to disk (index.arrow + safetensors shards).

    ds-adaptive synth --out data/synth --num-samples 1000 [--shapes FILE] [--seed S] [--model M]

The samples are exactly those of the embedded default (``--data synthetic`` with the same
``--shapes``, ``--seed`` and ``--num-samples``), so a run on the written directory and a run on
the embedded dataset see the same data.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from ds_adaptive.core.shapes import ShapeError
from ds_adaptive.data.synth import write_synthetic
from ds_adaptive.data.synthetic import DEFAULT_TEXT_LEN, DataError
from ds_adaptive.models.family import ModelError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds-adaptive synth", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (created; must not hold a dataset)")
    p.add_argument("--num-samples", type=int, required=True, help="number of samples to write")
    p.add_argument("--model", default=None,
                   help="the model the latents are for: its VAE's grid, channels and text width (default: the "
                        "default model; `ds-adaptive train --help` lists them)")
    p.add_argument("--shapes", default=None,
                   help="shape-distribution json (default: the model's shipped mix)")
    p.add_argument("--seed", type=int, default=0, help="dataset seed (shapes, classes, text lengths, noise)")
    p.add_argument("--text-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help=f"text length range, max <= the model's text length (default: {list(DEFAULT_TEXT_LEN)} "
                        "clipped to it)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="storage dtype of the tensors (read back as float32)")
    p.add_argument("--shard-mb", type=float, default=1024, help="target shard size in MiB (default 1024)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset in --out")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.num_samples < 1:
        print(f"ds-adaptive synth: --num-samples must be >= 1, got {args.num_samples}", file=sys.stderr)
        return 2
    try:
        done = write_synthetic(args.out, args.num_samples, model=args.model, shapes=args.shapes, seed=args.seed,
                               text_len=tuple(args.text_len) if args.text_len else None, dtype=args.dtype,
                               shard_mb=args.shard_mb, overwrite=args.overwrite)
    except (DataError, ShapeError, FileNotFoundError, ModelError) as exc:
        print(f"ds-adaptive synth: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {done.description} to {args.out} ({done.num_shards} shard file(s), index {done.index}) "
          f"in {done.seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
