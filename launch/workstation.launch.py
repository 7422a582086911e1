"""GPU workstation: physis-serve under torchrun, one rank per GPU, with config/serve.yaml.

    ros2 launch physis_ros workstation.launch.py nproc_per_node:=8 host:=0.0.0.0

The workstation needs no ROS at run time; this launch file is a convenience where ROS is
installed (elsewhere run the same torchrun command by hand). A host other than loopback
wants TLS and a token (see serve.yaml).
"""

import os

from ament_index_python.packages import get_package_share_directory
from launch.actions import DeclareLaunchArgument, ExecuteProcess
from launch.substitutions import LaunchConfiguration

from launch import LaunchDescription


def generate_launch_description():
    share = get_package_share_directory("physis_ros")
    return LaunchDescription(
        [
            DeclareLaunchArgument(
                "nproc_per_node",
                default_value="1",
                description="ranks (GPUs) on this node; 1 runs the single-process server",
            ),
            DeclareLaunchArgument(
                "config",
                default_value=os.path.join(share, "config", "serve.yaml"),
                description="physis-serve YAML (frontend and engine sections)",
            ),
            DeclareLaunchArgument(
                "model", default_value="tiny", description="model preset (overrides the config)"
            ),
            DeclareLaunchArgument(
                "host", default_value="127.0.0.1", description="interface physis-serve binds"
            ),
            DeclareLaunchArgument(
                "port", default_value="50051", description="gRPC port physis-serve listens on"
            ),
            ExecuteProcess(
                cmd=[
                    "torchrun",
                    "--standalone",
                    "--nproc-per-node",
                    LaunchConfiguration("nproc_per_node"),
                    "--no-python",
                    "physis-serve",
                    "--config",
                    LaunchConfiguration("config"),
                    "--model",
                    LaunchConfiguration("model"),
                    "--host",
                    LaunchConfiguration("host"),
                    "--port",
                    LaunchConfiguration("port"),
                ],
                output="screen",
                sigterm_timeout="10",
            ),
        ]
    )
