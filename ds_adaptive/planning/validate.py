"""One validation pass for the rules that span fields: the ds_config, its ``adaptive_load`` block, the model and
the launch, checked together before anything is built.

    problems = run_problems(ds_config, block, RunFacts(model="wan2.1-1.3b", sp=2, world=8, device="cuda"))
    validate_run(ds_config, block, facts)     # raises the first problem (ConfigError / SequenceParallelError)

A single field's bounds live on the field (pydantic, ``ds_adaptive.core.config``); the rules here need two or more
fields, or a field and the run (model, Ulysses degree, world size, device). Each rule returns None or one line
naming the key(s), the expected and the actual value, and the fix. What is not known yet (``RunFacts`` field
None) is not checked: ``ds-adaptive config --check`` knows the file (and whatever its flags add), the dry run
knows the planned launch, ``build_run`` knows the real run. All three call :func:`run_problems`.

Rules, in the order they are reported:

* ``sp``: the Ulysses degree from ``--sp`` / ``sequence_parallel_size`` agrees, divides the world, and
  ``data_parallel_size`` (if set) is world / sp (``ds_adaptive.core.layout.resolve_sp_size``);
* ``heads``: sp divides the model's attention heads (:func:`heads_sp_problem`, the one message for it), unless
  sparse attention runs a hybrid ``context_parallel`` mode (``sequence`` / ``auto``: any sp);
* ``batch``: ``train_batch_size`` / ``train_micro_batch_size_per_gpu`` / ``gradient_accumulation_steps`` agree
  (:func:`accumulation_steps`, which ``prepare_ds_config`` uses too);
* ``precision``: not both ``bf16`` and ``fp16``;
* ``zero_stage``: the deprecated ``adaptive_load.sampler.zero_stage``, when set, is the ds_config's ZeRO stage;
* ``zero3_torch_linear``: not set true next to ``zero_optimization.memory_efficient_linear: true``;
* ``budgets``: ``optimization.lr_scaling`` has a ``reference_batch``; a null ``profile`` only where no profile is needed;
* ``global_batch``: ``sampler.global_batch`` gives every data-parallel rank at least one sample per micro-step
  (``ds_adaptive.planning.global_batch.too_small_problem``; the plan checks the rest: within memory x micro-steps);
* ``sparse_attention``: ``dense_layers`` inside the model, ``predictor_rank`` <= the head dim, the backend
  available on the run's device: the sparse backends' own check (``sparse.backends.check_sparse_config``);
* ``ema``: ``ema.parameters: lora`` needs LoRA (``ds_adaptive.core.features.feature_problems``);
* ``optimizer``: ``optimizer.type`` is one DeepSpeed builds (its own names, any case, or a ``torch.optim`` class);
* ``zero_optimization.stage``: an integer 0..3;
* ``budgets`` (bounds): ``m_mem`` at most :data:`MAX_M_MEM_GIB` GiB (a typo like ``1e30`` would make the planner
  allocate a table of that many batch sizes);
* ``metrics.log_dir``: not a file, and no parent of it a file;
* ``adaptive_load``: a CPU run without the block would train the model's full-size shape mix with DeepSpeed's
  fixed batches (hours per step): an error naming what would be used.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from ds_adaptive.core.config import (BLOCK_KEY, AdaptiveLoadConfig, ConfigError, OptimizationConfig, SamplerConfig,
                                     SparseAttentionConfig)
from ds_adaptive.core.ds_config import accumulation_steps
from ds_adaptive.core.features import feature_problems
from ds_adaptive.core.layout import SequenceParallelError, heads_sp_problem, resolve_sp_size
from ds_adaptive.planning.global_batch import too_small_problem
from ds_adaptive.planning.shape_table import unique_shapes
from ds_adaptive.models.registry import get_model, model_names
from ds_adaptive.attention.backends.check import check_sparse_config

MAX_M_MEM_GIB = 4096.0
"""Largest ``adaptive_load.sampler.m_mem`` accepted (GiB of activation memory per GPU; no GPU has a tenth of it)."""
DEEPSPEED_OPTIMIZERS = ("adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon",
                        "onebitadam", "zerooneadam", "onebitlamb", "cpu_adam", "fusedadam")
"""Optimizer types DeepSpeed 0.19 builds by name (lower case); any ``torch.optim`` class name is accepted too."""

__all__ = ["RunFacts", "Problem", "run_problems", "validate_run", "heads_sp_problem", "accumulation_steps",
           "context_parallel_mode"]


@dataclass(frozen=True)
class RunFacts:
    """What is known about the run being checked; None = not known here (the rules that need it are skipped)."""

    model: Optional[str] = None
    """The registered model (``--model``)."""
    layers: Optional[int] = None
    """``--layers`` (None: the preset's depth)."""
    sp: Optional[int] = None
    """``--sp`` (None: the ds_config's ``sequence_parallel_size``, else 1)."""
    world: Optional[int] = None
    """Ranks of the launch (dp x sp)."""
    device: Optional[str] = None
    """``cuda`` or ``cpu``: where the ranks compute."""


@dataclass(frozen=True)
class Problem:
    key: str
    """The rule (``heads``, ``batch``, ``sparse_attention.dense_layers``, ...)."""
    message: str
    error: type = ConfigError
    """The exception type :func:`validate_run` raises it as."""


def _model(facts: RunFacts):
    if facts.model is None:
        return None

    return get_model(facts.model).config(**({"num_layers": facts.layers} if facts.layers else {}))


def _sp_problems(ds_config: Mapping[str, Any], facts: RunFacts, model,
                 context_parallel: str = "heads") -> tuple[list[Problem], Optional[int]]:
    """The Ulysses degree (``--sp`` / ``sequence_parallel_size``), then sp vs the heads (any sp under a hybrid
    ``context_parallel`` mode), then sp vs the world."""
    try:
        sp = resolve_sp_size(facts.sp, ds_config)
    except SequenceParallelError as exc:
        return [Problem("sp", str(exc), SequenceParallelError)], None
    out = []
    if model is not None:
        msg = heads_sp_problem(model.num_heads, sp, facts.model, context_parallel)
        if msg:
            out.append(Problem("heads", msg, SequenceParallelError))
    if facts.world is not None:
        try:
            resolve_sp_size(sp, ds_config, facts.world)
        except SequenceParallelError as exc:
            return out + [Problem("sp", str(exc), SequenceParallelError)], None
    return out, sp


def _precision_problem(ds_config: Mapping[str, Any]) -> Optional[str]:
    on = [k for k in ("bf16", "fp16") if isinstance(ds_config.get(k), dict) and ds_config[k].get("enabled") is True]
    if len(on) == 2:
        return "ds_config enables both 'bf16' and 'fp16'; enable one (bf16 is what the shipped configs train in)"
    return None


def _zero_stage_problem(ds_config: Mapping[str, Any], s: SamplerConfig) -> Optional[str]:
    stage = int((ds_config.get("zero_optimization") or {}).get("stage", 0))
    if s.dropped_zero_stage is not None and s.dropped_zero_stage != stage:
        return (f"adaptive_load.sampler.zero_stage (deprecated) is {s.dropped_zero_stage} but the ds_config's "
                f"zero_optimization.stage is {stage}; the run plans memory for the stage it runs: drop "
                "sampler.zero_stage")
    return None


def _linear_problem(ds_config: Mapping[str, Any], block: AdaptiveLoadConfig) -> Optional[str]:
    zero = ds_config.get("zero_optimization") or {}
    if ("zero3_torch_linear" in block.model_fields_set and block.zero3_torch_linear
            and zero.get("memory_efficient_linear") is True):
        return ("adaptive_load.zero3_torch_linear is true but the ds_config's zero_optimization.memory_efficient_linear "
                "is true (DeepSpeed's Linear replacement); drop one of the two keys (without either the trainer "
                "runs torch's F.linear)")
    return None


def _budget_problems(s: SamplerConfig, opt: OptimizationConfig) -> list[Problem]:
    out = []
    if opt.lr_scaling != "none" and opt.reference_batch is None:
        out.append(Problem("budgets", f"adaptive_load.optimization.lr_scaling is '{opt.lr_scaling}' but reference_batch "
                                      "is not set: give the global samples per optimizer step the base LR was tuned for "
                                      "(optimization.reference_batch), or set lr_scaling to 'none'"))
    if s.profile is None:
        needs = [k for k, v in (("cost_model 'calibrated'", s.cost_model == "calibrated"),
                                ("m_mem 'auto'", s.m_mem == "auto")) if v]
        if needs:
            out.append(Problem("budgets", f"adaptive_load.sampler.profile is null but {' and '.join(needs)} need a "
                                          "profile: use 'auto', a shipped name or a `ds-adaptive calibrate` json"))
    return out


def _sparse_problems(sa: SparseAttentionConfig, facts: RunFacts, model) -> list[Problem]:
    """The sparse-attention backends' own check (``ds_adaptive.attention.backends.check_sparse_config``: layer
    indices, predictor rank, a backend that runs on the device), for the model when it is known, else for
    the deepest registered preset."""
    if not sa.enabled:
        return []

    if model is not None:
        n, head_dim = model.num_layers, model.dim // model.num_heads
    else:

        n, head_dim = max(get_model(m).config().num_layers for m in model_names()), None
    device = facts.device if facts.device not in (None, "cuda") else "meta"  # meta: a GPU launch checked without one
    return [Problem("sparse_attention." + msg.split(" ", 1)[0].rsplit(".", 1)[-1], msg)
            for msg in check_sparse_config(sa, n, device, head_dim=head_dim)]


def run_problems(ds_config: Mapping[str, Any], block: AdaptiveLoadConfig, facts: RunFacts = RunFacts()) -> list[Problem]:
    """Every cross-field problem of this configuration and run, in the module doc's order (empty: all good)."""
    try:
        model = _model(facts)
    except (ValueError, KeyError) as exc:  # an unknown model or a bad --layers (ModelError is a ValueError)
        return [Problem("model", f"--model {facts.model} / --layers {facts.layers}: {exc}")]
    out, sp = _sp_problems(ds_config, facts, model, context_parallel_mode(block.sparse_attention))
    dp = facts.world // sp if facts.world is not None and sp is not None else None
    try:
        accumulation_steps(ds_config, dp, sp)
    except ConfigError as exc:
        out.append(Problem("batch", str(exc)))
    for key, msg in (("precision", _precision_problem(ds_config)),
                     ("zero_stage", _zero_stage_problem(ds_config, block.sampler)),
                     ("zero3_torch_linear", _linear_problem(ds_config, block))):
        if msg:
            out.append(Problem(key, msg))
    out += _budget_problems(block.sampler, block.optimization)
    gb = block.sampler.global_batch
    if gb is not None and dp is not None and (msg := too_small_problem(gb.value, gb.by, dp)):
        out.append(Problem("global_batch", msg))
    out += _sparse_problems(block.sparse_attention, facts, model)
    out += [Problem("ema", msg) for msg in feature_problems(block.ema, block.lora.enabled)]
    for key, msg in (("optimizer", _optimizer_problem(ds_config)),
                     ("zero_optimization.stage", _stage_problem(ds_config)),
                     ("budgets", _budget_bound_problem(block.sampler)),
                     ("metrics.log_dir", _log_dir_problem(block.metrics.log_dir)),
                     ("adaptive_load", _missing_block_problem(ds_config, facts))):
        if msg:
            out.append(Problem(key, msg))
    return out


def _optimizer_problem(ds_config: Mapping[str, Any]) -> Optional[str]:
    import torch

    opt = ds_config.get("optimizer")
    if opt is None:
        return None
    name = opt.get("type") if isinstance(opt, Mapping) else None
    if not isinstance(name, str):
        return (f"ds_config 'optimizer' must be an object with a string 'type' (e.g. {{\"type\": \"AdamW\", \"params\": "
                f"{{\"lr\": 1e-4}}}}), got {opt!r}")
    if name.lower() in DEEPSPEED_OPTIMIZERS or isinstance(getattr(torch.optim, name, None), type):
        return None
    return (f"ds_config optimizer.type is {name!r}, which DeepSpeed cannot build: expected one of DeepSpeed's "
            f"({', '.join(DEEPSPEED_OPTIMIZERS[:9])}, any case) or a torch.optim class (SGD, RMSprop, ...); e.g. "
            "\"AdamW\"")


def _stage_problem(ds_config: Mapping[str, Any]) -> Optional[str]:
    zo = ds_config.get("zero_optimization")
    if zo is None:
        return None
    if not isinstance(zo, Mapping):
        return f"ds_config 'zero_optimization' must be an object (e.g. {{\"stage\": 3}}), got {zo!r}"
    stage = zo.get("stage", 0)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= 3:
        return (f"ds_config zero_optimization.stage is {stage!r}: expected 0, 1, 2 or 3 (3 shards parameters, "
                "gradients and optimizer state: what the shipped configs use)")
    return None


def _budget_bound_problem(s: SamplerConfig) -> Optional[str]:
    if s.m_mem != "auto" and s.m_mem > MAX_M_MEM_GIB:
        return (f"adaptive_load.sampler.m_mem is {s.m_mem:g} GiB per GPU: expected at most {MAX_M_MEM_GIB:g} (GiB of "
                "activation memory per micro-batch per GPU); use \"auto\" (the GPU's capacity) or a value in GiB")
    return None


def _log_dir_problem(log_dir: str) -> Optional[str]:
    """``log_dir`` (not created yet) cannot be a directory when it or a parent of it is a file."""
    p = Path(log_dir)
    for part in (p, *p.parents):
        if part.exists() and not part.is_dir():
            what = "is a file" if part == p else f"is under {part}, which is a file"
            return (f"adaptive_load.metrics.log_dir {log_dir} {what}: expected a directory (it is created); pick "
                    "another metrics.log_dir (or --log-dir)")
    return None


def _missing_block_problem(ds_config: Mapping[str, Any], facts: RunFacts) -> Optional[str]:
    if BLOCK_KEY in ds_config or facts.device != "cpu":
        return None
    shapes = (f"{facts.model}'s shipped shape mix ({get_model(facts.model).shapes})" if facts.model else
              "the model's shipped shape mix")
    return (f"the ds_config has no '{BLOCK_KEY}' block: the run would use the defaults instead, AdaptiveLoad off "
            f"(DeepSpeed's fixed micro-batches) and {shapes}: full-size videos, hours per step "
            f"on the CPU. Add an \"{BLOCK_KEY}\" block (e.g. from launch/configs/cpu_tiny.json, with "
            "sampler.shapes for small shapes)")


def context_parallel_mode(sa: SparseAttentionConfig) -> str:
    """The run's context-parallel mode: ``sparse_attention.context_parallel`` when sparse attention is on, else
    ``heads`` (the sequence-wise path is the sparse runtime's)."""
    return sa.context_parallel if sa.enabled else "heads"


def validate_run(ds_config: Mapping[str, Any], block: AdaptiveLoadConfig, facts: RunFacts = RunFacts()) -> None:
    """Raise the first of :func:`run_problems` (its ``error`` type, its one-line message)."""
    problems = run_problems(ds_config, block, facts)
    if problems:
        raise problems[0].error(problems[0].message)


def check_fixed_batch_sizes(fixed: Optional[Mapping[str, int]], shapes) -> None:
    """``sampler.fixed_batch_sizes`` keys are buckets, "FxHxW" in pixels (or a token length): a key that is not one
    (``"banana"``) would silently change nothing. A well-formed bucket this dataset happens not to hold (a shape of
    the mix that a small synthetic epoch did not draw, a config shared between datasets) is allowed."""
    if not fixed:
        return
    known = sorted({str(s) for s in unique_shapes(shapes)[0]}, key=lambda k: [int(x) for x in k.split("x")])
    unknown = sorted(k for k in set(fixed) - set(known) if not _is_bucket_key(k))
    if unknown:
        raise ConfigError(f"adaptive_load.sampler.fixed_batch_sizes names bucket(s) {', '.join(map(repr, unknown))} "
                          f"that are not shapes of the data ({len(known)} bucket(s): {', '.join(known[:12])}"
                          f"{', ...' if len(known) > 12 else ''}); use those keys, FRAMESxHEIGHTxWIDTH in pixels")


def _is_bucket_key(key: str) -> bool:
    """"FxHxW" (three positive ints) or a token length (one positive int)."""
    parts = str(key).split("x")
    return len(parts) in (1, 3) and all(p.isdigit() and int(p) > 0 for p in parts)
