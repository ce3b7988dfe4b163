"""Guards validation (ds_adaptive.training.validation) on 2 ranks: its loss under ZeRO-3 equals a direct evaluation
of the same samples and every rank scores. The single-process checks are in tests/unit/training/test_validation.py."""
from __future__ import annotations

import json
import textwrap

import pytest

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
