"""Guards the dataset index (index.arrow): a 10M-sample index opens and gives a rank its shapes and rows; old
index.json datasets read the same and convert losslessly; shards are checked lazily, the error naming file and sample."""
from __future__ import annotations

import json
import pickle

import numpy as np
import pyarrow as pa
import pytest
import torch

import ds_adaptive.data.index as index_mod
from ds_adaptive.cli import main as cli_main
from ds_adaptive.core.shapes import IndexedShapes, SampleShape, ShapeWeight, load_shape_distribution
from ds_adaptive.data import (DataError, IndexBuilder, LatentShardDataset, LatentShardWriter, SyntheticLatentDataset,
                              read_legacy_index, write_index, write_legacy_index)
from ds_adaptive.data.convert import convert_dataset
from ds_adaptive.data.split import DatasetView
from ds_adaptive.planning.planner import unique_shapes as planner_unique_shapes
from ds_adaptive.planning.shape_table import dataset_shapes

SMALL = [ShapeWeight(SampleShape(1, 64, 96), 3.0), ShapeWeight(SampleShape(9, 64, 64), 1.0),
         ShapeWeight(SampleShape(5, 32, 64), 1.0)]


def _write(out, n=30, shard_bytes=300_000, meta=False):
    """``n`` synthetic samples in several shards (``meta``: preprocess's source / start_s on some)."""
    ds = SyntheticLatentDataset(n, SMALL, seed=3)
    with LatentShardWriter(out, shard_bytes=shard_bytes) as w:
        for i in range(n):
            s = ds[i]
            extra = {"source": f"clips/{i // 3}.mp4", "start_s": 0.5 * i} if meta and i % 2 else None
            w.add(f"{i:05d}", ds.shape_of(i), s["latents"], s["context"], meta=extra)
    return ds


def _to_json(out):
    """Rewrite ``out``'s index as the index.json of ds_adaptive before index.arrow."""
    write_legacy_index(out, list(LatentShardDataset(out).entries))
    (out / "index.arrow").unlink()


# --- 10M samples ------------------------------------------------------------------------------------------------

N_BIG, PER_SHARD, BATCH = 10_000_000, 100, 1 << 20


