"""Guards the Wan 2.2 family: TI2V-5B and the T2V-A14B experts as registry data (configs, released config.json files,
parameter counts against diffusers, VAE grid, objective options), TI2V numerics through the family's builder against
diffusers with per-token timesteps, each expert's noise range through the trainer's objective, preprocessing with a
tiny random Wan 2.2 VAE (48 channels, 4x16x16) into shards that the TI2V model trains on and a Wan 2.1 model refuses,
and the dry run of the real sizes."""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from conftest import CONFIGS
from ds_adaptive.models.registry import get_model
from ds_adaptive.models.testing import diffusers_twin, random_init_
from ds_adaptive.core.shapes import GridRule, SampleShape

diffusers = pytest.importorskip("diffusers", reason="diffusers is the reference these tests compare with")

# Wan-AI/Wan2.2-TI2V-5B-Diffusers transformer/config.json and Wan-AI/Wan2.2-TI2V-5B config.json (original layout)
TI2V_DIFFUSERS = {"_class_name": "WanTransformer3DModel", "added_kv_proj_dim": None, "attention_head_dim": 128,
                  "cross_attn_norm": True, "eps": 1e-06, "ffn_dim": 14336, "freq_dim": 256, "image_dim": None,
                  "in_channels": 48, "num_attention_heads": 24, "num_layers": 30, "out_channels": 48,
                  "patch_size": [1, 2, 2], "pos_embed_seq_len": None, "qk_norm": "rms_norm_across_heads",
                  "rope_max_seq_len": 1024, "text_dim": 4096}
TI2V_ORIGINAL = {"_class_name": "WanModel", "dim": 3072, "eps": 1e-06, "ffn_dim": 14336, "freq_dim": 256,
                 "in_dim": 48, "model_type": "ti2v", "num_heads": 24, "num_layers": 30, "out_dim": 48, "text_len": 512}


def test_presets_are_the_released_models():
    from ds_adaptive.models.weights import config_from_dict, diffusers_config

    ti2v = get_model("wan2.2-ti2v-5b")
    assert config_from_dict(TI2V_DIFFUSERS) == config_from_dict(TI2V_ORIGINAL) == ti2v.config()
    assert {k: v for k, v in diffusers_config(ti2v.config()).items() if k in TI2V_DIFFUSERS} == \
        {k: v for k, v in TI2V_DIFFUSERS.items() if not k.startswith("_")}
    assert ti2v.grid == GridRule((4, 16, 16), (1, 2, 2), 48) and ti2v.text_len == 512
    assert SampleShape(121, 704, 1280, ti2v.grid).tokens == 27280      # 31 x 22 x 40: 5 s of 704p at 24 fps
    assert ti2v.objective.first_frame_ratio == 0.5 and ti2v.objective.sigma_range == (0.0, 1.0)
    high, low = get_model("wan2.2-t2v-a14b-high"), get_model("wan2.2-t2v-a14b-low")
    assert high.config() == low.config() == get_model("wan2.1-14b").config()
    assert high.grid == low.grid == get_model("wan2.1-14b").grid
    assert (high.subfolder, low.subfolder) == ("transformer", "transformer_2")
    assert high.objective.sigma_range == (0.875, 1.0) and low.objective.sigma_range == (0.0, 0.875)
    assert high.profile_model == low.profile_model == "wan2.1-14b"


@pytest.mark.parametrize("name", ["wan2.2-ti2v-5b", "wan2.2-t2v-a14b-high"])
def test_parameter_counts_match_diffusers(name):
    from diffusers import WanTransformer3DModel

    from ds_adaptive.models.weights import diffusers_config, wan_key_to_diffusers

    m = get_model(name)
    with torch.device("meta"):
        ours, theirs = m.build(), WanTransformer3DModel(**diffusers_config(m.config()))
    assert {wan_key_to_diffusers(n): tuple(p.shape) for n, p in ours.named_parameters()} == \
        {n: tuple(p.shape) for n, p in theirs.named_parameters()}
    assert m.param_counts()["total"] == sum(p.numel() for p in theirs.parameters())
    if name == "wan2.2-ti2v-5b":
        assert 4.9e9 < m.param_counts()["total"] < 5.1e9


