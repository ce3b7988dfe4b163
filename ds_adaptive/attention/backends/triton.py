"""The ``triton`` backend: our Triton block-sparse kernels (:mod:`ds_adaptive.attention.kernels`).

Forward + backward (dQ and dK/dV kernels, no atomics) straight from the compact selection; the
sequence length and the batch are run-time arguments, so nothing compiles per shape: the kernels
compile once per (dtype, head dim, block, head count, tile config) at :meth:`TritonBackend.warmup`
(and Triton's disk cache keeps them across runs). Tile configs and the efficiency curve come from the
measured table ``ds_adaptive/attention/kernels/triton_configs.json`` (``bench/kernels/sparse_kernel.py
--table-out``) for this GPU, else sm90 defaults and the generic DSV curve.
"""
from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import torch

from ds_adaptive.attention.backends.base import BackendSupport, SparseAttentionBackend
from ds_adaptive.attention.backends.registry import register_backend
from ds_adaptive.attention.kernels import triton_status
from ds_adaptive.attention.kernels import triton_block_sparse_attention
from ds_adaptive.attention.backends.measure import random_selection
from ds_adaptive.attention.kernels import config_for
from ds_adaptive.attention.kernels.triton_block_sparse import block_sparse_backward, block_sparse_forward
from ds_adaptive.attention.kernels.triton_configs import entry_for
from ds_adaptive.core.contracts import KernelEfficiency
from ds_adaptive.attention.kernels import compiled_kernels

__all__ = ["TritonBackend", "UNMEASURED_SLOPE"]

UNMEASURED_SLOPE = 2.5
"""g(rho) = 2.5 rho where this GPU has no measurement: worse than flex's shipped curves at auto's reference density
0.1 (``flex.SHIPPED_CURVES``), so ``auto`` keeps flex until a
measurement or a shipped tile table of this GPU says otherwise."""
UNMEASURED_DENSITY = (0.05, 0.1, 0.2, 0.4)


@register_backend
class TritonBackend(SparseAttentionBackend):
    """Our Triton kernels, CUDA fwd+bwd (sm80+; tuned for sm90), blocks of 64 or 128 tokens."""

    name = "triton"
    support = BackendSupport(
        device_types=("cuda",), backward_device_types=("cuda",), dtypes=(torch.bfloat16, torch.float16),
        block_sizes=(64, 128), head_dims=(64, 128), min_capability=(8, 0), runtime_shapes=True,
        notes="Triton kernels (fwd, dQ, dK/dV without atomics) on the compact selection; S and B at run time")

    def __init__(self) -> None:
        self._warm: set = set()
        self._warmup_s = 0.0

    def unsupported(self, device: Any, **kw) -> Optional[str]:
        why = super().unsupported(device, **kw)
        if why is None:

            ok, msg = triton_status()
            if not ok:
                return f"backend '{self.name}' needs triton: {msg}"
        return why

    def attention(self, q, k, v, selection, *, valid_len=None, density=None):
        return triton_block_sparse_attention(q, k, v, selection, valid_len=valid_len, density=density)

    def warmup(self, shapes: Sequence[tuple[int, int]], *, num_heads: int, head_dim: int, dtype: torch.dtype,
               device: Any, block_size: int, backward: bool = True) -> float:
        """Compile the kernels of every tile config the table can pick here (one short fwd(+bwd) launch each,
        B = 1, three blocks: ``shapes`` do not matter, S and B are run-time arguments)."""
        dev = torch.device(device)
        entry = entry_for(head_dim, block_size, dev)
        densities = [None] if entry is None else [b["max_density"] for b in entry["buckets"]]
        t0 = time.perf_counter()
        for rho in densities:
            cfg = config_for(head_dim, block_size, rho, dev)
            key = (cfg, num_heads, head_dim, dtype, dev, block_size, backward)
            if key in self._warm:
                continue
            s = 3 * block_size - 1  # three blocks, the last one ragged: the raw launches, no autograd
            q, k, v, dout = (torch.randn(1, s, num_heads, head_dim, device=dev, dtype=dtype) for _ in range(4))
            sel = random_selection(1, num_heads, s, block_size, 0.5, device=dev)
            out, lse = block_sparse_forward(q, k, v, sel.kv_num, sel.kv_idx, block=block_size, seq=s, config=cfg)
            if backward:
                block_sparse_backward(q, k, v, out, lse, dout, sel.kv_num, sel.kv_idx, block=block_size, seq=s,
                                      config=cfg)
            torch.cuda.synchronize(dev)
            self._warm.add(key)
        spent = time.perf_counter() - t0
        self._warmup_s += spent
        return spent

    def shipped_efficiency(self, device, *, dtype, head_dim, block_size):
        entry = entry_for(head_dim, block_size, device)
        if entry is not None and entry.get("curve"):
            c = entry["curve"]
            return KernelEfficiency(tuple(c["density"]), tuple(c["ratio"]),
                                    source=f"triton, shipped {entry['device']} measurement ({c.get('source', '')})")
        # not measured on this GPU: assumed worse than every shipped flex curve, so that ``auto`` never
        # prefers an unmeasured triton to a measured flex (``measure=True`` or the bench settles it)
        return KernelEfficiency(UNMEASURED_DENSITY, tuple(UNMEASURED_SLOPE * d for d in UNMEASURED_DENSITY),
                                source=f"triton: not measured on this GPU (assumed {UNMEASURED_SLOPE} x density)")

    def stats(self) -> dict:
        return {"warmup_s": self._warmup_s, "compiled_kernels": compiled_kernels()}
