"""Per-GPU compute cost and activation memory of samples and micro-batches.

A micro-batch is ``B`` samples of one shape, i.e. one sequence length ``S`` (tokens). On one GPU,
with Ulysses sequence parallelism of degree ``sp`` (each rank of an SP group holds ``S/sp`` tokens
and ``heads/sp`` attention heads), the cost model predicts:

``calibrated`` (milliseconds, from a profile json written by ``ds-adaptive calibrate``)::

    S_pad           = S rounded up to a multiple of sp
    per_gpu_cost(S) = (a * S_pad + b * S_pad**2) / sp  +  comm(S_pad)          per sample
    comm(S_pad)     = layers * bytes_per_token_per_layer * (S_pad / sp) * (sp - 1) / sp / link_bandwidth
    batch_cost      = c0 + B * per_gpu_cost(S)                                 per micro-batch

    ``c0`` is the per-micro-batch overhead (kernel launches, embed/head), paid once per micro-batch;
    every rank runs exactly one micro-batch per micro-step, so ``c0`` never unbalances a micro-step.

Sparse attention (``sparse=SparseAttentionCost``, calibrated mode only; ``ds_adaptive.planning.sparse_cost``)::

    per_gpu_cost(S) = (a * S_pad + b * S_pad**2 * q(S_pad)) / sp  +  sel(S_pad)  +  comm(S_pad)
    q = 1 - attention_share * (1 - rho_eff(S)),  rho_eff from the busiest SP rank's head densities,
    sel = selection (scoring, top-k) of this rank's heads/sp heads in the layers that run sparse, per sample
    batch_cost = c0 + sel_call(S_pad) + B * per_gpu_cost(S)     sel_call: the selection's fixed part per call
    recomputed forwards (ckpt_cost): a sparse layer's recompute runs sparse too (its quadratic part x g)

    With every density 1 (every layer dense) ``q == 1`` and ``sel == 0``: exactly the dense model.

``power`` (the paper's ``S^p``, unit "S^p"): ``per_gpu_cost = S_pad**p / sp``, ``c0 = 0``, no comm.

``tokens`` (linear, unit "tokens"): ``per_gpu_cost = S_pad / sp``, ``c0 = 0``, no comm.

Memory (GiB, all modes, from the profile)::

    per_gpu_memory(S) = m0 + (m1 + v * m1_pt) * S_pad / sp                     per sample
    batch_memory      = B * per_gpu_memory(S)

    ``v`` is 1 for a video micro-batch of a run that trains with one timestep per token (first-frame
    conditioning: every video micro-batch may hold a conditioned sample), else 0; ``m1_pt`` is what the
    per-token modulation adds (``memory.per_token_timesteps``, :meth:`Profile.with_per_token_timesteps`).

Static memory (parameters, gradients, optimizer state under ZeRO) is separate: see
:meth:`Profile.static_memory_gib`. Profiles are looked up by shipped name (``h100-wan2.1-1.3b``,
``h100-wan2.1-14b``) or by path (:func:`load_profile`).

A profile describes the model at its full depth (``model.num_layers``: 30 blocks for Wan 1.3B, 40 for
14B); :meth:`Profile.with_num_layers` rescales it to a model with fewer (or more) blocks, as trained
with ``--layers N``.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping, Optional, Union

import numpy as np

from ds_adaptive.core.layout import Layout
from ds_adaptive.models.recompute import CHECKPOINT_ATTENTION_MODES, kept_attention_bytes_per_token
from ds_adaptive.core.shapes import SampleShape, pad_to_multiple

if TYPE_CHECKING:  # pragma: no cover
    from ds_adaptive.planning.sparse_cost import SparseAttentionCost

PROFILE_FORMAT = "ds_adaptive.profile/1"
#: LayerNorm-modulate paths a profile can be calibrated with (``ln_modulate`` in the json; absent = reference)
LN_MODULATE_PATHS = ("fused", "reference")
#: block-fusion modes a profile can be calibrated with (``block_fusion`` in the json; absent = off), the values of
#: ``adaptive_load.block_fusion`` (``ds_adaptive.models.fusion.BLOCK_FUSION_MODES``)
BLOCK_FUSION_MODES = ("off", "rope", "regions")
PROFILES_DIR = Path(__file__).parent / "profiles"
#: the blocks a profile's variant (``ln_modulate_variants``, ``block_fusion_variants``) replaces
_VARIANT_BLOCKS = ("compute", "memory", "train_overheads")
GIB = float(1 << 30)

CostMode = Literal["calibrated", "power", "tokens"]
COST_UNITS = {"calibrated": "ms", "power": "S^p", "tokens": "tokens"}

# Depth-independent embed/head part of a calibrated profile's time (see Profile.with_num_layers):
# patch/text/time embeddings and the head cost ~2 ms per micro-batch (launches, fwd+bwd) plus
# 12 * dim * 64 FLOP per token at 400 TFLOP/s. Estimates, not fitted: changing them changes every
# depth-rescaled plan (bench/training/e2e.py's GPU results were planned with these values).
EMBED_HEAD_MS = 2.0
EMBED_HEAD_FLOP_PER_TOKEN_PER_DIM = 12 * 64
EMBED_HEAD_FLOPS = 400e12


# Memory-aware activation checkpointing (ds_adaptive/planning/memory.py). Profiles written before
# `calibrate` measured both memories carry no per-block numbers; they get these estimates (documented
# in docs/MEMORY.md): a checkpointed block keeps its bf16 input (dim x 2 bytes per token); a whole block
# holds what the all-checkpointed fit's per-token memory leaves after the L checkpointed inputs and
# 6 x dim x 2 bytes of embed/head (the working set of the one block recomputed in backward), plus the
# cross-attention's k/v over the 512 text tokens per sample; the recomputed forward of one block is
# 0.3 / 1.3 of its checkpointed fwd+bwd (from an H200 calibration: checkpointing every block costs 1.3x of
# fwd+bwd).
RECOMPUTE_SHARE_ESTIMATE = 0.3 / 1.3
CHECKPOINT_POLICIES = ("auto", "all", "none")
# m_mem auto: without a measured fragmentation margin, capacity x this fraction; with one, capacity minus
# the margin minus AUTO_HEADROOM x capacity (room for the memory model's error).
DEFAULT_MEM_UTILIZATION = 0.85
AUTO_HEADROOM = 0.03
# Training-loop time outside the calibrated fwd+bwd (ms), used by the throughput-optimal compute budget
# (ds_adaptive/planning/budget.py). Per micro-step: ZeRO-3 parameter fetch / gradient reduce hooks, the
# host-to-device copy and the synchronised start and end of the micro-step; per optimizer step: the
# optimizer (ZeRO-3 AdamW on the fp32 partition, gradient norm, clipping, bf16 copy-back). Estimates per
# billion parameters for profiles without a measured ``train_overheads`` block (documented in
# docs/MEMORY.md): the trainer's time outside its compute windows in h200-wan2.1-1.3b's measured
# ``train_overheads`` (one H200, ZeRO-3; 35.4 ms per micro-step, 66.4 ms per optimizer step) divided by its 1.42B
# parameters.
MICRO_STEP_OVERHEAD_MS_PER_BPARAM = 24.9
OPTIMIZER_STEP_OVERHEAD_MS_PER_BPARAM = 46.8


class ProfileError(ValueError):
    """A profile name that is not shipped, or a profile json that is malformed."""


class ProfileDepthError(ProfileError):
    """A profile that cannot be rescaled to another depth (no ``model.block_params``)."""


def shipped_profiles() -> list[str]:
    """Names of the profiles shipped in ``ds_adaptive/planning/profiles`` (without ``.json``)."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def _need(d: Mapping, key: str, where: str) -> Any:
    if key not in d:
        raise ProfileError(f"profile {where}: missing key '{key}'; profiles are written by "
                           "`ds-adaptive calibrate` (see docs/SAMPLER.md for the format)")
    return d[key]


