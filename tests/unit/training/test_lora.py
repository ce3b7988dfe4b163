"""Guards LoRA fine-tuning (ds_adaptive.training.lora): peft adapters on the DiT's attention / FFN linears with the base
frozen; the model's setters keep working; the memory model counts gradients and optimizer state of the adapters
only; exported adapters load in diffusers (load_lora_adapter and WanPipeline.load_lora_weights) and reproduce our
forward; a checkpoint resumed with another base or without LoRA is one clear error. The multi-process LoRA runs
are in tests/integration/test_lora_launch.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft", reason="LoRA needs peft (pip install 'ds_adaptive[lora]')")

from ds_adaptive.core.config import LoraConfig  # noqa: E402
from ds_adaptive.training.lora import (LORA_FILE, LoraError, adapter_pairs, adapter_parameters, apply_lora,  # noqa: E402
                              base_probe, check_base, check_resume, diffusers_lora, load_adapters, merge_adapters,
                              read_lora_file)
from ds_adaptive.models.registry import get_model  # noqa: E402
from ds_adaptive.models.testing import diffusers_twin, random_init_  # noqa: E402
from ds_adaptive.models.wan import WanModel
from ds_adaptive.models.wan_config import get_wan_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
CFG = get_wan_config("tiny", num_layers=2)


def _inputs(b=2, cfg=CFG):
    g = torch.Generator().manual_seed(5)
    return (torch.randn(b, cfg.in_channels, 3, 8, 12, generator=g), torch.tensor([250.0, 900.0][:b]),
            torch.randn(b, 24, cfg.text_dim, generator=g))


def _random_adapters(model, seed=0):
    """Non-zero adapters on every LoRA-able linear (lora_B starts at zero in training: make it visible)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.copy_(0.2 * torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def test_targets_freeze_and_count():
    model = random_init_(WanModel(CFG), seed=1)
    x, t, c = _inputs()
    with torch.no_grad():
        before = model(x, t, c)
    cfg = LoraConfig(enabled=True, rank=4, alpha=8, targets=["self_attn", "ffn.2"])
    info = apply_lora(model, cfg, seed=0, spec="tiny")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    assert sorted(info.modules) == sorted(f"blocks.{i}.{m}" for i in range(2)
                                          for m in ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "ffn.2"))
    assert info.adapter_params == sum(p.numel() for n, p in model.named_parameters() if n in trainable)
    assert info.adapter_params == adapter_parameters(CFG, cfg, spec="tiny")   # what the memory model plans with
    with torch.no_grad():
        torch.testing.assert_close(model(x, t, c), before)        # lora_B starts at zero: the base model exactly
    with pytest.raises(LoraError, match="already has LoRA"):
        apply_lora(model, cfg, seed=0, spec="tiny")
    with pytest.raises(LoraError, match=r"unknown target 'attn'.*valid: groups \['cross_attn', 'ffn', 'self_attn'\]"):
        apply_lora(WanModel(CFG), LoraConfig(enabled=True, targets=["attn"]), seed=0, spec="tiny")
    with pytest.raises(ValueError, match="more than once"):
        LoraConfig(targets=["ffn", "ffn"])


def test_setters_still_reach_every_block_after_lora():
    """The fused-op / Ulysses / sparse hooks are plain attributes set through WanModel's setters: LoRA leaves them
    alone, and an attention fn installed after LoRA sees q, k, v that include the adapters."""
    model = random_init_(WanModel(CFG), seed=2)
    apply_lora(model, LoraConfig(enabled=True, rank=2), seed=0, spec="tiny")
    _random_adapters(model)
    calls = {"attn": 0, "ln": 0}

    def attn(q, k, v, **kw):
        calls["attn"] += 1
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    from ds_adaptive.ops.ln_modulate import ln_modulate_reference

    def ln(*a, **kw):
        calls["ln"] += 1
        return ln_modulate_reference(*a, **kw)

    x, t, c = _inputs()
    with torch.no_grad():
        ref = model(x, t, c)
        model.set_attention(attn)
        model.set_ln_modulate(ln)
        out = model(x, t, c)
    assert calls == {"attn": 2, "ln": 2 * 2 + 1}
    torch.testing.assert_close(out, ref)


