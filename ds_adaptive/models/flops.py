"""Model FLOPs of Wan DiT training (MFU / HFU, ``metrics``; formula in docs/MEMORY.md) and parameter counts.

Per sample of ``S`` tokens (D = dim, F = ffn_dim, L = blocks, T = text tokens, 512), forward,
counting a multiply-add as 2 FLOPs, linear layers and attention only (norms, RoPE, elementwise ops
and softmax left out, as in the usual MFU convention)::

    block linear   = 2 S (4 D^2 [self q,k,v,o] + 2 D^2 [cross q,o] + 2 D F [FFN]) + 2 T (2 D^2) [cross k,v]
    block attn     = 4 S^2 D [self: QK^T and AV] + 4 S T D [cross]
    embed + head   = 2 S D (C p) [patch] + 2 S D (C p) [head] + 2 T (4096 D + D^2) [text MLP]
    forward        = L (block linear + block attn) + embed + head

``model FLOPs = 3 x forward`` (backward = 2 x forward); the recomputed forward of checkpointed blocks
is excluded (MFU) or included (``hardware FLOPs = model + n_ckpt x (block linear + block attn)``,
HFU; with ``recompute.attention: keep`` the recompute skips the self-attention core, ``4 S^2 D`` less per
recomputed block). Under Ulysses each of the ``sp`` GPUs of a group does 1/sp of the sample's FLOPs.
"""
from __future__ import annotations

import math

TEXT_TOKENS = 512


def wan_block_flops(dim: int, ffn_dim: int, tokens: int, text_tokens: int = TEXT_TOKENS) -> float:
    """Forward FLOPs of one Wan block on one sample of ``tokens`` tokens."""
    s, d, t = float(tokens), float(dim), float(text_tokens)
    linear = 2 * s * (6 * d * d + 2 * d * ffn_dim) + 2 * t * 2 * d * d
    attn = 4 * s * s * d + 4 * s * t * d
    return linear + attn


def wan_train_flops(cfg, tokens: int, batch_size: int, ckpt_blocks: int = 0,
                    text_tokens: int = TEXT_TOKENS, *, kept_attention: bool = False) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one training micro-batch (fwd + bwd, all GPUs of an SP group
    together) of ``batch_size`` samples of ``tokens`` tokens with ``ckpt_blocks`` blocks recomputed
    (without their self-attention core when ``kept_attention``).
    ``cfg`` is a ``WanConfig`` (dim, ffn_dim, num_layers, in_channels, patch_size, text_dim)."""
    d, s, t = float(cfg.dim), float(tokens), float(text_tokens)
    patch = float(cfg.in_channels * math.prod(cfg.patch_size))
    block = wan_block_flops(cfg.dim, cfg.ffn_dim, tokens, text_tokens)
    embed_head = 2 * s * d * patch * 2 + 2 * t * (cfg.text_dim * d + d * d)
    fwd = cfg.num_layers * block + embed_head
    model = 3 * fwd * batch_size
    n = min(max(int(ckpt_blocks), 0), cfg.num_layers)
    recomputed = block - (4 * s * s * d if kept_attention else 0.0)
    return model, model + n * recomputed * batch_size


def wan_param_counts(cfg) -> dict:
    """Parameters of a Wan DiT config: ``{"block": per block, "total": all}`` (equal to
    ``count_parameters``, tested). Per block 8 D^2 + 2 D F + 21 D + F: self- and cross-attention q, k, v, o
    with biases, q/k RMSNorms, the affine LayerNorm before the cross-attention, the FFN, the [1, 6, D]
    modulation table."""
    d, f = cfg.dim, cfg.ffn_dim
    norm3 = 2 * d if cfg.cross_attn_norm else 0
    block = 8 * (d * d + d) + 4 * d + norm3 + 2 * d * f + f + d + 6 * d
    patch = cfg.in_channels * math.prod(cfg.patch_size)
    embed = (patch * d + d                                   # patch embedding Conv3d
             + cfg.text_dim * d + d + d * d + d              # text MLP
             + cfg.freq_dim * d + d + d * d + d              # time MLP
             + d * 6 * d + 6 * d)                            # time projection to 6 modulation vectors
    head = d * cfg.patch_channels + cfg.patch_channels + 2 * d
    return {"block": int(block), "total": int(block * cfg.num_layers + embed + head)}
