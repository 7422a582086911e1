"""Test helper: run `physis-serve` in a child process on an ephemeral 127.0.0.1 port."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

from physis_ros.children import stop_child
from physis_ros.link.proto_gen import physis_pb2 as pb
from physis_ros.link.proto_gen import physis_pb2_grpc as pb_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def engine_args() -> list[str]:
    """The real in-process engine with the `tiny` model; a stream that asks for interval 0
    gets 150 ms (not the fastest the pool can do, which would leave no room for the next
    test's stream while the last one is still closing)."""
    return ["--model", "tiny", "--default-target-ms", "150"]


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), str(HERE), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


class ServerProcess:
    def __init__(self, proc: subprocess.Popen, port: int, log_path: Path) -> None:
        self.proc = proc
        self.port = port
        self.log_path = log_path

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, then SIGKILL if it does not exit in time; returns the exit code."""
        return stop_child(self.proc, timeout_s=timeout_s)


def start_server(
    tmp_path: Path, *extra: str, port: int = 0, name: str = "serve", timeout_s: float = 60.0
) -> ServerProcess:
    port_file = tmp_path / f"{name}.port"
    port_file.unlink(missing_ok=True)
    log_path = tmp_path / f"{name}.log"
    cmd = [
        sys.executable,
        "-m",
        "physis_ros.serve.main",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--port-file",
        str(port_file),
        "--threads",
        "1",
        *engine_args(),
        *extra,
    ]
    log_file = open(log_path, "w")  # noqa: SIM115 - the child holds it
    proc = subprocess.Popen(
        cmd, cwd=REPO_ROOT, env=child_env(), stdout=log_file, stderr=subprocess.STDOUT
    )
    log_file.close()
    deadline = time.monotonic() + timeout_s
    while not port_file.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"physis-serve exited {proc.returncode}:\n{log_path.read_text()}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait(10)
            raise RuntimeError(
                f"physis-serve did not serve in {timeout_s} s:\n{log_path.read_text()}"
            )
        time.sleep(0.05)
    return ServerProcess(proc, int(port_file.read_text()), log_path)


@contextlib.contextmanager
def running_server(tmp_path: Path, *extra: str, **kw) -> Iterator[ServerProcess]:
    server = start_server(tmp_path, *extra, **kw)
    try:
        yield server
    finally:
        server.stop()


def server_info(target: str, metadata=(), credentials=None) -> pb.ServerInfo:
    channel = (
        grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
    )
    with channel:
        return pb_grpc.PhysisStub(channel).GetServerInfo(
            pb.ServerInfoRequest(), metadata=metadata, timeout=5
        )


def wait_for(predicate, timeout_s: float, interval_s: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)
