"""ds_adaptive: AdaptiveLoad for DeepSpeed / Megatron video diffusion transformer training."""
import importlib.util as _ilu
import os as _os
import sys as _sys

__version__ = "0.1.0"


def _alias_source_patches() -> None:
    """setup.py ships the top-level ``patches/`` folder as ``ds_adaptive.patches`` (package_dir).
    In a plain source checkout on PYTHONPATH (GPU nodes, ``deepspeed launch/train_wan.py``
    without ``pip install``) there is no such subfolder, so register the same package by path."""
    if "ds_adaptive.patches" in _sys.modules or _ilu.find_spec("ds_adaptive.patches") is not None:
        return
    src = _os.path.join(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))), "patches")
    init = _os.path.join(src, "__init__.py")
    if not _os.path.isfile(init):
        return
    spec = _ilu.spec_from_file_location("ds_adaptive.patches", init, submodule_search_locations=[src])
    module = _ilu.module_from_spec(spec)
    _sys.modules["ds_adaptive.patches"] = module
    spec.loader.exec_module(module)


_alias_source_patches()
