"""Guards `ds-adaptive preprocess` / `stats`: media written here with PyAV (3 sizes and lengths, an image, a
corrupt file, a missing caption) and tiny random AutoencoderKLWan + UMT5 + a tokenizer built here (no download)
-> shards + rejects -> 5 trainer steps; a killed run resumed is byte-identical; two ranks split the work; the
encodings equal diffusers' Wan pipeline encode path; the shape policy and frame sampling; stats json/PNG."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

av = pytest.importorskip("av")
pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("ftfy")

from conftest import CONFIGS, ROOT, launch_ranks  # noqa: E402

from ds_adaptive.preprocess.manifest import MediaItem, read_inputs  # noqa: E402
from ds_adaptive.preprocess.media import decode_item, planned_shapes, probe  # noqa: E402
from ds_adaptive.preprocess.policy import (PolicyError, ShapePolicy, choose_bucket, clip_frame_counts,  # noqa: E402
                                           load_policy, plan_resize, sampled_frame_count)
from ds_adaptive.core.shapes import SampleShape, load_shape_distribution  # noqa: E402

POLICY_ARGS = ["--fps", "8", "--frames", "5", "9", "--video-sizes", "32x64", "64x32", "48x48",
               "--image-sizes", "32x32", "32x64"]
EXPECTED = Counter({"9x32x64": 1, "5x32x64": 1, "9x64x32": 1, "9x48x48": 2, "5x48x48": 1, "1x32x64": 1})


def write_video(path: Path, n: int, fps: int, h: int, w: int, *, seed: int = 0, frames=None, rotation: int = 0):
    """A lossless H.264 file (qp 0) of ``n`` frames: a moving random block pattern, or ``frames``."""
    c = av.open(str(path), "w")
    s = c.add_stream("libx264", rate=fps, options={"qp": "0"})
    s.width, s.height, s.pix_fmt = w, h, "yuv420p"
    if rotation:
        s.set_display_rotation(rotation)
    base = np.random.default_rng(seed).integers(0, 255, (h // 8, w // 8, 3)).repeat(8, 0).repeat(8, 1)
    for i in range(n):
        img = frames[i] if frames is not None else np.roll(base, i, axis=1).astype(np.uint8)
        for p in s.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(img), format="rgb24")):
            c.mux(p)
    for p in s.encode():
        c.mux(p)
    c.close()


def tiny_models(root: Path) -> dict:
    """The stand-in pipeline's random tiny AutoencoderKLWan (z_dim 16), UMT5 (d_model 4096) and Unigram tokenizer with
    T5's special tokens (``ds_adaptive.integrations.diffusers_demo``, what ``ds-adaptive demo-assets`` writes)."""
    from ds_adaptive.integrations.diffusers_demo import write_demo_encoders

    write_demo_encoders(root)
    return {"--vae": root / "vae", "--text-encoder": root / "text_encoder", "--tokenizer": root / "tokenizer"}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("pre")
    media = root / "media"
    media.mkdir()
    write_video(media / "a.mp4", 48, 24, 96, 160, seed=1)    # 2 s -> 16 frames at 8 fps -> 9 + 5
    write_video(media / "b.mp4", 24, 16, 112, 64, seed=2)    # portrait 1.5 s -> 12 -> 9
    write_video(media / "c.mp4", 30, 10, 128, 128, seed=3)   # 3 s -> 24 -> 9 + 9 + 5
    write_video(media / "short.mp4", 3, 10, 64, 64, seed=4)  # 0.3 s -> 3 frames: too short
    write_video(media / "nocap.mp4", 20, 10, 64, 64, seed=5)
    from PIL import Image

    Image.fromarray(np.random.default_rng(6).integers(0, 255, (60, 100, 3)).astype(np.uint8)).save(media / "img.png")
    (media / "bad.mp4").write_bytes(np.random.default_rng(7).integers(0, 255, 3000).astype(np.uint8).tobytes())
    rows = [("a.mp4", "a cat runs over the blue sky"), ("b.mp4", "a dog jumps"), ("c.mp4", "red video of the sky"),
            ("short.mp4", "too short"), ("nocap.mp4", ""), ("img.png", "a blue cat"), ("bad.mp4", "corrupt")]
    manifest = root / "clips.jsonl"
    manifest.write_text("".join(json.dumps({"path": f"media/{p}", "caption": c}) + "\n" for p, c in rows))
    weights = tiny_models(root)
    argv = [str(manifest)] + [x for k, v in weights.items() for x in (k, str(v))] + POLICY_ARGS + [
        "--workers", "0", "--items-per-unit", "2", "--no-progress"]
    return {"root": root, "manifest": manifest, "weights": weights, "argv": argv}


