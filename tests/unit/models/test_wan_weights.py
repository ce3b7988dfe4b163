"""Guards ds_adaptive.models.weights: diffusers / original-Wan checkpoints load exactly, bad ones fail by name."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ds_adaptive.models.testing import diffusers_twin, random_init_
from ds_adaptive.models.wan import WanModel
from ds_adaptive.models.wan_blocks import is_fp32_param
from ds_adaptive.models.wan_config import get_wan_config
from ds_adaptive.models.weights import (load_pretrained, WanWeightsError, checkpoint_files, config_from_dict, convert_diffusers_to_wan,
                                        convert_wan_to_diffusers, load_wan_weights, read_config, save_wan_weights)

diffusers = pytest.importorskip("diffusers", reason="diffusers writes the reference checkpoints these tests load")

CFG = get_wan_config(dict(dim=96, num_heads=3, num_layers=2, ffn_dim=160, text_dim=64))


@pytest.fixture(scope="module")
def model():
    return random_init_(WanModel(CFG), seed=3)


@pytest.fixture(scope="module")
def diffusers_dir(model, tmp_path_factory):
    d = tmp_path_factory.mktemp("diffusers") / "transformer"
    diffusers_twin(model).save_pretrained(str(d), safe_serialization=True)
    return d


def _same_params(a: WanModel, b: WanModel):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k].float(), sb[k].float()), k


def _inputs(b=1, t=3, h=6, w=10):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(b, 16, t, h, w, generator=g), torch.rand(b, generator=g) * 1000,
            torch.randn(b, 5, 64, generator=g))


def test_load_diffusers_save_pretrained(model, diffusers_dir):
    assert (diffusers_dir / "config.json").is_file()
    assert read_config(diffusers_dir) == CFG  # config inferred from diffusers' config.json
    loaded = load_pretrained(diffusers_dir)
    _same_params(loaded, model)
    with torch.no_grad():
        assert torch.equal(loaded(*_inputs()), model(*_inputs()))


def test_load_sharded_and_pipeline_dir(model, diffusers_dir, tmp_path):
    sharded = tmp_path / "pipe" / "transformer"
    diffusers_twin(model).save_pretrained(str(sharded), safe_serialization=True, max_shard_size="150KB")
    files = checkpoint_files(sharded)
    assert len(files) > 2 and (sharded / "diffusion_pytorch_model.safetensors.index.json").is_file()
    _same_params(load_pretrained(sharded), model)
    (tmp_path / "pipe" / "model_index.json").write_text("{}")  # a diffusers pipeline folder
    _same_params(load_pretrained(tmp_path / "pipe"), model)
    files[1].unlink()
    with pytest.raises(WanWeightsError, match=f"lists shard.*{files[1].name}.*incomplete"):
        load_pretrained(sharded)


def _corrupt(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    f = dst / "diffusion_pytorch_model.safetensors"
    sd = load_file(str(f))
    edit(sd)
    save_file(sd, str(f))
    return dst


def test_missing_unexpected_and_misshapen_keys_are_named(diffusers_dir, tmp_path):
    key = "blocks.1.attn2.to_k.weight"
    bad = _corrupt(diffusers_dir, tmp_path / "missing", lambda sd: sd.pop(key))
    with pytest.raises(WanWeightsError,
                       match=r"1 missing parameter\(s\): 'blocks.1.cross_attn.k.weight' \(shape \[96, 96\]\)"):
        load_pretrained(bad)

    bad = _corrupt(diffusers_dir, tmp_path / "unexpected",
                   lambda sd: sd.update({"blocks.0.attn1.extra": torch.ones(3)}))
    with pytest.raises(WanWeightsError,
                       match=r"1 unexpected key\(s\): 'blocks.0.attn1.extra' "
                             r"\(in diffusion_pytorch_model.safetensors\)"):
        load_pretrained(bad)

    bad = _corrupt(diffusers_dir, tmp_path / "shape",
                   lambda sd: sd.update({"blocks.0.scale_shift_table": torch.ones(1, 6, 48)}))
    with pytest.raises(WanWeightsError) as err:
        load_pretrained(bad)
    msg = str(err.value)
    assert ("'blocks.0.modulation' (checkpoint key 'blocks.0.scale_shift_table') "
            "in diffusion_pytorch_model.safetensors") in msg
    assert "checkpoint has [1, 6, 48], model expects [1, 6, 96]" in msg and "missing parameter" not in msg

    # a config that does not match the weights: every mismatch is reported with both shapes
    with pytest.raises(WanWeightsError, match=r"shape mismatch.*'patch_embedding.weight'.*"
                       r"checkpoint has \[96, 16, 1, 2, 2\], model expects \[128, 16, 1, 2, 2\]"):
        load_pretrained(diffusers_dir, config=dict(CFG.to_dict(), dim=128, num_heads=2))


def test_original_layout_round_trip(model, tmp_path):
    out = tmp_path / "wan"
    f = save_wan_weights(model, out, layout="wan")
    cfg_json = json.loads((out / "config.json").read_text())
    assert cfg_json["_class_name"] == "WanModel" and cfg_json["dim"] == 96 and cfg_json["text_dim"] == 64
    keys = set(load_file(str(f)))
    assert {"blocks.0.self_attn.q.weight", "blocks.0.modulation", "blocks.0.norm3.weight", "head.head.weight",
            "head.modulation", "time_embedding.0.weight", "time_projection.1.weight", "text_embedding.2.bias",
            "patch_embedding.weight", "blocks.1.ffn.2.weight"} <= keys
    loaded = load_pretrained(out)
    assert loaded.config == CFG
    _same_params(loaded, model)


def test_original_released_config_and_prefixed_torch_file(model, tmp_path):
    # config.json as shipped with Wan-AI/Wan2.1-T2V-1.3B (no text_dim / patch_size / cross_attn_norm)
    released = {"_class_name": "WanModel", "_diffusers_version": "0.30.0", "dim": 1536, "eps": 1e-06, "ffn_dim": 8960,
                "freq_dim": 256, "in_dim": 16, "model_type": "t2v", "num_heads": 12, "num_layers": 30, "out_dim": 16,
                "text_len": 512}
    assert config_from_dict(released) == get_wan_config("wan2.1-1.3b")
    with pytest.raises(WanWeightsError, match="model_type='i2v'.*T2V / TI2V DiT only"):
        config_from_dict(dict(released, model_type="i2v"))
    with pytest.raises(WanWeightsError, match="image_dim=1280 .*I2V"):
        config_from_dict({"_class_name": "WanTransformer3DModel", "num_attention_heads": 40, "image_dim": 1280})

    # a single .pt file with ComfyUI's prefix, no config.json
    f = tmp_path / "wan.pt"
    torch.save({f"model.diffusion_model.{k}": v for k, v in model.state_dict().items()}, f)
    with pytest.raises(WanWeightsError, match="no config.json found .* pass config="):
        load_pretrained(f)
    _same_params(load_pretrained(f, config=CFG), model)

    sd = dict(model.state_dict())
    sd["blocks.0.cross_attn.k_img.weight"] = torch.ones(96, 96)
    torch.save(sd, f)
    with pytest.raises(WanWeightsError, match="image-conditioned .*k_img"):
        load_pretrained(f, config=CFG)


def test_key_conversion_agrees_with_diffusers_converter(model):
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    ours = convert_wan_to_diffusers(model.state_dict())
    theirs = convert_wan_transformer_to_diffusers(dict(model.state_dict()))
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert convert_diffusers_to_wan(ours).keys() == model.state_dict().keys()
    with pytest.raises(WanWeightsError, match=r"not part of the diffusers layout.*'foo.bar'"):
        convert_diffusers_to_wan({"foo.bar": torch.ones(1)})


def test_diffusers_layout_save_loads_in_diffusers(model, tmp_path):
    from diffusers import WanTransformer3DModel

    out = tmp_path / "d"
    f = save_wan_weights(model, out, layout="diffusers")
    twin = WanTransformer3DModel.from_config(json.loads((out / "config.json").read_text()))
    twin.load_state_dict(load_file(str(f)), strict=True)
    with torch.no_grad():
        assert torch.equal(twin(*_inputs(), return_dict=False)[0], model(*_inputs()))
    _same_params(load_pretrained(out), model)


def test_bf16_load_keeps_fp32_params_and_load_into_existing_model(model, diffusers_dir):
    from diffusers import WanTransformer3DModel

    m16 = load_pretrained(diffusers_dir, dtype=torch.bfloat16)
    keep = WanTransformer3DModel._keep_in_fp32_modules
    for name, p in m16.named_parameters():
        d_name = convert_wan_to_diffusers({name: p}).popitem()[0]
        kept_by_diffusers = any(k in d_name.split(".") for k in keep)
        assert is_fp32_param(name) == kept_by_diffusers, name
        assert p.dtype == (torch.float32 if kept_by_diffusers else torch.bfloat16), name
    assert not any(p.is_meta for p in m16.parameters())

    target = WanModel(CFG).to_dtype(torch.bfloat16, keep_fp32=False)
    load_wan_weights(target, diffusers_dir)  # copies into existing params, keeps their dtype
    assert all(p.dtype == torch.bfloat16 for p in target.parameters())
    assert torch.equal(target.blocks[1].ffn[0].weight, model.blocks[1].ffn[0].weight.bfloat16())