def _num(d: Mapping, key: str, where: str, *, minimum: float = 0.0) -> float:
    v = _need(d, key, where)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < minimum:
        raise ProfileError(f"profile {where}: '{key}' must be a finite number >= {minimum}, got {v!r}")
    return float(v)


def _pair(d: Mapping, where: str) -> tuple:
    return (_num(d, "m0_gib", where), _num(d, "m1_gib_per_token", where))


def _overhead_fields(d: Mapping[str, Any], where: str, params: int) -> dict:
    """``train_overheads`` of a profile json (``micro_step_ms``, ``optimizer_step_ms``, ``source``), or the
    per-parameter estimates (``MICRO_STEP_OVERHEAD_MS_PER_BPARAM``, ``OPTIMIZER_STEP_OVERHEAD_MS_PER_BPARAM``)."""
    ov = d.get("train_overheads")
    if ov is None:
        return {"micro_step_overhead_ms": MICRO_STEP_OVERHEAD_MS_PER_BPARAM * params / 1e9,
                "optimizer_step_overhead_ms": OPTIMIZER_STEP_OVERHEAD_MS_PER_BPARAM * params / 1e9,
                "overhead_source": "estimated"}
    w = where + " train_overheads"
    return {"micro_step_overhead_ms": _num(ov, "micro_step_ms", w),
            "optimizer_step_overhead_ms": _num(ov, "optimizer_step_ms", w),
            "overhead_source": str(ov.get("source", "measured"))}


def _checkpoint_fields(d: Mapping[str, Any], where: str) -> dict:
    """The per-block memory / recompute numbers of a profile json (``memory.checkpointing``,
    ``compute.recompute``, ``memory.fragmentation_margin_gib``), or estimates when it has none."""
    mem, comp, model = d["memory"], d["compute"], d["model"]
    gc = bool(d.get("gradient_checkpointing", True))
    L = int(model["num_layers"])
    dim = int(model["dim"])
    margin = mem.get("fragmentation_margin_gib")
    if margin is not None:
        margin = _num(mem, "fragmentation_margin_gib", where + " memory")
    ck = mem.get("checkpointing")
    rc = comp.get("recompute")
    if ck is not None and rc is not None:
        return {"gradient_checkpointing": gc,
                "block_full_gib": _pair(_need(ck, "block_full", where), where + " memory.checkpointing.block_full"),
                "block_ckpt_gib": _pair(_need(ck, "block_checkpointed", where),
                                        where + " memory.checkpointing.block_checkpointed"),
                "last_whole_gib": (_pair(ck["last_block_whole"], where + " memory.checkpointing.last_block_whole")
                                   if "last_block_whole" in ck else (0.0, 0.0)),
                "recompute_ms": tuple(_num(rc, k, where + " compute.recompute")
                                      for k in ("c0_ms", "a_ms_per_token", "b_ms_per_token2")),
                "checkpoint_source": str(ck.get("source", "measured")),
                "fragmentation_margin_gib": margin}
    # Estimates (see RECOMPUTE_SHARE_ESTIMATE): only for profiles measured with every block checkpointed.
    m1 = float(mem["m1_gib_per_token"])
    c_tok = 2 * dim / GIB
    ctx = 4 * 512 * dim * 2 / GIB                # cross-attn k, v (+ their pre-norm / normed copies), bf16
    g_tok = max(m1 - (L + 6) * c_tok, c_tok) if gc else max(m1 / max(L, 1), c_tok)
    share = RECOMPUTE_SHARE_ESTIMATE if gc else RECOMPUTE_SHARE_ESTIMATE / (1 - RECOMPUTE_SHARE_ESTIMATE)
    c0 = float(comp["c0_ms"])
    e_tok = EMBED_HEAD_FLOP_PER_TOKEN_PER_DIM * dim / EMBED_HEAD_FLOPS * 1e3
    per_block = (max(c0 - EMBED_HEAD_MS, 0.0) / L, max(float(comp["a_ms_per_token"]) - e_tok, 0.0) / L,
                 float(comp["b_ms_per_token2"]) / L)
    return {"gradient_checkpointing": gc, "block_full_gib": (ctx, g_tok), "block_ckpt_gib": (0.0, c_tok),
            "recompute_ms": tuple(share * v for v in per_block), "checkpoint_source": "estimated",
            "fragmentation_margin_gib": margin}


def _per_token_fields(mem: Mapping[str, Any], where: str) -> dict:
    """``memory.per_token_timesteps`` of a profile json: what one timestep per token adds (GiB per token to the
    fit's ``m1`` and to a whole block), whether it applies to the run (default: yes, the profile was measured
    with the model's own objective), and its source."""
    pt = mem.get("per_token_timesteps")
    if not pt:
        return {}
    w = where + " memory.per_token_timesteps"
    return {"per_token_gib": (_num(pt, "m1_gib_per_token", w), _num(pt, "block_full_m1_gib_per_token", w)),
            "per_token_applies": bool(pt.get("applies", True)), "per_token_source": str(pt.get("source", "measured"))}


