"""Builds the bridge's outgoing messages from plain values: ActionChunk, JointTrajectory,
the predicted end-effector path as a MarkerArray, PipelineStats and the DiagnosticArray.
No state and no publishing here; the node decides what and when."""

from __future__ import annotations

import numpy as np
from builtin_interfaces.msg import Duration, Time
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from geometry_msgs.msg import Point
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint
from visualization_msgs.msg import Marker, MarkerArray

from physis_ros.msg import ActionChunk, PipelineStats
from physis_ros.nodes.conversions import planar_fk

CONNECTION_STATES = {
    "connecting": PipelineStats.CONNECTING,
    "connected": PipelineStats.CONNECTED,
    "streaming": PipelineStats.STREAMING,
    "disconnected": PipelineStats.DISCONNECTED,
}


def time_msg(stamp_ns: int) -> Time:
    return Time(sec=int(stamp_ns // 1_000_000_000), nanosec=int(stamp_ns % 1_000_000_000))


def duration_msg(duration_ns: int) -> Duration:
    return Duration(sec=int(duration_ns // 1_000_000_000), nanosec=int(duration_ns % 1_000_000_000))


def action_chunk_msg(
    *,
    actions: np.ndarray,
    start_ns: int,
    dt_s: float,
    names: list[str],
    frame_id: str,
    source: int,
    stream_id: int = 0,
    chunk_index: int = 0,
    observation_seq: int = -1,
    observation_stamp_ns: int = 0,
) -> ActionChunk:
    msg = ActionChunk()
    msg.header.stamp = time_msg(start_ns)
    msg.header.frame_id = frame_id
    msg.source = source
    msg.stream_id = int(stream_id)
    msg.chunk_index = int(chunk_index)
    msg.observation_seq = int(observation_seq)
    msg.observation_stamp = time_msg(max(0, observation_stamp_ns))
    msg.action_names = list(names)
    msg.dt = float(dt_s)
    msg.horizon, msg.dim = int(actions.shape[0]), int(actions.shape[1])
    msg.data = np.ascontiguousarray(actions, dtype=np.float32).ravel().tolist()
    return msg


def trajectory_msg(
    *, actions: np.ndarray, start_ns: int, dt_s: float, joint_names: list[str]
) -> JointTrajectory:
    """Positions for the first len(joint_names) action columns, row i at start + i*dt."""
    msg = JointTrajectory()
    msg.header.stamp = time_msg(start_ns)
    msg.joint_names = list(joint_names)
    dt_ns = int(dt_s * 1e9)
    for i, row in enumerate(actions):
        point = JointTrajectoryPoint()
        point.positions = [float(v) for v in row[: len(joint_names)]]
        point.time_from_start = duration_msg(i * dt_ns)
        msg.points.append(point)
    return msg


def timed_trajectory_msg(
    *, stamp_ns: int, times_from_start_ns, rows: np.ndarray, joint_names: list[str]
) -> JointTrajectory:
    """Positions for the first len(joint_names) columns of ``rows``, point i reached
    times_from_start_ns[i] after ``stamp_ns`` (the publishing time: "from now")."""
    msg = JointTrajectory()
    msg.header.stamp = time_msg(stamp_ns)
    msg.joint_names = list(joint_names)
    for row, from_start in zip(rows, times_from_start_ns, strict=True):
        point = JointTrajectoryPoint()
        point.positions = [float(v) for v in row[: len(joint_names)]]
        point.time_from_start = duration_msg(int(from_start))
        msg.points.append(point)
    return msg


def ee_path_markers(
    *,
    actions: np.ndarray,
    stamp_ns: int,
    frame_id: str,
    joint_indices: list[int],
    link_lengths_m: list[float],
    base_xy_m: list[float],
    source: int,
) -> MarkerArray:
    """The predicted end-effector path (line + points) by planar forward kinematics;
    green for model actions (yellow-green: an acted-on preview), red for a fallback."""
    xy = planar_fk(actions[:, joint_indices], link_lengths_m, tuple(base_xy_m))
    points = [Point(x=float(x), y=float(y), z=0.01) for x, y in xy]
    color = {  # the model's chunks green, its previews yellow-green, fallbacks red
        ActionChunk.SOURCE_MODEL: (0.1, 0.8, 0.2),
        ActionChunk.SOURCE_MODEL_PREVIEW: (0.6, 0.8, 0.2),
    }.get(source, (0.9, 0.1, 0.1))
    markers = MarkerArray()
    for marker_id, (kind, scale) in enumerate(
        ((Marker.LINE_STRIP, 0.006), (Marker.SPHERE_LIST, 0.015))
    ):
        m = Marker()
        m.header.stamp = time_msg(stamp_ns)
        m.header.frame_id = frame_id
        m.ns = "predicted_ee_path"
        m.id = marker_id
        m.type = kind
        m.action = Marker.ADD
        m.pose.orientation.w = 1.0
        m.scale.x = m.scale.y = m.scale.z = scale
        m.color.r, m.color.g, m.color.b = color
        m.color.a = 1.0
        m.points = points
        markers.markers.append(m)
    return markers


def _kv(values: dict) -> list[KeyValue]:
    return [
        KeyValue(key=k, value=f"{v:.3f}" if isinstance(v, float) else str(v))
        for k, v in values.items()
    ]


def diagnostic_array(*, stamp_ns: int, node_name: str, report: dict) -> DiagnosticArray:
    """Three statuses: inputs, output, link. ``report`` holds (level, message, values) each."""
    array = DiagnosticArray()
    array.header.stamp = time_msg(stamp_ns)
    for part in ("inputs", "output", "link"):
        level, message, values = report[part]
        status = DiagnosticStatus()
        status.level = level
        status.name = f"{node_name}: {part}"
        status.message = message
        status.hardware_id = "physis"
        status.values = _kv(values)
        array.status.append(status)
    return array


LEVEL_OK = DiagnosticStatus.OK
LEVEL_WARN = DiagnosticStatus.WARN
LEVEL_ERROR = DiagnosticStatus.ERROR
