"""Where this process sits in the (data-parallel x sequence-parallel) layout: one ``Layout`` type.

``world = dp_size * sp_size`` model replicas x Ulysses ranks (tensor/pipeline ranks of a Megatron
replica share a dp_rank and are not counted here). The ``sp_size`` ranks of one SP group share
``dp_rank``, receive identical batches and each hold ``1/sp`` of every sample's tokens; rank
``dp_rank * sp_size + sp_rank`` when the groups are ours (consecutive ranks form an SP group, the
layout of DeepSpeed's mesh too).

Constructors (first match wins in :meth:`Layout.detect`):

* :meth:`Layout.from_megatron`: megatron-core ``parallel_state`` (its context-parallel group is the
  SP group), when initialised;
* :meth:`Layout.from_deepspeed`: DeepSpeed's ``(dp, sp)`` device mesh or its ``mpu``;
* :meth:`Layout.from_torch_distributed`: new groups of ``sp`` consecutive ranks (cached);
* :meth:`Layout.explicit`: numbers only, no process group (the dry run, the simulator, tests).

Validation happens once, in :meth:`Layout.validate` (sp divides the heads and the world). The
SP-specific collectives (``group_sum``, ``assert_replicated``) and the DeepSpeed engine check hang
off the layout; the sharding itself lives in ``ds_adaptive.parallel``.
"""
from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

__all__ = ["Layout", "SequenceParallelError", "MESH_KEYS", "resolve_sp_size", "strip_mesh_keys"]

MESH_KEYS = ("data_parallel_size", "sequence_parallel_size")
"""ds_config keys that make ``deepspeed.initialize`` build a (dp, sp) device mesh."""


class SequenceParallelError(ValueError):
    """A sequence-parallel (Ulysses) layout that cannot work: sp vs heads, world size, groups, engine."""


def _check_degree(sp: Any) -> int:
    if not isinstance(sp, int) or isinstance(sp, bool) or sp < 1:
        raise SequenceParallelError(f"the Ulysses degree sp must be an int >= 1, got {sp!r}")
    return sp


