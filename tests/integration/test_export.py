"""Guards fine-tuning I/O, for each model family's tiny model: `init_from_pretrained` loads a diffusers-saved model into
a ZeRO-3-partitioned one (2 ranks) and reproduces diffusers' output; `ds-adaptive export` consolidates the ZeRO-3 shards
of a trained checkpoint into a diffusers directory that WanTransformer3DModel.from_pretrained loads with identical
outputs; the two experts of a mixture are exported into one pipeline directory that diffusers' WanPipeline loads, and
--init-from reads an expert's own folder of it; bad checkpoints are one clear message; written files follow the
user's umask."""
from __future__ import annotations

import json
import os
import stat
import textwrap

import pytest
import torch

from conftest import TINY_MODELS
from ds_adaptive.cli.export import main as export_main
from ds_adaptive.models.registry import get_model
from ds_adaptive.models.testing import diffusers_twin, random_init_
from ds_adaptive.models.wan import WanModel
from ds_adaptive.models.wan_config import get_wan_config
from ds_adaptive.models.weights import load_pretrained

diffusers = pytest.importorskip("diffusers", reason="diffusers is the reference these tests compare with")
pytest.importorskip("deepspeed")

RANKS = textwrap.dedent("""
    import json, sys
    import torch, deepspeed
    from ds_adaptive.models.wan import WanModel, get_wan_config
    from ds_adaptive.models.weights import init_from_pretrained
    from ds_adaptive.cli.train import init_distributed

    src, ckpt, name = sys.argv[1], sys.argv[2], sys.argv[3]
    rank, world, _ = init_distributed(0)
    torch.set_num_threads(1)
    x, t, c = torch.load("inputs.pt")
    cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": False},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    torch.manual_seed(123)  # a random init that the load must overwrite everywhere
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = WanModel(get_wan_config(name, num_layers=2))
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
    engine.save_checkpoint(ckpt, tag="global_step1", client_state={"ds_adaptive": {"model": name, "layers": 2}})
    if rank == 0:
        torch.save({"init": out_init, "trained": out_trained}, "outputs.pt")
    print("RESULT " + json.dumps({"rank": rank, "partitioned": partitioned, **info}), flush=True)
""")


