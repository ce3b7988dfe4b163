"""Guards `ds-adaptive sample`: text prompts through a tiny random umT5 (or saved embeddings), a model directory plus
a diffusers-format LoRA, a tiny AutoencoderKLWan decoding to mp4; the latent PNG equals the sampler run by hand;
bad arguments are one message (exit 2)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from ds_adaptive.cli import main as cli_main  # noqa: E402
from ds_adaptive.models.testing import random_init_  # noqa: E402
from ds_adaptive.models.wan import WanModel, get_wan_config  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from ds_adaptive.config import LoraConfig
    from ds_adaptive.files import save_safetensors
    from ds_adaptive.lora import LORA_FILE, adapter_pairs, apply_lora, diffusers_lora
    from ds_adaptive.models.weights import save_wan_weights

    sys.path.insert(0, str(ROOT / "tests"))
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

    from ds_adaptive.flow_sampler import euler_sample, initial_noise
    from ds_adaptive.media_out import latent_strip
    from ds_adaptive.preview import load_embeddings
    from ds_adaptive.sample import load_model

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
