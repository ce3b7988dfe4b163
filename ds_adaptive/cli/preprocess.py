"""``ds-adaptive preprocess``: media + captions -> latent shards of a model that ``train --data DIR`` reads.

    ds-adaptive preprocess INPUT --out DIR --pipeline Wan2.1-T2V-1.3B-Diffusers
    ds-adaptive preprocess INPUT --out DIR --model wan2.2-ti2v-5b --pipeline Wan2.2-TI2V-5B-Diffusers
    ds-adaptive preprocess INPUT --out DIR --vae V --text-encoder T --tokenizer K

``--model`` (default: the default model) picks the VAE and text encoder classes, the grid rule the
shapes must fit, the media defaults of the shape policy and the text length; the written dataset is
for that model (``train --model`` checks it).
    torchrun --nproc-per-node 8 -m ds_adaptive.cli.preprocess INPUT --out DIR --pipeline P   # one GPU each

INPUT is a manifest (.jsonl / .csv: path, caption[, start, end, fps]) or a folder of media with
``<stem>.txt`` captions. The input is split into work units of ``--items-per-unit`` consecutive
items; rank r of WORLD_SIZE (torchrun / deepspeed launcher / any launcher that sets RANK and
WORLD_SIZE) takes units r, r + W, ... No process group is needed: a unit is finished when its
record ``parts/unit-NNNNN.json`` exists (written after its shard files ``shard-NNNNN-*``, each
renamed into place when complete). A killed job rerun with the same command skips finished units
and redoes the others; the result is byte-identical to an uninterrupted run (same devices). The
process that finishes the last unit writes ``index.arrow`` (the dataset), ``rejects.jsonl`` (path
and reason of every item that gave no sample) and ``report.json``. Rerunning a finished job only
rewrites those three files. The text encoder's embedding of the empty prompt goes to ``empty_prompt.safetensors``
(what ``adaptive_load.caption_dropout`` trains the unconditional branch with); a rerun of a job finished before
that file existed writes it (rank 0).
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from ds_adaptive.media.encode import EncoderError
from ds_adaptive.models.registry import default_model, model_names
from ds_adaptive.preprocess.manifest import ManifestError
from ds_adaptive.preprocess.policy import PolicyError
from ds_adaptive.preprocess.run import PreprocessError, run


def add_policy_args(parser: argparse.ArgumentParser) -> None:
    """The shape-policy flags shared by ``preprocess`` and ``stats``."""
    parser.add_argument("--model", default=None, choices=model_names(),
                        help=f"the model the data is for: its VAE, text encoder, grid rule and media defaults "
                             f"(default: {default_model()})")
    s = parser.add_argument_group("shape policy (defaults: the model's; a --policy json holds the same keys; flags "
                                  "override it)")
    s.add_argument("--policy", default=None, help="JSON file with ShapePolicy keys")
    s.add_argument("--fps", type=float, default=None, help="sampling frame rate (default: the model's, e.g. 16)")
    s.add_argument("--frames", type=int, nargs="+", default=None,
                   help="clip frame counts, 4n+1 (default: the model's, e.g. 17 33 49 81)")
    s.add_argument("--video-sizes", nargs="+", default=None,
                   help="video buckets HxW (default: the model's, e.g. 480x832 832x480 720x1280)")
    s.add_argument("--image-sizes", nargs="+", default=None,
                   help="image buckets HxW (default: the model's, e.g. 480x832 832x480 1024x1024 720x1280)")
    s.add_argument("--long-clips", choices=["cut", "truncate"], default=None,
                   help="long videos: cut into clips (default) or keep the first clip")
    s.add_argument("--max-clips-per-video", type=int, default=None, help="with cut: at most N clips per video")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds-adaptive preprocess", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help="manifest (.jsonl / .csv) or a folder of media with <stem>.txt captions")
    p.add_argument("--out", required=True, help="output dataset directory (created; resumed if it holds this job)")
    w = p.add_argument_group("weights (local diffusers-format directories; never downloaded)")
    w.add_argument("--pipeline", default=None, help="the model's diffusers pipeline directory (vae/, text_encoder/, "
                   "tokenizer/)")
    w.add_argument("--vae", default=None, help="the model's VAE directory (default: PIPELINE/vae)")
    w.add_argument("--text-encoder", default=None, help="its text encoder directory (default: PIPELINE/text_encoder)")
    w.add_argument("--tokenizer", default=None, help="tokenizer directory (default: PIPELINE/tokenizer)")
    add_policy_args(p)
    e = p.add_argument_group("encoding")
    e.add_argument("--device", default="auto", help="auto (cuda:LOCAL_RANK if CUDA is available, else cpu), cpu, cuda")
    e.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="encoder dtype (auto: bfloat16 on GPU, as the pipelines run them; float32 on CPU)")
    e.add_argument("--storage-dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="dtype of the stored tensors (auto: the encoder dtype)")
    e.add_argument("--vae-tiling", choices=["auto", "on", "off"], default="auto",
                   help="diffusers' spatial VAE tiling (auto: frames above 720x1280 pixels)")
    e.add_argument("--vae-batch", type=int, default=1, help="consecutive same-shape clips per VAE call (images: "
                   "try 8)")
    e.add_argument("--text-batch", type=int, default=16, help="captions per text-encoder call")
    e.add_argument("--text-len", type=int, default=None, help="tokens per caption (default: the model's, 512)")
    j = p.add_argument_group("job")
    j.add_argument("--items-per-unit", type=int, default=32, help="input items per work unit (the resume grain)")
    j.add_argument("--shard-mb", type=float, default=1024, help="largest shard file, MiB")
    j.add_argument("--workers", type=int, default=None, help="decoding processes per rank (default: CPUs / ranks, "
                   "at most 8; 0 decodes in the main process). Decoded clips reach the encoder through shared "
                   "memory (/dev/shm; an 81x720x1280 clip is 224 MB): in a container give it room (--shm-size)")
    j.add_argument("--overwrite", action="store_true", help="clear a previous job's output in --out first")
    j.add_argument("--no-progress", action="store_true", help="no progress bar")
    j.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        summary = run(args)
    except (PreprocessError, PolicyError, ManifestError, EncoderError) as exc:
        print(f"ds-adaptive preprocess: {exc}", file=sys.stderr)
        return 2
    report = summary["report"]
    return 1 if report is not None and report["samples"] == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
