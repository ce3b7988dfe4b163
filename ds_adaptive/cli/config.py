"""``ds-adaptive config``: the adaptive_load reference (``--reference``: docs/CONFIG.md), or ``--check DS_CONFIG``:
the block and the rules that span fields, as the dry run and the trainer check them."""
from __future__ import annotations

import argparse
import json
import re
import typing
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel

from ds_adaptive.core.config import BLOCK_KEY, AdaptiveLoadConfig, ConfigError
from ds_adaptive.core.config_base import is_advanced
from ds_adaptive.core.config_moves import MOVED_KEYS
from ds_adaptive.core.ds_config import load_adaptive_config, read_ds_config
from ds_adaptive.models.registry import get_model
from ds_adaptive.planning.context_parallel import ContextParallelCost
from ds_adaptive.planning.profile import load_profile
from ds_adaptive.planning.sparse_cost import SparseAttentionCost
from ds_adaptive.planning.validate import RunFacts, run_problems
from ds_adaptive.simulation.context_parallel import uniform_densities


REFERENCE_COMMAND = "ds-adaptive config --reference > docs/CONFIG.md"
#: keys the schema still reads for one release (``ds_adaptive.core.sampler_config``, ``core.config_moves``), and
#: where they went
DEPRECATED_KEYS = [("adaptive_load.sampler.zero_stage", "the ZeRO stage is the ds_config's `zero_optimization.stage`; "
                    "a value that disagrees with it is an error (exit 2), an equal one a warning. Drop the key.")] + [
    (f"{BLOCK_KEY}.{old}", f"moved to `{BLOCK_KEY}.{new}` (the same values); setting both is an error (exit 2). "
                           "Move the key.") for old, new in MOVED_KEYS]
#: the marker of an advanced key in the table
ADVANCED_MARK = "*(advanced)*"

REFERENCE_INTRO = """\
# The `adaptive_load` block: every key

Generated from the config's field docstrings by `{command}` (a test keeps it current: do not
edit by hand). DeepSpeed ignores top-level keys it does not know, so the block lives in the ds_config json you
pass to `deepspeed`; it is validated strictly (an unknown key, a key given twice or a wrong type is an error
naming the key and the file; types are not coerced). `ds-adaptive config --check FILE` checks a file and the
rules that span fields (`--model`, `--layers`, `--sp`, `--world`, `--device` say what it may assume about the
run); `--json` prints the resolved block.

Shipped configs (`launch/configs/`): `zero3_adaptive.json` (ZeRO-3, AdaptiveLoad on, fused op on; the GPU
default), `zero3_adaptive_14b.json` (the 14B model's calibration profile),
`zero3_adaptive_ti2v5b.json` (for the TI2V-5B model), `zero3_baseline.json` (AdaptiveLoad off: the
equal-token baseline at the same memory budget), `cpu_tiny.json` (the CPU default: fp32, `power` cost model
with explicit budgets, `shapes_cpu.json`).

The table gives each key's first sentence; the full text of every key follows it, block by block. Within a
block the keys an everyday run sets come first; its advanced keys (research and tuning knobs a run can leave at
their defaults, marked {mark} in the table) follow under "Advanced".
"""

_SENTENCE_END = re.compile(r"(?<!e\.g)(?<!i\.e)(?<!vs)\.\s+(?=[A-Z`(])")


def _type_name(ann: Any) -> str:
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is Literal:
        return " \\| ".join(json.dumps(a) for a in args)
    if origin is Union:
        return " \\| ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin is dict:
        return f"object of {_type_name(args[1])}"
    return getattr(ann, "__name__", str(ann))


def _bounds(field) -> str:
    marks = []
    for m in field.metadata:
        for attr, sym in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            v = getattr(m, attr, None)
            if v is not None:
                marks.append(f"{sym} {v}")
    return f" ({', '.join(marks)})" if marks else ""


def _optional_block(ann: Any) -> Optional[type]:
    """The model of an ``Optional[SomeBlock]`` annotation, else None."""
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    if typing.get_origin(ann) is Union and len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0]
    return None


