"""Decoding: images (Pillow) and videos (PyAV), sampled to the policy's fps, resized + centre-cropped.

Why PyAV: its wheels carry their own FFmpeg (H.264/HEVC/VP9/AV1 decoders, libswscale), so
``pip install av`` is the whole install on any Linux node, and it does not depend on the torch
build (torchcodec wheels are tied to one torch release and need FFmpeg from the system).
Resizing happens inside libswscale while converting YUV -> RGB (one pass, no full-size RGB copy).

Frame sampling: target times ``start + i / fps``; each takes the source frame that is on screen at
that time (the last frame whose timestamp is <= t), so a 30 fps source at 16 fps drops frames
evenly and an 8 fps source repeats them. The display rotation of phone videos (display matrix)
and the EXIF orientation of photos are applied before choosing the bucket.

Everything that goes wrong with one file raises ``MediaError`` whose message is the reject reason.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import numpy as np

from ds_adaptive.core.shapes import GridRule, SampleShape
from ds_adaptive.preprocess.manifest import MediaItem
from ds_adaptive.preprocess.policy import ShapePolicy, choose_bucket, clip_frame_counts, plan_resize, sampled_frame_count

_EPS = 1e-6


class MediaError(Exception):
    """A file cannot become samples; the message is the reason written to the rejects file."""


@dataclass
class MediaInfo:
    """What probing a file (headers + at most one frame) tells: displayed size, rate and length."""

    kind: str                 # "image" | "video"
    height: int               # displayed (after rotation / EXIF orientation)
    width: int
    fps: float = 0.0          # source frame rate (videos)
    duration: float = 0.0     # seconds (videos)
    rotation: int = 0         # counter-clockwise degrees applied for display


@dataclass
class DecodedItem:
    """Clips of one item: ``clips[k]`` uint8 ``[frames, height, width, 3]`` (RGB), ``starts[k]`` seconds."""

    clips: list = field(default_factory=list)
    starts: list = field(default_factory=list)
    source_frames: int = 0    # sampled frames before cutting into clips
    seconds: float = 0.0      # decode wall time
    grid: Optional[GridRule] = None  # the policy's (the model's) grid rule
    upscale: float = 1.0      # resize factor to cover the size bucket (> 1: smaller than every bucket, upscaled)

    @property
    def shapes(self) -> list[SampleShape]:
        return [SampleShape(*c.shape[:3], self.grid) for c in self.clips]


def _open_image(path: str):
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        img = Image.open(path)
        img.load()
    except FileNotFoundError:
        raise MediaError("file not found") from None
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise MediaError(f"unreadable image ({type(exc).__name__}: {exc})") from None
    return ImageOps.exif_transpose(img).convert("RGB")


def _open_video(path: str):
    import av

    try:
        container = av.open(path)
    except FileNotFoundError:
        raise MediaError("file not found") from None
    except (av.FFmpegError, OSError, ValueError, UnicodeDecodeError) as exc:
        raise MediaError(f"unreadable video ({type(exc).__name__}: {exc})") from None
    if not container.streams.video:
        container.close()
        raise MediaError("no video stream in the file")
    return container


def _video_fps(stream) -> float:
    for rate in (stream.average_rate, stream.guessed_rate, stream.base_rate):
        if rate:
            return float(rate)
    return 0.0


def _video_duration(container, stream) -> float:
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration:
        return container.duration / 1e6
    if stream.frames and _video_fps(stream):
        return stream.frames / _video_fps(stream)
    return 0.0


def _rotation(frame) -> int:
    rot = int(round((getattr(frame, "rotation", 0) or 0) / 90.0)) * 90
    return rot % 360


def probe(item: MediaItem) -> MediaInfo:
    """Displayed size (and for videos rate, length, rotation) from headers and the first frame."""
    if item.is_image:
        img = _open_image(item.path)
        return MediaInfo("image", img.height, img.width)
    import av

    container = _open_video(item.path)
    try:
        stream = container.streams.video[0]
        try:
            first = next(container.decode(stream), None)
        except (av.FFmpegError, OSError, ValueError) as exc:
            raise MediaError(f"cannot decode the first frame ({type(exc).__name__}: {exc})") from None
        if first is None:
            raise MediaError("the video stream has no frames")
        rot = _rotation(first)
        h, w = (first.width, first.height) if rot in (90, 270) else (first.height, first.width)
        return MediaInfo("video", h, w, _video_fps(stream), _video_duration(container, stream), rot)
    finally:
        container.close()


def _span(item: MediaItem, duration: float) -> tuple[float, float]:
    start = item.start or 0.0
    end = duration if item.end is None else min(item.end, duration) if duration > 0 else item.end
    return start, end


def _too_short(n: int, fps: float, policy: ShapePolicy, span: str) -> MediaError:
    need = policy.frame_counts[0]
    return MediaError(f"too short: {n} frame(s) at {fps:g} fps {span}; the shortest clip needs {need} "
                      f"frames ({(need - 1) / fps:.2f} s)")


def planned_shapes(item: MediaItem, info: MediaInfo, policy: ShapePolicy) -> list[SampleShape]:
    """The shapes ``decode_item`` is expected to produce, from probed metadata (what ``stats`` counts).

    Videos: the sampled frame count comes from the container's duration, which a damaged or
    variable-rate file can misstate; ``preprocess`` decides on the frames it really decodes."""
    if info.kind == "image":
        h, w = choose_bucket(info.height, info.width, policy.image_buckets, policy)
        return [policy.shape(1, h, w)]
    fps = item.fps or policy.fps
    start, end = _span(item, info.duration)
    n = sampled_frame_count(end - start, fps)
    counts = clip_frame_counts(n, policy)
    if not counts:
        raise _too_short(n, fps, policy, f"in {start:g}..{end:g} s")
    h, w = choose_bucket(info.height, info.width, policy.video_buckets, policy)
    return [policy.shape(f, h, w) for f in counts]


def _decode_image(item: MediaItem, policy: ShapePolicy) -> DecodedItem:
    from PIL import Image

    img = _open_image(item.path)
    bucket = choose_bucket(img.height, img.width, policy.image_buckets, policy)
    r = plan_resize(img.height, img.width, bucket)
    img = img.resize((r.resized_w, r.resized_h), Image.BICUBIC)
    arr = np.asarray(img.crop((r.left, r.top, r.left + r.width, r.top + r.height)), dtype=np.uint8)
    return DecodedItem([arr[None].copy()], [0.0], 1, grid=policy.grid, upscale=r.scale)


def _sampled_frames(container, stream, start: float, end: float, fps: float,
                    limit: Optional[int]) -> Iterator[tuple[float, object]]:
    """(target time, source frame) for targets ``start + i / fps`` < ``end``, at most ``limit``.

    Target t shows the last frame with timestamp <= t (before the first frame: the first frame);
    the last frame stays on screen for its duration (else 1 / source fps)."""
    import av

    if start > 0 and stream.time_base:
        try:
            container.seek(int(start / stream.time_base) + (stream.start_time or 0), stream=stream, backward=True)
        except av.FFmpegError:
            container.seek(0, stream=stream)
    src_fps = _video_fps(stream)
    limit = math.inf if limit is None else limit
    i, prev, prev_t, last_dur = 0, None, 0.0, (1.0 / src_fps if src_fps else _EPS)
    for frame in container.decode(stream):
        t = frame.time
        if t is None:
            continue
        if frame.duration and frame.time_base:
            last_dur = float(frame.duration * frame.time_base)
        while i < limit and start + i / fps < min(t, end) - _EPS:
            yield start + i / fps, (prev if prev is not None else frame)
            i += 1
        if i >= limit or t >= end - _EPS:
            return
        prev, prev_t = frame, t
    if prev is not None:
        stop = min(end, prev_t + last_dur)
        while i < limit and start + i / fps < stop - _EPS:
            yield start + i / fps, prev
            i += 1


def _decode_video(item: MediaItem, policy: ShapePolicy) -> DecodedItem:
    import av

    fps = item.fps or policy.fps
    container = _open_video(item.path)
    try:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        # the stream's end ends the last clip; the container's duration can be off by a frame
        start, end = item.start or 0.0, (math.inf if item.end is None else item.end)
        longest = policy.frame_counts[-1]
        limit = longest if policy.long_clips == "truncate" else (
            longest * policy.max_clips_per_video if policy.max_clips_per_video else None)
        frames: list[np.ndarray] = []
        last_src, last_arr, resize, rot = None, None, None, 0
        try:
            for _t, src in _sampled_frames(container, stream, start, end, fps, limit):
                if src is not last_src:
                    if resize is None:
                        rot = _rotation(src)
                        h, w = (src.width, src.height) if rot in (90, 270) else (src.height, src.width)
                        resize = plan_resize(h, w, choose_bucket(h, w, policy.video_buckets, policy))
                    rh, rw = resize.resized_h, resize.resized_w
                    cw, ch = (rh, rw) if rot in (90, 270) else (rw, rh)  # coded orientation
                    arr = src.to_ndarray(width=cw, height=ch, format="rgb24", interpolation="BICUBIC",
                                         src_color_range=src.color_range or None, dst_color_range="JPEG")
                    if rot:
                        arr = np.rot90(arr, k=rot // 90)
                    last_arr = np.ascontiguousarray(arr[resize.top: resize.top + resize.height,
                                                        resize.left: resize.left + resize.width])
                    last_src = src
                frames.append(last_arr)
        except (av.FFmpegError, OSError, ValueError) as exc:
            raise MediaError(f"decode error after {len(frames)} sampled frame(s) ({type(exc).__name__}: {exc})") \
                from None
    finally:
        container.close()
    counts = clip_frame_counts(len(frames), policy)
    if not counts:
        span = f"in {start:g}..{end:g} s" if math.isfinite(end) else f"from {start:g} s to the end"
        raise _too_short(len(frames), fps, policy, span)
    out = DecodedItem(source_frames=len(frames), grid=policy.grid, upscale=resize.scale if resize else 1.0)
    pos = 0
    for f in counts:
        out.clips.append(np.stack(frames[pos: pos + f]))
        out.starts.append(start + pos / fps)
        pos += f
    return out


def decode_item(item: MediaItem, policy: ShapePolicy) -> DecodedItem:
    """Decode ``item`` into clips of policy shapes; raises ``MediaError`` (the reject reason)."""
    if item.problem:
        raise MediaError(item.problem)
    t0 = time.perf_counter()
    out = _decode_image(item, policy) if item.is_image else _decode_video(item, policy)
    out.seconds = time.perf_counter() - t0
    return out
