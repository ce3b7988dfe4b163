"""Guards the process's memory of budget searches (ds_adaptive/planning/search_cache.py): a stored choice is the
fresh search's, and every input of the search (cost model, per-sample shapes and their order, arguments, the search
module's constants) is part of the key; a search that raises is not stored."""
from __future__ import annotations

import dataclasses
import warnings

import pytest

from ds_adaptive.core.config import SamplerConfig
from ds_adaptive.core.layout import Layout
from ds_adaptive.data import build_dataset
from ds_adaptive.planning import budget, search_cache
from ds_adaptive.planning.cost import CostModel
from ds_adaptive.planning.sampler import build_batch_sampler

H200 = "h200-wan2.1-1.3b"


def _shapes(n=300, seed=0):
    return build_dataset("synthetic", num_samples=n, shapes=None, seed=seed).sample_shapes()


def _choice(shapes, dp=2, rank=0, **cfg):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_batch_sampler(SamplerConfig(profile=H200, **cfg), shapes, Layout.explicit(dp_size=dp, dp_rank=rank),
                                   micro_steps_per_step="auto", gpu_mem_gib=139.8, model_name="wan2.1-1.3b",
                                   zero_stage=3).budget_choice


def test_the_other_ranks_get_the_first_ranks_search_and_it_equals_a_fresh_one():
    shapes = _shapes()
    search_cache.clear()
    before = dict(search_cache.STATS)
    first = _choice(shapes, rank=0)
    misses = search_cache.STATS["misses"] - before["misses"]
    assert misses >= 1
    second = _choice(shapes, rank=1)
    assert second is first and search_cache.STATS["misses"] - before["misses"] == misses   # no new search
    search_cache.clear()
    fresh = _choice(shapes, rank=1)
    assert fresh is not first and fresh == first and fresh.candidates == first.candidates


def test_every_input_is_in_the_key():
    shapes = _shapes(200)
    cost = CostModel(H200, checkpointing="auto")
    consts = budget._search_constants()
    kw = dict(m_mem=60.0, reference=900.0, dp_size=2, seed=0, global_batch=None)
    key = search_cache.search_key(cost, shapes, consts, **kw)
    assert key == search_cache.search_key(CostModel(H200, checkpointing="auto"), list(shapes), dict(consts), **kw)
    other_profile = dataclasses.replace(cost.profile, c0_ms=cost.profile.c0_ms + 1e-6)
    changed = [
        search_cache.search_key(CostModel(other_profile, checkpointing="auto"), shapes, consts, **kw),
        search_cache.search_key(CostModel(H200, checkpointing="auto", checkpoint_attention="keep"), shapes, consts,
                                **kw),
        search_cache.search_key(CostModel(H200, checkpointing="auto", sp=2), shapes, consts, **kw),
        search_cache.search_key(cost, list(shapes)[::-1], consts, **kw),                  # same shapes, other order
        search_cache.search_key(cost, list(shapes)[:-1], consts, **kw),
        search_cache.search_key(cost, shapes, {**consts, "SEARCH_DP": 8}, **kw),
        search_cache.search_key(cost, shapes, consts, **{**kw, "seed": 1}),
        search_cache.search_key(cost, shapes, consts, **{**kw, "dp_size": 3}),
        search_cache.search_key(cost, shapes, consts, **{**kw, "m_mem": 60.000001}),
        search_cache.search_key(cost, shapes, consts, **{**kw, "global_batch": SamplerConfig(
            global_batch={"samples": 64}).global_batch}),
    ]
    assert len({key, *changed}) == len(changed) + 1


def test_a_failed_search_is_not_stored_and_the_store_is_bounded():
    cost, shapes = CostModel(H200, checkpointing="auto"), _shapes(50)
    calls = []

    def fails(cost, shapes, **kw):
        calls.append(kw)
        raise ValueError("no plan")

    search_cache.clear()
    for _ in range(2):
        with pytest.raises(ValueError, match="no plan"):
            search_cache.cached_search(fails, cost, shapes, constants={}, x=1)
    assert len(calls) == 2
    for i in range(search_cache.SIZE + 3):
        assert search_cache.cached_search(lambda c, s, **kw: kw["x"], cost, shapes, constants={}, x=i) == i
    assert len(search_cache._STORE) == search_cache.SIZE
    assert search_cache.cached_search(lambda c, s, **kw: "again", cost, shapes, constants={}, x=0) == "again"  # out
    search_cache.clear()
