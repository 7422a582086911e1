"""Headless episode recorder: a simulated task's scene and its scripted motion, written to
rosbag2.

What belongs here: stepping a task's scene (``--scene``: ``push``, the default, moved by its
scripted policy with varied behaviour, or with ``--task goal_push`` running its episodes;
``reach``, which has no free motion, always running its episodes) in simulated time and
writing what ``sim_robot`` would publish — camera images, joint states, the wrench where the
robot has one (push), and where the task runs episodes (each driven by the task's expert, one
goal after another) the goal with each camera frame (push: ``/goal``, reach: ``/target``) and
the tracked object's position (push: the box, ``/object_position``) — plus the commanded joint
targets, as rosbag2 files (MCAP or sqlite3, version 9) through the ``rosbags`` library, so
``ros2 bag info/play``, ``physis-eval`` and the trainers read them. Every topic can be
renamed (``--camera-topic`` ..., as another robot's bags would name them). No rclpy.

Time: every stamp (header and bag receive time) is simulated time, starting at
``EPOCH_S + 3600 * seed`` so bags of different seeds never overlap.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm import tqdm

from physis_ros.cli_errors import cli_main, finite_float
from physis_ros.sim.episodes import GoalEpisodes
from physis_ros.sim.table import SceneConfig
from physis_ros.sim.tasks import TASKS, get_task

IMAGE_TOPIC = "/camera/image_raw"
COMPRESSED_IMAGE_TOPIC = "/camera/image_raw/compressed"
WRENCH_TOPIC = "/wrench"
JOINT_STATE_TOPIC = "/joint_states"
COMMAND_TOPIC = "/joint_command"
"""Commanded joint position targets (trajectory_msgs/JointTrajectory, one point)."""
OBJECT_TOPIC = "/object_position"
"""The tracked object's position (geometry_msgs/PointStamped, table frame), with episodes."""
CAMERA_FRAME = "camera"
TABLE_FRAME = "table"
EPOCH_S = 1_750_000_000
BAG_TASK_SEED0 = 1_000_000
"""A bag of seed s runs its task's episodes of seeds BAG_TASK_SEED0 + 1000 s, + 1, ...:
never a training (0..), held-out (10000..) or validation (20000..) seed of physis-train-wam."""
EPISODE_PAUSE_S = 1.0
"""Between a reached goal and the next episode, as sim_robot's default."""
RAW_ENCODINGS = ("rgb8", "bgr8", "mono8", "rgba8", "bgra8")
COMPRESSED_FORMATS = ("jpeg", "png")
STORAGES = ("mcap", "sqlite3")
RECORD_TASKS = ("free", "goal_push")
"""As sim_robot's ``task``: the scene's free scripted motion, or its episodes (a scene
without free motion always runs its episodes)."""


