"""``ds-adaptive demo-assets DIR``: a tiny random Wan-layout pipeline and a few captioned clips, to try the own-data
workflow (preprocess -> stats -> simulate -> train -> sample -> export) on a CPU in a few minutes.

Writes DIR/pipeline (vae/, text_encoder/, tokenizer/, transformer/, scheduler/, model_index.json: diffusers' Wan
layout, random weights, for the `tiny` model), DIR/clips (four short mp4 videos and an image, each with a
<stem>.txt caption) and DIR/policy.json (the shape policy of the demo: 5-frame clips at 8 fps, 64x112 pixels).

Exit status: 0 written, 2 DIR already holds files (pick another, or remove it).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from ds_adaptive.integrations.diffusers_demo import write_demo


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="ds-adaptive demo-assets", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="the directory to write (created; must be empty or absent)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights and clips (default 0)")
    args = ap.parse_args(argv)
    root = Path(args.dir)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        print(f"ds-adaptive demo-assets: error: {root} already exists and is not empty; pick another directory "
              "or remove it", file=sys.stderr)
        return 2
    try:
        import diffusers  # noqa: F401
        import transformers  # noqa: F401
        import av  # noqa: F401
    except ImportError as exc:
        print(f"ds-adaptive demo-assets: error: {exc.name} is missing: pip install -e \".[preprocess]\"",
              file=sys.stderr)
        return 2
    out = write_demo(root, seed=args.seed)
    print(f"wrote the demo pipeline {out['pipeline']} (random weights of the tiny model), clips {out['clips']} and "
          f"the shape policy {out['policy']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
