"""``ds-adaptive sample``: generate videos from a training checkpoint or an exported model.

    ds-adaptive sample ckpt --embeddings prompts.safetensors --frames 33 --height 480 --width 832 --out samples/
    ds-adaptive sample wan_export --text-encoder Wan2.1/text_encoder --prompt "a red fox in snow" \
        --vae Wan2.1/vae --out fox.mp4 --steps 30 --guidance 5 --negative "blurry, low quality"
    ds-adaptive sample Wan2.1/transformer --lora lora_out --embeddings p.safetensors --out p/   # with an adapter
    ds-adaptive sample --text-encoder DIR --prompt "a cat" --save-embeddings prompts.safetensors  # encode only

SOURCE is a ``--save`` directory or one of its ``global_stepN`` checkpoints (ZeRO shards consolidated as by
``ds-adaptive export``; a LoRA checkpoint's adapters merged into its base: the run's ``--init-from`` or
``--base``), or a model directory (``ds-adaptive export`` output, diffusers / original weights, a diffusers
pipeline). ``--lora`` adds a diffusers-format LoRA file or directory (``export --lora``) on top. The model (its
latent grid, text width and length, VAE and text-encoder classes) is the checkpoint's ``--model``, or the
registered model whose architecture a model directory's config.json describes; ``--model`` names it otherwise.

Prompts are text (``--prompt``, encoded with the model's text encoder from ``--text-encoder``, cleaned as
diffusers' Wan pipelines do) or precomputed embeddings (``--embeddings``: a safetensors file of ``[L, text
width]`` tensors; its tensor names name the outputs; ``--save-embeddings`` writes one). The sampler is the
training objective's inverse (``ds_adaptive.models.flow_sampler``): K Euler steps on the shifted sigmas of training,
optional classifier-free guidance (text-to-video: one timestep per sample). With ``--vae`` (the model's VAE)
the latents are decoded and written as mp4 / gif; without, a latent preview PNG. ``--out`` is a file (one
prompt, suffix .mp4 / .gif / .png) or a directory (``NAME.FORMAT`` per prompt).

Exit status: 0 written, 2 a bad argument, file or checkpoint (one message).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import torch

from ds_adaptive.core.shapes import SampleShape, ShapeError
from ds_adaptive.inference.export import cfg_model_name, checkpoint_weights, resolve_checkpoint
from ds_adaptive.media.encode import encode_captions, load_text_encoder, load_tokenizer, load_vae
from ds_adaptive.media.write import MEDIA_SUFFIXES, decode_latents, latent_strip, write_media, write_png
from ds_adaptive.models.family import ModelError
from ds_adaptive.models.flow_sampler import euler_sample, initial_noise
from ds_adaptive.models.registry import default_model, get_model, model_of_weights
from ds_adaptive.training.lora import LORA_FILE, load_adapters, read_lora_file
from ds_adaptive.training.preview import load_embeddings, pad_context, save_embeddings


__all__ = ["load_model", "model_of_source", "load_text_embeddings", "SampleError"]


class SampleError(ValueError):
    """An argument, file or model that cannot be sampled; the message names it."""


def _is_model_dir(p: Path) -> bool:
    return p.is_file() or (p / "config.json").is_file() or (p / "model_index.json").is_file()


def model_of_source(source: Optional[str], *, tag: Optional[str] = None, model: Optional[str] = None):
    """The registry entry (``get_model``) of what ``source`` holds: ``model`` (``--model``) when given, else a
    checkpoint's ``--model`` (its ds_adaptive state), else the registered architecture of a model directory's
    config; without a source, the default model."""
    if model is not None or source is None:
        return get_model(model or default_model())
    p = Path(source)
    if not p.exists():
        raise SampleError(f"{source} does not exist: pass a --save directory, a global_stepN checkpoint or a model "
                          "directory (ds-adaptive export output, diffusers weights)")
    if _is_model_dir(p):

        try:
            return model_of_weights(p)
        except ModelError as exc:
            raise SampleError(f"{exc} (--model NAME)") from None
    return get_model(cfg_model_name(*resolve_checkpoint(source, tag)))


def load_model(source: str, *, tag: Optional[str] = None, base: Optional[str] = None, lora: Optional[str] = None,
               dtype: torch.dtype = torch.float32, device: str = "cpu", spec=None, ema: bool = False):
    """The model (eval mode, no gradients) of a checkpoint or model directory, with ``lora`` applied; ``spec``:
    its registry entry (default :func:`model_of_source`); ``ema``: a checkpoint's EMA weights. Returns
    ``(model, description)``."""
    spec = spec or model_of_source(source, tag=tag)
    p = Path(source)
    if _is_model_dir(p):
        if ema:
            raise SampleError(f"--ema: {source} is a model directory (exported weights); the EMA is in a training "
                              "checkpoint: pass the --save directory, or export it with `ds-adaptive export CKPT --ema`")
        cfg = spec.weights.read_config(str(p), subfolder=spec.subfolder)
        if cfg is not None and not spec.takes_inputs_of(cfg):
            raise SampleError(f"{source} holds a model ({cfg}) that does not read the inputs of model {spec.name} "
                              f"({spec.input_spec.describe()}); pass the model it was trained as (--model)")
        model = spec.weights.load(str(p), config=cfg or spec.config(), subfolder=spec.subfolder, dtype=torch.float32)
        what = f"model {p} ({spec.name})"
    else:
        save_dir, tag = resolve_checkpoint(source, tag)
        cfg, sd = checkpoint_weights(save_dir, tag, model=spec.name, base=base, ema=ema)
        with torch.device("meta"):
            model = spec.build(cfg)
        model.load_state_dict(sd, strict=True, assign=True)
        what = f"checkpoint {save_dir / tag} ({spec.name}{', EMA weights' if ema else ''})"
    if lora is not None:
        f = Path(lora) / LORA_FILE if Path(lora).is_dir() else Path(lora)
        pairs, scale = read_lora_file(f, spec=spec)
        load_adapters(model, pairs, scale=scale)
        what += f" + LoRA {f} ({len(pairs)} modules, scale {scale:g})"
    model.to_dtype(dtype)
    model.to(device).eval().requires_grad_(False)
    return model, what


def load_text_embeddings(args, spec) -> tuple[list[tuple[str, torch.Tensor]], Optional[torch.Tensor]]:
    """``([(name, [L, text_dim] fp32)], negative or None)`` from ``--prompt`` + ``--text-encoder`` (the text
    encoder of ``spec``, the model's registry entry) or ``--embeddings``."""
    if args.embeddings:
        if args.prompt:
            raise SampleError("give either --prompt (with --text-encoder) or --embeddings, not both")
        table = load_embeddings(args.embeddings, what="--embeddings", spec=spec.input_spec)
        negative = None
        if args.negative is not None:
            if args.negative not in table:
                raise SampleError(f"--negative {args.negative!r}: with --embeddings it names an embedding of "
                                  f"{args.embeddings}; it has {sorted(table)}")
            negative = table.pop(args.negative)
        return list(table.items()), negative
    if not args.prompt:
        raise SampleError("no prompt: pass --prompt TEXT (with --text-encoder DIR) or --embeddings FILE")
    if not args.text_encoder:
        raise SampleError(f"--prompt needs --text-encoder DIR (model {spec.name}'s text encoder, a "
                          f"{spec.family.text_encoder_class} in diffusers / transformers format, e.g. a pipeline's "
                          "text_encoder/), or pass precomputed --embeddings")

    te = Path(args.text_encoder)
    tok = Path(args.tokenizer) if args.tokenizer else (
        te.parent / "tokenizer" if (te.parent / "tokenizer").is_dir() else te)
    encoder = load_text_encoder(spec, te).to(args.device)
    tokenizer = load_tokenizer(tok, what=f"tokenizer {tok} (--tokenizer)")
    texts = list(args.prompt) + ([args.negative] if args.negative is not None else [])
    embs = [e.float() for e in encode_captions(encoder, tokenizer, texts, text_len=spec.text_len, device=args.device)]
    negative = embs.pop() if args.negative is not None else None
    return [(f"prompt{i}", e) for i, e in enumerate(embs)], negative


def _outputs(out: str, names: list[str], fmt: str) -> list[Path]:

    p = Path(out)
    if p.suffix.lower() in MEDIA_SUFFIXES:
        if len(names) != 1:
            raise SampleError(f"--out {out} is one file but there are {len(names)} prompts; pass a directory")
        return [p]
    p.mkdir(parents=True, exist_ok=True)
    return [p / f"{n}.{fmt}" for n in names]


def sample(args) -> list[Path]:
    """Run the command; returns the files written."""
    spec = model_of_source(args.source, tag=args.tag, model=args.model)
    prompts, negative = load_text_embeddings(args, spec)
    written = []
    if args.save_embeddings:
        table = dict(prompts)
        if negative is not None:
            table["negative"] = negative
        written.append(save_embeddings(table, args.save_embeddings))
        print(f"wrote {args.save_embeddings} ({len(table)} embeddings: {', '.join(table)})")
    if args.source is None:
        if args.out is not None or not args.save_embeddings:
            raise SampleError("no SOURCE: pass a checkpoint or model directory to sample from (only "
                              "--save-embeddings runs without one)")
        return written
    if args.out is None:
        raise SampleError("--out FILE|DIR is required to sample")
    try:
        shape = SampleShape(args.frames, args.height, args.width, spec.grid)
    except ShapeError as exc:
        raise SampleError(f"--frames/--height/--width (model {spec.name}): {exc}") from None
    if args.steps < 1 or args.guidance < 1:
        raise SampleError(f"--steps must be >= 1 and --guidance >= 1, got {args.steps} and {args.guidance}")
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    model, what = load_model(args.source, tag=args.tag, base=args.base, lora=args.lora, dtype=dtype, device=args.device,
                             spec=spec, ema=getattr(args, "ema", False))
    vae = None
    if args.vae is not None:

        vae = load_vae(spec, args.vae, what="--vae").to(device)
    fmt = args.format or ("mp4" if vae is not None else "png")
    if vae is None and fmt != "png":
        raise SampleError(f"--format {fmt} needs --vae (without a VAE the output is a latent preview PNG)")
    outs = _outputs(args.out, [n for n, _ in prompts], fmt)
    pad = lambda e: pad_context(e, spec.text_len).to(device)  # noqa: E731
    neg = pad(negative) if negative is not None else None
    print(f"sampling {what}: {len(prompts)} prompt(s), {shape}, {args.steps} Euler steps, guidance {args.guidance:g}, "
          f"shift {args.shift:g}, {device}, {str(dtype).replace('torch.', '')}")
    for i, ((name, ctx), out) in enumerate(zip(prompts, outs)):
        t0 = time.perf_counter()
        noise = initial_noise(shape.latent_shape, args.seed + i).to(device)
        x0 = euler_sample(model, noise, pad(ctx), steps=args.steps, shift=args.shift, guidance_scale=args.guidance,
                          negative=neg, dtype=dtype)
        if vae is not None:
            frames = decode_latents(vae, x0, device=device)[0]
            written.append(write_media(frames, out, fps=args.fps or round(spec.media.fps)))
        else:
            if out.suffix.lower() != ".png":
                raise SampleError(f"--out {out}: without --vae the output is a latent preview PNG; use a .png name")
            written.append(write_png(latent_strip(x0[0], upscale=spec.grid.vae_stride[1:]), out))
        print(f"  {name}: {written[-1]} ({time.perf_counter() - t0:.1f} s)")
    return written
