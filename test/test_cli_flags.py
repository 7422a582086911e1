"""A flag the chosen command, mode or experiment does not use is refused by name, before any
work starts, with what it applies to: typed as a user types them, through each program's
own ``main`` (one line on stderr, exit 2)."""

from __future__ import annotations

import argparse

import pytest

from physis_ros.bench import engine as bench_engine
from physis_ros.bench.cli import main as bench_main
from physis_ros.cli_errors import UsageError, refuse_unused_flags
from physis_ros.eval.cli import main as eval_main
from physis_ros.tools.sim_cli import main as sim_main
from physis_ros.train.train import main as train_main


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="toy")
    p.add_argument("bags", nargs="*")
    p.add_argument("--plot", default=None)
    p.add_argument("--measured", "-m", default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p


USES = {
    "--experiment a": {"plot", "seed"},
    "--experiment b": {"measured", "seed"},
    "--experiment c": {"bags"},
}


@pytest.mark.parametrize(
    ("argv", "mode", "message"),
    [
        (["--plot", "x"], "--experiment b", "--plot is not used by --experiment b: it applies "
         "to --experiment a"),
        (["-m", "f"], "--experiment a", "--measured is not used by --experiment a"),
        (["--seed", "3"], "--experiment c", "it applies to --experiment a or --experiment b"),
        (["bag1"], "--experiment a", "BAGS is not used by --experiment a"),
    ],
)  # fmt: skip
def test_a_flag_the_mode_does_not_use_is_refused_by_name(argv, mode, message):
    parser = _parser()
    with pytest.raises(UsageError, match=message) as err:
        refuse_unused_flags(parser, parser.parse_args(argv), mode, USES)
    assert err.value.fix.startswith("drop ")


def test_flags_every_mode_uses_and_defaults_pass():
    parser = _parser()
    for mode in USES:
        # --json: no mode lists it (every mode reads it); a flag given at its default is
        # indistinguishable from one not given
        refuse_unused_flags(parser, parser.parse_args(["--json", "--seed", "0"]), mode, USES)
    refuse_unused_flags(parser, parser.parse_args(["--plot", "x"]), "--experiment a", USES)
    with pytest.raises(KeyError):
        refuse_unused_flags(parser, parser.parse_args([]), "--experiment z", USES)


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--experiment", "pool24", "--model", "tiny"],
         "--model is not used by --experiment pool24: it applies to the pool run"),
        (["--plot", "front.png"], "--plot is not used by the pool run (no --experiment): it "
         "applies to --experiment frontier"),
        (["--experiment", "depth", "--devices", "8"], "--devices is not used by --experiment "
         "depth"),
        (["--experiment", "frontier", "--measured", "m.json"], "it applies to --experiment depth"),
        (["--experiment", "latencycheck", "--profile", "p.json"], "--profile is not used by "
         "--experiment latencycheck"),
    ],
)  # fmt: skip
def test_physis_sim_refuses_a_flag_of_another_experiment(capsys, argv, words):
    assert sim_main(argv) == 2
    line = _error_line(capsys)
    assert line.startswith("physis-sim: error: ") and words in line, line


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--ranks", "2", "--workers", "2"], "--workers is not used by physis-bench engine "
         "--ranks: it applies to physis-bench engine in process"),
        (["--ranks", "2", "--resolution", "64x64"], "--resolution is not used by physis-bench "
         "engine --ranks"),
        (["--compare-batching", "--ranks", "2"], "--compare-batching is not used by "
         "physis-bench engine --ranks"),
        (["--ab-rounds", "5"], "--ab-rounds is not used by a run without --compare-batching"),
    ],
)  # fmt: skip
def test_physis_bench_engine_refuses_flags_of_the_other_runtime(capsys, monkeypatch, argv, words):
    def never(*_args):
        raise AssertionError("the benchmark started")

    monkeypatch.setattr(bench_engine, "run", never)
    monkeypatch.setattr(bench_engine.engine_dist, "run", never)
    assert bench_main(["engine", *argv]) == 2
    line = _error_line(capsys)
    assert line.startswith("physis-bench engine: error: ") and words in line, line


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["bag", "--link", "127.0.0.1:1", "--steps", "2"],
         "--steps is not used by physis-eval --link: it applies to physis-eval in process"),
        (["bag", "--link", "127.0.0.1:1", "--future-commands"],
         "--future-commands is not used by physis-eval --link"),
        (["bag", "--horizons", "1,2"], "--horizons is not used by physis-eval in process: it "
         "applies to physis-eval --link or physis-eval --serve-local"),
        (["bag", "--delay-ms", "100"], "--delay-ms is not used by physis-eval in process: it "
         "applies to physis-eval --closed-loop"),
        (["--closed-loop", "bag"], "BAGS is not used by physis-eval --closed-loop"),
        (["--closed-loop", "--model", "tiny"], "--model is not used by physis-eval "
         "--closed-loop"),
        (["--closed-loop", "--link", "127.0.0.1:1"], "--link is not used by physis-eval "
         "--closed-loop"),
        (["bag", "--model", "tiny", "--variant", "fp16"], "--variant is not used by a preset "
         "or a physis-train weights file: it applies to a model directory"),
    ],
)  # fmt: skip
def test_physis_eval_refuses_a_flag_its_mode_does_not_use(capsys, tmp_path, argv, words):
    assert eval_main([*argv, "--out", str(tmp_path / "report")]) == 2
    line = _error_line(capsys)
    assert line.startswith("physis-eval: error: ") and words in line, line
    assert not (tmp_path / "report").exists()  # nothing ran


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--log-floor", "1e-6"], "--log-floor is not used by --loss mse: it applies to "
         "--loss log_mse"),
        (["--val-every", "5"], "--val-every is not used by a run without --val: it applies to "
         "--val"),
    ],
)  # fmt: skip
def test_physis_train_refuses_a_flag_its_run_does_not_use(capsys, tmp_path, argv, words):
    assert train_main(["bag", "--out", str(tmp_path / "out"), *argv]) == 2
    line = _error_line(capsys)
    assert line.startswith("physis-train: error: ") and words in line, line
    assert not (tmp_path / "out").exists()