def _dist():
    """torch.distributed when it is initialised, else None (the layout stays importable without torch)."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return None
    return dist if dist.is_available() and dist.is_initialized() else None



def heads_sp_problem(num_heads: int, sp: int, what: str = "the model",
                     context_parallel: str = "heads") -> Optional[str]:
    """Ulysses gives each rank of an SP group heads/sp whole heads: sp must divide the heads. With hybrid context
    parallelism (``adaptive_load.sparse_attention.context_parallel`` ``sequence`` / ``auto``: a head-wise group of
    a divisor of the heads times a sequence-wise group) any sp >= 1 runs."""
    if sp >= 1 and (num_heads % sp == 0 or context_parallel != "heads"):
        return None
    divisors = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
    return (f"Ulysses sp={sp} does not divide the {num_heads} attention heads of {what}: each rank of an SP group "
            f"attends with heads/sp whole heads. Use sp in {divisors}, or set adaptive_load.sparse_attention."
            "context_parallel to 'sequence' or 'auto' (sequence-wise sparse attention has no head limit).")


@dataclass(frozen=True)
class Layout:
    """This process's place in the (dp, sp) layout and the process groups it talks over.

    ``sp_group`` is the SP group (None when ``sp_size == 1`` or without torch.distributed);
    ``sp_rank`` is the rank inside it (shard ``sp_rank`` of the sequence lives here);
    ``dp_group`` joins the ranks with the same ``sp_rank`` (None = the default group when sp=1).
    ``source`` says where the numbers came from: ``megatron``, ``deepspeed-mesh``,
    ``deepspeed-mpu``, ``created`` (our groups), ``explicit`` (numbers, no process group).
    """

    dp_size: int = 1
    dp_rank: int = 0
    sp_size: int = 1
    sp_rank: int = 0
    rank: int = -1
    """Global rank (default ``dp_rank * sp_size + sp_rank``)."""
    world: int = 0
    """Processes in the job (default ``dp_size * sp_size``; more under Megatron tensor/pipeline parallelism)."""
    sp_group: Any = field(default=None, compare=False)
    dp_group: Any = field(default=None, compare=False)
    source: str = "explicit"
    context_parallel: str = "heads"
    """How self-attention runs over the SP group (``adaptive_load.sparse_attention.context_parallel``):
    ``heads`` = Ulysses; ``sequence`` / ``auto`` = hybrid meshes, sp not bounded by the heads."""

    def __post_init__(self) -> None:
        for name in ("dp_size", "sp_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise SequenceParallelError(f"Layout.{name} must be an int >= 1, got {v!r}")
        if not 0 <= self.dp_rank < self.dp_size or not 0 <= self.sp_rank < self.sp_size:
            raise SequenceParallelError(f"rank out of range: dp_rank {self.dp_rank} / {self.dp_size}, "
                                        f"sp_rank {self.sp_rank} / {self.sp_size}")
        if self.rank < 0:
            object.__setattr__(self, "rank", self.dp_rank * self.sp_size + self.sp_rank)
        if self.world < 1:
            object.__setattr__(self, "world", self.dp_size * self.sp_size)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def explicit(cls, *, dp_size: int = 1, sp_size: int = 1, dp_rank: int = 0, sp_rank: int = 0) -> "Layout":
        """A layout from numbers, with no process group (dry run, simulator, planning on paper)."""
        return cls(dp_size=dp_size, dp_rank=dp_rank, sp_size=sp_size, sp_rank=sp_rank, source="explicit")

    @classmethod
    def for_world(cls, world: int, sp_size: int = 1, rank: int = 0) -> "Layout":
        """``world`` ranks in SP groups of ``sp_size`` consecutive ranks, seen from ``rank`` (no process group)."""
        _check_degree(sp_size)
        if world < 1 or world % sp_size:
            raise SequenceParallelError(
                f"the world size {world} (ranks) is not divisible by the Ulysses degree sp={sp_size}: every SP "
                f"group needs {sp_size} ranks. Use a world size that is a multiple of {sp_size}, or another sp.")
        return cls.explicit(dp_size=world // sp_size, sp_size=sp_size, dp_rank=rank // sp_size,
                            sp_rank=rank % sp_size)

    @classmethod
    def from_megatron(cls, sp_size: Optional[int] = None) -> Optional["Layout"]:
        """From megatron-core's parallel_state (context-parallel group = SP group); None when not initialised."""
        ps = sys.modules.get("megatron.core.parallel_state")  # whoever initialised it imported it
        dist = _dist()
        if ps is None or dist is None:
            return None
        try:
            if not ps.model_parallel_is_initialized():
                return None
            cp = int(ps.get_context_parallel_world_size() or 1)
            group = ps.get_context_parallel_group() if cp > 1 else None
            dp_group = ps.get_data_parallel_group()
        except (AssertionError, RuntimeError, AttributeError):
            return None
        _agree(sp_size, cp, "megatron-core's parallel_state is initialised with context_parallel_size")
        return cls(dp_size=dist.get_world_size(dp_group), dp_rank=dist.get_rank(dp_group), sp_size=cp,
                   sp_rank=dist.get_rank(group) if group is not None else 0, rank=dist.get_rank(),
                   world=dist.get_world_size(), sp_group=group, dp_group=dp_group, source="megatron")

    @classmethod
    def from_deepspeed(cls, sp_size: Optional[int] = None) -> Optional["Layout"]:
        """From DeepSpeed's (dp, sp) device mesh or its sequence-parallel ``mpu``; None when neither is set."""
        dist = _dist()
        if dist is None:
            return None
        try:
            from deepspeed.utils import groups
        except Exception:
            return None
        mesh, mpu = getattr(groups, "mesh_device", None), getattr(groups, "mpu", None)
        try:
            if mesh is not None:
                group = mesh.get_group(mesh_dim="sequence_parallel")
                dp_group = mesh.get_group(mesh_dim="data_parallel")
                sp, source = dist.get_world_size(group), "deepspeed-mesh"
                sp_rank, dp, dp_rank = dist.get_rank(group), dist.get_world_size(dp_group), dist.get_rank(dp_group)
            elif mpu is not None and hasattr(mpu, "get_sequence_parallel_world_size"):
                sp, sp_rank, source = mpu.get_sequence_parallel_world_size(), mpu.get_sequence_parallel_rank(), \
                    "deepspeed-mpu"
                group = mpu.get_sequence_parallel_group() if hasattr(mpu, "get_sequence_parallel_group") else None
                dp_group = mpu.get_data_parallel_group() if hasattr(mpu, "get_data_parallel_group") else None
                dp = dist.get_world_size() // sp
                dp_rank = mpu.get_data_parallel_rank() if hasattr(mpu, "get_data_parallel_rank") else dist.get_rank() // sp
            else:
                return None
        except (KeyError, AssertionError, RuntimeError):
            return None
        _agree(sp_size, sp, "DeepSpeed's groups have sequence_parallel_size")
        return cls(dp_size=dp, dp_rank=dp_rank, sp_size=sp, sp_rank=sp_rank, rank=dist.get_rank(),
                   world=dist.get_world_size(), sp_group=group if sp > 1 else None, dp_group=dp_group,
                   source=source)

    @classmethod
    def from_torch_distributed(cls, sp_size: int = 1) -> "Layout":
        """New SP groups of ``sp_size`` consecutive ranks (and DP groups across them), cached per (sp, world).
        A collective: every rank must call it, in the same order."""
        dist = _dist()
        if dist is None:
            if _check_degree(sp_size) != 1:
                raise SequenceParallelError(
                    f"sp={sp_size} needs torch.distributed: launch {sp_size} or more ranks with the deepspeed "
                    "launcher (or torchrun) and call deepspeed.init_distributed() first")
            return cls.explicit()
        world, rank = dist.get_world_size(), dist.get_rank()
        shape = cls.for_world(world, sp_size, rank)  # validates world % sp
        key = (sp_size, world)
        if key not in _CREATED:
            groups = _new_groups(dist, world, rank, sp_size) if sp_size > 1 else (None, None)
            _CREATED[key] = cls(dp_size=shape.dp_size, dp_rank=shape.dp_rank, sp_size=sp_size,
                                sp_rank=shape.sp_rank, rank=rank, world=world, sp_group=groups[0],
                                dp_group=groups[1], source="created")
        return _CREATED[key]

    @classmethod
    def detect(cls, sp_size: Optional[int] = None, *, ds_config: Optional[Mapping[str, Any]] = None) -> "Layout":
        """The layout of this process: megatron-core, else DeepSpeed's groups, else our own groups of
        ``sp_size`` consecutive ranks (default: the ds_config's ``sequence_parallel_size``, else 1), else
        (no torch.distributed) a single process. Call on every rank."""
        dist = _dist()
        if ds_config is not None:
            sp_size = resolve_sp_size(sp_size, ds_config, dist.get_world_size() if dist is not None else None)
        if sp_size is not None:
            _check_degree(sp_size)
        found = cls.from_megatron(sp_size) or cls.from_deepspeed(sp_size)
        if found is None:
            found = cls.from_torch_distributed(1 if sp_size is None else sp_size)
        if found.sp_size > 1:
            _ensure_deepspeed_comm()
        return found

    # ------------------------------------------------------------------ validation (once)
    def validate(self, *, num_heads: Optional[int] = None, what: str = "the model") -> "Layout":
        """Check that sp divides the world and ``num_heads`` (Ulysses gives each rank heads/sp whole heads).
        Returns self, so ``Layout.detect(sp).validate(num_heads=h)`` reads as one step."""
        if self.world % self.sp_size:
            raise SequenceParallelError(f"the world size {self.world} is not divisible by the Ulysses degree "
                                        f"sp={self.sp_size}: every SP group needs {self.sp_size} ranks")
        if num_heads is not None:
            problem = heads_sp_problem(num_heads, self.sp_size, what, self.context_parallel)
            if problem:
                raise SequenceParallelError(problem)
        return self

    # ------------------------------------------------------------------ properties
    @property
    def sp_enabled(self) -> bool:
        """True when the sequence is really split (sp_size > 1)."""
        return self.sp_size > 1

    @property
    def world_size(self) -> int:
        """dp_size x sp_size: the ranks that see data (the world, without Megatron TP/PP)."""
        return self.dp_size * self.sp_size

    @property
    def loss_scale(self) -> float:
        """Factor on each SP rank's partial loss under DeepSpeed's world-mean gradient reduction
        (== sp_size; docs/ULYSSES.md); :meth:`check_engine` verifies the engine reduces that way."""
        return float(self.sp_size)

    def describe(self) -> str:
        return (f"sp {self.sp_rank}/{self.sp_size}, dp {self.dp_rank}/{self.dp_size} "
                f"(world {self.world}, groups: {self.source})")

    # ------------------------------------------------------------------ SP collectives
    def group_sum(self, t):
        """Sum of ``t`` (detached) over the SP group, e.g. the full per-sample losses from the partial
        ones; ``t`` itself (detached) when sp=1. A collective: call on every rank of the group."""
        t = t.detach()
        if not self.sp_enabled:
            return t
        import torch.distributed as dist

        out = t.clone()
        dist.all_reduce(out, group=self.sp_group)
        return out

    def assert_replicated(self, *tensors, what: str = "the batch") -> None:
        """Raise unless every rank of the SP group holds the same values in ``tensors`` (an fp64
        checksum per tensor; a collective). A rank that draws its own noise silently breaks Ulysses."""
        if not self.sp_enabled:
            return
        import torch
        import torch.distributed as dist

        sums = torch.stack([torch.stack([t.detach().double().sum(), t.detach().double().square().sum()])
                            for t in tensors]).flatten()
        gathered = [torch.empty_like(sums) for _ in range(self.sp_size)]
        dist.all_gather(gathered, sums, group=self.sp_group)
        for r, other in enumerate(gathered):
            if not torch.allclose(other, sums, rtol=1e-12, atol=0.0):
                bad = [i for i in range(len(tensors))
                       if not torch.allclose(other[2 * i:2 * i + 2], sums[2 * i:2 * i + 2], rtol=1e-12)]
                raise SequenceParallelError(
                    f"{what} differs between SP ranks {self.sp_rank} and {r} (tensor(s) {bad} of {len(tensors)}): "
                    "all ranks of an SP group must get identical inputs. Draw noise / timesteps from per-sample "
                    "seeds (ds_adaptive.models.objective) and give the group the same batch (the sampler indexes "
                    "its plan by dp_rank only).")

    def check_engine(self, engine) -> float:
        """Check that ``engine`` (a DeepSpeedEngine) averages gradients over all dp*sp ranks, as the loss
        scaling assumes, and return the loss scale (``sp_size``; 1.0 without SP).

        DeepSpeed 0.19.8 (verified on gloo, tests/integration/test_ulysses_zero3.py): without a (dp, sp) mesh every
        ZeRO stage averages over the world; with a mesh ZeRO-3 with ``reduce_scatter: true`` does too;
        ZeRO-0/1/2 with a mesh and ZeRO-3 with ``reduce_scatter: false`` do not and are rejected.
        """
        if not self.sp_enabled:
            return 1.0
        import torch.distributed as dist

        world = dist.get_world_size()
        stage = int(engine.zero_optimization_stage())
        ds_sp = int(getattr(engine, "sequence_parallel_size", 1) or 1)
        fix = ("Remove 'data_parallel_size' and 'sequence_parallel_size' from the ds_config "
               "(ds_adaptive.core.layout.strip_mesh_keys) and let ds_adaptive create the SP groups")
        if ds_sp not in (1, self.sp_size):
            raise SequenceParallelError(f"DeepSpeed's engine has sequence_parallel_size={ds_sp} but the SP groups "
                                        f"have sp={self.sp_size}; use the same degree in the ds_config and --sp")
        if ds_sp > 1:
            _check_mesh_engine(engine, stage, self.sp_size, fix)
        if stage == 3:
            for name, p in engine.module.named_parameters():
                g = getattr(p, "ds_process_group", None)
                n = dist.get_world_size(g) if g is not None else world
                if n != world:
                    raise SequenceParallelError(
                        f"parameter {name} is ZeRO-3 partitioned over {n} ranks, not the world ({world}): the "
                        "gradient reduction would not include every SP rank. Build the model under "
                        "deepspeed.zero.Init without data_parallel_group (or without zero.Init).")
        else:
            n = int(getattr(engine, "seq_dp_world_size", world))
            if n != world:
                raise SequenceParallelError(f"DeepSpeed reduces gradients over {n} ranks, not the world ({world}); "
                                            f"{fix}.")
        return self.loss_scale


