"""docs/byo_wam.md ("Bring your own world-action model") runs as written: its quoted push-wam
contract is the shipped one; its listing of a preset's tensors runs; its example writes weights
trained elsewhere (random push-wam weights here) with a contract and metadata that physis-serve
resolves and the engine serves (a few chunks of [rows_per_chunk, actions]); the refusals it
quotes are the lines physis-serve prints; its 7-joint + gripper arm's preset, contract and
bridge parameters fit each other (8 actions served in process; every input bound, and the
quoted refusal when one is not)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.torch import load_file, save_file

from physis_ros.cli_errors import UsageError
from physis_ros.contract.model import CONTRACT_KEY, ContractError, WamContract
from physis_ros.contract.safetensors import read_metadata
from physis_ros.engine.api import StreamSpec
from physis_ros.engine.build import build_model
from physis_ros.engine.config import PRESETS, ModelConfig
from physis_ros.engine.model import to_upstream_state_dict
from physis_ros.engine.threads import local_engine
from physis_ros.serve.spec import ServingSpec
from physis_ros.weights import WAM_WEIGHTS, engine_kwargs

DOC = Path(__file__).resolve().parents[2] / "docs" / "byo_wam.md"
SOURCE = "my_push_arm.safetensors"  # the file the doc's example reads
OUT = "my_push_arm_physis.safetensors"  # and writes
WAIT_S = 120.0  # a generous bound for a busy machine: no timing is asserted
SHIPPED_PUSH_WAM = WamContract.from_metadata(read_metadata(WAM_WEIGHTS))


def doc_block(tag: str) -> str:
    """The body of the doc's fenced code block whose info string ends with ``tag``."""
    found = re.findall(rf"^```\w+ {re.escape(tag)}\n(.*?)^```$", DOC.read_text(), re.S | re.M)
    assert len(found) == 1, f"{DOC.name}: {len(found)} blocks tagged {tag!r}"
    return found[0]


def doc_says(text: str) -> bool:
    """The doc holds ``text``, line breaks aside."""
    return " ".join(text.split()) in " ".join(DOC.read_text().split())


def random_weights(arch: ModelConfig, path: Path) -> Path:
    """A model of architecture ``arch``, as another trainer would save it (no metadata)."""
    save_file(to_upstream_state_dict(build_model(arch, seed=0)), str(path))
    return path


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> tuple[Path, dict]:
    """(folder, namespace) of the doc's example, run as written in a folder holding random
    push-wam weights under the name it reads."""
    folder = tmp_path_factory.mktemp("byo")
    random_weights(PRESETS["push-wam"], folder / SOURCE)
    namespace: dict = {"__name__": "byo_example"}
    with contextlib.chdir(folder):
        exec(compile(doc_block("byo-example"), f"{DOC.name}:byo-example", "exec"), namespace)
    return folder, namespace


def serve_chunks(path: Path, task: dict[str, float], chunks: int = 3) -> list[np.ndarray]:
    """What physis-serve checks at start-up, then ``chunks`` chunks' actions from the
    in-process engine on the weights, each observation with every state input."""
    spec = ServingSpec(model=str(path)).resolve()
    contract = spec.contract()
    assert contract == WamContract.from_metadata(read_metadata(path))
    rng = np.random.default_rng(0)
    frames_shape = (contract.frames_per_chunk, contract.image_height, contract.image_width, 3)
    rows = np.full((contract.rows_per_chunk, len(contract.action_names)), np.nan, np.float32)
    values = {s.name: float(rng.normal(scale=0.1)) for s in contract.robot_state}
    state = np.stack([contract.state_vector(values, task)] * contract.frames_per_chunk)
    out: dict[int, np.ndarray] = {}
    with local_engine(**engine_kwargs(path)) as engine:
        assert engine.contract == contract
        sid = engine.open_stream(StreamSpec(seed=0, task=task)).stream_id
        for slot in range(chunks):
            frames = rng.integers(0, 256, frames_shape, dtype=np.uint8)
            engine.submit_context(sid, frames, rows, state, slot=slot)
            chunk = engine.submit_generate(sid, rows)
            deadline = time.monotonic() + WAIT_S
            while chunk not in out:
                assert time.monotonic() < deadline, f"no chunk {chunk}"
                out.update({o.chunk: o.actions for o in engine.poll(0.2) if not o.preview_steps})
    return [out[c] for c in sorted(out)]


def test_the_quoted_push_wam_contract_is_the_shipped_one():
    quoted = WamContract.from_json(doc_block("push-wam-contract"))
    assert quoted == SHIPPED_PUSH_WAM
    assert json.loads(doc_block("push-wam-contract")) == json.loads(SHIPPED_PUSH_WAM.to_json())


