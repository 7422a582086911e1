"""What a simulated task is, whichever robot and goal it has (numpy only, no ROS, no torch).

A task (``Task``) is a robot in a scene with a goal: it draws an episode's start and goal
from a seed, places its scene there, says when the goal is reached, has a scripted expert,
reports the robot's state per camera frame by name (joint positions and velocities, a wrench,
tracked objects' coordinates: what the robot's topics carry) and the episode's task values
(the goal's parameters), and makes the contract (``physis_ros.contract.model``) a
world-action model of it is trained with. ``TaskSim`` steps a task's scene on the clock
below. The tasks by name: ``physis_ros.sim.tasks``.

Clock: physics at ``PHYSICS_HZ``; the camera at ``FRAME_HZ`` (frame n at n / FRAME_HZ s);
joint targets are rows at ``CONTROL_HZ`` (row i is the target the joints are commanded to at
i / CONTROL_HZ s; between rows the target moves linearly, as ``sim_robot`` follows a
``JointTrajectory``). Every task runs on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np

from physis_ros.contract.model import ContractError, PromptSpec, StateInput, WamContract
from physis_ros.sim.table import SceneConfig

PHYSICS_HZ = 100
CONTROL_HZ = 20
FRAME_HZ = 10
TICKS_PER_ROW = PHYSICS_HZ // CONTROL_HZ
TICKS_PER_FRAME = PHYSICS_HZ // FRAME_HZ


class Setup(Protocol):
    """An episode's start and goal, drawn from its seed (a frozen dataclass per task)."""

    task: ClassVar[str]
    """The name of the task it is a setup of."""
    seed: int
    joints: tuple[float, ...]
    """The arm's start (rad, in the task's joint order)."""


class Expert(Protocol):
    def joint_targets(self, scene: Any, previous: np.ndarray, dt_s: float) -> np.ndarray:
        """The next row of joint targets, ``dt_s`` after ``previous`` (the row in force),
        from the scene as it is now."""
        ...


@dataclass
class Episode:
    """One episode of any task, as a robot's topics would carry it: frame n at n / FRAME_HZ
    s, row i at i / CONTROL_HZ s."""

    setup: Setup
    frames: np.ndarray
    """[N, H, W, 3] uint8 camera frames."""
    state: np.ndarray
    """[N, S] float32: the task's state values at each frame (columns ``state_names``)."""
    state_names: tuple[str, ...]
    rows: np.ndarray
    """[M, A] float32 commanded joint targets (the task's joint order)."""
    perturbed: np.ndarray
    """[M] bool: row commanded by a perturbation (or the model), not the expert."""
    task_values: dict[str, float]
    """The episode's task values by name (its goal's parameters)."""
    reached_s: float | None
    """When the goal first counted as reached (None: never: not a success)."""

    @property
    def task(self) -> str:
        return self.setup.task

    @property
    def seed(self) -> int:
        return self.setup.seed

    def values(self, names) -> np.ndarray:
        """[N, len(names)] the state columns ``names``."""
        return self.state[:, [self.state_names.index(n) for n in names]]


