"""Guards the model seam: the registry, a preset's grid / spec / config / objective options, and that a family
registered through one module (here a made-up one with another VAE grid) flows through data, planning and
``build_run`` without any other change."""
from __future__ import annotations

import dataclasses
import json
import sys
import types

import pytest
import torch

from conftest import CONFIGS
from ds_adaptive.models import registry
from ds_adaptive.models.family import ModelError, missing_members, ObjectiveOptions, sigma_to_u
from ds_adaptive.models.registry import default_model, families, get_model, model_names
from ds_adaptive.models.objective import draw_noise, eval_inputs, shifted_sigma
from ds_adaptive.core.shapes import GridRule, SampleShape


def test_registry_lists_every_model_once_and_names_the_known_ones():
    names = model_names()
    assert len(names) == len(set(names)) and default_model() in names
    assert {"wan2.1-1.3b", "wan2.1-14b", "tiny"} <= set(names)
    assert all(get_model(n).family.name in families() for n in names)
    with pytest.raises(ModelError, match=r"unknown model 'nope'; known: .*wan2.1-1.3b"):
        get_model("nope")


@pytest.mark.parametrize("name", ["wan2.1-1.3b", "wan2.1-14b", "tiny"])
def test_a_model_answers_what_the_package_asks(name):
    from ds_adaptive.models.wan import count_parameters

    m = get_model(name)
    cfg = m.config()
    assert m.grid == GridRule((4, 8, 8), (1, 2, 2), 16) and m.text_len == 512
    assert m.input_spec.grid == m.grid and m.input_spec.text_dim == cfg.text_dim == 4096
    assert m.param_counts(cfg)["total"] == count_parameters(cfg)
    assert m.config(num_layers=1).num_layers == 1 and m.objective == ObjectiveOptions()
    assert m.shapes.is_file() and len(m.preset.calibration_shapes) >= 3
    with torch.device("meta"):
        net = m.build(m.config(num_layers=1))
    assert missing_members(net) == []                       # the seam's check (not isinstance: see its docstring)
    assert "blocks" in missing_members(torch.nn.Linear(2, 2))
    model_flops, hw = m.flops(cfg, 1560, 2, cfg.num_layers)
    assert hw > model_flops > 0


@pytest.mark.parametrize("shift", [1.0, 5.0, 12.0])
def test_sigma_range_restricts_u_to_the_range(shift):
    opts = ObjectiveOptions(sigma_range=(0.875, 1.0))
    lo, hi = opts.u_range(shift)
    assert shifted_sigma(torch.tensor(lo, dtype=torch.float64), shift).item() == pytest.approx(0.875)
    assert hi == pytest.approx(1.0) and sigma_to_u(0.0, shift) == 0.0
    x0 = torch.randn(64, 2, 1, 2, 2)
    u, _ = draw_noise(x0, torch.arange(64), seed=0, epoch=0, u_range=(lo, hi))
    sigma = shifted_sigma(u.double(), shift)
    assert bool(((sigma >= 0.875 - 1e-6) & (sigma <= 1.0)).all())
    _, t, _ = eval_inputs(x0[0], 3, seed=0, shift=shift, objective=opts)
    assert bool((t >= 875 - 1e-3).all()) and bool((t <= 1000).all())
    # the default range draws exactly what the unrestricted objective drew (resume / equivalence tests rely on it)
    u_full, _ = draw_noise(x0, torch.arange(64), seed=0, epoch=0)
    u_def, _ = draw_noise(x0, torch.arange(64), seed=0, epoch=0, u_range=ObjectiveOptions().u_range(shift))
    assert torch.equal(u_full, u_def)


def test_objective_overrides_are_checked():
    opts = ObjectiveOptions()
    assert opts.with_overrides({"sigma_range": [0.0, 0.875]}).sigma_range == (0.0, 0.875)
    with pytest.raises(ModelError, match=r"unknown key\(s\) \['sigma'\]; valid keys: \['first_frame_ratio', 'sig"):
        opts.with_overrides({"sigma": 1})
    with pytest.raises(ModelError, match="0 <= lo < hi <= 1"):
        opts.with_overrides({"sigma_range": [0.9, 0.5]})
    with pytest.raises(ModelError, match=r"first_frame_ratio must be a number in \[0, 1\], got 2"):
        opts.with_overrides({"first_frame_ratio": 2})


