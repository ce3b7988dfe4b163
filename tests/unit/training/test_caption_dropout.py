"""Guards caption dropout (ds_adaptive.models.objective, ds_adaptive.training.captions): its rate over an epoch is
within binomial error of the setting, the draws are a pure function of (seed, epoch, index), a dropped row becomes
the empty prompt zero-padded (or zeros), and the empty prompt comes with the dataset (synthetic, synth, shards)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from ds_adaptive.core.config import ConfigError
from ds_adaptive.core.features import CaptionDropoutConfig
from ds_adaptive.core.shapes import SampleShape, ShapeWeight
from ds_adaptive.data import EMPTY_PROMPT_FILE, LatentShardDataset, SyntheticLatentDataset, write_empty_prompt
from ds_adaptive.models.objective import caption_dropout_draws, drop_captions, first_frame_draws
from ds_adaptive.training.captions import CaptionDropout, empty_prompt_for

SHAPES = [ShapeWeight(SampleShape(1, 64, 64), 1.0)]


@pytest.mark.parametrize("rate", [0.05, 0.1, 0.5])
def test_the_rate_over_an_epoch_is_within_binomial_error(rate):
    n = 20000
    drawn = caption_dropout_draws(torch.arange(n), seed=3, epoch=1, rate=rate)
    k = int(drawn.sum())
    sigma = math.sqrt(n * rate * (1 - rate))
    assert abs(k - n * rate) <= 4 * sigma, (k, n * rate, sigma)
    other_epoch = caption_dropout_draws(torch.arange(n), seed=3, epoch=2, rate=rate)
    assert abs(int(other_epoch.sum()) - n * rate) <= 4 * sigma
    assert not torch.equal(drawn, other_epoch)            # a new epoch draws anew


def test_draws_are_per_sample_and_apart_from_other_streams():
    ids = torch.tensor([5, 17, 2, 99, 40, 41])
    a = caption_dropout_draws(ids, seed=1, epoch=0, rate=0.5)
    for j, i in enumerate(ids.tolist()):   # a sample's draw does not depend on its batch (resume, ranks, SP)
        assert bool(caption_dropout_draws([i], seed=1, epoch=0, rate=0.5)[0]) == bool(a[j])
    many = torch.arange(4000)
    cap = caption_dropout_draws(many, seed=1, epoch=0, rate=0.5)
    ff = first_frame_draws(many, seed=1, epoch=0, ratio=0.5)
    agree = float((cap == ff).double().mean())
    assert 0.45 < agree < 0.55, agree                     # independent of the first-frame stream


def test_dropped_rows_become_the_padded_empty_prompt_or_zeros():
    g = torch.Generator().manual_seed(0)
    ctx = torch.randn(3, 8, 6, generator=g)
    empty = torch.randn(2, 6, generator=g)
    dropped = torch.tensor([False, True, False])
    out = drop_captions(ctx, dropped, empty)
    assert torch.equal(out[0], ctx[0]) and torch.equal(out[2], ctx[2])
    assert torch.equal(out[1, :2], empty) and torch.equal(out[1, 2:], torch.zeros(6, 6))
    assert torch.equal(drop_captions(ctx, dropped, None)[1], torch.zeros(8, 6))
    assert drop_captions(ctx, torch.zeros(3, dtype=torch.bool), empty) is ctx
    with pytest.raises(ValueError, match="empty-prompt embedding must be"):
        drop_captions(ctx, dropped, torch.randn(9, 6))


def test_the_empty_prompt_comes_with_the_dataset(tmp_path):
    from ds_adaptive.cli.synth import main as synth_main

    ds = SyntheticLatentDataset(4, SHAPES, seed=0)
    e = ds.empty_context()
    assert e.shape == (1, ds.spec.text_dim) and torch.equal(e, SyntheticLatentDataset(9, SHAPES, seed=5).empty_context())
    assert synth_main(["--out", str(tmp_path / "d"), "--num-samples", "3"]) == 0
    shard = LatentShardDataset(tmp_path / "d")
    assert torch.equal(shard.empty_context(), SyntheticLatentDataset(3, seed=0).empty_context())
    (tmp_path / "d" / EMPTY_PROMPT_FILE).unlink()
    bare = LatentShardDataset(tmp_path / "d")
    assert bare.empty_context() is None
    cfg = CaptionDropoutConfig(rate=0.1)
    with pytest.raises(ConfigError, match=f"no {EMPTY_PROMPT_FILE}: rerun `ds-adaptive preprocess`"):
        empty_prompt_for(cfg, bare, bare.spec)
    assert empty_prompt_for(CaptionDropoutConfig(replace="zeros"), bare, bare.spec) is None
    write_empty_prompt(tmp_path, torch.ones(3, bare.spec.text_dim))
    own = empty_prompt_for(CaptionDropoutConfig(embedding=str(tmp_path / EMPTY_PROMPT_FILE)), bare, bare.spec)
    assert torch.equal(own, torch.ones(3, bare.spec.text_dim))
    write_empty_prompt(tmp_path / "d", torch.ones(3, 7))
    with pytest.raises(Exception, match=r"\[L <= 512, 4096\]"):
        LatentShardDataset(tmp_path / "d").empty_context()


def test_the_trainer_collaborator_counts_only_once_per_sp_group():
    cfg = CaptionDropoutConfig(rate=0.5)
    ctx = torch.randn(4, 8, 6)
    mine = CaptionDropout(cfg, torch.ones(1, 6), seed=2, count=True)
    other = CaptionDropout(cfg, torch.ones(1, 6), seed=2, count=False)
    a, b = mine.apply(ctx, torch.arange(4), 0), other.apply(ctx, torch.arange(4), 0)
    assert torch.equal(a, b)                               # the SP ranks of a group drop the same captions
    s = mine.summary(torch.device("cpu"))["caption_dropout"]
    assert s["samples"] == 4 and other.summary(torch.device("cpu"))["caption_dropout"]["samples"] == 0
    assert s["dropped"] == int(caption_dropout_draws(torch.arange(4), seed=2, epoch=0, rate=0.5).sum())
    run = SimpleNamespace(cfg=SimpleNamespace(adaptive_load=SimpleNamespace(caption_dropout=None)))
    assert CaptionDropout.attach(run) is None


def test_the_config_block_is_strict():
    from ds_adaptive.core.config import AdaptiveLoadConfig

    assert AdaptiveLoadConfig().caption_dropout is None
    assert AdaptiveLoadConfig.model_validate({"caption_dropout": {}}).caption_dropout.rate == 0.1
    for bad in ({"rate": 0.0}, {"rate": 1.5}, {"replace": "blank"}, {"rate": "0.1"}, {"rat": 0.1}):
        with pytest.raises(ValueError):
            AdaptiveLoadConfig.model_validate({"caption_dropout": bad})
