"""What a model's weights say about the robot physis-demo and demo.launch.py start for it:
the camera it was trained on and, for a world-action model, how it drives ``sim_robot``
(``Drive``: the scene of the task it was trained on, the topics the bridge binds to its
contract), and reading back how sim_robot's episodes go. Reads the safetensors header only
(no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from physis_ros.contract.model import WamContract
from physis_ros.contract.safetensors import read_metadata
from physis_ros.nodes.monitor import diagnostics_by_name
from physis_ros.sim.base import Task
from physis_ros.sim.table import BASE_XY
from physis_ros.sim.tasks import TASKS, get_task
from physis_ros.weights import SHIPPED

WAM_METADATA = ("frame_hz", "action_hz", "action_names", "state_names")
"""What physis-serve reads from a world-action model's weights (serve/wam_requests.py)."""

SIM_OBJECT_TOPIC = "object_position"
"""Where sim_robot publishes its scene's tracked object (as an object tracker would)."""


def trained_task(meta: dict[str, str], contract: WamContract) -> Task:
    """The simulated task a world-action model's weights were trained on: their metadata
    ``task``, else (weights written before it was) the one task their contract fits."""
    if "task" in meta:
        return get_task(meta["task"])
    fitting = []
    for task in TASKS.values():
        try:
            task.check_fits(contract)
        except ValueError:
            continue
        fitting.append(task)
    if len(fitting) != 1:
        raise ValueError(
            f"the weights name no task (metadata 'task') and their contract fits "
            f"{[t.name for t in fitting] or 'no task'}; known tasks: {sorted(TASKS)}"
        )
    return fitting[0]


@dataclass(frozen=True)
class Drive:
    """How sim_robot and the bridge are set up for a world-action model to drive, all from
    its weights: sim_robot runs the episodes (``task: goal_push``) of the scene the model was
    trained on and holds when no trajectory comes; the bridge commands the model's joints,
    opens its stream with each episode's goal from the task's goal topic when the contract
    takes task values, pairs each observation with sim_robot's tracked object when the
    contract takes an object's coordinates and with a wrench only when it takes one (a robot
    without a force sensor sends none), and draws the predicted tool path with the scene's
    arm."""

    scene: str
    label: str
    """sim_robot's episodes report on /diagnostics as ``sim_robot: <label>``."""
    moved: str
    """What the task brings onto its goal (its distance to it is in that report)."""
    action_names: tuple[str, ...]
    task_topic: str
    """'' when the model takes no task values."""
    object_topics: tuple[str, ...]
    """``name=topic`` for each object the contract takes."""
    require_wrench: bool
    link_lengths_m: tuple[float, ...]
    """The scene's arm, base to tip (its joints are the actions' columns, in order)."""

    @classmethod
    def of(cls, meta: dict[str, str]) -> Drive:
        contract = WamContract.from_metadata(meta)
        task = trained_task(meta, contract)
        task.check_fits(contract)
        return cls(
            scene=task.name,
            label=task.label,
            moved=task.moved,
            action_names=contract.action_names,
            task_topic=task.goal_topic if contract.task_names else "",
            object_topics=tuple(f"{name}={SIM_OBJECT_TOPIC}" for name in contract.objects),
            require_wrench=any(s.source == "wrench" for s in contract.state),
            link_lengths_m=tuple(task.scene_type.link_lengths_m),
        )

    def sim_params(self) -> dict:
        return {"scene": self.scene, "task": "goal_push", "idle_policy": "hold"}

    def bridge_params(self) -> dict:
        params: dict = {
            "command_joint_names": list(self.action_names),
            "require_wrench": self.require_wrench,
            "ee_joint_indices": list(range(len(self.link_lengths_m))),
            "link_lengths_m": list(self.link_lengths_m),
            "arm_base_xy_m": list(BASE_XY),
        }
        if self.task_topic:  # its streams open with sim_robot's episode tasks
            params["task_topic"] = self.task_topic
        if self.object_topics:  # sim_robot's tracked object, as a tracker would report it
            params["object_topics"] = list(self.object_topics)
        return params


def weights_path(model: str, weights: str | None = None) -> Path | None:
    """The weights served: ``weights`` when given, else the preset's shipped ones (None:
    it ships none)."""
    return Path(weights) if weights else SHIPPED.get(model)


def shipped_camera(model: str, weights: str | None = None) -> dict | None:
    """For a preset with shipped weights (or the ``weights`` file given): the camera the
    weights were trained on (image size, frame rate), the video one chunk covers and, for a
    world-action model, how it drives (``drive``: a ``Drive``); None for the others. Reads
    the safetensors header only (no torch in this process)."""
    path = weights_path(model, weights)
    if path is None or not path.exists():
        return None
    meta = read_metadata(path)
    height, width = (int(v) for v in meta["image_size"].split("x"))
    frame_hz = float(meta["frame_hz"])
    frames_per_chunk = int(meta.get("frames_per_chunk", "2"))
    drives = meta.get("format") == "physis_ros world-action model"
    lacks = [k for k in WAM_METADATA if k not in meta]
    return {
        "image_height": height,
        "image_width": width,
        "camera_rate_hz": frame_hz,
        "chunk_ms": 1e3 * frames_per_chunk / frame_hz,
        "drives": drives,
        "drive": Drive.of(meta) if drives and not lacks else None,
        "action_names": meta.get("action_names", "").split(","),
        "lacks": lacks,
    }


def episodes_progress(monitor, label: str) -> dict | None:
    """sim_robot's newest episodes status (``sim_robot: <label>``) from /diagnostics (kept
    messages), or None."""
    for _, array in reversed(monitor.messages("/diagnostics")):
        for name, (_, _, values) in diagnostics_by_name(array).items():
            if name.endswith(f": {label}"):
                return values
    return None


def episodes_line(drive: Drive, episodes: dict[str, str]) -> str:
    """One line of sim_robot's episodes status: successes, and where the current one is."""
    distance = next((v for k, v in episodes.items() if k.endswith("_to_goal_m")), "-")
    return (
        f"{drive.label}: {episodes['successes']} of {episodes['finished']} episodes reached the "
        f"goal (median {episodes['median_time_to_goal_s']} s); episode {episodes['episode']}: "
        f"{drive.moved} {distance} m from it"
    )