def test_first_frame_conditioning_needs_per_token_timesteps():
    from ds_adaptive.models.family import Model

    m = get_model("tiny")
    assert m.objective_with({"first_frame_ratio": 0.5}).first_frame_ratio == 0.5   # WanModel takes [B, S]
    per_sample_only = Model(dataclasses.replace(m.family, per_token_timesteps=False), m.preset)
    with pytest.raises(ModelError, match="takes one timestep per sample, not one per token"):
        per_sample_only.objective_with({"first_frame_ratio": 0.5})


# ---------------------------------------------------------------------------------------------------------
# A family added through the seam only: one module with FAMILY, registered by name. It reuses the Wan code with
# another VAE (stride 4x4x4, 8 latent channels) and text width, so every consumer must take the numbers from it.
ODD_GRID = GridRule((4, 4, 4), (1, 2, 2), 8)


@pytest.fixture
def odd_family(tmp_path, monkeypatch):
    from ds_adaptive.models import wan21

    shapes = tmp_path / "odd_shapes.json"
    shapes.write_text(json.dumps([{"frames": 1, "height": 24, "width": 40, "weight": 3},
                                  {"frames": 9, "height": 24, "width": 16, "weight": 1}]))
    preset = wan21.wan_preset("odd-tiny", dict(dim=64, ffn_dim=96, num_heads=2, num_layers=2, in_channels=8,
                                               out_channels=8, text_dim=32),
                              vae_stride=(4, 4, 4), vae="odd VAE", shapes=shapes, text_len=16,
                              objective=ObjectiveOptions(sigma_range=(0.0, 0.5)),
                              calibration_shapes=((1, 24, 40), (5, 24, 40), (9, 24, 40)))
    module = types.ModuleType("odd_family_for_tests")
    module.FAMILY = dataclasses.replace(wan21.FAMILY, name="odd", presets=(preset,))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(registry, "FAMILY_MODULES", registry.FAMILY_MODULES + (module.__name__,))
    monkeypatch.setattr(registry, "_MODELS", None)
    monkeypatch.setattr(registry, "_FAMILIES", None)
    yield get_model("odd-tiny")
    registry._MODELS = registry._FAMILIES = None


def test_a_new_family_is_one_module(odd_family, tmp_path):
    from ds_adaptive.data import build_dataset
    from ds_adaptive.core.layout import Layout
    from ds_adaptive.training.assemble import build_run
    from ds_adaptive.training.run_config import RunConfig

    assert odd_family.grid == ODD_GRID and "odd-tiny" in model_names()
    assert SampleShape(9, 24, 16, ODD_GRID).latent_shape == (8, 3, 6, 4)
    ds = build_dataset("synthetic", num_samples=6, shapes=odd_family.shapes, spec=odd_family.input_spec)
    s = ds[0]
    assert s["latents"].shape == ds.shape_of(0).latent_shape and s["latents"].shape[0] == 8
    assert s["context"].shape[1] == 32 and s["context"].shape[0] <= 16
    ds_config = json.loads((CONFIGS / "cpu_tiny.json").read_text())
    del ds_config["adaptive_load"]["sampler"]["shapes"]   # the synthetic data: the model's own default mix
    cfg = RunConfig.load(ds_config, trainer={"model": "odd-tiny", "num_samples": 40})
    run = build_run(cfg, layout=Layout.for_world(2, 1), meta=True)
    assert run.preset is odd_family and run.text_len == 16
    assert run.objective.sigma_range == (0.0, 0.5)
    assert {sh.grid for sh in run.dataset.sample_shapes()} == {ODD_GRID}
    assert run.model.config.in_channels == 8 and run.model.patch_embedding.weight.shape[1] == 8
    assert max(sh.tokens for sh in run.dataset.sample_shapes()) == 3 * 3 * 2   # 9x24x16 -> 3 x 3 x 2 tokens


