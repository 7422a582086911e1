"""The bridge node's ROS parameters: one table of (name, default, description, read-only),
declared with ParameterDescriptors and read into a frozen, validated ``BridgeParams``."""

from __future__ import annotations

import ast
import itertools
import math
from dataclasses import dataclass, fields
from pathlib import Path

from rcl_interfaces.msg import ParameterDescriptor
from rclpy.parameter import Parameter

from physis_ros.link.options import ROLLOUT_CHOICES

RELIABILITIES = ("best_effort", "reliable")
JOINS = ("crossfade", "replace")


@dataclass(frozen=True, kw_only=True)
class BridgeParams:
    # inputs (topic names are relative, so namespaces and remapping work)
    image_topic: str = "camera/image"
    """sensor_msgs/Image camera topic ('' to disable)."""
    compressed_image_topic: str = ""
    """sensor_msgs/CompressedImage topic, jpeg or png ('' to disable)."""
    wrench_topic: str = "wrench"
    """geometry_msgs/WrenchStamped force/torque topic."""
    joint_states_topic: str = "joint_states"
    """sensor_msgs/JointState topic."""
    object_topics: tuple[str, ...] = ()
    """Tracked objects, each ``name=topic``: a geometry_msgs/PointStamped topic with the
    object's position (table frame, m) from an object tracker (fiducial tag, motion capture),
    paired with each image by stamp like the wrench; a model whose contract takes object
    ``name`` gets its coordinates (e.g. push-wam: ``box=object``)."""
    command_topic: str = "joint_command"
    """trajectory_msgs/JointTrajectory commanded joint targets, one point, sent with each
    observation as the action the world model is conditioned on ('' to disable)."""
    command_joint_names: tuple[str, ...] = ()
    """Joints taken from each command, in the model's action order (empty: action_names, else
    the joint order of the first command)."""
    command_max_age_s: float = 0.25
    """An image goes without a command when the newest one before it is older than this."""
    command_wait_s: float = 0.05
    """While commands flow, an image waits at most this long for the command in force when it
    was taken, until one stamped at or after the image arrives (on a busy host a command can
    still be in flight when its image is taken); 0: never wait."""
    input_reliability: str = "best_effort"
    """best_effort (sensor-data QoS) or reliable, for all inputs."""
    input_depth: int = 5
    """History depth of the input subscriptions."""
    slop_s: float = 0.02
    """Largest stamp gap between an image and the wrench/joints/object it is paired with."""
    require_wrench: bool = True
    """Only send images that have a wrench within the slop."""
    require_joints: bool = True
    """Only send images that have joint states within the slop."""
    require_object: bool = True
    """With object_topics: only send images that have every object's position within the
    slop."""
    resize_to_model: bool = True
    """Downscale raw images to the model's image size before sending (less to send)."""
    # link
    server: str = "127.0.0.1:50051"
    """host:port of physis-serve."""
    server_port_file: str = ""
    """If set, wait for physis-serve --port-file and use the port written there."""
    token: str = ""
    """Bearer token the server expects ('' for none)."""
    token_file: str = ""
    """File holding the bearer token, read at start (unlike token, not readable as a
    parameter by others on the ROS graph); wins over token."""
    root_cert_path: str = ""
    """CA bundle for TLS ('' for a plaintext link)."""
    client_cert_path: str = ""
    """Client certificate for mutual TLS."""
    client_key_path: str = ""
    """Client key for mutual TLS."""
    connect_timeout_s: float = 5.0
    """Deadline of one connection attempt."""
    seed: int = 0
    """Stream seed (initial noise of chunk c is seeded by (seed, c))."""
    prompt: str = ""
    """Name of a prompt embedding the server holds (its --prompts files); '' for the model's
    empty prompt."""
    task_topic: str = ""
    """geometry_msgs/PointStamped: the task's parameters (e.g. a goal's position, table frame,
    m) for a model whose contract takes task values: the stream opens once one arrives, with
    its x, y, z as the values task_names names, and reopens with each new one ('' to
    disable)."""
    task_names: tuple[str, ...] = ()
    """The task values task_topic's x, y, z are, in order (empty: the model's contract's task
    names)."""
    target_interval_ms: float = 0.0
    """Interval the robot needs between chunks (0: as fast as the server can)."""
    response_latency_budget_ms: float = 0.0
    """Most response latency the robot accepts, observation to chunk (0: none); else refused."""
    previews: bool = False
    """Ask the server for previews (each chunk's x0 estimate after every denoising step but
    the last) and publish them on predicted/preview/step_<k>, before the chunk."""
    horizon: int = 0
    """Chunks ahead of the newest observation the stream predicts (0: the model's)."""
    rollouts: str = "default"
    """on: every observation gets a rollout, the whole horizon generated again from it; off:
    only the chunk a horizon ahead of it; default: the server's (on for world models)."""
    act_on_previews: bool = False
    """A world-action model's stream (timed chunks): also execute each preview's action rows
    when it arrives, through the same timed execution as chunks (past rows skipped, joined to
    the committed rows); a later step's preview and then the chunk itself take over the rows
    not yet executed; a preview after its chunk, or for an older slot, is ignored and counted.
    Asks for previews (as previews: true). A world model's previews stay publish-only."""
    # actions
    action_dt_s: float = 0.0
    """Seconds between action rows (0: the stream's interval / horizon, chunks tile time)."""
    action_lead_s: float = 0.02
    """Row 0 of a chunk applies this long after the chunk was received."""
    action_names: tuple[str, ...] = ()
    """Names of the action dimensions (empty: the joint names, then action_<i>)."""
    joint_names: tuple[str, ...] = ()
    """Joints of the JointTrajectory, in action column order (empty: from joint_states)."""
    action_frame: str = ""
    """frame_id of ActionChunk headers."""
    fallback: str = "hold"
    """What to publish when chunks stop: hold (last joint positions) or zeros."""
    deadline_ms: float = 0.0
    """Stop model actions after this long without a chunk (0: two intervals)."""
    max_observation_age_s: float = 2.0
    """Never publish a chunk conditioned on an observation older than this (0: no limit)."""
    execution: str = "delay_aware"
    """Chunks whose rows say the time they are for (world-action models): delay_aware (rows
    at their time, past ones skipped, committed rows sent back to be continued) or naive (row
    0 on arrival: the baseline)."""
    join: str = "crossfade"
    """How a timed chunk joins the committed trajectory: crossfade (blended over the overlap)
    or replace."""
    fade_rows: int = 4
    """Rows a crossfade spans at most."""
    commands_dt_s: float = 0.05
    """Spacing of the joint-target timeline sent with each observation (world-action models)."""
    # visualisation
    camera_frame: str = "camera"
    """frame_id of the predicted and side-by-side images."""
    side_by_side_height: int = 0
    """Rows of the observed|predicted image (0: the camera image's height, at most 240)."""
    publish_markers: bool = True
    """Publish the predicted end-effector path (actions are joint positions of a planar arm)."""
    marker_frame: str = "table"
    """Frame of the end-effector path markers."""
    ee_joint_indices: tuple[int, ...] = (0, 1)
    """Action columns holding the planar arm's joint angles, base to tip."""
    link_lengths_m: tuple[float, ...] = (0.38, 0.32)
    """Link lengths of the planar arm (the sim's arm by default)."""
    arm_base_xy_m: tuple[float, ...] = (0.0, -0.5)
    """Arm base position in marker_frame."""
    # timers
    watchdog_period_s: float = 0.01
    """How often the action deadline is checked."""
    stats_period_s: float = 1.0
    """How often pipeline_stats and /diagnostics are published."""

    def __post_init__(self) -> None:
        for f in fields(self):
            values = getattr(self, f.name)
            for value in values if isinstance(values, tuple) else (values,):
                if isinstance(value, float) and not math.isfinite(value):
                    raise ValueError(f"{f.name} must be a finite number, got {value}")
        if self.horizon < 0:
            raise ValueError(f"horizon must be >= 0 (0: the model's), got {self.horizon}")
        if self.rollouts not in ROLLOUT_CHOICES:
            raise ValueError(f"rollouts {self.rollouts!r} is not one of {tuple(ROLLOUT_CHOICES)}")
        if self.input_reliability not in RELIABILITIES:
            raise ValueError(
                f"input_reliability {self.input_reliability!r} is not one of {RELIABILITIES}"
            )
        if not self.image_topic and not self.compressed_image_topic:
            raise ValueError(
                "image_topic and compressed_image_topic are both empty: no camera input"
            )
        for name in (
            "slop_s",
            "command_max_age_s",
            "connect_timeout_s",
            "watchdog_period_s",
            "stats_period_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in (
            "action_dt_s",
            "action_lead_s",
            "deadline_ms",
            "max_observation_age_s",
            "target_interval_ms",
            "command_wait_s",
            "response_latency_budget_ms",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.execution not in ("delay_aware", "naive") or self.join not in JOINS:
            raise ValueError(
                f"execution {self.execution!r} must be delay_aware or naive, join {self.join!r} "
                f"one of {JOINS}"
            )
        if self.fade_rows < 1 or not self.commands_dt_s > 0:
            raise ValueError(
                f"fade_rows {self.fade_rows} must be >= 1 and commands_dt_s "
                f"{self.commands_dt_s} > 0"
            )
        if self.input_depth < 1 or self.side_by_side_height < 0:
            raise ValueError(
                f"input_depth {self.input_depth} must be >= 1 and "
                f"side_by_side_height {self.side_by_side_height} >= 0"
            )
        if self.publish_markers and len(self.ee_joint_indices) != len(self.link_lengths_m):
            raise ValueError(
                f"ee_joint_indices {self.ee_joint_indices} and link_lengths_m "
                f"{self.link_lengths_m} differ in length"
            )
        if len(self.arm_base_xy_m) != 2:
            raise ValueError(f"arm_base_xy_m must be [x, y], got {self.arm_base_xy_m}")
        self.objects()  # each binding name=topic
        if len(self.task_names) > 3:
            raise ValueError(f"task_names {self.task_names}: a point gives at most 3 values")

    def objects(self) -> dict[str, str]:
        """Tracked object name -> its topic (object_topics)."""
        out = {}
        for binding in self.object_topics:
            name, sep, topic = binding.partition("=")
            if not sep or not name or not topic or name in out:
                raise ValueError(
                    f"object_topics entry {binding!r} must be name=topic, each name once"
                )
            out[name] = topic
        return out


_READ_ONLY = {
    "image_topic", "compressed_image_topic", "wrench_topic", "joint_states_topic", "object_topics",
    "command_topic", "command_joint_names",
    "input_reliability", "input_depth", "server", "server_port_file", "token", "token_file",
    "root_cert_path", "client_cert_path", "client_key_path", "seed", "target_interval_ms",
    "prompt", "task_topic", "task_names",
    "response_latency_budget_ms", "previews", "act_on_previews", "horizon", "rollouts",
}  # fmt: skip
_ARRAY_TYPES = {
    "object_topics": Parameter.Type.STRING_ARRAY,
    "task_names": Parameter.Type.STRING_ARRAY,
    "command_joint_names": Parameter.Type.STRING_ARRAY,
    "action_names": Parameter.Type.STRING_ARRAY,
    "joint_names": Parameter.Type.STRING_ARRAY,
    "ee_joint_indices": Parameter.Type.INTEGER_ARRAY,
    "link_lengths_m": Parameter.Type.DOUBLE_ARRAY,
    "arm_base_xy_m": Parameter.Type.DOUBLE_ARRAY,
}


def parameter_docs() -> dict[str, str]:
    """name -> description, from the field docstrings above (one source of truth)."""
    # this file's source (inspect.getsource scans every loaded module: seconds at start-up)
    tree = ast.parse(Path(__file__).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "BridgeParams")
    docs: dict[str, str] = {}
    body = cls.body
    for node, following in itertools.pairwise(body):
        if isinstance(node, ast.AnnAssign) and isinstance(following, ast.Expr):
            docs[node.target.id] = " ".join(str(following.value.value).split())
    return docs


def declare_bridge_params(node) -> BridgeParams:
    docs = parameter_docs()
    values = {}
    for f in fields(BridgeParams):
        descriptor = ParameterDescriptor(description=docs[f.name], read_only=f.name in _READ_ONLY)
        if f.name in _ARRAY_TYPES:
            default = list(f.default)
            # an empty list has no type of its own: declare the type, read None as empty
            param = node.declare_parameter(f.name, default or _ARRAY_TYPES[f.name], descriptor)
            values[f.name] = tuple(param.value or ())
        else:
            values[f.name] = node.declare_parameter(f.name, f.default, descriptor).value
    return BridgeParams(**values)
