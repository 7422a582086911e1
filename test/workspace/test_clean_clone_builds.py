"""A clean clone (the files git would commit: no build outputs, no generated wire code)
builds the two ways users build it, and what comes out runs:

- in a fresh ROS workspace with ``colcon build`` (the dev venv's PyPI ROS wheels as the
  underlay): ``ros2 run physis_ros physis-serve --help`` and the installed launch files;
- ``pip install '.[serve]'`` into a fresh venv (the GPU workstation without ROS): the
  dependencies come from the dev venv through a .pth file and nothing is downloaded
  (``--no-index``), so the build itself is what is tested.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from launching import copy_clean_tree, require_ros2_cli

pytestmark = pytest.mark.slow

VENV = Path(sys.prefix)


def clean_env() -> dict[str, str]:
    """This environment without the repository on PYTHONPATH: only installed code runs."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env["AMENT_PREFIX_PATH"] = str(VENV)
    return env


def sh(script: str, *, cwd: Path, env: dict[str, str], timeout_s: float = 600):
    proc = subprocess.run(
        ["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=timeout_s, check=False,
    )  # fmt: skip
    return proc


def test_colcon_build_of_a_clean_clone_runs_with_ros2_run(tmp_path, ros_env):
    if shutil.which("colcon") is None:
        pytest.skip("colcon is not installed (requirements.txt pins colcon-common-extensions)")
    require_ros2_cli()
    ws = tmp_path / "ws"
    copy_clean_tree(ws / "src" / "physis_ros")
    assert not (ws / "src/physis_ros/physis_ros/link/proto_gen").exists()
    env = clean_env()
    build = sh("colcon build --event-handlers console_direct- --cmake-args -DBUILD_TESTING=OFF",
               cwd=ws, env=env, timeout_s=1500)  # fmt: skip
    log = ws / "log" / "latest_build" / "physis_ros" / "stdout_stderr.log"
    assert build.returncode == 0, build.stdout[-3000:] + (
        log.read_text()[-3000:] if log.exists() else ""
    )

    env.update({k: ros_env[k] for k in ("ROS_DOMAIN_ID", "ROS_AUTOMATIC_DISCOVERY_RANGE")})
    run = sh(
        "source install/setup.bash && ros2 pkg prefix physis_ros"
        " && ros2 run physis_ros physis-serve --help"
        " && python -c 'import physis_ros.link.proto_gen.physis_pb2_grpc as m; print(m.__file__)'"
        " && ros2 launch physis_ros workstation.launch.py --show-args",
        cwd=ws, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = run.stdout.splitlines()
    install = ws / "install" / "physis_ros"
    assert lines[0] == str(install), lines[0]
    assert "usage: physis-serve" in run.stdout
    assert any(line.startswith(str(install)) and "proto_gen" in line for line in lines)
    assert "'weights':" in run.stdout and "'nproc_per_node':" in run.stdout, run.stdout[-2000:]


def test_pip_install_serve_of_a_clean_clone(tmp_path):
    source = copy_clean_tree(tmp_path / "src")
    venv = tmp_path / "venv"
    env = clean_env()
    for key in ("_ROS_WHEELS_BOOTSTRAP_COMPLETE", "LD_LIBRARY_PATH", "VIRTUAL_ENV"):
        env.pop(key, None)  # a different venv's python (ROS_WHEELS: drop both)
    # without pip of its own: its bundled setuptools would shadow this venv's
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, env=env, timeout=300
    )
    # the dependencies (torch, grpcio, pip, build tools) from this venv: pip downloads nothing
    purelib = Path(sysconfig.get_paths(vars={"base": str(venv)})["purelib"])
    (purelib / "dev_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-index",
         "--no-build-isolation", "--disable-pip-version-check", f"{source}[serve]"],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    generated = purelib / "physis_ros" / "link" / "proto_gen" / "physis_pb2_grpc.py"
    assert generated.is_file(), sorted(p.name for p in (purelib / "physis_ros" / "link").iterdir())
    serve = subprocess.run(
        [str(venv / "bin" / "physis-serve"), "--help"], env=env, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    assert serve.returncode == 0 and serve.stdout.startswith("usage: physis-serve"), serve.stderr
    shipped = purelib / "physis_ros" / "weights" / "push_wm.safetensors"
    assert shipped.is_file(), "the shipped weights are not in the wheel"
