"""LoRA fine-tuning of the DiT with peft, under ZeRO-3 and Ulysses SP.

    spec = get_model(name)                                             # the model's registry entry
    n = adapter_parameters(model_config, cfg.adaptive_load.lora, spec=spec)  # the memory model, before the model
    info = apply_lora(model, lora_cfg, seed=seed, spec=spec, base=base)    # build_run: after --init-from, before SP
    tensors, metadata = diffusers_lora(pairs, scale=info.scale, spec=spec)  # `ds-adaptive export --lora`

**Injection.** ``peft.inject_adapter_in_model`` replaces the targeted ``nn.Linear`` of every block by peft's
``lora.Linear``, which keeps the original layer as ``base_layer`` and adds ``lora_B(lora_A(dropout(x))) *
scale``. The model's setters (``set_attention``, ``set_ln_modulate``, ``set_sequence_parallel``,
``set_token_order``) store plain attributes on the model and its blocks, never on the replaced linears,
so the fused LayerNorm-modulate op, Ulysses, sparse attention and checkpointing run unchanged. Names change:
``blocks.N.self_attn.q.weight`` becomes ``blocks.N.self_attn.q.base_layer.weight``, the adapters are
``blocks.N.self_attn.q.lora_A.default.weight`` / ``lora_B``. Every other parameter is frozen.

**ZeRO-3.** ``build_run`` partitions the base under ``deepspeed.zero.Init``; the adapters are created after it,
outside ``zero.Init`` (peft initialises them on whole tensors; an init on a partitioned parameter would change
nothing), in the base weight's dtype and device, from ``seed`` (the same on every rank).
``deepspeed.initialize`` partitions them (DeepSpeed 0.19.8 ``_convert_to_zero_parameters``: broadcast from
rank 0, then partition). The trainer gives the optimizer only parameters with ``requires_grad``: gradients,
fp32 master weights and Adam moments exist for the adapters only; the frozen base is gathered layer by layer
for forward and backward as before (its input gradients need its weights).

**Checkpoints** are written with ``exclude_frozen_parameters=True``: the adapters and their optimizer state,
no base (``Trainer.save``). A resumed run rebuilds the base the way the first one did (the seed, or the same
``--init-from``), and :func:`check_resume` compares it with the base *probe* recorded in the checkpoint (a few
values of every base tensor, read from the ZeRO-3 partitions): a different base is an error, not silently
wrong adapters. The probe also lets ``ds-adaptive sample`` / ``export`` rebuild the base of a checkpoint.

**Export.** :func:`diffusers_lora` renames the adapters to the modules of the family's diffusers transformer
(the weight adapter's ``to_diffusers_key``; e.g. ``WanTransformer3DModel``) in PEFT format
(``transformer.blocks.N.attn1.to_q.lora_A.weight``), folds the scale alpha/r (alpha/sqrt(r) with
rsLoRA) into ``lora_B`` and writes ``lora_alpha = r`` in the safetensors metadata that diffusers'
``load_lora_adapter`` reads: any loader (diffusers with or without the metadata, ComfyUI) applies scale 1 to
exactly the trained product.

Everything model-specific comes from the model's registry entry (``get_model(name)``, passed as ``spec``: a
:class:`~ds_adaptive.models.family.Model` or its name): where adapters go (``spec.lora_targets``, data of the
family), how the model is built (``spec.build``) and loaded (``spec.weights.load``), and its parameter names in
diffusers' layout (``spec.weights.to_diffusers_key`` / ``from_diffusers_key``).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch

from ds_adaptive.core.config import ConfigError
from ds_adaptive.models.family import LoraTargets, ModelError
from ds_adaptive.training.checkpoint import CheckpointError, read_client_state
from ds_adaptive.models.registry import get_model
from ds_adaptive.core.files import save_safetensors

__all__ = ["LoraError", "LoraTargets", "targets_for", "LoraInfo", "ADAPTER", "apply_lora", "adapter_parameters",
           "base_probe", "check_base", "check_resume", "diffusers_lora", "read_lora_file", "adapter_pairs",
           "merge_adapters", "load_adapters", "reseed_dropout", "CLIENT_KEY", "LORA_FILE", "import_peft"]

ADAPTER = "default"
"""peft's adapter name (the ``default`` in ``lora_A.default.weight``)."""
CLIENT_KEY = "lora"
"""Key of the LoRA record inside the trainer's ``ds_adaptive`` client state."""
LORA_FILE = "pytorch_lora_weights.safetensors"
"""diffusers' default LoRA file name (``LORA_WEIGHT_NAME_SAFE``): ``load_lora_weights(DIR)`` finds it."""
PROBE_FRACTIONS = (0.1, 0.37, 0.61, 0.89)
"""Positions (share of a tensor's elements) of the probe values of every base tensor."""
PROBE_TOLERANCE = 0.01
"""Relative difference from which two probe values differ (bf16 rounding of the same base: <= 0.4%); two probes
belong to different bases when more than ``PROBE_TOLERANCE`` of their values differ."""
_ADAPTER_RE = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.(?P<name>[^.]+))?\.weight$")


