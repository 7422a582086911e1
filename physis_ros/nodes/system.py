"""A local closed loop as child processes: physis-serve, sim_robot and the bridge.

What ``physis-demo``, ``physis-bench ros`` and the node tests share: an isolated ROS
environment (own ROS_DOMAIN_ID, localhost discovery, the Fast DDS profile from
config/fastdds.xml), starting each program with a deadline for it to come up, and stopping
every child (SIGINT, then SIGKILL after a grace period) whatever happened, and should this
process be killed, the children end with it (``children.tie_to_launcher``: start them from a
thread that outlives them). Children run this interpreter's modules (``python -m``), so no
console script needs to be on PATH.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from physis_ros.children import PARENT_PID_ENV

REPO_CONFIG = Path(__file__).resolve().parents[2] / "config"


def ros_env(domain_id: int, *, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for ROS children: own domain, localhost discovery, the image-sized
    shared-memory profile, one thread per math library (the machines are shared)."""
    env = dict(os.environ if base is None else base)
    env.update(
        ROS_DOMAIN_ID=str(domain_id),
        ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST",
        RMW_IMPLEMENTATION="rmw_fastrtps_cpp",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
    )
    profile = REPO_CONFIG / "fastdds.xml"
    if profile.is_file():
        env["FASTDDS_DEFAULT_PROFILES_FILE"] = str(profile)
    root = str(REPO_CONFIG.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def ros_args(params: dict) -> list[str]:
    """``--ros-args -p name:=value ...`` for a node's parameters."""
    args = ["--ros-args"]
    for name, value in params.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, list | tuple):
            text = "[" + ",".join(repr(v) if isinstance(v, str) else str(v) for v in value) + "]"
        else:
            text = str(value)
        args += ["-p", f"{name}:={text}"]
    return args


class LocalSystem:
    """Starts and stops the server, the sim robot and the bridge; a context manager."""

    def __init__(
        self,
        *,
        domain_id: int,
        model: str = "tiny",
        weights: str | None = None,
        log_dir: str | None = None,
        server_port: int = 0,
    ) -> None:
        self.env = ros_env(domain_id)
        self.env[PARENT_PID_ENV] = str(os.getpid())  # the children end with this process
        self.model = model
        self.weights = weights
        """physis-serve --weights (None: the preset's shipped or random weights)."""
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="physis_system_"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.port_file = self.log_dir / "server.port"
        self.server_port = server_port
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs: list = []

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop()
        self._logs.append(log)
        proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def start_server(
        self, timeout_s: float = 60.0, ranks: int = 0, server_args: list[str] | None = None
    ) -> int:
        """Starts physis-serve (``ranks`` > 0: that many ranks under torchrun; more flags in
        ``server_args``) and waits until it serves; returns its port."""
        self.port_file.unlink(missing_ok=True)
        launcher = [sys.executable]
        if ranks:
            # physis-torchrun: torchrun that ends with exit 0 and one line when stopped (torchrun
            # itself re-raises the forwarded SIGINT: a traceback and exit 1)
            launcher += [
                "-m",
                "physis_ros.tools.torchrun",
                "--standalone",
                "--nproc-per-node",
                str(ranks),
            ]
        self._spawn(
            "server",
            [*launcher, "-m", "physis_ros.serve.main", "--model", self.model,
             "--host", "127.0.0.1", "--port", str(self.server_port),
             "--port-file", str(self.port_file),
             *(["--weights", self.weights] if self.weights else []), *(server_args or [])],
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.procs["server"].poll() is not None:
                raise RuntimeError(f"physis-serve exited: see {self.log_dir / 'server.log'}")
            text = self.port_file.read_text().strip() if self.port_file.exists() else ""
            if text:
                self.server_port = int(text)
                return self.server_port
            time.sleep(0.05)
        raise TimeoutError(f"physis-serve did not serve within {timeout_s} s")

    def start_sim_robot(self, **params) -> None:
        self._spawn(
            "sim_robot", [sys.executable, "-m", "physis_ros.nodes.sim_robot", *ros_args(params)]
        )

    def start_bridge(self, **params) -> None:
        params.setdefault("server", f"127.0.0.1:{self.server_port}")
        self._spawn("bridge", [sys.executable, "-m", "physis_ros.nodes.bridge", *ros_args(params)])

    def start_module(self, name: str, module: str, args: list[str]) -> None:
        """Any other child: ``python -m module args`` in the same environment."""
        self._spawn(name, [sys.executable, "-m", module, *args])

    def stop_one(self, name: str, grace_s: float = 5.0) -> int:
        """SIGINT one child (SIGKILL after ``grace_s``); its exit code."""
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(timeout=10)

    def kill(self, name: str) -> None:
        """SIGKILL (a crash, not a shutdown), for fault tests."""
        proc = self.procs.pop(name)
        proc.kill()
        proc.wait(timeout=10)

    def alive(self) -> dict[str, bool]:
        return {name: proc.poll() is None for name, proc in self.procs.items()}

    def stop(self, grace_s: float = 5.0) -> dict[str, int]:
        """SIGINT everyone, SIGKILL whoever is still there after ``grace_s``; exit codes."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + grace_s
        codes = {}
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait(timeout=10)
        self.procs.clear()
        for log in self._logs:
            log.close()
        self._logs.clear()
        return codes

    def __enter__(self) -> LocalSystem:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