def _doc(field) -> str:
    return " ".join((field.description or "").split()).replace("|", "\\|")


def _sections() -> list[tuple[str, list[tuple[str, str, str, str, bool]]]]:
    """Every block of adaptive_load, depth first in the models' field order: (block key, its rows), a row being
    (key, type, default, full description, advanced), the block's everyday keys first, then its advanced ones (a key
    of an advanced block is advanced)."""
    out = []

    def walk(model: type[BaseModel], key: str, advanced_block: bool) -> None:
        rows, subs = [], []
        for name, field in model.model_fields.items():
            ann, adv, path = field.annotation, advanced_block or is_advanced(field), f"{key}.{name}"
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                subs.append((ann, path, adv))
                continue
            block = _optional_block(ann)
            if block is not None:   # a sub-block that is off when null (ema, caption_dropout, validation)
                rows.append((path, "object \\| null", "`null`", _doc(field), adv))
                subs.append((block, path, adv))
                continue
            default = "required" if field.is_required() else f"`{json.dumps(field.get_default(call_default_factory=True))}`"
            rows.append((path, f"{_type_name(ann)}{_bounds(field)}", default, _doc(field), adv))
        out.append((key, sorted(rows, key=lambda r: r[4])))   # stable: everyday keys keep their order, then advanced
        for sub in subs:
            walk(*sub)

    walk(AdaptiveLoadConfig, BLOCK_KEY, False)
    return out


def _rows() -> list[tuple[str, str, str, str, bool]]:
    """(key, type, default, full description, advanced) of every key of the block, block by block."""
    return [row for _, rows in _sections() for row in rows]


def _first_sentence(text: str, limit: int = 160) -> str:
    """The docstring's first sentence, cut at a word before ``limit`` characters (the full text is on the page)."""
    head = _SENTENCE_END.split(text, maxsplit=1)[0].rstrip(".")
    if len(head) > limit:
        head = head[:head.rfind(" ", 0, limit - 4)].rstrip(",;:( ")
        return head + ("`" if head.count("`") % 2 else "") + " ..."
    return head + ("." if head else "")


def markdown_reference() -> str:
    """The table of every key of the adaptive_load block: type, default and the first sentence of its docstring."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    rows += [f"| `{k}`{' ' + ADVANCED_MARK if adv else ''} | {t} | {d} | {_first_sentence(doc)} |"
             for k, t, d, doc, adv in _rows()]
    return "\n".join(rows)


def _full_text(sections) -> str:
    """Every block's keys in full: a heading per block, its everyday keys, then its advanced keys under "Advanced"."""
    lines = []
    for block, rows in sections:
        lines.append(f"\n### `{block}`\n")
        for i, (k, t, d, doc, adv) in enumerate(rows):
            if adv and (i == 0 or not rows[i - 1][4]):
                lines.append(f"\n#### Advanced (`{block}`)\n")
            lines.append(f"- **`{k}`** ({t}, default {d}): {doc.replace(chr(92) + '|', '|')}")
    return "\n".join(lines)


def reference_page() -> str:
    """docs/CONFIG.md: the intro, the short table, then every key's full docstring, block by block."""
    return (REFERENCE_INTRO.format(command=REFERENCE_COMMAND, mark=ADVANCED_MARK) + "\n" + markdown_reference()
            + "\n\n## Every key in full\n" + _full_text(_sections()) + "\n"
            + "\n## Deprecated keys\n\nStill read for one release, with a warning naming where they went:\n\n"
            + "\n".join(f"- `{k}`: {why}" for k, why in DEPRECATED_KEYS) + "\n")


def _cross_field_problems(args, raw: dict, block: AdaptiveLoadConfig) -> list:
    """``config --check``: ``ds_adaptive.planning.validate.run_problems`` with what the flags say about the run."""
    device = args.device
    if device is None:
        try:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:  # pragma: no cover - torch is a dependency
            device = None
    return run_problems(raw, block, RunFacts(model=args.model, layers=args.layers, sp=args.sp, world=args.world,
                                             device=device))