class LoraError(ConfigError):
    """A LoRA setting, checkpoint or file that cannot be used; the message names it and what to do."""


def import_peft():
    """The peft package, or a :class:`LoraError` saying how to install it."""
    try:
        import peft
    except ImportError:
        raise LoraError("adaptive_load.lora needs the 'peft' package: pip install 'ds_adaptive[lora]' "
                        "(or pip install peft)") from None
    return peft


# --------------------------------------------------------------------------------------------
# Targets: data of the model family
# --------------------------------------------------------------------------------------------

def model_spec(spec: Any):
    """The registry entry of ``spec`` (a ``Model``, or a ``--model`` name)."""
    if isinstance(spec, str):

        return get_model(spec)
    return spec


def targets_for(spec: Any) -> LoraTargets:
    """The LoRA target table of a model (``spec``: its registry entry or name): data of its family."""
    spec = model_spec(spec)
    table = spec.lora_targets
    if table is None:
        raise LoraError(f"adaptive_load.lora: model {spec.name} ({spec.family.name}) defines no LoRA targets: its "
                        "family does not support LoRA fine-tuning")
    return table


def _target_paths(table: LoraTargets, targets) -> tuple[str, ...]:
    try:
        return table.resolve(targets)
    except ModelError as exc:
        raise LoraError(f"adaptive_load.lora.targets: {exc}") from None


def _matched_linears(model: torch.nn.Module, pattern: str) -> list[tuple[str, torch.nn.Linear]]:
    rx = re.compile(pattern)
    return [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and rx.fullmatch(n)]


# --------------------------------------------------------------------------------------------
# Applying adapters
# --------------------------------------------------------------------------------------------

def scale_of(rank: int, alpha: float, rslora: bool) -> float:
    """The adapters' output scale: alpha / r, or alpha / sqrt(r) with rsLoRA (peft's convention)."""
    return float(alpha) / (math.sqrt(rank) if rslora else rank)


@dataclass
class LoraInfo:
    """What :func:`apply_lora` did: the settings, the adapted modules, parameter counts and the base record."""

    rank: int
    alpha: float
    rslora: bool
    dropout: float
    init: str
    targets: tuple[str, ...]
    """Config targets as given (groups or paths)."""
    modules: tuple[str, ...]
    """Adapted modules (model names, e.g. ``blocks.0.self_attn.q``)."""
    adapter_params: int
    base_params: int
    base: dict = field(default_factory=dict)
    """How the frozen base was made: ``init_from`` (path or None), ``seed``, ``device`` type, ``probe``."""

    @property
    def scale(self) -> float:
        return scale_of(self.rank, self.alpha, self.rslora)

    def client_state(self) -> dict:
        """The record a checkpoint keeps (``ds_adaptive`` client state, key :data:`CLIENT_KEY`)."""
        return {"rank": self.rank, "alpha": self.alpha, "rslora": self.rslora, "dropout": self.dropout,
                "init": self.init, "targets": list(self.targets), "modules": list(self.modules),
                "adapter_params": self.adapter_params, "base_params": self.base_params, "base": dict(self.base)}

    def describe(self) -> str:
        share = self.adapter_params / max(self.base_params, 1)
        src = self.base.get("init_from") or (
            f"the random init of seed {self.base.get('seed')}, not pretrained weights (a DiT init zeroes the output "
            "head, which LoRA leaves frozen: the adapters would learn nothing; pass --init-from)")
        return (f"LoRA rank {self.rank}, alpha {self.alpha:g} (scale {self.scale:.4g}{', rsLoRA' if self.rslora else ''}"
                f"), dropout {self.dropout:g} on {len(self.modules)} linears ({', '.join(self.targets)}): "
                f"{self.adapter_params:,} trainable parameters ({100 * share:.2f}% of the frozen "
                f"{self.base_params:,}); base from {src}")


