"""Sequence parallelism (Ulysses) for a video DiT: see ``ds_adaptive/parallel/ulysses.py`` and docs/ULYSSES.md.
The layout (ranks, groups, validation, SP collectives) is :class:`ds_adaptive.core.layout.Layout`."""
from ds_adaptive.parallel.ulysses import (LocalOutput, SeqShard, UlyssesRunner, apply_ulysses, gather_sequence, make_ulysses_attention,
                      remove_ulysses, shard_plan, shard_sequence, valid_len_attention)

__all__ = ["LocalOutput", "SeqShard", "UlyssesRunner", "apply_ulysses", "gather_sequence", "make_ulysses_attention",
           "remove_ulysses", "shard_plan", "shard_sequence", "valid_len_attention"]