def _files(d: Path) -> dict:
    names = sorted(p.name for p in d.glob("shard-*.safetensors")) + ["index.arrow", "rejects.jsonl"]
    return {n: (d / n).read_bytes() for n in names}


@pytest.fixture(scope="module")
def clean_run(assets) -> dict:
    from ds_adaptive.cli.preprocess import main

    out = assets["root"] / "clean"
    old = os.umask(0o027)
    try:
        assert main(assets["argv"] + ["--out", str(out)]) == 0
    finally:
        os.umask(old)
    return {"out": out, "files": _files(out)}


def test_pipeline_writes_shards_rejects_and_report(clean_run, capsys):
    from ds_adaptive.data import LatentShardDataset

    out = clean_run["out"]
    ds = LatentShardDataset(out)
    assert Counter(str(s) for s in ds.sample_shapes()) == EXPECTED
    assert len(list(out.glob("shard-*.safetensors"))) == 3  # units 0-2 hold samples; unit 3 is all rejects
    sample = ds[0]
    assert sample["latents"].shape == (16, 3, 4, 8) and sample["latents"].abs().sum() > 0
    assert sample["context"].shape[1] == 4096 and 2 <= sample["context"].shape[0] <= 512
    rejects = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    assert {Path(r["path"]).name: r["reason"].split(" (")[0].split(":")[0] for r in rejects} == {
        "short.mp4": "too short", "nocap.mp4": "missing caption", "bad.mp4": "unreadable video"}
    assert all(r["where"].endswith(f"line {r['index'] + 1}") for r in rejects)
    report = json.loads((out / "report.json").read_text())
    assert report["items"] == 7 and report["samples"] == 7 and report["rejects"] == 3
    assert report["rejects_by_reason"] == {"missing caption": 1, "too short": 1, "unreadable video": 1}
    for name in ("index.arrow", "rejects.jsonl", "shard-00000-00000.safetensors"):  # the user's umask (027)
        assert (out / name).stat().st_mode & 0o777 == 0o640, name


@pytest.mark.slow
def test_five_trainer_steps_on_the_shards(clean_run, tmp_path):
    cfg = json.loads((CONFIGS / "cpu_tiny.json").read_text())
    cfg["adaptive_load"]["fused_ln_modulate"] = False
    cfg["adaptive_load"]["sampler"]["shapes"] = None
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    launch_ranks(["-m", "ds_adaptive.cli.train", "--deepspeed_config", "cfg.json", "--data", str(clean_run["out"]),
                  "--steps", "5", "--log-dir", "logs"], 1, cwd=tmp_path, timeout=300)
    s = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert s["steps"] == 5 and s["final_step"] == 5 and "latent dataset" in s["dataset"]
    assert len(s["losses"]) == 5 and all(np.isfinite(s["losses"]))


KILLED = textwrap.dedent("""
    import os, signal, sys
    from ds_adaptive.cli import preprocess
    from ds_adaptive.preprocess import encode
    calls = [0]
    real = encode.LatentEncoders.encode_video
    def encode_video(self, frames):
        calls[0] += 1
        if calls[0] == 2:  # rank 1's first unit (unit 1: c.mp4 gives 3 clips) is half encoded
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, frames)
    encode.LatentEncoders.encode_video = encode_video
    sys.exit(preprocess.main(sys.argv[1:]))
""")


