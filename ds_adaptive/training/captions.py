"""Caption dropout in the trainer (``adaptive_load.caption_dropout``): a share of the training samples sees the empty
prompt, so that classifier-free guidance's unconditional branch stays trained.

    dropout = CaptionDropout.attach(run)                      # None when off; the empty prompt loaded once
    context = dropout.apply(context, batch["index"], epoch)   # every micro-batch, after padding to text_len
    summary.update(dropout.summary(layout))                   # every rank: one all-reduce

Which samples drop their caption is ``ds_adaptive.models.objective.caption_dropout_draws``: per sample, from (seed,
epoch, index), so the ranks of a Ulysses group agree, the choice does not depend on the micro-batch and a resumed run
drops exactly the captions of the straight run. What replaces it: the dataset's embedding of the empty prompt
(``empty_prompt.safetensors``, written by ``ds-adaptive preprocess``; the synthetic dataset has its own),
``caption_dropout.embedding``'s file, or zeros.
"""
from __future__ import annotations

from typing import Optional

import torch

from ds_adaptive.core.config import ConfigError
from ds_adaptive.data import EMPTY_PROMPT_FILE, read_empty_prompt
from ds_adaptive.models.objective import caption_dropout_draws, drop_captions

__all__ = ["CaptionDropout", "empty_prompt_for"]


def empty_prompt_for(cfg, dataset, spec) -> Optional[torch.Tensor]:
    """The embedding that replaces a dropped caption (``[L, text_dim]`` fp32), or None for zeros; a
    :class:`ConfigError` naming the key and the file when ``replace: empty`` finds none."""
    if cfg.replace == "zeros":
        return None
    if cfg.embedding is not None:
        return read_empty_prompt(cfg.embedding, spec, what="adaptive_load.caption_dropout.embedding")
    empty = dataset.empty_context()
    if empty is None:
        raise ConfigError(f"adaptive_load.caption_dropout.replace is 'empty' but the dataset ({dataset.describe()}) "
                          f"has no {EMPTY_PROMPT_FILE}: rerun `ds-adaptive preprocess` with the same arguments (a "
                          "finished job only adds that file), or set caption_dropout.embedding to a file written by "
                          "`ds-adaptive sample --text-encoder DIR --prompt \"\" --save-embeddings FILE`, or set "
                          "caption_dropout.replace to \"zeros\"")
    return empty.float()


class CaptionDropout:
    """Drops captions of training samples with probability ``cfg.rate`` (see the module doc); counts them."""

    def __init__(self, cfg, empty: Optional[torch.Tensor], *, seed: int, count: bool = True) -> None:
        self.cfg, self.empty, self.seed = cfg, empty, int(seed)
        self.count = bool(count)   # False on Ulysses ranks > 0: their group's rank 0 counts the samples
        self.samples = self.dropped = 0

    @classmethod
    def attach(cls, run) -> Optional["CaptionDropout"]:
        """The caption dropout of ``run`` (None when ``adaptive_load.caption_dropout`` is null)."""
        cfg = run.cfg.adaptive_load.caption_dropout
        if cfg is None:
            return None
        empty = empty_prompt_for(cfg, run.dataset, run.preset.input_spec)
        if empty is not None and empty.shape[0] > run.text_len:
            raise ConfigError(f"adaptive_load.caption_dropout: the empty prompt's embedding has {empty.shape[0]} "
                              f"tokens, more than the model's text length {run.text_len}")
        return cls(cfg, empty, seed=run.cfg.trainer.seed, count=run.layout.sp_rank == 0)

    def describe(self) -> str:
        what = ("zeros" if self.empty is None else
                f"the empty prompt's embedding ({self.empty.shape[0]} token(s){', ' + self.cfg.embedding if self.cfg.embedding else ''})")
        return f"caption dropout: rate {self.cfg.rate:g}, a dropped caption becomes {what}"

    def apply(self, context: torch.Tensor, indices, epoch: int) -> torch.Tensor:
        """``context`` ``[B, L, text_dim]`` (padded) with the dropped samples' rows replaced."""
        dropped = caption_dropout_draws(indices, seed=self.seed, epoch=epoch, rate=self.cfg.rate)
        if self.count:
            self.samples += int(dropped.numel())
            self.dropped += int(dropped.sum())
        return drop_captions(context, dropped, self.empty)

    def summary(self, device: torch.device) -> dict:
        """``{"caption_dropout": {rate, replace, samples, dropped, observed_rate}}`` over every rank (a collective)."""
        counts = torch.tensor([self.samples, self.dropped], dtype=torch.float64, device=device)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(counts)
        n, k = (int(round(float(v))) for v in counts)
        return {"caption_dropout": {"rate": self.cfg.rate, "replace": self.cfg.replace, "samples": n, "dropped": k,
                                    "observed_rate": k / n if n else 0.0}}
