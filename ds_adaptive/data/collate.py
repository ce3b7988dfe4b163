"""Collate one micro-batch: samples share one latent shape; contexts are zero-padded.

Wan pads every umT5 text embedding with zeros to its text length (512) and attends to the
padding (its cross-attention gets no mask). We do the same by default, so that a sample's
output does not depend on which other samples share its micro-batch: the loss of a sample is
the same whatever the batch sizes, which the loss weighting and the resume / equivalence
tests rely on. ``context_lens`` is returned too, for models that mask.
"""
from __future__ import annotations

from typing import Literal, Sequence, Union

import torch

from ds_adaptive.core.shapes import default_input_spec
from ds_adaptive.data.synthetic import DataError


def collate_latents(samples: Sequence[dict], pad_text_to: Union[int, None, Literal["model"]] = "model") -> dict:
    """Stack ``samples`` into ``{"latents": [B,C,T',H',W'], "context": [B,L,text_dim], "context_lens": [B],
    "index": [B]}``.

    ``pad_text_to``: context length after zero padding (``"model"``: the default model's text length,
    512 for Wan); ``None`` pads to the longest context in the batch. A context longer than
    ``pad_text_to`` is an error (truncating a prompt would silently change the sample).
    """
    if not samples:
        raise DataError("collate_latents got an empty micro-batch; the batch sampler yielded []")
    shapes = {tuple(s["latents"].shape) for s in samples}
    if len(shapes) != 1:
        detail = ", ".join(f"{s['index']}: {tuple(s['latents'].shape)}" for s in samples)
        raise DataError("samples of one micro-batch must share a latent shape (the batch sampler groups them "
                        f"by shape); got index: shape {detail}")
    lens = [int(s["context"].shape[0]) for s in samples]
    if pad_text_to == "model":
        pad_text_to = default_input_spec().text_len
    target = max(lens) if pad_text_to is None else int(pad_text_to)
    if max(lens) > target:
        i = lens.index(max(lens))
        raise DataError(f"sample {samples[i]['index']} has a {max(lens)}-token context, longer than "
                        f"pad_text_to={target}; the model's text length is at most {target} tokens")
    ref = samples[0]["context"]
    context = ref.new_zeros((len(samples), target, ref.shape[1]))
    for row, s in enumerate(samples):
        context[row, : lens[row]] = s["context"]
    return {
        "latents": torch.stack([s["latents"] for s in samples]),
        "context": context,
        "context_lens": torch.tensor(lens, dtype=torch.long),
        "index": torch.tensor([int(s["index"]) for s in samples], dtype=torch.long),
    }
