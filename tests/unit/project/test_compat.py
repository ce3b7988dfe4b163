"""Guards the old module paths (before the layered package): each still imports, with a DeprecationWarning naming
its new home, and every name that left its module's main new home is found where ``_compat.NAMES`` says."""
from __future__ import annotations

import importlib
import sys

import pytest

from ds_adaptive import _compat


def _fresh(name: str):
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[key]
    return importlib.import_module(name)


@pytest.mark.parametrize("old, attr, new", [
    ("ds_adaptive.config", "load_adaptive_config", "ds_adaptive.core.ds_config"),
    ("ds_adaptive.config", "SamplerConfig", "ds_adaptive.core.config"),
    ("ds_adaptive.run", "build_run", "ds_adaptive.training.assemble"),
    ("ds_adaptive.patches.megatron", "MegatronAdaptiveLoader", "ds_adaptive.integrations.megatron"),
    ("ds_adaptive.balance.sampler", "build_batch_sampler", "ds_adaptive.planning.sampler"),
    ("ds_adaptive.sparse.runtime", "SparseAttentionRuntime", "ds_adaptive.attention.runtime"),
    ("ds_adaptive.layout", "Layout", "ds_adaptive.core.layout"),
])
def test_a_documented_old_path_still_works_and_says_where_it_went(old, attr, new):
    with pytest.warns(DeprecationWarning, match=f"{old} moved to ds_adaptive"):
        module = _fresh(old)
    assert getattr(module, attr) is getattr(importlib.import_module(new), attr)


def test_every_old_module_imports_and_every_moved_name_resolves():
    with pytest.warns(DeprecationWarning):
        for old in _compat.MOVED:
            module = importlib.import_module(f"ds_adaptive.{old}")
            for name, home in _compat.NAMES.get(old, {}).items():
                assert getattr(module, name) is getattr(importlib.import_module(f"ds_adaptive.{home}"), name), \
                    f"ds_adaptive.{old}.{name}"


def test_an_unknown_name_of_an_old_module_is_an_attribute_error():
    with pytest.warns(DeprecationWarning):
        module = _fresh("ds_adaptive.balance.cost")
    with pytest.raises(AttributeError, match="moved to ds_adaptive.planning.cost"):
        module.no_such_name
