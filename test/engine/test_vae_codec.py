"""The Wan VAE codec (diffusers AutoencoderKLWan, random tiny config): chunk-by-chunk encode and
decode per stream equal diffusers' own whole-video encode and decode."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from wan_fixtures import TINY_VAE, TINY_VAE22, make_vae

from physis_ros.engine.checkpoints import resolve_model
from physis_ros.engine.codec import make_codec
from physis_ros.engine.config import get_preset
from physis_ros.engine.vae import read_vae_config

T = 2
"""Latent frames per chunk: chunk 0 covers 1 + 4 camera frames, later chunks 8."""


@pytest.fixture(scope="module", params=["wan2.1", "wan2.2"])
def vae_setup(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("vae")
    vae = make_vae(root, config=TINY_VAE if request.param == "wan2.1" else TINY_VAE22)
    stride = read_vae_config(root / "vae").stride
    cfg = get_preset(
        "tiny",
        in_channels=4,
        action_mode="none",
        action_dim=0,
        action_horizon=0,
        codec="wan_vae",
        vae_path=str(root / "vae"),
        codec_stride=stride,
        latent_height=32 // stride[1],
        latent_width=32 // stride[2],
        latent_frames=T,
    )
    return vae, cfg, root


def _video(frames: int, seed: int, size: int = 32) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (1, size, size, 3))
    drift = rng.integers(-20, 21, (frames, size, size, 3))
    return np.clip(base + np.cumsum(drift, 0), 0, 255).astype(np.uint8)


def _norm(vae, z: torch.Tensor) -> torch.Tensor:
    c = vae.config
    mean = torch.tensor(c.latents_mean).view(-1, 1, 1, 1)
    std = torch.tensor(c.latents_std).view(-1, 1, 1, 1)
    return (z - mean) / std


def test_vae_config_strides(vae_setup):
    _, cfg, root = vae_setup
    vc = read_vae_config(root / "vae")
    assert vc.z_dim == 4 and vc.stride in ((4, 4, 4), (4, 8, 8))  # Wan2.2's patchify: x2
    assert cfg.image_size == (32, 32) and cfg.frames_per_chunk == 4 * T


def test_streaming_encode_equals_whole_video_encode(vae_setup):
    vae, cfg, _ = vae_setup
    codec = make_codec(cfg)
    chunks = 3
    video = _video(4 * T * chunks, seed=0)  # chunk 0's 3 oldest frames are dropped
    used = video[3:]
    streamed = torch.cat(
        [codec.encode(video[c * 4 * T : (c + 1) * 4 * T], stream_id=7) for c in range(chunks)],
        dim=1,
    )
    x = torch.from_numpy(used).float().permute(3, 0, 1, 2)[None] / 127.5 - 1.0
    with torch.no_grad():
        whole = _norm(vae, vae.encode(x).latent_dist.mode()[0])
    assert streamed.shape == whole.shape == (4, T * chunks, cfg.latent_height, cfg.latent_width)
    diff = (streamed - whole).abs().max().item()
    print("encode streamed vs whole", diff)
    assert diff <= 1e-5


def test_streaming_decode_equals_whole_video_decode(vae_setup):
    vae, cfg, _ = vae_setup
    codec = make_codec(cfg)
    gen = torch.Generator().manual_seed(3)
    # chunk 0 generated, chunk 1 observed (encoded), chunk 2 generated: chunk 1's latent passes
    # the decoder before chunk 2 (its output dropped)
    grid = (cfg.latent_height, cfg.latent_width)
    lat0 = torch.randn(4, T, *grid, generator=gen)
    out0 = codec.decode_float(lat0, stream_id=5, chunk=0)
    lat1 = codec.encode(_video(4 * T, seed=2), stream_id=5)
    codec.observed(5, 1, lat1)
    lat2 = torch.randn(4, T, *grid, generator=gen)
    out2 = codec.decode_float(lat2, stream_id=5, chunk=2)
    latents = torch.cat([lat0, lat1, lat2], dim=1)
    raw = latents * codec.std + codec.mean
    with torch.no_grad():
        whole = vae.decode(raw[None]).sample[0]  # [3, F, H, W] in [-1, 1]
    whole = whole.permute(1, 2, 3, 0)  # [F, H, W, 3]
    assert out0.shape == (1 + 4 * (T - 1), 32, 32, 3) and out2.shape == (4 * T, 32, 32, 3)
    d0 = (out0 - whole[: 1 + 4 * (T - 1)]).abs().max().item()
    d2 = (out2 - whole[1 + 4 * (2 * T - 1) :]).abs().max().item()
    print("decode streamed vs whole", d0, d2)
    assert max(d0, d2) <= 1e-5


def test_round_trip_matches_diffusers(vae_setup):
    vae, cfg, _ = vae_setup
    codec = make_codec(cfg)
    video = _video(4 * T, seed=1)
    lat = codec.encode(video, stream_id=1)
    ours = codec.decode(lat, stream_id=1, chunk=0)
    x = torch.from_numpy(video[3:]).float().permute(3, 0, 1, 2)[None] / 127.5 - 1.0
    with torch.no_grad():
        theirs = vae.decode(vae.encode(x).latent_dist.mode()).sample[0]
    theirs = (
        ((theirs.permute(1, 2, 3, 0) + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).numpy()
    )
    assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= 1


def test_codec_that_does_not_fit_is_refused(vae_setup, tmp_path):
    _, cfg, root = vae_setup
    with pytest.raises(ValueError, match=r"pixel with stride.*12 latent channels.*has 4"):
        make_codec(
            get_preset("tiny", in_channels=4, action_mode="none", action_dim=0, action_horizon=0)
        )
    with pytest.raises(ValueError, match=r"VAE .* has 4 latent channels, model tiny has 12"):
        resolve_model("tiny", vae=str(root / "vae"))
    assert TINY_VAE["z_dim"] == cfg.in_channels


def test_a_vae_whose_files_lack_a_weight_is_refused(vae_setup, tmp_path):
    """diffusers would keep the missing weight at its random init and only log it."""
    _, cfg, root = vae_setup
    vae_dir = tmp_path / "vae"
    shutil.copytree(root / "vae", vae_dir)
    weights = next(vae_dir.glob("*.safetensors"))
    state = load_file(str(weights))
    del state["decoder.conv_out.weight"]
    save_file(state, str(weights), metadata={"format": "pt"})
    broken = dataclasses.replace(cfg, vae_path=str(vae_dir))
    with pytest.raises(ValueError, match=r"missing 1 key\(s\) \['decoder.conv_out.weight'\]"):
        make_codec(broken)
