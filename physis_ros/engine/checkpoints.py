"""Model directories a user brings: upstream Wan2.1/Wan2.2 and diffusers ``WanTransformer3DModel``.

What belongs here: finding the layout of a model directory, turning its ``config.json`` into a
``ModelConfig`` (architecture switches included), mapping its weight names onto our blocks
(upstream names are ours; diffusers names are renamed), loading them strictly (every key
present, none unknown, every shape right; sharded files through their index), and the
one-screen summary printed at load. ``resolve_model`` is the one entry point: a preset name or
a directory.

Layouts:
  upstream  ``config.json`` (``_class_name: WanModel``: dim, num_layers, in_dim, ...) beside
            ``diffusion_pytorch_model.safetensors`` or shards + ``*.safetensors.index.json``
  diffusers a pipeline directory with ``transformer/config.json`` (``WanTransformer3DModel``),
            or that ``transformer/`` directory itself; same file names
Which weight files (and which variant of them) is ``engine.weight_files``'s; pickle formats
(``.pth``, ``.bin``, ``.pt``) are never loaded.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open

from physis_ros.contract.safetensors import MODEL_CONFIG_KEY, read_metadata
from physis_ros.engine.config import ModelConfig, SamplerConfig, get_preset, model_config_from_json
from physis_ros.engine.fused import describe_block_impl
from physis_ros.engine.model import Block, Stem, WanDiT
from physis_ros.engine.vae import read_vae_config
from physis_ros.engine.weight_files import is_model_dir, variant_of, weight_files

UPSTREAM, DIFFUSERS = "upstream Wan", "diffusers"
DEFAULT_LATENT_FRAMES = 3
"""Latent frames per chunk for a model directory (Self-Forcing / CausVid chunks)."""
DEFAULT_RESOLUTION = {16: (480, 832), 48: (704, 1280)}
"""Camera image (height, width) by latent channels: Wan2.1's 480p, Wan2.2 TI2V's 720p."""
STANDIN_STRIDE = {16: (4, 8, 8), 48: (4, 16, 16)}
"""The Wan VAE's strides by latent channels (Wan2.1 VAE, Wan2.2 VAE with its 2x2 patch)."""

# diffusers name piece -> upstream name piece (diffusers' convert_wan_to_diffusers, reversed).
# Applied in order to the part of a key after "blocks.N." (block keys) or to the whole key.
_DIFFUSERS_BLOCK = (
    ("attn1.to_out.0.", "self_attn.o."),
    ("attn2.to_out.0.", "cross_attn.o."),
    ("attn1.to_", "self_attn."),
    ("attn2.to_", "cross_attn."),
    ("attn1.norm_", "self_attn.norm_"),
    ("attn2.norm_", "cross_attn.norm_"),
    # diffusers calls the cross-attention norm norm2 (upstream: norm3; norm1/3 have no weights)
    ("norm2.", "norm3."),
    ("ffn.net.0.proj.", "ffn.0."),
    ("ffn.net.2.", "ffn.2."),
    ("scale_shift_table", "modulation"),
)
_DIFFUSERS_STEM = {
    "condition_embedder.time_embedder.linear_1.": "time_embedding.0.",
    "condition_embedder.time_embedder.linear_2.": "time_embedding.2.",
    "condition_embedder.text_embedder.linear_1.": "text_embedding.0.",
    "condition_embedder.text_embedder.linear_2.": "text_embedding.2.",
    "condition_embedder.time_proj.": "time_projection.1.",
    "proj_out.": "head.head.",
    "scale_shift_table": "head.modulation",
    "patch_embedding.": "patch_embedding.",
}
_BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class WeightsSource:
    """Where a model directory's weights are and how their names map onto ours."""

    layout: str
    """``UPSTREAM`` or ``DIFFUSERS``."""
    directory: Path
    key_files: dict[str, Path]
    """Our (upstream) key -> the safetensors file that holds it."""
    checkpoint_keys: dict[str, str]
    """Our key -> the key in the file."""

    @property
    def files(self) -> list[Path]:
        return sorted(set(self.key_files.values()))


@dataclass(frozen=True)
class ResolvedModel:
    """A model as every rank builds it: its config and, for a directory, its weights."""

    cfg: ModelConfig
    weights: WeightsSource | None = None
    """None: a preset (random weights by seed, or a physis-train checkpoint given apart)."""


