"""Robot side: the physis bridge (config/bridge.yaml), optionally the simulated robot and rviz.

    ros2 launch physis_ros robot.launch.py server:=gpu-box:50051 namespace:=arm1 \\
        token_file:=token.txt tls_ca:=ca.pem
    ros2 launch physis_ros robot.launch.py sim:=true namespace:=arm1     # no hardware
    ros2 launch physis_ros robot.launch.py sim:=true sim_task:=goal_push sim_idle_policy:=hold
    ros2 launch physis_ros robot.launch.py sim:=true sim_scene:=reach sim_task:=goal_push \
        task_topic:=target

Every topic is relative: ``namespace:=arm1`` gives ``/arm1/camera/image``,
``/arm1/predicted/image``, ``/arm1/pipeline_stats``, ``/arm1/tf``...; only ``/diagnostics``
is global, its statuses named ``arm1/bridge: ...``. Two robots against one workstation are
two of these launches with different namespaces and the same server. ``rviz:=true`` starts
rviz2 with config/physis.rviz in the namespace, reading that namespace's tf. The bridge's
camera, wrench, joint-state and joint-command topics are remapped in bridge.yaml (or by
remapping) to the robot's drivers; ``sim:=true`` starts sim_robot to provide them.
FASTDDS_DEFAULT_PROFILES_FILE points at config/fastdds.xml, whose shared-memory segment is
large enough for camera images (the Fast DDS default loses 640x480 frames).
PHYSIS_PARENT_PID names this launch process: the bridge and sim_robot end when it dies,
however it died (physis_ros/children.py), and a world-action bridge publishes its fallback
as it stops.
"""

import os

from ament_index_python.packages import get_package_share_directory
from launch.actions import DeclareLaunchArgument, OpaqueFunction, SetEnvironmentVariable
from launch.conditions import IfCondition
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node
from launch_ros.parameter_descriptions import ParameterValue

from launch import LaunchDescription
from physis_ros.children import PARENT_PID_ENV

OPTIONAL_BRIDGE_PARAMETERS = {
    "require_wrench": bool,
    "ee_joint_indices": list[int],
    "link_lengths_m": list[float],
    "arm_base_xy_m": list[float],
}
"""Bridge parameters passed only where their launch argument is set (else params_file's)."""


def bridge(context) -> list[Node]:
    """The bridge with params_file, the arguments' values, and those of
    OPTIONAL_BRIDGE_PARAMETERS that are set."""
    arg = LaunchConfiguration
    overrides = {
        "server": ParameterValue(arg("server"), value_type=str),
        "server_port_file": ParameterValue(arg("server_port_file"), value_type=str),
        "token_file": ParameterValue(arg("token_file"), value_type=str),
        "root_cert_path": ParameterValue(arg("tls_ca"), value_type=str),
        "target_interval_ms": ParameterValue(arg("target_interval_ms"), value_type=float),
        "fallback": ParameterValue(arg("fallback"), value_type=str),
        "execution": ParameterValue(arg("execution"), value_type=str),
        "join": ParameterValue(arg("join"), value_type=str),
        "previews": ParameterValue(arg("previews"), value_type=bool),
        "act_on_previews": ParameterValue(arg("act_on_previews"), value_type=bool),
        "horizon": ParameterValue(arg("horizon"), value_type=int),
        "rollouts": ParameterValue(arg("rollouts"), value_type=str),
        "task_topic": ParameterValue(arg("task_topic"), value_type=str),
        "object_topics": ParameterValue(arg("object_topics"), value_type=list[str]),
    }
    for name, kind in OPTIONAL_BRIDGE_PARAMETERS.items():
        if arg(name).perform(context):
            overrides[name] = ParameterValue(arg(name), value_type=kind)
    node = Node(
        package="physis_ros",
        executable="bridge",
        name="bridge",
        namespace=arg("namespace"),
        output="screen",
        parameters=[arg("params_file"), overrides],
    )
    return [node]


def sim_robot(context) -> list[Node]:
    """sim_robot with config/sim_robot.yaml, its task and idle policy, and its scene where
    sim_scene names one."""
    arg = LaunchConfiguration
    overrides = {
        "task": ParameterValue(arg("sim_task"), value_type=str),
        "idle_policy": ParameterValue(arg("sim_idle_policy"), value_type=str),
    }
    scene = arg("sim_scene").perform(context)
    if scene:
        overrides["scene"] = scene
    config = os.path.join(get_package_share_directory("physis_ros"), "config")
    node = Node(
        package="physis_ros",
        executable="sim_robot",
        name="sim_robot",
        namespace=arg("namespace"),
        output="screen",
        parameters=[os.path.join(config, "sim_robot.yaml"), overrides],
    )
    return [node]


