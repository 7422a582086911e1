"""The systemd units in docs/service.md: they stop the way the page says (SIGINT to the main
process, the rest of the unit killed after a timeout, restarts on failure but not on a usage
error), and ``systemd-analyze verify`` accepts them where it is installed (the site's paths
replaced by executables that exist here)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "service.md"
SITE_BIN = "/opt/physis/venv/bin/"


def units() -> dict[str, str]:
    blocks = re.findall(r"```ini\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 2, "docs/service.md: the GPU box's and the robot's unit"
    return {"physis-serve.service": blocks[0], "physis-robot.service": blocks[1]}


def directives(unit: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in unit.splitlines() if "=" in line and line[0] != "#")


def test_each_unit_stops_its_main_process_first_and_restarts_on_failure():
    for name, unit in units().items():
        d = directives(unit)
        assert d["KillSignal"] == "SIGINT" and d["KillMode"] == "mixed", name
        assert int(d["TimeoutStopSec"]) >= 20, name  # physis-torchrun's ranks, launch's nodes
        assert d["Restart"] == "on-failure" and d["RestartPreventExitStatus"] == "2", name
    assert "physis-serve" in directives(units()["physis-serve.service"])["ExecStart"]
    assert "exec ros2 launch physis_ros robot.launch.py" in units()["physis-robot.service"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_analyze_verifies_the_units(tmp_path):
    for name, unit in units().items():
        (tmp_path / name).write_text(unit.replace(SITE_BIN + "physis-serve", sys.executable))
    result = subprocess.run(
        ["systemd-analyze", "verify", *(str(p) for p in sorted(tmp_path.iterdir()))],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