def adapter_parameters(model_config, lora_cfg, *, spec) -> int:
    """Adapter parameters ``sum r * (in + out)`` of ``lora_cfg`` on the model ``spec`` (registry entry or name)
    of ``model_config``, counted on the meta device (no memory): what the memory model plans for before the
    model is built."""
    spec = model_spec(spec)
    table = targets_for(spec)
    with torch.device("meta"):
        model = spec.build(model_config)
    paths = _target_paths(table, lora_cfg.targets)
    return sum(lora_cfg.rank * (m.in_features + m.out_features)
               for _, m in _matched_linears(model, table.pattern(paths)))


def apply_lora(model: torch.nn.Module, lora_cfg, *, seed: int, spec, base: Optional[dict] = None) -> LoraInfo:
    """Inject peft LoRA adapters per ``lora_cfg`` (``config.LoraConfig``) into ``model`` (a model of ``spec``, its
    registry entry or name: the target table) in place and freeze everything else. ``seed`` draws ``lora_A``
    (identical on every rank). ``base``: the base record (:func:`base_record`) stored in checkpoints. Works on
    the meta device (the dry run) and on a ZeRO-3-partitioned model (before ``deepspeed.initialize``)."""
    peft = import_peft()
    if any(".lora_A." in n for n, _ in model.named_parameters()):
        raise LoraError("the model already has LoRA adapters; apply_lora is called once per model")
    table = targets_for(spec)
    paths = _target_paths(table, lora_cfg.targets)
    pattern = table.pattern(paths)
    matched = _matched_linears(model, pattern)
    if not matched:
        raise LoraError(f"adaptive_load.lora.targets {list(lora_cfg.targets)} match no nn.Linear of the model "
                        f"(pattern {pattern})")
    base_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
    config = peft.LoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, target_modules=pattern,
                             lora_dropout=lora_cfg.dropout, use_rslora=lora_cfg.rslora, bias="none",
                             init_lora_weights=True if lora_cfg.init == "kaiming" else "gaussian")
    # peft creates and initialises the adapters on the CPU, then moves them to the base weight's device and
    # dtype: the CPU generator alone decides them (the same values on every rank and device type).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    adapters = 0
    for name, p in model.named_parameters():
        is_adapter = ".lora_A." in name or ".lora_B." in name
        p.requires_grad_(is_adapter)
        adapters += p.numel() if is_adapter else 0
    return LoraInfo(rank=lora_cfg.rank, alpha=float(lora_cfg.alpha), rslora=lora_cfg.rslora,
                    dropout=float(lora_cfg.dropout), init=lora_cfg.init, targets=tuple(lora_cfg.targets),
                    modules=tuple(n for n, _ in matched), adapter_params=adapters, base_params=base_params,
                    base=dict(base or {}))


def reseed_dropout(seed: int, step: int, micro: int, rank: int) -> None:
    """Reseed the global RNG that peft's LoRA dropout draws from, as a function of (seed, step, micro-step,
    rank): a resumed run draws the masks of the straight run. The trainer calls it before each micro-step's
    forward when ``lora.dropout`` > 0 (after the batch is fetched: a new DataLoader iterator draws its base
    seed from the global RNG). Activation checkpointing replays the RNG state in its recompute."""
    import numpy as np

    torch.manual_seed(int(np.random.SeedSequence([seed, step, micro, rank, 0x10A4]).generate_state(1, np.uint64)[0]
                          >> np.uint64(1)))


# --------------------------------------------------------------------------------------------
# The base probe
# --------------------------------------------------------------------------------------------

