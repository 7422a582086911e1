"""The real Wan VAE as a codec: diffusers ``AutoencoderKLWan``, causal, chunk by chunk per stream.

The Wan VAE is causal in time: latent frame 0 of a video is encoded from camera frame 0 alone,
latent frame i >= 1 from frames 4i-3 .. 4i, and its 3-D convolutions carry a cache of the
previous frames' features. diffusers' own ``encode``/``decode`` run that loop over a whole
video; here the same loop runs one chunk at a time with the cache kept per stream, so a
stream's latents and frames equal what the whole-video calls give (tested against them).

Per stream:
  encode  the observed chunks, in the order they arrive; the encoder's first latent frame
          takes one camera frame, so the stream's first observed chunk uses its newest
          1 + 4 (T-1) frames (the 3 oldest are dropped), later chunks 4 T frames.
  decode  every chunk of the stream in chunk order: a generated chunk is decoded after the
          chunks before it, observed ones included (their encoded latents are decoded first,
          output discarded), so its causal cache holds the stream's real history. Chunk 0
          gives 1 + 4 (T-1) frames, later chunks 4 T.
Latents are normalised as the Wan pipelines do: (mu - latents_mean) / latents_std, with mu the
posterior mean (no sampling).

Needs the optional ``diffusers`` package (the workstation's ``models`` extra).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from physis_ros.engine.config import ModelConfig
from physis_ros.engine.frames import check_frames
from physis_ros.engine.weight_files import partial_load_problem

TEMPORAL_GROUP = 4
"""Camera frames per latent frame after the first (diffusers' loop is written for 4)."""
MAX_PENDING_CONTEXT = 8
"""Observed chunks a stream's decoder may lag behind before it catches up at once."""


@dataclass(frozen=True)
class VAEConfig:
    z_dim: int
    stride: tuple[int, int, int]
    """Camera -> latent stride (t, h, w)."""


def read_vae_config(path: str | Path) -> VAEConfig:
    """z_dim and strides of a diffusers AutoencoderKLWan directory (config.json only)."""
    path = Path(path)
    if (path / "vae" / "config.json").exists() and not (path / "config.json").exists():
        path = path / "vae"
    try:
        c = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise ValueError(f"VAE {path}: no config.json (a diffusers AutoencoderKLWan dir)") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"VAE {path}/config.json: not JSON: {err}") from err
    if c.get("_class_name", "AutoencoderKLWan") != "AutoencoderKLWan":
        raise ValueError(f"VAE {path}: class {c['_class_name']!r} is not AutoencoderKLWan")
    downs = c.get("temperal_downsample", [False, True, True])
    mults = c.get("dim_mult", [1, 2, 4, 4])
    t = 2 ** sum(bool(d) for d in downs)
    s = 2 ** (len(mults) - 1) * int(c.get("patch_size") or 1)
    # (config.scale_factor_* are not read: diffusers writes its defaults there whatever the
    # layers are; the strides follow from the layers)
    if t != TEMPORAL_GROUP:
        raise ValueError(f"VAE {path}: temporal stride {t}; the Wan VAE loop needs 4")
    return VAEConfig(z_dim=int(c.get("z_dim", 16)), stride=(t, s, s))


@dataclass
class _StreamCaches:
    enc: list | None = None
    """The encoder's feature cache (None: no chunk encoded yet)."""
    dec: list | None = None
    next_chunk: int = 0
    """The next chunk the decoder cache expects."""
    context: dict[int, torch.Tensor] = field(default_factory=dict)
    """Encoded observed chunks the decoder has not passed yet: chunk -> raw latent."""


