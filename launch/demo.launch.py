"""The closed loop on one machine: workstation.launch.py (physis-serve on loopback, the shipped
push-wm world model on the CPU) and robot.launch.py with sim:=true (sim_robot + bridge),
optionally rviz. The sim's camera is the one push-wm was trained on (config/sim_robot.yaml:
32x32 at 10 Hz). Without ``ros2 launch``, ``physis-demo`` (make demo) starts the same
programs itself and writes a summary and a picture.

    ros2 launch physis_ros demo.launch.py rviz:=true
    ros2 launch physis_ros demo.launch.py model:=push-wam drive:=true    # the model drives
    ros2 launch physis_ros demo.launch.py namespace:=arm1 port:=0 port_file:=/tmp/demo.port
"""

import os

from ament_index_python.packages import get_package_share_directory
from launch.actions import DeclareLaunchArgument, GroupAction, IncludeLaunchDescription
from launch.launch_description_sources import PythonLaunchDescriptionSource
from launch.substitutions import LaunchConfiguration, PythonExpression

from launch import LaunchDescription


def generate_launch_description():
    launch_dir = os.path.join(get_package_share_directory("physis_ros"), "launch")
    arguments = [
        ("model", "push-wm", "model preset physis-serve runs (push-wm: shipped trained weights)"),
        (
            "weights",
            "",
            "weights from physis-train, model named inside ('' = model's shipped ones)",
        ),
        ("port", "50051", "port of the local physis-serve (0: ephemeral, needs port_file)"),
        ("port_file", "", "physis-serve writes its port here and the bridge reads it"),
        ("namespace", "", "namespace of the robot's nodes and topics ('' = none)"),
        ("target_interval_ms", "200.0", "interval the bridge asks between chunks"),
        ("rviz", "false", "start rviz2 with config/physis.rviz"),
        (
            "drive",
            "false",
            "the served world-action model drives sim_robot: goal-push episodes, the arm holds "
            "when no trajectory comes, the bridge sends sim_robot's goal and box centre (with "
            "model:=push-wam)",
        ),
        ("execution", "delay_aware", "the bridge's execution of chunks: delay_aware or naive"),
        ("join", "crossfade", "how the bridge joins chunks: crossfade or replace"),
        ("previews", "false", "the bridge asks for previews and publishes them"),
        ("horizon", "0", "chunks ahead of the newest observation (0: the model's)"),
        ("rollouts", "default", "on, off or default (the server's: on for world models)"),
        (
            "act_on_previews",
            "false",
            "the bridge also executes a world-action model's previews as they arrive (with "
            "drive:=true; implies previews)",
        ),
    ]
    arg = LaunchConfiguration

    def include(name: str, launch_arguments: dict) -> GroupAction:
        source = PythonLaunchDescriptionSource(os.path.join(launch_dir, name))
        # scoped: the two files' arguments do not leak into each other
        return GroupAction(
            [IncludeLaunchDescription(source, launch_arguments=launch_arguments.items())]
        )

    return LaunchDescription(
        [
            *(
                DeclareLaunchArgument(name, default_value=default, description=text)
                for name, default, text in arguments
            ),
            include(
                "workstation.launch.py",
                {
                    "model": arg("model"),
                    "weights": arg("weights"),
                    "host": "127.0.0.1",
                    "port": arg("port"),
                    "port_file": arg("port_file"),
                },
            ),
            include(
                "robot.launch.py",
                {
                    "sim": "true",
                    "namespace": arg("namespace"),
                    "server": ["127.0.0.1:", arg("port")],
                    "server_port_file": arg("port_file"),
                    "target_interval_ms": arg("target_interval_ms"),
                    "rviz": arg("rviz"),
                    "execution": arg("execution"),
                    "join": arg("join"),
                    "previews": arg("previews"),
                    "act_on_previews": arg("act_on_previews"),
                    "horizon": arg("horizon"),
                    "rollouts": arg("rollouts"),
                    "sim_task": PythonExpression(
                        ["'goal_push' if '", arg("drive"), "' == 'true' else 'free'"]
                    ),
                    "task_topic": PythonExpression(
                        ["'goal' if '", arg("drive"), "' == 'true' else ''"]
                    ),
                    "object_topics": PythonExpression(
                        ["\"['box=object_position']\" if '", arg("drive"), "' == 'true' else '[]'"]
                    ),
                    "sim_idle_policy": PythonExpression(
                        ["'hold' if '", arg("drive"), "' == 'true' else 'scripted'"]
                    ),
                },
            ),
        ]
    )