def resolve_model(
    name_or_path: str,
    *,
    latent_frames: int = 0,
    resolution: str = "",
    vae: str = "",
    variant: str = "",
    dtype: str = "",
) -> ResolvedModel:
    """The model called ``name_or_path``: a preset, a model directory (see the module), or a
    weights file that names its preset or carries its architecture (``weights_file_config``;
    its weights are loaded as a checkpoint).

    ``latent_frames`` (0: the model's default), ``resolution`` ("HxW" camera pixels; "": the
    default) and ``vae`` (a diffusers AutoencoderKLWan directory: the real codec) choose what
    a checkpoint does not fix: the chunk and the codec. ``variant`` (e.g. ``fp16``) or else
    the serving ``dtype`` chooses which of a directory's weight variants loads
    (``engine.weight_files``)."""
    if str(name_or_path).endswith(".safetensors") and Path(name_or_path).is_file():
        layout = {"latent_frames": latent_frames, "resolution": resolution, "vae": vae}
        return ResolvedModel(cfg=weights_file_config(Path(name_or_path), **layout))
    if not is_model_dir(name_or_path):
        cfg = get_preset(name_or_path)
        return ResolvedModel(cfg=_layout(cfg, latent_frames, resolution, vae))
    layout, directory, config = find_model_dir(Path(name_or_path))
    cfg = config_from_json(layout, config, name=_model_name(directory))
    cfg = _layout(cfg, latent_frames, resolution, vae)
    source = weights_source(layout, directory, cfg, variant=variant, dtype=dtype)
    return ResolvedModel(cfg=cfg, weights=source)


def weights_file_config(path: Path, **layout) -> ModelConfig:
    """The architecture a weights file names (its preset, metadata ``model``) or carries
    (``model_config``); ``layout``: a preset's chunk and codec (``resolve_model``)."""
    meta = read_metadata(path)
    if MODEL_CONFIG_KEY not in meta:
        return resolve_model(_checkpoint_preset(meta, path), **layout).cfg
    if any(layout.values()):
        raise ValueError(
            f"{path} carries its architecture ({MODEL_CONFIG_KEY}): its chunk and codec are "
            "fixed, drop latent_frames, resolution and vae"
        )
    try:
        config = model_config_from_json(json.loads(meta[MODEL_CONFIG_KEY]))
    except (ValueError, TypeError) as err:  # JSON, fields, or the config's own checks
        raise ValueError(f"{path}: unreadable {MODEL_CONFIG_KEY} metadata: {err}") from None
    if meta.get("model", config.name) != config.name:
        raise ValueError(
            f"{path}: its model {meta['model']!r} is not the name in its {MODEL_CONFIG_KEY} "
            f"({config.name!r})"
        )
    return config


def _checkpoint_preset(meta: dict[str, str], path: Path) -> str:
    if "model" not in meta:
        raise ValueError(
            f"{path}: no physis-train metadata naming its model preset; "
            "give the preset as model and this file as weights"
        )
    return meta["model"]


def resolve_model_config(name_or_path: str, **layout) -> ModelConfig:
    """Only the config (shapes) of ``resolve_model``: for planners and simulators."""
    return resolve_model(name_or_path, **layout).cfg


def add_layout_arguments(parser) -> None:
    """--resolution and --latent-frames: the chunk of a model directory (for the CLIs)."""
    parser.add_argument(
        "--resolution", default="", help="camera HxW of a model directory (default: its own)"
    )
    parser.add_argument(
        "--latent-frames", type=int, default=0, help="latent frames per chunk (default 3)"
    )


# ---- finding the layout -------------------------------------------------------------------
def find_model_dir(path: Path) -> tuple[str, Path, dict]:
    """(layout, directory holding config.json and weights, parsed config) or ValueError."""
    if not path.exists():
        raise ValueError(f"model {str(path)!r}: no such preset or directory")
    if path.is_file():
        raise ValueError(
            f"model {path}: a file; --model takes a preset name or a model directory "
            "(config.json + safetensors)"
        )
    for a, b in (("transformer", "transformer_2"), ("high_noise_model", "low_noise_model")):
        if (path / a).is_dir() and (path / b).is_dir():
            raise ValueError(
                f"model {path} holds two experts ({a}/, {b}/) that upstream switches between "
                f"by noise level; serve one of them: --model {path / a}"
            )
    if not (path / "config.json").exists() and (path / "transformer" / "config.json").exists():
        path = path / "transformer"
    if not (path / "config.json").exists():
        raise ValueError(
            f"model {path}: no config.json (nor transformer/config.json); expected an upstream "
            "Wan directory or a diffusers Wan pipeline or transformer directory"
        )
    try:
        config = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path / 'config.json'}: not JSON: {err}") from err
    cls = config.get("_class_name", "")
    if cls == "WanTransformer3DModel":
        return DIFFUSERS, path, config
    if cls == "WanModel" or (not cls and {"dim", "num_layers", "in_dim"} <= set(config)):
        return UPSTREAM, path, config
    raise ValueError(
        f"{path / 'config.json'}: class {cls or '(none)'!r} is not a Wan text-to-video "
        "transformer (WanModel or WanTransformer3DModel)"
    )


