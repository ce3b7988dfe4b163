"""Sample previews during training (``adaptive_load.preview``): fixed prompts and seeds, Euler sampler.

    preview = PreviewRunner.attach(run, engine=engine, metrics=metrics, log=log)   # None when off
    preview.after_step(step, last=step == steps)       # every rank, between optimizer steps

**Who generates.** Under ZeRO-3 every forward gathers each block's parameters with a collective over all
``dp x sp`` ranks, so every rank takes part in every preview forward: the prompts are dealt out to the
data-parallel ranks (prompt j to DP rank ``j % dp``; the ``sp`` ranks of a Ulysses group run their prompt
together, its tokens sharded, and each gets the whole prediction back) and every rank runs the same number
of generations with the same number of forwards each (a rank with fewer prompts repeats one and drops the
result). Whether classifier-free guidance runs as one batch of 2 or as two forwards is decided once for all
prompts, from the memory plan below, so the forward counts agree. Rank 0 gathers the finished latents,
decodes them with the VAE (when ``preview.vae`` is set; else a latent preview PNG), writes the files next
to the logs (``LOG_DIR/previews/``), a ``previews.jsonl`` record and TensorBoard / W&B images.

**Memory.** A preview runs between optimizer steps, when the training activations are freed: what it may
use is the plan's activation budget ``m_mem`` (a run planned at 95% of the GPU keeps that much free of
static memory). Its need is bounded by the memory model: the activations of a training micro-batch of the
same shape and batch with every block checkpointed (the fewest-memory training footprint, which includes a
block's backward) is more than a no-grad forward holds, plus the sampler's fp32 state. A prompt whose
bound exceeds ``m_mem`` at batch 1 is dropped with a message naming its shape; guidance runs batched only
when every prompt fits at batch 2. The measured peak and time are reported with the prediction, and the
allocator's cache is emptied afterwards, so the preview leaves no fragmentation to the next step.
"""
from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ds_adaptive.core.config import ConfigError
from ds_adaptive.models.flow_sampler import euler_sample, initial_noise
from ds_adaptive.models.objective import sample_seed
from ds_adaptive.core.shapes import InputSpec, SampleShape, ShapeError, default_input_spec
from ds_adaptive.core.files import save_safetensors
from ds_adaptive.planning.memory import fewest_memory_blocks
from ds_adaptive.planning.shape_table import dataset_shapes
from ds_adaptive.media.encode import EncoderError, load_vae
from ds_adaptive.media.write import frame_strip, latent_strip, write_media, write_png
from ds_adaptive.media.write import decode_latents

__all__ = ["PreviewPrompt", "PreviewPlan", "PreviewRunner", "load_prompts", "plan_previews", "preview_memory_gib",
           "load_embeddings", "save_embeddings", "preview_size", "pad_context"]

GIB = float(1 << 30)


@dataclass(frozen=True)
class PreviewPrompt:
    """One preview: its name, text embedding ``[L, text_dim]`` (fp32, CPU), video shape (the model's grid) and
    noise seed."""

    name: str
    context: torch.Tensor
    shape: SampleShape
    seed: int


ORDER_KEY = "ds_adaptive_prompts"
"""safetensors metadata key of :func:`save_embeddings`: the prompt names in their order (safetensors sorts keys)."""


def save_embeddings(table: dict[str, torch.Tensor], path) -> Path:
    """Write ``{name: [L, text_dim]}`` text embeddings as safetensors, keeping the order of ``table``."""
    return save_safetensors({k: v.detach().float().contiguous().cpu() for k, v in table.items()}, path,
                            metadata={"format": "pt", ORDER_KEY: json.dumps(list(table))})


def load_embeddings(path, *, what: str, spec: Optional[InputSpec] = None) -> dict[str, torch.Tensor]:
    """``{name: [L, text_dim] fp32}`` from a safetensors file of text embeddings, in the order
    :func:`save_embeddings` wrote them (other files: name order), checked against the model's text width and
    length (``spec``, default the default model's); errors name the file."""
    spec = spec or default_input_spec()
    from safetensors import safe_open

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what}: {p} does not exist; write one with `ds-adaptive sample --text-encoder DIR "
                          "--prompt TEXT --save-embeddings FILE`")
    try:
        with safe_open(str(p), framework="pt") as f:
            names = list(f.keys())
            order = json.loads((f.metadata() or {}).get(ORDER_KEY, "[]"))
            names = [n for n in order if n in names] + [n for n in names if n not in order]
            out = {k: f.get_tensor(k).float() for k in names}
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(f"{what}: {p} is not a readable safetensors file ({exc})") from None
    bad = [f"{k} {list(v.shape)}" for k, v in out.items() if v.dim() != 2 or v.shape[1] != spec.text_dim
           or not 1 <= v.shape[0] <= spec.text_len]
    if bad or not out:
        who = f" ({spec.model}'s text encoder)" if spec.model else ""
        raise ConfigError(f"{what}: {p} must hold text embeddings [L <= {spec.text_len}, {spec.text_dim}]{who}, one "
                          f"per prompt; got {bad[:3] or 'no tensor'}")
    return out


