"""Guards fine-tuning I/O: `init_from_pretrained` loads a diffusers-saved Wan into a ZeRO-3-partitioned model (2 ranks)
and reproduces diffusers' output; `ds-adaptive export` consolidates the ZeRO-3 shards of a trained checkpoint into a
diffusers directory that WanTransformer3DModel.from_pretrained loads with identical outputs; bad checkpoints are one
clear message; written files follow the user's umask."""
from __future__ import annotations

import json
import os
import stat
import textwrap
from pathlib import Path

import pytest
import torch

from ds_adaptive.export import main as export_main
from ds_adaptive.models.testing import diffusers_twin, random_init_
from ds_adaptive.models.wan import WanModel, get_wan_config

diffusers = pytest.importorskip("diffusers", reason="diffusers is the reference these tests compare with")
pytest.importorskip("deepspeed")

CFG = get_wan_config("tiny", num_layers=2)

RANKS = textwrap.dedent("""
    import json, sys
    import torch, deepspeed
    from ds_adaptive.models.wan import WanModel, get_wan_config
    from ds_adaptive.models.weights import init_from_pretrained
    from ds_adaptive.train import init_distributed

    src, ckpt = sys.argv[1], sys.argv[2]
    rank, world, _ = init_distributed(0)
    torch.set_num_threads(1)
    x, t, c = torch.load("inputs.pt")
    cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": False},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    torch.manual_seed(123)  # a random init that the load must overwrite everywhere
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = WanModel(get_wan_config("tiny", num_layers=2))
    partitioned = all(p.numel() == 0 or p.numel() < p.ds_numel for p in model.parameters())
    info = init_from_pretrained(model, src)
    with deepspeed.zero.GatheredParameters(list(model.parameters())), torch.no_grad():
        out_init = model(x, t, c)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    loss = (engine(x, t, c) - torch.ones_like(x)).pow(2).mean()  # one step: the export is not the init
    engine.backward(loss)
    engine.step()
    engine.eval()
    with torch.no_grad():
        out_trained = engine(x, t, c)
    engine.save_checkpoint(ckpt, tag="global_step1", client_state={"ds_adaptive": {"model": "tiny", "layers": 2}})
    if rank == 0:
        torch.save({"init": out_init, "trained": out_trained}, "outputs.pt")
    print("RESULT " + json.dumps({"rank": rank, "partitioned": partitioned, **info}), flush=True)
""")


def _inputs():
    g = torch.Generator().manual_seed(7)
    return (torch.randn(2, 16, 3, 8, 12, generator=g), torch.tensor([250.0, 900.0]),
            torch.randn(2, 20, CFG.text_dim, generator=g))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, request):
    """A diffusers-saved tiny Wan, loaded into 2 ZeRO-3 ranks, trained one step and checkpointed."""
    from conftest import launch_ranks

    tmp = tmp_path_factory.mktemp("export")
    model = random_init_(WanModel(CFG), seed=3)
    twin = diffusers_twin(model)
    twin.save_pretrained(str(tmp / "diffusers"), safe_serialization=True)
    x, t, c = _inputs()
    torch.save((x, t, c), tmp / "inputs.pt")
    with torch.no_grad():
        ref = twin(x, t, c, return_dict=False)[0]
    results = launch_ranks(["-c", RANKS, str(tmp / "diffusers"), str(tmp / "ckpt")], 2, cwd=tmp, timeout=300)
    infos = [json.loads(next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))[7:]) for r in results]
    return tmp, ref, torch.load(tmp / "outputs.pt"), infos


def test_init_from_diffusers_under_zero3_reproduces_diffusers(trained):
    _, ref, outs, infos = trained
    for info in infos:
        assert info["partitioned"] and info["zero3"] and info["layout"] == "diffusers"
        assert info["tensors"] == len(list(WanModel(CFG).parameters()))
    torch.testing.assert_close(outs["init"], ref, rtol=1e-5, atol=1e-5)
    assert float(ref.abs().mean()) > 1e-2  # a real output, not zeros


def test_export_consolidates_zero3_and_diffusers_loads_it(trained, capsys):
    from diffusers import WanTransformer3DModel

    tmp, ref, outs, _ = trained
    assert export_main([str(tmp / "ckpt"), "--to", str(tmp / "exported")]) == 0
    assert "wrote" in capsys.readouterr().out
    loaded = WanTransformer3DModel.from_pretrained(str(tmp / "exported"))
    with torch.no_grad():
        got = loaded(*_inputs(), return_dict=False)[0]
    torch.testing.assert_close(got, outs["trained"], rtol=1e-5, atol=1e-5)
    assert (got - ref).abs().max() > 1e-3  # the trained weights, not the initial ones
    # our own loader reads the export too, and the files are readable for the group (umask 022 here)
    with torch.no_grad():
        torch.testing.assert_close(WanModel.from_pretrained(tmp / "exported")(*_inputs()), got, rtol=1e-5, atol=1e-5)
    mode = stat.S_IMODE(os.stat(tmp / "exported" / "diffusion_pytorch_model.safetensors").st_mode)
    assert mode == 0o666 & ~_umask()
    # bf16 export: diffusers' fp32 modules stay fp32
    assert export_main([str(tmp / "ckpt" / "global_step1"), "--to", str(tmp / "bf16"), "--dtype", "bf16"]) == 0
    from safetensors.torch import load_file

    sd = load_file(str(tmp / "bf16" / "diffusion_pytorch_model.safetensors"))
    assert sd["scale_shift_table"].dtype == torch.float32 and sd["proj_out.weight"].dtype == torch.bfloat16


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def test_export_errors_are_one_message(trained, tmp_path, capsys):
    tmp, *_ = trained
    assert export_main([str(tmp_path / "nothing"), "--to", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert export_main([str(tmp / "ckpt"), "--tag", "global_step9", "--to", str(tmp_path / "o")]) == 2
    assert "'global_step9'" in capsys.readouterr().err
    assert export_main([str(tmp / "ckpt"), "--to", str(tmp_path / "o"), "--layers", "3"]) == 2
    err = capsys.readouterr().err
    assert "missing parameter(s)" in err and "blocks.2." in err and "Traceback" not in err
    # a truncated model-states file
    bad = tmp_path / "bad"
    (bad / "global_step1").mkdir(parents=True)
    for f in (tmp / "ckpt" / "global_step1").iterdir():
        data = f.read_bytes()
        (bad / "global_step1" / f.name).write_bytes(data[: len(data) // 2] if "model_states" in f.name else data)
    (bad / "latest").write_text("global_step1")
    assert export_main([str(bad), "--to", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "model_states.pt is not a readable torch checkpoint file" in err and "nothing was written" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_shard_files_follow_the_umask(tmp_path):
    from ds_adaptive.data.synth import main as synth_main

    old = os.umask(0o002)
    try:
        assert synth_main(["--out", str(tmp_path / "d"), "--num-samples", "3", "--text-len", "4", "8"]) == 0
    finally:
        os.umask(old)
    shards = list((tmp_path / "d").glob("*.safetensors"))
    assert shards and all(stat.S_IMODE(os.stat(f).st_mode) == 0o664 for f in shards)