def test_static_memory_counts_adapter_state_only():
    from ds_adaptive.planning.profile import load_profile

    prof = load_profile("h200-wan2.1-1.3b")
    n = adapter_parameters(get_wan_config("wan2.1-1.3b"), LoraConfig(enabled=True, rank=32), spec="wan2.1-1.3b")
    assert 40e6 < n < 50e6   # rank 32 on q, k, v, o (self, cross) and both FFN linears of 30 blocks
    full = prof.static_memory_parts(3, 8)
    lora = prof.with_adapter_params(n).static_memory_parts(3, 8)
    gib = 1 << 30
    assert lora["params"] == pytest.approx((prof.params + n) * 2 / 8 / gib)
    assert lora["grads"] == pytest.approx(n * 2 / 8 / gib) and lora["optimizer"] == pytest.approx(n * 12 / 8 / gib)
    assert full["optimizer"] == pytest.approx(prof.params * 12 / 8 / gib)
    # survives the json round trip of profile variants, and None goes back to full fine-tuning
    again = type(prof).from_dict(prof.with_adapter_params(n).raw)
    assert again.adapter_params == n
    assert prof.with_adapter_params(n).with_adapter_params(None).static_memory_parts(3, 8) == full


def test_dry_run_build_sees_lora_and_its_memory():
    from ds_adaptive.core.layout import Layout
    from ds_adaptive.training.assemble import build_run
    from ds_adaptive.training.run_config import RunConfig

    raw = json.loads((ROOT / "launch" / "configs" / "zero3_adaptive.json").read_text())
    raw["adaptive_load"]["sampler"]["profile"] = "h200-wan2.1-1.3b"
    full = build_run(RunConfig.load(raw, trainer={"model": "wan2.1-1.3b", "num_samples": 200}),
                     layout=Layout.for_world(8, 1), meta=True)
    raw["adaptive_load"]["lora"] = {"enabled": True, "rank": 16}
    run = build_run(RunConfig.load(raw, trainer={"model": "wan2.1-1.3b", "num_samples": 200}),
                    layout=Layout.for_world(8, 1), meta=True)
    assert run.lora is not None and run.lora.rank == 16 and run.lora.base == {}
    assert run.profile.adapter_params == run.lora.adapter_params
    assert any("LoRA rank 16" in n for n in run.notes)
    assert run.budgets["m_mem"] > full.budgets["m_mem"] + 1.0  # ~1.2 GiB less optimizer state per GPU at 8 GPUs
    assert all(p.device.type == "meta" for p in run.model.parameters())


def test_base_probe_tells_bases_apart():
    a = random_init_(WanModel(CFG), seed=1)
    rec = {"probe": base_probe(a), "init_from": "base_dir"}
    assert check_base(rec, base_probe(random_init_(WanModel(CFG), seed=1)), what="ck") is None
    bf16 = random_init_(WanModel(CFG), seed=1).to_dtype(torch.bfloat16, keep_fp32=False)  # the same base, rounded
    assert check_base(rec, base_probe(bf16), what="ck") is None
    msg = check_base(rec, base_probe(random_init_(WanModel(CFG), seed=2)), what="ck")
    assert msg.startswith("ck: the frozen base differs") and "--init-from base_dir" in msg


def test_resume_rules_are_named():
    model = WanModel(CFG)
    info = apply_lora(model, LoraConfig(enabled=True, rank=4), seed=0, spec="tiny")
    state = info.client_state()
    assert check_resume(None, None, what="c") is None and check_resume(info, state, what="c") is None
    assert "holds LoRA adapters" in check_resume(None, state, what="c")
    assert "full fine-tuning checkpoint" in check_resume(info, None, what="c")
    assert "rank 8 -> 4" in check_resume(info, {**state, "rank": 8}, what="c")
    assert "targets" in check_resume(info, {**state, "modules": state["modules"][:3]}, what="c")


def _lora_model(seed=3, rank=4, alpha=6.0, rslora=False, name="tiny"):
    model = random_init_(get_model(name).build(get_model(name).config(num_layers=2)), seed=seed)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    info = apply_lora(model, LoraConfig(enabled=True, rank=rank, alpha=alpha, rslora=rslora), seed=0, spec=name)
    _random_adapters(model, seed)
    return model.eval(), base, info