def test_the_example_writes_weights_that_are_served(example):
    folder, namespace = example
    out = folder / OUT
    written = WamContract.from_metadata(read_metadata(out))
    assert written == namespace["contract"] == SHIPPED_PUSH_WAM
    # the tensors are the source's, unchanged
    source, served = load_file(str(folder / SOURCE)), load_file(str(out))
    assert source.keys() == served.keys()
    assert all(bool((source[k] == served[k]).all()) for k in source)
    actions = serve_chunks(out, {"goal_x": 0.1, "goal_y": -0.2})
    assert len(actions) == 3
    for a in actions:
        assert a.shape == (written.rows_per_chunk, len(written.action_names)) == (12, 2)
        assert np.isfinite(a).all()


def test_the_shapes_snippet_lists_the_presets_tensors(capsys):
    exec(compile(doc_block("byo-shapes"), f"{DOC.name}:byo-shapes", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert "action_head.weight (2, 256)" in printed and "state_head.weight (14, 256)" in printed


def test_a_stream_without_the_task_values_is_refused_as_quoted():
    with pytest.raises(ContractError) as err:
        SHIPPED_PUSH_WAM.check_task({"goal_y": 0.1})
    assert doc_says(f"bad stream spec: {err.value}")


def test_the_refusals_quoted_are_what_physis_serve_prints(example, monkeypatch):
    folder, _ = example
    monkeypatch.chdir(folder)
    meta = read_metadata(OUT)
    wrong = dataclasses.replace(SHIPPED_PUSH_WAM, action_names=("shoulder", "elbow", "wrist"))
    bad_key = json.loads(meta[CONTRACT_KEY])
    bad_key["state"][12]["key"] = "box"  # box_x's, not box.x
    reach = random_weights(PRESETS["reach-wam"], folder / "reach.safetensors")
    cases = {  # the file physis-serve is given: (its tensors' file, its metadata)
        "wrong_actions": (OUT, {**meta, CONTRACT_KEY: wrong.to_json()}),
        "no_contract": (OUT, {k: v for k, v in meta.items() if k != CONTRACT_KEY}),
        "bad_key": (OUT, {**meta, CONTRACT_KEY: json.dumps(bad_key)}),
        "wrong_shapes": (reach, meta),
    }
    for name, (tensors, metadata) in cases.items():
        path = f"{name}.safetensors"
        save_file(load_file(str(tensors)), path, metadata=metadata)
        with pytest.raises(UsageError) as err:
            ServingSpec(model=path).resolve()
        line = f"physis-serve: error: {err.value.problem} (fix: {err.value.fix})"
        assert doc_says(line), line


@pytest.fixture
def arm7() -> tuple[ModelConfig, WamContract]:
    """The doc's 7-joint + gripper architecture (no preset: the weights carry it) and
    contract."""
    namespace = {"PRESETS": PRESETS, "dataclasses": dataclasses}
    exec(compile(doc_block("byo-preset"), f"{DOC.name}:byo-preset", "exec"), namespace)
    assert namespace["arm7"].name not in PRESETS
    return namespace["arm7"], WamContract.from_json(doc_block("byo-arm7-contract"))


def test_the_7_joint_arm_with_a_gripper_is_served_8_actions(arm7, example, tmp_path):
    _, namespace = example
    arch, arm7 = arm7
    assert len(arm7.action_names) == 8 and arm7.action_names[-1] == "gripper_joint"
    assert WamContract.from_json(arm7.to_json()) == arm7
    assert not any(s.source == "wrench" for s in arm7.state)
    out = tmp_path / "arm7_physis.safetensors"
    source = random_weights(arch, tmp_path / "arm7.safetensors")
    namespace["write_physis_weights"](source, out, arm7, arch=arch)
    assert WamContract.from_metadata(read_metadata(out)) == arm7
    task = {"target_x": 0.4, "target_y": -0.1, "target_z": 0.2}
    actions = serve_chunks(out, task, chunks=2)
    assert [a.shape for a in actions] == [(12, 8)] * 2


@pytest.mark.ros
def test_the_7_joint_arms_bridge_parameters_bind_every_input(arm7):
    _, arm7 = arm7
    # rclpy: the bridge's parameters are ROS parameters (a GPU box may have no ROS)
    pytest.importorskip("rclpy")
    from physis_ros.nodes.bridge_inputs import binding_problems
    from physis_ros.nodes.bridge_params import BridgeParams

    values = yaml.safe_load(doc_block("byo-arm7-bridge"))["/**"]["ros__parameters"]
    params = BridgeParams(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})
    assert params.command_joint_names == params.joint_names == arm7.action_names
    assert params.task_names == arm7.task_names and not params.require_wrench
    assert binding_problems(arm7, params, tuple(params.objects())) == []
    # the launch line in the doc binds the same topics as the file
    objects = ", ".join(f"'{b}'" for b in params.object_topics)
    assert doc_says(f'task_topic:={params.task_topic} object_topics:="[{objects}]"')
    unbound = dataclasses.replace(params, object_topics=())
    problems = binding_problems(arm7, unbound, ())
    assert doc_says(f"the model cannot be fed: {'; '.join(problems)}; the stream is refused")
