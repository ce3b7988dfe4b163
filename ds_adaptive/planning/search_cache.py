"""A process's memory of budget searches: samplers of several ranks built in one process (the simulator's arms, the
tests' multi-rank plans, one Megatron loader per rank) search once.

The throughput search behind ``m_comp: auto`` (:func:`ds_adaptive.planning.budget.choose_compute_budget`) is a pure
function of its inputs and the same on every rank (the rank is not an input), and it is most of a sampler's start-up.
Its key is everything that can change its result: the cost model (the profile's fields, the sparse cost, the cost
mode and settings), the dataset's per-sample shapes in order, the search's arguments and the search's module
constants. A choice is returned as stored (a frozen :class:`~ds_adaptive.planning.budget.BudgetChoice`); a search
that raises is not stored. A lookup hashes the per-sample shape ids once (8 bytes per sample).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any, Callable, Sequence

from ds_adaptive.core.shapes import SampleShape
from ds_adaptive.planning.cost import CostModel
from ds_adaptive.planning.planner import unique_shapes

__all__ = ["cached_search", "clear", "search_key", "SIZE"]

#: searches kept (least recently used out): a process plans a few distinct runs at most
SIZE = 8
_STORE: "OrderedDict[str, Any]" = OrderedDict()
STATS = {"hits": 0, "misses": 0}


def _cost_key(cost: CostModel) -> str:
    return repr((cost.profile, cost.mode, cost.p, cost.sp, cost.num_heads, cost.sparse, cost.checkpointing,
                 cost.checkpoint_attention, cost.context_parallel))


def search_key(cost: CostModel, shapes: Sequence[SampleShape], constants: dict, **kwargs) -> str:
    """sha256 of the search's inputs: ``cost``, ``shapes`` (each sample's, in order), the search module's
    ``constants`` and the keyword arguments (their ``repr``: pydantic configs and frozen dataclasses print every
    field)."""
    uniq, sid = unique_shapes(shapes)
    h = hashlib.sha256()
    h.update(_cost_key(cost).encode())
    h.update(repr(tuple(uniq)).encode())
    h.update(sid.astype("<i8").tobytes())
    h.update(repr(sorted(constants.items())).encode())
    h.update(repr(sorted(kwargs.items())).encode())
    return h.hexdigest()


def cached_search(search: Callable[..., Any], cost: CostModel, shapes: Sequence[SampleShape], *, constants: dict,
                  **kwargs) -> Any:
    """``search(cost, shapes, **kwargs)``, or its stored result for the same inputs."""
    key = search_key(cost, shapes, constants, **kwargs)
    if key in _STORE:
        _STORE.move_to_end(key)
        STATS["hits"] += 1
        return _STORE[key]
    result = search(cost, shapes, **kwargs)
    STATS["misses"] += 1
    _STORE[key] = result
    while len(_STORE) > SIZE:
        _STORE.popitem(last=False)
    return result


def clear() -> None:
    """Forget every stored search."""
    _STORE.clear()
