"""A stand-in for a Wan pipeline and a few clips, to try the own-data workflow without downloading weights.

:func:`write_demo_pipeline` writes a tiny random pipeline in diffusers' Wan layout: ``vae/`` (AutoencoderKLWan,
16 latent channels, the 4x8x8 stride of Wan 2.1), ``text_encoder/`` (UMT5, 4096 wide like umT5-XXL, one layer),
``tokenizer/`` (a small Unigram vocabulary with T5's special tokens), ``transformer/`` (the ``tiny`` model's
weights in diffusers' layout, for ``--init-from``), ``scheduler/`` and ``model_index.json``, so that
``WanPipeline.from_pretrained`` loads it. :func:`write_demo_clips` writes short random-pattern clips and an image
with ``<stem>.txt`` captions. Nothing is trained: the outputs are noise, the workflow is real.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Union

import numpy as np

from ds_adaptive.models.registry import get_model

PathLike = Union[str, Path]

WORDS = "a the cat dog ball runs jumps rolls over red blue green sky grass video of in on with".split()
"""The tokenizer's words (anything else is spelled letter by letter)."""

CLIPS = (("ball", "a red ball rolls on the grass", 24, 8, 72, 128),
         ("dog", "a dog runs in the grass", 20, 8, 80, 144),
         ("sky", "the blue sky over the grass", 16, 8, 64, 112),
         ("cat", "a cat jumps over a ball", 28, 8, 72, 128))
"""(stem, caption, frames, fps, height, width) of the demo videos: 2-3.5 s at 8 fps, a little over 64x112."""


def write_demo_pipeline(root: PathLike, *, model: str = "tiny", seed: int = 0) -> Path:
    """The tiny random Wan-layout pipeline under ``root`` (see the module doc); returns ``root``."""
    from diffusers import UniPCMultistepScheduler

    root = write_demo_encoders(root, seed=seed)
    spec = get_model(model)
    net = spec.build(spec.config())
    spec.weights.save(net, root / "transformer", layout="diffusers")
    UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000,
                            flow_shift=5.0).save_pretrained(root / "scheduler")
    import diffusers

    (root / "model_index.json").write_text(json.dumps({
        "_class_name": "WanPipeline", "_diffusers_version": diffusers.__version__,
        "scheduler": ["diffusers", "UniPCMultistepScheduler"], "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"], "transformer": ["diffusers", "WanTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLWan"]}, indent=2) + "\n")
    return root


def write_demo_encoders(root: PathLike, *, seed: int = 0) -> Path:
    """``root/vae``, ``root/tokenizer`` and ``root/text_encoder`` of the stand-in pipeline (what ``preprocess`` and
    ``sample --text-encoder`` read); returns ``root``."""
    import torch
    from diffusers import AutoencoderKLWan

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                     temperal_downsample=[False, True, True]).save_pretrained(root / "vae")
    n_vocab = _write_tokenizer(root / "tokenizer")
    _write_text_encoder(root / "text_encoder", n_vocab)
    return root


def _write_tokenizer(path: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    vocab = ([("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [("▁" + w, -1.0) for w in WORDS]
             + [(ch, -5.0) for ch in "abcdefghijklmnopqrstuvwxyz&;"] + [("▁", -3.0)])
    tok = Tokenizer(models.Unigram(vocab, unk_id=2))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 1)])
    T5TokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
                    extra_ids=0).save_pretrained(path)
    return len(vocab)


def _write_text_encoder(path: Path, n_vocab: int) -> None:
    from transformers import UMT5Config, UMT5EncoderModel

    cfg = UMT5Config(vocab_size=n_vocab, d_model=4096, d_kv=8, d_ff=16, num_layers=1, num_heads=2,
                     relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", pad_token_id=0,
                     eos_token_id=1, decoder_start_token_id=0)
    UMT5EncoderModel(cfg).save_pretrained(path)


def write_video(path: PathLike, frames: int, fps: int, height: int, width: int, *, seed: int = 0) -> None:
    """A lossless H.264 mp4 (qp 0) of ``frames`` frames: a random block pattern moving one pixel per frame."""
    import av

    c = av.open(str(path), "w")
    s = c.add_stream("libx264", rate=fps, options={"qp": "0"})
    s.width, s.height, s.pix_fmt = width, height, "yuv420p"
    base = np.random.default_rng(seed).integers(0, 255, (height // 8, width // 8, 3)).repeat(8, 0).repeat(8, 1)
    for i in range(frames):
        img = np.ascontiguousarray(np.roll(base, i, axis=1).astype(np.uint8))
        for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
            c.mux(p)
    for p in s.encode():
        c.mux(p)
    c.close()


def write_demo_clips(root: PathLike, *, seed: int = 0) -> Path:
    """Four short videos and one image with ``<stem>.txt`` captions under ``root`` (a media folder
    ``ds-adaptive preprocess`` reads); returns ``root``."""
    from PIL import Image

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for i, (stem, caption, frames, fps, h, w) in enumerate(CLIPS):
        write_video(root / f"{stem}.mp4", frames, fps, h, w, seed=seed + i)
        (root / f"{stem}.txt").write_text(caption + "\n")
    img = np.random.default_rng(seed + len(CLIPS)).integers(0, 255, (72, 128, 3)).astype(np.uint8)
    Image.fromarray(img).save(root / "grass.png")
    (root / "grass.txt").write_text("green grass\n")
    return root


DEMO_POLICY = {"fps": 8, "frame_counts": [5], "video_sizes": ["64x112"], "image_sizes": ["64x112"],
               "long_clips": "truncate"}
"""The shape policy of the demo: one clip of 5 frames per video at 8 fps, 64x112 pixels (small for a CPU)."""


def write_demo(root: PathLike, *, seed: int = 0) -> dict:
    """``root/pipeline`` (:func:`write_demo_pipeline`), ``root/clips`` (:func:`write_demo_clips`) and
    ``root/policy.json`` (:data:`DEMO_POLICY`, for ``preprocess --policy``); returns their paths."""
    root = Path(root)
    out = {"pipeline": write_demo_pipeline(root / "pipeline", seed=seed),
           "clips": write_demo_clips(root / "clips", seed=seed), "policy": root / "policy.json"}
    out["policy"].write_text(json.dumps(DEMO_POLICY, indent=2) + "\n")
    return out
