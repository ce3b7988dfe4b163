"""Types the planner and the runtime share, owned by neither: per-layer x head attention densities
(:class:`DensityMap`, read and written as json) and a sparse kernel's efficiency curve
(:class:`KernelEfficiency`). The planner prices sparse attention with them
(:mod:`ds_adaptive.planning.sparse_cost`); the attention runtime, its backends and the head placement produce
and consume them.

Density json (written by :meth:`DensityMap.save`, read by :func:`load_densities`)::

    {"num_layers": 30, "num_heads": 12, "density": [[0.1, ...12], ...30],
     "dense_layers": [0, 29], "step": 1200, "source": "..."}           # the last three optional

A run's ``metrics.jsonl`` works too: the last record with a ``head_density`` key (``[layers][heads]``,
optional ``dense_layers`` and ``step``) at or before ``--step`` is used.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

__all__ = ["DensityMap", "DensityError", "KernelEfficiency", "load_densities", "synthetic_densities",
           "DSV_EFFICIENCY", "DENSITY_FORMAT"]

DENSITY_FORMAT = "ds_adaptive.densities/1"

# DSV.md: FlexAttention block-sparse (128x128, full blocks) runs at ~70% of cuDNN dense's effective
# rate on H100 and H200: time ~ 1.45 x density x dense time (measured 0.05-0.4), dense above ~0.69.
DSV_EFFICIENCY = {"density": [0.05, 0.1, 0.2, 0.4], "ratio": [0.0725, 0.145, 0.29, 0.58]}


class DensityError(ValueError):
    """A density table that is malformed or does not fit the model."""


@dataclass(frozen=True)
class DensityMap:
    """Attention density per layer and head: the fraction of key blocks a query block attends to."""

    density: tuple[tuple[float, ...], ...]
    dense_layers: tuple[int, ...] = ()
    step: Optional[int] = None
    source: str = ""

    def __post_init__(self) -> None:
        if not self.density or not self.density[0]:
            raise DensityError("density table is empty: need [layers][heads] densities")
        h = len(self.density[0])
        for layer, row in enumerate(self.density):
            if len(row) != h:
                raise DensityError(f"density row of layer {layer} has {len(row)} heads, layer 0 has {h}")
            for head, x in enumerate(row):
                if not (isinstance(x, (int, float)) and 0.0 < float(x) <= 1.0):
                    raise DensityError(f"density[{layer}][{head}] = {x!r}: must be in (0, 1] (fraction of key "
                                       "blocks attended)")
        bad = [x for x in self.dense_layers if not 0 <= int(x) < len(self.density)]
        if bad:
            raise DensityError(f"dense_layers {bad} outside 0..{len(self.density) - 1}")

    @property
    def num_layers(self) -> int:
        return len(self.density)

    @property
    def num_heads(self) -> int:
        return len(self.density[0])

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str = "<dict>") -> "DensityMap":
        dens = d.get("density", d.get("head_density"))
        if dens is None:
            raise DensityError(f"densities {where}: no 'density' key ([layers][heads] list of floats)")
        try:
            out = cls(density=tuple(tuple(float(x) for x in row) for row in dens),
                      dense_layers=tuple(int(x) for x in d.get("dense_layers") or ()),
                      step=None if d.get("step") is None else int(d["step"]), source=str(d.get("source", where)))
        except (TypeError, ValueError) as exc:
            raise DensityError(f"densities {where}: {exc}") from exc
        for key, have in (("num_layers", out.num_layers), ("num_heads", out.num_heads)):
            if key in d and int(d[key]) != have:
                raise DensityError(f"densities {where}: '{key}' is {d[key]} but 'density' has {have}")
        return out

    def as_dict(self) -> dict:
        return {"format": DENSITY_FORMAT, "num_layers": self.num_layers, "num_heads": self.num_heads,
                "density": [list(r) for r in self.density], "dense_layers": list(self.dense_layers),
                "step": self.step, "source": self.source}

    def save(self, path: Union[str, Path]) -> None:
        Path(path).write_text(json.dumps(self.as_dict(), indent=1))

    def fingerprint(self) -> str:
        """Short hash of the table (equal on every rank that holds the same densities)."""
        return hashlib.sha256(json.dumps([self.density, self.dense_layers]).encode()).hexdigest()[:16]

    def with_num_layers(self, num_layers: int) -> "DensityMap":
        """The first ``num_layers`` layers (a run with ``--layers N`` of a full-depth table)."""
        if num_layers == self.num_layers:
            return self
        if not 1 <= num_layers <= self.num_layers:
            raise DensityError(f"cannot take {num_layers} layers of a {self.num_layers}-layer density table")
        return DensityMap(self.density[:num_layers], tuple(x for x in self.dense_layers if x < num_layers),
                          self.step, f"{self.source} (first {num_layers} layers)")


def load_densities(src: Union[str, Path, Mapping[str, Any], DensityMap], *, step: Optional[int] = None) -> DensityMap:
    """A :class:`DensityMap` from a density json, a run's ``metrics.jsonl`` (the last record with
    ``head_density`` at or before ``step``), a dict or a DensityMap."""
    if isinstance(src, DensityMap):
        return src
    if isinstance(src, Mapping):
        return DensityMap.from_dict(src)
    path = Path(src)
    if not path.is_file():
        raise DensityError(f"densities file {path} does not exist (a density json, or a run's metrics.jsonl)")
    text = path.read_text()
    if path.suffix == ".jsonl":
        best = None
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            if "head_density" not in rec:
                continue
            if step is not None and rec.get("step") is not None and int(rec["step"]) > step:
                continue
            best = (n, rec)
        if best is None:
            raise DensityError(f"{path}: no record with 'head_density'" + (f" at or before step {step}" if step is not None
                               else "") + "; the run must log per-layer x head densities (sparse attention profiler)")
        return DensityMap.from_dict(best[1], where=f"{path}:{best[0]}")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DensityError(f"densities {path} is not valid JSON: {exc}") from exc
    return DensityMap.from_dict(data, where=str(path))


def synthetic_densities(num_layers: int, num_heads: int, *, lo: float = 0.02, hi: float = 0.5, seed: int = 0,
                        head_spread: float = 0.6, dense_layers: Sequence[int] = ()) -> DensityMap:
    """A realistic-looking table for simulation: per layer a mean density log-uniform in
    ``[2 lo, 0.7 hi]`` (layers differ), per head a log-normal factor (sigma ``head_spread``: heads of
    one layer differ several-fold, as DSV observes), clipped to ``[lo, hi]``. Deterministic in ``seed``."""
    rng = np.random.default_rng([seed, 0x5AA5])
    base = np.exp(rng.uniform(math.log(2 * lo), math.log(0.7 * hi), size=(num_layers, 1)))
    d = np.clip(base * np.exp(rng.normal(0.0, head_spread, size=(num_layers, num_heads))), lo, hi)
    return DensityMap(tuple(tuple(float(x) for x in row) for row in d), tuple(int(x) for x in dense_layers),
                      source=f"synthetic(lo={lo}, hi={hi}, seed={seed}, head_spread={head_spread})")


@dataclass(frozen=True)
class KernelEfficiency:
    """``g(rho)``: sparse-kernel time / dense time (fwd+bwd) at density ``rho``, piecewise linear in
    the measured points, proportional to rho below the first point (g(rho) = rho * g(d0)/d0), and
    ``min(1, .)``: above break-even the op runs dense."""

    density: tuple[float, ...]
    ratio: tuple[float, ...]
    source: str = "DSV.md anchors (H100/H200): 1.45 x density"

    def __post_init__(self) -> None:
        if len(self.density) != len(self.ratio) or not self.density:
            raise ValueError(f"efficiency table needs equal non-empty density/ratio lists, got "
                             f"{len(self.density)} / {len(self.ratio)}")
        if any(b <= a for a, b in zip(self.density, self.density[1:])) or self.density[0] <= 0:
            raise ValueError(f"efficiency densities must be increasing and > 0, got {self.density}")
        if any(r <= 0 for r in self.ratio):
            raise ValueError(f"efficiency ratios must be > 0, got {self.ratio}")

    def __call__(self, rho: float) -> float:
        d, r = self.density, self.ratio
        if rho >= 1.0:
            return 1.0
        if rho <= d[0]:
            g = rho * r[0] / d[0]
        elif rho >= d[-1]:
            g = r[-1] * rho / d[-1] if len(d) == 1 else r[-1] + (r[-1] - r[-2]) / (d[-1] - d[-2]) * (rho - d[-1])
        else:
            g = float(np.interp(rho, d, r))
        return min(1.0, g)

    @classmethod
    def default(cls) -> "KernelEfficiency":
        return cls(tuple(DSV_EFFICIENCY["density"]), tuple(DSV_EFFICIENCY["ratio"]))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str = "<dict>") -> "KernelEfficiency":
        """From a profile json with a ``sparse_attention`` section (written by ``calibrate --sparse``)
        or from that section itself."""
        sec = d.get("sparse_attention", d)
        eff = sec.get("efficiency")
        if not isinstance(eff, Mapping) or "density" not in eff or "ratio" not in eff:
            raise ValueError(f"{where}: no sparse_attention.efficiency {{density: [...], ratio: [...]}}; "
                             "write one with `ds-adaptive calibrate --sparse`")
        return cls(tuple(float(x) for x in eff["density"]), tuple(float(x) for x in eff["ratio"]),
                   source=str(sec.get("source", where)))

    def as_dict(self) -> dict:
        return {"density": list(self.density), "ratio": list(self.ratio), "source": self.source}