def test_two_ranks_killed_and_resumed_give_identical_bytes(assets, clean_run, monkeypatch, capsys):
    """Rank 1 of 2 is SIGKILLed inside its first unit; rank 0 does units 0 and 2 (disjoint); rank 1 rerun skips
    nothing of rank 0's, finishes units 1 and 3 and, seeing every unit, writes the same bytes as one process."""
    from ds_adaptive.cli.preprocess import main

    out = assets["root"] / "killed"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RANK": "1", "WORLD_SIZE": "2"}
    r = subprocess.run([sys.executable, "-c", KILLED, *assets["argv"], "--out", str(out)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == -9, r.stdout + r.stderr
    assert not list((out / "parts").glob("unit-*")) and not (out / "index.arrow").exists()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(assets["argv"] + ["--out", str(out)]) == 0
    assert sorted(p.name for p in (out / "parts").glob("unit-*")) == ["unit-00000.json", "unit-00002.json"]
    assert not (out / "index.arrow").exists() and "still running" in capsys.readouterr().out
    monkeypatch.setenv("RANK", "1")
    assert main(assets["argv"] + ["--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "rank 1/2: 3 items -> 3 samples, 2 rejected" in printed  # c.mp4 (3 clips), short.mp4, bad.mp4
    assert "preprocess report" in printed
    assert _files(out) == clean_run["files"]
    # a finished job rerun (any world size) changes nothing; a different job in the same --out is refused
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert main(assets["argv"] + ["--out", str(out)]) == 0
    assert _files(out) == clean_run["files"]
    assert main(assets["argv"] + ["--out", str(out), "--fps", "12"]) == 2
    err = capsys.readouterr().err
    assert "different preprocess job" in err and "policy: was" in err


def test_encoding_matches_diffusers_wan_pipeline(assets):
    from diffusers import AutoencoderKLWan, WanVideoToVideoPipeline
    from PIL import Image
    from transformers import AutoTokenizer, UMT5EncoderModel

    from ds_adaptive.media.encode import LatentEncoders

    w = assets["weights"]
    vae = AutoencoderKLWan.from_pretrained(w["--vae"])
    te, tok = UMT5EncoderModel.from_pretrained(w["--text-encoder"]), AutoTokenizer.from_pretrained(w["--tokenizer"])

    class CleanLatents:  # prepare_latents adds noise through the scheduler: keep the clean, encoded latent
        def scale_noise(self, sample, timestep, noise):
            return sample

    pipe = WanVideoToVideoPipeline(tokenizer=tok, text_encoder=te, transformer=None, vae=vae, scheduler=CleanLatents())
    ours = LatentEncoders(vae, te, tok)
    frames = np.random.default_rng(0).integers(0, 256, (9, 48, 80, 3), dtype=np.uint8)
    video = pipe.video_processor.preprocess_video([Image.fromarray(f) for f in frames], height=48, width=80)
    with torch.no_grad():
        ref = pipe.prepare_latents(video, 1, 16, 48, 80, torch.float32, torch.device("cpu"), None, None,
                                   torch.tensor([0]))
    got = ours.encode_video(torch.from_numpy(frames)[None])
    assert got.shape == ref.shape == (1, 16, 3, 6, 10)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    prompts = ["a  cat runs over the sky &amp;amp; the dog", "video"]
    ref_ctx, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=512,
                                    device=torch.device("cpu"))
    got_ctx = ours.encode_text(prompts)
    for ref_row, g in zip(ref_ctx, got_ctx):
        assert g.shape[1] == 4096 and 1 < g.shape[0] < 512
        torch.testing.assert_close(g, ref_row[: g.shape[0]], rtol=0, atol=0)
        assert ref_row[g.shape[0]:].abs().max() == 0  # Wan zeroes past the prompt: collate's padding gives the same


def test_the_empty_prompt_is_stored_as_the_wan_pipeline_encodes_it(assets, clean_run):
    """Caption dropout's replacement: the text encoder's embedding of "" (diffusers' Wan pipeline, its unconditional
    branch without a negative prompt), next to the index."""
    from diffusers import WanVideoToVideoPipeline
    from transformers import AutoTokenizer, UMT5EncoderModel

    from ds_adaptive.data import EMPTY_PROMPT_FILE, LatentShardDataset

    w = assets["weights"]
    te, tok = UMT5EncoderModel.from_pretrained(w["--text-encoder"]), AutoTokenizer.from_pretrained(w["--tokenizer"])
    pipe = WanVideoToVideoPipeline(tokenizer=tok, text_encoder=te, transformer=None, vae=None, scheduler=None)
    ref, _ = pipe.encode_prompt([""], do_classifier_free_guidance=False, max_sequence_length=512,
                                device=torch.device("cpu"))
    assert (clean_run["out"] / EMPTY_PROMPT_FILE).is_file()
    got = LatentShardDataset(clean_run["out"]).empty_context()
    assert got.shape == (1, 4096)   # the EOS token alone
    torch.testing.assert_close(got, ref[0, :1], rtol=0, atol=0)
    assert ref[0, 1:].abs().max() == 0


def test_stats_predicts_the_written_shapes_and_writes_a_usable_shapes_json(assets, clean_run, tmp_path, capsys):
    from ds_adaptive.cli.stats import main

    js, png = tmp_path / "mix.json", tmp_path / "mix.png"
    assert main([str(assets["manifest"]), "--json", str(js), "--png", str(png), "--workers", "0", *POLICY_ARGS]) == 0
    printed = capsys.readouterr().out
    assert "would be rejected, too short: 1" in printed and "would be rejected, missing caption: 1" in printed
    dist = load_shape_distribution(js)  # what simulate / dry-run / train --shapes / the synthetic dataset read
    assert Counter({str(d.shape): int(d.weight) for d in dist}) == EXPECTED
    assert png.stat().st_size > 1000 or "skipped" in printed
    assert main([str(clean_run["out"]), "--json", str(tmp_path / "d.json"), "--workers", "0"]) == 0
    assert json.loads((tmp_path / "d.json").read_text())["shapes"] == json.loads(js.read_text())["shapes"]
    from ds_adaptive.cli.simulate import main as simulate_main

    assert simulate_main(["--shapes", str(js), "--world", "2", "--steps", "4"]) == 0


def test_folder_input_with_sidecar_captions(tmp_path):
    write_video(tmp_path / "x.mp4", 10, 10, 64, 64)
    (tmp_path / "x.txt").write_text("  a   cat \n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "y.jpg").write_bytes(b"not a jpeg")
    (tmp_path / "notes.md").write_text("not media")
    items = read_inputs(tmp_path)
    assert [Path(i.path).relative_to(tmp_path).as_posix() for i in items] == ["sub/y.jpg", "x.mp4"]
    by = {Path(i.path).name: i for i in items}
    assert by["x.mp4"].caption == "a   cat" and by["x.mp4"].problem is None
    assert "missing caption" in by["y.jpg"].problem


def test_frame_sampling_rotation_and_time_window(tmp_path):
    # 24 fps gray ramp: frame i has value 8 * i; sampled at 8 fps every 3rd frame is on screen
    ramp = [np.full((32, 64, 3), 8 * i, np.uint8) for i in range(30)]
    write_video(tmp_path / "ramp.mp4", 30, 24, 32, 64, frames=ramp)
    pol = ShapePolicy(fps=8, frame_counts=[5, 9], video_sizes=["32x64"], image_sizes=["32x32"])
    d = decode_item(MediaItem(0, str(tmp_path / "ramp.mp4"), "c"), pol)
    assert d.source_frames == 10 and [c.shape[0] for c in d.clips] == [9]
    assert [round(float(f.mean()) / 8) for f in d.clips[0]] == [0, 3, 6, 9, 12, 15, 18, 21, 24]
    d = decode_item(MediaItem(0, str(tmp_path / "ramp.mp4"), "c", start=0.5, end=1.2), pol)
    assert [round(float(f.mean()) / 8) for f in d.clips[0]] == [12, 15, 18, 21, 24] and d.starts == [0.5]
    # display rotation 90 (counter-clockwise): a 32x64 coded frame is shown 64x32; its top rows become the left
    top = np.zeros((32, 64, 3), np.uint8)
    top[:8] = 255
    write_video(tmp_path / "rot.mp4", 10, 10, 32, 64, frames=[top] * 10, rotation=90)
    pol = ShapePolicy(fps=10, frame_counts=[5], video_sizes=["32x64", "64x32"], image_sizes=["32x32"])
    item = MediaItem(0, str(tmp_path / "rot.mp4"), "c")
    info = probe(item)
    assert (info.height, info.width, info.rotation) == (64, 32, 90)
    d = decode_item(item, pol)
    assert d.shapes == planned_shapes(item, info, pol) == [SampleShape(5, 64, 32)] * 2  # 10 frames: cut 5 + 5
    clip = d.clips[0]
    assert clip[0, :, :4].mean() > 200 and clip[0, :, -8:].mean() < 50


@pytest.mark.parametrize("src, bucket", [((1080, 1920), (720, 1280)), ((480, 854), (480, 832)),
                                         ((480, 640), (480, 832)), ((960, 1280), (720, 1280)),
                                         ((1920, 1080), (832, 480)), ((360, 640), (480, 832))])
def test_bucket_choice(src, bucket):
    pol = ShapePolicy()
    assert choose_bucket(*src, pol.video_buckets, pol) == bucket
    r = plan_resize(*src, bucket)
    assert r.resized_h >= bucket[0] and r.resized_w >= bucket[1] and (r.height, r.width) == bucket
    assert abs(r.resized_h / r.resized_w - src[0] / src[1]) < 0.01


def test_frame_counts_and_policy_errors():
    pol = ShapePolicy()
    assert clip_frame_counts(16, pol) == [] and clip_frame_counts(17, pol) == [17] and clip_frame_counts(80, pol) == [49]
    assert clip_frame_counts(81 * 2 + 40, pol) == [81, 81, 33]
    assert clip_frame_counts(400, ShapePolicy(long_clips="truncate")) == [81]
    assert clip_frame_counts(400, ShapePolicy(max_clips_per_video=2)) == [81, 81]
    assert sampled_frame_count(81 / 16, 16) == 81 and sampled_frame_count(5.0, 16) == 80
    # the default policy makes the default plan's shapes (and portrait 17/49-frame clips, which it lacks)
    defaults = {d.shape for d in load_shape_distribution()}
    assert set(pol.output_shapes()) - defaults == {SampleShape(17, 832, 480), SampleShape(49, 832, 480)}
    assert defaults <= set(pol.output_shapes())
    with pytest.raises(PolicyError, match="frame_counts.*4n\\+1"):
        load_policy(None, frame_counts=[16])
    with pytest.raises(PolicyError, match="multiple of 16"):
        load_policy(None, video_sizes=["480x830"])
    with pytest.raises(PolicyError, match="unknown key 'fsp'"):
        load_policy(None, fsp=3)


def test_csv_manifest_rows_and_row_problems(tmp_path):
    from ds_adaptive.preprocess.manifest import ManifestError, read_manifest

    (tmp_path / "m.csv").write_text('path,caption,start,end,fps\nv/a.mp4,"a, cat",1.5,4,12\nb.mp4,,,,\n'
                                    'c.mp4,x,5,2,\nd.mp4,y,abc,,\n')
    a, b, c, d = read_manifest(tmp_path / "m.csv")
    assert (a.path, a.caption, a.start, a.end, a.fps, a.problem) == (str(tmp_path / "v" / "a.mp4"), "a, cat", 1.5,
                                                                     4.0, 12.0, None)
    assert "missing caption" in b.problem and "'end' (2.0) must be after 'start' (5.0)" in c.problem
    assert "'start' must be a number" in d.problem and d.where == f"{tmp_path / 'm.csv'} line 5"
    (tmp_path / "bad.csv").write_text("file,text\nx.mp4,y\n")
    with pytest.raises(ManifestError, match="header with at least 'path'"):
        read_manifest(tmp_path / "bad.csv")
    (tmp_path / "u.jsonl").write_text('{"path": "x.mp4", "caption": "y", "lenght": 3}\n')
    with pytest.raises(ManifestError, match="unknown column.*lenght"):
        read_manifest(tmp_path / "u.jsonl")


def test_overwrite_clears_only_preprocess_outputs_and_refuses_several_ranks(tmp_path):
    from ds_adaptive.preprocess.run import PreprocessError, _check_settings

    out = tmp_path / "out"
    (out / "parts").mkdir(parents=True)
    for name in ("preprocess.json", "index.arrow", "index.json", "rejects.jsonl", "report.json",
                 "shard-00000-00000.safetensors", "parts/unit-00000.json", "notes.txt"):
        (out / name).write_text("{}")
    with pytest.raises(PreprocessError, match="cannot run under several ranks"):
        _check_settings(out, {"a": 1}, True, world=2)
    _check_settings(out, {"a": 1}, True, world=1)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == ["notes.txt", "parts", "preprocess.json"]
    assert json.loads((out / "preprocess.json").read_text()) == {"a": 1}
    (tmp_path / "synth").mkdir()
    (tmp_path / "synth" / "index.json").write_text("{}")
    with pytest.raises(PreprocessError, match="not written by preprocess"):
        _check_settings(tmp_path / "synth", {"a": 1}, False, world=1)


def test_a_failed_argument_check_writes_nothing(assets, tmp_path, capsys):
    """No weights (or a missing folder): one line, exit 2, and --out untouched, so the corrected call is not refused
    as "a different job"."""
    from ds_adaptive.cli.preprocess import main

    out = tmp_path / "out"
    argv = [str(assets["manifest"]), "--out", str(out)] + POLICY_ARGS + ["--workers", "0", "--no-progress"]
    assert main(argv) == 2
    assert "no vae weights: pass --vae DIR or --pipeline DIR" in capsys.readouterr().err and not out.exists()
    assert main(argv + ["--pipeline", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err and not out.exists()


def test_upscaling_is_counted_in_the_report(tmp_path, clean_run):
    """A source smaller than every bucket is upscaled to the nearest one, and the report says how many were."""
    from PIL import Image

    from ds_adaptive.preprocess.run import format_report

    Image.fromarray(np.zeros((24, 40, 3), np.uint8)).save(tmp_path / "small.png")
    pol = ShapePolicy(fps=8, frame_counts=[5], video_sizes=["32x64"], image_sizes=["32x64"])
    d = decode_item(MediaItem(0, str(tmp_path / "small.png"), "c"), pol)
    assert d.shapes == [SampleShape(1, 32, 64)] and d.upscale > 1.5
    report = json.loads((clean_run["out"] / "report.json").read_text())
    assert report["upscaled"] == 0 and "upscaled" not in format_report(report)
    assert "upscaled to reach a size bucket" in format_report(dict(report, upscaled=2))
