"""The closed loop on one machine: workstation.launch.py (physis-serve on loopback, the shipped
push-wm world model on the CPU) and robot.launch.py with sim:=true (sim_robot + bridge),
optionally rviz. The sim's camera is the one push-wm was trained on (config/sim_robot.yaml:
32x32 at 10 Hz). Without ``ros2 launch``, ``physis-demo`` (make demo) starts the same
programs itself and writes a summary and a picture.

    ros2 launch physis_ros demo.launch.py rviz:=true
    ros2 launch physis_ros demo.launch.py model:=push-wam drive:=true    # the model drives
    ros2 launch physis_ros demo.launch.py model:=reach-wam drive:=true
    ros2 launch physis_ros demo.launch.py namespace:=arm1 port:=0 port_file:=/tmp/demo.port

A world-action model's weights say which robot it drives (``physis_ros.demo.drive.Drive``,
read from their metadata when the launch starts): sim_robot runs the scene of the task they
were trained on, and with ``drive:=true`` its episodes, while the bridge takes each
episode's goal on the task's goal topic and the tracked objects the model's contract names.
"""

import os

from ament_index_python.packages import get_package_share_directory
from launch.actions import (
    DeclareLaunchArgument,
    GroupAction,
    IncludeLaunchDescription,
    OpaqueFunction,
)
from launch.launch_description_sources import PythonLaunchDescriptionSource
from launch.substitutions import LaunchConfiguration

from launch import LaunchDescription
from physis_ros.demo.drive import shipped_camera

ROBOT_ARGUMENTS = (
    "namespace", "target_interval_ms", "rviz", "execution", "join", "previews",
    "act_on_previews", "horizon", "rollouts",
)  # fmt: skip
"""demo.launch.py's arguments that robot.launch.py takes as they are."""


def sim_arguments(context) -> dict[str, str]:
    """robot.launch.py's sim_robot and bridge arguments for the served model: its weights'
    scene; with drive:=true, their episodes, held when no trajectory comes, and the bridge
    bound to the episode's goal, the tracked objects and the wrench the model's contract
    takes, drawing the scene's arm (``Drive``)."""
    model = LaunchConfiguration("model").perform(context)
    weights = LaunchConfiguration("weights").perform(context)
    drives = LaunchConfiguration("drive").perform(context) == "true"
    camera = shipped_camera(model, weights or None)
    drive = camera["drive"] if camera is not None else None
    if drives and drive is None:
        raise ValueError(
            f"drive:=true needs a world-action model with its weights (model:={model}"
            f"{f' weights:={weights}' if weights else ''} drives nothing)"
        )
    if drive is None:
        return {}
    if not drives:  # the robot the model knows, its scene's own motion
        return {"sim_scene": drive.scene}
    bridge = drive.bridge_params()
    del bridge["command_joint_names"]  # the bridge takes the contract's action names
    return {
        **{f"sim_{name}": value for name, value in drive.sim_params().items()},
        **{name: str(value) for name, value in bridge.items()},
    }


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
            "the served world-action model drives sim_robot: episodes of the task its weights "
            "were trained on, the arm holds when no trajectory comes, the bridge sends each "
            "episode's goal and the tracked objects the model takes (model:=push-wam, "
            "model:=reach-wam)",
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

    def robot(context) -> dict:
        return {
            "sim": "true",
            "server": ["127.0.0.1:", arg("port")],
            "server_port_file": arg("port_file"),
            **{name: arg(name) for name in ROBOT_ARGUMENTS},
            **sim_arguments(context),
        }

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
            OpaqueFunction(function=lambda context: [include("robot.launch.py", robot(context))]),
        ]
    )