def preview_size(cfg, spec: InputSpec) -> Optional[SampleShape]:
    """``cfg.size`` (``config.PreviewConfig``) as a shape of the model's grid rule (None: unset); a
    :class:`ConfigError` naming the key and the model when the model cannot represent it."""
    if not cfg.size:
        return None
    try:
        return SampleShape.parse(cfg.size, where="adaptive_load.preview.size", grid=spec.grid)
    except ShapeError as exc:
        raise ConfigError(f"{exc}{f' (model {spec.model})' if spec.model else ''}") from None


def pad_context(context: torch.Tensor, text_len: int) -> torch.Tensor:
    """``[L, text_dim]`` -> ``[1, text_len, text_dim]``, zero-padded as the trainer pads the text (the model's length)."""
    return F.pad(context, (0, 0, 0, text_len - context.shape[0])).unsqueeze(0)


def load_prompts(cfg, dataset, spec: Optional[InputSpec] = None) -> tuple[list[PreviewPrompt], Optional[torch.Tensor]]:
    """The preview prompts of ``cfg`` (``config.PreviewConfig``) and the negative embedding (None: zeros):
    the first ``num_prompts`` embeddings of ``cfg.prompts`` (the negative one left out), or the contexts and
    shapes of the first ``num_prompts`` samples of ``dataset``. ``spec``: the model's inputs (default: the
    dataset's), which the file's embeddings and ``cfg.size`` must fit."""
    spec = spec or getattr(dataset, "spec", None) or default_input_spec()
    size = preview_size(cfg, spec)
    negative = None
    if cfg.prompts is not None:
        table = load_embeddings(cfg.prompts, what="adaptive_load.preview.prompts", spec=spec)
        if cfg.negative is not None:
            if cfg.negative not in table:
                raise ConfigError(f"adaptive_load.preview.negative {cfg.negative!r} is not in {cfg.prompts} "
                                  f"(its embeddings: {sorted(table)})")
            negative = table.pop(cfg.negative)
        items = list(table.items())[:cfg.num_prompts]
        if not items:
            raise ConfigError(f"adaptive_load.preview.prompts {cfg.prompts} holds no prompt besides the negative one")
        shapes = [size] * len(items)
    else:
        if cfg.negative is not None:
            raise ConfigError("adaptive_load.preview.negative names an embedding of preview.prompts, which is null "
                              "(the dataset's prompts have no negative one): set preview.prompts or drop negative")
        n = min(cfg.num_prompts, len(dataset))
        all_shapes = dataset_shapes(dataset)
        items = [(f"sample{i}", dataset[i]["context"].float()) for i in range(n)]
        shapes = [size or all_shapes[i] for i in range(n)]
    prompts = [PreviewPrompt(name=name, context=ctx, shape=shape, seed=sample_seed(cfg.seed, 0, j))
               for j, ((name, ctx), shape) in enumerate(zip(items, shapes))]
    return prompts, negative


# --------------------------------------------------------------------------------------------
# The memory plan (pure)
# --------------------------------------------------------------------------------------------

def preview_memory_gib(cost, shape: SampleShape, batch: int) -> float:
    """Upper bound (GiB per GPU) of a preview forward of ``batch`` samples of ``shape``: the memory model's
    activations of a training micro-batch of that size with its fewest-memory checkpoint count (which hold a
    block's backward working set, more than a no-grad forward), plus the sampler's fp32 state (x, noise,
    velocity and the gathered prediction)."""
    acts = float(cost.ckpt_memory(shape, batch, fewest_memory_blocks(cost, shape)))
    state = 4 * 4 * batch * math.prod(shape.latent_shape) / GIB
    return acts + state


@dataclass
class PreviewPlan:
    """Which prompts run, whether guidance is batched, and the memory each one is predicted to need."""

    prompts: list
    batch_cfg: bool
    budget_gib: float
    predicted_gib: dict = field(default_factory=dict)
    """name -> predicted GiB at the batch it runs with."""
    dropped: list = field(default_factory=list)
    """Messages, one per prompt that does not fit."""


