"""Where a layer's block selection waits between its forward and its activation-checkpointing recompute.

One :class:`SelectionEntry` per layer and step (the key of the forward that made it, the selection and the
host-known selected share); :class:`SelectionCache` keeps them until the runtime's ``step()`` clears it.
On CUDA with ``selection_cache: host`` the kept copy lives in pinned host buffers (:class:`HostCopy`):
asynchronous, stream-ordered copies, no GPU memory held across the step.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ds_adaptive.attention.selection import BlockSelection

__all__ = ["HostCopy", "SelectionEntry", "SelectionCache", "in_backward"]


def in_backward() -> bool:
    """True while the autograd engine runs a backward (where checkpointing recomputes forwards)."""
    return torch._C._current_graph_task_id() != -1


class SelectionEntry:
    """One layer's selection of this step: ``key`` (q's shape, valid_len, head ids: a recompute matches it),
    ``selection`` (device tensors, for the forward itself), ``stored`` (the copy kept for the checkpoint
    recompute: the same selection, or a :class:`HostCopy`), ``density`` (host-known selected share: the
    kernel-options bucket)."""
    __slots__ = ("key", "selection", "stored", "density")

    def __init__(self, key, selection, stored, density):
        self.key, self.selection, self.stored, self.density = key, selection, stored, density


class HostCopy:
    """A selection parked in pinned host buffers (reused per layer across steps): the device->host
    and host->device copies are asynchronous and ordered on the current stream, so nothing waits
    and no GPU memory is held between a layer's forward and its recompute."""

    def __init__(self):
        self._bufs: dict[int, tuple] = {}
        self.meta: dict[int, tuple] = {}

    def put(self, layer: int, sel: BlockSelection) -> None:
        bufs = self._bufs.get(layer)
        if bufs is None or any(b.shape != t.shape or b.dtype != t.dtype for b, t in zip(bufs, (sel.kv_num, sel.kv_idx))):
            bufs = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda) for t in (sel.kv_num, sel.kv_idx))
            self._bufs[layer] = bufs
        for b, t in zip(bufs, (sel.kv_num, sel.kv_idx)):
            b.copy_(t, non_blocking=True)
        self.meta[layer] = (sel.block_size, sel.seq_len, sel.kv_idx.device)

    def get(self, layer: int) -> BlockSelection:
        bs, s, dev = self.meta[layer]
        num, idx = (b.to(dev, non_blocking=True) for b in self._bufs[layer])
        return BlockSelection(kv_num=num, kv_idx=idx, block_size=bs, seq_len=s)


class SelectionCache:
    """The per-layer :class:`SelectionEntry` of the current step. ``host``: park CUDA selections in pinned
    host buffers (``selection_cache: host``); else keep them where they are."""

    def __init__(self, host: bool = True):
        self.host = host
        self.entries: dict[int, SelectionEntry] = {}
        self._host = HostCopy()

    def entry(self, layer: int) -> Optional[SelectionEntry]:
        return self.entries.get(layer)

    def recompute_hit(self, layer: int, key: Any) -> bool:
        """Inside a backward (the checkpoint recompute) with this step's entry for the same inputs."""
        entry = self.entries.get(layer)
        return in_backward() and entry is not None and entry.key == key

    def store(self, layer: int, key: Any, selection: Optional[BlockSelection], density) -> SelectionEntry:
        """Record this forward's selection (None: the layer ran dense) and return its entry."""
        stored = selection
        if selection is not None and selection.kv_idx.is_cuda and self.host:
            self._host.put(layer, selection)
            stored = self._host
        entry = SelectionEntry(key, selection, stored, density)
        self.entries[layer] = entry
        return entry

    def selection(self, layer: int) -> Optional[BlockSelection]:
        """The selection this step's forward made for ``layer`` (what its recompute reuses); None: the layer
        ran dense or has not run since the last :meth:`clear`."""
        entry = self.entries.get(layer)
        if entry is None or entry.stored is None:
            return None
        return self._host.get(layer) if isinstance(entry.stored, HostCopy) else entry.stored

    def clear(self) -> None:
        self.entries.clear()
