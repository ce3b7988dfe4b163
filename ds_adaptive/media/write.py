"""Writing generated samples: VAE decode, latent previews, PNG / GIF / MP4 files.

    vae = preprocess.encode.load_vae(model, "pipeline/vae")   # the model's VAE class, checked against its grid
    frames = decode_latents(vae, latents)          # uint8 [B, T, H, W, 3]
    strip = latent_strip(latents[0], upscale=8)    # uint8 [T' * 8, n * W' * 8, 3] without a VAE
    write_media(frames[0], "out.mp4", fps=16)      # .mp4 (PyAV), .gif (Pillow), .png (a frame strip)

Latents are the DiT's normalised latents ``(mu - latents_mean) / latents_std`` (``preprocess.encode``);
:func:`decode_latents` undoes that with the VAE config's per-channel means and stds (16 for Wan 2.1's VAE, 48 for
Wan 2.2's) before ``vae.decode``, as diffusers' Wan pipelines do. Without a VAE, :func:`latent_strip` shows three latent channels as RGB on a fixed range and
puts up to ``max_frames`` latent frames side by side: enough to see structure and motion appear during training,
at no cost.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import torch

LATENT_RGB_CHANNELS = (0, 1, 2)
"""Latent channels shown as R, G, B by the latent preview."""
LATENT_RGB_RANGE = 2.5
"""Normalised latent values (about unit variance) in ``[-range, range]`` map to 0..255; the same fixed map at every
step, so previews of one run compare."""
MEDIA_SUFFIXES = (".mp4", ".gif", ".png")


def _to_uint8(x: torch.Tensor) -> np.ndarray:
    """[-1, 1] float -> uint8 0..255."""
    return ((x.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu().numpy()


def latent_rgb(latent: torch.Tensor) -> np.ndarray:
    """Normalised latent ``[C, T', H', W']`` -> uint8 ``[T', H', W', 3]``: channels :data:`LATENT_RGB_CHANNELS`
    as R, G, B on the fixed range :data:`LATENT_RGB_RANGE`."""
    if latent.dim() != 4 or latent.shape[0] <= max(LATENT_RGB_CHANNELS):
        raise ValueError(f"latent must be [C >= 3, T', H', W'], got {list(latent.shape)}")
    rgb = latent[list(LATENT_RGB_CHANNELS)].float().cpu().permute(1, 2, 3, 0) / LATENT_RGB_RANGE
    return _to_uint8(rgb)


def frame_strip(frames: np.ndarray, max_frames: int = 8) -> np.ndarray:
    """uint8 ``[T, H, W, 3]`` -> ``[H, n*W, 3]``: up to ``max_frames`` frames evenly spaced over T, side by side."""
    t = frames.shape[0]
    idx = np.unique(np.linspace(0, t - 1, num=min(t, max_frames)).round().astype(int))
    return np.concatenate([frames[i] for i in idx], axis=1)


def latent_strip(latent: torch.Tensor, max_frames: int = 8, upscale: Union[int, Sequence[int]] = 8) -> np.ndarray:
    """The latent preview image of one sample: :func:`latent_rgb`, each latent pixel ``upscale`` pixels high and
    wide (an int, or (height, width): the VAE's spatial stride, so that the strip has the video's size per
    frame), frames side by side."""
    rgb = latent_rgb(latent)
    uh, uw = (upscale, upscale) if isinstance(upscale, int) else (int(upscale[0]), int(upscale[1]))
    if uh > 1 or uw > 1:
        rgb = rgb.repeat(uh, axis=1).repeat(uw, axis=2)
    return frame_strip(rgb, max_frames)


@torch.no_grad()
def decode_latents(vae, latents: torch.Tensor, *, device: Optional[torch.device] = None,
                   tiling: bool = True) -> np.ndarray:
    """Normalised latents ``[B, C, T', H', W']`` -> uint8 frames ``[B, T, H, W, 3]`` with the model's diffusers
    VAE (:func:`ds_adaptive.media.encode.load_vae`; on ``device``, default the VAE's; spatial tiling on by
    default to bound memory). C must be the VAE's ``z_dim`` (its config's ``latents_mean`` / ``latents_std``)."""
    cfg = vae.config
    dev = device or next(vae.parameters()).device
    dtype = next(vae.parameters()).dtype
    if latents.dim() != 5 or latents.shape[1] != len(cfg.latents_mean):
        raise ValueError(f"latents {list(latents.shape)} do not fit the VAE: it decodes [B, {len(cfg.latents_mean)}, "
                         "T', H', W'] (z_dim channels)")
    mean = torch.tensor(cfg.latents_mean, dtype=torch.float32, device=dev).view(1, -1, 1, 1, 1)
    std = torch.tensor(cfg.latents_std, dtype=torch.float32, device=dev).view(1, -1, 1, 1, 1)
    z = latents.to(dev, torch.float32) * std + mean
    if hasattr(vae, "enable_tiling") and tiling:
        vae.enable_tiling()
    video = vae.decode(z.to(dtype), return_dict=False)[0]  # [B, 3, T, H, W] in [-1, 1]
    return _to_uint8(video.permute(0, 2, 3, 4, 1))


def write_png(image: np.ndarray, path: Union[str, Path]) -> Path:
    from PIL import Image

    Image.fromarray(np.ascontiguousarray(image)).save(str(path))
    return Path(path)


def write_gif(frames: np.ndarray, path: Union[str, Path], fps: int) -> Path:
    from PIL import Image

    images = [Image.fromarray(np.ascontiguousarray(f)) for f in frames]
    images[0].save(str(path), save_all=True, append_images=images[1:], duration=max(1, round(1000 / fps)), loop=0)
    return Path(path)


def write_mp4(frames: np.ndarray, path: Union[str, Path], fps: int) -> Path:
    """H.264 (yuv420p) through PyAV; odd sizes are cropped to even."""
    try:
        import av
    except ImportError:
        raise RuntimeError("writing mp4 needs PyAV (pip install av); or choose gif") from None
    t, h, w, _ = frames.shape
    h2, w2 = h - h % 2, w - w % 2
    with av.open(str(path), mode="w") as out:
        stream = out.add_stream("libx264", rate=int(fps))
        stream.width, stream.height, stream.pix_fmt = w2, h2, "yuv420p"
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f[:h2, :w2]), format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return Path(path)


def write_media(frames: np.ndarray, path: Union[str, Path], *, fps: int = 16) -> Path:
    """uint8 frames ``[T, H, W, 3]`` to ``path`` by its suffix: ``.mp4``, ``.gif``, or ``.png`` (a frame strip;
    a single frame as it is)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in MEDIA_SUFFIXES:
        path.parent.mkdir(parents=True, exist_ok=True)  # `--out samples/ball.mp4` as written
    if suffix == ".mp4":
        return write_mp4(frames, path, fps)
    if suffix == ".gif":
        return write_gif(frames, path, fps)
    if suffix == ".png":
        return write_png(frames[0] if len(frames) == 1 else frame_strip(frames), path)
    raise ValueError(f"{path}: the file type is taken from the suffix, one of {MEDIA_SUFFIXES}")

