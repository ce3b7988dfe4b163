"""Reading a DeepSpeed config json: its ``adaptive_load`` block validated into
:class:`~ds_adaptive.core.config.AdaptiveLoadConfig`, misspelt block names caught, and the dict that
``deepspeed.initialize`` gets (our block stripped, precision and batch keys resolved)."""
from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from pydantic import BaseModel, ValidationError

from ds_adaptive.core.config import BLOCK_KEY, AdaptiveLoadConfig, ConfigError


def _format_validation_error(exc: ValidationError, source: str) -> str:
    lines = [f"invalid '{BLOCK_KEY}' block in {source}:"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        key = f"{BLOCK_KEY}.{loc}" if loc else BLOCK_KEY
        if err["type"] == "extra_forbidden":
            parent = _model_at(err["loc"][:-1])
            valid = ", ".join(sorted(parent.model_fields)) if parent else "?"
            lines.append(f"  - unknown key '{key}'. Valid keys here: {valid}")
        else:
            lines.append(f"  - {key}: {err['msg'].removeprefix('Value error, ')} (got {err.get('input')!r})")
    lines.append("Fix the ds_config json; docs/CONFIG.md (or `ds-adaptive config`) lists every key.")
    return "\n".join(lines)


def _model_at(loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] = AdaptiveLoadConfig
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        else:
            return None
    return model


def read_ds_config(ds_config: Union[str, Path, dict, None]) -> dict:
    """The ds_config as a dict, from a dict or a json path (the one DeepSpeed gets)."""
    if ds_config is None:
        return {}
    if isinstance(ds_config, dict):
        return ds_config
    path = Path(ds_config)
    if not path.is_file():
        raise ConfigError(f"ds_config file {path} does not exist (from --deepspeed_config / DS_CONFIG); "
                          "pass the path of a DeepSpeed json, e.g. launch/configs/zero3_adaptive.json")
    try:
        raw = json.loads(path.read_text(), object_pairs_hook=_unique_keys(path))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"ds_config file {path} is not valid JSON: {exc}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"ds_config file {path} cannot be read ({getattr(exc, 'strerror', None) or exc}); check "
                          "its permissions and that it is a text file") from None
    if _looks_like_shapes(raw):
        raise ConfigError(f"{path} is a shape-distribution file, not a ds_config: pass it as --shapes {path} (or "
                          "adaptive_load.sampler.shapes) and give a DeepSpeed json, e.g. launch/configs/cpu_tiny.json, "
                          "as the ds_config")
    if not isinstance(raw, dict):
        raise ConfigError(f"ds_config file {path} holds a JSON {type(raw).__name__}, expected an object "
                          "({\"train_batch_size\": ..., \"adaptive_load\": {...}}); e.g. launch/configs/cpu_tiny.json")
    return raw


def _unique_keys(path: Path):
    """``json`` object hook that refuses a key given twice in one object: JSON keeps the last silently, so
    ``"enabled": true, "enabled": false`` would turn a feature off without a word."""
    def hook(pairs: list) -> dict:
        out: dict = {}
        for k, v in pairs:
            if k in out:
                raise ConfigError(f"ds_config file {path}: key '{k}' is given twice in one object (JSON keeps the "
                                  "last one silently); keep one")
            out[k] = v
        return out
    return hook


def _looks_like_shapes(raw: Any) -> bool:
    """A shape-distribution json (a list of ``{frames, height, width, weight}``, or ``{"shapes": [...]}``)."""
    items = raw.get("shapes") if isinstance(raw, dict) and BLOCK_KEY not in raw else raw
    return isinstance(items, list) and bool(items) and all(isinstance(i, dict) and {"frames", "height", "width"} <= set(i)
                                                          for i in items)


MISSPELLING_CUTOFF = 0.75
"""difflib ratio (of the lower-cased, alphanumeric-only key to "adaptiveload") from which a top-level key is taken
for a misspelt block name; no DeepSpeed top-level key comes above 0.5."""


def _normalised(key: str) -> str:
    return "".join(c for c in key.lower() if c.isalnum())


