"""Files written for people: the user's umask decides who can read them.

safetensors (0.8) creates its files with mode 0600 whatever the umask, so a dataset or an
exported model written by one user is unreadable for the rest of the team. ``save_safetensors``
writes through safetensors and then sets the mode a plain ``open()`` would have given.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Optional, Union

import torch


def umask_mode(base: int = 0o666) -> int:
    """``base`` with the current umask applied (what ``open(path, "w")`` creates)."""
    mask = os.umask(0)
    os.umask(mask)
    return base & ~mask


def save_safetensors(tensors: Mapping[str, torch.Tensor], path: Union[str, Path],
                     metadata: Optional[dict[str, str]] = None) -> Path:
    """``safetensors.torch.save_file`` with the file mode set from the user's umask (not 0600)."""
    from safetensors.torch import save_file

    save_file(dict(tensors), str(path), metadata=metadata)
    os.chmod(path, umask_mode())
    return Path(path)
