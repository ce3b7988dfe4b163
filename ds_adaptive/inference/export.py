"""``ds-adaptive export CKPT --to DIR``: a trained DeepSpeed checkpoint -> a diffusers-format transformer.

    ds-adaptive export ckpt --to finetuned                     # the checkpoint 'latest' names
    ds-adaptive export ckpt/global_step1000 --to out --dtype bf16
    ds-adaptive export ckpt_high --to my_pipeline && ds-adaptive export ckpt_low --to my_pipeline

CKPT is a ``--save`` directory (its ``latest`` checkpoint, or ``--tag``) or one of its
``global_stepN`` subdirectories. ZeRO shards (stage 1-3, any number of ranks) are consolidated
into full fp32 tensors with DeepSpeed's ``zero_to_fp32`` utilities on the CPU and written by the
model's weight adapter in diffusers' layout as ``DIR/config.json`` +
``DIR/diffusion_pytorch_model.safetensors``: the diffusers transformer class loads it with
``from_pretrained(DIR)``, and so does the trainer's ``--init-from``. When ``DIR`` is a diffusers
pipeline directory (it has ``model_index.json``, e.g. a copy of the base pipeline) the weights go to
the model's own folder in it (``transformer``, or ``transformer_2`` for the second expert of a
mixture), so exporting both experts of a run pair into one copy gives a complete pipeline. The model
(``--model`` and ``--layers`` of the run) comes from the checkpoint's ds_adaptive state;
``--model`` / ``--layers`` give it for checkpoints written by other code. ``--ema`` exports the EMA of the
weights the run kept (``adaptive_load.ema``: every rank's slices put together, ``ds_adaptive.training.ema``)
instead of the trained weights; with ``--lora``, the EMA of the adapters.

Exit status: 0 written, 2 a checkpoint or argument that cannot be exported (one message, no traceback).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

from ds_adaptive.models.family import ModelError
from ds_adaptive.models.registry import get_model
from ds_adaptive.core.ckpt_pointer import directory_run_id, newest_complete, read_pointer
from ds_adaptive.training.checkpoint import (MARKER, CLIENT_STATE_KEY, CheckpointError, check_checkpoint, last_good,
                                             read_client_state as checkpoint_client_state, read_marker)
from ds_adaptive.training.ema import EmaError, consolidate as consolidate_ema
from ds_adaptive.training.lora import export_lora, merged_weights


DTYPES = ("fp32", "bf16", "fp16")


class ExportError(ValueError):
    """A checkpoint that cannot be exported; the message names the file and what to do."""


def _pointed(p: Path, path: str, log) -> str:
    """The checkpoint ``p/latest`` names, under the pointer rule (``ds_adaptive.core.ckpt_pointer``): a bare
    ``global_stepN`` of ``p`` written by the directory's run; otherwise (one line) the newest complete one."""
    named, note = read_pointer(p)
    owner = directory_run_id(p, exclude=(named,) if named else ())
    if named is not None and owner and (read_marker(p / named) or {}).get("run_id") not in (None, owner):
        note, named = (f"{p / 'latest'} names {named}, a checkpoint of another run (run id "
                       f"{read_marker(p / named).get('run_id')}, the directory's run is {owner}): ignored"), None
    if named is not None:
        return named
    fallback = newest_complete(p, run_id=directory_run_id(p))
    if note is None and fallback is None:
        raise ExportError(f"{path} has no 'latest' file and no *model_states.pt: not a DeepSpeed checkpoint "
                          "directory; pass --tag global_stepN or the global_stepN directory itself")
    if fallback is None:
        raise ExportError(f"{note}; and {path} holds no complete checkpoint: pass --tag global_stepN")
    log(f"ds-adaptive export: {note}; exporting {fallback}")
    return fallback


def resolve_checkpoint(path: str, tag: Optional[str] = None, log=print) -> tuple[Path, str]:
    """(save directory, tag) of ``path``: a --save directory (its 'latest', or ``tag``) or DIR/global_stepN."""
    p = Path(path)
    if not p.exists():
        raise ExportError(f"checkpoint {path} does not exist; pass the directory given to the trainer's --save "
                          "or one of its global_stepN subdirectories")
    if p.is_dir() and any(p.glob("*model_states.pt")):
        if tag is not None and tag != p.name:
            raise ExportError(f"{path} is the checkpoint '{p.name}' but --tag {tag} was given; drop one")
        return p.parent, p.name
    if tag is None:
        tag = _pointed(p, path, log)
    if not (p / tag).is_dir() or not any((p / tag).glob("*model_states.pt")):
        raise ExportError(f"checkpoint '{tag}' of {path} is missing or incomplete ({p / tag} holds no "
                          "*model_states.pt); pick another with --tag")
    return p, tag