@dataclass(frozen=True)
class Profile:
    """Coefficients of one (device, model, sp) calibration; see the module docstring for units.

    ``a_ms_per_token`` / ``b_ms_per_token2`` are per-GPU times measured at Ulysses degree
    ``sp`` as a function of the full (padded) sequence length; :class:`CostModel` rescales them
    to another sp (compute divides by sp).
    """

    name: str
    device: str
    gpu_mem_gib: float
    num_layers: int
    num_heads: int
    dim: int
    params: int
    sp: int
    c0_ms: float
    a_ms_per_token: float
    b_ms_per_token2: float
    m0_gib: float
    m1_gib_per_token: float
    comm_bytes_per_token_per_layer: float
    link_gbps: float
    bytes_per_param: Mapping[str, float]
    stage3_live_params: int
    workspace_gib: float
    #: the calibration ran with every block checkpointed (the c0/a/b and m0/m1 fits include the recompute)
    gradient_checkpointing: bool = True
    #: activation memory one block holds for backward when NOT checkpointed: (GiB per sample, GiB per token)
    block_full_gib: tuple = (0.0, 0.0)
    #: what a checkpointed block keeps (its input): (GiB per sample, GiB per token)
    block_ckpt_gib: tuple = (0.0, 0.0)
    #: extra activation memory when the LAST block is not checkpointed (n < L): (GiB per sample, GiB per token).
    #: Backward then starts (head, loss) on top of a whole last block instead of L inputs; calibrate measures
    #: it as E(none) - E(all) (``memory.checkpointing.last_block_whole``); 0 in profiles without it
    last_whole_gib: tuple = (0.0, 0.0)
    #: recomputed forward of ONE block: (ms per micro-batch, ms per token, ms per token^2), at the profile's sp
    recompute_ms: tuple = (0.0, 0.0, 0.0)
    #: "measured" (calibrate ran with and without checkpointing) or "estimated" (see RECOMPUTE_SHARE_ESTIMATE)
    checkpoint_source: str = "estimated"
    #: reserved minus allocated peak over calibrate's shape sweep (GiB); None when not measured
    fragmentation_margin_gib: Optional[float] = None
    #: what one timestep per token adds, GiB per token: (the profile's own fit ``m1``, one whole block ``g``);
    #: json ``memory.per_token_timesteps`` (``m1_gib_per_token``, ``block_full_m1_gib_per_token``)
    per_token_gib: tuple = (0.0, 0.0)
    #: whether this run's video micro-batches take per-token timesteps (``memory.per_token_timesteps.applies``)
    per_token_applies: bool = False
    #: "measured" (calibrate fitted it), "estimated" (the model family's count) or "none"
    per_token_source: str = "none"
    #: training-loop time per micro-step beyond the calibrated batch cost (ms): ZeRO-3 hooks, copies, syncs
    micro_step_overhead_ms: float = 0.0
    #: time of one optimizer step (ms): ZeRO-3 optimizer, gradient norm, clipping
    optimizer_step_overhead_ms: float = 0.0
    #: "measured" (a ``train_overheads`` block in the json) or "estimated" (per-parameter constants)
    overhead_source: str = "estimated"
    #: LayerNorm-modulate path the calibration ran ("fused" op or torch "reference"; profiles without the key:
    #: "reference"); its activation memory per token differs (:meth:`for_ln_modulate`)
    ln_modulate: str = "reference"
    #: ``adaptive_load.block_fusion`` mode the calibration ran (profiles without the key: "off"); fused blocks
    #: hold less activation memory and run faster (:meth:`for_block_fusion`)
    block_fusion: str = "off"
    #: LoRA: parameters added to the (frozen) model by adapters, the only ones with gradients and optimizer
    #: state (json ``static_memory.adapter_params``; None: every parameter is trained). :meth:`with_adapter_params`
    adapter_params: Optional[int] = None
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    #: depth of the profile this one was rescaled from by :meth:`with_num_layers` (None: as loaded)
    rescaled_from_layers: Optional[int] = field(default=None, compare=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str = "<dict>") -> "Profile":
        if d.get("format") != PROFILE_FORMAT:
            raise ProfileError(f"profile {where}: 'format' must be '{PROFILE_FORMAT}', got "
                               f"{d.get('format')!r}; re-create it with `ds-adaptive calibrate`")
        model = _need(d, "model", where)
        comp = _need(d, "compute", where)
        mem = _need(d, "memory", where)
        comm = _need(d, "comm", where)
        static = _need(d, "static_memory", where)
        sp = int(_num(d, "sp", where, minimum=1))
        heads = int(_num(model, "num_heads", where + " model", minimum=1))
        fields = dict(
            name=str(d.get("name", Path(where).stem)),
            device=str(_need(d, "device", where)),
            gpu_mem_gib=_num(d, "gpu_mem_gib", where, minimum=1e-3),
            num_layers=int(_num(model, "num_layers", where + " model", minimum=1)),
            num_heads=heads,
            dim=int(_num(model, "dim", where + " model", minimum=1)),
            params=int(_num(model, "params", where + " model", minimum=1)),
            sp=sp,
            c0_ms=_num(comp, "c0_ms", where + " compute"),
            a_ms_per_token=_num(comp, "a_ms_per_token", where + " compute"),
            b_ms_per_token2=_num(comp, "b_ms_per_token2", where + " compute"),
            m0_gib=_num(mem, "m0_gib", where + " memory"),
            m1_gib_per_token=_num(mem, "m1_gib_per_token", where + " memory", minimum=1e-15),
            comm_bytes_per_token_per_layer=_num(comm, "bytes_per_token_per_layer", where + " comm"),
            link_gbps=_num(comm, "link_GBps", where + " comm", minimum=1e-6),
            bytes_per_param={k: float(v) for k, v in _need(static, "bytes_per_param", where).items()},
            stage3_live_params=int(_num(static, "stage3_live_params", where + " static_memory")),
            workspace_gib=_num(static, "workspace_gib", where + " static_memory"),
        )
        ln = d.get("ln_modulate", "reference")
        if ln not in LN_MODULATE_PATHS:
            raise ProfileError(f"profile {where}: 'ln_modulate' must be one of {list(LN_MODULATE_PATHS)}, got {ln!r}")
        fusion = d.get("block_fusion", "off")
        if fusion not in BLOCK_FUSION_MODES:
            raise ProfileError(f"profile {where}: 'block_fusion' must be one of {list(BLOCK_FUSION_MODES)}, got "
                               f"{fusion!r}")
        adapters = static.get("adapter_params")
        if adapters is not None:
            adapters = int(_num(static, "adapter_params", where + " static_memory"))
        return cls(**fields, **_checkpoint_fields(d, where), **_overhead_fields(d, where, fields["params"]),
                   **_per_token_fields(mem, where), ln_modulate=ln, block_fusion=fusion, adapter_params=adapters,
                   raw=dict(d))

    def with_per_token_timesteps(self, applies: bool, estimate_bytes: Optional[tuple] = None) -> "Profile":
        """This calibration for a run whose video micro-batches do (``applies``) or do not take one timestep per
        token (first-frame conditioning). With ``applies`` and no measured term (``memory.per_token_timesteps``,
        fitted by ``ds-adaptive calibrate`` on a model trained that way), ``estimate_bytes`` = the model
        family's ``(outside, block)`` bytes per token (``Model.per_token_modulation_bytes``) is recorded with
        ``source: estimated``. The choice is stored in the json (``applies``), so a sampler state re-plans
        with it. Returns ``self`` when nothing changes."""
        applies = bool(applies)
        have = self.per_token_source != "none"
        if applies == self.per_token_applies and (have or not applies):
            return self
        d = copy.deepcopy(dict(self.raw))
        entry = dict(d["memory"].get("per_token_timesteps") or {})
        if applies and not have:
            if estimate_bytes is None:
                return self
            outside, block = (float(v) / GIB for v in estimate_bytes)
            L = self.num_layers
            own = outside + (block if self.gradient_checkpointing else L * block)
            entry = {"m1_gib_per_token": own, "block_full_m1_gib_per_token": block, "source": "estimated",
                     "note": "the model family's count (ModelFamily.per_token_modulation_bytes): "
                             "re-calibrate for a measured one"}
        entry["applies"] = applies
        d["memory"]["per_token_timesteps"] = entry
        return dataclasses.replace(Profile.from_dict(d, where=f"{self.name} per_token_timesteps"),
                                   rescaled_from_layers=self.rescaled_from_layers)

    def per_token_extra(self, shape_or_tokens: Union[SampleShape, int]) -> tuple:
        """``(m1, g)`` GiB per token that ``shape_or_tokens`` adds for per-token timesteps: the profile's
        :attr:`per_token_gib` for a video (or a bare token count: any sample may be one) when they apply, else 0."""
        if not self.per_token_applies or (isinstance(shape_or_tokens, SampleShape) and shape_or_tokens.is_image):
            return (0.0, 0.0)
        return self.per_token_gib

    def for_ln_modulate(self, path: Optional[str]) -> "tuple[Profile, Optional[str]]":
        """This calibration for a run whose LayerNorm-modulate sites run ``path`` (``fused`` | ``reference``;
        None: unknown, no check). Returns ``(profile, message)``: ``self`` when the paths match; the json's
        ``ln_modulate_variants[path]`` (its own ``compute`` and ``memory`` blocks, measured with that path by
        ``ds-adaptive calibrate --ln-modulate PATH``) in place of the top-level ones when it has one, with a
        note; else ``self`` with a warning naming both paths and the calibrate command (the fused op holds
        less activation memory per token than the reference)."""
        if path is None or path == self.ln_modulate:
            return self, None
        if path not in LN_MODULATE_PATHS:
            raise ValueError(f"ln_modulate must be one of {list(LN_MODULATE_PATHS)} or None, got {path!r}")
        variant = (self.raw.get("ln_modulate_variants") or {}).get(path)
        if variant is not None:
            d = {**copy.deepcopy(dict(self.raw)), **copy.deepcopy(dict(variant)), "ln_modulate": path}
            d.pop("ln_modulate_variants", None)
            out = Profile.from_dict(d, where=f"{self.name} ln_modulate_variants.{path}")
            return out, (f"profile '{self.name}': using its '{path}' LayerNorm-modulate entries "
                         f"(ln_modulate_variants.{path}: {', '.join(sorted(variant))}) for this run's {path} path")
        model = self.raw.get("model", {}).get("name", "MODEL")
        return self, (f"warning: profile '{self.name}' was calibrated with the {self.ln_modulate} LayerNorm-modulate "
                      f"path, this run uses the {path} path: predicted activation memory will be off (the fused "
                      f"op holds less per token); re-calibrate with `ds-adaptive calibrate --model {model} "
                      f"--ln-modulate {path} --out PROFILE.json` and pass sampler.profile=PROFILE.json")

    def for_block_fusion(self, mode: Optional[str], ln_path: Optional[str] = None) -> "tuple[Profile, Optional[str]]":
        """This calibration for a run with ``adaptive_load.block_fusion`` ``mode`` (None: unknown, no check).
        Returns ``(profile, message)``: ``self`` when the modes match; the json's ``block_fusion_variants[mode]``
        (``memory``, and ``compute`` with the ``train_overheads`` fitted on it where the variant has both, measured
        with that mode and this profile's LayerNorm-modulate path, by ``ds-adaptive calibrate --block-fusion MODE``,
        added by ``python -m ds_adaptive.calibration.autocalibrate ship``) in place of the top-level ones when it has
        one, with a note (a variant's compute without its own overheads is not used: the profile's overheads were
        fitted on the profile's compute);
        else ``self`` with a note (fused blocks hold less: the plan is conservative), or a warning when the
        profile was calibrated fused and the run is not (predicted activation memory is then too low). ``ln_path``:
        the run's LayerNorm-modulate path, for the calibrate command the message gives (default: the profile's)."""
        if mode is None or mode == self.block_fusion:
            return self, None
        if mode not in BLOCK_FUSION_MODES:
            raise ValueError(f"block_fusion must be one of {list(BLOCK_FUSION_MODES)} or None, got {mode!r}")
        variant = (self.raw.get("block_fusion_variants") or {}).get(mode)
        if variant is not None and variant.get("ln_modulate", "reference") == self.ln_modulate:
            # compute terms and the trainer's overheads are fitted together: a variant's compute replaces the
            # profile's only with overheads fitted on it (a model-level calibration's compute with the profile's
            # overheads over-predicted the H200 default job; docs/MEMORY.md)
            used = [k for k in _VARIANT_BLOCKS if k in variant and (k != "compute" or "train_overheads" in variant)]
            d = copy.deepcopy(dict(self.raw))
            d.update({k: copy.deepcopy(variant[k]) for k in used})
            d["block_fusion"] = mode
            d.pop("block_fusion_variants", None)
            out = Profile.from_dict(d, where=f"{self.name} block_fusion_variants.{mode}")
            kept = ("; compute: the profile's own (the variant's compute terms come without train_overheads fitted "
                    "on them)" if "compute" in variant and "compute" not in used else "")
            return out, (f"profile '{self.name}': using its block fusion '{mode}' entries (block_fusion_variants."
                         f"{mode}: {', '.join(sorted(used))}){kept}")
        model = self.raw.get("model", {}).get("name", "MODEL")
        how = (f"`ds-adaptive calibrate --model {model} --ln-modulate {ln_path or self.ln_modulate} --block-fusion "
               f"{mode} --out CAL.json`, then `python -m ds_adaptive.calibration.autocalibrate ship CAL.json PROFILE.json`")
        if mode == "off":
            return self, (f"warning: profile '{self.name}' was calibrated with block fusion '{self.block_fusion}', "
                          f"this run has it off: predicted activation memory is too low (fused blocks hold less); "
                          f"calibrate without it ({how.replace(' --block-fusion off', '')})")
        return self, (f"note: profile '{self.name}' was calibrated with block fusion '{self.block_fusion}', this run "
                      f"uses '{mode}': its plans are conservative (fused blocks hold less activation memory and run "
                      f"faster); for a profile of this path: {how}")

    def with_num_layers(self, num_layers: int) -> "Profile":
        """The same calibration for the model with ``num_layers`` transformer blocks instead of
        ``self.num_layers`` (e.g. a run with ``--layers 4`` of the 30-block Wan 1.3B profile).

        Calibrated time is ``blocks x block(S) + embed/head`` and activation memory per token is
        ``one block's recomputed working set + blocks x dim x 2 bytes (checkpointed bf16 block inputs)
        + embed/head`` (``ds-adaptive calibrate`` differences two depths; its measurements give
        exactly 2.0 bytes per token per dim per block). With ``f = num_layers / self.num_layers``:

        - ``c0_ms``: ``f x (c0 - EMBED_HEAD_MS) + EMBED_HEAD_MS`` (2 ms per micro-batch of
          embed/head launches is depth-independent; the rest of the intercept is the blocks').
        - ``a_ms_per_token``: ``f x (a - e) + e`` with ``e = 12 x dim x 64 FLOP / 400 TFLOP/s``, the
          embed/head per-token time (depth-independent).
        - ``b_ms_per_token2``: ``f x b`` (all of the S^2 term is attention, in the blocks).
        - ``m1_gib_per_token``: minus ``dim x 2`` bytes per removed block; ``m0_gib`` unchanged
          (per-sample, not per-block).
        - Ulysses comm: unchanged per layer (``comm.bytes_per_token_per_layer``); :class:`CostModel`
          multiplies it by ``num_layers``, so the total scales with depth.
        - Static memory: ``params`` minus ``model.block_params`` per removed block (embeddings and
          head kept), ``stage3_live_params`` capped at the new ``params``; ``bytes_per_param``,
          ``workspace_gib``, ``gpu_mem_gib``, ``sp``, heads and dim unchanged. A budget of
          ``m_mem: auto`` resolved with the result is the reduced model's own (its smaller static
          memory): a reduced model gets larger micro-batches than the full-depth one.
        - ``train_overheads`` (measured): x the params ratio (per-parameter hooks and optimizer work);
          without one, the per-parameter estimates apply to the new ``params`` anyway.
        - The calibration's fit points and raw measurements (full-depth) are dropped.

        ``EMBED_HEAD_MS`` and the per-token FLOP are estimates, not fitted. Against the shipped
        calibrations' own reduced-depth measurements (``measurements.raw``: 1.3B at 2 and 4 blocks,
        14B at 1 and 2), the rescaled profiles predict time and activation memory at the points the
        full-depth fit uses (B x S >= 8192 tokens) as well as the full-depth fit itself; latency-bound micro-batches (one short sample) are underpredicted there as at
        full depth. Returns ``self`` when the depth is unchanged; the result's
        ``rescaled_from_layers`` is the original depth. Needs ``model.block_params`` in the profile
        json (written by ``ds-adaptive calibrate``).
        """
        L0 = self.num_layers
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be an int >= 1, got {num_layers!r}")
        if num_layers == L0:
            return self
        raw = self.raw
        if "block_params" not in raw.get("model", {}):
            raise ProfileDepthError(f"profile {self.name} has no model.block_params: cannot rescale it from {L0} to "
                               f"{num_layers} blocks; re-create it with `ds-adaptive calibrate`, or calibrate "
                               f"the {num_layers}-block model")
        # The arithmetic below is bench/training/e2e.py's former scale_profile_depth, operation for operation:
        # e2e's GPU results were planned with it (tests/test_cost.py pins the numbers).
        f = num_layers / L0
        dim = int(raw["model"]["dim"])
        e_tok = EMBED_HEAD_FLOP_PER_TOKEN_PER_DIM * dim / EMBED_HEAD_FLOPS * 1e3   # ms per token
        d = copy.deepcopy(dict(raw))
        c, c_raw = d["compute"], raw["compute"]
        c["c0_ms"] = f * max(c_raw["c0_ms"] - EMBED_HEAD_MS, 0.0) + min(EMBED_HEAD_MS, c_raw["c0_ms"])
        c["a_ms_per_token"] = f * max(c_raw["a_ms_per_token"] - e_tok, 0.0) + min(e_tok, c_raw["a_ms_per_token"])
        c["b_ms_per_token2"] = f * c_raw["b_ms_per_token2"]
        c.pop("fit", None)   # the fit's points are full-depth measurements
        dbytes = 2 * dim / 2**30
        d["memory"]["m1_gib_per_token"] = raw["memory"]["m1_gib_per_token"] - (L0 - num_layers) * dbytes
        d["memory"].pop("fit", None)
        pt = d["memory"].get("per_token_timesteps")
        if pt and not self.gradient_checkpointing:   # the fit's extra holds every (whole) block's
            pt["m1_gib_per_token"] = float(pt["m1_gib_per_token"]) - (L0 - num_layers) * float(
                pt["block_full_m1_gib_per_token"])
        params = int(raw["model"]["params"]) - (L0 - num_layers) * int(raw["model"]["block_params"])
        d["model"]["num_layers"] = num_layers
        d["model"]["params"] = params
        d["static_memory"]["params"] = params
        d["static_memory"]["stage3_live_params"] = min(int(raw["static_memory"]["stage3_live_params"]), params)
        d.pop("measurements", None)
        if "train_overheads" in d:   # per-parameter work (hooks, optimizer): x the params ratio
            ov = d["train_overheads"]
            for k in ("micro_step_ms", "optimizer_step_ms"):
                ov[k] = float(ov[k]) * params / int(raw["model"]["params"])
        d["name"] = f"{raw.get('name', 'profile')}-{num_layers}blocks"
        d["source"] = (f"{raw.get('name')} rescaled from {L0} to {num_layers} blocks by ds_adaptive.planning.cost "
                       "(Profile.with_num_layers): block terms x depth ratio, embed/head terms kept")
        out = Profile.from_dict(d, where=f"{self.name} at {num_layers} blocks")
        return dataclasses.replace(out, rescaled_from_layers=self.rescaled_from_layers or L0)

    def with_train_overheads(self, micro_step_ms: float, optimizer_step_ms: float) -> "Profile":
        """The same calibration with other training-loop terms (``train_overheads``: ms per micro-step and per
        optimizer step), e.g. to see how they move the budget search (``bench/planner/budget_candidates.py``); its variants'
        own terms are replaced too, so a run that resolves one (:meth:`for_block_fusion`) plans with them."""
        d = copy.deepcopy(dict(self.raw))
        terms = {"micro_step_ms": float(micro_step_ms), "optimizer_step_ms": float(optimizer_step_ms),
                 "source": "measured"}
        d["train_overheads"] = {**d.get("train_overheads", {}), **terms}
        for key in ("ln_modulate_variants", "block_fusion_variants"):   # a variant's own terms, too: a run that
            for variant in (d.get(key) or {}).values():                  # resolves one plans with these as well
                if "train_overheads" in variant:
                    variant["train_overheads"] = {**variant["train_overheads"], **terms}
        return dataclasses.replace(self, raw=d, micro_step_overhead_ms=float(micro_step_ms),
                                   optimizer_step_overhead_ms=float(optimizer_step_ms), overhead_source="measured")

    def with_adapter_params(self, adapter_params: Optional[int]) -> "Profile":
        """The same calibration for a LoRA run: ``adapter_params`` parameters are added to the model and are
        the only trained ones (gradients and optimizer state); the model's own parameters are frozen and keep
        only their weights. Activation memory and compute stay the profile's (the adapters' inputs are the
        base linears' inputs, which full fine-tuning holds as well). None: back to full fine-tuning."""
        d = copy.deepcopy(dict(self.raw))
        static = d.setdefault("static_memory", {})
        static.pop("adapter_params", None)
        if adapter_params is not None:
            if isinstance(adapter_params, bool) or int(adapter_params) != adapter_params or adapter_params < 0:
                raise ValueError(f"adapter_params must be an int >= 0 or None, got {adapter_params!r}")
            static["adapter_params"] = int(adapter_params)
        return dataclasses.replace(self, adapter_params=None if adapter_params is None else int(adapter_params),
                                   raw=d)

    def static_memory_parts(self, zero_stage: int, shard_ranks: int, params: Optional[int] = None) -> dict:
        """GiB per GPU of ``params`` (default: the profile's model) under ZeRO ``zero_stage`` (0-3) with
        ``shard_ranks`` ranks sharing the partition (DeepSpeed+Ulysses partitions over dp*sp):
        ``{"params", "grads", "optimizer", "zero3 live", "workspace"}``. With ``adapter_params`` (LoRA) the
        weights are those of the model plus the adapters, gradients and optimizer state the adapters' only."""
        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
        n = max(int(shard_ranks), 1)
        count = self.params if params is None else int(params)
        trained = count if self.adapter_params is None else self.adapter_params
        weights = count + (self.adapter_params or 0)
        bpp = self.bytes_per_param

        def sharded(kind: str, default: float, from_stage: int, number: int) -> float:
            return number * bpp.get(kind, default) / (n if zero_stage >= from_stage else 1) / GIB

        return {"params": sharded("params", 2.0, 3, weights), "grads": sharded("grads", 2.0, 2, trained),
                "optimizer": sharded("optimizer", 12.0, 1, trained),
                "zero3 live": self.stage3_live_params * bpp.get("params", 2.0) / GIB if zero_stage >= 3 else 0.0,
                "workspace": self.workspace_gib}

    def static_memory_gib(self, zero_stage: int, shard_ranks: int) -> float:
        """Parameters + gradients + optimizer state per GPU plus the working set (ZeRO-3's gathered
        layers, kernel workspace), GiB: the sum of :meth:`static_memory_parts`."""
        return sum(self.static_memory_parts(zero_stage, shard_ranks).values())


