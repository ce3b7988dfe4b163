"""Guards the datasets: synthetic latents are deterministic and learnable; shards round-trip; errors name file and sample."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
import torch

from ds_adaptive.data import (DataError, LatentShardDataset, LatentShardWriter, SyntheticLatentDataset,
                              build_dataset, collate_latents, write_legacy_index)
from ds_adaptive.cli.synth import main as synth_main
from ds_adaptive.core.shapes import SampleShape, ShapeWeight

SMALL = [ShapeWeight(SampleShape(1, 64, 96), 3.0), ShapeWeight(SampleShape(9, 64, 64), 1.0)]


def test_samples_have_wan_shapes_and_text_lengths():
    ds = SyntheticLatentDataset(200, seed=3)
    shapes = ds.sample_shapes()
    assert len(shapes) == 200 and any(s.is_image for s in shapes) and any(not s.is_image for s in shapes)
    for i in (0, 1, 2, 50, 199):
        s = ds[i]
        assert s["index"] == i
        assert tuple(s["latents"].shape) == shapes[i].latent_shape == ds.shape_of(i).latent_shape
        assert s["latents"].dtype == torch.float32 and s["context"].dtype == torch.float32
        assert s["context"].shape[1] == 4096 and 16 <= s["context"].shape[0] <= 256
        assert torch.isfinite(s["latents"]).all()
        assert 0.6 < float(s["latents"].std()) < 1.4  # about unit variance, like normalised Wan latents


def test_shape_frequencies_follow_the_weights():
    ds = SyntheticLatentDataset(4000, SMALL, seed=1)
    share = sum(s.is_image for s in ds.sample_shapes()) / 4000
    assert abs(share - 0.75) < 0.03


def test_deterministic_per_sample_and_seed_dependent():
    a = SyntheticLatentDataset(50, SMALL, seed=7)
    b = SyntheticLatentDataset(50, SMALL, seed=7)
    c = SyntheticLatentDataset(50, SMALL, seed=8)
    for i in (49, 3, 17):  # any access order gives the same sample
        x, y = a[i], b[i]
        assert torch.equal(x["latents"], y["latents"]) and torch.equal(x["context"], y["context"])
        assert torch.equal(a[i]["latents"], x["latents"])
    assert a.sample_shapes() == b.sample_shapes()
    assert any(not torch.equal(a[i]["context"], c[i]["context"]) for i in range(5))


def test_latents_are_learnable_from_the_context():
    """The class is readable from the context (nearest centroid) and fixes the clean latent: a per-class mean
    learnt on training samples predicts held-out latents far better than chance."""
    ds = SyntheticLatentDataset(400, [ShapeWeight(SampleShape(5, 64, 64), 1.0)], seed=5, text_len=(4, 16))
    train, test = range(300), range(300, 400)
    ctx = {i: ds[i]["context"].mean(0) for i in range(400)}
    lat = {i: ds[i]["latents"] for i in range(400)}
    cls = {i: ds.class_of(i) for i in range(400)}
    classes = sorted(set(cls[i] for i in train))
    centroid = {k: torch.stack([ctx[i] for i in train if cls[i] == k]).mean(0) for k in classes}
    mean_lat = {k: torch.stack([lat[i] for i in train if cls[i] == k]).mean(0) for k in classes}

    def predict_class(i):
        return min(classes, key=lambda k: float((ctx[i] - centroid[k]).pow(2).sum()))

    held = [i for i in test if cls[i] in mean_lat]
    accuracy = sum(predict_class(i) == cls[i] for i in held) / len(held)
    assert accuracy > 0.95
    mse = np.mean([float((lat[i] - mean_lat[predict_class(i)]).pow(2).mean()) for i in held])
    variance = np.mean([float(lat[i].var()) for i in held])
    wrong = np.mean([float((lat[i] - mean_lat[classes[(classes.index(cls[i]) + 1) % len(classes)]]).pow(2).mean())
                     for i in held])
    assert mse < 0.05 * variance  # only the small per-sample noise is left
    assert wrong > 10 * mse       # and the class really matters


def test_videos_move_and_images_are_one_frame():
    ds = SyntheticLatentDataset(100, [ShapeWeight(SampleShape(33, 64, 64), 1.0)], seed=0)
    x = ds[0]["latents"]
    assert x.shape[1] == 9
    assert float((x[:, 0] - x[:, -1]).pow(2).mean()) > 0.05  # frames differ: motion, not a still


def test_bad_arguments():
    with pytest.raises(DataError, match="num_samples must be a positive int"):
        SyntheticLatentDataset(0)
    with pytest.raises(DataError, match="text_len"):
        SyntheticLatentDataset(10, text_len=(10, 600))
    with pytest.raises(IndexError, match="out of range"):
        SyntheticLatentDataset(10, SMALL)[10]


# --- on-disk shards ----------------------------------------------------------------------------

@pytest.fixture
def written(tmp_path):
    ds = SyntheticLatentDataset(12, SMALL, seed=2)
    out = tmp_path / "ds"
    with LatentShardWriter(out, shard_bytes=400_000) as w:
        for i in range(len(ds)):
            s = ds[i]
            w.add(f"{i:04d}", ds.shape_of(i), s["latents"], s["context"])
    return ds, out


@pytest.fixture
def written_json(written):
    """The same dataset with the index.json (version 1) of ds_adaptive before index.arrow."""
    ds, out = written
    write_legacy_index(out, list(LatentShardDataset(out).entries))
    (out / "index.arrow").unlink()
    return ds, out


def test_round_trip_is_exact(written):
    ds, out = written
    table = pa.ipc.open_file(str(out / "index.arrow")).read_all()
    assert table.schema.names == ["id", "file", "shape", "text_len"]   # default keys: no key columns
    assert json.loads(table.schema.metadata[b"ds_adaptive"])["num_samples"] == 12
    assert len(table.column("file").chunk(0).dictionary) > 1  # several shards
    rd = LatentShardDataset(out)
    assert len(rd) == 12 and rd.sample_shapes() == ds.sample_shapes()
    assert set(rd.entries[0]) >= {"id", "frames", "height", "width", "text_len", "file", "latents_key", "context_key"}
    for i in range(12):
        a, b = rd[i], ds[i]
        assert a["index"] == i
        assert torch.equal(a["latents"], b["latents"]) and torch.equal(a["context"], b["context"])


def test_bf16_storage_reads_back_as_float32(tmp_path):
    ds = SyntheticLatentDataset(2, SMALL, seed=2)
    with LatentShardWriter(tmp_path / "bf", dtype="bfloat16") as w:
        for i in range(2):
            w.add(str(i), ds.shape_of(i), ds[i]["latents"], ds[i]["context"])
    x = LatentShardDataset(tmp_path / "bf")[1]["latents"]
    assert x.dtype == torch.float32
    torch.testing.assert_close(x, ds[1]["latents"], atol=0.02, rtol=0.01)


def test_writer_refuses_bad_input(tmp_path, written):
    _, out = written
    with pytest.raises(DataError, match="index.arrow already exists.*--overwrite"):
        LatentShardWriter(out)
    w = LatentShardWriter(tmp_path / "w")
    shape = SampleShape(1, 64, 96)
    with pytest.raises(DataError, match=r"sample a: latents have shape \(16, 1, 8, 8\), expected \(16, 1, 8, 12\)"):
        w.add("a", shape, torch.zeros(16, 1, 8, 8), torch.zeros(3, 4096))
    with pytest.raises(DataError, match="sample a: context must be"):
        w.add("a", shape, torch.zeros(shape.latent_shape), torch.zeros(600, 4096))
    w.add("a", shape, torch.zeros(shape.latent_shape), torch.zeros(3, 4096))
    with pytest.raises(DataError, match="duplicated"):
        w.add("a", shape, torch.zeros(shape.latent_shape), torch.zeros(3, 4096))


def test_missing_directory_and_index(tmp_path):
    with pytest.raises(DataError, match=f"dataset directory {tmp_path / 'none'} does not exist.*ds-adaptive synth"):
        LatentShardDataset(tmp_path / "none")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"index.arrow does not exist \(nor an older index.json\)"):
        LatentShardDataset(tmp_path / "empty")


def test_corrupt_index(written_json):
    _, out = written_json
    (out / "index.json").write_text('{"format": "ds_adaptive.latents", ')
    with pytest.raises(DataError, match="index.json is not valid JSON"):
        LatentShardDataset(out)


def test_corrupt_arrow_index(written):
    _, out = written
    path = out / "index.arrow"
    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(DataError, match="index.arrow is not a readable Arrow IPC file.*rewrite the dataset"):
        LatentShardDataset(out)


def test_index_entry_errors_name_the_sample(written_json):
    _, out = written_json
    index = json.loads((out / "index.json").read_text())
    index["samples"][3]["frames"] = 4
    (out / "index.json").write_text(json.dumps(index))
    with pytest.raises(DataError, match=r"frames must be 4n\+1 .*sample 3 \(id '0003'\)"):
        LatentShardDataset(out)
    del index["samples"][3]["file"]
    (out / "index.json").write_text(json.dumps(index))
    with pytest.raises(DataError, match=r"sample 3 \(id '0003'\): missing key\(s\) \['file'\]"):
        LatentShardDataset(out)


def test_missing_shard_names_file_and_sample(written):
    _, out = written
    victim = LatentShardDataset(out).entries[-1]
    (out / victim["file"]).unlink()
    with pytest.raises(DataError, match=f"shard .*{victim['file']} does not exist.*sample '"):
        LatentShardDataset(out, verify="open")
    rd = LatentShardDataset(out)  # lazily: opening reads no shard; the first read of that shard names it
    rd[0]
    with pytest.raises(DataError, match=f"{victim['file']} does not exist.*sample '{victim['id']}'"):
        rd[len(rd) - 1]


def test_corrupt_shard_names_file_and_sample(written):
    _, out = written
    victim = LatentShardDataset(out).entries[0]
    path = out / victim["file"]
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(DataError, match=f"shard .*{victim['file']} is corrupt.*'{victim['id']}'"):
        LatentShardDataset(out, verify=True)
    rd = LatentShardDataset(out)
    rd[len(rd) - 1]
    with pytest.raises(DataError, match=f"shard .*{victim['file']} is corrupt.*'{victim['id']}'"):
        rd[0]


def test_key_and_shape_mismatch_are_errors(written_json):
    _, out = written_json
    index = json.loads((out / "index.json").read_text())
    index["samples"][2]["latents_key"] = "nope.latents"
    (out / "index.json").write_text(json.dumps(index))
    with pytest.raises(DataError, match="has no tensor 'nope.latents' for sample '0002'"):
        LatentShardDataset(out, verify=True)
    with pytest.raises(DataError, match="has no tensor 'nope.latents' for sample '0002'"):
        LatentShardDataset(out)[2]   # lazily, when its shard is first read
    index["samples"][2]["latents_key"] = "0002.latents"
    index["samples"][2]["text_len"] += 1
    (out / "index.json").write_text(json.dumps(index))
    with pytest.raises(DataError, match="'0002.context' of sample '0002' has shape .*the index says"):
        LatentShardDataset(out, verify=True)


def test_synth_cli_writes_the_embedded_samples(tmp_path, capsys):
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps([{"frames": 1, "height": 64, "width": 64}]))
    out = tmp_path / "syn"
    assert synth_main(["--out", str(out), "--num-samples", "5", "--shapes", str(shapes), "--seed", "4"]) == 0
    assert "wrote" in capsys.readouterr().out
    disk = build_dataset(str(out))
    mem = build_dataset("synthetic", num_samples=5, shapes=str(shapes), seed=4)
    assert torch.equal(disk[4]["latents"], mem[4]["latents"])
    assert synth_main(["--out", str(out), "--num-samples", "5"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert synth_main(["--out", str(tmp_path / "x"), "--num-samples", "1", "--shapes", str(tmp_path / "no.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


# --- collate -----------------------------------------------------------------------------------

def test_collate_pads_contexts_with_zeros_to_512():
    ds = SyntheticLatentDataset(40, [ShapeWeight(SampleShape(1, 64, 64), 1.0)], seed=0)
    samples = [ds[i] for i in range(3)]
    batch = collate_latents(samples)
    assert batch["latents"].shape == (3, 16, 1, 8, 8)
    assert batch["context"].shape == (3, 512, 4096)
    lens = [s["context"].shape[0] for s in samples]
    assert batch["context_lens"].tolist() == lens and batch["index"].tolist() == [0, 1, 2]
    for row, n in enumerate(lens):
        assert torch.equal(batch["context"][row, :n], samples[row]["context"])
        assert batch["context"][row, n:].abs().sum() == 0
    assert collate_latents(samples, pad_text_to=None)["context"].shape[1] == max(lens)


def test_collate_errors():
    ds = SyntheticLatentDataset(40, SMALL, seed=0)
    shapes = ds.sample_shapes()
    i = next(k for k in range(40) if shapes[k] != shapes[0])
    with pytest.raises(DataError, match="must share a latent shape.*index: shape"):
        collate_latents([ds[0], ds[i]])
    with pytest.raises(DataError, match="empty micro-batch"):
        collate_latents([])
    long = ds[0]
    with pytest.raises(DataError, match=f"sample 0 has a {long['context'].shape[0]}-token context"):
        collate_latents([long], pad_text_to=8)
