"""Raw media + captions -> a model's latent shards (``ds-adaptive preprocess``) and their shape mix (``stats``).

Modules, one job each:

* ``manifest``: inputs (jsonl / csv manifest or a folder with sidecar captions) -> ``MediaItem``s.
* ``policy``: ``ShapePolicy`` (the model's fps, frame counts, size buckets, cut / truncate) and the pure
  functions that map a source to output shapes under the model's grid rule.
* ``media``: probing and decoding (PyAV for videos, Pillow for images), frame sampling, resize + crop.
* ``encode``: ``LatentEncoders`` (the model's diffusers VAE + transformers text encoder), latent normalisation.
* ``run``: the resumable multi-rank job writing ``LatentShardWriter`` shards; ``stats``: histograms.

Needs the ``preprocess`` extra (``pip install 'ds_adaptive[preprocess]'``: av, transformers, diffusers, ftfy).
"""
from ds_adaptive.preprocess.manifest import ManifestError, MediaItem, read_inputs
from ds_adaptive.preprocess.policy import PolicyError, ShapePolicy, load_policy

__all__ = ["ManifestError", "MediaItem", "read_inputs", "PolicyError", "ShapePolicy", "load_policy"]
