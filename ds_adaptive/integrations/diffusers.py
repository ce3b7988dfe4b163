"""Fused LayerNorm-Modulate for diffusers' ``WanTransformer3DModel`` (shipped as ``ds_adaptive.integrations.diffusers``).

``apply_fused_ln_modulate_to_diffusers_wan(model=None)`` routes the three adaLN sites of diffusers'
Wan 2.1 / 2.2 transformer through ``ds_adaptive.ops.ln_modulate``:

* ``WanTransformerBlock``: ``norm1(h.float()) * (1 + scale_msa) + shift_msa`` and
  ``norm3(h.float()) * (1 + c_scale_msa) + c_shift_msa`` (per-sample ``[B, 1, D]`` views of the
  ``[B, 6, D]`` table, or per-token ``[B, S, D]`` views of ``[B, S, 6, D]`` for Wan 2.2 TI2V);
* ``WanTransformer3DModel``: the output head ``norm_out(h.float()) * (1 + scale) + shift``.

The patched forwards are copies of diffusers 0.42.x with only those expressions replaced (same fp32
math, one rounding to the activation dtype, as the op's reference); other versions are refused with
a message, since a copied forward must match the library it replaces.

Deliberately left alone: ``norm2`` (the affine cross-attention LayerNorm has no modulation),
attention and its RMSNorms, the FFN, the time/text embedders, and the other Wan variants
(``WanVACETransformer3DModel``, ``WanAnimateTransformer3DModel``).
"""
from __future__ import annotations

import importlib
import types
from typing import Any, Optional

import torch

_LN_MODULATE_MODULE = importlib.import_module("ds_adaptive.ops.ln_modulate")  # the module, not the function

SUPPORTED = ((0, 42),)  # diffusers major.minor series whose Wan forwards are copied below
_MARK = "_ds_adaptive_fused_ln_modulate"


def _ln_modulate():
    """The op, looked up at each forward (so a profiler's or a test's wrapper of the module's function takes)."""
    return _LN_MODULATE_MODULE.ln_modulate


def _check_version():
    import diffusers

    parts = diffusers.__version__.split(".")
    try:
        series = (int(parts[0]), int(parts[1]))
    except (ValueError, IndexError):
        series = None
    if series not in SUPPORTED:
        ok = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED)
        raise RuntimeError(f"apply_fused_ln_modulate_to_diffusers_wan supports diffusers {ok}; found "
                           f"{diffusers.__version__}. Its patched forwards copy diffusers' Wan code, so another "
                           "version needs a new copy: pin diffusers or use ds_adaptive.models.wan.WanModel.")


def _classes():
    from diffusers.models.transformers import transformer_wan

    return transformer_wan.WanTransformerBlock, transformer_wan.WanTransformer3DModel


# ------------------------------------------------------------------------------------------------
# Copies of diffusers 0.42.x forwards (models/transformers/transformer_wan.py), norm+modulate fused.
# ------------------------------------------------------------------------------------------------
def _block_forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
                   rotary_emb: torch.Tensor) -> torch.Tensor:
    ln_modulate = _ln_modulate()
    if temb.ndim == 4:
        # temb: batch_size, seq_len, 6, inner_dim (wan2.2 ti2v)
        shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = (
            self.scale_shift_table.unsqueeze(0) + temb.float()
        ).chunk(6, dim=2)
        # batch_size, seq_len, 1, inner_dim
        shift_msa = shift_msa.squeeze(2)
        scale_msa = scale_msa.squeeze(2)
        gate_msa = gate_msa.squeeze(2)
        c_shift_msa = c_shift_msa.squeeze(2)
        c_scale_msa = c_scale_msa.squeeze(2)
        c_gate_msa = c_gate_msa.squeeze(2)
    else:
        # temb: batch_size, 6, inner_dim (wan2.1/wan2.2 14B)
        shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = (
            self.scale_shift_table + temb.float()
        ).chunk(6, dim=1)

    # 1. Self-attention
    norm_hidden_states = ln_modulate(hidden_states, shift_msa, scale_msa, self.norm1.eps, self.norm1.weight,
                                     self.norm1.bias)
    attn_output = self.attn1(norm_hidden_states, None, None, rotary_emb)
    hidden_states = (hidden_states.float() + attn_output * gate_msa).type_as(hidden_states)

    # 2. Cross-attention
    norm_hidden_states = self.norm2(hidden_states.float()).type_as(hidden_states)
    attn_output = self.attn2(norm_hidden_states, encoder_hidden_states, None, None)
    hidden_states = hidden_states + attn_output

    # 3. Feed-forward
    norm_hidden_states = ln_modulate(hidden_states, c_shift_msa, c_scale_msa, self.norm3.eps, self.norm3.weight,
                                     self.norm3.bias)
    ff_output = self.ffn(norm_hidden_states)
    hidden_states = (hidden_states.float() + ff_output.float() * c_gate_msa).type_as(hidden_states)

    return hidden_states


