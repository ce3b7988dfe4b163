"""Preprocess throughput on one GPU: real-size Wan 2.1 VAE (AutoencoderKLWan defaults) and umT5-xxl encoder
(random weights, built on the GPU in bf16 from config; no download) through the real job
(`ds_adaptive.preprocess.run.run`: PyAV decode in loader workers -> resize/crop -> VAE -> umT5 -> shards).

    python bench/data/preprocess.py --out-json results.json [--clips-480 12 --clips-720 8 --workers 8]

Sources: H.264 files written here (854x480 and 1920x1080, 30 fps, 5.5 s) -> one 81-frame clip each at
16 fps (81x480x832 and 81x720x1280). Per size: clips/s of the whole job (decode overlapped), VAE
s/clip, peak GPU memory; and one 81x720x1280 clip encoded tiled vs untiled (time, memory, difference).
Captions: ~120 tokens each, tokenised by a small local stand-in tokenizer (the real umT5 vocabulary
is not downloaded; tokenisation is host work of microseconds, the encoder cost depends on length only).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                relative_attention_num_buckets=32, relative_attention_max_distance=128,
                feed_forward_proj="gated-gelu", dense_act_fn="gelu_new", is_gated_act=True,
                tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
WORDS = ("a the cat dog runs jumps over red blue sky video of in on with slowly camera pans across "
         "bright sunny street city night lights reflect wet road people walk").split()


def write_source(job) -> str:
    import av

    path, h, w, n, fps, seed = job
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, (h // 16 + 1, w // 16 + 1, 3)).repeat(16, 0).repeat(16, 1)[:h, :w].astype(np.uint8)
    c = av.open(path, "w")
    s = c.add_stream("libx264", rate=fps, options={"preset": "ultrafast", "crf": "18"})
    s.width, s.height, s.pix_fmt = w, h, "yuv420p"
    for i in range(n):
        for p in s.encode(av.VideoFrame.from_ndarray(np.roll(base, 3 * i, axis=1), format="rgb24")):
            c.mux(p)
    for p in s.encode():
        c.mux(p)
    c.close()
    return path


def tokenizer(root: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import AutoTokenizer, T5TokenizerFast

    vocab = ([("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [("▁" + x, -1.0) for x in WORDS]
             + [(ch, -5.0) for ch in "abcdefghijklmnopqrstuvwxyz"] + [("▁", -3.0)])
    tok = Tokenizer(models.Unigram(vocab, unk_id=2))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    T5TokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
                    extra_ids=0).save_pretrained(root / "tokenizer")
    return AutoTokenizer.from_pretrained(root / "tokenizer")


def build_encoders(root: Path, device: torch.device):
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    from ds_adaptive.media.encode import LatentEncoders

    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        vae = AutoencoderKLWan().to(torch.bfloat16)           # the Wan 2.1 VAE config (diffusers defaults)
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            te = UMT5EncoderModel(UMT5Config(**UMT5_XXL))
        finally:
            torch.set_default_dtype(old)
    torch.cuda.synchronize()
    info = {"vae_params": sum(p.numel() for p in vae.parameters()),
            "text_encoder_params": sum(p.numel() for p in te.parameters()),
            "build_s": round(time.perf_counter() - t0, 2)}
    return LatentEncoders(vae, te, tokenizer(root), device=device), info


def job_args(manifest: Path, out: Path, workers: int, tiling: str):
    from ds_adaptive.cli.preprocess import build_parser

    return build_parser().parse_args([str(manifest), "--out", str(out), "--workers", str(workers),
                                      "--items-per-unit", "4", "--vae-tiling", tiling, "--no-progress"])


def one_clip(enc, h: int, w: int, tiling: str) -> dict:
    frames = torch.randint(0, 256, (1, 81, h, w, 3), dtype=torch.uint8)
    enc.vae_tiling = tiling
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    z = enc.encode_video(frames)
    torch.cuda.synchronize()
    return {"s": time.perf_counter() - t0, "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "z": z}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/ppbench")
    ap.add_argument("--clips-480", type=int, default=12)
    ap.add_argument("--clips-720", type=int, default=8)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out-json", default="preprocess_bench.json")
    args = ap.parse_args()
    import diffusers
    import transformers

    from ds_adaptive.preprocess.run import run

    dev = torch.device("cuda:0")
    root = Path(args.work)
    (root / "media").mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    jobs = [(str(root / "media" / f"s480_{i}.mp4"), 480, 854, 165, 30, i) for i in range(args.clips_480)]
    jobs += [(str(root / "media" / f"s720_{i}.mp4"), 1080, 1920, 165, 30, 100 + i) for i in range(args.clips_720)]
    with ProcessPoolExecutor(min(16, os.cpu_count() or 1)) as pool:
        list(pool.map(write_source, jobs))
    gen_s = time.perf_counter() - t0
    enc, info = build_encoders(root, dev)
    rng = np.random.default_rng(0)
    for tag, n in (("480", args.clips_480), ("720", args.clips_720)):
        rows = [{"path": f"media/s{tag}_{i}.mp4", "caption": " ".join(rng.choice(WORDS, 118))} for i in range(n)]
        (root / f"m{tag}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # warm-up (cuDNN autotuning, allocator) on one clip of each shape, outside the timed jobs
    for h, w in ((480, 832), (720, 1280)):
        one_clip(enc, h, w, "off")
    enc.encode_text(["warm up"] * 4)
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "diffusers": diffusers.__version__,
           "transformers": transformers.__version__, "source_gen_s": round(gen_s, 1), **info, "sizes": {}}
    for tag, shape in (("480", "81x480x832"), ("720", "81x720x1280")):
        torch.cuda.reset_peak_memory_stats()
        s = run(job_args(root / f"m{tag}.jsonl", root / f"out{tag}", args.workers, "auto"), encoders=enc)
        rep = s["report"]
        assert rep["shapes"] == {shape: rep["samples"]}, rep["shapes"]
        res["sizes"][shape] = {"clips": rep["samples"], "job_s": s["seconds"], "clips_per_s": s["clips_per_s"],
                               "peak_gpu_mem_gib": s["peak_gpu_mem_gib"],
                               "vae_s_per_clip": rep["seconds"]["vae_s"] / rep["samples"],
                               "text_s_per_clip": rep["seconds"]["text_s"] / rep["samples"],
                               "decode_s_per_clip": rep["seconds"]["decode_s"] / rep["samples"],
                               "write_s_per_clip": rep["seconds"]["write_s"] / rep["samples"]}
    a, b = one_clip(enc, 720, 1280, "off"), one_clip(enc, 720, 1280, "on")
    res["tiling_720"] = {"untiled_s": a["s"], "untiled_peak_gib": a["peak_gib"], "tiled_s": b["s"],
                         "tiled_peak_gib": b["peak_gib"],
                         "rel_diff": float((a["z"] - b["z"]).norm() / a["z"].norm())}
    c = one_clip(enc, 480, 832, "off")
    res["untiled_480_single"] = {"s": c["s"], "peak_gib": c["peak_gib"]}
    s480, s720 = res["sizes"]["81x480x832"], res["sizes"]["81x720x1280"]
    t = res["tiling_720"]
    print(f"\n{res['device']}: VAE {info['vae_params'] / 1e6:.1f}M params, umT5 encoder "
          f"{info['text_encoder_params'] / 1e9:.2f}B params (bf16, random)")
    print(f"{'clip':<14}{'clips':>6}{'clips/s':>9}{'VAE s/clip':>12}{'text s/clip':>12}{'decode s/clip':>15}"
          f"{'peak GiB':>10}")
    for shape, r in res["sizes"].items():
        print(f"{shape:<14}{r['clips']:>6}{r['clips_per_s']:>9.3f}{r['vae_s_per_clip']:>12.3f}"
              f"{r['text_s_per_clip']:>12.4f}{r['decode_s_per_clip']:>15.3f}{r['peak_gpu_mem_gib']:>10.1f}")
    print(f"ratios: 720p/480p VAE time {s720['vae_s_per_clip'] / s480['vae_s_per_clip']:.2f}x for "
          f"{720 * 1280 / (480 * 832):.2f}x pixels; 720p tiled/untiled time {t['tiled_s'] / t['untiled_s']:.2f}x, "
          f"peak memory {t['tiled_peak_gib'] / t['untiled_peak_gib']:.2f}x ({t['tiled_peak_gib']:.1f} vs "
          f"{t['untiled_peak_gib']:.1f} GiB), latent rel. difference {t['rel_diff']:.2e}")
    Path(args.out_json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