def misspelt_block_keys(raw: dict) -> list[str]:
    """Top-level keys of a ds_config that look like a misspelling of ``adaptive_load`` ("adaptive_lod",
    "AdaptiveLoad", "adaptive-load", ...). DeepSpeed ignores unknown top-level keys, so such a typo would
    silently turn AdaptiveLoad off."""
    target = _normalised(BLOCK_KEY)
    return [k for k in raw if isinstance(k, str) and k != BLOCK_KEY
            and difflib.SequenceMatcher(None, _normalised(k), target).ratio() >= MISSPELLING_CUTOFF]


def require_block(ds_config: Union[str, Path, dict, None], flags: list[str]) -> None:
    """Raise ConfigError when command-line ``flags`` that only mean something with AdaptiveLoad are given
    but the ds_config has no ``adaptive_load`` block (the run would silently be the baseline)."""
    if not flags:
        return
    raw = read_ds_config(ds_config)
    if BLOCK_KEY not in raw:
        source = str(ds_config) if not isinstance(ds_config, dict) else "the ds_config dict"
        raise ConfigError(f"{', '.join(flags)} given, but {source} has no '{BLOCK_KEY}' block: AdaptiveLoad would be "
                          f"off and the flag(s) would change nothing you meant. Add an \"{BLOCK_KEY}\" block (e.g. "
                          "from launch/configs/zero3_adaptive.json) or drop the flag(s)")


def load_adaptive_config(ds_config: Union[str, Path, dict, None]) -> AdaptiveLoadConfig:
    """Parse and validate the adaptive_load block; an absent block gives the defaults (disabled).

    A top-level key that looks like a misspelling of ``adaptive_load`` is an error naming it."""
    source = str(ds_config) if not isinstance(ds_config, dict) else "the ds_config dict"
    raw = read_ds_config(ds_config)
    typos = misspelt_block_keys(raw)
    if typos:
        raise ConfigError(f"top-level key(s) {', '.join(repr(k) for k in typos)} in {source} look like a misspelling of "
                          f"'{BLOCK_KEY}'; DeepSpeed ignores unknown keys, so AdaptiveLoad would silently be off. "
                          f"Rename the key to '{BLOCK_KEY}'" + (f" (the file also has an '{BLOCK_KEY}' block: merge them)"
                                                                 if BLOCK_KEY in raw else ""))
    block: Any = raw.get(BLOCK_KEY, {})
    if not isinstance(block, dict):
        raise ConfigError(f"'{BLOCK_KEY}' in {source} must be a JSON object, got {type(block).__name__}")
    try:
        return AdaptiveLoadConfig.model_validate(block)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, source)) from None


def strip_block(ds_config: dict) -> dict:
    """A copy of ds_config without our block (to hand to deepspeed.initialize)."""
    return {k: v for k, v in ds_config.items() if k != BLOCK_KEY}


def _resolve_switch(section: object, key: str, auto_value: bool) -> bool:
    if section is None:
        return False
    if not isinstance(section, dict):
        raise ConfigError(f"ds_config '{key}' must be an object like {{\"enabled\": \"auto\"}}, got {section!r}")
    value = section.get("enabled", False)
    if value == "auto":
        return auto_value
    if not isinstance(value, bool):
        raise ConfigError(f"ds_config '{key}.enabled' must be true, false or \"auto\", got {value!r}")
    return value


