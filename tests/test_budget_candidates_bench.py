"""Guards bench/budget_candidates.py: the default job's budget search, under the shipped loop terms and others."""
from __future__ import annotations

import importlib.util
import json

from conftest import ROOT

_spec = importlib.util.spec_from_file_location("budget_candidates", ROOT / "bench" / "budget_candidates.py")
bc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bc)


def test_loop_terms_move_the_default_jobs_budget(tmp_path):
    """Per-step loop terms several times the trainer's (the H200 profile's until the nineteenth session) favour fewer,
    larger micro-batches; the measured ones a smaller budget with more micro-steps per step."""
    out = tmp_path / "c.json"
    assert bc.main(["--samples", "3000", "--loop", "220", "910", "--loop", "35.4", "66.4", "--checkpoint-attention",
                    "recompute", "--out", str(out)]) == 0
    arms = json.loads(out.read_text())["arms"]
    old, new = arms["220 / 910 ms"], arms["35.4 / 66.4 ms"]
    assert old["m_comp"] > new["m_comp"] and old["micro_steps_per_step"] < new["micro_steps_per_step"]
    for arm in (old, new):   # the chosen candidate is the best one, never slower than the equal-token plan
        best = max(c["tokens_per_s"] for c in arm["candidates"])
        assert arm["predicted_tokens_per_s"] == best >= arm["equal_token_tokens_per_s"]
    uncapped = [[c["m_comp"] for c in arm["candidates"] if not c["efficient_batches"]] for arm in (old, new)]
    assert uncapped[0] == uncapped[1]   # the same budgets; the capped rows where the cap changes a batch
