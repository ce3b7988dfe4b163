"""A profile json from a calibration: the fitted compute and memory, static memory under ZeRO, the all-to-all
model, checkpoint terms; also the shipped profiles rebuilt from measured per-block times
(``--from-block-scaling``) and a profile refitted from its own raw rows.
"""
from __future__ import annotations

import copy
import datetime as _dt
import os
from typing import Any, Mapping, Sequence

import numpy as np

from ds_adaptive.calibration.calibrate import STAGE3_PREFETCH_PARAMS, _config_dict
from ds_adaptive.calibration.fit import (checkpoint_fit, fit_compute, fit_memory, fragmentation_margin,
                                         full_model_points, per_token_entry, row_per_token)
from ds_adaptive.core.shapes import SampleShape
from ds_adaptive.models.registry import get_model, model_names
from ds_adaptive.planning.profile import GIB, PROFILE_FORMAT


CPU_MODEL = "tiny"
"""``--device cpu``'s default model: its calibration grids are small (seconds on a CPU, not the >14 min of a
GPU model's grids)."""


# Bytes per parameter of mixed-precision Adam under DeepSpeed: bf16 params, bf16 grads,
# fp32 master weights + Adam m + v.
BYTES_PER_PARAM = {"params": 2.0, "grads": 2.0, "optimizer": 12.0}


ZERO_PARTITIONED = {"0": [], "1": ["optimizer"], "2": ["optimizer", "grads"],
                    "3": ["optimizer", "grads", "params"]}


CONTEXT_AND_NCCL_GIB = 1.5               # CUDA context + NCCL buffers + allocator slack (estimate)


DEFAULT_LINK_GBPS = 150.0                # effective all-to-all GB/s per GPU, 8xH100 NVSwitch (estimate)


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


def _memory_entry(mem_pts: list, full_cfg: dict, num_layers: int, text_len: int) -> dict:
    if mem_pts:
        return fit_memory(mem_pts)
    d = int(full_cfg.get("dim", 0))  # CPU: no allocator statistics; analytic estimate (checkpointed bf16 inputs)
    return {"m0_gib": text_len * int(full_cfg["text_dim"]) * 4 / GIB,
            "m1_gib_per_token": (num_layers + 6) * d * 2 * 3 / GIB,
            "fit": {"note": "no device memory statistics on this device: analytic estimate"}}


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
