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

import math
import warnings
from dataclasses import dataclass, field
from typing import Iterator, Literal, Mapping, Optional, Sequence, Union

import numpy as np

from ds_adaptive.planning.cost import CostModel
from ds_adaptive.planning.memory import MicroBatchTable, micro_batch_table, policy_blocks, sample_memory
from ds_adaptive.core.shapes import SampleShape

Mode = Literal["dual", "tokens", "fixed"]
Bucket = Union[SampleShape, int]
"""A shape bucket: a video/image shape, or a plain sequence length in tokens (non-video datasets)."""


def bucket_tokens(b: Bucket) -> int:
    """Tokens (unpadded) of a bucket."""
    return b.tokens if isinstance(b, SampleShape) else int(b)


class OversizeSampleError(ValueError):
    """A sample that exceeds a budget even alone (B=1)."""


class PlanError(ValueError):
    """Budgets or parameters that cannot produce a plan."""


@dataclass(frozen=True)
class PlannerParams:
    """Resolved planning parameters (budgets are numbers here, never ``auto``)."""

    mode: Mode
    dp_size: int
    micro_steps_per_step: int
    m_mem: float
    m_comp: Optional[float] = None
    max_tokens: Optional[int] = None
    fixed_batch_sizes: Optional[Mapping[str, int]] = None
    window: int = 256
    oversize: Literal["error", "skip"] = "error"
    balance_tolerance: float = 0.03
    #: ``dual``: a sample whose B=1 cost is over ``m_comp`` (but fits ``m_mem``) runs alone (B=1) instead of
    #: being oversize, and the other ranks of its micro-step get batches up to its cost (within ``m_mem``).
    #: Set by the throughput-optimal ``m_comp: auto`` (``ds_adaptive.planning.budget``), whose budget may be
    #: below the longest sample's cost.
    solo_over_budget: bool = False
    #: ``dual`` with a checkpoint plan per batch (``checkpointing: auto``): each shape's batch is at most the size
    #: with the lowest predicted time per sample, its cost plus the training loop's time per micro-step and share
    #: of an optimizer step's (``Profile.micro_step_overhead_ms``, ``optimizer_step_overhead_ms``). Past that size
    #: a larger batch checkpoints more blocks, and each recomputes a forward for every sample of the batch. Set by
    #: the budget search (``ds_adaptive.planning.budget``) where it predicts the capped plan faster.
    efficient_batches: bool = False

    def __post_init__(self) -> None:
        if self.mode not in ("dual", "tokens", "fixed"):
            raise PlanError(f"mode must be dual, tokens or fixed, got {self.mode!r}")
        if self.dp_size < 1 or self.micro_steps_per_step < 1:
            raise PlanError(f"dp_size ({self.dp_size}) and micro_steps_per_step "
                            f"({self.micro_steps_per_step}) must be >= 1")
        if not self.m_mem > 0:
            raise PlanError(f"memory budget m_mem must be > 0 GiB, got {self.m_mem}")
        if self.mode == "dual" and not (self.m_comp is not None and self.m_comp > 0):
            raise PlanError(f"mode dual needs a compute budget m_comp > 0, got {self.m_comp}")
        if self.mode == "tokens" and not (self.max_tokens and self.max_tokens > 0):
            raise PlanError(f"mode tokens needs max_tokens > 0, got {self.max_tokens}")

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["fixed_batch_sizes"] = dict(self.fixed_batch_sizes) if self.fixed_batch_sizes else None
        if not self.efficient_batches:   # only then: a sampler state saved before the field resumes its plan exactly
            del d["efficient_batches"]
        return d


@dataclass
class StepTotals:
    """Global counts of one optimizer step (over DP ranks; an SP group counts once)."""

    samples: int
    tokens: int
    micro_steps: int

    def loss_weight(self, local_samples: int, local_tokens: int, dp_size: int,
                    by: Literal["samples", "tokens"] = "samples") -> float:
        """Factor for one rank's mean micro-batch loss so that the DP-averaged gradient of the step
        is the mean over all samples (or tokens) of the step: local share x dp_size x micro_steps
        (DeepSpeed averages over DP and divides by gradient_accumulation_steps itself)."""
        num, den = (local_samples, self.samples) if by == "samples" else (local_tokens, self.tokens)
        return num / den * dp_size * self.micro_steps if den else 0.0

    def lr_scale(self, mode: Literal["none", "linear", "sqrt"], reference_batch: Optional[int]) -> float:
        """LR multiplier of this step: 1, samples/reference or sqrt(samples/reference)."""
        if mode == "none":
            return 1.0
        if not reference_batch:
            raise PlanError("lr_scaling needs sampler.reference_batch (global samples per optimizer "
                            "step that the base LR was tuned for)")
        r = self.samples / reference_batch
        return r if mode == "linear" else math.sqrt(r)


