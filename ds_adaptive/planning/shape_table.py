"""Per unique shape: the batch sizes and costs that the planner's budgets allow (``ShapeTable``)."""
from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

import numpy as np

from ds_adaptive.core.shapes import IndexedShapes, SampleShape
from ds_adaptive.planning.cost import CostModel
from ds_adaptive.planning.memory import MicroBatchTable, micro_batch_table, policy_blocks, sample_memory
from ds_adaptive.planning.plan_types import Bucket, PlanError, PlannerParams, bucket_tokens


class ShapeTable:
    """Per unique shape: per-sample cost/memory, largest feasible batch, tokens.

    When the cost model's checkpointing policy is the profile's own calibration (``all`` blocks of a
    checkpointed calibration), a batch costs ``c0 + B x cost1`` and holds ``B x mem1`` (``linear``).
    Otherwise (``auto``: the checkpoint plan of :mod:`ds_adaptive.planning.memory` decides per batch)
    costs, memory and checkpointed blocks come from a per-shape :class:`MicroBatchTable` over B;
    ``mem1`` is then the per-sample memory at the policy's fewest-memory count (feasibility)."""

    def __init__(self, shapes: Sequence[SampleShape], cost: CostModel, params: PlannerParams,
                 tables: Optional[Mapping[SampleShape, MicroBatchTable]] = None) -> None:
        """``tables``: :class:`MicroBatchTable` of some shapes for this ``cost`` and ``params.m_mem`` (no budget
        changes them: the budget search builds them once for all its candidates); the others are built here."""
        self.shapes = list(shapes)
        n = len(self.shapes)
        # per-micro-batch cost of each shape: c0 (+ the sparse selection's fixed part per call)
        self.c0 = np.array([cost.batch_overhead(s) for s in self.shapes], float)
        self.linear = cost.as_profiled(policy_blocks(cost))
        self.ckpt_fixed = policy_blocks(cost)
        self.tables: list[Optional[MicroBatchTable]] = [None] * n
        if self.linear:
            self.cost1 = np.array([cost.per_gpu_cost(s) for s in self.shapes], float)
            self.mem1 = np.array([cost.per_gpu_memory(s) for s in self.shapes], float)
        else:
            self.mem1 = np.array([sample_memory(cost, s) for s in self.shapes], float)
            for u, s in enumerate(self.shapes):
                b_mem = max(int(math.floor(params.m_mem / self.mem1[u] * (1 + 1e-12))), 1)
                given = tables.get(s) if tables else None
                self.tables[u] = (given if given is not None and len(given.cost) == b_mem + 1
                                  else micro_batch_table(cost, s, b_mem, params.m_mem))
            self.cost1 = np.array([t.cost[1] - c for t, c in zip(self.tables, self.c0)], float)
        self.tokens = np.array([bucket_tokens(s) for s in self.shapes], np.int64)
        self.padded = np.array([cost.padded_tokens(s) for s in self.shapes], np.int64)
        self.bmax = np.zeros(n, np.int64)
        self.bmem = np.zeros(n, np.int64)    # largest B within m_mem alone (fill batches of solo micro-steps)
        self.m_comp = params.m_comp if params.mode == "dual" else None
        self.solo = bool(params.solo_over_budget) and params.mode == "dual"
        self.why = [""] * n
        self.blim = batch_limits(params, self.tokens)   # the global batch's share per micro-batch (int64 max: none)
        for u, s in enumerate(self.shapes):
            b_mem = int(math.floor(params.m_mem / self.mem1[u] * (1 + 1e-12)))
            self.bmem[u] = max(b_mem, 0)
            b, why = b_mem, (f"activation memory {self.mem1[u]:.3f} GiB > m_mem {params.m_mem:.3f} GiB"
                             if b_mem < 1 else "")
            if params.mode == "dual":
                if self.linear:
                    b_comp = int(math.floor((params.m_comp - self.c0[u]) / self.cost1[u] * (1 + 1e-12)))
                else:   # the table's cost is non-decreasing in B
                    b_comp = int(np.searchsorted(self.tables[u].cost, params.m_comp * (1 + 1e-12), "right")) - 1
                if b_comp < 1 and b >= 1:
                    why = (f"compute cost {self.c0[u] + self.cost1[u]:.4g} {cost.unit} > m_comp "
                           f"{params.m_comp:.4g} {cost.unit}")
                    if self.solo:   # runs alone; its micro-step's other batches are filled up to its cost
                        b_comp, why = 1, ""
                b = min(b, b_comp)
            elif params.mode == "tokens":
                b_tok = int(params.max_tokens // self.padded[u])
                if b_tok < 1 and b >= 1:
                    why = f"{self.padded[u]} tokens > max_tokens {params.max_tokens}"
                b = min(b, b_tok)
            else:
                key = str(s)
                fixed = (params.fixed_batch_sizes or {}).get(key)
                if fixed is not None:
                    if fixed < 1:
                        raise PlanError(f"sampler.fixed_batch_sizes['{key}'] must be >= 1, got {fixed}")
                    if fixed > b_mem:
                        raise PlanError(
                            f"sampler.fixed_batch_sizes['{key}'] = {fixed} needs "
                            f"{fixed * self.mem1[u]:.2f} GiB > m_mem {params.m_mem:.2f} GiB "
                            f"(at most {b_mem} fit); lower it or raise m_mem")
                    b = fixed
            b = min(b, int(self.blim[u]))   # blim >= 1: an oversize shape stays oversize
            if params.efficient_batches and params.mode == "dual" and not self.linear and cost.mode == "calibrated" \
                    and b > 1:
                loop = loop_ms_per_micro_step(cost.profile, params.micro_steps_per_step)
                b = efficient_batch(self.tables[u].cost[:b + 1], loop)
            self.bmax[u] = max(b, 0)
            if self.bmax[u] < 1:
                self.why[u] = why

    def batch_cost(self, u: int, b: int) -> float:
        return self.c0[u] + b * self.cost1[u] if self.linear else float(self.tables[u].cost[b])

    def batch_memory(self, u: int, b: int) -> float:
        return b * self.mem1[u] if self.linear else float(self.tables[u].memory[b])

    def batch_ckpt(self, u: int, b: int) -> int:
        return self.ckpt_fixed if self.linear else int(self.tables[u].ckpt[b])

    def tail_cap(self, u: int) -> int:
        """Largest batch of shape ``u`` in the epoch's re-planned last step: ``bmax``; with
        ``solo_over_budget`` the memory bound (that step's batches are dealt cost-sorted, not filled to a
        target, and the solo micro-steps' fill batches it re-batches were over ``m_comp`` already)."""
        return min(int(self.bmem[u]), int(self.blim[u])) if self.solo else int(self.bmax[u])

    def fill_cap(self, cand: np.ndarray, target: float) -> np.ndarray:
        """Largest batch size a fill batch of each candidate shape may have in a micro-step whose target
        cost is ``target``: ``bmax``, except in a solo micro-step (``solo_over_budget``, target over
        ``m_comp``), where it may grow to the first size that reaches the target, within ``m_mem``."""
        if not self.solo or target <= self.m_comp:
            return self.bmax[cand]
        if self.linear:
            reach = np.ceil((target - self.c0[cand]) / self.cost1[cand]).astype(np.int64)
        else:
            reach = np.array([np.searchsorted(self.tables[u].cost[1:], target, "left") + 1 for u in cand.tolist()],
                             np.int64)
        return np.maximum(self.bmax[cand], np.minimum(np.minimum(reach, self.bmem[cand]), self.blim[cand]))

    def nearest_sizes(self, cand: np.ndarray, cap: np.ndarray, target: float) -> tuple[np.ndarray, np.ndarray]:
        """Per candidate shape, the batch size in 1..cap whose cost is closest to ``target``, and that cost."""
        if self.linear:
            b = np.clip(np.rint((target - self.c0[cand]) / self.cost1[cand]), 1, cap).astype(np.int64)
            return b, self.c0[cand] + b * self.cost1[cand]
        bs = np.empty(len(cand), np.int64)
        for i, (u, c) in enumerate(zip(cand.tolist(), cap.tolist())):
            row = self.tables[u].cost[1:c + 1]
            j = min(max(int(np.searchsorted(row, target)), 1), max(len(row) - 1, 1))   # not a scalar np.clip: slower per call
            j = j - 1 if len(row) == 1 or abs(row[j - 1] - target) <= abs(row[j] - target) else j
            bs[i] = j + 1
        return bs, np.array([self.tables[u].cost[b] for u, b in zip(cand.tolist(), bs.tolist())], float)


def batch_limits(params: PlannerParams, tokens: np.ndarray) -> np.ndarray:
    """Per shape, the most samples one micro-batch may hold under ``params.batch_limit`` (samples, or tokens with
    ``step_balance="tokens"``; at least 1); the int64 maximum where there is no limit."""
    if params.batch_limit is None:
        return np.full(len(tokens), np.iinfo(np.int64).max, np.int64)
    per = tokens.astype(float) if params.step_balance == "tokens" else np.ones(len(tokens))
    return np.maximum(np.floor(params.batch_limit / per * (1 + 1e-12)), 1).astype(np.int64)


def loop_ms_per_micro_step(profile, micro_steps_per_step: int) -> float:
    """The training loop's time charged to one micro-step of a ``Profile``: its own term plus its share of an
    optimizer step's at ``micro_steps_per_step``."""
    return float(profile.micro_step_overhead_ms + profile.optimizer_step_overhead_ms / micro_steps_per_step)


def efficient_batch(batch_cost: np.ndarray, loop_ms: float) -> int:
    """The batch size B >= 1 with the lowest ``(batch_cost[B] + loop_ms) / B`` (``batch_cost[0]`` unused; ties:
    the larger B)."""
    b = np.arange(1, len(batch_cost))
    per = (np.asarray(batch_cost[1:], float) + loop_ms) / b
    return int(b[len(per) - 1 - int(np.argmin(per[::-1]))])


#: the last call of :func:`unique_shapes`: (its sequence, length, distinct shapes, index); planning one dataset asks
#: for the same sequence many times (the sampler, each budget search, the checks)
_LAST: list = []


def unique_shapes(shapes: Sequence[Bucket]) -> tuple[list[Bucket], np.ndarray]:
    """Distinct shapes (sorted) and the per-sample index into them (read-only). Vectorised: token lengths with numpy,
    shapes by object identity first (a dataset's shapes are a few objects repeated), then equal objects merged.
    The same sequence object (of the same length) as the last call's is answered from that call."""
    if isinstance(shapes, IndexedShapes):   # already distinct and sorted: no per-sample work
        return list(shapes.unique), shapes.ids
    n = len(shapes)
    if _LAST and _LAST[0][0] is shapes and _LAST[0][1] == n:
        return list(_LAST[0][2]), _LAST[0][3]
    uniq, sid = _unique_shapes(shapes, n)
    if n >= 10_000:   # a dataset, not a list of distinct shapes
        sid.flags.writeable = False
        _LAST[:] = [(shapes, n, uniq, sid)]
    return list(uniq), sid


def _unique_shapes(shapes: Sequence[Bucket], n: int) -> tuple[list[Bucket], np.ndarray]:
    if n and isinstance(shapes[0], (int, np.integer)) and not isinstance(shapes[0], bool):
        arr = np.asarray(shapes)
        if arr.dtype.kind in "iu":
            u, inv = np.unique(arr, return_inverse=True)
            return [int(x) for x in u], inv.astype(np.int64).reshape(-1)
    ids = np.fromiter(map(id, shapes), np.int64, count=n)
    _, first, inv = np.unique(ids, return_index=True, return_inverse=True)
    reps = [shapes[i] for i in first.tolist()]
    kinds = {type(s) for s in reps}
    if len(kinds) > 1:
        raise PlanError(f"sample shapes mix {sorted(k.__name__ for k in kinds)}: give every sample a "
                        "SampleShape or every sample a token length, not both")
    uniq = sorted(set(reps))
    pos = {s: i for i, s in enumerate(uniq)}
    rep_idx = np.array([pos[s] for s in reps], np.int64)
    return uniq, rep_idx[inv.reshape(-1)] if n else np.zeros(0, np.int64)


def indexed(shapes: Sequence) -> IndexedShapes:
    """``shapes`` (one per sample: ``SampleShape`` or token lengths) as :class:`IndexedShapes`, one int32 a sample
    (a list of 10M shapes is 80 MB of references; as ids, 40 MB), unchanged when it is one."""
    if isinstance(shapes, IndexedShapes):
        return shapes
    uniq, sid = unique_shapes([s if isinstance(s, SampleShape) else int(s) for s in shapes])
    return IndexedShapes(uniq, sid.astype(np.int32))


def dataset_shapes(dataset) -> IndexedShapes:
    """A dataset's shapes to plan: its ``unique_shapes()`` and ``shape_ids()`` as they are where it has them (an
    indexed dataset at 10M samples: no per-sample object), else its ``sample_shapes()``."""
    return IndexedShapes.of_dataset(dataset) or indexed(dataset.sample_shapes())
