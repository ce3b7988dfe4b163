"""Guards the keys that moved out of `adaptive_load.sampler` (ds_adaptive/core/config_moves.py): an old key warns once
and means what the new key means, both keys are an error naming both, bad old values name the old key; and the
advanced marker of the config reference."""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest

from ds_adaptive.cli.config import ADVANCED_MARK, _sections, main as config_main, markdown_reference, reference_page
from ds_adaptive.core.config import AdaptiveLoadConfig, ConfigError
from ds_adaptive.core.config_base import is_advanced
from ds_adaptive.core.config_moves import MOVED_KEYS
from ds_adaptive.core.ds_config import load_adaptive_config

ROOT = Path(__file__).resolve().parents[3]

#: a value other than the default for every moved key (new block, new key) -> value
VALUES = {"recompute.blocks": "all", "recompute.attention": "keep", "optimization.loss_weighting": "tokens",
          "optimization.lr_scaling": "sqrt", "optimization.reference_batch": 64}
#: a value each key rejects, and a word of the error
BAD = {"recompute.blocks": ("some", "'auto', 'all' or 'none'"), "recompute.attention": ("save", "'recompute' or 'keep'"),
       "optimization.loss_weighting": ("pixels", "'samples' or 'tokens'"),
       "optimization.lr_scaling": ("cubic", "'linear' or 'sqrt'"),
       "optimization.reference_batch": (0, "greater than 0")}


def _nested(dotted: str, value) -> dict:
    block, key = dotted.split(".")
    return {block: {key: value}}


def _get(cfg: AdaptiveLoadConfig, dotted: str):
    block, key = dotted.split(".")
    return getattr(getattr(cfg, block), key)


def test_every_moved_key_has_a_test_value():
    assert sorted(new for _, new in MOVED_KEYS) == sorted(VALUES) == sorted(BAD)
    assert all(old.startswith("sampler.") for old, _ in MOVED_KEYS)


@pytest.mark.parametrize("old,new", MOVED_KEYS)
def test_an_old_key_warns_once_and_has_the_new_keys_effect(old, new):
    value = VALUES[new]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = AdaptiveLoadConfig.model_validate(_nested(old, value))
    lines = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert len(lines) == 1, lines
    assert f"adaptive_load.{old} is deprecated" in lines[0] and f"adaptive_load.{new}" in lines[0]
    assert "move the key there" in lines[0]
    assert got == AdaptiveLoadConfig.model_validate(_nested(new, value))
    assert _get(got, new) == value and old.split(".")[1] not in got.sampler.model_fields_set


@pytest.mark.parametrize("old,new", MOVED_KEYS)
def test_the_new_key_validates_without_a_warning(old, new):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _get(AdaptiveLoadConfig.model_validate(_nested(new, VALUES[new])), new) == VALUES[new]
    bad, words = BAD[new]
    with pytest.raises(ConfigError, match=rf"adaptive_load\.{re.escape(new)}: .*{re.escape(words)}"):
        load_adaptive_config({"adaptive_load": _nested(new, bad)})


@pytest.mark.parametrize("same", [True, False])
@pytest.mark.parametrize("old,new", MOVED_KEYS)
def test_both_keys_are_an_error_naming_both(old, new, same):
    other = VALUES[new] if same else AdaptiveLoadConfig().model_dump()[new.split(".")[0]][new.split(".")[1]]
    block = _nested(old, VALUES[new])
    block.update(_nested(new, other))
    with pytest.raises(ConfigError) as exc:
        load_adaptive_config({"adaptive_load": block})
    msg = str(exc.value)
    assert f"adaptive_load.{old} (deprecated) and adaptive_load.{new} are both set" in msg
    assert f"keep adaptive_load.{new} and drop adaptive_load.{old}" in msg


@pytest.mark.parametrize("old,new", MOVED_KEYS)
def test_a_bad_old_value_names_the_old_key(old, new):
    bad, words = BAD[new]
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no deprecation line on top of the error
        with pytest.raises(ConfigError) as exc:
            load_adaptive_config({"adaptive_load": _nested(old, bad)})
    msg = str(exc.value)
    assert f"adaptive_load.{old}: " in msg and words in msg and f"(got {bad!r})" in msg
    assert f"adaptive_load.{new}" not in msg


