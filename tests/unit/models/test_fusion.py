"""Guards block fusion (ds_adaptive/models/fusion.py, adaptive_load.block_fusion): the fused functions are the
eager block's own arithmetic (bit-identical uncompiled), the compiled forms match an fp64 reference within
twice torch's own low-precision error forward and backward on awkward sizes, a whole model trains the same
with every mode, and a ZeRO-3-partitioned RMSNorm weight sends the block down the module path."""
from __future__ import annotations

import types

import pytest
import torch

from ds_adaptive.models import fusion, wan_blocks
from ds_adaptive.models.testing import block_fusion_errors
from ds_adaptive.models.wan import WanModel
from ds_adaptive.models.wan_config import get_wan_config

torch.set_num_threads(1)


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    m = WanModel(get_wan_config("tiny", num_layers=2))
    with torch.no_grad():   # the zero-initialised head would hide every difference upstream
        m.head.head.weight.normal_(std=0.05)
    return m.to_dtype(dtype)


def _inputs(B=2, frames=3, h=6, w=10, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    lat = torch.randn(B, 16, frames, h, w, generator=g).to(dtype)
    return lat, torch.rand(B, generator=g) * 1000, torch.randn(B, 7, 4096, generator=g).to(dtype)


def _loss_and_grads(model, inputs):
    model.zero_grad(set_to_none=True)
    out = model(*inputs)
    loss = out.float().square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_uncompiled_fused_functions_are_the_eager_block(dtype):
    inputs = _inputs(dtype=dtype)
    ref_loss, ref_grads = _loss_and_grads(_model(dtype=dtype), inputs)
    m = _model(dtype=dtype)
    m.set_block_fusion(qk_rope=wan_blocks.qk_norm_rope, residual=wan_blocks.gated_residual, layer_norm=wan_blocks.fp32_layer_norm)
    loss, grads = _loss_and_grads(m, inputs)
    assert loss == ref_loss and grads.keys() == ref_grads.keys()
    for n in grads:
        assert torch.equal(grads[n], ref_grads[n]), n


def test_partitioned_norm_weight_takes_the_module_path(monkeypatch):
    m = _model()
    calls = []

    def spy(*a):
        calls.append(1)
        return wan_blocks.qk_norm_rope(*a)

    m.set_block_fusion(qk_rope=spy)
    inputs = _inputs()
    m(*inputs)
    assert calls   # the fused function runs while the weights are whole
    calls.clear()
    w = m.blocks[0].self_attn.norm_q.weight
    w.ds_status = types.SimpleNamespace(name="NOT_AVAILABLE")   # as ZeRO-3 marks a partitioned parameter
    m(*inputs)
    assert len(calls) == len(m.blocks) - 1   # that block read it through its module (ZeRO-3 gathers there)


def test_unknown_mode_is_an_error():
    with pytest.raises(ValueError, match=r"block_fusion must be one of \['off', 'rope', 'regions'\], got 'all'"):
        fusion.apply_block_fusion(_model(), "all")


@pytest.mark.slow   # compiles 3 functions x 2 dtypes on the CPU (tens of seconds)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_matches_fp64_within_torchs_own_error(dtype):
    # odd S, 3 heads, head_dim 12: rope split (2, 2, 2)
    for name, i, err, eager_err, ref_max in block_fusion_errors(dtype, (2, 37, 3, 12)):
        bound = 2 * eager_err + 1e-6 * ref_max + 1e-12
        assert err <= bound, (name, dtype, i, err, bound)


@pytest.mark.slow   # compiles the model's fused functions on the CPU
@pytest.mark.parametrize("mode", ["rope", "regions"])
def test_a_model_trains_the_same_with_every_mode(mode):
    inputs = _inputs()
    ref_loss, ref_grads = _loss_and_grads(_model(), inputs)
    m = _model()
    assert fusion.apply_block_fusion(m, mode).startswith(f"block fusion '{mode}'")
    loss, grads = _loss_and_grads(m, inputs)
    assert torch.allclose(loss, ref_loss, rtol=1e-5)
    for n in ref_grads:
        assert torch.allclose(grads[n], ref_grads[n], rtol=1e-4, atol=1e-6 * ref_grads[n].abs().max()), n
    assert fusion.apply_block_fusion(m, "off") is None and m.blocks[0].self_attn.qk_rope is None


def _counting_compiled(monkeypatch):
    """``fusion.compiled`` through a frame-counting aot_eager backend (what dynamo guards on is the backend's
    business only after the guards: the count is the graphs the real Inductor would compile)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    cache = {}

    def compiled(name):
        if name not in cache:
            cache[name] = torch.compile(getattr(wan_blocks, name), backend=counter, dynamic=True, fullgraph=True)
        return cache[name]

    monkeypatch.setattr(fusion, "compiled", compiled)
    torch._dynamo.reset()
    return counter


STEPS = [(1, 3, 6, 10), (3, 1, 4, 6), (2, 5, 8, 4), (1, 1, 6, 6), (3, 5, 8, 4)]   # B, frames, h, w (h, w: pixels / 8)


def _train_steps(m, per_token, dtype, steps=STEPS):
    for B, frames, h, w in steps:
        lat, t, ctx = _inputs(B=B, frames=frames, h=h, w=w, dtype=dtype)
        if per_token:   # per-token timesteps [B, S] (Wan 2.2 TI2V style)
            t = t[:, None].expand(B, frames * (h // 2) * (w // 2)).contiguous()
        m.zero_grad(set_to_none=True)
        m(lat, t, ctx).float().square().mean().backward()


@pytest.mark.parametrize("dtype,per_token", [(torch.float32, False), (torch.bfloat16, True)],
                         ids=["fp32-per_sample", "bf16-per_token"])
def test_warm_up_compiles_every_graph_that_training_needs(monkeypatch, per_token, dtype):
    """After ``warm_up`` for the plan's (B, tokens) pairs, training steps of one and of several samples, images and
    videos, compile nothing; the same steps without it compile at the first step of each kind."""
    counter = _counting_compiled(monkeypatch)
    m = _model(dtype=dtype)
    fusion.apply_block_fusion(m, "regions")
    pairs = [(B, f * (h // 2) * (w // 2)) for B, f, h, w in STEPS]
    spent = m.warm_up_block_fusion(pairs, dtype=dtype, device=torch.device("cpu"), per_token=per_token)
    assert spent > 0
    warmed = counter.frame_count
    assert warmed >= 4   # 2 functions (on the CPU the q/k norm + RoPE is compiled) x (B = 1, B >= 2)
    _train_steps(m, per_token, dtype)
    assert counter.frame_count == warmed, f"a training step compiled {counter.frame_count - warmed} more graph(s)"

    if per_token:
        return
    cold = _counting_compiled(monkeypatch)   # the control: the same steps, no warm-up
    m = _model(dtype=dtype)
    fusion.apply_block_fusion(m, "regions")
    _train_steps(m, per_token, dtype)
    assert cold.frame_count >= 4


def test_a_machine_that_cannot_compile_falls_back_to_eager(monkeypatch):
    """No working compiler (here: Inductor's C++ compiler path points nowhere): the warm-up puts every block back on
    its eager path and says why in one line; the model then trains exactly as the eager one."""
    import torch._dynamo
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()   # nothing compiled earlier in this process may satisfy the call
    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)
    monkeypatch.setattr(functorch_config, "enable_autograd_cache", False)
    monkeypatch.setattr(inductor_config.cpp, "cxx", ("/nonexistent/c++",))
    try:
        m = _model()
        fusion.apply_block_fusion(m, "regions")
        with pytest.raises(fusion.BlockFusionUnavailable, match="C\\+\\+ compiler") as err:
            m.warm_up_block_fusion([(1, 15), (2, 60)], dtype=torch.float32, device=torch.device("cpu"))
        assert "\n" not in str(err.value)
        for blk in m.blocks:
            assert blk.self_attn.qk_rope is None and blk.residual is wan_blocks.gated_residual
            assert getattr(blk.norm3, "layer_norm_fn", wan_blocks.fp32_layer_norm) is wan_blocks.fp32_layer_norm
        inputs = _inputs()
        loss, grads = _loss_and_grads(m, inputs)
        ref_loss, ref_grads = _loss_and_grads(_model(), inputs)
        assert torch.equal(loss, ref_loss) and all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
    finally:
        torch._dynamo.reset()


def test_warm_up_with_fusion_off_compiles_nothing():
    m = _model()
    assert m.warm_up_block_fusion([(1, 15)], dtype=torch.float32, device=torch.device("cpu")) == 0.0


def test_the_run_summary_names_the_warm_up():
    from ds_adaptive.training.summary import format_summary

    s = {"steps": 3, "samples": 3, "tokens": 30, "wall_s": 1.0, "tokens_per_s": 30.0, "samples_per_s": 3.0,
         "step_s_mean": 0.3, "warmup_steps": 1, "peak_mem_gib": 1.0, "mem_capacity_gib": 2.0, "peak_mem_frac": 0.5,
         "mem_efficiency": 0.5, "cv_step": 0.0, "compute_cv": 0.0, "idle_frac": 0.0, "loss_window": 1,
         "loss_first": 1.0, "loss_last": 0.9, "loss_fell": True}
    assert "block fusion" not in format_summary(s)
    s["block_fusion"] = {"mode": "regions", "warmup_s": 12.34, "later_warmup_s": 0.0, "later_pairs": 0,
                         "fallback": None}
    assert "block fusion     'regions': compiled before step 1 in 12.3 s\n" in format_summary(s)
    s["block_fusion"].update(later_warmup_s=2.04, later_pairs=3)
    assert ("block fusion     'regions': compiled before step 1 in 12.3 s, and 2.0 s for 3 new pair(s) of later "
            "plans") in format_summary(s)
    s["block_fusion"] = {"mode": "regions", "warmup_s": None, "fallback": "InvalidCxxCompiler: no compiler"}
    assert ("block fusion     'regions' could not compile (InvalidCxxCompiler: no compiler): the blocks ran eager"
            in format_summary(s))


@pytest.mark.parametrize("ckpt", [False, True], ids=["whole", "checkpointed"])
def test_sparse_attention_trains_the_same_with_block_fusion(monkeypatch, ckpt):
    """Block fusion (on in the shipped config) leaves sparse attention's selection and kernel as they are: a model with
    DSV sparse attention (forced density 0.3) gives the same outputs and gradients with 'regions' as without it,
    with and without recompute (which reuses the forward's selection)."""
    from ds_adaptive.models.testing import random_init_
    from ds_adaptive.attention.runtime import SparseAttentionRuntime

    counter = _counting_compiled(monkeypatch)
    g = torch.Generator().manual_seed(4)
    lat, t, ctx = (torch.randn(1, 16, 3, 6, 10, generator=g, dtype=torch.float64), torch.rand(1, generator=g) * 1000,
                   torch.randn(1, 5, 4096, generator=g, dtype=torch.float64))
    runs = []
    for mode in ("off", "regions"):
        model = random_init_(WanModel("tiny"), seed=3).to(torch.float64)
        model.gradient_checkpointing = ckpt
        rt = SparseAttentionRuntime({"forced_density": 0.3, "block_size": 16, "cube": [1, 2, 8], "dense_layers": [],
                                     "backend": "reference"}, num_layers=2, num_heads=2, head_dim=64)
        rt.install(model)
        fusion.apply_block_fusion(model, mode)
        out = model(lat, t, ctx)
        out.square().mean().backward()
        runs.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()},
                     rt.cached_selection(0).density()))
    (out0, g0, d0), (out1, g1, d1) = runs
    assert counter.frame_count >= 3   # the 'regions' model ran its compiled pieces
    assert 0.2 < float(d0.mean()) < 0.5 and torch.equal(d0, d1)   # sparse, and the same blocks selected
    assert torch.allclose(out1, out0, rtol=1e-10, atol=1e-12)
    for n in g0:
        assert torch.allclose(g1[n], g0[n], rtol=1e-9, atol=1e-12), n


