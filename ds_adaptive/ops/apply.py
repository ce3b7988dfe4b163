"""The one switch for the fused LayerNorm-Modulate op in a model: :func:`apply_ln_modulate`.

The run configuration decides (``adaptive_load.fused_ln_modulate``, overridden by the trainer's
``--fused-ln-modulate`` / ``--no-fused-ln-modulate``); ``build_run`` calls this once per model.

Environment override (the only one, documented here and in ``ds_adaptive.ops.ln_modulate``):
``DS_ADAPTIVE_LN_MODULATE`` = ``auto`` (default) | ``fused`` | ``reference`` selects the path inside
the fused function on each call: with ``reference`` even an enabled model runs the torch reference,
with ``fused`` a missing CUDA op is an error instead of a warning. It never enables the op in a model
whose configuration disabled it.
"""
from __future__ import annotations

import torch

from ds_adaptive.ops.ln_modulate import ln_modulate, ln_modulate_reference, load_op
from ds_adaptive.ops.ln_modulate import call_counts


def apply_ln_modulate(model, enabled: bool, *, load: bool = True):
    """Use the fused op at every adaLN site of ``model`` (a ``WanModel``: ``set_ln_modulate``) when
    ``enabled``, else the plain torch reference. Explicit both ways. With ``enabled`` and ``load`` on a
    CUDA machine the op is loaded (or JIT-built) now, not inside the first step; without it the op
    falls back to the reference with one warning. Returns the function installed."""
    fn = ln_modulate if enabled else ln_modulate_reference
    if enabled and load and torch.cuda.is_available():
        load_op(strict=False)
    model.set_ln_modulate(fn)
    return fn


def ln_modulate_summary(requested: bool) -> dict:
    """What the model's LayerNorm-modulate sites really ran (for the run summary): the fused op only when
    it was asked for (adaptive_load.fused_ln_modulate) and every call took it; on the CPU, or when the op
    could not load, it falls back to the torch reference and the summary says so."""
    calls = call_counts() if requested else {"fused": 0, "reference": 0}
    ran = ("fused op" if calls["fused"] and not calls["reference"] else
           "fused op and torch reference" if calls["fused"] else "torch reference")
    return {"fused_ln_modulate": ran == "fused op", "fused_ln_modulate_requested": requested,
            "ln_modulate": ran, "ln_modulate_calls": calls}
