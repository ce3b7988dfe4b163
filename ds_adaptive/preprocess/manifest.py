"""Inputs of ``ds-adaptive preprocess``: a manifest (jsonl / csv) or a folder with sidecar captions.

Manifest rows (relative paths resolve against the manifest's directory)::

    {"path": "clips/a.mp4", "caption": "a red car", "start": 2.0, "end": 9.5, "fps": 16}   # jsonl
    path,caption,start,end,fps                                                             # csv header
    clips/a.mp4,"a red car",2.0,9.5,16

``start`` / ``end`` (seconds) and ``fps`` (sampling rate of this row; default: the policy's) are
optional. A folder is scanned recursively for media files (sorted by relative path); the caption of
``x/clip.mp4`` is ``x/clip.txt``. Rows that cannot become samples (no caption, bad times) are not
errors: they become rejects with a reason, like undecodable files later on.
"""
from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Union

VIDEO_EXTS = (".mp4", ".webm", ".mov", ".mkv", ".avi", ".m4v", ".mpg", ".mpeg", ".gif")
IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff")
MANIFEST_KEYS = ("path", "caption", "start", "end", "fps")


class ManifestError(ValueError):
    """The manifest or input folder as a whole cannot be read (a bad row is a reject, not this)."""


@dataclass(frozen=True)
class MediaItem:
    """One input row. ``index`` is its position in the input (it names the samples: ``<index>-<clip>``)."""

    index: int
    path: str
    caption: Optional[str]
    start: Optional[float] = None
    end: Optional[float] = None
    fps: Optional[float] = None
    where: str = ""          # "manifest.jsonl line 7" / "folder entry 3", for messages
    problem: Optional[str] = None  # set when the row itself is unusable (becomes a reject)

    @property
    def is_image(self) -> bool:
        return Path(self.path).suffix.lower() in IMAGE_EXTS

    def as_dict(self) -> dict:
        return asdict(self)


def _num(row: dict, key: str) -> tuple[Optional[float], Optional[str]]:
    v = row.get(key)
    if v is None or (isinstance(v, str) and not v.strip()):
        return None, None
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None, f"'{key}' must be a number (seconds / frames per second), got {v!r}"
    if not math.isfinite(x) or x < 0 or (key == "fps" and x == 0):
        return None, f"'{key}' must be a finite number {'> 0' if key == 'fps' else '>= 0'}, got {v!r}"
    return x, None


def _item(index: int, row: dict, base: Path, where: str) -> MediaItem:
    unknown = sorted(set(row) - set(MANIFEST_KEYS))
    if unknown:
        raise ManifestError(f"{where}: unknown column(s) {unknown}; valid columns are {list(MANIFEST_KEYS)}")
    raw = row.get("path")
    if not isinstance(raw, str) or not raw.strip():
        return MediaItem(index, str(raw), None, where=where, problem="no 'path' in the manifest row")
    path = Path(raw.strip())
    path = str(path if path.is_absolute() else base / path)
    caption = row.get("caption")
    caption = caption.strip() if isinstance(caption, str) else None
    problems = []
    nums = {}
    for key in ("start", "end", "fps"):
        nums[key], err = _num(row, key)
        if err:
            problems.append(err)
    if nums["start"] is not None and nums["end"] is not None and nums["end"] <= nums["start"]:
        problems.append(f"'end' ({nums['end']}) must be after 'start' ({nums['start']})")
    if not caption:
        problems.append("missing caption (empty or absent 'caption')")
    return MediaItem(index, path, caption or None, nums["start"], nums["end"], nums["fps"], where,
                     "; ".join(problems) or None)


def read_manifest(path: Union[str, Path]) -> list[MediaItem]:
    """Rows of a ``.jsonl`` / ``.json`` (one object per line) or ``.csv`` (with a header) manifest."""
    p = Path(path)
    if not p.is_file():
        raise ManifestError(f"manifest {p} does not exist")
    base = p.resolve().parent
    items: list[MediaItem] = []
    if p.suffix.lower() == ".csv":
        with p.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            if not reader.fieldnames or "path" not in reader.fieldnames:
                raise ManifestError(f"{p}: the first line must be a header with at least 'path' and 'caption' "
                                    f"(valid columns: {list(MANIFEST_KEYS)}), got {reader.fieldnames}")
            for row in reader:
                items.append(_item(len(items), row, base, f"{p} line {reader.line_num}"))
        return items
    if p.suffix.lower() not in (".jsonl", ".json", ".ndjson"):
        raise ManifestError(f"manifest {p}: unknown format {p.suffix!r}; use .jsonl (one JSON object per line) "
                            "or .csv (header path,caption[,start,end,fps]), or pass a folder")
    for lineno, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{p} line {lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            items.append(MediaItem(len(items), "", None, where=where, problem=f"not valid JSON ({exc})"))
            continue
        if not isinstance(row, dict):
            items.append(MediaItem(len(items), "", None, where=where, problem="a row must be a JSON object"))
            continue
        items.append(_item(len(items), row, base, where))
    return items


def scan_folder(root: Union[str, Path]) -> list[MediaItem]:
    """Media files under ``root`` (recursive, sorted) with captions from ``<stem>.txt`` beside them."""
    r = Path(root)
    if not r.is_dir():
        raise ManifestError(f"input folder {r} does not exist")
    files = sorted((p for p in r.rglob("*") if p.is_file() and p.suffix.lower() in VIDEO_EXTS + IMAGE_EXTS),
                   key=lambda p: p.relative_to(r).as_posix())
    items = []
    for i, f in enumerate(files):
        side = f.with_suffix(".txt")
        caption = side.read_text(encoding="utf-8", errors="replace").strip() if side.is_file() else ""
        problem = None if caption else f"missing caption ({side.name} {'is empty' if side.is_file() else 'not found'})"
        items.append(MediaItem(i, str(f), caption or None, where=f"{r} file {f.relative_to(r)}", problem=problem))
    return items


def read_inputs(source: Union[str, Path]) -> list[MediaItem]:
    """A manifest file or a media folder -> items in input order."""
    p = Path(source)
    items = scan_folder(p) if p.is_dir() else read_manifest(p)
    if not items:
        raise ManifestError(f"{p} lists no media (manifest rows, or files with extensions "
                            f"{' '.join(VIDEO_EXTS + IMAGE_EXTS)})")
    return items
