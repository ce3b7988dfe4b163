"""Guards `recompute.attention: keep` (ds_adaptive/models/recompute.py): a checkpointed block keeps its
self-attention output, so backward runs the attention forward once, with the same gradients; the cost model
counts the smaller recompute and the kept bytes, the sampler state carries the mode, build_run sets it."""
from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from ds_adaptive.planning.cost import CostModel
from ds_adaptive.planning.profile import GIB
from ds_adaptive.planning.sparse_cost import SparseAttentionCost
from ds_adaptive.core.contracts import DensityMap
from ds_adaptive.models.testing import AttentionCalls
from ds_adaptive.models.wan import WanModel
from ds_adaptive.models.wan_config import WanConfigError, get_wan_config
from ds_adaptive.models.recompute import kept_attention_bytes_per_token

ROOT = Path(__file__).resolve().parents[3]
H200 = "h200-wan2.1-1.3b"


def _inputs(channels: int, per_token: bool):
    g = torch.Generator().manual_seed(1)
    lat = torch.randn(2, channels, 3, 6, 10, generator=g, dtype=torch.float64)   # 3 x 3 x 5 = 45 tokens
    if per_token:
        t = torch.rand(2, 45, generator=g, dtype=torch.float64) * 1000
        t[0, :15] = 0.0                                           # image-to-video: the first frame at t = 0
    else:
        t = torch.tensor([130.0, 810.0], dtype=torch.float64)
    ctx = torch.randn(2, 7, 4096, generator=g, dtype=torch.float64)
    return lat, t, ctx


def _train_step(model, mode: str, n: int, per_token: bool):
    m = copy.deepcopy(model)
    m.set_checkpoint_attention(mode)
    m.set_checkpoint_blocks(n)
    lat, t, ctx = _inputs(m.config.in_channels, per_token)
    loss = (m(lat, t, ctx) ** 2).mean()
    counter = AttentionCalls()
    with counter:
        loss.backward()
    return loss.detach(), [p.grad for p in m.parameters()], counter.calls


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("preset", ["tiny", "tiny-ti2v"])
def test_keep_gives_the_same_gradients_and_runs_self_attention_once(preset, n):
    from ds_adaptive.models import get_model

    spec = get_model(preset)
    torch.manual_seed(0)
    model = spec.build(spec.config(num_layers=3)).double()
    per_token = preset == "tiny-ti2v"
    ref_loss, ref_grads, plain_calls = _train_step(model, "recompute", 0, per_token)
    assert plain_calls == 0                                   # nothing recomputed without checkpointing
    for mode, calls in (("recompute", 2 * n), ("keep", n)):   # keep: only the cross-attention runs again
        loss, grads, got = _train_step(model, mode, n, per_token)
        assert got == calls, (mode, got)
        assert torch.equal(loss, ref_loss)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_set_checkpoint_attention_rejects_unknown_modes():
    m = WanModel(get_wan_config("tiny"))
    assert m.checkpoint_attention == "recompute"
    with pytest.raises(WanConfigError, match="set_checkpoint_attention: mode must be one of"):
        m.set_checkpoint_attention("save")


@pytest.mark.parametrize("S,B", [(1560, 11), (32760, 2), (75600, 1)])
def test_cost_model_counts_the_kept_bytes_and_drops_the_attention_recompute(S, B):
    rec = CostModel(H200, checkpointing="auto")
    keep = CostModel(H200, checkpointing="auto", checkpoint_attention="keep")
    pr = rec.profile
    kept = kept_attention_bytes_per_token(pr.dim, pr.num_heads) / GIB
    assert kept_attention_bytes_per_token(1536, 12) == 3120
    quad = pr.recompute_ms[2] * S * S                           # one block's recomputed attention, per sample
    for n in (0, 1, 12, pr.num_layers):
        assert float(keep.ckpt_memory(S, B, n) - rec.ckpt_memory(S, B, n)) == pytest.approx(B * n * kept * S)
        assert float(rec.ckpt_cost(S, B, n) - keep.ckpt_cost(S, B, n)) == pytest.approx(B * n * quad)
    # the profile's own state (every block checkpointed, attention recomputed) is no longer the keep run's
    assert rec.as_profiled(pr.num_layers) and not keep.as_profiled(pr.num_layers) and not rec.as_profiled(0)
    assert float(keep.ckpt_cost(S, B, pr.num_layers)) < rec.batch_cost(S, B)


def test_keep_saves_only_the_dense_layers_of_a_sparse_run():
    """A sparse layer's kernel is recomputed (not a kept SDPA op): only dense layers lose their recompute."""
    dm = DensityMap(tuple(tuple([0.1] * 12) for _ in range(30)), dense_layers=(0, 1, 29))
    sparse = SparseAttentionCost(dm)
    rec = CostModel(H200, checkpointing="auto", sparse=sparse)
    keep = CostModel(H200, checkpointing="auto", sparse=sparse, checkpoint_attention="keep")
    S = 75600
    runs_sparse = np.asarray(keep.sparse.layer_decisions(S, 1)[0], bool)
    assert not runs_sparse[[0, 1, 29]].any() and runs_sparse[2:29].all()
    quad = keep.profile.recompute_ms[2] * S * S
    for n, dense_before in ((1, 1), (2, 2), (10, 2), (30, 3)):
        assert float(rec.ckpt_cost(S, 1, n) - keep.ckpt_cost(S, 1, n)) == pytest.approx(dense_before * quad)
    assert keep.with_sparse(None).checkpoint_attention == "keep"


