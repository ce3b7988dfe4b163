"""Raw media + captions -> Wan latent shards (``ds-adaptive preprocess``) and their shape mix (``stats``).

Modules, one job each:

* ``manifest``: inputs (jsonl / csv manifest or a folder with sidecar captions) -> ``MediaItem``s.
* ``policy``: ``ShapePolicy`` (fps, 4n+1 frame counts, size buckets, cut / truncate) and the pure
  functions that map a source to output shapes.
* ``media``: probing and decoding (PyAV for videos, Pillow for images), frame sampling, resize + crop.
* ``encode``: ``WanEncoders`` (diffusers ``AutoencoderKLWan`` + transformers umT5), Wan's normalisation.
* ``run``: the resumable multi-rank job writing ``LatentShardWriter`` shards; ``stats``: histograms.

Needs the ``preprocess`` extra (``pip install 'ds_adaptive[preprocess]'``: av, transformers, diffusers, ftfy).
"""
from .manifest import ManifestError, MediaItem, read_inputs
from .policy import PolicyError, ShapePolicy, load_policy

__all__ = ["ManifestError", "MediaItem", "read_inputs", "PolicyError", "ShapePolicy", "load_policy"]
