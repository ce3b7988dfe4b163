"""Self-calibration on first use: a profile for a GPU / model / LayerNorm-modulate path nothing ships for.

``sampler.profile: auto`` uses the shipped calibration of the detected GPU and model when it was measured
with the run's LayerNorm-modulate path (``fused`` | ``reference``; its ``ln_modulate`` or one of its
``ln_modulate_variants``). When there is none -- another GPU, a model without a shipped profile, or the H100
profile that was calibrated on the reference path while the run uses the fused op -- and on
``profile: calibrate``, the run calibrates at start-up instead of planning with a scaled estimate:

1. rank 0 looks in the profile cache (:func:`cache_dir`) for the entry of this GPU name, model, path, block-fusion
   mode, torch / CUDA version, profile format and protocol (:func:`cache_key`); on a miss it runs the quick
   protocol (:func:`quick_protocol`: 6 of the model's calibration grids at 2 and 4 blocks, both checkpointing modes, 1 warm-up
   and 3 timed runs per point, a time budget of 90 s for Wan 1.3B; the machinery of
   :mod:`ds_adaptive.calibration.calibrate`; with the run's block fusion compiled first) with a progress bar, checks
   the fit against the quality bar and
   writes the entry (atomically);
2. rank 0 broadcasts the profile (or "none needed", or "failed: use the fallback") to every rank, so
   every rank plans with the same numbers whatever its own cache holds;
3. the plan uses it (``build_batch_sampler(..., profile=...)``); a second run reads the cache.

A calibration that fails (an error, a fit over the quality bar) is not cached; the run falls back to
``auto``'s scaled estimate with a warning naming the problem. The dry run (``meta``) reports what the run
would do: the cached entry it would use, or that rank 0 would calibrate, and why.

Entry point: :func:`startup_profile`, called by ``ds_adaptive.training.assemble.build_run`` (the one assembly path).
To ship a cached calibration as a profile's other path: ``python -m ds_adaptive.cli.autocalibrate ship
CACHED.json ds_adaptive/planning/profiles/<gpu>-<model>.json`` (:func:`ship_variant`).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from ds_adaptive.calibration import calibrate as cal
from ds_adaptive.calibration.fit import MAX_FIT_ERROR, fit_quality_problem
from ds_adaptive.calibration.profile_json import profile_from_rows
from ds_adaptive.core.shapes import SampleShape
from ds_adaptive.models.registry import get_model
from ds_adaptive.planning.devices import detect_device_name, gpu_spec
from ds_adaptive.planning.profile import PROFILE_FORMAT, Profile, load_profile, shipped_profiles


__all__ = ["QuickProtocol", "quick_protocol", "cache_dir", "cache_key", "cache_path", "calibration_reason",
           "quick_calibrate", "startup_profile", "ship_variant", "CACHE_ENV", "PROTOCOL_VERSION", "CalibrationFailed"]


#: environment variable naming the cache directory (``sampler.profile_cache`` takes precedence)
CACHE_ENV = "DS_ADAPTIVE_CACHE_DIR"


#: part of the cache key: a change of the quick protocol, or of what the model's blocks hold for the backward,
#: invalidates the cached entries. 2: blocks keep less for the backward (``models.lean_backward``), so entries
#: measured before over-predict activation memory.
PROTOCOL_VERSION = 2


class CalibrationFailed(RuntimeError):
    """The start-up calibration could not produce a usable profile (the message says why)."""


@dataclass(frozen=True)
class QuickProtocol:
    """What the start-up calibration measures (see :func:`quick_protocol`)."""

    layers: tuple                    #: two depths (k1, k2) to difference
    shapes: tuple                    #: SampleShapes, short to long
    batch_sizes: Mapping[int, tuple] = field(default_factory=dict)   #: tokens -> batch sizes (default (1,))
    warmup: int = 1
    iters: int = 3
    budget_s: float = 90.0           #: points not started within this many seconds are skipped
    dtype: str = "bf16"
    max_fit_error: Optional[float] = None   #: None: calibrate.MAX_FIT_ERROR; on the CPU not applied (inf)

    @property
    def points(self) -> int:
        """Measurements (depths x shapes x batch sizes x both checkpointing modes)."""
        return len(self.layers) * 2 * sum(len(self.batch_sizes.get(s.tokens, (1,))) for s in self.shapes)


def quick_protocol(model_name: str, device_type: str) -> QuickProtocol:
    """The start-up calibration of ``model_name`` on a ``device_type`` ("cuda" | "cpu") device, from the model's
    registry entry (``ds_adaptive.models``): its calibration grids under its grid rule and its size.

    GPU: 6 of the preset's calibration grids (the shortest and the 5 longest; Wan 2.1: 1x480x832, 33x480x832,
    49x480x832, 81x480x832, 49x720x1280, 81x720x1280 = 1,560 to 75,600 tokens, 5 points over the fit's 8,192
    tokens), the two shortest also at a batch of ~17k tokens (Wan 2.1: B = 11 and 2), 2 and 4
    blocks (1 and 2 for models over 10B parameters): 6 grids and 1 + 3 runs per point, where a full
    ``ds-adaptive calibrate`` runs 8 grids and 2 + 5.
    CPU (``profile: calibrate`` in tests): tiny grids of 16-720 tokens (Wan 2.1's rule), 1 and 2 blocks, fp32,
    no quality bar (CPU timings describe no GPU). The longest two hold the length-dependent time above the
    per-micro-batch overhead: with 192 tokens at most, a loaded machine's noise
    sometimes fitted a = b = 0, a fit that ``fit_quality_problem`` refuses."""
    m = get_model(model_name)
    if device_type != "cuda":
        shapes = tuple(SampleShape(f, h, w, m.grid) for f, h, w in ((1, 64, 64), (5, 128, 128), (9, 192, 192),
                                                                    (17, 192, 192)))
        return QuickProtocol(layers=(1, 2), shapes=shapes, batch_sizes={shapes[0].tokens: (1, 4)}, warmup=1,
                             iters=2, budget_s=60.0, dtype="fp32", max_fit_error=float("inf"))
    grids = list(m.preset.calibration_shapes)
    if len(grids) > 6:   # the shortest (the fixed-cost end) and the 5 longest (the fit's S^2 term)
        grids = grids[:1] + grids[-5:]
    shapes = tuple(SampleShape(f, h, w, m.grid) for f, h, w in grids)
    batch_tokens = 11 * shapes[0].tokens   # Wan 2.1: 11 images of 1,560 tokens
    batch_sizes = {s.tokens: (1, max(2, -(-batch_tokens // s.tokens))) for s in shapes[:2]}
    big = m.param_counts(m.config())["total"] > 10e9
    return QuickProtocol(layers=(1, 2) if big else (2, 4), shapes=shapes, batch_sizes=batch_sizes)


# ------------------------------------------------------------------------------------- cache
def cache_dir(setting: Optional[str] = None, environ: Optional[Mapping[str, str]] = None) -> Path:
    """The profile cache: ``setting`` (``sampler.profile_cache``), else ``$DS_ADAPTIVE_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/ds_adaptive``, else ``~/.cache/ds_adaptive``; entries live in its ``profiles/``."""
    env = os.environ if environ is None else environ
    if setting:
        base = Path(setting).expanduser()
    elif env.get(CACHE_ENV):
        base = Path(env[CACHE_ENV]).expanduser()
    elif env.get("XDG_CACHE_HOME"):
        base = Path(env["XDG_CACHE_HOME"]).expanduser() / "ds_adaptive"
    else:
        base = Path("~/.cache/ds_adaptive").expanduser()
    return base / "profiles"


def cache_key(device_name: str, model_name: str, ln_modulate: str, block_fusion: str = "off") -> dict:
    """What a cached profile was measured with; an entry is used only when all of it matches. ``block_fusion``
    enters the key only when on (entries measured without it keep their keys)."""
    import torch

    key = {"device": device_name, "model": model_name, "ln_modulate": ln_modulate, "torch": torch.__version__,
           "cuda": torch.version.cuda, "format": PROFILE_FORMAT, "protocol": PROTOCOL_VERSION}
    if block_fusion != "off":
        key["block_fusion"] = block_fusion
    return key


def cache_path(directory: Path, key: Mapping[str, Any]) -> Path:
    """``<gpu>-<model>-<path>-<hash of the whole key>.json`` in ``directory``."""
    slug = "-".join(re.sub(r"[^A-Za-z0-9.-]+", "_", str(key[k])).strip("_")
                    for k in ("device", "model", "ln_modulate", "block_fusion") if k in key)
    digest = hashlib.sha256(json.dumps(dict(key), sort_keys=True).encode()).hexdigest()[:10]
    return Path(directory) / f"{slug}-{digest}.json"


def _read_cached(path: Path, key: Mapping[str, Any]) -> Optional[dict]:
    """The cached profile at ``path`` when its key matches and it validates, else None (a corrupt or stale
    file is ignored, and overwritten by the next calibration)."""
    try:
        data = json.loads(path.read_text())
        if data.get("cache_key") != dict(key):
            return None
        Profile.from_dict(data, where=str(path))
        return data
    except (OSError, ValueError):
        return None


def _write_cached(path: Path, prof: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(prof, indent=1) + "\n")
    os.replace(tmp, path)   # atomic: ranks of several nodes may write the same entry


# ------------------------------------------------------------------------------------- when
def _shipped_for(model_name: str, device_name: str) -> Optional[str]:

    spec = gpu_spec(device_name)
    name = f"{spec.key}-{model_name}" if spec is not None else None
    return name if name in shipped_profiles() else None


def calibration_reason(setting: Optional[str], model_name: str, device_name: Optional[str],
                       ln_modulate: str) -> Optional[str]:
    """Why this run calibrates at start-up, or None: ``profile: calibrate``; or ``auto`` on a GPU with no
    shipped profile of this GPU and model that was measured with the run's LayerNorm-modulate path. Never
    without a GPU for ``auto`` (simulation, dry runs and CPU runs plan with the H100 profile, as before)."""
    if setting == "calibrate":
        return "sampler.profile is 'calibrate'"
    if setting != "auto" or device_name is None:
        return None

    name = _shipped_for(model_name, device_name)
    if name is None:
        return f"no shipped profile for GPU '{device_name}' and model '{model_name}'"
    prof = load_profile(name)
    if prof.ln_modulate == ln_modulate or ln_modulate in (prof.raw.get("ln_modulate_variants") or {}):
        return None
    return (f"the shipped profile '{name}' was calibrated with the {prof.ln_modulate} LayerNorm-modulate path, "
            f"this run uses the {ln_modulate} path")


# ------------------------------------------------------------------------------------- how
def _progress_bar(label: str, out=sys.stdout) -> Callable[[int, int], None]:
    """A text progress bar: redrawn in place on a terminal, else one line per tenth (logs stay short)."""
    t0 = time.perf_counter()
    tty = hasattr(out, "isatty") and out.isatty()
    shown = [-1]

    def show(done: int, total: int) -> None:
        tenth = 10 * done // max(total, 1)
        if not tty and tenth == shown[0]:
            return
        shown[0] = tenth
        n = 30 * done // max(total, 1)
        line = f"{label} [{'#' * n}{'.' * (30 - n)}] {done}/{total} points, {time.perf_counter() - t0:.0f} s"
        print(("\r" + line) if tty else line, end="\n" if (not tty or done == total) else "", file=out, flush=True)

    return show


def quick_calibrate(model_name: str, *, device, ln_modulate: str, protocol: Optional[QuickProtocol] = None,
                    log: Callable[[str], None] = lambda m: None, progress: bool = True,
                    block_fusion: str = "off") -> dict:
    """Measure ``model_name`` on ``device`` with the quick protocol (and the run's ``block_fusion``, compiled before
    the points, its compile time outside the time budget) and return the profile json (dict) with its
    ``cache_key``; raise :class:`CalibrationFailed` when the fit misses the quality bar or the fusion cannot compile."""
    import torch


    proto = protocol or quick_protocol(model_name, device.type)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    gpu_mem = (torch.cuda.get_device_properties(device).total_memory / cal.GIB if device.type == "cuda" else 16.0)
    fused = f", block fusion {block_fusion}" if block_fusion != "off" else ""
    label = f"calibrating {model_name} on {dev_name} ({ln_modulate} LayerNorm-modulate{fused})"
    t0 = time.perf_counter()
    try:
        rows, _ = cal.measure(model_name, layers=list(proto.layers), shapes=list(proto.shapes),
                              batch_sizes={k: list(v) for k, v in proto.batch_sizes.items()}, sp=1,
                              device_name=str(device), dtype_name=proto.dtype, warmup=proto.warmup, iters=proto.iters,
                              gradient_checkpointing=True, overrides={}, log=log, both_checkpointing=True,
                              ln_modulate=ln_modulate, deadline=t0 + proto.budget_s,
                              progress=_progress_bar(label) if progress else None, block_fusion=block_fusion)
    except SystemExit as exc:   # the fusion could not compile: a failed calibration, not the end of rank 0
        raise CalibrationFailed(str(exc)) from None
    ran = cal.ran_ln_modulate(ln_modulate)
    wall = time.perf_counter() - t0
    key = cache_key(dev_name, model_name, ran, block_fusion)
    try:
        prof = profile_from_rows(
            rows, model_name=model_name, overrides={}, layers=proto.layers, sp=1, device_name=dev_name,
            gpu_mem_gib=gpu_mem, dtype=proto.dtype, ln_modulate=ran, block_fusion=block_fusion,
            name=cache_path(Path("."), key).stem,
            source=(f"start-up calibration (ds_adaptive.calibration.autocalibrate, protocol {PROTOCOL_VERSION}: "
                    f"{proto.points} points, layers {proto.layers[0]},{proto.layers[1]})"), wall_s=wall)
    except ValueError as exc:   # too few points (the time budget cut the sweep short)
        raise CalibrationFailed(f"{exc} ({len(rows)} of {proto.points} points measured in {wall:.0f} s)") from exc
    bar = MAX_FIT_ERROR if proto.max_fit_error is None else proto.max_fit_error
    problem = fit_quality_problem(prof["compute"], bar)
    if problem:
        raise CalibrationFailed(problem)
    prof["cache_key"] = key
    return prof


def _rank0_resolve(setting: str, model_name: str, ln_modulate: str, device, cache: Path, *,
                   dry: bool, block_fusion: str = "off") -> dict:
    """Rank 0's decision: ``{"profile": dict | None, "note": str | None}``."""
    if device.type == "cpu":   # a CPU run calibrates the CPU only when asked to (``calibrate``: tests)
        dev_name = "cpu" if setting == "calibrate" else None
    else:                      # cuda, or a dry run (meta) on whatever GPU this machine has
        dev_name = detect_device_name()
    reason = calibration_reason(setting, model_name, dev_name, ln_modulate)
    if reason is None:
        return {"profile": None, "note": None}
    if dev_name is None:   # a dry run without a GPU: the GPU job decides
        return {"profile": None, "note": (f"profile: {reason}: rank 0 of the GPU job calibrates at start-up unless "
                                          f"{cache} holds an entry for its GPU; this check plans with the fallback")}
    key = cache_key(dev_name, model_name, ln_modulate, block_fusion)
    path = cache_path(cache, key)
    cached = _read_cached(path, key)
    if cached is not None:
        return {"profile": cached, "note": (f"profile: {path} (start-up calibration cached {cached.get('date')}, "
                                            f"{cached.get('wall_s')} s; {reason}; delete it to calibrate again)")}
    proto = quick_protocol(model_name, "cuda" if dev_name != "cpu" else "cpu")
    if dry:
        return {"profile": None, "note": (f"profile: {reason}: rank 0 would calibrate at start-up ({proto.points} "
                                          f"points, at most {proto.budget_s:.0f} s) and cache the result in {path}; "
                                          "this check plans with the fallback")}
    try:
        prof = quick_calibrate(model_name, device=device, ln_modulate=ln_modulate, protocol=proto,
                               block_fusion=block_fusion)
    except (CalibrationFailed, RuntimeError) as exc:
        return {"profile": None, "note": (f"warning: start-up calibration of {model_name} on {dev_name} failed "
                                          f"({exc}); planning with the fallback profile instead")}
    try:
        _write_cached(path, prof)
        where = f"cached in {path}"
    except OSError as exc:
        where = f"not cached ({exc}; set sampler.profile_cache or ${CACHE_ENV} to a writable directory)"
    return {"profile": prof, "note": (f"profile: calibrated at start-up in {prof['wall_s']} s on {dev_name} "
                                      f"({model_name}, {prof['ln_modulate']} LayerNorm-modulate, block fusion "
                                      f"{prof.get('block_fusion', 'off')}; {reason}); {where}")}


def startup_profile(setting: Optional[str], *, model_name: str, ln_modulate: str, device, cache: Optional[str] = None,
                    meta: bool = False, notes: Optional[list] = None, block_fusion: str = "off") -> Optional[Profile]:
    """The profile this run plans with when it is calibrated at start-up (or read from the cache), else None
    (the caller resolves ``setting`` as before). Call on EVERY rank, collectively, when torch.distributed is
    initialised: rank 0 decides and broadcasts. ``meta``: a dry run (never calibrates, no collectives).
    ``block_fusion``: the mode the run's plan counts (``run.planned_block_fusion``); a calibration measures with it
    (a shipped profile without it is used as is: its plan is conservative). The one-line note (what was done and
    why) is appended to ``notes``."""
    if setting not in ("auto", "calibrate"):
        return None
    import torch.distributed as dist

    group = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and not meta
    rank = dist.get_rank() if group else 0
    payload = [None]
    if rank == 0:
        try:
            payload[0] = _rank0_resolve(setting, model_name, ln_modulate, device, cache_dir(cache), dry=meta,
                                        block_fusion=block_fusion)
        except Exception as exc:   # noqa: BLE001 -- the other ranks wait in the broadcast: never leave them hanging
            payload[0] = {"profile": None, "note": f"warning: start-up profile resolution failed ({exc!r}); "
                                                   "planning with the fallback profile"}
    if group:
        dist.broadcast_object_list(payload, src=0)
    res = payload[0]
    if res["note"] and notes is not None:
        notes.append(res["note"])
    if res["profile"] is None:
        return None
    return Profile.from_dict(res["profile"], where=res["profile"].get("name", "start-up calibration"))


# ------------------------------------------------------------------------------------- shipping
def ship_variant(base: Mapping[str, Any], calibrated: Mapping[str, Any], *, replace: bool = False) -> dict:
    """``base`` (a shipped profile json) with ``calibrated`` (a calibration of the same model on the same GPU kind)
    as one of its variants, whose ``compute``, ``memory`` and ``train_overheads`` (where measured) blocks replace the
    top-level ones for a run that matches it (a block-fusion variant's ``compute`` only together with its own
    ``train_overheads``: :meth:`Profile.for_block_fusion`):

    * another block-fusion mode on the base's LayerNorm-modulate path (``ds-adaptive calibrate --block-fusion``):
      ``block_fusion_variants[<mode>]`` (:meth:`Profile.for_block_fusion`);
    * else another LayerNorm-modulate path, without block fusion (a start-up calibration or ``--ln-modulate``):
      ``ln_modulate_variants[<path>]`` (:meth:`Profile.for_ln_modulate`).

    Refuses another model, a calibration the base already is, one it already has (unless ``replace``: a new
    calibration of the same variant, e.g. after a model change), and one that differs in both."""
    model, bmodel = calibrated.get("model", {}).get("name"), base.get("model", {}).get("name")
    path, bpath = calibrated.get("ln_modulate", "reference"), base.get("ln_modulate", "reference")
    fusion, bfusion = calibrated.get("block_fusion", "off"), base.get("block_fusion", "off")
    if model != bmodel:
        raise ValueError(f"the calibration is of model {model!r}, the profile of {bmodel!r}")
    if fusion != bfusion and path != bpath:
        raise ValueError(f"the calibration ran LayerNorm-modulate {path!r} with block fusion {fusion!r}, the profile "
                         f"{bpath!r} with {bfusion!r}: a variant differs from its profile in one of them")
    key, value, bvalue = (("block_fusion_variants", fusion, bfusion) if fusion != bfusion else
                          ("ln_modulate_variants", path, bpath))
    variants = dict(base.get(key) or {})
    if value == bvalue or (value in variants and not replace):
        raise ValueError(f"the profile already has {value!r} entries in {key} (its own is {bvalue!r})"
                         + ("" if value == bvalue else "; pass --replace to measure them anew"))
    out = json.loads(json.dumps(dict(base)))
    entry = {k: calibrated[k] for k in ("compute", "memory", "train_overheads") if k in calibrated}
    entry["source"] = f"{calibrated.get('source')} on {calibrated.get('device')}, {calibrated.get('date')}"
    if key == "block_fusion_variants":
        entry["ln_modulate"] = path
    variants[value] = entry
    out[key] = variants
    prof = Profile.from_dict(out, where=f"{base.get('name')} + {value} variant")   # the variant validates too:
    prof.for_block_fusion(value) if key == "block_fusion_variants" else prof.for_ln_modulate(value)
    return out
