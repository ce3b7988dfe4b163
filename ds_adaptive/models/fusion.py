"""Block fusion: the elementwise pieces of a Wan block outside attention, compiled (``adaptive_load.block_fusion``).

Eager, a Wan block spends its non-matmul, non-attention time in short chains of memory-bound kernels:
q / k RMSNorm then RoPE (fp32 upcast, two products, a stack, a rounding: ~10 kernels per tensor, each
reading or writing the whole [B, S, D]), two gated residuals ``(x.float() + y.float() * gate).to(bf16)``
(4 kernels each) and the cross-attention LayerNorm in fp32 (4). torch.compile (Inductor) turns each
chain into one kernel forward and one backward. Modes:

    off      eager (the default)
    rope     q / k RMSNorm + RoPE by one Triton kernel per tensor each way (``ds_adaptive.ops.qk_norm_rope``,
             :func:`qk_norm_rope_kernel`; where it cannot run, ``wan_blocks.qk_norm_rope`` compiled)
    regions  rope, plus the gated residuals (``wan_blocks.gated_residual``) compiled

Measured, not assumed (``bench/kernels/block_fusion_kernels.py``, fwd+bwd; figures in docs/RESULTS.md): Inductor's
dynamic-shape kernels for ``qk_norm_rope`` ran far from the bytes' copy time (its weight-gradient reductions over
the tokens), the Triton kernel close to it; the compiled gated residual beat eager; the compiled cross-attention
LayerNorm was slower than eager, so it stays eager.

What stays eager, on purpose: the Linear layers (ZeRO-3 gathers their weights in their modules' forward
hooks; a compiled region that contained them would break its graph at every hook), the self-attention
core (an opaque call: dense SDPA, Ulysses or sparse attention alike) and the fused LayerNorm-modulate
op. The compiled functions are plain functions of tensors (the RMSNorm weights are read as tensors:
ZeRO-3 keeps them whole below ``stage3_param_persistence_threshold``; a partitioned one sends that block
down the eager path, ``wan_blocks._params_available``). Compiled with ``dynamic=True``: one graph for every
micro-batch shape, except where torch or Inductor specialise: a size of 1 (B = 1), a view's base (a one-frame
grid's RoPE table), element counts behind some fusion decisions, the thread count. Without a warm-up, the trainer
pays a compile of seconds at the first step of each kind, mid-run. :func:`warm_up` compiles the plan's
micro-batch sizes before step 1 (the trainer calls it; the time is in the summary, ``block_fusion.warmup_s``), after
which no step compiles. The Triton kernel compiles once per dtype and D, whatever the shapes. The torch references are
the eager functions themselves (``tests/unit/models/test_fusion.py`` compares them). Whether a mode is faster is
measured, not assumed: ``bench/kernels/block_profile.py`` (one block), ``bench/training/mfu_levers.py`` (the trainer).
"""
from __future__ import annotations

import functools
import itertools
from typing import Callable, Iterable, Optional

from ds_adaptive.models import wan_blocks
from ds_adaptive.models.family import BlockFusionUnavailable
from ds_adaptive.ops.qk_norm_rope import try_triton_qk_norm_rope
from ds_adaptive.core.config import ConfigError
from ds_adaptive.ops.qk_norm_rope import tiles

__all__ = ["BLOCK_FUSION_MODES", "BlockFusionUnavailable", "apply_block_fusion", "compiled", "qk_norm_rope_kernel",
           "warm_up"]

BLOCK_FUSION_MODES = ("off", "rope", "regions")


@functools.lru_cache(maxsize=None)
def compiled(name: str) -> Callable:
    """The compiled form of ``wan_blocks.<name>`` (one per process; compilation happens at the first call)."""
    import torch

    return torch.compile(getattr(wan_blocks, name), dynamic=True, fullgraph=True)


def qk_norm_rope_kernel(q, k, wq, wk, freqs, eps: float, heads: int):
    """``wan_blocks.qk_norm_rope`` by the Triton kernels (``ds_adaptive.ops.qk_norm_rope``: one read and one write of each
    tensor, either way) where they can run (CUDA, triton), else its compiled form. Inductor's kernels for this
    function ran at a small fraction of the memory bandwidth (``bench/kernels/block_fusion_kernels.py``)."""
    out = try_triton_qk_norm_rope(q, k, wq, wk, freqs, eps, heads)
    return out if out is not None else compiled("qk_norm_rope")(q, k, wq, wk, freqs, eps, heads)


