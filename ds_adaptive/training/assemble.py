"""``build_run``: the one place where a run is assembled, read top to bottom.

    cfg = RunConfig.load("launch/configs/zero3_adaptive.json", trainer={"model": "wan2.1-1.3b"})
    run = build_run(cfg, layout=Layout.detect(...), device=device)   # the trainer, the Megatron hook
    run = build_run(cfg, layout=Layout.for_world(16, sp=2), meta=True)  # the dry run: no GPU, no process group

A :class:`Run` holds the layout, the DeepSpeed config prepared for ``deepspeed.initialize``, the
model's registry entry (``ds_adaptive.models.registry.get_model``: config, token grid, text length,
objective options, weights), the dataset, the model (fused-op and attention choices applied), the
batch sampler with its resolved budgets and cost profile, the run plan (:class:`ds_adaptive.core.run_plan.RunPlan`:
the start-up choices, resolved once where the sampler is built), and the notes a launcher should print. ``meta=True`` builds the model on
the meta device (shapes, no memory, no ZeRO partitioning) and never touches torch.distributed: the
dry run follows the same code path as training.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch

from ds_adaptive.core.config import ConfigError
from ds_adaptive.core.ds_config import prepare_ds_config
from ds_adaptive.core.layout import Layout, strip_mesh_keys
from ds_adaptive.core.run_plan import RunPlan
from ds_adaptive.training.lora import adapter_parameters, apply_run_lora, targets_for
from ds_adaptive.training.run_config import RunConfig
from ds_adaptive.planning.validate import RunFacts, context_parallel_mode, validate_run
from ds_adaptive.planning.context_parallel import ContextParallelCost
from ds_adaptive.models.registry import get_model
from ds_adaptive.parallel import apply_ulysses
from ds_adaptive.data import build_dataset
from ds_adaptive.training.placement import ema_param_count, sampler_and_ema, split_for_validation
from ds_adaptive.ops import apply_ln_modulate
from ds_adaptive.models.family import ModelError, missing_members
from ds_adaptive.attention.backends import select_backend
from ds_adaptive.attention.backends.check import check_sparse_config, sparse_config_notes
from ds_adaptive.attention.backends import BackendChoice, get_backend
from ds_adaptive.planning.sparse_cost import SparseAttentionCost
from ds_adaptive.core.contracts import DensityMap
from ds_adaptive.planning.shape_table import dataset_shapes
from ds_adaptive.attention.runtime import attach_sparse_attention
from ds_adaptive.ops.ln_modulate import get_mode
from ds_adaptive.calibration.autocalibrate import startup_profile
from ds_adaptive.planning.profile import ProfileDepthError
from ds_adaptive.planning.sampler import build_batch_sampler

__all__ = ["Run", "build_run", "DEFAULT_NUM_SAMPLES"]

DEFAULT_NUM_SAMPLES = 10000
"""Size of the synthetic dataset when ``trainer.num_samples`` is not given."""


@dataclass
class Run:
    """Everything a training job (or its dry run) consists of, before the engine exists."""

    cfg: RunConfig
    layout: Layout
    device: torch.device
    ds_config: dict
    """The dict for ``deepspeed.initialize`` (our block and the mesh keys stripped, precision/batch resolved)."""
    dtype: torch.dtype
    preset: Any
    """The registry entry of ``--model`` (:class:`ds_adaptive.models.family.Model`)."""
    model_config: Any
    """The family's config of the trained model (``--layers`` applied)."""
    model: Any
    """The model, a :class:`ds_adaptive.models.family.DiffusionTransformer` (meta tensors in a dry run)."""
    dataset: Any
    sampler: Any
    """The batch sampler (``ds_adaptive.planning.sampler``): plan, budgets, cost model."""
    plan: RunPlan
    """The start-up choices (budgets, gas, checkpoint policy, kept attention, sparse layers) as the sampler resolved
    them when it was built; the trainer and the dry run read these, the sampler may re-plan later."""
    gpu_mem_gib: Optional[float] = None
    """GPU memory the budgets were resolved for (None: the visible GPU or the profile's device)."""
    notes: list = field(default_factory=list)
    """Messages for the launcher to print once (rank 0): profile rescaling, memory-plan warnings."""
    sparse: Any = None
    """The :class:`ds_adaptive.attention.runtime.SparseAttentionRuntime` installed on the model (None:
    sparse attention off): its backend (``sparse.backend_choice``), schedule and decision cost."""

    @property
    def objective(self):
        """The model's :class:`ds_adaptive.models.family.ObjectiveOptions` with the trainer's ``--objective``
        overrides."""
        return self.preset.objective_with(self.cfg.trainer.objective)

    @property
    def text_len(self) -> int:
        """Text tokens per sample after zero padding (the model's)."""
        return self.preset.text_len
    lora: Any = None
    """``ds_adaptive.training.lora.LoraInfo`` when ``adaptive_load.lora`` is enabled (adapters injected, base frozen)."""
    validation: Any = None
    """The held-out split (``ds_adaptive.data.split.DatasetView``) when ``adaptive_load.validation`` is set;
    ``dataset`` is then the training split, which alone the sampler plans."""
    ema_device: Any = None
    """Where each rank keeps its EMA slices (``adaptive_load.ema``; None: no EMA): the run's device, or the CPU."""

    @property
    def gas(self) -> int:
        """Micro-steps per optimizer step (``gradient_accumulation_steps``; ``plan.gas``)."""
        return self.plan.gas

    @property
    def zero_stage(self) -> int:
        return int((self.ds_config.get("zero_optimization") or {}).get("stage", 0))

    @property
    def cost(self):
        """The sampler's ``CostModel`` (profile rescaled to the trained depth, SP-aware)."""
        return self.sampler.cost

    @property
    def profile(self):
        return self.sampler.cost.profile

    @property
    def budgets(self) -> dict:
        """Resolved per-micro-batch budgets: ``m_mem`` GiB, ``m_comp`` (cost unit), ``max_tokens``;
        ``solo_over_budget``: samples over ``m_comp`` run alone (the throughput-optimal ``m_comp: auto``);
        ``efficient_batches``: its batches are capped at their lowest time per sample (``plan.budgets``)."""
        return self.plan.budgets

    @property
    def on_gpu(self) -> bool:
        return self.device.type in ("cuda", "meta")


