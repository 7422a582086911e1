"""A world-action model's contract: everything the server and the robot need to feed it and
to execute what it predicts, stored as JSON in its weights' metadata (key ``contract``).

A model is trained for one robot and task; the contract says, by name, what it takes and
gives, so that no code path names a robot or a task:

- **actions**: the joint-target rows it predicts: joint names (in the robot's command
  order), unit, rows per second, rows per chunk;
- **camera**: image size and frames per second it was trained at;
- **state**: its proprioceptive inputs, in the model's order, each a name and a source:
  ``joint_position`` / ``joint_velocity`` (key: the joint's name in ``JointState``),
  ``wrench`` (key: ``force_x`` ... ``torque_z``), ``object`` (key ``<object>.<axis>``: a
  tracked object's position, table frame, m), ``task`` (key: a task parameter the stream is
  opened with, e.g. a goal's coordinates; the same for every observation of the stream);
- **prompt**: how the stream's conditioning is made: ``none`` (the trained empty prompt),
  ``text`` (a named or sent text embedding), or ``task_features`` (features of the task
  values ``values``, each divided by ``scale``: ``prompt_features``);
- **committed**: how far the rows the robot has already committed are given to the model
  (at least ``min_ms`` after the newest frame, at most ``max_rows_ahead`` rows), as trained.

The robot sends each observation's state as named values (its bindings of topics to
sources); the server checks them by name against the contract before they enter the model.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

import numpy as np

CONTRACT_KEY = "contract"
"""The safetensors metadata key holding the contract's JSON."""
VERSION = 1
SOURCES = ("joint_position", "joint_velocity", "wrench", "object", "task")
WRENCH_KEYS = ("force_x", "force_y", "force_z", "torque_x", "torque_y", "torque_z")
AXES = ("x", "y", "z")
PROMPT_KINDS = ("none", "text", "task_features")


class ContractError(ValueError):
    """A contract (or the metadata holding it) that cannot be used, saying why."""


@dataclass(frozen=True)
class StateInput:
    """One proprioceptive input: the model's name for it, and where the robot reads it."""

    name: str
    source: str
    """One of ``SOURCES``."""
    key: str
    """Joint name, wrench component, ``<object>.<axis>`` or task value name."""

    def check(self) -> None:
        if not self.name:
            raise ContractError("a state input has no name")
        if self.source not in SOURCES:
            raise ContractError(
                f"state input {self.name!r}: source {self.source!r} is not one of {SOURCES}"
            )
        if self.source == "wrench" and self.key not in WRENCH_KEYS:
            raise ContractError(
                f"state input {self.name!r}: wrench key {self.key!r} is not one of {WRENCH_KEYS}"
            )
        if self.source == "object":
            obj, _, axis = self.key.rpartition(".")
            if not obj or axis not in AXES:
                raise ContractError(
                    f"state input {self.name!r}: object key {self.key!r} is not <object>.<x|y|z>"
                )
        if not self.key:
            raise ContractError(f"state input {self.name!r} has no key")

    @property
    def object_name(self) -> str:
        """The tracked object an ``object`` input reads ("" for other sources)."""
        return self.key.rpartition(".")[0] if self.source == "object" else ""


@dataclass(frozen=True)
class PromptSpec:
    kind: str = "none"
    values: tuple[str, ...] = ()
    """``task_features``: the task values the conditioning is made of, in order."""
    scale: float = 1.0
    """``task_features``: each value is divided by this before its features are taken."""


