"""The closed-loop demo on one machine: sim_robot + physis-serve (CPU, the shipped push-wm
world model) + bridge, optionally rviz with config/physis.rviz. The camera runs at the size
and rate push-wm was trained on (32x32, 10 Hz). Without ``ros2 launch``, ``physis-demo`` (make demo)
starts the same processes itself.

    ros2 launch physis_ros demo.launch.py rviz:=true
"""

import os

from ament_index_python.packages import get_package_share_directory
from launch.actions import DeclareLaunchArgument, ExecuteProcess, SetEnvironmentVariable
from launch.conditions import IfCondition
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node

from launch import LaunchDescription


def generate_launch_description():
    share = get_package_share_directory("physis_ros")
    config = os.path.join(share, "config")
    return LaunchDescription(
        [
            DeclareLaunchArgument(
                "model",
                default_value="push-wm",
                description="model preset physis-serve runs (push-wm: shipped trained weights)",
            ),
            DeclareLaunchArgument(
                "port", default_value="50051", description="port of the local physis-serve"
            ),
            DeclareLaunchArgument(
                "rviz", default_value="false", description="start rviz2 with physis.rviz"
            ),
            DeclareLaunchArgument(
                "fastdds_profile",
                default_value=os.path.join(config, "fastdds.xml"),
                description="Fast DDS XML profile (shared-memory segment sized for images)",
            ),
            SetEnvironmentVariable(
                "FASTDDS_DEFAULT_PROFILES_FILE", LaunchConfiguration("fastdds_profile")
            ),
            ExecuteProcess(
                cmd=[
                    "physis-serve",
                    "--config",
                    os.path.join(config, "serve.yaml"),
                    "--model",
                    LaunchConfiguration("model"),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    LaunchConfiguration("port"),
                ],
                output="screen",
            ),
            Node(
                package="physis_ros",
                executable="sim_robot",
                name="sim_robot",
                output="screen",
                parameters=[
                    os.path.join(config, "sim_robot.yaml"),
                    # what push-wm was trained on (physis_ros/weights metadata)
                    {"camera_rate_hz": 10.0, "image_height": 32, "image_width": 32},
                ],
            ),
            Node(
                package="physis_ros",
                executable="bridge",
                name="bridge",
                output="screen",
                parameters=[
                    os.path.join(config, "bridge.yaml"),
                    {
                        "server": ["127.0.0.1:", LaunchConfiguration("port")],
                        # push-wm's action columns (its metadata action_names): sim_robot's
                        # joint_command positions, sent with each image, condition it
                        "command_joint_names": ["shoulder", "elbow"],
                    },
                ],
            ),
            Node(
                package="rviz2",
                executable="rviz2",
                name="rviz2",
                arguments=["-d", os.path.join(config, "physis.rviz")],
                condition=IfCondition(LaunchConfiguration("rviz")),
            ),
        ]
    )
