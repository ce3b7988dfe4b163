"""The adaptive sampler inside Megatron's data pipeline (``--dataloader-type external``).

With ``--dataloader-type external`` Megatron's ``build_pretraining_data_loader`` returns the
object the ``train_valid_test_datasets_provider`` gave it unchanged, and the training loop calls
``next()`` on it once per micro-batch (``get_num_microbatches()`` per optimizer step). So the
provider returns a :class:`MegatronAdaptiveLoader`::

    from ds_adaptive.integrations.megatron import build_external_dataloader

    def train_valid_test_datasets_provider(train_val_test_num_samples):
        train_ds = MyVideoDataset(...)            # has sample_shapes() or sample_token_lengths()
        loader = build_external_dataloader(train_ds, sampler_cfg, collate_fn=collate)
        return loader, None, None

Ranks come from megatron-core's ``parallel_state`` (data-parallel rank/size; the context-parallel
group plays the role of the Ulysses group: its ranks get identical batches). Tensor- and
pipeline-parallel ranks of one model replica share a data-parallel rank and get the same
batches. Variable micro-batch shapes need ``pipeline_model_parallel_size == 1`` (or
``--variable-seq-lengths``): pipeline p2p buffers are sized from the micro-batch shape.

The dataset protocol (:class:`ShapedDataset`): ``__len__``, ``__getitem__`` and either
``sample_shapes() -> Sequence[SampleShape]`` (video/image datasets) or
``sample_token_lengths() -> Sequence[int]`` (plain sequences), both without loading tensors.

Checkpoints: the loader state is tiny and the same on every rank. Put it into Megatron's
checkpoint state dict with :func:`add_sampler_state` (e.g. from a ``save_checkpoint`` wrapper or
your own checkpoint code) and restore it with :func:`restore_sampler_state`; or keep a sidecar
json next to the checkpoint with :func:`save_sampler_state` / :func:`load_sampler_state`.
This module deliberately does not monkeypatch Megatron's checkpointing.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Protocol, Sequence, Union, runtime_checkable

from ds_adaptive.core.config import AdaptiveLoadConfig, OptimizationConfig, RecomputeConfig, SamplerConfig
from ds_adaptive.planning.planner import StepTotals
from ds_adaptive.planning.sampler import build_batch_sampler
from ds_adaptive.core.layout import Layout
from ds_adaptive.core.shapes import IndexedShapes, SampleShape

STATE_KEY = "ds_adaptive_sampler"
SIDECAR_NAME = "ds_adaptive_sampler.json"


@runtime_checkable
class ShapedDataset(Protocol):
    """A map-style dataset that tells each sample's shape without loading it."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


def dataset_shapes(dataset: Any) -> Sequence[Union[SampleShape, int]]:
    """Per-sample buckets of a dataset: ``sample_shapes()`` (SampleShape) or
    ``sample_token_lengths()`` (ints); checked against ``len(dataset)``."""
    indexed = IndexedShapes.of_dataset(dataset)   # unique_shapes() + shape_ids(): no object per sample
    if indexed is not None:
        shapes, kind = indexed, "shape_ids()"
    elif hasattr(dataset, "sample_shapes"):
        shapes = list(dataset.sample_shapes())
        kind = "sample_shapes()"
    elif hasattr(dataset, "sample_token_lengths"):
        shapes = [int(n) for n in dataset.sample_token_lengths()]
        kind = "sample_token_lengths()"
    else:
        raise TypeError(
            f"{type(dataset).__name__} does not tell its sample sizes: the adaptive sampler needs "
            "dataset.sample_shapes() -> [SampleShape] (video/image) or dataset.sample_token_lengths() "
            "-> [int], computed without loading the samples")
    if len(shapes) != len(dataset):
        raise ValueError(f"{type(dataset).__name__}.{kind} gave {len(shapes)} entries but len(dataset) "
                         f"is {len(dataset)}: one entry per sample is needed")
    for i, s in enumerate(shapes.unique if isinstance(shapes, IndexedShapes) else shapes):
        if not isinstance(s, (SampleShape, int)) or (isinstance(s, int) and s < 1):
            raise ValueError(f"{type(dataset).__name__}.{kind}[{i}] = {s!r}: expected a SampleShape "
                             "or a token length >= 1")
    return shapes


def _megatron_num_microbatches() -> int:
    try:
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        return int(get_num_microbatches())
    except Exception as exc:  # not initialised
        raise ValueError("micro_steps_per_step not given and Megatron's num-microbatches calculator is "
                         f"not initialised ({exc}); pass micro_steps_per_step=get_num_microbatches()") from None