def test_the_trainer_warms_each_new_plan_once_and_falls_back_once():
    """FusionWarmup (the trainer's compile-ahead): all pairs of the first plan before step 1, only the pairs a new
    plan adds before its first step, nothing for a plan already seen; a compile failure warns once and stops it."""
    from ds_adaptive.training.fusion_warmup import FusionWarmup

    calls, logs = [], []

    def warm(pairs, **kw):
        calls.append(set(pairs))
        if (9, 9) in pairs:
            raise fusion.BlockFusionUnavailable("InvalidCxxCompiler: no compiler")
        return 1.5

    fw = FusionWarmup("regions", warm, dtype=torch.bfloat16, device=None, per_token=False, log=logs.append)
    epoch0, epoch1, epoch2, epoch3 = object(), object(), object(), object()
    assert fw.before_step(epoch0, lambda: {(1, 100), (3, 40)}, 0) == 1.5
    assert fw.before_step(epoch0, lambda: {(1, 100), (3, 40)}, 0) is None   # the same plan: nothing
    assert fw.before_step(epoch1, lambda: {(3, 40)}, 1) is None             # a new plan, no new pair
    assert fw.before_step(epoch2, lambda: {(3, 40), (2, 100)}, 2) == 1.5
    assert calls == [{(1, 100), (3, 40)}, {(2, 100)}]
    assert "warm-up: 1.5 s (compiled for the plan's 2 (batch, tokens) pairs)" in logs[0]
    assert "1 new (batch, tokens) pair(s) of epoch 2's plan: 1.5 s" in logs[1]
    assert fw.summary() == {"mode": "regions", "warmup_s": 1.5, "later_warmup_s": 1.5, "later_pairs": 1,
                            "fallback": None}
    assert fw.before_step(epoch3, lambda: {(9, 9)}, 3) is None
    assert fw.fallback == "InvalidCxxCompiler: no compiler" and "could not compile" in logs[2] and len(logs) == 3
    assert fw.before_step(object(), lambda: {(7, 7)}, 4) is None and len(calls) == 3   # no second attempt
