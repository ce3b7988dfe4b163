"""The module paths of ds_adaptive 0.1 before the layered package, kept for one release.

``import ds_adaptive.config`` (or ``ds_adaptive.run``, ``ds_adaptive.patches.megatron``, ...) still works: the
old name is an alias of the module's new home (the same module object, so ``isinstance`` checks, monkeypatching
and checkpoints pickled with old class paths keep working) and a :class:`DeprecationWarning` names the new
path. docs/ARCHITECTURE.md has the table of old and new paths.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

#: old module (below ``ds_adaptive.``) -> its new module
MOVED = {
    "balance": "planning",
    "balance.autocalibrate": "calibration.autocalibrate",
    "balance.budget": "planning.budget",
    "balance.calibrate": "calibration.calibrate",
    "balance.calibrate_sparse": "calibration.sparse",
    "balance.cost": "planning.cost",
    "balance.devices": "planning.devices",
    "balance.heads": "parallel.placement",
    "balance.memory": "planning.memory",
    "balance.planner": "planning.planner",
    "balance.refit": "calibration.refit",
    "balance.sampler": "planning.sampler",
    "balance.selection_cost": "planning.selection_cost",
    "balance.simulate": "simulation.simulate",
    "balance.simulate_sparse": "simulation.sparse",
    "balance.sparse": "planning.sparse_cost",
    "checkpoint": "training.checkpoint",
    "checksum": "training.checksum",
    "config": "core.config",
    "dryrun": "cli.dry_run",
    "e2e": "simulation.e2e",
    "export": "inference.export",
    "files": "core.files",
    "flow_sampler": "models.flow_sampler",
    "fusion_warmup": "training.fusion_warmup",
    "jsonfile": "core.jsonfile",
    "layout": "core.layout",
    "lora": "training.lora",
    "media_out": "media.write",
    "metrics": "training.metrics",
    "multinode": "launch.multinode",
    "multinode.launcher": "launch.multinode.launcher",
    "multinode.rendezvous": "launch.multinode.rendezvous",
    "objective": "models.objective",
    "patches": "integrations",
    "patches.deepspeed": "integrations.deepspeed",
    "patches.diffusers": "integrations.diffusers",
    "patches.megatron": "integrations.megatron",
    "ports": "core.ports",
    "preempt": "training.preempt",
    "preprocess.encode": "media.encode",
    "preview": "training.preview",
    "recompute": "models.recompute",
    "run": "training.assemble",
    "run_config": "training.run_config",
    "runlock": "training.runlock",
    "sample": "inference.sample",
    "shapes": "core.shapes",
    "sparse": "attention",
    "sparse.attention": "attention.attention",
    "sparse.backends": "attention.backends",
    "sparse.backends.base": "attention.backends.base",
    "sparse.backends.check": "attention.backends.check",
    "sparse.backends.flex": "attention.backends.flex",
    "sparse.backends.measure": "attention.backends.measure",
    "sparse.backends.reference": "attention.backends.reference",
    "sparse.backends.registry": "attention.backends.registry",
    "sparse.backends.triton": "attention.backends.triton",
    "sparse.cube_order": "attention.cube_order",
    "sparse.kernel_options": "attention.kernel_options",
    "sparse.kernels": "attention.kernels",
    "sparse.kernels._triton_block_scores": "attention.kernels._triton_block_scores",
    "sparse.kernels._triton_block_sparse": "attention.kernels._triton_block_sparse",
    "sparse.kernels.reference": "attention.kernels.reference",
    "sparse.kernels.triton_block_scores": "attention.kernels.triton_block_scores",
    "sparse.kernels.triton_block_sparse": "attention.kernels.triton_block_sparse",
    "sparse.kernels.triton_configs": "attention.kernels.triton_configs",
    "sparse.planted": "attention.planted",
    "sparse.predictor": "attention.predictor",
    "sparse.profiler": "attention.profiler",
    "sparse.runtime": "attention.runtime",
    "sparse.schedule": "attention.schedule",
    "sparse.selection": "attention.selection",
    "sparse.selection_timing": "calibration.selection_timing",
    "sparse.telemetry": "attention.telemetry",
    "startup": "launch.startup",
    "supervise": "launch.supervise",
    "train": "cli.train",
    "trainer": "training.trainer",
    "validate": "planning.validate",
    "wandb_log": "training.wandb_log",

}


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec):
        return importlib.import_module(self.new)

    def exec_module(self, module) -> None:  # the new module is already executed
        pass


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Resolves an old module path to the module at its new path (with a DeprecationWarning)."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("ds_adaptive."):
            return None
        old = fullname[len("ds_adaptive."):]
        new = MOVED.get(old)
        if new is None:
            return None
        warnings.warn(f"{fullname} moved to ds_adaptive.{new}; the old path goes in the next release",
                      DeprecationWarning, stacklevel=3)
        new_module = importlib.import_module(f"ds_adaptive.{new}")
        spec = importlib.machinery.ModuleSpec(fullname, _AliasLoader(new_module.__name__),
                                              is_package=hasattr(new_module, "__path__"))
        if hasattr(new_module, "__path__"):
            spec.submodule_search_locations = list(new_module.__path__)
        return spec


def install() -> None:
    """Put the finder on ``sys.meta_path`` once."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())  # before the path finder, which would load a second copy
