"""Every command-line program ends a fault in one line on stderr that names the problem and
the fix, with exit status 2 for usage / config errors and 1 for runtime failures, and no
traceback unless --debug. The faults are the ones a user meets: typed as a user would type
them (most through the program's own ``main``, a few as the installed command)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from physis_ros.cli_errors import UsageError, check_fields, describe, run_main
from physis_ros.serve.frontend_config import SessionLimits
from physis_ros.weights import DEFAULT_WEIGHTS

from physis_testing import REPO_ROOT

BIN = Path(sys.executable).parent


def _one_line_error(err: str, prog: str) -> str:
    """The error line: the last line of stderr, the only one that says error, no traceback."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines, "nothing on stderr"
    assert lines[-1].startswith(f"{prog}: error: ") or lines[-1] == f"{prog}: interrupted", err
    assert sum("error:" in line for line in lines) == 1, err
    return lines[-1]


@functools.cache
def _console_scripts() -> dict[str, str]:
    """prog -> ``module:function``, as setup.py names them."""
    setup_py = (Path(__file__).resolve().parents[1] / "setup.py").read_text()
    return dict(re.findall(r'"([\w-]+) = ([\w.]+:\w+)"', setup_py))


def _main_of(prog: str):
    """The console script's main."""
    module, function = _console_scripts()[prog].split(":")
    return getattr(importlib.import_module(module), function)


def _run(capsys, prog: str, *argv: str) -> tuple[int, str]:
    """(exit status, the one error line) of ``prog``'s main called as the console script."""
    try:
        code = _main_of(prog)(list(argv))
    except SystemExit as exc:  # argparse's exit
        code = exc.code
    shown = f"{prog} {argv[0]}" if prog == "physis-bench" else prog  # and its subcommand
    return code, _one_line_error(capsys.readouterr().err, shown)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli_faults")
    state = load_file(str(DEFAULT_WEIGHTS))
    from safetensors import safe_open

    with safe_open(str(DEFAULT_WEIGHTS), "pt") as f:
        meta = f.metadata()
    name = sorted(state)[3]
    state[name] = state[name].clone()
    state[name].view(-1)[7] = float("nan")
    save_file(state, str(d / "nan.safetensors"), metadata=meta)
    raw = DEFAULT_WEIGHTS.read_bytes()
    (d / "truncated.safetensors").write_bytes(raw[: len(raw) // 2])
    (d / "garbage.safetensors").write_bytes(b"\xff" * 64)
    yamls = {
        "invalid": "frontend: {port: [1, 2\n",
        "wrong_type": "frontend: {max_streams: lots}\n",
        "unknown_key": "frontend: {max_streemz: 3}\n",
        "unknown_section": "frontends: {}\n",
        "nan": "frontend: {stall_timeout_s: .nan}\n",
        "inf_engine": "engine: {model: tiny, shift: .inf}\n",
        "engine_key": "engine: {model: tiny, stepz: 3}\n",
        "missing_device": "engine: {model: tiny, device: cuda}\n",
        "corrupt_weights": f"engine: {{model: push-wm, checkpoint: {d}/truncated.safetensors}}\n",
        "garbage_weights": f"engine: {{model: push-wm, checkpoint: {d}/garbage.safetensors}}\n",
        "nan_weights": f"engine: {{model: push-wm, checkpoint: {d}/nan.safetensors}}\n",
    }
    for key, text in yamls.items():
        (d / f"{key}.yaml").write_text(text)
    (d / "a_file").write_text("x")
    return {"dir": d, "nan_tensor": name}


SERVE_CONFIG_FAULTS = [
    ("invalid", "is not valid YAML", "correct the file"),
    ("wrong_type", "max_streams is 'lots' (str)", "type int"),
    ("unknown_key", "unknown key(s) ['max_streemz']", "known keys"),
    ("unknown_section", "unknown section(s) ['frontends']", "known sections"),
    ("nan", "stall_timeout_s is nan", "finite"),
    ("inf_engine", "shift is inf", "finite"),
    ("engine_key", "unknown engine key 'stepz'", "known keys"),
    ("missing_device", "no usable CUDA device", "use device cpu"),
    ("corrupt_weights", "is not a readable safetensors file", "copy it again"),
    ("garbage_weights", "is not a readable safetensors file", "copy it again"),
    ("nan_weights", "NaN/inf", "checkpoint from before"),
]


@pytest.mark.parametrize(("name", "problem", "fix"), SERVE_CONFIG_FAULTS)
def test_serve_config_faults_end_in_one_line_exit_2(capsys, files, name, problem, fix):
    if name == "missing_device" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    code, line = _run(capsys, "physis-serve", "--config", str(files["dir"] / f"{name}.yaml"))
    assert code == 2, line
    assert problem in line and fix in line.split("(fix: ", 1)[1]


def test_nan_weights_are_refused_by_tensor_name(capsys, files):
    code, line = _run(capsys, "physis-serve", "--config", str(files["dir"] / "nan_weights.yaml"))
    assert code == 2 and files["nan_tensor"] in line


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--log-level", "LOUD"], "'LOUD' is not one of DEBUG"),
        (["--threads", "0"], "--threads: 0 must be >= 1"),
        (["--port", "70000"], "70000 is not in 0..65535"),
        (["--config", "/no/such/serve.yaml"], "No such file or directory: /no/such/serve.yaml"),
        (["--engine-factory", "no_such_module:make"], "module 'no_such_module' cannot be"),
        (["--engine-factory", "physis_ros.serve.main:no_such_function"], "has no"),
        (["--engine-factory", "just_a_name"], "is not module:function"),
        (["--host", "no-such-host.invalid", "--port", "0"], "does not resolve"),
    ],
)
def test_serve_usage_faults_end_in_one_line_exit_2(capsys, argv, problem):
    code, line = _run(capsys, "physis-serve", "--model", "tiny", *argv)
    assert code == 2, line
    assert problem in line and "(fix: " in line


