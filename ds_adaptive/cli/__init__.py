"""``ds-adaptive`` console script: one sub-command per module, each module owns its own argparse.

Every target module exposes ``main(argv: list[str] | None = None) -> int``.
"""
from __future__ import annotations

import importlib
import sys
from ds_adaptive.planning.profile import ProfileError
from ds_adaptive.core.layout import SequenceParallelError
from ds_adaptive.planning.planner import OversizeSampleError, PlanError
from ds_adaptive.core.config import ConfigError
from ds_adaptive.data.synthetic import DataError
from ds_adaptive.core.shapes import ShapeError
from ds_adaptive.models.family import ModelError

COMMANDS = {
    "train": ("ds_adaptive.cli.train", "train a model with DeepSpeed + AdaptiveLoad (what the launch/ script runs)"),
    "synth": ("ds_adaptive.cli.synth", "write a synthetic latent dataset to disk (index.json + safetensors)"),
    "simulate": ("ds_adaptive.cli.simulate", "plan many ranks on paper: CV, balance, predicted tokens/s per sampler"),
    "calibrate": ("ds_adaptive.cli.calibrate", "profile the real model on this GPU -> cost/memory profile json"),
    "refit": ("ds_adaptive.cli.refit", "a profile's compute and loop terms refitted to trainer runs' logs (CPU)"),
    "report": ("ds_adaptive.cli.report", "status of the fused op: DeepSpeed registry, compatibility, build"),
    "config": ("ds_adaptive.cli.config", "print the adaptive_load reference table, or --check a ds_config's block"),
    "dry-run": ("ds_adaptive.cli.dry_run", "validate a ds_config + topology without GPUs and print the deepspeed command"),
    "export": ("ds_adaptive.cli.export", "a trained checkpoint (ZeRO shards consolidated) -> diffusers-format transformer"),
    "sample": ("ds_adaptive.cli.sample", "generate videos from a checkpoint or exported model (Euler sampler, optional VAE)"),
    "preprocess": ("ds_adaptive.cli.preprocess", "media + captions -> latent shards (the model's VAE + text encoder), multi-GPU, resumable"),
    "stats": ("ds_adaptive.cli.stats", "shape histogram (table, PNG, shapes json) of a latent dataset or manifest"),
    "data": ("ds_adaptive.cli.data", "a latent dataset's index: convert index.json -> index.arrow, check every shard"),
    "plot": ("ds_adaptive.cli.plot", "one PNG of a training run: losses, tokens/s, peak memory and compute per rank"),
    "demo-assets": ("ds_adaptive.cli.demo_assets", "a tiny random diffusers pipeline and captioned clips, to try the "
                                                   "own-data workflow on a CPU"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items())
    return f"usage: ds-adaptive COMMAND [args]\n\ncommands:\n{rows}\n\n'ds-adaptive COMMAND --help' for each."


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"ds-adaptive: unknown command '{name}'.\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    try:
        return int(module.main(rest) or 0)
    except _user_errors() as exc:  # a bad input that a command did not turn into its own message
        print(f"ds-adaptive {name}: error: {exc}", file=sys.stderr)
        return 2


def _user_errors() -> tuple:
    """The project's exception types for bad input (config, shapes, profiles, data, weights, plans)."""


    return (ConfigError, ShapeError, ProfileError, SequenceParallelError, PlanError, OversizeSampleError, DataError,
            FileNotFoundError, ModelError)


if __name__ == "__main__":
    sys.exit(main())
