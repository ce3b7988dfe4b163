"""The backend registry and the choice of ``adaptive_load.sparse_attention.backend: auto | <name>``.

    @register_backend
    class MyBackend(SparseAttentionBackend):
        name = "mine"
        ...

    get_backend("flex")                     # the process's one instance (compile caches live there)
    choice = select_backend("auto", device, dtype=torch.bfloat16, head_dim=128, block_size=128)
    choice.backend, choice.line             # the backend, and the one start-up line that says why

``auto`` takes, among the registered backends that run on the device (:meth:`unsupported` is None)
and do not materialise the S x S scores, the fastest by measured speed on this GPU (the cached
measurement of :mod:`ds_adaptive.attention.backends.measure`, keyed by GPU name + torch version; with
``measure=True`` a missing one is measured and cached). A single candidate is taken without
measuring. When none runs there, ``auto`` falls back to a reference backend and says so in its
line (``fallback`` is True); it never picks an S^2 path silently. A named backend that cannot run
there is an error naming the config key and the reason.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Any

import torch

from ds_adaptive.attention.backends.base import SparseAttentionBackend, SparseBackendError
from ds_adaptive.attention.backends import measure as m

__all__ = ["BackendChoice", "BUILTIN_MODULES", "backend_names", "get_backend", "register_backend", "select_backend"]

BUILTIN_MODULES = ("flex", "triton", "reference")
"""Modules of ``ds_adaptive.attention.backends`` imported on first lookup (each registers its backend;
a missing file is skipped). Their order is the tie-break order of ``auto``."""

CONFIG_KEY = "adaptive_load.sparse_attention.backend"
REFERENCE_DENSITY = 0.1
"""``auto`` compares backends by ``g(REFERENCE_DENSITY)`` (the mean of their curves over 0.05-0.4 breaks ties)."""

_classes: dict[str, type] = {}
_instances: dict[str, SparseAttentionBackend] = {}
_loaded = False


def register_backend(cls: type) -> type:
    """Class decorator: register a :class:`SparseAttentionBackend` subclass under ``cls.name``.
    Registering another class under a taken name is an error (the same class again is a no-op)."""
    if not (isinstance(cls, type) and issubclass(cls, SparseAttentionBackend)):
        raise TypeError(f"register_backend needs a SparseAttentionBackend subclass, got {cls!r}")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name or name != name.lower() or name == "auto":
        raise ValueError(f"{cls.__name__}.name must be a non-empty lower-case string other than 'auto', got {name!r}")
    old = _classes.get(name)
    if old is not None and old.__qualname__ != cls.__qualname__:
        raise ValueError(f"sparse-attention backend '{name}' is already registered by {old.__module__}.{old.__qualname__}")
    _classes[name] = cls
    return cls


def _load_builtins() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in BUILTIN_MODULES:
        full = f"ds_adaptive.attention.backends.{mod}"
        if importlib.util.find_spec(full) is not None:
            importlib.import_module(full)


def backend_names() -> list[str]:
    """Registered names: the built-ins in :data:`BUILTIN_MODULES` order, then any others."""
    _load_builtins()
    order = {m: i for i, m in enumerate(BUILTIN_MODULES)}
    return sorted(_classes, key=lambda n: (order.get(n, len(order)), n))


def get_backend(name: str) -> SparseAttentionBackend:
    """The process's instance of backend ``name`` (made on first use)."""
    _load_builtins()
    if name not in _classes:
        raise SparseBackendError(f"{CONFIG_KEY} is '{name}': no such backend; registered: "
                                 f"{', '.join(backend_names())} (or 'auto')")
    inst = _instances.get(name)
    if inst is None:
        inst = _instances[name] = _classes[name]()
    return inst


@dataclass
class BackendChoice:
    """The outcome of :func:`select_backend`."""

    backend: SparseAttentionBackend
    requested: str
    line: str
    """The one start-up line (why this backend; a fallback says so)."""
    fallback: bool = False
    """True: ``auto`` found no block-sparse kernel for the device and took an S^2 reference."""
    candidates: dict = field(default_factory=dict)
    """name -> ``{"ok": bool, "why": str | None, "g_ref": float | None, "measured": bool}``."""
    curve: Any = None
    """The chosen backend's :class:`~ds_adaptive.core.contracts.KernelEfficiency` on this device
    (what the cost model uses; the same on every rank when the choice was broadcast)."""


