"""The Wan 2.2 family as data: TI2V-5B and the two experts of T2V-A14B (and tiny twins for tests).

Same architecture and code as Wan 2.1 (``models/wan.py``, diffusers' ``WanTransformer3DModel``):

* **TI2V-5B** (Wan-AI/Wan2.2-TI2V-5B): dim 3072, 24 heads, 30 blocks, FFN 14336, on the Wan 2.2 VAE:
  48 latent channels, compression 4x16x16 (a 32-pixel token side with the 1x2x2 patch), 24 fps,
  704p. It is trained text-to-video and image-to-video at once: for image-to-video the first latent
  frame is the clean image and its tokens get timestep 0 (one timestep per token: diffusers'
  ``expand_timesteps``); ``first_frame_ratio`` 0.5 trains half of the video samples that way (our
  default; the published recipe does not state the share).
* **T2V-A14B**: two 14B experts with the Wan 2.1 14B architecture and VAE, one for high and one for low
  noise, split at ``boundary_ratio`` 0.875 as diffusers' ``WanPipeline`` does (``transformer`` runs the
  timesteps t >= 0.875 * 1000, ``transformer_2`` those below). Each expert is one preset, trained on its
  noise range (``ObjectiveOptions.sigma_range``); train both in turn (two runs) and export both into one
  pipeline directory (``ds-adaptive export --to PIPELINE``: ``transformer`` / ``transformer_2``). Their
  architecture and token grid are Wan 2.1 14B's, so that model's shipped calibrations describe them.
"""
from __future__ import annotations

from pathlib import Path

from ds_adaptive.models.family import MediaDefaults, ModelFamily, ObjectiveOptions
from ds_adaptive.models.wan21 import CPU_CALIBRATION_SHAPES, FAMILY as WAN21, wan_preset

_DATA = Path(__file__).resolve().parent.parent / "data"

BOUNDARY_RATIO = 0.875
"""T2V-A14B's expert switch (diffusers' pipeline ``boundary_ratio``): sigma >= 0.875 is the high-noise expert's."""

TI2V_VAE_STRIDE = (4, 16, 16)
TI2V_MEDIA = MediaDefaults(fps=24.0, frame_counts=(25, 49, 81, 121),
                           video_sizes=("704x1280", "1280x704", "480x832", "832x480"),
                           image_sizes=("704x1280", "1280x704", "1024x1024", "480x832", "832x480"))
"""TI2V-5B's data: 24 fps, 704p (and 480p) buckets, clips of up to 121 frames (5 s)."""
TI2V_CALIBRATION_SHAPES = ((1, 704, 1280), (1, 1024, 1024), (25, 704, 1280), (49, 704, 1280), (121, 480, 832),
                           (81, 704, 1280), (101, 704, 1280), (121, 704, 1280))
"""880 ... 27,280 tokens."""
TI2V_5B = dict(dim=3072, ffn_dim=14336, num_heads=24, num_layers=30, in_channels=48, out_channels=48)
A14B = dict(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40)
TINY = dict(dim=128, ffn_dim=256, num_heads=2, num_layers=2)


def _ti2v(name: str, arch: dict, **kw):
    return wan_preset(name, arch, vae_stride=TI2V_VAE_STRIDE, vae="Wan 2.2 VAE", shapes=_DATA / "shapes_ti2v_5b.json",
                      media=TI2V_MEDIA, objective=ObjectiveOptions(first_frame_ratio=0.5), **kw)


def _experts(prefix: str, arch: dict, **kw):
    """The high-noise (``transformer``) and low-noise (``transformer_2``) experts of a Wan 2.2 A14B pipeline."""
    return (wan_preset(f"{prefix}-high", arch, objective=ObjectiveOptions(sigma_range=(BOUNDARY_RATIO, 1.0)),
                       subfolder="transformer", **kw),
            wan_preset(f"{prefix}-low", arch, objective=ObjectiveOptions(sigma_range=(0.0, BOUNDARY_RATIO)),
                       subfolder="transformer_2", **kw))


FAMILY = ModelFamily(
    name="wan2.2",
    description="Wan 2.2: TI2V-5B (48-channel 4x16x16 VAE, per-token timesteps) and the T2V-A14B experts",
    presets=(
        _ti2v("wan2.2-ti2v-5b", TI2V_5B, calibration_shapes=TI2V_CALIBRATION_SHAPES, description="Wan2.2-TI2V-5B"),
        *_experts("wan2.2-t2v-a14b", A14B, profile_model="wan2.1-14b", description="Wan2.2-T2V-A14B"),
        # CPU tests: TI2V's grid and objective, and the experts' ranges, at the tiny width
        _ti2v("tiny-ti2v", {**TINY, "in_channels": 48, "out_channels": 48}, calibration_shapes=CPU_CALIBRATION_SHAPES,
              description="2-block test model on the Wan 2.2 VAE"),
        *_experts("tiny-a14b", TINY, profile_model="tiny", calibration_shapes=CPU_CALIBRATION_SHAPES,
                  description="2-block test experts"),
    ),
    make_config=WAN21.make_config,
    build_model=WAN21.build_model,
    train_flops=WAN21.train_flops,
    param_counts=WAN21.param_counts,
    weights=WAN21.weights,
    vae_class=WAN21.vae_class,   # diffusers' AutoencoderKLWan holds both VAEs (z_dim 48, is_residual: TI2V's)
    text_encoder_class=WAN21.text_encoder_class,
    per_token_timesteps=True,
    transformer_class=WAN21.transformer_class,
    lora_targets=WAN21.lora_targets,   # the same DiT: TI2V-5B's and the A14B experts' block linears
    keeps_attention=WAN21.keeps_attention,
    per_token_modulation_bytes=WAN21.per_token_modulation_bytes,
    kept_input_bytes=WAN21.kept_input_bytes,
)
