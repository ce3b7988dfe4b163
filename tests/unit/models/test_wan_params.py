"""Guards the parameter counts of the Wan 2.1 presets (meta device) against diffusers and the published models."""
from __future__ import annotations

import pytest
import torch

from ds_adaptive.models.wan21 import WAN_CONFIGS
from ds_adaptive.models.wan import WanModel, count_parameters
from ds_adaptive.models.weights import diffusers_config, wan_key_to_diffusers

diffusers = pytest.importorskip("diffusers", reason="diffusers' WanTransformer3DModel is the reference for the counts")

# Wan-AI/Wan2.1-T2V-1.3B(-Diffusers) and Wan-AI/Wan2.1-T2V-14B(-Diffusers): the DiT alone
# (the 1.3B bf16 transformer file is 2.84 GB = 1.419e9 x 2 bytes).
PUBLISHED = {"wan2.1-1.3b": 1_418_996_800, "wan2.1-14b": 14_288_491_584}


def _diffusers_meta(cfg):
    from diffusers import WanTransformer3DModel
    with torch.device("meta"):
        return WanTransformer3DModel(**diffusers_config(cfg))


@pytest.mark.parametrize("name", ["wan2.1-1.3b", "wan2.1-14b", "tiny"])
def test_param_count_matches_diffusers(name):
    cfg = WAN_CONFIGS[name]
    with torch.device("meta"):
        ours = WanModel(cfg)
    theirs = _diffusers_meta(cfg)
    shapes = {n: tuple(p.shape) for n, p in ours.named_parameters()}
    ref = {n: tuple(p.shape) for n, p in theirs.named_parameters()}
    assert {wan_key_to_diffusers(n): s for n, s in shapes.items()} == ref  # same tensors, one by one
    n = count_parameters(cfg)
    assert n == sum(p.numel() for p in theirs.parameters())
    if name in PUBLISHED:
        assert n == PUBLISHED[name]


def test_param_count_formula():
    # per block: 8 D^2 + 8 D (q,k,v,o x2) + 4 D (q/k RMSNorm x2) + 2 D (cross LN) + 2 D F + F + D (FFN) + 6 D
    cfg = WAN_CONFIGS["wan2.1-1.3b"]
    d, f = cfg.dim, cfg.ffn_dim
    block = 8 * d * d + 8 * d + 4 * d + 2 * d + 2 * d * f + f + d + 6 * d
    embed = ((16 * 4 * d + d) + (cfg.text_dim * d + d + d * d + d) + (cfg.freq_dim * d + d + d * d + d)
             + (d * 6 * d + 6 * d))
    head = d * 64 + 64 + 2 * d
    assert count_parameters(cfg) == embed + cfg.num_layers * block + head