def _model_forward_raw(self, hidden_states: torch.Tensor, timestep: torch.LongTensor,
                       encoder_hidden_states: torch.Tensor, encoder_hidden_states_image: Optional[torch.Tensor] = None,
                       return_dict: bool = True, attention_kwargs: Optional[dict[str, Any]] = None):
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    ln_modulate = _ln_modulate()
    batch_size, num_channels, num_frames, height, width = hidden_states.shape
    p_t, p_h, p_w = self.config.patch_size
    post_patch_num_frames = num_frames // p_t
    post_patch_height = height // p_h
    post_patch_width = width // p_w

    rotary_emb = self.rope(hidden_states)

    hidden_states = self.patch_embedding(hidden_states)
    hidden_states = hidden_states.flatten(2).transpose(1, 2)
    hidden_states = hidden_states.contiguous()

    # timestep shape: batch_size, or batch_size, seq_len (wan 2.2 ti2v)
    if timestep.ndim == 2:
        ts_seq_len = timestep.shape[1]
        timestep = timestep.flatten()  # batch_size * seq_len
    else:
        ts_seq_len = None

    temb, timestep_proj, encoder_hidden_states, encoder_hidden_states_image = self.condition_embedder(
        timestep, encoder_hidden_states, encoder_hidden_states_image, timestep_seq_len=ts_seq_len
    )
    if ts_seq_len is not None:
        # batch_size, seq_len, 6, inner_dim
        timestep_proj = timestep_proj.unflatten(2, (6, -1))
    else:
        # batch_size, 6, inner_dim
        timestep_proj = timestep_proj.unflatten(1, (6, -1))

    if encoder_hidden_states_image is not None:
        encoder_hidden_states = torch.concat([encoder_hidden_states_image, encoder_hidden_states], dim=1)

    # 4. Transformer blocks
    if torch.is_grad_enabled() and self.gradient_checkpointing:
        for block in self.blocks:
            hidden_states = self._gradient_checkpointing_func(
                block, hidden_states, encoder_hidden_states, timestep_proj, rotary_emb
            )
    else:
        for block in self.blocks:
            hidden_states = block(hidden_states, encoder_hidden_states, timestep_proj, rotary_emb)

    # 5. Output norm, projection & unpatchify
    if temb.ndim == 3:
        # batch_size, seq_len, inner_dim (wan 2.2 ti2v)
        shift, scale = (self.scale_shift_table.unsqueeze(0).to(temb.device) + temb.unsqueeze(2)).chunk(2, dim=2)
        shift = shift.squeeze(2)
        scale = scale.squeeze(2)
    else:
        # batch_size, inner_dim
        shift, scale = (self.scale_shift_table.to(temb.device) + temb.unsqueeze(1)).chunk(2, dim=1)

    shift = shift.to(hidden_states.device)
    scale = scale.to(hidden_states.device)

    hidden_states = ln_modulate(hidden_states, shift, scale, self.norm_out.eps, self.norm_out.weight,
                                self.norm_out.bias)
    hidden_states = self.proj_out(hidden_states)

    hidden_states = hidden_states.reshape(
        batch_size, post_patch_num_frames, post_patch_height, post_patch_width, p_t, p_h, p_w, -1
    )
    hidden_states = hidden_states.permute(0, 7, 1, 4, 2, 5, 3, 6)
    output = hidden_states.flatten(6, 7).flatten(4, 5).flatten(2, 3)

    if not return_dict:
        return (output,)

    return Transformer2DModelOutput(sample=output)


