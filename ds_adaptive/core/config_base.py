"""What every block of the ``adaptive_load`` schema shares: strict pydantic models and the error a bad config
raises."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["ConfigError", "_Block"]


class ConfigError(ValueError):
    """The adaptive_load block (or the ds_config around it) is invalid."""


class _Block(BaseModel):
    # strict: no coercion; "enabled": "yes" / "1" / 1 and "m_mem": "4" are errors, not true / 4.0
    # (an int is still accepted where a float is expected).
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True, use_attribute_docstrings=True)