def plan_previews(prompts: list[PreviewPrompt], cost, budget_gib: float, *, guidance: bool) -> PreviewPlan:
    """Fit the prompts into ``budget_gib`` (the plan's ``m_mem``). The same on every rank (global inputs)."""
    kept, dropped, need1 = [], [], {}
    for p in prompts:
        need1[p.name] = preview_memory_gib(cost, p.shape, 1)
        if need1[p.name] <= budget_gib:
            kept.append(p)
        else:
            dropped.append(f"preview '{p.name}' ({p.shape}) dropped: it needs up to {need1[p.name]:.2f} GiB of "
                           f"activations, the run's budget between steps is m_mem {budget_gib:.2f} GiB; set "
                           "adaptive_load.preview.size to a smaller video")
    batch_cfg = guidance and all(preview_memory_gib(cost, p.shape, 2) <= budget_gib for p in kept)
    predicted = {p.name: preview_memory_gib(cost, p.shape, 2) if batch_cfg else need1[p.name] for p in kept}
    return PreviewPlan(prompts=kept, batch_cfg=batch_cfg, budget_gib=budget_gib, predicted_gib=predicted,
                       dropped=dropped)


# --------------------------------------------------------------------------------------------
# The runner
# --------------------------------------------------------------------------------------------

def _load_vae(model, path):
    """The model's VAE for decoding previews (rank 0); a ConfigError naming ``adaptive_load.preview.vae``."""
    try:
        return load_vae(model, path, what="adaptive_load.preview.vae")
    except EncoderError as exc:
        raise ConfigError(str(exc)) from None