def test_sampler_state_carries_the_mode_and_the_plan_uses_it():
    from ds_adaptive.planning.sampler import build_batch_sampler
    from ds_adaptive.simulation.simulate import draw_shapes
    from ds_adaptive.core.layout import Layout
    from ds_adaptive.core.shapes import load_shape_distribution

    shapes = draw_shapes(load_shape_distribution(), 300, seed=3)
    topo = Layout.explicit(dp_rank=0, dp_size=1)

    def sampler(mode):
        cfg = {"profile": H200, "m_mem": 60.0, "m_comp": 12000.0, "window": 32}
        return build_batch_sampler(cfg, shapes, topo, micro_steps_per_step=2, checkpointing="auto",
                                   model_name="wan2.1-1.3b", recompute={"attention": mode})

    a, rec = sampler("keep"), sampler("recompute")
    assert a.cost.checkpoint_attention == "keep"
    plan = a.plan
    assert plan.batch_ckpt is not None and plan.batch_ckpt.max() > 0          # the memory budget binds
    j = int(np.argmax(plan.batch_ckpt))
    u, b = plan.batch_shape[j], plan.batch_sizes()[j]
    assert plan.batch_cost[j] == pytest.approx(float(a.cost.ckpt_cost(plan.shapes[u], b, plan.batch_ckpt[j])))
    assert plan.batch_cost[j] < float(rec.cost.ckpt_cost(plan.shapes[u], b, plan.batch_ckpt[j]))
    state = a.state_dict(3)
    assert state["segments"][-1]["checkpoint_attention"] == "keep"
    assert "checkpoint_attention" not in rec.state_dict(3)["segments"][-1]   # older states stay as they were
    b2 = sampler("keep")
    b2.load_state_dict(state)
    assert [b2.checkpoint_blocks(st, m) for st in range(3, b2.steps_per_epoch) for m in range(2)] == \
        [a.checkpoint_blocks(st, m) for st in range(3, a.steps_per_epoch) for m in range(2)]


def test_hardware_flops_leave_out_the_kept_attention():
    from ds_adaptive.models import get_model

    spec = get_model("wan2.1-1.3b")
    cfg = spec.config()
    S, B, n = 32760, 2, 7
    model, hw = spec.flops(cfg, S, B, n)
    model_k, hw_k = spec.flops(cfg, S, B, n, kept_attention=True)
    assert model_k == model
    assert hw - hw_k == pytest.approx(n * B * 4 * S * S * cfg.dim)


@pytest.mark.parametrize("ckpt,note", [("auto", "keeps its self-attention output"), ("none", "does nothing")])
def test_build_run_sets_the_mode_on_the_model_and_says_so(ckpt, note):
    from ds_adaptive.core.layout import Layout
    from ds_adaptive.training.assemble import build_run
    from ds_adaptive.training.run_config import RunConfig

    cfg = RunConfig.load(str(ROOT / "launch" / "configs" / "zero3_adaptive.json"),
                         trainer={"model": "wan2.1-1.3b", "num_samples": 200},
                         overrides={"sampler.profile": H200, "recompute.attention": "keep",
                                    "recompute.blocks": ckpt})
    run = build_run(cfg, layout=Layout.for_world(1, 1), meta=True, gpu_mem_gib=139.8)
    assert run.model.checkpoint_attention == "keep"
    assert run.sampler.cost.checkpoint_attention == "keep"
    assert sum(note in n for n in run.notes) == 1, run.notes


def test_config_rejects_an_unknown_mode_naming_the_key():
    from ds_adaptive.core.config import AdaptiveLoadConfig

    with pytest.raises(Exception, match="recompute.attention"):
        AdaptiveLoadConfig.model_validate({"enabled": True, "recompute": {"attention": "save"}})


def test_the_recompute_takes_the_kept_outputs_in_order_and_names_a_mismatch():
    """The mode pair directly: only the self-attention core's SDPA calls are kept; a recompute that makes more
    such calls than its forward is an error that says what to do (not a silent recompute with other outputs)."""
    import torch.nn.functional as F

    from ds_adaptive.models.recompute import keep_attention_context, self_attention_core

    q, k, v = (torch.randn(1, 2, 9, 4, dtype=torch.float64) for _ in range(3))
    keep, reuse = keep_attention_context()()
    with keep:
        F.scaled_dot_product_attention(q, k, v)                       # outside the core: not kept
        with self_attention_core():
            first = F.scaled_dot_product_attention(q, k, v)
            second = F.scaled_dot_product_attention(q * 2, k, v)
    assert keep.store.outputs and len(keep.store.outputs) == 2
    with reuse, self_attention_core():
        a = F.scaled_dot_product_attention(torch.zeros_like(q), k, v)   # answered from the store, not computed
        b = F.scaled_dot_product_attention(q, k, v)
        assert torch.equal(a, first) and torch.equal(b, second)
        with pytest.raises(RuntimeError, match="called its self-attention core 3 time"):
            F.scaled_dot_product_attention(q, k, v)