def _device_name(device: torch.device) -> str:
    if device.type == "meta":
        return "a GPU (dry run)"
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device.type


def select_backend(requested: str, device: Any, *, dtype: torch.dtype = torch.bfloat16, head_dim: int = 128,
                   block_size: int = 128, backward: bool = True, measure: bool = False,
                   num_heads: int = 12) -> BackendChoice:
    """Resolve ``requested`` (``auto`` or a name) for ``device``; see the module docstring.
    ``measure``: ``auto`` with several candidates times those without a cached measurement (a short
    fwd+bwd benchmark per backend, cached per GPU + torch version) instead of trusting shipped curves."""
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    kw = dict(dtype=dtype, head_dim=head_dim, block_size=block_size, backward=backward)
    where = _device_name(dev)
    if requested != "auto":
        b = get_backend(requested)
        why = b.unsupported(dev, **kw)
        if why is not None:
            fits = [n for n in backend_names() if get_backend(n).unsupported(dev, **kw) is None]
            raise SparseBackendError(f"{CONFIG_KEY} is '{requested}' but {why}; use 'auto' or a backend that runs "
                                     f"on {where} ({', '.join(fits) or 'none'})")
        line = f"sparse attention: backend '{b.name}' (configured) on {where}"
        if b.support.materialises_scores:
            line += ": masked dense reference, S^2 memory, no speed-up"
        return BackendChoice(b, requested, line, curve=b.efficiency(dev, dtype=dtype, head_dim=head_dim,
                                                                      block_size=block_size))
    cands: dict[str, dict] = {}
    fused, refs = [], []
    for name in backend_names():
        b = get_backend(name)
        why = b.unsupported(dev, **kw)
        cands[name] = {"ok": why is None, "why": why, "g_ref": None, "measured": False}
        if why is None:
            (refs if b.support.materialises_scores else fused).append(b)
    if not fused:
        reasons = "; ".join(c["why"] for n, c in cands.items() if c["why"] and not get_backend(n).support.materialises_scores)
        if not refs:
            raise SparseBackendError(f"{CONFIG_KEY} is 'auto' but no sparse-attention backend runs on {where}: {reasons}")
        ref = refs[0]
        limit = f", at most {ref.support.max_tokens:,} tokens" if ref.support.max_tokens else ""
        line = (f"sparse attention: WARNING: no block-sparse kernel runs on {where} ({reasons}); backend auto falls "
                f"back to '{ref.name}' (masked dense torch: S^2 memory, no speed-up{limit})")
        return BackendChoice(ref, requested, line, fallback=True, candidates=cands,
                             curve=ref.efficiency(dev, dtype=dtype, head_dim=head_dim, block_size=block_size))
    if len(fused) == 1:
        b = fused[0]
        return BackendChoice(b, requested, f"sparse attention: backend '{b.name}' (auto: the only block-sparse kernel "
                                           f"that runs on {where})", candidates=cands,
                             curve=b.efficiency(dev, dtype=dtype, head_dim=head_dim, block_size=block_size))

    scored = []
    for b in fused:
        curve = m.cached_curve(b, dev, dtype=dtype, head_dim=head_dim, block_size=block_size)
        measured = curve is not None
        if curve is None and measure and dev.type == "cuda":
            curve = m.measure_backend(b, dev, dtype=dtype, head_dim=head_dim, block_size=block_size,
                                      num_heads=num_heads).curve
            measured = True
        if curve is None:
            curve = b.efficiency(dev, dtype=dtype, head_dim=head_dim, block_size=block_size)
        g = curve(REFERENCE_DENSITY)
        tie = sum(curve(d) for d in (0.05, 0.1, 0.2, 0.4))
        cands[b.name].update(g_ref=g, measured=measured)
        scored.append((g, tie, b, curve))
    scored.sort(key=lambda t: (t[0], t[1]))
    best, best_curve = scored[0][2], scored[0][3]
    table = ", ".join(f"{b.name} {g:.3f}{'' if cands[b.name]['measured'] else ' (not measured here)'}"
                      for g, _, b, _ in scored)
    return BackendChoice(best, requested, f"sparse attention: backend '{best.name}' (auto on {where}: sparse/dense time "
                                          f"at density {REFERENCE_DENSITY}: {table})", candidates=cands,
                         curve=best_curve)
