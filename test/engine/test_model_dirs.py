"""--model PATH: diffusers and upstream Wan directories load onto our blocks and compute what
diffusers' own WanTransformer3DModel computes (<= 1e-5, fp32)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
from wan_fixtures import TINY_WAN, make_diffusers_wan, save_upstream_wan

from physis_ros.engine import checkpoints as ck
from physis_ros.engine.build import build_model
from physis_ros.engine.config import SamplerConfig
from physis_ros.engine.forward import forward_sequence, sinusoidal
from physis_ros.engine.sampler import pack_chunk, unpack_chunk

SIGMAS = (0.0, 0.37, 0.9, 1.0)
LAYOUT = dict(latent_frames=2, resolution="64x64")
"""Chunk of 2 latent frames of 8x8 (vae_standin stride 8 for a 4-channel model)."""


def _ours(directory, **changes):
    resolved = ck.resolve_model(str(directory), **{**LAYOUT, **changes})
    model = build_model(resolved.cfg)
    ck.load_weights(model, resolved.weights)
    return resolved, model


def _max_diff(ref_model, model, *, seed: int = 0, tokens: int = 7) -> dict[float, float]:
    """Max abs diff of the velocity of one chunk (ours: block-causal over one chunk = full
    attention) against diffusers' forward on the same latent, timestep and padded prompt."""
    cfg = model.cfg
    gen = torch.Generator().manual_seed(seed)
    lat = torch.randn(
        cfg.in_channels, cfg.latent_frames, cfg.latent_height, cfg.latent_width, generator=gen
    )
    text = torch.randn(tokens, cfg.text_dim, generator=gen)
    padded = torch.cat([text, torch.zeros(cfg.text_len - tokens, cfg.text_dim)])
    out = {}
    with torch.no_grad():
        for sigma in SIGMAS:
            ref = ref_model(lat[None], torch.tensor([1000.0 * sigma]), padded[None]).sample[0]
            v = forward_sequence(
                model, pack_chunk(cfg, lat)[None], torch.tensor([sigma]), text, window=2
            )
            out[sigma] = (unpack_chunk(cfg, v[0])[0] - ref).abs().max().item()
    return out


class _Float64Sinusoid(torch.nn.Module):
    """diffusers' Timesteps computes the sinusoid in float32, upstream Wan (and we) in float64:
    at t ~ 1000 the arguments differ by ~6e-5. This feeds diffusers upstream's features."""

    def __init__(self, freq_dim: int) -> None:
        super().__init__()
        self.freq_dim = freq_dim

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return sinusoidal(self.freq_dim, t).float()


@pytest.fixture(scope="module")
def wan_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan")
    ref = make_diffusers_wan(root / "diffusers")
    save_upstream_wan(ref, root / "upstream", shards=2)
    return ref, root


def test_diffusers_dir_equals_diffusers_forward(wan_dirs):
    ref, root = wan_dirs
    resolved, model = _ours(root / "diffusers")
    assert resolved.weights.layout == ck.DIFFUSERS
    assert (model.cfg.num_blocks, model.cfg.dim, model.cfg.text_len) == (3, 24, 512)
    as_is = _max_diff(ref, model)
    print("diffusers as-is", as_is)
    assert as_is[0.0] <= 1e-5  # t = 0: the float32 sinusoid is exact
    assert max(as_is.values()) <= 1e-4
    ref.condition_embedder.timesteps_proj = _Float64Sinusoid(TINY_WAN["freq_dim"])
    try:
        matched = _max_diff(ref, model)
    finally:
        from diffusers.models.embeddings import Timesteps

        ref.condition_embedder.timesteps_proj = Timesteps(TINY_WAN["freq_dim"], True, 0)
    print("diffusers, float64 sinusoid", matched)
    assert max(matched.values()) <= 1e-5


def test_upstream_layout_loads_to_the_same_numbers(wan_dirs):
    _, root = wan_dirs
    resolved, upstream = _ours(root / "upstream")
    assert resolved.weights.layout == ck.UPSTREAM and len(resolved.weights.files) == 2
    _, diffusers = _ours(root / "diffusers")
    assert replace(resolved.cfg, name="-") == replace(diffusers.cfg, name="-")
    for key, val in diffusers.state_dict().items():
        assert torch.equal(val, upstream.state_dict()[key]), key


