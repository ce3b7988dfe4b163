"""Issue 52, case 4: every value that would fail in the run fails ``config --check``, the dry run and the run's own
check (``RunConfig.load``: the one cross-field pass ``ds_adaptive.planning.validate``) first, with exit 2 and one
line; ``--init-from`` weights with a NaN are named before the model is built. In-process, no DeepSpeed run."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from ds_adaptive.cli import config as config_cli, dry_run
from ds_adaptive.core.config import ConfigError
from ds_adaptive.cli.train import build_parser
from ds_adaptive.training.run_config import run_config_from_args

ROOT = Path(__file__).resolve().parents[3]
BASE = json.loads((ROOT / "launch" / "configs" / "cpu_tiny.json").read_text())


def _case(tmp_path, name):
    d = copy.deepcopy(BASE)
    d["adaptive_load"]["sampler"]["shapes"] = str(ROOT / "launch" / "configs" / "shapes_cpu.json")
    (tmp_path / "afile").write_text("x")
    if name == "optimizer":
        d["optimizer"] = {"type": "AdamQ", "params": {"lr": 1e-4}}
        return d, "optimizer.type is 'AdamQ', which DeepSpeed cannot build"
    if name == "stage":
        d["zero_optimization"]["stage"] = 7
        return d, "zero_optimization.stage is 7: expected 0, 1, 2 or 3"
    if name == "log_dir":
        d["adaptive_load"].setdefault("metrics", {})["log_dir"] = str(tmp_path / "afile" / "logs")
        return d, f"metrics.log_dir {tmp_path / 'afile' / 'logs'} is under {tmp_path / 'afile'}, which is a file"
    if name == "m_mem":
        d["adaptive_load"]["sampler"]["m_mem"] = 1e30
        return d, "adaptive_load.sampler.m_mem is 1e+30 GiB per GPU: expected at most 4096"
    if name == "array":
        return [1, 2], "holds a JSON list, expected an object"
    if name == "no_block":
        d.pop("adaptive_load")
        return d, "the ds_config has no 'adaptive_load' block: the run would use the defaults instead, AdaptiveLoad off"
    raise KeyError(name)


@pytest.mark.parametrize("name", ["optimizer", "stage", "log_dir", "m_mem", "array", "no_block"])
def test_check_dry_run_and_run_agree_with_exit_2_and_one_line(tmp_path, capsys, name):
    raw, expected = _case(tmp_path, name)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(raw))
    assert config_cli.main(["--check", str(path), "--device", "cpu", "--model", "tiny"]) == 2
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if expected in x]
    assert len(lines) == 1 and "Traceback" not in out, out
    assert dry_run.main(["--deepspeed_config", str(path), "--model", "tiny", "--world", "2", "--device", "cpu"]) == 2
    out = capsys.readouterr()
    assert expected in out.out + out.err and "Traceback" not in out.out + out.err
    args = build_parser().parse_args(["--deepspeed_config", str(path), "--model", "tiny", "--num-samples", "10"])
    with pytest.raises(ConfigError) as e:   # what `ds-adaptive train` checks before any rank starts a collective
        run_config_from_args(args)
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_a_torch_optimizer_name_and_the_shipped_configs_pass(tmp_path, capsys):
    d = copy.deepcopy(BASE)
    d["optimizer"] = {"type": "SGD", "params": {"lr": 1e-3}}
    d["adaptive_load"]["sampler"]["shapes"] = str(ROOT / "launch" / "configs" / "shapes_cpu.json")
    (tmp_path / "sgd.json").write_text(json.dumps(d))
    assert config_cli.main(["--check", str(tmp_path / "sgd.json"), "--device", "cpu", "--model", "tiny"]) == 0
    for cfg in ("cpu_tiny.json", "zero3_adaptive.json", "zero3_baseline.json"):
        assert config_cli.main(["--check", str(ROOT / "launch" / "configs" / cfg), "--device", "cuda"]) == 0, cfg
    capsys.readouterr()


def test_init_from_weights_with_a_nan_are_named(tmp_path):
    from ds_adaptive.launch.startup import init_from_problem
    from ds_adaptive.models.wan import WanModel
    from ds_adaptive.models.wan_config import get_wan_config
    from ds_adaptive.models.weights import save_wan_weights

    model = WanModel(get_wan_config("tiny", num_layers=1))
    save_wan_weights(model, tmp_path / "good", layout="diffusers")
    assert init_from_problem(str(tmp_path / "good"), "tiny", 1) is None
    with torch.no_grad():
        next(iter(model.parameters())).view(-1)[3] = float("nan")
    save_wan_weights(model, tmp_path / "bad", layout="diffusers")
    msg = init_from_problem(str(tmp_path / "bad"), "tiny", 1)
    assert msg is not None and "has 1 non-finite value(s) (NaN / inf)" in msg and "tensor '" in msg
    assert msg.startswith(f"--init-from {tmp_path / 'bad'}: tensor ") and "\n" not in msg
