"""Training from a robot's own bags: bags recorded under other topic names are read through a
mapping file by both trainers, and what physis-train-wam makes of them is served.

The bags: ``physis-record --task goal_push`` episodes (the push expert, one goal after
another) under renamed topics, one MCAP with raw images, one sqlite3 with JPEG images and a
corrupt joint-state message, and a copy of the first without its wrench topic (refused,
named). physis-train-wam fine-tunes the shipped push-wam on them (``--init``), physis-serve
serves the result and a LinkClient stream gets a prediction; physis-train trains push-wm on
them. A bag episode is the episode the simulator's expert gives for the same seed.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from eval.bagtools import rewrite_bag

from physis_ros.sim.record import RecordConfig, record_episode

TOPICS = dict(
    camera_topic="/arm/camera",
    joint_states_topic="/arm/joint_states",
    command_topic="/arm/joint_target",
    wrench_topic="/arm/wrench",
    goal_topic="/episode/goal",
    object_topic="/tracker/box",
)
MAPPING = """\
camera: /arm/camera
command: {topic: /arm/joint_target, joints: [shoulder, elbow]}
joint_states: /arm/joint_states
wrench: /arm/wrench
objects: {box: /tracker/box}
task: {topic: /episode/goal, names: [goal_x, goal_y]}
"""
WAIT_S = 180.0


@pytest.fixture(scope="module")
def bags(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bags")
    common = dict(task="goal_push", duration_s=6.0, image_height=32, image_width=32, **TOPICS)
    a = root / "arm_a"
    record_episode(a, RecordConfig(seed=0, **common))
    src = root / "arm_b_src"
    record_episode(src, RecordConfig(seed=1, encoding="jpeg", **common))

    def corrupt_one_joint_state(topic, index, raw, store):
        return raw[:12] if topic == TOPICS["joint_states_topic"] and index == 40 else raw

    b = rewrite_bag(src, root / "arm_b", storage="sqlite3", edit=corrupt_one_joint_state)
    no_wrench = rewrite_bag(a, root / "no_wrench", drop_topics=(TOPICS["wrench_topic"],))
    mapping = root / "mapping.yaml"
    mapping.write_text(MAPPING)
    return {"a": a, "b": b, "no_wrench": no_wrench, "mapping": mapping}


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", module, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False, env=env)


def _episodes(bags):
    from physis_ros.train.bag_episodes import Timing, read_bags
    from physis_ros.train.bag_mapping import load_mapping
    from physis_ros.train.wam_config import WamTrainConfig, contract

    timing = Timing(frame_hz=10.0, rows_per_frame=2, min_frames=8)
    return read_bags(
        [bags["a"], bags["b"]], load_mapping(bags["mapping"]), contract(WamTrainConfig()),
        timing, image_size=(32, 32), progress=False,
    )  # fmt: skip


def test_a_bag_episode_is_the_simulated_experts_episode(bags):
    """Frames at 10 Hz, the named state paired with each, rows at 20 Hz from the 50 Hz
    commands and the goal as task values: what the simulator's expert episode of the same
    seed holds (the bag's robot is stepped at 50 Hz, the simulator's at 100 Hz)."""
    from physis_ros.sim.episodes import run_expert_episode
    from physis_ros.sim.record import BAG_TASK_SEED0
    from physis_ros.sim.task import sample_task

    episodes, report = _episodes(bags)
    assert report.bags == 2 and report.refused == [] and report.episodes == len(episodes) >= 3
    assert report.skipped_messages == {(TOPICS["joint_states_topic"], "corrupt_message"): 1}
    assert report.unpaired_frames == {"before the first command": 2}  # each bag's first frame
    bag = episodes[0]
    sim = run_expert_episode(sample_task(BAG_TASK_SEED0))
    assert bag.task_values == sim.task_values
    n = 5  # frame 0 has no command before it: the bag's episode starts at frame 1
    assert np.abs(bag.frames[:n].astype(int) - sim.frames[1 : n + 1]).mean() < 1.0
    names = bag.state_names
    assert names[:4] == ("shoulder_pos", "elbow_pos", "shoulder_vel", "elbow_vel")
    np.testing.assert_allclose(
        bag.values(names[:2])[:n], sim.values(names[:2])[1 : n + 1], atol=0.01
    )
    np.testing.assert_allclose(
        bag.values(["box_x", "box_y"])[:n], sim.values(["box_x", "box_y"])[1 : n + 1], atol=0.005
    )
    assert len(bag.rows) == 2 * (len(bag.frames) - 1) + 1 and not bag.perturbed.any()
    np.testing.assert_allclose(bag.rows[: 2 * n], sim.rows[2 : 2 * n + 2], atol=0.02)
    # the goal changed: a new episode began (each of its frames the new goal's)
    assert len({tuple(e.task_values.values()) for e in episodes}) == len(episodes)


def test_mapping_files_that_do_not_fit_are_refused_naming_what(bags, tmp_path):
    from physis_ros.eval.bag import BagReadError
    from physis_ros.train.bag_episodes import read_bag_streams
    from physis_ros.train.bag_mapping import MappingError, load_mapping, parse_mapping
    from physis_ros.train.wam_config import WamTrainConfig, contract

    with pytest.raises(MappingError, match=r"unknown keys \['wrenches'\]"):
        parse_mapping({"camera": "/c", "command": {"topic": "/j", "joints": ["a"]}, "wrenches": 1})
    with pytest.raises(MappingError, match="command is required"):
        parse_mapping({"camera": "/c"})
    with pytest.raises(MappingError, match=r"command\.joints must be a list of distinct names"):
        parse_mapping({"camera": "/c", "command": {"topic": "/j", "joints": "shoulder"}})
    partial = tmp_path / "partial.yaml"
    partial.write_text(
        MAPPING.replace("wrench: /arm/wrench\n", "").replace(
            "joints: [shoulder, elbow]", "joints: [elbow, shoulder]"
        )
    )
    with pytest.raises(ValueError) as refused:
        WamTrainConfig(bags=str(bags["a"]), mapping=str(partial))
    assert "command joints ['elbow', 'shoulder'] are not the model's actions" in str(refused.value)
    assert "it takes force_x, force_y, force_z, torque_x, torque_y, torque_z: set wrench" in str(
        refused.value
    )
    # a topic of another type is named with both types
    wrong = replace(load_mapping(bags["mapping"]), wrench=TOPICS["joint_states_topic"])
    with pytest.raises(
        BagReadError, match="'/arm/joint_states' has type sensor_msgs/msg/JointState, wrench needs"
    ):
        read_bag_streams(
            bags["a"], wrong, contract(WamTrainConfig()), image_size=(32, 32), skipped=Counter()
        )


def test_config_mapping_example_feeds_push_wam_from_physis_record_bags():
    """config/bag_mapping_push_wam.yaml binds every input of the shipped push-wam to the
    topics ``physis-record --task goal_push`` writes."""
    from physis_ros.contract.model import WamContract
    from physis_ros.sim import record
    from physis_ros.train.bag_mapping import load_mapping
    from physis_ros.weights import WAM_WEIGHTS, read_metadata

    mapping = load_mapping(
        Path(__file__).resolve().parents[2] / "config" / "bag_mapping_push_wam.yaml"
    )
    assert mapping.contract_problems(WamContract.from_metadata(read_metadata(WAM_WEIGHTS))) == []
    assert (mapping.camera, mapping.command.topic) == (record.IMAGE_TOPIC, record.COMMAND_TOPIC)
    assert (mapping.joint_states, mapping.wrench) == (record.JOINT_STATE_TOPIC, record.WRENCH_TOPIC)
    assert mapping.objects == {"box": record.OBJECT_TOPIC} and mapping.task.topic == "/goal"


def test_push_wam_fine_tuned_on_renamed_bags_is_served(bags, tmp_path):
    from physis_ros.contract.model import WamContract
    from physis_ros.weights import WAM_WEIGHTS, read_metadata

    out = tmp_path / "wam"
    all_bags = ",".join(str(bags[k]) for k in ("a", "b", "no_wrench"))
    proc = _run(
        "physis_ros.train.wam", "--out", str(out), "--bags", all_bags, "--mapping",
        str(bags["mapping"]), "--init", str(WAM_WEIGHTS), "--steps", "2", "--batch-size", "2",
        "--lr", "1e-4", "--checkpoint-every", "0", "--quiet",
        "--min-committed-ms", "250",  # as the shipped model was trained: its contract, unchanged
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps_done"] == 2 and np.isfinite(summary["final_val"]["action"])
    # what could not be used is said: the bag without its wrench, the corrupt message
    assert (
        f"refused {bags['no_wrench']}: topic '/arm/wrench' (wrench) is not in the bag"
        in proc.stderr
    )
    assert "1 messages of /arm/joint_states not used: corrupt_message" in proc.stderr
    log = json.loads((out / "train_log.json").read_text())
    assert log["bags"]["bags"] == 3 and len(log["bags"]["refused"]) == 1
    assert summary["train_episodes"] + 1 == log["bags"]["episodes"]  # one held out to validate
    weights = out / "weights.safetensors"
    meta = read_metadata(weights)
    assert meta["init_sha256"] == hashlib.sha256(WAM_WEIGHTS.read_bytes()).hexdigest()
    shipped = WamContract.from_metadata(read_metadata(WAM_WEIGHTS))
    assert WamContract.from_metadata(meta) == shipped
    episodes, _ = _episodes(bags)
    pred = _one_prediction(weights, episodes[0], shipped, tmp_path)
    assert pred.actions.shape == (12, 2) and np.isfinite(pred.actions).all()


def _one_prediction(weights: Path, episode, contract, folder: Path):
    """physis-serve --weights on an ephemeral port; a LinkClient stream opened with the
    episode's goal sends its first four frames with their named state; the first chunk."""
    from physis_ros.eval.local_server import LocalServer
    from physis_ros.link.client import LinkClient, Observation
    from physis_ros.link.wire import rgb_image

    serve = dict(extra_args=("--weights", str(weights)))
    with LocalServer({"workers": 1}, folder / "serve.log", **serve) as server:
        client = LinkClient(server.target, seed=1, task=episode.task_values)
        client.start()
        try:
            deadline = time.monotonic() + WAIT_S
            while client.stats().promise is None:
                assert time.monotonic() < deadline, client.stats()
                time.sleep(0.05)
            t0_ns, frame_ns = 1_000_000_000_000, 100_000_000
            for n in range(4):
                state = dict(zip(episode.state_names, map(float, episode.state[n]), strict=True))
                robot = {s.name: state[s.name] for s in contract.robot_state}
                client.send_observation(
                    Observation(
                        seq=n + 1,
                        capture_stamp_ns=t0_ns + n * frame_ns,
                        image=rgb_image(episode.frames[n]),
                        state=robot,
                        commands=episode.rows[: 2 * n + 1],
                        commands_start_ns=t0_ns,
                        commands_dt_ns=frame_ns // 2,
                    )
                )
                while client.stats().observations_sent == n:  # sent (the client keeps one)
                    assert time.monotonic() < deadline, client.stats()
                    time.sleep(0.005)
            while time.monotonic() < deadline:
                pred = client.get_prediction(0.2)
                if pred is not None and not pred.preview_steps:
                    return pred
            pytest.fail(f"no prediction: {client.stats()}; {server.log_tail()}")
        finally:
            client.close()


