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

import argparse
import copy
import datetime as _dt
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np

from ds_adaptive.planning.cost import GIB, PROFILE_FORMAT, PROFILES_DIR, Profile
from ds_adaptive.planning.memory import configure_allocator
from ds_adaptive.models.registry import default_model, get_model, model_names
from ds_adaptive.core.shapes import GridRule, SampleShape
from ds_adaptive.planning.validate import heads_sp_problem

CPU_MODEL = "tiny"
"""``--device cpu``'s default model: its calibration grids are small (seconds on a CPU, not the >14 min of a
GPU model's grids)."""
MAX_FIT_ERROR = 0.10
"""Quality bar of a calibration: largest |relative error| of the compute fit over its fitted points.
A fit worse than this would mis-plan batches (the shipped calibrations' errors: docs/RESULTS.md)."""

# Bytes per parameter of mixed-precision Adam under DeepSpeed: bf16 params, bf16 grads,
# fp32 master weights + Adam m + v.
BYTES_PER_PARAM = {"params": 2.0, "grads": 2.0, "optimizer": 12.0}
ZERO_PARTITIONED = {"0": [], "1": ["optimizer"], "2": ["optimizer", "grads"],
                    "3": ["optimizer", "grads", "params"]}
STAGE3_PREFETCH_PARAMS = 50_000_000      # DeepSpeed's default stage3_prefetch_bucket_size
CONTEXT_AND_NCCL_GIB = 1.5               # CUDA context + NCCL buffers + allocator slack (estimate)
DEFAULT_LINK_GBPS = 150.0                # effective all-to-all GB/s per GPU, 8xH100 NVSwitch (estimate)


# ------------------------------------------------------------------------------------- fitting
def nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares ``min ||a x - y||, x >= 0`` for a few columns (exact: tries every
    active set and keeps the best feasible one)."""
    a = np.asarray(a, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    n = a.shape[1]
    best, best_res = np.zeros(n), float(np.sum(y * y))
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sub = a[:, cols]
            x, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if np.any(x < 0):
                continue
            res = float(np.sum((sub @ x - y) ** 2))
            if res < best_res * (1 - 1e-12):
                best = np.zeros(n)
                best[list(cols)] = x
                best_res = res
    return best


def _errors(pred: np.ndarray, y: np.ndarray) -> np.ndarray:
    return (pred - y) / y


def fit_compute(points: Sequence[Mapping[str, float]], *, min_fit_tokens: int = 0) -> dict:
    """Fit ``ms = c0 + B*(a*S + b*S^2)`` (non-negative, relative error) to points with keys
    ``S`` (tokens per sample, padded), ``B`` and ``ms``. Returns coefficients and the error
    of every point (``fit: true/false`` says whether it was used)."""
    pts = [dict(p) for p in points]
    use = [p for p in pts if p["B"] * p["S"] >= min_fit_tokens]
    if len(use) < 3:
        raise ValueError(f"compute fit needs >= 3 points with >= {min_fit_tokens} tokens per micro-batch, "
                         f"got {len(use)} of {len(pts)}; add longer lengths or lower --min-fit-tokens")
    s = np.array([p["S"] for p in use], float)
    b = np.array([p["B"] for p in use], float)
    y = np.array([p["ms"] for p in use], float)
    design = np.stack([np.ones_like(s), b * s, b * s * s], axis=1) / y[:, None]
    c0, a, bb = nnls(design, np.ones_like(y))
    rows = []
    for p in pts:
        pred = c0 + p["B"] * (a * p["S"] + bb * p["S"] ** 2)
        rows.append({"S": p["S"], "B": p["B"], "measured_ms": p["ms"], "predicted_ms": pred,
                     "rel_err": (pred - p["ms"]) / p["ms"], "fit": p in use})
    errs = np.array([abs(r["rel_err"]) for r in rows if r["fit"]])
    return {"c0_ms": float(c0), "a_ms_per_token": float(a), "b_ms_per_token2": float(bb),
            "fit": {"max_rel_err": float(errs.max()), "mean_rel_err": float(errs.mean()),
                    "min_fit_tokens": int(min_fit_tokens), "points": rows}}


def fit_memory(points: Sequence[Mapping[str, float]], *, relative: bool = True) -> dict:
    """Fit activation memory per sample ``gib/B = m0 + m1*S`` (non-negative; relative error, or absolute
    with ``relative=False``) to points with keys ``S``, ``B`` and ``gib`` (activation memory of the
    micro-batch).

    Points measured with one timestep per token (``pt`` true: the videos of a model trained with first-frame
    conditioning) hold that modulation besides; when both kinds are present the fit has a third term,
    ``gib/B = m0 + (m1 + pt * m1_pt) S``, and returns ``per_token_timesteps_gib_per_token`` (m1_pt): one
    ``m1`` over both kinds over-predicts the images and under-predicts the videos."""
    pts = [dict(p) for p in points]
    s = np.array([p["S"] for p in pts], float)
    b = np.array([p["B"] for p in pts], float)
    y = np.array([p["gib"] for p in pts], float)
    pt = np.array([bool(p.get("pt")) for p in pts], float)
    split = 0 < pt.sum() < len(pts)
    cols = [b, b * s] + ([b * s * pt] if split else [])
    design = np.stack(cols, axis=1)
    coef = nnls(design / y[:, None], np.ones_like(y)) if relative else nnls(design, y)
    m0, m1 = coef[0], coef[1]
    m1_pt = coef[2] if split else 0.0
    rows = []
    for p, v in zip(pts, pt):
        pred = p["B"] * (m0 + (m1 + v * m1_pt) * p["S"])
        row = {"S": p["S"], "B": p["B"], "measured_gib": p["gib"], "predicted_gib": pred,
               "rel_err": (pred - p["gib"]) / p["gib"]}
        if split:
            row["per_token_timesteps"] = bool(v)
        rows.append(row)
    errs = np.array([abs(r["rel_err"]) for r in rows])
    out = {"m0_gib": float(m0), "m1_gib_per_token": float(m1)}
    if split:
        out["per_token_timesteps_gib_per_token"] = float(m1_pt)
    out["fit"] = {"max_rel_err": float(errs.max()), "mean_rel_err": float(errs.mean()), "points": rows}
    return out


def row_per_token(row: Mapping[str, Any], model) -> bool:
    """Whether a calibration row was measured with one timestep per token: its ``per_token_timesteps``, or
    for rows written before calibrate recorded it, :func:`_timesteps`' rule (a video of a model trained with
    first-frame conditioning)."""
    if "per_token_timesteps" in row:
        return bool(row["per_token_timesteps"])
    frames = int(str(row.get("shape", "1x")).split("x")[0])
    return bool(model is not None and model.objective.first_frame_ratio > 0 and frames > 1)


def per_token_entry(memory: Mapping[str, Any]) -> Optional[dict]:
    """``memory.per_token_timesteps`` of a profile from its fits (None when no fit separated the two kinds):
    the per-token extra of the full-model fit and of a whole block (``CostModel.ckpt_memory``)."""
    own = memory.get("per_token_timesteps_gib_per_token")
    block = (memory.get("checkpointing") or {}).get("block_full", {}).get("per_token_timesteps_gib_per_token")
    if own is None:
        return None
    return {"m1_gib_per_token": float(own), "block_full_m1_gib_per_token": float(block or 0.0), "source": "measured",
            "note": "extra activation memory of micro-batches with one timestep per token (first-frame "
                    "conditioned videos): fitted as a third term over the video (per-token) and image points"}


# ------------------------------------------------------------------------------------- profile
def calibration_shapes(model_name: str) -> list[SampleShape]:
    """The model's calibration grids (``Preset.calibration_shapes``) under its grid rule, short to long."""
    m = get_model(model_name)
    return [SampleShape(f, h, w, m.grid) for f, h, w in m.preset.calibration_shapes]


