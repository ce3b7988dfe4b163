"""Wan 2.1 text-to-video diffusion transformer (DiT), built for ZeRO-3 + Ulysses training.

Shapes (B batch, S = F*H*W tokens, D = dim, Dh = head_dim, L text tokens)::

    latents [B, 16, T', H', W']  --patch 1x2x2 Conv3d-->  tokens [B, S, D], grid (F, H, W) = (T', H'/2, W'/2)
    timestep [B] float in [0, 1000] --sinusoid(256)--> MLP --> time_emb [B, D] --SiLU, Linear--> time_mod [B, 6, D]
      (or one per token, timestep [B, S] -> time_emb [B, S, D], time_mod [B, S, 6, D]: diffusers' expand_timesteps)
    context [B, L, 4096] --Linear, GELU-tanh, Linear--> [B, L, D]
    30 / 40 blocks:  x += gate1 * SelfAttn(LN(x)*(1+scale1)+shift1, 3D RoPE)
                     x += CrossAttn(LN_affine(x), context)
                     x += gate2 * FFN(LN(x)*(1+scale2)+shift2)
    head: Linear(LN(x)*(1+scale)+shift) --> [B, S, 16*1*2*2] --unpatchify--> [B, 16, T', H', W']

The forward is split so that a sequence-parallel wrapper can shard the tokens between
``embed`` and ``head``: ``embed -> rope -> run_blocks -> head -> unpatchify``. Every parameter
is used only inside the forward of the module that owns it, so ZeRO-3's per-module gather
hooks fire on this split path too.

Numerics follow diffusers' ``WanTransformer3DModel`` (the reference we test against):

* activations (the residual stream ``x``) are in the parameter dtype (bf16 in training);
* the adaLN sites compute LayerNorm, ``* (1 + scale) + shift`` in fp32 and round once to x's
  dtype (``ln_modulate``); the modulation tables ``[1, 6, D]`` / ``[1, 2, D]`` are added to the
  time modulation in fp32;
* gated residuals are ``(x.float() + y.float() * gate).to(x.dtype)``; the cross-attention
  residual is a plain add in x's dtype;
* RoPE is applied in fp32 (tables computed in fp64, stored fp32) and rounded once;
* the time embedding MLP runs in its parameter dtype and its output ``time_emb`` is rounded to the
  activation dtype before ``time_projection`` (diffusers' ``temb.type_as(...)``).

The original Wan 2.1 code (Wan-Video/Wan2.1 ``wan/modules/model.py``) differs: it runs under
``torch.autocast(bf16)`` with fp32 parameters, so the residual stream, the gates and the whole
time embedding / projection stay fp32; RoPE is applied in fp64 and the sinusoid is computed in
fp64; its RMSNorm rounds the normalised q/k to bf16 before the weight multiply; and it zero-pads
the text context to 512 tokens (callers of this model should pass T5 context zero-padded to 512
tokens to match Wan's training). In fp32 all of these agree to rounding error.

Module / parameter names follow the original Wan checkpoint layout (``blocks.N.self_attn.q``,
``blocks.N.modulation``, ``head.head``, ...); ``ds_adaptive.models.weights`` converts diffusers'
names. Wan 2.1 I2V / FLF2V (CLIP image branch) are not implemented.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.nn as nn
from einops import rearrange

from ds_adaptive.models import fusion
from ds_adaptive.models.lean_backward import fp32_layer_norm
from ds_adaptive.models.recompute import CHECKPOINT_ATTENTION_MODES, keep_attention_context
from ds_adaptive.models.rope import rope_table
from ds_adaptive.models.wan_blocks import (AttentionFn, FP32LayerNorm, Grid, LnModulateFn, TokenOrder, WanBlock,
                                           WanHead, WanInputs, _set_plain_attr, gated_residual, is_fp32_param,
                                           sdpa_attention, timestep_embedding)
from ds_adaptive.models.wan_config import WanConfig, WanConfigError, get_wan_config
from ds_adaptive.ops.ln_modulate import ln_modulate_reference as _default_ln_modulate


class WanModel(nn.Module):
    """Wan 2.1 T2V DiT. See the module docstring for shapes and numerics.

    ``forward(latents, timestep, context)`` = ``embed -> rope -> run_blocks -> head -> unpatchify``.
    """

    def __init__(self, cfg: Union[WanConfig, str, Mapping[str, Any]]):
        super().__init__()
        cfg = cfg if isinstance(cfg, WanConfig) else get_wan_config(cfg)
        self.config = cfg
        d = cfg.dim
        self.patch_embedding = nn.Conv3d(cfg.in_channels, d, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.text_embedding = nn.Sequential(nn.Linear(cfg.text_dim, d), nn.GELU(approximate="tanh"), nn.Linear(d, d))
        self.time_embedding = nn.Sequential(nn.Linear(cfg.freq_dim, d), nn.SiLU(), nn.Linear(d, d))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        self.blocks = nn.ModuleList(WanBlock(cfg) for _ in range(cfg.num_layers))
        self.head = WanHead(cfg)
        # Checkpoint each block (torch.utils.checkpoint, use_reentrant=False) while grad is enabled;
        # checkpoint_blocks (set_checkpoint_blocks) limits it to the first n blocks.
        self.gradient_checkpointing = False
        self.checkpoint_blocks: Optional[int] = None
        # what a checkpointed block's backward recomputes: "recompute" all of it, "keep" all but the
        # self-attention core (ds_adaptive.models.recompute; set_checkpoint_attention)
        self.checkpoint_attention = "recompute"
        self.set_attention(None)
        self.set_token_order(None)
        self.set_ln_modulate(None)
        self.set_sequence_parallel(None)
        self.init_weights()

    # ---- hooks for the fused op and sequence parallelism ----
    # The one patching mechanism of ds_adaptive: these setters store plain (non-module) attributes that
    # forward reads. ds_adaptive.ops.apply_ln_modulate and ds_adaptive.parallel.apply_ulysses call them;
    # nothing replaces a method.

    def set_attention(self, fn: Optional[AttentionFn]) -> None:
        """Use ``fn(q, k, v, **kwargs) -> out`` (all ``[B, S, H, Dh]``) as every block's
        self-attention core; None restores ``sdpa_attention``. kwargs given to ``run_blocks``
        are forwarded to fn. fn is not registered as a submodule."""
        fn = sdpa_attention if fn is None else fn
        _set_plain_attr(self, "attention_fn", fn)
        per_layer = getattr(fn, "for_layer", None)  # a per-layer attention (sparse runtime): block i gets fn.for_layer(i)
        for i, block in enumerate(self.blocks):
            _set_plain_attr(block, "attn_fn", per_layer(i) if per_layer is not None else fn)

    def set_token_order(self, order: Optional[TokenOrder]) -> None:
        """Permute the tokens once after the patch embedding (and the RoPE table rows the same way)
        and restore raster order in ``unpatchify``; ``order`` has ``to_cube(x, grid, dim)`` /
        ``to_raster(x, grid, dim)`` (e.g. ``ds_adaptive.attention.CubeOrder``). None: raster order."""
        _set_plain_attr(self, "token_order", order)

    def order_tokens(self, tokens: torch.Tensor, grid: Grid) -> torch.Tensor:
        """Raster-order tokens ``[B, S, ...]`` (e.g. a patchified target) in the model's token order."""
        return tokens if self.token_order is None else self.token_order.to_cube(tokens, grid, dim=1)

    def set_ln_modulate(self, fn: Optional[LnModulateFn]) -> None:
        """Use ``fn(x, shift, scale, eps, weight=None, bias=None)`` at every norm+modulate site
        (2 per block + head); None restores the torch reference ``ln_modulate_reference``."""
        fn = _default_ln_modulate if fn is None else fn
        _set_plain_attr(self, "ln_modulate_fn", fn)
        for m in (*self.blocks, self.head):
            _set_plain_attr(m, "ln_modulate", fn)

    def set_block_fusion(self, qk_rope: Optional[Callable[..., Any]] = None, residual: Optional[Callable[..., Any]] = None,
                         layer_norm: Optional[Callable[..., Any]] = None) -> None:
        """Every block's elementwise pieces outside attention: ``qk_rope`` like ``qk_norm_rope`` (None: the
        RMSNorm modules and ``apply_rope``), ``residual`` like ``gated_residual``, ``layer_norm`` like
        ``fp32_layer_norm`` for the cross-attention norm (None: the references). ``ds_adaptive.models.fusion``
        passes compiled forms (``adaptive_load.block_fusion``)."""
        for block in self.blocks:
            _set_plain_attr(block.self_attn, "qk_rope", qk_rope)
            _set_plain_attr(block, "residual", residual or gated_residual)
            if isinstance(block.norm3, FP32LayerNorm):
                _set_plain_attr(block.norm3, "layer_norm_fn", layer_norm or fp32_layer_norm)

    def apply_block_fusion(self, mode: str) -> Optional[str]:
        """``adaptive_load.block_fusion`` (``off`` | ``rope`` | ``regions``): the compiled elementwise pieces of
        :mod:`ds_adaptive.models.fusion` in every block; returns the launcher's one-line note (None for off)."""
        return fusion.apply_block_fusion(self, mode)

    def warm_up_block_fusion(self, micro_batches, *, dtype: torch.dtype, device: Optional[torch.device],
                             per_token: bool = False) -> float:
        """Compile the installed block-fusion pieces for a plan's ``micro_batches`` ((B, tokens per rank) pairs)
        before its steps run them (:func:`ds_adaptive.models.fusion.warm_up`; the trainer's
        :class:`~ds_adaptive.training.fusion_warmup.FusionWarmup` calls it); seconds spent, 0.0 with block fusion off.
        Raises ``BlockFusionUnavailable`` with the blocks back on eager when torch.compile cannot work."""
        return fusion.warm_up(self, micro_batches, dtype=dtype, device=device, per_token=per_token)

    def set_sequence_parallel(self, runner: Optional[Callable[..., Any]]) -> None:
        """Route ``forward`` through ``runner(model, latents, timestep, context, local=...)`` (the Ulysses
        runner of ``ds_adaptive.parallel.apply_ulysses``); None restores the plain forward."""
        _set_plain_attr(self, "sequence_parallel", runner)

    def set_checkpoint_blocks(self, n: Optional[int]) -> None:
        """Checkpoint only the first ``n`` blocks (0..num_layers; more is clamped to all) while grad is
        enabled; ``None`` restores ``gradient_checkpointing``'s all-or-nothing. Set before each forward
        (the trainer does, per micro-batch, from the checkpoint plan of ``ds_adaptive.planning.memory``):
        the first blocks are the ones backward reaches last, when the whole blocks after them are freed."""
        if n is not None and (isinstance(n, bool) or int(n) != n or n < 0):
            raise WanConfigError(f"set_checkpoint_blocks: n must be an int >= 0 or None, got {n!r}")
        self.checkpoint_blocks = None if n is None else min(int(n), len(self.blocks))

    def set_checkpoint_attention(self, mode: str) -> None:
        """``recompute.attention``: ``recompute`` (a checkpointed block runs its whole forward again in
        backward) or ``keep`` (it keeps its self-attention core's output and log-sum-exp and recomputes the
        rest: :mod:`ds_adaptive.models.recompute`). Gradients are the same either way."""
        if mode not in CHECKPOINT_ATTENTION_MODES:
            raise WanConfigError(f"set_checkpoint_attention: mode must be one of {list(CHECKPOINT_ATTENTION_MODES)}, "
                                 f"got {mode!r}")
        self.checkpoint_attention = mode

    def checkpointed_blocks(self) -> int:
        """Blocks the next forward checkpoints (0 when grad is off)."""
        if not torch.is_grad_enabled():
            return 0
        if self.checkpoint_blocks is not None:
            return self.checkpoint_blocks
        return len(self.blocks) if self.gradient_checkpointing else 0

    # ---- the split forward ----

    def embed(self, latents: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor) -> WanInputs:
        """latents [B, C_in, T', H', W'], timestep [B] or [B, S] (float, 0..1000; [B, S]: one per token in
        (f, h, w) raster order, diffusers' ``expand_timesteps``), context [B, L, text_dim]."""
        self._check_inputs(latents, timestep, context)
        dtype = self.patch_embedding.weight.dtype  # the activation dtype
        x = self.patch_embedding(latents.to(dtype))  # [B, D, F, H, W]
        grid = tuple(int(n) for n in x.shape[2:])
        tokens = self.order_tokens(x.flatten(2).transpose(1, 2), grid).contiguous()
        per_token = timestep.dim() == 2
        steps = self.order_tokens(timestep, grid).flatten() if per_token else timestep  # [B*S] or [B]
        t = timestep_embedding(steps, self.config.freq_dim)
        time_emb = self.time_embedding(t.to(self.time_embedding[0].weight.dtype)).to(dtype)
        time_mod = self.time_projection(time_emb.to(self.time_projection[1].weight.dtype))
        time_mod = time_mod.float().unflatten(1, (6, self.config.dim))  # [B(*S), 6, D]
        if per_token:  # rows are (sample, token): [B, S, D] and [B, S, 6, D]
            b = timestep.shape[0]
            time_emb, time_mod = time_emb.unflatten(0, (b, -1)), time_mod.unflatten(0, (b, -1))
        ctx = self.text_embedding(context.to(self.text_embedding[0].weight.dtype))
        return WanInputs(tokens=tokens, time_mod=time_mod, time_emb=time_emb, context=ctx, grid=grid)

    def rope(self, grid: Grid, device: Optional[torch.device] = None) -> torch.Tensor:
        """Rotary table ``[S, head_dim/2, 2]`` fp32 (cos, sin) for the token grid (F, H, W) in the model's
        token order (rows follow the tokens); see ``rope_table``."""
        grid = tuple(int(n) for n in grid)
        table = rope_table(grid, self.config.rope_split, self.config.rope_theta, device)
        return table if self.token_order is None else self.token_order.to_cube(table, grid, dim=0)

    def run_blocks(self, x: torch.Tensor, inputs: WanInputs, freqs: torch.Tensor, **attn_kwargs: Any) -> torch.Tensor:
        """All blocks on x [B, S_local, D] with freqs [S_local, Dh/2, 2] (rows aligned with x's tokens).

        Under sequence parallelism x and freqs are the local shards; ``attn_kwargs`` (e.g.
        ``valid_len``) go to the attention fn of every block.
        """
        if freqs.dim() != 3 or freqs.shape[0] != x.shape[1] or freqs.shape[1:] != (self.config.head_dim // 2, 2):
            raise WanConfigError(
                f"rope table has shape {list(freqs.shape)} but x has {x.shape[1]} tokens; expected "
                f"[{x.shape[1]}, {self.config.head_dim // 2}, 2]: shard model.rope(grid) along dim 0 "
                "exactly like the tokens (same padding)")
        if freqs._base is not None and self.blocks and self.blocks[0].self_attn.qk_rope is not None:
            # block fusion: the compiled qk_norm_rope guards on a view's base (its sizes; a one-frame grid's size
            # of 1), which differs between the plain, the Ulysses-sharded and the warm-up tables: one small copy per
            # forward gives every call the same kind of table
            freqs = freqs.clone()
        n_ckpt = self.checkpointed_blocks()
        ctx = {"context_fn": keep_attention_context()} if self.checkpoint_attention == "keep" else {}
        for i, block in enumerate(self.blocks):   # a checkpointed block checkpoints inside its call (WanBlock.forward)
            x = block(x, inputs.time_mod, inputs.context, freqs, checkpointed=ctx if i < n_ckpt else None,
                      **attn_kwargs)
        return x

    # ``self.head`` (a WanHead submodule) is the split-path head: model.head(x, time_emb) -> [B, S, C*pt*ph*pw].

    def unpatchify(self, tokens: torch.Tensor, grid: Grid) -> torch.Tensor:
        """[B, S, out_channels*pt*ph*pw] (channels fastest) -> [B, out_channels, F*pt, H*ph, W*pw]."""
        f, h, w = grid
        if tokens.shape[1] != f * h * w:
            raise WanConfigError(f"unpatchify got {tokens.shape[1]} tokens for grid {tuple(grid)} "
                                 f"(= {f * h * w}); drop sequence-parallel padding before unpatchify")
        if self.token_order is not None:
            tokens = self.token_order.to_raster(tokens, grid, dim=1)
        pt, ph, pw = self.config.patch_size
        return rearrange(tokens, "b (f h w) (pt ph pw c) -> b c (f pt) (h ph) (w pw)",
                         f=f, h=h, w=w, pt=pt, ph=ph, pw=pw)

    def forward(self, latents: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor, *, local: bool = False):
        """latents [B, 16, T', H', W'], timestep [B] float in [0, 1000], context [B, L, 4096]
        -> the prediction [B, 16, T', H', W'] in the activation (parameter) dtype.

        ``local=True``: the caller takes this rank's share of the prediction. Under sequence
        parallelism that is a ``ds_adaptive.parallel.LocalOutput`` (this rank's token shard, no
        all-gather); without it the shard is the whole prediction, returned as above.
        """
        if self.sequence_parallel is not None:
            return self.sequence_parallel(self, latents, timestep, context, local=local)
        inputs = self.embed(latents, timestep, context)
        freqs = self.rope(inputs.grid, inputs.tokens.device)
        x = self.run_blocks(inputs.tokens, inputs, freqs)
        return self.unpatchify(self.head(x, inputs.time_emb), inputs.grid)

    # ---- utilities ----

    def _check_inputs(self, latents: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor) -> None:
        cfg = self.config
        pt, ph, pw = cfg.patch_size
        if latents.dim() != 5 or latents.shape[1] != cfg.in_channels:
            raise WanConfigError(f"latents must be [B, {cfg.in_channels}, T', H', W'], got {list(latents.shape)}")
        b, _, t, h, w = latents.shape
        if t % pt or h % ph or w % pw:
            raise WanConfigError(f"latent grid {t}x{h}x{w} (T'xH'xW') is not divisible by the patch "
                                 f"{cfg.patch_size}; crop or resize the sample (H', W' must be even)")
        s = (t // pt) * (h // ph) * (w // pw)
        if timestep.shape not in ((b,), (b, s)):
            raise WanConfigError(f"timestep must be [B] = [{b}] (one float in [0, 1000] per sample) or [B, S] = "
                                 f"[{b}, {s}] (one per token), got {list(timestep.shape)}")
        if context.dim() != 3 or context.shape[0] != b or context.shape[2] != cfg.text_dim:
            raise WanConfigError(f"context must be [B, L, text_dim] = [{b}, L, {cfg.text_dim}], "
                                 f"got {list(context.shape)}")

    @torch.no_grad()
    def init_weights(self) -> None:
        """The original Wan init: xavier-uniform Linear/patch weights, zero biases, N(0, 0.02) for
        the text and time embeddings, zero output head; RMSNorm / LayerNorm weights 1, modulation
        tables N(0, 1/D). Works under deepspeed.zero.Init; on the meta device (a dry run's model) there are no
        values to write and it returns at once (torch's meta init ops would import its compiler stack, seconds)."""
        params = list(self.parameters())
        if params and all(p.is_meta for p in params):
            return
        if any(hasattr(p, "ds_id") for p in params):  # ZeRO-3 partitioned: gather, init on rank 0
            import deepspeed
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                self._init_weights()
        else:
            self._init_weights()

    def _init_weights(self) -> None:
        d = self.config.dim
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, (nn.LayerNorm, nn.RMSNorm)) and m.weight is not None:
                nn.init.ones_(m.weight)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        nn.init.xavier_uniform_(self.patch_embedding.weight.view(d, -1))
        nn.init.zeros_(self.patch_embedding.bias)
        for seq in (self.text_embedding, self.time_embedding):
            for m in seq:
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=0.02)
        for p in (*(b.modulation for b in self.blocks), self.head.modulation):
            nn.init.normal_(p, std=d ** -0.5)
        nn.init.zeros_(self.head.head.weight)

    def to_dtype(self, dtype: torch.dtype, keep_fp32: bool = True) -> "WanModel":
        """Cast floating parameters to dtype; with keep_fp32, those of ``is_fp32_param`` stay fp32."""
        for name, p in self.named_parameters():
            target = torch.float32 if keep_fp32 and is_fp32_param(name) else dtype
            if p.dtype != target:
                p.data = p.data.to(target)
        return self


def count_parameters(cfg: Union[WanConfig, str, Mapping[str, Any]]) -> int:
    """Parameter count of a config, built on the meta device (no memory)."""
    with torch.device("meta"):
        model = WanModel(cfg)
    return sum(p.numel() for p in model.parameters())