class Task:
    """A robot, its scene and its goal. A task fills the class attributes and the methods
    that raise NotImplementedError; what follows from them is here."""

    name: ClassVar[str]
    setup_type: ClassVar[type]
    """Its episodes' setup (a frozen dataclass: ``Setup``)."""
    scene_type: ClassVar[type]
    """Its scene, made from a ``SceneConfig`` (camera size, seed)."""
    label: ClassVar[str]
    """The name of its episodes in logs and diagnostics."""
    joint_names: ClassVar[tuple[str, ...]]
    """The arm's joints, in the order of its joint targets and joint states."""
    state_names: ClassVar[tuple[str, ...]]
    """The values ``state`` reports at each camera frame, in order."""
    task_value_names: ClassVar[tuple[str, ...]]
    """The episode's task values (``task_values``), in order."""
    model_state: ClassVar[tuple[StateInput, ...]]
    """Every state input a model of the task may take (its ``state`` names or task values),
    in the order its models take them: a model with S inputs takes a selection."""
    prompt: ClassVar[PromptSpec]
    """How a prompted model of the task is conditioned on its task values."""
    default_model: ClassVar[str]
    """The model preset ``physis-train-wam --task NAME`` trains."""
    moved: ClassVar[str]
    """What the task brings onto its goal (plots: its path against the goal)."""
    has_wrench: ClassVar[bool] = False
    """Whether the robot reports a wrench at its tool."""
    objects: ClassVar[tuple[str, ...]] = ()
    """Tracked objects whose positions the robot reports (``object_xy``)."""
    goal_topic: ClassVar[str] = "goal"
    """The topic the simulated robot publishes an episode's goal on (PointStamped)."""
    episode_type: ClassVar[type[Episode]] = Episode
    """The record of the task's episodes (a task may name its columns there)."""
    time_limit_s: ClassVar[float]
    """An episode succeeds when the goal is reached within this much simulated time."""
    tolerance_m: ClassVar[float]
    """... with what it moves within this distance of the goal (``succeeded``)."""

    # ---- what a task defines ---------------------------------------------------------
    def sample(self, seed: int) -> Setup:
        """The start and goal of episode ``seed`` (held-out seeds: never trained on)."""
        raise NotImplementedError

    def start(self, scene: Any, setup: Setup) -> None:
        """Place ``scene`` at the setup's start, its goal drawn."""
        raise NotImplementedError

    def goal_xy(self, scene: Any) -> np.ndarray:
        """Where the scene's goal is (table frame, m)."""
        raise NotImplementedError

    def moved_xy(self, scene: Any) -> np.ndarray:
        """Where what the task moves onto its goal is now (table frame, m)."""
        raise NotImplementedError

    def state(self, scene: Any) -> np.ndarray:
        """[len(state_names)] float32: the robot's state now."""
        raise NotImplementedError

    def object_xy(self, scene: Any, name: str) -> np.ndarray:
        """Where the tracked object ``name`` (of ``objects``) is now (table frame, m)."""
        raise KeyError(f"task {self.name!r} tracks no object {name!r}")

    def expert(self, setup: Setup) -> Expert:
        """The scripted expert for the episode ``setup`` starts."""
        raise NotImplementedError

    def task_values(self, setup: Setup) -> dict[str, float]:
        """The episode's task values by name (``task_value_names``)."""
        raise NotImplementedError

    def free_policy(self, seed: int) -> Any | None:
        """The scene's scripted free motion (``joint_targets(scene, t_s)``, for recordings
        without episodes), or None: the task has none and always runs its episodes."""
        return None

    # ---- what follows -----------------------------------------------------------------
    def setup_from_dict(self, fields: dict) -> Setup:
        """A setup from its ``dataclasses.asdict`` (JSON lists back to tuples)."""
        return self.setup_type(
            **{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
        )

    def new_scene(self, image_size: tuple[int, int], seed: int) -> Any:
        """The task's scene with a camera of ``image_size`` [H, W], seeded."""
        return self.scene_type(
            SceneConfig(image_height=image_size[0], image_width=image_size[1], seed=seed)
        )

    def error_m(self, scene: Any) -> float:
        """Distance from what the task moves to its goal."""
        return float(np.linalg.norm(self.moved_xy(scene) - self.goal_xy(scene)))

    def succeeded(self, scene: Any) -> bool:
        """Whether the goal counts as reached now."""
        return self.error_m(scene) <= self.tolerance_m

    @property
    def success_text(self) -> str:
        return f"{self.moved} within {self.tolerance_m:g} m of the goal"

    def contract(
        self,
        *,
        state_names: tuple[str, ...],
        prompted: bool,
        rows_per_chunk: int,
        frames_per_chunk: int,
        image_size: tuple[int, int],
        min_committed_ms: float = 0.0,
        max_known_rows_ahead: int = 8,
    ) -> WamContract:
        """The contract of a model of this task taking the state inputs ``state_names`` (of
        ``model_state``), conditioned on the task's prompt if ``prompted`` (else none), on
        this task's clock."""
        inputs = {s.name: s for s in self.model_state}
        unknown = [n for n in state_names if n not in inputs]
        if unknown:
            raise ContractError(
                f"task {self.name!r} has no state inputs {unknown}; it has {list(inputs)}"
            )
        return WamContract(
            action_names=self.joint_names,
            action_unit="rad",
            action_hz=float(CONTROL_HZ),
            rows_per_chunk=rows_per_chunk,
            frame_hz=float(FRAME_HZ),
            image_height=image_size[0],
            image_width=image_size[1],
            frames_per_chunk=frames_per_chunk,
            state=tuple(inputs[n] for n in state_names),
            prompt=self.prompt if prompted else PromptSpec(),
            min_committed_ms=float(min_committed_ms),
            max_known_rows_ahead=max_known_rows_ahead,
        )

    def check_fits(self, contract: WamContract) -> None:
        """ValueError naming what a model's contract needs that this task does not give: its
        actions must be the task's joints (in order), its robot state among the task's state
        values, its task values among the task's."""
        problems = []
        if contract.action_names != self.joint_names:
            problems.append(
                f"actions {list(contract.action_names)} are not its joints {list(self.joint_names)}"
            )
        missing = [s.name for s in contract.robot_state if s.name not in self.state_names]
        if missing:
            problems.append(f"state {missing} is not among {list(self.state_names)}")
        unknown = [k for k in contract.task_names if k not in self.task_value_names]
        if unknown:
            problems.append(f"task values {unknown} are not among {list(self.task_value_names)}")
        if problems:
            raise ValueError(f"the model does not fit task {self.name!r}: " + "; ".join(problems))


class TaskSim:
    """A task's scene at an episode's start, stepped one physics tick at a time."""

    def __init__(self, task: Task, setup: Setup, *, image_size: tuple[int, int] = (32, 32)):
        self.task, self.setup = task, setup
        self.scene = task.new_scene(image_size, setup.seed)
        task.start(self.scene, setup)
        self.goal = np.asarray(task.goal_xy(self.scene), dtype=np.float64)
        self.tick = 0
        self.reached_s: float | None = None
        """Simulated time at which the goal first counted as reached."""

    @property
    def time_s(self) -> float:
        return self.tick / PHYSICS_HZ

    def step(self, joint_targets: np.ndarray) -> None:
        self.scene.step(1.0 / PHYSICS_HZ, joint_targets)
        self.tick += 1
        if self.reached_s is None and self.task.succeeded(self.scene):
            self.reached_s = self.time_s

    def error_m(self) -> float:
        return self.task.error_m(self.scene)

    def state(self) -> np.ndarray:
        """[S] float32 in the task's ``state_names`` order."""
        return self.task.state(self.scene)

    def moved_xy(self) -> np.ndarray:
        return self.task.moved_xy(self.scene)

    def joint_positions(self) -> np.ndarray:
        return self.scene.joint_positions()

    def render(self) -> np.ndarray:
        return self.scene.render()