def static_memory_entry(params: int, block_params: int, workspace_gib: float) -> dict:
    return {"params": int(params), "bytes_per_param": dict(BYTES_PER_PARAM),
            "zero_partitioned": ZERO_PARTITIONED,
            "stage3_live_params": int(2 * block_params + STAGE3_PREFETCH_PARAMS),
            "workspace_gib": float(workspace_gib),
            "note": ("per GPU = params*(2/n3 + 2/n2 + 12/n1) bytes where n_k = ranks sharing the "
                     "partition at ZeRO stage >= k (else 1); + stage3_live_params*2 bytes (ZeRO-3 "
                     "gathered blocks + prefetch bucket) + workspace_gib")}


def comm_entry(dim: int, gradient_checkpointing: bool, link_gbps: float = DEFAULT_LINK_GBPS) -> dict:
    # Ulysses all-to-alls per layer: q, k, v before attention and the output after it, bf16,
    # forward + backward (+ the recomputed forward with gradient checkpointing).
    passes = 3 if gradient_checkpointing else 2
    return {"bytes_per_token_per_layer": float(4 * dim * 2 * passes), "link_GBps": float(link_gbps),
            "note": (f"4 all-to-alls (q, k, v, out) x {dim} x 2 bytes x {passes} passes "
                     "(fwd, bwd" + (", recomputed fwd" if gradient_checkpointing else "") + "); "
                     f"link_GBps {link_gbps:g} is an estimate of NCCL all-to-all bandwidth per GPU "
                     "on 8xH100 NVSwitch: replace with an nccl-tests alltoall_perf busbw of your cluster")}


def block_scaling_models(data: Mapping[str, Any]) -> dict[str, str]:
    """{model name: block-scaling key} for the registered models a per-block scaling json measured: its
    ``fits`` keys are released size labels ("1.3B"), the last ``-`` part of a preset's description
    ("...-T2V-1.3B")."""
    keys = set(data.get("fits", {}))
    out = {}
    for name in model_names():
        label = get_model(name).preset.description.rsplit("-", 1)[-1]
        if label in keys:
            out[name] = label
    return out


