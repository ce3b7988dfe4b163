"""Write the synthetic latent dataset to disk (index.arrow + safetensors shards): ``ds-adaptive synth``
(``ds_adaptive/cli/synth.py``) runs :func:`write_synthetic`.

The samples are exactly those of the embedded default (``--data synthetic`` with the same
shapes, seed and number of samples), so a run on the written directory and a run on the
embedded dataset see the same data.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import NamedTuple, Optional, Union

from ds_adaptive.data.shards import LatentShardWriter, write_empty_prompt
from ds_adaptive.data.synthetic import SyntheticLatentDataset
from ds_adaptive.models.registry import default_model, get_model


class SynthWritten(NamedTuple):
    """What :func:`write_synthetic` wrote."""

    description: str   # the dataset's ``describe()``
    num_shards: int
    index: Path
    seconds: float


def write_synthetic(out: Union[str, Path], num_samples: int, *, model: Optional[str] = None,
                    shapes: Union[str, Path, None] = None, seed: int = 0,
                    text_len: Optional[tuple[int, int]] = None, dtype: str = "float32", shard_mb: float = 1024,
                    overwrite: bool = False) -> SynthWritten:
    """The synthetic dataset of ``model`` (default: the default model; its shipped shape mix unless ``shapes``)
    written to ``out``, with the empty prompt's context that caption dropout uses. Raises ``DataError``,
    ``ShapeError``, ``ModelError`` or ``FileNotFoundError`` on bad input."""
    spec_model = get_model(model or default_model())
    ds = SyntheticLatentDataset(num_samples, shapes or spec_model.shapes, seed=seed,
                                text_len=tuple(text_len) if text_len else None, spec=spec_model.input_spec)
    t0 = time.perf_counter()
    with LatentShardWriter(out, shard_bytes=int(shard_mb * 2**20), dtype=dtype, overwrite=overwrite,
                           spec=spec_model.input_spec) as writer:
        for i in range(len(ds)):
            s = ds[i]
            writer.add(f"{i:08d}", ds.shape_of(i), s["latents"], s["context"])
    index = writer.close()
    write_empty_prompt(out, ds.empty_context())   # what caption dropout replaces a caption with
    return SynthWritten(ds.describe(), writer.num_shards, index, time.perf_counter() - t0)


if __name__ == "__main__":   # the command moved to the cli layer: say where, never exit 0 having done nothing
    print("python -m ds_adaptive.data.synth is no longer a command: run `ds-adaptive synth` (or python -m ds_adaptive.cli.synth) "
          "with the same arguments", file=sys.stderr)
    raise SystemExit(2)
