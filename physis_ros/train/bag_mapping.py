"""The mapping file: which topics of a robot's rosbag2 bags feed a model, by the names its
contract gives its inputs (``physis-train-wam --bags ... --mapping FILE``, ``physis-train
--mapping FILE``; docs/train_on_bags.md).

A YAML file with these keys (``camera`` and ``command`` required, the rest as the model
needs them)::

    camera: /arm/camera/image_raw      # sensor_msgs/Image or sensor_msgs/CompressedImage
    command:                           # trajectory_msgs/JointTrajectory (first point)
      topic: /arm/joint_command
      joints: [shoulder, elbow]        # joint names in the commands, in the action order
    joint_states: /arm/joint_states    # sensor_msgs/JointState: joint_position/_velocity
    wrench: /arm/wrench                # geometry_msgs/WrenchStamped: wrench inputs
    objects:                           # object name -> geometry_msgs/PointStamped topic
      box: /tracker/box                #   (a model's "<name>.<axis>" inputs)
    task:                              # geometry_msgs/PointStamped: the task's values
      topic: /episode_goal
      names: [goal_x, goal_y]          # what its x, y (, z) are
    slop_s: 0.05                       # a sensor sample this near a frame is paired with it

What belongs here: reading and checking the file (an unknown key, a missing one or a value
of the wrong kind is named), and what a model's contract takes that the mapping does not
bind (``contract_problems``). Reading the bags through it: ``physis_ros.train.bag_episodes``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from physis_ros.contract.model import WamContract

KEYS = ("camera", "command", "joint_states", "wrench", "objects", "task", "slop_s")
DEFAULT_SLOP_S = 0.05
"""Half a 10 Hz camera's period: a sensor sample nearer a frame than this is its partner."""


class MappingError(ValueError):
    """A mapping file that cannot be used, saying which key and why."""


@dataclass(frozen=True)
class CommandBinding:
    topic: str
    joints: tuple[str, ...]
    """Joint names as the commands (and joint states) name them, in the action order."""


@dataclass(frozen=True)
class TaskBinding:
    topic: str
    names: tuple[str, ...]
    """The task values the point's x, y, z are, in order (1 to 3)."""


@dataclass(frozen=True, kw_only=True)
class BagMapping:
    """A mapping file's bindings of topics to a model's inputs (module docstring)."""

    camera: str
    command: CommandBinding
    joint_states: str = ""
    wrench: str = ""
    objects: dict[str, str] = field(default_factory=dict)
    task: TaskBinding | None = None
    slop_s: float = DEFAULT_SLOP_S
    path: str = ""
    """The file it was read from (for messages)."""

    def contract_problems(self, contract: WamContract) -> list[str]:
        """What ``contract`` takes that this mapping does not bind, each with its fix."""
        problems = []
        if self.command.joints != contract.action_names:
            problems.append(
                f"command joints {list(self.command.joints)} are not the model's actions "
                f"{list(contract.action_names)} (in that order)"
            )
        needs = {
            "joint_states": ("joint_position", "joint_velocity"),
            "wrench": ("wrench",),
        }
        for key, sources in needs.items():
            inputs = [s.name for s in contract.robot_state if s.source in sources]
            if inputs and not getattr(self, key):
                problems.append(f"it takes {', '.join(inputs)}: set {key} (a topic)")
        for name in contract.objects:
            if name not in self.objects:
                inputs = [s.name for s in contract.robot_state if s.object_name == name]
                problems.append(
                    f"it takes object {name!r} ({', '.join(inputs)}): add it under objects "
                    f"({name}: <PointStamped topic>)"
                )
        bound = self.task.names if self.task else ()
        missing = [n for n in contract.task_names if n not in bound]
        if missing:
            problems.append(
                f"it takes task values {missing}: set task (topic: <PointStamped topic>, "
                f"names: {list(contract.task_names)})"
            )
        return problems


def load_mapping(path: str | Path) -> BagMapping:
    """The mapping in YAML file ``path``; MappingError naming what is wrong."""
    path = Path(path)
    try:
        body = yaml.safe_load(path.read_text())
    except OSError as err:
        raise MappingError(f"mapping {path}: cannot read it: {err}") from None
    except yaml.YAMLError as err:
        raise MappingError(f"mapping {path}: not YAML: {err}") from None
    try:
        return parse_mapping(body, str(path))
    except MappingError as err:
        raise MappingError(f"mapping {path}: {err}") from None


def parse_mapping(body, path: str = "") -> BagMapping:
    """A mapping from a parsed YAML document (``load_mapping``)."""
    if not isinstance(body, dict):
        raise MappingError("must be a YAML mapping of keys (camera, command, ...)")
    unknown = sorted(set(body) - set(KEYS))
    if unknown:
        raise MappingError(f"unknown keys {unknown}; the keys are {list(KEYS)}")
    for key in ("camera", "command"):
        if key not in body:
            raise MappingError(f"{key} is required")
    command = _section(body, "command", ("topic", "joints"))
    task = _section(body, "task", ("topic", "names")) if body.get("task") is not None else None
    objects = body.get("objects") or {}
    if not isinstance(objects, dict):
        raise MappingError("objects must map object names to topics (box: /tracker/box)")
    slop_s = body.get("slop_s", DEFAULT_SLOP_S)
    if isinstance(slop_s, bool) or not isinstance(slop_s, (int, float)):
        raise MappingError(f"slop_s must be seconds, got {slop_s!r}")
    if not (math.isfinite(slop_s) and slop_s > 0):
        raise MappingError(f"slop_s must be > 0 seconds, got {slop_s}")
    mapping = BagMapping(
        camera=_topic(body["camera"], "camera"),
        command=CommandBinding(
            _topic(command["topic"], "command.topic"), _names(command["joints"], "command.joints")
        ),
        joint_states=_topic(body.get("joint_states", ""), "joint_states", optional=True),
        wrench=_topic(body.get("wrench", ""), "wrench", optional=True),
        objects={str(k): _topic(v, f"objects.{k}") for k, v in objects.items()},
        task=None
        if task is None
        else TaskBinding(_topic(task["topic"], "task.topic"), _names(task["names"], "task.names")),
        slop_s=float(slop_s),
        path=path,
    )
    if mapping.task is not None and len(mapping.task.names) > 3:
        raise MappingError(f"task.names {list(mapping.task.names)}: a point gives at most 3")
    return mapping


def _section(body: dict, key: str, fields: tuple[str, ...]) -> dict:
    section = body[key]
    if not isinstance(section, dict):
        raise MappingError(f"{key} must be a mapping with {list(fields)}")
    unknown = sorted(set(section) - set(fields))
    missing = [f for f in fields if f not in section]
    if unknown or missing:
        raise MappingError(
            f"{key} needs exactly {list(fields)}; missing {missing}, unknown {unknown}"
        )
    return section


def _topic(value, key: str, *, optional: bool = False) -> str:
    """A topic name as bags store it (absolute: a leading / is added)."""
    if value is None or (optional and value == ""):
        if optional:
            return ""
        raise MappingError(f"{key} is required")
    if not isinstance(value, str) or not value.strip("/") or any(c.isspace() for c in value):
        raise MappingError(f"{key} must be a topic name, got {value!r}")
    return value if value.startswith("/") else f"/{value}"


def _names(value, key: str) -> tuple[str, ...]:
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(v, str) and v for v in value)
        or len(set(value)) != len(value)
    ):
        raise MappingError(f"{key} must be a list of distinct names, got {value!r}")
    return tuple(value)