def profile_from_block_scaling(data: Mapping[str, Any], model_name: str, *, source: str,
                               gradient_checkpointing: bool = True,
                               gpu_mem_gib: float = 79.19) -> dict:
    """A profile from measured per-block fwd+bwd times and peaks at B=1 (``h100_block_scaling.json``),
    scaled by depth. Documented estimates (this is not a full-model calibration):

    - full model time = num_layers x block_ms x (4/3 with gradient checkpointing: the recomputed
      forward is ~1/3 of fwd+bwd) + embed/head overhead: 2 ms per micro-batch (launches of the
      patch/text/time embeddings and head, fwd+bwd) + 12*dim*64 FLOP per token at 400 TFLOP/s.
    - activation memory per token = one block's measured slope (the block recomputed in backward)
      + num_layers x dim x 2 bytes (checkpointed bf16 block inputs) + 6 x dim x 2 bytes (embed/head);
      per sample m0 = text context 512 x 4096 fp32 + its 512 x dim projection.
    """
    key = block_scaling_models(data)[model_name]
    model = get_model(model_name)
    cfg = model.config()
    arch = {"dim": cfg.dim, "ffn_dim": cfg.ffn_dim, "num_heads": cfg.num_heads, "num_layers": cfg.num_layers}
    dim, layers = arch["dim"], arch["num_layers"]
    text_len, text_dim = model.text_len, cfg.text_dim
    rows = sorted((r for r in data["block"] if r["model"] == key), key=lambda r: r["S"])
    if len(rows) < 3:
        raise ValueError(f"{source}: fewer than 3 block rows for model {key}")
    gc = 4.0 / 3.0 if gradient_checkpointing else 1.0
    per_tok_head_ms = 12 * dim * 64 / 400e12 * 1e3
    overhead_ms = 2.0
    meas = []
    for r in rows:
        ms = layers * r["fwdbwd_ms"] * gc + overhead_ms + per_tok_head_ms * r["S"]
        meas.append({"S": r["S"], "B": 1, "ms": ms, "block_ms": r["fwdbwd_ms"], "block_peak_gib": r["peak_GiB"]})
    # The short sequences at B=1 are latency-bound (on an H100 the two shortest take the same time):
    # fit on saturated points only (>= 7800 tokens per micro-batch).
    compute = fit_compute(meas, min_fit_tokens=7800)
    s = np.array([r["S"] for r in rows], float)
    pk = np.array([r["peak_GiB"] for r in rows], float)
    slope, intercept = np.polyfit(s, pk, 1)
    m1 = slope + (layers * dim * 2 + 6 * dim * 2) / GIB
    m0 = (text_len * text_dim * 4 + text_len * dim * 2 * 2) / GIB
    mem_points = [{"S": r["S"], "B": 1, "gib": (r["peak_GiB"] - intercept) + (layers * dim * 2 + 6 * dim * 2) * r["S"] / GIB + m0}
                  for r in rows]
    memory = fit_memory(mem_points)
    counts = model.param_counts(cfg)
    block_weight_gib = counts["block"] * 4 / GIB      # bf16 weights + grads of the measured block
    workspace = max(float(intercept) - block_weight_gib, 0.0) + CONTEXT_AND_NCCL_GIB
    return {
        "format": PROFILE_FORMAT,
        "name": f"h100-{model_name}",
        "source": f"{source} (per-block, scaled by depth)",
        "note": profile_from_block_scaling.__doc__.strip(),
        "device": data.get("device", "unknown"),
        "gpu_mem_gib": gpu_mem_gib,
        "torch": data.get("torch", "unknown"),
        "date": _dt.date.today().isoformat(),
        "dtype": "bf16",
        "gradient_checkpointing": gradient_checkpointing,
        "model": {"name": model_name, **arch, "params": counts["total"], "block_params": counts["block"]},
        "sp": 1,
        "compute": compute,
        "memory": memory,
        "comm": comm_entry(dim, gradient_checkpointing),
        "static_memory": static_memory_entry(counts["total"], counts["block"], workspace),
        "measurements": meas,
    }


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

    from ds_adaptive.ops.apply import apply_ln_modulate

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

            def step():
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
    from ds_adaptive.models.family import BlockFusionUnavailable

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


def full_model_points(rows: Sequence[Mapping[str, Any]], num_layers: int) -> tuple[list[dict], list[dict]]:
    """Depth differencing: per (S, B) with two depths k1 < k2, per-block = (t2 - t1) / (k2 - k1),
    overhead = t1 - k1 * per-block, full = overhead + num_layers * per-block. Memory the same
    way on the activation memory. With one depth only, scale it (full = t * L / k)."""
    by_key: dict[tuple, dict[int, Mapping]] = {}
    modes = {r.get("checkpointing") for r in rows}
    if len(modes) > 1:   # both modes measured: the fit is of the first row's mode (the profile's own)
        rows = [r for r in rows if r.get("checkpointing") == rows[0].get("checkpointing")]
    for r in rows:
        by_key.setdefault((r["S"], r["B"], r["shape"]), {})[r["layers"]] = r
    comp, mem = [], []
    for (s, b, shape), d in sorted(by_key.items()):
        depths = sorted(d)
        if len(depths) >= 2:
            k1, k2 = depths[0], depths[-1]
            blk = (d[k2]["ms"] - d[k1]["ms"]) / (k2 - k1)
            ms = d[k1]["ms"] + (num_layers - k1) * blk
            blk_m = (d[k2]["act_gib"] - d[k1]["act_gib"]) / (k2 - k1)
            gib = d[k1]["act_gib"] + (num_layers - k1) * blk_m
        else:
            k = depths[0]
            ms = d[k]["ms"] * num_layers / k
            gib = d[k]["act_gib"] * num_layers / k
        comp.append({"S": s, "B": b, "shape": shape, "ms": ms})
        if gib > 0:
            pt = any(bool(r.get("per_token_timesteps")) for r in d.values())
            mem.append({"S": s, "B": b, "shape": shape, "gib": gib, **({"pt": True} if pt else {})})
    return comp, mem


