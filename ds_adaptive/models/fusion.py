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
micro-batch shape, except that torch specialises sizes of 1: a micro-batch of one sample (B = 1) is a second
graph per function (measured in the trainer on an H200: ~10-20 s of compile at the first step of each kind,
mid-run). :func:`warm_up` compiles both kinds before step 1 (the trainer calls it; the time is in the summary,
``block_fusion.warmup_s``), so no training step compiles. The torch references are the eager functions themselves (``tests/test_fusion.py``
compares them). Whether a mode is faster is measured, not assumed: ``bench/block_profile.py``.
"""
from __future__ import annotations

import functools
import itertools
from typing import Callable, Optional

from ds_adaptive.models import wan

__all__ = ["BLOCK_FUSION_MODES", "WARMUP_BATCH_SIZES", "apply_block_fusion", "compiled", "warm_up"]

BLOCK_FUSION_MODES = ("off", "rope", "regions")
#: micro-batch sizes whose graphs :func:`warm_up` compiles: torch specialises a size of 1, every B >= 2 shares one
#: graph. Sizes that equal no other size in the call: torch assumes equal sizes equal in the graph it compiles
#: ("duck sizing"; B = 2 would tie the batch to the RoPE table's (cos, sin) dimension)
WARMUP_BATCH_SIZES = (1, 3)
#: latent token grids (frames, height, width) of the warm-up: an image (one frame) and a video; the RoPE table's
#: view of its (frames, ...) base is specialised on a frame count of 1. Sizes all distinct, as above
WARMUP_GRIDS = ((1, 5, 7), (4, 5, 7))


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


def warm_up(model, *, dtype, device, per_token: bool = False, batch_sizes=WARMUP_BATCH_SIZES,
            grids=WARMUP_GRIDS) -> float:
    """Compile the block's installed compiled pieces, forward and backward, before training: each is called on
    stand-in tensors that have what the real call's graph guards on (dtype, device, which inputs need gradients,
    the per-sample ``[B, 1, D]`` gate views (and with ``per_token`` the per-token ``[B, S, D]`` ones) of the fp32 modulation table) for each
    micro-batch size in ``batch_sizes`` and token grid in ``grids`` (the RoPE table of a one-frame grid, an
    image, is a graph of its own); sizes other than batch and tokens are the model's. Touches no parameter
    (ZeRO-3 sees nothing). Returns the seconds spent (0.0 when no piece is compiled)."""
    import time

    import torch

    block = model.blocks[0]
    attn, norm3 = block.self_attn, getattr(block, "norm3", None)
    qk_rope = attn.qk_rope
    residual = block.residual if block.residual is not wan.gated_residual else None
    layer_norm = getattr(norm3, "layer_norm_fn", wan.fp32_layer_norm)
    layer_norm = None if layer_norm is wan.fp32_layer_norm else layer_norm
    if qk_rope is None and residual is None and layer_norm is None:
        return 0.0
    dim = model.config.dim

    def like(p: torch.Tensor) -> torch.Tensor:   # a Parameter (dynamo guards on the type) like the block's, not it
        return torch.nn.Parameter(torch.ones(dim, dtype=p.dtype, device=device), requires_grad=p.requires_grad)

    t0 = time.perf_counter()
    layouts = (False, True) if per_token else (False,)   # per-token runs may mix in per-sample micro-batches
    for b, grid, token_gate in itertools.product(batch_sizes, grids, layouts):
        tokens = int(grid[0] * grid[1] * grid[2])
        freqs = model.rope(grid, device)

        def act(b: int = b, tokens: int = tokens) -> torch.Tensor:
            return torch.randn(b, tokens, dim, dtype=dtype, device=device, requires_grad=True)

        outs = []
        if qk_rope is not None:
            outs += qk_rope(act(), act(), like(attn.norm_q.weight), like(attn.norm_k.weight), freqs,
                            attn.norm_q.eps, attn.num_heads)
        if residual is not None:
            n = block.modulation.shape[1]
            table = torch.nn.Parameter(torch.zeros(block.modulation.shape, dtype=block.modulation.dtype, device=device),
                                       requires_grad=block.modulation.requires_grad)
            time_mod = torch.zeros((b, tokens, n, dim) if token_gate else (b, n, dim), dtype=torch.float32,
                                   device=device, requires_grad=True)
            gate = wan.modulation(table, time_mod)[2]
            outs.append(residual(act(), act(), gate))
        if layer_norm is not None:
            outs.append(layer_norm(act(), like(norm3.weight), like(norm3.bias), norm3.eps))
        sum(o.float().sum() for o in outs).backward()
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0
