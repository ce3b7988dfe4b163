"""Reading the package's json inputs (shape mixes, dataset indexes) with errors that name the file."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: Path, *, missing: str, missing_error: type = FileNotFoundError,
              invalid_error: type = ValueError, fix: str = "") -> Any:
    """The parsed json at ``path``; ``missing_error(missing)`` when there is no such file,
    ``invalid_error`` naming the file, the parser's message and ``fix`` when it is not valid json."""
    if not path.is_file():
        raise missing_error(missing)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise invalid_error(f"{path} is not valid JSON: {exc}{fix}") from exc
