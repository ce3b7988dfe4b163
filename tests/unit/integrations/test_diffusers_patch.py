"""Guards the diffusers WanTransformer3DModel patch: same outputs/grads as unpatched, idempotent, revertible."""
from __future__ import annotations

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
from diffusers import WanTransformer3DModel  # noqa: E402
from diffusers.models.transformers.transformer_wan import WanTransformerBlock  # noqa: E402

try:
    from ds_adaptive.integrations import diffusers as pd
except ImportError:  # source checkout without the package_dir mapping
    from patches import diffusers as pd  # type: ignore

pytestmark = pytest.mark.skipif(tuple(int(p) for p in diffusers.__version__.split(".")[:2]) not in pd.SUPPORTED,
                                reason=f"patch supports diffusers {pd.SUPPORTED}, found {diffusers.__version__}")

CFG = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
           text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True, eps=1e-6, rope_max_seq_len=32)


@pytest.fixture
def model():
    torch.manual_seed(0)
    m = WanTransformer3DModel(**CFG)
    yield m
    pd.revert()
    pd.revert(m)


def inputs(per_token=False, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, 3, 6, 8, generator=g)
    ctx = torch.randn(2, 7, 16, generator=g)
    if per_token:  # Wan 2.2 TI2V: one timestep per token -> per-token [B, S, D] modulation
        t = torch.rand(2, 3 * 3 * 4, generator=g) * 1000
    else:
        t = torch.tensor([10.0, 700.0])
    return x, t, ctx


def run(model, x, t, ctx):
    params = [p for p in model.parameters() if p.requires_grad]
    xl = x.clone().requires_grad_()
    y = model(xl, t, ctx, return_dict=False)[0]
    grads = torch.autograd.grad(y.square().sum(), [xl] + params)
    return y.detach(), grads


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("scope", ["classes", "instance"])
def test_patched_model_equals_unpatched(model, per_token, scope):
    x, t, ctx = inputs(per_token)
    y0, g0 = run(model, x, t, ctx)
    pd.apply_fused_ln_modulate_to_diffusers_wan(None if scope == "classes" else model)
    assert pd.is_patched(None if scope == "classes" else model)
    y1, g1 = run(model, x, t, ctx)
    assert torch.equal(y0, y1)  # the reference path on CPU: the same fp32 ops as diffusers
    for a, b in zip(g0, g1):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _to_bf16_keeping_fp32_modules(model):
    """bf16 as diffusers' from_pretrained(torch_dtype=bf16) does it: _keep_in_fp32_modules stay fp32."""
    model = model.to(torch.bfloat16)
    for name, p in model.named_parameters():
        if any(k in name.split(".") for k in model._keep_in_fp32_modules):
            p.data = p.data.float()
    return model


def test_bf16_model_matches(model):
    model = _to_bf16_keeping_fp32_modules(model)
    x, t, ctx = inputs()
    x, ctx = x.bfloat16(), ctx.bfloat16()
    with torch.no_grad():
        y0 = model(x, t, ctx, return_dict=False)[0]
        pd.apply_fused_ln_modulate_to_diffusers_wan(model)
        y1 = model(x, t, ctx, return_dict=False)[0]
    assert torch.equal(y0, y1)


def test_all_bf16_model_is_within_rounding(model):
    """A plain .to(bf16) (diffusers warns against it) makes the head's shift/scale bf16; diffusers
    then rounds (1 + scale) to bf16, the op keeps it in fp32 (the documented numerics): results
    agree to bf16 rounding."""
    model = model.to(torch.bfloat16)
    x, t, ctx = inputs()
    x, ctx = x.bfloat16(), ctx.bfloat16()
    with torch.no_grad():
        y0 = model(x, t, ctx, return_dict=False)[0]
        pd.apply_fused_ln_modulate_to_diffusers_wan(model)
        y1 = model(x, t, ctx, return_dict=False)[0]
    torch.testing.assert_close(y1.float(), y0.float(), rtol=2e-2, atol=2e-2)


def test_patch_is_idempotent_and_keeps_the_original(model):
    original_block, original_model = WanTransformerBlock.forward, WanTransformer3DModel.forward
    pd.apply_fused_ln_modulate_to_diffusers_wan()
    first = WanTransformerBlock.forward
    pd.apply_fused_ln_modulate_to_diffusers_wan()
    assert WanTransformerBlock.forward is first
    assert first.__wrapped__ is original_block
    assert WanTransformer3DModel.forward.__wrapped__ is original_model
    pd.revert()
    assert WanTransformerBlock.forward is original_block and WanTransformer3DModel.forward is original_model
    assert not pd.is_patched()


def test_instance_patch_leaves_other_models_alone(model):
    other = WanTransformer3DModel(**CFG)
    pd.apply_fused_ln_modulate_to_diffusers_wan(model)
    pd.apply_fused_ln_modulate_to_diffusers_wan(model)
    assert pd.is_patched(model) and not pd.is_patched(other)
    assert all(getattr(b.forward, "_ds_adaptive_fused_ln_modulate", False) for b in model.blocks)
    assert not any(getattr(b.forward, "_ds_adaptive_fused_ln_modulate", False) for b in other.blocks)
    pd.revert(model)
    assert not pd.is_patched(model)


def test_patched_forward_calls_the_op(model, monkeypatch):
    from ds_adaptive.ops import ln_modulate as ln_fn
    import importlib

    lnm = importlib.import_module("ds_adaptive.ops.ln_modulate")
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[1].shape)
        return ln_fn(*args, **kwargs)

    monkeypatch.setattr(lnm, "ln_modulate", spy)
    pd.apply_fused_ln_modulate_to_diffusers_wan(model)
    x, t, ctx = inputs()
    with torch.no_grad():
        model(x, t, ctx)
    assert len(calls) == 2 * CFG["num_layers"] + 1  # norm1 + norm3 per block, norm_out in the head


def test_unsupported_version_is_refused(monkeypatch, model):
    monkeypatch.setattr(diffusers, "__version__", "0.30.0")
    with pytest.raises(RuntimeError, match="supports diffusers 0.42.x; found 0.30.0"):
        pd.apply_fused_ln_modulate_to_diffusers_wan()
    assert not pd.is_patched()


def test_wrong_model_type_is_refused():
    with pytest.raises(TypeError, match="expects a WanTransformer3DModel"):
        pd.apply_fused_ln_modulate_to_diffusers_wan(torch.nn.Linear(2, 2))