def apply_block_fusion(model, mode: str) -> Optional[str]:
    """Install ``mode`` (``BLOCK_FUSION_MODES``) in every block of ``model`` (a ``WanModel``); returns a
    one-line note for the launcher, or None for ``off``."""
    if mode not in BLOCK_FUSION_MODES:
        raise ValueError(f"adaptive_load.block_fusion must be one of {list(BLOCK_FUSION_MODES)}, got {mode!r}")
    if mode == "off":
        model.set_block_fusion()
        return None

    try:   # the kernel's launch override, checked before the run starts (one line, exit 2)
        tiles(model.config.dim)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    regions = mode == "regions"
    model.set_block_fusion(qk_rope=qk_norm_rope_kernel,
                           residual=compiled("gated_residual") if regions else None,
                           layer_norm=None)
    what = ", gated residuals compiled (torch.compile, dynamic shapes)" if regions else ""
    return (f"block fusion '{mode}': q/k RMSNorm + RoPE by a Triton kernel (compiled where it cannot run){what}; the "
            f"trainer compiles them before step 1 for the plan's micro-batch sizes")


def warm_up(model, micro_batches: Iterable[tuple[int, int]], *, dtype, device, per_token: bool = False) -> float:
    """Compile the block's installed compiled pieces, forward and backward, before training, for the plan's
    ``micro_batches`` ((B, tokens per rank) pairs, e.g. every distinct pair of the epoch's plan): each piece is
    called at those sizes on stand-in tensors with what the real call's graph guards on: dtype, device, which
    inputs need gradients, a base-less RoPE table (``WanModel.run_blocks`` copies views), the per-sample
    ``[B, 1, D]`` gate views of the fp32 modulation table (and with ``per_token`` the per-token ``[B, S, D]``
    ones). Real sizes matter: torch specialises a size of 1 (B = 1) and Inductor guards some fusion decisions on
    the number of elements. Pairs that an earlier graph already covers cost one eager-speed call. Call it with
    the thread count training will have (dynamo guards on it; a CUDA DataLoader's pin-memory thread sets 1).
    Touches no parameter (ZeRO-3 sees nothing). Returns the seconds spent (0.0 when no piece is compiled). When
    torch.compile fails, the blocks go back to eager and :class:`BlockFusionUnavailable` says why."""
    import torch._dynamo

    try:
        return _warm_up(model, micro_batches, dtype=dtype, device=device, per_token=per_token)
    except torch._dynamo.exc.TorchDynamoException as exc:   # Inductor's errors (no compiler, no triton) included
        model.set_block_fusion()
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise BlockFusionUnavailable(first[:300]) from exc


def _warm_up(model, micro_batches: Iterable[tuple[int, int]], *, dtype, device, per_token: bool) -> float:
    """:func:`warm_up` without the fallback."""
    import time

    import torch

    block = model.blocks[0]
    attn, norm3 = block.self_attn, getattr(block, "norm3", None)
    qk_rope = attn.qk_rope
    residual = block.residual if block.residual is not wan_blocks.gated_residual else None
    layer_norm = getattr(norm3, "layer_norm_fn", wan_blocks.fp32_layer_norm)
    layer_norm = None if layer_norm is wan_blocks.fp32_layer_norm else layer_norm
    if qk_rope is None and residual is None and layer_norm is None:
        return 0.0
    dim = model.config.dim
    shape = tuple(getattr(block.modulation, "ds_shape", block.modulation.shape))   # ZeRO-3: partitioned

    def like(p: Optional[torch.Tensor], *size: int) -> Optional[torch.Tensor]:
        """A Parameter like ``p`` (dynamo guards on the type), not the block's; None for None."""
        if p is None:
            return None
        return torch.nn.Parameter(torch.ones(size or (dim,), dtype=p.dtype, device=device),
                                  requires_grad=p.requires_grad)

    t0 = time.perf_counter()
    layouts = (False, True) if per_token else (False,)   # per-token runs may mix in per-sample micro-batches
    for (b, tokens), token_gate in itertools.product(sorted({(int(b), int(s)) for b, s in micro_batches}), layouts):
        freqs = model.rope((1, 1, tokens), device).clone()

        def act() -> torch.Tensor:
            return torch.randn(b, tokens, dim, dtype=dtype, device=device, requires_grad=True)

        outs = []
        if qk_rope is not None and not token_gate:
            outs += qk_rope(act(), act(), like(attn.norm_q.weight), like(attn.norm_k.weight), freqs,
                            attn.norm_q.eps, attn.num_heads)
        if residual is not None:
            time_mod = torch.zeros((b, tokens, shape[1], dim) if token_gate else (b, shape[1], dim),
                                   dtype=torch.float32, device=device, requires_grad=True)
            gate = wan_blocks.modulation(like(block.modulation, *shape), time_mod)[2]
            outs.append(residual(act(), act(), gate))
        if layer_norm is not None and not token_gate:
            outs.append(layer_norm(act(), like(norm3.weight), like(norm3.bias), norm3.eps))
        if outs:
            sum(o.float().sum() for o in outs).backward()
        del outs
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()   # the stand-ins' blocks back to the device before training allocates
    return time.perf_counter() - t0
