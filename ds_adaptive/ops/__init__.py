"""Custom ops (fused LayerNorm-Modulate) with torch reference fallbacks.

Note: ``ds_adaptive.ops.ln_modulate`` is the function; the module of the same name is
``importlib.import_module("ds_adaptive.ops.ln_modulate")``.
"""
from ds_adaptive.ops.ln_modulate import (  # noqa: F401
    LayerNormModulate,
    get_mode,
    ln_modulate,
    ln_modulate_reference,
    load_op,
    op_status,
)
from ds_adaptive.ops.apply import apply_ln_modulate  # noqa: F401,E402