@dataclass
class EpochPlan:
    """All micro-steps of one epoch (or of a resumed segment of it).

    Batch ``j = micro * dp_size + rank`` holds ``sample_ids[batch_offsets[j]:batch_offsets[j+1]]``,
    all of shape ``shapes[batch_shape[j]]``.
    """

    dp_size: int
    micro_steps_per_step: int
    shapes: list[SampleShape]
    sample_ids: np.ndarray
    batch_offsets: np.ndarray
    batch_shape: np.ndarray
    batch_cost: np.ndarray
    batch_memory: np.ndarray
    batch_tokens: np.ndarray
    oversize: list[int] = field(default_factory=list)
    tail_dropped: list[int] = field(default_factory=list)
    tail_replanned: int = 0
    #: blocks to checkpoint (the first n) per batch: the checkpoint plan (ds_adaptive/planning/memory.py)
    batch_ckpt: Optional[np.ndarray] = None

    @property
    def num_micro_steps(self) -> int:
        return len(self.batch_shape) // self.dp_size

    @property
    def num_steps(self) -> int:
        return self.num_micro_steps // self.micro_steps_per_step

    @property
    def num_samples(self) -> int:
        return int(len(self.sample_ids))

    def batch(self, micro_step: int, dp_rank: int) -> list[int]:
        j = micro_step * self.dp_size + dp_rank
        return self.sample_ids[self.batch_offsets[j]:self.batch_offsets[j + 1]].tolist()

    def rank_batches(self, dp_rank: int, start_micro: int = 0) -> Iterator[list[int]]:
        for m in range(start_micro, self.num_micro_steps):
            yield self.batch(m, dp_rank)

    def micro_step_costs(self) -> np.ndarray:
        """[num_micro_steps, dp_size] predicted per-GPU cost of every batch."""
        return self.batch_cost.reshape(-1, self.dp_size)

    def batch_sizes(self) -> np.ndarray:
        return np.diff(self.batch_offsets)

    def checkpoint_blocks(self, micro_step: int, dp_rank: int) -> int:
        """Blocks that rank ``dp_rank`` checkpoints in ``micro_step`` (from the plan's checkpoint plan)."""
        if self.batch_ckpt is None:
            raise ValueError("this plan carries no checkpoint plan")
        return int(self.batch_ckpt[micro_step * self.dp_size + dp_rank])

    def step_totals(self, step: int) -> StepTotals:
        if not 0 <= step < self.num_steps:
            raise IndexError(f"optimizer step {step} is outside this plan (0..{self.num_steps - 1})")
        g = self.micro_steps_per_step * self.dp_size
        lo, hi = step * g, (step + 1) * g
        return StepTotals(samples=int(self.batch_offsets[hi] - self.batch_offsets[lo]),
                          tokens=int(self.batch_tokens[lo:hi].sum()), micro_steps=self.micro_steps_per_step)

    def samples_of_steps(self, num_steps: int) -> np.ndarray:
        """Sample ids consumed by the first ``num_steps`` optimizer steps."""
        hi = min(num_steps, self.num_steps) * self.micro_steps_per_step * self.dp_size
        return self.sample_ids[:self.batch_offsets[hi]]