@dataclass(frozen=True)
class WamContract:
    """A world-action model's contract (module docstring)."""

    action_names: tuple[str, ...]
    action_unit: str
    action_hz: float
    rows_per_chunk: int
    frame_hz: float
    image_height: int
    image_width: int
    frames_per_chunk: int
    state: tuple[StateInput, ...]
    prompt: PromptSpec = field(default_factory=PromptSpec)
    min_committed_ms: float = 0.0
    max_known_rows_ahead: int = 8

    def __post_init__(self) -> None:
        for name in ("action_hz", "frame_hz", "min_committed_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ContractError(f"{name} must be a number, got {value!r}")
        for name in ("rows_per_chunk", "image_height", "image_width", "frames_per_chunk"):
            if not isinstance(getattr(self, name), int):
                raise ContractError(f"{name} must be a whole number, got {getattr(self, name)!r}")
        if not isinstance(self.max_known_rows_ahead, int):
            raise ContractError("max_known_rows_ahead must be a whole number")
        if not self.action_names or len(set(self.action_names)) != len(self.action_names):
            raise ContractError(f"action names must be distinct and not empty: {self.action_names}")
        for name in ("action_hz", "frame_hz"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ContractError(f"{name} must be a rate > 0 per second, got {value}")
        for name in ("rows_per_chunk", "image_height", "image_width", "frames_per_chunk"):
            if getattr(self, name) < 1:
                raise ContractError(f"{name} must be >= 1, got {getattr(self, name)}")
        names = [s.name for s in self.state]
        if len(set(names)) != len(names):
            raise ContractError(f"state names repeat: {names}")
        for s in self.state:
            s.check()
        if self.prompt.kind not in PROMPT_KINDS:
            raise ContractError(f"prompt kind {self.prompt.kind!r} is not one of {PROMPT_KINDS}")
        if self.prompt.kind == "task_features":
            if not self.prompt.values:
                raise ContractError("a task_features prompt names no task values")
            if not (math.isfinite(self.prompt.scale) and self.prompt.scale > 0):
                raise ContractError(f"prompt scale must be > 0, got {self.prompt.scale}")
        if not (math.isfinite(self.min_committed_ms) and self.min_committed_ms >= 0):
            raise ContractError(f"min_committed_ms must be >= 0, got {self.min_committed_ms}")
        if self.max_known_rows_ahead < 0:
            raise ContractError(
                f"max_known_rows_ahead must be >= 0, got {self.max_known_rows_ahead}"
            )

    @property
    def state_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.state)

    @property
    def task_names(self) -> tuple[str, ...]:
        """The task values a stream must be opened with: its task state inputs' keys and its
        prompt's values, in order, each once."""
        keys = [s.key for s in self.state if s.source == "task"] + list(self.prompt.values)
        return tuple(dict.fromkeys(keys))

    @property
    def robot_state(self) -> tuple[StateInput, ...]:
        """The inputs the robot sends with each observation (all but the task's)."""
        return tuple(s for s in self.state if s.source != "task")

    @property
    def objects(self) -> tuple[str, ...]:
        """The tracked objects whose positions the model takes, in order, each once."""
        return tuple(dict.fromkeys(s.object_name for s in self.state if s.source == "object"))

    def to_json(self) -> str:
        body = asdict(self)
        body["version"] = VERSION
        body["kind"] = "world_action"
        return json.dumps(body, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> WamContract:
        try:
            body = json.loads(text)
        except (json.JSONDecodeError, TypeError) as err:
            raise ContractError(f"contract is not JSON: {err}") from None
        if not isinstance(body, dict):
            raise ContractError("contract is not a JSON object")
        if body.pop("version", None) != VERSION or body.pop("kind", None) != "world_action":
            raise ContractError(f"not a version {VERSION} world_action contract")
        try:
            body["action_names"] = tuple(body["action_names"])
            body["state"] = tuple(StateInput(**s) for s in body["state"])
            prompt = dict(body.get("prompt") or {})
            prompt["values"] = tuple(prompt.get("values", ()))
            body["prompt"] = PromptSpec(**prompt)
            return cls(**body)
        except (KeyError, TypeError) as err:
            raise ContractError(f"contract fields are wrong: {err}") from None

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> WamContract:
        """The contract in a weights file's metadata; ContractError when it holds none."""
        if CONTRACT_KEY not in meta:
            raise ContractError(
                "the weights' metadata holds no model contract (key 'contract'): not a "
                "world-action model's weights, or written before contracts"
            )
        return cls.from_json(meta[CONTRACT_KEY])

    # ---- a stream's task values ---------------------------------------------------------
    def check_task(self, task: dict[str, float]) -> None:
        """The task values a stream is opened with: exactly the contract's, all finite."""
        want, have = set(self.task_names), set(task)
        if want != have:
            missing, extra = sorted(want - have), sorted(have - want)
            parts = [f"missing {missing}" if missing else "", f"unknown {extra}" if extra else ""]
            raise ContractError(
                f"task values {'; '.join(p for p in parts if p)}: the model takes "
                f"{list(self.task_names) or 'none'}"
            )
        bad = sorted(k for k, v in task.items() if not math.isfinite(v))
        if bad:
            raise ContractError(f"task values {bad} are not finite numbers")
        if self.prompt.kind == "task_features":  # as far as the model was trained
            scale = self.prompt.scale
            out = sorted(v for v in self.prompt.values if abs(task[v]) > scale)
            if out:
                raise ContractError(
                    f"task values {out} lie outside the range the model was trained on "
                    f"(|value| <= {scale:g})"
                )

    def state_vector(self, values: dict[str, float], task: dict[str, float]) -> np.ndarray:
        """[S] float32 in the contract's order: robot inputs from ``values`` (by name), task
        inputs from the stream's ``task``. KeyError names a missing one."""
        out = np.empty(len(self.state), np.float32)
        for i, s in enumerate(self.state):
            out[i] = task[s.key] if s.source == "task" else values[s.name]
        return out


def prompt_features(values, scale: float, dim: int) -> np.ndarray:
    """[1, dim] float32: the conditioning token of a ``task_features`` prompt, where a text
    encoder's output would go: each value divided by ``scale``, then, at three scales
    (pi, 2 pi, 4 pi), each value's sine and cosine; zero-padded to ``dim``. (A model trained
    on the camera alone planned the same motion for a goal and its mirror image: the task's
    parameters enter as this token.)"""
    v = [float(x) / scale for x in values]
    features = list(v)
    for k in range(3):
        w = math.pi * 2**k
        for x in v:
            features += [math.sin(w * x), math.cos(w * x)]
    if dim < len(features):
        raise ContractError(f"a task_features prompt needs text_dim >= {len(features)}, got {dim}")
    out = np.zeros((1, dim), np.float32)
    out[0, : len(features)] = features
    return out
