"""Guards validation on a held-out split (ds_adaptive.data.split, ds_adaptive.training.validation) in one process: the
split is never planned into a training batch (hypothesis), and its rows are planned within the training plan's
memory budget and dealt to every DP rank. Its loss under ZeRO-3 on 2 ranks is checked in
tests/integration/test_validation_launch.py."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds_adaptive.core.config import SamplerConfig
from ds_adaptive.core.features import ValidationConfig, validation_count
from ds_adaptive.core.layout import Layout
from ds_adaptive.core.shapes import SampleShape, load_shape_distribution
from ds_adaptive.data import DataError, DatasetView, split_held_out
from ds_adaptive.planning.cost import CostModel
from ds_adaptive.planning.memory import fewest_memory_blocks
from ds_adaptive.planning.profile import load_profile
from ds_adaptive.planning.sampler import build_batch_sampler
from ds_adaptive.training.validation import ValidationError, plan_validation

DIST = load_shape_distribution()


class _Shapes:
    """A dataset of shapes only (what the sampler plans from)."""

    def __init__(self, shapes):
        self.shapes = list(shapes)

    def __len__(self):
        return len(self.shapes)

    def sample_shapes(self):
        return list(self.shapes)

    def describe(self):
        return f"{len(self)} shapes"


def mix(n, seed=0):
    w = np.array([d.weight for d in DIST])
    idx = np.random.default_rng(seed).choice(len(DIST), n, p=w / w.sum())
    return [DIST[i].shape for i in idx]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(8, 240), share=st.floats(0.01, 0.6), seed=st.integers(0, 10**6), dp=st.sampled_from([1, 2, 4]),
       epoch=st.integers(0, 2))
def test_the_held_out_split_is_never_in_a_training_batch(n, share, seed, dp, epoch):
    base = _Shapes(mix(n, seed % 97))
    count = validation_count(ValidationConfig(samples=share), n) if share * n < n - 1 else n - 1
    train, held = split_held_out(base, count=count, seed=seed)
    held_ids = {held.source_index(i) for i in range(len(held))}
    assert len(held_ids) == count and len(train) == n - count
    assert {train.source_index(i) for i in range(len(train))}.isdisjoint(held_ids)
    assert train.sample_shapes() == [base.shapes[train.source_index(i)] for i in range(len(train))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for r in range(dp):
            sampler = build_batch_sampler(SamplerConfig(window=32, seed=seed % 13, cost_model="power"),  # no search
                                          train.sample_shapes(),
                                          Layout.explicit(dp_size=dp, sp_size=1, dp_rank=r, sp_rank=0),
                                          micro_steps_per_step=1)
            sampler.set_epoch(epoch)
            planned = [train.source_index(i) for batch in sampler for i in batch]
            # a training split too small for one micro-step of dp ranks plans nothing, and counts it (never silently)
            assert planned or len(sampler.plan.tail_dropped) + len(sampler.plan.oversize) == len(train)
            assert not set(planned) & held_ids
    again, _ = split_held_out(base, count=count, seed=seed)   # a pure function of (n, count, seed)
    assert np.array_equal(again.indices, train.indices)


def test_split_counts_fractions_and_errors():
    assert validation_count(ValidationConfig(samples=0.1), 1000) == 100
    assert validation_count(ValidationConfig(samples=0.0001), 1000) == 1
    assert validation_count(ValidationConfig(samples=64), 1000) == 64
    with pytest.raises(ValueError, match="leaving none to train"):
        validation_count(ValidationConfig(samples=10), 10)
    with pytest.raises(DataError):
        split_held_out(_Shapes(mix(5)), count=5, seed=0)
    train, held = split_held_out(_Shapes(mix(20)), count=3, seed=1)
    assert isinstance(held, DatasetView) and "held-out" in held.describe() and len(held) == 3


def _cost():
    return CostModel(load_profile("h100-wan2.1-1.3b"), "calibrated", checkpointing="auto")


@pytest.mark.parametrize("dp", [1, 2, 3, 8])
def test_plan_covers_every_row_once_within_the_budget_on_every_rank(dp):
    cost = _cost()
    shapes = mix(40, 3)
    m_mem = 30.0
    plan = plan_validation(shapes, cost, m_mem=m_mem, dp_size=dp, timesteps=4)
    real = [row for r in plan.ranks for b in r if b.weight > 0 for row in b.rows]
    assert sorted(real) == [(i, k) for i in range(40) for k in range(4)]
    assert all(len(r) == plan.forwards for r in plan.ranks)            # the same forwards on every rank
    for r in plan.ranks:
        for b in r:
            shape = {shapes[i] for i, _ in b.rows}
            assert len(shape) == 1                                      # one shape per batch
            s = shape.pop()
            assert float(cost.ckpt_memory(s, len(b.rows), fewest_memory_blocks(cost, s))) <= m_mem * (1 + 1e-9)
    costs = plan.rank_costs()
    if dp <= 3:   # 40 samples x 4 rows: every rank scores a share, about an equal one
        assert min(costs) > 0 and max(costs) / min(costs) < 1.5, costs


def test_a_row_over_the_budget_is_an_error_or_skipped():
    cost = _cost()
    big, small = SampleShape(81, 720, 1280), SampleShape(1, 480, 832)
    with pytest.raises(ValidationError, match="held-out sample 0 .*81x720x1280.*sampler.oversize"):
        plan_validation([big, small], cost, m_mem=2.0, dp_size=2, timesteps=2)
    plan = plan_validation([big, small], cost, m_mem=2.0, dp_size=2, timesteps=2, oversize="skip")
    assert plan.skipped == [0] and plan.samples == 1 and plan.rows == 2


