"""Tiny Wan checkpoints the tests make themselves: a random diffusers ``WanTransformer3DModel``
saved with ``save_pretrained``, the same weights in the upstream Wan layout (sharded, with an
index), a random ``AutoencoderKLWan`` and prompt-embedding files. Nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TINY_WAN = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,
    in_channels=4,
    out_channels=4,
    text_dim=16,
    freq_dim=32,
    ffn_dim=48,
    num_layers=3,
    cross_attn_norm=True,
    eps=1e-6,
)
"""A Wan transformer small enough for a CPU test (dim 24, 3 blocks)."""
TEXT_LEN = 512
"""diffusers' config has no text_len: upstream's 512 is assumed for that layout."""
TINY_VAE = dict(
    base_dim=8,
    z_dim=4,
    dim_mult=[1, 2, 2],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[True, True],
    latents_mean=[0.1, -0.2, 0.3, 0.05],
    latents_std=[1.5, 0.8, 2.0, 1.1],
    scale_factor_spatial=4,
)
"""Wan2.1 VAE architecture at toy width: temporal stride 4, spatial stride 4, 4 latent channels."""
TINY_VAE22 = dict(
    TINY_VAE,
    decoder_base_dim=12,
    is_residual=True,
    patch_size=2,
    in_channels=12,
    out_channels=12,
    scale_factor_spatial=8,
)
"""Wan2.2 VAE architecture (residual blocks, 2x2 patchify) at toy width: stride 4x8x8."""


def randomize(module: torch.nn.Module, seed: int, scale: float = 0.3) -> None:
    """Every parameter random (norm weights and biases too), so no key can go unnoticed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * scale)


def make_diffusers_wan(root: Path, seed: int = 0, **changes):
    """A random WanTransformer3DModel saved as ``root/transformer`` (a pipeline layout)."""
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(**{**TINY_WAN, **changes}).eval()
    randomize(model, seed)
    model.save_pretrained(root / "transformer")
    return model


def upstream_state_dict(diffusers_model) -> dict[str, torch.Tensor]:
    """The diffusers weights under upstream Wan names; checked against diffusers' own converter
    (upstream -> diffusers), so the names are diffusers', not ours."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    from physis_ros.engine.checkpoints import DIFFUSERS, to_upstream_key

    ours = {
        to_upstream_key(DIFFUSERS, k): v.clone() for k, v in diffusers_model.state_dict().items()
    }
    back = convert_wan_transformer_to_diffusers(dict(ours))
    want = diffusers_model.state_dict()
    if set(back) != set(want) or any(not torch.equal(back[k], want[k]) for k in want):
        raise AssertionError(
            f"upstream names disagree with diffusers: {sorted(set(back) ^ set(want))}"
        )
    return ours


def save_upstream_wan(diffusers_model, root: Path, shards: int = 2) -> Path:
    """The same weights as an upstream Wan directory: config.json and ``shards`` safetensors
    files with a ``diffusion_pytorch_model.safetensors.index.json``."""
    from safetensors.torch import save_file

    c = diffusers_model.config
    root.mkdir(parents=True, exist_ok=True)
    config = {
        "_class_name": "WanModel",
        "model_type": "t2v",
        "patch_size": list(c.patch_size),
        "text_len": TEXT_LEN,
        "in_dim": c.in_channels,
        "dim": c.num_attention_heads * c.attention_head_dim,
        "ffn_dim": c.ffn_dim,
        "freq_dim": c.freq_dim,
        "text_dim": c.text_dim,
        "out_dim": c.out_channels,
        "num_heads": c.num_attention_heads,
        "num_layers": c.num_layers,
        "qk_norm": True,
        "cross_attn_norm": c.cross_attn_norm,
        "eps": c.eps,
    }
    (root / "config.json").write_text(json.dumps(config, indent=1))
    state = upstream_state_dict(diffusers_model)
    keys = sorted(state)
    weight_map = {}
    for i in range(shards):
        name = f"diffusion_pytorch_model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k].contiguous() for k in keys[i::shards]}
        save_file(part, str(root / name))
        weight_map.update(dict.fromkeys(part, name))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (root / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    return root


def make_vae(root: Path, seed: int = 1, config: dict | None = None):
    """A random AutoencoderKLWan (``TINY_VAE`` unless ``config``) saved as ``root/vae``."""
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan(**(config or TINY_VAE)).eval()
    randomize(vae, seed, scale=0.2)
    vae.save_pretrained(root / "vae")
    return vae


WORDS = "a the robot arm picks up red blue cube holds still moves left right slowly".split()  # noqa: SIM905


def make_text_encoder(root: Path, seed: int = 2, d_model: int = 16):
    """A random umT5 encoder (``root/text_encoder``) and a word-level tokenizer with the T5
    end token (``root/tokenizer``): the layout of a diffusers Wan pipeline."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", 1)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(str(root / "tokenizer"))
    torch.manual_seed(seed)
    config = UMT5Config(
        vocab_size=len(vocab),
        d_model=d_model,
        d_kv=8,
        d_ff=32,
        num_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    encoder = UMT5EncoderModel(config).eval()
    encoder.save_pretrained(str(root / "text_encoder"), safe_serialization=True)
    return fast, encoder
