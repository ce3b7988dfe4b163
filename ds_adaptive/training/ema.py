"""An exponential moving average of the trained weights, partitioned like them (``adaptive_load.ema``).

    ema = EmaState.attach(run, engine, log)    # after deepspeed.initialize (and a resume's load); None when off
    ema.after_step(step)                       # every rank, after each optimizer step
    with ema.swapped():                        # every rank: the model computes with the EMA (previews, validation)
        ...
    ema.save(tag_dir); ema.load(tag_dir)       # every rank, inside a checkpoint (files ema_rank*.pt)
    full = consolidate(tag_dir)                # {parameter name: fp32 tensor}: `export --ema`, `sample --ema`

**Partitions.** Every averaged parameter is cut into ``parts`` slices of its flattened elements, ``ceil(numel /
parts)`` each (the last shorter), and each rank keeps the fp32 average of its own slice only. Under ZeRO-3 the
slices are DeepSpeed's: a rank's slice is the valid part of ``param.ds_tensor`` (its partition, padding left out),
``parts`` the parameter's partition group; a 14B model's EMA takes 4 bytes per parameter / ranks, like its
optimizer state, and no rank ever holds the whole average. Below stage 3 (full parameters on every rank) the world
is cut the same way. The memory model counts ``4 x averaged parameters / ranks`` bytes per rank
(``Profile.with_ema``), on the accelerator or, with ``ema.device: cpu``, on the host.

**Updates** run after the optimizer step, on the rank's slice of the weights the optimizer just wrote (ZeRO-3:
the partition in the model's dtype): ``ema += (1 - decay) (weights - ema)`` in fp32 (``torch.lerp``), at steps
``start_step + k * every`` (k >= 1). The average starts as a copy of the weights at ``start_step`` (0: the initial
weights). Resume is exact: the slices and the update count are saved bit for bit.

**Swapping in.** :meth:`EmaState.swapped` writes the average into the weights (ZeRO-3: into each rank's partition,
then re-gathers the parameters ZeRO-3 keeps gathered, ``ds_persist``; below stage 3 the slices are all-gathered
into the full parameters) and puts the trained weights back afterwards, bit for bit: the optimizer's fp32 master
weights are never touched. A collective: every rank enters it.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from ds_adaptive.core.config import ConfigError

__all__ = ["EmaState", "EmaError", "EMA_FORMAT", "EMA_CLIENT_KEY", "consolidate", "ema_files", "select_parameters",
           "slice_bounds", "EMA_BYTES_PER_PARAM"]

EMA_FORMAT = "ds_adaptive.ema/1"
EMA_CLIENT_KEY = "ema"
"""Key of the EMA record inside the trainer's ``ds_adaptive`` client state."""
EMA_BYTES_PER_PARAM = 4
"""The average is kept in fp32."""
_FILE = "ema_rank{rank:05d}.pt"


class EmaError(ConfigError):
    """An EMA setting, checkpoint or file that cannot be used; the message names it and what to do."""


def ema_files(tag_dir) -> list[Path]:
    """The EMA files of a checkpoint directory (one per rank), in rank order."""
    return sorted(Path(tag_dir).glob("ema_rank*.pt"))


