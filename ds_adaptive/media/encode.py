"""A model's encoders: its diffusers VAE for pixels, its transformers text encoder for captions.

The classes and expected shapes are the model's (``get_model(name)``: ``family.vae_class`` /
``text_encoder_class``, the grid rule's channels and stride, the text width and length); for the Wan
families that is ``AutoencoderKLWan`` (Wan 2.1's 16-channel 4x8x8 VAE, Wan 2.2's 48-channel 4x16x16 one)
and umT5-XXL. Both follow diffusers' Wan pipelines exactly (checked against them in
tests/unit/preprocess/test_preprocess.py):

* **Video/image -> latent** (``WanVideoToVideoPipeline.prepare_latents``): RGB uint8 ->
  ``x / 255 * 2 - 1`` in fp32, cast to the VAE dtype, ``[B, 3, T, H, W]``; the posterior's mode
  (its mean; Wan's own encoder returns ``mu`` too), in fp32, normalised per channel as
  ``(mu - latents_mean) * (1 / latents_std)`` with the per-channel values of the VAE config. The DiT is
  trained on these normalised latents (``x_0`` of flow matching).
* **Caption -> context** (``WanPipeline._get_t5_prompt_embeds``): ``prompt_clean`` (ftfy +
  html unescape + whitespace), tokenised to ``text_len`` = 512 tokens (padding ``max_length``,
  truncation, EOS added), ``UMT5EncoderModel(ids, mask).last_hidden_state`` cut to the prompt's
  length (EOS included). Wan zero-pads that to 512 before the DiT; we store the ``[L, 4096]``
  rows and ``collate_latents`` zero-pads at train time, which gives the same tensor.

Weights come only from local diffusers-format directories (``local_files_only``): never a download.
"""
from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from ds_adaptive.core.shapes import InputSpec, default_input_spec

PathLike = Union[str, Path]


class EncoderError(ValueError):
    """A model directory is missing or does not hold the model's expected component."""


def prompt_clean(text: str) -> str:
    """Caption cleaning (diffusers' ``prompt_clean``: ftfy, html unescape, whitespace)."""
    try:
        import ftfy
    except ImportError:  # pragma: no cover - the preprocess extra installs it
        raise EncoderError("caption cleaning needs ftfy (as diffusers' pipelines do): "
                           "pip install 'ds_adaptive[preprocess]'") from None
    text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
    return re.sub(r"\s+", " ", text).strip()


def _component_dir(path: Optional[PathLike], pipeline: Optional[PathLike], sub: str, flag: str) -> Path:
    if path is None and pipeline is None:
        raise EncoderError(f"no {sub} weights: pass {flag} DIR or --pipeline DIR (the model's diffusers pipeline "
                           f"directory with a {sub}/ folder)")
    d = Path(path) if path is not None else Path(pipeline) / sub
    src = flag if path is not None else f"--pipeline ({pipeline})"
    if not d.is_dir():
        raise EncoderError(f"{sub} directory {d} (from {src}) does not exist; weights are read from local "
                           "diffusers-format directories only (save_pretrained / a downloaded pipeline)")
    return d


def component_dirs(*, vae: Optional[PathLike] = None, text_encoder: Optional[PathLike] = None,
                   tokenizer: Optional[PathLike] = None, pipeline: Optional[PathLike] = None) -> tuple[Path, Path, Path]:
    """The VAE, text-encoder and tokenizer directories :meth:`LatentEncoders.from_pretrained` reads (each flag, else
    the pipeline's folder); :class:`EncoderError` names the first that is missing. Reads nothing else."""
    return (_component_dir(vae, pipeline, "vae", "--vae"),
            _component_dir(text_encoder, pipeline, "text_encoder", "--text-encoder"),
            _component_dir(tokenizer, pipeline, "tokenizer", "--tokenizer"))


def check_vae(vae, spec: InputSpec) -> None:
    """The VAE's latent channels and compression against the model's grid rule (its config's ``z_dim``,
    ``scale_factor_temporal`` / ``_spatial``, as diffusers' VAEs name them)."""
    grid, what = spec.grid, spec.describe()
    z = getattr(vae.config, "z_dim", None)
    if z != grid.latent_channels:
        raise EncoderError(f"the VAE has z_dim {z}; {what} needs {grid.latent_channels} latent channels: pass the "
                           "model's VAE (--vae / --pipeline) or the model of this VAE (--model)")
    t, s = getattr(vae.config, "scale_factor_temporal", None), getattr(vae.config, "scale_factor_spatial", None)
    if t is not None and s is not None and (t, s, s) != tuple(grid.vae_stride):
        raise EncoderError(f"the VAE compresses {t}x{s}x{s}; {what} needs {'x'.join(map(str, grid.vae_stride))}")


