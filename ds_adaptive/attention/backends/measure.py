"""Measured efficiency curves of sparse-attention backends on this GPU, cached per GPU + torch version.

:func:`measure_backend` times a backend's fwd+bwd (random block selections at a few densities, one
ragged sequence of ``seq_len`` tokens) against dense SDPA fwd+bwd (cuDNN / flash) at the same shape
and returns the curve ``g(rho) = sparse / dense`` (:class:`ds_adaptive.core.contracts.KernelEfficiency`).
:func:`store` / :func:`cached_curve` keep it in a JSON file, ``$DS_ADAPTIVE_CACHE_DIR/sparse_backends.json``
(default ``~/.cache/ds_adaptive/``), one entry per (GPU name, torch version, backend, dtype, head dim,
block size): ``auto`` reuses it across runs, and a new driver, GPU or torch version measures anew.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from ds_adaptive.core.contracts import KernelEfficiency
from ds_adaptive.core.timing import time_ms
from ds_adaptive.attention.selection import select_blocks

__all__ = ["Measurement", "cache_key", "cache_path", "cached_curve", "cuda_time_ms", "measure_backend",
           "random_selection", "store", "MEASURE_DENSITIES", "MEASURE_SEQ_LEN"]

MEASURE_DENSITIES = (0.05, 0.1, 0.2, 0.4)
MEASURE_SEQ_LEN = 32760
"""Tokens of the measurement: a 21x60x104-token Wan clip (81 x 480 x 832 video), ragged in 128-token blocks."""
CACHE_FILE = "sparse_backends.json"


def cache_path() -> Path:
    root = os.environ.get("DS_ADAPTIVE_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "ds_adaptive"


def _gpu(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device.type


def cache_key(name: str, device: Any, *, dtype: torch.dtype, head_dim: int, block_size: int) -> str:
    dev = torch.device(device)
    return f"{_gpu(dev)}|torch {torch.__version__}|{name}|{str(dtype).replace('torch.', '')}|d{head_dim}|b{block_size}"


def _read() -> dict:
    p = cache_path() / CACHE_FILE
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def cached_curve(backend, device: Any, *, dtype: torch.dtype, head_dim: int, block_size: int):
    """The cached curve of ``backend`` for this GPU + torch version, or None."""
    rec = _read().get(cache_key(backend.name, device, dtype=dtype, head_dim=head_dim, block_size=block_size))
    if rec is None:
        return None
    try:
        return KernelEfficiency(tuple(rec["density"]), tuple(rec["ratio"]), source=rec.get("source", "cache"))
    except (KeyError, TypeError, ValueError):
        return None


def store(key: str, record: dict) -> Path:
    """Write one cache entry (atomic replace of the file; concurrent writers keep one of the two)."""
    d = cache_path()
    d.mkdir(parents=True, exist_ok=True)
    data = _read()
    data[key] = record
    tmp = d / f".{CACHE_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(d / CACHE_FILE)
    return d / CACHE_FILE


@dataclass
class Measurement:
    """One measurement: the curve and the timings it rests on."""

    curve: Any
    rows: list = field(default_factory=list)
    seconds: float = 0.0


def cuda_time_ms(fn, iters: int) -> float:
    """Median ms of ``fn()`` (CUDA events) over ``iters`` calls after 2 untimed ones: the package's
    timer (``balance.calibrate_sparse.time_ms``), so measurements and calibration agree."""
    return time_ms(fn, warmup=2, iters=iters)


def random_selection(batch: int, heads: int, seq_len: int, block_size: int, density: float, *, device: Any,
                     seed: int = 0):
    """A :class:`BlockSelection` of ``ceil(density * nk)`` random key blocks per query block (own block kept)."""
    nk = math.ceil(seq_len / block_size)
    g = torch.Generator(device="cpu").manual_seed(seed)
    scores = torch.rand(batch, heads, nk, nk, generator=g).to(device)
    k = max(1, min(nk, math.ceil(density * nk - 1e-9)))
    return select_blocks(scores, torch.full((heads,), k), seq_len=seq_len, block_size=block_size, inplace=True)


def measure_backend(backend, device: Any, *, dtype: torch.dtype = torch.bfloat16, head_dim: int = 128,
                    block_size: int = 128, num_heads: int = 12, seq_len: int = MEASURE_SEQ_LEN,
                    densities: Sequence[float] = MEASURE_DENSITIES, iters: int = 5, cache: bool = True) -> Measurement:
    """Time ``backend`` fwd+bwd vs dense SDPA fwd+bwd on ``device`` (CUDA); cache the curve (``cache``)."""
    import torch.nn.functional as F


    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"measure_backend times CUDA kernels; got device {dev}")
    t0 = time.perf_counter()
    backend.warmup([(1, seq_len)], num_heads=num_heads, head_dim=head_dim, dtype=dtype, device=dev,
                   block_size=block_size, backward=True)
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(1, seq_len, num_heads, head_dim, generator=g).to(dev, dtype).requires_grad_()
               for _ in range(3))
    dout = torch.randn(1, seq_len, num_heads, head_dim, generator=g).to(dev, dtype)

    def dense():
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        torch.autograd.backward(out, dout.transpose(1, 2))

    dense_ms = cuda_time_ms(dense, iters)
    rows, ratios = [], []
    for rho in densities:
        sel = random_selection(1, num_heads, seq_len, block_size, rho, device=dev)

        def sparse(sel=sel, rho=rho):
            out = backend.attention(q, k, v, sel, density=rho)
            torch.autograd.backward(out, dout)

        ms = cuda_time_ms(sparse, iters)
        rows.append({"density": rho, "ms": ms, "dense_ms": dense_ms, "efficiency": rho * dense_ms / ms})
        ratios.append(ms / dense_ms)
    key = cache_key(backend.name, dev, dtype=dtype, head_dim=head_dim, block_size=block_size)
    src = f"measured on {_gpu(dev)}, torch {torch.__version__}, S={seq_len}, H={num_heads}, Dh={head_dim}"
    # a curve must rise with density (KernelEfficiency interpolates it); timing noise at the
    # low end must not make a denser selection look cheaper
    mono = [max(ratios[: i + 1]) for i in range(len(ratios))]
    curve = KernelEfficiency(tuple(float(d) for d in densities), tuple(mono), source=src)
    seconds = time.perf_counter() - t0
    if cache:
        store(key, {"density": list(curve.density), "ratio": list(curve.ratio), "source": src, "rows": rows,
                    "seconds": seconds, "date": time.strftime("%Y-%m-%dT%H:%M:%S")})
    return Measurement(curve, rows, seconds)