class MegatronAdaptiveLoader:
    """An endless iterator over this rank's micro-batches, epoch after epoch, with resumable state.

    ``next(loader)`` returns the collated micro-batch; ``current_step_totals`` are the global
    counts of the optimizer step that batch belongs to (loss weighting / LR scaling). ``recompute`` /
    ``optimization``: the ``adaptive_load.recompute`` / ``adaptive_load.optimization`` blocks (the checkpoint
    policy the plan counts; the LR scaling of ``lr_scale``), their defaults when None.
    """

    def __init__(self, dataset: Any, sampler_cfg: Union[SamplerConfig, Mapping[str, Any]], *,
                 micro_steps_per_step: Optional[int] = None, layout: Optional[Layout] = None,
                 sp_size: Optional[int] = None, collate_fn: Optional[Callable] = None, num_workers: int = 0,
                 pin_memory: bool = False, enabled: bool = True, gpu_mem_gib: Optional[float] = None,
                 model_name: Optional[str] = None, zero_stage: Optional[int] = None,
                 recompute: Optional[Union[RecomputeConfig, Mapping[str, Any]]] = None,
                 optimization: Optional[Union[OptimizationConfig, Mapping[str, Any]]] = None) -> None:
        import torch.utils.data

        # validated as the block is: a sampler dict that still sets a moved key works (with its warning)
        block = AdaptiveLoadConfig.model_validate({"sampler": sampler_cfg, **{
            k: v for k, v in (("recompute", recompute), ("optimization", optimization)) if v is not None}})
        cfg = block.sampler
        self.dataset = dataset
        self.layout = layout or Layout.detect(sp_size)
        ga = micro_steps_per_step or _megatron_num_microbatches()
        self.sampler = build_batch_sampler(cfg, dataset_shapes(dataset), self.layout,
                                           micro_steps_per_step=ga, enabled=enabled, gpu_mem_gib=gpu_mem_gib,
                                           model_name=model_name, zero_stage=zero_stage,
                                           recompute=block.recompute, optimization=block.optimization)
        self._loader = torch.utils.data.DataLoader(dataset, batch_sampler=self.sampler, collate_fn=collate_fn,
                                                   num_workers=num_workers, pin_memory=pin_memory)
        self.epoch = 0
        self.micro_in_epoch = 0          # micro-batches handed out in this epoch (incl. resumed ones)
        self._it: Optional[Iterator] = None
        self._resumed_micro = 0

    @property
    def micro_steps_per_step(self) -> int:
        return self.sampler.micro_steps_per_step

    @property
    def step_in_epoch(self) -> int:
        """Optimizer steps of this epoch whose micro-batches were all handed out."""
        return self.micro_in_epoch // self.micro_steps_per_step

    @property
    def current_step_totals(self) -> StepTotals:
        """Global counts of the step of the micro-batch returned last."""
        return self.sampler.step_totals(max(self.micro_in_epoch - 1, 0) // self.micro_steps_per_step)

    def __iter__(self) -> "MegatronAdaptiveLoader":
        return self

    def __next__(self):
        for _ in range(2):
            if self._it is None:
                self.sampler.set_epoch(self.epoch)
                self._it = iter(self._loader)
            try:
                batch = next(self._it)
            except StopIteration:
                self._it = None
                self.epoch += 1
                self.micro_in_epoch = 0
                continue
            self.micro_in_epoch += 1
            return batch
        raise RuntimeError(f"epoch {self.epoch} has no micro-steps for this layout "
                           f"({len(self.dataset)} samples): the dataset is smaller than one optimizer step")

    def state_dict(self) -> dict:
        """State after the optimizer steps handed out so far (save after a complete step)."""
        if self.micro_in_epoch % self.micro_steps_per_step:
            warnings.warn(f"sampler state saved mid-step ({self.micro_in_epoch % self.micro_steps_per_step} "
                          f"of {self.micro_steps_per_step} micro-batches of step {self.step_in_epoch}); "
                          "resume restarts that step", stacklevel=2)
        if self._it is None and self.micro_in_epoch == 0:
            self.sampler.set_epoch(self.epoch)
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch,
                "sampler": self.sampler.state_dict(self.step_in_epoch)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume (possibly on another world size): the next micro-batch is the first of the
        saved step_in_epoch."""
        self.sampler.load_state_dict(state["sampler"])
        self.epoch = int(state["epoch"])
        self.micro_in_epoch = int(state["step_in_epoch"]) * self.micro_steps_per_step
        self._it = None
        self.sampler.set_epoch(self.epoch)
        self._it = iter(self._loader)


def build_external_dataloader(dataset: Any, sampler_cfg: Union[SamplerConfig, Mapping[str, Any]],
                              **kwargs: Any) -> MegatronAdaptiveLoader:
    """The object to return from Megatron's datasets provider with ``--dataloader-type external``;
    see :class:`MegatronAdaptiveLoader` for the keyword arguments."""
    return MegatronAdaptiveLoader(dataset, sampler_cfg, **kwargs)


def add_sampler_state(state_dict: dict, loader: MegatronAdaptiveLoader, key: str = STATE_KEY) -> dict:
    """Put the loader's state into a (Megatron) checkpoint state dict; returns it."""
    state_dict[key] = json.dumps(loader.state_dict())   # a string: safe for torch.load(weights_only)
    return state_dict


def restore_sampler_state(state_dict: Mapping[str, Any], loader: MegatronAdaptiveLoader,
                          key: str = STATE_KEY) -> bool:
    """Restore from a checkpoint state dict; False (and a warning) when it has no sampler state."""
    if key not in state_dict:
        warnings.warn(f"checkpoint has no '{key}' entry: the adaptive sampler starts epoch 0 afresh", stacklevel=2)
        return False
    raw = state_dict[key]
    loader.load_state_dict(json.loads(raw) if isinstance(raw, (str, bytes)) else raw)
    return True


def save_sampler_state(checkpoint_dir: Union[str, Path], loader: MegatronAdaptiveLoader) -> Path:
    """Write the sidecar json (call on one rank; the state is the same on all ranks)."""
    path = Path(checkpoint_dir) / SIDECAR_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(loader.state_dict()))
    tmp.replace(path)
    return path


def load_sampler_state(checkpoint_dir: Union[str, Path], loader: MegatronAdaptiveLoader) -> bool:
    path = Path(checkpoint_dir) / SIDECAR_NAME
    if not path.is_file():
        warnings.warn(f"{path} does not exist: the adaptive sampler starts epoch 0 afresh", stacklevel=2)
        return False
    loader.load_state_dict(json.loads(path.read_text()))
    return True
