"""The ``"adaptive_load"`` block of a DeepSpeed config json.

DeepSpeed ignores top-level keys it does not know, so our block lives in the
same file the user passes as ``--deepspeed_config`` and is validated here
with ``extra="forbid"``: a typo is an error that names the key and lists the
valid ones. This module is the schema only; reading a ds_config is
:mod:`ds_adaptive.core.ds_config`, the rules that span fields are
:mod:`ds_adaptive.planning.validate`. Example::

    "adaptive_load": {
      "enabled": true,
      "fused_ln_modulate": true,
      "sampler": {"mode": "dual", "cost_model": "calibrated",
                  "profile": "h100-wan2.1-1.3b", "m_mem": "auto", "m_comp": "auto"},
      "metrics": {"interval": 10, "log_dir": "runs/wan"}
    }
"""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field, ValidationError, field_validator, model_validator

from ds_adaptive.core.config_base import ConfigError, _Block, advanced
from ds_adaptive.core.config_moves import at_old_keys, move_keys, warn_moved
from ds_adaptive.core.features import CaptionDropoutConfig, EmaConfig, ValidationConfig
from ds_adaptive.core.sampler_config import DROPPED_ZERO_STAGE, GlobalBatchConfig, SamplerConfig
from ds_adaptive.core.shapes import SampleShape, ShapeError

BLOCK_KEY = "adaptive_load"

__all__ = ["BLOCK_KEY", "ConfigError", "DROPPED_ZERO_STAGE", "GlobalBatchConfig", "SamplerConfig", "RecomputeConfig",
           "OptimizationConfig", "MetricsConfig", "ContextParallelCostConfig", "SparseAttentionConfig", "LoraConfig", "PreviewConfig", "AdaptiveLoadConfig"]


class RecomputeConfig(_Block):
    """Activation recompute (activation checkpointing) of the model's transformer blocks: which blocks a micro-batch
    checkpoints and what a checkpointed block runs again in backward. The planner counts both in each micro-batch's
    cost and memory."""

    blocks: Literal["auto", "all", "none"] = "auto"
    """Which blocks are checkpointed: `auto` checkpoints, per micro-batch, only the first n blocks needed
    for its activations to fit `sampler.m_mem` (from the plan; the cost model adds their recompute), `all`
    every block, `none` no block. The trainer's `--grad-ckpt [auto|all|none]` overrides it."""

    attention: Literal["auto", "recompute", "keep"] = "auto"
    """What a checkpointed block runs again in backward: `recompute` its whole forward (self-attention
    included), `keep` everything but the self-attention core, whose output and log-sum-exp it holds
    (2 x dim + 4 x heads bytes per token per checkpointed block: 3 KiB at Wan 1.3B) so the attention
    forward runs once. The planner counts both sides: the smaller recompute in the cost (the dense
    layers' quadratic recompute term goes) and the bytes in the memory plan. Only the fused SDPA
    attention is kept (a sparse layer's kernel is recomputed). Gradients are the same. `auto`: where the
    throughput-optimal budget search runs (`sampler.mode: dual`, `sampler.cost_model: calibrated`,
    `blocks: auto`, a model that can keep it) it plans both and runs the one with the higher predicted tokens/s
    (ties: `recompute`; the launcher's notes give both predictions); elsewhere `recompute`."""


class OptimizationConfig(_Block):
    """How the trainer turns micro-batches of varying size into optimizer steps: the weight of each rank's loss
    and the LR of each step."""

    loss_weighting: Literal["samples", "tokens"] = "samples"
    """Weight each rank's loss by its share of the optimizer step's samples or tokens, so that
    variable batch sizes give unbiased gradients."""

    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    """Scale the LR of each optimizer step by (samples / reference_batch) or its sqrt."""

    reference_batch: Optional[int] = Field(None, gt=0)
    """Global samples per optimizer step that the base LR was tuned for (for `lr_scaling`)."""


