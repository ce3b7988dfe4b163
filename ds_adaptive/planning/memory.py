"""Memory-aware activation checkpointing: per micro-batch, how many blocks to checkpoint.

Activation checkpointing trades memory for compute: a checkpointed block keeps only its input for
backward and runs its forward a second time there. Checkpointing every block (the old default)
leaves most of a large GPU idle and pays the recomputed forwards for micro-batches that would fit without
it. The *checkpoint plan* checkpoints, for each micro-batch ``(B, S)``, the fewest blocks ``n`` such
that its activations fit the memory budget ``m_mem`` (GiB, static memory already taken out)::

    n(B, S) = min { n in 0..L-1 : B * mem(S, n) <= m_mem }          (policy "auto")

with ``mem(S, n) = E + n c + max(L - n, 1) g + (d if n < L)`` per sample (:meth:`CostModel.ckpt_memory`).
``n`` is the count of the FIRST blocks (closest to the input): backward reaches them last, when the
whole blocks after them have already been freed. ``n = L`` is chosen only when ``n = L - 1`` does not
fit and checkpointing the last block as well holds less (the profile's last-block term ``d``, the
head's backward on top of a whole last block, exceeds the block input ``c`` in the shipped H200 Wan 1.3B
profiles); profiles without ``d`` never choose it. When nothing fits, the fewest-memory count is returned;
the planner never forms such a batch (its feasibility check is that count's memory, :func:`sample_memory`).

The plan is a pure function of (B, S, profile, m_mem, policy): identical on every rank of a
micro-step (they hold the same batch, or, across DP ranks, their own batch of the same plan), and
a resumed run reproduces it from the sampler state, which stores the profile and the budgets. The
cost model adds the recomputed forward of exactly those ``n`` blocks (:meth:`CostModel.ckpt_cost`),
so the planner balances the true cost. Policies ``all`` (every block; the old ``--grad-ckpt``) and
``none`` give ``L`` and ``0``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import numpy as np

from ds_adaptive.planning.cost import CostModel
from ds_adaptive.planning.profile import CHECKPOINT_POLICIES
from ds_adaptive.core.shapes import SampleShape

__all__ = ["checkpoint_blocks", "fewest_memory_blocks", "micro_batch_table", "MicroBatchTable", "policy_blocks",
           "sample_memory",
           "model_checkpoint_blocks", "CHECKPOINT_POLICIES"]


def checkpoint_blocks(cost: CostModel, shape: Union[SampleShape, int], batch_sizes, m_mem: float,
                      policy: str = None) -> np.ndarray:
    """Blocks to checkpoint (the first ``n``) for micro-batches of ``batch_sizes`` samples of
    ``shape`` under the activation budget ``m_mem`` GiB; ``policy`` defaults to ``cost.checkpointing``.
    Returns an int array shaped like ``batch_sizes`` (a 0-d array for a scalar)."""
    policy = cost.checkpointing if policy is None else policy
    if policy not in CHECKPOINT_POLICIES:
        raise ValueError(f"checkpointing policy must be one of {list(CHECKPOINT_POLICIES)}, got {policy!r}")
    bs = np.asarray(batch_sizes, dtype=np.int64)
    L = cost.num_layers
    if policy == "all":
        return np.full(bs.shape, L, np.int64)
    if policy == "none" or L == 1:
        return np.zeros(bs.shape, np.int64)
    # mem(n) is linear in n on 0..L-1: mem(0) + n * (mem(1) - mem(0)) per sample (slope < 0 when a
    # whole block holds more than its input); solve, then step up where rounding left it over budget.
    m0 = cost.ckpt_memory(shape, 1, 0)
    slope = cost.ckpt_memory(shape, 1, 1) - m0
    if slope >= 0:
        return np.zeros(bs.shape, np.int64)
    need = (bs * m0 - m_mem) / (bs * -slope)
    n = np.clip(np.ceil(need - 1e-9), 0, L - 1).astype(np.int64)
    over = (cost.ckpt_memory(shape, bs, n) > m_mem * (1 + 1e-12)) & (n < L - 1)
    n = np.where(over, n + 1, n)
    if fewest_memory_blocks(cost, shape) == L:   # L - 1 over budget: the last block checkpointed too holds less
        n = np.where((n == L - 1) & (cost.ckpt_memory(shape, bs, n) > m_mem * (1 + 1e-12)), L, n)
    return n


def fewest_memory_blocks(cost: CostModel, shape: Union[SampleShape, int]) -> int:
    """The checkpoint count of the policy that holds the least activation memory for ``shape``: ``all``
    L, ``none`` 0; ``auto`` L - 1, or L when the profile's last-block term makes every block checkpointed
    smaller (:meth:`CostModel.ckpt_memory`; the per-sample / per-token terms make it shape-dependent)."""
    n = policy_blocks(cost, fewest_memory=True)
    L = cost.num_layers
    if cost.checkpointing == "auto" and L > 1 and cost.ckpt_memory(shape, 1, L) < cost.ckpt_memory(shape, 1, L - 1):
        return L
    return n


def model_checkpoint_blocks(n: int, plan_blocks: int, model_blocks: int) -> int:
    """The plan's count ``n`` of ``plan_blocks`` (the profile's depth) for a model of ``model_blocks``: the
    same share of blocks, rounded up (never fewer checkpointed than planned), ``n`` itself when the depths
    agree. A model trained without ``--layers`` at another depth than its profile (``tiny`` planned with the
    30-block 1.3B profile on CPU) gets ``ceil(n x model / plan)`` instead of ``min(n, model)`` (which made
    any n >= 2 of 30 checkpoint both blocks of ``tiny``)."""
    n, plan_blocks, model_blocks = int(n), int(plan_blocks), int(model_blocks)
    if plan_blocks == model_blocks or plan_blocks < 1:
        return n
    return min(model_blocks, -(-n * model_blocks // plan_blocks))


@dataclass(frozen=True)
class MicroBatchTable:
    """For one shape, micro-batches of ``B = 0..len-1`` samples (row 0 unused): the checkpointed
    blocks, the predicted activation memory (GiB) and the compute cost (cost unit) with them."""

    ckpt: np.ndarray
    memory: np.ndarray
    cost: np.ndarray


def micro_batch_table(cost: CostModel, shape: Union[SampleShape, int], max_batch: int, m_mem: float,
                      policy: str = None) -> MicroBatchTable:
    """:class:`MicroBatchTable` for ``B = 0..max_batch``; cost is non-decreasing in B (more samples,
    and at least as many checkpointed blocks)."""
    bs = np.arange(max(int(max_batch), 0) + 1, dtype=np.int64)
    n = checkpoint_blocks(cost, shape, np.maximum(bs, 1), m_mem, policy)
    mem = cost.ckpt_memory(shape, bs, n)
    c = cost.ckpt_cost(shape, bs, n)
    c = np.where(bs == 0, 0.0, c)
    return MicroBatchTable(ckpt=n, memory=np.asarray(mem, float), cost=np.asarray(c, float))


def policy_blocks(cost: CostModel, *, fewest_memory: bool = False) -> int:
    """The fixed count of a policy (``all``: L, ``none``: 0); for ``auto`` -1 (it varies per batch), or
    with ``fewest_memory`` L - 1 (0 for a single block): the fewest-memory count of profiles without a
    last-block term (:func:`fewest_memory_blocks` decides per shape)."""
    L = cost.num_layers
    if cost.checkpointing == "all":
        return L
    if cost.checkpointing == "none":
        return 0
    return max(L - 1, 0) if fewest_memory else -1


def sample_memory(cost: CostModel, shape: Union[SampleShape, int]) -> float:
    """Activation memory (GiB) of ONE sample at the policy's fewest-memory checkpoint count: what a
    batch must fit at least (the planner's feasibility check). The profile's own fit when the policy
    is the profile's calibration."""
    n = fewest_memory_blocks(cost, shape)
    if cost.as_profiled(n):
        return cost.per_gpu_memory(shape)
    return float(cost.ckpt_memory(shape, 1, n))


#: The allocator configuration the trainer, the launcher and ``calibrate`` use unless the user set one:
#: expandable segments grow one mapping instead of caching fixed-size blocks per shape, so changing
#: micro-batch shapes do not strand reserved-but-unallocated memory (without it a 1.3B run of the
#: equal-token baseline ran out of memory with a large share of the GPU reserved and unallocated).
ALLOCATOR_CONF = "expandable_segments:True"


def configure_allocator(environ=None) -> str:
    """Set ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless the user set it (call before
    the first CUDA allocation); returns the log line saying which one is in effect."""
    import os

    env = os.environ if environ is None else environ
    given = env.get("PYTORCH_CUDA_ALLOC_CONF")
    if given == ALLOCATOR_CONF:  # e.g. exported by launch/train_wan.sh: nobody chose anything else
        return f"ds_adaptive: PYTORCH_CUDA_ALLOC_CONF={ALLOCATOR_CONF} (fragmentation-safe allocator, the default)"
    if given is not None:
        return (f"ds_adaptive: PYTORCH_CUDA_ALLOC_CONF={given!r} from the environment: kept (the memory budget's "
                f"fragmentation margin was measured with {ALLOCATOR_CONF!r})")
    env["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATOR_CONF
    return (f"ds_adaptive: PYTORCH_CUDA_ALLOC_CONF={ALLOCATOR_CONF} (fragmentation-safe allocator for changing "
            "micro-batch shapes; set PYTORCH_CUDA_ALLOC_CONF yourself to override)")