def _inputs(cfg):
    """Inputs of a tiny model: per-token timesteps for a model trained with them (frame 0 at 0, as TI2V's I2V)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, cfg.in_channels, 3, 8, 12, generator=g)
    t = torch.tensor([250.0, 900.0])
    if cfg.in_channels == 48:
        t = t[:, None].repeat(1, 3 * 4 * 6)
        t[:, :24] = 0.0
    return x, t, torch.randn(2, 20, cfg.text_dim, generator=g)


@pytest.fixture(scope="module", params=TINY_MODELS)
def trained(tmp_path_factory, request):
    """A diffusers-saved tiny model, loaded into 2 ZeRO-3 ranks, trained one step and checkpointed."""
    from conftest import launch_ranks

    name = request.param
    cfg = get_wan_config(name, num_layers=2)
    tmp = tmp_path_factory.mktemp("export")
    model = random_init_(WanModel(cfg), seed=3)
    twin = diffusers_twin(model)
    twin.save_pretrained(str(tmp / "diffusers"), safe_serialization=True)
    x, t, c = _inputs(cfg)
    torch.save((x, t, c), tmp / "inputs.pt")
    with torch.no_grad():
        ref = twin(x, t, c, return_dict=False)[0]
    results = launch_ranks(["-c", RANKS, str(tmp / "diffusers"), str(tmp / "ckpt"), name], 2, cwd=tmp, timeout=300)
    infos = [json.loads(next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))[7:]) for r in results]
    return tmp, ref, torch.load(tmp / "outputs.pt"), infos, cfg


def test_init_from_diffusers_under_zero3_reproduces_diffusers(trained):
    _, ref, outs, infos, cfg = trained
    for info in infos:
        assert info["partitioned"] and info["zero3"] and info["layout"] == "diffusers"
        assert info["tensors"] == len(list(WanModel(cfg).parameters()))
    torch.testing.assert_close(outs["init"], ref, rtol=1e-5, atol=1e-5)
    assert float(ref.abs().mean()) > 1e-2  # a real output, not zeros


def test_export_consolidates_zero3_and_diffusers_loads_it(trained, capsys):
    from diffusers import WanTransformer3DModel

    tmp, ref, outs, _, cfg = trained
    assert export_main([str(tmp / "ckpt"), "--to", str(tmp / "exported"), "--allow-unverified"]) == 0
    assert "wrote" in capsys.readouterr().out
    loaded = WanTransformer3DModel.from_pretrained(str(tmp / "exported"))
    assert loaded.config.in_channels == cfg.in_channels
    with torch.no_grad():
        got = loaded(*_inputs(cfg), return_dict=False)[0]
    torch.testing.assert_close(got, outs["trained"], rtol=1e-5, atol=1e-5)
    assert (got - ref).abs().max() > 1e-3  # the trained weights, not the initial ones
    # our own loader reads the export too, and the files are readable for the group (umask 022 here)
    with torch.no_grad():
        torch.testing.assert_close(load_pretrained(tmp / "exported")(*_inputs(cfg)), got, rtol=1e-5, atol=1e-5)
    mode = stat.S_IMODE(os.stat(tmp / "exported" / "diffusion_pytorch_model.safetensors").st_mode)
    assert mode == 0o666 & ~_umask()
    # bf16 export: diffusers' fp32 modules stay fp32
    assert export_main([str(tmp / "ckpt" / "global_step1"), "--to", str(tmp / "bf16"), "--dtype", "bf16",
                        "--allow-unverified"]) == 0
    from safetensors.torch import load_file

    sd = load_file(str(tmp / "bf16" / "diffusion_pytorch_model.safetensors"))
    assert sd["scale_shift_table"].dtype == torch.float32 and sd["proj_out.weight"].dtype == torch.bfloat16


def _tiny_pipeline(root, transformer, transformer_2):
    """A diffusers WanPipeline directory (model_index.json with the A14B boundary) of tiny random components."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline
    from tokenizers import Tokenizer, models
    from transformers import T5TokenizerFast, UMT5Config, UMT5EncoderModel

    tok = T5TokenizerFast(tokenizer_object=Tokenizer(models.Unigram([("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)],
                                                                     unk_id=2)),
                          eos_token="</s>", unk_token="<unk>", pad_token="<pad>", extra_ids=0)
    te = UMT5EncoderModel(UMT5Config(vocab_size=3, d_model=8, d_kv=4, d_ff=8, num_layers=1, num_heads=2))
    vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
    pipe = WanPipeline(tokenizer=tok, text_encoder=te, vae=vae, scheduler=UniPCMultistepScheduler(),
                       transformer=transformer, transformer_2=transformer_2, boundary_ratio=0.875)
    pipe.save_pretrained(str(root))
    return root


def test_both_experts_export_into_one_pipeline_and_init_from_reads_their_folders(trained, tmp_path, capsys):
    """A14B: the high- and low-noise experts go to transformer/ and transformer_2/ of a pipeline directory, which
    WanPipeline loads (boundary 0.875); --init-from of the pipeline gives each expert its own folder."""
    from diffusers import WanPipeline

    tmp, ref, outs, _, cfg = trained
    if cfg.in_channels != 16:
        pytest.skip("the A14B experts have the Wan 2.1 architecture (the 'tiny' parametrisation covers them)")
    base = [diffusers_twin(random_init_(WanModel(cfg), seed=s)) for s in (10, 11)]
    pipe_dir = _tiny_pipeline(tmp_path / "pipe", *base)
    assert export_main([str(tmp / "ckpt"), "--to", str(pipe_dir), "--model", "tiny-a14b-low", "--allow-unverified"]) == 0
    assert "transformer_2" in capsys.readouterr().out
    pipe = WanPipeline.from_pretrained(str(pipe_dir))
    assert pipe.config.boundary_ratio == 0.875
    x, t, c = _inputs(cfg)
    with torch.no_grad():
        torch.testing.assert_close(pipe.transformer_2(x, t, c, return_dict=False)[0], outs["trained"],
                                   rtol=1e-5, atol=1e-5)   # the trained low-noise expert
        torch.testing.assert_close(pipe.transformer(x, t, c, return_dict=False)[0], base[0](x, t, c, return_dict=False)[0])
    for name, want in (("tiny-a14b-low", outs["trained"]), ("tiny-a14b-high", base[0](x, t, c, return_dict=False)[0])):
        spec = get_model(name)
        net = WanModel(cfg)
        info = spec.weights.init_from(net, str(pipe_dir), subfolder=spec.subfolder)
        assert info["layout"] == "diffusers" and not info["zero3"]
        with torch.no_grad():
            torch.testing.assert_close(net(x, t, c), want.detach(), rtol=1e-5, atol=1e-5)


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
    # a checkpoint DeepSpeed wrote without ds_adaptive (no completeness marker): refused unless asked
    assert export_main([str(tmp / "ckpt"), "--to", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "has no completeness marker" in err and "--allow-unverified" in err and len(err.strip().splitlines()) == 1
    assert export_main([str(tmp / "ckpt"), "--to", str(tmp_path / "o"), "--layers", "3", "--allow-unverified"]) == 2
    err = capsys.readouterr().err
    assert "missing parameter(s)" in err and "blocks.2." in err and "Traceback" not in err
    # a truncated model-states file
    bad = tmp_path / "bad"
    (bad / "global_step1").mkdir(parents=True)
    for f in (tmp / "ckpt" / "global_step1").iterdir():
        data = f.read_bytes()
        (bad / "global_step1" / f.name).write_bytes(data[: len(data) // 2] if "model_states" in f.name else data)
    (bad / "latest").write_text("global_step1")
    assert export_main([str(bad), "--to", str(tmp_path / "o"), "--allow-unverified"]) == 2
    err = capsys.readouterr().err
    assert "model_states.pt is not a readable torch checkpoint file" in err and "nothing was written" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_shard_files_follow_the_umask(tmp_path):
    from ds_adaptive.cli.synth import main as synth_main

    old = os.umask(0o002)
    try:
        assert synth_main(["--out", str(tmp_path / "d"), "--num-samples", "3", "--text-len", "4", "8"]) == 0
    finally:
        os.umask(old)
    shards = list((tmp_path / "d").glob("*.safetensors"))
    assert shards and all(stat.S_IMODE(os.stat(f).st_mode) == 0o664 for f in shards)
