"""Profile the real model on this GPU -> a cost/memory profile json for :mod:`ds_adaptive.planning.cost`.

``ds-adaptive calibrate --model wan2.1-1.3b --sp 1 --out h100-wan2.1-1.3b.json``

What it does (bf16, fwd+bwd, gradient checkpointing as in training):

1. For each of the model's ~8 calibration grids (``Preset.calibration_shapes``: images to its longest
   videos) and a few batch sizes for the short ones, time the model with ``k1`` and ``k2`` transformer blocks (``--layers k1,k2``) and
   record the peak memory. Differencing the two depths separates the per-block cost from the
   embed/head overhead; the full model is ``overhead + num_layers * per_block``.
2. Fit ``t = c0 + B * (a*S + b*S^2)`` (ms) by non-negative least squares on relative error, and
   ``mem/B = m0 + m1*S`` (GiB) the same way; report max/mean relative error per length.
   Points with fewer than ``--min-fit-tokens`` tokens per micro-batch are latency-bound (the GPU
   is not saturated), are reported and excluded from the fit: the planner never forms such
   small micro-batches.
3. With ``--sp K`` (K > 1) one GPU emulates the work of one Ulysses rank: the non-attention
   layers see ``S/K`` tokens and attention runs over the full ``S`` with ``heads/K`` heads; the
   all-to-all is not timed (it is modelled from ``comm.bytes_per_token_per_layer`` and
   ``comm.link_GBps``).

The json records device, torch version, date, model config, sp, the fit and its errors, the raw
measurements, and the static memory (bytes per parameter for params/grads/optimizer under ZeRO).

``ds-adaptive calibrate --sparse --profile NAME --out X.json`` measures the block-sparse attention kernel's
cost vs density instead (:mod:`ds_adaptive.calibration.sparse`).

``python -m ds_adaptive.calibration.calibrate --from-block-scaling shared/data/h100_block_scaling.json`` rebuilds
the shipped profiles from measured per-block times (scaled by depth).
"""
from __future__ import annotations

import math
import sys
import time
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from ds_adaptive.core.layout import heads_sp_problem
from ds_adaptive.core.shapes import SampleShape
from ds_adaptive.models.registry import get_model
from ds_adaptive.planning.profile import GIB
from ds_adaptive.ops.apply import apply_ln_modulate
from ds_adaptive.models.family import BlockFusionUnavailable
from ds_adaptive.ops.ln_modulate import load_op
from ds_adaptive.ops.ln_modulate import call_counts


STAGE3_PREFETCH_PARAMS = 50_000_000      # DeepSpeed's default stage3_prefetch_bucket_size


# ------------------------------------------------------------------------------------- measuring
def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device) -> int:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    return 0


def _peak(device) -> int:
    import torch

    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


class UlyssesEmulation:
    """One GPU doing the work of one rank of a Ulysses group of degree ``sp``: the model sees S/sp
    tokens, attention (called with ``[B, S/sp, H, Dh]``) runs on the full sequence with H/sp heads.
    Communication is not modelled here (see ``comm`` in the profile)."""

    def __init__(self, sp: int) -> None:
        self.sp = sp

    def __call__(self, q, k, v, **_: Any):
        import torch.nn.functional as F

        sp = self.sp
        h = q.shape[2] // sp

        def gather(t):  # [B, S/sp, H, Dh] -> [B, S, H/sp, Dh]: what the all-to-all would deliver
            return t[:, :, :h].repeat(1, sp, 1, 1)

        out = F.scaled_dot_product_attention(gather(q).transpose(1, 2), gather(k).transpose(1, 2),
                                             gather(v).transpose(1, 2)).transpose(1, 2)
        s_local = q.shape[1]
        return out[:, :s_local].repeat(1, 1, sp, 1).contiguous()  # back to [B, S/sp, H, Dh]


