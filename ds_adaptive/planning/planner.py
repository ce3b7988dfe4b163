"""Pure planning: micro-batches under both budgets, dealt into cost-balanced micro-steps.

No torch, no torch.distributed: a plan is a pure function of (sample shapes, order, cost model,
:class:`PlannerParams`). The sampler (``ds_adaptive/planning/sampler.py``) adds the epoch shuffle, ranks
and resumable state; the simulator (``ds_adaptive/simulation/simulate.py``) scores plans.

Vocabulary
    batch       a micro-batch: ``B`` samples of ONE shape, processed by one data-parallel rank
                (all ``sp`` ranks of its Ulysses group) in one micro-step.
    micro-step  one forward+backward on every DP rank: exactly ``dp_size`` batches. Under ZeRO-3
                every micro-step is a synchronisation point, so its batches should cost the same.
    step        one optimizer step = ``micro_steps_per_step`` micro-steps (DeepSpeed's
                gradient_accumulation_steps): every rank runs the same number.
    window      ``window * dp_size`` shuffled samples planned together; what cannot be planned
                well is carried to the next window.

Modes
    ``dual``    (AdaptiveLoad, extended) every batch obeys ``batch_memory <= m_mem`` AND
                ``batch_cost <= m_comp``. Micro-steps are built by *anchor and fill*: the anchor is
                the costliest-per-sample shape left in the pool at its largest feasible batch,
                which sets the micro-step's target cost ``T``; every other rank gets the batch
                ``(shape, B)`` whose cost is closest to ``T`` (among near-ties the coarsest shape,
                so that divisible fillers -- images, short clips -- stay available for the
                indivisible long videos). A micro-step whose CV of per-rank cost exceeds
                ``balance_tolerance`` is not emitted: its anchor shape waits for the next window,
                where new samples bring partners. Micro-steps of a window are shuffled.
    ``tokens``  equal-token bucketing (Open-Sora / DeepSpeed variable batch): per shape bucket
                ``B = max_tokens // S`` (and within ``m_mem``), batches shuffled and dealt
                round-robin.
    ``fixed``   a fixed batch size per bucket (within ``m_mem``), dealt like ``tokens``.

End of epoch: the final incomplete optimizer step (fewer than ``micro_steps_per_step``
micro-steps) is re-planned: its samples are re-batched and big batches split until there are
exactly ``dp_size * micro_steps_per_step`` batches, dealt cost-sorted into one full step. If the
tail holds fewer samples than that, its samples join batches of their shape in the last full
step where both budgets allow one more; what finds no room is dropped for this epoch and counted
in ``EpochPlan.tail_dropped`` (the next epoch's shuffle trains them; a warning names the count).
Oversize samples (over a budget even at B=1) raise :class:`OversizeSampleError`, or with
``oversize="skip"`` are counted in ``EpochPlan.oversize`` with a warning. Nothing is dropped
silently: ``planned + oversize + tail_dropped == all samples`` of the epoch.
"""
from __future__ import annotations

import heapq
import warnings
from typing import Optional, Sequence

import numpy as np

from ds_adaptive.core.shapes import SampleShape
from ds_adaptive.planning.cost import CostModel
from ds_adaptive.planning.plan_types import (Bucket, EpochPlan, Mode, OversizeSampleError, PlanError, PlannerParams,
                                             StepTotals, bucket_tokens)
from ds_adaptive.planning.shape_table import ShapeTable, efficient_batch, loop_ms_per_micro_step, unique_shapes

__all__ = ["Bucket", "EpochPlan", "Mode", "OversizeSampleError", "PlanError", "PlannerParams", "StepTotals",
           "bucket_tokens", "check_oversize", "efficient_batch", "loop_ms_per_micro_step", "plan_epoch", "unique_shapes"]