def _model_name(directory: Path) -> str:
    return directory.parent.name if directory.name == "transformer" else directory.name


def config_from_json(layout: str, config: dict, *, name: str) -> ModelConfig:
    """The ModelConfig a Wan ``config.json`` describes (latent layout: defaults, see _layout)."""
    c = dict(config)
    if layout == UPSTREAM:
        kind = c.get("model_type", "t2v")
        if kind not in ("t2v", "ti2v"):
            raise ValueError(
                f"model {name}: model_type {kind!r} is not supported (text-to-video t2v and "
                "ti2v only: i2v/flf2v/vace add image channels and a CLIP image branch)"
            )
        window = tuple(c.get("window_size", (-1, -1)))
        if window != (-1, -1):
            raise ValueError(f"model {name}: local attention window_size {window} unsupported")
        dim, heads = int(c["dim"]), int(c["num_heads"])
        in_ch, out_ch = int(c["in_dim"]), int(c.get("out_dim", c["in_dim"]))
        blocks, qk_norm = int(c["num_layers"]), bool(c.get("qk_norm", True))
        cross_norm = bool(c.get("cross_attn_norm", True))
    else:
        for key in ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len"):
            if c.get(key) is not None:
                raise ValueError(
                    f"model {name}: {key}={c[key]} (an image-conditioned Wan) is not supported"
                )
        heads = int(c.get("num_attention_heads", 40))
        dim = heads * int(c.get("attention_head_dim", 128))
        in_ch = int(c.get("in_channels", 16))
        out_ch = int(c.get("out_channels") or in_ch)
        blocks = int(c.get("num_layers", 40))
        # diffusers' WanAttention always has (and applies) its q/k RMSNorms, whatever
        # config.qk_norm says: its weights are computed that way.
        qk_norm = True
        cross_norm = bool(c.get("cross_attn_norm", True))
    if in_ch != out_ch:
        raise ValueError(
            f"model {name}: in {in_ch} != out {out_ch} latent channels (image-conditioned "
            "inputs are not supported)"
        )
    patch = tuple(int(p) for p in c.get("patch_size", (1, 2, 2)))
    if len(patch) != 3:
        raise ValueError(f"model {name}: patch_size {patch} is not (t, h, w)")
    channels_default = in_ch if in_ch in DEFAULT_RESOLUTION else 16
    h, w = DEFAULT_RESOLUTION[channels_default]
    stride = STANDIN_STRIDE[channels_default]
    return ModelConfig(
        name=name,
        num_blocks=blocks,
        dim=dim,
        num_heads=heads,
        ffn_dim=int(c.get("ffn_dim", 8192 if layout == UPSTREAM else 13824)),
        freq_dim=int(c.get("freq_dim", 256)),
        text_dim=int(c.get("text_dim", 4096)),
        text_len=int(c.get("text_len", 512)),
        in_channels=in_ch,
        patch=patch,
        latent_frames=DEFAULT_LATENT_FRAMES * patch[0],
        latent_height=h // stride[1],
        latent_width=w // stride[2],
        codec="vae_standin",
        codec_stride=stride,
        eps=float(c.get("eps", 1e-6)),
        qk_norm=qk_norm,
        cross_attn_norm=cross_norm,
    )


