"""The module paths of ds_adaptive before the layered package, kept for one release.

``import ds_adaptive.config`` (or ``ds_adaptive.run``, ``ds_adaptive.patches.megatron``, ...) still works, with a
:class:`DeprecationWarning` that names the new path: the old name is a module whose attributes are those of the
new modules, looked up when first read (so classes pickled under an old path still load). Where one old module
was split, :data:`NAMES` says where each of its names went. docs/ARCHITECTURE.md has the table.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

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
"""Old module (below ``ds_adaptive.``) -> the new module that holds most of it."""

NAMES = {
    "balance.autocalibrate": {
        "main": "cli",
    },
    "balance.calibrate": {
        "BYTES_PER_PARAM": "calibration.profile_json", "CONTEXT_AND_NCCL_GIB": "calibration.profile_json",
        "CPU_MODEL": "calibration.profile_json", "DEFAULT_LINK_GBPS": "calibration.profile_json",
        "MAX_FIT_ERROR": "calibration.fit", "ZERO_PARTITIONED": "calibration.profile_json",
        "block_scaling_models": "calibration.profile_json", "build_parser": "cli.calibrate",
        "calibration_shapes": "calibration.profile_json", "checkpoint_fit": "calibration.fit",
        "comm_entry": "calibration.profile_json", "fit_compute": "calibration.fit",
        "fit_memory": "calibration.fit", "fit_quality_problem": "calibration.fit",
        "fragmentation_margin": "calibration.fit", "full_model_points": "calibration.fit", "main": "cli",
        "nnls": "calibration.fit", "parse_lengths": "cli.calibrate", "per_token_entry": "calibration.fit",
        "profile_from_block_scaling": "calibration.profile_json",
        "profile_from_rows": "calibration.profile_json", "refit_profile": "calibration.profile_json",
        "row_per_token": "calibration.fit", "static_memory_entry": "calibration.profile_json",
    },
    "balance.calibrate_sparse": {
        "main": "cli", "time_ms": "core.timing",
    },
    "balance.cost": {
        "AUTO_HEADROOM": "planning.profile", "BLOCK_FUSION_MODES": "planning.profile",
        "CHECKPOINT_POLICIES": "planning.profile", "COST_UNITS": "planning.profile",
        "CostMode": "planning.profile", "DEFAULT_MEM_UTILIZATION": "planning.profile",
        "EMBED_HEAD_FLOPS": "planning.profile", "EMBED_HEAD_FLOP_PER_TOKEN_PER_DIM": "planning.profile",
        "EMBED_HEAD_MS": "planning.profile", "GIB": "planning.profile",
        "LN_MODULATE_PATHS": "planning.profile", "MICRO_STEP_OVERHEAD_MS_PER_BPARAM": "planning.profile",
        "OPTIMIZER_STEP_OVERHEAD_MS_PER_BPARAM": "planning.profile", "PROFILES_DIR": "planning.profile",
        "PROFILE_FORMAT": "planning.profile", "Profile": "planning.profile",
        "ProfileDepthError": "planning.profile", "ProfileError": "planning.profile",
        "RECOMPUTE_SHARE_ESTIMATE": "planning.profile", "load_profile": "planning.profile",
        "shipped_profiles": "planning.profile",
    },
    "balance.planner": {
        "resolve_budgets": "planning.budget",
    },
    "balance.refit": {
        "main": "cli",
    },
    "balance.selection_cost": {
        "fit_selection": "calibration.selection_timing",
    },
    "balance.simulate": {
        "main": "cli",
    },
    "balance.sparse": {
        "DENSITY_FORMAT": "core.contracts", "DSV_EFFICIENCY": "core.contracts",
        "DensityError": "core.contracts", "DensityMap": "core.contracts",
        "KernelEfficiency": "core.contracts", "load_densities": "core.contracts",
        "synthetic_densities": "core.contracts",
    },
    "config": {
        "MISSPELLING_CUTOFF": "core.ds_config",
        "load_adaptive_config": "core.ds_config", "main": "cli", "markdown_reference": "cli.config",
        "misspelt_block_keys": "core.ds_config", "prepare_ds_config": "core.ds_config",
        "read_ds_config": "core.ds_config", "require_block": "core.ds_config",
        "strip_block": "core.ds_config",
    },
    "export": {
        "CLIENT_STATE_KEY": "training.checkpoint", "main": "cli",
    },
    "sample": {
        "build_parser": "cli.calibrate", "main": "cli",
    },
    "sparse.backends.flex": {
        "transpose_blocks": "attention.attention",
    },
    "sparse.selection": {
        "SCORE_CHUNK_ELEMS": "attention.scores", "SCORE_IMPLS": "attention.scores",
        "pooled_lse_scores": "attention.scores", "pooled_lse_scores_torch": "attention.scores",
        "warm_pooled_lse_scores": "attention.scores",
    },
    "sparse.telemetry": {
        "effective_densities": "attention.runtime",
    },
    "trainer": {
        "CLIENT_STATE_KEY": "training.checkpoint",
    },
    "validate": {
        "accumulation_steps": "core.ds_config", "heads_sp_problem": "core.layout",
    },
}
"""Old module -> {name: new module} for the names that did not go to :data:`MOVED`'s module."""


class _OldModule(types.ModuleType):
    """An old module path: every attribute read is the new module's."""

    def __getattr__(self, name: str):
        old = self.__name__[len("ds_adaptive."):]
        home = NAMES.get(old, {}).get(name, MOVED[old])
        try:
            return getattr(importlib.import_module(f"ds_adaptive.{home}"), name)
        except AttributeError:
            raise AttributeError(f"module {self.__name__!r} (moved to ds_adaptive.{MOVED[old]}) has no attribute "
                                 f"{name!r}") from None

    def __dir__(self):
        old = self.__name__[len("ds_adaptive."):]
        return sorted(set(dir(importlib.import_module(f"ds_adaptive.{MOVED[old]}"))) | set(NAMES.get(old, {})))


class _AliasLoader(importlib.abc.Loader):
    def create_module(self, spec):
        module = _OldModule(spec.name)
        if spec.submodule_search_locations is not None:
            module.__path__ = []   # a package: its old submodules resolve through the finder too
        return module

    def exec_module(self, module) -> None:
        old = module.__name__[len("ds_adaptive."):]
        warnings.warn(f"{module.__name__} moved to ds_adaptive.{MOVED[old]}; the old path goes in the next release "
                      "(docs/ARCHITECTURE.md lists every move)", DeprecationWarning, stacklevel=2)


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Finds an old module path (before the path finder, which would find nothing)."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("ds_adaptive.") or fullname[len("ds_adaptive."):] not in MOVED:
            return None
        is_package = any(k.startswith(fullname[len("ds_adaptive."):] + ".") for k in MOVED)
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(), is_package=is_package)


def install() -> None:
    """Put the finder on ``sys.meta_path`` once."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