def test_cross_attn_norm_switch_from_config(tmp_path):
    ref = make_diffusers_wan(tmp_path, seed=3, cross_attn_norm=False)
    resolved, model = _ours(tmp_path)
    assert not resolved.cfg.cross_attn_norm
    assert not any(".norm3." in k for k in model.state_dict())
    ref.condition_embedder.timesteps_proj = _Float64Sinusoid(TINY_WAN["freq_dim"])
    assert max(_max_diff(ref, model, seed=4).values()) <= 1e-5


def test_qk_norm_switch_from_upstream_config(wan_dirs, tmp_path):
    _, root = wan_dirs
    target = tmp_path / "no_qk"
    shutil.copytree(root / "upstream", target)
    config = json.loads((target / "config.json").read_text())
    config["qk_norm"] = False
    (target / "config.json").write_text(json.dumps(config))
    # the checkpoint still holds norm_q/norm_k weights: strict loading names them
    with pytest.raises(ValueError, match=r"unknown keys.*norm_"):
        ck.resolve_model(str(target), **LAYOUT)
    cfg = ck.config_from_json(ck.UPSTREAM, config, name="x")
    assert not cfg.qk_norm and not any("norm_q" in k for k in ck.expected_shapes(cfg))


def test_strict_keys_and_shapes(wan_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    _, root = wan_dirs
    src = root / "diffusers" / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(str(src))
    cases = {
        "missing": (
            {k: v for k, v in state.items() if k != "blocks.1.attn2.to_k.bias"},
            "missing keys.*blocks.1.cross_attn.k.bias",
        ),
        "unknown": (
            {**state, "blocks.0.extra.weight": torch.zeros(2)},
            "unknown keys.*blocks.0.extra.weight",
        ),
        "shape": ({**state, "proj_out.bias": torch.zeros(5)}, "wrong shape.*proj_out.bias"),
    }
    for name, (bad, message) in cases.items():
        d = tmp_path / name / "transformer"
        d.mkdir(parents=True)
        shutil.copy(src.parent / "config.json", d / "config.json")
        save_file(bad, str(d / "diffusion_pytorch_model.safetensors"))
        with pytest.raises(ValueError, match=message):
            ck.resolve_model(str(tmp_path / name), **LAYOUT)


def test_directories_that_are_refused(wan_dirs, tmp_path):
    _, root = wan_dirs
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(root / "upstream" / "config.json", pickled / "config.json")
    (pickled / "diffusion_pytorch_model.pth").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="pickle formats are never loaded"):
        ck.resolve_model(str(pickled))
    moe = tmp_path / "moe"
    shutil.copytree(root / "diffusers" / "transformer", moe / "transformer")
    shutil.copytree(root / "diffusers" / "transformer", moe / "transformer_2")
    with pytest.raises(ValueError, match="two experts"):
        ck.resolve_model(str(moe))
    i2v = dict(json.loads((root / "upstream" / "config.json").read_text()), model_type="i2v")
    with pytest.raises(ValueError, match="i2v"):
        ck.config_from_json(ck.UPSTREAM, i2v, name="x")
    with pytest.raises(ValueError, match="no such preset or directory"):
        ck.resolve_model(str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="multiple of"):
        ck.resolve_model(str(root / "diffusers"), resolution="72x64")


def test_summary_names_what_runs(wan_dirs):
    _, root = wan_dirs
    resolved = ck.resolve_model(str(root / "upstream"), **LAYOUT)
    text = ck.summary(resolved, SamplerConfig(steps=4, window=2), torch.bfloat16)
    print(text)
    assert len(text.splitlines()) <= 24
    for part in (
        "3 blocks",
        "2 heads x 12",
        "K=4",
        "window W=2",
        "per block",
        "bfloat16",
        "upstream Wan layout, 2 file(s)",
        "KV ring",
    ):
        assert part in text, part


def test_presets_still_resolve():
    resolved = ck.resolve_model("tiny")
    assert resolved.weights is None and resolved.cfg.name == "tiny"
    with pytest.raises(ValueError, match="unknown model preset"):
        ck.resolve_model("no-such-model")