def test_old_keys_beside_other_sampler_keys_and_other_errors():
    with pytest.warns(FutureWarning):
        cfg = AdaptiveLoadConfig.model_validate({"sampler": {"mode": "tokens", "checkpointing": "none", "lr_scaling":
                                                             "linear", "reference_batch": 8},
                                                 "recompute": {"attention": "recompute"}})
    assert (cfg.sampler.mode, cfg.recompute.blocks, cfg.recompute.attention) == ("tokens", "none", "recompute")
    assert (cfg.optimization.lr_scaling, cfg.optimization.reference_batch) == ("linear", 8)
    with pytest.raises(ConfigError) as exc:   # an unrelated error keeps its own key
        load_adaptive_config({"adaptive_load": {"sampler": {"checkpointing": "all", "windw": 3}}})
    assert "unknown key 'adaptive_load.sampler.windw'" in str(exc.value)


def test_config_check_exit_status(tmp_path, capsys):
    def write(name, block):
        (tmp_path / name).write_text(json.dumps({"adaptive_load": {"enabled": True, **block}}))
        return str(tmp_path / name)

    with pytest.warns(FutureWarning, match="sampler.loss_weighting is deprecated"):
        assert config_main(["--check", write("old.json", {"sampler": {"loss_weighting": "tokens"}})]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("OK: ")
    both = write("both.json", {"sampler": {"checkpointing": "all"}, "recompute": {"blocks": "all"}})
    assert config_main(["--check", both]) == 2
    out = capsys.readouterr().out
    assert "adaptive_load.recompute.blocks are both set" in out and out.strip().splitlines()[-1].startswith("FAILED")
    assert config_main(["--check", write("bad.json", {"sampler": {"checkpoint_attention": "save"}})]) == 2
    assert "adaptive_load.sampler.checkpoint_attention: Input should be" in capsys.readouterr().out
    lr = write("lr.json", {"optimization": {"lr_scaling": "sqrt"}})   # the cross-field rule reads the new block
    assert config_main(["--check", lr, "--device", "cpu"]) == 2
    assert "adaptive_load.optimization.lr_scaling is 'sqrt' but reference_batch" in capsys.readouterr().out


def test_the_moved_keys_table_is_current_and_no_shipped_file_sets_an_old_key():
    arch = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    for old, new in MOVED_KEYS:
        assert f"| `adaptive_load.{old}` | `adaptive_load.{new}` |" in arch
    for path in sorted((ROOT / "launch" / "configs").glob("*.json")):
        sampler = json.loads(path.read_text()).get("adaptive_load", {}).get("sampler", {})
        assert not set(sampler) & {old.split(".")[1] for old, _ in MOVED_KEYS}, path
    page = reference_page()
    assert all(f"`adaptive_load.{old}`: moved to `adaptive_load.{new}`" in page for old, new in MOVED_KEYS)


def test_advanced_keys_are_marked_after_the_everyday_ones_and_documented():
    sections = dict(_sections())
    table = markdown_reference()
    advanced = [row for rows in sections.values() for row in rows if row[4]]
    assert {"adaptive_load.sampler.p", "adaptive_load.sampler.window", "adaptive_load.sparse_attention.sample_rows",
            "adaptive_load.metrics.sync_timing"} <= {row[0] for row in advanced}
    for key, _, _, doc, _ in advanced:
        assert doc.strip(), f"{key} has no docstring"
        assert f"| `{key}` {ADVANCED_MARK} |" in table
    for block, rows in sections.items():   # within a block: everyday keys, then advanced
        flags = [row[4] for row in rows]
        assert flags == sorted(flags), block
    everyday = {"adaptive_load.sampler.mode", "adaptive_load.recompute.blocks", "adaptive_load.optimization.lr_scaling"}
    assert all(f"| `{k}` |" in table for k in everyday)
    page = reference_page()
    assert "#### Advanced (`adaptive_load.sampler`)" in page
    assert page.index("**`adaptive_load.sampler.shapes`**") < page.index("#### Advanced (`adaptive_load.sampler`)") \
        < page.index("**`adaptive_load.sampler.window`**")
    # every key of an advanced sub-block is advanced; the marker is the schema's, not the generator's
    assert all(row[4] for row in sections["adaptive_load.sparse_attention.context_parallel_cost"])
    from ds_adaptive.core.config import SparseAttentionConfig

    assert is_advanced(SparseAttentionConfig.model_fields["block_score"])
    assert not is_advanced(SparseAttentionConfig.model_fields["enabled"])
