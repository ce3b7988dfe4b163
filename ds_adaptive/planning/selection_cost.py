"""Cost of the sparse-attention block selection: its form, its shipped default and its fit to GPU timings.

One sparse layer's selection for a micro-batch of ``B`` samples of ``S`` tokens on one SP rank
(``h = heads / sp`` local heads; ``nq = nk = ceil(S / block)`` query / key blocks) does, for the
default ``pooled_lse`` scoring (``ds_adaptive.attention.scores.pooled_lse_scores``) and the top-k
(``select_blocks``)::

    pooling   B * h * S * Dh             reads         (the block-mean query)         ~ B h S
    scoring   B * h * nq * S * Dh        multiply-adds (mean query x every key)       ~ B h nq S
              B * h * nq * S             exps          (log-sum-exp per key block)
    top-k     B * h * nq * nk            scores        (k largest per query block)    ~ B h nq nk
    launches  a fixed number of kernels per call (independent of B and S)

so its time (ms) is::

    sel(B, S) = ms_per_call + B * h * (ms_per_token * S + ms_per_logit * nq * S + ms_per_block_pair * nq * nk)

``ms_per_logit`` is ``Dh`` multiply-adds plus one exp (the head dim is the model's, fixed per
measurement). The selection runs once per layer and micro-batch in the forward (the recomputed
forward and the backward reuse it), so ``ms_per_call`` is paid per micro-batch, the rest per sample.

Where the coefficients come from (:meth:`SelectionCost.load_for`): ``ds-adaptive calibrate --sparse
--selection`` times the runtime's own selection call on this GPU over a grid of ``(B, S)`` and fits
them (:func:`fit_selection`), stored in the profile's ``sparse_attention.selection`` section; without
one, :meth:`SelectionCost.default` (one H200's calibration of the fused selection, see
``DEFAULT_SELECTION``). Pure numpy: no torch here.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional

import numpy as np

__all__ = ["SelectionCost", "selection_features", "DEFAULT_SELECTION", "SELECTION_FORMAT"]

SELECTION_FORMAT = "ds_adaptive.selection_cost/1"

# The shipped default (no measurement of this GPU): the selection the runtime runs (the fused pooled-LSE
# scoring + top-k, block 128, Dh 128, 12 heads) as `ds-adaptive calibrate --sparse --selection` fitted it on one
# H200 (the shipped H200 profile's sparse_attention.selection section). The earlier default, fitted to the
# torch scoring's in-trainer times, predicted an order of magnitude more than the fused kernel takes on an H100
# (the trainer A/B in docs/RESULTS.md); this fit is close to those H100 times. A calibration of the GPU replaces
# it.
DEFAULT_SELECTION = {"ms_per_call": 0.403712229116853, "ms_per_token": 3.197243575763739e-08,
                     "ms_per_logit": 7.645181453881365e-10, "ms_per_block_pair": 5.064767076161865e-08,
                     "block_size": 128,
                     "source": "default: the fused pooled_lse selection as calibrated on one H200 "
                               "(calibrate --sparse --selection, the shipped H200 profile)"}


def selection_features(batch, seq_len, heads, block_size: int) -> np.ndarray:
    """``[..., 4]`` the form's columns ``(1, B h S, B h nq S, B h nq nk)`` (numpy broadcasting over
    ``batch`` / ``seq_len`` / ``heads``)."""
    b = np.asarray(batch, dtype=np.float64)
    s = np.asarray(seq_len, dtype=np.float64)
    h = np.asarray(heads, dtype=np.float64)
    nb = np.ceil(s / block_size)
    b, s, h, nb = np.broadcast_arrays(b, s, h, nb)
    return np.stack([np.ones_like(s), b * h * s, b * h * nb * s, b * h * nb * nb], axis=-1)


@dataclass(frozen=True)
class SelectionCost:
    """Coefficients of the selection's time (ms; see the module docstring), for one block size."""

    ms_per_call: float = DEFAULT_SELECTION["ms_per_call"]
    """Fixed part of one layer's selection call (kernel launches), once per micro-batch."""
    ms_per_token: float = DEFAULT_SELECTION["ms_per_token"]
    """Per token per head per sample (the block-mean pooling of q)."""
    ms_per_logit: float = DEFAULT_SELECTION["ms_per_logit"]
    """Per (query block, key) pair per head per sample: Dh multiply-adds and one exp."""
    ms_per_block_pair: float = DEFAULT_SELECTION["ms_per_block_pair"]
    """Per (query block, key block) pair per head per sample: the top-k."""
    block_size: int = DEFAULT_SELECTION["block_size"]
    """Block size (tokens) of the measurement."""
    source: str = DEFAULT_SELECTION["source"]

    def __post_init__(self) -> None:
        for name in ("ms_per_call", "ms_per_token", "ms_per_logit", "ms_per_block_pair"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"selection cost {name} must be a finite number >= 0 (ms), got {v!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"selection cost block_size must be an int >= 1, got {self.block_size!r}")

    @property
    def coefficients(self) -> np.ndarray:
        return np.array([self.ms_per_call, self.ms_per_token, self.ms_per_logit, self.ms_per_block_pair])

    def call_ms(self, batch, seq_len, heads, block_size: Optional[int] = None):
        """One layer's selection call for ``batch`` samples of ``seq_len`` tokens over ``heads`` local heads (ms)."""
        return selection_features(batch, seq_len, heads, block_size or self.block_size) @ self.coefficients

    def per_sample_ms(self, seq_len, heads, block_size: Optional[int] = None):
        """The part of :meth:`call_ms` that each sample adds (everything but ``ms_per_call``)."""
        return self.call_ms(1, seq_len, heads, block_size) - self.ms_per_call

    @classmethod
    def default(cls) -> "SelectionCost":
        return cls()

    def as_dict(self) -> dict:
        return {"format": SELECTION_FORMAT, **asdict(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str = "<dict>") -> "SelectionCost":
        """From a ``sparse_attention.selection`` section (extra keys such as ``measurements`` and ``fit``
        are kept in the json, ignored here)."""
        try:
            return cls(**{k: (int(d[k]) if k == "block_size" else str(d[k]) if k == "source" else float(d[k]))
                          for k in ("ms_per_call", "ms_per_token", "ms_per_logit", "ms_per_block_pair",
                                    "block_size", "source") if k in d})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: sparse_attention.selection: {exc}") from exc

    @classmethod
    def load_for(cls, profile_json: Optional[Mapping[str, Any]], *, block_size: int, block_score: str = "pooled_lse",
                 where: str = "<profile>") -> "SelectionCost":
        """The measured selection of a profile json (``sparse_attention.selection``) when it was measured
        for this block size and scoring, else :meth:`default`."""
        sec = ((profile_json or {}).get("sparse_attention") or {}).get("selection")
        if not isinstance(sec, Mapping):
            return cls.default()
        if int(sec.get("block_size", -1)) != int(block_size) or sec.get("block_score", "pooled_lse") != block_score:
            return cls.default()
        return cls.from_dict(sec, where=where)
