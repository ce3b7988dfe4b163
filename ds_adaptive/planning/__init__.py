"""The planning core of AdaptiveLoad: pure functions of (seed, epoch, shapes, config, layout); no
torch.distributed, no GPU timing.

- ``cost``: per-sample compute and memory (calibrated ``c0 + a*S + b*S^2``, power law, tokens), SP-aware;
  profiles in ``profiles/``; ``devices``: known GPUs and ``profile: "auto"``.
- ``memory``: memory-aware activation checkpointing per micro-batch.
- ``planner``: batches under both budgets, dealt into cost-equal micro-steps.
- ``budget``: ``m_comp: auto``, the throughput-optimal compute budget.
- ``sampler``: the batch samplers (dual / tokens / fixed) with rank, seed and resumable state.
- ``sparse_cost``, ``selection_cost``: the cost of sparse attention and of its block selection.
- ``validate``: the one pass over the rules that span fields (config, model, layout, backend).
"""
