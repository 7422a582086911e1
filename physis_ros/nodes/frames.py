"""A simulated scene's TF frames, as ``geometry_msgs/TransformStamped``.

``table`` is the root (the table centre, x right, y away from the robot: physis_ros.sim.table),
the fixed frame of config/physis.rviz and of the bridge's ``predicted/ee_path`` markers.
Below it: ``camera`` (static, top-down, optical convention: z into the table, x right, y down
the image), ``arm_base`` (static, where the arm stands) and the planar arm's chain of links
``upper_arm`` -> ``forearm`` (-> ``hand`` for a third joint) -> the tool frame (the tip:
push's pusher, frame of the wrench), moved by the joint angles. The table, camera and tool
frame names are the sim_robot node's parameters.
"""

from __future__ import annotations

import math

from geometry_msgs.msg import TransformStamped

CAMERA_HEIGHT_M = 1.0
"""Height of the simulated top-down camera above the table (it sees VIEW_HALF_M around)."""


def transform(
    stamp, parent: str, child: str, xyz: tuple[float, float, float], yaw_rad: float = 0.0
) -> TransformStamped:
    """``child`` at ``xyz`` in ``parent``, rotated by ``yaw_rad`` about z."""
    t = TransformStamped()
    t.header.stamp = stamp
    t.header.frame_id = parent
    t.child_frame_id = child
    t.transform.translation.x, t.transform.translation.y, t.transform.translation.z = (
        float(v) for v in xyz
    )
    t.transform.rotation.z = math.sin(yaw_rad / 2.0)
    t.transform.rotation.w = math.cos(yaw_rad / 2.0)
    return t


LINK_FRAMES = ("upper_arm", "forearm", "hand")
"""The arm's link frames from its base on (an arm with n joints has the first n)."""


def static_transforms(stamp, *, table: str, camera: str, base_xy) -> list[TransformStamped]:
    """table -> camera (looking down: a half turn about x) and table -> arm_base (at
    ``base_xy``, table frame, m)."""
    cam = transform(stamp, table, camera, (0.0, 0.0, CAMERA_HEIGHT_M))
    cam.transform.rotation.x, cam.transform.rotation.z, cam.transform.rotation.w = 1.0, 0.0, 0.0
    return [cam, transform(stamp, table, "arm_base", (float(base_xy[0]), float(base_xy[1]), 0.0))]


def arm_transforms(stamp, joint_positions, *, tool: str, link_lengths_m) -> list[TransformStamped]:
    """arm_base -> upper_arm -> forearm (-> hand) -> tool for a planar arm's joint angles (rad,
    from the base on) and its links' lengths (m)."""
    angles = [float(q) for q in joint_positions]
    if len(angles) != len(link_lengths_m) or len(angles) > len(LINK_FRAMES):
        raise ValueError(f"{len(angles)} joints for {len(link_lengths_m)} links")
    parents = ("arm_base", *LINK_FRAMES[: len(angles)])
    offsets = (0.0, *(float(v) for v in link_lengths_m[:-1]))  # each link's start on its parent
    out = [
        transform(stamp, parent, child, (offset, 0.0, 0.0), angle)
        for parent, child, angle, offset in zip(
            parents[:-1], parents[1:], angles, offsets, strict=True
        )
    ]
    out.append(transform(stamp, parents[-1], tool, (float(link_lengths_m[-1]), 0.0, 0.0)))
    return out
