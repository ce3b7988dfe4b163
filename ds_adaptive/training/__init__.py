"""A run assembled once (``assemble.build_run``) and trained (``trainer``: the loop), with its collaborators:
``engine``, ``batches``, ``checkpointing`` (on ``checkpoint``, ``checksum``, ``runlock``), ``warmups``,
``rebalance``, ``nonfinite``, ``evaluation``, ``memory_log``, ``metrics`` (``timers``, ``balance``, ``summary``),
``progress``; LoRA, previews, preemption, block-fusion warm-up.
"""
