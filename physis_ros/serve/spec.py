"""The serving spec: everything physis-serve runs with, in one object, validated once.

``ServingSpec`` holds the model (a name that ``physis_ros.engine.models.resolve_model``
resolves: preset or checkpoint), its weights, the sampler, dtype and device, the placement
policy (planned at start-up or given by hand), the pool (admission policy, default target,
memory) and the torch.distributed runtime's settings. It is read from the YAML file's
sections ``engine``, ``placement``, ``pool`` and ``distributed`` plus command-line overrides
(``from_config``), resolved once (``resolve``: the model's full config, the weights' absolute
path after checking they fit the model, the sampler the weights were trained for) and then
never changes. Under torchrun rank 0 resolves it and sends ``to_json`` to every other rank,
which rebuilds it with ``from_json``: all ranks run exactly rank 0's spec. JSON only, never
pickle.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from physis_ros.cli_errors import UsageError, check_fields
from physis_ros.contract.model import ContractError, WamContract
from physis_ros.contract.safetensors import read_metadata
from physis_ros.engine.checkpoints import is_model_dir
from physis_ros.engine.config import PRESETS, ModelConfig, SamplerConfig, model_config_from_json
from physis_ros.engine.controller import MODES
from physis_ros.engine.models import check_weights_fit, resolve_model
from physis_ros.engine.pool.terms import POLICIES
from physis_ros.engine.ranks.config import (
    DISTRIBUTED_FIELDS,
    DistributedSettings,
    RuntimeConfig,
    check_placement_spec,
)

SPEC_VERSION = 1
DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
HAND_PLACEMENTS = "even | single | one-stage | groups:a,b,... | balanced"


@dataclass(frozen=True, kw_only=True)
class ServingSpec(DistributedSettings):
    """What physis-serve serves and how (module docstring). Sections as in the YAML file."""

    # ---- engine: the model and how it runs ---------------------------------------------
    model: str = "push-wm"
    """A preset name, a physis-train .safetensors checkpoint or a model directory (upstream
    Wan or diffusers; every rank must see it at the same path): ``engine.models``."""
    weights: str = ""
    """Safetensors file; empty: the model's own (a preset's shipped weights, a checkpoint
    itself), or random weights where it has none; ``random``: random weights. Resolved: the
    absolute path, or empty for random weights."""
    steps: int | None = None
    """K; None: what the weights were trained for, else 4."""
    window: int | None = None
    """W; None: what the weights were trained for, else 2."""
    shift: float | None = None
    """Schedule shift; None: what the weights were trained for, else 5.0."""
    horizon: int | None = None
    """Chunks ahead of its newest observation a stream predicts unless it asks otherwise
    (DESIGN.md §3.1); None: what the weights were trained for, else 0 (the front end then
    gives served streams ``engine.api.DEFAULT_HORIZON``)."""
    known_rows_ahead: int | None = None
    """A world-action stream is told the committed rows up to this many rows past the newest
    frame (0: none); None: the weights' ``max_known_rows_ahead`` (what they were trained
    with). A model that copies committed rows instead of correcting them (push-wam before
    ``physis-train-wam --committed-drift-rad``) does better with none (docs/push_wam)."""
    context_noise: str | None = None
    """How observations enter the history (``SamplerConfig.context_noise``); None: as the
    weights were trained, else clean."""
    seed: int = 0
    """Seed of random weights."""
    latent_frames: int = 0
    """Latent frames per chunk of a model directory (0: its default)."""
    resolution: str = ""
    """Camera image ``HxW`` of a model directory ("": its default)."""
    vae: str = ""
    """diffusers AutoencoderKLWan directory: the real codec ("": the model's own)."""
    variant: str = ""
    """Which weight variant of a model directory loads, e.g. ``fp16`` ("": the one ``dtype``
    names when the directory has it, else the files without one: ``engine.weight_files``)."""
    prompts: tuple[str, ...] = ()
    """Prompt-embedding files (physis-embed) whose prompts streams may ask for by name."""
    dtype: str = "float32"
    device: str = "auto"
    """``auto``: cuda (cuda:LOCAL_RANK under torchrun) if CUDA exists, else cpu."""
    mode: str = "pipelined"
    """Executor: pipelined | sequential-noisy | sequential-clean (baselines)."""
    batching: bool = True
    """Batch ready tasks that share block weights."""
    max_streams: int = 64
    """Streams the engine holds at once, whatever the pool could admit."""
    model_config: ModelConfig | None = None
    """The model's full config; set by ``resolve`` (None before)."""

    # ---- placement: which worker runs which stage ----------------------------------------
    plan: str = "auto"
    """``auto``: planned at start-up from per-block costs for the default target (workers and
    stage groups); or by hand (``HAND_PLACEMENTS``), checked against the pool at every
    admission."""
    workers: int = 0
    """One process: worker threads (0: planned, up to the CPU cores or one per GPU). Under
    torchrun every rank is a worker: 0 or the number of ranks."""
    profile: str = ""
    """A physis-profile JSON for the cost model; empty: measured at start-up."""

    # ---- pool: admission and promises ---------------------------------------------------
    policy: str = "shared"
    """``shared``: streams share workers; ``static``: each gets an exclusive group."""
    default_target_ms: float = 0.0
    """Interval of a stream that asks for 0; 0: the fastest the plan can promise one stream."""
    max_utilization: float = 0.75
    """Most of every interval a worker may be busy with admitted work; admission checks every
    target with forwards 1 / max_utilization times slower (headroom for a host that slows
    down now and then: a shared CPU host needs it; a dedicated GPU pool can take 0.9)."""
    memory_gib: float = 0.0
    """Memory per worker that streams may use (weights, KV slots, activations); 0: measured
    (free device memory, or available host memory, shared out over the workers)."""
    context_chunks: bool = True
    """Charge every generated chunk with one context chunk (the observation put in before
    it), as a stream fed at its interval does."""
    recalibrate: bool = True
    """Scale the pool's costs by the measured latencies while serving (promises revised,
    later admissions checked against them); false: the start-up costs throughout (admissions
    reproducible from a profile, whatever the host's load)."""

    # ---- distributed: the torch.distributed runtime (torchrun): DistributedSettings' fields

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {list(DTYPES)}")
        if self.device not in DEVICES:
            raise ValueError(f"device {self.device!r} is not one of {list(DEVICES)}")
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is not one of {list(MODES)}")
        if self.plan != "auto":
            check_placement_spec(self.plan)
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r} is not one of {list(POLICIES)}")
        if self.max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {self.max_streams}")
        if isinstance(self.prompts, list):  # from YAML or JSON
            object.__setattr__(self, "prompts", tuple(self.prompts))
        for name in ("workers", "default_target_ms", "memory_gib", "seed", "latent_frames"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.known_rows_ahead is not None and self.known_rows_ahead < 0:
            raise ValueError(f"known_rows_ahead must be >= 0, got {self.known_rows_ahead}")
        if self.horizon is not None and self.horizon < 0:
            raise ValueError(f"horizon must be >= 0 (0: no limit), got {self.horizon}")
        if not 0 < self.max_utilization <= 1:
            raise ValueError(f"max_utilization must be in (0, 1], got {self.max_utilization}")
        SamplerConfig(
            steps=self.steps if self.steps is not None else 4,
            window=self.window if self.window is not None else 2,
            shift=self.shift if self.shift is not None else 5.0,
            context_noise=self.context_noise or "clean",
        )

    # ---- building it ----------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: dict[str, Any], **overrides: Any) -> ServingSpec:
        """From the YAML file's sections; non-None ``overrides`` (flags) win. Unknown keys are
        refused by name."""
        values: dict[str, Any] = {}
        for section, body in config.items():
            if section == "frontend":
                continue
            if section not in SECTIONS:
                raise UsageError(
                    f"unknown config section {section!r}",
                    f"known sections: frontend, {', '.join(SECTIONS)}",
                )
            for key, value in (body or {}).items():
                name = LEGACY_KEYS.get((section, key), key)
                if name not in SECTIONS[section] and (section, key) not in LEGACY_KEYS:
                    raise UsageError(
                        f"unknown {section} key {key!r}",
                        f"known keys: {', '.join(SECTIONS[section])}",
                    )
                if name == "model_config":
                    raise ValueError("model_config is set by resolving the model, not by hand")
                values[name] = value
                # types and finite numbers, named by section (a YAML typo is refused here)
                check_fields(cls, {name: value}, f"config section {section}")
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def resolve(self) -> ServingSpec:
        """The model's config, its weights (absolute path, checked to fit the model key by
        key) and the sampler the weights were trained for; raises ValueError naming the
        problem."""
        if self.model_config is not None:
            return self
        resolved = resolve_model(
            self.model,
            self.weights or None,
            latent_frames=self.latent_frames,
            resolution=self.resolution,
            vae=self.vae,
            variant=self.variant,
            dtype=self.dtype,
        )
        if resolved.config.state_dim or resolved.config.committed_actions:
            _contract(resolved.config, resolved.weights)  # refused in one line if unusable
        check_weights_fit(resolved)
        sampling = {
            "steps": 4,
            "window": 2,
            "shift": 5.0,
            "horizon": 0,
            "context_noise": "clean",
            **resolved.sampling,
        }
        return dataclasses.replace(
            self,
            model_config=resolved.config,
            weights=str(resolved.weights.resolve()) if resolved.weights else "",
            steps=self.steps if self.steps is not None else int(sampling["steps"]),
            window=self.window if self.window is not None else int(sampling["window"]),
            shift=self.shift if self.shift is not None else float(sampling["shift"]),
            horizon=self.horizon if self.horizon is not None else int(sampling["horizon"]),
            context_noise=self.context_noise or str(sampling["context_noise"]),
        )

    def contract(self) -> WamContract | None:
        """A world-action model with state values or committed actions: its contract (from
        its weights' metadata; ``known_rows_ahead`` overrides how far committed rows reach);
        else None."""
        self._need_resolved()
        cfg = self.model_config
        if not (cfg.state_dim or cfg.committed_actions):
            return None
        contract = _contract(cfg, self.weights or None)
        if self.known_rows_ahead is None:
            return contract
        return dataclasses.replace(contract, max_known_rows_ahead=self.known_rows_ahead)

    @property
    def resolved(self) -> bool:
        return self.model_config is not None

    @property
    def model_directory(self) -> bool:
        """The model is a directory holding its own weights (not a preset or a file)."""
        return (
            self.model not in PRESETS
            and not self.model.endswith(".safetensors")
            and is_model_dir(self.model)
        )

    def sampler(self) -> SamplerConfig:
        self._need_resolved()
        return SamplerConfig(
            steps=self.steps, window=self.window, shift=self.shift, context_noise=self.context_noise
        )

    def _need_resolved(self) -> None:
        if self.model_config is None:
            raise ValueError("the serving spec is not resolved yet (ServingSpec.resolve)")

    def runtime_config(self, world_size: int):
        """The per-rank ``RuntimeConfig`` of the torch.distributed runtime."""
        self._need_resolved()
        if self.workers not in (0, world_size):
            raise ValueError(
                f"placement workers {self.workers}: under torchrun every one of the "
                f"{world_size} ranks is a worker (0 or {world_size})"
            )
        return RuntimeConfig(
            # a directory's weights are read on every rank from the same path
            model=self.model if self.model_directory else self.model_config.name,
            resolved_config=self.model_config,
            latent_frames=self.latent_frames,
            resolution=self.resolution,
            vae=self.vae,
            variant=self.variant,
            steps=self.steps,
            window=self.window,
            shift=self.shift,
            context_noise=self.context_noise,
            horizon=self.horizon,
            weights_seed=self.seed,
            weights_path=self.weights,
            dtype=self.dtype,
            device=self.device,
            # A planned placement loads each rank's share of an even split at first; the
            # blocks a stream's admitted placement needs are loaded before it opens.
            placement="even" if self.plan == "auto" else self.plan,
            batching=self.batching,
            **self.distributed_settings(),
        )

    # ---- JSON ---------------------------------------------------------------------------
    def to_json(self) -> str:
        """The resolved spec as JSON text, in the YAML file's sections."""
        self._need_resolved()
        out: dict[str, Any] = {"version": SPEC_VERSION}
        for section, names in SECTIONS.items():
            out[section] = {
                name: dataclasses.asdict(self.model_config)
                if name == "model_config"
                else getattr(self, name)
                for name in names
            }
        return json.dumps(out, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> ServingSpec:
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"serving spec is not JSON: {err}") from None
        if not isinstance(data, dict) or data.get("version") != SPEC_VERSION:
            raise ValueError(
                f"serving spec version {data.get('version') if isinstance(data, dict) else '?'}"
                f", this server reads {SPEC_VERSION}"
            )
        values: dict[str, Any] = {}
        for section, names in SECTIONS.items():
            body = data.get(section)
            if not isinstance(body, dict) or set(body) != set(names):
                raise ValueError(f"serving spec section {section!r} is missing or malformed")
            values.update(body)
        values["model_config"] = model_config_from_json(values["model_config"])
        values["prompts"] = tuple(values["prompts"])
        return cls(**values)


SECTIONS: dict[str, tuple[str, ...]] = {
    "engine": (
        "model",
        "weights",
        "steps",
        "window",
        "shift",
        "horizon",
        "known_rows_ahead",
        "context_noise",
        "seed",
        "latent_frames",
        "resolution",
        "vae",
        "variant",
        "prompts",
        "dtype",
        "device",
        "mode",
        "batching",
        "max_streams",
        "model_config",
    ),
    "placement": ("plan", "workers", "profile"),
    "pool": (
        "policy",
        "default_target_ms",
        "max_utilization",
        "memory_gib",
        "context_chunks",
        "recalibrate",
    ),
    "distributed": DISTRIBUTED_FIELDS,
}
"""YAML section -> the spec's fields it holds."""

LEGACY_KEYS: dict[tuple[str, str], str] = {
    ("engine", "checkpoint"): "weights",
    ("engine", "workers"): "workers",
    ("distributed", "placement"): "plan",
    ("distributed", "model"): "model",
    ("distributed", "steps"): "steps",
    ("distributed", "window"): "window",
    ("distributed", "dtype"): "dtype",
    ("distributed", "device"): "device",
    ("distributed", "batching"): "batching",
}
"""Keys of earlier config files, and the field each now sets."""


def _contract(cfg: ModelConfig, weights) -> WamContract:
    """The contract a served world-action stream is fed by (actions, camera, state inputs by
    name, committed rows), from the weights' metadata; UsageError when there is none to read
    (random weights) or it does not fit the model."""
    fix = "serve a checkpoint physis-train-wam wrote (--weights OUT/weights.safetensors)"
    if weights is None:
        raise UsageError(
            f"{cfg.name}: a world-action model is served with its weights' contract (actions, "
            "camera, state inputs by name); random weights have none",
            fix,
        )
    try:
        contract = WamContract.from_metadata(read_metadata(weights))
    except (ContractError, ValueError) as err:
        raise UsageError(f"{weights}: {err}", fix) from err
    shapes = {
        "actions": (len(contract.action_names), cfg.action_dim),
        "state values": (len(contract.state), cfg.state_dim),
        "rows per chunk": (contract.rows_per_chunk, cfg.action_horizon),
        "frames per chunk": (contract.frames_per_chunk, cfg.frames_per_chunk),
        "image size": ((contract.image_height, contract.image_width), tuple(cfg.image_size)),
    }
    wrong = [
        f"{k} {mine} (model {theirs})" for k, (mine, theirs) in shapes.items() if mine != theirs
    ]
    if wrong:
        raise UsageError(
            f"{weights}: its contract names {', '.join(wrong)}, model {cfg.name} differs", fix
        )
    return contract
