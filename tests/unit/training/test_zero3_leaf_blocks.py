"""The ZeRO-3 settings of the ``adaptive_load`` block.

``zero3_leaf_blocks``: build_run marks each block a ZeRO-3 leaf (stage 3 only, and only when on), and a ZeRO-3 run
with leaf blocks trains exactly as one without (CPU, gloo): same losses and weights over steps with checkpointed and
plain blocks and the split path, on 2 ranks (real gathers), with one hook pair per block instead of one per
submodule, and ZeRO-3's trace of the module order (its prefetch schedule) stays valid while the count of
checkpointed blocks changes between micro-batches.

``zero3_torch_linear``: build_run hands DeepSpeed ``memory_efficient_linear: false`` unless the ds_config sets it, a
conflict with an explicit ``true`` is one validation line, and the same 2-rank run with torch's ``F.linear`` (put back
after DeepSpeed replaced it for the process) trains as with DeepSpeed's, up to float rounding."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from conftest import launch_script

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


SCRIPT = textwrap.dedent("""
    import os, warnings, torch, deepspeed
    # torch's deprecation warning per reduce-scatter would fill the harness's output pipe (ranks read in turn)
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as PPC
    from ds_adaptive.models.wan import WanModel
    from ds_adaptive.training.assemble import set_leaf_blocks, use_torch_linear

    invalidations = []   # ZeRO-3's trace of the module order, thrown away (no prefetch, a device sync) when it differs
    _invalidate = PPC._invalidate_trace
    PPC._invalidate_trace = lambda self: (invalidations.append(1), _invalidate(self))[1]

    def train(leaf, torch_linear=False):
        invalidations.clear()
        cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
               "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                     "reduce_bucket_size": 20000, "stage3_prefetch_bucket_size": 20000,
                                     "memory_efficient_linear": not torch_linear},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
        torch.manual_seed(0)
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = WanModel("tiny")
        if torch_linear:   # adaptive_load.zero3_torch_linear: the earlier arms left DeepSpeed's F.linear in place
            assert use_torch_linear()
        if leaf:
            assert set_leaf_blocks(model) == len(model.blocks) == 2
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        linear = torch.nn.functional.linear.__name__
        assert (linear == "zero3_linear_wrap") != torch_linear, linear
        hooks = len(engine.optimizer.parameter_offload.forward_hooks)
        g = torch.Generator().manual_seed(0)
        x, c = torch.randn(2, 16, 3, 6, 10, generator=g), torch.randn(2, 7, 4096, generator=g)
        target = torch.randn(2, 16, 3, 6, 10, generator=g)
        losses = []
        for step in range(3):
            for micro, n_ckpt in enumerate((step % 3, 1)):   # 0, 1 and 2 checkpointed blocks
                model.set_checkpoint_blocks(n_ckpt)
                t = torch.tensor([100.0 + 300 * micro, 700.0])
                loss = (engine(x, t, c).float() - target).square().mean()
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        trained_invalidations = len(invalidations)
        with torch.no_grad():   # the split path outside forward (a sequence-parallel wrapper's)
            inp = model.embed(x, torch.tensor([300.0, 500.0]), c)
            out = model.unpatchify(model.head(model.run_blocks(inp.tokens, inp, model.rope(inp.grid)), inp.time_emb),
                                   inp.grid)
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        return losses, out, weights, hooks, trained_invalidations

    rank = torch.distributed.get_rank()
    # bit-for-bit between the two gathers: the plain blocks (a leaf block hands its Linear layers recomputable
    # inputs, a hooked one does not: models.lean_backward, the same training up to rounding, checked below)
    os.environ["DS_ADAPTIVE_LEAN_BACKWARD"] = "0"
    l0, o0, w0, h0, _ = train(False)
    l1, o1, w1, h1, inv1 = train(True)
    # a checkpointed leaf block recomputes inside its own call: the module order is the same for 0, 1 and 2
    # checkpointed blocks, so the trace recorded once stays valid (checkpointing the block's call invalidated it)
    assert inv1 == 0, inv1
    assert l0 == l1, (l0, l1)
    assert torch.equal(o0, o1)
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
    assert any(not torch.equal(w0[k], w0[k] * 0) for k in w0)
    assert h1 < h0, (h0, h1)
    # torch's F.linear (the bias in addmm's epilogue) instead of DeepSpeed's (a matmul, then the bias added), and
    # the blocks' recomputed Linear inputs (the default): the same training up to float rounding, the trace kept
    del os.environ["DS_ADAPTIVE_LEAN_BACKWARD"]
    l2, o2, w2, _, inv2 = train(True, torch_linear=True)
    assert inv2 == 0, inv2
    assert torch.allclose(torch.tensor(l2), torch.tensor(l1), rtol=1e-5, atol=0), (l1, l2)
    assert torch.allclose(o2, o1, rtol=1e-4, atol=1e-5)
    assert all(torch.allclose(w2[k], w1[k], rtol=1e-4, atol=1e-6) for k in w1)
    print("LEAF_OK", rank, h0, h1, l1)
""")


@pytest.mark.slow
def test_leaf_blocks_train_exactly_as_per_module_hooks(tmp_path):
    out = launch_script(SCRIPT, 2, tmp_path, name="leaf.py", timeout=300)
    assert "LEAF_OK 0" in out, out[-3000:]


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