def slice_bounds(numel: int, part: int, parts: int) -> tuple[int, int]:
    """``(start, length)`` of slice ``part`` of ``parts`` of a flattened tensor of ``numel`` elements: ZeRO-3's
    partitioning (``ceil(numel / parts)`` elements each, the padding of the last ones left out)."""
    size = -(-int(numel) // int(parts))
    start = int(part) * size
    return start, max(0, min(size, int(numel) - start))


def select_parameters(model: torch.nn.Module, which: str) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters ``ema.parameters`` averages: ``all`` every one with ``requires_grad``; ``lora`` the adapters."""
    if which == "lora":
        out = [(n, p) for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n]
        if not out:
            raise EmaError("adaptive_load.ema.parameters is 'lora' but the model has no LoRA adapters; enable "
                           "adaptive_load.lora or set ema.parameters to 'all'")
        return out
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _strip(names: list[str]) -> Callable[[str], str]:
    """A run under Ulysses SP may wrap the model (``wrapper.model``): names as the exported model has them."""
    wrapped = bool(names) and all(n.startswith("model.") for n in names)
    return (lambda n: n[len("model."):]) if wrapped else (lambda n: n)


@dataclass
class _Slot:
    name: str
    param: torch.nn.Parameter
    start: int
    length: int
    zero3: bool

    @property
    def numel(self) -> int:
        return int(self.param.ds_numel if self.zero3 else self.param.numel())

    @property
    def shape(self) -> tuple:
        return tuple(self.param.ds_shape if self.zero3 else self.param.shape)

    def local(self) -> torch.Tensor:
        """This rank's slice of the weights (a view: ZeRO-3's partition, or the full parameter's elements)."""
        flat = (self.param.ds_tensor.data if self.zero3 else self.param.data).view(-1)
        return flat[:self.length] if self.zero3 else flat[self.start:self.start + self.length]


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None


class EmaState:
    """This rank's slices of the average of ``params`` (see the module doc)."""

    def __init__(self, cfg, params: list[tuple[str, torch.nn.Parameter]], *, device: torch.device,
                 log: Callable[[str], None] = print) -> None:
        if not params:
            raise EmaError("adaptive_load.ema: the model has no trained parameter to average")
        self.cfg, self.device, self.log = cfg, torch.device(device), log
        dist = _dist()
        self.rank = dist.get_rank() if dist is not None else 0
        self.zero3 = all(hasattr(p, "ds_tensor") for _, p in params)
        if self.zero3:
            self.part = int(params[0][1].ds_zero_partition_rank)
            self.parts = int(params[0][1].ds_zero_partition_world_size)
        else:
            self.part, self.parts = self.rank, (dist.get_world_size() if dist is not None else 1)
        self.slots: list[_Slot] = []
        for name, p in params:
            numel = int(p.ds_numel) if self.zero3 else p.numel()
            if self.zero3 and int(p.ds_zero_partition_world_size) != self.parts:
                raise EmaError(f"parameter {name} is partitioned over {p.ds_zero_partition_world_size} ranks, "
                               f"others over {self.parts}: the EMA needs one ZeRO-3 partition group")
            start, length = slice_bounds(numel, self.part, self.parts)
            self.slots.append(_Slot(name, p, start, length, self.zero3))
        with torch.no_grad():
            self.tensors = [s.local().detach().to(self.device, torch.float32, copy=True) for s in self.slots]
        self.updates, self.last_step = 0, None
        self.predicted_bytes: Optional[float] = None   # what the memory model counts for this rank's slices

    # ---------------------------------------------------------------- construction from a run
    @classmethod
    def attach(cls, run, engine, log: Callable[[str], None] = print) -> Optional["EmaState"]:
        """The EMA of ``run`` (None when ``adaptive_load.ema`` is null), on the device ``build_run`` placed it
        (``run.ema_device``), started from the engine's current weights."""
        cfg = run.cfg.adaptive_load.ema
        if cfg is None:
            return None
        state = cls(cfg, select_parameters(engine.module, cfg.parameters), device=run.ema_device, log=log)
        part = run.profile.static_memory_parts(run.zero_stage, run.layout.world).get("ema")
        state.predicted_bytes = None if part is None else part * 2**30   # the plan's term (None: on the host)
        log(f"ds_adaptive: {state.describe()}")
        return state

    def describe(self) -> str:
        c = self.cfg
        return (f"EMA decay {c.decay:g} every {c.every} step(s) from step {c.start_step}: {self.numel_total():,} "
                f"parameters ({c.parameters}), this rank's slice {self.nbytes() / 2**20:.1f} MiB fp32 on {self.device} "
                f"(slice {self.part} of {self.parts}{', ZeRO-3 partitions' if self.zero3 else ''})")

    def numel_total(self) -> int:
        """Averaged parameters (all ranks)."""
        return sum(s.numel for s in self.slots)

    def nbytes(self) -> int:
        """Bytes of this rank's slices (what the memory model predicts)."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    # ---------------------------------------------------------------- updates
    def due(self, step: int) -> str:
        """What ``after_step(step)`` does: ``start`` (copy), ``update`` or ``""``."""
        c = self.cfg
        if step == c.start_step and c.start_step > 0:
            return "start"
        if step > c.start_step and (step - c.start_step) % c.every == 0:
            return "update"
        return ""

    @torch.no_grad()
    def after_step(self, step: int) -> str:
        """After optimizer step ``step`` (every rank; no collective): start or update the average when due."""
        what = self.due(step)
        if what == "start":
            for t, s in zip(self.tensors, self.slots):
                t.copy_(s.local())
        elif what == "update":
            weight = 1.0 - float(self.cfg.decay)   # one fused launch per list (hundreds of tensors on a GPU)
            torch._foreach_lerp_(self.tensors, [s.local().to(t.device, torch.float32)
                                                for t, s in zip(self.tensors, self.slots)], weight)
            self.updates += 1
        if what:
            self.last_step = int(step)
        return what

    # ---------------------------------------------------------------- the average in the model
    @contextmanager
    def swapped(self) -> Iterator[None]:
        """Inside: the model's weights are the average; after: the trained weights, bit for bit. Every rank."""
        with torch.no_grad():
            if self.zero3:
                stash = [s.local().detach().clone() for s in self.slots]
                for t, s in zip(self.tensors, self.slots):
                    s.local().copy_(t)
                self._regather()
            else:
                stash = [s.param.data.detach().clone() for s in self.slots]
                self._write_full()
        try:
            yield
        finally:
            with torch.no_grad():
                if self.zero3:
                    for old, s in zip(stash, self.slots):
                        s.local().copy_(old)
                    self._regather()
                else:
                    for old, s in zip(stash, self.slots):
                        s.param.data.copy_(old)

    def _regather(self) -> None:
        """ZeRO-3 parameters that are gathered now (``ds_persist``: small ones ZeRO-3 keeps whole) are rebuilt from
        the partitions: freed (the partition is kept), then all-gathered. A collective."""
        whole = [s.param for s in self.slots if s.param.ds_status.name == "AVAILABLE"]
        if whole:
            whole[0].partition(param_list=whole)
            whole[0].all_gather(param_list=whole)

    def _write_full(self) -> None:
        """Below ZeRO-3: every rank's slices all-gathered into the full parameters."""
        dist = _dist()
        for t, s in zip(self.tensors, self.slots):
            size = -(-s.numel // self.parts)
            mine = torch.zeros(size, dtype=torch.float32, device=s.param.device)
            mine[:s.length] = t
            if dist is None:
                full = mine
            else:
                parts = [torch.empty_like(mine) for _ in range(self.parts)]
                dist.all_gather(parts, mine)
                full = torch.cat(parts)
            s.param.data.copy_(full[:s.numel].view(s.shape))

    # ---------------------------------------------------------------- checkpoints
    def record(self) -> dict:
        """The small record in the checkpoint's client state (:data:`EMA_CLIENT_KEY`)."""
        c = self.cfg
        return {"format": EMA_FORMAT, "decay": c.decay, "every": c.every, "start_step": c.start_step,
                "parameters": c.parameters, "updates": self.updates, "last_step": self.last_step,
                "parts": self.parts, "zero3": self.zero3, "numel": self.numel_total()}

    def state_dict(self) -> dict:
        """This rank's file: the record, and per parameter its slice (fp32) and bounds."""
        names = [s.name for s in self.slots]
        plain = _strip(names)
        return {**self.record(), "rank": self.rank, "part": self.part,
                "slices": {plain(s.name): [s.start, s.length, s.numel, list(s.shape)] for s in self.slots},
                "tensors": {plain(s.name): t.detach().cpu() for s, t in zip(self.slots, self.tensors)}}

    def save(self, tag_dir) -> Path:
        """Write this rank's slices into the checkpoint directory ``tag_dir`` (every rank)."""
        path = Path(tag_dir) / _FILE.format(rank=self.rank)
        torch.save(self.state_dict(), path)
        return path

    @torch.no_grad()
    def load(self, tag_dir) -> str:
        """Restore the average from the checkpoint directory ``tag_dir``: this rank's own file when the checkpoint
        was cut into as many slices (exact), else the slices re-cut from every rank's file (another world size).
        A checkpoint without an EMA leaves the average at the resumed weights. Returns the log line."""
        tag_dir = Path(tag_dir)
        files = ema_files(tag_dir)
        if not files:
            for t, s in zip(self.tensors, self.slots):
                t.copy_(s.local())
            return (f"EMA: checkpoint {tag_dir} holds no EMA (written without adaptive_load.ema): the average starts "
                    "from the resumed weights")
        own = tag_dir / _FILE.format(rank=self.rank)
        state = _read(own) if own.is_file() else None
        plain = _strip([s.name for s in self.slots])
        if state is not None and state["parts"] == self.parts and state["part"] == self.part:
            self._check_names(state["slices"], plain, own)
            for s, t in zip(self.slots, self.tensors):
                t.copy_(state["tensors"][plain(s.name)])
            how = "exactly"
        else:
            full = consolidate(tag_dir)
            self._check_names(full, plain, tag_dir)
            for s, t in zip(self.slots, self.tensors):
                t.copy_(full[plain(s.name)].reshape(-1)[s.start:s.start + s.length])
            state = _read(files[0])
            how = f"re-cut from {state['parts']} slices into {self.parts}"
        self.updates, self.last_step = int(state["updates"]), state["last_step"]
        return f"EMA restored from {tag_dir} ({how}; {self.updates} updates, the last after step {self.last_step})"

    def _check_names(self, saved, plain, where) -> None:
        mine = {plain(s.name) for s in self.slots}
        if set(saved) != mine:
            missing, extra = sorted(mine - set(saved))[:3], sorted(set(saved) - mine)[:3]
            raise EmaError(f"the EMA in {where} averages other parameters than this run (missing {missing}, not in "
                           f"this model {extra}): another model, --layers or ema.parameters; resume with the "
                           "settings of the checkpoint")

    def summary(self) -> dict:
        """For the run summary."""
        return {**self.record(), "bytes_per_rank": self.nbytes(), "predicted_bytes_per_rank": self.predicted_bytes,
                "device": str(self.device)}


def _read(path: Path) -> dict:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - unreadable for whatever reason: one message
        raise EmaError(f"{path} cannot be read ({type(exc).__name__}: {exc}); the checkpoint is truncated or "
                       "corrupt") from None
    if not isinstance(state, dict) or state.get("format") != EMA_FORMAT:
        raise EmaError(f"{path} is not an EMA file of this ds_adaptive (format {EMA_FORMAT})")
    return state


def consolidate(tag_dir) -> dict[str, torch.Tensor]:
    """``{parameter name: full fp32 tensor}`` of the EMA in the checkpoint directory ``tag_dir``: every rank's slices
    put together (one copy of each slice; slices must cover every element). An :class:`EmaError` names what is
    missing (no EMA files: the run had no ``adaptive_load.ema``)."""
    files = ema_files(tag_dir)
    if not files:
        raise EmaError(f"checkpoint {tag_dir} holds no EMA (no ema_rank*.pt): it was trained without "
                       "adaptive_load.ema; export or sample it without --ema")
    parts: dict[int, dict] = {}
    for f in files:
        state = _read(f)
        parts.setdefault(int(state["part"]), state)
    n = int(next(iter(parts.values()))["parts"])
    if sorted(parts) != list(range(n)):
        raise EmaError(f"checkpoint {tag_dir}: the EMA is cut into {n} slices but the files hold slices "
                       f"{sorted(parts)}; a rank's ema_rank*.pt is missing")
    out = {}
    first = parts[0]
    for name, (_, _, numel, shape) in first["slices"].items():
        flat = torch.cat([parts[k]["tensors"][name].reshape(-1) for k in range(n)])
        if flat.numel() != numel or math.prod(shape) != numel:
            raise EmaError(f"checkpoint {tag_dir}: the EMA slices of {name} hold {flat.numel()} elements, the "
                           f"parameter has {numel}; the EMA files do not belong together")
        out[name] = flat.view(shape).clone()
    return out