class MetricsConfig(_Block):
    """Step timing, balance figures and logs."""

    interval: int = Field(10, ge=1)
    """Log every `interval` optimizer steps (TensorBoard, W&B, progress bar; metrics.jsonl: `jsonl_interval`)."""

    jsonl_interval: Optional[int] = Field(1, ge=1)
    """Steps between metrics.jsonl lines (1: every step, what the run's plot draws); null: every `interval`."""

    plot: bool = True
    """At the end of the run, draw `log_dir`/run.png (losses, tokens/s, peak memory and compute per rank; needs
    matplotlib, a note when it is missing); `ds-adaptive plot LOG_DIR` draws it on demand."""

    log_dir: str = "runs/ds_adaptive"
    """Directory for metrics.jsonl, TensorBoard events and the final summary.json."""

    tensorboard: bool = True
    """Write TensorBoard event files (needs the `tensorboard` package; a warning if missing)."""

    jsonl: bool = True
    """Write one JSON line per logged step to `log_dir`/metrics.jsonl."""

    wandb: bool = False
    """Also log to Weights & Biases (rank 0; the scalars TensorBoard gets, previews as images). Needs the
    `wandb` package; when it is not installed the run says so once and logs without it."""

    wandb_project: str = "ds_adaptive"
    """W&B project of the run (its name is the log directory's name; entity and mode come from the usual
    `WANDB_*` environment variables, e.g. `WANDB_MODE=offline`)."""

    peak_tflops: Optional[float] = Field(None, gt=0.0)
    """Dense bf16 peak of one GPU (TFLOP/s) for MFU / HFU; null: from the table of known GPUs
    (`ds_adaptive/planning/devices.py`: H100/H200 989, A100 312, ...); MFU is not reported when the
    GPU is unknown and this is null."""

    sync_timing: Union[bool, Literal["auto"]] = advanced("auto")
    """Synchronize the device when each micro-step's timed region (batch on the device .. backward
    done) starts and ends. `auto` (default): only where compute time is the host's clock. With the
    trainer's default `--compute-timing` on CUDA, per-rank compute time comes from CUDA events
    (`metrics.ComputeTimer`: ZeRO-3's waits for other ranks inside forward/backward subtracted), which
    need no sync, so `auto` does not sync and the host queues the next micro-step while the GPU finishes
    this one; `data_ms` is then the host's wait for
    the batch. With `--no-compute-timing`, or when no DeepSpeed wait points are found (summary `timing:
    wall`), compute time is the region's host wall-clock time, waits for other ranks included, and only
    with the sync does it cover the rank's kernels rather than their launches: `auto` syncs there.
    `true` / `false` force it. No effect on CPU."""


class ContextParallelCostConfig(_Block):
    """What the hybrid context-parallel cost model assumes about the machine and the selections
    (ds_adaptive.planning.context_parallel; docs/CONTEXT_PARALLEL.md). Configured, not measured: replace the
    bandwidths with an nccl-tests alltoall_perf bus bandwidth of your cluster."""

    intra_node_gbps: float = Field(150.0, gt=0.0)
    """All-to-all bandwidth per GPU between the GPUs of one node, GB/s (the shipped profiles' estimate for
    8 x H100 NVSwitch)."""

    inter_node_gbps: float = Field(25.0, gt=0.0)
    """All-to-all bandwidth per GPU between nodes, GB/s (about a 400 Gb/s NIC per GPU at ~50% efficiency)."""

    gpus_per_node: int = Field(8, ge=1)
    """GPUs per node (consecutive ranks share a node)."""

    latency_us: float = Field(30.0, ge=0.0)
    """Fixed time per collective, microseconds."""

    query_block_overlap: float = Field(0.9, ge=0.0, le=1.0)
    """Share of selected key blocks two adjacent query blocks have in common: the planner's estimate of how
    many key blocks a rank's query chunk fetches (DSV reports > 0.9 on trained video DiTs)."""


