"""The ZeRO-3 settings of the ``adaptive_load`` block, in one process.

``zero3_leaf_blocks``: build_run marks each block a ZeRO-3 leaf (stage 3 only, and only when on); LoRA keeps per-module
hooks. ``zero3_torch_linear``: build_run hands DeepSpeed ``memory_efficient_linear: false`` unless the ds_config sets
it, and a conflict with an explicit ``true`` is one validation line. The 2-rank training checks are in
tests/integration/test_zero3_leaf_blocks_launch.py."""
from __future__ import annotations

from pathlib import Path

import pytest


pytest.importorskip("deepspeed", reason="DeepSpeed is needed for the ZeRO-3 leaf-block tests")

ROOT = Path(__file__).resolve().parents[3]
H200 = "h200-wan2.1-1.3b"


def _meta_run(over: dict, *, stage: int = 3, memory_efficient_linear=None):
    """build_run of the shipped 1.3B job on meta with block overrides, ZeRO ``stage`` and, when given, the ds_config's
    ``zero_optimization.memory_efficient_linear``."""
    from ds_adaptive.core.layout import Layout
    from ds_adaptive.training.assemble import build_run
    from ds_adaptive.training.run_config import RunConfig

    cfg = RunConfig.load(str(ROOT / "launch" / "configs" / "zero3_adaptive.json"),
                         trainer={"model": "wan2.1-1.3b", "num_samples": 200},
                         overrides={"sampler.profile": H200, **over})
    zero = cfg.ds_config["zero_optimization"]
    zero["stage"] = stage
    if memory_efficient_linear is not None:
        zero["memory_efficient_linear"] = memory_efficient_linear
    return build_run(cfg, layout=Layout.for_world(1, 1), meta=True, gpu_mem_gib=139.8)


@pytest.mark.parametrize("stage,on,want", [(3, True, 30), (3, False, 0), (2, True, 0)])
def test_build_run_marks_the_blocks_at_stage_3_only(stage, on, want):
    from deepspeed.utils import z3_leaf_module

    run = _meta_run({"zero3_leaf_blocks": on}, stage=stage)
    leaves = [m for m in run.model.modules() if z3_leaf_module(m)]
    assert len(leaves) == want
    assert all(any(b is m for b in run.model.blocks) for m in leaves)


@pytest.mark.parametrize("explicit", [False, True])
def test_lora_keeps_per_module_hooks_and_says_so_when_asked(explicit):
    """Under LoRA the frozen base gives block 0 an input without a gradient; ZeRO-3's leaf-module backward hook would
    release the block's parameters before the adapters' backward (a CPU LoRA run failed so): leaf blocks stay off."""
    from deepspeed.utils import z3_leaf_module

    run = _meta_run({"lora.enabled": True, **({"zero3_leaf_blocks": True} if explicit else {})})
    assert not any(z3_leaf_module(m) for m in run.model.modules())
    assert sum("zero3_leaf_blocks is off under LoRA" in n for n in run.notes) == int(explicit)


@pytest.mark.parametrize("stage,over,ds_key,want", [
    (3, {}, None, False),                               # the default: torch's F.linear
    (3, {}, True, True),                                # the ds_config's own key wins
    (3, {"zero3_torch_linear": False}, None, "unset"),  # off: DeepSpeed's default (its replacement)
    (3, {"zero3_torch_linear": True}, False, False),
    (2, {}, None, "unset"),                             # below stage 3 DeepSpeed never replaces F.linear
])
def test_build_run_writes_memory_efficient_linear_unless_the_ds_config_sets_it(stage, over, ds_key, want):
    run = _meta_run(over, stage=stage, memory_efficient_linear=ds_key)
    assert run.ds_config["zero_optimization"].get("memory_efficient_linear", "unset") == want


def test_torch_linear_next_to_an_explicit_memory_efficient_linear_is_one_line():
    from ds_adaptive.core.config import ConfigError

    with pytest.raises(ConfigError) as err:
        _meta_run({"zero3_torch_linear": True}, memory_efficient_linear=True)
    msg = str(err.value)
    assert "adaptive_load.zero3_torch_linear" in msg and "zero_optimization.memory_efficient_linear" in msg
    assert "\n" not in msg
