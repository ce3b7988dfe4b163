"""Guards ZeRO-3 leaf blocks on 2 ranks (CPU, gloo, real gathers): a ZeRO-3 run with leaf blocks trains exactly as one
without (same losses and weights over steps with checkpointed and plain blocks and the split path), with one hook
pair per block, ZeRO-3's trace of the module order stays valid while the count of checkpointed blocks changes, and
the same run with torch's ``F.linear`` trains as with DeepSpeed's, up to float rounding. The single-process checks
are in tests/unit/training/test_zero3_leaf_blocks.py."""
from __future__ import annotations

import textwrap

import pytest
from conftest import launch_script

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