def measure(model_name: str, *, layers: Sequence[int], shapes: Sequence[SampleShape],
            batch_sizes: Mapping[int, Sequence[int]], sp: int, device_name: str, dtype_name: str,
            warmup: int, iters: int, gradient_checkpointing: bool, overrides: Mapping[str, Any],
            log=print, both_checkpointing: bool = False, ln_modulate: str = "reference",
            deadline: Optional[float] = None, progress=None, block_fusion: str = "off") -> tuple[list[dict], dict]:
    """Time fwd+bwd and record peak memory for every (depth, shape, B), with the LayerNorm-modulate
    path ``ln_modulate`` (``fused`` | ``reference``, as ``apply_ln_modulate`` installs it in a run) and
    ``block_fusion`` (``adaptive_load.block_fusion``; its pieces are compiled for every point before timing,
    as the trainer does before step 1; where they cannot compile, a SystemExit says so).
    A model trained with first-frame conditioning (``objective.first_frame_ratio > 0``) is measured with one
    timestep per token on its videos (per-token modulation: the costlier path of its micro-batches).
    ``deadline`` (a ``time.perf_counter()`` value): points not started by then are skipped (logged).
    ``progress(done, total)`` is called after every point. Returns raw rows and the model config (as a dict)."""
    import torch


    spec = get_model(model_name)
    device = torch.device(device_name)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[dtype_name]
    rows: list[dict] = []
    cfg_dict: dict = {}
    torch.manual_seed(0)
    n_modes = 2 if both_checkpointing else 1
    total, done = len(layers) * n_modes * sum(len(batch_sizes.get(sh.tokens, [1])) for sh in shapes), 0
    for depth in layers:
        cfg = spec.config(**{**overrides, "num_layers": depth})
        cfg_dict = _config_dict(cfg)
        problem = heads_sp_problem(cfg.num_heads, sp, f"{model_name} (--sp)")
        if problem:
            raise SystemExit(f"calibrate: {problem}")
        with torch.device(device):
            model = spec.build(cfg)
        model.to_dtype(dtype)
        model.train()
        apply_ln_modulate(model, ln_modulate == "fused")
        if block_fusion != "off":   # its compile time is not the points' time budget's
            spent = _fuse_blocks(model, spec, block_fusion, shapes, batch_sizes, sp, dtype, device)
            deadline = None if deadline is None else deadline + spent
        if sp > 1:
            model.set_attention(UlyssesEmulation(sp))
        modes = [gradient_checkpointing, not gradient_checkpointing] if both_checkpointing else [gradient_checkpointing]
        for shape, b, ckpt in ((sh, bb, m) for sh in shapes for bb in batch_sizes.get(sh.tokens, [1]) for m in modes):
            done += 1
            if deadline is not None and time.perf_counter() > deadline:
                log(f"  layers={depth} {shape} B={b} ckpt={ckpt}: skipped (over the time budget)")
                continue
            model.gradient_checkpointing = ckpt
            latents = torch.randn(b, *shape.latent_shape, device=device, dtype=dtype)
            tstep = _timesteps(spec, b, shape, device)
            ctx = torch.randn(b, spec.text_len, cfg.text_dim, device=device, dtype=dtype)

            def step(model=model):
                out = _forward(model, latents, tstep, ctx, sp)
                out.float().square().mean().backward()

            try:
                times, base, peak, reserved = _time_point(step, device, warmup, iters)
            except torch.OutOfMemoryError:
                log(f"  layers={depth} {shape} B={b} ckpt={ckpt}: out of memory, skipped")
                model.zero_grad(set_to_none=False)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            row = {"layers": depth, "shape": str(shape), "S": shape.padded_tokens(sp), "B": b,
                   "ms": float(np.median(times)), "ms_all": [round(t, 4) for t in times],
                   "act_gib": max(peak - base, 0) / GIB, "peak_gib": peak / GIB,
                   "reserved_gib": reserved / GIB, "checkpointing": bool(ckpt),
                   "per_token_timesteps": tstep.dim() == 2}
            rows.append(row)
            log(f"  layers={depth:>2} {str(shape):>14} S={row['S']:>6} B={b:>3} ckpt={int(ckpt)}: "
                f"{row['ms']:9.2f} ms  act {row['act_gib']:.3f} GiB  reserved-allocated "
                f"{row['reserved_gib'] - row['peak_gib']:.3f} GiB")
            if progress is not None:
                progress(done, total)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows, cfg_dict


