"""Wan 2.1 DiT weights: diffusers-format and original-Wan checkpoints <-> ``WanModel``.

``WanModel`` uses the original Wan key layout (``blocks.N.self_attn.q.weight``,
``blocks.N.modulation``, ``head.head.weight``, ``time_embedding.0.weight``, ...). Diffusers'
``WanTransformer3DModel`` names are converted on load (``convert_diffusers_to_wan``) and on save
(``convert_wan_to_diffusers``). Note the norm swap: Wan's ``norm3`` (the affine LayerNorm before
the cross-attention) is diffusers' ``norm2``; the parameter-free FFN norm has no weights.

A checkpoint is a directory (``config.json`` + ``*.safetensors``, sharded through
``*.safetensors.index.json`` or not; a diffusers pipeline directory with a ``transformer/``
sub-folder is accepted) or a single ``.safetensors`` / ``.pt`` / ``.pth`` / ``.bin`` file. The
layout is detected from the keys; the config is read from ``config.json`` (diffusers'
``WanTransformer3DModel`` or the original ``WanModel`` format). Key names and shapes are
checked before any tensor is read; errors name the key, the file, the expected and actual shape.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch

from ds_adaptive.models.family import ModelError
from ds_adaptive.models.wan import WanModel
from ds_adaptive.models.wan_config import WanConfig, get_wan_config
from ds_adaptive.core.files import save_safetensors

PathLike = Union[str, Path]
WEIGHTS_STEM = "diffusion_pytorch_model"
_TORCH_SUFFIXES = (".pt", ".pth", ".bin")


class WanWeightsError(ModelError):
    """A checkpoint that does not fit the model (missing / unexpected key, shape, layout, config)."""


# --------------------------------------------------------------------------------------------
# Key conversion
# --------------------------------------------------------------------------------------------

# (wan name, diffusers name) prefixes; a name without a trailing dot must match exactly.
_TOP_KEYS = [
    ("patch_embedding.", "patch_embedding."),
    ("text_embedding.0.", "condition_embedder.text_embedder.linear_1."),
    ("text_embedding.2.", "condition_embedder.text_embedder.linear_2."),
    ("time_embedding.0.", "condition_embedder.time_embedder.linear_1."),
    ("time_embedding.2.", "condition_embedder.time_embedder.linear_2."),
    ("time_projection.1.", "condition_embedder.time_proj."),
    ("head.head.", "proj_out."),
    ("head.modulation", "scale_shift_table"),
]
_BLOCK_KEYS = [("modulation", "scale_shift_table"), ("norm3.", "norm2."),
               ("ffn.0.", "ffn.net.0.proj."), ("ffn.2.", "ffn.net.2.")]
for _wan, _diff in (("self_attn", "attn1"), ("cross_attn", "attn2")):
    _BLOCK_KEYS += [(f"{_wan}.q.", f"{_diff}.to_q."), (f"{_wan}.k.", f"{_diff}.to_k."),
                    (f"{_wan}.v.", f"{_diff}.to_v."), (f"{_wan}.o.", f"{_diff}.to_out.0."),
                    (f"{_wan}.norm_q.", f"{_diff}.norm_q."), (f"{_wan}.norm_k.", f"{_diff}.norm_k.")]
_BLOCK_RE = re.compile(r"^blocks\.(\d+)\.(.+)$")

# Keys of the image-conditioned variants (Wan 2.1 I2V / FLF2V), in either layout.
_I2V_MARKERS = ("img_emb.", "image_embedder.", ".k_img.", ".v_img.", ".norm_k_img.",
                ".add_k_proj.", ".add_v_proj.", ".norm_added_k.")
# Prefixes that single-file exports (ComfyUI and others) put in front of the original keys.
_STRIP_PREFIXES = ("model.diffusion_model.",)


def _rename(key: str, table: list[tuple[str, str]], src: int) -> Optional[str]:
    dst = 1 - src
    for pair in table:
        pre = pair[src]
        if pre.endswith("."):
            if key.startswith(pre):
                return pair[dst] + key[len(pre):]
        elif key == pre:
            return pair[dst]
    return None


def _convert_key(key: str, src: int) -> Optional[str]:
    m = _BLOCK_RE.match(key)
    if m:
        local = _rename(m.group(2), _BLOCK_KEYS, src)
        return None if local is None else f"blocks.{m.group(1)}.{local}"
    return _rename(key, _TOP_KEYS, src)


def diffusers_key_to_wan(key: str) -> Optional[str]:
    """diffusers ``WanTransformer3DModel`` name -> ``WanModel`` name (None if it has no counterpart)."""
    return _convert_key(key, 1)


def wan_key_to_diffusers(key: str) -> Optional[str]:
    """``WanModel`` name -> diffusers name (None if it has no counterpart)."""
    return _convert_key(key, 0)


def convert_diffusers_to_wan(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a diffusers state dict to WanModel's layout; unknown keys are an error naming them."""
    return _convert_all(state_dict, diffusers_key_to_wan, "diffusers")


