"""The sparse-attention backend interface: one block-sparse kernel behind one small, stable contract.

A backend is one file in ``ds_adaptive/attention/backends/`` with a :class:`SparseAttentionBackend`
subclass registered by name (:func:`ds_adaptive.attention.backends.registry.register_backend`); the
config value ``adaptive_load.sparse_attention.backend`` (``auto`` or a name) picks it, so swapping a
kernel is a config edit. The runtime, the warm-up, the cost model and ``config --check`` use only
what is below.

Contract (every backend keeps it; tests/unit/attention/test_sparse_backends.py checks the shipped ones, and a new
backend adds itself to those tests and to tests/gpu/test_sparse_gpu.py):

* ``name`` (class attribute): the registry key and config value, lower case.
* ``support`` (class attribute, :class:`BackendSupport`): what it can run, as data. The default
  :meth:`unsupported` reads it; a backend overrides :meth:`unsupported` for checks that need the
  machine (a package that must import, a GPU architecture).
* :meth:`attention` ``(q, k, v, selection, *, valid_len=None, density=None) -> out``:
  ``q, k, v`` ``[B, S, H, Dh]`` (the model's attention-fn layout; one dtype and device), ``selection`` a
  :class:`~ds_adaptive.attention.selection.BlockSelection` over the S tokens (``selection.block_size``,
  ``kv_num [B, H, nq]`` / ascending ``kv_idx [B, H, nq, kmax]``). Query block i attends exactly to
  the tokens of its selected key blocks (softmax over those keys only, scale ``Dh ** -0.5``).
  ``valid_len``: tokens ``>= valid_len`` are padding (Ulysses pads S): real tokens attend among
  themselves, padded query rows give 0. ``density``: the selection's mean share of key blocks, known
  on the host (a hint, e.g. for tile options; never read from the device). Returns ``[B, S, H, Dh]``
  in q's dtype, differentiable in q, k, v where ``support`` says backward. It must not synchronise
  the host, and after :meth:`warmup` it must not compile per shape: B and S change every call.
* :meth:`warmup` ``(shapes, *, num_heads, head_dim, dtype, device, block_size, backward) -> seconds``:
  prepare (compile) for the ``(B, S)`` pairs the plan will run, before step 1; idempotent (a second
  call with known shapes costs ~0); returns the seconds it spent.
* :meth:`efficiency` ``(device, *, dtype, head_dim, block_size) -> KernelEfficiency``: the backend's
  curve ``g(rho)`` = its fwd+bwd time / dense SDPA fwd+bwd time at density ``rho`` (effective
  efficiency vs dense = ``rho / g(rho)``), which the planner's sparse cost and the runtime's
  "sparse only where it pays" decision use. Source order: a measurement of this GPU + torch
  version in the cache (:mod:`ds_adaptive.attention.backends.measure`; the base class looks it up), then
  the backend's :meth:`shipped_efficiency` (its shipped table for this GPU, or its documented default):
  a backend overrides only the latter.
* :meth:`stats` ``() -> dict``: JSON-able figures for the run summary (at least ``warmup_s``;
  compiling backends also ``graphs``: compiled graphs so far).

Keep the interface small: add an optional keyword with a default rather than change a signature.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Sequence

import torch
from ds_adaptive.attention.backends import measure as measured  # a module: tests replace measure.cached_curve
from ds_adaptive.core.contracts import KernelEfficiency

__all__ = ["BackendSupport", "SparseAttentionBackend", "SparseBackendError", "WarmupShape"]

WarmupShape = tuple[int, int]
"""``(B, S)``: samples and tokens (per sample, after the Ulysses all-to-all: the full sequence) of one
micro-batch the plan will run."""


class SparseBackendError(RuntimeError):
    """A sparse-attention backend cannot run as configured (device, dtype, shape, compile guard)."""


@dataclass(frozen=True)
class BackendSupport:
    """What a backend can run (data, read by :meth:`SparseAttentionBackend.unsupported`)."""

    device_types: tuple[str, ...]
    """torch device types it runs on at all (``"cuda"``, ``"cpu"``)."""
    backward_device_types: tuple[str, ...]
    """Device types where it also has a backward (training needs one)."""
    dtypes: tuple[torch.dtype, ...]
    """Input dtypes."""
    block_sizes: tuple[int, ...]
    """Query / key block sizes (tokens) it accepts."""
    head_dims: Optional[tuple[int, ...]] = None
    """Head dims it accepts (None: any)."""
    min_capability: Optional[tuple[int, int]] = None
    """Lowest CUDA compute capability (None: any)."""
    runtime_shapes: bool = True
    """True: no compile per (B, S) after warm-up (the sequence length is a run-time argument)."""
    materialises_scores: bool = False
    """True: builds the S x S scores (a reference, no speed-up): never chosen by ``auto`` unless
    nothing else runs on the device, and then with a loud start-up line."""
    max_tokens: Optional[int] = None
    """Longest sequence it accepts (None: no limit)."""
    notes: str = ""
    """One line for users (shown by ``config --check`` and the start-up line)."""


class SparseAttentionBackend(abc.ABC):
    """One block-sparse attention kernel; see the module docstring for the contract."""

    name: ClassVar[str]
    support: ClassVar[BackendSupport]

    def unsupported(self, device: Any, *, dtype: Optional[torch.dtype] = None, head_dim: Optional[int] = None,
                    block_size: Optional[int] = None, backward: bool = True) -> Optional[str]:
        """None when this backend can run there, else one line saying why not (what it needs).

        ``device``: a torch device or device type string (``"meta"`` counts as ``"cuda"``: a dry run
        checks a GPU launch, and then capability is not checked). Arguments left None are not checked.
        """
        dev = torch.device(device) if not isinstance(device, torch.device) else device
        kind = "cuda" if dev.type == "meta" else dev.type
        s = self.support
        if kind not in s.device_types:
            return f"backend '{self.name}' runs on {'/'.join(s.device_types)}, not {kind}"
        if backward and kind not in s.backward_device_types:
            return (f"backend '{self.name}' has no backward on {kind} (training needs one; backward on "
                    f"{'/'.join(s.backward_device_types) or 'no device'})")
        if dtype is not None and dtype not in s.dtypes:
            return f"backend '{self.name}' takes {[str(d).replace('torch.', '') for d in s.dtypes]}, not {dtype}"
        if block_size is not None and block_size not in s.block_sizes:
            return f"backend '{self.name}' takes block_size {list(s.block_sizes)}, not {block_size}"
        if head_dim is not None and s.head_dims is not None and head_dim not in s.head_dims:
            return f"backend '{self.name}' takes head dims {list(s.head_dims)}, not {head_dim}"
        if s.min_capability is not None and dev.type == "cuda" and torch.cuda.is_available():
            cap = torch.cuda.get_device_capability(dev)
            if tuple(cap) < tuple(s.min_capability):
                return (f"backend '{self.name}' needs compute capability >= {s.min_capability[0]}.{s.min_capability[1]}, "
                        f"{torch.cuda.get_device_name(dev)} has {cap[0]}.{cap[1]}")
        return None

    @abc.abstractmethod
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection, *,
                  valid_len: Optional[int] = None, density: Optional[float] = None) -> torch.Tensor:
        """Block-sparse attention ``[B, S, H, Dh] -> [B, S, H, Dh]`` (see the module docstring)."""

    def warmup(self, shapes: Sequence[WarmupShape], *, num_heads: int, head_dim: int, dtype: torch.dtype,
               device: Any, block_size: int, backward: bool = True) -> float:
        """Prepare for ``shapes`` before step 1; returns seconds spent (default: nothing to do)."""
        return 0.0

    def efficiency(self, device: Any, *, dtype: torch.dtype = torch.bfloat16, head_dim: int = 128,
                   block_size: int = 128):
        """:class:`ds_adaptive.core.contracts.KernelEfficiency` ``g(rho)`` of this backend on ``device``: a
        measurement of this GPU + torch version in the cache (``measure``) wins, else :meth:`shipped_efficiency`."""
        curve = measured.cached_curve(self, device, dtype=dtype, head_dim=head_dim, block_size=block_size)
        if curve is not None:
            return curve
        return self.shipped_efficiency(device, dtype=dtype, head_dim=head_dim, block_size=block_size)

    def shipped_efficiency(self, device: Any, *, dtype: torch.dtype, head_dim: int, block_size: int):
        """The curve this backend ships for ``device`` (a measured table, or an assumption it states in the
        curve's ``source``); default: the DSV anchors (``KernelEfficiency.default()``)."""
        return KernelEfficiency.default()

    def stats(self) -> dict:
        """Figures for the run summary (``warmup_s`` at least)."""
        return {"warmup_s": 0.0}

    def describe(self) -> dict:
        """Name and support, JSON-able (for summaries and ``config --check``)."""
        s = self.support
        return {"name": self.name, "devices": list(s.device_types), "backward": list(s.backward_device_types),
                "dtypes": [str(d).replace("torch.", "") for d in s.dtypes], "block_sizes": list(s.block_sizes),
                "head_dims": None if s.head_dims is None else list(s.head_dims),
                "runtime_shapes": s.runtime_shapes, "materialises_scores": s.materialises_scores, "notes": s.notes}

