"""Known GPUs (dense bf16 peak, memory bandwidth) and ``profile: "auto"``: the profile for the GPU at hand.

``sampler.profile: "auto"`` (the default) picks the shipped calibration of the detected GPU and the
trained model (``<gpu>-<model>.json`` in ``ds_adaptive/planning/profiles``, e.g. ``h200-wan2.1-1.3b``; a
model of identical architecture and token grid uses its twin's, ``Preset.profile_model``).
When none is shipped for that GPU, one message names the GPU found and the one-line calibrate
command, and the nearest shipped profile of the model is used, its times scaled by the ratio of
dense bf16 peaks (the Wan blocks' time is matmul- and attention-bound) and its capacity set to the
GPU's. On a machine without a GPU (simulation, dry runs, CPU smoke runs) the H100 calibration of
the model is used, with a message (its times describe an H100). A model with no shipped profile
(``tiny``) uses the 1.3B profile, with a message.

``GPU_SPECS`` also gives MFU its peak (``metrics``: ``peak_tflops``, overridable in the config).
Datasheet figures (dense, no sparsity), SXM parts unless named.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Optional

from ds_adaptive.planning.profile import Profile, load_profile, shipped_profiles
from ds_adaptive.models.registry import default_model
from ds_adaptive.models.registry import default_model, model_for_profile


@dataclass(frozen=True)
class GpuSpec:
    key: str                 #: profile prefix (``h200`` in ``h200-wan2.1-1.3b``)
    pattern: str             #: regex on ``torch.cuda.get_device_name()`` (case-insensitive)
    bf16_tflops: float       #: dense bf16 tensor-core peak, TFLOP/s
    hbm_tbps: float          #: memory bandwidth, TB/s
    mem_gib: float           #: nominal capacity


# Order matters: the first match wins (H100 PCIe before H100).
GPU_SPECS: tuple[GpuSpec, ...] = (
    GpuSpec("gh200", r"GH200", 989.0, 4.0, 96.0),
    GpuSpec("h200", r"H200", 989.0, 4.8, 141.0),
    GpuSpec("h100-pcie", r"H100.*PCIe", 756.0, 2.0, 80.0),
    GpuSpec("h100-nvl", r"H100 NVL", 835.0, 3.9, 94.0),
    GpuSpec("h100", r"H100", 989.0, 3.35, 80.0),
    GpuSpec("h800", r"H800", 989.0, 3.35, 80.0),
    GpuSpec("h20", r"H20\b", 148.0, 4.0, 96.0),
    GpuSpec("b200", r"B200", 2250.0, 8.0, 180.0),
    GpuSpec("b100", r"B100", 1750.0, 8.0, 180.0),
    GpuSpec("a100", r"A100", 312.0, 2.0, 80.0),
    GpuSpec("a800", r"A800", 312.0, 2.0, 80.0),
    GpuSpec("l40s", r"L40S", 362.0, 0.86, 48.0),
    GpuSpec("a10g", r"A10G", 70.0, 0.6, 24.0),
    GpuSpec("rtx4090", r"4090", 165.0, 1.0, 24.0),
    GpuSpec("mi300x", r"MI300X", 1307.0, 5.3, 192.0),
)


def gpu_spec(device_name: Optional[str]) -> Optional[GpuSpec]:
    """The table row of a device name (``torch.cuda.get_device_name()``), or None."""
    if not device_name:
        return None
    for spec in GPU_SPECS:
        if re.search(spec.pattern, device_name, re.IGNORECASE):
            return spec
    return None


def detect_device_name() -> Optional[str]:
    """``torch.cuda.get_device_name()`` of the current device, or None without a GPU."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(torch.cuda.current_device())
    except Exception:
        return None
    return None


def calibrate_command(model_name: str, key: Optional[str]) -> str:
    prefix = key or "mygpu"
    return (f"ds-adaptive calibrate --model {model_name} --sp 1 --out "
            f"ds_adaptive/planning/profiles/{prefix}-{model_name}.json")


def calibrate_hint(model_name: str, device_name: Optional[str] = None, *, detect: bool = True) -> str:
    """What to run for a profile of ``model_name``, as a command that works as written: on a GPU machine for
    its GPU; without a GPU (calibrate measures the GPU it runs on; CPU timings fail its fit-quality bar) on the
    GPU the run trains on."""
    if device_name is None and detect:
        device_name = detect_device_name()
    spec = gpu_spec(device_name)
    cmd = calibrate_command(model_name, spec.key if spec else None)
    where = "" if device_name else " on the GPU you train on (no GPU here)"
    return f"run `{cmd}`{where} and set sampler.profile to that file"


