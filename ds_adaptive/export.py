"""``ds-adaptive export CKPT --to DIR``: a trained DeepSpeed checkpoint -> a diffusers-format Wan transformer.

    ds-adaptive export ckpt --to wan_finetuned                 # the checkpoint 'latest' names
    ds-adaptive export ckpt/global_step1000 --to out --dtype bf16

CKPT is a ``--save`` directory (its ``latest`` checkpoint, or ``--tag``) or one of its
``global_stepN`` subdirectories. ZeRO shards (stage 1-3, any number of ranks) are consolidated
into full fp32 tensors with DeepSpeed's ``zero_to_fp32`` utilities on the CPU, renamed to
diffusers' ``WanTransformer3DModel`` keys and written as ``DIR/config.json`` +
``DIR/diffusion_pytorch_model.safetensors``: ``WanTransformer3DModel.from_pretrained(DIR)`` loads
it, and so do ``WanModel.from_pretrained`` and the trainer's ``--init-from``. The model's shape
(preset and ``--layers``) comes from the checkpoint's ds_adaptive state; ``--model`` / ``--layers``
give it for checkpoints written by other code.

Exit status: 0 written, 2 a checkpoint or argument that cannot be exported (one message, no traceback).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

CLIENT_STATE_KEY = "ds_adaptive"  # the trainer's client_state key (ds_adaptive.trainer.CLIENT_STATE_KEY)
DTYPES = ("fp32", "bf16", "fp16")


class ExportError(ValueError):
    """A checkpoint that cannot be exported; the message names the file and what to do."""


def resolve_checkpoint(path: str, tag: Optional[str] = None) -> tuple[Path, str]:
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
        latest = p / "latest"
        if not latest.is_file():
            raise ExportError(f"{path} has no 'latest' file and no *model_states.pt: not a DeepSpeed checkpoint "
                              "directory; pass --tag global_stepN or the global_stepN directory itself")
        tag = latest.read_text().strip()
    if not (p / tag).is_dir() or not any((p / tag).glob("*model_states.pt")):
        raise ExportError(f"checkpoint '{tag}' of {path} is missing or incomplete ({p / tag} holds no "
                          "*model_states.pt); pick another with --tag")
    return p, tag


def verify_checkpoint(save_dir: Path, tag: str, log=print) -> None:
    """The checkpoint's files against its completeness marker (sizes and checksums, every byte read):
    ExportError naming the first bad file. A checkpoint written by another program (no marker) is exported
    as it is; one saved after non-finite steps is exported with a note naming the last good one."""
    from ds_adaptive.checkpoint import check_checkpoint, last_good, read_marker

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
    """The ds_adaptive client state (model preset, layers, step, ...) of a checkpoint; {} if absent."""
    import torch

    files = sorted(ckpt_dir.glob("*model_states.pt"))
    try:
        state = torch.load(files[0], map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same message for the user
        raise ExportError(f"{files[0]} cannot be read ({type(exc).__name__}: {exc}); the checkpoint is "
                          "truncated or corrupt: export another one (--tag)") from None
    return dict(state.get(CLIENT_STATE_KEY) or {})


def consolidated_state_dict(save_dir: Path, tag: str) -> dict:
    """Full fp32 tensors of every trained parameter (ZeRO shards merged), WanModel names."""
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
    # a run under Ulysses SP wraps the model (UlyssesWan.model)
    if sd and all(k.startswith("model.") for k in sd):
        sd = {k[len("model."):]: v for k, v in sd.items()}
    return sd


def export_checkpoint(ckpt: str, out: str, *, tag: Optional[str] = None, dtype: str = "fp32",
                      model: Optional[str] = None, layers: Optional[int] = None) -> Path:
    """Write the diffusers-format transformer of a DeepSpeed checkpoint to ``out``; returns the weights file."""
    import torch

    from ds_adaptive.models.wan import WanConfigError, WanModel, get_wan_config
    from ds_adaptive.models.weights import _plan, save_wan_weights

    if dtype not in DTYPES:
        raise ExportError(f"--dtype must be one of {DTYPES}, got {dtype!r}")
    save_dir, tag = resolve_checkpoint(ckpt, tag)
    verify_checkpoint(save_dir, tag)
    state = read_client_state(save_dir / tag)
    name = model or state.get("model")
    if name is None:
        raise ExportError(f"{save_dir / tag} was not written by ds_adaptive (no '{CLIENT_STATE_KEY}' client state): "
                          "pass --model (and --layers) to say which Wan preset it holds")
    n_layers = layers if layers is not None else state.get("layers")
    try:
        cfg = get_wan_config(name, **({"num_layers": n_layers} if n_layers else {}))
    except (WanConfigError, ValueError) as exc:
        raise ExportError(f"model {name!r} (layers {n_layers}): {exc}") from None
    sd = consolidated_state_dict(save_dir, tag)
    with torch.device("meta"):
        net = WanModel(cfg)
    net.to_dtype({"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype])
    expected = {n: tuple(p.shape) for n, p in net.named_parameters()}

    class _DictReader:  # the shape/name check of models.weights, on the consolidated tensors
        entries = {k: (save_dir / tag, tuple(v.shape)) for k, v in sd.items()}

    from ds_adaptive.models.weights import WanWeightsError

    try:
        plan = _plan(_DictReader, expected, f"{save_dir / tag} (model {name}, {cfg.num_layers} blocks)")
    except WanWeightsError as exc:
        raise ExportError(f"{exc}\nIf the run used --layers N, pass --layers N.") from None
    params = dict(net.named_parameters())
    net.load_state_dict({n: sd[k].to(params[n].dtype) for n, k in plan.items()}, strict=True, assign=True)
    return save_wan_weights(net, out, layout="diffusers")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="ds-adaptive export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a --save directory, or one of its global_stepN subdirectories")
    ap.add_argument("--to", required=True, metavar="DIR", help="output directory (config.json + safetensors)")
    ap.add_argument("--tag", default=None, help="checkpoint tag in a --save directory (default: its 'latest')")
    ap.add_argument("--dtype", default="fp32", choices=DTYPES,
                    help="weights dtype (default fp32; bf16/fp16 keep diffusers' fp32 modules in fp32)")
    ap.add_argument("--model", default=None, help="Wan preset, for checkpoints without ds_adaptive state")
    ap.add_argument("--layers", type=int, default=None, help="number of blocks, when the run used --layers")
    args = ap.parse_args(argv)
    from ds_adaptive.models.weights import WanWeightsError

    try:
        f = export_checkpoint(args.checkpoint, args.to, tag=args.tag, dtype=args.dtype, model=args.model,
                              layers=args.layers)
    except (ExportError, WanWeightsError) as exc:
        print(f"ds-adaptive export: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {f.parent / 'config.json'} and {f} (diffusers WanTransformer3DModel, {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
