"""Pixels in and out: a model's VAE and text encoder (``encode``), decoding images and videos (``decode``),
writing generated samples as PNG / GIF / MP4 (``write``).
"""
