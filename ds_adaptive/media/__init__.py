"""A model's pixels and words in and out: its VAE and text encoder (``encode``: media and captions -> latents and
text features, also for previews and sampling) and generated samples written as PNG / GIF / MP4 (``write``).
Decoding source media for preprocessing is :mod:`ds_adaptive.preprocess.media`."""