def _model_profiles(model_name: str) -> list[str]:
    return [n for n in shipped_profiles() if n.endswith(f"-{model_name}")]


def scale_profile(profile: Profile, *, from_tflops: float, to_tflops: float, gpu_mem_gib: float,
                  device: str) -> Profile:
    """``profile`` for another GPU: every time (c0, a, b, recompute) x ``from_tflops / to_tflops``;
    memory per token unchanged; capacity ``gpu_mem_gib``. An estimate until `calibrate` runs there."""
    f = from_tflops / to_tflops
    d = copy.deepcopy(dict(profile.raw))
    for k in ("c0_ms", "a_ms_per_token", "b_ms_per_token2"):
        d["compute"][k] = d["compute"][k] * f
    d["compute"].pop("fit", None)
    if "recompute" in d["compute"]:
        for k in ("c0_ms", "a_ms_per_token", "b_ms_per_token2"):
            d["compute"]["recompute"][k] *= f
    d["gpu_mem_gib"] = float(gpu_mem_gib)
    d["device"] = device
    d["name"] = f"{profile.name}-scaled-to-{device.replace(' ', '_')}"
    d["source"] = (f"{profile.name} scaled by dense bf16 peak {from_tflops:g}/{to_tflops:g} TFLOP/s "
                   "(ds_adaptive.planning.devices.scale_profile): an estimate, not a calibration")
    d.pop("measurements", None)
    return Profile.from_dict(d, where=d["name"])


def default_profile_name() -> str:
    """The shipped H100 calibration of the default model: the planners' reference profile (``simulate``)."""
    return f"h100-{default_model()}"


def resolve_auto_profile(model_name: Optional[str], device_name: Optional[str] = None, *,
                         gpu_mem_gib: Optional[float] = None, detect: bool = True) -> tuple[Profile, str]:
    """``profile: "auto"`` -> (profile, one-line message saying what was chosen and why).

    ``device_name`` defaults to the detected GPU (None on a CPU-only machine)."""
    if device_name is None and detect:
        device_name = detect_device_name()
    model = model_name or default_model()
    known = model_for_profile(model)
    model = known.profile_model if known is not None else model
    candidates = _model_profiles(model)
    note = ""
    if not candidates:
        fallback = default_model()
        note = (f" (no shipped profile for model '{model}'; using the {fallback} calibrations, whose "
                "absolute costs and memory do not describe this model)")
        model = fallback
        candidates = _model_profiles(model)
    spec = gpu_spec(device_name)
    if device_name is None:
        name = f"h100-{model}" if f"h100-{model}" in candidates else candidates[0]
        return load_profile(name), (f"profile auto: no GPU visible; using '{name}' (its times and capacity "
                                    f"describe {load_profile(name).device}){note}")
    if spec is not None and f"{spec.key}-{model}" in candidates:
        name = f"{spec.key}-{model}"
        return load_profile(name), f"profile auto: '{name}' (shipped calibration for {device_name}){note}"
    # nearest shipped GPU by dense bf16 peak
    ref = []
    for name in candidates:
        key = name[: -len(model) - 1]
        s = next((g for g in GPU_SPECS if g.key == key), None)
        if s is not None:
            ref.append((abs(s.bf16_tflops - (spec.bf16_tflops if spec else s.bf16_tflops)), name, s))
    ref.sort(key=lambda r: (r[0], r[1]))
    _, name, rspec = ref[0]
    base = load_profile(name)
    cap = gpu_mem_gib or (spec.mem_gib if spec else base.gpu_mem_gib)
    if spec is None:
        prof = scale_profile(base, from_tflops=rspec.bf16_tflops, to_tflops=rspec.bf16_tflops,
                             gpu_mem_gib=cap, device=device_name)
        how = "unknown GPU: times unscaled"
    else:
        prof = scale_profile(base, from_tflops=rspec.bf16_tflops, to_tflops=spec.bf16_tflops,
                             gpu_mem_gib=cap, device=device_name)
        how = f"times x {rspec.bf16_tflops:g}/{spec.bf16_tflops:g} (dense bf16 TFLOP/s)"
    msg = (f"profile auto: no shipped calibration for GPU '{device_name}'; using '{name}' scaled to it "
           f"({how}, capacity {cap:.1f} GiB){note}. Calibrate this GPU (about a minute): "
           f"{calibrate_command(model, spec.key if spec else None)} and set sampler.profile to that file")
    return prof, msg


def peak_tflops(device_name: Optional[str]) -> Optional[float]:
    """Dense bf16 peak of a known GPU (TFLOP/s), else None."""
    spec = gpu_spec(device_name)
    return spec.bf16_tflops if spec else None