class WanVAECodec:
    """Image <-> latent through a Wan VAE, one causal cache per stream (see the module)."""

    causal = True

    def __init__(self, cfg: ModelConfig, *, device: str | torch.device = "cpu") -> None:
        try:
            from diffusers import AutoencoderKLWan  # optional (the models extra), and heavy
        except ImportError as err:
            raise ValueError(
                "codec wan_vae needs diffusers (pip install 'physis_ros[models]')"
            ) from err
        vc = read_vae_config(cfg.vae_path)
        if vc.z_dim != cfg.in_channels:
            raise ValueError(
                f"VAE {cfg.vae_path} has {vc.z_dim} latent channels, model {cfg.name} has "
                f"{cfg.in_channels}"
            )
        if vc.stride != tuple(cfg.codec_stride):
            raise ValueError(f"VAE stride {vc.stride} != model codec_stride {cfg.codec_stride}")
        path = Path(cfg.vae_path)
        if (path / "vae").is_dir() and not (path / "config.json").exists():
            path = path / "vae"
        self.cfg = cfg
        self.device = torch.device(device)
        self.vae, loading = AutoencoderKLWan.from_pretrained(
            str(path),
            torch_dtype=torch.float32,
            use_safetensors=True,
            low_cpu_mem_usage=False,
            output_loading_info=True,
        )
        if problem := partial_load_problem(f"VAE {path}", loading):
            raise ValueError(problem)
        self.vae.to(self.device).eval()
        conf = self.vae.config
        shape = (cfg.in_channels, 1, 1, 1)
        self.mean = torch.tensor(conf.latents_mean, dtype=torch.float32).view(shape).to(device)
        self.std = torch.tensor(conf.latents_std, dtype=torch.float32).view(shape).to(device)
        self.patch = conf.patch_size
        self._convs = dict(self.vae._cached_conv_counts)
        self._streams: dict[int, _StreamCaches] = {}
        self._lock = threading.Lock()
        """Guards the per-stream state between the encoding and the decoding threads."""

    @property
    def frames(self) -> int:
        return self.cfg.frames_per_chunk

    def check_frames(self, frames: np.ndarray) -> np.ndarray:
        return check_frames(self.cfg, frames)

    def close(self, stream_id: int) -> None:
        with self._lock:
            self._streams.pop(stream_id, None)

    # ---- encode -----------------------------------------------------------------------------
    @torch.inference_mode()
    def encode(self, frames: np.ndarray, *, stream_id: int = 0) -> torch.Tensor:
        """[F, H, W, 3] uint8 -> latent [C, T, h, w] (normalised), advancing the stream's
        encoder cache (one caller per stream at a time)."""
        frames = self.check_frames(frames)
        with self._lock:
            st = self._streams.setdefault(stream_id, _StreamCaches())
        x = torch.from_numpy(frames).to(self.device).float() / 127.5 - 1.0
        x = x.permute(3, 0, 1, 2)[None]  # [1, 3, F, H, W]
        if st.enc is None:  # the stream's first latent frame is one camera frame
            x = x[:, :, TEMPORAL_GROUP - 1 :]
        return (self.encode_raw(x, st) - self.mean) / self.std

    @torch.inference_mode()
    def observed(self, stream_id: int, chunk: int, latent: torch.Tensor) -> None:
        """The encoded observation became chunk ``chunk``: the decoder passes it on its way."""
        with self._lock:
            st = self._streams.setdefault(stream_id, _StreamCaches())
            if chunk >= st.next_chunk:
                st.context[chunk] = latent
                if len(st.context) > MAX_PENDING_CONTEXT:
                    self._catch_up(st, max(st.context) + 1)

    def encode_raw(self, x: torch.Tensor, st: _StreamCaches) -> torch.Tensor:
        """[1, 3, F, H, W] in [-1, 1] -> the posterior mean [C, T, h, w], diffusers' loop."""
        from diffusers.models.autoencoders.autoencoder_kl_wan import patchify  # optional dep

        vae = self.vae
        if self.patch is not None:
            x = patchify(x, patch_size=self.patch)
        first = st.enc is None
        if first:
            st.enc = [None] * self._convs["encoder"]
            groups = [x[:, :, :1], *x[:, :, 1:].split(TEMPORAL_GROUP, dim=2)]
        else:
            groups = list(x.split(TEMPORAL_GROUP, dim=2))
        out = [vae.encoder(g, feat_cache=st.enc, feat_idx=[0]) for g in groups if g.shape[2]]
        h = vae.quant_conv(torch.cat(out, 2))
        return h[0, : self.cfg.in_channels]  # the mean half of (mu, logvar)

    # ---- decode -----------------------------------------------------------------------------
    def decode(self, latent: torch.Tensor, *, stream_id: int = 0, chunk: int = 0) -> np.ndarray:
        """latent [C, T, h, w] (normalised) -> [F, H, W, 3] uint8 (see ``decode_float``)."""
        x = self.decode_float(latent, stream_id=stream_id, chunk=chunk)
        return ((x + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8).cpu().numpy()

    @torch.inference_mode()
    def decode_float(
        self, latent: torch.Tensor, *, stream_id: int = 0, chunk: int = 0
    ) -> torch.Tensor:
        """latent [C, T, h, w] (normalised) -> frames [F, H, W, 3] in [-1, 1], after the
        stream's earlier chunks (observed ones decoded first for the cache, output dropped)."""
        with self._lock:
            st = self._streams.setdefault(stream_id, _StreamCaches())
            self._catch_up(st, chunk)
            video = self._decode_latent(latent, st)
            st.next_chunk = chunk + 1
        return video[0].permute(1, 2, 3, 0)

    def _decode_latent(self, latent: torch.Tensor, st: _StreamCaches) -> torch.Tensor:
        """Normalised latent [C, T, h, w] -> video [1, 3, F, H, W] in [-1, 1], diffusers' loop."""
        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify  # optional dep

        vae = self.vae
        first = st.dec is None
        if first:
            st.dec = [None] * self._convs["decoder"]
        z = latent.to(self.device, torch.float32) * self.std + self.mean
        x = vae.post_quant_conv(z[None])
        out = [
            vae.decoder(
                x[:, :, i : i + 1], feat_cache=st.dec, feat_idx=[0], first_chunk=first and i == 0
            )
            for i in range(x.shape[2])
        ]
        video = torch.cat(out, 2)
        if self.patch is not None:
            video = unpatchify(video, patch_size=self.patch)
        return video.clamp(-1.0, 1.0)

    def _catch_up(self, st: _StreamCaches, chunk: int) -> None:
        """Pass the decoder over the observed chunks before ``chunk`` it has not seen."""
        for c in sorted(k for k in st.context if k < chunk):
            if c >= st.next_chunk:
                self._decode_latent(st.context[c], st)
                st.next_chunk = c + 1
            del st.context[c]