def _layout(cfg: ModelConfig, latent_frames: int, resolution: str, vae: str) -> ModelConfig:
    """``cfg`` with the chunk length, camera resolution and codec asked for."""
    changes: dict = {}
    if vae:
        vc = read_vae_config(vae)
        changes.update(codec="wan_vae", vae_path=str(vae), codec_stride=vc.stride)
        if vc.z_dim != cfg.in_channels:
            raise ValueError(
                f"VAE {vae} has {vc.z_dim} latent channels, model {cfg.name} has {cfg.in_channels}"
            )
    stride = changes.get("codec_stride", cfg.codec_stride)
    if resolution:
        try:
            h, w = (int(v) for v in resolution.lower().split("x"))
        except ValueError:
            raise ValueError(f"resolution {resolution!r} is not HxW, e.g. 480x832") from None
        if h % stride[1] or w % stride[2]:
            raise ValueError(
                f"resolution {h}x{w} is not a multiple of the codec's spatial stride "
                f"{stride[1]}x{stride[2]}"
            )
        lh, lw = h // stride[1], w // stride[2]
        if lh % cfg.patch[1] or lw % cfg.patch[2]:
            raise ValueError(
                f"resolution {h}x{w} gives a {lh}x{lw} latent, not a multiple of model "
                f"{cfg.name}'s patch {cfg.patch[1]}x{cfg.patch[2]}: use a multiple of "
                f"{stride[1] * cfg.patch[1]}x{stride[2] * cfg.patch[2]} pixels"
            )
        changes.update(latent_height=lh, latent_width=lw)
    elif "codec_stride" in changes and changes["codec_stride"] != cfg.codec_stride:
        h, w = cfg.image_size  # keep the camera image, the latent follows the VAE's stride
        changes.update(latent_height=h // stride[1], latent_width=w // stride[2])
    if latent_frames:
        changes["latent_frames"] = latent_frames
    return replace(cfg, **changes) if changes else cfg


# ---- weights ------------------------------------------------------------------------------
def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every key a checkpoint of ``cfg`` must hold (upstream names), with its shape."""
    with torch.device("meta"):
        stem, block = Stem(cfg), Block(cfg)
    out = {k: tuple(v.shape) for k, v in stem.state_dict().items()}
    out["patch_embedding.weight"] = (cfg.dim, cfg.in_channels, *cfg.patch)  # Conv3d upstream
    for i in range(cfg.num_blocks):
        out.update({f"blocks.{i}.{k}": tuple(v.shape) for k, v in block.state_dict().items()})
    return out


def to_upstream_key(layout: str, key: str) -> str:
    """A checkpoint key in our (upstream) naming."""
    if layout == UPSTREAM:
        return key
    m = _BLOCK_KEY.match(key)
    if m:
        rest = m.group(2)
        for old, new in _DIFFUSERS_BLOCK:
            if rest.startswith(old):
                rest = new + rest[len(old) :]
                break
        return f"blocks.{m.group(1)}.{rest}"
    for old, new in _DIFFUSERS_STEM.items():
        if key.startswith(old):
            return new + key[len(old) :]
    return key


def weights_source(
    layout: str, directory: Path, cfg: ModelConfig, *, variant: str = "", dtype: str = ""
) -> WeightsSource:
    """Index every weight of ``directory`` (of the variant ``variant`` or ``dtype`` chooses:
    ``engine.weight_files``) and check names and shapes against ``cfg`` (strict: missing,
    unknown or mis-shaped keys raise ValueError naming them). Reads headers only."""
    files = weight_files(directory, variant=variant, dtype=dtype)
    key_files: dict[str, Path] = {}
    checkpoint_keys: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                ours = to_upstream_key(layout, key)
                if ours in key_files:
                    raise ValueError(f"{directory}: key {key!r} is in two files")
                key_files[ours], checkpoint_keys[ours] = path, key
                shapes[ours] = tuple(f.get_slice(key).get_shape())
    want = expected_shapes(cfg)
    missing = sorted(set(want) - set(shapes))
    unknown = sorted(set(shapes) - set(want))
    bad = sorted(k for k in set(want) & set(shapes) if want[k] != shapes[k])
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing keys, e.g. {missing[:4]}")
    if unknown:
        named = [checkpoint_keys[k] for k in unknown[:4]]
        problems.append(f"{len(unknown)} unknown keys, e.g. {named}")
    if bad:
        k = bad[0]
        problems.append(
            f"{len(bad)} keys of the wrong shape, e.g. {checkpoint_keys[k]} {shapes[k]} "
            f"(config says {want[k]})"
        )
    if problems:
        raise ValueError(
            f"{directory} ({layout} layout) does not match its config.json: " + "; ".join(problems)
        )
    return WeightsSource(layout, directory, key_files, checkpoint_keys)


@torch.no_grad()
def load_weights(model, source: WeightsSource) -> int:
    """Copy the weights of the blocks ``model`` holds (and its stem) from ``source``, cast to
    the model's dtype; every key the model has must come from the checkpoint (names and
    shapes were checked by ``weights_source``). Returns the number of tensors loaded."""
    cfg = model.cfg
    params = model.state_dict()
    todo: dict[Path, list[str]] = {}
    for key in params:
        if key not in source.key_files:
            raise ValueError(f"{source.directory}: no weight for {key}")
        todo.setdefault(source.key_files[key], []).append(key)
    for path, keys in todo.items():
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in keys:
                val = f.get_tensor(source.checkpoint_keys[key])
                if key == "patch_embedding.weight":
                    val = val.reshape(cfg.dim, cfg.patch_dim)  # Conv3d [D, C, pt, ph, pw]
                params[key].copy_(val.to(params[key].dtype))
    return len(params)


# ---- the summary at load ------------------------------------------------------------------
def summary(
    resolved: ResolvedModel,
    sampler: SamplerConfig,
    dtype: torch.dtype,
    *,
    checkpoint: str = "",
    model: WanDiT | None = None,
) -> str:
    """A screenful about the model as it will run: where its weights come from, its shape,
    parameters, chunk and codec, K and W, memory per block, and which block implementation
    runs and why (``model``: the built model; without it, the rule it is chosen by)."""
    cfg, w = resolved.cfg, resolved.weights
    item = torch.empty((), dtype=dtype).element_size()
    if w is not None:
        variant = variant_of(w.files[0].name)
        source = f"{w.layout} layout, {len(w.files)} file(s) in {w.directory}" + (
            f", variant {variant}" if variant else ""
        )
    elif checkpoint:
        source = f"preset, weights {checkpoint}"
    else:
        source = "preset, random weights (shapes only)"
    block_p = cfg.block_params()
    kv_bytes = 2 * (sampler.window + 1) * cfg.tokens_per_chunk * cfg.dim * item
    cross_bytes = 2 * cfg.text_len * cfg.dim * item
    h, wd = cfg.image_size
    pt, ph, pw = cfg.patch
    st, sh, sw = cfg.codec_stride
    codec = {
        "pixel": "pixel (exact space-to-depth)",
        "vae_standin": "vae_standin (VAE shapes only: images mean nothing; --vae DIR for the "
        "real Wan VAE)",
        "wan_vae": f"wan_vae {cfg.vae_path}",
    }[cfg.codec]
    lines = [
        f"model    {cfg.name}  ({source})",
        f"         {cfg.num_blocks} blocks, dim {cfg.dim}, {cfg.num_heads} heads x "
        f"{cfg.head_dim}, ffn {cfg.ffn_dim}, qk_norm {'on' if cfg.qk_norm else 'off'}, "
        f"cross_attn_norm {'on' if cfg.cross_attn_norm else 'off'}, eps {cfg.eps:g}",
        f"params   {_count(cfg.num_params())} in {str(dtype).removeprefix('torch.')}: "
        f"{format_bytes(cfg.num_params() * item)}; per block {_count(block_p)} = "
        f"{format_bytes(block_p * item)}",
        f"text     {cfg.text_len} tokens x {cfg.text_dim} (prompts zero-padded to {cfg.text_len})",
        f"chunk    {cfg.in_channels} ch x {cfg.latent_frames} x {cfg.latent_height} x "
        f"{cfg.latent_width} latent, patch {pt}x{ph}x{pw}: {cfg.tokens_per_chunk} tokens",
        f"codec    {codec}",
        f"         stride {st}x{sh}x{sw}: {cfg.frames_per_chunk} camera frames of {h}x{wd} "
        "per chunk",
        f"sampler  K={sampler.steps} steps x L={cfg.num_blocks} blocks = "
        f"{sampler.steps * cfg.num_blocks} stages, window W={sampler.window}, shift "
        f"{sampler.shift:g}",
        f"memory   per stream: KV ring {format_bytes(kv_bytes)} per stage (W+1 chunks), "
        f"cross-attn K/V {format_bytes(cross_bytes)} per block",
        f"blocks   {describe_block_impl(model)}",
    ]
    return "\n".join(lines)


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f}"


def format_bytes(n: float) -> str:
    """``n`` bytes in GiB, MiB or KiB (one decimal)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"