def _probe_indices(numel: int) -> list[int]:
    return [min(int(numel * f), numel - 1) for f in PROBE_FRACTIONS] if numel else []


def base_probe(model: torch.nn.Module) -> list[float]:
    """A few values of every parameter (at :data:`PROBE_FRACTIONS` of its elements, names sorted): the
    fingerprint of a frozen base. A ZeRO-3-partitioned model is read from its partitions (every rank of
    the world calls this: one all-reduce); other models directly. The same on every rank."""
    named = sorted(model.named_parameters(), key=lambda kv: kv[0])
    partitioned = [hasattr(p, "ds_id") for _, p in named]
    if not any(partitioned):
        out = []
        for _, p in named:
            flat = p.detach().reshape(-1)
            out += [float(flat[i]) for i in _probe_indices(flat.numel())]
        return out
    import torch.distributed as dist

    values, group_sizes = [], set()
    device = None
    for _, p in named:
        local = p.ds_tensor.detach().reshape(-1)
        device = local.device
        part = local.numel()
        group = p.ds_process_group
        group_sizes.add(dist.get_world_size(group=group))
        start = dist.get_rank(group=group) * part
        for i in _probe_indices(int(p.ds_numel)):
            values.append(local[i - start].float() if start <= i < start + part else torch.zeros((), device=device))
    probe = torch.stack(values).double() if values else torch.zeros(0, dtype=torch.float64)
    dist.all_reduce(probe)
    copies = dist.get_world_size() // max(group_sizes)  # every partition group holds one copy of each value
    return (probe / copies).tolist()


def base_record(model: torch.nn.Module, *, init_from: Optional[str], seed: int, device: str) -> dict:
    """The base record of a LoRA run: where the frozen weights came from and their probe."""
    return {"init_from": init_from, "seed": int(seed), "device": device, "probe": base_probe(model)}


def check_base(recorded: Mapping, probe: list[float], *, what: str) -> Optional[str]:
    """None when ``probe`` belongs to the base ``recorded``; else a message for ``what`` (the checkpoint)."""
    old = recorded.get("probe")
    if old is None:
        return None
    src = (f"--init-from {recorded['init_from']}" if recorded.get("init_from") else
           f"random init from seed {recorded.get('seed')} on {recorded.get('device')}")
    if len(old) != len(probe):
        return (f"{what}: its adapters were trained on a base with {len(old)} probe values, this model has "
                f"{len(probe)}: another model or --layers; the base came from {src}")
    a, b = torch.tensor(probe, dtype=torch.float64), torch.tensor(old, dtype=torch.float64)
    differ = (a - b).abs() > PROBE_TOLERANCE * torch.maximum(a.abs(), b.abs()) + 1e-6
    share = float(differ.double().mean()) if differ.numel() else 0.0
    if share > PROBE_TOLERANCE:
        return (f"{what}: the frozen base differs from the one its adapters were trained on ({100 * share:.0f}% of "
                f"{differ.numel()} probe values differ by more than {100 * PROBE_TOLERANCE:g}%); that base came from "
                f"{src}: use the same (--init-from PATH / --seed, or --base for sample/export)")
    return None


_SHAPE_KEYS = ("rank", "alpha", "rslora", "modules")


def check_resume(info: Optional[LoraInfo], state: Optional[Mapping], *, what: str) -> Optional[str]:
    """None when a run with LoRA ``info`` (None: full fine-tuning) can resume a checkpoint whose LoRA record is
    ``state`` (None: a full fine-tuning checkpoint); else the message (the base probe included)."""
    if info is None and state is None:
        return None
    if info is None:
        return (f"{what} holds LoRA adapters (rank {state['rank']}, targets {state['targets']}) but this run trains "
                "the whole model: enable adaptive_load.lora with the same settings to resume it, or export it "
                "(ds-adaptive export --lora, or with --base to merge) and start a new run")
    if state is None:
        return (f"{what} is a full fine-tuning checkpoint but adaptive_load.lora is enabled: to put LoRA on top of "
                "it, export it (ds-adaptive export CKPT --to DIR) and start the LoRA run with --init-from DIR")
    mine = info.client_state()
    diff = [f"{k} {state.get(k)!r} -> {mine[k]!r}" for k in _SHAPE_KEYS[:3] if state.get(k) != mine[k]]
    if list(state.get("modules", [])) != mine["modules"]:
        diff.append(f"targets {state.get('targets')} -> {mine['targets']}")
    if diff:
        return (f"{what} was trained with other LoRA settings ({'; '.join(diff)}); set adaptive_load.lora "
                "back to the checkpoint's to resume it")
    return check_base(state.get("base") or {}, info.base.get("probe", []), what=what) if info.base.get("probe") \
        else None