@dataclass(frozen=True, kw_only=True)
class RecordConfig:
    """One episode: scene, seed, duration, rates, image size/encoding and bag storage."""

    scene: str = "push"
    """The simulated task whose scene is recorded (``physis_ros.sim.tasks``)."""
    seed: int = 0
    """Seeds the scene's initial state and the scripted policy."""
    duration_s: float = 30.0
    """Simulated seconds recorded."""
    control_hz: float = 50.0
    """Rate of the policy, the physics step, joint states, wrench and commands."""
    camera_hz: float = 10.0
    """Camera frame rate; must divide control_hz."""
    image_height: int = 64
    image_width: int = 64
    encoding: str = "rgb8"
    """One of RAW_ENCODINGS (sensor_msgs/Image) or COMPRESSED_FORMATS (CompressedImage)."""
    storage: str = "mcap"
    """``mcap`` (default, as ros2 bag records) or ``sqlite3``."""
    task: str = "free"
    """One of RECORD_TASKS."""
    camera_topic: str = ""
    """"": IMAGE_TOPIC, or COMPRESSED_IMAGE_TOPIC for a compressed encoding."""
    joint_states_topic: str = JOINT_STATE_TOPIC
    command_topic: str = COMMAND_TOPIC
    wrench_topic: str = WRENCH_TOPIC
    goal_topic: str = ""
    """"": the task's goal topic (``/goal``, ``/target``)."""
    object_topic: str = OBJECT_TOPIC

    def __post_init__(self) -> None:
        if self.scene not in TASKS:
            raise ValueError(f"scene {self.scene!r} is not one of {sorted(TASKS)}")
        if self.task not in RECORD_TASKS:
            raise ValueError(f"task {self.task!r} is not one of {RECORD_TASKS}")
        topics = [self.image_topic, self.joint_states_topic, self.command_topic]
        topics += [self.wrench_topic, self.goal_topic_name, self.object_topic]
        bad = [t for t in topics if not t.startswith("/") or len(t) < 2 or " " in t]
        if bad or len(set(topics)) != len(topics):
            raise ValueError(f"topics must be distinct absolute names (/...), got {topics}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if not 0 < self.duration_s <= 3600:
            raise ValueError(f"duration_s must be in (0, 3600], got {self.duration_s}")
        if not 0 < self.camera_hz <= self.control_hz <= 1000:
            raise ValueError(
                f"need 0 < camera_hz ({self.camera_hz}) <= control_hz ({self.control_hz}) <= 1000"
            )
        ratio = self.control_hz / self.camera_hz
        if abs(ratio - round(ratio)) > 1e-9:
            raise ValueError(f"camera_hz {self.camera_hz} must divide control_hz {self.control_hz}")
        if self.encoding not in RAW_ENCODINGS + COMPRESSED_FORMATS:
            raise ValueError(
                f"encoding {self.encoding!r} is not one of {RAW_ENCODINGS + COMPRESSED_FORMATS}"
            )
        if self.storage not in STORAGES:
            raise ValueError(f"storage {self.storage!r} is not one of {STORAGES}")
        SceneConfig(image_height=self.image_height, image_width=self.image_width, seed=self.seed)

    @property
    def compressed(self) -> bool:
        return self.encoding in COMPRESSED_FORMATS

    @property
    def image_topic(self) -> str:
        if self.camera_topic:
            return self.camera_topic
        return COMPRESSED_IMAGE_TOPIC if self.compressed else IMAGE_TOPIC

    @property
    def goal_topic_name(self) -> str:
        return self.goal_topic or f"/{get_task(self.scene).goal_topic}"


@dataclass(frozen=True, kw_only=True)
class EpisodeSummary:
    """What a recorded bag holds."""

    path: str
    scene: str
    seed: int
    duration_s: float
    camera_frames: int
    control_ticks: int
    contact_fraction: float
    """Fraction of control ticks with a contact force above 0.05 N (0 without a wrench)."""
    box_travel_m: float
    """Distance between the tracked object's (push: the box's) first and last position (0
    without one)."""
    goals_reached: int
    """Episodes that reached their goal (0 for a scene recorded without episodes)."""
    record_s: float
    """Wall time spent recording."""


def typestore():
    """The ROS 2 Kilted type store of ``rosbags`` (the distribution the wheels come from)."""
    from rosbags.typesys import Stores, get_typestore

    return get_typestore(Stores.ROS2_KILTED)


def encode_image(rgb: np.ndarray, encoding: str) -> tuple[bytes, int]:
    """(data, step) of an [H, W, 3] uint8 RGB image in a raw ROS encoding, or (data, 0) for a
    compressed format."""
    if encoding == "rgb8":
        out = rgb
    elif encoding == "bgr8":
        out = rgb[..., ::-1]
    elif encoding == "mono8":
        # ITU-R 601 luma, as cv_bridge / OpenCV convert
        out = np.round(rgb.astype(np.float32) @ np.array([0.299, 0.587, 0.114], np.float32))
        out = out.astype(np.uint8)
    elif encoding in ("rgba8", "bgra8"):
        chans = rgb if encoding == "rgba8" else rgb[..., ::-1]
        alpha = np.full((*rgb.shape[:2], 1), 255, np.uint8)
        out = np.concatenate([chans, alpha], axis=-1)
    elif encoding in COMPRESSED_FORMATS:
        buf = io.BytesIO()
        Image.fromarray(rgb).save(buf, format=encoding.upper(), quality=95)
        return buf.getvalue(), 0
    else:
        raise ValueError(
            f"encoding {encoding!r} is not one of {RAW_ENCODINGS + COMPRESSED_FORMATS}"
        )
    out = np.ascontiguousarray(out)
    step = out.shape[1] * (out.shape[2] if out.ndim == 3 else 1)
    return out.tobytes(), step


class _Messages:
    """Builds the recorded messages from the scene's state (rosbags message classes)."""

    def __init__(self, store, joint_names: tuple[str, ...]) -> None:
        self.store = store
        types = store.types
        self._time = types["builtin_interfaces/msg/Time"]
        self._duration = types["builtin_interfaces/msg/Duration"]
        self._header = types["std_msgs/msg/Header"]
        self._image = types["sensor_msgs/msg/Image"]
        self._compressed = types["sensor_msgs/msg/CompressedImage"]
        self._wrench_stamped = types["geometry_msgs/msg/WrenchStamped"]
        self._wrench = types["geometry_msgs/msg/Wrench"]
        self._vector = types["geometry_msgs/msg/Vector3"]
        self._joint_state = types["sensor_msgs/msg/JointState"]
        self._trajectory = types["trajectory_msgs/msg/JointTrajectory"]
        self._point_stamped = types["geometry_msgs/msg/PointStamped"]
        self._point_xyz = types["geometry_msgs/msg/Point"]
        self._point = types["trajectory_msgs/msg/JointTrajectoryPoint"]
        self.joint_names = list(joint_names)

    def header(self, stamp_ns: int, frame_id: str):
        stamp = self._time(sec=stamp_ns // 1_000_000_000, nanosec=stamp_ns % 1_000_000_000)
        return self._header(stamp=stamp, frame_id=frame_id)

    def image(self, stamp_ns: int, rgb: np.ndarray, encoding: str):
        data, step = encode_image(rgb, encoding)
        payload = np.frombuffer(data, np.uint8)
        if encoding in COMPRESSED_FORMATS:
            return self._compressed(
                header=self.header(stamp_ns, CAMERA_FRAME), format=encoding, data=payload
            )
        return self._image(
            header=self.header(stamp_ns, CAMERA_FRAME),
            height=rgb.shape[0],
            width=rgb.shape[1],
            encoding=encoding,
            is_bigendian=0,
            step=step,
            data=payload,
        )

    def wrench(self, stamp_ns: int, w: np.ndarray):
        vec = self._vector
        body = self._wrench(force=vec(x=w[0], y=w[1], z=w[2]), torque=vec(x=w[3], y=w[4], z=w[5]))
        return self._wrench_stamped(header=self.header(stamp_ns, "pusher"), wrench=body)

    def point(self, stamp_ns: int, xy):
        """A point on the table (z 0), as sim_robot publishes a goal."""
        xyz = self._point_xyz(x=float(xy[0]), y=float(xy[1]), z=0.0)
        return self._point_stamped(header=self.header(stamp_ns, TABLE_FRAME), point=xyz)

    def joint_state(self, stamp_ns: int, q: np.ndarray, qd: np.ndarray):
        return self._joint_state(
            header=self.header(stamp_ns, ""),
            name=self.joint_names,
            position=np.asarray(q, np.float64),
            velocity=np.asarray(qd, np.float64),
            effort=np.zeros(0, np.float64),
        )

    def command(self, stamp_ns: int, targets: np.ndarray):
        point = self._point(
            positions=np.asarray(targets, np.float64),
            velocities=np.zeros(0, np.float64),
            accelerations=np.zeros(0, np.float64),
            effort=np.zeros(0, np.float64),
            time_from_start=self._duration(sec=0, nanosec=0),
        )
        return self._trajectory(
            header=self.header(stamp_ns, TABLE_FRAME), joint_names=self.joint_names, points=[point]
        )


def record_episode(path: Path | str, cfg: RecordConfig) -> EpisodeSummary:
    """Record one episode into a new bag directory ``path`` (must not exist)."""
    from rosbags.rosbag2 import StoragePlugin, Writer

    path = Path(path)
    t0_wall = time.perf_counter()
    store = typestore()
    start_ns = (EPOCH_S + 3600 * cfg.seed) * 1_000_000_000
    run = _SceneRun(cfg, start_ns)
    msgs = _Messages(store, run.scene.joint_names)
    plugin = StoragePlugin.MCAP if cfg.storage == "mcap" else StoragePlugin.SQLITE3
    control_dt_s = 1.0 / cfg.control_hz
    ticks_per_frame = round(cfg.control_hz / cfg.camera_hz)
    n_ticks = round(cfg.duration_s * cfg.control_hz)
    contact_ticks = 0
    frames = 0
    with Writer(path, version=9, storage_plugin=plugin) as writer:
        conns = _connections(writer, store, cfg, run)

        def write(kind: str, stamp_ns: int, msg) -> None:
            conn = conns[kind]
            writer.write(conn, stamp_ns, store.serialize_cdr(msg, conn.msgtype))

        # tick i: observe at t_i (camera every ticks_per_frame), command, step to t_{i+1}
        for tick in range(n_ticks + 1):
            stamp_ns = start_ns + round(tick * control_dt_s * 1e9)
            scene = run.scene
            write(
                "joints",
                stamp_ns,
                msgs.joint_state(stamp_ns, scene.joint_positions(), scene.joint_velocities()),
            )
            if "wrench" in conns:
                write("wrench", stamp_ns, msgs.wrench(stamp_ns, scene.wrench()))
                contact_ticks += int(np.linalg.norm(scene.wrench()[:2]) > 0.05)
            if "object" in conns:
                write("object", stamp_ns, msgs.point(stamp_ns, run.object_xy()))
            if tick % ticks_per_frame == 0:
                write("image", stamp_ns, msgs.image(stamp_ns, scene.render(), cfg.encoding))
                frames += 1
                if "goal" in conns:
                    write("goal", stamp_ns, msgs.point(stamp_ns, run.task.goal_xy(scene)))
            if tick == n_ticks:
                break
            targets = run.targets(tick * control_dt_s, control_dt_s)
            write("command", stamp_ns, msgs.command(stamp_ns, targets))
            run.step(control_dt_s, targets, stamp_ns + round(control_dt_s * 1e9))
    return EpisodeSummary(
        path=str(path),
        scene=cfg.scene,
        seed=cfg.seed,
        duration_s=n_ticks * control_dt_s,
        camera_frames=frames,
        control_ticks=n_ticks,
        contact_fraction=contact_ticks / (n_ticks + 1),
        box_travel_m=run.object_travel_m(),
        goals_reached=run.episodes.successes if run.episodes is not None else 0,
        record_s=time.perf_counter() - t0_wall,
    )


class _SceneRun:
    """The recorded scene and what moves it: its free scripted policy, or (a task without
    one) its episodes, each driven by the task's expert."""

    def __init__(self, cfg: RecordConfig, start_ns: int) -> None:
        self.task = get_task(cfg.scene)
        self.scene = self.task.new_scene((cfg.image_height, cfg.image_width), cfg.seed)
        self.policy = self.task.free_policy(cfg.seed) if cfg.task == "free" else None
        self.episodes = None
        if self.policy is None:
            seed0 = BAG_TASK_SEED0 + 1000 * cfg.seed
            self.episodes = GoalEpisodes(seed0, EPISODE_PAUSE_S, task=self.task.name)
            # on the bag's clock: the first episode runs its full course like the others
            self.episodes.start(self.scene, start_ns)
        self._previous = self.scene.joint_positions()
        self._object_start = self.object_xy()

    def targets(self, t_s: float, dt_s: float) -> np.ndarray:
        """The joint targets commanded at ``t_s`` for the next ``dt_s``."""
        if self.policy is not None:
            return self.policy.joint_targets(self.scene, t_s)
        return self.episodes.expert.joint_targets(self.scene, self._previous, dt_s)

    def step(self, dt_s: float, targets: np.ndarray, now_ns: int) -> None:
        self.scene.step(dt_s, targets)
        self._previous = targets
        if self.episodes is not None and self.episodes.after_step(self.scene, now_ns):
            self._previous = self.scene.joint_positions()  # the next episode's start

    def object_xy(self) -> np.ndarray | None:
        """The task's tracked object's position now (push: the box), None without one."""
        objects = self.task.objects
        return self.task.object_xy(self.scene, objects[0]).copy() if objects else None

    def object_travel_m(self) -> float:
        if self._object_start is None:
            return 0.0
        return float(np.linalg.norm(self.object_xy() - self._object_start))


def _connections(writer, store, cfg: RecordConfig, run: _SceneRun) -> dict:
    """The bag's topics: camera, joint states and commands; the wrench where the robot has
    one; the goal and the tracked object where the task runs episodes."""
    image_type = "sensor_msgs/msg/CompressedImage" if cfg.compressed else "sensor_msgs/msg/Image"
    point = "geometry_msgs/msg/PointStamped"
    topics = {
        "image": (cfg.image_topic, image_type),
        "wrench": (cfg.wrench_topic, "geometry_msgs/msg/WrenchStamped"),
        "joints": (cfg.joint_states_topic, "sensor_msgs/msg/JointState"),
        "command": (cfg.command_topic, "trajectory_msgs/msg/JointTrajectory"),
        "goal": (cfg.goal_topic_name, point),
        "object": (cfg.object_topic, point),
    }
    if not run.task.has_wrench:
        del topics["wrench"]
    if run.episodes is None:
        del topics["goal"]
    if run.episodes is None or not run.task.objects:
        del topics["object"]
    return {
        kind: writer.add_connection(topic, msgtype, typestore=store)
        for kind, (topic, msgtype) in topics.items()
    }


TOPIC_OPTIONS = {
    "camera_topic": f"camera topic (default {IMAGE_TOPIC}, compressed: {COMPRESSED_IMAGE_TOPIC})",
    "joint_states_topic": f"joint states topic (default {JOINT_STATE_TOPIC})",
    "command_topic": f"commanded joint targets topic (default {COMMAND_TOPIC})",
    "wrench_topic": f"wrench topic, where the robot has one (default {WRENCH_TOPIC})",
    "goal_topic": "goal topic, with episodes (default the task's: /goal, /target)",
    "object_topic": f"tracked object topic, with episodes (default {OBJECT_TOPIC})",
}
"""RecordConfig's topic fields, each a ``--`` option: another robot's names for the topics."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="physis-record", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="folder that receives one bag per episode")
    parser.add_argument(
        "--scene",
        default="push",
        choices=sorted(TASKS),
        help="push (the arm and its box, scripted) or reach (the 3-joint arm, its targets)",
    )
    parser.add_argument(
        "--task",
        default="free",
        choices=RECORD_TASKS,
        help="free: the scene's scripted motion; goal_push: its episodes, each driven by the "
        "task's expert (reach always runs them)",
    )
    parser.add_argument("--episodes", type=int, default=1, help="number of episodes (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first episode")
    parser.add_argument(
        "--duration-s", type=finite_float, default=30.0, help="simulated seconds per episode"
    )
    parser.add_argument(
        "--control-hz", type=finite_float, default=50.0, help="policy/physics/sensor rate"
    )
    parser.add_argument("--camera-hz", type=finite_float, default=10.0, help="camera frame rate")
    parser.add_argument("--height", type=int, default=64, help="image height (pixels)")
    parser.add_argument("--width", type=int, default=64, help="image width (pixels)")
    parser.add_argument(
        "--encoding",
        default="rgb8",
        choices=RAW_ENCODINGS + COMPRESSED_FORMATS,
        help="image encoding",
    )
    parser.add_argument(
        "--storage", default="mcap", choices=STORAGES, help="rosbag2 storage plugin"
    )
    defaults = RecordConfig()
    for field_name, text in TOPIC_OPTIONS.items():
        option = "--" + field_name.replace("_", "-")
        parser.add_argument(option, default=getattr(defaults, field_name), help=text)
    return parser


@cli_main("physis-record")
def main(argv: list[str] | None = None) -> int:
    """``physis-record OUT_DIR``: record episodes of seeds [seed, seed + episodes)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.episodes < 1:
        parser.error(f"--episodes must be >= 1, got {args.episodes}")
    try:
        configs = [
            RecordConfig(
                scene=args.scene,
                task=args.task,
                seed=args.seed + i,
                duration_s=args.duration_s,
                control_hz=args.control_hz,
                camera_hz=args.camera_hz,
                image_height=args.height,
                image_width=args.width,
                encoding=args.encoding,
                storage=args.storage,
                **{name: getattr(args, name) for name in TOPIC_OPTIONS},
            )
            for i in range(args.episodes)
        ]
    except ValueError as err:
        parser.error(str(err))
    args.out_dir.mkdir(parents=True, exist_ok=True)

    for cfg in tqdm(configs, desc="episodes", unit="bag", file=sys.stderr):
        bag = args.out_dir / f"episode_{cfg.seed:05d}"
        if bag.exists():
            print(
                f"physis-record: {bag} exists, skipped (bags are never overwritten)",
                file=sys.stderr,
            )
            continue
        summary = record_episode(bag, cfg)
        print(json.dumps(asdict(summary)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
