"""``physis-eval --serve-local``: a physis-serve child process on 127.0.0.1, for one run.

The child serves the engine settings the in-process evaluation would use (weights, model,
steps, window, shift, workers, mode), passed as the ``engine`` section of a YAML config it
reads; it binds an ephemeral port and writes it to a port file, which we wait for. Its log
goes to ``serve.log`` in the report folder. Stopped with SIGTERM (SIGKILL if it lingers).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from physis_ros.children import stop_child


class LocalServerError(Exception):
    """The child did not start serving; the message holds the end of its log."""


class LocalServer:
    """A running physis-serve child; ``target`` is its host:port."""

    def __init__(
        self,
        engine: dict,
        log_path: Path,
        *,
        start_timeout_s: float = 120.0,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        """``extra_args``: more physis-serve flags (e.g. ``--token-file``)."""
        self._dir = tempfile.TemporaryDirectory(prefix="physis-eval-serve-")
        folder = Path(self._dir.name)
        config = folder / "serve.yaml"
        # Only plain values go into the YAML (the checkpoint path as a string).
        section = {k: (str(v) if isinstance(v, Path) else v) for k, v in engine.items()}
        config.write_text(yaml.safe_dump({"frontend": {"host": "127.0.0.1"}, "engine": section}))
        port_file = folder / "port"
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "physis_ros.serve.main",
            "--config",
            str(config),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--port-file",
            str(port_file),
            *extra_args,
        ]
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + start_timeout_s
        while not port_file.exists():
            if self.proc.poll() is not None:
                self._cleanup()
                raise LocalServerError(
                    f"physis-serve exited with {self.proc.returncode}: {self.log_tail()}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise LocalServerError(
                    f"physis-serve did not serve within {start_timeout_s:.0f} s: {self.log_tail()}"
                )
            time.sleep(0.05)
        self.port = int(port_file.read_text())
        self.target = f"127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 8) -> str:
        try:
            return " | ".join(self.log_path.read_text().strip().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL; the exit status."""
        code = stop_child(self.proc, timeout_s=timeout_s)
        self._cleanup()
        return code

    def _cleanup(self) -> None:
        if os.path.isdir(self._dir.name):
            self._dir.cleanup()

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