def verify_checkpoint(save_dir: Path, tag: str, log=print, allow_unverified: bool = False) -> None:
    """The checkpoint's files against its completeness marker (sizes and checksums, every byte read):
    ExportError naming the first bad file. A checkpoint without a marker (an interrupted save, or another
    program's) is refused unless ``allow_unverified`` (``--allow-unverified``); one saved after non-finite steps
    is exported with a note naming the last good one."""
    if not allow_unverified and read_marker(save_dir / tag) is None:
        good = last_good(save_dir, exclude=(tag,))
        raise ExportError(f"{save_dir / tag} has no completeness marker {MARKER}: its save may have been "
                          "interrupted, so it cannot be verified; nothing was written. Export another checkpoint"
                          + (f" (--tag {good})" if good else " (--tag)")
                          + ", or pass --allow-unverified to export it as it is")
    problem = check_checkpoint(save_dir / tag, need_marker=False)
    if problem is not None:
        good = last_good(save_dir, exclude=(tag,))
        raise ExportError(f"{problem}; nothing was written. Export another checkpoint"
                          + (f" (--tag {good}: the newest other one marked good)" if good else " (--tag)"))
    marker = read_marker(save_dir / tag) or {}
    if not marker.get("good", True):
        good = last_good(save_dir, marker.get("run_id"))
        log(f"ds-adaptive export: note: {tag} was saved after non-finite step(s) {marker.get('nonfinite_steps')}"
            + (f"; the last checkpoint whose steps were all finite is {good} (--tag {good})" if good else ""))


def read_client_state(ckpt_dir: Path) -> dict:
    """:func:`ds_adaptive.training.checkpoint.read_client_state` with its error as an :class:`ExportError`."""
    try:
        return checkpoint_client_state(ckpt_dir)
    except CheckpointError as exc:
        raise ExportError(f"{exc}: export another one (--tag)") from None


def consolidated_state_dict(save_dir: Path, tag: str, *, ema: bool = False) -> dict:
    """Full fp32 tensors of every trained parameter (ZeRO shards merged), WanModel names; ``ema``: the averaged
    parameters replaced by the checkpoint's EMA of them."""
    import torch

    ckpt = save_dir / tag
    zero_files = list(ckpt.glob("*optim_states.pt"))
    try:
        if zero_files:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            sd = get_fp32_state_dict_from_zero_checkpoint(str(save_dir), tag=tag)
        else:  # ZeRO disabled: the module's state dict is in the model file
            sd = torch.load(next(ckpt.glob("*model_states.pt")), map_location="cpu", weights_only=True)["module"]
    except ExportError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ExportError(f"cannot consolidate the checkpoint {ckpt} ({type(exc).__name__}: {exc}); a shard is "
                          "missing or corrupt: export another checkpoint (--tag)") from None
    sd = {k: v for k, v in sd.items() if torch.is_tensor(v)}
    # a run under Ulysses SP may wrap the model (wrapper.model)
    if sd and all(k.startswith("model.") for k in sd):
        sd = {k[len("model."):]: v for k, v in sd.items()}
    return with_ema(sd, ckpt) if ema else sd


def with_ema(sd: dict, ckpt: Path) -> dict:
    """``sd`` with every parameter the EMA of checkpoint ``ckpt`` averages replaced by its average (fp32)."""
    try:
        avg = consolidate_ema(ckpt)
    except EmaError as exc:
        raise ExportError(str(exc)) from None
    unknown = sorted(set(avg) - set(sd))
    if unknown:
        raise ExportError(f"{ckpt}: the EMA averages {unknown[:3]}, which the checkpoint's weights do not hold; the "
                          "EMA files belong to another run")
    return {**sd, **avg}


