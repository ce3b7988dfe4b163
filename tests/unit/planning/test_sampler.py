"""Batch samplers: exactly-once across DP ranks, identical SP-group batches, equal micro-step counts,
determinism, resume (same topology, 4 -> 2 and 2 -> 4 DP ranks), DataLoader, config errors."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_adaptive.core.config import SamplerConfig
from ds_adaptive.planning.planner import OversizeSampleError
from ds_adaptive.planning.sampler import (AdaptiveBatchSampler, FixedBucketSampler, SamplerStateError, TokenBucketSampler,
                                 build_batch_sampler)
from ds_adaptive.core.layout import Layout
from ds_adaptive.core.shapes import IndexedShapes, SampleShape, load_shape_distribution

DIST = load_shape_distribution()


def mix(n, seed=0):
    w = np.array([d.weight for d in DIST])
    idx = np.random.default_rng(seed).choice(len(DIST), n, p=w / w.sum())
    return [DIST[i].shape for i in idx]


CFG = SamplerConfig(window=32, seed=5)


def build(shapes, dp, sp=1, ga=2, cfg=CFG, **kw):
    """One sampler per rank of a dp x sp topology: {(dp_rank, sp_rank): sampler}."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {(r, s): build_batch_sampler(cfg, shapes, Layout.explicit(dp_size=dp, sp_size=sp, dp_rank=r, sp_rank=s), micro_steps_per_step=ga, **kw)
                for r in range(dp) for s in range(sp)}


def run(samplers):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {k: list(s) for k, s in samplers.items()}


@pytest.mark.parametrize("mode", ["dual", "tokens", "fixed"])
def test_exactly_once_equal_counts_and_sp_groups(mode):
    shapes = mix(3000)
    ss = build(shapes, dp=3, sp=2, cfg=CFG.model_copy(update={"mode": mode}))
    out = run(ss)
    counts = {len(v) for v in out.values()}
    assert len(counts) == 1 and counts.pop() == len(ss[(0, 0)])           # same micro-steps everywhere
    for r in range(3):
        assert out[(r, 0)] == out[(r, 1)]                                  # SP group: identical batches
    ids = [i for r in range(3) for b in out[(r, 0)] for i in b]
    stats = ss[(0, 0)].epoch_stats()
    assert len(ids) == len(set(ids)) == stats["samples"]
    assert stats["samples"] + stats["oversize"] + stats["tail_dropped"] == len(shapes)
    assert all(len({shapes[i] for i in b}) == 1 for v in out.values() for b in v)
    cls = {"dual": AdaptiveBatchSampler, "tokens": TokenBucketSampler, "fixed": FixedBucketSampler}[mode]
    assert isinstance(ss[(0, 0)], cls)


def test_disabled_builds_the_token_baseline_at_the_same_memory_budget():
    shapes = mix(500)
    on = build_batch_sampler(CFG, shapes, Layout.explicit(dp_size=2), micro_steps_per_step=1)
    off = build_batch_sampler(CFG, shapes, Layout.explicit(dp_size=2), micro_steps_per_step=1, enabled=False)
    assert isinstance(off, TokenBucketSampler) and off.params.m_mem == on.params.m_mem


def test_deterministic_and_epochs_differ():
    shapes = mix(1500)
    a, b = build(shapes, 2)[(0, 0)], build(shapes, 2)[(0, 0)]
    assert list(a) == list(b)
    a.set_epoch(1)
    assert list(a) != list(b)
    b.set_epoch(1)
    assert list(a) == list(b)


def test_step_totals_are_global_counts():
    shapes = mix(2000)
    ss = build(shapes, 4, ga=2)
    out = run(ss)
    s0 = ss[(0, 0)]
    for step in range(s0.steps_per_epoch):
        t = s0.step_totals(step)
        batches = [out[(r, 0)][m] for r in range(4) for m in (2 * step, 2 * step + 1)]
        assert t.samples == sum(len(b) for b in batches)
        assert t.tokens == sum(shapes[i].tokens for b in batches for i in b)
        assert t.micro_steps == 2
    with pytest.raises(IndexError):
        s0.step_totals(s0.steps_per_epoch)