# --------------------------------------------------------------------------------------------
# Adapter tensors: checkpoints, diffusers files, merging
# --------------------------------------------------------------------------------------------

def adapter_pairs(state_dict: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{module: (lora_A [r, in], lora_B [out, r])}`` of a state dict with peft adapter keys (any adapter
    name, or none as in diffusers files); other keys are ignored. A module with only one of A / B is an error."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in state_dict.items():
        m = _ADAPTER_RE.match(k)
        if m:
            halves.setdefault(m.group("module"), {})[m.group("ab")] = v
    broken = sorted(mod for mod, h in halves.items() if len(h) != 2)
    if broken:
        raise LoraError(f"LoRA weights of {broken[:5]} have lora_A without lora_B or the reverse")
    return {mod: (h["A"], h["B"]) for mod, h in halves.items()}


def _diffusers_class(spec) -> str:
    return f"diffusers' {spec.family.transformer_class or 'transformer'} ({spec.name})"


def diffusers_lora(pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]], *, scale: float, spec,
                   provenance: Optional[dict] = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Adapters named by the model's modules -> (tensors, safetensors metadata) of a diffusers LoRA file in PEFT
    format: ``transformer.<diffusers module>.lora_A.weight`` / ``lora_B.weight`` (names by ``spec``'s weight
    adapter, ``to_diffusers_key``) with ``scale`` folded into lora_B, fp32 contiguous; metadata
    ``lora_adapter_metadata`` (``transformer.r``, ``transformer.lora_alpha`` = r, ``transformer.target_modules``:
    read by ``load_lora_adapter``) and ``ds_adaptive`` (``provenance``)."""
    spec = model_spec(spec)
    weights = spec.weights
    tensors, modules, ranks = {}, [], set()
    for mod, (a, b) in sorted(pairs.items()):
        name = weights.to_diffusers_key(f"{mod.removeprefix('model.')}.weight")
        if name is None:
            raise LoraError(f"adapter on {mod}: no module of {_diffusers_class(spec)} corresponds to it")
        target = name.removesuffix(".weight")
        modules.append(target)
        ranks.add(int(a.shape[0]))
        tensors[f"transformer.{target}.lora_A.weight"] = a.detach().float().contiguous()
        tensors[f"transformer.{target}.lora_B.weight"] = (b.detach().float() * scale).contiguous()
    if len(ranks) != 1:
        raise LoraError(f"adapters of different ranks {sorted(ranks)}: one rank per file")
    r = ranks.pop()
    adapter_meta = {"transformer.r": r, "transformer.lora_alpha": r, "transformer.target_modules": modules}
    meta = {"format": "pt", "lora_adapter_metadata": json.dumps(adapter_meta, indent=2, sort_keys=True)}
    if provenance is not None:
        meta["ds_adaptive"] = json.dumps(provenance, sort_keys=True, default=str)
    return tensors, meta


def loading_hint(spec, directory) -> str:
    """How diffusers loads a LoRA file of the model ``spec`` written to ``directory`` (for messages)."""
    spec = model_spec(spec)
    into = "" if spec.subfolder == "transformer" else f", load_into_{spec.subfolder}=True"
    return (f"diffusers PEFT format for {_diffusers_class(spec)}: pipe.load_lora_weights({str(directory)!r}{into})")


def read_lora_file(path, *, spec) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float]:
    """A diffusers-format LoRA safetensors file for the model ``spec`` (what ``export --lora`` writes; PEFT keys
    ``transformer.blocks.N.attn1.to_q.lora_A.weight``) -> (``{model module: (A, B)}``, scale alpha/r from its
    metadata, 1 without)."""
    from safetensors import safe_open

    spec = model_spec(spec)

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            sd = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # noqa: BLE001 - unreadable for whatever reason: one message
        raise LoraError(f"cannot read the LoRA file {path}: {exc}") from None
    if not any(".lora_A." in k for k in sd):
        raise LoraError(f"{path} holds no PEFT LoRA weights (keys '*.lora_A.weight'); first keys {sorted(sd)[:3]}")
    pairs = {}
    for mod, ab in adapter_pairs(sd).items():
        name = spec.weights.from_diffusers_key(f"{mod.removeprefix('transformer.')}.weight")
        if name is None:
            raise LoraError(f"{path}: {mod} is not a module of {_diffusers_class(spec)}")
        pairs[name.removesuffix(".weight")] = ab
    scale = 1.0
    raw = meta.get("lora_adapter_metadata")
    if raw:
        m = {k.removeprefix("transformer."): v for k, v in json.loads(raw).items()}
        if "r" in m and "lora_alpha" in m:
            scale = scale_of(int(m["r"]), float(m["lora_alpha"]), bool(m.get("use_rslora", False)))
    return pairs, scale


def merge_adapters(state_dict: dict[str, torch.Tensor], pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                   scale: float) -> dict[str, torch.Tensor]:
    """``W + scale * B @ A`` (fp32 math) for every adapted module of a base state dict (the model's names)."""
    out = dict(state_dict)
    for mod, (a, b) in pairs.items():
        key = f"{mod}.weight"
        if key not in out:
            raise LoraError(f"the base has no {key} for the adapter on {mod}")
        w = out[key]
        out[key] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    return out


def load_adapters(model: torch.nn.Module, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]], *,
                  scale: float, dropout: float = 0.0) -> None:
    """Put ``pairs`` as peft adapters (scale ``scale``) into a plain (non-partitioned) model: inference of a LoRA
    checkpoint or file exactly as trained (``ds-adaptive sample``)."""
    peft = import_peft()
    ranks = {int(a.shape[0]) for a, _ in pairs.values()}
    if len(ranks) != 1:
        raise LoraError(f"adapters of different ranks {sorted(ranks)}")
    r = ranks.pop()
    modules = {n for n, _ in model.named_modules()}
    missing = sorted(set(pairs) - modules)
    if missing:
        raise LoraError(f"adapters for modules the model does not have: {missing[:5]} (another model or --layers?)")
    # alpha chosen so that peft's scale alpha / r is `scale`
    config = peft.LoraConfig(r=r, lora_alpha=scale * r, lora_dropout=dropout, bias="none",
                             target_modules="(" + "|".join(re.escape(m) for m in sorted(pairs)) + ")")
    peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for mod, (a, b) in pairs.items():
            for half, t in (("A", a), ("B", b)):
                p = params[f"{mod}.lora_{half}.{ADAPTER}.weight"]
                if tuple(p.shape) != tuple(t.shape):
                    raise LoraError(f"{mod}.lora_{half}: shape {tuple(t.shape)} in the file, the model's module "
                                    f"needs {tuple(p.shape)}")
                p.copy_(t.to(p.dtype))
    model.requires_grad_(False)


