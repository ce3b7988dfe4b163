"""One validated run configuration: the ds_config's ``adaptive_load`` block plus the trainer's options.

    cfg = RunConfig.load("launch/configs/cpu_tiny.json", trainer={"model": "tiny", "steps": 20})
    cfg = run_config_from_args(args)         # the trainer's CLI: flags override fields of the same models

One source per setting: a command-line flag sets a field of :class:`TrainerConfig` or overrides a
field of the ``adaptive_load`` block (``--fused-ln-modulate`` -> ``adaptive_load.fused_ln_modulate``,
``--log-dir`` -> ``adaptive_load.metrics.log_dir``, ``--shapes`` -> ``adaptive_load.sampler.shapes``,
``--grad-ckpt`` -> ``adaptive_load.recompute.blocks``, ``--global-batch N`` ->
``adaptive_load.sampler.global_batch = {"samples": N}``);
nothing downstream reads the flag again. Relative paths in the ds_config (``sampler.shapes``,
``sampler.profile``) are resolved next to the ds_config first, then from the working directory.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ds_adaptive.core.config import AdaptiveLoadConfig, GlobalBatchConfig
from ds_adaptive.core.ds_config import load_adaptive_config, read_ds_config, require_block
from ds_adaptive.models.registry import get_model
from ds_adaptive.planning.validate import RunFacts, validate_run
from ds_adaptive.training.preview import preview_size

__all__ = ["TrainerConfig", "RunConfig", "UsageError", "run_config_from_args", "resolve_relative",
           "DEFAULT_SAVE_INTERVAL"]

DEFAULT_SAVE_INTERVAL = 100
"""Steps between periodic checkpoints when ``--save`` is given without ``--save-interval``."""


class UsageError(ValueError):
    """A command-line flag combination the trainer cannot run."""


class TrainerConfig(BaseModel):
    """The trainer's options (the flags of ``ds-adaptive train``; each field names its flag)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True,
                              protected_namespaces=())

    model: str = "tiny"
    """``--model``: a registered model (``ds_adaptive.models.registry.model_names()``)."""
    layers: Optional[int] = Field(None, ge=1)
    """``--layers``: override the number of transformer blocks (the cost profile is rescaled to it)."""
    steps: int = Field(20, ge=1)
    """``--steps``: train until this global optimizer step."""
    data: str = "synthetic"
    """``--data``: 'synthetic' (the embedded default) or a directory written by ``ds-adaptive synth``."""
    num_samples: Optional[int] = Field(None, ge=1)
    """``--num-samples``: size of the synthetic dataset (default 10000)."""
    shift: float = Field(5.0, gt=0.0)
    """``--shift``: timestep shift of the flow-matching sampler (default 5)."""
    objective: dict[str, Any] = Field(default_factory=dict)
    """``--objective KEY=VALUE``: override the model's objective options (``ObjectiveOptions``, e.g.
    ``sigma_range=[0.875,1]``)."""
    seed: int = 0
    """``--seed``: model init, data and noise seed."""
    sp: Optional[int] = Field(None, ge=1)
    """``--sp``: Ulysses degree (default: the ds_config's sequence_parallel_size, else 1)."""
    workers: Optional[int] = Field(None, ge=0)
    """``--workers``: DataLoader workers per rank (default: 2 on GPU, 0 on CPU)."""
    compute_timing: bool = True
    """``--compute-timing``: time each rank's compute without ZeRO's waits (CV_step); off: wall clock only."""
    eval_samples: int = Field(0, ge=0)
    """``--eval-samples``: held-out flow-matching loss on this many synthetic samples after training (0: off)."""
    save: Optional[str] = None
    """``--save``: checkpoint directory."""
    save_interval: Optional[int] = Field(None, ge=0)
    """``--save-interval``: save every N steps (default with ``save``: ``DEFAULT_SAVE_INTERVAL``;
    0: only at the end and on a stop signal)."""
    keep_checkpoints: int = Field(3, ge=0)
    """``--keep-checkpoints``: keep the N newest complete checkpoints in ``save`` (0: keep all)."""
    resume: Optional[str] = None
    """``--resume``: the --save directory (its newest complete checkpoint) or DIR/global_stepN."""
    restart_epoch: bool = False
    """``--restart-epoch``: resume the weights, optimizer and step of a checkpoint whose sampler state belongs to
    another dataset (samples were removed or added): the current epoch is planned afresh from its start for this
    dataset (its samples already seen this epoch are seen again); without it that is an error naming the flag."""
    overwrite: bool = False
    """``--overwrite``: start a new run in ``save`` although it holds checkpoints of an earlier run (they are
    deleted at start-up); without it that is an error naming them."""
    init_from: Optional[str] = None
    """``--init-from``: start from pretrained weights (diffusers or the family's original layout) in this
    directory, or the model's folder of a diffusers pipeline directory."""
    nonfinite: Literal["skip", "stop"] = "skip"
    """``--nonfinite``: a step with a non-finite loss or gradient norm is skipped (no update) or stops the run."""
    nonfinite_limit: int = Field(20, ge=0)
    """``--nonfinite-limit``: stop (exit 2) once more than N steps were skipped as non-finite."""

    @property
    def save_every(self) -> int:
        """The effective save interval in steps (0: only at the end / on a stop signal)."""
        return DEFAULT_SAVE_INTERVAL if self.save_interval is None else self.save_interval