def test_a_new_family_gets_lora_previews_and_sampling_from_its_data(odd_family, tmp_path, capsys):
    """LoRA (targets from the family, counted in a dry run), preview prompts and sizes (its text width / length and
    grid) and ``ds-adaptive sample`` (the model found from the weights' config.json, its grid's noise and latent
    preview) for the made-up family, through the seam only."""
    pytest.importorskip("peft")
    import numpy as np
    from PIL import Image

    from ds_adaptive.core.config import ConfigError, LoraConfig, PreviewConfig
    from ds_adaptive.core.layout import Layout
    from ds_adaptive.training.lora import LoraError, adapter_parameters
    from ds_adaptive.models.family import Model
    from ds_adaptive.models.registry import model_of_weights
    from ds_adaptive.training.preview import load_prompts, save_embeddings
    from ds_adaptive.training.assemble import build_run
    from ds_adaptive.training.run_config import RunConfig
    from ds_adaptive.cli.sample import main as sample_main

    ds_config = json.loads((CONFIGS / "cpu_tiny.json").read_text())
    del ds_config["adaptive_load"]["sampler"]["shapes"]
    ds_config["adaptive_load"]["lora"] = {"enabled": True, "rank": 4}
    run = build_run(RunConfig.load(ds_config, trainer={"model": "odd-tiny", "num_samples": 40}),
                    layout=Layout.for_world(2, 1), meta=True)
    # dim 64, FFN 96: q, k, v, o of both attentions (64 -> 64) and the two FFN linears, in 2 blocks
    assert len(run.lora.modules) == 2 * 10 and run.lora.adapter_params == 2 * 4 * (8 * 128 + 2 * 160)
    no_lora = Model(dataclasses.replace(odd_family.family, lora_targets=None), odd_family.preset)
    with pytest.raises(LoraError, match=r"model odd-tiny \(odd\) defines no LoRA targets"):
        adapter_parameters(odd_family.config(), LoraConfig(enabled=True), spec=no_lora)

    f = tmp_path / "p.safetensors"
    save_embeddings({"a": torch.randn(5, 32), "b": torch.randn(16, 32)}, f)
    prompts, _ = load_prompts(PreviewConfig(enabled=True, prompts=str(f), size="5x24x40"), run.dataset)
    assert [p.shape.latent_shape for p in prompts] == [(8, 2, 6, 10)] * 2
    with pytest.raises(ConfigError, match=r"height must be a multiple of 8 .*\(model odd-tiny\)"):
        load_prompts(PreviewConfig(enabled=True, prompts=str(f), size="5x20x40"), run.dataset)
    save_embeddings({"wide": torch.randn(5, 4096)}, tmp_path / "wide.safetensors")
    with pytest.raises(ConfigError, match=r"\[L <= 16, 32\] \(odd-tiny's text encoder\).*wide \[5, 4096\]"):
        load_prompts(PreviewConfig(enabled=True, prompts=str(tmp_path / "wide.safetensors"), size="5x24x40"),
                     run.dataset)

    torch.manual_seed(0)
    odd_family.weights.save(odd_family.build(odd_family.config()), tmp_path / "model", layout="diffusers")
    assert model_of_weights(tmp_path / "model") is odd_family
    assert sample_main([str(tmp_path / "model"), "--embeddings", str(f), "--frames", "5", "--height", "24", "--width",
                        "40", "--steps", "2", "--device", "cpu", "--out", str(tmp_path / "out")]) == 0
    assert "(odd-tiny)" in capsys.readouterr().out
    strip = np.asarray(Image.open(tmp_path / "out" / "a.png"))
    assert strip.shape == (24, 2 * 40, 3)   # 2 latent frames side by side, each latent pixel 4 x 4 (the VAE stride)
    assert sample_main([str(tmp_path / "model"), "--embeddings", str(f), "--height", "20", "--width", "40",
                        "--frames", "5", "--out", str(tmp_path / "bad")]) == 2
    assert "model odd-tiny" in capsys.readouterr().err


def test_the_cores_defaults_are_the_default_models():
    """core.shapes holds the default model's grid, inputs and shape mix as numbers (the core imports no model):
    they must stay the registry's default model's."""
    from pathlib import Path

    from ds_adaptive.core.shapes import DEFAULT_GRID, DEFAULT_INPUT_SPEC, DEFAULT_SHAPES

    m = get_model(default_model())
    assert m.grid == DEFAULT_GRID and m.input_spec == DEFAULT_INPUT_SPEC
    assert Path(m.shapes).resolve() == DEFAULT_SHAPES
