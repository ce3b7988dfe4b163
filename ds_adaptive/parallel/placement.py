"""Density-balanced Ulysses head placement (pure: no torch).

Under Ulysses the all-to-all gives SP rank ``r`` the contiguous heads ``[r*k, (r+1)*k)`` of the
(permuted) head axis, ``k = heads / sp``. With sparse attention a head's attention time is about
proportional to its density, so the rank that holds the densest heads of a layer is the straggler
of the whole SP group (the next all-to-all waits for it). A placement is a permutation ``perm`` of
the head axis applied before the all-to-all (``q[:, :, perm]``: new position ``j`` holds original
head ``perm[j]``) and undone after attention (``out[:, :, inverse(perm)]``); every rank keeps
exactly ``k`` heads, so the all-to-all stays even (DeepSpeed's DistributedAttention needs equal
splits).

:func:`balance_heads` chooses the permutation: LPT (densest head first, to the rank with the least
summed density that still has a free slot), then a swap pass that exchanges a head of the busiest
rank with a lighter head of another rank while that lowers the pair's maximum (every accepted swap
strictly lowers the sum of squared rank loads, so it terminates), then a depth-first
branch-and-bound over equal-count partitions that starts from that bound and stops after
``node_limit`` nodes: optimal for small head counts (12 heads over 4 ranks: ~15k partitions), never
worse than LPT + swaps for large ones. It returns the identity when the identity is already as
balanced (no needless permutation).

The objective is the busiest rank's summed density, i.e. its mean density (equal counts): that is
what :class:`ds_adaptive.planning.sparse_cost.SparseAttentionCost` charges for the layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence
from ds_adaptive.core.layout import heads_sp_problem

__all__ = ["balance_heads", "identity_placement", "inverse_permutation", "rank_sums", "rank_heads",
           "check_placement", "placement_lower_bound", "HeadPlacement", "plan_head_placement", "PlacementError"]

_EPS = 1e-12
_GAP = 1e-3   # the search stops within 0.1% of the lower bound (placement_lower_bound)


class PlacementError(ValueError):
    """A head permutation that is not a permutation, or heads that do not divide by sp."""


def identity_placement(num_heads: int) -> list[int]:
    """``[0, 1, ..., num_heads - 1]``: what Ulysses does without placement."""
    return list(range(int(num_heads)))


def inverse_permutation(perm: Sequence[int]) -> list[int]:
    """``inv`` with ``inv[perm[j]] == j``: ``x[:, :, perm][:, :, inv] == x``."""
    inv = [0] * len(perm)
    for j, h in enumerate(perm):
        inv[int(h)] = j
    return inv


def check_placement(perm: Sequence[int], num_heads: int, sp: int) -> None:
    """Raise :class:`PlacementError` unless ``perm`` is a permutation of ``range(num_heads)`` and
    ``sp`` divides ``num_heads`` (equal head counts per rank)."""
    problem = heads_sp_problem(num_heads, sp, "the head placement")
    if problem:
        raise PlacementError(problem)
    if len(perm) != num_heads or sorted(int(h) for h in perm) != list(range(num_heads)):
        raise PlacementError(f"head placement {list(perm)} is not a permutation of range({num_heads})")


def rank_heads(perm: Sequence[int], sp: int, rank: int) -> list[int]:
    """Original head ids that SP rank ``rank`` holds after the all-to-all under ``perm``."""
    k = len(perm) // sp
    return [int(h) for h in perm[rank * k:(rank + 1) * k]]


def rank_sums(density: Sequence[float], perm: Sequence[int], sp: int) -> list[float]:
    """Summed density of the heads of every SP rank under ``perm`` (``sp`` floats)."""
    return [sum(float(density[h]) for h in rank_heads(perm, sp, r)) for r in range(sp)]


def placement_lower_bound(density: Sequence[float], sp: int) -> float:
    """No equal-count placement has a busiest rank lighter than this: the mean rank sum, and the
    densest head together with the ``k - 1`` lightest others (it must share its rank with k - 1
    heads)."""
    d = sorted(float(x) for x in density)
    k = len(d) // sp
    return max(sum(d) / sp, d[-1] + sum(d[:k - 1]))


def balance_heads(density: Sequence[float], sp: int, *, max_swaps: Optional[int] = None,
                  node_limit: int = 50_000) -> list[int]:
    """A head permutation for one layer: equal heads per SP rank, near-equal summed density.

    Args:
        density: per head (original order) the attention density in (0, 1] (or any non-negative
            per-head cost, e.g. measured attention ms).
        sp: Ulysses degree; must divide ``len(density)``.
        max_swaps: bound on the swap pass (default ``4 * heads**2``; the pass ends earlier when no
            swap improves).
        node_limit: bound on the branch-and-bound search that follows (nodes visited); it stops
            early within 0.1% of :func:`placement_lower_bound`, and within the limit it finds the
            optimum (smallest busiest-rank sum), e.g. always for 12 heads over 4 ranks.

    Returns:
        ``perm`` (list of original head ids): rank ``r`` gets ``perm[r*k:(r+1)*k]``, each rank's
        heads in ascending order. Deterministic (ties broken by head id and rank). The identity when
        ``sp == 1`` or when the identity's busiest rank is not heavier than the balanced one's.
    """
    d = [float(x) for x in density]
    h = len(d)
    check_placement(list(range(h)), h, sp)
    if any(not (x >= 0.0) for x in d):
        raise PlacementError(f"head densities must be >= 0 (and not NaN), got {d}")
    ident = identity_placement(h)
    if sp == 1:
        return ident
    k = h // sp
    groups: list[list[int]] = [[] for _ in range(sp)]
    sums = [0.0] * sp
    for head in sorted(range(h), key=lambda i: (-d[i], i)):            # LPT, equal-count constraint
        r = min((r for r in range(sp) if len(groups[r]) < k), key=lambda r: (sums[r], r))
        groups[r].append(head)
        sums[r] += d[head]
    budget = 4 * h * h if max_swaps is None else int(max_swaps)
    for _ in range(budget):                                             # swap pass on the busiest rank
        top = max(range(sp), key=lambda r: (sums[r], -r))
        best = None
        for r in range(sp):
            if r == top:
                continue
            for i in groups[top]:
                for j in groups[r]:
                    delta = d[i] - d[j]
                    if delta <= _EPS:
                        continue
                    new_max = max(sums[top] - delta, sums[r] + delta)
                    if new_max < sums[top] - _EPS:
                        key = (new_max, r, i, j)
                        if best is None or key < best:
                            best = key
        if best is None:
            break
        _, r, i, j = best
        groups[top][groups[top].index(i)] = j
        groups[r][groups[r].index(j)] = i
        sums[top] -= d[i] - d[j]
        sums[r] += d[i] - d[j]
    groups = _exact_search(d, sp, k, groups, sums, node_limit)
    perm = [head for g in groups for head in sorted(g)]
    if max(rank_sums(d, ident, sp)) <= max(rank_sums(d, perm, sp)) + _EPS:
        return ident
    return perm


def _exact_search(d: list[float], sp: int, k: int, groups: list[list[int]], sums: list[float],
                  node_limit: int) -> list[list[int]]:
    """Branch and bound: heads densest first, each into a rank with a free slot (empty ranks are
    interchangeable: only the first empty one is tried); prune when a rank reaches the best max."""
    order = sorted(range(len(d)), key=lambda i: (-d[i], i))
    best_max = max(sums)
    best = [list(g) for g in groups]
    cur: list[list[int]] = [[] for _ in range(sp)]
    load = [0.0] * sp
    lower = placement_lower_bound(d, sp) * (1 + _GAP)
    if best_max <= lower:
        return best
    nodes = 0

    def dfs(pos: int) -> bool:          # True: stop (optimal reached or node limit)
        nonlocal best_max, best, nodes
        nodes += 1
        if nodes > node_limit:
            return True
        if pos == len(order):
            m = max(load)
            if m < best_max - _EPS:
                best_max, best = m, [list(g) for g in cur]
                return best_max <= lower
            return False
        head = order[pos]
        tried_empty = False
        for r in sorted(range(sp), key=lambda r: (load[r], r)):
            if len(cur[r]) >= k:
                continue
            if not cur[r]:
                if tried_empty:
                    continue
                tried_empty = True
            if load[r] + d[head] >= best_max - _EPS:
                continue
            cur[r].append(head)
            load[r] += d[head]
            stop = dfs(pos + 1)
            cur[r].pop()
            load[r] -= d[head]
            if stop:
                return True
        return False

    dfs(0)
    return best


@dataclass(frozen=True)
class HeadPlacement:
    """Per-layer head permutations for one Ulysses degree.

    ``perms[l]`` is layer ``l``'s permutation (see the module docstring); ``None`` for a layer
    means the identity. ``sp`` is the degree the placement was planned for.
    """

    sp: int
    perms: tuple[Optional[tuple[int, ...]], ...]

    @property
    def num_layers(self) -> int:
        return len(self.perms)

    def perm(self, layer: int, num_heads: int) -> list[int]:
        p = self.perms[layer]
        return identity_placement(num_heads) if p is None else list(p)

    def is_identity(self) -> bool:
        return all(p is None or list(p) == list(range(len(p))) for p in self.perms)

    def as_dict(self) -> dict:
        return {"sp": self.sp, "perms": [None if p is None else list(p) for p in self.perms]}


def plan_head_placement(density: Sequence[Sequence[float]], sp: int, *,
                        dense_layers: Sequence[int] = (), enabled: bool = True) -> HeadPlacement:
    """:func:`balance_heads` for every layer of a ``[layers][heads]`` density table.

    ``dense_layers`` (run dense attention: every head costs the same) and ``enabled=False`` (sparse
    attention off) give the identity for those layers / all layers."""
    dense = {int(x) for x in dense_layers}
    perms: list[Optional[tuple[int, ...]]] = []
    for layer, row in enumerate(density):
        if not enabled or layer in dense or sp == 1:
            perms.append(None)
            continue
        p = balance_heads(row, sp)
        perms.append(None if p == list(range(len(p))) else tuple(p))
    return HeadPlacement(sp=int(sp), perms=tuple(perms))
