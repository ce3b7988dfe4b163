"""Block fusion: the elementwise pieces of a Wan block outside attention, compiled (``adaptive_load.block_fusion``).

Eager, a Wan block spends its non-matmul, non-attention time in short chains of memory-bound kernels:
q / k RMSNorm then RoPE (fp32 upcast, two products, a stack, a rounding: ~10 kernels per tensor, each
reading or writing the whole [B, S, D]), two gated residuals ``(x.float() + y.float() * gate).to(bf16)``
(4 kernels each) and the cross-attention LayerNorm in fp32 (4). torch.compile (Inductor) turns each
chain into one kernel forward and one backward. Modes:

    off      eager (the default)
    rope     q / k RMSNorm + RoPE compiled (``wan.qk_norm_rope``): one kernel per tensor each way
    regions  rope, plus the gated residuals (``wan.gated_residual``) and the cross-attention LayerNorm
             (``wan.fp32_layer_norm``): every elementwise chain of the block outside the fused
             LayerNorm-modulate op, attention and the Linear layers

What stays eager, on purpose: the Linear layers (ZeRO-3 gathers their weights in their modules' forward
hooks; a compiled region that contained them would break its graph at every hook), the self-attention
core (an opaque call: dense SDPA, Ulysses or sparse attention alike) and the fused LayerNorm-modulate
op. The compiled functions are plain functions of tensors (the RMSNorm weights are read as tensors:
ZeRO-3 keeps them whole below ``stage3_param_persistence_threshold``; a partitioned one sends that block
down the eager path, ``wan._params_available``). Compiled with ``dynamic=True``: one graph for every
micro-batch shape. The torch references are the eager functions themselves (``tests/test_fusion.py``
compares them). Whether a mode is faster is measured, not assumed: ``bench/block_profile.py``.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

from ds_adaptive.models import wan

__all__ = ["BLOCK_FUSION_MODES", "apply_block_fusion", "compiled"]

BLOCK_FUSION_MODES = ("off", "rope", "regions")


@functools.lru_cache(maxsize=None)
def compiled(name: str) -> Callable:
    """The compiled form of ``wan.<name>`` (one per process; compilation happens at the first call)."""
    import torch

    return torch.compile(getattr(wan, name), dynamic=True, fullgraph=True)


def apply_block_fusion(model, mode: str) -> Optional[str]:
    """Install ``mode`` (``BLOCK_FUSION_MODES``) in every block of ``model`` (a ``WanModel``); returns a
    one-line note for the launcher, or None for ``off``."""
    if mode not in BLOCK_FUSION_MODES:
        raise ValueError(f"adaptive_load.block_fusion must be one of {list(BLOCK_FUSION_MODES)}, got {mode!r}")
    if mode == "off":
        model.set_block_fusion()
        return None
    regions = mode == "regions"
    model.set_block_fusion(qk_rope=compiled("qk_norm_rope"),
                           residual=compiled("gated_residual") if regions else None,
                           layer_norm=compiled("fp32_layer_norm") if regions else None)
    what = "q/k RMSNorm + RoPE" + (", gated residuals, cross-attention LayerNorm" if regions else "")
    return f"block fusion '{mode}': {what} compiled (torch.compile, dynamic shapes; compiles at the first step)"
