import json, numpy as np, warnings
warnings.simplefilter("ignore")
from ds_adaptive.config import load_adaptive_config
from ds_adaptive.data import build_dataset
from ds_adaptive.balance.sampler import build_batch_sampler, Topology
ds = build_dataset("synthetic", num_samples=10000, shapes=None, seed=0)
shapes = ds.sample_shapes()
for cfgp, pol, extra in (("launch/configs/zero3_adaptive.json","auto",{}),("launch/configs/zero3_adaptive.json","all",{}),
                  ("launch/configs/zero3_baseline.json","auto",{}), ("launch/configs/zero3_baseline.json","all",{})):
    cfg = load_adaptive_config(cfgp)
    sc = cfg.sampler.model_copy(update={"profile": "h200-wan2.1-1.3b", **extra})
    s = build_batch_sampler(sc, shapes, Topology(0,1), micro_steps_per_step=1, enabled=cfg.enabled,
                            gpu_mem_gib=139.80072021484375, model_name="wan2.1-1.3b", zero_stage=3, checkpointing=pol)
    s.set_epoch(0)
    p = s.plan
    for n in (19, 200):
        tok = int(p.batch_tokens[:n].sum()); ms = float(p.batch_cost[:n].sum())
        print(f"{cfgp.split('/')[-1]:22} {pol:4} {n:4} steps: tokens {tok:9d} predicted {ms/1e3:7.1f} s -> {tok/ms*1e3:8.0f} tok/s; m_comp {s.params.m_comp or 0:.0f} m_mem {s.params.m_mem:.1f} ckpt mean {p.batch_ckpt[:n].mean():.1f}")
