"""Guards "re-planning with the sparse cost is never the slower choice": when the sampler gets new
sparse-attention densities (``update_densities``, as the trainer hands them over with ``rebalance: step``
or at an epoch boundary), the plan it then runs is predicted at least as fast, under the new (sparse)
cost with the training loop's overheads and on compute alone, as the plan it would have run without the
update (the same samples: the rest of the epoch). Random shape mixes, densities, depths, DP sizes and gradient
accumulation, on the shipped H200 profile (with its calibrated selection cost)."""
from __future__ import annotations

import warnings

import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from ds_adaptive.planning.budget import plan_tokens_per_s
from ds_adaptive.planning.profile import load_profile
from ds_adaptive.planning.sampler import build_batch_sampler
from ds_adaptive.planning.sparse_cost import SparseAttentionCost
from ds_adaptive.core.contracts import DensityMap
from ds_adaptive.core.config import SamplerConfig
from ds_adaptive.core.layout import Layout
from ds_adaptive.core.shapes import SampleShape
from test_never_slower import mixes

PROFILE = "h200-wan2.1-1.3b"
HEADS = 12


def _densities(layers: int, rho: list[float]) -> DensityMap:
    dense = (0, layers - 1)
    return DensityMap(tuple((1.0,) * HEADS if i in dense else (rho[i % len(rho)],) * HEADS for i in range(layers)),
                      dense_layers=dense, source="test")


def _sampler(shapes, layers: int, dp: int, gas: int, profile=None, checkpoint_attention: str = "auto"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_batch_sampler(SamplerConfig(profile=PROFILE), shapes, Layout.explicit(dp_size=dp),
                                   recompute={"attention": checkpoint_attention},
                                   micro_steps_per_step=gas, gpu_mem_gib=139.8, model_name="wan2.1-1.3b",
                                   zero_stage=3, num_layers=layers, profile=profile,
                                   sparse=SparseAttentionCost(_densities(layers, [1.0])))




def _replan_vs_keep(shapes, layers, dp, gas, rho, at_step):
    s = _sampler(shapes, layers, dp, gas)
    old = s.plan
    at_step = min(at_step, old.num_steps - 1)
    new_cost = s.cost.with_sparse(s.cost.sparse.with_densities(_densities(layers, rho)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s.update_densities(_densities(layers, rho), at_step=at_step)
        ran = s.plan
        first = at_step - (s.steps_per_epoch - ran.num_steps)   # the step of the running plan the update starts at
    return tuple(plan_tokens_per_s(p, new_cost, first_step=f, loop=loop)
                 for loop in (True, False) for p, f in ((ran, first), (old, at_step)))


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(dist=mixes(), layers=st.sampled_from([4, 8, 30]), dp=st.sampled_from([1, 2, 8]), gas=st.sampled_from([1, 2]),
       rho=st.lists(st.floats(0.03, 1.0), min_size=1, max_size=3), seed=st.integers(0, 100), at_step=st.integers(1, 3))
def test_replan_never_slower_than_keeping_the_plan(dist, layers, dp, gas, rho, seed, at_step):
    w = np.array([d.weight for d in dist])
    idx = np.random.default_rng(seed).choice(len(dist), 300 * dp, p=w / w.sum())
    shapes = [dist[i].shape for i in idx]
    replan, keep, replan_compute, keep_compute = _replan_vs_keep(shapes, layers, dp, gas, rho, at_step)
    case = ([f"{d.shape}:{d.weight:g}" for d in dist], layers, dp, gas, rho)
    assert replan >= keep * (1 - 1e-9), (case, replan, keep)
    assert replan_compute >= keep_compute * (1 - 1e-9), (case, replan_compute, keep_compute)


def test_a_replan_that_only_the_loop_terms_favour_is_not_taken():
    """Long videos at 30 layers, gas 2, density 0.1: with loop terms of 220 ms per micro-step and 910 ms per step (the
    H200 profile's until the nineteenth session, several times what the trainer spends outside compute) the re-plan's
    fewer, larger micro-steps are predicted ~10% faster, while its compute per token is predicted ~12% slower (the
    case measured on an H200: 0.931x). Kept."""
    sh = [SampleShape(81, 720, 1280), SampleShape(49, 720, 1280), SampleShape(81, 480, 832)]
    shapes = [sh[i] for i in np.random.default_rng(0).integers(0, 3, 300)]
    old_loop = load_profile(PROFILE).with_train_overheads(220.0, 910.0)
    s = _sampler(shapes, 30, 1, 2, profile=old_loop, checkpoint_attention="recompute")
    before = s.plan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s.update_densities(_densities(30, [0.1]), at_step=1)
    u = s.density_updates[-1]
    assert u["predicted_tokens_per_s"]["replan"] > 1.05 * u["predicted_tokens_per_s"]["kept"], u
    assert u["predicted_compute_tokens_per_s"]["kept"] > 1.05 * u["predicted_compute_tokens_per_s"]["replan"], u
    assert u["kept"] and s.plan is before


def test_bench_plan_only_replan_not_slower(tmp_path):
    """bench/training/sparse_train_ab.py --plan-only on the default mix at 8 layers (the GPU A/B's settings): the re-planned
    arm's predicted tokens/s (loop overheads counted, as the planner predicts) is within 3% of the pinned sparse
    arm's (which plans with the densities from step 0, the re-plan from step 1 on the samples left: not a bound,
    the re-plan was ahead by 1.0% before the efficient batch cap and is behind by 1.6% with it), and the density
    update re-planned only where the re-plan is predicted faster with the loop terms and on compute
    alone (with the profile's earlier loop terms it was kept: its compute was predicted slower; with the measured
    loop terms it is predicted faster both ways and runs)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    out = tmp_path / "plan.json"
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONWARNINGS": "ignore"}
    r = subprocess.run([sys.executable, str(root / "bench" / "training" / "sparse_train_ab.py"), "--plan-only",
                        "--layers", "8", "--mixes", "default", "--arms", "sparse", "replan", "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["default/replan"]["predicted_tokens_per_s"] >= 0.97 * r["default/sparse"]["predicted_tokens_per_s"], r
    (u,) = r["default/replan"]["density_updates"]
    faster = (u["predicted_tokens_per_s"]["replan"] >= u["predicted_tokens_per_s"]["kept"]
              and u["predicted_compute_tokens_per_s"]["replan"] >= u["predicted_compute_tokens_per_s"]["kept"])
    assert u["kept"] == (not faster), u
