"""Measured FlexAttention ``kernel_options`` per density bucket (the block-sparse op's defaults).

``kernel_options.json`` beside this module holds one table (``options: {}`` = torch's defaults won), measured by
``bench/kernels/sparse_kernel.py --sweep`` on one device: the GPU (name, compute capability), head dim and
dtype it was measured for, and per density bucket (``max_density``, ascending) the tile options
that were fastest for sparse fwd+bwd, with the measured times (ours and torch's default config) as
a record. :func:`options_for` returns a bucket's options only for a matching device / head dim /
dtype, else None (torch's own defaults). Each distinct options dict is its own compiled kernel
(``max_compiled_shapes`` counts them).

Keys are torch 2.11's flex ``kernel_options``: ``fwd_*`` apply to the forward kernel only,
``bwd_*`` to the backward (``BLOCK_M1/N1`` the dK/dV loop, ``BLOCK_M2/N2`` the dQ loop).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

import torch

TABLE_PATH = Path(__file__).with_name("kernel_options.json")

OPTION_KEYS = {
    "fwd_BLOCK_M", "fwd_BLOCK_N", "fwd_num_warps", "fwd_num_stages",
    "bwd_BLOCK_M1", "bwd_BLOCK_N1", "bwd_BLOCK_M2", "bwd_BLOCK_N2", "bwd_num_warps", "bwd_num_stages",
}
"""The options a table may set (tile sizes must divide the sparse block size)."""


class KernelTableError(ValueError):
    """A malformed kernel-options table (names the field, the expected and the actual value)."""


def validate_table(table: dict, block_size: int = 128) -> dict:
    """Check a table's structure; return it. Raises :class:`KernelTableError`."""
    for key in ("device", "capability", "head_dim", "dtype", "buckets"):
        if key not in table:
            raise KernelTableError(f"kernel table: missing '{key}'")
    if getattr(torch, str(table["dtype"]), None) is None:
        raise KernelTableError(f"kernel table: dtype '{table['dtype']}' is not a torch dtype")
    last = 0.0
    for i, b in enumerate(table["buckets"]):
        where = f"kernel table bucket {i}"
        d = b.get("max_density")
        if not isinstance(d, (int, float)) or not last < d <= 1.0:
            raise KernelTableError(f"{where}: max_density must ascend in (0, 1] (previous {last}), got {d!r}")
        last = float(d)
        opts = b.get("options")
        if not isinstance(opts, dict):  # {}: torch's default config measured best in this bucket
            raise KernelTableError(f"{where}: 'options' must be a dict ({{}} = torch's defaults), got {opts!r}")
        bad = set(opts) - OPTION_KEYS
        if bad:
            raise KernelTableError(f"{where}: unknown option(s) {sorted(bad)}; allowed {sorted(OPTION_KEYS)}")
        for k, v in opts.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise KernelTableError(f"{where}: option {k} must be an int >= 1, got {v!r}")
            if "BLOCK" in k and (block_size % v or v & (v - 1)):
                raise KernelTableError(f"{where}: option {k} = {v} must be a power of two dividing the block {block_size}")
        measured = b.get("measured")
        if not isinstance(measured, list) or not measured:
            raise KernelTableError(f"{where}: 'measured' must list the timings the choice rests on")
        for m in measured:
            if not all(isinstance(m.get(f), (int, float)) and m[f] > 0 for f in ("seq", "density", "ms", "default_ms")):
                raise KernelTableError(f"{where}: each measured entry needs positive seq, density, ms, default_ms: {m!r}")
            if m["density"] > d:
                raise KernelTableError(f"{where}: a timing at density {m['density']} is outside the bucket (<= {d})")
    return table


_table: Optional[dict] = None


def load_table(path: Union[str, Path, None] = None) -> dict:
    """The table at ``path`` (default: the shipped ``kernel_options.json``), validated."""
    p = Path(path) if path is not None else TABLE_PATH
    try:
        return validate_table(json.loads(p.read_text()))
    except (OSError, json.JSONDecodeError) as exc:
        raise KernelTableError(f"kernel table {p}: {exc}") from exc


def use_table(table: Union[dict, str, Path, None]) -> Optional[dict]:
    """Replace the table in use (a dict, a path, or None: back to the shipped one); returns the old one."""
    global _table
    old = _table
    _table = validate_table(table) if isinstance(table, dict) else (load_table(table) if table else None)
    return old


def current_table() -> dict:
    global _table
    if _table is None:
        _table = load_table()
    return _table


def options_for(density: float, *, head_dim: int, dtype: torch.dtype, device: Any) -> Optional[dict]:
    """The options of the first bucket with ``density <= max_density`` where the table matches this
    device (CUDA name and capability), head dim and dtype; None otherwise."""
    t = current_table()
    dev = torch.device(device)
    if dev.type != "cuda" or head_dim != t["head_dim"] or dtype != getattr(torch, t["dtype"]):
        return None
    if list(torch.cuda.get_device_capability(dev)) != list(t["capability"]) or torch.cuda.get_device_name(dev) != t["device"]:
        return None
    for b in t["buckets"]:
        if density <= b["max_density"] + 1e-9:
            return dict(b["options"]) or None
    return None
