"""Guards the EMA (ds_adaptive.training.ema) on 2 ranks: equal to an fp64 reference EMA of the same updates (ZeRO-3,
ZeRO-2, LoRA adapters) and swapped in and out bit for bit. The single-process checks are in
tests/unit/training/test_ema.py."""
from __future__ import annotations

import json
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch, deepspeed
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    import torch.distributed as dist
    from ds_adaptive.core.features import EmaConfig
    from ds_adaptive.core.config import LoraConfig
    from ds_adaptive.data import SyntheticLatentDataset, collate_latents
    from ds_adaptive.models.objective import flow_matching_losses
    from ds_adaptive.models.registry import get_model
    from ds_adaptive.training.ema import EmaState, consolidate, select_parameters
    from ds_adaptive.training.lora import apply_lora

    mode, out = sys.argv[1], Path(sys.argv[2])
    rank = dist.get_rank()
    stage = 2 if mode == "zero2" else 3
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage,
           "stage3_param_persistence_threshold": 2000},
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}}}
    spec = get_model("tiny")
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg, enabled=stage == 3):
        model = spec.build(spec.config(num_layers=2))
    head = list(model.head.parameters())   # Wan's head starts at zero: a random one, so that outputs depend on the rest
    with deepspeed.zero.GatheredParameters(head, modifier_rank=0, enabled=stage == 3):
        g = torch.Generator().manual_seed(3)
        for p in head:
            p.data.copy_(0.05 * torch.randn(p.shape, generator=g))
    ema_cfg = EmaConfig(decay=0.8, every=2, start_step=1, parameters="lora" if mode == "lora" else "all")
    if mode == "lora":
        apply_lora(model, LoraConfig(enabled=True, rank=4, alpha=4.0, targets=["self_attn"]), seed=0, spec=spec)
    engine, *_ = deepspeed.initialize(model=model, config=cfg,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    ema = EmaState(ema_cfg, select_parameters(engine.module, ema_cfg.parameters), device=torch.device("cpu"),
                   log=lambda m: None)
    names = [n for n, _ in select_parameters(engine.module, ema_cfg.parameters)]
    params = dict(engine.module.named_parameters())

    def full_weights():
        ps = [params[n] for n in names]
        with deepspeed.zero.GatheredParameters(ps, enabled=stage == 3):
            return {n: params[n].detach().double().clone() for n in names}

    from ds_adaptive.core.shapes import SampleShape, ShapeWeight
    shapes = [ShapeWeight(SampleShape(1, 64, 64), 1.0), ShapeWeight(SampleShape(5, 32, 64), 1.0)]
    ds = SyntheticLatentDataset(16, shapes, seed=1, spec=spec.input_spec, text_len=(4, 8))
    ref = full_weights()
    for step in range(1, 8):
        batch = collate_latents([ds[2 * step + rank]], pad_text_to=spec.text_len)
        loss = flow_matching_losses(engine, batch["latents"], batch["context"], batch["index"], epoch=0, seed=0,
                                    shift=5.0, dtype=torch.float32).mean()
        engine.backward(loss)
        engine.step()
        what = ema.after_step(step)
        w = full_weights()
        if what == "start":
            ref = w
        elif what == "update":
            ref = {n: 0.8 * ref[n] + 0.2 * w[n] for n in names}
    ema.save(out)
    dist.barrier()
    got = consolidate(out)
    err = max(float((got[n].double() - ref[n]).abs().max()) for n in names)
    scale = max(float(ref[n].abs().max()) for n in names)
    moved = max(float((ref[n] - w[n]).abs().max()) for n in names)

    # swapped: the engine computes with the average; afterwards the trained weights come back bit for bit
    probe = collate_latents([ds[0]], pad_text_to=spec.text_len)
    x = torch.randn(probe["latents"].shape, generator=torch.Generator().manual_seed(5))
    t = torch.tensor([500.0])
    with ema.swapped():
        with torch.no_grad():
            swapped_out = engine(x, t, probe["context"])
    after = full_weights()
    restored = all(torch.equal(after[n], w[n]) for n in names)
    with torch.no_grad():
        trained_out = engine(x, t, probe["context"])
    plain = spec.build(spec.config(num_layers=2))   # the same architecture; every weight comes from the engine
    if mode == "lora":
        apply_lora(plain, LoraConfig(enabled=True, rank=4, alpha=4.0, targets=["self_attn"]), seed=0, spec=spec)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        sd = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    sd.update({n: got[n] for n in names})
    plain.load_state_dict(sd)
    with torch.no_grad():
        plain_out = plain(x, t, probe["context"])

    # restore into a fresh state: exact; the counted bytes are the slices' elements x 4
    fresh = EmaState(ema_cfg, select_parameters(engine.module, ema_cfg.parameters), device=torch.device("cpu"),
                     log=lambda m: None)
    line = fresh.load(out)
    same = all(torch.equal(a, b) for a, b in zip(fresh.tensors, ema.tensors))
    print("RESULT " + json.dumps({
        "rank": rank, "err": err, "scale": scale, "moved": moved, "restored": restored,
        "swap_vs_plain": float((swapped_out - plain_out).abs().max()),
        "swap_vs_trained": float((swapped_out - trained_out).abs().max()),
        "loaded_exactly": same, "line": line, "updates": ema.updates, "bytes": ema.nbytes(),
        "numel": ema.numel_total(), "zero3": ema.zero3, "parts": ema.parts}), flush=True)
""")


def _results(runs) -> list[dict]:
    return [json.loads(next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))[7:]) for r in runs]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["zero3", "zero2", "lora"])
def test_ema_equals_an_fp64_reference_and_swaps_in_and_out_exactly(mode, tmp_path, run_ranks):
    """Two ranks, 7 optimizer steps, EMA started after step 1 and updated every 2nd step: the consolidated slices
    equal an fp64 EMA of the gathered weights (to fp32 rounding), the engine under ``swapped()`` computes what a
    plain model with the EMA weights computes, the trained weights come back bit for bit, a saved EMA loads exactly,
    and each rank holds half of the averaged elements (4 bytes each)."""
    res = _results(run_ranks(["-c", SCRIPT, mode, str(tmp_path)], 2, cwd=tmp_path, timeout=400))
    for r in res:
        assert r["zero3"] is (mode != "zero2") and r["parts"] == 2 and r["updates"] == 3
        assert r["moved"] > 1e-4 * r["scale"], r          # the EMA is not the last weights (the test has teeth)
        assert r["err"] <= 1e-6 * r["scale"], r
        assert r["restored"] and r["loaded_exactly"] and "exactly" in r["line"]
        assert r["swap_vs_plain"] <= 1e-5, r
        assert r["swap_vs_trained"] > 100 * max(r["swap_vs_plain"], 1e-9), r
    assert sum(r["bytes"] for r in res) == 4 * res[0]["numel"]
    assert all(abs(r["bytes"] - 2 * res[0]["numel"]) <= 4 * 200 for r in res)   # halves, up to one element a tensor
