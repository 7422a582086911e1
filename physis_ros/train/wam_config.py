"""What determines a ``physis-train-wam`` run (``WamTrainConfig``, checked as it is made),
the contract the model it trains is trained with, and the metadata written beside its weights
(what the engine, the server and physis-eval read). The run itself: ``physis_ros.train.wam``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from physis_ros.contract.model import CONTRACT_KEY, WamContract
from physis_ros.contract.safetensors import read_metadata
from physis_ros.engine.config import get_preset
from physis_ros.eval.closed_loop import ClosedLoopConfig
from physis_ros.sim.base import CONTROL_HZ, FRAME_HZ
from physis_ros.sim.tasks import TASKS, get_task
from physis_ros.train.bag_mapping import MappingError, load_mapping
from physis_ros.train.train import SAVE_DTYPES
from physis_ros.train.wam_data import wam_contract
from physis_ros.train.wam_sources import VAL_SEED0, split_paths

HELD_OUT_SEED0 = ClosedLoopConfig().seed0
"""physis-eval --closed-loop's episodes start here: no training episode may use them."""


GOAL_PROMPT = "goal_xy"
"""The ``prompt`` value of a run conditioned on its task's values (its contract's
``task_features`` prompt); the name is the one every run has written."""


@dataclass(frozen=True, kw_only=True)
class WamTrainConfig:
    """Everything that determines the trained weights."""

    task: str = "push"
    """The simulated task trained on (``physis_ros.sim.tasks``)."""
    model: str = ""
    """Preset (default: the task's: ``push-wam``, ``reach-wam``; or ``push-wam-nowrench``:
    push-wam without the wrench)."""
    episodes: int = 1000
    """Training episodes (expert, with perturbations), seeds 0..episodes-1."""
    val_episodes: int = 40
    steps: int = 3000
    batch_size: int = 16
    chunks: int = 4
    """Chunks per window: 1..max_obs observed, the rest generated."""
    max_obs: int = 3
    window: int = 3
    """W: previous chunks each chunk attends to (the served window)."""
    max_freeze_rows: int = 8
    """Rows after the newest observed frame that may be known (0.4 s at 20 Hz)."""
    hide_history_fraction: float = 0.5
    """Training windows (not validation, kept comparable with earlier runs) whose rows at or
    before the newest observed frame are hidden, so the actions must come from the frames and
    the state. Served requests hide them always (``contract.timeline.known_rows``): the
    shipped push-wam was trained at 0.5, and served at 1.0 it reached 11 of 20 held-out
    episodes against 3."""
    start_fraction: float = 0.0
    """Training windows that open their episode (the first plan, from the arm at rest)."""
    committed_drift_rad: float = 0.0
    """In half the training windows with committed rows, those rows drift off the expert's
    (spread in rad 0.4 s past the newest frame; ``WamWindows._committed_drift``) while the
    targets after them stay the expert's: served, the committed rows are the model's own
    plan, and a model that copies them continues its mistakes. 0: the expert's rows."""
    min_committed_ms: float = 0.0
    """Written into the weights' metadata: served requests (and physis-eval's closed loop)
    commit the robot's plan at least this long after the newest frame (``weights.
    min_committed_ms``). Choose it from a closed-loop evaluation (``physis-eval --closed-loop
    --min-committed-ms``); 0: only what the response latency commits."""
    shift: float = 3.0
    sample_steps: int = 4
    """Noise levels of the K-step sampler (this shift) the windows are trained at."""
    action_weight: float = 2.0
    state_weight: float = 0.5
    lr: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    ema: float = 0.999
    save_dtype: str = "float16"
    init: str = ""
    """Start from these weights (a physis-train-wam checkpoint of the same model: to train
    on from a run's last checkpoint with a new schedule) instead of the seeded ones."""
    prompt: str = GOAL_PROMPT
    """``goal_xy``: each window's stream is conditioned on its task values as the task's
    prompt says (push: its goal; ``contract.model.prompt_features``), as the served streams
    are; "": on the fixed stand-in prompt (the goal only in the camera and the state)."""
    on_policy_from: str = ""
    """Comma-separated checkpoints of the model: each drives ``on_policy_episodes`` training
    episodes in the closed loop with expert takeovers (``wam_onpolicy``; cached), added to
    the expert's episodes (DAgger: list every earlier round's checkpoint to aggregate)."""
    on_policy_episodes: int = 0
    bags: str = ""
    """Comma-separated rosbag2 bags (or folders of them) to train on instead of the task's
    expert episodes, read through ``mapping`` onto the contract of the task's model."""
    val_bags: str = ""
    """Bags to validate on ("": every 10th episode of ``bags``, not trained on)."""
    mapping: str = ""
    """The mapping file (YAML) of ``bags``: which topic feeds which input of the contract."""
    seed: int = 0
    threads: int = 1
    """Torch threads for training, and worker processes for the on-policy episodes."""
    val_every: int = 100
    checkpoint_every: int = 250
    """Write the weights so far (``weights.safetensors``, and kept as ``w<steps>.safetensors``)
    every this many steps (0: only at the end): a long run can be evaluated, or stopped,
    midway."""
    max_minutes: float = 0.0
    """0: no limit; otherwise stop after this many minutes of training."""
    stop_after_steps: int = 0
    """0: run all ``steps``; else stop after this many with the learning-rate schedule of
    ``steps``: reproduces exactly the checkpoint a longer run wrote at that step."""

    @property
    def on_policy_checkpoints(self) -> list[str]:
        return [p for p in self.on_policy_from.split(",") if p]

    def __post_init__(self) -> None:
        if self.task in TASKS and not self.model:  # frozen: the default resolved once
            object.__setattr__(self, "model", get_task(self.task).default_model)
        checks = {
            "task": self.task in TASKS,
            "episodes": self.episodes >= 1,
            "val_episodes": self.val_episodes >= 1,
            "steps": self.steps >= 1,
            "batch_size": self.batch_size >= 1,
            "chunks": self.chunks >= 2,
            "max_obs": 1 <= self.max_obs < self.chunks,
            "window": self.window >= self.max_obs,
            "max_freeze_rows": self.max_freeze_rows >= 0,
            "hide_history_fraction": 0 <= self.hide_history_fraction <= 1,
            "start_fraction": 0 <= self.start_fraction <= 1,
            "committed_drift_rad": self.committed_drift_rad >= 0,
            "min_committed_ms": math.isfinite(self.min_committed_ms) and self.min_committed_ms >= 0,
            "shift": self.shift > 0,
            "sample_steps": self.sample_steps >= 1,
            "action_weight": self.action_weight >= 0,
            "state_weight": self.state_weight >= 0,
            "lr": self.lr > 0,
            "ema": 0 <= self.ema < 1,
            "save_dtype": self.save_dtype in SAVE_DTYPES,
            "threads": self.threads >= 1,
            "val_every": self.val_every >= 1,
            "checkpoint_every": self.checkpoint_every >= 0,
            "max_minutes": self.max_minutes >= 0,
            "stop_after_steps": 0 <= self.stop_after_steps <= self.steps,
            "prompt": self.prompt in ("", GOAL_PROMPT),
            "on_policy_episodes": self.on_policy_episodes >= 0
            and (self.on_policy_episodes > 0) == bool(self.on_policy_from)
            and len(self.on_policy_checkpoints) * self.on_policy_episodes <= HELD_OUT_SEED0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{name} has an invalid value: {getattr(self, name)!r}")
        cfg = get_preset(self.model)
        if not (cfg.action_mode == "predict" and cfg.committed_actions and cfg.state_dim):
            raise ValueError(f"model {self.model!r} is not a world-action model with state")
        wam_contract(cfg, get_task(self.task))  # the preset fits the task
        if self.episodes + self.val_episodes > VAL_SEED0:
            raise ValueError(f"training seeds would reach the validation seeds ({VAL_SEED0}..)")
        for path in self.on_policy_checkpoints:
            if not Path(path).is_file():
                raise ValueError(f"on_policy_from: {path} is not a file")
        self._check_bags()
        if self.init:
            if not Path(self.init).is_file():
                raise ValueError(f"init {self.init} is not a file")
            trained_as = read_metadata(self.init).get("model")
            if trained_as != self.model:
                raise ValueError(f"init {self.init} holds model {trained_as!r}, not {self.model!r}")

    def _check_bags(self) -> None:
        """Bags come with their mapping, which must bind every input of the contract."""
        if bool(self.bags) != bool(self.mapping) or (self.val_bags and not self.bags):
            raise ValueError("--bags and --mapping go together (and --val-bags with them)")
        if not self.bags:
            return
        if self.on_policy_from:
            raise ValueError("on_policy_from drives the simulated task: not with --bags")
        for path in split_paths(self.bags) + split_paths(self.val_bags):
            if not Path(path).exists():
                raise ValueError(f"bags: {path} does not exist")
        try:
            problems = load_mapping(self.mapping).contract_problems(contract(self))
        except MappingError as err:
            raise ValueError(str(err)) from None
        if problems:
            raise ValueError(
                f"mapping {self.mapping} does not feed model {self.model!r}: " + "; ".join(problems)
            )


def contract(cfg: WamTrainConfig) -> WamContract:
    """The contract the model ``cfg`` trains is trained with (written into its weights)."""
    return wam_contract(
        get_preset(cfg.model),
        get_task(cfg.task),
        prompted=bool(cfg.prompt),
        min_committed_ms=cfg.min_committed_ms,
        max_known_rows_ahead=cfg.max_freeze_rows,
    )


def metadata(cfg: WamTrainConfig, extra: dict[str, str]) -> dict[str, str]:
    """What the engine, the server and physis-eval read from the weights."""
    mcfg = get_preset(cfg.model)
    wam = contract(cfg)
    return {
        "format": "physis_ros world-action model",
        "model": cfg.model,
        "window": str(cfg.window),
        "steps": str(cfg.sample_steps),
        "frame_hz": str(float(FRAME_HZ)),
        "action_hz": str(float(CONTROL_HZ)),
        "image_size": f"{mcfg.image_size[0]}x{mcfg.image_size[1]}",
        "frames_per_chunk": str(mcfg.frames_per_chunk),
        "action_names": ",".join(wam.action_names),
        "state_names": ",".join(wam.state_names),
        "task": cfg.task,
        CONTRACT_KEY: wam.to_json(),
        "context_noise": "clean",
        "horizon": "1",
        "max_known_rows_ahead": str(cfg.max_freeze_rows),
        "min_committed_ms": str(float(cfg.min_committed_ms)),
        **({"prompt": cfg.prompt} if cfg.prompt else {"cond_seed": "0"}),
        "train_config": json.dumps(asdict(cfg)),
        "torch": torch.__version__,
        **extra,
    }
