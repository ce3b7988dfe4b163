"""Several runs in one process: a closed trainer leaves no engine behind (DeepSpeed ZeRO-3 keeps every engine's
model, gradients and optimizer state reachable from module-level state otherwise)."""
from __future__ import annotations

import re
import textwrap

import pytest

from conftest import CONFIGS, ROOT, launch_ranks

SCRIPT = textwrap.dedent("""
    import gc, sys, warnings, weakref
    import torch
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from ds_adaptive.training.trainer import Trainer, init_distributed
    init_distributed(0)
    from deepspeed.runtime.zero import parameter_offload
    from ds_adaptive.core.layout import Layout
    from ds_adaptive.training.assemble import build_run
    from ds_adaptive.training.run_config import RunConfig

    def one_run(seed):
        cfg = RunConfig.load(sys.argv[1], trainer={"model": "tiny", "num_samples": 24, "steps": 1, "seed": seed},
                             overrides={"sampler.shapes": sys.argv[2]})
        cfg.adaptive_load.metrics.log_dir = sys.argv[3] + f"/run{seed}"
        run = build_run(cfg, layout=Layout.detect(1))
        trainer = Trainer(run)
        trainer.train_step()
        refs = [weakref.ref(run.model), weakref.ref(trainer.engine), weakref.ref(trainer.engine.optimizer)]
        trainer.close()
        return refs

    for seed in (0, 1):   # a second run in the same process after the first was closed
        refs = one_run(seed)
        gc.collect()
        alive = [r() is not None for r in refs]
        print(f"RUN {seed} ALIVE {alive} STACK {len(parameter_offload.FWD_MODULE_STACK)}")
""")


def test_a_closed_trainer_frees_its_engine_for_the_next_run(tmp_path):
    script = tmp_path / "release.py"
    script.write_text(SCRIPT)
    argv = [str(script), str(CONFIGS / "cpu_tiny.json"), str(CONFIGS / "shapes_cpu.json"), str(tmp_path)]
    out = launch_ranks(argv, 1, cwd=tmp_path, timeout=300, env={"PYTHONPATH": str(ROOT)})[0].stdout
    runs = re.findall(r"RUN (\d) ALIVE \[(.*)\] STACK (\d+)", out)
    assert len(runs) == 2, out
    for seed, alive, stack in runs:
        assert alive == "False, False, False", f"run {seed}: model / engine / optimizer still reachable\n{out[-3000:]}"
        assert stack == "0", f"run {seed}: DeepSpeed's forward module stack still holds a model\n{out[-3000:]}"


STACK_SCRIPT = textwrap.dedent("""
    import sys, warnings
    import torch
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from ds_adaptive.training.trainer import Trainer, init_distributed
    init_distributed(0)
    from deepspeed.runtime.zero import parameter_offload
    from ds_adaptive.core.layout import Layout
    from ds_adaptive.training.assemble import build_run
    from ds_adaptive.training.run_config import RunConfig

    cfg = RunConfig.load(sys.argv[1], trainer={"model": "tiny", "num_samples": 48, "steps": 3, "seed": 0},
                         overrides={"sampler.shapes": sys.argv[2], "recompute.blocks": "all",
                                    "recompute.attention": sys.argv[4],
                                    "sampler.m_mem": 1.0})   # keep: the 1.3B profile's 30 blocks hold 3 KiB/token more
    cfg.adaptive_load.metrics.log_dir = sys.argv[3]
    trainer = Trainer(build_run(cfg, layout=Layout.detect(1)))
    print("BASE", len(parameter_offload.FWD_MODULE_STACK), trainer.run.model.checkpointed_blocks())
    for _ in range(3):
        rec = trainer.train_step()
        print("STACK", len(parameter_offload.FWD_MODULE_STACK), trainer.run.model.checkpoint_attention,
              bool(torch.isfinite(torch.tensor(rec.loss))))
    trainer.close()
""")


@pytest.mark.parametrize("attention", ["recompute", "keep"])
def test_checkpointed_recomputes_leave_nothing_on_deepspeeds_forward_stack(tmp_path, attention):
    """Every block checkpointed: the early-stopped recomputes skip ZeRO-3's post-forward pop; the trainer drops
    the leftovers after each micro-batch (the stack grew by one entry per checkpointed block per micro-step).
    The same with ``checkpoint_attention: keep`` (its dispatch modes under ZeRO-3's hooks): finite losses."""
    script = tmp_path / "stack.py"
    script.write_text(STACK_SCRIPT)
    argv = [str(script), str(CONFIGS / "cpu_tiny.json"), str(CONFIGS / "shapes_cpu.json"), str(tmp_path / "logs"),
            attention]
    out = launch_ranks(argv, 1, cwd=tmp_path, timeout=300, env={"PYTHONPATH": str(ROOT)})[0].stdout
    base = re.findall(r"BASE (\d+) (\d+)", out)
    assert base and int(base[0][1]) > 0, f"no checkpointed block: the test would not exercise the recompute\n{out[-3000:]}"
    assert re.findall(r"STACK (\d+) (\w+) (\w+)", out) == [(base[0][0], attention, "True")] * 3, out[-3000:]
