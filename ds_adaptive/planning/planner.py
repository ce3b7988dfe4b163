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
micro-steps) and the samples left in the pool are re-planned: re-batched and big batches split until
there are exactly ``dp_size * micro_steps_per_step`` batches per step, dealt cost-sorted into one full
step, or with a global batch (``step_balance``) into as many as the tail holds the mean samples of the
epoch's steps (so the last steps hold about the global batch too). If the tail holds fewer samples than one step's batches, its samples join batches of their shape in the last full
step where both budgets allow one more; what finds no room is dropped for this epoch and counted
in ``EpochPlan.tail_dropped`` (the next epoch's shuffle trains them; a warning names the count).
Oversize samples (over a budget even at B=1) raise :class:`OversizeSampleError`, or with
``oversize="skip"`` are counted in ``EpochPlan.oversize`` with a warning. Nothing is dropped
silently: ``planned + oversize + tail_dropped == all samples`` of the epoch.
"""
from __future__ import annotations

import heapq
import math
import warnings
from array import array
from typing import Mapping, Optional, Sequence

import numpy as np

from ds_adaptive.core.shapes import SampleShape
from ds_adaptive.planning.cost import CostModel
from ds_adaptive.planning.memory import MicroBatchTable
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
        # typed arrays: 8 bytes a sample and a batch (a list of ints holds ~36; 10M samples in 5M batches at 4,096 GPUs)
        self.ids = array("q")
        self.offsets = array("q", [0])
        self.shape = array("q")

    def add_micro_steps(self, steps: list[list[tuple[int, list[int]]]], rng: np.random.Generator,
                        shuffle_steps: bool = True) -> None:
        order = rng.permutation(len(steps)).tolist() if shuffle_steps else range(len(steps))
        flat, offsets, shape, dp = self.ids, self.offsets, self.shape, self.dp
        for k in order:
            batches = steps[k]
            assert len(batches) == dp
            # the ranks' order: a one-rank micro-step draws nothing (permutation(1) takes no random numbers)
            for r in (rng.permutation(dp).tolist() if dp > 1 else (0,)):
                u, ids = batches[r]
                flat.extend(ids)
                offsets.append(len(flat))
                shape.append(u)

    def pop_last_micro_steps(self, n: int) -> list[tuple[int, list[int]]]:
        """Remove the last ``n`` micro-steps; return their batches."""
        if n == 0:
            return []
        k = n * self.dp
        start = self.offsets[-k - 1]
        out = []
        for j in range(len(self.shape) - k, len(self.shape)):
            out.append((self.shape[j], list(self.ids[self.offsets[j]:self.offsets[j + 1]])))
        del self.ids[start:]
        del self.offsets[-k:]
        del self.shape[-k:]
        return out


class _Pool:
    """Samples waiting to be planned, one list per shape in arrival order. Taking from the front moves a head
    (no copy); :meth:`compact` drops the taken part once per window."""

    def __init__(self, n: int) -> None:
        self.lists: list[list[int]] = [[] for _ in range(n)]
        self.head = [0] * n

    def __len__(self) -> int:
        return len(self.lists)

    def count(self, u: int) -> int:
        return len(self.lists[u]) - self.head[u]

    def counts(self) -> np.ndarray:
        return np.array([len(x) - h for x, h in zip(self.lists, self.head)], np.int64)

    def add(self, shape_ids: np.ndarray, ids: np.ndarray) -> None:
        """Append ``ids`` (with their shapes ``shape_ids``) in order."""
        by = np.argsort(shape_ids, kind="stable")
        us, starts = np.unique(shape_ids[by], return_index=True)
        ends = list(starts[1:]) + [len(by)]
        sorted_ids = ids[by]
        for u, a, b in zip(us.tolist(), starts.tolist(), ends):
            self.lists[u].extend(sorted_ids[a:b].tolist())

    def take(self, u: int, b: int) -> list[int]:
        h = self.head[u]
        ids = self.lists[u][h:h + b]
        self.head[u] = h + len(ids)
        return ids

    def live(self, u: int) -> list[int]:
        return self.lists[u][self.head[u]:]

    def put_back(self, u: int, ids: list[int]) -> None:
        self.compact()
        self.lists[u][:0] = ids

    def compact(self) -> None:
        for u, h in enumerate(self.head):
            if h:
                del self.lists[u][:h]
                self.head[u] = 0


def _runs_cv(table: ShapeTable, runs: list[tuple[int, int, int]], dp: int) -> float:
    """CV of the per-rank cost of a micro-step given as runs ``(shape, B, ranks)``: 0 for one run (every rank's
    batch the same)."""
    if len(runs) == 1:
        return 0.0
    costs = [float(table.batch_cost(u, b)) for u, b, _ in runs]
    mean = sum(c * n for c, (_, _, n) in zip(costs, runs)) / dp
    if mean <= 0:
        return 0.0
    var = sum(n * (c - mean) ** 2 for c, (_, _, n) in zip(costs, runs)) / dp
    return math.sqrt(var) / mean


def _dual_micro_step(table: ShapeTable, counts: np.ndarray, dp: int, anchor_ok: np.ndarray,
                     tolerance: float) -> Optional[tuple[list[tuple[int, int, int]], float]]:
    """Anchor-and-fill on shape counts. Returns (runs, cv): the micro-step's ``dp`` batches as runs
    ``(shape, B, ranks)`` (the anchor's first; ``ranks`` batches of ``B`` samples of that shape), and the CV of
    their costs; or None when the pool cannot fill dp batches or no anchor is allowed."""
    live = ((counts > 0) & anchor_ok).nonzero()[0]   # ndarray methods: np.flatnonzero / np.argmax wrap these
    if live.size == 0:
        return None
    cost1 = table.cost1
    ua = int(live[cost1[live].argmax()])
    left = int(counts[ua])
    ba = min(int(table.bmax[ua]), left)
    k = min(dp, left // ba)
    runs = [(ua, ba, k)]
    if k < dp:
        target = table.batch_cost(ua, ba)
        rem = counts.copy()
        rem[ua] -= k * ba
        filled = k
        near = 0.25 * tolerance  # fill candidates this close to the target count as ties
        while filled < dp:
            cand = (rem > 0).nonzero()[0]
            if cand.size == 0:
                return None
            cap = np.minimum(table.fill_cap(cand, target), rem[cand])
            b, cb = table.nearest_sizes(cand, cap, target)
            err = np.abs(cb - target) / target
            best = err.min()
            ties = (err <= max(best, near)).nonzero()[0]
            i = int(ties[cost1[cand[ties]].argmax()])
            u, bu = int(cand[i]), int(b[i])
            n = min(dp - filled, int(rem[u]) // bu)
            runs.append((u, bu, n))
            filled += n
            rem[u] -= n * bu
    return runs, _runs_cv(table, runs, dp)


def _plan_dual_window(table: ShapeTable, pool: _Pool, params: PlannerParams,
                      final: bool) -> list[list[tuple[int, list[int]]]]:
    dp = params.dp_size
    counts = pool.counts()
    anchor_ok = table.bmax > 0
    steps: list[list[tuple[int, list[int]]]] = []
    take = pool.take
    while True:
        res = _dual_micro_step(table, counts, dp, anchor_ok, params.balance_tolerance)
        if res is None:
            break
        runs, cv = res
        ua, ba, _ = runs[0]
        if not final and (cv > params.balance_tolerance or ba < table.bmax[ua]):
            # The anchor shape has no good partners in this pool, or fewer samples left than one full batch
            # (a smaller anchor makes a smaller micro-step, paying c0 and the loop overheads for fewer
            # samples): let it wait for the next window, as the bucket baselines' incomplete batches do.
            anchor_ok = anchor_ok.copy()
            anchor_ok[ua] = False
            continue
        step = []
        for u, b, n in runs:
            ids = take(u, b * n)   # the run's n batches: consecutive samples of the shape's queue
            step.extend((u, ids[j:j + b]) for j in range(0, b * n, b))
            counts[u] -= b * n
        steps.append(step)
    return steps


def _plan_bucket_window(table: ShapeTable, pool: _Pool, params: PlannerParams, final: bool,
                        rng: np.random.Generator) -> list[list[tuple[int, list[int]]]]:
    """tokens / fixed: full batches per bucket, shuffled, dealt round-robin in groups of dp."""
    dp = params.dp_size
    batches: list[tuple[int, list[int]]] = []
    for u in range(len(pool)):
        b = int(table.bmax[u])
        if b < 1:
            continue
        n_full = pool.count(u) // b
        for _ in range(n_full):
            batches.append((u, pool.take(u, b)))
        if final and pool.count(u):
            batches.append((u, pool.take(u, pool.count(u))))
    order = rng.permutation(len(batches))
    batches = [batches[i] for i in order]
    n_steps = len(batches) // dp
    for u, ids in batches[n_steps * dp:]:   # an incomplete micro-step waits for the next window
        pool.put_back(u, ids)
    return [batches[i * dp:(i + 1) * dp] for i in range(n_steps)]


def _rebatch_tail(table: ShapeTable, batches: list[tuple[int, list[int]]], step_slots: int,
                  step_samples: Optional[float] = None) -> Optional[list[tuple[int, list[int]]]]:
    """Re-batch the tail samples into whole optimizer steps of ``step_slots`` batches each (budget-filled, then
    the costliest batch with B >= 2 split in two until there are enough): as many steps as the tail holds
    ``step_samples`` (the mean samples of the epoch's planned steps; None: one step), and at least as many as its
    budget-filled batches need. None if the samples are fewer than one step's batches."""
    by_shape: dict[int, list[int]] = {}
    for u, ids in batches:
        by_shape.setdefault(u, []).extend(ids)
    out: list[tuple[int, list[int]]] = []
    for u, ids in sorted(by_shape.items()):
        b = table.tail_cap(u)
        out.extend((u, ids[i:i + b]) for i in range(0, len(ids), b))
    total = sum(len(ids) for _, ids in out)
    steps = max(1, round(total / step_samples) if step_samples else 1, -(-len(out) // step_slots))
    steps = min(steps, total // step_slots)
    if steps < 1:
        return None
    n_slots = steps * step_slots
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
    if len(out) > n_slots:   # more budget-filled batches than the tail's samples can spread over whole steps
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
        builder.offsets[first + 1:] = array("q", offs)
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
               params: PlannerParams, *, seed: int = 0, replan_tail: bool = True,
               tables: Optional[Mapping[SampleShape, MicroBatchTable]] = None) -> EpochPlan:
    """Plan all of ``order`` (sample ids, already shuffled) into micro-steps.

    ``replan_tail=False`` (a plan of a prefix of the epoch, as the budget search makes): the micro-steps of an
    incomplete last optimizer step stay as planned (``num_steps`` does not count them) and the samples left in
    the pool are not planned (nor counted in ``tail_dropped``): exactly the plan before the tail re-plan. Its last
    ``dual`` window is planned as a mid-epoch one (an anchor without good partners waits): its micro-steps stand for the epoch's.

    ``shape_ids[i]`` indexes ``shapes`` for sample ``i``. Deterministic in all arguments. ``tables``: micro-batch
    tables for ``cost`` and ``params.m_mem`` that the caller has built already (:class:`ShapeTable`).
    """
    table = ShapeTable(shapes, cost, params, tables)
    order = np.asarray(order, np.int64)
    order, oversize = check_oversize(table, np.asarray(shape_ids), order, params, cost.unit)
    dp, ga = params.dp_size, params.micro_steps_per_step
    rng = np.random.default_rng([seed, 0x5A3C, dp, ga])
    builder = _Builder(table, dp)
    pool = _Pool(len(shapes))
    w = max(params.window if params.mode != "dual" else max(params.window, 2 * int(table.bmax.max(initial=0))), 1) * dp
    n = len(order)
    starts = list(range(0, n, w)) or [0]
    sid = np.asarray(shape_ids)
    for k, lo in enumerate(starts):
        chunk = order[lo:lo + w]
        pool.add(sid[chunk], chunk)
        final = k == len(starts) - 1 and (replan_tail or params.mode != "dual")   # dual: a prefix's last window is mid-epoch
        if params.mode == "dual":
            steps = _plan_dual_window(table, pool, params, final)
        else:
            steps = _plan_bucket_window(table, pool, params, final, rng)
        builder.add_micro_steps(steps, rng)
        pool.compact()
    # ---- tail: leftover pool + the micro-steps of an incomplete optimizer step
    n_micro = len(builder.shape) // dp
    r = n_micro % ga
    tail = builder.pop_last_micro_steps(r) if replan_tail else []
    tail.extend((u, pool.live(u)) for u in range(len(pool)) if pool.count(u) and replan_tail)
    tail_dropped: list[int] = []
    replanned = 0
    full = len(builder.shape) // (dp * ga)   # the steps before the tail's: the ones balance_steps regroups
    if tail:
        # with a global batch (step_balance) as many steps as the tail holds the mean step; else one, as always
        rebatched = _rebatch_tail(table, tail, dp * ga,
                                  builder.offsets[-1] / full if full and params.step_balance else None)
        if rebatched is None:
            tail_dropped = _absorb_into_last_step(builder, table, tail, dp * ga)
        else:
            rebatched.sort(key=lambda x: -table.batch_cost(x[0], len(x[1])))
            builder.add_micro_steps([rebatched[m * dp:(m + 1) * dp] for m in range(len(rebatched) // dp)], rng)
            replanned = sum(len(ids) for _, ids in rebatched)
    if tail_dropped:
        warnings.warn(
            f"sampler: the last {len(tail_dropped)} sample(s) of the epoch are fewer than one optimizer "
            f"step of batches (dp_size {dp} x micro_steps_per_step {ga}) and found no room in the last "
            "step's batches of their shape; they are not trained this "
            f"epoch (counted in tail_dropped; the next epoch's shuffle includes them)", stacklevel=2)
    bs, offsets, ids = (np.frombuffer(a, np.int64) if len(a) else np.zeros(0, np.int64)   # no copies
                        for a in (builder.shape, builder.offsets, builder.ids))
    del builder
    if params.step_balance is not None and ga > 1 and bs.size:
        ids, offsets, bs = balance_steps(ids, offsets, bs, table.tokens, dp, ga, params.step_balance, steps=full)
    sizes = np.diff(offsets)
    b_cost, b_mem, b_ckpt = _batch_figures(table, cost, shapes, bs, sizes, dp)
    return EpochPlan(
        dp_size=dp, micro_steps_per_step=ga, shapes=list(shapes),
        sample_ids=ids, batch_offsets=offsets, batch_shape=bs,
        batch_cost=b_cost, batch_memory=b_mem,
        batch_tokens=sizes * table.tokens[bs] if bs.size else np.zeros(0, np.int64),
        oversize=oversize, tail_dropped=tail_dropped, tail_replanned=replanned, batch_ckpt=b_ckpt)


def _batch_figures(table: ShapeTable, cost: CostModel, shapes: Sequence[SampleShape], bs: np.ndarray,
                   sizes: np.ndarray, dp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(cost, memory, checkpointed blocks) of each planned batch (shape ``bs``, ``sizes`` samples)."""
    if table.linear:
        b_cost = (table.c0[bs] + sizes * table.cost1[bs]) if bs.size else np.zeros(0)
        b_mem = sizes * table.mem1[bs] if bs.size else np.zeros(0)
        return b_cost, b_mem, np.full(bs.shape, table.ckpt_fixed, np.int64)
    b_cost, b_mem, b_ckpt = np.zeros(len(bs)), np.zeros(len(bs)), np.zeros(len(bs), np.int64)
    for u in np.unique(bs).tolist():   # per shape: its micro-batch table at the batches' sizes
        j = np.flatnonzero(bs == u)
        t = table.tables[u]
        b_cost[j], b_mem[j], b_ckpt[j] = t.cost[sizes[j]], t.memory[sizes[j]], t.ckpt[sizes[j]]
    if dp > 1 and bs.size:
        b_ckpt, b_cost, b_mem = _uniform_checkpoint_counts(cost, shapes, bs, sizes, b_ckpt, b_cost, b_mem, dp)
    return b_cost, b_mem, b_ckpt


#: optimizer steps whose micro-steps :func:`balance_steps` regroups together (the epoch's coarse order is kept)
STEP_BALANCE_BLOCK = 64


def _fill_steps(count: np.ndarray, steps: int, ga: int) -> np.ndarray:
    """Deal each row of ``count`` (``[blocks, steps * ga]`` sample or token totals of micro-steps) into ``steps``
    steps of exactly ``ga`` micro-steps with about equal sums: largest first, each to the step with the smallest sum
    among those with a free slot (longest-processing-time with a cardinality bound; ties to the lower step), one
    row at a time (:func:`_fill_steps_row`). Returns ``[blocks, steps, ga]`` indices into each row, a step's micro-steps in their planned
    order, the steps in a fixed shuffled order (the dealing leaves the larger sums first)."""
    order = np.argsort(-count, axis=1, kind="stable")
    members = np.array([_fill_steps_row(c, o, steps, ga) for c, o in zip(count.tolist(), order.tolist())],
                       np.int64).reshape(count.shape[0], steps, ga)
    members.sort(axis=2)
    return members[:, np.random.default_rng([steps, ga, 0x57E9]).permutation(steps)]


def _fill_steps_row(count: list, order: list, steps: int, ga: int) -> list[list[int]]:
    """:func:`_fill_steps` of one row: a heap of the steps with a free slot (the smallest sum first, ties to the lower
    step)."""
    members: list[list[int]] = [[] for _ in range(steps)]
    heap = [(0.0, i) for i in range(steps)]
    for j in order:
        total, i = heapq.heappop(heap)
        members[i].append(j)
        if len(members[i]) < ga:
            heapq.heappush(heap, (total + count[j], i))
    return members


def balance_steps(ids: np.ndarray, offsets: np.ndarray, bs: np.ndarray, shape_tokens: np.ndarray, dp: int, ga: int,
                  by: str, steps: Optional[int] = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Regroup the micro-steps of every block of :data:`STEP_BALANCE_BLOCK` optimizer steps so that the steps'
    sample (``by="samples"``) or token totals come out about equal (:func:`_fill_steps`). A micro-step keeps its
    batches (balance per micro-step is untouched); only which step it belongs to changes. ``steps``: regroup only
    the first ``steps`` optimizer steps (the epoch's re-planned tail stays as planned); default all. Returns the
    permuted ``(ids, offsets, batch_shape)``."""
    n_micro = len(bs) // dp
    sizes = np.diff(offsets)
    per = sizes if by == "samples" else sizes * shape_tokens[bs]
    count = per[:n_micro * dp].reshape(n_micro, dp).sum(axis=1)
    perm = np.arange(n_micro)
    n_steps = n_micro // ga if steps is None else min(int(steps), n_micro // ga)
    block = STEP_BALANCE_BLOCK * ga
    n_full = n_steps // STEP_BALANCE_BLOCK
    if n_full:   # the whole blocks together, then the last, shorter one
        dealt = _fill_steps(count[:n_full * block].reshape(n_full, block), STEP_BALANCE_BLOCK, ga)
        perm[:n_full * block] = (dealt.reshape(n_full, block) + (np.arange(n_full) * block)[:, None]).ravel()
    lo, hi = n_full * block, n_steps * ga
    if hi > lo:
        perm[lo:hi] = lo + _fill_steps(count[lo:hi][None], (hi - lo) // ga, ga).ravel()
    batch_perm = (perm[:, None] * dp + np.arange(dp)).ravel()
    new_sizes = sizes[batch_perm]
    del sizes, per
    new_offsets = np.zeros(len(new_sizes) + 1, np.int64)
    np.cumsum(new_sizes, out=new_offsets[1:])
    out = np.empty_like(ids)
    for a in range(0, len(batch_perm), _GATHER_CHUNK):   # the samples of a chunk of batches at a time (peak memory)
        b = min(a + _GATHER_CHUNK, len(batch_perm))
        gather = np.repeat(offsets[batch_perm[a:b]] - new_offsets[a:b], new_sizes[a:b])
        gather += np.arange(new_offsets[a], new_offsets[b])
        np.take(ids, gather, out=out[new_offsets[a]:new_offsets[b]])
    return out, new_offsets, bs[batch_perm]


#: batches whose samples :func:`balance_steps` gathers at once: its temporaries stay a few MB at any plan size
_GATHER_CHUNK = 1 << 16


def _uniform_checkpoint_counts(cost: CostModel, shapes: Sequence, bs: np.ndarray, sizes: np.ndarray, ckpt: np.ndarray,
                               b_cost: np.ndarray, b_mem: np.ndarray, dp: int):
    """Every DP rank of a micro-step checkpoints the same number of blocks: the largest of their own
    plans (a larger count only lowers a batch's memory, so each still fits ``m_mem``). ZeRO-3 gathers
    parameters with collectives in module order, and a rank that recomputes a block gathers in another
    order than one that does not: different counts in one micro-step hang it (seen with 2 CPU ranks).
    The batches whose count rises get its recompute in their cost (the plan's balance figures include it).
    ``bs``: each batch's index into ``shapes``."""
    n = ckpt.reshape(-1, dp).max(axis=1).repeat(dp)
    up = np.flatnonzero(n != ckpt)
    if up.size == 0:
        return ckpt, b_cost, b_mem
    b_cost, b_mem = b_cost.copy(), b_mem.copy()
    for u in np.unique(bs[up]).tolist():   # per shape, vectorised over its raised batches
        j = up[bs[up] == u]
        b_cost[j] = cost.ckpt_cost(shapes[u], sizes[j], n[j])
        b_mem[j] = cost.ckpt_memory(shapes[u], sizes[j], n[j])
    return n, b_cost, b_mem
