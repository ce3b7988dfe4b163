"""Guards the adaptive_load block of ds_config: clear errors (key, type, file, JSON) and the dict DeepSpeed gets."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds_adaptive.core.config import AdaptiveLoadConfig, ConfigError, SamplerConfig
from ds_adaptive.core.ds_config import load_adaptive_config, prepare_ds_config, read_ds_config, strip_block


def _write(tmp_path, obj, name: str = "ds.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(obj) if not isinstance(obj, str) else obj)
    return str(path)


def test_absent_block_gives_disabled_defaults():
    cfg = load_adaptive_config({"train_micro_batch_size_per_gpu": 1})
    assert cfg == AdaptiveLoadConfig()
    assert cfg.enabled is False and cfg.fused_ln_modulate is False and cfg.sampler.mode == "dual"


def test_valid_block_from_file(tmp_path):
    cfg = load_adaptive_config(_write(tmp_path, {"adaptive_load": {
        "enabled": True, "fused_ln_modulate": True, "sampler": {"mode": "tokens", "m_mem": 40},
        "metrics": {"interval": 3, "log_dir": "x"}}}))
    assert cfg.enabled and cfg.fused_ln_modulate
    assert cfg.sampler.mode == "tokens" and cfg.sampler.m_mem == 40.0
    assert cfg.metrics.interval == 3 and cfg.metrics.log_dir == "x"


def test_unknown_top_level_key_is_named_with_valid_keys(tmp_path):
    path = _write(tmp_path, {"adaptive_load": {"enable": True}})
    with pytest.raises(ConfigError) as exc:
        load_adaptive_config(path)
    msg = str(exc.value)
    assert "adaptive_load.enable'" in msg and path in msg
    for valid in ("enabled", "fused_ln_modulate", "sampler", "metrics"):
        assert valid in msg


def test_unknown_nested_key_is_named_with_valid_keys():
    with pytest.raises(ConfigError) as exc:
        load_adaptive_config({"adaptive_load": {"metrics": {"intervall": 5}}})
    msg = str(exc.value)
    assert "adaptive_load.metrics.intervall" in msg
    for valid in ("interval", "log_dir", "tensorboard", "jsonl", "sync_timing"):
        assert valid in msg


@pytest.mark.parametrize("block, key", [
    ({"enabled": "sometimes"}, "adaptive_load.enabled"),
    ({"sampler": {"mode": "fast"}}, "adaptive_load.sampler.mode"),
    ({"sampler": {"m_mem": "lots"}}, "adaptive_load.sampler.m_mem"),
    ({"metrics": {"interval": 0}}, "adaptive_load.metrics.interval"),
    ({"sampler": {"p": -1}}, "adaptive_load.sampler.p"),
])
def test_bad_type_or_value_names_the_key_and_value(block, key):
    with pytest.raises(ConfigError) as exc:
        load_adaptive_config({"adaptive_load": block})
    assert key in str(exc.value)
    bad = next(iter(block.values()))
    shown = bad if not isinstance(bad, dict) else next(iter(bad.values()))
    assert repr(shown) in str(exc.value)


def test_block_must_be_an_object():
    with pytest.raises(ConfigError, match="must be a JSON object, got list"):
        load_adaptive_config({"adaptive_load": [1]})


def test_missing_file_names_it(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match=f"{missing}.*does not exist"):
        load_adaptive_config(str(missing))


def test_invalid_json_names_file_and_position(tmp_path):
    path = _write(tmp_path, '{"adaptive_load": {"enabled": true,}}')
    with pytest.raises(ConfigError) as exc:
        read_ds_config(path)
    assert path in str(exc.value) and "not valid JSON" in str(exc.value) and "line 1" in str(exc.value)


def test_strip_block_keeps_the_rest():
    raw = {"adaptive_load": {"enabled": True}, "zero_optimization": {"stage": 3}}
    assert strip_block(raw) == {"zero_optimization": {"stage": 3}}
    assert "adaptive_load" in raw  # not mutated


@pytest.mark.parametrize("on_gpu, expected", [(True, True), (False, False)])
def test_bf16_auto_follows_the_device(on_gpu, expected):
    out = prepare_ds_config({"bf16": {"enabled": "auto"}, "adaptive_load": {}}, dp_size=2, on_gpu=on_gpu)
    assert out["bf16"]["enabled"] is expected
    assert "adaptive_load" not in out


def test_explicit_precision_is_kept_and_conflicts_are_errors():
    assert prepare_ds_config({"bf16": {"enabled": True}}, dp_size=1, on_gpu=False)["bf16"]["enabled"] is True
    assert prepare_ds_config({"bf16": {"enabled": False}}, dp_size=1, on_gpu=True)["bf16"]["enabled"] is False
    with pytest.raises(ConfigError, match="both 'bf16' and 'fp16'"):
        prepare_ds_config({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, dp_size=1, on_gpu=True)
    with pytest.raises(ConfigError, match="bf16.enabled.*'yes'"):
        prepare_ds_config({"bf16": {"enabled": "yes"}}, dp_size=1, on_gpu=True)


def test_batch_keys_become_nominal_micro_batch_and_real_gas():
    out = prepare_ds_config({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, dp_size=4, on_gpu=True)
    assert out["gradient_accumulation_steps"] == 2
    assert out["train_micro_batch_size_per_gpu"] == 1 and "train_batch_size" not in out
    out = prepare_ds_config({"gradient_accumulation_steps": 3, "train_batch_size": 12}, dp_size=4, on_gpu=True)
    assert out["gradient_accumulation_steps"] == 3 and "train_batch_size" not in out
    assert prepare_ds_config({}, dp_size=8, on_gpu=True)["gradient_accumulation_steps"] == 1


def test_batch_keys_one_rule_for_the_trainer_and_the_dry_run():
    """A train_batch_size that disagrees with gas x dp was silently dropped by the trainer and failed the dry run;
    now both use ds_adaptive.validate.accumulation_steps: an error naming the value to set."""
    from ds_adaptive.core.ds_config import accumulation_steps

    raw = {"gradient_accumulation_steps": 3, "train_batch_size": 999}
    with pytest.raises(ConfigError, match="train_batch_size=999 != .* gradient_accumulation_steps 3 x dp 4 = 12; "
                                          "set train_batch_size to 12"):
        prepare_ds_config(raw, dp_size=4, on_gpu=True)
    with pytest.raises(ConfigError, match=r"x dp 4 \(= world 8 / sp 2\) = 12"):
        accumulation_steps(raw, 4, sp=2)
    assert accumulation_steps(raw, None) == 3  # dp not known yet (config --check without --world): types only
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu must be an int >= 1, got 0"):
        accumulation_steps({"train_micro_batch_size_per_gpu": 0}, None)


def test_bad_batch_keys_are_errors():
    with pytest.raises(ConfigError, match="train_batch_size=10 is not a multiple"):
        prepare_ds_config({"train_batch_size": 10}, dp_size=4, on_gpu=True)
    with pytest.raises(ConfigError, match="gradient_accumulation_steps must be an int >= 1, got 0"):
        prepare_ds_config({"gradient_accumulation_steps": 0}, dp_size=1, on_gpu=True)


def test_config_reference_is_current():
    """docs/CONFIG.md is generated from the field docstrings; a new or changed field must show up there."""
    from ds_adaptive.cli.config import REFERENCE_COMMAND, markdown_reference, reference_page

    page = (Path(__file__).resolve().parents[3] / "docs" / "CONFIG.md").read_text()
    assert page == reference_page(), f"regenerate it: {REFERENCE_COMMAND}"
    table = markdown_reference()
    assert "`adaptive_load.sampler.mode`" in table and "`adaptive_load.metrics.log_dir`" in table
    assert max(len(row) for row in table.splitlines()) < 400  # cells short: the full text is below the table


def test_config_check_command(tmp_path, capsys):
    from ds_adaptive.cli.config import main

    good = _write(tmp_path, {"adaptive_load": {"enabled": True}})
    assert main(["--check", good]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(f"OK: {good} is valid (AdaptiveLoad on"), out
    assert main(["--check", good, "--json"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out[:out.rindex("}") + 1])["adaptive_load"]["enabled"] is True
    assert out.strip().splitlines()[-1].startswith("OK: ")
    (tmp_path / "bad.json").write_text(json.dumps({"adaptive_load": {"enabeld": True}}))
    assert main(["--check", str(tmp_path / "bad.json")]) == 2
    out = capsys.readouterr().out
    assert "unknown key 'adaptive_load.enabeld'" in out and out.strip().splitlines()[-1].startswith("FAILED: ")


def test_the_dropped_sampler_zero_stage_warns_and_must_agree_with_the_ds_config(tmp_path, capsys):
    from ds_adaptive.cli.config import main

    ds = {"zero_optimization": {"stage": 2}}
    same = _write(tmp_path, {**ds, "adaptive_load": {"enabled": True, "sampler": {"zero_stage": 2}}}, "same.json")
    with pytest.warns(FutureWarning, match="sampler.zero_stage is deprecated .* zero_optimization.stage"):
        assert main(["--check", same]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("OK: ")
    other = _write(tmp_path, {**ds, "adaptive_load": {"enabled": True, "sampler": {"zero_stage": 3}}}, "other.json")
    with pytest.warns(FutureWarning):
        assert main(["--check", other]) == 2
    out = capsys.readouterr().out
    assert "sampler.zero_stage (deprecated) is 3 but the ds_config's zero_optimization.stage is 2" in out
    assert AdaptiveLoadConfig().sampler.dropped_zero_stage is None and "zero_stage" not in SamplerConfig.model_fields


def test_duplicate_keys_and_shapes_files_are_errors(tmp_path):
    """JSON keeps the last of two equal keys silently ("enabled": true, "enabled": false would turn AdaptiveLoad
    off); a shape-distribution file given as the ds_config is not silently an empty config."""
    dup = tmp_path / "dup.json"
    dup.write_text('{"adaptive_load": {"enabled": true, "enabled": false}}')
    with pytest.raises(ConfigError, match=f"{dup}: key 'enabled' is given twice"):
        load_adaptive_config(str(dup))
    shapes = Path(__file__).resolve().parents[3] / "launch" / "configs" / "shapes_cpu.json"
    with pytest.raises(ConfigError, match="is a shape-distribution file, not a ds_config: pass it as --shapes"):
        load_adaptive_config(str(shapes))
    (tmp_path / "list.json").write_text(json.dumps([{"frames": 1, "height": 64, "width": 64, "weight": 1}]))
    with pytest.raises(ConfigError, match="shape-distribution file"):
        load_adaptive_config(str(tmp_path / "list.json"))


@pytest.mark.parametrize("block, key", [
    ({"enabled": "yes"}, "adaptive_load.enabled"),
    ({"enabled": "no"}, "adaptive_load.enabled"),
    ({"enabled": "1"}, "adaptive_load.enabled"),
    ({"enabled": 1}, "adaptive_load.enabled"),
    ({"fused_ln_modulate": 0}, "adaptive_load.fused_ln_modulate"),
    ({"sampler": {"m_mem": "40"}}, "adaptive_load.sampler.m_mem"),
    ({"sampler": {"window": "64"}}, "adaptive_load.sampler.window"),
    ({"sampler": {"window": 64.0}}, "adaptive_load.sampler.window"),
    ({"sampler": {"p": "1.5"}}, "adaptive_load.sampler.p"),
    ({"metrics": {"jsonl": "false"}}, "adaptive_load.metrics.jsonl"),
])
def test_no_coercion_of_booleans_and_numbers(block, key):
    """strict: a string or number where a boolean is expected (or a string where a number is) is an error naming
    the key and the value, never silently true / false / a number."""
    with pytest.raises(ConfigError) as exc:
        load_adaptive_config({"adaptive_load": block})
    assert key in str(exc.value)
    assert load_adaptive_config({"adaptive_load": {"sampler": {"m_mem": 40, "p": 2}}}).sampler.m_mem == 40.0


@pytest.mark.parametrize("typo", ["adaptive_lod", "AdaptiveLoad", "adaptive-load", "adaptive_loads", "adaptve_load"])
def test_misspelt_block_name_is_an_error_naming_it(tmp_path, typo):
    path = _write(tmp_path, {"train_batch_size": 8, typo: {"enabled": True}})
    with pytest.raises(ConfigError) as exc:
        load_adaptive_config(path)
    assert repr(typo) in str(exc.value) and "misspelling of 'adaptive_load'" in str(exc.value) and path in str(exc.value)


def test_deepspeed_top_level_keys_are_not_taken_for_misspellings():
    from ds_adaptive.core.ds_config import misspelt_block_keys

    keys = ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer",
            "scheduler", "fp16", "bf16", "zero_optimization", "activation_checkpointing", "gradient_clipping",
            "steps_per_print", "wall_clock_breakdown", "data_parallel_size", "sequence_parallel_size",
            "tensorboard", "flops_profiler", "aio", "autotuning", "data_efficiency", "compression_training",
            "comms_logger", "checkpoint", "dataloader_drop_last", "amp", "zero_allow_untested_optimizer"]
    assert misspelt_block_keys({k: {} for k in keys}) == []


def test_adaptive_flags_without_a_block_are_an_error(tmp_path, capsys):
    from ds_adaptive.cli.config import main as config_main
    from ds_adaptive.core.ds_config import require_block
    from ds_adaptive.cli.train import main as train_main

    path = _write(tmp_path, {"train_batch_size": 8, "zero_optimization": {"stage": 3}})
    require_block(path, [])  # no flag: fine
    with pytest.raises(ConfigError, match="--fused-ln-modulate given, but .* has no 'adaptive_load' block"):
        require_block(path, ["--fused-ln-modulate"])
    assert train_main(["--deepspeed_config", path, "--fused-ln-modulate"]) == 2
    err = capsys.readouterr().err
    assert "has no 'adaptive_load' block" in err and "Traceback" not in err
    # on a machine without a GPU the block-less run would train the model's full-size shape mix on the CPU: refused
    # (one line saying what would be used); on a GPU machine it is valid, AdaptiveLoad off
    import torch

    if torch.cuda.is_available():
        assert config_main(["--check", path]) == 0
        assert "has no 'adaptive_load' block, so AdaptiveLoad is off" in capsys.readouterr().out
    else:
        assert config_main(["--check", path]) == 2
        out = capsys.readouterr()
        assert "has no 'adaptive_load' block: the run would use the defaults instead" in out.err + out.out


def test_unknown_fixed_batch_bucket_is_an_error():
    """`fixed_batch_sizes: {"banana": 2}` names no shape of the data: an error listing the buckets, not ignored."""
    from ds_adaptive.core.shapes import SampleShape
    from ds_adaptive.planning.validate import check_fixed_batch_sizes

    shapes = [SampleShape(1, 128, 224), SampleShape(17, 128, 224)]
    check_fixed_batch_sizes({"17x128x224": 2}, shapes)
    check_fixed_batch_sizes(None, shapes)
    check_fixed_batch_sizes({"17x128x224": 2, "33x256x256": 1}, shapes)  # a bucket of the mix this data did not draw
    with pytest.raises(ConfigError, match=r"bucket\(s\) 'banana' that are not shapes of the data \(2 bucket\(s\): "
                                          r"1x128x224, 17x128x224\)"):
        check_fixed_batch_sizes({"banana": 2, "17x128x224": 1}, shapes)


def test_readme_config_check_commands_pass(capsys, monkeypatch):
    """README.md's `ds-adaptive config --check` lines run as written and end with the OK verdict."""
    import re
    import shlex

    from ds_adaptive.cli.config import main

    root = Path(__file__).resolve().parents[3]
    blocks = re.findall(r"```bash\n(.*?)```", (root / "README.md").read_text(), re.S)
    lines = [line.strip() for b in blocks for line in b.splitlines() if line.strip().startswith("ds-adaptive config")]
    assert lines
    monkeypatch.chdir(root)
    for line in lines:
        assert main(shlex.split(line)[2:]) == 0, line
        assert capsys.readouterr().out.strip().splitlines()[-1].startswith("OK: "), line
