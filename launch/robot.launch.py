"""Robot side: the physis bridge, with parameters from config/bridge.yaml.

    ros2 launch physis_ros robot.launch.py server:=gpu-box:50051 namespace:=arm

Camera, wrench, joint-state and joint-command topics are relative (remap them in bridge.yaml
or with a namespace); the robot's commanded joint targets on ``joint_command`` condition an
action-conditioned world model. FASTDDS_DEFAULT_PROFILES_FILE points at config/fastdds.xml,
whose shared-memory segment is large enough for camera images (the Fast DDS default loses
640x480 frames).
"""

import os

from ament_index_python.packages import get_package_share_directory
from launch.actions import DeclareLaunchArgument, SetEnvironmentVariable
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node

from launch import LaunchDescription


def generate_launch_description():
    share = get_package_share_directory("physis_ros")
    return LaunchDescription(
        [
            DeclareLaunchArgument(
                "namespace", default_value="", description="namespace of the bridge and its topics"
            ),
            DeclareLaunchArgument(
                "server",
                default_value="127.0.0.1:50051",
                description="host:port of physis-serve on the GPU workstation",
            ),
            DeclareLaunchArgument(
                "params_file",
                default_value=os.path.join(share, "config", "bridge.yaml"),
                description="ROS parameters of the bridge (topics, QoS, safety, markers)",
            ),
            DeclareLaunchArgument(
                "fallback",
                default_value="hold",
                description="what to publish when chunks stop arriving: hold or zeros",
            ),
            DeclareLaunchArgument(
                "fastdds_profile",
                default_value=os.path.join(share, "config", "fastdds.xml"),
                description="Fast DDS XML profile (shared-memory segment sized for images)",
            ),
            SetEnvironmentVariable(
                "FASTDDS_DEFAULT_PROFILES_FILE", LaunchConfiguration("fastdds_profile")
            ),
            Node(
                package="physis_ros",
                executable="bridge",
                name="bridge",
                namespace=LaunchConfiguration("namespace"),
                output="screen",
                parameters=[
                    LaunchConfiguration("params_file"),
                    {
                        "server": LaunchConfiguration("server"),
                        "fallback": LaunchConfiguration("fallback"),
                    },
                ],
            ),
        ]
    )