def test_a_world_model_trains_on_renamed_bags(bags, tmp_path):
    from physis_ros.weights import read_metadata

    out = tmp_path / "wm"
    proc = _run(
        "physis_ros.train.train", str(bags["a"]), str(bags["b"]), "--mapping",
        str(bags["mapping"]), "--out", str(out), "--steps", "2", "--batch-size", "2",
        "--max-context", "2", "--horizon", "2", "--window", "2", "--quiet",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps_done"] == 2 and summary["train_episodes"] == 2
    assert "1 messages of /arm/joint_states not used: corrupt_message" in proc.stderr
    log = json.loads((out / "train_log.json").read_text())
    assert log["skipped_messages"] == {"/arm/joint_states: corrupt_message": 1}
    assert read_metadata(out / "weights.safetensors")["action_names"] == "shoulder,elbow"
    # a mapping whose command topic the bags lack: every bag refused, naming it
    bad = tmp_path / "bad.yaml"
    bad.write_text(MAPPING.replace("/arm/joint_target", "/joint_command"))
    proc = _run("physis_ros.train.train", str(bags["a"]), "--mapping", str(bad), "--out",
                str(tmp_path / "bad"), "--quiet")  # fmt: skip
    assert proc.returncode == 2
    assert "topic '/joint_command' (commanded action) is not in the bag" in proc.stderr