def _resume(shapes, dp_from, dp_to, consumed, mode="dual", ga=2, cfg=CFG, clip=False):
    """Save after ``consumed`` steps on ``dp_from`` ranks (``clip``: at most the epoch's steps), resume on ``dp_to``."""
    cfg = cfg.model_copy(update={"mode": mode})
    old = build(shapes, dp_from, ga=ga, cfg=cfg)
    if clip:
        consumed = min(consumed, old[(0, 0)].steps_per_epoch)
    done = [i for (r, _), s in old.items() for b in list(s)[:consumed * ga] for i in b]
    state = old[(0, 0)].state_dict(consumed)
    new = build(shapes, dp_to, ga=ga, cfg=cfg)
    for s in new.values():
        s.load_state_dict(state)
    rest = run(new)
    return old, new, done, rest, state


@pytest.mark.parametrize("mode", ["dual", "tokens"])
def test_resume_same_topology_continues_the_same_plan(mode):
    shapes = mix(2500)
    old, new, done, rest, _ = _resume(shapes, 3, 3, consumed=4, mode=mode)
    full = run(old)
    for r in range(3):
        assert rest[(r, 0)] == full[(r, 0)][4 * 2:]
    assert new[(0, 0)].steps_per_epoch == old[(0, 0)].steps_per_epoch
    assert new[(0, 0)].step_totals(5) == old[(0, 0)].step_totals(5)


@pytest.mark.parametrize("dp_from,dp_to", [(4, 2), (2, 4)])
@pytest.mark.parametrize("mode", ["dual", "tokens"])
def test_resume_on_another_world_size_never_repeats(dp_from, dp_to, mode):
    shapes = mix(3000)
    old, new, done, rest, state = _resume(shapes, dp_from, dp_to, consumed=3, mode=mode)
    after = [i for v in rest.values() for b in v for i in b]
    assert not set(done) & set(after)
    assert len(after) == len(set(after))
    s = new[(0, 0)]
    stats = s.epoch_stats()
    assert len(done) + len(after) + stats["oversize"] + stats["tail_dropped"] == len(shapes)
    assert len({len(v) for v in rest.values()}) == 1
    assert s.steps_per_epoch == 3 + s.plan.num_steps
    assert s.step_totals(3).samples == sum(len(v[0]) + len(v[1]) for v in rest.values())
    assert s.step_totals(0) == old[(0, 0)].step_totals(0)    # steps before the resume still answer
    # a second save/resume (back to the original world size) still never repeats
    st2 = s.state_dict(5)
    done2 = done + [i for v in rest.values() for b in v[:2 * 2] for i in b]
    back = build(shapes, dp_from, cfg=CFG.model_copy(update={"mode": mode}))
    for b in back.values():
        b.load_state_dict(st2)
    after2 = [i for v in run(back).values() for b in v for i in b]
    assert not set(done2) & set(after2) and len(done2) + len(after2) <= len(shapes)
    assert len(set(done2) | set(after2)) + back[(0, 0)].epoch_stats()["tail_dropped"] == len(shapes)


@settings(max_examples=12, deadline=None)
@given(n=st.integers(40, 900), dp_from=st.integers(1, 4), dp_to=st.integers(1, 4), consumed=st.integers(0, 3),
       ga=st.integers(1, 2), seed=st.integers(0, 9))
def test_resume_property(n, dp_from, dp_to, consumed, ga, seed):
    """Any resume never repeats a sample and keeps equal micro-step counts. A set budget: the property is the
    sampler's state, not the budget search's choice (the resume tests above run ``m_comp: auto``); each of
    the examples' 24 searches would be its own (seconds each)."""
    shapes = mix(n, seed)
    _, new, done, rest, _ = _resume(shapes, dp_from, dp_to, consumed, ga=ga, clip=True,   # one plan per rank and world
                                    cfg=CFG.model_copy(update={"m_comp": 12000.0}))
    after = [i for v in rest.values() for b in v for i in b]
    assert not set(done) & set(after) and len(after) == len(set(after))
    assert len({len(v) for v in rest.values()}) == 1


