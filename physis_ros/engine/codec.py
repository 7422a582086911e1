"""Codecs between camera frames (uint8 [F, H, W, 3]) and a chunk's latent [C, T, h, w].

``pixel`` (tiny, small): exact space-to-depth of the [-1, 1]-scaled image; decode(encode(f))
== f bit for bit. ``vae_standin`` (Wan presets): the Wan VAE's shapes and strides (temporal x4,
spatial x8 or x16, 16 or 48 channels) as strided space-to-depth plus a fixed random projection,
so that benchmarks can time a codec of the right shapes apart from the DiT. It is not a VAE:
its images mean nothing. ``wan_vae``: the real Wan VAE through diffusers, causal per stream
(``physis_ros.engine.vae``). ``make_codec`` picks the one a config names; every codec takes
``stream_id`` (and ``chunk`` to decode; the stateless ones ignore them), hears which chunk an
encoded observation became (``observed``) and forgets a stream on ``close``.
"""

from __future__ import annotations

import numpy as np
import torch

from physis_ros.engine.config import ModelConfig
from physis_ros.engine.frames import check_frames
from physis_ros.engine.vae import WanVAECodec


class Codec:
    """Image <-> latent for one model config."""

    causal = False
    """Decoding a chunk depends on the chunks the stream decoded before (the Wan VAE)."""

    def __init__(
        self, cfg: ModelConfig, *, device: str | torch.device = "cpu", seed: int = 0
    ) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        st, sh, sw = cfg.codec_stride
        self.block = 3 * st * sh * sw
        """Values of one space-to-depth cell."""
        if cfg.codec == "pixel":
            if self.block != cfg.in_channels:
                raise ValueError(
                    f"codec pixel with stride {cfg.codec_stride} gives 3 x {st * sh * sw} = "
                    f"{self.block} latent channels, model {cfg.name} has {cfg.in_channels}: "
                    "use its VAE (--vae DIR) or vae_standin (shapes only)"
                )
            self.proj = None
        else:
            gen = torch.Generator().manual_seed(seed)
            proj = torch.randn(self.block, cfg.in_channels, generator=gen) / self.block**0.5
            self.proj = proj.to(self.device)
            self.unproj = torch.linalg.pinv(proj).to(self.device)

    @property
    def frames(self) -> int:
        return self.cfg.frames_per_chunk

    def check_frames(self, frames: np.ndarray) -> np.ndarray:
        return check_frames(self.cfg, frames)

    def close(self, stream_id: int) -> None:
        """Nothing to forget: this codec keeps no state per stream."""

    def observed(self, stream_id: int, chunk: int, latent: torch.Tensor) -> None:
        """Nothing to remember: decoding does not depend on a stream's history."""

    def encode(self, frames: np.ndarray, *, stream_id: int = 0) -> torch.Tensor:
        """[F, H, W, 3] uint8 -> latent [C, T, h, w] float32 on the codec's device."""
        return self.encode_frames(self.check_frames(frames))

    def encode_frames(self, frames: np.ndarray) -> torch.Tensor:
        """Any number of frames (a multiple of the temporal stride), [N, H, W, 3] uint8 ->
        [C, N / stride, h, w]: a whole episode at once."""
        cfg = self.cfg
        st, sh, sw = cfg.codec_stride
        x = torch.from_numpy(frames).to(self.device).float() / 127.5 - 1.0  # [F, H, W, 3]
        f, hh, ww, _ = x.shape
        x = x.reshape(f // st, st, hh // sh, sh, ww // sw, sw, 3)
        x = x.permute(0, 2, 4, 6, 1, 3, 5).reshape(f // st, hh // sh, ww // sw, self.block)
        if self.proj is not None:
            x = x @ self.proj
        return x.permute(3, 0, 1, 2).contiguous()

    def decode(self, latent: torch.Tensor, *, stream_id: int = 0, chunk: int = 0) -> np.ndarray:
        """latent [C, T, h, w] -> [F, H, W, 3] uint8."""
        cfg = self.cfg
        st, sh, sw = cfg.codec_stride
        x = latent.to(self.device, torch.float32).permute(1, 2, 3, 0)  # [T, h, w, C]
        if self.proj is not None:
            x = x @ self.unproj
        t, hh, ww, _ = x.shape
        x = x.reshape(t, hh, ww, 3, st, sh, sw).permute(0, 4, 1, 5, 2, 6, 3)
        x = x.reshape(t * st, hh * sh, ww * sw, 3)
        return ((x + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8).cpu().numpy()


def make_codec(cfg: ModelConfig, *, device: str | torch.device = "cpu"):
    """The codec ``cfg.codec`` names, checked against the model's latent channels (the
    latent grid's fit to the patch is checked by ModelConfig)."""
    if cfg.codec == "wan_vae":
        return WanVAECodec(cfg, device=device)
    return Codec(cfg, device=device)


def check_stream_codec(spec, codec) -> None:
    """Previews and rollouts need a codec that decodes each chunk on its own: through a
    causal codec a preview, or a slot decoded a second time, would enter the stream's
    decoder history."""
    for wanted, what in ((spec.previews, "previews"), (spec.rollouts, "rollouts")):
        if wanted and codec.causal:
            raise ValueError(
                f"{what} need a codec that decodes each chunk on its own; "
                f"{type(codec).__name__} is causal per stream"
            )
