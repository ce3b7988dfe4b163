"""The balancing core of AdaptiveLoad: pure planning code, no torch.distributed.

- ``cost``: per-sample compute and memory (calibrated ``c0 + a*S + b*S^2``, power law, tokens),
  SP-aware; profiles in ``profiles/``.
- ``planner``: batches under both budgets, dealt into cost-equal micro-steps (pure).
- ``sampler``: the batch samplers (dual / tokens / fixed) with rank, seed and resumable state.
- ``simulate``: many ranks on paper (CV, idle time, predicted throughput).
- ``calibrate``: profile the real model on the GPU at hand -> profile json.
"""