def _mesh_line(args, block: AdaptiveLoadConfig, tokens: int = 75_600) -> Optional[str]:
    """Under hybrid context parallelism with ``--model`` and ``--sp``: which layers run on which mesh at ``tokens``
    and the density stage 2 runs at (``forced_density``, else ``layer_density_threshold``); the dry run shows the
    run's longest shape with its backend's curve."""
    sa = block.sparse_attention
    if not (sa.enabled and sa.context_parallel != "heads" and args.model and args.sp and args.sp > 1):
        return None
    mc = get_model(args.model).config(**({"num_layers": args.layers} if args.layers else {}))
    d = sa.forced_density if sa.forced_density is not None else sa.layer_density_threshold
    dm = uniform_densities(mc.num_layers, mc.num_heads, d, sa.dense_layers)
    cost = SparseAttentionCost(densities=dm, block_size=sa.block_size, dense_above=sa.dense_above,
                               head_placement="identity", min_blocks=1 + int(sa.keep_sink),
                               context_parallel=ContextParallelCost.from_config(sa, mc.head_dim))
    try:   # the profile's dense attention time (else relative times: the mesh then follows the bytes)
        cost = cost.for_profile(load_profile(block.sampler.profile))
    except (ValueError, FileNotFoundError, TypeError):
        pass
    return "note: " + cost.mesh_summary(tokens, args.sp) + f", at density {d}"


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ds-adaptive config",
        description="Check a ds_config's adaptive_load block, or print the reference of every key. "
                    "Without arguments: the table of keys, types and defaults.")
    parser.add_argument("--check", metavar="DS_CONFIG",
                        help="check the adaptive_load block of this ds_config and the rules that span fields; ends "
                             "with one verdict line (exit 0: OK, 2: the problems above it)")
    parser.add_argument("--json", action="store_true", help="with --check: print the resolved block as JSON too")
    parser.add_argument("--reference", action="store_true",
                        help=f"print the whole reference page (`{REFERENCE_COMMAND}`)")
    parser.add_argument("--model", default=None, help="--check: the model it trains (layer indices, heads)")
    parser.add_argument("--layers", type=int, default=None, help="--check: the trainer's --layers")
    parser.add_argument("--sp", type=int, default=None, help="--check: the Ulysses degree")
    parser.add_argument("--world", type=int, default=None, help="--check: ranks of the launch (batch keys vs dp)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="--check: where the ranks compute (default: this machine's, as `ds-adaptive train`)")
    args = parser.parse_args(argv)
    if args.reference:
        print(reference_page(), end="")
        return 0
    if not args.check:
        if args.json:
            parser.error("--json goes with --check DS_CONFIG")
        print(markdown_reference())
        return 0
    try:
        cfg = load_adaptive_config(args.check)
        raw = read_ds_config(args.check)
        problems = _cross_field_problems(args, raw, cfg)
    except ConfigError as exc:
        print(f"ds-adaptive config: error: {exc}")
        print(f"FAILED: {args.check} has 1 problem")
        return 2
    for p in problems:
        print(f"ds-adaptive config: error: {p.message}")
    if problems:
        print(f"FAILED: {args.check} has {len(problems)} problem(s)")
        return 2
    if args.json:
        print(json.dumps({BLOCK_KEY: cfg.model_dump()}, indent=2))
    line = _mesh_line(args, cfg)
    if line:
        print(line)
    if BLOCK_KEY in raw:
        s = cfg.sampler
        print(f"OK: {args.check} is valid (AdaptiveLoad {'on' if cfg.enabled else 'off'}, sampler {s.mode}/"
              f"{s.cost_model}, profile {s.profile})")
    else:
        print(f"OK: {args.check} is valid; it has no '{BLOCK_KEY}' block, so AdaptiveLoad is off (the defaults apply)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
