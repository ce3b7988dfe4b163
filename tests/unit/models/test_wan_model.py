"""Guards ds_adaptive.models.wan: numerics == diffusers' WanTransformer3DModel (per-sample and per-token timesteps), and the SP / fused-op hooks."""
from __future__ import annotations

import pytest
import torch

from ds_adaptive.models.lean_backward import RecomputingLinear
from ds_adaptive.models.testing import diffusers_twin, random_init_
from ds_adaptive.models.wan21 import WAN_CONFIGS
from ds_adaptive.models.wan import WanModel
from ds_adaptive.models.rope import rope_table
from ds_adaptive.models.wan_blocks import sdpa_attention
from ds_adaptive.models.wan_config import WanConfigError, get_wan_config
from ds_adaptive.models.weights import wan_key_to_diffusers
from ds_adaptive.ops.ln_modulate import ln_modulate_reference

diffusers = pytest.importorskip("diffusers", reason="diffusers is the reference these tests compare with")

# head_dim 128 (the released models), head_dim 32 (rotary split 6/5/5 pairs, custom text width) and a
# 48-channel latent (Wan 2.2 TI2V-5B's VAE)
CONFIGS = {
    "hd128": dict(dim=256, num_heads=2, num_layers=2, ffn_dim=512),
    "hd32": dict(dim=96, num_heads=3, num_layers=2, ffn_dim=160, text_dim=64),
    "c48": dict(dim=96, num_heads=3, num_layers=2, ffn_dim=160, text_dim=64, in_channels=48, out_channels=48),
}
# (B, T', H', W'): an image (1 latent frame) and a video; token grids 1x3x5 and 3x3x5 (odd sizes)
INPUTS = {"image": (2, 1, 6, 10), "video": (1, 3, 6, 10)}