def checkpoint_fit(rows: Sequence[Mapping[str, Any]], *, min_fit_tokens: int = 8192) -> Optional[dict]:
    """Per-block memory with and without checkpointing and the recompute time, from rows measured at
    two depths in both modes (``measure(..., both_checkpointing=True)``). Per (S, B):

    - whole block ``g = (act_none(k2) - act_none(k1)) / (k2 - k1)`` (GiB per micro-batch),
    - checkpointed block ``c`` the same on the checkpointed rows (its kept input),
    - recompute ``r = ((t_ckpt(k2) - t_ckpt(k1)) - (t_none(k2) - t_none(k1))) / (k2 - k1)`` (ms),
    - last-block term ``d = (act_none(k1) - k1 g) - (act_ckpt(k1) - k1 c - g)``: what the rest of the model
      (embeddings, head, loss, the backward's working set) holds more when the last block is whole than
      when every block is checkpointed (``CostModel.ckpt_memory``); a small difference of large numbers:
      fitted with absolute error on the points with B x S >= ``min_fit_tokens`` (all when fewer than 2),
      omitted when not above 1 KiB at 2 points,

    fitted as ``B (m0 + m1 S)`` and ``c0 + B (a S + b S^2)`` (non-negative, relative error; recompute on
    points with B x S >= ``min_fit_tokens``). None when the rows lack a mode or a second depth."""
    by: dict[tuple, dict] = {}
    for r in rows:
        if "checkpointing" not in r:
            return None
        by.setdefault((r["S"], r["B"]), {})[(bool(r["checkpointing"]), r["layers"])] = r
    g_pts, c_pts, r_pts, d_pts = [], [], [], []
    for (s, b), d in sorted(by.items()):
        depths = sorted({k for _, k in d})
        if len(depths) < 2:
            continue
        k1, k2 = depths[0], depths[-1]
        if not all((m, k) in d for m in (True, False) for k in (k1, k2)):
            continue
        g = (d[(False, k2)]["act_gib"] - d[(False, k1)]["act_gib"]) / (k2 - k1)
        c = (d[(True, k2)]["act_gib"] - d[(True, k1)]["act_gib"]) / (k2 - k1)
        rc = ((d[(True, k2)]["ms"] - d[(True, k1)]["ms"]) - (d[(False, k2)]["ms"] - d[(False, k1)]["ms"])) / (k2 - k1)
        pt = {"pt": True} if any(bool(r.get("per_token_timesteps")) for r in d.values()) else {}
        if g > 0:
            g_pts.append({"S": s, "B": b, "gib": g, **pt})
        if c > 0:
            c_pts.append({"S": s, "B": b, "gib": c})
        if rc > 0:
            r_pts.append({"S": s, "B": b, "ms": rc})
        d_last = (d[(False, k1)]["act_gib"] - k1 * g) - (d[(True, k1)]["act_gib"] - k1 * c - g)
        if d_last > 1e-6:   # GiB (1 KiB): above the float noise of the differences
            d_pts.append({"S": s, "B": b, "gib": d_last})
    if len(g_pts) < 2 or len(c_pts) < 2 or len(r_pts) < 3:
        return None
    full, kept = fit_memory(g_pts), fit_memory(c_pts)
    use_min = min_fit_tokens if sum(p["B"] * p["S"] >= min_fit_tokens for p in r_pts) >= 3 else 0
    rec = fit_compute(r_pts, min_fit_tokens=use_min)
    memory = {"block_full": full, "block_checkpointed": kept, "source": "measured"}
    big = [p for p in d_pts if p["B"] * p["S"] >= min_fit_tokens]
    if len(d_pts) >= 2:
        memory["last_block_whole"] = {**fit_memory(big if len(big) >= 2 else d_pts, relative=False),
                                      "note": "E(no block checkpointed) - E(every block): absolute-error fit"}
    return {
        "memory": memory,
        "recompute": {**{k: rec[k] for k in ("c0_ms", "a_ms_per_token", "b_ms_per_token2")},
                      "note": "recomputed forward of ONE block (ms): checkpointed minus plain fwd+bwd per block",
                      "fit": rec["fit"]},
    }


def fragmentation_margin(rows: Sequence[Mapping[str, Any]]) -> Optional[float]:
    """Largest ``reserved - allocated`` peak (GiB) over the shape sweep's high-water marks, or None.

    Only rows whose allocated peak is the largest so far at their depth count (rows in measurement
    order; a new model per depth starts from an empty cache): there the reserved peak is the
    measurement's own, while a smaller point after a larger one reads memory that the allocator
    still caches from the larger one (reserved, free, reusable: not fragmentation)."""
    vals, high = [], {}
    for r in rows:
        if not r.get("reserved_gib"):
            continue
        k = r["layers"]
        if r["peak_gib"] >= high.get(k, 0.0):
            high[k] = r["peak_gib"]
            vals.append(r["reserved_gib"] - r["peak_gib"])
    return float(max(vals)) if vals else None


