"""Ulysses sequence parallelism for the Wan DiT: SP groups, sequence sharding, DistributedAttention.

An SP group of ``sp`` ranks trains ONE micro-batch together: every rank embeds the (identical)
batch, keeps its contiguous ``1/sp`` slice of the token sequence (padded to a multiple of sp),
and runs all blocks on that slice. Self-attention goes through DeepSpeed's
``DistributedAttention``: an all-to-all turns ``[B, S/sp, H, Dh]`` into ``[B, S, H/sp, Dh]``
(the full sequence, 1/sp of the heads), attention runs locally, and a second all-to-all turns
the result back. Cross-attention, the FFN, norms and RoPE are per token and stay local (the text
context is replicated). The head runs on the local tokens and the loss is computed on the
shard::

    sp   = init_sequence_parallel(sp_size)           # groups: megatron-core CP, DeepSpeed mesh, or ours
    uw   = apply_ulysses(model, sp)                  # model.forward(..., target=) -> per-sample partial loss
    engine, *_ = deepspeed.initialize(model=model, config=strip_mesh_keys(ds_cfg), ...)
    scale = sp.check_engine(engine)                  # == sp for every supported DeepSpeed setup
    partial = engine(x_t, timestep, context, target=v)   # [B] fp32, sum over the SP group = per-sample MSE
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
``scale = sp``. :meth:`SequenceParallel.check_engine` verifies the engine's setup and returns it.
"""
from __future__ import annotations

import copy
import math
import sys
import types
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange

from ds_adaptive.balance.cost import SequenceParallelError
from ds_adaptive.models.wan import WanInputs, WanModel, sdpa_attention

__all__ = [
    "SequenceParallel", "SequenceParallelError", "SeqShard", "LocalOutput", "UlyssesWan",
    "init_sequence_parallel", "resolve_sp_size", "strip_mesh_keys", "check_heads", "shard_plan",
    "shard_sequence", "gather_sequence", "valid_len_attention", "make_ulysses_attention",
    "apply_ulysses", "remove_ulysses", "MESH_KEYS",
]

MESH_KEYS = ("data_parallel_size", "sequence_parallel_size")
"""ds_config keys that make ``deepspeed.initialize`` build a (dp, sp) device mesh."""

_PATCH_MARKER = "_ds_adaptive_ulysses"


