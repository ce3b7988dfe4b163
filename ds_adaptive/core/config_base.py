"""What every block of the ``adaptive_load`` schema shares: strict pydantic models, the error a bad config
raises, and the marker of an advanced field."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

__all__ = ["ConfigError", "_Block", "advanced", "is_advanced"]


class ConfigError(ValueError):
    """The adaptive_load block (or the ds_config around it) is invalid."""


class _Block(BaseModel):
    # strict: no coercion; "enabled": "yes" / "1" / 1 and "m_mem": "4" are errors, not true / 4.0
    # (an int is still accepted where a float is expected).
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True, use_attribute_docstrings=True)


def advanced(default: Any = PydanticUndefined, **kwargs: Any) -> Any:
    """``Field(default, **kwargs)`` marked advanced: a research or tuning knob an everyday run leaves at its
    default. It validates like any field; the reference (``ds-adaptive config --reference``) lists a block's
    advanced keys after its everyday ones."""
    return Field(default, json_schema_extra={"advanced": True}, **kwargs)


def is_advanced(field: FieldInfo) -> bool:
    """Whether ``field`` was declared with :func:`advanced`."""
    extra = field.json_schema_extra
    return isinstance(extra, dict) and bool(extra.get("advanced"))