def generate_launch_description():
    config = os.path.join(get_package_share_directory("physis_ros"), "config")
    arguments = [
        ("namespace", "", "namespace of this robot's nodes and topics ('' = none)"),
        ("server", "127.0.0.1:50051", "host:port of physis-serve on the GPU workstation"),
        ("server_port_file", "", "wait for this port file of a local physis-serve ('' = none)"),
        ("token_file", "", "file holding the bearer token the server expects ('' = none)"),
        ("tls_ca", "", "CA certificate (PEM) of the server's TLS certificate ('' = plaintext)"),
        (
            "target_interval_ms",
            "200.0",
            "interval the robot asks between chunks (push-wm: one chunk = 200 ms of video)",
        ),
        (
            "params_file",
            os.path.join(config, "bridge.yaml"),
            "ROS parameters of the bridge (topics, QoS, safety, markers)",
        ),
        ("fallback", "hold", "what to publish when chunks stop arriving: hold or zeros"),
        (
            "execution",
            "delay_aware",
            "a world-action model's chunks: rows at the time they are for (delay_aware) or "
            "row 0 on arrival (naive)",
        ),
        ("join", "crossfade", "how a chunk joins the committed trajectory: crossfade or replace"),
        (
            "previews",
            "false",
            "ask for previews (each chunk's x0 estimate after every denoising step but the last) "
            "and publish them on predicted/preview/step_<k>",
        ),
        (
            "act_on_previews",
            "false",
            "a world-action model: also execute each preview's action rows when it arrives (its "
            "chunk takes over after); implies previews. A world model's previews are only shown",
        ),
        (
            "horizon",
            "0",
            "chunks ahead of the newest observation the stream predicts (0: the model's)",
        ),
        (
            "rollouts",
            "default",
            "on: every observation gets the whole horizon generated again from it; off: only the "
            "chunk a horizon ahead; default: the server's (on for world models)",
        ),
        (
            "task_topic",
            "",
            "the task's parameters (PointStamped) a model that takes task values opens its "
            "stream with ('' = none; sim_robot's episodes publish theirs on their task's goal "
            "topic: goal, target)",
        ),
        (
            "object_topics",
            "[]",
            "tracked objects, each name=topic (PointStamped, table frame, from an object "
            "tracker), e.g. \"['box=object_position']\" for push-wam ([] = none)",
        ),
        (
            "require_wrench",
            "",
            "the bridge sends only images with a wrench ('' = params_file's; false for a model "
            "that takes none on a robot without a force sensor)",
        ),
        (
            "ee_joint_indices",
            "",
            "the bridge's predicted tool path: action columns of the arm's joints, base to tip "
            "('' = params_file's), e.g. [0, 1, 2]",
        ),
        ("link_lengths_m", "", "... the arm's link lengths ('' = params_file's)"),
        ("arm_base_xy_m", "", "... the arm's base in the marker frame ('' = params_file's)"),
        ("sim", "false", "also start sim_robot (config/sim_robot.yaml) as the robot"),
        (
            "sim_scene",
            "",
            "sim_robot's scene, the simulated task's robot (push, reach: physis_ros.sim.tasks; "
            "'' = config/sim_robot.yaml's)",
        ),
        (
            "sim_task",
            "free",
            "sim_robot's task: free (its scripted scene) or goal_push (episodes a world-action "
            "model drives)",
        ),
        ("sim_idle_policy", "scripted", "sim_robot without a fresh trajectory: scripted or hold"),
        ("rviz", "false", "also start rviz2 with config/physis.rviz"),
        (
            "fastdds_profile",
            os.path.join(config, "fastdds.xml"),
            "Fast DDS XML profile (shared-memory segment sized for images)",
        ),
    ]
    arg = LaunchConfiguration
    namespace = arg("namespace")
    return LaunchDescription(
        [
            *(
                DeclareLaunchArgument(name, default_value=default, description=text)
                for name, default, text in arguments
            ),
            SetEnvironmentVariable("FASTDDS_DEFAULT_PROFILES_FILE", arg("fastdds_profile")),
            # launch exits on SIGTERM without stopping its processes: they watch it instead
            SetEnvironmentVariable(PARENT_PID_ENV, str(os.getpid())),
            OpaqueFunction(function=bridge),
            OpaqueFunction(function=sim_robot, condition=IfCondition(arg("sim"))),
            Node(
                package="rviz2",
                executable="rviz2",
                name="rviz2",
                namespace=namespace,
                arguments=["-d", os.path.join(config, "physis.rviz")],
                # tf is relative (one tree per robot namespace); rviz2 subscribes to /tf
                remappings=[("/tf", "tf"), ("/tf_static", "tf_static")],
                condition=IfCondition(arg("rviz")),
            ),
        ]
    )
