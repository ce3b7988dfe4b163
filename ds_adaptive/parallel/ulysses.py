"""Ulysses sequence parallelism for a video DiT: SP groups, sequence sharding, DistributedAttention.

The model is any :class:`ds_adaptive.models.family.DiffusionTransformer` (its split forward
``embed -> rope -> run_blocks -> head -> unpatchify`` and setters); nothing here knows a family.

An SP group of ``sp`` ranks trains ONE micro-batch together: every rank embeds the (identical)
batch, keeps its contiguous ``1/sp`` slice of the token sequence (padded to a multiple of sp),
and runs all blocks on that slice. Self-attention goes through DeepSpeed's
``DistributedAttention``: an all-to-all turns ``[B, S/sp, H, Dh]`` into ``[B, S, H/sp, Dh]``
(the full sequence, 1/sp of the heads), attention runs locally, and a second all-to-all turns
the result back. Cross-attention, the FFN, norms and RoPE are per token and stay local (the text
context is replicated). The head runs on the local tokens; the objective computes the loss on the
shard (``ds_adaptive.models.objective.per_sample_mse`` of a :class:`LocalOutput`)::

    layout = Layout.detect(sp_size).validate(num_heads=...)  # groups: megatron-core CP, DeepSpeed, or ours
    apply_ulysses(model, layout)                             # DistributedAttention + the sequence runner
    engine, *_ = deepspeed.initialize(model=model, config=strip_mesh_keys(ds_cfg), ...)
    scale = layout.check_engine(engine)                      # == sp for every supported DeepSpeed setup
    local = engine(x_t, timestep, context, local=True)       # LocalOutput: this rank's prediction shard
    partial = per_sample_mse(local, v)                       # [B] fp32, sum over the SP group = per-sample MSE
    engine.backward(partial.mean() * weight * scale)

Padding: S is padded to ``S_pad = ceil(S/sp)*sp`` with zero tokens (and zero rows of the rotary
table) at the END of the sequence, so only the last rank(s) hold padding. Padded keys are kept
out of attention by ``valid_len = S`` (the local attention slices q/k/v to the first S
positions, runs unmasked SDPA -- flash stays available -- and zero-fills the padded query rows);
padded tokens never touch real ones (everything else is per token) and are sliced away before
the loss. Real tokens therefore get exactly the unpadded result.

Loss scaling (derivation in docs/ULYSSES.md): rank r of group d backpropagates
``scale * P_r`` where ``P_r`` is its shard's part of the group loss ``L_d`` (``sum_r P_r = L_d``).
The parameter gradients of the ranks of a group then sum to ``grad L_d``. DeepSpeed 0.19.8 sums
the gradients of all ``world = dp*sp`` ranks and divides by ``world`` (ZeRO-3 reduce-scatter, and
every stage when DeepSpeed has no (dp, sp) mesh), so the reduced gradient is
``scale/(dp*sp) * sum_d grad L_d``; the DP-only convention (``1/dp * sum_d grad L_d``) needs
``scale = sp``. :meth:`ds_adaptive.core.layout.Layout.check_engine` verifies the engine's setup and returns it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange

from ds_adaptive.core.layout import Layout
from ds_adaptive.models.family import DiffusionTransformer

__all__ = ["SeqShard", "LocalOutput", "UlyssesRunner", "shard_plan", "shard_sequence", "gather_sequence",
           "valid_len_attention", "make_ulysses_attention", "apply_ulysses", "remove_ulysses"]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Unmasked SDPA on ``[B, S, H, Dh]``."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


# ============================================================================== sharding
@dataclass(frozen=True)
class SeqShard:
    """How one sequence of ``seq_len`` tokens is split over an SP group (contiguous, padded at the end).

    Rank ``sp_rank`` holds padded positions ``[start, start + local_len)``; the first ``valid`` of
    them are real tokens (``valid`` is 0 on a rank that holds only padding).
    """

    seq_len: int
    sp_size: int
    sp_rank: int
    multiple: int = 1
    """The padded length is also a multiple of this (tokens): hybrid context parallelism keeps every
    sequence-wise chunk whole key blocks (``ContextParallelAttention.token_multiple``); 1 under Ulysses."""

    @property
    def padded_len(self) -> int:
        m = math.lcm(self.sp_size, self.multiple)
        return -(-self.seq_len // m) * m

    @property
    def pad(self) -> int:
        return self.padded_len - self.seq_len

    @property
    def local_len(self) -> int:
        return self.padded_len // self.sp_size

    @property
    def start(self) -> int:
        return self.sp_rank * self.local_len

    @property
    def valid(self) -> int:
        return max(0, min(self.local_len, self.seq_len - self.start))

    @property
    def attn_kwargs(self) -> dict:
        """kwargs for ``run_blocks``: ``valid_len`` only when there is padding."""
        return {"valid_len": self.seq_len} if self.pad else {}


def shard_plan(seq_len: int, layout: Layout, multiple: int = 1) -> SeqShard:
    if seq_len < 1:
        raise ValueError(f"sequence length must be >= 1 token, got {seq_len}")
    return SeqShard(int(seq_len), layout.sp_size, layout.sp_rank, int(multiple))


def shard_sequence(x: torch.Tensor, shard: SeqShard, dim: int = 1) -> torch.Tensor:
    """This rank's padded slice ``[.., local_len, ..]`` of ``x`` along ``dim`` (zero padding at the end).

    A fresh tensor (never a view), so the full ``x`` can be freed; its gradient is the slice's
    gradient scattered into zeros. With sp=1 it returns ``x`` itself.
    """
    if shard.sp_size == 1:
        return x
    n = x.shape[dim]
    if n != shard.seq_len:
        raise ValueError(f"tensor has {n} positions along dim {dim}, the shard plan {shard.seq_len}")
    lo, hi = shard.start, shard.start + shard.local_len
    part = x.narrow(dim, lo, max(0, min(hi, n) - lo)) if lo < n else x.narrow(dim, n, 0)
    missing = shard.local_len - part.shape[dim]
    if missing:
        pad = [0, 0] * (x.dim() - 1 - (dim % x.dim())) + [0, missing]
        return F.pad(part, pad)
    return part.clone(memory_format=torch.contiguous_format)


class _GatherSequence(torch.autograd.Function):
    """All-gather along ``dim``; backward takes this rank's slice of the gradient.

    The slice (not a reduce-scatter) is the right adjoint here because every rank of an SP group
    computes the same loss from the gathered tensor: rank r then backpropagates exactly
    dL/d(shard r), and the group's parameter gradients sum to dL/dtheta once.
    """

    @staticmethod
    def forward(ctx, x, group, sp_size: int, sp_rank: int, dim: int):
        ctx.sp_size, ctx.sp_rank, ctx.dim = sp_size, sp_rank, dim
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(sp_size)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        n = grad.shape[ctx.dim] // ctx.sp_size
        return grad.narrow(ctx.dim, ctx.sp_rank * n, n).contiguous(), None, None, None, None


def gather_sequence(x_local: torch.Tensor, layout: Layout, shard: SeqShard, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: the full ``[.., seq_len, ..]`` tensor on every rank of the group
    (padding dropped). Differentiable; see ``_GatherSequence`` for the gradient convention (every rank
    of the group must compute the same loss from the result)."""
    if not layout.sp_enabled:
        return x_local
    if x_local.shape[dim] != shard.local_len:
        raise ValueError(f"local tensor has {x_local.shape[dim]} positions along dim {dim}, the shard "
                         f"plan {shard.local_len}")
    full = _GatherSequence.apply(x_local, layout.sp_group, layout.sp_size, layout.sp_rank, dim)
    return full.narrow(dim, 0, shard.seq_len)