def _ids(lo: int, hi: int) -> pa.Array:
    """Ids "00000000".."09999999" of rows lo..hi as an Arrow string array, built from bytes (no Python str)."""
    rows = np.arange(lo, hi, dtype=np.int64)
    digits = (rows[:, None] // (10 ** np.arange(7, -1, -1, dtype=np.int64))) % 10 + ord("0")
    offsets = np.arange(0, 8 * (hi - lo) + 1, 8, dtype=np.int32)
    return pa.StringArray.from_buffers(hi - lo, pa.py_buffer(offsets), pa.py_buffer(digits.astype(np.uint8)))


@pytest.fixture(scope="module")
def big_index(tmp_path_factory):
    """An index.arrow of 10M samples (no shard exists), written with pyarrow directly: the default shape mix,
    100 samples per shard, random text lengths."""
    out = tmp_path_factory.mktemp("big")
    shapes = sorted({w.shape for w in load_shape_distribution(None)})
    rng = np.random.default_rng(0)
    shape_ids = rng.integers(0, len(shapes), N_BIG).astype(np.int32)
    text = rng.integers(1, 513, N_BIG).astype(np.int32)
    files = pa.array([f"shard-{k:06d}.safetensors" for k in range(N_BIG // PER_SHARD)])
    names = pa.array([str(s) for s in shapes])
    header = {**index_mod.header_for(None, N_BIG)}
    strings = index_mod._schema()["file"]
    schema = pa.schema([pa.field("id", pa.string(), False), pa.field("file", strings, False),
                        pa.field("shape", strings, False), pa.field("text_len", pa.int32(), False)],
                       metadata={b"ds_adaptive": json.dumps(header).encode()})
    with pa.OSFile(str(out / "index.arrow"), "wb") as sink, pa.ipc.new_file(sink, schema) as w:
        for lo in range(0, N_BIG, BATCH):
            hi = min(lo + BATCH, N_BIG)
            shard = (np.arange(lo, hi) // PER_SHARD).astype(np.int32)
            w.write_batch(pa.record_batch([
                _ids(lo, hi), pa.DictionaryArray.from_arrays(shard, files),
                pa.DictionaryArray.from_arrays(shape_ids[lo:hi], names), pa.array(text[lo:hi])], schema=schema))
    return out, shapes, shape_ids, text


def test_a_10m_sample_index_gives_every_shape_and_a_rank_its_rows(big_index):
    out, shapes, shape_ids, text = big_index
    ds = LatentShardDataset(out)   # no shard file exists: opening reads none
    assert len(ds) == N_BIG and ds.unique_shapes() == shapes
    ids = ds.shape_ids()
    assert ids.dtype == np.int32 and np.array_equal(ids, shape_ids)
    assert np.array_equal(ds.text_lens(), text)
    rank, world = 37, 64   # a rank reads only its own rows
    mine = np.arange(rank, N_BIG, world)[::5000]
    for i in mine:
        e = ds.entries[int(i)]
        assert e["id"] == f"{i:08d}" and e["file"] == f"shard-{i // PER_SHARD:06d}.safetensors"
        assert SampleShape(e["frames"], e["height"], e["width"]) == shapes[shape_ids[i]] == ds.shape_of(int(i))
        assert e["text_len"] == text[i] and e["latents_key"] == f"{i:08d}.latents"
    last = N_BIG // PER_SHARD - 1
    assert np.array_equal(ds.index.rows_of_shard(last), np.arange(last * PER_SHARD, N_BIG))
    with pytest.raises(DataError, match=rf"shard-{last:06d}.safetensors does not exist \(needed by sample "
                                        rf"'{N_BIG - 1:08d}' and 99 more"):
        ds[N_BIG - 1]


def test_the_trainer_plans_a_10m_index_from_its_ids_without_an_object_per_sample(big_index):
    out, shapes, shape_ids, _ = big_index
    ds = LatentShardDataset(out)
    planned = dataset_shapes(ds)   # what build_run, the trainer and the dry run plan with
    assert isinstance(planned, IndexedShapes) and len(planned) == N_BIG and planned.unique == shapes
    assert planned.ids is ds.shape_ids()   # the index's own int32 column: no copy
    uniq, sid = planner_unique_shapes(planned)
    assert uniq == shapes and sid is planned.ids
    i = 7_654_321
    assert planned[i] == shapes[shape_ids[i]] == ds.shape_of(i)
    view = DatasetView(ds, np.arange(3, N_BIG, 1000), role="training")   # a split view keeps the ids
    vs = dataset_shapes(view)
    assert len(vs) == 10_000 and [vs.unique[j] for j in vs.ids[:5]] == [shapes[shape_ids[k]] for k in (3, 1003, 2003,
                                                                                                       3003, 4003)]


def test_the_planner_gets_the_same_unique_shapes_and_ids(tmp_path):
    _write(tmp_path / "d")
    ds = LatentShardDataset(tmp_path / "d")
    uniq, sid = planner_unique_shapes(ds.sample_shapes())
    assert uniq == ds.unique_shapes() and np.array_equal(sid, ds.shape_ids())
    syn = SyntheticLatentDataset(50, SMALL + [ShapeWeight(SampleShape(1, 64, 96), 1.0)], seed=1)  # a repeated shape
    uniq, sid = planner_unique_shapes(syn.sample_shapes())
    assert uniq == syn.unique_shapes() and np.array_equal(sid, syn.shape_ids()) and syn.shape_ids().dtype == np.int32


def test_many_record_batches_and_a_rank_reading_its_slice(tmp_path, monkeypatch):
    monkeypatch.setattr(index_mod, "BATCH_ROWS", 7)   # 30 samples in 5 record batches
    ref = _write(tmp_path / "d", meta=True)
    ds = LatentShardDataset(tmp_path / "d")
    assert ds.index.table.to_batches()[0].num_rows == 7 and len(ds.index.table.to_batches()) == 5
    assert ds.sample_shapes() == ref.sample_shapes()
    files = [e["file"] for e in ds.entries]
    for k, name in enumerate(ds.index.shard_files):
        assert ds.index.rows_of_shard(k).tolist() == [i for i, f in enumerate(files) if f == name]
    # a rank whose samples are all in the first shards never opens the others, even when they are gone
    first = ds.index.rows_of_shard(0)
    for name in ds.index.shard_files[1:]:
        (tmp_path / "d" / name).unlink()
    for i in first:
        assert torch.equal(ds[int(i)]["latents"], ref[int(i)]["latents"])
    assert ds.entries[3]["source"] == "clips/1.mp4" and ds.entries[3]["start_s"] == 1.5
    assert "source" not in ds.entries[2]


def test_shards_interleaved_in_the_index(tmp_path):
    """Samples need not be grouped by shard (an edited index.json): each shard's rows are still found and checked."""
    ref = _write(tmp_path / "d")
    entries = list(LatentShardDataset(tmp_path / "d").entries)
    order = np.random.default_rng(0).permutation(len(entries))
    write_index(tmp_path / "d", [entries[k] for k in order])
    ds = LatentShardDataset(tmp_path / "d")
    files = [entries[k]["file"] for k in order]
    for k, name in enumerate(ds.index.shard_files):
        assert ds.index.rows_of_shard(k).tolist() == [i for i, f in enumerate(files) if f == name]
    for i in (0, 9, 29):
        assert torch.equal(ds[i]["latents"], ref[int(order[i])]["latents"])
    LatentShardDataset(tmp_path / "d", verify="open")


def test_old_json_datasets_read_the_same(tmp_path):
    ref = _write(tmp_path / "d", meta=True)
    arrow = LatentShardDataset(tmp_path / "d")
    entries = list(arrow.entries)
    _to_json(tmp_path / "d")
    old = LatentShardDataset(tmp_path / "d")
    assert old.index_path.name == "index.json" and list(old.entries) == entries
    assert old.sample_shapes() == ref.sample_shapes() and np.array_equal(old.shape_ids(), arrow.shape_ids())
    assert torch.equal(old[7]["context"], ref[7]["context"])


def test_convert_round_trip_keeps_samples_shapes_and_tensors(tmp_path, capsys):
    out = tmp_path / "d"
    _write(out, meta=True)
    _to_json(out)
    old = LatentShardDataset(out)
    before = [(e, old[i]) for i, e in enumerate(old.entries)]
    assert cli_main(["data", "convert", str(out)]) == 0
    assert "converted" in capsys.readouterr().out
    assert not (out / "index.json").exists() and (out / "index.json.bak").is_file()
    new = LatentShardDataset(out)
    assert new.index_path.name == "index.arrow" and new.header["version"] == 2
    assert new.sample_shapes() == old.sample_shapes()
    for i, (entry, sample) in enumerate(before):
        assert new.entries[i] == entry
        got = new[i]
        assert torch.equal(got["latents"], sample["latents"]) and torch.equal(got["context"], sample["context"])
    assert cli_main(["data", "convert", str(out)]) == 2
    assert "already exists and there is no index.json" in capsys.readouterr().err
    assert cli_main(["data", "check", str(out)]) == 0
    assert f"all {len(new.index.shard_files)} shards hold every sample's tensors" in capsys.readouterr().out


def test_convert_keeps_the_json_and_fills_what_old_indexes_lack(tmp_path):
    out = tmp_path / "d"
    _write(out)
    _to_json(out)
    index = json.loads((out / "index.json").read_text())
    del index["vae"], index["vae_stride"]   # written before they were recorded
    (out / "index.json").write_text(json.dumps(index))
    report = convert_dataset(out, keep_json=True)
    assert report["filled_from_model"] == ["vae", "vae_stride"] and (out / "index.json").is_file()
    assert LatentShardDataset(out).header["vae_stride"] == [4, 8, 8]
    with pytest.raises(DataError, match="index.arrow already exists; pass --overwrite"):
        convert_dataset(out)
    assert convert_dataset(out, overwrite=True)["samples"] == 30


def test_lazy_shard_check_names_file_key_and_sample_when_first_read(tmp_path):
    out = tmp_path / "d"
    _write(out, shard_bytes=1_000_000)
    entries = list(LatentShardDataset(out).entries)
    files = [e["file"] for e in entries]
    k = next(i for i in range(1, len(files)) if files[i] == files[i - 1])   # the 2nd sample of a shard
    victim = entries[k]
    entries[k] = {**victim, "latents_key": "nope.latents"}
    write_index(out, entries)   # an index whose key is not in the shard
    ds = LatentShardDataset(out)   # opens: no shard is read
    other = files.index(next(f for f in files if f != victim["file"]))
    ds[other]
    same = k - 1
    with pytest.raises(DataError, match=rf"shard .*{victim['file']} has no tensor 'nope.latents' for sample "
                                        rf"'{victim['id']}' \(index .*index.arrow\)"):
        ds[same]   # the shard's first read checks all its samples
    with pytest.raises(DataError, match="has no tensor 'nope.latents'"):
        LatentShardDataset(out, verify="open")
    assert cli_main(["data", "check", str(out)]) == 2
    LatentShardDataset(out, verify="off")[other]


def test_arrow_index_errors_name_the_sample(tmp_path):
    out = tmp_path / "d"
    _write(out)
    entries = list(LatentShardDataset(out).entries)
    write_index(out, [{**e, "frames": 4} if i == 3 else e for i, e in enumerate(entries)])
    with pytest.raises(DataError, match=r"frames must be 4n\+1.*index.arrow: shape '4x\d+x\d+' of 1 sample\(s\), "
                                        r"the first sample 3 \(id '00003'\)"):
        LatentShardDataset(out)
    write_index(out, [{**e, "text_len": 600} if i == 4 else e for i, e in enumerate(entries)])
    with pytest.raises(DataError, match=r"index.arrow sample 4 \(id '00004'\): text_len must be an int in 1..512, "
                                        r"got 600"):
        LatentShardDataset(out)
    table = pa.ipc.open_file(str(out / "index.arrow")).read_all()
    header = json.loads(table.schema.metadata[b"ds_adaptive"])
    index_mod.write_table(out / "index.arrow", table.replace_schema_metadata(
        {b"ds_adaptive": json.dumps({**header, "latent_channels": 48}).encode()}))
    with pytest.raises(DataError, match="written for another model.*latent_channels 48 \\(expected 16\\)"):
        LatentShardDataset(out)
    pa.ipc.new_file(str(out / "x.arrow"), pa.schema([("a", pa.int32())])).close()
    (out / "x.arrow").replace(out / "index.arrow")
    with pytest.raises(DataError, match="metadata 'ds_adaptive' must be a JSON header"):
        LatentShardDataset(out)


def test_builder_keeps_keys_and_odd_meta(tmp_path):
    b = IndexBuilder()
    b.add_entries([{"id": "a", "frames": 1, "height": 64, "width": 64, "text_len": 3, "file": "s.safetensors",
                    "latents_key": "a.latents", "context_key": "a.context", "n": 1}])
    b.add_entries([{"id": "b", "frames": 1, "height": 64, "width": 64, "text_len": 3, "file": "s.safetensors",
                    "latents_key": "x", "context_key": "b.context", "n": 2.5, "tags": ["p", "q"]}])
    b.write(tmp_path)
    idx = LatentShardDataset(tmp_path).index
    assert idx.table.schema.names == ["id", "file", "shape", "text_len", "latents_key", "n", "tags"]
    assert idx.entry(0)["latents_key"] == "a.latents" and idx.entry(1)["latents_key"] == "x"
    assert idx.entry(0)["n"] == 1 and idx.entry(1)["n"] == 2.5 and idx.entry(1)["tags"] == ["p", "q"]
    assert "tags" not in idx.entry(0)
    with pytest.raises(DataError, match="extra key 'shape' is a column"):
        IndexBuilder().add_entries([{**idx.entry(0), "shape": 1}])


def test_pickled_dataset_maps_the_index_again(tmp_path):
    _write(tmp_path / "d")
    ds = LatentShardDataset(tmp_path / "d")
    blob = pickle.dumps(ds)
    assert len(blob) < 4000   # the path, not the table
    back = pickle.loads(blob)
    assert torch.equal(back[4]["latents"], ds[4]["latents"]) and back.sample_shapes() == ds.sample_shapes()
    _to_json(tmp_path / "d")
    assert pickle.loads(pickle.dumps(read_legacy_index(tmp_path / "d"))).entry(2) == ds.entries[2]