# ============================================================================== planning
class _Builder:
    """Accumulates batches (flat) while planning."""

    def __init__(self, table: ShapeTable, dp: int) -> None:
        self.t = table
        self.dp = dp
        self.ids: list[int] = []
        self.offsets: list[int] = [0]
        self.shape: list[int] = []

    def add_micro_steps(self, steps: list[list[tuple[int, list[int]]]], rng: np.random.Generator,
                        shuffle_steps: bool = True) -> None:
        order = rng.permutation(len(steps)) if shuffle_steps else range(len(steps))
        for k in order:
            batches = steps[k]
            assert len(batches) == self.dp
            for r in rng.permutation(self.dp):
                u, ids = batches[r]
                self.ids.extend(ids)
                self.offsets.append(len(self.ids))
                self.shape.append(u)

    def pop_last_micro_steps(self, n: int) -> list[tuple[int, list[int]]]:
        """Remove the last ``n`` micro-steps; return their batches."""
        if n == 0:
            return []
        k = n * self.dp
        start = self.offsets[-k - 1]
        out = []
        for j in range(len(self.shape) - k, len(self.shape)):
            out.append((self.shape[j], self.ids[self.offsets[j]:self.offsets[j + 1]]))
        del self.ids[start:]
        del self.offsets[-k:]
        del self.shape[-k:]
        return out


def _take(pool: list[list[int]], u: int, b: int) -> list[int]:
    ids = pool[u][:b]
    del pool[u][:b]
    return ids