def test_ti2v_tiny_model_equals_diffusers_with_per_token_timesteps():
    m = get_model("tiny-ti2v")
    model = random_init_(m.build(), seed=5)
    twin = diffusers_twin(model)
    g = torch.Generator().manual_seed(1)
    lat = torch.randn(2, 48, 3, 4, 6, generator=g)
    t = torch.rand(2, 3 * 2 * 3, generator=g) * 1000
    t[0, :6] = 0.0     # image-to-video: the first latent frame's tokens at t=0
    ctx = torch.randn(2, 9, 4096, generator=g)
    lat.requires_grad_()
    ours = model(lat, t, ctx)
    theirs = twin(lat, t, ctx, return_dict=False)[0]
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() <= 1e-5
    (gl,) = torch.autograd.grad(ours.square().sum(), lat)
    (gr,) = torch.autograd.grad(theirs.square().sum(), lat)
    assert ((gl - gr).abs().max() / gr.abs().max()).item() <= 1e-4


@pytest.mark.parametrize("name,lo,hi", [("tiny-a14b-high", 875.0, 1000.0), ("tiny-a14b-low", 0.0, 875.0)])
def test_each_expert_trains_on_its_noise_range(name, lo, hi):
    """build_run gives the expert's objective; the trainer's objective draws timesteps in [lo, hi) only."""
    from ds_adaptive.core.layout import Layout
    from ds_adaptive.models.objective import flow_matching_losses
    from ds_adaptive.training.assemble import build_run
    from ds_adaptive.training.run_config import RunConfig

    cfg = RunConfig.load(str(CONFIGS / "cpu_tiny.json"), trainer={"model": name, "num_samples": 64})
    run = build_run(cfg, layout=Layout.for_world(1, 1), meta=True)
    seen = []

    class Recorder(torch.nn.Module):
        def forward(self, x_t, timestep, context):
            seen.append(timestep)
            return torch.zeros_like(x_t)

    x0 = torch.randn(64, 16, 1, 2, 2)
    flow_matching_losses(Recorder(), x0, torch.zeros(64, 3, 4096), torch.arange(64), epoch=0, seed=0, shift=5.0,
                         dtype=torch.float32, objective=run.objective)
    t = seen[0]
    assert bool((t >= lo - 1e-3).all()) and bool((t < hi + 1e-3).all())
    assert float(t.max() - t.min()) > 0.3 * (hi - lo)   # spread over the range, not one value
    with pytest.raises(Exception, match="--objective: unknown key"):
        build_run(RunConfig.load(str(CONFIGS / "cpu_tiny.json"), trainer={"model": name, "objective": {"x": 1}}),
                  layout=Layout.for_world(1, 1), meta=True)


