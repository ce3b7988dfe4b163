"""Sequence parallelism (Ulysses) for the Wan DiT: see ``ds_adaptive/parallel/ulysses.py`` and docs/ULYSSES.md."""
from .ulysses import (MESH_KEYS, LocalOutput, SeqShard, SequenceParallel, SequenceParallelError, UlyssesWan,
                      apply_ulysses, check_heads, gather_sequence, init_sequence_parallel, make_ulysses_attention,
                      remove_ulysses, resolve_sp_size, shard_plan, shard_sequence, strip_mesh_keys,
                      valid_len_attention)

__all__ = ["MESH_KEYS", "LocalOutput", "SeqShard", "SequenceParallel", "SequenceParallelError", "UlyssesWan",
           "apply_ulysses", "check_heads", "gather_sequence", "init_sequence_parallel", "make_ulysses_attention",
           "remove_ulysses", "resolve_sp_size", "shard_plan", "shard_sequence", "strip_mesh_keys",
           "valid_len_attention"]