def apply_run_lora(cfg, model: torch.nn.Module, *, meta: bool, device: torch.device) -> LoraInfo:
    """``build_run``'s step: record the frozen base (its probe; every rank takes part under ZeRO-3), then
    :func:`apply_lora` with the run's ``adaptive_load.lora`` and seed. On the meta device (the dry run) no
    probe is taken."""
    t = cfg.trainer
    base = None if meta else base_record(model, init_from=t.init_from, seed=t.seed, device=device.type)
    return apply_lora(model, cfg.adaptive_load.lora, seed=t.seed, spec=t.model, base=base)


def resume_problem(info: Optional[LoraInfo], ckpt_dir, client: Optional[Mapping] = None) -> Optional[str]:
    """:func:`check_resume` for the checkpoint directory ``ckpt_dir`` (``client``: its ``ds_adaptive`` client
    state when already loaded; else read from its model-states file)."""
    if client is None:
        try:
            client = read_client_state(ckpt_dir)
        except CheckpointError:
            return None
    return check_resume(info, (client or {}).get(CLIENT_KEY), what=f"checkpoint {ckpt_dir}")


# --------------------------------------------------------------------------------------------
# Checkpoints -> files / weights (export, sample)
# --------------------------------------------------------------------------------------------

def _checkpoint_pairs(record: Mapping, sd: Mapping[str, torch.Tensor], what: str):
    pairs = {k.removeprefix("model."): v for k, v in adapter_pairs(sd).items()}
    expected = set(record.get("modules", []))
    if expected and set(pairs) != expected:
        missing = sorted(expected - set(pairs))[:5]
        raise LoraError(f"{what}: its LoRA record lists {len(expected)} adapted modules, the weights hold "
                        f"{len(pairs)} (missing e.g. {missing}); the checkpoint is incomplete")
    return pairs