def test_preprocess_with_a_tiny_wan22_vae_gives_ti2v_shards(tmp_path):
    """ds-adaptive preprocess --model tiny-ti2v: the 48-channel 4x16x16 VAE (encoded as diffusers' pipeline encodes,
    normalised by its 48 means / stds), shapes on the 32-pixel grid and the model's media defaults; the shards train
    the TI2V model and are refused, with both VAEs named, for a Wan 2.1 model."""
    pytest.importorskip("av")
    pytest.importorskip("ftfy")
    import numpy as np
    from diffusers import AutoencoderKLWan
    from test_preprocess import tiny_models, write_video

    from ds_adaptive.data import DataError, LatentShardDataset
    from ds_adaptive.media.encode import EncoderError, LatentEncoders
    from ds_adaptive.cli.preprocess import main

    weights = tiny_models(tmp_path)   # Wan 2.1 VAE + umT5 + tokenizer
    torch.manual_seed(0)
    AutoencoderKLWan(base_dim=8, z_dim=48, dim_mult=[1, 1, 1, 1], num_res_blocks=1, is_residual=True, in_channels=12,
                     out_channels=12, patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4,
                     latents_mean=[0.02 * i for i in range(48)],
                     latents_std=[1.0 + 0.05 * i for i in range(48)]).save_pretrained(tmp_path / "vae22")
    media = tmp_path / "media"
    media.mkdir()
    write_video(media / "a.mp4", 30, 24, 96, 160, seed=1)    # 1.25 s at 24 fps -> clips of 25 frames
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"path": "media/a.mp4", "caption": "a cat runs"}) + "\n")
    argv = [str(manifest), "--out", str(tmp_path / "out"), "--model", "tiny-ti2v", "--vae", str(tmp_path / "vae22"),
            "--text-encoder", str(weights["--text-encoder"]), "--tokenizer", str(weights["--tokenizer"]),
            "--video-sizes", "64x96", "--workers", "0", "--no-progress"]
    assert main(argv) == 0
    m = get_model("tiny-ti2v")
    ds = LatentShardDataset(tmp_path / "out", spec=m.input_spec)
    index = ds.header
    assert index["latent_channels"] == 48 and index["vae_stride"] == [4, 16, 16] and index["vae"] == "Wan 2.2 VAE"
    assert Counter(str(s) for s in ds.sample_shapes()) == Counter({"25x64x96": 1})   # fps 24, 25 frames: the model's
    sample = ds[0]
    assert sample["latents"].shape == (48, 7, 4, 6) and sample["context"].shape[1] == 4096
    # the same clip through diffusers' pipeline encode path
    from diffusers import WanVideoToVideoPipeline
    from PIL import Image
    from transformers import AutoTokenizer, UMT5EncoderModel

    vae = AutoencoderKLWan.from_pretrained(str(tmp_path / "vae22"))
    te = UMT5EncoderModel.from_pretrained(str(weights["--text-encoder"]))
    tok = AutoTokenizer.from_pretrained(str(weights["--tokenizer"]))

    class CleanLatents:
        def scale_noise(self, sample, timestep, noise):
            return sample

    pipe = WanVideoToVideoPipeline(tokenizer=tok, text_encoder=te, transformer=None, vae=vae, scheduler=CleanLatents())
    frames = np.random.default_rng(0).integers(0, 256, (9, 64, 96, 3), dtype=np.uint8)
    video = pipe.video_processor.preprocess_video([Image.fromarray(f) for f in frames], height=64, width=96)
    with torch.no_grad():
        ref = pipe.prepare_latents(video, 1, 48, 64, 96, torch.float32, torch.device("cpu"), None, None,
                                   torch.tensor([0]))
    got = LatentEncoders(vae, te, tok, spec=m.input_spec).encode_video(torch.from_numpy(frames)[None])
    assert got.shape == ref.shape == (1, 48, 3, 4, 6)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    # the wrong VAE for the model, and the model's shards read for a Wan 2.1 model: one message naming both
    with pytest.raises(EncoderError, match="the VAE has z_dim 48; model tiny: .* needs 16 latent channels"):
        LatentEncoders(vae, te, tok, spec=get_model("tiny").input_spec)
    with pytest.raises(DataError, match=r"written for another model \(Wan 2.2 VAE\): latent_channels 48 \(expected "
                                        r"16\), vae_stride \[4, 16, 16\] \(expected \[4, 8, 8\]\)"):
        LatentShardDataset(tmp_path / "out", spec=get_model("tiny").input_spec)


@pytest.mark.parametrize("model,sp,expect", [
    ("wan2.2-ti2v-5b", 2, ["24 heads / sp 2 = 12 per rank", "longest 121x704x1280 = 27280 tokens",
                           "Wan 2.2 VAE 4x16x16 (48 channels)", "5.000 B parameters"]),
    ("wan2.2-t2v-a14b-low", 4, ["40 heads / sp 4 = 10 per rank", "longest 81x720x1280 = 75600 tokens"]),
])
def test_dry_run_of_the_real_sizes(capsys, model, sp, expect):
    from ds_adaptive.cli.dry_run import main

    code = main(["--deepspeed_config", str(CONFIGS / "zero3_adaptive.json"), "--model", model, "--num-gpus", "8",
                 "--sp", str(sp)])
    out = capsys.readouterr().out
    assert code == 0, out
    for text in expect:
        assert text in out, (text, out)
    assert f"--model {model}" in out