def fit_quality_problem(compute: Mapping[str, Any], max_err: float = MAX_FIT_ERROR) -> Optional[str]:
    """Why a compute fit is not usable (None when it is): error over the bar, or no length dependence."""
    err = float(compute["fit"]["max_rel_err"])
    if compute["a_ms_per_token"] <= 0 and compute["b_ms_per_token2"] <= 0:
        return (f"the fit has a = b = 0 (cost does not grow with length; max |rel err| {err:.1%}): the timings "
                "are dominated by overhead or noise")
    if err > max_err:
        return f"the fit's max |rel err| {err:.1%} is over the quality bar {max_err:.0%} (--max-fit-error)"
    return None


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


def parse_lengths(spec: str, grid: Optional[GridRule] = None) -> list[SampleShape]:
    """``--lengths 1x480x832,81x720x1280`` -> shapes (FxHxW, valid under the model's ``grid``)."""
    out = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            f, h, w = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--lengths: '{item}' is not FRAMESxHEIGHTxWIDTH (e.g. 81x480x832)") from None
        out.append(SampleShape(f, h, w, grid))
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ds-adaptive calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sparse", action="store_true",
                    help="measure the block-sparse attention kernel's cost vs density instead (see "
                         "`ds-adaptive calibrate --sparse --help`)")
    ap.add_argument("--model", default=None, choices=model_names(),
                    help=f"the model (default {default_model()}, {CPU_MODEL} with --device cpu)")
    ap.add_argument("--sp", type=int, default=1, help="Ulysses degree to emulate on one GPU (default 1)")
    ap.add_argument("--out", help="profile json to write")
    ap.add_argument("--name", help="profile name stored in the json (default: stem of --out)")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (tiny model, for testing)")
    ap.add_argument("--dtype", default=None, choices=["bf16", "fp32", "fp16"],
                    help="default bf16 on cuda, fp32 on cpu")
    ap.add_argument("--layers", default="2,4", help="two depths k1,k2 to difference (default 2,4)")
    ap.add_argument("--lengths", default=None,
                    help="comma list of FxHxW shapes (default: the model's calibration grids, e.g. 8 from "
                         "1x480x832 to 81x720x1280; the tiny model's are 5 small grids of 64-2304 tokens)")
    ap.add_argument("--batch-sizes", default=None,
                    help="extra batch sizes for short shapes, e.g. '1560:1,12;4096:1,4' (default: auto)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed runs per point (default 2; 1 on cpu)")
    ap.add_argument("--iters", type=int, default=None, help="timed runs per point (default 5; 2 on cpu)")
    ap.add_argument("--no-checkpointing", action="store_true", help="measure without gradient checkpointing")
    ap.add_argument("--checkpoint-memory", action=argparse.BooleanOptionalAction, default=True,
                    help="also measure every point in the other checkpointing mode: per-block memory with and "
                         "without checkpointing and the recompute time, for `checkpointing: auto` (default on)")
    ap.add_argument("--min-fit-tokens", type=int, default=8192,
                    help="exclude latency-bound points with fewer tokens per micro-batch from the fit")
    ap.add_argument("--gpu-mem-gib", type=float, default=None, help="GPU capacity (default: detected)")
    ap.add_argument("--link-gbps", type=float, default=DEFAULT_LINK_GBPS,
                    help="all-to-all bandwidth per GPU for the Ulysses comm term (GB/s)")
    ap.add_argument("--override", action="append", default=[],
                    help="model config override KEY=VALUE (e.g. dim=64), repeatable")
    ap.add_argument("--max-fit-error", type=float, default=MAX_FIT_ERROR,
                    help="quality bar: refuse to write a profile whose compute fit is worse (max |rel err|; "
                         "default %(default)s) or does not grow with length")
    ap.add_argument("--accept-poor-fit", action="store_true",
                    help="write the profile even when the fit misses the quality bar (with a warning)")
    ap.add_argument("--ln-modulate", default="auto", choices=["auto", "fused", "reference"],
                    help="LayerNorm-modulate path to measure with (its activation memory differs): auto (default) "
                         "= the fused op when it loads on CUDA (as a run with adaptive_load.fused_ln_modulate), "
                         "else the torch reference; recorded in the profile as \"ln_modulate\"")
    ap.add_argument("--block-fusion", default="off", choices=["off", "rope", "regions"],
                    help="adaptive_load.block_fusion to measure with (fused blocks hold less activation memory and "
                         "run faster): recorded in the profile as \"block_fusion\"; `python -m "
                         "ds_adaptive.calibration.autocalibrate ship` adds it to a profile as its block_fusion_variants entry")
    ap.add_argument("--from-block-scaling", metavar="JSON",
                    help="instead of measuring, rebuild the shipped profiles from a per-block scaling json")
    ap.add_argument("--refit", metavar="PROFILE",
                    help="instead of measuring, re-derive a profile's memory fits from its own raw measurements "
                         "(measurements.raw) with this version's fitting; writes --out (default: in place)")
    return ap