def load_profile(name_or_path: Union[str, Path, Mapping[str, Any]]) -> Profile:
    """A shipped profile by name (``h100-wan2.1-1.3b``), a profile json path, or a dict."""
    if isinstance(name_or_path, Mapping):
        return Profile.from_dict(name_or_path)
    s = str(name_or_path)
    path = Path(s)
    if not path.is_file():
        shipped = PROFILES_DIR / f"{s}.json"
        if shipped.is_file():
            path = shipped
        elif s == "calibrate":
            raise ProfileError("sampler.profile 'calibrate' is resolved when a run is assembled (build_run: the "
                               "start-up calibration); here give a shipped name, 'auto' or a profile json")
        else:
            raise ProfileError(
                f"unknown profile '{s}' (sampler.profile): not a file and not a shipped name. "
                f"Shipped profiles: {', '.join(shipped_profiles()) or '(none)'}; or pass the path of "
                "a json written by `ds-adaptive calibrate --out PROFILE.json`.")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ProfileError(f"profile {path} is not valid JSON: {exc}") from exc
    return Profile.from_dict(data, where=str(path))


class CostModel:
    """Per-GPU compute cost and activation memory of samples and micro-batches.

    Args:
        profile: a :class:`Profile` (or name / path / dict): memory always, compute for
            ``calibrated``, ``heads`` for the SP check.
        mode: ``calibrated`` (ms), ``power`` (S^p) or ``tokens`` (S).
        p: exponent of ``power``.
        sp: Ulysses degree (ranks that share one sample's sequence).
        num_heads: attention heads of the model (default: the profile's); must divide by ``sp``.
        sparse: a :class:`ds_adaptive.planning.sparse_cost.SparseAttentionCost` (calibrated mode only):
            the quadratic term scales with the busiest SP rank's attention density, plus selection.
    """

    def __init__(self, profile: Union[Profile, str, Path, Mapping[str, Any]], mode: CostMode = "calibrated",
                 *, p: float = 1.5, sp: int = 1, num_heads: Optional[int] = None,
                 sparse: "Optional[SparseAttentionCost]" = None, checkpointing: str = "all",
                 checkpoint_attention: str = "recompute") -> None:
        self.profile = profile if isinstance(profile, Profile) else load_profile(profile)
        if checkpointing not in CHECKPOINT_POLICIES:
            raise ValueError(f"checkpointing must be one of {list(CHECKPOINT_POLICIES)}, got {checkpointing!r}")
        if checkpoint_attention not in CHECKPOINT_ATTENTION_MODES:
            raise ValueError(f"checkpoint_attention must be one of {list(CHECKPOINT_ATTENTION_MODES)}, "
                             f"got {checkpoint_attention!r}")
        #: activation checkpointing policy the plan is made for: ``all`` blocks (the profile's own
        #: calibration when it was measured with checkpointing), ``none``, or ``auto`` (per micro-batch the
        #: fewest blocks that fit ``m_mem``: :func:`ds_adaptive.planning.memory.checkpoint_blocks`)
        self.checkpointing = checkpointing
        #: what a checkpointed block recomputes: ``recompute`` (all of it, as the profile measured) or ``keep``
        #: (all but the self-attention core, whose output it holds: :mod:`ds_adaptive.models.recompute`)
        self.checkpoint_attention = checkpoint_attention
        if mode not in COST_UNITS:
            raise ValueError(f"cost mode must be one of {sorted(COST_UNITS)}, got {mode!r}")
        heads = self.profile.num_heads if num_heads is None else int(num_heads)
        Layout.explicit(sp_size=sp).validate(num_heads=heads, what=f"the model of profile '{self.profile.name}'")
        if not p > 0:
            raise ValueError(f"power-law exponent p must be > 0, got {p!r}")
        if sparse is not None:
            if mode != "calibrated":
                raise ValueError(f"a sparse-attention cost needs cost mode 'calibrated' (ms), got {mode!r}")
            dm = sparse.densities
            if dm.num_heads != heads or dm.num_layers != self.profile.num_layers:
                raise ValueError(
                    f"density table has {dm.num_layers} layers x {dm.num_heads} heads but the model (profile "
                    f"'{self.profile.name}') has {self.profile.num_layers} x {heads}: give densities of the "
                    "trained model (DensityMap.with_num_layers for --layers)")
            sparse = sparse.for_profile(self.profile)  # the layer's dense attention time: the pay check
        self.sparse = sparse
        self.mode: CostMode = mode
        self.p = float(p)
        self.sp = sp
        self.num_heads = heads
        pr = self.profile
        # Coefficients at sp=1 (the profile's per-GPU time at its own sp, times that sp).
        self._a1 = pr.a_ms_per_token * pr.sp
        self._b1 = pr.b_ms_per_token2 * pr.sp
        # ms per token of the all-to-alls: bytes per token per layer -> seconds at GB/s -> ms.
        self._comm_ms_per_token = pr.num_layers * pr.comm_bytes_per_token_per_layer / (pr.link_gbps * 1e9) * 1e3

    # ----------------------------------------------------------------------------- sizes
    @property
    def unit(self) -> str:
        """Unit of costs and of the compute budget (``ms``, ``S^p`` or ``tokens``)."""
        return COST_UNITS[self.mode]

    @property
    def c0(self) -> float:
        """Per-micro-batch overhead in the cost unit (0 unless ``calibrated``)."""
        return self.profile.c0_ms if self.mode == "calibrated" else 0.0

    def padded_tokens(self, shape_or_tokens: Union[SampleShape, int]) -> int:
        """Sequence length padded to a multiple of sp (tokens)."""
        s = shape_or_tokens.tokens if isinstance(shape_or_tokens, SampleShape) else int(shape_or_tokens)
        if s < 1:
            raise ValueError(f"sequence length must be >= 1 token, got {s}")
        return pad_to_multiple(s, self.sp)

    # ----------------------------------------------------------------------------- compute
    def per_gpu_cost(self, shape_or_tokens: Union[SampleShape, int]) -> float:
        """Compute cost of ONE sample on one GPU (without the micro-batch overhead c0)."""
        s = float(self.padded_tokens(shape_or_tokens))
        if self.mode == "calibrated":
            if self.sparse is not None:
                n = int(s)
                quad = self._b1 * s * s * self.sparse.quadratic_factor(n, self.sp)
                sel = self.sparse.selection_ms(n, self.sp, self.num_heads)   # this rank's heads/sp heads
                return (self._a1 * s + quad) / self.sp + sel + self.comm_cost(shape_or_tokens)
            return (self._a1 * s + self._b1 * s * s) / self.sp + self.comm_cost(shape_or_tokens)
        if self.mode == "power":
            return s ** self.p / self.sp
        return s / self.sp

    def comm_cost(self, shape_or_tokens: Union[SampleShape, int]) -> float:
        """Ulysses all-to-all time of one sample on one GPU (ms; 0 for sp=1 or non-ms modes)."""
        if self.mode != "calibrated" or self.sp == 1:
            return 0.0
        s = float(self.padded_tokens(shape_or_tokens))
        return self._comm_ms_per_token * (s / self.sp) * (self.sp - 1) / self.sp

    def batch_overhead(self, shape_or_tokens: Union[SampleShape, int]) -> float:
        """Per-micro-batch cost of a micro-batch of this shape (whatever its size): ``c0``, plus with sparse
        attention the fixed part of the selection call of every layer that runs sparse at this length."""
        if self.sparse is None or self.mode != "calibrated":
            return self.c0
        return self.c0 + self.sparse.selection_call_ms(self.padded_tokens(shape_or_tokens), self.sp)

    def batch_cost(self, shape_or_tokens: Union[SampleShape, int], batch_size: int) -> float:
        """Compute cost of a micro-batch of ``batch_size`` samples of one shape on one GPU."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        return self.batch_overhead(shape_or_tokens) + batch_size * self.per_gpu_cost(shape_or_tokens)

    # ----------------------------------------------------------------------------- memory
    def per_gpu_memory(self, shape_or_tokens: Union[SampleShape, int]) -> float:
        """Activation memory of ONE sample on one GPU (GiB)."""
        s = float(self.padded_tokens(shape_or_tokens))
        m1 = self.profile.m1_gib_per_token + self.profile.per_token_extra(shape_or_tokens)[0]
        return self.profile.m0_gib + m1 * s / self.sp

    def batch_memory(self, shape_or_tokens: Union[SampleShape, int], batch_size: int) -> float:
        """Activation memory of a micro-batch on one GPU (GiB)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        return batch_size * self.per_gpu_memory(shape_or_tokens)

    def max_batch_size(self, shape_or_tokens: Union[SampleShape, int], m_mem: float,
                       m_comp: Optional[float] = None) -> int:
        """Largest B with ``batch_memory <= m_mem`` (and ``batch_cost <= m_comp`` if given);
        0 when even B=1 is over a budget."""
        mem1 = self.per_gpu_memory(shape_or_tokens)
        b = int(math.floor(m_mem / mem1 * (1 + 1e-12)))
        if m_comp is not None:
            c1 = self.per_gpu_cost(shape_or_tokens)
            b = min(b, int(math.floor((m_comp - self.batch_overhead(shape_or_tokens)) / c1 * (1 + 1e-12)))
                    if c1 > 0 else b)
        return max(b, 0)

    # ----------------------------------------------------------------------------- checkpointing
    @property
    def num_layers(self) -> int:
        """Transformer blocks of the profiled model (the range of a checkpoint count is 0..num_layers)."""
        return self.profile.num_layers

    def profile_ckpt_blocks(self) -> int:
        """Blocks checkpointed in the profile's own calibration (all or none)."""
        return self.profile.num_layers if self.profile.gradient_checkpointing else 0

    def as_profiled(self, ckpt_blocks: int) -> bool:
        """True when a micro-batch with ``ckpt_blocks`` checkpointed blocks runs as the profile's calibration did
        (the same count, and no kept attention in a checkpointed block): its cost and memory are the profile's
        own fits (``per_gpu_cost`` / ``per_gpu_memory``), with no checkpointing correction."""
        return ckpt_blocks == self.profile_ckpt_blocks() and (ckpt_blocks == 0 or self.checkpoint_attention != "keep")

    def ckpt_memory(self, shape_or_tokens: Union[SampleShape, int], batch_size, ckpt_blocks):
        """Activation memory (GiB) of a micro-batch with the FIRST ``ckpt_blocks`` blocks checkpointed
        (numpy arrays broadcast over ``batch_size`` / ``ckpt_blocks``).

        Per sample, with ``E`` the embed/head + backward working set, ``c`` a checkpointed block's
        input, ``g`` a whole block's activations and ``d`` the last-block term (all three
        ``per-sample + per-token x S/sp``)::

            mem(n) = E + n c + max(L - n, 1) g + (d if n < L else 0)

        (the backward starts at the last block: with n < L the L - n whole blocks are held at once and the
        head's backward runs on top of them, ``d`` more than the working set the all-checkpointed fit saw;
        with n = L the last block is recomputed after the head's backward, so one block's g is held on top
        of L inputs: checkpointing the last block saves ``d - c``, nothing in profiles without ``d``).
        ``E`` comes from the profile's own fit (``m0 + m1 S`` at all blocks checkpointed, or none), so
        ``mem(profile's own n)`` is that fit exactly. A video of a run with per-token timesteps adds the
        profile's per-token terms to ``m1`` and ``g`` (:meth:`Profile.per_token_extra`): its modulation
        table in every whole block, and once outside the blocks."""
        pr = self.profile
        s = float(self.padded_tokens(shape_or_tokens)) / self.sp
        L = pr.num_layers
        pt_own, pt_block = pr.per_token_extra(shape_or_tokens)
        own = pr.m0_gib + (pr.m1_gib_per_token + pt_own) * s
        g = pr.block_full_gib[0] + (pr.block_full_gib[1] + pt_block) * s
        c = pr.block_ckpt_gib[0] + pr.block_ckpt_gib[1] * s
        d = pr.last_whole_gib[0] + pr.last_whole_gib[1] * s
        e = own - (L * c + g if pr.gradient_checkpointing else L * g + d)
        c += self.kept_attention_gib_per_token() * s           # ``keep``: the attention output and LSE too
        n = np.asarray(ckpt_blocks)
        return np.asarray(batch_size) * (e + n * c + np.maximum(L - n, 1) * g + np.where(n < L, d, 0.0))

    def kept_attention_gib_per_token(self) -> float:
        """What a checkpointed block holds beyond its input under ``checkpoint_attention: keep`` (GiB per token
        of the local shard): the self-attention output and log-sum-exp (``kept_attention_bytes_per_token``,
        exact sizes, not measured); 0 for ``recompute``. Counted for every checkpointed block, a sparse layer
        too (its kernel's output is recomputed, not kept: an over-estimate of 3 KiB per token there)."""
        if self.checkpoint_attention != "keep":
            return 0.0
        act_bytes = int(self.profile.bytes_per_param.get("params", 2.0))
        return kept_attention_bytes_per_token(self.profile.dim, self.num_heads, act_bytes) / GIB

    def recompute_ms(self, shape_or_tokens: Union[SampleShape, int], batch_size):
        """Time (ms) of ONE block's recomputed forward for a micro-batch (per GPU, Ulysses-aware:
        compute / sp, plus that block's share of the all-to-alls)."""
        pr = self.profile
        s = float(self.padded_tokens(shape_or_tokens))
        c0, a, b = pr.recompute_ms
        per = (a * pr.sp * s + b * pr.sp * s * s) / self.sp
        if self.sp > 1:
            passes = 3.0 if pr.gradient_checkpointing else 2.0
            per += self._comm_raw(s) / pr.num_layers / passes
        return c0 + np.asarray(batch_size) * per

    def _recompute_quadratic_ms(self, s: float) -> float:
        """The quadratic part (the self-attention forward) of ONE block's recomputed forward, per sample, at ``s``
        padded tokens (ms, per GPU)."""
        pr = self.profile
        return pr.recompute_ms[2] * pr.sp * s * s / self.sp

    def _sparse_recompute_saving(self, shape_or_tokens: Union[SampleShape, int], batch_size, ckpt_blocks):
        """With sparse attention, the recomputed forward of a sparse layer runs sparse: its quadratic part
        costs ``r_l`` (the layer's kernel ratio) of the dense one that :meth:`recompute_ms` counts. The
        profile's ``b S^2`` holds the recompute of the blocks it checkpointed (all or none), already scaled
        by ``q``; the correction is for the blocks whose state differs from the profile's: ``+(1 - r_l)``
        of a dense recompute's quadratic part for each block not recomputed that the profile recomputed
        (blocks ``>= n``), ``-(1 - r_l)`` for each recomputed that it did not (blocks ``< n``). 0 dense."""
        if self.sparse is None:
            return 0.0
        s = float(self.padded_tokens(shape_or_tokens))
        saved = 1.0 - np.asarray(self.sparse.layer_ratios(int(s), self.sp), float)   # [L], 0 for dense layers
        if not saved.any():
            return 0.0
        pr = self.profile
        quad = self._recompute_quadratic_ms(s)                      # one block's dense recompute, per sample
        n = np.clip(np.asarray(ckpt_blocks).astype(np.int64), 0, len(saved))
        before = np.concatenate([[0.0], np.cumsum(saved)])          # before[n] = sum of saved[l], l < n
        if pr.gradient_checkpointing:
            share = before[-1] - before[n]                          # blocks >= n: recomputed in the profile only
        else:
            share = -before[n]                                      # blocks < n: recomputed here only
        return np.asarray(batch_size) * quad * share

    def _kept_attention_saving(self, shape_or_tokens: Union[SampleShape, int], batch_size, ckpt_blocks):
        """``checkpoint_attention: keep``: the recomputed forward of a checkpointed block whose attention runs
        dense (SDPA) skips the attention core, the quadratic part of :meth:`recompute_ms`; a sparse layer's
        recompute still runs its kernel (``r_l`` of that part, :meth:`_sparse_recompute_saving`). Returns
        that quadratic part times the dense layers among the first ``ckpt_blocks`` (ms). 0 for ``recompute``."""
        if self.checkpoint_attention != "keep":
            return 0.0
        s = float(self.padded_tokens(shape_or_tokens))
        pr = self.profile
        quad = self._recompute_quadratic_ms(s)                      # one block's dense recompute, per sample
        n = np.clip(np.asarray(ckpt_blocks).astype(np.int64), 0, pr.num_layers)
        if self.sparse is None:
            dense_before = n
        else:
            dense = ~np.asarray(self.sparse.layer_decisions(int(s), self.sp)[0], bool)   # [L]: runs SDPA
            dense_before = np.concatenate([[0], np.cumsum(dense)])[n]
        return np.asarray(batch_size) * quad * dense_before

    def _comm_raw(self, s: float) -> float:
        return self._comm_ms_per_token * (s / self.sp) * (self.sp - 1) / self.sp

    def ckpt_cost(self, shape_or_tokens: Union[SampleShape, int], batch_size, ckpt_blocks):
        """Compute cost of a micro-batch (in :attr:`unit`) with ``ckpt_blocks`` blocks checkpointed:
        the profile's cost, minus (or plus) the recomputed forwards of the blocks that differ from the
        profile's calibration. Non-ms modes are scaled by the calibrated ratio. numpy-broadcasting."""
        bs = np.asarray(batch_size)
        base = self.batch_overhead(shape_or_tokens) + bs * self.per_gpu_cost(shape_or_tokens)
        delta = (np.asarray(ckpt_blocks) - self.profile_ckpt_blocks()) * self.recompute_ms(shape_or_tokens, bs)
        if self.mode == "calibrated":
            return (base + delta + self._sparse_recompute_saving(shape_or_tokens, bs, ckpt_blocks)
                    - self._kept_attention_saving(shape_or_tokens, bs, ckpt_blocks))
        pr = self.profile
        s = float(self.padded_tokens(shape_or_tokens))
        ms = pr.c0_ms + bs * ((self._a1 * s + self._b1 * s * s) / self.sp + self._comm_raw(s))
        return base * (ms + delta) / ms

    # ----------------------------------------------------------------------------- budgets
    def usable_memory_gib(self, gpu_mem_gib: Optional[float] = None, utilization: Optional[float] = None) -> float:
        """GPU memory the plan may fill (static + activations), GiB: ``capacity x utilization`` when
        given; else ``capacity - fragmentation margin - AUTO_HEADROOM x capacity`` when the profile
        measured a margin (``ds-adaptive calibrate``); else ``capacity x DEFAULT_MEM_UTILIZATION``."""
        cap = self.profile.gpu_mem_gib if gpu_mem_gib is None else float(gpu_mem_gib)
        if utilization is not None:
            return cap * float(utilization)
        margin = self.profile.fragmentation_margin_gib
        if margin is None:
            return cap * DEFAULT_MEM_UTILIZATION
        return cap * (1 - AUTO_HEADROOM) - margin

    def auto_memory_budget(self, gpu_mem_gib: Optional[float] = None, utilization: Optional[float] = None,
                           *, zero_stage: int = 3, dp_size: int = 1) -> float:
        """``m_mem: auto``: the usable GPU memory (:meth:`usable_memory_gib`) minus the static memory (GiB).

        ZeRO partitions over all ``dp_size * sp`` ranks (DeepSpeed's sequence-data-parallel group)."""
        cap = self.profile.gpu_mem_gib if gpu_mem_gib is None else float(gpu_mem_gib)
        static = self.profile.static_memory_gib(zero_stage, dp_size * self.sp)
        usable = self.usable_memory_gib(cap, utilization)
        budget = usable - static
        if budget <= 0:
            how = (f"x mem_utilization {utilization}" if utilization is not None else
                   "minus the fragmentation margin and headroom" if self.profile.fragmentation_margin_gib
                   is not None else f"x {DEFAULT_MEM_UTILIZATION}")
            raise ValueError(
                f"m_mem auto: GPU memory {cap:.1f} GiB {how} = "
                f"{usable:.1f} GiB does not cover the static memory {static:.1f} GiB "
                f"(params/grads/optimizer of {self.profile.params / 1e9:.2f}B params, ZeRO-{zero_stage}, "
                f"{dp_size * self.sp} ranks). Use a higher ZeRO stage, more ranks, or set sampler.m_mem.")
        return budget

    def with_sparse(self, sparse: "Optional[SparseAttentionCost]") -> "CostModel":
        """The same model (checkpointing policy included) with another (or no) sparse-attention term."""
        return CostModel(self.profile, self.mode, p=self.p, sp=self.sp, num_heads=self.num_heads, sparse=sparse,
                         checkpointing=self.checkpointing, checkpoint_attention=self.checkpoint_attention)

    def describe(self) -> dict:
        """Small JSON-able summary (for logs and plan fingerprints)."""
        return {"sparse": None if self.sparse is None else self.sparse.describe(),"mode": self.mode, "unit": self.unit, "p": self.p, "sp": self.sp,
                "profile": self.profile.name, "c0": self.c0, "a_ms_per_token_sp1": self._a1,
                "b_ms_per_token2_sp1": self._b1, "m0_gib": self.profile.m0_gib,
                "m1_gib_per_token": self.profile.m1_gib_per_token,
                "comm_ms_per_token": self._comm_ms_per_token, "checkpointing": self.checkpointing,
                "checkpoint_attention": self.checkpoint_attention,
                "checkpoint_source": self.profile.checkpoint_source}