class PreviewRunner:
    """Runs the previews of a training run (see the module docstring). Every rank holds one."""

    def __init__(self, run, cfg, prompts: list[PreviewPrompt], negative: Optional[torch.Tensor], *, engine,
                 metrics, log: Callable[[str], None], shift: float, weights=None) -> None:
        self.run, self.cfg, self.engine, self.metrics, self.log = run, cfg, engine, metrics, log
        self.weights = weights or contextlib.nullcontext   # the EMA's ``swapped``: previews of the average
        self.layout = run.layout
        self.spec = run.preset
        self.negative = negative
        self.shift = shift
        self.out_dir = Path(run.cfg.adaptive_load.metrics.log_dir) / "previews"
        self.plan = plan_previews(prompts, run.cost, run.plan.m_mem, guidance=cfg.guidance_scale > 1)
        self.vae = None
        self.records: list[dict] = []
        self.is_writer = self.layout.rank == 0
        for msg in self.plan.dropped:
            log(f"ds_adaptive.preview: {msg}")
        if self.is_writer:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            if cfg.vae is not None:
                self.vae = _load_vae(run.preset, cfg.vae)

    @classmethod
    def attach(cls, run, *, engine, metrics, log: Callable[[str], None], weights=None) -> Optional["PreviewRunner"]:
        """The runner of ``run`` (None when ``adaptive_load.preview`` is off); ``weights``: a context manager the
        previews run inside (the EMA's ``swapped``: previews of the EMA weights)."""
        cfg = run.cfg.adaptive_load.preview
        if not cfg.enabled:
            return None
        prompts, negative = load_prompts(cfg, run.dataset, run.preset.input_spec)
        shift = cfg.shift if cfg.shift is not None else run.cfg.trainer.shift
        return cls(run, cfg, prompts, negative, engine=engine, metrics=metrics, log=log, shift=shift, weights=weights)

    def after_step(self, step: int, *, last: bool = False) -> Optional[dict]:
        """Run a preview round when ``step`` is a multiple of ``interval`` (or the last step); every rank."""
        if step % self.cfg.interval and not last:
            return None
        if not self.plan.prompts:
            return None
        return self.preview(step)

    # ---------------------------------------------------------------- one round
    def preview(self, step: int) -> dict:
        """One round of previews at ``step`` (a collective: every rank calls it)."""
        device, cuda = self.run.device, self.run.device.type == "cuda"
        t0 = time.perf_counter()
        if cuda:
            torch.cuda.synchronize(device)
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        with self.weights():
            mine = self._generate()
        if cuda:
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) / GIB
            extra = (torch.cuda.max_memory_allocated(device) - before) / GIB
            torch.cuda.empty_cache()
        gen_s = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(gen_s, op=torch.distributed.ReduceOp.MAX)
        results = self._gather(mine)
        rec = {"step": step, "prompts": [p.name for p in self.plan.prompts], "steps": self.cfg.steps,
               "guidance_scale": self.cfg.guidance_scale, "batch_cfg": self.plan.batch_cfg, "shift": self.shift,
               "generate_s": float(gen_s[0]), "budget_gib": self.plan.budget_gib,
               "predicted_gib": max(self.plan.predicted_gib.values()),
               "peak_gib": peak if cuda else None, "preview_gib": extra if cuda else None}
        if self.is_writer:
            rec["files"] = [str(f) for f in self._write(step, results)]
            rec["seconds"] = time.perf_counter() - t0
            with open(self.out_dir.parent / "previews.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
            self.metrics.log_scalars(step, {"preview/seconds": rec["seconds"], **(
                {"preview/peak_gib": rec["peak_gib"], "preview/activations_gib": rec["preview_gib"]} if cuda else {})})
            mem = (f", peak {peak:.2f} GiB ({extra:.2f} GiB over the static memory; predicted <= "
                   f"{rec['predicted_gib']:.2f}, budget m_mem {self.plan.budget_gib:.2f})") if cuda else ""
            self.log(f"ds_adaptive.preview: step {step}: {len(self.plan.prompts)} preview(s), {self.cfg.steps} Euler "
                     f"steps, guidance {self.cfg.guidance_scale:g}{' (batched)' if self.plan.batch_cfg else ''}: "
                     f"{rec['generate_s']:.2f} s generating, {rec['seconds']:.2f} s in all{mem}; "
                     f"{self.out_dir}")
        self.records.append(rec)
        return rec

    def _generate(self) -> list[tuple[int, torch.Tensor]]:
        """This rank's share: every rank runs ``ceil(n / dp)`` generations (padding repeats are dropped);
        returns ``[(prompt index, latents [C, T', H', W'] fp32 CPU)]`` (SP ranks > 0 return none)."""
        lay, prompts = self.layout, self.plan.prompts
        n = len(prompts)
        rounds = -(-n // lay.dp_size)
        out = []
        engine, dtype, device = self.engine, self.run.dtype, self.run.device
        was_training = engine.training
        engine.eval()
        try:
            for r in range(rounds):
                j = lay.dp_rank + r * lay.dp_size
                p = prompts[j if j < n else (lay.dp_rank % n)]
                ctx = pad_context(p.context, self.run.text_len).to(device)
                neg = None if self.negative is None else pad_context(self.negative, self.run.text_len).to(device)
                noise = initial_noise(p.shape.latent_shape, p.seed).to(device)
                x0 = euler_sample(lambda x, t, c: engine(x, t, c), noise, ctx, steps=self.cfg.steps, shift=self.shift,
                                  guidance_scale=self.cfg.guidance_scale, negative=neg, batch_cfg=self.plan.batch_cfg,
                                  dtype=dtype)
                if j < n and lay.sp_rank == 0:
                    out.append((j, x0[0].cpu()))
        finally:
            engine.train(was_training)
        return out

    def _gather(self, mine: list) -> list:
        dist = torch.distributed
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return sorted(mine, key=lambda kv: kv[0])
        got = [None] * dist.get_world_size() if self.is_writer else None
        dist.gather_object(mine, got, dst=0)
        return sorted((kv for part in (got or []) for kv in part), key=lambda kv: kv[0])

    def _write(self, step: int, results: list) -> list[Path]:
        files = []
        for j, latents in results:
            p = self.plan.prompts[j]
            stem = self.out_dir / f"step{step:07d}_{p.name}"
            frames = self._decode(latents) if self.vae is not None else None
            if frames is None:
                image = latent_strip(latents, upscale=self.spec.grid.vae_stride[1:])
                files.append(write_png(image, stem.with_suffix(".png")))
            else:
                image = frame_strip(frames)
                files.append(write_media(frames, stem.with_suffix(f".{self.cfg.format}"),
                                         fps=self.cfg.fps or round(self.spec.media.fps)))
            self.metrics.log_image(f"preview/{p.name}", image, step, caption=f"{p.shape}, seed {p.seed}")
        return files

    def _decode(self, latents: torch.Tensor):
        """uint8 frames of one preview; None (latent preview instead, with a message) when the VAE runs out of
        GPU memory: the VAE is outside the memory plan."""
        device = self.run.device
        try:
            self.vae.to(device)
            return decode_latents(self.vae, latents.unsqueeze(0), device=device)[0]
        except torch.cuda.OutOfMemoryError:
            self.log("ds_adaptive.preview: the VAE ran out of GPU memory decoding a preview; wrote the latent "
                     "preview instead (use a smaller preview.size)")
            return None
        finally:
            self.vae.to("cpu")
            if device.type == "cuda":
                torch.cuda.empty_cache()

    def summary(self) -> dict:
        """For the run summary: rounds, the slowest round and the highest peak."""
        r = self.records
        peaks = [x["peak_gib"] for x in r if x.get("peak_gib") is not None]
        return {"rounds": len(r), "prompts": [p.name for p in self.plan.prompts], "dropped": list(self.plan.dropped),
                "max_generate_s": max((x["generate_s"] for x in r), default=0.0),
                "max_peak_gib": max(peaks) if peaks else None,
                "predicted_gib": max(self.plan.predicted_gib.values()) if self.plan.predicted_gib else None,
                "budget_gib": self.plan.budget_gib}
