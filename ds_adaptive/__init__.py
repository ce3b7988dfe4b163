"""ds_adaptive: AdaptiveLoad for DeepSpeed / Megatron video diffusion transformer training."""
import importlib.util as _ilu
import os as _os
import sys as _sys

__version__ = "0.1.0"


def _alias_source_patches() -> None:
    """setup.py ships the top-level ``patches/`` folder as ``ds_adaptive.patches`` (package_dir).
    In a source checkout (GPU nodes with the checkout on PYTHONPATH, a second checkout or git
    worktree next to an editable install) the ``patches/`` beside this package is the one that
    belongs to it: register it by path, so that the package and its patches come from the same
    tree. Installed (no sibling ``patches/``), the package_dir mapping provides it."""
    if "ds_adaptive.patches" in _sys.modules:
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