def build_run(cfg: RunConfig, *, layout: Optional[Layout] = None, device: Optional[torch.device] = None,
              meta: bool = False, gpu_mem_gib: Optional[float] = None) -> Run:
    """Assemble a run from its configuration.

    ``layout``: default :meth:`Layout.detect` (needs torch.distributed for sp > 1); a dry run passes an
    explicit one. ``device``: default CPU (the meta device with ``meta``). ``gpu_mem_gib``: GPU memory
    for ``auto`` budgets (default: the visible GPU, else the profile's device).
    """
    t = cfg.trainer
    preset = get_model(t.model)
    overrides = {"num_layers": t.layers} if t.layers else {}
    model_config = preset.config(**overrides)
    preset.objective_with(t.objective)  # a bad --objective fails before any work
    if layout is None:
        layout = Layout.detect(t.sp, ds_config=cfg.ds_config)
    # hybrid context parallelism (sparse_attention.context_parallel sequence / auto): sp may exceed the heads
    layout = replace(layout, context_parallel=context_parallel_mode(cfg.adaptive_load.sparse_attention))
    device = torch.device("meta") if meta else (device or torch.device("cpu"))
    on_gpu = device.type in ("cuda", "meta")  # a dry run checks a GPU launch
    # the cross-field rules (heads vs sp, batch keys, layer indices, sparse backend, budgets), once
    validate_run(cfg.ds_config, cfg.adaptive_load, RunFacts(model=t.model, layers=t.layers, sp=layout.sp_size,
                                                            world=layout.world_size,
                                                            device="cuda" if on_gpu else device.type))
    ds_config = _engine_config(cfg, layout, on_gpu=on_gpu, announce=layout.rank == 0 and not meta)
    dtype = torch.bfloat16 if ds_config["bf16"]["enabled"] else (
        torch.float16 if (ds_config.get("fp16") or {}).get("enabled") else torch.float32)
    notes: list = []
    dataset, held_out = split_for_validation(cfg, _build_dataset(cfg, preset, notes), notes)
    if on_gpu and not meta and gpu_mem_gib is None:
        from deepspeed.accelerator import get_accelerator

        gpu_mem_gib = get_accelerator().total_memory(device.index or 0) / 2**30
    # the block-sparse kernel for this device (its efficiency curve is the sparse cost's)
    shapes = dataset_shapes(dataset)   # once: the sparse check, every sampler build and the trainer use it
    sparse_choice = _sparse_backend(cfg, model_config, shapes, device, dtype, notes)
    sparse_cost = (None if sparse_choice is None else
                   sparse_decision_cost(cfg.adaptive_load.sparse_attention, model_config, sparse_choice, device, dtype))
    # Before the model: "gradient_accumulation_steps": "auto" is resolved by the sampler, and zero.Init
    # reads the ds_config.
    lora_cfg = cfg.adaptive_load.lora  # LoRA: only the adapters have gradients and optimizer state (memory model)
    adapters = adapter_parameters(model_config, lora_cfg, spec=preset) if lora_cfg.enabled else None
    build = lambda out, ema: _build_sampler(cfg, shapes, layout, ds_config, gpu_mem_gib, out,  # noqa: E731
                                            model_config=model_config, sparse_cost=sparse_cost, device=device,
                                            meta=meta, adapter_params=adapters, ema_params=ema)
    sampler, plan, ema_device = sampler_and_ema(build, cfg, layout, ds_config, notes, device=device,
                                                ema_params=ema_param_count(cfg, preset, model_config, adapters),
                                                gpu_mem_gib=gpu_mem_gib)
    model = _build_model(cfg, preset, model_config, ds_config, meta=meta)
    notes.extend(_leaf_blocks(model, cfg.adaptive_load, _zero_stage(ds_config)))
    notes.extend(_checkpoint_attention(model, cfg.adaptive_load.recompute, plan.checkpoint_attention, t.model))
    if not meta:
        notes.extend(_block_fusion(model, cfg.adaptive_load.block_fusion, t.model))
    if t.init_from and not meta:
        notes.append(_init_from(model, t.init_from, preset))
    lora = apply_run_lora(cfg, model, meta=meta, device=device) if lora_cfg.enabled else None  # base names first
    if lora is not None:
        notes.append(lora.describe())
    if layout.sp_enabled and not meta:

        apply_ulysses(model, layout)  # sequence sharding + DistributedAttention
    sparse = _attach_sparse(cfg, model, layout, device, sampler, sparse_choice, sparse_cost)
    return Run(cfg=cfg, layout=layout, device=device, ds_config=ds_config, dtype=dtype, preset=preset,
               model_config=model_config, model=model, dataset=dataset, sampler=sampler, plan=plan, gpu_mem_gib=gpu_mem_gib,
               notes=notes, sparse=sparse, lora=lora, validation=held_out, ema_device=ema_device)


