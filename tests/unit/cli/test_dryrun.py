"""Guards `ds-adaptive dry-run`: good launches pass with the exact deepspeed command; bad topologies, heads, batch keys, budgets and configs fail with the value and the fix."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from conftest import CONFIGS
from ds_adaptive import cli
from ds_adaptive.cli.dry_run import TRAIN_SCRIPT, main

ZERO3 = str(CONFIGS / "zero3_adaptive.json")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def write_config(tmp_path: Path, name: str = "ds.json", **changes) -> str:
    cfg = json.loads(Path(ZERO3).read_text())
    for block in ("sampler", "recompute"):
        keys = changes.pop(block, None)
        if keys:
            cfg["adaptive_load"].setdefault(block, {}).update(keys)
    cfg.update(changes)
    p = tmp_path / name
    p.write_text(json.dumps(cfg))
    return str(p)


def test_good_single_node_prints_report_and_command(capsys) -> None:
    code, out, _ = run(capsys, "--deepspeed_config", ZERO3, "--model", "wan2.1-1.3b", "--num-gpus", "8", "--sp", "2")
    assert code == 0, out
    assert "world 8 = 1 node(s) x 8 GPU(s); Ulysses sp 2 -> dp 4" in out
    assert "12 heads / sp 2 = 6 per rank" in out
    assert "ZeRO-3 over 8 ranks" in out and "longest 81x720x1280 = 75600 tokens" in out
    assert "OK" in out and "FAIL" not in out
    cmd = [line for line in out.splitlines() if line.strip().startswith("command")][0].split(None, 1)[1]
    argv = shlex.split(cmd)
    assert argv[:3] == ["deepspeed", "--num_gpus", "8"]
    assert Path(argv[3]).resolve() == TRAIN_SCRIPT
    assert argv[4:] == ["--deepspeed_config", ZERO3, "--model", "wan2.1-1.3b", "--sp", "2"]


def test_print_command_is_scriptable_and_forwards_trainer_args(capsys, tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two nodes\nnode-a slots=8\nnode-b slots=8  # comment\nnode-c slots=4\n")
    code, out, err = run(capsys, "--deepspeed_config", ZERO3, "--hostfile", str(hostfile), "--num-nodes", "2",
                         "--num-gpus", "4", "--sp", "4", "--master-addr", "node-a", "--print-command",
                         "--", "--steps", "100", "--grad-ckpt")
    assert code == 0, err
    assert "world 8 = 2 node(s) x 4 GPU(s); Ulysses sp 4 -> dp 2" in err
    lines = out.strip().splitlines()
    assert len(lines) == 1
    argv = shlex.split(lines[0])
    assert argv[:9] == ["deepspeed", "--hostfile", str(hostfile), "--num_nodes", "2", "--num_gpus", "4",
                        "--master_addr", "node-a"]
    assert Path(argv[9]).resolve() == TRAIN_SCRIPT
    assert argv[10:] == ["--deepspeed_config", ZERO3, "--model", "wan2.1-1.3b", "--sp", "4",
                         "--steps", "100", "--grad-ckpt"]


def test_layers_rescales_the_profile_to_the_checked_depth(capsys) -> None:
    """--layers 4 of the 30-block profile: the activations and cost of the longest sample shrink with the
    depth (block terms x 4/30, embed/head kept), as the trainer plans them."""
    from ds_adaptive.planning.cost import CostModel
    from ds_adaptive.planning.profile import load_profile

    base = ("--deepspeed_config", ZERO3, "--model", "wan2.1-1.3b", "--num-gpus", "4")
    code, full, _ = run(capsys, *base)
    assert code == 0 and "rescaled" not in full
    code, out, _ = run(capsys, *base, "--layers", "4")
    assert code == 0, out
    assert "profile 'h100-wan2.1-1.3b' describes 30 blocks; rescaled to --layers 4" in out
    p4 = CostModel(load_profile("h100-wan2.1-1.3b").with_num_layers(4))
    assert f"{p4.per_gpu_memory(75600):.2f} GiB activations, {p4.batch_cost(75600, 1):.4g} ms per GPU at B=1" in out
    assert "--layers 4" in [x for x in out.splitlines() if x.strip().startswith("command")][0]


def test_heads_not_divisible_by_sp(capsys) -> None:
    code, out, _ = run(capsys, "--deepspeed_config", ZERO3, "--num-gpus", "8", "--sp", "8")
    assert code == 2
    assert "Ulysses sp=8 does not divide the 12 attention heads of wan2.1-1.3b" in out
    assert "Use sp in [1, 2, 3, 4, 6, 12]" in out
    assert out.count("[FAIL]") == 1  # reported once, not again by the cost model


def test_world_not_divisible_by_sp(capsys) -> None:
    code, out, _ = run(capsys, "--deepspeed_config", ZERO3, "--world", "6", "--sp", "4")
    assert code == 2
    assert "world size 6 (ranks) is not divisible by the Ulysses degree sp=4" in out
    assert "--sp 4" in out  # the command shows what was asked


def test_sp_group_across_nodes_is_a_warning(capsys, tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=6\nb slots=6\n")
    code, out, _ = run(capsys, "--deepspeed_config", ZERO3, "--hostfile", str(hostfile), "--sp", "4")
    assert code == 0, out
    assert "world 12" in out and "span two nodes" in out and "[warn]" in out


def test_oversize_sample_error_and_skip(capsys, tmp_path: Path) -> None:
    # recompute: the figure below is a checkpointed block that keeps its input only (`auto` may plan `keep`, whose
    # checkpointed blocks hold their attention output too, where no shape it would lose fits either way)
    cfg = write_config(tmp_path, sampler={"m_mem": 6.0}, recompute={"attention": "recompute"})
    code, out, _ = run(capsys, "--deepspeed_config", cfg, "--num-gpus", "8", "--sp", "1")
    assert code == 2
    assert "shape 81x720x1280 (75600 tokens" in out
    from ds_adaptive.planning.cost import CostModel
    from ds_adaptive.planning.memory import sample_memory

    # the shipped calibration at the fewest-memory checkpoint count of `checkpointing: auto` (29 of 30
    # blocks; all 30 hold one block input more): ~15.9 GiB
    act = sample_memory(CostModel("h100-wan2.1-1.3b", checkpointing="auto"), 75600)
    assert act < CostModel("h100-wan2.1-1.3b").per_gpu_memory(75600)
    assert f"activation memory {act:.2f} GiB > m_mem 6.00 GiB" in out and "use a higher sp" in out
    # sp=4 quarters the activation memory: it fits
    code, out, _ = run(capsys, "--deepspeed_config", cfg, "--num-gpus", "8", "--sp", "4")
    assert code == 0, out
    cfg = write_config(tmp_path, "skip.json", sampler={"m_mem": 6.0, "oversize": "skip"})
    code, out, _ = run(capsys, "--deepspeed_config", cfg, "--num-gpus", "8", "--sp", "1")
    assert code == 0 and "skipped (oversize: skip)" in out and "81x720x1280" in out


def test_compute_budget_oversize(capsys, tmp_path: Path) -> None:
    cfg = write_config(tmp_path, sampler={"m_comp": 1000.0})
    code, out, _ = run(capsys, "--deepspeed_config", cfg, "--num-gpus", "8", "--sp", "2")
    assert code == 2 and "> m_comp 1000 ms" in out


@pytest.mark.parametrize("keys,ok,msg", [
    ({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2}, False,
     "train_batch_size=12 != train_micro_batch_size_per_gpu 1 x gradient_accumulation_steps 2 x dp 4 "
     "(= world 8 / sp 2) = 8; set train_batch_size to 8"),
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2}, True,
     "gradient_accumulation_steps 2 per optimizer step, dp 4"),
    ({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": None}, True,
     "gradient_accumulation_steps 3 per optimizer step, dp 4"),
    ({"train_batch_size": 6, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": None}, False,
     "train_batch_size=6 is not a multiple of train_micro_batch_size_per_gpu (1) x data-parallel size (4)"),
])
def test_batch_keys_against_dp(capsys, tmp_path: Path, keys: dict, ok: bool, msg: str) -> None:
    cfg = json.loads(Path(ZERO3).read_text())
    for k, v in keys.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    p = tmp_path / "b.json"
    p.write_text(json.dumps(cfg))
    code, out, _ = run(capsys, "--deepspeed_config", str(p), "--num-gpus", "8", "--sp", "2")
    assert (code == 0) == ok, out
    assert msg in out


def test_ds_config_sequence_parallel_keys(capsys, tmp_path: Path) -> None:
    cfg = write_config(tmp_path, sequence_parallel_size=4)
    code, out, _ = run(capsys, "--deepspeed_config", cfg, "--num-gpus", "8", "--sp", "2")
    assert code == 2 and "--sp 2 but the ds_config has sequence_parallel_size=4" in out
    code, out, _ = run(capsys, "--deepspeed_config", cfg, "--num-gpus", "8")  # sp from the ds_config
    assert code == 0 and "Ulysses sp 4 -> dp 2" in out
    cfg = write_config(tmp_path, "m.json", sequence_parallel_size=2, data_parallel_size=4)
    code, out, _ = run(capsys, "--deepspeed_config", cfg, "--num-gpus", "8")
    assert code == 0 and "DeepSpeed build a (dp, sp) mesh" in out
    code, out, _ = run(capsys, "--deepspeed_config", cfg, "--num-gpus", "4")
    assert code == 2 and "data_parallel_size=4 x sp=2 = 8 but the world has 4 ranks" in out


def test_bad_adaptive_block_and_model_memory(capsys, tmp_path: Path) -> None:
    cfg = json.loads(Path(ZERO3).read_text())
    cfg["adaptive_load"]["sampler"]["mdoe"] = "dual"
    p = tmp_path / "typo.json"
    p.write_text(json.dumps(cfg))
    code, out, _ = run(capsys, "--deepspeed_config", str(p), "--num-gpus", "8")
    assert code == 2 and "unknown key 'adaptive_load.sampler.mdoe'" in out
    code, out, _ = run(capsys, "--deepspeed_config", str(tmp_path / "missing.json"), "--num-gpus", "8")
    assert code == 2 and "does not exist" in out
    # 14B with the 1.3B profile: m_mem auto assumes 1.3B's static memory -> would OOM
    p13 = write_config(tmp_path, "p13.json", sampler={"profile": "h100-wan2.1-1.3b"})
    code, out, _ = run(capsys, "--deepspeed_config", p13, "--model", "wan2.1-14b", "--num-gpus", "8", "--sp", "2")
    assert code == 2 and "static memory of wan2.1-14b" in out and "measured for wan2.1-1.3b" in out
    # the shipped config's `profile: auto` takes the 14B profile for the 14B model
    code, out, _ = run(capsys, "--deepspeed_config", ZERO3, "--model", "wan2.1-14b", "--num-gpus", "8", "--sp", "2")
    assert "profile auto: no GPU visible; using 'h100-wan2.1-14b'" in out and "measured for" not in out


def test_layout_errors(capsys, tmp_path: Path) -> None:
    code, out, _ = run(capsys, "--deepspeed_config", ZERO3)
    assert code == 2 and "--world N, --num-gpus G [--num-nodes K], or --hostfile FILE" in out
    bad = tmp_path / "hosts"
    bad.write_text("node-a slots=8\nnode-b gpus=8\n")
    code, out, _ = run(capsys, "--deepspeed_config", ZERO3, "--hostfile", str(bad))
    assert code == 2 and "line 2: 'node-b gpus=8' is not 'hostname slots=N'" in out
    bad.write_text("node-a slots=8\nnode-b slots=4\n")
    code, out, _ = run(capsys, "--deepspeed_config", ZERO3, "--hostfile", str(bad), "--num-gpus", "8")
    assert code == 2 and "fewer slots on: node-b (slots=4)" in out
    code, out, _ = run(capsys, "--deepspeed_config", ZERO3, "--world", "8", "--num-gpus", "8")
    assert code == 2 and "not --world with the others" in out


def test_cli_dispatch(capsys) -> None:
    code = cli.main(["dry-run", "--deepspeed_config", str(CONFIGS / "cpu_tiny.json"), "--model", "tiny",
                     "--world", "2", "--sp", "2", "--gpu-mem-gib", "8"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "--model tiny --sp 2" in out
    assert cli.main(["dry-run", "--deepspeed_config", ZERO3, "--world", "3", "--sp", "2"]) == 2