def refit_profile(d: Mapping[str, Any]) -> dict:
    """A profile json whose memory fits are re-derived from its own ``measurements.raw`` (:func:`profile_from_rows`
    with the settings the json records); everything else (compute, name, source, date, torch, train_overheads,
    ln_modulate_variants, ...) is kept. No device needed."""
    meas = d.get("measurements") or {}
    if not meas.get("raw"):
        raise SystemExit(f"calibrate --refit: profile {d.get('name')!r} has no measurements.raw to re-fit")
    fit = (d.get("compute") or {}).get("fit") or {}
    new = profile_from_rows(meas["raw"], model_name=d["model"]["name"], overrides={}, layers=meas["layers"],
                            sp=int(d["sp"]), device_name=d["device"], gpu_mem_gib=d["gpu_mem_gib"], dtype=d["dtype"],
                            ln_modulate=d.get("ln_modulate", "reference"), block_fusion=d.get("block_fusion", "off"),
                            gradient_checkpointing=bool(d.get("gradient_checkpointing", True)),
                            min_fit_tokens=int(fit.get("min_fit_tokens", 8192)), name=d["name"],
                            source=d.get("source", ""), wall_s=float(d.get("wall_s", 0.0)))
    out = {**copy.deepcopy(dict(d)), **{k: new[k] for k in ("memory", "measurements")}}
    for k in ("allocator", "fragmentation_margin_note"):   # the measuring process's, not this one's
        if k in d["memory"]:
            out["memory"][k] = d["memory"][k]
    return out


def _refit(args: argparse.Namespace) -> int:
    path = Path(args.refit)
    prof = refit_profile(json.loads(path.read_text()))
    Profile.from_dict(prof, where=str(path))
    out = Path(args.out) if args.out else path
    out.write_text(json.dumps(prof, indent=1) + "\n")
    _print_fit(prof["compute"], prof["memory"])
    print(f"wrote {out} (re-fitted from {path}'s measurements.raw)")
    return 0


def _rebuild_from_block_scaling(args: argparse.Namespace) -> int:
    """--from-block-scaling: the shipped profiles from per-block timings, no measurement."""
    data = json.loads(Path(args.from_block_scaling).read_text())
    out_dir = Path(args.out) if args.out else PROFILES_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in block_scaling_models(data):
        prof = profile_from_block_scaling(data, name, source="shared/data/h100_block_scaling.json")
        Profile.from_dict(prof)
        path = out_dir / f"{prof['name']}.json"
        path.write_text(json.dumps(prof, indent=1) + "\n")
        c = prof["compute"]
        print(f"{path}: c0={c['c0_ms']:.3f} ms a={c['a_ms_per_token']:.4g} ms/tok "
              f"b={c['b_ms_per_token2']:.4g} ms/tok^2 fit max|err|={c['fit']['max_rel_err']:.1%}")
    return 0


def _device_defaults(args: argparse.Namespace, on_cpu: bool) -> None:
    """--warmup / --iters / --model defaults: short runs and the tiny model on a CPU."""
    args.warmup = args.warmup if args.warmup is not None else (1 if on_cpu else 2)
    args.iters = args.iters if args.iters is not None else (2 if on_cpu else 5)
    args.model = args.model or (CPU_MODEL if on_cpu else default_model())


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
    from ds_adaptive.ops.ln_modulate import load_op

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
    from ds_adaptive.ops.ln_modulate import call_counts

    calls = call_counts()
    if calls["reference"] or not calls["fused"]:
        print(f"calibrate: warning: --ln-modulate fused but the calls ran {calls}; recording \"reference\"",
              file=sys.stderr)
        return "reference"
    return "fused"


def _parse_batch_sizes(ap: argparse.ArgumentParser, args: argparse.Namespace, shapes: list, on_cpu: bool) -> dict:
    if args.batch_sizes:  # explicit: listed lengths get these sizes, the others B=1
        batch_sizes = {sh.tokens: [1] for sh in shapes}
        for part in args.batch_sizes.split(";"):
            try:
                s, bs = part.split(":")
                batch_sizes[int(s)] = [int(b) for b in bs.split(",")]
            except ValueError:
                ap.error(f"--batch-sizes: '{part}' is not TOKENS:B1,B2 (e.g. '1560:1,12;4096:1,4')")
        return batch_sizes
    if on_cpu:  # no saturated batches on a CPU: B=1, and B=4 for the two shortest lengths
        short = sorted(sh.tokens for sh in shapes)[:2]
        return {sh.tokens: [1, 4] if sh.tokens in short else [1] for sh in shapes}
    return _batch_sizes(shapes, args.sp)


def _memory_entry(mem_pts: list, full_cfg: dict, num_layers: int, text_len: int) -> dict:
    if mem_pts:
        return fit_memory(mem_pts)
    d = int(full_cfg.get("dim", 0))  # CPU: no allocator statistics; analytic estimate (checkpointed bf16 inputs)
    return {"m0_gib": text_len * int(full_cfg["text_dim"]) * 4 / GIB,
            "m1_gib_per_token": (num_layers + 6) * d * 2 * 3 / GIB,
            "fit": {"note": "no device memory statistics on this device: analytic estimate"}}


def _parse_overrides(items: list) -> dict:
    """``--override key=value`` (json values: numbers, lists, objects, true/false) -> {key: value}."""
    overrides = {}
    for ov in items:
        k, _, v = ov.partition("=")
        overrides[k] = json.loads(v) if v[:1] in "0123456789-[{tf" else v
    return overrides