def _fuse_blocks(model, spec, mode: str, shapes, batch_sizes, sp: int, dtype, device) -> float:
    """``adaptive_load.block_fusion`` ``mode`` on ``model`` (of the registry's ``spec``), compiled for every
    (B, tokens per rank) point; returns the seconds spent."""
    if not hasattr(model, "apply_block_fusion"):
        raise SystemExit(f"calibrate: --block-fusion {mode}: model {spec.name} has no compiled block pieces")
    t0 = time.perf_counter()
    model.apply_block_fusion(mode)
    pairs = {(b, sh.padded_tokens(sp) // sp) for sh in shapes for b in batch_sizes.get(sh.tokens, [1])}
    per_token = any(_timesteps(spec, 1, sh, "cpu").dim() == 2 for sh in shapes)
    try:
        model.warm_up_block_fusion(sorted(pairs), dtype=dtype, device=device, per_token=per_token)
    except BlockFusionUnavailable as exc:
        raise SystemExit(f"calibrate: --block-fusion {mode} could not compile on this machine ({exc}); install a "
                         "working triton (GPU) or C++ compiler (CPU), or calibrate without --block-fusion") from None
    return time.perf_counter() - t0


def _timesteps(model, b: int, shape: SampleShape, device):
    """``[B]``, or ``[B, S]`` (one per token, frame 0 at 0) for a video of a model trained with first-frame
    conditioning."""
    import torch

    if model.objective.first_frame_ratio > 0 and not shape.is_image:
        t = torch.rand(b, shape.tokens, device=device) * 1000
        f, h, w = shape.token_grid
        t[:, : h * w] = 0.0
        return t
    return torch.rand(b, device=device) * 1000


def _time_point(step, device, warmup: int, iters: int) -> tuple[list, int, int, int]:
    """``warmup`` untimed and ``iters`` timed calls of ``step``: (times in ms, allocated bytes before, allocated
    peak, reserved peak)."""
    import torch

    if device.type == "cuda":   # the reserved peak is then this point's own
        torch.cuda.empty_cache()
    for _ in range(warmup):
        step()
    base = _reset_peak(device)
    _sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0
    return times, base, _peak(device), reserved


def _forward(model, latents, tstep, ctx, sp: int):
    if sp == 1:
        return model(latents, tstep, ctx)
    inputs = model.embed(latents, tstep, ctx)
    s = inputs.tokens.shape[1]
    s_pad = -(-s // sp) * sp
    local = s_pad // sp
    inputs = inputs.local(lambda t, dim: torch_pad_seq(t, s_pad, dim).narrow(dim, 0, local))  # rank 0's shard
    freqs = torch_pad_seq(model.rope(inputs.grid, inputs.tokens.device), s_pad, dim=0)[:local]
    x = model.run_blocks(inputs.tokens, inputs, freqs)
    return model.head(x, inputs.time_emb)


def torch_pad_seq(t, length: int, dim: int = 1):
    import torch

    pad_shape = list(t.shape)
    pad_shape[dim] = length - t.shape[dim]
    return torch.cat([t, t.new_zeros(pad_shape)], dim=dim) if pad_shape[dim] else t


def _config_dict(cfg) -> dict:
    import dataclasses

    d = cfg.to_dict() if hasattr(cfg, "to_dict") else (dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(vars(cfg)))
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()
            if isinstance(v, (int, float, str, bool, type(None), list, tuple))}


def _batch_sizes(shapes: Sequence[SampleShape], sp: int) -> dict[int, list[int]]:
    """B=1 for every length; short ones also in saturated batches (>= ~16k tokens) so the fit sees
    what the planner forms (many images per micro-batch)."""
    out = {}
    for sh in shapes:
        bs = [1]
        if sh.tokens < 16000:
            bs.append(max(2, math.ceil(16384 / sh.tokens)))
        out[sh.tokens] = bs
    return out


def resolve_ln_modulate(choice: str, device_type: str) -> str:
    """``--ln-modulate`` -> ``fused`` | ``reference``. ``auto``: the fused op when it loads on CUDA (the
    run's default path with ``adaptive_load.fused_ln_modulate``), else the reference; ``fused`` off CUDA
    or with an op that does not load is an error (a profile must not claim a path it did not measure)."""
    if choice == "reference":
        return "reference"
    if device_type != "cuda":
        if choice == "fused":
            raise SystemExit("calibrate: --ln-modulate fused needs a CUDA device (the op has no CPU path); "
                             "use --ln-modulate reference or auto on the CPU")
        return "reference"

    try:
        return "fused" if load_op(strict=True) is not None else "reference"
    except RuntimeError as exc:
        if choice == "fused":
            raise SystemExit(f"calibrate: --ln-modulate fused: {exc}; build the op (ds-adaptive ops) or "
                             "pass --ln-modulate reference") from exc
        print(f"calibrate: note: {exc}; measuring with the torch LayerNorm-modulate reference", file=sys.stderr)
        return "reference"


def ran_ln_modulate(requested: str) -> str:
    """The path the measurement really ran (the op's call counts): ``fused`` only when every call took
    the fused op. DS_ADAPTIVE_LN_MODULATE=reference forces the reference inside an enabled model."""
    if requested != "fused":
        return requested

    calls = call_counts()
    if calls["reference"] or not calls["fused"]:
        print(f"calibrate: warning: --ln-modulate fused but the calls ran {calls}; recording \"reference\"",
              file=sys.stderr)
        return "reference"
    return "fused"