def export_lora(save_dir, tag: str, state: Mapping, out, sd: Mapping[str, torch.Tensor], *, spec):
    """``ds-adaptive export --lora``: the adapters of a LoRA checkpoint of the model ``spec`` as ``out/``
    :data:`LORA_FILE` (:func:`diffusers_lora`); ``state`` is its ``ds_adaptive`` client state. Returns the file."""
    from pathlib import Path


    what = str(Path(save_dir) / tag)
    record = state.get(CLIENT_KEY)
    if not record:
        raise LoraError(f"{what} is a full fine-tuning checkpoint (no LoRA record): export it without --lora")
    pairs = _checkpoint_pairs(record, sd, what)
    provenance = {k: record.get(k) for k in ("rank", "alpha", "rslora", "targets")}
    provenance.update(step=state.get("global_step"), model=state.get("model"), layers=state.get("layers"),
                      base={k: v for k, v in (record.get("base") or {}).items() if k != "probe"}, scale_folded=True)
    tensors, meta = diffusers_lora(pairs, scale=scale_of(record["rank"], record["alpha"], record.get("rslora", False)),
                                   spec=spec, provenance=provenance)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return save_safetensors(tensors, out / LORA_FILE, metadata=meta)


def rebuild_base(model_config, record: Mapping, *, spec, base: Optional[str] = None, what: str = "the checkpoint"):
    """The frozen base of a LoRA run of the model ``spec`` (``model_config``) as a plain fp32 model on the CPU:
    ``base`` (a weights directory the family's weight adapter reads), else the run's ``--init-from``, else the
    run's random init (seed; CPU runs only: a GPU draws other numbers). Checked against the recorded probe
    (:func:`check_base`)."""
    from pathlib import Path

    spec = model_spec(spec)
    path = base or record.get("init_from")
    if path:
        if not Path(path).exists():
            raise LoraError(f"{what}: its base was --init-from {path}, which does not exist here; pass --base DIR "
                            "(the same base weights)")
        model = spec.weights.load(path, config=model_config, subfolder=spec.subfolder, dtype=torch.float32)
    else:
        if record.get("device") not in (None, "cpu"):
            raise LoraError(f"{what}: its base was the random init of seed {record.get('seed')} on "
                            f"{record.get('device')}, which this process cannot redraw; pass --base DIR")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(record.get("seed", 0)))
            model = spec.build(model_config)
    problem = check_base(record, base_probe(model), what=what)
    if problem is not None:
        raise LoraError(problem)
    return model


def merged_weights(model_config, record: Mapping, sd: Mapping[str, torch.Tensor], *, spec, base: Optional[str] = None,
                   what: str = "the checkpoint") -> dict[str, torch.Tensor]:
    """``{model parameter name: fp32 tensor}`` of a LoRA checkpoint of the model ``spec``: its base
    (:func:`rebuild_base`) with the adapters of ``sd`` (the consolidated checkpoint) merged in, ``W + scale * B @ A``."""
    model = rebuild_base(model_config, record.get("base") or {}, spec=spec, base=base, what=what)
    pairs = _checkpoint_pairs(record, sd, what)
    plain = {k: v.detach().float() for k, v in model.state_dict().items()}
    return merge_adapters(plain, pairs, scale_of(record["rank"], record["alpha"], record.get("rslora", False)))