# ============================================================================== attention
def valid_len_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        valid_len: Optional[int] = None) -> torch.Tensor:
    """SDPA on ``[B, S, H, Dh]`` where only the first ``valid_len`` positions are real tokens.

    Slices q, k, v to ``valid_len``, runs unmasked SDPA (so the flash backend stays usable) and
    zero-fills the output rows of the padded queries: real queries get exactly the unpadded
    result (the same as ``sdpa_attention(..., valid_len=...)``'s mask), padded queries give 0.
    """
    s = q.shape[1]
    if valid_len is None or valid_len >= s:
        return _sdpa(q, k, v)
    if valid_len < 1:
        raise ValueError(f"valid_len must be >= 1, got {valid_len}")
    out = _sdpa(q[:, :valid_len], k[:, :valid_len], v[:, :valid_len])
    return F.pad(out, (0, 0, 0, 0, 0, s - valid_len))


def make_ulysses_attention(layout: Layout, local_attention=valid_len_attention):
    """The attention fn for ``model.set_attention``: DeepSpeed's DistributedAttention over the
    SP group (all-to-all over heads, scatter_idx=2, gather_idx=1, batch dim 0) around
    ``local_attention`` (which receives ``valid_len``)."""
    from deepspeed.sequence.layer import DistributedAttention

    dist_attn = DistributedAttention(local_attention, layout.sp_group, scatter_idx=2, gather_idx=1)

    def ulysses_attention(q, k, v, **kwargs):
        return dist_attn(q, k, v, 0, None, **kwargs)

    ulysses_attention.distributed_attention = dist_attn
    return ulysses_attention