def _add_checkpoint_terms(rows: list, memory: dict, compute: dict, min_fit_tokens: int) -> None:
    """Both checkpointing modes measured (``--checkpoint-memory``): the no-checkpointing memory terms and the
    recompute cost; and the fragmentation margin over the sweep's high-water marks (GPU only)."""
    ckfit = checkpoint_fit(rows, min_fit_tokens=min_fit_tokens)
    if ckfit is not None:
        memory["checkpointing"] = ckfit["memory"]
        compute["recompute"] = ckfit["recompute"]
    margin = fragmentation_margin(rows)
    if margin is not None:
        memory["fragmentation_margin_gib"] = margin
        memory["allocator"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")


def _write_profile(prof: dict, compute: dict, memory: dict, args: argparse.Namespace) -> int:
    """Validate, apply the fit-quality bar, write ``args.out`` and print the fit."""
    Profile.from_dict(prof)  # validate before writing
    problem = fit_quality_problem(compute, args.max_fit_error)
    if problem and not args.accept_poor_fit:
        _print_fit(compute, memory)
        print(f"calibrate: error: {problem}; the profile would mis-plan batches, so {args.out} was NOT written. "
              "Measure longer lengths (--lengths), more --iters, on an idle device, or pass --accept-poor-fit to "
              "write it anyway.", file=sys.stderr)
        return 2
    if problem:
        prof["fit_warning"] = problem
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(prof, indent=1) + "\n")
    _print_fit(compute, memory)
    if problem:
        print(f"calibrate: warning: {problem}; written anyway (--accept-poor-fit)", file=sys.stderr)
    print(f"wrote {args.out} ({prof['wall_s']} s)")
    return 0


def profile_from_rows(rows: Sequence[Mapping[str, Any]], *, model_name: str, overrides: Mapping[str, Any],
                      layers: Sequence[int], sp: int, device_name: str, gpu_mem_gib: float, dtype: str,
                      ln_modulate: str, gradient_checkpointing: bool = True, min_fit_tokens: int = 8192,
                      link_gbps: float = DEFAULT_LINK_GBPS, name: str, source: str, wall_s: float,
                      block_fusion: str = "off") -> dict:
    """The profile json (dict) of :func:`measure`'s rows: depth-differenced full-model points, the compute and
    memory fits, the checkpointing terms and fragmentation margin when both modes were measured, static
    memory and comm. Shared by ``ds-adaptive calibrate`` and the start-up calibration
    (:mod:`ds_adaptive.calibration.autocalibrate`); validate with :func:`fit_quality_problem` before use."""
    import torch

    model = get_model(model_name)
    rows = [{**r, "per_token_timesteps": row_per_token(r, model)} for r in rows]
    full_cfg = _config_dict(model.config(**overrides))
    num_layers = int(full_cfg["num_layers"])
    comp_pts, mem_pts = full_model_points(rows, num_layers)
    compute = fit_compute(comp_pts, min_fit_tokens=min_fit_tokens if any(
        p["B"] * p["S"] >= min_fit_tokens for p in comp_pts) else 0)
    memory = _memory_entry(mem_pts, full_cfg, num_layers, model.text_len)
    _add_checkpoint_terms(list(rows), memory, compute, min_fit_tokens)
    pt_entry = per_token_entry(memory)
    if pt_entry is not None:
        memory["per_token_timesteps"] = pt_entry
    dim = int(full_cfg.get("dim", 0))
    counts = model.param_counts(model.config(**overrides))
    heads = int(full_cfg.get("num_heads", 1))
    return {
        "format": PROFILE_FORMAT,
        "name": name,
        "source": source,
        "device": device_name,
        "gpu_mem_gib": float(gpu_mem_gib),
        "torch": torch.__version__,
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "dtype": dtype,
        "gradient_checkpointing": bool(gradient_checkpointing),
        "ln_modulate": ln_modulate,
        "block_fusion": block_fusion,
        "model": {"name": model_name, "config": full_cfg, "num_layers": num_layers, "num_heads": heads,
                  "dim": dim, "params": counts["total"], "block_params": counts["block"]},
        "sp": sp,
        "compute": compute,
        "memory": memory,
        "comm": comm_entry(dim, gradient_checkpointing, link_gbps),
        "static_memory": static_memory_entry(counts["total"], counts["block"], CONTEXT_AND_NCCL_GIB),
        "measurements": {"layers": list(layers), "raw": list(rows), "full_model": comp_pts, "full_model_memory": mem_pts},
        "wall_s": round(float(wall_s), 1),
    }


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--sparse" in argv:   # the sparse kernel's efficiency table (ds_adaptive.calibration.sparse)
        from ds_adaptive.planning import calibrate_sparse

        return calibrate_sparse.main([a for a in argv if a != "--sparse"])
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.from_block_scaling:
        return _rebuild_from_block_scaling(args)
    if args.refit:
        return _refit(args)
    if not args.out:
        ap.error("--out is required (path of the profile json to write)")
    print(configure_allocator())   # as the trainer: before CUDA's allocator starts
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("calibrate: --device cuda but no CUDA GPU is visible; run on a GPU node or pass "
              "--device cpu --model tiny to test the pipeline", file=sys.stderr)
        return 2
    dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    try:
        k1, k2 = (int(v) for v in args.layers.split(","))
    except ValueError:
        ap.error(f"--layers must be two depths 'k1,k2', got {args.layers!r}")
    if not 1 <= k1 < k2:
        ap.error(f"--layers needs 1 <= k1 < k2, got {k1},{k2}")
    on_cpu = args.device == "cpu"
    _device_defaults(args, on_cpu)
    model = get_model(args.model)
    shapes = parse_lengths(args.lengths, model.grid) if args.lengths else [  # on a CPU: the tiny model's grids
        s.with_grid(model.grid) for s in calibration_shapes(CPU_MODEL if on_cpu else args.model)]
    batch_sizes = _parse_batch_sizes(ap, args, shapes, on_cpu)
    overrides = _parse_overrides(args.override)
    full_cfg = _config_dict(model.config(**overrides))
    num_layers = int(full_cfg["num_layers"])
    device = torch.device(args.device)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    gpu_mem = args.gpu_mem_gib or (torch.cuda.get_device_properties(device).total_memory / GIB
                                   if device.type == "cuda" else 16.0)
    ln_path = resolve_ln_modulate(args.ln_modulate, device.type)
    print(f"calibrate {args.model} on {dev_name} ({dtype}, sp={args.sp}, layers {k1},{k2} -> {num_layers}, {ln_path}, "
          f"block fusion {args.block_fusion})")
    t_start = time.perf_counter()
    rows, _ = measure(args.model, layers=[k1, k2], shapes=shapes, batch_sizes=batch_sizes, sp=args.sp,
                      device_name=args.device, dtype_name=dtype, warmup=args.warmup, iters=args.iters,
                      gradient_checkpointing=not args.no_checkpointing, overrides=overrides,
                      both_checkpointing=args.checkpoint_memory, ln_modulate=ln_path, block_fusion=args.block_fusion)
    ln_path = ran_ln_modulate(ln_path)
    prof = profile_from_rows(
        rows, model_name=args.model, overrides=overrides, layers=(k1, k2), sp=args.sp, device_name=dev_name,
        gpu_mem_gib=float(gpu_mem), dtype=dtype, ln_modulate=ln_path, gradient_checkpointing=not args.no_checkpointing,
        min_fit_tokens=args.min_fit_tokens, link_gbps=args.link_gbps, name=args.name or Path(args.out).stem,
        source=f"ds-adaptive calibrate {' '.join(argv if argv is not None else sys.argv[1:])}",
        wall_s=time.perf_counter() - t_start, block_fusion=args.block_fusion)
    compute, memory = prof["compute"], prof["memory"]
    return _write_profile(prof, compute, memory, args)