def convert_wan_to_diffusers(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a WanModel / original-Wan state dict to diffusers' ``WanTransformer3DModel`` layout."""
    return _convert_all(state_dict, wan_key_to_diffusers, "Wan")


def _convert_all(sd: Mapping[str, torch.Tensor], fn, layout: str) -> dict[str, torch.Tensor]:
    out, bad = {}, []
    for k, v in sd.items():
        new = fn(k)
        if new is None:
            bad.append(k)
        else:
            out[new] = v
    if bad:
        raise WanWeightsError(f"{len(bad)} key(s) are not part of the {layout} layout of a Wan 2.1 T2V DiT: "
                              f"{bad[:10]}")
    return out


def detect_layout(keys: list[str], source: str = "checkpoint") -> str:
    """'diffusers' or 'wan' from a checkpoint's key names."""
    keys = [_strip_prefix(k) for k in keys]
    i2v = [k for k in keys if any(m in f".{k}" for m in _I2V_MARKERS)]
    if i2v:
        raise WanWeightsError(
            f"{source} is an image-conditioned Wan model (I2V / FLF2V keys such as {i2v[:3]}); "
            "ds_adaptive.models.wan implements Wan 2.1 T2V only")
    if any(k.startswith("condition_embedder.") or ".attn1." in k or k == "scale_shift_table" for k in keys):
        return "diffusers"
    if any(k.startswith(("time_embedding.", "text_embedding.", "head.")) or ".self_attn." in k for k in keys):
        return "wan"
    raise WanWeightsError(f"cannot tell the key layout of {source}: first keys {sorted(keys)[:5]} are neither "
                          "diffusers' WanTransformer3DModel nor the original Wan layout")


def _strip_prefix(key: str) -> str:
    for pre in _STRIP_PREFIXES:
        if key.startswith(pre):
            return key[len(pre):]
    return key


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------

def config_from_dict(d: Mapping[str, Any], source: str = "config.json") -> WanConfig:
    """WanConfig from a diffusers ``WanTransformer3DModel`` config or an original Wan ``WanModel`` config."""
    if d.get("_class_name") == "WanTransformer3DModel" or "num_attention_heads" in d:
        for key in ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len"):
            if d.get(key) is not None:
                raise WanWeightsError(f"{source}: {key}={d[key]!r} means an image-conditioned model (I2V/FLF2V); "
                                      "ds_adaptive.models.wan implements Wan 2.1 T2V only")
        if d.get("qk_norm", "rms_norm_across_heads") != "rms_norm_across_heads":
            raise WanWeightsError(f"{source}: qk_norm={d['qk_norm']!r} is not supported; Wan 2.1 uses "
                                  "'rms_norm_across_heads'")
        heads, hd = d.get("num_attention_heads", 40), d.get("attention_head_dim", 128)
        fields = dict(dim=heads * hd, num_heads=heads, ffn_dim=d.get("ffn_dim", 13824),
                      num_layers=d.get("num_layers", 40), in_channels=d.get("in_channels", 16),
                      out_channels=d.get("out_channels") or d.get("in_channels", 16),
                      text_dim=d.get("text_dim", 4096), freq_dim=d.get("freq_dim", 256),
                      patch_size=tuple(d.get("patch_size", (1, 2, 2))), eps=d.get("eps", 1e-6),
                      cross_attn_norm=d.get("cross_attn_norm", True))
    elif "dim" in d and "num_heads" in d:
        if d.get("model_type", "t2v") not in ("t2v", "ti2v"):   # ti2v: Wan 2.2 TI2V-5B (no image branch)
            raise WanWeightsError(f"{source}: model_type={d['model_type']!r}; ds_adaptive.models.wan implements "
                                  "the Wan T2V / TI2V DiT only")
        if d.get("qk_norm", True) is not True:
            raise WanWeightsError(f"{source}: qk_norm=false is not supported (Wan 2.1 uses q/k RMSNorm)")
        # The original WanModel does not save patch_size, text_dim, cross_attn_norm (ignore_for_config).
        fields = dict(dim=d["dim"], num_heads=d["num_heads"], ffn_dim=d.get("ffn_dim", 8192),
                      num_layers=d.get("num_layers", 32), in_channels=d.get("in_dim", 16),
                      out_channels=d.get("out_dim", 16), text_dim=d.get("text_dim", 4096),
                      freq_dim=d.get("freq_dim", 256), patch_size=tuple(d.get("patch_size", (1, 2, 2))),
                      eps=d.get("eps", 1e-6), cross_attn_norm=d.get("cross_attn_norm", True))
    else:
        raise WanWeightsError(f"{source} is not a Wan config: expected diffusers' WanTransformer3DModel keys "
                              "(num_attention_heads, attention_head_dim, ...) or the original WanModel keys "
                              f"(dim, num_heads, ...); got {sorted(d)}")
    try:
        return get_wan_config(fields)
    except ValueError as exc:
        raise WanWeightsError(f"{source}: {exc}") from None


def diffusers_config(cfg: WanConfig) -> dict[str, Any]:
    """The ``WanTransformer3DModel(**kwargs)`` / config.json dict of a WanConfig."""
    return dict(patch_size=list(cfg.patch_size), num_attention_heads=cfg.num_heads,
                attention_head_dim=cfg.head_dim, in_channels=cfg.in_channels, out_channels=cfg.out_channels,
                text_dim=cfg.text_dim, freq_dim=cfg.freq_dim, ffn_dim=cfg.ffn_dim, num_layers=cfg.num_layers,
                cross_attn_norm=cfg.cross_attn_norm, qk_norm="rms_norm_across_heads", eps=cfg.eps,
                image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=1024, pos_embed_seq_len=None)


def original_config(cfg: WanConfig) -> dict[str, Any]:
    """The original Wan ``config.json`` of a WanConfig (non-default extras only when they differ)."""
    d = dict(_class_name="WanModel", _diffusers_version="0.30.0", model_type="t2v", dim=cfg.dim,
             ffn_dim=cfg.ffn_dim, freq_dim=cfg.freq_dim, in_dim=cfg.in_channels, out_dim=cfg.out_channels,
             num_heads=cfg.num_heads, num_layers=cfg.num_layers, eps=cfg.eps, text_len=512)
    if cfg.text_dim != 4096:
        d["text_dim"] = cfg.text_dim
    if cfg.patch_size != (1, 2, 2):
        d["patch_size"] = list(cfg.patch_size)
    if not cfg.cross_attn_norm:
        d["cross_attn_norm"] = False
    return d


def read_config(path: PathLike, subfolder: str = "transformer") -> Optional[WanConfig]:
    """WanConfig from ``config.json`` of a checkpoint directory (or next to a weights file); None if absent.
    ``subfolder``: the model's folder when ``path`` is a diffusers pipeline directory."""
    p = _model_dir(Path(path), subfolder)
    f = (p if p.is_dir() else p.parent) / "config.json"
    if not f.is_file():
        return None
    try:
        return config_from_dict(json.loads(f.read_text()), source=str(f))
    except json.JSONDecodeError as exc:
        raise WanWeightsError(f"{f} is not valid JSON: {exc}") from None


# --------------------------------------------------------------------------------------------
# Reading checkpoints
# --------------------------------------------------------------------------------------------

def _model_dir(p: Path, subfolder: str = "transformer") -> Path:
    if p.is_dir() and (p / "model_index.json").is_file():  # a diffusers pipeline directory
        if not (p / subfolder).is_dir():
            raise WanWeightsError(f"{p} is a diffusers pipeline directory without a {subfolder}/ folder (the model's "
                                  f"weights); pass the folder itself or the pipeline it belongs to")
        return p / subfolder
    return p


def checkpoint_files(path: PathLike, subfolder: str = "transformer") -> list[Path]:
    """The weight files of a checkpoint directory or file (shards in index order); ``subfolder``: the
    model's folder in a diffusers pipeline directory (``transformer_2``: the second expert of a mixture)."""
    p = _model_dir(Path(path), subfolder)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise WanWeightsError(f"checkpoint path {p} does not exist")
    indexes = sorted(p.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise WanWeightsError(f"{p} holds several shard indexes {[i.name for i in indexes]}; keep one")
    if indexes:
        try:
            weight_map = json.loads(indexes[0].read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise WanWeightsError(f"{indexes[0]} is not a safetensors index (needs a 'weight_map'): {exc}") from None
        files = [p / name for name in dict.fromkeys(weight_map.values())]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise WanWeightsError(f"{indexes[0].name} lists shard(s) {absent} that are not in {p}; "
                                  "the download is incomplete")
        return files
    st = sorted(p.glob("*.safetensors"))
    if len(st) == 1:
        return st
    if len(st) > 1:
        raise WanWeightsError(f"{p} holds several .safetensors files {[f.name for f in st]} but no "
                              "*.safetensors.index.json; add the index or point at one file")
    pt = sorted(f for f in p.iterdir() if f.suffix in _TORCH_SUFFIXES)
    if len(pt) == 1:
        return pt
    raise WanWeightsError(f"no weights in {p}: expected {WEIGHTS_STEM}.safetensors, a sharded "
                          f"{WEIGHTS_STEM}.safetensors.index.json, or one .pt/.pth/.bin file")


class _Reader:
    """Key names and shapes of all files without reading tensors; tensors on demand."""

    def __init__(self, files: list[Path], device: str):
        self.device = device
        self.entries: dict[str, tuple[Path, tuple[int, ...]]] = {}
        self._st: dict[Path, Any] = {}
        self._pt: dict[Path, dict[str, torch.Tensor]] = {}
        for f in files:
            if f.suffix == ".safetensors":
                from safetensors import safe_open
                h = safe_open(str(f), framework="pt", device=device)
                self._st[f] = h
                items = ((k, tuple(h.get_slice(k).get_shape())) for k in h.keys())
            elif f.suffix in _TORCH_SUFFIXES:
                sd = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
                if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
                    sd = sd["state_dict"]
                self._pt[f] = sd
                items = ((k, tuple(v.shape)) for k, v in sd.items() if torch.is_tensor(v))
            else:
                raise WanWeightsError(f"{f}: unsupported weights file type {f.suffix!r} "
                                      "(use .safetensors, .pt, .pth or .bin)")
            for k, shape in items:
                if k in self.entries:
                    raise WanWeightsError(f"key {k!r} is in both {self.entries[k][0].name} and {f.name}")
                self.entries[k] = (f, shape)

    def get(self, key: str) -> torch.Tensor:
        f = self.entries[key][0]
        if f in self._st:
            return self._st[f].get_tensor(key)
        return self._pt[f][key].to(self.device)


def _plan(reader: _Reader, expected: Mapping[str, tuple[int, ...]], source: str) -> dict[str, str]:
    """Map model names -> checkpoint keys; raise one error listing every problem."""
    layout = detect_layout(list(reader.entries), source)
    to_wan = diffusers_key_to_wan if layout == "diffusers" else (lambda k: k)
    plan: dict[str, str] = {}
    unexpected, mismatched, mismatched_names = [], [], set()
    for key, (f, shape) in reader.entries.items():
        if layout == "diffusers" and key.split(".")[-1] == "norm_added_q":
            continue  # diffusers' _keys_to_ignore_on_load_unexpected
        name = to_wan(_strip_prefix(key))
        if name is None or name not in expected:
            unexpected.append(f"'{key}' (in {f.name}" + (f", would be '{name}')" if name and name != key else ")"))
            continue
        if name in plan:
            raise WanWeightsError(f"checkpoint keys '{plan[name]}' and '{key}' both map to parameter '{name}'")
        if tuple(shape) != tuple(expected[name]):
            where = f"'{name}'" + (f" (checkpoint key '{key}')" if key != name else "")
            mismatched.append((name, f"{where} in {f.name}: checkpoint has {list(shape)}, "
                                     f"model expects {list(expected[name])}"))
            mismatched_names.add(name)
            continue
        plan[name] = key
    order = {n: i for i, n in enumerate(expected)}
    mismatched.sort(key=lambda m: order[m[0]])
    mismatched = [m[1] for m in mismatched]
    missing = [f"'{n}' (shape {list(s)})" for n, s in expected.items() if n not in plan and n not in mismatched_names]
    if missing or unexpected or mismatched:
        lines = [f"checkpoint {source} ({layout} layout) does not fit the model:"]
        for title, items in (("missing parameter(s)", missing), ("unexpected key(s)", unexpected),
                             ("shape mismatch(es)", mismatched)):
            if items:
                more = f" ... and {len(items) - 10} more" if len(items) > 10 else ""
                lines.append(f"  {len(items)} {title}: " + "; ".join(items[:10]) + more)
        lines.append("Check that config.json matches the weights (or pass config=...), and that the files "
                     "are complete Wan 2.1 T2V DiT weights.")
        raise WanWeightsError("\n".join(lines))
    return plan


def load_wan_weights(model: WanModel, path: PathLike, device: Optional[Union[str, torch.device]] = None, *,
                     subfolder: str = "transformer") -> WanModel:
    """Load a checkpoint (any supported layout) into ``model`` in place, strictly.

    Materialised parameters are copied into (keeping their dtype and device); parameters on the
    meta device are replaced by the loaded tensors, cast to the meta parameter's dtype. For a
    ZeRO-3-partitioned model, load before ``deepspeed.initialize`` or inside
    ``deepspeed.zero.GatheredParameters(..., modifier_rank=0)``.
    """
    files = checkpoint_files(path, subfolder)
    params = dict(model.named_parameters())
    if device is None:
        real = [p.device for p in params.values() if p.device.type != "meta"]
        device = real[0] if real else torch.device("cpu")
    reader = _Reader(files, str(device))
    plan = _plan(reader, {n: tuple(p.shape) for n, p in params.items()}, str(path))
    assign: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, key in plan.items():
            p = params[name]
            t = reader.get(key)
            if p.device.type == "meta":
                assign[name] = t.to(device=device, dtype=p.dtype)
            else:
                p.copy_(t)
    if assign:
        model.load_state_dict(assign, strict=False, assign=True)
    return model


def _is_zero3_param(p: torch.nn.Parameter) -> bool:
    return hasattr(p, "ds_id") and hasattr(p, "ds_shape")


def init_from_pretrained(model: torch.nn.Module, path: PathLike, *, rank: Optional[int] = None,
                         subfolder: str = "transformer") -> dict[str, Any]:
    """Load Wan weights (diffusers or original layout) into a model that may be ZeRO-3-partitioned.

    For fine-tuning (the trainer's ``--init-from``): call on every rank, after the model was built
    (inside ``deepspeed.zero.Init`` or not) and before or after ``deepspeed.initialize``.

    * A model whose parameters are materialised (ZeRO 0-2, one process): ``load_wan_weights``.
    * ZeRO-3-partitioned parameters (``ds_id``): no rank ever holds the full model. Every rank reads
      the checkpoint's headers and checks names and shapes (so every rank raises the same error, no
      hang); then, one block at a time, the block's parameters are gathered
      (``deepspeed.zero.GatheredParameters(modifier_rank=0)``), rank 0 copies the block's tensors from
      the file into them, and leaving the context broadcasts them and re-partitions. Peak extra
      memory: one block's parameters.

    ``subfolder``: the model's folder when ``path`` is a diffusers pipeline directory (``transformer_2``:
    the low-noise expert of Wan 2.2 A14B). Returns ``{"path", "layout", "tensors", "zero3"}`` for the
    run's log and summary.
    """
    params = dict(model.named_parameters())
    zero3 = any(_is_zero3_param(p) for p in params.values())
    files = checkpoint_files(path, subfolder)
    if not zero3:
        load_wan_weights(model, path, subfolder=subfolder)
        layout = detect_layout(list(_Reader(files, "cpu").entries), str(path))
        return {"path": str(path), "layout": layout, "tensors": len(params), "zero3": False}
    import deepspeed

    if rank is None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    reader = _Reader(files, "cpu")
    shapes = {n: tuple(p.ds_shape) if _is_zero3_param(p) else tuple(p.shape) for n, p in params.items()}
    plan = _plan(reader, shapes, str(path))
    groups: dict[str, list[str]] = {}
    for name in params:  # one group per transformer block, one for the rest
        m = _BLOCK_RE.match(name)
        groups.setdefault(f"blocks.{m.group(1)}" if m else "", []).append(name)
    with torch.no_grad():
        for names in groups.values():
            with deepspeed.zero.GatheredParameters([params[n] for n in names], modifier_rank=0):
                if rank == 0:
                    for n in names:
                        params[n].copy_(reader.get(plan[n]))
    return {"path": str(path), "layout": detect_layout(list(reader.entries), str(path)), "tensors": len(plan),
            "zero3": True}


def load_pretrained(path: PathLike, dtype: Optional[torch.dtype] = None, device: Union[str, torch.device] = "cpu",
                    config: Optional[Union[WanConfig, str, Mapping[str, Any]]] = None,
                    keep_fp32: bool = True, subfolder: str = "transformer") -> WanModel:
    """Build a WanModel from a checkpoint without a random init (built on meta, then loaded).

    ``dtype``: parameter dtype (default fp32); with ``keep_fp32`` the parameters of
    ``is_fp32_param`` (modulation tables, time embedding, cross-attention norm) stay fp32, as
    diffusers does. ``config``: overrides / replaces ``config.json`` (needed when there is none).
    ``subfolder``: the model's folder when ``path`` is a diffusers pipeline directory.
    """
    cfg = get_wan_config(config) if config is not None else read_config(path, subfolder)
    if cfg is None:
        raise WanWeightsError(f"no config.json found for {path}; "
                              "pass config= (a WAN_CONFIGS name, a dict or a WanConfig)")
    dtype = dtype or torch.float32
    with torch.device("meta"):
        model = WanModel(cfg)
    model.to_dtype(dtype, keep_fp32=keep_fp32)  # meta: sets the dtype each tensor is loaded as
    load_wan_weights(model, path, device=device, subfolder=subfolder)
    return model


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------

def save_wan_weights(model: WanModel, directory: PathLike, layout: str = "wan") -> Path:
    """Write ``config.json`` + ``diffusion_pytorch_model.safetensors`` in the original Wan layout
    (``layout="wan"``) or diffusers' (``layout="diffusers"``, loadable by
    ``WanTransformer3DModel.from_pretrained``). Returns the weights file."""
    if layout not in ("wan", "diffusers"):
        raise ValueError(f"layout must be 'wan' or 'diffusers', got {layout!r}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if layout == "diffusers":
        sd = convert_wan_to_diffusers(sd)
        cfg = {"_class_name": "WanTransformer3DModel", "_diffusers_version": _diffusers_version(),
               **diffusers_config(model.config)}
    else:
        cfg = original_config(model.config)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    f = out / f"{WEIGHTS_STEM}.safetensors"
    save_safetensors(sd, f, metadata={"format": "pt"})
    return f


def _diffusers_version() -> str:
    try:
        import diffusers
        return diffusers.__version__
    except ImportError:
        return "0.33.0"


def iter_state_dict(path: PathLike, device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) of a checkpoint as stored (no renaming), one tensor at a time."""
    reader = _Reader(checkpoint_files(path), device)
    for key in reader.entries:
        yield key, reader.get(key)


# --------------------------------------------------------------------------------------------
# The family's weight adapter (ds_adaptive.models.family.WeightAdapter)
# --------------------------------------------------------------------------------------------

class _StateDictReader:
    """``_plan``'s view of an in-memory state dict (names and shapes)."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor], source: str):
        self.entries = {k: (Path(source), tuple(v.shape)) for k, v in state_dict.items()}


class WanWeights:
    """Weights of Wan-architecture models (Wan 2.1, Wan 2.2): what the package calls through
    ``get_model(name).weights``."""

    def init_from(self, model: torch.nn.Module, path: PathLike, *, subfolder: str = "transformer") -> dict[str, Any]:
        return init_from_pretrained(model, path, subfolder=subfolder)

    def load_state_dict(self, model: WanModel, state_dict: Mapping[str, torch.Tensor], *, source: str) -> WanModel:
        """Assign ``state_dict`` (WanModel names; e.g. a consolidated DeepSpeed checkpoint) into ``model``
        (meta-built), cast to each parameter's dtype; names and shapes are checked first (one
        :class:`WanWeightsError` listing every problem)."""
        params = dict(model.named_parameters())
        plan = _plan(_StateDictReader(state_dict, source), {n: tuple(p.shape) for n, p in params.items()}, source)
        model.load_state_dict({n: state_dict[k].to(params[n].dtype) for n, k in plan.items()}, strict=True,
                              assign=True)
        return model

    def check(self, model: WanModel, path: PathLike, *, subfolder: str = "transformer") -> None:
        _plan(_Reader(checkpoint_files(path, subfolder), "cpu"), {n: tuple(p.shape) for n, p in model.named_parameters()},
              str(path))

    def save(self, model: WanModel, directory: PathLike, *, layout: str = "diffusers") -> Path:
        return save_wan_weights(model, directory, layout=layout)

    def read_config(self, path: PathLike, *, subfolder: str = "transformer") -> Optional[WanConfig]:
        return read_config(path, subfolder)

    def load(self, path: PathLike, *, config: Any = None, subfolder: str = "transformer",
             dtype: Optional[torch.dtype] = None) -> WanModel:
        return load_pretrained(path, dtype=dtype, config=config, subfolder=subfolder)

    def to_diffusers_key(self, name: str) -> Optional[str]:
        return wan_key_to_diffusers(name)

    def from_diffusers_key(self, key: str) -> Optional[str]:
        return diffusers_key_to_wan(key)
