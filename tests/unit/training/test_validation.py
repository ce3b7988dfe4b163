"""Guards validation on a held-out split (ds_adaptive.data.split, ds_adaptive.training.validation): the split is
never planned into a training batch (hypothesis), its rows are planned within the training plan's memory budget and
dealt to every DP rank, and its loss under ZeRO-3 on 2 ranks equals a direct evaluation of the same samples."""
from __future__ import annotations

import json
import textwrap
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


SCRIPT = textwrap.dedent("""
    import json, sys
    import torch, deepspeed
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    import torch.distributed as dist
    from ds_adaptive.core.layout import Layout
    from ds_adaptive.core.shapes import SampleShape, ShapeWeight
    from ds_adaptive.data import SyntheticLatentDataset, split_held_out
    from ds_adaptive.models.objective import eval_inputs, per_sample_mse
    from ds_adaptive.models.registry import get_model
    from ds_adaptive.planning.cost import CostModel
    from ds_adaptive.planning.profile import load_profile
    from ds_adaptive.training.validation import plan_validation, score

    rank = dist.get_rank()
    spec = get_model("tiny")
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = spec.build(spec.config(num_layers=2))
    head = list(model.head.parameters())
    with deepspeed.zero.GatheredParameters(head, modifier_rank=0):
        g = torch.Generator().manual_seed(3)
        for p in head:
            p.data.copy_(0.05 * torch.randn(p.shape, generator=g))
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    shapes = [ShapeWeight(SampleShape(1, 64, 64), 2.0), ShapeWeight(SampleShape(5, 32, 64), 1.0),
              ShapeWeight(SampleShape(1, 32, 96), 1.0)]
    ds = SyntheticLatentDataset(60, shapes, seed=2, spec=spec.input_spec, text_len=(4, 12))
    _, held = split_held_out(ds, count=9, seed=4)
    cost = CostModel(load_profile("h100-wan2.1-1.3b"), "calibrated", checkpointing="auto")
    plan = plan_validation(held.sample_shapes(), cost, m_mem=0.12, dp_size=2, timesteps=3)
    mine = sum(len(b.rows) for b in plan.ranks[rank] if b.weight > 0)
    got = score(engine, held, plan, layout=Layout.explicit(dp_size=2, sp_size=1, dp_rank=rank, sp_rank=0), seed=7,
                shift=5.0, dtype=torch.float32, device=torch.device("cpu"), text_len=spec.text_len)
    plain = spec.build(spec.config(num_layers=2))
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        plain.load_state_dict({k: v.detach().clone() for k, v in engine.module.state_dict().items()})
    rows = []
    with torch.no_grad():
        for i in range(len(held)):          # directly: every held-out sample, all its timesteps in one batch
            s = held[i]
            x_t, t, target = eval_inputs(s["latents"], held.source_index(i), seed=7, shift=5.0, timesteps=3)
            ctx = torch.nn.functional.pad(s["context"], (0, 0, 0, spec.text_len - s["context"].shape[0]))
            rows += per_sample_mse(plain(x_t, t, ctx.unsqueeze(0).expand(3, -1, -1)), target).tolist()
    print("RESULT " + json.dumps({"rank": rank, "loss": got["loss"], "direct": sum(rows) / len(rows),
                                  "rows": got["rows"], "mine": mine, "forwards": plan.forwards,
                                  "batch_sizes": sorted({len(b.rows) for r in plan.ranks for b in r})}), flush=True)
""")


@pytest.mark.slow
def test_the_validation_loss_equals_a_direct_evaluation_and_every_rank_scores(tmp_path, run_ranks):
    """Two ZeRO-3 ranks score a held-out split of 9 samples x 3 timesteps, planned into batches of several rows of
    one shape and dealt to both ranks: the loss is what one process computes sample by sample."""
    res = [json.loads(next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))[7:])
           for r in run_ranks(["-c", SCRIPT], 2, cwd=tmp_path, timeout=300)]
    for r in res:
        assert r["rows"] == 27 and r["loss"] == pytest.approx(r["direct"], rel=1e-5), r
        assert max(r["batch_sizes"]) > 1                 # rows are batched (the test covers batching)
    assert all(r["mine"] > 0 for r in res) and sum(r["mine"] for r in res) == 27   # both ranks scored a share
    assert res[0]["loss"] == res[1]["loss"]