def test_tls_key_that_does_not_match_its_certificate_is_named(capsys, tmp_path):
    from certs import make_certs

    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    a, b = make_certs(first), make_certs(second)
    code, line = _run(
        capsys,
        "physis-serve",
        "--model",
        "tiny",
        "--port",
        "0",
        "--tls-cert",
        str(a["server.pem"]),
        "--tls-key",
        str(b["server.key"]),
    )
    assert code == 2
    assert f"TLS key {b['server.key']} does not match certificate" in line
    assert "bind" not in line


def test_port_in_use_is_a_runtime_failure_naming_the_port():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        out = subprocess.run(
            [str(BIN / "physis-serve"), "--model", "tiny", "--port", str(port)],
            check=False,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert out.returncode == 1
    line = _one_line_error(out.stderr, "physis-serve")
    assert f"port {port} on 127.0.0.1 is in use" in line and "choose another --port" in line


def test_debug_shows_the_traceback(capsys):
    try:
        _main_of("physis-serve")(["--debug", "--config", "/no/such/serve.yaml"])
    finally:
        os.environ.pop("PHYSIS_DEBUG", None)
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("physis-serve: error:")


@pytest.mark.parametrize(
    ("argv", "code", "problem"),
    [
        (["--weights", "{d}/truncated.safetensors"], 2, "is not a readable safetensors file"),
        (["--weights", "{d}/garbage.safetensors"], 2, "safetensors header"),
        (["--weights", "{d}/nan.safetensors"], 2, "NaN/inf"),
        (["--shift", "nan"], 2, "'nan' is not a finite number"),
        (["--frame-hz", "inf"], 2, "'inf' is not a finite number"),
        (["--out", "{d}/a_file"], 2, "exists and is not a folder"),
    ],
)
def test_eval_faults_end_in_one_line(capsys, files, argv, code, problem):
    argv = [a.format(d=files["dir"]) for a in argv]
    got, line = _run(capsys, "physis-eval", str(files["dir"]), *argv)
    assert got == code, line
    assert problem in line


@pytest.mark.parametrize(
    "argv",
    [
        ["physis-demo", "--duration-s", "nan"],
        ["physis-demo", "--target-interval-ms", "inf"],
        ["physis-record", "--camera-hz", "nan"],
        ["physis-replay", "bag", "--rate", "inf"],
        ["physis-sim", "--max-utilization", "nan"],
        ["physis-train", "bag", "--out", "o", "--lr", "nan"],
        ["physis-bench", "link", "--rate-hz", "inf"],
        ["physis-bench", "ros", "--target-interval-ms", "nan"],
    ],
    ids=lambda argv: " ".join(argv[:2]),
)
def test_a_non_finite_number_on_any_command_line_is_refused(capsys, argv):
    code, line = _run(capsys, *argv)
    assert code == 2, line
    assert "is not a finite number" in line


def test_physis_record_never_overwrites_a_bag_and_says_which_it_skipped(capsys, tmp_path):
    """A second run into the same folder keeps the first run's bag byte for byte, names it
    on stderr, and records the episode that is new."""
    record = _main_of("physis-record")
    common = ["--duration-s", "0.2", "--height", "8", "--width", "8"]
    assert record([str(tmp_path), *common]) == 0
    first = {f: f.read_bytes() for f in (tmp_path / "episode_00000").iterdir()}
    capsys.readouterr()
    assert record([str(tmp_path), "--episodes", "2", *common]) == 0
    err = capsys.readouterr().err
    assert f"{tmp_path / 'episode_00000'} exists, skipped (bags are never overwritten)" in err
    assert {f: f.read_bytes() for f in (tmp_path / "episode_00000").iterdir()} == first
    assert (tmp_path / "episode_00001").is_dir()


def test_missing_profile_file_is_named(capsys):
    code, line = _run(capsys, "physis-sim", "--profile", "/no/such/profile.json")
    assert code == 2 and "/no/such/profile.json" in line


def test_missing_device_for_profile_is_named(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    code, line = _run(capsys, "physis-profile", "--device", "cuda", "--model", "tiny")
    assert code == 2 and "no usable CUDA device" in line


@pytest.mark.parametrize(
    ("exc", "code", "words"),
    [
        (FileExistsError(17, "File exists", "/x/out"), 2, "/x/out already exists"),
        (PermissionError(13, "Permission denied", "/x/key.pem"), 2, "permission denied"),
        (UsageError("bad thing", "do this"), 2, "bad thing (fix: do this)"),
        (ImportError("no module named grpc"), 1, "missing module"),
        (ConnectionResetError(104, "reset"), 1, "ConnectionResetError"),
        (RuntimeError("boom\nsecond line"), 1, "internal error: RuntimeError: boom second line"),
        (KeyboardInterrupt(), 130, "prog: interrupted"),
    ],
)
def test_describe_classifies_by_whose_fault_it_is(exc, code, words):
    got, line = describe(exc, "prog")
    assert got == code and words in line and "\n" not in line


def test_run_main_turns_any_escape_into_one_line(capsys):
    def main(argv):
        raise RuntimeError("deep inside")

    assert run_main("prog", main, []) == 1
    assert capsys.readouterr().err.strip() == (
        "prog: error: internal error: RuntimeError: deep inside "
        "(fix: rerun with --debug and report the traceback)"
    )


def test_check_fields_names_key_type_and_finiteness():
    check_fields(SessionLimits, {"stall_timeout_s": 5, "outbound_queue": 4}, "f")
    with pytest.raises(UsageError, match=r"f: outbound_queue is 4\.5"):
        check_fields(SessionLimits, {"outbound_queue": 4.5}, "f")
    with pytest.raises(UsageError, match="f: stall_timeout_s is True"):
        check_fields(SessionLimits, {"stall_timeout_s": True}, "f")
    with pytest.raises(UsageError, match="f: stall_timeout_s is -inf"):
        check_fields(SessionLimits, {"stall_timeout_s": float("-inf")}, "f")
    with pytest.raises(UsageError, match=r"unknown key\(s\) \['nope'\]"):
        check_fields(SessionLimits, {"nope": 1}, "f")


def test_cli_errors_imports_neither_torch_nor_rclpy():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, physis_ros.cli_errors; "
            "print(sorted({'torch', 'rclpy'} & set(sys.modules)))",
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "[]"


TORCHRUN_CONFIG = "engine: {model: tiny}\ndistributed: {comm_timeout_s: 30.0}\n"


def test_ctrl_c_under_torchrun_ends_every_rank_in_one_line(tmp_path):
    """physis-torchrun (torchrun's own arguments): Ctrl-C in the terminal (SIGINT to the
    whole process group) stops the ranks and ends in one line, no traceback (exit 0: Ctrl-C
    is how a server is stopped)."""
    (tmp_path / "serve.yaml").write_text(TORCHRUN_CONFIG)
    port_file = tmp_path / "port"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [
            str(BIN / "physis-torchrun"),
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "physis_ros.serve.main",
            "--config",
            str(tmp_path / "serve.yaml"),
            "--port",
            "0",
            "--port-file",
            str(port_file),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    try:
        deadline = time.monotonic() + 240
        while not port_file.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert port_file.exists(), "physis-serve under physis-torchrun never served"
        os.killpg(proc.pid, signal.SIGINT)
        # and again to physis-torchrun alone while it stops the ranks, as ros2 launch does
        # after a terminal's Ctrl-C reached the whole group
        time.sleep(0.05)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "physis-torchrun: SIGINT: the ranks were stopped", err


def _signal_a_thread_other_than_main(pid: int, sig: int) -> int:
    """Deliver ``sig`` to one of ``pid``'s threads that is not its main thread (Linux
    tgkill), as the kernel does when the main thread already has a signal pending."""
    import ctypes

    tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
    assert tids, "the server runs no threads besides its main one"
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.tgkill(pid, tids[0], sig) != 0:
        raise OSError(ctypes.get_errno(), "tgkill")
    return tids[0]


@contextlib.contextmanager
def _serving_tiny(tmp_path):
    """physis-serve --model tiny on an ephemeral port, yielded once it serves; killed on the
    way out if it still runs."""
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [str(BIN / "physis-serve"), "--model", "tiny", "--port", "0", "--port-file",
         str(port_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not port_file.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert port_file.exists(), "physis-serve never served"
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="tgkill and /proc are Linux")
def test_physis_serve_stops_on_a_signal_another_thread_received(tmp_path):
    """SIGINT handed to a gRPC or engine thread, not the main one, still stops physis-serve:
    Python only trips a flag there, and a main thread in an untimed wait never looked at it
    (under torchrun, rank 0 stayed up until torchrun's SIGTERM)."""
    with _serving_tiny(tmp_path) as proc:
        _signal_a_thread_other_than_main(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "shutting down" in err, err


def test_physis_serve_ends_cleanly_however_many_ctrl_c_follow(tmp_path):
    """Ctrl-C under ``ros2 launch`` reaches physis-serve twice: the terminal signals the
    whole group, then launch signals each process. A late second SIGINT found Python's
    exit-time SIG_DFL and killed the server (-2) after it had stopped. Here SIGINT keeps
    coming every few milliseconds until the server exits: still exit 0, no traceback."""
    with _serving_tiny(tmp_path) as proc:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(ProcessLookupError):  # it exited between the two
                proc.send_signal(signal.SIGINT)
            time.sleep(0.002)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "Traceback" not in err, err


def test_physis_torchrun_raises_on_the_first_sigint_only(monkeypatch):
    """torchrun's handler raises on every signal; a second SIGINT raised inside the agent's
    shutdown (in a log call) printed a traceback. physis-torchrun raises on the first only,
    and a SIGTERM after it still escalates."""
    from torch.distributed.elastic.multiprocessing import api

    from physis_ros.tools import torchrun

    monkeypatch.setattr(api, "_terminate_process_handler", api._terminate_process_handler)
    torchrun._stop_once()
    handler = api._terminate_process_handler
    with pytest.raises(api.SignalException):
        handler(signal.SIGINT, None)
    assert handler(signal.SIGINT, None) is None  # the second: already stopping
    with pytest.raises(api.SignalException):
        handler(signal.SIGTERM, None)


def test_physis_torchrun_ignores_a_ctrl_c_once_the_ranks_are_stopped(monkeypatch, capsys):
    """After the ranks stopped, a late SIGINT (launch signals the group, then each process)
    found Python's exit-time SIG_DFL and killed physis-torchrun (-2) after its line: it is
    ignored from then on (SIG_IGN survives interpreter exit)."""
    import torch.distributed.run as torch_run
    from torch.distributed.elastic.multiprocessing import api

    from physis_ros.tools import torchrun

    def stopped_by_ctrl_c(_args):
        raise api.SignalException("stopped", sigval=signal.SIGINT)

    monkeypatch.setattr(api, "_terminate_process_handler", api._terminate_process_handler)
    monkeypatch.setattr(torch_run, "run", stopped_by_ctrl_c)
    before = signal.getsignal(signal.SIGINT)
    try:
        assert torchrun.main(["--standalone", "--nproc-per-node", "1", "serve.py"]) == 0
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
    assert "physis-torchrun: SIGINT: the ranks were stopped" in capsys.readouterr().err


def test_a_rank_with_a_config_error_ends_physis_torchrun_in_one_line(tmp_path):
    """A config error every rank meets: the rank says it in one line (exit 2), and
    physis-torchrun names the rank instead of torchrun's failure table and traceback."""
    (tmp_path / "serve.yaml").write_text("engine: {model: tiny}\nfrontend: {max_streams: lots}\n")
    out = subprocess.run(
        [str(BIN / "physis-torchrun"), "--standalone", "--nproc-per-node", "2",
         "-m", "physis_ros.serve.main", "--config", str(tmp_path / "serve.yaml")],
        check=False, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines[-1].startswith("physis-torchrun: error: rank 0 exited 2"), out.stderr
    assert any("physis-serve: error:" in line and "max_streams is 'lots'" in line for line in lines)
