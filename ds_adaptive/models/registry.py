"""The model registry: ``--model NAME`` -> :class:`ds_adaptive.models.family.Model`.

Each module of ``FAMILY_MODULES`` defines ``FAMILY`` (a :class:`ModelFamily` with its presets). They are
imported on the first lookup; preset names are unique across families. Adding a family: its module
(``models/<family>.py``), one line here, its profile and its tests.
"""
from __future__ import annotations

import importlib
from typing import Optional

from ds_adaptive.models.family import Model, ModelError, ModelFamily, check_presets

__all__ = ["FAMILY_MODULES", "DEFAULT_MODEL", "families", "get_model", "model_names", "default_model",
           "model_for_profile", "model_of_weights"]

FAMILY_MODULES = (
    "ds_adaptive.models.wan21",
    "ds_adaptive.models.wan22",
)
"""Modules that define ``FAMILY``, in the order ``model_names()`` lists them."""

DEFAULT_MODEL = "wan2.1-1.3b"
"""The model of a run that names none on a GPU (launcher, calibrate, simulate's default profile)."""

_FAMILIES: Optional[dict[str, ModelFamily]] = None
_MODELS: Optional[dict[str, Model]] = None


def _load() -> dict[str, Model]:
    global _FAMILIES, _MODELS
    if _MODELS is None:
        fams: dict[str, ModelFamily] = {}
        models: dict[str, Model] = {}
        for mod_name in FAMILY_MODULES:
            fam = importlib.import_module(mod_name).FAMILY
            if fam.name in fams:
                raise ModelError(f"model family {fam.name!r} is defined twice ({mod_name})")
            check_presets(fam.presets)
            for p in fam.presets:
                if p.name in models:
                    raise ModelError(f"model {p.name!r} is defined by both {models[p.name].family.name} and {fam.name}")
                models[p.name] = Model(fam, p)
            fams[fam.name] = fam
        _FAMILIES, _MODELS = fams, models
    return _MODELS


def families() -> dict[str, ModelFamily]:
    """Every registered family by name."""
    _load()
    return dict(_FAMILIES)


def model_names() -> list[str]:
    """Every ``--model`` value, family by family."""
    return list(_load())


def get_model(name: str) -> Model:
    """The model of a ``--model`` value; an unknown name is a :class:`ModelError` listing the known ones."""
    models = _load()
    if name not in models:
        raise ModelError(f"unknown model {name!r}; known: {', '.join(models)}")
    return models[name]


def default_model() -> str:
    """:data:`DEFAULT_MODEL`."""
    return DEFAULT_MODEL


def model_for_profile(profile_model: Optional[str]) -> Optional[Model]:
    """The model a profile's ``model.name`` names (None when absent or unknown: e.g. a calibration of a
    custom config)."""
    if not profile_model:
        return None
    return _load().get(profile_model)


def model_of_weights(path) -> Model:
    """The registered model whose architecture the config of the weights at ``path`` (a model or pipeline
    directory) describes, at any depth: the first preset, family by family, whose config with that number of
    layers equals it (presets of one architecture and one input spec, e.g. a model and the experts built
    like it, are interchangeable for inference). A :class:`ModelError` when no family reads a config there,
    none matches, or matching presets differ in their inputs (then the caller must name the model)."""
    models = _load()
    found, seen = [], []
    for fam in _FAMILIES.values():
        try:
            cfg = fam.weights().read_config(str(path), subfolder="transformer")
        except ModelError as exc:
            seen.append(str(exc))
            continue
        if cfg is None:
            continue
        seen.append(f"config {cfg}")
        for p in fam.presets:
            try:
                same = models[p.name].config(num_layers=cfg.num_layers) == cfg
            except (ModelError, AttributeError, TypeError):
                same = False
            if same:
                found.append(models[p.name])
    if not found:
        why = "; ".join(dict.fromkeys(seen)) if seen else "no config.json"
        raise ModelError(f"{path}: the weights are not of a registered model's architecture ({why}); name the "
                         "registered model whose inputs (VAE latents, text encoder) they were trained on")
    if len({m.input_spec for m in found}) > 1:
        raise ModelError(f"{path}: the architecture is that of models with different inputs "
                         f"({', '.join(m.name for m in found)}): say which one")
    return found[0]