def test_state_errors_are_explained():
    shapes = mix(300)
    s = build(shapes, 2)[(0, 0)]
    st_ = s.state_dict(0)
    other = build(mix(301), 2)[(0, 0)]
    with pytest.raises(SamplerStateError, match="301"):
        other.load_state_dict(st_)
    with pytest.raises(SamplerStateError, match="seed"):
        build(shapes, 2, cfg=CFG.model_copy(update={"seed": 9}))[(0, 0)].load_state_dict(st_)
    with pytest.raises(SamplerStateError, match="format"):
        s.load_state_dict({"format": "x"})
    with pytest.raises(ValueError, match="consumed_steps"):
        s.state_dict(10 ** 6)


def test_oversize_error_and_skip_through_the_sampler():
    shapes = [SampleShape(1, 480, 832)] * 40 + [SampleShape(81, 720, 1280)] * 2
    cfg = CFG.model_copy(update={"m_mem": 10.0})
    s = build_batch_sampler(cfg, shapes, Layout.explicit(dp_size=2), micro_steps_per_step=1)
    with pytest.raises(OversizeSampleError, match="sample 40 .*81x720x1280"):
        list(s)
    s = build_batch_sampler(cfg.model_copy(update={"oversize": "skip"}), shapes, Layout.explicit(dp_size=2), micro_steps_per_step=1)
    with pytest.warns(UserWarning, match="skipping 2 oversize"):
        list(s)
    assert s.epoch_stats()["oversize"] == 2


def test_topology_detect_single_process_and_errors():
    assert Layout.detect() == Layout.explicit()
    with pytest.raises(ValueError):
        Layout.explicit(dp_size=2, dp_rank=2)
    with pytest.raises(Exception, match="sp=8|heads"):
        build_batch_sampler(CFG, mix(10), Layout.explicit(sp_size=8), micro_steps_per_step=1)


def test_works_as_a_dataloader_batch_sampler():
    torch = pytest.importorskip("torch")
    shapes = mix(400)

    class DS(torch.utils.data.Dataset):
        def __len__(self):
            return len(shapes)

        def __getitem__(self, i):
            return torch.zeros(*shapes[i].latent_grid), i

    s = build_batch_sampler(CFG, shapes, Layout.explicit(dp_size=2, dp_rank=1), micro_steps_per_step=1)
    loader = torch.utils.data.DataLoader(DS(), batch_sampler=s)
    got = [idx.tolist() for _, idx in loader]
    assert got == list(s) and len(got) == len(s)


def test_lr_scale_from_config():
    s = build_batch_sampler(CFG, mix(800), Layout.explicit(dp_size=2), micro_steps_per_step=1,
                            optimization={"lr_scaling": "sqrt", "reference_batch": 16})
    t = s.step_totals(0)
    assert s.lr_scale(0) == pytest.approx((t.samples / 16) ** 0.5)


def test_a_planner_given_ids_plans_what_it_plans_from_the_list():
    dist = load_shape_distribution()
    rng = np.random.default_rng(5)
    listed = [dist[i].shape for i in rng.integers(0, len(dist), 3000)]
    cfg = {"profile": "h100-wan2.1-1.3b", "window": 64}
    plans = [build_batch_sampler(cfg, s, Layout.explicit(dp_size=4, dp_rank=1), micro_steps_per_step=2,
                                 model_name="wan2.1-1.3b") for s in (listed, IndexedShapes.of_dataset(_Listed(listed)))]
    assert isinstance(plans[1].shapes, IndexedShapes) and plans[0].state_dict(0) == plans[1].state_dict(0)
    assert [list(b) for b in plans[0]] == [list(b) for b in plans[1]]


class _Listed:
    """A dataset that gives its shapes as unique shapes and ids."""

    def __init__(self, shapes):
        self.unique = sorted(set(shapes))
        self.ids = np.array([self.unique.index(s) for s in shapes], np.int32)

    def unique_shapes(self):
        return self.unique

    def shape_ids(self):
        return self.ids