# ============================================================================== the model runner
@dataclass
class LocalOutput:
    """This rank's part of the model output, in patch-token space (what ``model(..., local=True)``
    returns under SP)."""

    tokens: torch.Tensor
    """[B, local_len, C*pt*ph*pw] head output of the local (padded) shard, activation dtype."""
    shard: SeqShard
    """Where the shard sits in the sequence."""
    grid: tuple[int, int, int]
    """(F, H, W) token grid of the sample."""
    patch_size: tuple[int, int, int] = (1, 2, 2)
    """(pt, ph, pw) of the model, to cut a full target the same way."""
    token_order: Any = None
    """The model's token order (``model.token_order``, e.g. sparse attention's cube order), or None
    for raster order: a full target is put in the same order before it is cut."""

    @property
    def valid_tokens(self) -> torch.Tensor:
        """[B, shard.valid, C*pt*ph*pw]: the real tokens of the shard (padding dropped)."""
        return self.tokens[:, :self.shard.valid]

    def shard_target(self, target: torch.Tensor) -> torch.Tensor:
        """The real tokens of this shard of a full ``[B, C, T', H', W']`` target:
        ``[B, shard.valid, C*pt*ph*pw]``, aligned with :attr:`valid_tokens`."""
        pt, ph, pw = self.patch_size
        tokens = rearrange(target, "b c (f pt) (h ph) (w pw) -> b (f h w) (pt ph pw c)", pt=pt, ph=ph, pw=pw)
        if tokens.shape[1] != self.shard.seq_len:
            raise ValueError(f"target has {tokens.shape[1]} tokens, the model output {self.shard.seq_len}: "
                             "give the target the latents' shape")
        if self.token_order is not None:
            tokens = self.token_order.to_cube(tokens, self.grid, dim=1)
        return tokens[:, self.shard.start:self.shard.start + self.shard.valid]


class UlyssesRunner:
    """Runs a :class:`DiffusionTransformer` with its token sequence sharded over the layout's SP group.

    Installed by :func:`apply_ulysses` as the model's sequence-parallel runner
    (``model.set_sequence_parallel``): ``model(latents, t, ctx)`` then returns the full
    (all-gathered) output on every rank of the group, ``model(latents, t, ctx, local=True)`` this
    rank's :class:`LocalOutput`. The runner holds no parameters and no model: it drives
    ``model.embed / rope / run_blocks / head``, so parameter names, checkpoints and ZeRO-3 hooks are
    unchanged, and a deepcopy of the model (an EMA copy) runs its own weights over the same groups.
    """

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        # seq_len -> tokens the padded sequence must be a multiple of (hybrid context parallelism sets it)
        self.token_multiple: Optional[Callable[[int], int]] = None

    def forward_local(self, model: DiffusionTransformer, latents: torch.Tensor, timestep: torch.Tensor,
                      context: torch.Tensor) -> LocalOutput:
        """Embed the full batch, keep this rank's shard (the inputs' per-token tensors: ``inputs.local``), run
        the blocks and the head on it."""
        inputs = model.embed(latents, timestep, context)
        n = inputs.tokens.shape[1]
        shard = shard_plan(n, self.layout, self.token_multiple(n) if self.token_multiple is not None else 1)
        inputs = inputs.local(lambda t, dim: shard_sequence(t, shard, dim=dim))  # copies: the full ones are freed
        x = inputs.tokens
        freqs = shard_sequence(model.rope(inputs.grid, x.device), shard, dim=0)
        x = model.run_blocks(x, inputs, freqs, **shard.attn_kwargs)
        return LocalOutput(tokens=model.head(x, inputs.time_emb), shard=shard, grid=inputs.grid,
                           patch_size=tuple(model.config.patch_size), token_order=model.token_order)

    def __call__(self, model: DiffusionTransformer, latents: torch.Tensor, timestep: torch.Tensor,
                 context: torch.Tensor, *,
                 local: bool = False):
        out = self.forward_local(model, latents, timestep, context)
        if local:
            return out
        tokens = gather_sequence(out.tokens, self.layout, out.shard, dim=1)
        return model.unpatchify(tokens, out.grid)

    def __deepcopy__(self, memo):
        return self  # process groups cannot be copied; the runner is stateless


def apply_ulysses(model: DiffusionTransformer, layout: Layout) -> UlyssesRunner:
    """Shard ``model``'s sequence over ``layout``'s SP group (idempotent): DistributedAttention in every
    block and the :class:`UlyssesRunner`. Checks that sp divides the model's heads. With sp=1 the
    model is left as it is (same numerics) and the runner is not installed. Call before or after
    ``deepspeed.initialize``; parameters are untouched. :func:`remove_ulysses` undoes it."""
    layout.validate(num_heads=model.config.num_heads, what=f"this model (dim {model.config.dim})")
    prev = model.sequence_parallel
    if prev is not None:
        if prev.layout == layout:
            return prev
        remove_ulysses(model)
    runner = UlyssesRunner(layout)
    if layout.sp_enabled:
        model.set_attention(make_ulysses_attention(layout))
        model.set_sequence_parallel(runner)
    return runner


def remove_ulysses(model: DiffusionTransformer) -> None:
    """Undo :func:`apply_ulysses`: the plain forward and the default attention."""
    model.set_sequence_parallel(None)
    model.set_attention(None)