def _engine_config(cfg: RunConfig, layout: Layout, *, on_gpu: bool, announce: bool) -> dict:
    """The ds_config for ``deepspeed.initialize``. No DeepSpeed (dp, sp) mesh: DeepSpeed 0.19.8's mesh
    breaks ZeRO-3 checkpoints (docs/ULYSSES.md); ds_adaptive owns the SP groups."""
    out = prepare_ds_config(strip_mesh_keys(cfg.ds_config), dp_size=layout.dp_size, on_gpu=on_gpu)
    torch_linear_config(out, cfg.adaptive_load)
    if "optimizer" not in out:
        out["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0, "torch_adam": True}}
        if announce:
            print("ds_adaptive.train: the ds_config has no 'optimizer'; using AdamW(lr=1e-4) "
                  "(add an 'optimizer' section to choose)")
    return out


def _build_dataset(cfg: RunConfig, preset, notes: list):
    """The dataset of the model's inputs (its grid rule, text width and length): the synthetic mix
    (``sampler.shapes``, else the model's default mix) or ``--data DIR`` (checked against the model)."""
    t, s = cfg.trainer, cfg.adaptive_load.sampler
    if t.data == "synthetic":
        return build_dataset("synthetic", num_samples=t.num_samples or DEFAULT_NUM_SAMPLES,
                             shapes=s.shapes or preset.shapes, seed=t.seed, spec=preset.input_spec)
    if s.shapes:
        notes.append(f"note: adaptive_load.sampler.shapes ({s.shapes}) describes the synthetic dataset; "
                     f"--data {t.data} takes its shapes from its index.json")
    return build_dataset(t.data, spec=preset.input_spec)


def _build_model(cfg: RunConfig, preset, model_config, ds_config: dict, *, meta: bool):
    """The model with the run's op choice; ZeRO-3 partitions it as it is built (same init on every rank)."""
    enabled = cfg.adaptive_load.fused_ln_modulate
    if meta:
        with torch.device("meta"):
            model = _checked(preset, preset.build(model_config))
        apply_ln_modulate(model, enabled, load=False)
        return model
    import deepspeed

    torch.manual_seed(cfg.trainer.seed)
    with deepspeed.zero.Init(config_dict_or_path=ds_config, enabled=_zero_stage(ds_config) == 3):
        model = _checked(preset, preset.build(model_config))
    if torch_linear_config(ds_config, cfg.adaptive_load):
        use_torch_linear()   # adaptive_load.zero3_torch_linear, whatever an earlier engine of the process did
    # 'all' / 'none' fixed; 'auto': the Trainer sets model.set_checkpoint_blocks(n) per micro-batch from the plan
    model.gradient_checkpointing = cfg.adaptive_load.recompute.blocks == "all"
    apply_ln_modulate(model, enabled)  # loaded / JIT-built now, not inside the first step
    return model


def planned_block_fusion(mode: str, device_type: str) -> str:
    """The block-fusion mode the memory model plans for: ``mode``, unless it cannot run here (CUDA or a GPU dry run
    without triton: the blocks would run eager, holding more than a fused profile predicts); then ``off``."""
    import importlib.util

    if mode != "off" and device_type in ("cuda", "meta") and importlib.util.find_spec("triton") is None:
        return "off"
    return mode


def _zero_stage(ds_config: dict) -> int:
    return int((ds_config.get("zero_optimization") or {}).get("stage", 0))


def torch_linear_config(ds_config: dict, al) -> bool:
    """``adaptive_load.zero3_torch_linear``: at ZeRO stage 3 write ``memory_efficient_linear: false`` into
    ``ds_config`` (in place) unless it sets the key; True when the run uses torch's ``F.linear``. Idempotent."""
    if _zero_stage(ds_config) != 3:
        return False
    zero = ds_config["zero_optimization"]
    if al.zero3_torch_linear:
        zero.setdefault("memory_efficient_linear", False)
    return zero.get("memory_efficient_linear") is False


def use_torch_linear() -> bool:
    """Put torch's ``F.linear`` back where a DeepSpeed ZeRO-3 ``Init`` of this process replaced it (its
    ``memory_efficient_linear``, which DeepSpeed leaves in place for the process); True when it was replaced."""
    import torch.nn.functional as F
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as Patcher

    original = getattr(Patcher, "linear_bk", None)
    if original is None or F.linear is original:
        return False
    F.linear = original
    return True


def kept_inputs_bytes(al, model, model_config, stage: int) -> float:
    """Bytes per token a whole block of this run keeps beyond its calibrated count (``Model.kept_input_bytes``):
    ZeRO-3 hooks its submodules without leaf blocks (:func:`uses_leaf_blocks`), and LoRA wraps its target Linear
    layers."""
    lora = al.lora
    wrapped = targets_for(model).resolve(lora.targets) if lora.enabled else ()
    return model.kept_input_bytes(model_config, hooked=stage == 3 and not uses_leaf_blocks(al, stage),
                                  wrapped=wrapped, adapter_rank=lora.rank if lora.enabled else 0,
                                  adapter_dropout=lora.enabled and lora.dropout > 0)


def uses_leaf_blocks(al, stage: int) -> bool:
    """Whether the run's blocks are ZeRO-3 leaf modules: ``adaptive_load.zero3_leaf_blocks`` at stage 3, except
    under LoRA (a frozen base: see the field's doc)."""
    return stage == 3 and al.zero3_leaf_blocks and not al.lora.enabled


def _leaf_blocks(model, al, stage: int) -> list:
    """``adaptive_load.zero3_leaf_blocks`` on the model where :func:`uses_leaf_blocks`; the note, if any."""
    if uses_leaf_blocks(al, stage):
        set_leaf_blocks(model)
        return []
    if stage == 3 and al.lora.enabled and "zero3_leaf_blocks" in al.model_fields_set and al.zero3_leaf_blocks:
        return ["note: adaptive_load.zero3_leaf_blocks is off under LoRA (the frozen base gives the first block an "
                "input without a gradient, and ZeRO-3 would release a leaf block's parameters before its adapters' "
                "backward)"]
    return []


def set_leaf_blocks(model) -> int:
    """``adaptive_load.zero3_leaf_blocks``: every block of ``model.blocks`` (the family seam) a ZeRO-3 leaf module,
    before ``deepspeed.initialize`` installs its hooks; returns the count."""
    from deepspeed.utils import set_z3_leaf_module

    for block in model.blocks:
        set_z3_leaf_module(block, True)
    return len(model.blocks)


def leaf_block_count(model) -> int:
    """The model's ZeRO-3 leaf modules (DeepSpeed's flag; the summary and the profile bench report it)."""
    from deepspeed.utils import get_z3_leaf_modules

    return len(get_z3_leaf_modules(model))


def _checked(preset, model):
    """``model`` if it has the runtime's setters and split forward (the family seam), else a ModelError."""
    missing = missing_members(model)
    if missing:
        raise ModelError(f"model {preset.name}: {type(model).__name__} lacks {', '.join(missing)} of the runtime's "
                         "seam (ds_adaptive.models.family.DiffusionTransformer)")
    return model


def _capability(model, method: str, model_name: str, asked: str, lacking: str):
    """The model's optional ``method`` (a capability a family's model may offer), or a ConfigError naming the key."""
    fn = getattr(model, method, None)
    if fn is None:
        raise ConfigError(f"{asked} but model {model_name} {lacking}")
    return fn


def _checkpoint_attention(model, recompute, mode: str, model_name: str) -> list:
    """``recompute.attention`` as the sampler resolved it (``mode``: ``auto`` planned both) on the model (a
    family's model that can keep its attention core in a checkpointed block offers ``set_checkpoint_attention``);
    the launcher's note, if any."""
    if mode == "recompute":
        return []
    asked = recompute.attention
    _capability(model, "set_checkpoint_attention", model_name,
                f"adaptive_load.recompute.attention is '{asked}'" + (f" (planned '{mode}')" if asked != mode
                                                                             else ""),
                "cannot keep its attention in a checkpointed block; set it to 'recompute'")(mode)
    if recompute.blocks == "none":
        return ["note: adaptive_load.recompute.attention 'keep' does nothing with recompute.blocks 'none' "
                "(no block is checkpointed)"]
    return ["checkpoint_attention 'keep': a checkpointed block keeps its self-attention output; backward recomputes "
            "the rest of the block, not the attention"]


def _block_fusion(model, mode: str, model_name: str) -> list:
    """``adaptive_load.block_fusion`` on the model (a family's model that has compiled block pieces offers
    ``apply_block_fusion``); the launcher's note, if any."""
    if mode == "off":
        return []
    note = _capability(model, "apply_block_fusion", model_name, f"adaptive_load.block_fusion is '{mode}'",
                       "has no compiled block pieces; set it to 'off'")(mode)
    return [note] if note else []


def _init_from(model, path: str, preset) -> str:
    """``--init-from``: pretrained weights into the (possibly ZeRO-3-partitioned) model, every rank, through
    the family's weight adapter; no rank holds the full model. A diffusers pipeline directory gives the
    model's own folder (``transformer`` / ``transformer_2``). Returns the log line."""
    info = preset.weights.init_from(model, path, subfolder=preset.subfolder)
    return (f"--init-from {info['path']}: {info['tensors']} tensors loaded ({info['layout']} layout"
            f"{', block by block into ZeRO-3 partitions' if info['zero3'] else ''})")


def _sparse_backend(cfg: RunConfig, model_config, shapes, device: torch.device, dtype: torch.dtype, notes: list):
    """The sparse-attention backend for this device (None: sparse attention off). What the trainer
    would reject (``sparse.backends.check_sparse_config``) is a :class:`ConfigError` here, before
    anything is built; the start-up lines (the backend and why; where sparse will not run) go to
    ``notes``. ``auto`` on a GPU measures the candidates it has no cached measurement for."""
    sa = cfg.adaptive_load.sparse_attention
    if not sa.enabled:
        return None

    n = model_config.num_layers
    longest = max((sh.tokens for sh in shapes.unique), default=None)
    problems = check_sparse_config(sa, n, device.type, head_dim=model_config.head_dim, dtype=dtype,
                                   max_tokens=longest)
    if problems:
        raise ConfigError(problems[0])
    notes.extend(sparse_config_notes(sa, n))
    dist = torch.distributed
    multi = device.type != "meta" and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    choice = None
    if not multi or dist.get_rank() == 0:
        choice = select_backend(sa.backend, device, dtype=dtype, head_dim=model_config.head_dim,
                                block_size=sa.block_size, measure=device.type == "cuda",
                                num_heads=model_config.num_heads)
    if multi:  # one choice and one curve for every rank: the plans must be identical

        msg = [None if choice is None else (choice.backend.name, choice.line, choice.fallback, choice.curve)]
        dist.broadcast_object_list(msg, src=0)
        name, line, fallback, curve = msg[0]
        choice = BackendChoice(get_backend(name), sa.backend, line, fallback=fallback, curve=curve)
    notes.append(choice.line)
    return choice


def sparse_decision_cost(sa, model_config, choice, device: torch.device, dtype: torch.dtype):
    """The sparse cost every density 1 (the dense cost exactly), with the chosen backend's efficiency
    curve and the config's block / sink / ``dense_above``: what the sampler plans with and (its
    densities replaced by the profiled ones) what the runtime decides with, so both make the same
    per-layer decision (``SparseAttentionCost.layer_decisions``)."""
    n, h = model_config.num_layers, model_config.num_heads
    dense = sa.dense_layers if sa.dense_layers is not None else sorted({0, n - 1})
    ones = DensityMap(tuple((1.0,) * h for _ in range(n)), dense_layers=tuple(i for i in dense if 0 <= i < n),
                      source="initial (dense) densities")
    backend = choice.backend
    eff = choice.curve or backend.efficiency(device if device.type != "meta" else "cuda", dtype=dtype,
                                             head_dim=model_config.head_dim, block_size=sa.block_size)
    # selection None: the profile's measured selection cost when it has one for this block size and
    # scoring (CostModel / for_profile fill it), else the shipped default
    return SparseAttentionCost(densities=ones, efficiency=eff, block_size=sa.block_size, block_score=sa.block_score,
                               min_blocks=1 + int(sa.keep_sink), dense_above=sa.dense_above,
                               # a reference backend runs for exactness, not speed: no pay check
                               pay_check=not backend.support.materialises_scores,
                               context_parallel=ContextParallelCost.from_config(sa, model_config.head_dim))


def _sparse_cost(cfg: RunConfig, notes: list, sparse_cost):
    """The sampler's sparse-attention cost when sparse attention feeds its densities to the balancers
    (``sparse_attention.rebalance``): ``sparse_cost`` (every density 1 at the start, which is the
    dense cost exactly: the first plan is the dense plan); the trainer hands the profiled densities
    over later. None when off, or with a cost model that has no sparse term (a note says so)."""
    sa = cfg.adaptive_load.sparse_attention
    if sparse_cost is None or sa.rebalance == "off":
        return None
    cost_model = cfg.adaptive_load.sampler.cost_model
    if cost_model != "calibrated":
        notes.append(f"note: adaptive_load.sparse_attention.rebalance is '{sa.rebalance}' but sampler.cost_model is "
                     f"'{cost_model}': the sampler plans dense costs (the sparse cost needs 'calibrated'); the "
                     "Ulysses head placement still follows the profiled densities")
        return None
    return sparse_cost


def _attach_sparse(cfg: RunConfig, model, layout: Layout, device: torch.device, sampler, choice, sparse_cost):
    """The sparse-attention runtime on the model (after Ulysses) with the chosen backend and, as its
    decision, the sampler's sparse cost (or ``sparse_cost`` with the plan's profile when the sampler
    plans dense costs): what runs is what the planner costs."""
    if choice is None:
        return None

    decision = sampler.cost.sparse or sparse_cost.for_profile(sampler.cost.profile)
    return attach_sparse_attention(model, cfg.adaptive_load.sparse_attention, layout=layout, device=device,
                                   choice=choice, decision=decision)


def run_ln_modulate_path(fused_requested: bool, device_type: str = "cuda") -> str:
    """The LayerNorm-modulate path a run's model computes with, for matching the profile's memory entries:
    ``fused`` when ``adaptive_load.fused_ln_modulate`` asks for it, the run computes on CUDA (``meta``: a dry run
    of a GPU launch; the op has no CPU path) and DS_ADAPTIVE_LN_MODULATE does not force the reference, else
    ``reference``. (A CUDA op that fails to build also falls back; the trainer's summary reports that from the
    op's call counts.)"""
    on_cuda = device_type in ("cuda", "meta")
    return "fused" if fused_requested and on_cuda and get_mode() != "reference" else "reference"


def _build_sampler(cfg: RunConfig, shapes, layout: Layout, ds_config: dict, gpu_mem_gib, notes: list, *,
                   model_config=None, sparse_cost=None, device: Optional[torch.device] = None, meta: bool = False,
                   adapter_params=None, ema_params=None) -> tuple:
    """``(the batch sampler, its RunPlan)``; with ``--layers`` the profile is rescaled to the trained depth (or, when it
    cannot be, used at full depth with a note). With sparse attention rebalancing, it plans with the
    sparse cost (:func:`_sparse_cost`) when the profile has the trained model's layers. ``profile: auto``
    on a GPU / model / LayerNorm-modulate path with no shipped profile, and ``profile: calibrate``, plan with
    the start-up calibration (rank 0 measures or reads the cache, every rank gets its result:
    :func:`ds_adaptive.calibration.autocalibrate.startup_profile`; collective when torch.distributed is up)."""
    t, s = cfg.trainer, cfg.adaptive_load.sampler
    stage = _zero_stage(ds_config)
    gas = ds_config["gradient_accumulation_steps"]   # an int, or "auto": the sampler chooses it
    ln_path = run_ln_modulate_path(cfg.adaptive_load.fused_ln_modulate, (device or torch.device("cpu")).type)
    fusion = planned_block_fusion(cfg.adaptive_load.block_fusion, (device or torch.device("cpu")).type)
    calibrated = startup_profile(s.profile, model_name=t.model, ln_modulate=ln_path, cache=s.profile_cache, meta=meta,
                                 device=device or torch.device("cpu"), notes=notes, block_fusion=fusion)
    model = get_model(t.model)
    kw = dict(micro_steps_per_step=gas if gas == "auto" else int(gas), enabled=cfg.adaptive_load.enabled,
              gpu_mem_gib=gpu_mem_gib, model_name=t.model, zero_stage=stage, profile_log=notes.append,
              ln_modulate=ln_path, profile=calibrated, adapter_params=adapter_params,
              per_token_timesteps=model.trains_per_token_timesteps(model.objective_with(t.objective)),
              block_fusion=fusion, ema_params=ema_params, recompute=cfg.adaptive_load.recompute,
              optimization=cfg.adaptive_load.optimization,
              kept_inputs_bytes=kept_inputs_bytes(cfg.adaptive_load, model, model_config, stage))
    sparse = _sparse_cost(cfg, notes, sparse_cost)
    try:
        sampler = build_batch_sampler(cfg.adaptive_load.sampler, shapes, layout, num_layers=t.layers, sparse=sparse,
                                      **kw)
    except ProfileDepthError as exc:
        notes.append(f"warning: {exc}; planning with the profile's full-depth costs and memory (conservative: "
                     "smaller micro-batches than --layers needs)")
        sampler = build_batch_sampler(cfg.adaptive_load.sampler, shapes, layout, **kw)
    except ValueError as exc:  # the profile's depth is not the model's: no per-layer sparse cost
        if sparse is None:
            raise
        notes.append(f"note: sparse-aware planning is off ({exc}); the sampler plans dense costs, the head "
                     "placement still follows the profiled densities")
        sampler = build_batch_sampler(cfg.adaptive_load.sampler, shapes, layout, num_layers=t.layers, **kw)
    prof = sampler.cost.profile
    if prof.rescaled_from_layers is not None:
        name = cfg.adaptive_load.sampler.profile
        if name in ("auto", "calibrate"):  # the resolved profile's own name (with_num_layers appends "-<n>blocks")
            name = prof.name.removesuffix(f"-{prof.num_layers}blocks")
        notes.append(f"profile '{name}' describes {prof.rescaled_from_layers} blocks; "
                     f"rescaled to --layers {prof.num_layers} for planning (Profile.with_num_layers: block compute "
                     f"and activation terms x {prof.num_layers}/{prof.rescaled_from_layers}, embed/head kept, "
                     f"static memory of {prof.params / 1e9:.3f}B params)")
    model_blocks = model_config.num_layers if model_config is not None else prof.num_layers
    note = _gas_note(sampler) if gas == "auto" else None
    plan = RunPlan.from_sampler(sampler, budget_note=note, sparse_layers=_sparse_layers(sparse_cost, model_blocks))
    on_cpu = device is not None and device.type == "cpu"   # nothing to act on: no GPU profile of the model there
    if plan.checkpointing == "auto" and prof.num_layers != model_blocks and not on_cpu:
        notes.append(f"checkpointing auto: the plan's checkpoint counts are for the profile's {prof.num_layers} "
                     f"blocks; the model has {model_blocks}: each count is mapped to the same share of its blocks "
                     "(rounded up; pass --layers to plan at the model's depth)")
    if gas == "auto":   # DeepSpeed runs what the sampler plans (the Trainer checks the engine agrees)
        ds_config["gradient_accumulation_steps"] = plan.gas
        notes.append(note)
    elif plan.gas != kw["micro_steps_per_step"]:
        raise RuntimeError(f"the batch sampler plans {plan.gas} micro-steps per step, "
                           f"DeepSpeed runs {kw['micro_steps_per_step']}")
    return sampler, plan


def _sparse_layers(sparse_cost, num_layers: int):
    """The layers outside ``sparse_attention.dense_layers`` (the decision cost's, as the runtime's schedule reads the
    config), or None when sparse attention is off."""
    if sparse_cost is None:
        return None
    dense = set(sparse_cost.densities.dense_layers)
    return tuple(i for i in range(num_layers) if i not in dense)


def _gas_note(sampler) -> str:
    """The launcher's line for ``gradient_accumulation_steps: auto``."""
    c = sampler.budget_choice
    gas, m_comp = sampler.micro_steps_per_step, sampler.params.m_comp   # after the global-batch check's re-fit / re-aim
    if c is None:
        return (f"gradient_accumulation_steps auto -> {gas} (no compute-budget search: "
                f"m_comp {m_comp} {sampler.cost.unit})" + _global_batch_note(sampler))
    if c.plan_mode == "tokens":
        return (f"gradient_accumulation_steps auto -> {gas}: equal-token batches (max_tokens "
                f"{sampler.params.max_tokens}); the budget search predicts the equal-token plan faster than every "
                f"balanced one ({c.equal_token_tokens_per_s:,.0f} vs {max(r['tokens_per_s'] for r in c.candidates):,.0f} "
                f"tokens/s over {c.samples_planned} samples)")
    refit = f" (the search's {c.micro_steps_per_step}, re-fitted to the global batch)" if gas != c.micro_steps_per_step else ""
    aimed = f" (the search's {c.m_comp:.0f}, re-aimed at the global batch)" if abs(m_comp - c.m_comp) > 0.5 else ""
    return (f"gradient_accumulation_steps auto -> {gas}{refit}, m_comp auto -> {m_comp:.0f} ms{aimed} per "
            f"micro-batch{', each shape capped at its lowest time per sample' if c.efficient_batches else ''} "
            f"(throughput-optimal of {len(c.candidates)} candidates over {c.samples_planned} samples: "
            f"predicted {c.predicted_tokens_per_s:,.0f} tokens/s, {c.predicted_tokens_per_s / c.reference_tokens_per_s:.3f}x "
            f"the longest-sample budget {c.reference_m_comp:.0f} ms at 1 micro-step per step"
            + (f", {c.predicted_tokens_per_s / c.equal_token_tokens_per_s:.3f}x the equal-token plan"
               if c.equal_token_tokens_per_s else "")
            + f"; overheads {sampler.cost.profile.overhead_source})" + _global_batch_note(sampler))


def _global_batch_note(sampler) -> str:
    """`` for global_batch samples N: ...`` when the run sets one (the sampler's checked fit)."""
    gb, fit = getattr(sampler, "global_batch", None), getattr(sampler, "global_batch_fit", None)
    if gb is None or not fit:
        return ""
    return (f"; for global_batch {gb.by} {gb.value:,}: {fit['gas']} micro-steps x {fit['per_micro']:,.0f} {gb.by} "
            f"per micro-step = {fit['predicted']:,.0f} per optimizer step ({fit['error']:.1%} off)")
