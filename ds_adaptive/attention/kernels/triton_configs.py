"""Tile configurations of the Triton block-sparse kernels: built-in defaults and a measured table.

A :class:`KernelConfig` holds one :class:`TileConfig` per kernel (forward, dQ, dK/dV) and the dQ mode.
Each distinct config is one compiled kernel per (dtype, head dim, block); the sequence length never
enters the choice (no compile per S). ``triton_configs.json`` beside this module holds the measured
table written by ``bench/kernels/sparse_backends.py --table-out``: entries per GPU (name, compute capability),
head dim and block size, each with density buckets (``max_density`` ascending) and the timings the
choice rests on. :func:`config_for` takes the table's bucket for (device, head dim, block, density)
when one matches, else :func:`default_config` (the sm90 starting point of the sweep).
"""
from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Union

TABLE_PATH = Path(__file__).with_name("triton_configs.json")


class TritonConfigError(ValueError):
    """A malformed tile config or config table (names the field, expected and actual value)."""


@dataclass(frozen=True)
class TileConfig:
    """One kernel's launch shape."""

    block_m: int
    """Query rows per tile (a power of two dividing the selection block, >= 16)."""
    block_n: int
    """Key rows per tile (a power of two dividing the selection block, >= 16)."""
    num_warps: int
    """Warps per program (4 = one Hopper warpgroup)."""
    num_stages: int
    """Software-pipelining depth of the K/V (forward, dQ) or Q/dO (dK/dV) loads."""

    def check(self, block: int, where: str) -> "TileConfig":
        for name in ("block_m", "block_n"):
            t = getattr(self, name)
            if not isinstance(t, int) or t < 16 or t & (t - 1) or block % t:
                raise TritonConfigError(f"{where}.{name} must be a power of two >= 16 dividing the block {block}, got {t!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise TritonConfigError(f"{where}.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 6:
            raise TritonConfigError(f"{where}.num_stages must be an int in 1..6, got {self.num_stages!r}")
        return self

    def short(self) -> str:
        return f"{self.block_m}x{self.block_n}w{self.num_warps}s{self.num_stages}"


@dataclass(frozen=True)
class KernelConfig:
    """Tiles of the three kernels and the dQ mode."""

    fwd: TileConfig
    """Forward: block_m queries per program, block_n keys per loop step."""
    dq: TileConfig
    """dQ kernel (split mode): block_m queries per program, block_n keys per loop step."""
    dkdv: TileConfig
    """dK/dV kernel: block_n keys per program, block_m queries per loop step."""
    atomic_dq: bool = False
    """True: dQ added from the dK/dV kernel by fp32 atomics (5 GEMMs per block pair instead of 7, not
    deterministic, an fp32 [B, S, H, D] scratch); False: the dQ kernel (deterministic, no atomics)."""

    def check(self, block: int) -> "KernelConfig":
        for name in ("fwd", "dq", "dkdv"):
            getattr(self, name).check(block, name)
        return self

    def short(self) -> str:
        mode = "atomic" if self.atomic_dq else "split"
        return f"f{self.fwd.short()}_q{self.dq.short()}_kv{self.dkdv.short()}_{mode}"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict, block: int, where: str = "config") -> "KernelConfig":
        try:
            cfg = cls(fwd=TileConfig(**d["fwd"]), dq=TileConfig(**d["dq"]), dkdv=TileConfig(**d["dkdv"]),
                      atomic_dq=bool(d.get("atomic_dq", False)))
        except (KeyError, TypeError) as exc:
            raise TritonConfigError(f"{where}: needs fwd, dq, dkdv with block_m, block_n, num_warps, num_stages "
                                    f"(and optional atomic_dq): {exc}") from exc
        return cfg.check(block)


def default_config(head_dim: int, block: int) -> KernelConfig:
    """The sm90 starting point: tiles that compile without register spills for head dims 64 and 128 (checked
    offline with triton 3.6's sm90 compiler; the dK/dV kernel keeps two [tile, Dh] fp32 accumulators, so it
    takes 64 keys per program and steps through the queries 32 rows at a time, two programs per SM).
    ``head_dim`` does not change the defaults (the measured table has entries per head dim)."""
    if block >= 128:  # the H200 sweep's winners at densities 0.1-0.4 (bench/results/sparse/sparse_backends_h200_6eceb6a)
        return KernelConfig(fwd=TileConfig(128, 128, 8, 2), dq=TileConfig(128, 128, 8, 2),
                            dkdv=TileConfig(32, 64, 4, 3)).check(block)
    return KernelConfig(fwd=TileConfig(block, block, 4, 3), dq=TileConfig(block, block, 4, 3),
                        dkdv=TileConfig(min(32, block), block, 4, 3)).check(block)


