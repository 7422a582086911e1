"""GPU workstation: physis-serve, by default the shipped push-wm world model on loopback.

    ros2 launch physis_ros workstation.launch.py
    ros2 launch physis_ros workstation.launch.py host:=0.0.0.0 \\
        tls_cert:=server.pem tls_key:=server.key token_file:=token.txt
    ros2 launch physis_ros workstation.launch.py nproc_per_node:=8 model:=NAME weights:=W

``nproc_per_node`` 1 runs the single-process server; more run it under ``physis-torchrun``
(torchrun with this package's interpreter, ending quietly on Ctrl-C), one rank per GPU,
rank 0 serving. Both programs are this package's executables (``lib/physis_ros``), so the
launch file works in any sourced workspace. The server needs no ROS; without ROS run the
same ``physis-serve`` command line (README: "Two machines"). Anything but loopback wants
TLS and a token. PHYSIS_PARENT_PID names this launch process: physis-serve (or
physis-torchrun and its ranks) ends when it dies, however it died (physis_ros/children.py).
"""

import os

from ament_index_python.packages import get_package_share_directory
from launch.actions import (
    DeclareLaunchArgument,
    ExecuteProcess,
    OpaqueFunction,
    SetEnvironmentVariable,
)
from launch.substitutions import LaunchConfiguration
from launch_ros.substitutions import ExecutableInPackage

from launch import LaunchDescription
from physis_ros.children import PARENT_PID_ENV

# launch argument -> physis-serve flag, passed only when the argument is not empty
OPTIONAL_FLAGS = {
    "weights": "--weights",
    "port_file": "--port-file",
    "token_file": "--token-file",
    "tls_cert": "--tls-cert",
    "tls_key": "--tls-key",
}


def server_command(context) -> list:
    value = {
        name: LaunchConfiguration(name).perform(context)
        for name in ("config", "model", "host", "port", "nproc_per_node", *OPTIONAL_FLAGS)
    }
    serve = ExecutableInPackage("physis-serve", "physis_ros").perform(context)
    cmd = [serve, "--config", value["config"]]
    if not value["weights"]:  # weights name their own model
        cmd += ["--model", value["model"]]
    cmd += ["--host", value["host"], "--port", value["port"]]
    cmd += [
        arg for name, flag in OPTIONAL_FLAGS.items() if value[name] for arg in (flag, value[name])
    ]
    ranks = int(value["nproc_per_node"])
    if ranks < 1:
        raise ValueError(f"nproc_per_node must be >= 1, got {ranks}")
    if ranks > 1:
        torchrun = ExecutableInPackage("physis-torchrun", "physis_ros").perform(context)
        cmd = [torchrun, "--standalone", "--nproc-per-node", str(ranks), "--no-python", *cmd]
    # SIGINT first (the server and torchrun stop their ranks); SIGTERM only after 20 s
    return [ExecuteProcess(cmd=cmd, name="physis-serve", output="screen", sigterm_timeout="20")]


def generate_launch_description():
    share = get_package_share_directory("physis_ros")
    arguments = [
        ("model", "push-wm", "model preset (push-wm: the shipped trained world model)"),
        (
            "weights",
            "",
            "weights from physis-train, model named inside ('' = model's shipped ones)",
        ),
        (
            "config",
            os.path.join(share, "config", "serve.yaml"),
            "physis-serve YAML (frontend, engine and distributed sections)",
        ),
        ("host", "127.0.0.1", "interface physis-serve binds (0.0.0.0: every interface)"),
        ("port", "50051", "gRPC port (0: an ephemeral one, written to port_file)"),
        ("port_file", "", "write the bound port to this file once serving ('' = none)"),
        ("token_file", "", "file holding the bearer token every stream must carry"),
        ("tls_cert", "", "server certificate chain (PEM); TLS when set, with tls_key"),
        ("tls_key", "", "server private key (PEM)"),
        ("nproc_per_node", "1", "ranks (GPUs) on this machine; 1 = the single-process server"),
    ]
    return LaunchDescription(
        [
            *(
                DeclareLaunchArgument(name, default_value=default, description=text)
                for name, default, text in arguments
            ),
            # launch exits on SIGTERM without stopping its processes: they watch it instead
            SetEnvironmentVariable(PARENT_PID_ENV, str(os.getpid())),
            OpaqueFunction(function=server_command),
        ]
    )