def check_text_encoder(text_encoder, spec: InputSpec) -> None:
    """The text encoder's width (``d_model``) against the model's text width."""
    d = getattr(text_encoder.config, "d_model", None)
    if d != spec.text_dim:
        raise EncoderError(f"the text encoder has d_model {d}; {spec.describe()} needs {spec.text_dim}")


def _from_pretrained(library: str, class_name: str, path: PathLike, what: str, **kwargs):
    """``library.class_name.from_pretrained(path, local_files_only=True, **kwargs)``; one EncoderError naming
    ``what`` and the directory otherwise."""
    import importlib

    try:
        cls = getattr(importlib.import_module(library), class_name)
    except ImportError:
        raise EncoderError(f"{what} needs the {library} package: pip install 'ds_adaptive[preprocess]'") from None
    p = Path(path)
    if not p.is_dir():
        raise EncoderError(f"{what}: {p} is not a directory (a diffusers-format {class_name}, e.g. a pipeline's "
                           "folder)")
    try:
        return cls.from_pretrained(str(p), local_files_only=True, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise EncoderError(f"{what}: cannot load {class_name} from {p}: {exc}") from None


def load_vae(model, path: PathLike, *, dtype: torch.dtype = torch.float32, what: str = "--vae"):
    """The VAE of ``model`` (a :class:`ds_adaptive.models.family.Model`: its family's diffusers ``vae_class``)
    from a local directory, in ``dtype`` on the CPU, eval mode, checked against the model's grid rule
    (:func:`check_vae`); errors name ``what`` (the flag or config key)."""
    vae = _from_pretrained("diffusers", model.family.vae_class, path, what, torch_dtype=dtype).eval()
    try:
        check_vae(vae, model.input_spec)
    except EncoderError as exc:
        raise EncoderError(f"{what} {path}: {exc}") from None
    return vae


def load_text_encoder(model, path: PathLike, *, dtype: torch.dtype = torch.float32, what: str = "--text-encoder"):
    """The text encoder of ``model`` (its family's transformers ``text_encoder_class``) from a local directory,
    in ``dtype``, eval mode, checked against the model's text width."""
    te = _from_pretrained("transformers", model.family.text_encoder_class, path, what, dtype=dtype)
    try:
        check_text_encoder(te, model.input_spec)
    except EncoderError as exc:
        raise EncoderError(f"{what} {path}: {exc}") from None
    return te.to(dtype).eval()


def load_tokenizer(path: PathLike, *, what: str = "--tokenizer"):
    """``AutoTokenizer`` from a local directory; errors name ``what``."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise EncoderError(f"{what}: cannot load the tokenizer from {path}: {exc}") from None


class LatentEncoders:
    """The VAE, the text encoder and the tokenizer of a model, on one device.

    Args:
        vae: the model's diffusers VAE (``AutoencoderKLWan``: z_dim = the grid rule's channels).
        text_encoder: its text encoder (``UMT5EncoderModel``, d_model = the model's text width).
        tokenizer: its tokenizer. device: where both models run.
        vae_tiling: ``"auto"`` tiles clips with more than ``tile_above`` pixels per frame (diffusers'
            spatial tiling), ``"on"`` always, ``"off"`` never.
        text_len: tokens per caption (default and maximum: the model's, 512 for Wan).
        spec: the model's inputs (default: the default model's); the components are checked against it.
    """

    def __init__(self, vae, text_encoder, tokenizer, *, device: Union[str, torch.device] = "cpu",
                 vae_tiling: str = "auto", tile_above: int = 720 * 1280, text_len: Optional[int] = None,
                 spec: Optional[InputSpec] = None) -> None:
        self.spec = spec or default_input_spec()
        check_vae(vae, self.spec)
        check_text_encoder(text_encoder, self.spec)
        text_len = self.spec.text_len if text_len is None else int(text_len)
        if vae_tiling not in ("auto", "on", "off"):
            raise EncoderError(f"vae_tiling must be auto, on or off, got {vae_tiling!r}")
        if not 1 <= text_len <= self.spec.text_len:
            raise EncoderError(f"text_len must be in 1..{self.spec.text_len}, got {text_len}")
        self.device = torch.device(device)
        self.vae = vae.to(self.device).eval().requires_grad_(False)
        self.text_encoder = text_encoder.to(self.device).eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.vae_tiling, self.tile_above, self.text_len = vae_tiling, int(tile_above), int(text_len)
        cfg, c = vae.config, self.spec.grid.latent_channels
        self._mean = torch.tensor(cfg.latents_mean, dtype=torch.float32).view(1, c, 1, 1, 1)
        self._inv_std = 1.0 / torch.tensor(cfg.latents_std, dtype=torch.float32).view(1, c, 1, 1, 1)

    @property
    def vae_dtype(self) -> torch.dtype:
        return next(self.vae.parameters()).dtype

    @property
    def text_dtype(self) -> torch.dtype:
        return next(self.text_encoder.parameters()).dtype

    @classmethod
    def from_pretrained(cls, model, *, vae: Optional[PathLike] = None, text_encoder: Optional[PathLike] = None,
                        tokenizer: Optional[PathLike] = None, pipeline: Optional[PathLike] = None,
                        device: Union[str, torch.device] = "cpu", dtype: torch.dtype = torch.float32,
                        **kwargs) -> "LatentEncoders":
        """Load the three components of ``model`` (a :class:`ds_adaptive.models.family.Model`: its family's
        VAE and text-encoder classes) from local directories (``--vae`` / ``--text-encoder`` /
        ``--tokenizer``, each defaulting to the ``vae/``, ``text_encoder/``, ``tokenizer/`` folder of
        ``--pipeline``), in ``dtype`` on ``device``."""
        vae_dir = _component_dir(vae, pipeline, "vae", "--vae")
        te_dir = _component_dir(text_encoder, pipeline, "text_encoder", "--text-encoder")
        tok_dir = _component_dir(tokenizer, pipeline, "tokenizer", "--tokenizer")
        vae_m = _from_pretrained("diffusers", model.family.vae_class, vae_dir, "--vae", torch_dtype=dtype)
        te = _from_pretrained("transformers", model.family.text_encoder_class, te_dir, "--text-encoder", dtype=dtype)
        return cls(vae_m, te.to(dtype), load_tokenizer(tok_dir), device=device, spec=model.input_spec, **kwargs)

    def _tiling_for(self, height: int, width: int) -> bool:
        return self.vae_tiling == "on" or (self.vae_tiling == "auto" and height * width > self.tile_above)

    @torch.no_grad()
    def encode_video(self, frames: torch.Tensor) -> torch.Tensor:
        """uint8 ``[B, T, H, W, 3]`` (a shape of the model's grid rule) -> fp32 normalised latents
        ``[B, C, (T-1)/t+1, H/s, W/s]`` on the CPU."""
        if frames.dtype != torch.uint8 or frames.dim() != 5 or frames.shape[-1] != 3:
            raise ValueError(f"frames must be uint8 [B, T, H, W, 3], got {frames.dtype} {tuple(frames.shape)}")
        x = frames.to(self.device, non_blocking=True).permute(0, 4, 1, 2, 3).float()
        x = (x / 255.0 * 2.0 - 1.0).to(self.vae_dtype)
        tiled = self._tiling_for(x.shape[3], x.shape[4])
        self.vae.use_tiling = tiled
        mu = self.vae.encode(x).latent_dist.mode().float()
        return ((mu - self._mean.to(mu.device)) * self._inv_std.to(mu.device)).cpu()

    def encode_text(self, captions: Sequence[str]) -> list[torch.Tensor]:
        """Captions -> one ``[L_i, text_dim]`` tensor each (text-encoder dtype, CPU), L_i = prompt tokens + EOS."""
        return encode_captions(self.text_encoder, self.tokenizer, captions, text_len=self.text_len, device=self.device)


@torch.no_grad()
def encode_captions(text_encoder, tokenizer, captions: Sequence[str], *, text_len: int,
                    device: Union[str, torch.device] = "cpu") -> list[torch.Tensor]:
    """Text-encoder embeddings of ``captions`` as diffusers' Wan pipelines compute them (``_get_t5_prompt_embeds``):
    one ``[L_i, text_dim]`` tensor each (text-encoder dtype, CPU), L_i = prompt tokens + EOS, at most ``text_len``
    (the model's); ``ds-adaptive sample`` uses it without a VAE."""
    if not captions:
        return []
    tok = tokenizer([prompt_clean(c) for c in captions], padding="max_length", max_length=text_len,
                    truncation=True, add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
    ids, mask = tok.input_ids.to(device), tok.attention_mask.to(device)
    hidden = text_encoder(ids, mask).last_hidden_state
    lens = mask.gt(0).sum(dim=1).tolist()
    return [hidden[i, : max(1, n)].cpu() for i, n in enumerate(lens)]
