"""``ds-adaptive sample``: videos from a training checkpoint or an exported model (:mod:`ds_adaptive.inference.sample`).
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

import torch

from ds_adaptive.core.config import ConfigError
from ds_adaptive.inference.export import ExportError
from ds_adaptive.inference.sample import SampleError, sample
from ds_adaptive.media.encode import EncoderError
from ds_adaptive.models.family import ModelError


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ds-adaptive sample", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", nargs="?", help="a --save directory / global_stepN checkpoint, or a model directory")
    ap.add_argument("--model", default=None, help="the model SOURCE holds (default: the checkpoint's, or the "
                                                  "registered architecture of a model directory's config.json)")
    ap.add_argument("--tag", default=None, help="checkpoint tag in a --save directory (default: its 'latest')")
    ap.add_argument("--base", default=None, help="LoRA checkpoints: the base model directory (default: the run's "
                                                 "--init-from)")
    ap.add_argument("--ema", action="store_true", help="a checkpoint SOURCE: sample its EMA weights (adaptive_load.ema)")
    ap.add_argument("--lora", default=None, help="a diffusers-format LoRA file or directory (ds-adaptive export --lora)")
    ap.add_argument("--prompt", action="append", default=[], help="prompt text (repeat for several)")
    ap.add_argument("--negative", default=None, help="negative prompt text (with --text-encoder), or the name of its "
                                                     "embedding in --embeddings; used with --guidance > 1")
    ap.add_argument("--text-encoder", default=None, help="the model's text encoder directory (diffusers / "
                                                         "transformers format)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer directory (default: ../tokenizer next to the encoder, "
                                                      "else the encoder's directory)")
    ap.add_argument("--embeddings", default=None, help="safetensors file of [L, text width] prompt embeddings")
    ap.add_argument("--save-embeddings", default=None, metavar="FILE",
                    help="write the prompt embeddings used to FILE (preview.prompts of a training config)")
    ap.add_argument("--frames", type=int, default=17, help="video frames, 4n+1 (default %(default)s; 1: an image)")
    ap.add_argument("--height", type=int, default=480, help="pixels, a multiple of the model's pixels per token "
                                                            "(16 or 32; default %(default)s)")
    ap.add_argument("--width", type=int, default=832, help="pixels, like --height (default %(default)s)")
    ap.add_argument("--steps", type=int, default=30, help="Euler steps (default %(default)s)")
    ap.add_argument("--guidance", type=float, default=5.0, help="classifier-free guidance scale (1: off; default "
                                                                "%(default)s)")
    ap.add_argument("--shift", type=float, default=5.0, help="timestep shift of the sigmas (default %(default)s, the "
                                                             "trainer's --shift default; smaller videos: lower)")
    ap.add_argument("--seed", type=int, default=0, help="noise seed; prompt i uses seed + i (default %(default)s)")
    ap.add_argument("--vae", default=None, help="the model's VAE directory (diffusers format, e.g. a pipeline's "
                                                "vae/): decode to video (else a latent PNG)")
    ap.add_argument("--format", choices=("mp4", "gif", "png"), default=None,
                    help="output format when --out is a directory (default: mp4 with --vae, png without)")
    ap.add_argument("--fps", type=int, default=None, help="frames per second of videos (default: the model's)")
    ap.add_argument("--out", default=None, help="output file (one prompt) or directory")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                    help="model dtype (default bf16 on CUDA, fp32 on the CPU)")
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)

    try:
        sample(args)
    except (SampleError, ExportError, ConfigError, ModelError, EncoderError) as exc:
        print(f"ds-adaptive sample: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