# ============================================================================== groups
@dataclass(frozen=True)
class SequenceParallel:
    """Where this rank sits in the (dp, sp) layout and the process groups it talks over.

    ``world = dp_size * sp_size``; the ``sp_size`` ranks of one SP group share ``dp_rank``, get
    identical batches and each hold ``1/sp`` of every sample's tokens. ``group`` is the SP group
    (None when ``sp_size == 1``); ``sp_rank`` is the rank inside it (the order of the all-to-all,
    so shard ``sp_rank`` of the sequence lives here); ``dp_group`` joins the ranks with the same
    ``sp_rank`` (None = the default group, when ``sp_size == 1``). ``source`` says where the groups
    came from: ``megatron`` (context-parallel groups of parallel_state), ``deepspeed-mesh``
    (``deepspeed.utils.groups.mesh_device``), ``created`` (ours, consecutive ranks) or ``single``
    (no torch.distributed).
    """

    sp_size: int
    sp_rank: int
    dp_size: int
    dp_rank: int
    group: Any = None
    dp_group: Any = None
    source: str = "single"

    @property
    def enabled(self) -> bool:
        """True when the sequence is really split (sp_size > 1)."""
        return self.sp_size > 1

    @property
    def world_size(self) -> int:
        return self.sp_size * self.dp_size

    @property
    def topology(self):
        """The sampler's view of this layout: ``ds_adaptive.balance.sampler.Topology``."""
        from ds_adaptive.balance.sampler import Topology

        return Topology(dp_rank=self.dp_rank, dp_size=self.dp_size, sp_rank=self.sp_rank, sp_size=self.sp_size)

    @property
    def loss_scale(self) -> float:
        """Factor on each SP rank's partial loss under DeepSpeed's world-mean gradient reduction
        (== sp_size); :meth:`check_engine` verifies that the engine reduces that way."""
        return float(self.sp_size)

    def check_engine(self, engine) -> float:
        """Check that ``engine`` (a DeepSpeedEngine) averages gradients the way the loss scaling
        assumes, and return the loss scale (``sp_size``).

        DeepSpeed 0.19.8 (verified on gloo, tests/test_ulysses_zero3.py):

        * no (dp, sp) mesh (ds_config without ``data_parallel_size`` + ``sequence_parallel_size``,
          the recommended setup): DeepSpeed sees ``world`` data-parallel ranks; every ZeRO stage
          sums the gradients over the world and divides by ``world``;
        * with a mesh, ZeRO-3 with ``reduce_scatter: true`` (default) does the same, because the
          parameters are partitioned over the world;
        * with a mesh, ZeRO-0/1/2 reduce over the ``data_parallel`` mesh dimension only (the SP
          ranks of a group would drift apart), and ZeRO-3 with ``reduce_scatter: false`` divides
          small buckets by ``dp`` and large ones by ``dp*sp``: both are rejected here.
        """
        if not self.enabled:
            return 1.0
        world = dist.get_world_size()
        stage = int(engine.zero_optimization_stage())
        ds_sp = int(getattr(engine, "sequence_parallel_size", 1) or 1)
        fix = ("Remove 'data_parallel_size' and 'sequence_parallel_size' from the ds_config "
               "(ds_adaptive.parallel.strip_mesh_keys) and let ds_adaptive create the SP groups")
        if ds_sp not in (1, self.sp_size):
            raise SequenceParallelError(
                f"DeepSpeed's engine has sequence_parallel_size={ds_sp} but the SP groups have "
                f"sp={self.sp_size}; use the same degree in the ds_config and --sp")
        if ds_sp > 1:
            if stage < 3:
                raise SequenceParallelError(
                    f"ZeRO stage {stage} with DeepSpeed's (dp, sp) mesh: DeepSpeed 0.19.8 reduces gradients "
                    "only over the mesh's data_parallel dimension, so the SP ranks of a group would train "
                    f"different weights. {fix}, or use ZeRO-3.")
            if not engine.zero_reduce_scatter():
                raise SequenceParallelError(
                    "zero_optimization.reduce_scatter=false with DeepSpeed's (dp, sp) mesh: DeepSpeed 0.19.8 "
                    "divides the gradients of small buckets by dp and of large ones by dp*sp. Set "
                    f"reduce_scatter to true, or: {fix}.")
            warnings.warn(
                "DeepSpeed's (dp, sp) mesh is active: DeepSpeed 0.19.8 names ZeRO-3 checkpoint shards by the "
                f"data_parallel rank, so the {self.sp_size} SP ranks of a group overwrite each other's "
                f"optimizer-state files on save_checkpoint. {fix}.", stacklevel=2)
        if stage == 3:
            for name, p in engine.module.named_parameters():
                g = getattr(p, "ds_process_group", None)
                n = dist.get_world_size(g) if g is not None else world
                if n != world:
                    raise SequenceParallelError(
                        f"parameter {name} is ZeRO-3 partitioned over {n} ranks, not the world ({world}): "
                        "the gradient reduction would not include every SP rank. Build the model under "
                        "deepspeed.zero.Init without data_parallel_group (or without zero.Init).")
        else:
            n = int(getattr(engine, "seq_dp_world_size", world))
            if n != world:
                raise SequenceParallelError(
                    f"DeepSpeed reduces gradients over {n} ranks, not the world ({world}); {fix}.")
        return self.loss_scale

    def group_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of ``t`` (detached) over the SP group, e.g. the full per-sample losses from the partial
        ones for logging; ``t`` itself (detached) when sp=1. A collective: call on every rank of the group."""
        t = t.detach()
        if not self.enabled:
            return t
        out = t.clone()
        dist.all_reduce(out, group=self.group)
        return out

    def assert_replicated(self, *tensors: torch.Tensor, what: str = "the batch") -> None:
        """Raise unless every rank of the SP group holds the same values in ``tensors`` (compares an
        fp64 checksum per tensor; a collective). The ranks of a group must train on identical inputs
        (latents, noise, timesteps, text): a rank that draws its own noise silently breaks Ulysses."""
        if not self.enabled:
            return
        sums = torch.stack([torch.stack([t.detach().double().sum(), t.detach().double().square().sum()])
                            for t in tensors]).flatten()
        gathered = [torch.empty_like(sums) for _ in range(self.sp_size)]
        dist.all_gather(gathered, sums, group=self.group)
        for r, other in enumerate(gathered):
            if not torch.allclose(other, sums, rtol=1e-12, atol=0.0):
                bad = [i for i in range(len(tensors)) if not torch.allclose(other[2 * i:2 * i + 2],
                                                                            sums[2 * i:2 * i + 2], rtol=1e-12)]
                raise SequenceParallelError(
                    f"{what} differs between SP ranks {self.sp_rank} and {r} (tensor(s) {bad} of {len(tensors)}): "
                    "all ranks of an SP group must get identical inputs. Draw noise / timesteps from per-sample "
                    "seeds (not per-rank RNG state) and give the group the same batch (Topology.sp_rank "
                    "must not change what the sampler yields).")

    def describe(self) -> str:
        return (f"sp {self.sp_rank}/{self.sp_size}, dp {self.dp_rank}/{self.dp_size} "
                f"(world {self.world_size}, groups: {self.source})")


def check_heads(num_heads: int, sp_size: int, *, what: str = "the model") -> None:
    """Raise SequenceParallelError unless ``sp_size`` divides ``num_heads`` (Ulysses splits heads)."""
    if not isinstance(sp_size, int) or isinstance(sp_size, bool) or sp_size < 1:
        raise SequenceParallelError(f"the Ulysses degree sp must be an int >= 1, got {sp_size!r}")
    if num_heads % sp_size:
        divisors = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
        raise SequenceParallelError(
            f"Ulysses sp={sp_size} does not divide the {num_heads} attention heads of {what}: each rank "
            f"of an SP group attends with heads/sp whole heads. Use sp in {divisors}.")


def resolve_sp_size(sp_size: Optional[int], ds_config: Optional[Mapping[str, Any]] = None,
                    world_size: Optional[int] = None) -> int:
    """The Ulysses degree from ``--sp`` and/or the ds_config's ``sequence_parallel_size``.

    They must agree when both are given; ``data_parallel_size`` (if present) must equal
    ``world_size / sp``; ``world_size`` (if given) must be divisible by sp. Default 1.
    """
    cfg = dict(ds_config or {})
    cfg_sp, cfg_dp = cfg.get("sequence_parallel_size"), cfg.get("data_parallel_size")
    for key, v in (("sequence_parallel_size", cfg_sp), ("data_parallel_size", cfg_dp)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise SequenceParallelError(f"ds_config '{key}' must be an int >= 1, got {v!r}")
    if sp_size is not None and cfg_sp is not None and int(sp_size) != cfg_sp:
        raise SequenceParallelError(
            f"--sp {sp_size} but the ds_config has sequence_parallel_size={cfg_sp}; give one of them "
            "(or the same value in both)")
    sp = int(sp_size if sp_size is not None else (cfg_sp or 1))
    if sp < 1:
        raise SequenceParallelError(f"the Ulysses degree sp must be >= 1, got {sp}")
    if world_size is not None:
        if world_size % sp:
            raise SequenceParallelError(
                f"the world size {world_size} (ranks) is not divisible by the Ulysses degree sp={sp}: every SP "
                f"group needs {sp} ranks. Use a world size that is a multiple of {sp}, or another sp.")
        if cfg_dp is not None and cfg_dp * sp != world_size:
            raise SequenceParallelError(
                f"ds_config data_parallel_size={cfg_dp} x sp={sp} = {cfg_dp * sp} but the world has "
                f"{world_size} ranks; set data_parallel_size to {world_size // sp} or remove it")
    return sp


def strip_mesh_keys(ds_config: Mapping[str, Any]) -> dict:
    """A copy of the ds_config without ``data_parallel_size`` / ``sequence_parallel_size``.

    With both keys ``deepspeed.initialize`` builds a (dp, sp) device mesh, and DeepSpeed 0.19.8
    then (a) names ZeRO-3 checkpoint shards by the mesh's data-parallel rank, so the SP ranks of a
    group overwrite each other's optimizer states, and (b) reduces ZeRO-0/1/2 gradients over the
    data-parallel dimension only. Without the mesh DeepSpeed treats all ranks as data parallel
    (partitions and checkpoints per rank, averages gradients over the world) and ds_adaptive owns
    the SP groups; :meth:`SequenceParallel.check_engine` gives the matching loss scale.
    """
    return {k: v for k, v in ds_config.items() if k not in MESH_KEYS}


_CREATED: dict[tuple[int, int], SequenceParallel] = {}


def _ensure_deepspeed_comm() -> None:
    """DistributedAttention talks through ``deepspeed.comm``: attach it to an existing torch.distributed."""
    import deepspeed
    import deepspeed.comm as ds_comm

    if not ds_comm.is_initialized():
        deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False, dist_init_required=False)


def _from_megatron(sp_size: Optional[int]) -> Optional[SequenceParallel]:
    # Whoever initialised parallel_state imported it: do not pay megatron's import otherwise.
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None:
        return None
    try:
        if not ps.model_parallel_is_initialized():
            return None
        cp = int(ps.get_context_parallel_world_size() or 1)
        group = ps.get_context_parallel_group() if cp > 1 else None
        dp_group = ps.get_data_parallel_group()
    except (AssertionError, RuntimeError, AttributeError):
        return None
    if sp_size is not None and sp_size != cp:
        raise SequenceParallelError(
            f"sp={sp_size} but megatron-core's parallel_state is initialised with context_parallel_size={cp}; "
            f"pass sp={cp} or initialise parallel_state with context_parallel_size={sp_size}")
    return SequenceParallel(sp_size=cp, sp_rank=dist.get_rank(group) if group is not None else 0,
                            dp_size=dist.get_world_size(dp_group), dp_rank=dist.get_rank(dp_group),
                            group=group, dp_group=dp_group, source="megatron")


def _from_deepspeed_mesh(sp_size: Optional[int]) -> Optional[SequenceParallel]:
    try:
        from deepspeed.utils import groups
    except Exception:
        return None
    mesh = getattr(groups, "mesh_device", None)
    if mesh is None:
        return None
    group = mesh.get_group(mesh_dim="sequence_parallel")
    dp_group = mesh.get_group(mesh_dim="data_parallel")
    sp = dist.get_world_size(group)
    if sp_size is not None and sp_size != sp:
        raise SequenceParallelError(
            f"sp={sp_size} but DeepSpeed's device mesh has sequence_parallel_size={sp}; use the same degree")
    return SequenceParallel(sp_size=sp, sp_rank=dist.get_rank(group), dp_size=dist.get_world_size(dp_group),
                            dp_rank=dist.get_rank(dp_group), group=group if sp > 1 else None,
                            dp_group=dp_group, source="deepspeed-mesh")


def _create(sp: int) -> SequenceParallel:
    world, rank = dist.get_world_size(), dist.get_rank()
    key = (sp, world)
    if key in _CREATED:
        return _CREATED[key]
    if sp == 1:
        out = SequenceParallel(sp_size=1, sp_rank=0, dp_size=world, dp_rank=rank, source="created")
    else:
        # Every rank must create every group, in the same order (torch.distributed.new_group).
        group = dp_group = None
        for g in range(world // sp):
            ranks = list(range(g * sp, (g + 1) * sp))
            pg = dist.new_group(ranks)
            if rank in ranks:
                group = pg
        for r in range(sp):
            ranks = list(range(r, world, sp))
            pg = dist.new_group(ranks)
            if rank in ranks:
                dp_group = pg
        out = SequenceParallel(sp_size=sp, sp_rank=rank % sp, dp_size=world // sp, dp_rank=rank // sp,
                               group=group, dp_group=dp_group, source="created")
    _CREATED[key] = out
    return out


def init_sequence_parallel(sp_size: Optional[int] = None, *, ds_config: Optional[Mapping[str, Any]] = None,
                           num_heads: Optional[int] = None) -> SequenceParallel:
    """The SP layout of this process (call on every rank, after torch.distributed is initialised).

    Groups, first match wins:

    1. megatron-core's ``parallel_state`` when initialised: its context-parallel group;
    2. DeepSpeed's device mesh (``deepspeed.utils.groups.mesh_device``, set by
       ``deepspeed.initialize`` when the ds_config has ``data_parallel_size`` and
       ``sequence_parallel_size``): its ``sequence_parallel`` dimension;
    3. otherwise new groups of ``sp`` consecutive ranks (rank = dp_rank * sp + sp_rank, the layout
       of ``ds_adaptive.balance.sampler.Topology`` and of DeepSpeed's mesh), cached per (sp, world).

    ``sp_size`` defaults to the ds_config's ``sequence_parallel_size`` (see :func:`resolve_sp_size`)
    or to what megatron / the mesh say. ``num_heads`` (if given) must be divisible by sp.
    Without torch.distributed (a single process) the result is sp=1, dp=1.
    """
    if ds_config is not None:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
        sp_size = resolve_sp_size(sp_size, ds_config, world)
    if sp_size is not None and (not isinstance(sp_size, int) or isinstance(sp_size, bool) or sp_size < 1):
        raise SequenceParallelError(f"the Ulysses degree sp must be an int >= 1, got {sp_size!r}")
    if not (dist.is_available() and dist.is_initialized()):
        if sp_size not in (None, 1):
            raise SequenceParallelError(
                f"sp={sp_size} needs torch.distributed: launch {sp_size} or more ranks with the deepspeed "
                "launcher (or torchrun) and call deepspeed.init_distributed() first")
        return SequenceParallel(sp_size=1, sp_rank=0, dp_size=1, dp_rank=0)
    sp = _from_megatron(sp_size) or _from_deepspeed_mesh(sp_size)
    if sp is None:
        want = 1 if sp_size is None else sp_size
        resolve_sp_size(want, None, dist.get_world_size())
        sp = _create(want)
    if num_heads is not None:
        check_heads(int(num_heads), sp.sp_size)
    if sp.enabled:
        _ensure_deepspeed_comm()
    return sp


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

    @property
    def padded_len(self) -> int:
        return -(-self.seq_len // self.sp_size) * self.sp_size

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


def shard_plan(seq_len: int, sp: SequenceParallel) -> SeqShard:
    if seq_len < 1:
        raise ValueError(f"sequence length must be >= 1 token, got {seq_len}")
    return SeqShard(int(seq_len), sp.sp_size, sp.sp_rank)


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


def gather_sequence(x_local: torch.Tensor, sp: SequenceParallel, shard: SeqShard, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: the full ``[.., seq_len, ..]`` tensor on every rank of the group
    (padding dropped). Differentiable; see ``_GatherSequence`` for the gradient convention (every rank
    of the group must compute the same loss from the result)."""
    if not sp.enabled:
        return x_local
    if x_local.shape[dim] != shard.local_len:
        raise ValueError(f"local tensor has {x_local.shape[dim]} positions along dim {dim}, the shard "
                         f"plan {shard.local_len}")
    full = _GatherSequence.apply(x_local, sp.group, sp.sp_size, sp.sp_rank, dim)
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
        return sdpa_attention(q, k, v)
    if valid_len < 1:
        raise ValueError(f"valid_len must be >= 1, got {valid_len}")
    out = sdpa_attention(q[:, :valid_len], k[:, :valid_len], v[:, :valid_len])
    return F.pad(out, (0, 0, 0, 0, 0, s - valid_len))


def make_ulysses_attention(sp: SequenceParallel, local_attention=valid_len_attention):
    """The attention fn for ``WanModel.set_attention``: DeepSpeed's DistributedAttention over the
    SP group (all-to-all over heads, scatter_idx=2, gather_idx=1, batch dim 0) around
    ``local_attention`` (which receives ``valid_len``)."""
    from deepspeed.sequence.layer import DistributedAttention

    dist_attn = DistributedAttention(local_attention, sp.group, scatter_idx=2, gather_idx=1)

    def ulysses_attention(q, k, v, **kwargs):
        return dist_attn(q, k, v, 0, None, **kwargs)

    ulysses_attention.distributed_attention = dist_attn
    return ulysses_attention


# ============================================================================== the model wrapper
@dataclass
class LocalOutput:
    """This rank's part of the model output, in patch-token space."""

    tokens: torch.Tensor
    """[B, local_len, C*pt*ph*pw] head output of the local (padded) shard, activation dtype."""
    shard: SeqShard
    """Where the shard sits in the sequence."""
    grid: tuple[int, int, int]
    """(F, H, W) token grid of the sample."""

    @property
    def valid_tokens(self) -> torch.Tensor:
        """[B, shard.valid, C*pt*ph*pw]: the real tokens of the shard (padding dropped)."""
        return self.tokens[:, :self.shard.valid]


class UlyssesWan:
    """Runs a :class:`WanModel` with its token sequence sharded over an SP group.

    Construction installs the Ulysses attention (DistributedAttention) on every block when
    ``sp.sp_size > 1``; with sp=1 every method reduces to the plain model (same numerics).
    The object holds no parameters: it drives ``model.embed / rope / run_blocks / head``, so the
    model's parameter names, checkpoints and ZeRO-3 hooks are unchanged. Call it through the
    DeepSpeed engine (:func:`apply_ulysses` routes ``model.forward`` here), so that DeepSpeed's
    forward/backward hooks run.
    """

    def __init__(self, model: WanModel, sp: SequenceParallel) -> None:
        check_heads(model.config.num_heads, sp.sp_size, what=f"this Wan model (dim {model.config.dim})")
        self.model = model
        self.sp = sp
        if sp.enabled:
            model.set_attention(make_ulysses_attention(sp))

    # ---------------------------------------------------------------- shapes
    def plan(self, seq_len: int) -> SeqShard:
        return shard_plan(seq_len, self.sp)

    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, T', H', W'] -> [B, S, pt*ph*pw*C] (the head's token layout, channels fastest)."""
        pt, ph, pw = self.model.config.patch_size
        return rearrange(x, "b c (f pt) (h ph) (w pw) -> b (f h w) (pt ph pw c)", pt=pt, ph=ph, pw=pw)

    def shard_target(self, target: torch.Tensor, shard: SeqShard) -> torch.Tensor:
        """The real tokens of this rank's shard of a full target ``[B, C, T', H', W']``:
        ``[B, shard.valid, C*pt*ph*pw]``, aligned with :attr:`LocalOutput.valid_tokens`."""
        tokens = self.patchify(target)
        if tokens.shape[1] != shard.seq_len:
            raise ValueError(f"target has {tokens.shape[1]} tokens, the model output {shard.seq_len}: "
                             "give the target the latents' shape")
        grid = tuple(n // p for n, p in zip(target.shape[2:], self.model.config.patch_size))
        tokens = self.model.order_tokens(tokens, grid)  # the model's token order (cube order under sparse attention)
        return tokens[:, shard.start:shard.start + shard.valid]

    # ---------------------------------------------------------------- forward
    def forward_local(self, latents: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor) -> LocalOutput:
        """Embed the full batch, keep this rank's shard, run the blocks and the head on it."""
        model = self.model
        inputs: WanInputs = model.embed(latents, timestep, context)
        shard = self.plan(inputs.tokens.shape[1])
        x = shard_sequence(inputs.tokens, shard, dim=1)
        inputs.tokens = x  # drop the full [B, S, D] tokens (x is a copy)
        freqs = shard_sequence(model.rope(inputs.grid, x.device), shard, dim=0)
        x = model.run_blocks(x, inputs, freqs, **shard.attn_kwargs)
        return LocalOutput(tokens=model.head(x, inputs.time_emb), shard=shard, grid=inputs.grid)

    def forward(self, latents: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """The full output ``[B, C, T', H', W']`` on every rank of the group (all-gathered)."""
        out = self.forward_local(latents, timestep, context)
        tokens = gather_sequence(out.tokens, self.sp, out.shard, dim=1)
        return self.model.unpatchify(tokens, out.grid)

    def per_sample_loss(self, latents: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                        target: torch.Tensor) -> torch.Tensor:
        """This rank's part of every sample's MSE: ``[B]`` fp32,
        ``sum over the shard's real tokens of (out - target)^2 / (elements per sample)``.

        Summed over the SP group it is the per-sample ``mean((out - target)^2)`` of the full output
        (sp=1: exactly that). Backpropagate it scaled by :meth:`SequenceParallel.check_engine`'s scale.
        """
        if target.shape != latents.shape[:1] + (self.model.config.out_channels,) + latents.shape[2:]:
            raise ValueError(f"target must be [B, {self.model.config.out_channels}, T', H', W'] like the latents "
                             f"{list(latents.shape)}, got {list(target.shape)}")
        out = self.forward_local(latents, timestep, context)
        tgt = self.shard_target(target, out.shard)
        numel = math.prod(target.shape[1:])
        return (out.valid_tokens.float() - tgt.float()).square().sum(dim=(1, 2)) / numel

    __call__ = forward

    def __deepcopy__(self, memo):
        # copy.deepcopy(model) (an EMA copy, say) copies this too: the copy drives the copied model over the
        # same process groups (groups cannot be copied; the attention fn is shared, it holds no state).
        new = object.__new__(UlyssesWan)
        memo[id(self)] = new
        new.model = copy.deepcopy(self.model, memo)
        new.sp = self.sp
        return new


def apply_ulysses(model: WanModel, sp: SequenceParallel) -> UlyssesWan:
    """Install Ulysses on ``model`` and route ``model.forward`` through it (idempotent).

    After this, ``model(latents, timestep, context)`` returns the full (gathered) output and
    ``model(latents, timestep, context, target=v)`` returns :meth:`UlyssesWan.per_sample_loss`
    (``[B]`` fp32 partial MSE, the loss-on-shards path; with sp=1 the plain per-sample MSE). Both
    go through ``engine(...)`` unchanged, so DeepSpeed's hooks run. Call before or after
    ``deepspeed.initialize``; the parameters are untouched. The original forward is kept in
    ``model.forward.__wrapped__``; :func:`remove_ulysses` restores it.
    """
    prev = getattr(model, _PATCH_MARKER, None)
    if prev is not None:
        if prev.sp is sp or prev.sp == sp:
            return prev
        remove_ulysses(model)
    uw = UlyssesWan(model, sp)
    original = type(model).forward

    def forward(self, latents, timestep, context, target=None):
        uw = getattr(self, _PATCH_MARKER)  # looked up per call: a deepcopy of the model drives its own weights
        if target is None:
            return uw.forward(latents, timestep, context)
        return uw.per_sample_loss(latents, timestep, context, target)

    forward.__wrapped__ = original
    forward.__doc__ = ("Ulysses forward (ds_adaptive.parallel.apply_ulysses): full output, or with target= "
                       "the per-sample partial MSE [B] of this rank's shard.")
    object.__setattr__(model, "forward", types.MethodType(forward, model))
    object.__setattr__(model, _PATCH_MARKER, uw)
    return uw


def remove_ulysses(model: WanModel) -> None:
    """Undo :func:`apply_ulysses`: the class forward and the default attention."""
    if getattr(model, _PATCH_MARKER, None) is None:
        return
    model.__dict__.pop("forward", None)
    model.__dict__.pop(_PATCH_MARKER, None)
    model.set_attention(None)
