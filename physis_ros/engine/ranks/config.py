"""What every rank of a job agrees on: ``RuntimeConfig`` (rank 0 sends it to the others as
JSON) and the placement names a stream's default layout is given by."""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass

import torch

from physis_ros.engine.checkpoints import ResolvedModel, resolve_model
from physis_ros.engine.config import ModelConfig, SamplerConfig, model_config_from_json
from physis_ros.engine.placement import (
    Layout,
    layout_even,
    layout_groups,
    layout_one_stage_per_worker,
    layout_single,
    validate_layout,
)
from physis_ros.engine.ranks.framing import ActivationShapes
from physis_ros.engine.sampler import chunk_numel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True)
class DistributedSettings:
    """How the ranks of a torch.distributed job run and watch each other: the serving spec's
    ``distributed`` section, handed to every rank in its ``RuntimeConfig``."""

    threads: int = 1
    """torch intra-op threads per rank."""
    heartbeat_interval_s: float = 0.25
    """How often every rank tells rank 0 it is alive (and rank 0 tells every rank)."""
    fault_timeout_s: float = 5.0
    """A rank silent for this long is dead or hung: its streams fail."""
    comm_timeout_s: float = 60.0
    """torch.distributed process-group timeout: no wait lasts longer."""
    startup_timeout_s: float = 120.0
    """Time for every rank to load weights and report ready."""
    poll_interval_s: float = 0.002
    """Longest a worker waits for an activation before checking control and heartbeats."""

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        for name in (
            "heartbeat_interval_s",
            "fault_timeout_s",
            "comm_timeout_s",
            "startup_timeout_s",
            "poll_interval_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.fault_timeout_s <= 2 * self.heartbeat_interval_s:
            raise ValueError(
                f"fault_timeout_s {self.fault_timeout_s} must exceed two heartbeats "
                f"({2 * self.heartbeat_interval_s} s)"
            )
        if self.comm_timeout_s <= self.fault_timeout_s:
            raise ValueError(
                f"comm_timeout_s {self.comm_timeout_s} must exceed fault_timeout_s "
                f"{self.fault_timeout_s} so faults are reported before waits give up"
            )

    def distributed_settings(self) -> dict:
        """This object's distributed settings by name (to hand on to another config)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(DistributedSettings)}


DISTRIBUTED_FIELDS = tuple(f.name for f in dataclasses.fields(DistributedSettings))


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig(DistributedSettings):
    """What every rank must agree on (rank 0 sends it to the others as JSON, ``to_json``)."""

    model: str = "tiny"
    """Model preset name (``physis_ros.engine.config.PRESETS``) or model directory (upstream
    Wan or diffusers; ``engine.checkpoints``): every rank must see it at the same path."""
    latent_frames: int = 0
    """Latent frames per chunk of a model directory (0: its default)."""
    resolution: str = ""
    """Camera image ``HxW`` of a model directory ("": its default)."""
    vae: str = ""
    """diffusers AutoencoderKLWan directory: the real codec ("": the preset's or a stand-in)."""
    variant: str = ""
    """Which weight variant of a model directory loads ("": the one ``dtype`` names, else the
    files without one: ``engine.weight_files``)."""
    resolved_config: ModelConfig | None = None
    """The model's full config as rank 0 resolved it (a serving spec's); None: resolved here
    from ``model``."""
    steps: int = 4
    """K: denoising steps."""
    window: int = 2
    """W: history window in chunks."""
    shift: float = 5.0
    """Schedule shift."""
    context_noise: str = "clean"
    """How observations enter the history (``SamplerConfig.context_noise``), as trained."""
    horizon: int = 0
    """Chunks ahead of its newest observation a stream generates unless it asks otherwise
    (0: no limit, offline generation: observations only take new slots)."""
    weights_seed: int = 0
    """Random-init seed of the weights (when ``weights_path`` is empty)."""
    weights_path: str = ""
    """Safetensors checkpoint with upstream key names; empty: random weights."""
    dtype: str = "float32"
    """Compute dtype: float32 or bfloat16."""
    device: str = "auto"
    """``auto`` (cuda:LOCAL_RANK if CUDA exists, else cpu), ``cpu`` or ``cuda``."""
    placement: str = "even"
    """Default layout of a stream over the ranks: ``even``, ``single``, ``one-stage``,
    ``groups:a,b,...`` (contiguous groups of a, b, ... stages in pipeline order), or
    ``balanced`` (contiguous groups balanced by per-block costs measured on the ranks at
    start-up; ranks load the blocks it needs)."""
    batching: bool = True
    """Batch ready tasks that share block weights."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.resolved_config is None:
            # raises ValueError naming an unknown preset or what is wrong with a directory
            _ = self.resolved
        SamplerConfig(
            steps=self.steps,
            window=self.window,
            shift=self.shift,
            context_noise=self.context_noise,
        )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device {self.device!r} is not auto, cpu or cuda")
        if self.horizon < 0:
            raise ValueError(f"horizon must be >= 0 (0: no limit), got {self.horizon}")
        check_placement_spec(self.placement)

    @property
    def resolved(self) -> ResolvedModel:
        files = (self.variant, self.dtype)
        return _resolve(self.model, self.latent_frames, self.resolution, self.vae, *files)

    @property
    def model_config(self) -> ModelConfig:
        if self.resolved_config is not None:
            return self.resolved_config
        return self.resolved.cfg

    @property
    def sampler_config(self) -> SamplerConfig:
        return SamplerConfig(
            steps=self.steps,
            window=self.window,
            shift=self.shift,
            context_noise=self.context_noise,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def shapes(self) -> ActivationShapes:
        cfg = self.model_config
        return ActivationShapes(
            x_numel=chunk_numel(cfg),
            h_tokens=cfg.tokens_per_chunk,
            h_dim=cfg.dim,
            h_dtype=self.torch_dtype,
            steps=self.steps,
        )

    def to_json(self) -> str:
        """JSON text that ``from_json`` rebuilds this config from (the model's config in full)."""
        out = dataclasses.asdict(self)
        out["resolved_config"] = dataclasses.asdict(self.model_config)
        return json.dumps(out, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> RuntimeConfig:
        try:
            values = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"runtime config is not JSON: {err}") from None
        known = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(values, dict) or set(values) != known:
            raise ValueError("runtime config JSON does not have this runtime's fields")
        values["resolved_config"] = model_config_from_json(values["resolved_config"])
        return cls(**values)


@functools.lru_cache(maxsize=4)
def _resolve(  # noqa: PLR0917 - cached by its arguments
    model: str, latent_frames: int, resolution: str, vae: str, variant: str, dtype: str
) -> ResolvedModel:
    # a model directory's headers are read once per process, not on every model_config
    layout = {"latent_frames": latent_frames, "resolution": resolution, "vae": vae}
    return resolve_model(model, **layout, variant=variant, dtype=dtype)


def _group_sizes(spec: str) -> list[int]:
    try:
        sizes = [int(s) for s in spec[len("groups:") :].split(",")]
    except ValueError:
        raise ValueError(f"placement {spec!r}: groups must be integers, e.g. groups:3,5") from None
    if any(size < 1 for size in sizes):
        raise ValueError(f"placement {spec!r}: every group needs at least one stage")
    return sizes


def check_placement_spec(spec: str) -> None:
    """Raise ValueError naming ``spec`` unless it is a placement name this runtime knows."""
    if spec.startswith("groups:"):
        _group_sizes(spec)
    elif spec not in ("even", "single", "one-stage", "balanced"):
        raise ValueError(
            f"placement {spec!r} is not even, single, one-stage, balanced or groups:a,b,..."
        )


def parse_placement(spec: str, steps: int, blocks: int, workers: int) -> Layout:
    """The layout named by ``spec`` (see ``RuntimeConfig.placement``) over ``workers`` ranks
    (``balanced`` before its costs are measured: ``even``, whose blocks ranks load first)."""
    check_placement_spec(spec)
    if spec == "single":
        return layout_single(steps, blocks)
    if spec in ("even", "balanced"):
        return layout_even(steps, blocks, workers)
    if spec == "one-stage":
        layout = layout_one_stage_per_worker(steps, blocks)
        validate_layout(layout, steps, blocks, workers)
        return layout
    sizes = _group_sizes(spec)
    if len(sizes) > workers:
        raise ValueError(f"placement {spec!r} needs {len(sizes)} ranks, the job has {workers}")
    return layout_groups(steps, blocks, sizes)


def blocks_for_rank(cfg: RuntimeConfig, rank: int, world_size: int) -> set[int]:
    """Blocks whose weights ``rank`` loads: those of its stages under the default layout
    (``single`` puts everything on rank 0, so every rank then loads every block to let
    streams be placed anywhere)."""
    blocks = cfg.model_config.num_blocks
    layout = parse_placement(cfg.placement, cfg.steps, blocks, world_size)
    if cfg.placement == "single":
        return set(range(blocks))
    return {blk for row in layout for blk, r in enumerate(row) if r == rank}
