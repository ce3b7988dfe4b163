"""DeepSpeed op-registry registration of the fused LayerNorm-Modulate op (``ds_adaptive.ops.registry``).

``register_ops()`` makes DeepSpeed see ``LNModulateBuilder`` like one of its own builders:

* ``get_accelerator().get_op_builder("LNModulateBuilder")`` returns the class and
  ``get_accelerator().create_op_builder("LNModulateBuilder")`` an instance. DeepSpeed resolves names
  per accelerator (the CUDA accelerator scans ``deepspeed.ops.op_builder`` into ``class_dict``; the
  CPU accelerator has a fixed if-chain), so the accelerator class's two methods are wrapped to look
  our names up first (originals kept in ``__wrapped__``), and the CUDA ``class_dict`` gets the entry.
* ``deepspeed.ops.op_builder.all_ops.ALL_OPS`` / ``__op_builders__`` (what ``ds_report`` and
  ``deepspeed.env_report.op_report`` list) get an instance, and ``git_version_info.installed_ops``
  says whether the prebuilt extension is installed.
* ``from deepspeed.ops.op_builder import LNModulateBuilder`` works afterwards.

Idempotent (marker attributes); ``unregister_ops()`` restores DeepSpeed's originals. DeepSpeed's own
``ds_report`` command does not import ds_adaptive: ``ds-adaptive report`` prints the same op report
with our op registered.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional
from ds_adaptive.ops.builder import LNModulateBuilder

_MARK = "_ds_adaptive_registered"


def _builders() -> Dict[str, type]:

    return {"LNModulateBuilder": LNModulateBuilder}


def _wrap(orig: Callable, kind: str) -> Callable:
    if getattr(orig, _MARK, False):
        return orig

    @functools.wraps(orig)
    def wrapper(self, class_name, *args, **kwargs):
        cls = _builders().get(class_name)
        if cls is not None:
            return cls if kind == "get" else cls()
        return orig(self, class_name, *args, **kwargs)

    setattr(wrapper, _MARK, True)
    return wrapper  # functools.wraps sets wrapper.__wrapped__ = orig


def _patch_accelerator(acc) -> None:
    cls = type(acc)
    for name, kind in (("get_op_builder", "get"), ("create_op_builder", "create")):
        if name in cls.__dict__ or hasattr(cls, name):
            setattr(cls, name, _wrap(getattr(cls, name), kind))
    # CUDA-style accelerators keep a name -> class dict; fill it too (for code that reads it).
    if hasattr(acc, "_lazy_init_class_dict"):
        try:
            acc._lazy_init_class_dict()
        except Exception:  # noqa: BLE001 - a broken scan of DeepSpeed's builders is not ours to fix
            pass
        class_dict = getattr(acc, "class_dict", None)
        if isinstance(class_dict, dict):
            for name, cls_ in _builders().items():
                class_dict.setdefault(name, cls_)


def _patch_registry() -> None:
    import deepspeed.ops.op_builder as op_builder_pkg

    for name, cls in _builders().items():
        if getattr(op_builder_pkg, name, None) is not cls:
            setattr(op_builder_pkg, name, cls)
    try:
        from deepspeed.ops.op_builder import all_ops
    except Exception:  # noqa: BLE001 - older DeepSpeed without all_ops: the accelerator patch suffices
        all_ops = None
    if all_ops is not None:
        for cls in _builders().values():
            if cls.NAME not in all_ops.ALL_OPS:
                inst = cls()
                all_ops.ALL_OPS[cls.NAME] = inst
                all_ops.__op_builders__.append(inst)
    try:
        from deepspeed import git_version_info
    except Exception:  # noqa: BLE001
        git_version_info = None
    if git_version_info is not None and isinstance(getattr(git_version_info, "installed_ops", None), dict):
        for cls in _builders().values():
            git_version_info.installed_ops[cls.NAME] = cls().prebuilt_available()


def register_ops(accelerator=None) -> List[str]:
    """Register ds_adaptive's op builders with DeepSpeed (idempotent). Returns the class names."""
    from deepspeed.accelerator import get_accelerator

    acc = accelerator if accelerator is not None else get_accelerator()
    _patch_accelerator(acc)
    _patch_registry()
    return sorted(_builders())


def is_registered(accelerator=None) -> bool:
    """Whether DeepSpeed's accelerator resolves our builder names now."""
    from deepspeed.accelerator import get_accelerator

    acc = accelerator if accelerator is not None else get_accelerator()
    return all(acc.get_op_builder(name) is cls for name, cls in _builders().items())


def unregister_ops(accelerator=None) -> None:
    """Undo ``register_ops()``: DeepSpeed's original methods and registries come back."""
    from deepspeed.accelerator import get_accelerator

    acc = accelerator if accelerator is not None else get_accelerator()
    cls = type(acc)
    for name in ("get_op_builder", "create_op_builder"):
        fn = cls.__dict__.get(name)
        if fn is not None and getattr(fn, _MARK, False):
            setattr(cls, name, fn.__wrapped__)
    class_dict = getattr(acc, "class_dict", None)
    if isinstance(class_dict, dict):
        for name, b in _builders().items():
            if class_dict.get(name) is b:
                del class_dict[name]
    import deepspeed.ops.op_builder as op_builder_pkg

    for name, b in _builders().items():
        if getattr(op_builder_pkg, name, None) is b:
            delattr(op_builder_pkg, name)
    try:
        from deepspeed.ops.op_builder import all_ops
    except Exception:  # noqa: BLE001
        return
    for b in _builders().values():
        inst = all_ops.ALL_OPS.pop(b.NAME, None)
        if inst is not None and inst in all_ops.__op_builders__:
            all_ops.__op_builders__.remove(inst)
    from deepspeed import git_version_info

    for b in _builders().values():
        git_version_info.installed_ops.pop(b.NAME, None)


def op_report(verbose: bool = False) -> None:
    """DeepSpeed's op report (as ``ds_report`` prints it) with our ops registered."""
    register_ops()
    from deepspeed.env_report import op_report as ds_op_report

    ds_op_report(verbose=verbose)


def builder(name: str = "LNModulateBuilder") -> Optional[object]:
    """An instance of one of our builders through DeepSpeed's accelerator (registers first)."""
    from deepspeed.accelerator import get_accelerator

    register_ops()
    return get_accelerator().create_op_builder(name)