class RunConfig(BaseModel):
    """Everything a run is assembled from (``build_run``): the ds_config, its validated ``adaptive_load``
    block and the trainer's options."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, use_attribute_docstrings=True)

    ds_config_path: Optional[str] = None
    """Path of the ds_config json (None when built from a dict)."""
    ds_config: dict
    """The raw ds_config as DeepSpeed would read it (``prepare_ds_config`` makes the engine's copy)."""
    adaptive_load: AdaptiveLoadConfig
    """The validated ``adaptive_load`` block, CLI overrides applied, relative paths resolved."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """The trainer's options."""

    @classmethod
    def load(cls, ds_config, *, trainer: Optional[dict] = None, overrides: Optional[dict] = None) -> "RunConfig":
        """From a ds_config path or dict; ``overrides`` = {dotted adaptive_load key: value} (None values skipped)."""
        path = None if isinstance(ds_config, dict) else str(ds_config)
        raw = read_ds_config(ds_config)
        block = load_adaptive_config(raw if path is None else path)
        if path is not None:
            s = block.sampler
            s.shapes = resolve_relative(s.shapes, path)
            s.profile = resolve_relative(s.profile, path)
            pv = block.preview
            pv.prompts, pv.vae = resolve_relative(pv.prompts, path), resolve_relative(pv.vae, path)
            if block.caption_dropout is not None:
                block.caption_dropout.embedding = resolve_relative(block.caption_dropout.embedding, path)
        for key, value in (overrides or {}).items():
            if value is not None:
                _set_dotted(block, key, value)
        try:
            opts = TrainerConfig.model_validate(trainer or {})
        except ValidationError as exc:
            raise UsageError(_flag_error(exc)) from None
        return cls(ds_config_path=path, ds_config=raw, adaptive_load=block, trainer=opts)


def resolve_relative(path: Optional[str], config_path: str) -> Optional[str]:
    """A relative path from the ds_config is tried next to the config first, then from the CWD.
    Names without a path separator or suffix (shipped profile names) are kept as they are."""
    if path is None or os.path.isabs(path):
        return path
    beside = Path(config_path).parent / path
    return str(beside) if beside.exists() else path


def _set_dotted(block: BaseModel, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    target = block
    for p in parents:
        target = getattr(target, p)
    setattr(target, leaf, value)


def _flag_error(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        name = str(err["loc"][0]) if err["loc"] else "?"
        flag = "--" + name.replace("_", "-")
        ctx = err.get("ctx") or {}
        bound = next((f"{sym} {ctx[k]}" for k, sym in (("ge", ">="), ("gt", ">")) if k in ctx), None)
        parts.append(f"{flag} must be {bound}, got {err.get('input')!r}" if bound
                     else f"{flag}: {err['msg']} (got {err.get('input')!r})")
    return "; ".join(parts)


TRAINER_FLAGS = tuple(TrainerConfig.model_fields)
"""argparse destinations that are TrainerConfig fields (the rest are overrides or launcher flags)."""


def run_config_from_args(args, *, world: Optional[int] = None, device: Optional[str] = None) -> RunConfig:
    """The trainer CLI's namespace -> a validated :class:`RunConfig`, with the checks that need no
    process group done here (bad flags fail before any rank starts a collective). ``world`` / ``device``: the
    launch the rules are checked for (default: the launcher's WORLD_SIZE and this machine; the dry run's plan)."""
    trainer = {k: getattr(args, k) for k in TRAINER_FLAGS if getattr(args, k, None) is not None}
    if "objective" in trainer:
        trainer["objective"] = parse_key_values(trainer["objective"], "--objective")
    if args.data != "synthetic" and (args.shapes or args.num_samples is not None):
        raise UsageError(f"--shapes and --num-samples describe the synthetic dataset; --data {args.data} "
                         "reads its samples and shapes from its index.json")
    if args.eval_samples and args.data != "synthetic":
        raise UsageError(f"--eval-samples {args.eval_samples}: held-out evaluation needs --data synthetic "
                         "(the held-out set is drawn from its shape mix); to score a held-out split of your own "
                         "data during training, set adaptive_load.validation (e.g. {\"samples\": 64, \"every\": 200})")
    # adaptive-load-only flags without an adaptive_load block would silently change nothing
    require_block(args.deepspeed_config, [f"--{'' if args.fused_ln_modulate else 'no-'}fused-ln-modulate"]
                  if args.fused_ln_modulate is not None else [])
    global_batch = getattr(args, "global_batch", None)
    if global_batch is not None and global_batch < 1:
        raise UsageError(f"--global-batch (GLOBAL_BATCH) must be >= 1 samples per optimizer step, got {global_batch}")
    cfg = RunConfig.load(args.deepspeed_config, trainer=trainer, overrides={
        "fused_ln_modulate": args.fused_ln_modulate, "metrics.log_dir": args.log_dir,
        "sampler.shapes": args.shapes, "recompute.blocks": args.grad_ckpt,
        "sampler.global_batch": None if global_batch is None else GlobalBatchConfig(samples=global_batch)})
    _check_planned_layout(cfg, world=world, device=device)
    return cfg


def parse_key_values(items, flag: str) -> dict:
    """``["k=v", ...]`` -> ``{k: v}``; a value is JSON when it parses (numbers, lists, true/false), else a string."""
    import json

    out = {}
    for item in items:
        key, sep, value = str(item).partition("=")
        if not sep or not key:
            raise UsageError(f"{flag}: expected KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _check_planned_layout(cfg: RunConfig, *, world: Optional[int] = None, device: Optional[str] = None) -> None:
    """The model's objective overrides, the preview size on its grid, and the cross-field rules
    (``ds_adaptive.planning.validate``) for the launcher's WORLD_SIZE and this machine's device, before torch.distributed
    exists: a bad config fails on every rank before any collective."""
    import torch


    t = cfg.trainer
    model = get_model(t.model)
    model.objective_with(t.objective)
    if cfg.adaptive_load.preview.enabled:  # the preview size on the model's grid

        preview_size(cfg.adaptive_load.preview, model.input_spec)
    validate_run(cfg.ds_config, cfg.adaptive_load, RunFacts(
        model=t.model, layers=t.layers, sp=t.sp, world=world or int(os.environ.get("WORLD_SIZE", "1")),
        device=device or ("cuda" if torch.cuda.is_available() else "cpu")))
