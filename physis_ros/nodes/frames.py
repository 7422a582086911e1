"""The simulated push scene's TF frames, as ``geometry_msgs/TransformStamped``.

``table`` is the root (the table centre, x right, y away from the robot: physis_ros.sim.scene),
the fixed frame of config/physis.rviz and of the bridge's ``predicted/ee_path`` markers.
Below it: ``camera`` (static, top-down, optical convention: z into the table, x right, y down
the image), ``arm_base`` (static, at ``BASE_XY``) and the arm's chain ``upper_arm`` ->
``forearm`` -> the tool frame (the pusher at the tip, frame of the wrench), moved by the
joint angles. The frame names are the sim_robot node's parameters.
"""

from __future__ import annotations

import math

from geometry_msgs.msg import TransformStamped

from physis_ros.sim.scene import BASE_XY, LINK_LENGTHS_M

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


def static_transforms(stamp, *, table: str, camera: str) -> list[TransformStamped]:
    """table -> camera (looking down: a half turn about x) and table -> arm_base."""
    cam = transform(stamp, table, camera, (0.0, 0.0, CAMERA_HEIGHT_M))
    cam.transform.rotation.x, cam.transform.rotation.z, cam.transform.rotation.w = 1.0, 0.0, 0.0
    return [cam, transform(stamp, table, "arm_base", (BASE_XY[0], BASE_XY[1], 0.0))]


def arm_transforms(stamp, joint_positions, *, tool: str) -> list[TransformStamped]:
    """arm_base -> upper_arm -> forearm -> tool for the joint angles [shoulder, elbow] (rad)."""
    shoulder, elbow = (float(q) for q in joint_positions)
    upper, fore = LINK_LENGTHS_M
    return [
        transform(stamp, "arm_base", "upper_arm", (0.0, 0.0, 0.0), shoulder),
        transform(stamp, "upper_arm", "forearm", (upper, 0.0, 0.0), elbow),
        transform(stamp, "forearm", tool, (fore, 0.0, 0.0)),
    ]
