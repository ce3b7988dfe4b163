"""Keys of the ``adaptive_load`` block that moved to another block: for one release a config may still set a key
at its old place; :func:`move_keys` puts it at its new one before the block is validated, and :func:`warn_moved`
says so in one line per key (a FutureWarning, shown by default).

A key set at both places is an error naming both, whatever the two values: the old key is dropped in the next
release, so a config that sets both must lose one, and only the user knows which. A bad value at the old place is
the error it always was, naming the old key (:func:`at_old_keys`).
"""
from __future__ import annotations

import warnings
from typing import Any, Mapping

from pydantic import BaseModel, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

__all__ = ["MOVED_KEYS", "moved_key_line", "move_keys", "warn_moved", "at_old_keys"]

#: (old key, new key) under ``adaptive_load``, each ``block.key``
MOVED_KEYS: tuple[tuple[str, str], ...] = (
    ("sampler.checkpointing", "recompute.blocks"),
    ("sampler.checkpoint_attention", "recompute.attention"),
    ("sampler.loss_weighting", "optimization.loss_weighting"),
    ("sampler.lr_scaling", "optimization.lr_scaling"),
    ("sampler.reference_batch", "optimization.reference_batch"),
)


def moved_key_line(old: str, new: str) -> str:
    """The one line of a config that still sets ``old``."""
    return (f"adaptive_load.{old} is deprecated and goes in the next release: it is now adaptive_load.{new} "
            f"(the same values); move the key there")


def _set_keys(block: Any) -> dict:
    """The keys a sub-block sets: a dict as given, a model's explicitly set fields."""
    if isinstance(block, BaseModel):
        return {k: getattr(block, k) for k in block.model_fields_set}
    return dict(block)


def move_keys(data: Any) -> tuple[Any, dict[tuple[str, str], tuple[str, str]]]:
    """``(data with every moved key at its new place, {new (block, key): old (block, key)})``; ``data`` is the raw
    ``adaptive_load`` block (anything else is returned as it is). A key set at both places raises a
    :class:`ValidationError` located at the old key, naming both."""
    if not isinstance(data, Mapping):
        return data, {}
    out, moved = dict(data), {}
    for old, new in MOVED_KEYS:
        (ob, ok), (nb, nk) = old.split("."), new.split(".")
        src = out.get(ob)
        if not isinstance(src, Mapping) or ok not in src:
            continue
        dst = out.get(nb, {})
        if not isinstance(dst, (Mapping, BaseModel)):
            continue   # the new block is not an object: its own validation error says so
        src, dst = dict(src), _set_keys(dst)
        value = src.pop(ok)
        if nk in dst:
            raise ValidationError.from_exception_data("AdaptiveLoadConfig", [InitErrorDetails(
                type=PydanticCustomError("moved_key_conflict", _conflict_message(old, new)), loc=(ob, ok),
                input=value)])
        dst[nk] = value
        out[ob], out[nb] = src, dst
        moved[(nb, nk)] = (ob, ok)
    return out, moved


def _conflict_message(old: str, new: str) -> str:
    return (f"adaptive_load.{old} (deprecated) and adaptive_load.{new} are both set; they are one setting: keep "
            f"adaptive_load.{new} and drop adaptive_load.{old}").replace("{", "{{").replace("}", "}}")


def warn_moved(moved: Mapping[tuple[str, str], tuple[str, str]]) -> None:
    """One FutureWarning per moved key (``moved`` as :func:`move_keys` returns it)."""
    for new, old in moved.items():
        warnings.warn(moved_key_line(".".join(old), ".".join(new)), FutureWarning, stacklevel=2)


def at_old_keys(exc: ValidationError, moved: Mapping[tuple[str, str], tuple[str, str]]) -> ValidationError:
    """``exc`` with the errors of a moved key located at its old place (the key the user wrote)."""
    def loc(e) -> tuple:
        head = tuple(e["loc"][:2])
        return moved[head] + tuple(e["loc"][2:]) if head in moved else tuple(e["loc"])

    errors = exc.errors()
    if not moved or not any(tuple(e["loc"][:2]) in moved for e in errors):
        return exc
    details = []
    for e in errors:
        d = InitErrorDetails(type=e["type"], loc=loc(e), input=e["input"])
        if "ctx" in e:
            d["ctx"] = e["ctx"]
        details.append(d)
    try:
        return ValidationError.from_exception_data(exc.title, details)
    except (TypeError, ValueError, KeyError):   # an error type that cannot be rebuilt: keep the original
        return exc
