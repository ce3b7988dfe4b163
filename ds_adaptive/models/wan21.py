"""The Wan 2.1 family: text-to-video DiTs 1.3B and 14B (and ``tiny`` for tests) as data.

The code is shared with every Wan-architecture family: the model is ``models/wan.py``
(diffusers' ``WanTransformer3DModel`` numerics), weights ``models/weights.py``, FLOPs and
parameter counts ``models/flops.py``. Architectures are the released configs
(Wan-AI/Wan2.1-T2V-1.3B / -14B); the VAE is Wan 2.1's causal VAE (stride 4x8x8, 16 channels), the
text encoder umT5-XXL (4096 features, 512 tokens).
"""
from __future__ import annotations

from pathlib import Path

from ds_adaptive.models.family import LoraTargets, MediaDefaults, ModelFamily, Preset
from ds_adaptive.models.flops import wan_param_counts, wan_train_flops
from ds_adaptive.models.wan import WanModel
from ds_adaptive.models.wan_config import WanConfig, get_wan_config
from ds_adaptive.models.weights import WanWeights

_DATA = Path(__file__).resolve().parent.parent / "data"

VAE_STRIDE = (4, 8, 8)
VAE_NAME = "Wan 2.1 VAE"
MEDIA = MediaDefaults(fps=16.0, frame_counts=(17, 33, 49, 81), video_sizes=("480x832", "832x480", "720x1280"),
                      image_sizes=("480x832", "832x480", "1024x1024", "720x1280"))
"""Wan 2.1's training data: 16 fps, 480p and 720p buckets (the shapes of ``data/default_shapes.json``)."""
CALIBRATION_SHAPES = ((1, 480, 832), (1, 1024, 1024), (17, 480, 832), (33, 480, 832), (49, 480, 832),
                      (81, 480, 832), (49, 720, 1280), (81, 720, 1280))
"""Real token grids, short to long: 1,560 ... 75,600 tokens."""
CPU_CALIBRATION_SHAPES = ((1, 128, 128), (1, 256, 256), (9, 256, 256), (17, 256, 256), (33, 256, 256))
"""Small grids of 64-2,304 tokens: a CPU calibration of a tiny model takes seconds."""


LORA_TARGETS = LoraTargets(block_prefix=r"blocks\.\d+\.", groups={
    "self_attn": ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o"),
    "cross_attn": ("cross_attn.q", "cross_attn.k", "cross_attn.v", "cross_attn.o"),
    "ffn": ("ffn.0", "ffn.2"),
})
"""LoRA targets of the Wan DiT (``WanModel`` names): the attention projections (self and cross) and both FFN
linears of every block, DiffSynth-Studio's default (``q,k,v,o,ffn.0,ffn.2``). The embeddings, the time
projection and the head stay dense."""


def make_config(arch, **overrides):
    return get_wan_config(arch, **overrides)


def build_model(config):
    return WanModel(config)


def train_flops(config, tokens: int, batch_size: int, ckpt_blocks: int = 0, kept_attention: bool = False):
    return wan_train_flops(config, tokens, batch_size, ckpt_blocks, kept_attention=kept_attention)


def param_counts(config) -> dict:
    return wan_param_counts(config)


def per_token_modulation_bytes(config) -> tuple[float, float]:
    """Activation bytes per token that ``timestep [B, S]`` adds over ``[B]`` (``WanModel``): every block that is
    not checkpointed keeps its fp32 modulation ``[S, 6, D]`` (``modulation(table, time_mod)``: the shift /
    scale / gate views hold the whole table for backward) -> ``block = 6 D x 4 = 24 D``; once per sample the
    fp32 ``time_mod [S, 6, D]`` the blocks read and its fp32 gradient, accumulated over the blocks in backward
    -> ``outside = 2 x 24 D``. The H200 calibration of TI2V-5B agrees
    (``memory.per_token_timesteps`` of its profile); tests/unit/planning/test_activation_memory.py counts the saved
    tensors with ``saved_tensors_hooks``. The planner's estimate for profiles that did not measure it."""
    d = int(config.dim)
    return 48.0 * d, 24.0 * d


#: the Linear layers (LoRA target paths) whose input a whole block recomputes in its backward instead of keeping it
#: (``models.lean_backward``), by site: the norm output of q / k / v, of the cross-attention's q, of the FFN's
#: first projection, and the GELU output of its second
LEAN_SITES = {"self_attn": ("self_attn.q", "self_attn.k", "self_attn.v"), "cross_attn": ("cross_attn.q",),
              "ffn_in": ("ffn.0",), "ffn_out": ("ffn.2",)}