class SparseAttentionConfig(_Block):
    """DSV dynamic sparse self-attention (ds_adaptive.attention; docs/SPARSE.md)."""

    enabled: bool = False
    """Turn sparse self-attention on: cube token order, the low-rank predictor, block top-k selection
    and the block-sparse kernel in the layers the schedule makes sparse."""

    mass: float = Field(0.99, gt=0.5, le=1.0)
    """Softmax mass a head's selected key blocks must hold: a head's density is the mean share of
    key blocks needed to reach it on the profiled query rows, and its top-k follows that density."""

    min_density: float = advanced(0.02, ge=0.0, le=1.0)
    """Lower bound of the per-head density used for top-k (share of key blocks per query block)."""

    max_density: float = advanced(1.0, gt=0.0, le=1.0)
    """Upper bound of the per-head density used for top-k."""

    block_size: int = advanced(128, ge=16, le=1024)
    """Tokens per query / key block of the block-sparse kernel (a multiple of 16; 128 on Hopper:
    64-token blocks failed to compile in FlexAttention on H100)."""

    cube: list[int] = advanced(default_factory=lambda: [2, 8, 8])
    """[frames, rows, columns] of the 3D token cubes of the token order (2x8x8 = 128 = one block)."""

    predictor_rank: int = advanced(16, ge=1, le=256)
    """Rank r of the per-head projections of q and k that predict the attention logits."""

    block_score: Literal["pooled_lse", "lse", "mean"] = advanced("pooled_lse")
    """How a (query block, key block) pair is scored for the top-k: `pooled_lse` = log-sum-exp over the
    key block of the query block's mean query against the real keys (exact logits, no predictor:
    keeps >= 0.95 of the softmax mass on RoPE-structured data with local windows, far regions and
    sinks, docs/SPARSE.md; ~nq * S * Dh multiply-adds per head); `lse` = the same with the low-rank
    predictor's logits; `mean` = block mean of the predicted logits (O(nq nk r); keeps 0.6-0.75 of
    the mass there). Only `lse` and `mean` train the predictor."""

    predictor_lr: float = advanced(1e-3, gt=0.0)
    """AdamW learning rate of the predictor (its own optimizer, not the DiT's)."""

    predictor_cos_weight: float = advanced(0.9, ge=0.0, le=1.0)
    """Weight of the cosine term of the predictor loss; the normalised-MSE term gets 1 - this."""

    sample_rows: int = advanced(128, ge=1)
    """Query rows per layer and micro-step whose exact logits train the predictor and measure
    density / recall (their logits cost [B, H, sample_rows, S] fp32 memory)."""

    warmup_steps: int = Field(500, ge=0)
    """Stage 1 (dense attention, predictor training) lasts at most this many optimizer steps."""

    loss_threshold: float = advanced(0.05, ge=0.0)
    """Stage 1 ends early when the predictor loss (mean over layers, all ranks) is below this."""

    profile_interval: int = advanced(50, ge=1)
    """In stage 2, re-measure densities / recall and train the predictor every this many steps."""

    layer_density_threshold: float = advanced(0.3, gt=0.0, le=1.0)
    """In stage 2 a layer runs sparse only when its profiled mean head density is at most this."""

    dense_above: float = advanced(0.6, gt=0.0, le=1.0)
    """A layer whose selected density is above this runs dense cuDNN/flash SDPA instead (per
    selected block a block-sparse kernel costs more than dense attention, so above some density dense is faster)."""

    dense_layers: Optional[list[int]] = None
    """Layers that always run dense (0-based). Default: the first and the last layer."""

    keep_sink: bool = advanced(False)
    """Always select key block 0 too (an attention sink) besides the diagonal block."""

    forced_density: Optional[float] = advanced(None, gt=0.0, le=1.0)
    """Benchmarks: skip stage 1 and profiling, run every non-dense layer sparse at this density."""

    forced_after_warmup: bool = advanced(False)
    """With `forced_density`: run stage 1 first (dense, predictor training; it ends as usual), then
    every non-dense layer sparse at `forced_density` (top-k by the trained predictor), profiling
    every `profile_interval` steps (so density and recall are measured). For quality runs of a
    randomly initialised model, whose natural density is too high for any layer to go sparse."""

    rebalance: Literal["off", "epoch", "step"] = "step"
    """Feed the densities the layers really run at (profiled per head, all-reduced over the ranks;
    1 for dense layers) to the balancers when they change: the batch sampler plans with the sparse
    cost (needs `sampler.cost_model: calibrated` and a profile of the trained depth) and,
    under Ulysses SP, the heads are re-placed for equal density per rank. `step`: the sampler
    re-plans the rest of the epoch from the next step; `epoch`: from the next epoch; `off`: never
    (the plan is the dense plan, e.g. to compare with a dense run on the same batches)."""

    rebalance_min_change: float = advanced(0.02, ge=0.0, le=1.0)
    """Re-plan only when some layer/head density changed by more than this since the last re-plan."""

    backend: str = "auto"
    """Block-sparse kernel, by name from the backend registry (`ds_adaptive.attention.backends`: `flex` =
    compiled FlexAttention, CUDA; `reference` = masked dense torch, S^2 memory: tests / CPU; others
    as registered), or `auto`: the fastest measured on this GPU among those that run here (a cached
    measurement per GPU + torch version); with none, the reference, said loudly at start-up."""

    selection_cache: Literal["host", "device"] = advanced("host")
    """Where a layer's selection waits between the forward and its activation-checkpointing
    recompute: `host` (pinned CPU buffers, stream-ordered async copies, no GPU memory held across
    the step; CUDA only) or `device` (kept on the GPU: [B, H, nq, k] int32 per sparse layer)."""

    max_compiled_graphs: int = advanced(8, ge=1)
    """Graphs a compiling backend (`flex`) may compile in the process. Shapes are dynamic: one graph
    for B == 1 and one for B >= 2 per dtype / kernel-options bucket / training or evaluation, whatever
    the sequence lengths; one more than this is an error (never a silent fallback to an unfused S^2 path)."""

    seed: int = 0
    """Seed of the predictor init and of the profiled row samples."""

    context_parallel: Literal["heads", "sequence", "auto"] = "heads"
    """How an SP group runs self-attention (docs/CONTEXT_PARALLEL.md): `heads` = Ulysses (heads % sp == 0);
    `sequence` = every sparse layer sequence-wise (each rank keeps its query chunk and fetches only the key
    blocks it selected), dense layers Ulysses (or the largest head-wise group the heads allow, the rest
    sequence-wise); `auto` = per layer and sequence length, the mesh (head-wise x sequence-wise = sp) the cost
    model predicts fastest. `sequence` and `auto` allow sp beyond the head count. Default `heads` until a GPU
    run has measured `auto`."""

    context_parallel_cost: ContextParallelCostConfig = advanced(default_factory=ContextParallelCostConfig)
    """Links and selection overlap the `auto` solver and the planner's communication term assume."""

    @field_validator("cube")
    @classmethod
    def _cube_positive(cls, v):
        if len(v) != 3 or any(n < 1 for n in v):
            raise ValueError(f"must be 3 ints >= 1 [frames, rows, columns], got {list(v)}")
        return v

    @field_validator("block_size")
    @classmethod
    def _block_multiple(cls, v):
        if v % 16:
            raise ValueError(f"must be a multiple of 16 (tensor-core tiles), got {v}")
        return v

    @field_validator("dense_layers")
    @classmethod
    def _layers_non_negative(cls, v):
        if v is not None and any(i < 0 for i in v):
            raise ValueError(f"layer indices must be >= 0, got {v}")
        return v

    @model_validator(mode="after")
    def _density_bounds(self):
        if self.min_density > self.max_density:
            raise ValueError(f"min_density ({self.min_density}) must be <= max_density ({self.max_density})")
        return self


