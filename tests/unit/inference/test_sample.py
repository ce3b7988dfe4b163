"""Guards `ds-adaptive sample`: text prompts through a tiny random umT5 (or saved embeddings), a model directory plus
a diffusers-format LoRA, a tiny AutoencoderKLWan decoding to mp4; the latent PNG equals the sampler run by hand;
bad arguments are one message (exit 2)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from ds_adaptive.cli import main as cli_main  # noqa: E402
from ds_adaptive.models.testing import random_init_  # noqa: E402
from ds_adaptive.models.wan import WanModel
from ds_adaptive.models.wan_config import get_wan_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from ds_adaptive.core.config import LoraConfig
    from ds_adaptive.core.files import save_safetensors
    from ds_adaptive.training.lora import LORA_FILE, adapter_pairs, apply_lora, diffusers_lora
    from ds_adaptive.models.weights import save_wan_weights

    from test_preprocess import tiny_models

    tmp = tmp_path_factory.mktemp("sample")
    models = tiny_models(tmp / "enc")
    model = random_init_(WanModel(get_wan_config("tiny")), seed=4)
    save_wan_weights(model, tmp / "model", layout="diffusers")
    info = apply_lora(model, LoraConfig(enabled=True, rank=2, alpha=4, targets=["self_attn"]), seed=0, spec="tiny")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.1)
    tensors, meta = diffusers_lora(adapter_pairs(model.state_dict()), scale=info.scale, spec="tiny")
    (tmp / "lora").mkdir()
    save_safetensors(tensors, tmp / "lora" / LORA_FILE, metadata=meta)
    return tmp, models


def test_sample_text_prompts_lora_and_vae_to_mp4(assets, capsys):
    av = pytest.importorskip("av")
    tmp, m = assets
    args = ["sample", str(tmp / "model"), "--lora", str(tmp / "lora"), "--prompt", "a red fox", "--prompt", "a cat",
            "--negative", "blurry", "--text-encoder", str(m["--text-encoder"]), "--tokenizer", str(m["--tokenizer"]),
            "--frames", "5", "--height", "32", "--width", "48", "--steps", "3", "--guidance", "3", "--device", "cpu"]
    assert cli_main(args + ["--vae", str(m["--vae"]), "--out", str(tmp / "vid"),
                            "--save-embeddings", str(tmp / "p.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "+ LoRA" in out and "3 embeddings: prompt0, prompt1, negative" in out
    for name in ("prompt0", "prompt1"):
        with av.open(str(tmp / "vid" / f"{name}.mp4")) as c:
            frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
        assert len(frames) == 5 and frames[0].shape == (32, 48, 3)

    # the same prompts from the saved embeddings, latent preview: equals the sampler run by hand
    assert cli_main(["sample", str(tmp / "model"), "--lora", str(tmp / "lora"), "--embeddings", str(tmp / "p.safetensors"),
                     "--negative", "negative", "--frames", "5", "--height", "32", "--width", "48", "--steps", "3",
                     "--guidance", "3", "--seed", "7", "--device", "cpu", "--out", str(tmp / "lat")]) == 0
    from PIL import Image

    from ds_adaptive.models.flow_sampler import euler_sample, initial_noise
    from ds_adaptive.media.write import latent_strip
    from ds_adaptive.training.preview import load_embeddings
    from ds_adaptive.inference.sample import load_model

    model, _ = load_model(str(tmp / "model"), lora=str(tmp / "lora"))
    emb = load_embeddings(tmp / "p.safetensors", what="x")
    pad = lambda e: torch.nn.functional.pad(e, (0, 0, 0, 512 - e.shape[0]))[None]  # noqa: E731
    x0 = euler_sample(model, initial_noise((16, 2, 4, 6), 7 + 1), pad(emb["prompt1"]), steps=3, shift=5.0,
                      guidance_scale=3.0, negative=pad(emb["negative"]))
    got = np.asarray(Image.open(tmp / "lat" / "prompt1.png"))
    assert np.array_equal(got, latent_strip(x0[0]))
    plain, _ = load_model(str(tmp / "model"))
    x_plain = euler_sample(plain, initial_noise((16, 2, 4, 6), 8), pad(emb["prompt1"]), steps=3, shift=5.0,
                           guidance_scale=3.0, negative=pad(emb["negative"]))
    assert float((x_plain - x0).abs().max()) > 1e-3   # the LoRA file changed the model


def test_sample_errors_are_one_message(assets, capsys):
    tmp, m = assets
    base = ["sample", str(tmp / "model"), "--device", "cpu", "--steps", "1"]
    cases = [
        (base + ["--prompt", "x", "--out", str(tmp / "e")], "--prompt needs --text-encoder"),
        (base + ["--embeddings", str(tmp / "missing.safetensors"), "--out", str(tmp / "e")], "does not exist"),
        (["sample", str(tmp / "nope"), "--prompt", "x", "--text-encoder", str(m["--text-encoder"]),
          "--tokenizer", str(m["--tokenizer"]), "--out", str(tmp / "e")], "nope does not exist"),
    ]
    for argv, msg in cases:
        assert cli_main(argv) == 2
        assert msg in capsys.readouterr().err


def test_sample_ti2v_uses_its_grid_and_the_48_channel_vae(assets, capsys):
    """A Wan 2.2 TI2V model directory: the model is found from its config.json (48 channels: tiny-ti2v), the noise
    has its 4x16x16 grid, --vae must be its 48-channel VAE (the 16-channel one is one message), decoding undoes the
    VAE's 48 means / stds exactly as diffusers' WanPipeline does before vae.decode, and the fps is the model's."""
    av = pytest.importorskip("av")
    from diffusers import AutoencoderKLWan

    from ds_adaptive.media.write import decode_latents
    from ds_adaptive.models.registry import get_model, model_of_weights
    from ds_adaptive.training.preview import save_embeddings
    from ds_adaptive.inference.sample import load_model

    tmp, m = assets
    spec = get_model("tiny-ti2v")
    spec.weights.save(random_init_(spec.build(), seed=5), tmp / "ti2v", layout="diffusers")
    torch.manual_seed(0)
    AutoencoderKLWan(base_dim=8, z_dim=48, dim_mult=[1, 1, 1, 1], num_res_blocks=1, is_residual=True, in_channels=12,
                     out_channels=12, patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4,
                     latents_mean=[0.02 * i for i in range(48)],
                     latents_std=[1.0 + 0.05 * i for i in range(48)]).save_pretrained(tmp / "vae22")
    assert model_of_weights(tmp / "ti2v") is spec and model_of_weights(tmp / "model") is get_model("tiny")
    save_embeddings({"fox": torch.randn(6, 4096)}, tmp / "e.safetensors")
    common = [str(tmp / "ti2v"), "--embeddings", str(tmp / "e.safetensors"), "--frames", "5", "--height", "32",
              "--width", "64", "--steps", "2", "--device", "cpu"]
    assert cli_main(["sample", *common, "--vae", str(tmp / "vae22"), "--out", str(tmp / "ti2v.mp4")]) == 0
    assert "(tiny-ti2v)" in capsys.readouterr().out
    with av.open(str(tmp / "ti2v.mp4")) as c:
        stream = c.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
        assert float(stream.average_rate) == 24.0
    assert len(frames) == 5 and frames[0].shape == (32, 64, 3)
    assert cli_main(["sample", *common, "--out", str(tmp / "ti2v.png")]) == 0   # 2 latent frames, 16 px each
    from PIL import Image

    assert np.asarray(Image.open(tmp / "ti2v.png")).shape == (32, 2 * 64, 3)

    assert cli_main(["sample", *common, "--vae", str(m["--vae"]), "--out", str(tmp / "x.mp4")]) == 2
    assert "the VAE has z_dim 16; model tiny-ti2v" in capsys.readouterr().err
    assert cli_main(["sample", *common, "--height", "48", "--out", str(tmp / "x.png")]) == 2   # 16-px grid only
    err = capsys.readouterr().err
    assert "(model tiny-ti2v)" in err and "height must be a multiple of 32" in err

    model, _ = load_model(str(tmp / "ti2v"))
    assert model.config.in_channels == 48
    latents = torch.randn(1, 48, 2, 2, 4, generator=torch.Generator().manual_seed(1))
    vae = AutoencoderKLWan.from_pretrained(str(tmp / "vae22")).eval()
    ours = decode_latents(vae, latents)
    # diffusers' WanPipeline.__call__ (0.42): latents / (1 / latents_std) + latents_mean, then vae.decode
    mean = torch.tensor(vae.config.latents_mean).view(1, 48, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, 48, 1, 1, 1)
    with torch.no_grad():
        video = vae.decode(latents / inv_std + mean, return_dict=False)[0]
    ref = ((video.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 4, 1).numpy()
    assert ours.shape == (1, 5, 32, 64, 3) and np.abs(ours.astype(int) - ref.astype(int)).max() <= 1
    with pytest.raises(ValueError, match=r"do not fit the VAE: it decodes \[B, 48"):
        decode_latents(vae, torch.randn(1, 16, 2, 2, 4))
