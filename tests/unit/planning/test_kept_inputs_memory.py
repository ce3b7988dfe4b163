"""What a whole block keeps beyond its calibrated count when its Linear layers cannot recompute their inputs.

Calibrations measure blocks whose norm and GELU sites recompute their Linear layer's input in the backward
(``models.lean_backward``). Two run settings keep those inputs instead: ZeRO-3 hooks on every submodule
(``zero3_leaf_blocks`` off, and always under LoRA) keep the three norm outputs, and a LoRA wrapper takes its
site's evaluated input. The LoRA fine-tune of the 1.3B default job OOMed at step 2 on an H200 (130.2 GiB at step 1,
139.4 GiB in use at the failed allocation) with a plan that counted neither. The model family counts them
(``Model.kept_input_bytes``) and the planner adds them to every whole block (``Profile.with_kept_inputs``).
"""
from __future__ import annotations

import pytest
import torch

from ds_adaptive.core.config import AdaptiveLoadConfig, LoraConfig, SamplerConfig
from ds_adaptive.core.layout import Layout
from ds_adaptive.core.shapes import SampleShape
from ds_adaptive.models.registry import get_model
from ds_adaptive.planning.profile import load_profile
from ds_adaptive.planning.sampler import build_batch_sampler
from ds_adaptive.training.assemble import kept_inputs_bytes

GIB = float(1 << 30)
ALL = ("self_attn", "cross_attn", "ffn")


class _KernelLikeLnModulate(torch.autograd.Function):
    """The fused LayerNorm-modulate op's forward, keeping what its CUDA kernel keeps for backward (x, shift, scale
    and the fp32 mean / rstd per row), so the saved-tensor count is the GPU path's (the CPU reference path keeps
    fp32 intermediates instead). Only the forward is measured."""

    @staticmethod
    def forward(ctx, x, shift, scale, eps):
        xf = x.float()
        mean = xf.mean(-1, keepdim=True)
        rstd = torch.rsqrt(xf.var(-1, unbiased=False, keepdim=True) + eps)
        ctx.save_for_backward(x, shift, scale, mean.squeeze(-1), rstd.squeeze(-1))
        return ((xf - mean) * rstd * (1 + scale) + shift).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):   # pragma: no cover - the test measures the forward's saved tensors only
        raise NotImplementedError


def _kernel_like(x, shift, scale, eps):
    return _KernelLikeLnModulate.apply(x, shift, scale, eps)


def _saved_bytes_per_token(*, hooked: bool, targets=(), rank: int = 4, dropout: float = 0.0) -> float:
    """Bytes of every storage autograd saves in one tiny bf16 block's forward, per token: the slope between two
    lengths (per-sample tensors such as the text context and the weights cancel)."""
    from ds_adaptive.training.lora import apply_lora   # peft: the LoRA cases only

    model = get_model("tiny")
    cfg = model.config(num_layers=1)
    total = []
    for frames in (2, 4):
        torch.manual_seed(0)
        net = model.build(cfg)
        net.to_dtype(torch.bfloat16)
        object.__setattr__(net.blocks[0], "ln_modulate", _kernel_like)
        if targets:
            apply_lora(net, LoraConfig(enabled=True, rank=rank, targets=list(targets), dropout=dropout), seed=0,
                       spec=model)
        if hooked:   # WanBlock._hooked_children: a ZeRO-3 parameter without leaf blocks
            net.blocks[0].modulation.ds_id = 0
        latents = torch.randn(1, cfg.in_channels, frames, 16, 20).bfloat16()
        inp = net.embed(latents, torch.rand(1) * 1000, torch.randn(1, 16, cfg.text_dim).bfloat16())
        x, tm = inp.tokens.detach().requires_grad_(), inp.time_mod.detach().requires_grad_()
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            net.blocks[0](x, tm, inp.context.detach(), net.rope(inp.grid))
        total.append((frames * 8 * 10, sum(seen.values())))
    (s1, b1), (s2, b2) = total
    return (b2 - b1) / (s2 - s1)


