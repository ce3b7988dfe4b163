"""Guards bench/training/train_step_profile.py on the CPU: the trainer's step is split into its segments (fetch, forward,
backward, the engine's inner and boundary steps, the metrics), every micro-step's call is counted, the segments and
the host time between them add up to the timed step, and the profiled step lists the same segments as ranges and its
elementwise operators by input shape."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.slow
def test_segments_add_up_to_the_step(tmp_path):
    out = tmp_path / "p"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT")}  # its own world of one, as users run it
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "training" / "train_step_profile.py"), "--out", str(out), "--config",
                          str(ROOT / "launch" / "configs" / "cpu_tiny.json"), "--model", "tiny", "--gas", "2",
                          "--num-samples", "64", "--warm", "1", "--timed", "1", "--profiled", "1", "--set",
                          f'adaptive_load.sampler.shapes="{ROOT / "launch" / "configs" / "shapes_cpu.json"}"'],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads((out / "train_step_profile.json").read_text())
    assert doc["gas"] == 2
    calls = doc["timed"]["calls_per_step"]
    assert calls["data"] == calls["forward"] == calls["backward"] == 2
    assert calls["step_inner"] == 1 and calls["step_boundary"] == 1 and calls["end_step"] == 1
    seg = doc["timed"]["segments_ms"]
    assert sum(seg.values()) == pytest.approx(doc["timed"]["step_ms"])
    assert all(v > 0 for k, v in seg.items() if k in ("forward", "backward"))
    assert {"data", "forward", "backward", "step_boundary"} <= set(doc["profiled"]["segments"])
    assert [s["kind"] for s in doc["steps"]] == ["warm", "timed", "profiled"]
    tables = (out / "profile_tables.txt").read_text()
    assert tables.count("Self CPU") >= 2 and "elementwise operators by input shape" in tables
    rows = doc["profiled"]["elementwise_by_shape"]   # copies / adds / casts, told apart by the tensors they move
    assert rows and all(r["op"].startswith("aten::") and r["shapes"].startswith("[") and r["calls"] > 0 for r in rows)
    assert "| backward |" in res.stdout


def _checkpoint_around_module_call(model) -> None:
    """The placement before the trainer's (checkpoint around a block's module call, ``checkpoint(block, ...)``): the
    recompute calls the module again, so module hooks (ZeRO-3's) fire in the recompute."""
    from torch.utils.checkpoint import checkpoint

    class AroundCall(type(model.blocks[0])):
        def __call__(self, *args, checkpointed=None, **kwargs):
            if checkpointed is None:
                return super().__call__(*args, **kwargs)
            return checkpoint(super().__call__, *args, use_reentrant=False, **checkpointed, **kwargs)

    for block in model.blocks:
        block.__class__ = AroundCall


def test_checkpointing_inside_the_call_recomputes_without_calling_the_module_with_the_same_gradients():
    """The trainer checkpoints a block inside its call: the same loss and gradients as checkpointing around the
    block's module call, but a checkpointed block's module hooks do not fire again in backward (ZeRO-3's trace of
    module calls stays the same whatever the count of checkpointed blocks)."""
    import torch

    from ds_adaptive.models.testing import random_init_
    from ds_adaptive.models.wan import WanModel
    from ds_adaptive.models.wan_config import get_wan_config

    def run(around: bool):
        model = random_init_(WanModel(get_wan_config("tiny", num_layers=3)), seed=0).double()
        if around:
            _checkpoint_around_module_call(model)
        model.set_checkpoint_blocks(2)
        calls = []
        for i, b in enumerate(model.blocks):
            b.register_forward_pre_hook(lambda m, a, i=i: calls.append(i))
        g = torch.Generator().manual_seed(0)
        lat = torch.randn(2, 16, 3, 6, 10, generator=g, dtype=torch.float64)
        out = model(lat, torch.tensor([100.0, 700.0]), torch.randn(2, 7, 4096, generator=g, dtype=torch.float64))
        forward_calls = list(calls)
        out.square().mean().backward()
        return forward_calls, calls, [p.grad for p in model.parameters()]

    fwd_in, all_in, grads_in = run(False)
    fwd_around, all_around, grads_around = run(True)
    assert fwd_in == fwd_around == [0, 1, 2]
    assert all_in == [0, 1, 2]                                  # the recompute runs the body: no module call
    assert sorted(all_around) == [0, 0, 1, 1, 2]                # the recompute calls blocks 0 and 1 again
    for a, b in zip(grads_in, grads_around):
        assert torch.equal(a, b)
