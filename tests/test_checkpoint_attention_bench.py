"""Guards bench/checkpoint_attention_ab.py on the CPU: plan predicts both arms' epochs (keep never predicted slower
where blocks are checkpointed), prepare writes configs that differ only in checkpoint_attention with each arm's
epoch length, report computes tokens/s and the ratio from the arms' logs."""
from __future__ import annotations

import argparse
import importlib.util
import json

import pytest

from conftest import ROOT
from ds_adaptive.training.run_config import RunConfig

_spec = importlib.util.spec_from_file_location("checkpoint_attention_ab", ROOT / "bench" / "checkpoint_attention_ab.py")
ab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab)


def _args(**kw):
    base = dict(model="wan2.1-1.3b", config=str(ab.CONFIG), profile=ab.PROFILE, shapes="long", num_samples=30,
                m_comp="auto", gas="auto", gpu_mem_gib=139.8, world=1, out=None)
    return argparse.Namespace(**{**base, **kw})


def test_plan_predicts_keep_faster_on_the_long_mix(tmp_path):
    out = ab.cmd_plan(_args(out=str(tmp_path / "plan.json")))
    r, k = out["recompute"], out["keep"]
    assert r["mean_checkpointed_blocks"] > 1                        # the long mix checkpoints blocks
    assert k["predicted_compute_s"] < r["predicted_compute_s"]
    assert out["keep_over_recompute_predicted_tokens_per_s"] > 1.0
    assert json.loads((tmp_path / "plan.json").read_text())["keep"]["steps_per_epoch"] == k["steps_per_epoch"]


def _arm(d, wall, tokens=1000, ckpt=3):
    d.mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps({"mfu": 0.4, "hfu": 0.45, "peak_mem_gib": 100.0}))
    (d / "metrics.jsonl").write_text("\n".join(json.dumps({"step": s, "tokens": tokens, "wall_s": wall,
                                                           "micro_compute_ms": [[400.0], [400.0]]})
                                               for s in (1, 2, 3)))
    (d / "memory.jsonl").write_text("\n".join(json.dumps({"step": s, "micro": m, "shape": "81x480x832", "tokens": 32760,
                                                          "B": 1, "ckpt_blocks": ckpt}) for s in (1, 2, 3) for m in (0, 1)))


def test_prepare_and_report(tmp_path, capsys):
    ab.cmd_prepare(_args(dir=str(tmp_path)))
    cmds = [x for x in capsys.readouterr().out.splitlines() if "ds_adaptive.cli.train" in x]
    assert [c.rsplit("/", 1)[-1] for c in cmds] == ["recompute", "keep"]
    cfgs = {a: RunConfig.load(str(tmp_path / f"config_{a}.json"), trainer={"model": "wan2.1-1.3b"}) for a in ab.ARMS}
    assert cfgs["keep"].adaptive_load.sampler.checkpoint_attention == "keep"
    assert cfgs["recompute"].adaptive_load.sampler.checkpoint_attention == "recompute"
    same = lambda c: c.adaptive_load.sampler.model_dump(exclude={"checkpoint_attention"})  # noqa: E731
    assert same(cfgs["keep"]) == same(cfgs["recompute"])
    runs = tmp_path / "runs"
    _arm(runs / "recompute", 2.0)
    _arm(runs / "keep", 1.6, ckpt=4)
    res = ab.cmd_report(argparse.Namespace(runs=str(runs), out=str(tmp_path / "r.json")))
    assert res["keep_over_recompute"]["tokens_per_s"] == pytest.approx(1.25)
    assert res["rows"]["keep"]["mean_checkpointed_blocks"] == 4
    assert 0 < res["rows"]["keep"]["predicted_over_measured_micro_step"] < res["rows"]["recompute"][
        "predicted_over_measured_micro_step"]   # the same batch, predicted cheaper with its attention kept
