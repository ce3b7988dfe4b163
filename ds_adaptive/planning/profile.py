"""Cost / memory profiles: what ``ds-adaptive calibrate`` measured of a model on a GPU (the compute terms
``c0 + a*S + b*S^2``, activation memory per token, static memory, loop overheads, variants per LayerNorm-modulate
path and block-fusion mode), read from a shipped name or a json (:func:`load_profile`). The cost model built on
them is :mod:`ds_adaptive.planning.cost`.

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
from typing import Any, Literal, Mapping, Optional, Union

from ds_adaptive.core.shapes import SampleShape

PROFILE_FORMAT = "ds_adaptive.profile/1"
#: LayerNorm-modulate paths a profile can be calibrated with (``ln_modulate`` in the json; absent = reference)
LN_MODULATE_PATHS = ("fused", "reference")
#: block-fusion modes a profile can be calibrated with (``block_fusion`` in the json; absent = off), the values of
#: ``adaptive_load.block_fusion`` (``ds_adaptive.models.fusion.BLOCK_FUSION_MODES``)
BLOCK_FUSION_MODES = ("off", "rope", "regions")
PROFILES_DIR = Path(__file__).parent / "profiles"
"""The shipped profiles (``<gpu>-<model>.json``)."""
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
    #: an EMA of ``ema_params`` parameters kept in fp32 on the accelerator, partitioned over the ranks
    #: (``ds_adaptive.training.ema``; None: no EMA on the accelerator). :meth:`with_ema`
    ema_params: Optional[int] = None
    kept_inputs_gib: float = 0.0   #: GiB per token a whole block keeps beyond calibration: :meth:`with_kept_inputs`
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
        added by ``python -m ds_adaptive.cli.autocalibrate ship``) in place of the top-level ones when it has
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
               f"{mode} --out CAL.json`, then `python -m ds_adaptive.cli.autocalibrate ship CAL.json PROFILE.json`")
        if mode == "off":
            return self, (f"warning: profile '{self.name}' was calibrated with block fusion '{self.block_fusion}', "
                          f"this run has it off: predicted activation memory is too low (fused blocks hold less); "
                          f"calibrate without it ({how.replace(' --block-fusion off', '')})")
        return self, (f"note: profile '{self.name}' was calibrated with block fusion '{self.block_fusion}', this run "
                      f"uses '{mode}': its plans are conservative (fused blocks hold less activation memory and run "
                      f"faster); for a profile of this path: {how}")

    def with_num_layers(self, num_layers: int) -> "Profile":
        """The same calibration for a model with ``num_layers`` blocks: :func:`rescale_depth` (the rules there)."""
        return rescale_depth(self, num_layers)

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
        only their weights. Compute stays the profile's; what the wrapped Linear layers keep beyond the calibrated
        lean blocks is :meth:`with_kept_inputs`. None: back to full fine-tuning."""
        d = copy.deepcopy(dict(self.raw))
        static = d.setdefault("static_memory", {})
        static.pop("adapter_params", None)
        if adapter_params is not None:
            if isinstance(adapter_params, bool) or int(adapter_params) != adapter_params or adapter_params < 0:
                raise ValueError(f"adapter_params must be an int >= 0 or None, got {adapter_params!r}")
            static["adapter_params"] = int(adapter_params)
        return dataclasses.replace(self, adapter_params=None if adapter_params is None else int(adapter_params),
                                   raw=d)

    def with_kept_inputs(self, bytes_per_token: float) -> "Profile":
        """Whole blocks keep ``bytes_per_token`` more than calibrated (``Model.kept_input_bytes``): added to ``g`` and to
        ``m1`` (one block at a time if the fit checkpointed every block, else all), replacing an earlier amount."""
        x = float(bytes_per_token) / GIB
        if x < 0:
            raise ValueError(f"bytes_per_token must be >= 0, got {bytes_per_token!r}")
        if (dx := x - self.kept_inputs_gib) == 0:
            return self
        blocks = 1 if self.gradient_checkpointing else self.num_layers
        g0, g1 = self.block_full_gib
        return dataclasses.replace(self, m1_gib_per_token=self.m1_gib_per_token + blocks * dx,
                                   block_full_gib=(g0, g1 + dx), kept_inputs_gib=x)

    def with_ema(self, ema_params: Optional[int]) -> "Profile":
        """The same calibration for a run that keeps an EMA of ``ema_params`` parameters on the accelerator (fp32,
        each rank the average of its slice: 4 bytes x ``ema_params`` / ranks at every ZeRO stage); None: none."""
        if ema_params is not None and (isinstance(ema_params, bool) or int(ema_params) != ema_params or ema_params < 0):
            raise ValueError(f"ema_params must be an int >= 0 or None, got {ema_params!r}")
        return dataclasses.replace(self, ema_params=None if ema_params is None else int(ema_params))

    def static_memory_parts(self, zero_stage: int, shard_ranks: int, params: Optional[int] = None) -> dict:
        """GiB per GPU of ``params`` (default: the profile's model) under ZeRO ``zero_stage`` (0-3) with
        ``shard_ranks`` ranks sharing the partition (DeepSpeed+Ulysses partitions over dp*sp):
        ``{"params", "grads", "optimizer", "zero3 live", "workspace"}`` (and ``"ema"`` with :meth:`with_ema`). With
        ``adapter_params`` (LoRA) the weights are those of the model plus the adapters, gradients and optimizer
        state the adapters' only."""
        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
        n = max(int(shard_ranks), 1)
        count = self.params if params is None else int(params)
        trained = count if self.adapter_params is None else self.adapter_params
        weights = count + (self.adapter_params or 0)
        bpp = self.bytes_per_param

        def sharded(kind: str, default: float, from_stage: int, number: int) -> float:
            return number * bpp.get(kind, default) / (n if zero_stage >= from_stage else 1) / GIB

        parts = {"params": sharded("params", 2.0, 3, weights), "grads": sharded("grads", 2.0, 2, trained),
                 "optimizer": sharded("optimizer", 12.0, 1, trained),
                 "zero3 live": self.stage3_live_params * bpp.get("params", 2.0) / GIB if zero_stage >= 3 else 0.0,
                 "workspace": self.workspace_gib}
        if self.ema_params:   # partitioned over the ranks at every stage (ds_adaptive.training.ema)
            parts["ema"] = self.ema_params * EMA_BYTES_PER_PARAM / n / GIB
        return parts

    def static_memory_gib(self, zero_stage: int, shard_ranks: int) -> float:
        """Parameters + gradients + optimizer state per GPU plus the working set (ZeRO-3's gathered
        layers, kernel workspace), GiB: the sum of :meth:`static_memory_parts`."""
        return sum(self.static_memory_parts(zero_stage, shard_ranks).values())


EMA_BYTES_PER_PARAM = 4
"""An EMA is kept in fp32 (``ds_adaptive.training.ema``)."""


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


def rescale_depth(self: "Profile", num_layers: int) -> "Profile":
    """(:meth:`Profile.with_num_layers`) The same calibration for the model with ``num_layers`` transformer blocks instead of
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
    # e2e's GPU results were planned with it (tests/unit/planning/test_cost.py pins the numbers).
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
