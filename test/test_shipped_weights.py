"""A preset whose shipped weights are not in the install (as push-wam was until they were trained
and committed) is refused by every command that would serve it, in one line that names the
command making them; never served on random weights unasked."""

import numpy as np
import pytest

from physis_ros.engine.models import RANDOM_WEIGHTS, resolve_model
from physis_ros.weights import SHIPPED


@pytest.fixture
def push_wam_absent(monkeypatch, tmp_path):
    monkeypatch.setitem(SHIPPED, "push-wam", tmp_path / "push_wam.safetensors")


def _one_line_naming_the_trainer(text: str, use: str = "--weights out/push_wam/") -> None:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    assert "physis-train-wam --out out/push_wam" in lines[0], text
    assert use in lines[0], text


def test_resolving_the_preset_names_the_training_command(push_wam_absent):
    with pytest.raises(ValueError) as err:
        resolve_model("push-wam")
    _one_line_naming_the_trainer(str(err.value))
    # asked for explicitly, random weights stay available (tests, pipeline benchmarks)
    assert resolve_model("push-wam", RANDOM_WEIGHTS).weights is None


def test_demo_and_closed_loop_eval_refuse_in_one_line(push_wam_absent, tmp_path, capsys):
    from physis_ros.demo import main as demo_main
    from physis_ros.eval.cli import main as eval_main

    assert demo_main(["--model", "push-wam", "--out", str(tmp_path / "demo")]) == 2
    captured = capsys.readouterr()
    _one_line_naming_the_trainer(captured.err)
    assert captured.out == ""
    assert not (tmp_path / "demo" / "logs").exists()  # nothing was started

    assert eval_main(["--closed-loop", "--out", str(tmp_path / "cl")]) == 2
    captured = capsys.readouterr()
    _one_line_naming_the_trainer(captured.err)
    assert not (tmp_path / "cl").exists()


def test_physis_serve_refuses_in_one_line(push_wam_absent, capsys):
    from physis_ros.serve.main import main as serve_main

    assert serve_main(["--model", "push-wam", "--port", "0"]) == 2
    _one_line_naming_the_trainer(capsys.readouterr().err)


def test_a_world_action_model_without_its_metadata_is_refused_in_one_line(tmp_path, capsys):
    """physis-serve serves a world-action model with the timing and names its weights'
    metadata give (camera and row rates, joint and state names): random weights (none) and
    the demo on a file that lacks them stop in one line naming what is missing."""
    from safetensors.numpy import save_file

    from physis_ros.demo import main as demo_main
    from physis_ros.serve.main import main as serve_main

    assert serve_main(["--model", "push-wam", "--weights", "random", "--port", "0"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and "random weights have none" in errors[0], errors
    assert "physis-train-wam" in errors[0]

    weights = tmp_path / "wam.safetensors"
    meta = {"format": "physis_ros world-action model", "image_size": "32x32", "frame_hz": "10.0"}
    save_file({"x": np.zeros(1, np.float32)}, str(weights), metadata=meta)
    assert demo_main(["--model", "push-wam", "--weights", str(weights)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lacks ['action_hz', 'action_names', 'state_names']" in err[0], err