def _dual_micro_step(table: ShapeTable, counts: np.ndarray, dp: int, anchor_ok: np.ndarray,
                     tolerance: float) -> Optional[tuple[list[tuple[int, int]], float]]:
    """Anchor-and-fill on shape counts. Returns ([(shape, B)] * dp, cv) or None when the pool
    cannot fill dp batches or no anchor is allowed."""
    live = np.flatnonzero((counts > 0) & anchor_ok)
    if live.size == 0:
        return None
    cost1, bmax = table.cost1, table.bmax
    ua = int(live[np.argmax(cost1[live])])
    ba = int(min(bmax[ua], counts[ua]))
    target = table.batch_cost(ua, ba)
    rem = counts.copy()
    k = int(min(dp, rem[ua] // ba))
    slots: list[tuple[int, int]] = [(ua, ba)] * k
    rem[ua] -= k * ba
    near = 0.25 * tolerance  # fill candidates this close to the target count as ties
    while len(slots) < dp:
        cand = np.flatnonzero(rem > 0)
        if cand.size == 0:
            return None
        cap = np.minimum(table.fill_cap(cand, target), rem[cand])
        b, cb = table.nearest_sizes(cand, cap, target)
        err = np.abs(cb - target) / target
        best = err.min()
        ties = np.flatnonzero(err <= max(best, near))
        i = int(ties[np.argmax(cost1[cand[ties]])])
        u, bu = int(cand[i]), int(b[i])
        n = int(min(dp - len(slots), rem[u] // bu))
        slots.extend([(u, bu)] * n)
        rem[u] -= n * bu
    costs = np.array([table.batch_cost(u, bb) for u, bb in slots])
    cv = float(costs.std() / costs.mean()) if costs.mean() > 0 else 0.0
    return slots, cv


def _plan_dual_window(table: ShapeTable, pool: list[list[int]], params: PlannerParams,
                      final: bool) -> list[list[tuple[int, list[int]]]]:
    dp = params.dp_size
    counts = np.array([len(p) for p in pool], np.int64)
    anchor_ok = table.bmax > 0
    steps: list[list[tuple[int, list[int]]]] = []
    while True:
        res = _dual_micro_step(table, counts, dp, anchor_ok, params.balance_tolerance)
        if res is None:
            break
        slots, cv = res
        ua, ba = slots[0]
        if not final and (cv > params.balance_tolerance or ba < table.bmax[ua]):
            # The anchor shape has no good partners in this pool, or fewer samples left than one full batch
            # (a smaller anchor makes a smaller micro-step, paying c0 and the loop overheads for fewer
            # samples): let it wait for the next window, as the bucket baselines' incomplete batches do.
            anchor_ok = anchor_ok.copy()
            anchor_ok[ua] = False
            continue
        step = []
        for u, b in slots:
            step.append((u, _take(pool, u, b)))
            counts[u] -= b
        steps.append(step)
    return steps


def _plan_bucket_window(table: ShapeTable, pool: list[list[int]], params: PlannerParams, final: bool,
                        rng: np.random.Generator) -> list[list[tuple[int, list[int]]]]:
    """tokens / fixed: full batches per bucket, shuffled, dealt round-robin in groups of dp."""
    dp = params.dp_size
    batches: list[tuple[int, list[int]]] = []
    for u in range(len(pool)):
        b = int(table.bmax[u])
        if b < 1:
            continue
        n_full = len(pool[u]) // b
        for _ in range(n_full):
            batches.append((u, _take(pool, u, b)))
        if final and pool[u]:
            batches.append((u, _take(pool, u, len(pool[u]))))
    order = rng.permutation(len(batches))
    batches = [batches[i] for i in order]
    n_steps = len(batches) // dp
    for u, ids in batches[n_steps * dp:]:   # an incomplete micro-step waits for the next window
        pool[u][:0] = ids
    return [batches[i * dp:(i + 1) * dp] for i in range(n_steps)]


def _rebatch_tail(table: ShapeTable, batches: list[tuple[int, list[int]]], n_slots: int
                  ) -> Optional[list[tuple[int, list[int]]]]:
    """Re-batch the tail samples into exactly ``n_slots`` batches (budget-filled, then the
    costliest batch with B >= 2 split in two until there are enough); None if too few samples, or
    if even budget-filled batches are more than ``n_slots`` (the whole epoch is less than one step)."""
    by_shape: dict[int, list[int]] = {}
    for u, ids in batches:
        by_shape.setdefault(u, []).extend(ids)
    out: list[tuple[int, list[int]]] = []
    for u, ids in sorted(by_shape.items()):
        b = table.tail_cap(u)
        out.extend((u, ids[i:i + b]) for i in range(0, len(ids), b))
    if sum(len(ids) for _, ids in out) < n_slots:
        return None
    # split the costliest batch with B >= 2 (ties: the first in ``out``) until there are n_slots: a heap of them
    heap = [(-table.batch_cost(u, len(ids)), i) for i, (u, ids) in enumerate(out) if len(ids) >= 2]
    heapq.heapify(heap)
    while len(out) < n_slots:
        _, i = heapq.heappop(heap)
        u, ids = out[i]
        h = len(ids) // 2
        out[i] = (u, ids[:h])
        out.append((u, ids[h:]))
        for j in (i, len(out) - 1):
            if len(out[j][1]) >= 2:
                heapq.heappush(heap, (-table.batch_cost(u, len(out[j][1])), j))
    if len(out) > n_slots:   # an epoch shorter than one optimizer step: no full step can be formed
        return None
    return out


def _absorb_into_last_step(builder: _Builder, table: ShapeTable, tail: list[tuple[int, list[int]]],
                           n_batches: int) -> list[int]:
    """Add tail samples to batches of the same shape in the last optimizer step where both budgets
    still allow one more sample; returns the samples that found no room (sorted)."""
    left: list[int] = []
    first = max(len(builder.shape) - n_batches, 0)
    nb = len(builder.shape)
    sizes = [builder.offsets[j + 1] - builder.offsets[j] for j in range(first, nb)]
    rooms: dict[int, list] = {}   # per shape: a heap of (size, batch) with room (the smallest batch first)
    for k, j in enumerate(range(first, nb)):
        rooms.setdefault(builder.shape[j], []).append((sizes[k], j))
    for h in rooms.values():
        heapq.heapify(h)
    added: dict[int, list[int]] = {}
    for u, ids in tail:
        h = rooms.get(u, [])
        cap = table.tail_cap(u)
        for i in ids:
            while h and h[0][0] >= cap:
                heapq.heappop(h)
            if not h:
                left.append(i)
                continue
            size, j = heapq.heappop(h)
            added.setdefault(j, []).append(i)
            heapq.heappush(h, (size + 1, j))
    if added:   # rebuild the last step's ids and offsets once
        start = builder.offsets[first]
        ids_new: list[int] = []
        offs = []
        for j in range(first, nb):
            ids_new.extend(builder.ids[builder.offsets[j]:builder.offsets[j + 1]])
            ids_new.extend(added.get(j, ()))
            offs.append(start + len(ids_new))
        del builder.ids[start:]
        builder.ids.extend(ids_new)
        builder.offsets[first + 1:] = offs
    return sorted(left)


def check_oversize(table: ShapeTable, shape_ids: np.ndarray, order: np.ndarray, params: PlannerParams,
                   unit: str) -> tuple[np.ndarray, list[int]]:
    """Remove samples that no batch can hold; error (default) or counted warning."""
    bad_shapes = np.flatnonzero(table.bmax < 1)
    if bad_shapes.size == 0:
        return order, []
    bad_mask = np.isin(shape_ids[order], bad_shapes)
    bad = order[bad_mask]
    if bad.size == 0:
        return order, []
    if params.oversize == "error":
        i = int(bad.min())
        u = int(shape_ids[i])
        raise OversizeSampleError(
            f"sample {i} (shape {table.shapes[u]}, {table.tokens[u]} tokens) does not fit one GPU even "
            f"at batch size 1 in mode '{params.mode}': {table.why[u]}. {bad.size} sample(s) of this "
            f"epoch are over budget. Raise the budget (sampler.m_mem / m_comp / max_tokens), use a "
            f"higher Ulysses degree sp, or set sampler.oversize: \"skip\" to skip them with a count.")
    desc = ", ".join(f"{table.shapes[u]} ({int(np.sum(shape_ids[bad] == u))}: {table.why[u]})"
                     for u in bad_shapes if np.any(shape_ids[bad] == u))
    warnings.warn(f"sampler: skipping {bad.size} oversize sample(s) this epoch (oversize=skip): {desc}",
                  stacklevel=3)
    return order[~bad_mask], sorted(int(i) for i in bad)


def plan_epoch(shape_ids: np.ndarray, shapes: Sequence[SampleShape], order: np.ndarray, cost: CostModel,
               params: PlannerParams, *, seed: int = 0, replan_tail: bool = True) -> EpochPlan:
    """Plan all of ``order`` (sample ids, already shuffled) into micro-steps.

    ``replan_tail=False`` (a plan of a prefix of the epoch, as the budget search makes): the micro-steps of an
    incomplete last optimizer step stay as planned (``num_steps`` does not count them) and the samples left in
    the pool are not planned (nor counted in ``tail_dropped``): exactly the plan before the tail re-plan.

    ``shape_ids[i]`` indexes ``shapes`` for sample ``i``. Deterministic in all arguments.
    """
    table = ShapeTable(shapes, cost, params)
    order = np.asarray(order, np.int64)
    order, oversize = check_oversize(table, np.asarray(shape_ids), order, params, cost.unit)
    dp, ga = params.dp_size, params.micro_steps_per_step
    rng = np.random.default_rng([seed, 0x5A3C, dp, ga])
    builder = _Builder(table, dp)
    pool: list[list[int]] = [[] for _ in shapes]
    w = max(params.window if params.mode != "dual" else max(params.window, 2 * int(table.bmax.max(initial=0))), 1) * dp
    n = len(order)
    starts = list(range(0, n, w)) or [0]
    sid = np.asarray(shape_ids)
    for k, lo in enumerate(starts):
        chunk = order[lo:lo + w]
        for u, i in zip(sid[chunk].tolist(), chunk.tolist()):
            pool[u].append(i)
        final = k == len(starts) - 1
        if params.mode == "dual":
            steps = _plan_dual_window(table, pool, params, final)
        else:
            steps = _plan_bucket_window(table, pool, params, final, rng)
        builder.add_micro_steps(steps, rng)
    # ---- tail: leftover pool + the micro-steps of an incomplete optimizer step
    n_micro = len(builder.shape) // dp
    r = n_micro % ga
    tail = builder.pop_last_micro_steps(r) if replan_tail else []
    tail.extend((u, ids) for u, ids in enumerate(pool) if ids and replan_tail)
    tail_dropped: list[int] = []
    replanned = 0
    if tail:
        rebatched = _rebatch_tail(table, tail, dp * ga)
        if rebatched is None:
            tail_dropped = _absorb_into_last_step(builder, table, tail, dp * ga)
        else:
            rebatched.sort(key=lambda x: -table.batch_cost(x[0], len(x[1])))
            builder.add_micro_steps([rebatched[m * dp:(m + 1) * dp] for m in range(ga)], rng)
            replanned = sum(len(ids) for _, ids in rebatched)
    if tail_dropped:
        warnings.warn(
            f"sampler: the last {len(tail_dropped)} sample(s) of the epoch are fewer than one optimizer "
            f"step of batches (dp_size {dp} x micro_steps_per_step {ga}) and found no room in the last "
            "step's batches of their shape; they are not trained this "
            f"epoch (counted in tail_dropped; the next epoch's shuffle includes them)", stacklevel=2)
    bs = np.asarray(builder.shape, np.int64)
    offsets = np.asarray(builder.offsets, np.int64)
    sizes = np.diff(offsets)
    if table.linear:
        b_cost = (table.c0[bs] + sizes * table.cost1[bs]) if bs.size else np.zeros(0)
        b_mem = sizes * table.mem1[bs] if bs.size else np.zeros(0)
        b_ckpt = np.full(bs.shape, table.ckpt_fixed, np.int64)
    else:
        pairs = list(zip(bs.tolist(), sizes.tolist()))
        b_cost = np.array([table.batch_cost(u, b) for u, b in pairs], float)
        b_mem = np.array([table.batch_memory(u, b) for u, b in pairs], float)
        b_ckpt = np.array([table.batch_ckpt(u, b) for u, b in pairs], np.int64)
        if dp > 1 and bs.size:
            b_ckpt, b_cost, b_mem = _uniform_checkpoint_counts(cost, [shapes[u] for u in bs.tolist()], sizes, b_ckpt,
                                                               b_cost, b_mem, dp)
    return EpochPlan(
        dp_size=dp, micro_steps_per_step=ga, shapes=list(shapes),
        sample_ids=np.asarray(builder.ids, np.int64), batch_offsets=offsets, batch_shape=bs,
        batch_cost=b_cost, batch_memory=b_mem,
        batch_tokens=sizes * table.tokens[bs] if bs.size else np.zeros(0, np.int64),
        oversize=oversize, tail_dropped=tail_dropped, tail_replanned=replanned, batch_ckpt=b_ckpt)


def _uniform_checkpoint_counts(cost: CostModel, batch_shapes: list, sizes: np.ndarray, ckpt: np.ndarray,
                               b_cost: np.ndarray, b_mem: np.ndarray, dp: int):
    """Every DP rank of a micro-step checkpoints the same number of blocks: the largest of their own
    plans (a larger count only lowers a batch's memory, so each still fits ``m_mem``). ZeRO-3 gathers
    parameters with collectives in module order, and a rank that recomputes a block gathers in another
    order than one that does not: different counts in one micro-step hang it (seen with 2 CPU ranks).
    The batches whose count rises get its recompute in their cost (the plan's balance figures include it)."""
    n = ckpt.reshape(-1, dp).max(axis=1).repeat(dp)
    up = np.flatnonzero(n != ckpt)
    if up.size == 0:
        return ckpt, b_cost, b_mem
    b_cost, b_mem = b_cost.copy(), b_mem.copy()
    for j in up.tolist():
        b_cost[j] = float(cost.ckpt_cost(batch_shapes[j], int(sizes[j]), int(n[j])))
        b_mem[j] = float(cost.ckpt_memory(batch_shapes[j], int(sizes[j]), int(n[j])))
    return n, b_cost, b_mem