_NORM_SITES = ("self_attn", "cross_attn", "ffn_in")
_STATS_BYTES = 8   # a norm's fp32 mean and rstd per token, kept with its output
_CONTEXT_INPUTS = ("cross_attn.k", "cross_attn.v")   # read the text context: per sample, not per token


def kept_input_bytes(config, *, hooked: bool, wrapped=(), adapter_rank: int = 0, adapter_dropout: bool = False,
                     elem_bytes: int = 2) -> float:
    """Activation bytes per token that a whole block (``WanBlock``, not checkpointed) keeps beyond the lean
    backward's count (what calibrations measure: every site recomputes its Linear's input) when sites cannot
    recompute. ``hooked``: ZeRO-3 hooks every submodule (``adaptive_load.zero3_leaf_blocks`` off, or LoRA), so
    the three norm sites keep their outputs (``WanBlock._hooked_children``). ``wrapped``: the LoRA-wrapped Linear
    layers (target paths inside a block): a wrapper gets its site's evaluated input (``lean_backward.linear_on``),
    so that site keeps it (a norm output ``D``, the GELU output ``ffn_dim``), and each adapter keeps its
    ``[S, rank]`` product for ``lora_B``; with ``adapter_dropout`` each also keeps its dropped-out input and
    mask (``3 x in_features`` bytes in bf16). Cross-attention k / v read the text context (per sample, not per
    token) and are not counted. ``elem_bytes``: the activation dtype's size. tests/unit/planning/test_kept_inputs_memory.py counts
    the saved tensors."""
    wrapped = set(wrapped)
    d, f = int(config.dim), int(config.ffn_dim)
    width = {"self_attn": d, "cross_attn": d, "ffn_in": d, "ffn_out": f}
    out = 0.0
    for site, linears in LEAN_SITES.items():
        if (hooked and site in _NORM_SITES) or wrapped & set(linears):
            out += width[site] * elem_bytes + (_STATS_BYTES if site in _NORM_SITES else 0)
    for path in wrapped.difference(_CONTEXT_INPUTS):
        out += adapter_rank * elem_bytes
        if adapter_dropout:
            out += (f if path == "ffn.2" else d) * (elem_bytes + 1)
    return out


def weights():
    return WanWeights()


def wan_preset(name: str, arch: dict, **kw) -> Preset:
    """A preset on Wan 2.1's VAE and data defaults (``kw`` overrides any Preset field)."""
    base = dict(vae_stride=VAE_STRIDE, vae=VAE_NAME, shapes=_DATA / "default_shapes.json", media=MEDIA,
                calibration_shapes=CALIBRATION_SHAPES)
    return Preset(name=name, arch=arch, **{**base, **kw})


FAMILY = ModelFamily(
    name="wan2.1",
    description="Wan 2.1 text-to-video DiT (diffusers WanTransformer3DModel)",
    presets=(
        wan_preset("wan2.1-1.3b", dict(dim=1536, ffn_dim=8960, num_heads=12, num_layers=30),
                   description="Wan2.1-T2V-1.3B"),
        wan_preset("wan2.1-14b", dict(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40),
                   description="Wan2.1-T2V-14B"),
        # CPU tests / smoke training: real text width, head_dim 64.
        wan_preset("tiny", dict(dim=128, ffn_dim=256, num_heads=2, num_layers=2),
                   calibration_shapes=CPU_CALIBRATION_SHAPES, description="2-block test model"),
    ),
    make_config=make_config,
    build_model=build_model,
    train_flops=train_flops,
    param_counts=param_counts,
    weights=weights,
    vae_class="AutoencoderKLWan",
    text_encoder_class="UMT5EncoderModel",
    per_token_timesteps=True,   # WanModel takes timestep [B] or [B, S] (diffusers' expand_timesteps)
    transformer_class="WanTransformer3DModel",
    lora_targets=LORA_TARGETS,
    keeps_attention=True,   # WanModel.set_checkpoint_attention
    per_token_modulation_bytes=per_token_modulation_bytes,
    kept_input_bytes=kept_input_bytes,
)

WAN_CONFIGS: dict[str, WanConfig] = {p.name: WanConfig(**p.arch) for p in FAMILY.presets}
"""The Wan 2.1 presets' architectures by name; ``get_wan_config`` also knows every registered Wan-architecture model
(``ds_adaptive.models.registry``)."""