def _inputs(cfg, b, t, h, w, seed=0, per_token=False):
    """latents, timestep ([B], or [B, S] with ``per_token``: one per token, diffusers' expand_timesteps), context."""
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(b, cfg.in_channels, t, h, w, generator=g)
    timestep = torch.rand(b, generator=g) * 1000
    context = torch.randn(b, 7, cfg.text_dim, generator=g)
    if per_token:  # per token, as TI2V's first-frame conditioning: frame 0 at t=0, the rest at per-token values
        s = t * (h // 2) * (w // 2)
        timestep = torch.rand(b, s, generator=g) * 1000
        timestep[:, : (h // 2) * (w // 2)] = 0.0
    return latents, timestep, context


def _model(name, seed=0):
    return random_init_(WanModel(get_wan_config(CONFIGS[name])), seed)


def _rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


# per-token timesteps on the two small configs (the numerics do not depend on the width; CPU time)
CASES = [(c, i, pt) for c in CONFIGS for i in INPUTS for pt in (False, True) if not (pt and c == "hd128")]


@pytest.mark.parametrize("cfg_name,inp,per_token", CASES,
                         ids=[f"{c}-{i}-{'t_token' if pt else 't_sample'}" for c, i, pt in CASES])
def test_matches_diffusers_forward_and_grads(cfg_name, inp, per_token):
    model = _model(cfg_name)
    twin = diffusers_twin(model)
    lat, ts, ctx = _inputs(model.config, *INPUTS[inp], per_token=per_token)
    ins_a = [t.clone().requires_grad_() for t in (lat, ts, ctx)]
    ins_b = [t.clone().requires_grad_() for t in (lat, ts, ctx)]
    out_a = model(*ins_a)
    out_b = twin(*ins_b, return_dict=False)[0]
    assert out_a.shape == lat.shape == out_b.shape
    assert _rel_err(out_a, out_b) <= 1e-4

    w = torch.randn(out_b.shape, generator=torch.Generator().manual_seed(1))
    (out_a * w).sum().backward()
    (out_b * w).sum().backward()
    for name, a, b in zip(("latents", "timestep", "context"), ins_a, ins_b):
        assert _rel_err(a.grad, b.grad) <= 1e-4, name
    twin_params = dict(twin.named_parameters())
    for name, p in model.named_parameters():
        ref = twin_params[wan_key_to_diffusers(name)].grad
        assert p.grad is not None and ref is not None, name
        assert ref.abs().max() > 0, name
        assert _rel_err(p.grad, ref) <= 1e-4, name


def test_comparison_detects_a_small_change():
    # Negative control: the tolerance above is tight enough to see a 1% change of one modulation row.
    model = _model("hd32")
    twin = diffusers_twin(model)
    lat, ts, ctx = _inputs(model.config, *INPUTS["video"])
    with torch.no_grad():
        model.blocks[1].modulation[0, 4] *= 1.01  # scale of the FFN adaLN in the last block
        assert _rel_err(model(lat, ts, ctx), twin(lat, ts, ctx, return_dict=False)[0]) > 1e-4


def test_bf16_matches_diffusers_bf16():
    """bf16 params (modulation, time embedding, cross-attn norm kept fp32 as diffusers does)."""
    model = _model("hd128")
    twin = diffusers_twin(model, torch.bfloat16)
    ref32 = diffusers_twin(model)
    model.to_dtype(torch.bfloat16)
    lat, ts, ctx = _inputs(model.config, *INPUTS["video"])
    with torch.no_grad():
        ours = model(lat, ts, ctx)
        theirs = twin(lat.bfloat16(), ts, ctx.bfloat16(), return_dict=False)[0]
        exact = ref32(lat, ts, ctx, return_dict=False)[0]
    assert ours.dtype == theirs.dtype == torch.bfloat16
    lowp_err = (theirs.float() - exact).abs().max()
    assert lowp_err > 0  # the comparison below is meaningful
    # same rounding points as diffusers: far below bf16's own error
    assert (ours.float() - theirs.float()).abs().max() <= 0.25 * lowp_err


@pytest.mark.parametrize("head_dim,split", [(128, (22, 21, 21)), (64, (12, 10, 10)), (32, (6, 5, 5)), (6, (1, 1, 1))])
def test_rope_split_and_table_match_diffusers(head_dim, split):
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    cfg = get_wan_config(dict(dim=2 * head_dim, num_heads=2, num_layers=1, ffn_dim=8))
    assert cfg.rope_split == split and sum(split) == head_dim // 2
    grid = (3, 4, 5)
    table = rope_table(grid, cfg.rope_split)
    assert table.shape == (60, head_dim // 2, 2) and table.dtype == torch.float32
    cos, sin = WanRotaryPosEmbed(head_dim, (1, 2, 2), 1024)(torch.zeros(1, 16, 3, 8, 10))
    assert torch.equal(table[..., 0], cos[0, :, 0, 0::2]) and torch.equal(table[..., 1], sin[0, :, 0, 1::2])


def test_padded_sequence_with_valid_len_matches_unpadded():
    """The sequence-parallel contract: pad tokens + rope rows, pass valid_len; real tokens are unchanged."""
    model = _model("hd32")
    lat, ts, ctx = _inputs(model.config, *INPUTS["video"])
    with torch.no_grad():
        inputs = model.embed(lat, ts, ctx)
        freqs = model.rope(inputs.grid)
        ref = model.run_blocks(inputs.tokens, inputs, freqs)
        s, pad = inputs.tokens.shape[1], 3
        x = torch.cat([inputs.tokens, torch.randn(1, pad, model.config.dim)], dim=1)
        f = torch.cat([freqs, torch.zeros(pad, *freqs.shape[1:])], dim=0)
        out = model.run_blocks(x, inputs, f, valid_len=s)
        assert _rel_err(out[:, :s], ref) <= 1e-5
        unmasked = model.run_blocks(x, inputs, f)
        assert _rel_err(unmasked[:, :s], ref) > 1e-3  # the mask matters
        with pytest.raises(WanConfigError, match="shard model.rope"):
            model.run_blocks(x, inputs, freqs)


def test_set_attention_fn_is_called_with_bshd_and_kwargs():
    model = _model("hd32")
    cfg = model.config
    lat, ts, ctx = _inputs(cfg, *INPUTS["image"])
    calls = []

    class Recorder(torch.nn.Module):  # a Module, like DeepSpeed's DistributedAttention
        def forward(self, q, k, v, **kwargs):
            calls.append((q.shape, k.shape, v.shape, kwargs))
            return 2.0 * sdpa_attention(q, k, v)

    with torch.no_grad():
        ref = model(lat, ts, ctx)
        model.set_attention(Recorder())
        assert not any(isinstance(m, Recorder) for m in model.modules())  # not registered
        doubled = model(lat, ts, ctx)
        b, s = lat.shape[0], 15
        assert len(calls) == cfg.num_layers
        assert all(c[:3] == ((b, s, cfg.num_heads, cfg.head_dim),) * 3 and c[3] == {} for c in calls)
        assert _rel_err(doubled, ref) > 1e-2  # the fn's output is what the block uses
        calls.clear()
        inputs = model.embed(lat, ts, ctx)
        model.run_blocks(inputs.tokens, inputs, model.rope(inputs.grid), valid_len=s, note="x")
        assert [c[3] for c in calls] == [{"valid_len": s, "note": "x"}] * cfg.num_layers
        model.set_attention(None)
        assert torch.equal(model(lat, ts, ctx), ref)


def test_set_ln_modulate_sites_and_strided_views():
    model = _model("hd32")
    d, L = model.config.dim, model.config.num_layers
    lat, ts, ctx = _inputs(model.config, *INPUTS["image"])
    b = lat.shape[0]
    seen = []

    def recording(x, shift, scale, eps, weight=None, bias=None):
        seen.append((shift, scale, eps, weight, bias))
        return ln_modulate_reference(x, shift, scale, eps, weight, bias)

    with torch.no_grad():
        ref = model(lat, ts, ctx)
        model.set_ln_modulate(recording)
        assert torch.equal(model(lat, ts, ctx), ref)
    assert len(seen) == 2 * L + 1
    for i, (shift, scale, eps, weight, bias) in enumerate(seen):
        rows = 2 if i == 2 * L else 6
        assert shift.dtype == scale.dtype == torch.float32 and eps == model.config.eps
        assert shift.shape == scale.shape == (b, 1, d)
        assert shift.stride() == scale.stride() == (rows * d, d, 1)  # views of one [B, rows, D] table
        assert shift._base is not None and shift._base is scale._base
        assert weight is None and bias is None
    def swapped(x, shift, scale, eps, weight=None, bias=None):
        return ln_modulate_reference(x, scale, shift, eps)

    model.set_ln_modulate(swapped)
    with torch.no_grad():
        assert _rel_err(model(lat, ts, ctx), ref) > 1e-3  # the fn is really used
    model.set_ln_modulate(None)


def test_per_token_modulation_reaches_the_sites_as_token_rows():
    """timestep [B, S]: every site gets fp32 [B, S, D] shift / scale views of one [B, S, rows, D] table
    (what the fused op's per-token path reads); equal timesteps give the per-sample result."""
    model = _model("hd32")
    d, L = model.config.dim, model.config.num_layers
    lat, ts, ctx = _inputs(model.config, *INPUTS["video"], per_token=True)
    b, s = ts.shape
    seen = []

    def recording(x, shift, scale, eps, weight=None, bias=None):
        seen.append((shift, scale))
        return ln_modulate_reference(x, shift, scale, eps, weight, bias)

    model.set_ln_modulate(recording)
    with torch.no_grad():
        model(lat, ts, ctx)
        assert len(seen) == 2 * L + 1
        for i, (shift, scale) in enumerate(seen):
            rows = 2 if i == 2 * L else 6
            assert shift.shape == scale.shape == (b, s, d) and shift.dtype == torch.float32
            assert shift.stride() == scale.stride() == (s * rows * d, rows * d, 1)
        model.set_ln_modulate(None)
        same = ts[:, :1].expand(b, s) + 0.0   # one value per sample, written per token
        assert _rel_err(model(lat, same, ctx), model(lat, same[:, 0], ctx)) <= 1e-5
        assert _rel_err(model(lat, ts, ctx), model(lat, same[:, 0], ctx)) > 1e-3  # the per-token values matter


def test_per_token_timesteps_follow_the_token_order():
    """Under a token order (sparse attention's cube order) per-token timesteps are permuted with the tokens."""
    from ds_adaptive.attention.cube_order import CubeOrder

    model = _model("hd32")
    lat, ts, ctx = _inputs(model.config, 1, 4, 8, 8, per_token=True)
    with torch.no_grad():
        ref = model(lat, ts, ctx)
        model.set_token_order(CubeOrder((2, 2, 2)))
        assert _rel_err(model(lat, ts, ctx), ref) <= 1e-5
        inputs = model.embed(lat, ts, ctx)
        assert inputs.per_token and inputs.time_mod.shape == (1, 64, 6, model.config.dim)
        model.set_token_order(None)


def test_gradient_checkpointing_same_grads_and_recomputes():
    model = _model("hd32")
    lat, ts, ctx = _inputs(model.config, *INPUTS["video"])
    n_calls = [0]

    def counting(q, k, v, **kw):
        n_calls[0] += 1
        return sdpa_attention(q, k, v, **kw)

    model.set_attention(counting)

    def grads():
        model.zero_grad(set_to_none=True)
        n_calls[0] = 0
        x = lat.clone().requires_grad_()
        model(x, ts, ctx).square().mean().backward()
        return [x.grad] + [p.grad.clone() for p in model.parameters()], n_calls[0]

    plain, calls_plain = grads()
    model.gradient_checkpointing = True
    ckpt, calls_ckpt = grads()
    assert calls_plain == model.config.num_layers and calls_ckpt == 2 * model.config.num_layers
    for a, b in zip(plain, ckpt):
        assert _rel_err(b, a) <= 1e-6
    with torch.no_grad():  # no recomputation without grad
        n_calls[0] = 0
        model(lat, ts, ctx)
        assert n_calls[0] == model.config.num_layers


def test_config_presets_and_validation():
    assert (WAN_CONFIGS["wan2.1-1.3b"].dim, WAN_CONFIGS["wan2.1-1.3b"].ffn_dim, WAN_CONFIGS["wan2.1-1.3b"].num_heads,
            WAN_CONFIGS["wan2.1-1.3b"].num_layers) == (1536, 8960, 12, 30)
    assert (WAN_CONFIGS["wan2.1-14b"].dim, WAN_CONFIGS["wan2.1-14b"].ffn_dim, WAN_CONFIGS["wan2.1-14b"].num_heads,
            WAN_CONFIGS["wan2.1-14b"].num_layers) == (5120, 13824, 40, 40)
    assert WAN_CONFIGS["wan2.1-14b"].head_dim == 128 and WAN_CONFIGS["tiny"].text_dim == 4096
    cfg = get_wan_config("tiny", num_layers=3)
    assert cfg.num_layers == 3 and cfg.dim == WAN_CONFIGS["tiny"].dim
    assert get_wan_config({"dim": 64, "num_heads": 1, "ffn_dim": 32, "num_layers": 1}).head_dim == 64
    with pytest.raises(WanConfigError, match=r"dim \(100\) must be divisible by num_heads \(3\)"):
        get_wan_config("tiny", dim=100, num_heads=3)
    with pytest.raises(WanConfigError, match="head_dim .* = 33 must be even"):
        get_wan_config("tiny", dim=99, num_heads=3)
    with pytest.raises(WanConfigError, match="head_dim = 4 is too small"):
        get_wan_config("tiny", dim=8, num_heads=2)
    with pytest.raises(WanConfigError, match=r"unknown WanConfig key\(s\) \['heads'\]"):
        get_wan_config("tiny", heads=4)
    with pytest.raises(WanConfigError, match="unknown model 'wan2.2'.*wan2.1-14b"):
        get_wan_config("wan2.2")
    with pytest.raises(WanConfigError, match=r"needs \['ffn_dim', 'num_layers'\]"):
        get_wan_config({"dim": 64, "num_heads": 1})
    with pytest.raises(WanConfigError, match="num_layers must be an int >= 1"):
        get_wan_config("tiny", num_layers=0)


def test_input_validation_names_the_problem():
    model = WanModel("tiny")
    lat, ts, ctx = _inputs(model.config, 1, 1, 4, 4)
    with pytest.raises(WanConfigError, match=r"latents must be \[B, 16"):
        model(lat[:, :4], ts, ctx)
    with pytest.raises(WanConfigError, match="1x4x5 .* not divisible by the patch"):
        model(torch.randn(1, 16, 1, 4, 5), ts, ctx)
    with pytest.raises(WanConfigError, match=r"timestep must be \[B\] = \[1\] .* or \[B, S\] = \[1, 4\]"):
        model(lat, ts[0], ctx)
    with pytest.raises(WanConfigError, match=r"\[B, S\] = \[1, 4\] \(one per token\), got \[1, 5\]"):
        model(lat, torch.zeros(1, 5), ctx)
    with pytest.raises(WanConfigError, match=r"context must be \[B, L, text_dim\] = \[1, L, 4096\]"):
        model(lat, ts, ctx[..., :64])


def test_default_init_and_meta_instantiation():
    model = WanModel("tiny")
    lat, ts, ctx = _inputs(model.config, 1, 1, 4, 4)
    assert torch.count_nonzero(model.head.head.weight) == 0  # Wan zero-inits the output layer
    assert torch.count_nonzero(model(lat, ts, ctx)) == 0
    std = model.blocks[0].modulation.std().item()
    assert 0.5 < std * model.config.dim ** 0.5 < 1.5
    assert all(torch.count_nonzero(b.self_attn.q.weight) > 0 for b in model.blocks)
    with torch.device("meta"):
        big = WanModel("wan2.1-14b")
    assert all(p.is_meta for p in big.parameters())
    assert len(big.blocks) == 40


def test_flat_linear_is_an_nn_linear_with_the_same_results_also_under_zero3s_function():
    """``wan.FlatLinear`` (the FFN's first Linear) multiplies a 3-D input as 2-D: same outputs and gradients as
    ``nn.Linear`` with torch's ``F.linear`` and with DeepSpeed's ZeRO-3 replacement (``LinearFunctionForZeroStage3``,
    which takes the 2-D input to ``addmm``); same parameters and state-dict keys; a 2-D input passes through."""
    import torch.nn.functional as F

    from ds_adaptive.models.wan import WanModel
    from ds_adaptive.models.wan_blocks import FlatLinear
    from ds_adaptive.models.wan_config import get_wan_config

    torch.manual_seed(0)
    ref = torch.nn.Linear(12, 20).double()
    flat = FlatLinear(12, 20).double()
    flat.load_state_dict(ref.state_dict())
    assert isinstance(flat, torch.nn.Linear) and list(flat.state_dict()) == list(ref.state_dict())
    x = torch.randn(3, 7, 12, dtype=torch.double)

    def out_and_grads(m, x):
        x = x.clone().requires_grad_()
        y = m(x)
        y.backward(torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y))
        grads = [x.grad] + [p.grad.clone() for p in m.parameters()]
        m.zero_grad(set_to_none=True)
        return [y.detach()] + grads

    want = out_and_grads(ref, x)
    assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(out_and_grads(flat, x), want))
    assert torch.equal(flat(x[0]), F.linear(x[0], flat.weight, flat.bias))
    with torch.no_grad():   # a non-contiguous input: reshape copies, the result is the same
        xt = x.transpose(0, 1).contiguous().transpose(0, 1)
        assert torch.allclose(flat(xt), ref(xt), rtol=1e-12, atol=1e-12)

    zero3 = pytest.importorskip("deepspeed.runtime.zero.linear").LinearFunctionForZeroStage3
    orig = F.linear
    try:   # what zero.Init does to torch.nn.functional.linear
        F.linear = lambda inp, w, b=None: zero3.apply(inp, w, b)
        got = out_and_grads(flat, x)
        ref_zero = out_and_grads(ref, x)
    finally:
        F.linear = orig
    assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(got, want))
    assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(ref_zero, want))

    m = WanModel(get_wan_config("tiny", num_layers=1))
    assert type(m.blocks[0].ffn[0]) is FlatLinear and type(m.blocks[0].ffn[2]) is RecomputingLinear