# ============================================================================== shape tables
class _ShapeTable:
    """Per unique shape: per-sample cost/memory, largest feasible batch, tokens.

    When the cost model's checkpointing policy is the profile's own calibration (``all`` blocks of a
    checkpointed calibration), a batch costs ``c0 + B x cost1`` and holds ``B x mem1`` (``linear``).
    Otherwise (``auto``: the checkpoint plan of :mod:`ds_adaptive.planning.memory` decides per batch)
    costs, memory and checkpointed blocks come from a per-shape :class:`MicroBatchTable` over B;
    ``mem1`` is then the per-sample memory at the policy's fewest-memory count (feasibility)."""

    def __init__(self, shapes: Sequence[SampleShape], cost: CostModel, params: PlannerParams) -> None:
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
                b_mem = int(math.floor(params.m_mem / self.mem1[u] * (1 + 1e-12)))
                self.tables[u] = micro_batch_table(cost, s, max(b_mem, 1), params.m_mem)
            self.cost1 = np.array([t.cost[1] - c for t, c in zip(self.tables, self.c0)], float)
        self.tokens = np.array([bucket_tokens(s) for s in self.shapes], np.int64)
        self.padded = np.array([cost.padded_tokens(s) for s in self.shapes], np.int64)
        self.bmax = np.zeros(n, np.int64)
        self.bmem = np.zeros(n, np.int64)    # largest B within m_mem alone (fill batches of solo micro-steps)
        self.m_comp = params.m_comp if params.mode == "dual" else None
        self.solo = bool(params.solo_over_budget) and params.mode == "dual"
        self.why = [""] * n
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
        return int(self.bmem[u]) if self.solo else int(self.bmax[u])

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
        return np.maximum(self.bmax[cand], np.minimum(reach, self.bmem[cand]))

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


def unique_shapes(shapes: Sequence[Bucket]) -> tuple[list[Bucket], np.ndarray]:
    """Distinct shapes (sorted) and the per-sample index into them."""
    kinds = {type(s) for s in shapes}
    if len(kinds) > 1:
        raise PlanError(f"sample shapes mix {sorted(k.__name__ for k in kinds)}: give every sample a "
                        "SampleShape or every sample a token length, not both")
    uniq = sorted(set(shapes))
    pos = {s: i for i, s in enumerate(uniq)}
    return uniq, np.fromiter((pos[s] for s in shapes), np.int64, count=len(shapes))


# ============================================================================== planning
class _Builder:
    """Accumulates batches (flat) while planning."""

    def __init__(self, table: _ShapeTable, dp: int) -> None:
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


def _dual_micro_step(table: _ShapeTable, counts: np.ndarray, dp: int, anchor_ok: np.ndarray,
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


def _plan_dual_window(table: _ShapeTable, pool: list[list[int]], params: PlannerParams,
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


def _plan_bucket_window(table: _ShapeTable, pool: list[list[int]], params: PlannerParams, final: bool,
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


def _rebatch_tail(table: _ShapeTable, batches: list[tuple[int, list[int]]], n_slots: int
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
    while len(out) < n_slots:
        splittable = [i for i, (u, ids) in enumerate(out) if len(ids) >= 2]
        i = max(splittable, key=lambda j: table.batch_cost(out[j][0], len(out[j][1])))
        u, ids = out[i]
        h = len(ids) // 2
        out[i] = (u, ids[:h])
        out.append((u, ids[h:]))
    if len(out) > n_slots:   # an epoch shorter than one optimizer step: no full step can be formed
        return None
    return out


def _absorb_into_last_step(builder: _Builder, table: _ShapeTable, tail: list[tuple[int, list[int]]],
                           n_batches: int) -> list[int]:
    """Add tail samples to batches of the same shape in the last optimizer step where both budgets
    still allow one more sample; returns the samples that found no room (sorted)."""
    left: list[int] = []
    first = max(len(builder.shape) - n_batches, 0)
    for u, ids in tail:
        for i in ids:
            room = [j for j in range(first, len(builder.shape)) if builder.shape[j] == u
                    and builder.offsets[j + 1] - builder.offsets[j] < table.tail_cap(u)]
            if not room:
                left.append(i)
                continue
            j = min(room, key=lambda k: builder.offsets[k + 1] - builder.offsets[k])
            pos = builder.offsets[j + 1]
            builder.ids.insert(pos, i)
            for k in range(j + 1, len(builder.offsets)):
                builder.offsets[k] += 1
    return sorted(left)


def check_oversize(table: _ShapeTable, shape_ids: np.ndarray, order: np.ndarray, params: PlannerParams,
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
               params: PlannerParams, *, seed: int = 0) -> EpochPlan:
    """Plan all of ``order`` (sample ids, already shuffled) into micro-steps.

    ``shape_ids[i]`` indexes ``shapes`` for sample ``i``. Deterministic in all arguments.
    """
    table = _ShapeTable(shapes, cost, params)
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
    tail = builder.pop_last_micro_steps(r)
    tail.extend((u, ids) for u, ids in enumerate(pool) if ids)
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


# ============================================================================== budgets