def _patched(fn, original):
    """fn marked as our patch, with the original in __wrapped__."""
    fn.__wrapped__ = original
    setattr(fn, _MARK, True)
    return fn


def _model_forward(original):
    from diffusers.utils import apply_lora_scale

    fwd = apply_lora_scale("attention_kwargs")(_model_forward_raw)
    fwd.__doc__ = (original.__doc__ or "") + "\n(ds_adaptive: norm+modulate sites fused.)"
    return _patched(fwd, original)


def _block_forward_for(original):
    def forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb):
        return _block_forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb)

    forward.__doc__ = "WanTransformerBlock.forward with norm1/norm3 + modulation fused (ds_adaptive)."
    return _patched(forward, original)


def apply_fused_ln_modulate_to_diffusers_wan(model: Optional[torch.nn.Module] = None) -> Optional[torch.nn.Module]:
    """Make diffusers' ``WanTransformer3DModel`` use ``ds_adaptive.ops.ln_modulate`` at its
    norm+modulate sites (norm1 and norm3 of every block, norm_out of the head).

    Call it once before the forward passes (before ``torch.compile`` and before wrapping the model
    with DeepSpeed is simplest; it only swaps Python forwards, no parameters or buffers change, so
    checkpoints and ZeRO partitioning are unaffected):

    * ``model=None``: patches the classes ``WanTransformerBlock`` and ``WanTransformer3DModel`` (every
      model in the process, existing or future);
    * ``model=<WanTransformer3DModel>``: patches that model and its blocks only (instance forwards).

    Idempotent (a marker attribute); the original forwards are kept in ``forward.__wrapped__`` and
    ``revert_fused_ln_modulate_diffusers_wan`` restores them. Path selection (fused / torch reference)
    follows ``DS_ADAPTIVE_LN_MODULATE``; on CPU the results equal diffusers' bit for bit. Leaves
    ``norm2`` (no modulation), attention, FFN, embedders and the other Wan variants alone.
    Requires diffusers 0.42.x (RuntimeError otherwise). Returns ``model``.
    """
    _check_version()
    block_cls, model_cls = _classes()
    if model is None:
        if not getattr(block_cls.forward, _MARK, False):
            block_cls.forward = _block_forward_for(block_cls.forward)
        if not getattr(model_cls.forward, _MARK, False):
            model_cls.forward = _model_forward(model_cls.forward)
        return None
    if not isinstance(model, model_cls):
        raise TypeError(f"apply_fused_ln_modulate_to_diffusers_wan expects a {model_cls.__name__}, "
                        f"got {type(model).__name__}")
    for m in model.modules():
        if isinstance(m, block_cls) and not getattr(m, _MARK, False):
            m.forward = types.MethodType(_block_forward_for(type(m).forward), m)
            object.__setattr__(m, _MARK, True)
    if not getattr(model, _MARK, False):
        model.forward = types.MethodType(_model_forward(type(model).forward), model)
        object.__setattr__(model, _MARK, True)
    return model


def revert_fused_ln_modulate_diffusers_wan(model: Optional[torch.nn.Module] = None) -> None:
    """Undo ``apply_fused_ln_modulate_to_diffusers_wan`` (the classes, or one model's instances)."""
    block_cls, model_cls = _classes()
    if model is None:
        for cls in (block_cls, model_cls):
            fwd = cls.__dict__.get("forward")
            if fwd is not None and getattr(fwd, _MARK, False):
                cls.forward = fwd.__wrapped__
        return
    for m in list(model.modules()):
        if getattr(m, _MARK, False):
            m.__dict__.pop("forward", None)
            m.__dict__.pop(_MARK, None)


# Short name used in the docs.
revert = revert_fused_ln_modulate_diffusers_wan


def is_patched(model: Optional[torch.nn.Module] = None) -> bool:
    """Whether the classes (model=None) or this model use the fused forwards."""
    block_cls, model_cls = _classes()
    if model is None:
        return bool(getattr(block_cls.forward, _MARK, False) and getattr(model_cls.forward, _MARK, False))
    return bool(getattr(model.forward, _MARK, False))
