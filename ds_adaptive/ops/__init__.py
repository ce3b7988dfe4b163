"""Custom ops (fused LayerNorm-Modulate) with torch reference fallbacks."""
from .ln_modulate import ln_modulate, ln_modulate_reference  # noqa: F401