def _check_mesh_engine(engine, stage: int, sp: int, fix: str) -> None:
    if stage < 3:
        raise SequenceParallelError(
            f"ZeRO stage {stage} with DeepSpeed's (dp, sp) mesh: DeepSpeed 0.19.8 reduces gradients only over the "
            f"mesh's data_parallel dimension, so the SP ranks of a group would train different weights. {fix}, "
            "or use ZeRO-3.")
    if not engine.zero_reduce_scatter():
        raise SequenceParallelError(
            "zero_optimization.reduce_scatter=false with DeepSpeed's (dp, sp) mesh: DeepSpeed 0.19.8 divides the "
            f"gradients of small buckets by dp and of large ones by dp*sp. Set reduce_scatter to true, or: {fix}.")
    warnings.warn(
        "DeepSpeed's (dp, sp) mesh is active: DeepSpeed 0.19.8 names ZeRO-3 checkpoint shards by the data_parallel "
        f"rank, so the {sp} SP ranks of a group overwrite each other's optimizer-state files on save_checkpoint. "
        f"{fix}.", stacklevel=3)


def _agree(wanted: Optional[int], found: int, source: str) -> None:
    if wanted is not None and wanted != found:
        raise SequenceParallelError(f"sp={wanted} but {source}={found}; pass sp={found} or set up the groups "
                                    f"with {wanted}")


_CREATED: dict = {}


def _new_groups(dist, world: int, rank: int, sp: int) -> tuple:
    """(SP group, DP group) of this rank; every rank creates every group in the same order."""
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
    return group, dp_group


def _ensure_deepspeed_comm() -> None:
    """DistributedAttention talks through ``deepspeed.comm``: attach it to an existing torch.distributed."""
    import deepspeed
    import deepspeed.comm as ds_comm
    import torch.distributed as dist

    if not ds_comm.is_initialized():
        deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False, dist_init_required=False)


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
        raise SequenceParallelError(f"--sp {sp_size} but the ds_config has sequence_parallel_size={cfg_sp}; give "
                                    "one of them (or the same value in both)")
    sp = _check_degree(int(sp_size if sp_size is not None else (cfg_sp or 1)))
    if world_size is not None:
        Layout.for_world(world_size, sp)
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
    data-parallel dimension only. Without the mesh DeepSpeed treats all ranks as data parallel and
    ds_adaptive owns the SP groups; :meth:`Layout.check_engine` gives the matching loss scale.
    """
    return {k: v for k, v in ds_config.items() if k not in MESH_KEYS}