class LoraConfig(_Block):
    """LoRA fine-tuning with peft (ds_adaptive.training.lora): low-rank adapters on the DiT's linears, base frozen."""

    enabled: bool = False
    """Train LoRA adapters instead of the whole DiT: the base weights are frozen (no gradients, no
    optimizer state), only the adapters are optimised and saved in checkpoints. Needs `peft`
    (`pip install 'ds_adaptive[lora]'`). Combine with `--init-from` to adapt pretrained Wan weights."""

    rank: int = Field(32, ge=1, le=1024)
    """Rank r of every adapter (`lora_A` is r x in, `lora_B` is out x r)."""

    alpha: float = Field(32.0, gt=0.0)
    """LoRA alpha: the adapter's output is scaled by alpha / rank (alpha / sqrt(rank) with `rslora`).
    `ds-adaptive export --lora` folds this scale into `lora_B`, so the file loads with scale 1 anywhere."""

    targets: list[str] = Field(default_factory=lambda: ["self_attn", "cross_attn", "ffn"])
    """Linears of every block that get an adapter: groups `self_attn` (q, k, v, o), `cross_attn` (q, k, v,
    o), `ffn` (both FFN linears), or single module paths inside a block such as `self_attn.q` or `ffn.0`."""

    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input (peft `lora_dropout`); its random mask is reseeded from (seed,
    step, rank) every optimizer step, so a resumed run draws the masks of the straight run."""

    init: Literal["kaiming", "gaussian"] = "kaiming"
    """Initialisation of `lora_A` (`lora_B` starts at zero, so training starts from the base model):
    peft's default Kaiming-uniform, or Gaussian with std 1/rank."""

    rslora: bool = False
    """Rank-stabilised LoRA: scale by alpha / sqrt(rank) instead of alpha / rank."""

    @field_validator("targets")
    @classmethod
    def _targets_listed_once(cls, v):
        if not v:
            raise ValueError("must name at least one target (e.g. [\"self_attn\", \"cross_attn\", \"ffn\"])")
        dup = sorted({t for t in v if v.count(t) > 1})
        if dup:
            raise ValueError(f"lists {dup} more than once")
        return v