@pytest.mark.parametrize("name,rslora", [("tiny", False), ("tiny", True), ("tiny-ti2v", False)])
def test_diffusers_file_loads_and_matches_our_forward(tmp_path, name, rslora):
    """alpha != rank (and rsLoRA): the scale is folded into lora_B; diffusers' load_lora_adapter and
    WanPipeline.load_lora_weights give our forward to 1e-5; merging gives it too; the file reads back. The file
    names come from the model's weight adapter, the targets from its family: Wan 2.2 TI2V-5B (48 latent
    channels, diffusers' WanPipeline with expand_timesteps) takes the same file format."""
    diffusers = pytest.importorskip("diffusers")
    from ds_adaptive.core.files import save_safetensors

    spec = get_model(name)
    cfg = spec.config(num_layers=2)
    model, base_sd, info = _lora_model(rslora=rslora, name=name)
    pairs = adapter_pairs(model.state_dict())
    tensors, meta = diffusers_lora(pairs, scale=info.scale, spec=spec)
    assert all(k.startswith("transformer.blocks.") and (".lora_A.weight" in k or ".lora_B.weight" in k) for k in tensors)
    assert "transformer.blocks.0.attn1.to_q.lora_A.weight" in tensors
    assert "transformer.blocks.1.ffn.net.0.proj.lora_B.weight" in tensors
    (tmp_path / "lora").mkdir()
    save_safetensors(tensors, tmp_path / "lora" / LORA_FILE, metadata=meta)

    plain = random_init_(spec.build(cfg), seed=3)
    twin = diffusers_twin(plain).eval()
    twin.load_lora_adapter(str(tmp_path / "lora" / LORA_FILE), prefix="transformer")
    pipe = diffusers.WanPipeline(tokenizer=None, text_encoder=None, vae=None,
                                 scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
                                 transformer=diffusers_twin(plain).eval(), expand_timesteps=name == "tiny-ti2v")
    pipe.load_lora_weights(str(tmp_path / "lora"))
    x, t, c = _inputs(cfg=cfg)
    with torch.no_grad():
        ours = model(x, t, c)
        base_out = plain(x, t, c)
        theirs = twin(x, t, c, return_dict=False)[0]
        piped = pipe.transformer(x, t, c, return_dict=False)[0]
        merged = spec.build(cfg)
        merged.load_state_dict(merge_adapters(base_sd, pairs, info.scale))
        merged_out = merged.eval()(x, t, c)
    assert float((ours - base_out).abs().max()) > 1e-2  # the adapters matter
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(piped, ours, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged_out, ours, rtol=1e-5, atol=1e-5)

    back, scale = read_lora_file(tmp_path / "lora" / LORA_FILE, spec=spec)
    assert scale == 1.0 and set(back) == set(pairs)
    again = random_init_(spec.build(cfg), seed=3)
    load_adapters(again, back, scale=scale)
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(x, t, c), ours, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["wan2.1-1.3b", "wan2.2-ti2v-5b", "wan2.2-t2v-a14b-low"])
def test_released_models_file_names_are_diffusers_linears(name):
    """At the released sizes (meta device): every adapted module's diffusers name, as an exported file writes it,
    is an nn.Linear of diffusers' WanTransformer3DModel built from the same config, with the same in / out
    features, so load_lora_adapter finds every target (TI2V-5B: 48 channels; the A14B expert: 14B)."""
    diffusers = pytest.importorskip("diffusers")
    from ds_adaptive.models.weights import diffusers_config

    spec = get_model(name)
    cfg = spec.config()
    with torch.device("meta"):
        ours = spec.build(cfg)
        theirs = diffusers.WanTransformer3DModel(**diffusers_config(cfg))
    info = apply_lora(ours, LoraConfig(enabled=True, rank=2), seed=0, spec=spec)
    assert len(info.modules) == 10 * cfg.num_layers
    linears = {n: m for n, m in theirs.named_modules() if isinstance(m, torch.nn.Linear)}
    mine = dict(ours.named_modules())
    for mod in info.modules:
        target = spec.weights.to_diffusers_key(f"{mod}.weight").removesuffix(".weight")
        base = mine[mod].base_layer
        assert target in linears, (mod, target)
        assert (linears[target].in_features, linears[target].out_features) == (base.in_features, base.out_features)