def _print_fit(compute: Mapping[str, Any], memory: Mapping[str, Any]) -> None:
    print("\nfull-model fit  t = c0 + B*(a*S + b*S^2)  [ms]")
    print(f"  c0 = {compute['c0_ms']:.4g} ms   a = {compute['a_ms_per_token']:.4g} ms/token   "
          f"b = {compute['b_ms_per_token2']:.4g} ms/token^2")
    print(f"  {'S':>7} {'B':>4} {'measured':>10} {'predicted':>10} {'rel err':>8}")
    for r in compute["fit"]["points"]:
        tag = "" if r["fit"] else "  (latency-bound, not fitted)"
        print(f"  {r['S']:>7} {r['B']:>4} {r['measured_ms']:>10.2f} {r['predicted_ms']:>10.2f} "
              f"{r['rel_err']:>+8.1%}{tag}")
    print(f"  max |rel err| {compute['fit']['max_rel_err']:.1%}, mean {compute['fit']['mean_rel_err']:.1%}")
    if "points" in memory.get("fit", {}):
        print(f"memory fit  act/B = m0 + m1*S: m0 = {memory['m0_gib']:.4g} GiB, "
              f"m1 = {memory['m1_gib_per_token'] * 1024 ** 2:.4g} KiB/token; max |rel err| "
              f"{memory['fit']['max_rel_err']:.1%}, mean {memory['fit']['mean_rel_err']:.1%}")
    ck, rc = memory.get("checkpointing"), compute.get("recompute")
    if ck is not None and rc is not None:
        bf, bc = ck["block_full"], ck["block_checkpointed"]
        print(f"per block: whole {bf['m1_gib_per_token'] * 2**30 / 1024:.1f} KiB/token (+{bf['m0_gib'] * 1024:.1f} MiB/sample, "
              f"max err {bf['fit']['max_rel_err']:.1%}), checkpointed {bc['m1_gib_per_token'] * 2**30 / 1024:.2f} KiB/token; "
              f"recompute c0 {rc['c0_ms']:.3g} ms a {rc['a_ms_per_token']:.3g} ms/token b {rc['b_ms_per_token2']:.3g} "
              f"ms/token^2 (max err {rc['fit']['max_rel_err']:.1%})")
        if "last_block_whole" in ck:
            lw = ck["last_block_whole"]
            print(f"last block whole (n < L) adds {lw['m1_gib_per_token'] * 2**30 / 1024:.2f} KiB/token "
                  f"(+{lw['m0_gib'] * 1024:.1f} MiB/sample, max err {lw['fit']['max_rel_err']:.1%})")
    pt = memory.get("per_token_timesteps")
    if pt is not None:
        print(f"one timestep per token (first-frame conditioned videos) adds {pt['m1_gib_per_token'] * 2**20:.1f} "
              f"KiB/token to m1 and {pt['block_full_m1_gib_per_token'] * 2**20:.1f} KiB/token to a whole block")
    if memory.get("fragmentation_margin_gib") is not None:
        print(f"fragmentation margin (reserved - allocated peak at the sweep's high-water marks): "
              f"{memory['fragmentation_margin_gib']:.3f} GiB (PYTORCH_CUDA_ALLOC_CONF={memory.get('allocator', '')!r})")


if __name__ == "__main__":
    sys.exit(main())