class PreviewConfig(_Block):
    """Sample previews during training (ds_adaptive.training.preview): fixed prompts and seeds, Euler sampler."""

    enabled: bool = False
    """Generate previews every `interval` optimizer steps (and after the last step)."""

    interval: int = Field(500, ge=1)
    """Optimizer steps between previews."""

    prompts: Optional[str] = None
    """Text embeddings of the preview prompts: a `.safetensors` file with one `[L, text width]` embedding of
    the model's text encoder (umT5, 4096 wide, for Wan) per prompt, the tensor names are the preview names (`ds-adaptive sample --text-encoder DIR --prompt
    TEXT --save-embeddings FILE` writes one, in prompt order; other files are read in name order). null: the contexts of the first `num_prompts` training
    samples (the synthetic dataset's embeddings, or your shards' captions)."""

    num_prompts: int = Field(2, ge=1, le=64)
    """Previews per round (the first N prompts of `prompts`, or of the dataset); they are dealt out to
    the data-parallel ranks, which generate in parallel."""

    size: Optional[str] = None
    """Video size of a preview in pixels, "FRAMESxHEIGHTxWIDTH" (e.g. "81x480x832"), a shape of the
    trained model's grid (frames 4n+1, height and width multiples of 16 for a 4x8x8 VAE with a 1x2x2
    patch, of 32 for a 4x16x16 one). null: each dataset prompt's own sample shape (required with
    `prompts`)."""

    steps: int = Field(20, ge=1, le=1000)
    """Euler steps of the flow-matching sampler (sigma from 1 to 0 on the shifted schedule of training)."""

    shift: Optional[float] = Field(None, gt=0.0)
    """Timestep shift of the sampler's sigma schedule; null: the trainer's `--shift`."""

    guidance_scale: float = Field(1.0, ge=1.0)
    """Classifier-free guidance scale; 1: no guidance (one forward per step), > 1: conditional and
    unconditional forwards per step (batched when the memory budget allows)."""

    negative: Optional[str] = None
    """Name of the negative-prompt embedding in `prompts` (the unconditional branch of guidance);
    null: an all-zero context."""

    seed: int = 0
    """Seed of the preview noise: preview j always starts from the same noise."""

    vae: Optional[str] = None
    """Directory of the model's diffusers VAE (`save_pretrained` / a pipeline's `vae/`; Wan 2.1 and 2.2 both
    use `AutoencoderKLWan`, with 16 and 48 latent channels; it is checked against the model): previews
    are decoded to video (`format`). null: a latent preview PNG (latent frames side by side, the latent
    channels projected to RGB)."""

    format: Literal["mp4", "gif"] = "mp4"
    """File format of decoded previews (mp4 via PyAV, gif via Pillow)."""

    fps: Optional[int] = Field(None, ge=1, le=120)
    """Frames per second of decoded previews; null: the model's frame rate (its preprocessing default:
    16 for Wan 2.1, 24 for Wan 2.2 TI2V-5B)."""

    @field_validator("size")
    @classmethod
    def _size_is_a_shape(cls, v):
        if v is not None:

            try:  # the syntax; the model's grid rule is checked with the model (run_config, preview)
                SampleShape.parse_text(v)
            except ShapeError as exc:
                raise ValueError(str(exc)) from None
        return v

    @model_validator(mode="after")
    def _file_prompts_need_a_size(self):
        if self.enabled and self.prompts is not None and self.size is None:
            raise ValueError("preview.prompts is a file of text embeddings, which carry no video size: set "
                             "preview.size (e.g. \"33x480x832\")")
        return self


