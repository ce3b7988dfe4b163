"""Guards the memory-aware checkpoint plan (ds_adaptive/planning/memory.py), its place in the cost model,
planner and sampler (same on every rank, reproduced on resume), `profile: auto`, the allocator
configuration, calibrate's per-block fit and the MFU FLOP count."""
from __future__ import annotations

import numpy as np
import pytest

from ds_adaptive.planning.cost import CostModel
from ds_adaptive.planning.profile import load_profile
from ds_adaptive.planning.devices import gpu_spec, resolve_auto_profile
from ds_adaptive.planning.memory import (checkpoint_blocks, configure_allocator, micro_batch_table, sample_memory)
from ds_adaptive.planning.sampler import build_batch_sampler
from ds_adaptive.core.layout import Layout
from ds_adaptive.core.shapes import SampleShape, load_shape_distribution

SHAPES = sorted({w.shape for w in load_shape_distribution()})


@pytest.mark.parametrize("profile", ["h100-wan2.1-1.3b", "h100-wan2.1-14b", "h200-wan2.1-1.3b", "h200-wan2.1-14b"])
@pytest.mark.parametrize("m_mem", [7.5, 41.0, 96.3])
def test_checkpoint_plan_fits_the_budget_for_every_shape_and_is_minimal(profile, m_mem):
    from ds_adaptive.planning.memory import fewest_memory_blocks

    cost = CostModel(profile, checkpointing="auto")
    L = cost.num_layers
    for shape in SHAPES:
        bmax = int(m_mem // sample_memory(cost, shape))
        if bmax < 1:
            continue
        bs = np.arange(1, bmax + 1)
        n = checkpoint_blocks(cost, shape, bs, m_mem)
        # the last block is checkpointed only where that holds less (a measured last-block term, H200)
        assert n.min() >= 0 and n.max() <= fewest_memory_blocks(cost, shape)
        mem = cost.ckpt_memory(shape, bs, n)
        assert np.all(mem <= m_mem * (1 + 1e-9)), (shape, bs[mem > m_mem], mem[mem > m_mem])
        fewer = n > 0
        assert np.all(cost.ckpt_memory(shape, bs[fewer], n[fewer] - 1) > m_mem)   # the fewest that fit
        assert np.all(np.diff(n) >= 0)                       # more samples never need fewer blocks


def test_memory_and_cost_model_of_the_checkpoint_count():
    cost = CostModel("h100-wan2.1-1.3b", checkpointing="auto")
    pr = cost.profile
    L, S, B = pr.num_layers, 32760, 2
    # the profile's own calibration (every block checkpointed) is reproduced exactly at n = L
    assert cost.ckpt_memory(S, B, L) == pytest.approx(B * cost.per_gpu_memory(S), rel=1e-12)
    assert cost.ckpt_cost(S, B, L) == pytest.approx(cost.batch_cost(S, B), rel=1e-12)
    g = pr.block_full_gib[0] + pr.block_full_gib[1] * S
    c = pr.block_ckpt_gib[0] + pr.block_ckpt_gib[1] * S
    assert cost.ckpt_memory(S, B, L - 1) == pytest.approx(B * (cost.per_gpu_memory(S) - c))
    assert cost.ckpt_memory(S, B, 3) - cost.ckpt_memory(S, B, 4) == pytest.approx(B * (g - c))
    # each checkpointed block adds exactly its recomputed forward
    for n in (0, 7, 29):
        assert cost.ckpt_cost(S, B, n + 1) - cost.ckpt_cost(S, B, n) == pytest.approx(float(cost.recompute_ms(S, B)))
    assert 0.2 < float(L * cost.recompute_ms(S, 1)) / cost.batch_cost(S, 1) < 0.3   # ~0.3/1.3 estimate
    t = micro_batch_table(cost, S, 4, 60.0)
    assert np.all(np.diff(t.cost[1:]) > 0) and t.ckpt[1] < t.ckpt[4]
    assert t.cost[1] == pytest.approx(float(cost.ckpt_cost(S, 1, t.ckpt[1])))


def _sampler(topo, ckpt="auto", **cfg):
    from ds_adaptive.simulation.simulate import draw_shapes

    shapes = draw_shapes(load_shape_distribution(), 600, seed=3)
    sc = {"profile": "h100-wan2.1-1.3b", "m_mem": 45.0, "window": 32, **cfg}
    return build_batch_sampler(sc, shapes, topo, micro_steps_per_step=2, checkpointing=ckpt,
                               model_name="wan2.1-1.3b"), shapes


def test_plan_carries_the_count_identical_on_every_rank_of_a_micro_step():
    per_rank, own = {}, {}
    for dp_rank in range(2):
        for sp_rank in range(2):
            s, shapes = _sampler(Layout.explicit(dp_rank=dp_rank, dp_size=2, sp_rank=sp_rank, sp_size=2))
            s.set_epoch(1)
            per_rank[(dp_rank, sp_rank)] = [s.checkpoint_blocks(st, m) for st in range(s.steps_per_epoch)
                                            for m in range(2)]
            batches = list(iter(s))
            cost = s.cost
            # the count is the checkpoint plan of the batch itself, and within the budget
            for k, ids in enumerate(batches):
                n = per_rank[(dp_rank, sp_rank)][k]
                own.setdefault((dp_rank, sp_rank), []).append(
                    int(checkpoint_blocks(cost, shapes[ids[0]], len(ids), s.params.m_mem)))
                assert float(cost.ckpt_memory(shapes[ids[0]], len(ids), n)) <= s.params.m_mem * (1 + 1e-9)
    assert per_rank[(0, 0)] == per_rank[(0, 1)] and per_rank[(1, 0)] == per_rank[(1, 1)]   # SP group
    # DP ranks hold their own batches but checkpoint the same count: ZeRO-3's gathers are collectives in
    # module order, and different recompute hangs the micro-step (the largest of the ranks' plans)
    assert per_rank[(0, 0)] == per_rank[(1, 0)] == [max(a, b) for a, b in zip(own[(0, 0)], own[(1, 0)])]
    assert own[(0, 0)] != own[(1, 0)]   # ... which their own plans would not
    assert any(n not in (0, 30) for n in per_rank[(0, 0)])  # the budget binds: partial checkpointing
    # the plan's costs are the checkpoint-aware costs (the planner balances true cost)
    plan = s.plan
    j = 5
    u, b = plan.batch_shape[j], plan.batch_sizes()[j]
    assert plan.batch_cost[j] == pytest.approx(float(s.cost.ckpt_cost(plan.shapes[u], b, plan.batch_ckpt[j])))


def test_resume_reproduces_the_checkpoint_plan_and_policies():
    topo = Layout.explicit(dp_rank=1, dp_size=2)
    a, _ = _sampler(topo)
    a.set_epoch(0)
    full = [a.checkpoint_blocks(st, m) for st in range(a.steps_per_epoch) for m in range(2)]
    state = a.state_dict(4)
    b, _ = _sampler(topo)
    b.load_state_dict(state)
    assert [b.checkpoint_blocks(st, m) for st in range(4, b.steps_per_epoch) for m in range(2)] == full[8:]
    assert state["segments"][-1]["checkpointing"] == "auto"
    # a state saved under another policy is re-planned, not misread
    c, _ = _sampler(topo, ckpt="all")
    c.load_state_dict(state)
    assert {c.checkpoint_blocks(st, 0) for st in range(4, c.steps_per_epoch)} == {30}
    none, _ = _sampler(topo, ckpt="none", m_mem=400.0)
    assert none.checkpoint_blocks(0, 1) == 0


def test_profile_auto_selection_and_messages():
    prof, msg = resolve_auto_profile("wan2.1-1.3b", "NVIDIA H100 80GB HBM3")
    assert prof.name == "h100-wan2.1-1.3b" and "shipped calibration for NVIDIA H100 80GB HBM3" in msg
    prof, msg = resolve_auto_profile("wan2.1-14b", "NVIDIA A100-SXM4-80GB", gpu_mem_gib=79.3)
    base = load_profile("h100-wan2.1-14b") if "h200" not in msg else load_profile("h200-wan2.1-14b")
    assert "NVIDIA A100-SXM4-80GB" in msg and "ds-adaptive calibrate --model wan2.1-14b" in msg
    assert "a100-wan2.1-14b.json" in msg
    assert prof.a_ms_per_token == pytest.approx(base.a_ms_per_token * 989 / 312)
    assert prof.gpu_mem_gib == 79.3 and prof.m1_gib_per_token == base.m1_gib_per_token
    prof, msg = resolve_auto_profile("wan2.1-1.3b", "Some Future GPU 9000")
    assert "Some Future GPU 9000" in msg and "times unscaled" in msg and "mygpu-wan2.1-1.3b.json" in msg
    prof, msg = resolve_auto_profile("wan2.1-1.3b", None, detect=False)
    assert prof.name == "h100-wan2.1-1.3b" and "no GPU visible" in msg
    prof, msg = resolve_auto_profile("tiny", None, detect=False)
    assert prof.raw["model"]["name"] == "wan2.1-1.3b" and "no shipped profile for model 'tiny'" in msg
    assert gpu_spec("NVIDIA H200").bf16_tflops == 989 and gpu_spec("NVIDIA H100 PCIe").key == "h100-pcie"


def test_shipped_h200_profiles_are_picked_on_an_h200():
    if "h200-wan2.1-1.3b" not in __import__("ds_adaptive.planning.profile", fromlist=["x"]).shipped_profiles():
        pytest.skip("no H200 calibration shipped")
    for model in ("wan2.1-1.3b", "wan2.1-14b"):
        prof, msg = resolve_auto_profile(model, "NVIDIA H200")
        assert prof.name == f"h200-{model}" and "NVIDIA H200" in prof.device
        assert prof.checkpoint_source == "measured" and prof.fragmentation_margin_gib is not None


def test_m_mem_auto_uses_the_measured_margin():
    d = dict(load_profile("h100-wan2.1-1.3b").raw)
    d["memory"] = {**d["memory"], "fragmentation_margin_gib": 1.25}
    cost = CostModel(d)
    static = cost.profile.static_memory_gib(3, 1)
    assert cost.auto_memory_budget(139.8) == pytest.approx(139.8 * 0.97 - 1.25 - static)
    assert cost.auto_memory_budget(139.8, 0.5) == pytest.approx(69.9 - static)      # explicit utilisation
    assert CostModel("h100-wan2.1-1.3b").auto_memory_budget(139.8) == pytest.approx(139.8 * 0.85 - static)


def test_configure_allocator_keeps_the_users_setting():
    env = {}
    assert "expandable_segments:True" in configure_allocator(env) and env["PYTORCH_CUDA_ALLOC_CONF"] == \
        "expandable_segments:True"
    env = {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}
    assert "from the environment: kept" in configure_allocator(env)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "backend:cudaMallocAsync"
    # the value launch/train_wan.sh exports is the default, not a user's choice
    msg = configure_allocator({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert "the default" in msg and "user" not in msg and "kept" not in msg


def _two_depth_rows(d0=0.0, d1=0.0):
    """calibrate rows of a synthetic model: 2 and 4 blocks, both modes; (d0, d1): last-block term."""
    g0, g1, c1, e0, e1 = 0.004, 9.5e-5, 2.9e-6, 0.05, 3.0e-5       # GiB / sample, GiB / token
    r0, ra, rb = 0.2, 2.5e-4, 1.1e-8                                 # recompute per block (ms)
    rows = []
    for s, b in ((1560, 11), (7800, 3), (14040, 2), (32760, 1), (75600, 1)):
        for k in (2, 4):
            for ck in (True, False):
                blocks = k * (c1 * s) + (g0 + g1 * s) if ck else k * (g0 + g1 * s)
                act = b * (e0 + e1 * s + blocks) if ck else b * (e0 + e1 * s + d0 + d1 * s) + b * blocks
                ms = 5 + k * (3 * b * (ra * s + rb * s * s) + (r0 if ck else 0) + (b * (ra * s + rb * s * s) if ck else 0))
                rows.append({"layers": k, "S": s, "B": b, "shape": str(s), "ms": ms, "act_gib": act,
                             "peak_gib": act + 20, "reserved_gib": act + 20.5 + s * 1e-6, "checkpointing": ck})
    return rows, (g0, g1, c1, r0, ra, rb)


def test_calibrate_checkpoint_fit_recovers_per_block_numbers():
    from ds_adaptive.calibration.fit import checkpoint_fit, fragmentation_margin

    rows, (g0, g1, c1, r0, ra, rb) = _two_depth_rows()
    fit = checkpoint_fit(rows, min_fit_tokens=0)
    full, kept = fit["memory"]["block_full"], fit["memory"]["block_checkpointed"]
    assert full["m1_gib_per_token"] == pytest.approx(g1, rel=1e-6) and full["m0_gib"] == pytest.approx(g0, rel=1e-6)
    assert kept["m1_gib_per_token"] == pytest.approx(c1, rel=1e-6)
    rc = fit["recompute"]
    assert (rc["c0_ms"], rc["a_ms_per_token"], rc["b_ms_per_token2"]) == pytest.approx((r0, ra, rb), rel=1e-6)
    assert fragmentation_margin(rows) == pytest.approx(0.5 + 75600e-6)
    assert checkpoint_fit([dict(r, checkpointing=True) for r in rows]) is None   # one mode only: no fit
    assert "last_block_whole" not in fit["memory"]      # E(none) == E(all): no last-block term


def test_calibrate_fits_the_last_block_term_and_the_model_uses_it():
    """E(none) - E(all) = d0 + d1 S per sample is recovered from the two-depth rows (on the points with
    B x S >= min_fit_tokens); in the model it is held only while the last block is whole (n < L)."""
    from ds_adaptive.calibration.fit import checkpoint_fit

    d0, d1 = 0.006, 1.4e-5
    rows, _ = _two_depth_rows(d0, d1)
    fit = checkpoint_fit(rows, min_fit_tokens=8192)
    lw = fit["memory"]["last_block_whole"]
    assert (lw["m0_gib"], lw["m1_gib_per_token"]) == pytest.approx((d0, d1), rel=1e-6)
    assert {(p["S"], p["B"]) for p in lw["fit"]["points"]} == {(1560, 11), (7800, 3), (14040, 2), (32760, 1),
                                                                 (75600, 1)}
    raw = dict(load_profile("h200-wan2.1-1.3b").raw)
    raw["memory"] = {**raw["memory"], "checkpointing": {**raw["memory"]["checkpointing"], "last_block_whole": lw}}
    with_d = CostModel(load_profile(raw), checkpointing="auto")
    raw["memory"]["checkpointing"] = {k: v for k, v in raw["memory"]["checkpointing"].items() if k != "last_block_whole"}
    without = CostModel(load_profile(raw), checkpointing="auto")
    L, S, B = with_d.num_layers, 75600, 3
    d = B * (d0 + d1 * S)
    assert with_d.ckpt_memory(S, B, L) == pytest.approx(without.ckpt_memory(S, B, L), rel=1e-12)   # the fit itself
    for n in (0, 11, L - 1):
        assert with_d.ckpt_memory(S, B, n) - without.ckpt_memory(S, B, n) == pytest.approx(d, rel=1e-9)
    c = B * with_d.profile.block_ckpt_gib[1] * S
    assert with_d.ckpt_memory(S, B, L - 1) - with_d.ckpt_memory(S, B, L) == pytest.approx(d - c, rel=1e-9)


@pytest.mark.parametrize("path", ["fused", "reference"])
def test_plan_checkpoints_the_last_block_only_when_that_alone_fits(path):
    """Shipped H200 1.3B (both LayerNorm-modulate entries carry a measured last-block term > c): a budget
    between mem(L) and mem(L - 1) checkpoints all L blocks, a budget at mem(L - 1) keeps L - 1; the
    planner's per-sample feasibility is the smaller of the two."""
    from ds_adaptive.planning.memory import fewest_memory_blocks

    cost = CostModel(load_profile("h200-wan2.1-1.3b").for_ln_modulate(path)[0], checkpointing="auto")
    L = cost.num_layers
    for shape in (SampleShape(81, 720, 1280), SampleShape(33, 720, 1280), SampleShape(1, 480, 832)):
        B = 7
        lo, hi = float(cost.ckpt_memory(shape, B, L)), float(cost.ckpt_memory(shape, B, L - 1))
        assert lo < hi and fewest_memory_blocks(cost, shape) == L
        assert sample_memory(cost, shape) == pytest.approx(lo / B, rel=1e-12)
        assert int(checkpoint_blocks(cost, shape, B, (lo + hi) / 2)) == L
        assert int(checkpoint_blocks(cost, shape, B, hi)) == L - 1
        assert int(checkpoint_blocks(cost, shape, B, lo * 0.99)) == L     # nothing fits: the fewest-memory count
        t = micro_batch_table(cost, shape, B, (lo + hi) / 2)
        assert t.ckpt[B] == L and np.all(t.memory[1:] <= (lo + hi) / 2) and np.all(np.diff(t.cost[1:]) >= 0)
    assert fewest_memory_blocks(CostModel("h100-wan2.1-1.3b", checkpointing="auto"), 75600) == L - 1   # no term


def test_wan_checkpoints_only_the_first_n_blocks_with_the_same_gradients():
    torch = pytest.importorskip("torch")
    from ds_adaptive.models.wan import WanModel
    from ds_adaptive.models.wan_config import get_wan_config

    torch.manual_seed(0)
    model = WanModel(get_wan_config("tiny", num_layers=3, text_dim=32))
    x = torch.randn(2, 16, 1, 4, 6)
    t = torch.tensor([10.0, 700.0])
    ctx = torch.randn(2, 5, 32)
    calls, module_calls = [0, 0, 0], [0, 0, 0]
    for i, blk in enumerate(model.blocks):
        blk.register_forward_pre_hook(lambda m, a, i=i: module_calls.__setitem__(i, module_calls[i] + 1))
        body = blk._body   # what a block computes; a checkpointed block's recompute runs it again

        def counted(*a, i=i, body=body, **k):
            calls[i] += 1
            return body(*a, **k)
        blk._body = counted

    def grads(n):
        model.zero_grad()
        model.set_checkpoint_blocks(n)
        calls[:], module_calls[:] = [0, 0, 0], [0, 0, 0]
        model(x, t, ctx).square().mean().backward()
        # the recompute runs inside the block's call: module hooks (ZeRO-3's) see one call per block either way
        assert module_calls == [1, 1, 1], module_calls
        return [p.grad.clone() for p in model.parameters()], list(calls)

    ref, c0 = grads(0)
    got, c2 = grads(2)
    assert c0 == [1, 1, 1] and c2 == [2, 2, 1]               # blocks 0 and 1 recomputed in backward
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(ref, got))
    assert grads(7)[1] == [2, 2, 2] and model.checkpoint_blocks == 3     # clamped to the depth
    model.set_checkpoint_blocks(None)
    model.gradient_checkpointing = False
    assert model.checkpointed_blocks() == 0
    with pytest.raises(ValueError, match="int >= 0"):
        model.set_checkpoint_blocks(-1)


def test_mfu_flops_formula():
    from ds_adaptive.models.flops import wan_block_flops, wan_train_flops
    from ds_adaptive.models.wan_config import get_wan_config

    cfg = get_wan_config("wan2.1-1.3b")
    model, hw = wan_train_flops(cfg, 32760, 2, ckpt_blocks=12)
    assert hw - model == pytest.approx(12 * 2 * wan_block_flops(cfg.dim, cfg.ffn_dim, 32760))
    # DESIGN.md's H200 figure: 32,760 tokens fwd+bwd in 2.48 s is ~34% of 989 TFLOP/s
    assert wan_train_flops(cfg, 32760, 1)[0] / 2.48 / 989e12 == pytest.approx(0.346, abs=0.005)
    s, d, f = 1000, cfg.dim, cfg.ffn_dim
    lin = 2 * s * (6 * d * d + 2 * d * f) + 2 * 512 * 2 * d * d
    assert wan_block_flops(d, f, s) == pytest.approx(lin + 4 * s * s * d + 4 * s * 512 * d)