def test_zero3_hooks_keep_exactly_the_three_norm_outputs_the_family_counts():
    model = get_model("tiny")
    cfg = model.config(num_layers=1)
    measured = _saved_bytes_per_token(hooked=True) - _saved_bytes_per_token(hooked=False)
    counted = model.kept_input_bytes(cfg, hooked=True)
    assert counted == 3 * (2 * cfg.dim + 8)
    assert measured == counted
    assert model.kept_input_bytes(cfg, hooked=False) == 0.0


@pytest.mark.parametrize("targets", [ALL, ("self_attn",), ("cross_attn",), ("ffn",)])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_lora_block_keeps_no_more_than_the_family_counts(targets, dropout):
    """Per token, LoRA under ZeRO-3 (hooked submodules, wrapped targets) keeps at most the family's count more
    than a full fine-tune's lean block; the count leaves out what a frozen base saves (inputs kept only for weight
    gradients), so it errs high, never low."""
    pytest.importorskip("peft")
    model = get_model("tiny")
    cfg = model.config(num_layers=1)
    wrapped = model.lora_targets.resolve(targets)
    counted = model.kept_input_bytes(cfg, hooked=True, wrapped=wrapped, adapter_rank=4, adapter_dropout=dropout > 0)
    measured = (_saved_bytes_per_token(hooked=True, targets=targets, dropout=dropout)
                - _saved_bytes_per_token(hooked=False))
    assert measured <= counted
    if "ffn" in targets:   # the wrapped second projection keeps the GELU output: counted
        assert counted >= 2 * cfg.ffn_dim


def test_the_planner_adds_the_count_to_every_whole_block_once():
    base = load_profile("h200-wan2.1-1.3b")
    x = 27_000.0
    kept = base.with_kept_inputs(x)
    assert kept.with_kept_inputs(x) is kept and kept.with_kept_inputs(0.0).block_full_gib == base.block_full_gib
    assert kept.kept_inputs_gib == x / GIB
    shapes = [SampleShape(81, 480, 832), SampleShape(1, 480, 832)]
    cfg = SamplerConfig.model_validate({"profile": base.name, "m_mem": 60.0, "m_comp": "auto"})
    layout = Layout.for_world(1, 1)
    plain, more = (build_batch_sampler(cfg, shapes, layout, micro_steps_per_step=1, model_name="wan2.1-1.3b",
                                       gpu_mem_gib=139.8, checkpointing="auto", kept_inputs_bytes=v)
                   for v in (0.0, x))
    L, s = plain.cost.num_layers, shapes[0].tokens
    for n in (0, 7, L):   # whole blocks: L - n, and the block recomputing when all are checkpointed
        grow = float(more.cost.ckpt_memory(shapes[0], 2, n)) - float(plain.cost.ckpt_memory(shapes[0], 2, n))
        assert grow == pytest.approx(2 * max(L - n, 1) * x * s / GIB, rel=1e-9)


def test_a_run_counts_lora_and_zero3_without_leaf_blocks_and_nothing_for_the_default():
    model = get_model("wan2.1-1.3b")
    cfg = model.config()
    default = AdaptiveLoadConfig()
    assert kept_inputs_bytes(default, model, cfg, 3) == 0.0
    no_leaf = AdaptiveLoadConfig.model_validate({"zero3_leaf_blocks": False})
    assert kept_inputs_bytes(no_leaf, model, cfg, 3) == model.kept_input_bytes(cfg, hooked=True) > 0
    assert kept_inputs_bytes(no_leaf, model, cfg, 2) == 0.0
    lora = AdaptiveLoadConfig.model_validate({"lora": {"enabled": True, "rank": 32}})
    counted = kept_inputs_bytes(lora, model, cfg, 3)
    d, f = cfg.dim, cfg.ffn_dim   # three norm outputs, the GELU output and eight [S, 32] adapter products (not the
    assert counted == 3 * (2 * d + 8) + 2 * f + 8 * 2 * 32   # cross-attention's k / v: they read the text)