class AdaptiveLoadConfig(_Block):
    """The "adaptive_load" block of the ds_config json."""

    enabled: bool = False
    """Turn AdaptiveLoad on: the dual-constraint sampler (sampler.mode) drives the data loader.
    When false, the trainer uses the equal-token baseline sampler at the same memory budget."""

    fused_ln_modulate: bool = False
    """Use the fused LayerNorm-Modulate CUDA op in the model's adaLN sites (falls back to the
    torch reference with one warning when the op cannot be built)."""

    block_fusion: Literal["off", "rope", "regions"] = "off"
    """Fuse each block's elementwise pieces outside attention (`ds_adaptive/models/fusion.py`): `rope` runs the
    q/k RMSNorm + RoPE as one Triton kernel per tensor each way (compiled by torch.compile where the kernel cannot
    run), `regions` also compiles the gated residuals. Linear layers, attention (dense, Ulysses or sparse), the
    LayerNorm-modulate op and the cross-attention LayerNorm (compiled, it measured slower than eager) stay as they
    are. `off`: eager. The trainer compiles the pieces for the plan's micro-batch sizes before step 1 and for the
    sizes a later epoch's plan adds (printed, and `block_fusion` in the summary), so no step compiles;
    where torch.compile cannot work (no triton on the GPU, no C++ compiler on the CPU) it warns once and runs eager.
    The shipped Wan 1.3B config turns `regions` on, where it measured faster (docs/RESULTS.md). Measure on your job
    (`bench/training/mfu_levers.py`)."""

    zero3_leaf_blocks: bool = advanced(True)
    """Under ZeRO stage 3, mark each transformer block a ZeRO-3 leaf module (DeepSpeed's
    `set_z3_leaf_module`): ZeRO-3 then gathers and releases a block's parameters at once, with one hook
    pair per block instead of one per Linear and norm (a Wan 1.3B block has 18), so the host spends less
    time per block in forward, backward and recompute, and multi-GPU runs all-gather a block in one
    collective. A checkpointed block recomputes inside its
    own call, so ZeRO-3's trace of the module order, which it prefetches parameters by, stays valid when the count
    of checkpointed blocks changes between micro-batches. The same as listing the block class in
    ds_config's `zero_optimization.leaf_module`. A block's parameters are all live while it runs (Wan 1.3B:
    46M, within the prefetch bucket the memory model counts). No effect below stage 3, and off under LoRA: the
    frozen base gives the first block an input without a gradient, and DeepSpeed's leaf-module backward hook then
    releases the block's parameters before the adapters' backward uses them (a note says so when the key is set)."""

    zero3_torch_linear: bool = advanced(True)
    """Under ZeRO stage 3, run Linear layers through torch's own `F.linear` rather than DeepSpeed's replacement
    (`zero_optimization.memory_efficient_linear`, which DeepSpeed turns on by default and which then stays on for the
    whole process): torch multiplies a `[B, S, D]` input as one matrix with the bias in the GEMM's epilogue, where
    DeepSpeed's function adds a 3-D input's bias in a separate kernel. The trainer writes
    `memory_efficient_linear: false` into the ds_config it hands DeepSpeed when your ds_config does not set the key
    (yours wins when it does), and puts torch's `F.linear` back if an earlier DeepSpeed engine of the process
    replaced it. Training is the same up to rounding (CPU test); DeepSpeed's version saves no memory here (ZeRO-3
    gathers a Linear's weight again for its backward either way; its same-sample A/B: docs/RESULTS.md). No effect
    below stage 3."""

    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    """The sampler sub-block."""

    recompute: RecomputeConfig = Field(default_factory=RecomputeConfig)
    """The activation-recompute sub-block (which blocks are checkpointed, what they run again)."""

    optimization: OptimizationConfig = Field(default_factory=OptimizationConfig)
    """The optimization sub-block (loss weighting, LR scaling)."""

    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    """The metrics sub-block."""

    sparse_attention: SparseAttentionConfig = Field(default_factory=SparseAttentionConfig)
    """The DSV sparse-attention sub-block (off by default)."""

    lora: LoraConfig = Field(default_factory=LoraConfig)
    """The LoRA fine-tuning sub-block (off by default)."""

    preview: PreviewConfig = Field(default_factory=PreviewConfig)
    """The sample-preview sub-block (off by default)."""

    ema: Optional[EmaConfig] = None
    """An EMA of the weights, partitioned like them (null: off; `export --ema`, `sample --ema`, previews use it)."""

    caption_dropout: Optional[CaptionDropoutConfig] = None
    """Caption dropout for classifier-free guidance (null: off)."""

    validation: Optional[ValidationConfig] = None
    """Validation on a held-out split of the dataset during training (null: off)."""

    @model_validator(mode="wrap")
    @classmethod
    def _moved_keys(cls, data, handler):
        # keys that moved out of `sampler` (core.config_moves): read at their old place for one release
        data, moved = move_keys(data)
        try:
            out = handler(data)
        except ValidationError as exc:
            raise at_old_keys(exc, moved) from None
        warn_moved(moved)
        return out