def validate_table(table: dict) -> dict:
    """Check a table's structure; return it. Raises :class:`TritonConfigError`."""
    entries = table.get("entries")
    if not isinstance(entries, list):
        raise TritonConfigError("triton config table: 'entries' must be a list")
    for i, e in enumerate(entries):
        where = f"triton config table entry {i}"
        for key in ("device", "capability", "head_dim", "block", "buckets"):
            if key not in e:
                raise TritonConfigError(f"{where}: missing '{key}'")
        last = 0.0
        for j, b in enumerate(e["buckets"]):
            d = b.get("max_density")
            if not isinstance(d, (int, float)) or not last < d <= 1.0:
                raise TritonConfigError(f"{where} bucket {j}: max_density must ascend in (0, 1] (previous {last}), got {d!r}")
            last = float(d)
            KernelConfig.from_json(b.get("config", {}), e["block"], f"{where} bucket {j} config")
            if not isinstance(b.get("measured"), list) or not b["measured"]:
                raise TritonConfigError(f"{where} bucket {j}: 'measured' must list the timings the choice rests on")
        if not e["buckets"] or last < 1.0:
            raise TritonConfigError(f"{where}: the last bucket must reach max_density 1.0, got {last}")
        curve = e.get("curve")
        if curve is not None:
            dens, ratio = curve.get("density"), curve.get("ratio")
            if not (isinstance(dens, list) and isinstance(ratio, list) and dens and len(dens) == len(ratio)
                    and all(b > a for a, b in zip(dens, dens[1:])) and all(r > 0 for r in ratio)):
                raise TritonConfigError(f"{where}: 'curve' needs ascending 'density' and positive 'ratio' lists "
                                        f"of one length (fwd+bwd time / dense time), got {curve!r}")
    return table


def load_table(path: Union[str, Path]) -> dict:
    """The table at ``path``, validated (raises :class:`TritonConfigError` naming the file)."""
    try:
        return validate_table(json.loads(Path(path).read_text()))
    except (OSError, json.JSONDecodeError) as exc:
        raise TritonConfigError(f"triton config table {path}: {exc}") from exc


@functools.lru_cache(maxsize=None)
def shipped_table() -> dict:
    """``triton_configs.json`` beside this module (no entries when none is shipped)."""
    return load_table(TABLE_PATH) if TABLE_PATH.exists() else {"entries": []}


def entry_for(head_dim: int, block: int, device: Any = None, *, table: Optional[dict] = None) -> Optional[dict]:
    """The table entry (``table``, default :func:`shipped_table`) for this GPU (same name, else the same
    compute capability), head dim and block; None off CUDA or when none matches."""
    import torch

    if device is None or torch.device(device).type != "cuda":
        return None
    name, cap = torch.cuda.get_device_name(device), list(torch.cuda.get_device_capability(device))
    fits = [e for e in (table or shipped_table())["entries"]
            if e["head_dim"] == head_dim and e["block"] == block and list(e["capability"]) == cap]
    fits.sort(key=lambda e: e["device"] != name)
    return fits[0] if fits else None


def config_for(head_dim: int, block: int, density: Optional[float], device: Any = None, *,
               table: Optional[dict] = None) -> KernelConfig:
    """The config of the first bucket with ``density <= max_density`` (density None: the first bucket)
    of :func:`entry_for`; :func:`default_config` when no entry matches (also on CPU, the interpreter)."""
    entry = entry_for(head_dim, block, device, table=table)
    if entry is not None:
        for b in entry["buckets"]:
            if density is None or density <= b["max_density"] + 1e-9:
                return KernelConfig.from_json(b["config"], block)
    return default_config(head_dim, block)


def table_from_sweep(chosen: dict, meta: dict, head_dim: int, block: int, capability: list, triton_version: str,
                     command: str) -> dict:
    """A one-entry table from a tile sweep's per-density winners ``{density: (KernelConfig, measured record)}``
    (``bench/kernels/sparse_backends.py``): adjacent densities with the same config share a bucket, bucket edges at
    the midpoints between measured densities, the last at 1.0. ``meta``: the run's device, dtype, torch, commit and
    date; ``command``: what produced it."""
    dens = sorted(chosen)
    tops = [round((a + b) / 2, 4) for a, b in zip(dens, dens[1:])] + [1.0]
    buckets = []
    for dv, top in zip(dens, tops):
        cfg, rec = chosen[dv]
        if buckets and buckets[-1]["config"] == cfg.to_json():
            buckets[-1]["max_density"] = top
            buckets[-1]["measured"].append(rec)
        else:
            buckets.append({"max_density": top, "config": cfg.to_json(), "measured": [rec]})
    entry = {"device": meta["device"], "capability": list(capability), "head_dim": head_dim,
             "block": block, "dtype": meta["dtype"], "torch": meta["torch"], "triton": triton_version,
             "commit": meta["commit"], "date": meta["date"], "command": command, "buckets": buckets}
    return {"entries": [entry]}


def merge_tables(old: Optional[dict], new: dict) -> dict:
    """``new``'s entries plus those of ``old`` (a table file already written) for other (GPU, head dim, block):
    one file can ship several blocks, head dims and GPUs."""
    key = lambda e: (e["device"], tuple(e["capability"]), e["head_dim"], e["block"])  # noqa: E731
    mine = {key(e) for e in new["entries"]}
    kept = [e for e in (old or {}).get("entries", []) if key(e) not in mine]
    return {**(old or {}), **new, "entries": new["entries"] + kept}


def worst_curves(rows: list) -> dict:
    """Per backend and density, over a benchmark's shapes (``rows``: per shape ``dense_ms`` and per backend
    ``rows`` of density, ms, ``eff_vs_dense``, ``speedup_vs_dense``): the worst of ``g`` (sparse ms / dense ms, the
    curve a table entry ships), efficiency and speed-up."""
    out: dict = {}
    for r in rows:
        for name, rec in r["backends"].items():
            for x in rec.get("rows", []):
                c = out.setdefault(name, {}).setdefault(x["density"], {"g": 0.0, "eff": float("inf"),
                                                                       "speedup": float("inf")})
                c["g"] = max(c["g"], x["ms"] / r["dense_ms"])
                c["eff"] = min(c["eff"], x["eff_vs_dense"])
                c["speedup"] = min(c["speedup"], x["speedup_vs_dense"])
    return out
