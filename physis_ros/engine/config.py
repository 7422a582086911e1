"""Model and sampler configurations, with named presets that keep the real compute shapes.

A preset fixes the backbone (blocks, width, heads, FFN), the latent layout (channels, patch,
latent frames per chunk, latent grid) and the codec (image <-> latent). The sampler config
fixes what a run chooses: denoising steps K, history window W (in chunks), schedule shift.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

ACTION_MODES = ("none", "condition", "predict")
CODECS = ("pixel", "vae_standin", "wan_vae")
PREDICTIONS = ("velocity", "x0")
CONTEXT_NOISE = ("clean", "noised")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A block-causal diffusion transformer and its latent/codec layout."""

    name: str
    """Preset name, e.g. ``tiny`` or ``wan2.1-1.3b``."""
    num_blocks: int
    """L: transformer blocks."""
    dim: int
    """D: hidden size."""
    num_heads: int
    """Attention heads; head dim = dim / num_heads."""
    ffn_dim: int
    """Hidden size of the feed-forward network."""
    freq_dim: int = 256
    """Size of the sinusoidal timestep embedding (Wan2.1: 256)."""
    text_dim: int
    """Width of the conditioning (text) tokens fed to cross-attention."""
    text_len: int
    """Number of conditioning tokens per stream."""
    in_channels: int
    """Latent channels C."""
    patch: tuple[int, int, int] = (1, 2, 2)
    """Patch size (t, h, w) over the latent."""
    latent_frames: int
    """T: latent frames per chunk."""
    latent_height: int
    """Latent grid height per frame."""
    latent_width: int
    """Latent grid width per frame."""
    codec: str = "pixel"
    """``pixel`` (exact space-to-depth, tiny/small), ``vae_standin`` (VAE shapes, timed apart) or
    ``wan_vae`` (the Wan VAE of ``vae_path`` through diffusers, streaming and causal)."""
    vae_path: str = ""
    """Directory of a diffusers ``AutoencoderKLWan`` (``config.json`` + safetensors), for
    ``codec="wan_vae"``."""
    codec_stride: tuple[int, int, int] = (1, 4, 4)
    """Image -> latent stride (t, h, w)."""
    action_dim: int = 0
    """A: values per action (0: no actions)."""
    action_horizon: int = 0
    """H: actions per chunk."""
    action_mode: str = "none"
    """``none``; ``condition`` (world model conditioned on commanded actions per chunk);
    ``predict`` (world-action model: action tokens denoised and decoded per chunk)."""
    state_dim: int = 0
    """S: proprioceptive values per camera frame (predict mode; joint positions and
    velocities, wrench, ...): one state token per frame, clean in observed chunks, denoised
    (predicted) in generated ones."""
    committed_actions: bool = False
    """Predict mode: each action row carries a flag "known": a generated chunk's committed rows
    (actions the robot executes before this chunk arrives) enter clean and flagged and are
    never updated, the rest is generated to continue them (real-time chunking). In observed
    chunks the flag marks the rows the robot reported."""
    action_center: tuple[float, ...] = ()
    """Per action value: subtracted before the model sees it (empty: 0)."""
    action_scale: tuple[float, ...] = ()
    """Per action value: divides it after centring (empty: 1). Denoising starts from unit
    noise, so the values should be about unit scale."""
    state_center: tuple[float, ...] = ()
    """Per state value, like ``action_center``."""
    state_scale: tuple[float, ...] = ()
    """Per state value, like ``action_scale``."""
    eps: float = 1e-6
    """Norm epsilon (Wan2.1: 1e-6)."""
    qk_norm: bool = True
    """RMSNorm over the full width on q and k of both attentions (Wan: ``qk_norm``)."""
    cross_attn_norm: bool = True
    """Affine LayerNorm before cross-attention (Wan: ``cross_attn_norm``, key ``norm3``)."""
    prediction: str = "velocity"
    """What the head outputs: ``velocity`` eps - x0 (Wan2.1), or ``x0``, the clean state, turned
    into the velocity (x - x0) / sigma the sampler steps with. A narrow model over wide pixel
    tokens spends its width carrying the input noise through to a velocity; predicting x0 it
    only has to carry the image, and the last sampling step returns its x0 exactly."""
    anchor_residual: bool = False
    """An x0 head that predicts the change from the anchor: a generated chunk carries, as
    conditioning, the newest observed latent frame (repeated over its frames), and its x0
    estimate is ``anchor_gate * anchor + head``. A still scene is then the zero change, which
    a plain head only approximates (a blur several dB below copying the last frame)."""

    def __post_init__(self) -> None:
        if self.dim % self.num_heads:
            raise ValueError(f"dim {self.dim} is not divisible by num_heads {self.num_heads}")
        if (self.dim // self.num_heads) % 2:
            raise ValueError(f"head dim {self.dim // self.num_heads} must be even for RoPE")
        if self.action_mode not in ACTION_MODES:
            raise ValueError(f"action_mode {self.action_mode!r} is not one of {ACTION_MODES}")
        if self.prediction not in PREDICTIONS:
            raise ValueError(f"prediction {self.prediction!r} is not one of {PREDICTIONS}")
        if self.codec not in CODECS:
            raise ValueError(f"codec {self.codec!r} is not one of {CODECS}")
        if (self.codec == "wan_vae") != bool(self.vae_path):
            raise ValueError("codec 'wan_vae' and vae_path go together (the VAE's directory)")
        if self.action_mode != "none" and (self.action_dim <= 0 or self.action_horizon <= 0):
            raise ValueError(
                f"action_mode {self.action_mode!r} needs action_dim and action_horizon > 0"
            )
        if (self.state_dim or self.committed_actions) and self.action_mode != "predict":
            raise ValueError("state_dim and committed_actions need action_mode 'predict'")
        if self.state_dim < 0:
            raise ValueError(f"state_dim must be >= 0, got {self.state_dim}")
        if self.anchor_residual and self.prediction != "x0":
            raise ValueError("anchor_residual needs prediction 'x0' (it adds to the x0 estimate)")
        for name, size in (
            ("action_center", self.action_dim),
            ("action_scale", self.action_dim),
            ("state_center", self.state_dim),
            ("state_scale", self.state_dim),
        ):
            value = getattr(self, name)
            if value and len(value) != size:
                raise ValueError(f"{name} has {len(value)} values, need {size} (or none)")
        if any(v <= 0 for v in self.action_scale + self.state_scale):
            raise ValueError("action_scale and state_scale must be positive")
        pt, ph, pw = self.patch
        if self.latent_frames % pt or self.latent_height % ph or self.latent_width % pw:
            raise ValueError(
                f"latent chunk {self.latent_frames}x{self.latent_height}x{self.latent_width} "
                f"is not divisible by patch {self.patch}"
            )
        for name in ("num_blocks", "dim", "ffn_dim", "text_dim", "text_len", "in_channels"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per video token: C * pt * ph * pw."""
        pt, ph, pw = self.patch
        return self.in_channels * pt * ph * pw

    @property
    def grid(self) -> tuple[int, int, int]:
        """Token grid of one chunk (t, h, w)."""
        pt, ph, pw = self.patch
        return (self.latent_frames // pt, self.latent_height // ph, self.latent_width // pw)

    @property
    def tokens_per_frame(self) -> int:
        _, gh, gw = self.grid
        return gh * gw

    @property
    def video_tokens(self) -> int:
        gt, gh, gw = self.grid
        return gt * gh * gw

    @property
    def action_tokens(self) -> int:
        return self.action_horizon if self.action_mode == "predict" else 0

    @property
    def state_tokens(self) -> int:
        """One state token per camera frame of the chunk."""
        return self.frames_per_chunk if self.state_dim else 0

    @property
    def tokens_per_chunk(self) -> int:
        """N: tokens one chunk carries through every block."""
        return self.video_tokens + self.action_tokens + self.state_tokens

    @property
    def image_size(self) -> tuple[int, int]:
        """(height, width) of the camera image the codec takes."""
        _, sh, sw = self.codec_stride
        return (self.latent_height * sh, self.latent_width * sw)

    @property
    def frames_per_chunk(self) -> int:
        """Camera frames one chunk covers (latent frames x temporal stride)."""
        return self.latent_frames * self.codec_stride[0]

    def block_params(self) -> int:
        """Parameters of one transformer block (self-attn, cross-attn, norms, FFN, modulation)."""
        d, f = self.dim, self.ffn_dim
        attn = 4 * (d * d + d) + (2 * d if self.qk_norm else 0)  # q, k, v, o + q/k RMSNorm
        ffn = d * f + f + f * d + d
        norm3 = 2 * d if self.cross_attn_norm else 0
        return 2 * attn + ffn + norm3 + 6 * d  # + modulation

    def num_params(self) -> int:
        """Approximate parameter count of the whole DiT."""
        d = self.dim
        embed = self.patch_dim * d + d + self.text_dim * d + d + d * d + d
        time = self.freq_dim * d + d + d * d + d + d * 6 * d + 6 * d
        head = d * self.patch_dim + self.patch_dim + 2 * d
        return self.num_blocks * self.block_params() + embed + time + head


@dataclass(frozen=True, kw_only=True)
class SamplerConfig:
    """How a stream is sampled: the shared noise schedule and the attention window."""

    steps: int = 4
    """K: denoising steps per chunk."""
    window: int = 2
    """W: previous chunks each chunk attends to (same step, noisy history)."""
    shift: float = 5.0
    """Timestep shift of the flow-matching schedule (Wan2.1 uses 3.0-5.0)."""
    context_noise: str = "clean"
    """How an observed chunk enters the history at step k, as the model was trained (its
    weights' metadata says): ``clean`` (sigma 0 at every step) or ``noised`` (to sigma_k,
    with noise seeded by the stream seed and the slot, ``sampler.context_noise``)."""

    def __post_init__(self) -> None:
        if self.context_noise not in CONTEXT_NOISE:
            raise ValueError(f"context_noise {self.context_noise!r} is not one of {CONTEXT_NOISE}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.window < 0:
            raise ValueError(f"window must be >= 0, got {self.window}")
        if not (math.isfinite(self.shift) and self.shift > 0):  # NaN: every frame black
            raise ValueError(f"shift must be a finite number > 0, got {self.shift}")


def _wan(name: str, **kw) -> ModelConfig:
    base = dict(
        text_dim=4096,
        text_len=512,
        in_channels=16,
        patch=(1, 2, 2),
        latent_frames=3,
        latent_height=60,
        latent_width=104,
        codec="vae_standin",
        codec_stride=(4, 8, 8),
    )
    base.update(kw)
    return ModelConfig(name=name, **base)


_PUSH_JOINT_CENTER = (1.0, 1.75)
_PUSH_JOINT_SCALE = (0.45, 0.45)

PRESETS: dict[str, ModelConfig] = {
    # Tests: seconds on a CPU. 16x16 images, 32 tokens per chunk + 4 action tokens.
    "tiny": ModelConfig(
        name="tiny",
        num_blocks=2,
        dim=32,
        num_heads=2,
        ffn_dim=64,
        freq_dim=32,
        text_dim=16,
        text_len=4,
        in_channels=12,
        latent_frames=2,
        latent_height=8,
        latent_width=8,
        codec="pixel",
        codec_stride=(1, 2, 2),
        action_dim=4,
        action_horizon=4,
        action_mode="predict",
    ),
    # CPU benchmarks: 64x64 images, 128 video tokens per chunk, ~10 ms per block forward.
    "small": ModelConfig(
        name="small",
        num_blocks=4,
        dim=256,
        num_heads=4,
        ffn_dim=1024,
        freq_dim=256,
        text_dim=64,
        text_len=8,
        in_channels=48,
        latent_frames=2,
        latent_height=16,
        latent_width=16,
        codec="pixel",
        codec_stride=(1, 4, 4),
        action_dim=7,
        action_horizon=16,
        action_mode="predict",
    ),
    # The demo scene's world model (physis_ros/weights): 32x32 camera at 10 Hz, 2 frames per
    # chunk (32 video tokens), conditioned on the 2 joint position targets of each frame.
    # Its head predicts x0: a velocity head at this width has to carry each 192-value token's
    # input noise through; with the same data, recipe and 3000 steps it scored 0.9-1.4 dB lower
    # PSNR at horizon chunks 2-4 on the validation bags (docs/push_wm/README.md). The x0 is
    # predicted as a change from the newest observed frame (anchor_residual): with a plain
    # x0 head a still scene came out 4 dB below copying the last frame.
    "push-wm": ModelConfig(
        name="push-wm",
        num_blocks=3,
        dim=256,
        num_heads=4,
        ffn_dim=768,
        freq_dim=64,
        text_dim=16,
        text_len=4,
        in_channels=48,
        latent_frames=2,
        latent_height=8,
        latent_width=8,
        codec="pixel",
        codec_stride=(1, 4, 4),
        action_dim=2,
        action_horizon=2,
        action_mode="condition",
        prediction="x0",
        anchor_residual=True,
    ),
    # The demo scene's world-action model (push-wam, physis_ros/weights): push-wm's backbone and
    # camera, a token per 2x2 latent cells of both frames (16 video tokens, half push-wm's:
    # a CPU trains it in half the time); each chunk also carries 12 joint-target rows at
    # 20 Hz (0.6 s from the chunk's first frame: one chunk period of its own and two beyond,
    # so consecutive chunks overlap and a chunk that arrives up to ~0.4 s late still has rows
    # to execute), a known/committed flag per row, and one state token per frame (joint
    # positions, velocities, wrench, the task's goal and the box's position from an object
    # tracker: sim.task.MODEL_STATE_NAMES).
    # Normalisation: the spread of the expert's joint targets and of the contact forces.
    "push-wam": ModelConfig(
        name="push-wam",
        num_blocks=3,
        dim=256,
        num_heads=4,
        ffn_dim=768,
        freq_dim=64,
        text_dim=16,
        text_len=4,
        in_channels=48,
        patch=(2, 2, 2),
        latent_frames=2,
        latent_height=8,
        latent_width=8,
        codec="pixel",
        codec_stride=(1, 4, 4),
        action_dim=2,
        action_horizon=12,
        action_mode="predict",
        state_dim=14,
        committed_actions=True,
        action_center=_PUSH_JOINT_CENTER,
        action_scale=_PUSH_JOINT_SCALE,
        state_center=_PUSH_JOINT_CENTER + (0.0,) * 12,
        # rad/s; N (about the contact forces' spread); N·m (the planar tip torque is small);
        # the goal's and the box's m (their spread over the table)
        state_scale=(*_PUSH_JOINT_SCALE, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.02, *(0.3,) * 4),
        prediction="x0",
    ),
    # Wan2.1 T2V 1.3B at 480x832: 1560 tokens per latent frame, 3 latent frames per chunk.
    "wan2.1-1.3b": _wan("wan2.1-1.3b", num_blocks=30, dim=1536, num_heads=12, ffn_dim=8960),
    # Wan2.2 TI2V 5B at 704x1280: VAE 4x16x16, 48 latent channels, 880 tokens per frame.
    "wan2.2-ti2v-5b": _wan(
        "wan2.2-ti2v-5b",
        num_blocks=30,
        dim=3072,
        num_heads=24,
        ffn_dim=14336,
        in_channels=48,
        latent_height=44,
        latent_width=80,
        codec_stride=(4, 16, 16),
    ),
    # Wan2.1 T2V 14B at 480x832.
    "wan2.1-14b": _wan("wan2.1-14b", num_blocks=40, dim=5120, num_heads=40, ffn_dim=13824),
    # Larger backbones, 50 blocks, sized to 22B / 33B parameters (head dim 128).
    "dit-22b": _wan("dit-22b", num_blocks=50, dim=5888, num_heads=46, ffn_dim=13824),
    "dit-33b": _wan("dit-33b", num_blocks=50, dim=7168, num_heads=56, ffn_dim=17408),
}


# Tests of a served world-action model: push-wam's layout (2 joint targets at 20 Hz, known-row
# flags, one state token per frame: joint positions, velocities and the wrench) shrunk to 8x8
# images, 6 rows a chunk and ~11.5 k parameters, without normalisation.
PRESETS["tiny-wam"] = dataclasses.replace(
    PRESETS["push-wam"],
    name="tiny-wam",
    num_blocks=2,
    dim=16,
    num_heads=2,
    ffn_dim=32,
    freq_dim=16,
    text_dim=8,
    text_len=2,
    in_channels=12,
    patch=(1, 2, 2),
    latent_height=4,
    latent_width=4,
    codec_stride=(1, 2, 2),
    action_horizon=6,
    state_dim=10,  # no goal columns: its streams need no goal
    state_center=(),
    state_scale=(),
)

# push-wam without the wrench (columns 4-9, sim.task.WRENCH_SLICE; its state_names are
# train.wam_data.state_names'): what removing it costs
_NO_WRENCH = (*range(4), *range(10, PRESETS["push-wam"].state_dim))
PRESETS["push-wam-nowrench"] = dataclasses.replace(
    PRESETS["push-wam"],
    name="push-wam-nowrench",
    state_dim=len(_NO_WRENCH),
    state_center=tuple(PRESETS["push-wam"].state_center[i] for i in _NO_WRENCH),
    state_scale=tuple(PRESETS["push-wam"].state_scale[i] for i in _NO_WRENCH),
)

# push-wam's recipe for the 3-joint reaching arm (physis-train-wam --task reach): 3 joint
# targets a row; state: joint positions and velocities, the target's x, y (m); normalised by
# the spread of the reach expert's joint targets.
PRESETS["reach-wam"] = dataclasses.replace(
    PRESETS["push-wam"],
    name="reach-wam",
    action_dim=3,
    state_dim=8,
    action_center=(1.05, 1.6, -0.75),
    action_scale=(0.5, 0.45, 0.5),
    state_center=(1.05, 1.6, -0.75, *(0.0,) * 5),
    state_scale=(0.5, 0.45, 0.5, 1.0, 1.0, 1.0, 0.3, 0.3),
)


def get_preset(name: str, **overrides) -> ModelConfig:
    """The preset called ``name``, with fields replaced by ``overrides``."""
    try:
        cfg = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}") from None
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


def model_config_from_json(data: dict[str, Any]) -> ModelConfig:
    """A ``ModelConfig`` from ``dataclasses.asdict`` output (JSON lists back to tuples)."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ValueError(f"model config has unknown fields {unknown}")
    return ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})