def _default_job_sampler(mode, **kw):
    import warnings

    from ds_adaptive.planning.sampler import build_batch_sampler
    from ds_adaptive.core.config import SamplerConfig
    from ds_adaptive.data.synthetic import SyntheticLatentDataset
    from ds_adaptive.core.layout import Layout

    cfg = {"mode": "dual", "cost_model": "calibrated", "profile": H200, "m_mem": "auto", "m_comp": "auto", **kw}
    logs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = build_batch_sampler(SamplerConfig.model_validate(cfg), SyntheticLatentDataset(3000, seed=0).sample_shapes(),
                                Layout.explicit(dp_size=1), micro_steps_per_step="auto", gpu_mem_gib=139.8,
                                model_name="wan2.1-1.3b", zero_stage=3, ln_modulate="fused", block_fusion="regions",
                                profile_log=logs.append, recompute={"attention": mode})
    return s, logs


def test_auto_plans_both_and_runs_the_one_predicted_faster():
    """The default job's mix on the H200 profile: ``auto`` plans keep and recompute and runs the higher predicted
    tokens/s (keep there: its long clips checkpoint blocks whose attention is most of their recompute)."""
    auto, logs = _default_job_sampler("auto")
    keep, _ = _default_job_sampler("keep")
    rec, _ = _default_job_sampler("recompute")
    tps = {m: s.budget_choice.predicted_tokens_per_s for m, s in (("keep", keep), ("recompute", rec))}
    pick = max(tps, key=tps.get)
    assert auto.cost.checkpoint_attention == pick == "keep"
    ref = keep if pick == "keep" else rec
    assert auto.budget_choice.predicted_tokens_per_s == tps[pick]
    assert (auto.budget_choice.m_comp, auto.micro_steps_per_step) == (ref.budget_choice.m_comp, ref.micro_steps_per_step)
    assert np.array_equal(auto.plan.batch_ckpt, ref.plan.batch_ckpt)
    (line,) = [x for x in logs if "recompute.attention auto" in x]
    assert f"auto -> {pick}" in line and f"{tps['keep']:,.0f}" in line and f"{tps['recompute']:,.0f}" in line


def test_auto_recomputes_without_the_budget_search_or_a_family_that_can_keep(monkeypatch):
    fixed, logs = _default_job_sampler("auto", m_comp=4000.0)   # no search: nothing to compare
    assert fixed.cost.checkpoint_attention == "recompute" and not any("recompute.attention" in x for x in logs)
    import dataclasses

    import ds_adaptive.planning.sampler as sampler_mod

    real = sampler_mod.get_model

    def no_keep(name):
        m = real(name)
        return dataclasses.replace(m, family=dataclasses.replace(m.family, keeps_attention=False))

    monkeypatch.setattr(sampler_mod, "get_model", no_keep)
    plain, logs = _default_job_sampler("auto")
    assert plain.cost.checkpoint_attention == "recompute" and not any("recompute.attention" in x for x in logs)


def test_build_run_applies_the_planned_mode_to_the_model():
    from ds_adaptive.core.layout import Layout
    from ds_adaptive.training.assemble import build_run
    from ds_adaptive.training.run_config import RunConfig

    cfg = RunConfig.load(str(ROOT / "launch" / "configs" / "zero3_adaptive.json"),
                         trainer={"model": "wan2.1-1.3b", "num_samples": 3000},
                         overrides={"sampler.profile": H200})
    assert cfg.adaptive_load.recompute.attention == "auto"   # the default
    run = build_run(cfg, layout=Layout.for_world(1, 1), meta=True, gpu_mem_gib=139.8)
    assert run.model.checkpoint_attention == run.sampler.cost.checkpoint_attention
    assert any("recompute.attention auto -> " + run.model.checkpoint_attention in n for n in run.notes), run.notes


def test_auto_does_not_keep_where_keeping_would_lose_a_shape():
    """Kept attention outputs add bytes to every checkpointed block: a shape that fits ``m_mem`` only with every
    block recomputing stays trainable (the keep search leaves it out, so its prediction would not count it)."""
    from ds_adaptive.planning.memory import sample_memory
    from ds_adaptive.core.shapes import SampleShape

    longest = SampleShape(81, 720, 1280)
    rec = sample_memory(_default_job_sampler("recompute")[0].cost, longest)
    keep = sample_memory(_default_job_sampler("keep")[0].cost, longest)
    assert keep > rec
    auto, logs = _default_job_sampler("auto", m_mem=(rec + keep) / 2)
    assert auto.cost.checkpoint_attention == "recompute"
    (line,) = [x for x in logs if "recompute.attention auto" in x]
    assert "auto -> recompute" in line and f"{longest} would not fit" in line