def prepare_ds_config(ds_config: dict, *, dp_size: int, on_gpu: bool) -> dict:
    """The dict to hand to ``deepspeed.initialize``: our block stripped, precision and batch keys resolved.

    * ``"bf16": {"enabled": "auto"}`` becomes bf16 on a GPU and fp32 on the CPU (``"fp16"``'s
      ``"auto"`` becomes off); explicit true/false are kept.
    * Micro-batch sizes come from the batch sampler and vary, so DeepSpeed gets a nominal
      ``train_micro_batch_size_per_gpu = 1`` and the real ``gradient_accumulation_steps``: given
      directly (a ``train_batch_size`` next to it must equal micro x gas x dp_size), or derived from
      ``train_batch_size / (train_micro_batch_size_per_gpu x dp_size)`` (``accumulation_steps``).
      ``"gradient_accumulation_steps": "auto"`` stays ``"auto"`` here: the batch sampler chooses it with
      the throughput-optimal compute budget (``ds_adaptive.planning.budget``) and ``build_run`` writes
      the number in (``Run.ds_config``) before ``deepspeed.initialize``.
    * ``steps_per_print`` defaults to off (our metrics log every step).
    """
    out = strip_block(ds_config)
    bf16 = _resolve_switch(out.get("bf16", out.get("bfloat16")), "bf16", on_gpu)
    fp16 = _resolve_switch(out.get("fp16"), "fp16", False)
    if bf16 and fp16:
        raise ConfigError("ds_config enables both 'bf16' and 'fp16'; enable one (bf16 is what the video DiTs train in)")
    out.pop("bfloat16", None)
    out["bf16"] = {**(out.get("bf16") or {}), "enabled": bf16}
    if "fp16" in out:
        out["fp16"] = {**out["fp16"], "enabled": fp16}
    # the one rule for the batch keys: train_batch_size must agree, never silently dropped
    out["gradient_accumulation_steps"] = accumulation_steps(out, dp_size)
    out.pop("train_batch_size", None)
    out["train_micro_batch_size_per_gpu"] = 1
    out.setdefault("steps_per_print", 2**31 - 1)
    return out


def accumulation_steps(ds_config: Mapping[str, Any], dp_size: Optional[int], sp: Optional[int] = None):
    """``gradient_accumulation_steps`` of a ds_config: an int >= 1, or ``"auto"`` (the sampler chooses it).

    ``train_micro_batch_size_per_gpu`` (default 1; the sampler decides the real micro-batch sizes) x
    ``gradient_accumulation_steps`` x dp must equal ``train_batch_size`` when all are given; without
    ``gradient_accumulation_steps`` it is ``train_batch_size / (micro x dp)``; with ``"auto"``,
    ``train_batch_size`` cannot be given. ``dp_size`` None (not known yet): the types only. ``sp`` only explains
    dp in the message. Raises ConfigError."""
    gas, tbs, micro = (ds_config.get("gradient_accumulation_steps"), ds_config.get("train_batch_size"),
                       ds_config.get("train_micro_batch_size_per_gpu"))
    for key, value in (("train_batch_size", tbs), ("train_micro_batch_size_per_gpu", micro)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"ds_config {key} must be an int >= 1, got {value!r}")
    if gas == "auto":
        if tbs is not None:
            raise ConfigError(f"ds_config sets gradient_accumulation_steps 'auto' and train_batch_size {tbs!r}: "
                              "with 'auto' the sampler chooses the micro-steps per optimizer step; drop "
                              "train_batch_size, or set gradient_accumulation_steps to a number")
        return "auto"
    if gas is not None and (not isinstance(gas, int) or isinstance(gas, bool) or gas < 1):
        raise ConfigError(f"ds_config gradient_accumulation_steps must be an int >= 1, got {gas!r} (or \"auto\": "
                          "the adaptive_load sampler chooses it)")
    micro = micro or 1
    if tbs is None or dp_size is None:
        return gas or 1
    if gas is None:
        if tbs % (micro * dp_size):
            raise ConfigError(
                f"ds_config train_batch_size={tbs!r} is not a multiple of train_micro_batch_size_per_gpu "
                f"({micro}) x data-parallel size ({dp_size}); set 'gradient_accumulation_steps' instead "
                "(micro-batch sizes are chosen by the adaptive_load sampler)")
        return tbs // (micro * dp_size)
    if tbs != micro * gas * dp_size:
        raise ConfigError(
            f"ds_config train_batch_size={tbs} != train_micro_batch_size_per_gpu {micro} x "
            f"gradient_accumulation_steps {gas} x dp {dp_size}"
            + (f" (= world {dp_size * sp} / sp {sp})" if sp else "") + f" = {micro * gas * dp_size}; set train_batch_size to "
            f"{micro * gas * dp_size}, or drop it (the trainer derives it) -- an SP group of sp ranks trains one "
            "micro-batch")
    return gas
