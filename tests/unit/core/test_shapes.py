"""Guards shape arithmetic (pixels -> latent -> tokens by a model's grid rule) and the shape-distribution files."""
from __future__ import annotations

import json

import numpy as np

import pytest

from ds_adaptive.models.registry import default_model, get_model
from ds_adaptive.core.shapes import (GridRule, IndexedShapes, SampleShape, ShapeError, latent_to_token_grid, load_shape_distribution,
                                num_tokens, pad_to_multiple, parse_shape_distribution)


@pytest.mark.parametrize("frames, height, width, latent, tokens", [
    (81, 480, 832, (16, 21, 60, 104), 32760),
    (81, 720, 1280, (16, 21, 90, 160), 75600),
    (1, 480, 832, (16, 1, 60, 104), 1560),
    (1, 720, 1280, (16, 1, 90, 160), 3600),
    (1, 1024, 1024, (16, 1, 128, 128), 4096),
    (17, 480, 832, (16, 5, 60, 104), 7800),
])
def test_tokens_and_latent_shape(frames, height, width, latent, tokens):
    s = SampleShape(frames, height, width)
    assert s.latent_shape == latent
    assert s.tokens == tokens == num_tokens(frames, height, width)
    assert s.is_image == (frames == 1)
    assert str(s) == f"{frames}x{height}x{width}"


@pytest.mark.parametrize("frames, height, width, match", [
    (80, 480, 832, "frames must be 4n\\+1.*got 80; use 77 or 81"),
    (81, 470, 832, "height must be a multiple of 16.*got 470; resize or crop to 464 or 480"),
    (81, 480, 830, "width must be a multiple of 16"),
    (0, 480, 832, "frames must be >= 1"),
    (1, -16, 832, "height must be >= 1"),
    (1.0, 480, 832, "frames must be an int"),
    (True, 480, 832, "frames must be an int"),
])
def test_invalid_shapes_are_errors(frames, height, width, match):
    with pytest.raises(ShapeError, match=match):
        SampleShape(frames, height, width)


def test_padding_for_sequence_parallelism():
    s = SampleShape(81, 480, 832)
    assert s.padded_tokens(1) == 32760 and s.padded_tokens(8) == 32760
    assert s.padded_tokens(7) == 32760 + (-32760 % 7)
    assert pad_to_multiple(1561, 4) == 1564
    with pytest.raises(ValueError, match="must be >= 1"):
        pad_to_multiple(10, 0)


def test_latent_to_token_grid():
    assert latent_to_token_grid((21, 60, 104)) == (21, 30, 52)
    with pytest.raises(ShapeError, match="not divisible by the patch"):
        latent_to_token_grid((21, 61, 104))


def test_default_distribution_is_the_documented_mix():
    dist = load_shape_distribution()
    shapes = {w.shape for w in dist}
    images = {(s.height, s.width) for s in shapes if s.is_image}
    assert images == {(480, 832), (832, 480), (1024, 1024), (720, 1280)}
    videos = [s for s in shapes if not s.is_image]
    assert {s.frames for s in videos} >= {17, 81} and min(s.frames for s in videos) == 17
    assert max(s.frames for s in videos) == 81
    assert {min(s.height, s.width) for s in videos} == {480, 720}
    total = sum(w.weight for w in dist)
    image_share = sum(w.weight for w in dist if w.shape.is_image) / total
    assert 0.4 < image_share < 0.7
    assert get_model(default_model()).shapes.is_file()


@pytest.mark.parametrize("entries, match", [
    ([], "is empty"),
    ([{"frames": 1, "height": 480}], r"entry 0: missing key\(s\) \['width'\]"),
    ([{"frames": 1, "height": 480, "width": 832, "fps": 8}], r"entry 0: unknown key\(s\) \['fps'\]"),
    ([{"frames": 1, "height": 480, "width": 832, "weight": 0}], "entry 0: weight must be a number > 0"),
    ([{"frames": 1, "height": 480, "width": 832}, {"frames": 2, "height": 480, "width": 832}],
     r"frames must be 4n\+1 .*\(test.json entry 1\), got 2"),
    (["81x480x832"], "entry 0: expected an object"),
])
def test_bad_distribution_entries_name_the_entry(entries, match):
    with pytest.raises(ShapeError, match=match):
        parse_shape_distribution(entries, source="test.json")


def test_distribution_files(tmp_path):
    good = tmp_path / "s.json"
    good.write_text(json.dumps([{"frames": 5, "height": 64, "width": 64, "weight": 2}]))
    (w,) = load_shape_distribution(good)
    assert w.shape == SampleShape(5, 64, 64) and w.weight == 2.0
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_shape_distribution(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("[{")
    with pytest.raises(ShapeError, match="not valid JSON"):
        load_shape_distribution(bad)


# A 4x16x16 VAE with 48 channels and a 1x2x2 patch (Wan 2.2 TI2V-5B's grid), and a made-up 2x4x4 / 2x1x1 one
WIDE = GridRule((4, 16, 16), (1, 2, 2), 48, vae="wide VAE")
ODD = GridRule((2, 4, 4), (2, 1, 1), 8)


@pytest.mark.parametrize("grid, shape, latent, tokens", [
    (WIDE, (121, 704, 1280), (48, 31, 44, 80), 27280),
    (WIDE, (81, 480, 832), (48, 21, 30, 52), 8190),
    (WIDE, (1, 704, 1280), (48, 1, 44, 80), 880),
    (ODD, (5, 12, 8), (8, 3, 3, 2), 0),     # T' = 3 is not divisible by the time patch 2
    (ODD, (7, 12, 8), (8, 4, 3, 2), 12),
])
def test_other_grid_rules(grid, shape, latent, tokens):
    if not tokens:
        with pytest.raises(ShapeError, match="3 latent frames, not a multiple of the time patch 2"):
            SampleShape(*shape, grid)
        return
    s = SampleShape(*shape, grid)
    assert s.latent_shape == latent and s.tokens == tokens == num_tokens(*shape, grid)
    assert str(s) == "x".join(map(str, shape))


def test_a_shape_under_another_rule_names_the_rule():
    assert SampleShape(81, 480, 832, WIDE) != SampleShape(81, 480, 832)  # the rule is part of the shape
    with pytest.raises(ShapeError, match=r"height must be a multiple of 32 \(wide VAE 4x16x16 \(48 channels\), "
                                         r"patch 1x2x2\), got 720; resize or crop to 704 or 736"):
        SampleShape(81, 720, 1280).with_grid(WIDE)
    with pytest.raises(ShapeError, match="entry 3"):   # 720x1280 of the default mix does not fit WIDE
        load_shape_distribution(get_model(default_model()).shapes, grid=WIDE)


def test_indexed_shapes_are_a_sequence_of_the_samples_shapes():
    a, b, c = SampleShape(1, 64, 96), SampleShape(5, 64, 96), SampleShape(9, 64, 96)
    x = IndexedShapes([a, b, c], np.array([2, 0, 2, 1], np.int32))
    assert len(x) == 4 and list(x) == [c, a, c, b] and x[3] == b and x == [c, a, c, b] and x != [c, a, c]
    part = x[1:3]   # a slice holds only its own shapes
    assert part.unique == [a, c] and list(part) == [a, c] and part.ids.tolist() == [0, 1]
    for unique, ids, match in (([b, a], [0], "sorted"), ([a, a], [0], "distinct"), ([a], [1], r"\[0, 1\)"),
                               ([a], [[0]], "1-d"), ([a], [0.5], "int")):
        with pytest.raises(ValueError, match=match):
            IndexedShapes(unique, np.array(ids))
