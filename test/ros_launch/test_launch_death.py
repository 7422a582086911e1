"""Nothing outlives its launcher: ``ros2 launch physis_ros demo.launch.py`` streaming, then
the launcher alone is killed the ways supervisors and users kill it, and within a few seconds
no process it started is left (physis-serve, the bridge, sim_robot each end with it:
physis_ros/children.py).

- SIGTERM (``kill PID``, systemd's KillMode=mixed or process): launch exits at once without
  stopping what it started. With a world-action model driving (push-wam, drive:=true) the
  bridge's last word to the robot is its hold fallback.
- SIGKILL: launch stops nothing at all; also with physis-torchrun and two ranks
  (workstation.launch.py nproc_per_node:=2).

What launch started (and what that started) before the signal and after it is printed as
``ps`` lists it (``pytest -s`` shows it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from launching import LaunchRun, wait_for_file

pytestmark = [pytest.mark.ros, pytest.mark.slow]

STREAMING_WITHIN_S = 240.0  # server start (torch import, weights) on a busy machine
ALL_GONE_WITHIN_S = 30.0  # a few seconds on an idle machine; a loaded one is slower to stop


def processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of the live processes (zombies aside)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):  # gone meanwhile
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] not in ("Z", "X"):
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                found[int(entry.name)] = (int(fields[1]), cmd.strip())
    return found


def descendants(pid: int) -> dict[int, str]:
    """pid -> command line of every live process ``pid`` started, and they started, ...
    (torchrun's ranks run in sessions of their own)."""
    table = processes()
    found: dict[int, str] = {}
    parents = {pid}
    while parents:
        children = {p for p, (ppid, _) in table.items() if ppid in parents and p not in found}
        found.update({p: table[p][1] for p in children})
        parents = children
    return found


def ps(pids) -> str:
    """What ``ps`` says of ``pids`` (its header alone when none is left; Z: ended, not yet
    reaped by init)."""
    cmd = ["ps", "-ww", "-o", "pid,ppid,stat,etime,args", "-p", ",".join(map(str, pids)) or "0"]
    return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout


def kill_launcher(run: LaunchRun, sig: int, started: dict[int, str]) -> set[int]:
    """``sig`` to ros2 launch alone; what of ``started`` is still running once all of it
    ended or ALL_GONE_WITHIN_S passed. Prints ps before and after."""
    before = ps([run.proc.pid, *started])
    t_signal = time.monotonic()
    run.proc.send_signal(sig)
    code = run.proc.wait(timeout=30)
    deadline = time.monotonic() + ALL_GONE_WITHIN_S
    while time.monotonic() < deadline and set(processes()) & set(started):
        time.sleep(0.1)
    gone_after_s = time.monotonic() - t_signal
    print(f"\n{signal.Signals(sig).name} to ros2 launch (pid {run.proc.pid}), which exited {code}")
    print(f"before:\n{before}after {gone_after_s:.1f} s:\n{ps(started)}")
    return set(processes()) & set(started)


def clean_up(run: LaunchRun, started: dict[int, str]) -> None:
    """Whatever is left of a failed test."""
    for pid in {run.proc.pid, *started} & set(processes()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    run.__exit__(None, None, None)


def _streaming(monitor, wam: bool) -> bool:
    if wam:
        from physis_ros.msg import ActionChunk

        return any(
            m.source == ActionChunk.SOURCE_MODEL for _, m in monitor.messages("action_chunk")
        )
    return monitor.count("predicted/image") > 0


@pytest.mark.parametrize(
    "sig, model",
    [(signal.SIGTERM, "push-wam"), (signal.SIGKILL, "push-wm")],
    ids=["SIGTERM", "SIGKILL"],
)
def test_no_process_outlives_the_launcher(ros_launch_env, tmp_path, sig, model):
    from physis_ros.msg import ActionChunk
    from physis_ros.nodes.monitor import Monitor

    wam = model == "push-wam"
    args = ["demo.launch.py", f"model:={model}", "port:=0", f"port_file:={tmp_path / 'port'}",
            "target_interval_ms:=0", *(["drive:=true"] if wam else [])]  # fmt: skip
    domain_id = int(ros_launch_env["ROS_DOMAIN_ID"])
    run = LaunchRun(args, env=ros_launch_env, log_path=tmp_path / "demo.log")
    monitor = Monitor(domain_id=domain_id, keep=("action_chunk",))
    started: dict[int, str] = {}
    try:
        monitor.wait_for(lambda: _streaming(monitor, wam) or not run.running(), STREAMING_WITHIN_S)
        assert _streaming(monitor, wam), f"nothing predicted:\n{run.log()[-3000:]}"
        started = descendants(run.proc.pid)
        programs = " ".join(started.values())
        for program in ("physis-serve", "bridge", "sim_robot"):
            assert f"lib/physis_ros/{program}" in programs, (program, started)
        t_signal = time.monotonic()
        left = kill_launcher(run, sig, started)
        assert not left, f"left running {ALL_GONE_WITHIN_S} s after {sig!r}:\n{ps(left)}"
        if wam:  # the robot's last command is the fallback, sent at the signal unless held
            time.sleep(0.5)
            chunks = monitor.messages("action_chunk")
            hold = ActionChunk.SOURCE_FALLBACK_HOLD
            # a loaded host may stall the server first: the bridge then holds already and
            # sends its fallback once (test_bridge_recovery), not again when it stops
            holding = [m.source for t, m in chunks if t <= t_signal][-1:] == [hold]
            sent_at_stop = any(t > t_signal for t, _ in chunks)
            assert chunks[-1][1].source == hold and (sent_at_stop or holding), [
                (round(t - t_signal, 2), m.source) for t, m in chunks[-5:]
            ]
    finally:
        monitor.close()
        clean_up(run, started)


def test_torchrun_and_its_ranks_do_not_outlive_the_launcher(ros_launch_env, tmp_path):
    """workstation.launch.py nproc_per_node:=2: physis-torchrun (tied to launch) stops its
    ranks (tied to it) when launch is killed."""
    port_file = tmp_path / "port"
    run = LaunchRun(
        ["workstation.launch.py", "nproc_per_node:=2", "model:=tiny", "port:=0",
         f"port_file:={port_file}"],
        env=ros_launch_env,
        log_path=tmp_path / "workstation.log",
    )  # fmt: skip
    started: dict[int, str] = {}
    try:
        wait_for_file(port_file, STREAMING_WITHIN_S, run)
        started = descendants(run.proc.pid)
        commands = list(started.values())
        assert sum("lib/physis_ros/physis-torchrun" in c for c in commands) == 1, started
        ranks = [c for c in commands if "physis-serve" in c and "physis-torchrun" not in c]
        assert len(ranks) == 2, started
        left = kill_launcher(run, signal.SIGKILL, started)
        assert not left, f"left running {ALL_GONE_WITHIN_S} s after SIGKILL:\n{ps(left)}"
    finally:
        clean_up(run, started)
