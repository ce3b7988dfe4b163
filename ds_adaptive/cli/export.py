"""``ds-adaptive export CKPT --to DIR``: a trained checkpoint (ZeRO shards consolidated) -> a diffusers-format
transformer (:mod:`ds_adaptive.inference.export`).
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from ds_adaptive.inference.export import DTYPES, ExportError, cfg_model_name, export_checkpoint, resolve_checkpoint
from ds_adaptive.models.family import ModelError
from ds_adaptive.models.registry import get_model
from ds_adaptive.training.lora import LoraError, loading_hint


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="ds-adaptive export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a --save directory, or one of its global_stepN subdirectories")
    ap.add_argument("--to", required=True, metavar="DIR",
                    help="output directory (config.json + safetensors), or a diffusers pipeline directory: the "
                         "model's folder in it (transformer / transformer_2) is written")
    ap.add_argument("--tag", default=None, help="checkpoint tag in a --save directory (default: its 'latest')")
    ap.add_argument("--dtype", default="fp32", choices=DTYPES,
                    help="weights dtype (default fp32; bf16/fp16 keep diffusers' fp32 modules in fp32)")
    ap.add_argument("--model", default=None, help="the model, for checkpoints without ds_adaptive state")
    ap.add_argument("--layers", type=int, default=None, help="number of blocks, when the run used --layers")
    ap.add_argument("--lora", action="store_true",
                    help="LoRA checkpoints: write only the adapters, DIR/pytorch_lora_weights.safetensors in diffusers' "
                         "PEFT format (the diffusers pipeline's load_lora_weights(DIR) loads it)")
    ap.add_argument("--base", default=None,
                    help="LoRA checkpoints exported whole: the base model's directory (default: the run's --init-from); "
                         "the adapters are merged into it")
    ap.add_argument("--ema", action="store_true",
                    help="export the EMA of the weights the run kept (adaptive_load.ema) instead of the trained weights")
    ap.add_argument("--allow-unverified", action="store_true",
                    help="export a checkpoint without a completeness marker (an interrupted save, or written by "
                         "another program) as it is, unchecked")
    args = ap.parse_args(argv)

    try:
        f = export_checkpoint(args.checkpoint, args.to, tag=args.tag, dtype=args.dtype, model=args.model,
                              layers=args.layers, lora=args.lora, base=args.base, ema=args.ema,
                              allow_unverified=args.allow_unverified)
    except (ExportError, ModelError, LoraError) as exc:
        print(f"ds-adaptive export: error: {exc}", file=sys.stderr)
        return 2
    if args.lora:

        spec = get_model(cfg_model_name(*resolve_checkpoint(args.checkpoint, args.tag), args.model))
        print(f"wrote {f} (LoRA adapters, {loading_hint(spec, f.parent)})")
    else:
        print(f"wrote {f.parent / 'config.json'} and {f} (diffusers layout, {args.dtype}"
              + (", the EMA weights)" if args.ema else ")"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