def export_checkpoint(ckpt: str, out: str, *, tag: Optional[str] = None, dtype: str = "fp32",
                      model: Optional[str] = None, layers: Optional[int] = None, lora: bool = False,
                      base: Optional[str] = None, ema: bool = False, allow_unverified: bool = False) -> Path:
    """Write the diffusers-format transformer of a DeepSpeed checkpoint to ``out`` (or to the model's folder of
    the diffusers pipeline directory ``out``); returns the weights file. ``lora``: write only the LoRA adapters
    of a LoRA checkpoint (``out/pytorch_lora_weights.safetensors``, ``ds_adaptive.training.lora.export_lora``). A LoRA
    checkpoint exported whole gets its adapters merged into its base (``base``: the base's directory, default
    the run's ``--init-from``)."""
    import torch


    if dtype not in DTYPES:
        raise ExportError(f"--dtype must be one of {DTYPES}, got {dtype!r}")
    save_dir, tag = resolve_checkpoint(ckpt, tag)
    verify_checkpoint(save_dir, tag, allow_unverified=allow_unverified)
    destination_problem(out)
    if lora:

        return export_lora(save_dir, tag, read_client_state(save_dir / tag), out,
                           consolidated_state_dict(save_dir, tag, ema=ema),
                           spec=get_model(cfg_model_name(save_dir, tag, model)))
    cfg, sd = checkpoint_weights(save_dir, tag, model=model, layers=layers, base=base, ema=ema)
    spec = get_model(cfg_model_name(save_dir, tag, model))
    with torch.device("meta"):
        net = spec.build(cfg)
    net.to_dtype({"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype])
    spec.weights.load_state_dict(net, sd, source=str(save_dir / tag))
    target = Path(out)
    if (target / "model_index.json").is_file():   # a diffusers pipeline: the model's own folder in it
        target = target / spec.subfolder
    return _written(lambda: spec.weights.save(net, target, layout="diffusers"), target)


def destination_problem(out: str) -> None:
    """``--to out`` must be a directory this process can write (or one it can create): ExportError otherwise."""
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise ExportError(f"--to {out} is an existing file, not a directory; nothing was written. Pass a "
                          "directory (it is created), or remove the file")
    probe_dir = p if p.is_dir() else next((a for a in p.parents if a.exists()), Path("."))
    if not os.access(probe_dir, os.W_OK | os.X_OK):
        raise ExportError(f"--to {out}: {probe_dir} is not writable (permission denied or a read-only "
                          "filesystem); nothing was written. Pick a directory you can write")


def _written(save, target: Path):
    """Run ``save()`` (it writes files into ``target``); an OSError (a full disk, a read-only filesystem) removes
    the files it created and is one ExportError."""
    before = set(target.iterdir()) if target.is_dir() else set()
    try:
        return save()
    except OSError as exc:
        created = (set(target.iterdir()) if target.is_dir() else set()) - before
        for f in created:
            if f.is_file():
                f.unlink(missing_ok=True)
        free = shutil.disk_usage(target if target.exists() else target.parent).free
        raise ExportError(f"--to {target}: writing the weights failed ({exc.strerror or exc}; "
                          f"{free / 1e6:.1f} MB free there); the partial files were removed. Free some space or "
                          "pick another --to") from None


def cfg_model_name(save_dir: Path, tag: str, model: Optional[str] = None) -> str:
    """The model a checkpoint holds: ``model`` (``--model``), else its ds_adaptive client state's."""
    name = model or read_client_state(save_dir / tag).get("model")
    if name is None:
        raise ExportError(f"{save_dir / tag} was not written by ds_adaptive (no '{CLIENT_STATE_KEY}' client state): "
                          "pass --model (and --layers) to say which model it holds")
    return name


def checkpoint_weights(save_dir: Path, tag: str, *, model: Optional[str] = None, layers: Optional[int] = None,
                       base: Optional[str] = None, ema: bool = False):
    """``(model config, {model parameter name: fp32 tensor})`` of the model a checkpoint holds (``export`` and
    ``ds-adaptive sample``): ZeRO shards consolidated, names and shapes checked by the family's weight adapter;
    a LoRA checkpoint's adapters merged into its base."""
    import torch


    state = read_client_state(save_dir / tag)
    name = cfg_model_name(save_dir, tag, model)
    n_layers = layers if layers is not None else state.get("layers")
    try:
        spec = get_model(name)
        cfg = spec.config(**({"num_layers": n_layers} if n_layers else {}))
    except ModelError as exc:
        raise ExportError(f"model {name!r} (layers {n_layers}): {exc}") from None
    sd = consolidated_state_dict(save_dir, tag, ema=ema)
    if state.get("lora"):

        return cfg, merged_weights(cfg, state["lora"], sd, spec=spec, base=base, what=str(save_dir / tag))
    with torch.device("meta"):
        net = spec.build(cfg)
    net.to_dtype(torch.float32)
    try:
        spec.weights.load_state_dict(net, sd, source=f"{save_dir / tag} (model {name}, {cfg.num_layers} blocks)")
    except ModelError as exc:
        raise ExportError(f"{exc}\nIf the run used --layers N, pass --layers N.") from None
    return cfg, {n: p.detach() for n, p in net.named_parameters()}
