"""Commanded actions, robot to engine, with real nodes on real topics (isolated domain):
sim_robot publishes the joint targets it applies on ``joint_command``; the bridge pairs each
image with the command in force when it was taken and sends it as the observation's action;
the server passes it to the engine (context chunk and generate requests) of an
action-conditioned world model; malformed or stale commands are counted and the node keeps
running."""

from __future__ import annotations

import contextlib
import json
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from physis_ros.children import stop_child
from physis_ros.nodes.system import ros_args

HELPER = str(Path(__file__).parent / "helpers" / "command_bridge.py")
MS = 1_000_000
pytestmark = [pytest.mark.ros, pytest.mark.slow]


def _stamp_ns(header) -> int:
    return header.stamp.sec * 1_000_000_000 + header.stamp.nanosec


def test_sim_robot_publishes_the_joint_targets_it_applies(ros_env, monitor):
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

    child = subprocess.Popen(
        [sys.executable, "-m", "physis_ros.nodes.sim_robot",
         *ros_args({"camera_rate_hz": 2.0, "trajectory_timeout_s": 60.0})],
        env=ros_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert monitor.wait_for(lambda: monitor.count("joint_command") >= 150, timeout_s=30)
        assert monitor.published_types("joint_command") == {"trajectory_msgs/msg/JointTrajectory"}
        scripted = [m for _, m in monitor.messages("joint_command")]
        for msg in scripted:
            assert list(msg.joint_names) == ["shoulder", "elbow"]
            assert len(msg.points) == 1 and len(msg.points[0].positions) == 2
            assert msg.header.frame_id == "table"  # as in the recorded bags
        stamps = np.array([_stamp_ns(m.header) for m in scripted])
        assert np.all(np.diff(stamps) > 0)
        # one command per physics step (state_rate_hz 100): stamps ~10 ms apart
        assert 5 * MS < np.median(np.diff(stamps)) < 20 * MS, np.diff(stamps)
        positions = np.array([m.points[0].positions for m in scripted])
        assert np.all(np.isfinite(positions))
        assert np.ptp(positions, axis=0).max() > 1e-3  # the scripted policy moves the arm

        # A followed trajectory is what gets commanded (joint order given reversed here).
        pub = monitor.node.create_publisher(
            JointTrajectory,
            "joint_trajectory",
            QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE),
        )
        # two subscribers: the monitor's own and sim_robot's
        assert monitor.wait_for(lambda: pub.get_subscription_count() >= 2, timeout_s=10)
        traj = JointTrajectory()  # zero stamp: start now; one point, held until the timeout
        traj.joint_names = ["elbow", "shoulder"]
        traj.points = [JointTrajectoryPoint(positions=[0.9, 0.3])]
        t_sent = time.monotonic()
        pub.publish(traj)

        def followed():
            return any(
                list(m.points[0].positions) == [0.3, 0.9]
                for _, m in monitor.messages("joint_command", since_s=t_sent)
            )

        assert monitor.wait_for(followed, timeout_s=5), monitor.get("joint_command")
        assert child.poll() is None
    finally:
        code = stop_child(child, sig=signal.SIGINT)
    assert code == 0  # it ran until stopped and exited cleanly on SIGINT


def _image(stamp_ns: int, value: int):
    from sensor_msgs.msg import Image

    msg = Image()
    msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(stamp_ns, 1_000_000_000)
    msg.height, msg.width, msg.encoding, msg.step = 16, 16, "rgb8", 48
    msg.data = bytes([value]) * (16 * 48)
    return msg


def _command(stamp_ns: int, names: list[str], positions: list[float] | None):
    from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

    msg = JointTrajectory()
    msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(stamp_ns, 1_000_000_000)
    msg.joint_names = names
    msg.points = [] if positions is None else [JointTrajectoryPoint(positions=positions)]
    return msg


def _lines(stream) -> queue.Queue:
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in stream], daemon=True).start()
    return lines


@contextlib.contextmanager
def _command_bridge(ros_env, tmp_path, params: dict):
    """The bridge and front end over a recording engine (helpers/command_bridge.py), ready;
    yields ``state()`` (its counts, drops and the engine's context chunks now), ``wait``
    (until a predicate of the state holds) and ``finish()``, which ends it and returns its
    report (events, counts, drops)."""
    params = {"server_port_file": str(tmp_path / "port"), **params}
    child = subprocess.Popen(
        [sys.executable, HELPER, str(tmp_path / "port"), *ros_args(params)],
        env=ros_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        out = _lines(child.stdout)
        assert out.get(timeout=120).strip() == "ready"

        def state() -> dict:
            child.stdin.write("state\n")
            child.stdin.flush()
            return json.loads(out.get(timeout=60))

        def wait(predicate, what: str, timeout_s: float = 60.0) -> dict:
            """Until ``predicate(state)``: a busy machine delays delivery, never reorders
            the steps of the test."""
            deadline = time.monotonic() + timeout_s
            while not predicate(got := state()):
                assert time.monotonic() < deadline, f"timed out waiting for {what}: {got}"
                time.sleep(0.02)
            return got

        def finish() -> dict:
            child.stdin.write("done\n")
            child.stdin.flush()
            report = json.loads(out.get(timeout=60))
            assert child.wait(timeout=30) == 0
            return report

        yield SimpleNamespace(state=state, wait=wait, finish=finish)
    finally:
        stop_child(child, sig=signal.SIGINT)


def test_bridge_sends_the_command_in_force_and_the_engine_gets_it(ros_env, monitor, tmp_path):
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from sensor_msgs.msg import Image
    from trajectory_msgs.msg import JointTrajectory

    params = {
        "input_reliability": "reliable",
        "require_wrench": False,
        "require_joints": False,
        "command_joint_names": ["shoulder", "elbow"],
        "command_max_age_s": 0.05,
        "target_interval_ms": 30.0,
    }
    with _command_bridge(ros_env, tmp_path, params) as bridge:
        node = monitor.node
        qos = QoSProfile(depth=20, reliability=ReliabilityPolicy.RELIABLE)
        images = node.create_publisher(Image, "camera/image", qos)
        commands = node.create_publisher(JointTrajectory, "joint_command", qos)
        # Two subscribers each: the monitor's own and the bridge's. Once matched (reliable,
        # depth 20), nothing published from here on is lost.
        assert monitor.wait_for(
            lambda: images.get_subscription_count() >= 2 and commands.get_subscription_count() >= 2,
            timeout_s=60,
        )

        def now_ns() -> int:
            return node.get_clock().now().nanoseconds

        def commands_seen(state: dict) -> int:
            problems = ("missing_joint", "no_points", "out_of_order_stamp")
            drops = state["drops"]
            return state["counts"]["commands"] + sum(drops.get(f"command:{p}", 0) for p in problems)

        published = {"commands": 0, "images": 0}

        def publish_commands(*msgs) -> None:
            """Published, and waited for until the bridge has them all: its image is paired
            with the commands it has when the image arrives."""
            for msg in msgs:
                commands.publish(msg)
            published["commands"] += len(msgs)
            bridge.wait(lambda s: commands_seen(s) >= published["commands"], "the commands")

        def publish_image(stamp_ns: int, value: int) -> None:
            """Published, and waited for until the engine has its context chunk: none is
            superseded by the next, however slowly the machine runs."""
            images.publish(_image(stamp_ns, value))
            published["images"] += 1
            bridge.wait(lambda s: s["contexts"] >= published["images"], f"image {value}")

        expected: dict[int, list[float] | None] = {}  # image pixel value -> action [A]
        step_ms = 150  # stamps only: the pairing goes by stamps, not by arrival times

        # 1. An image before any command: sent without one (command:none_before_image).
        expected[10] = None
        base = now_ns()
        publish_image(base, 10)
        # 2. Good commands; joints in another order, with one the model does not take. The
        #    command stamped after the image must not be taken.
        for i in range(4):
            base += step_ms * MS
            shoulder, elbow = 0.25 + 0.125 * i, -0.5 - 0.0625 * i
            publish_commands(
                _command(base - 20 * MS, ["elbow", "wrist", "shoulder"], [elbow, 9.0, shoulder]),
                _command(base + 10 * MS, ["shoulder", "elbow"], [7.0, 7.0]),
            )
            value = 20 + 10 * i
            expected[value] = [shoulder, elbow]
            publish_image(base, value)
        # 3. The newest command is 150 ms old (> command_max_age_s): no action (stale).
        base += step_ms * MS
        expected[70] = None
        publish_image(base, 70)
        # 4. Malformed commands: a needed joint missing, no points. Counted, ignored; the
        #    image after them goes with the last good command, and the node keeps running.
        base += step_ms * MS
        publish_commands(
            _command(base - 40 * MS, ["shoulder", "elbow"], [1.5, -1.5]),
            _command(base - 30 * MS, ["shoulder"], [0.5]),
            _command(base - 20 * MS, ["shoulder", "elbow"], None),
        )
        expected[80] = [1.5, -1.5]
        publish_image(base, 80)
        base += step_ms * MS
        publish_commands(_command(base - 5 * MS, ["shoulder", "elbow"], [-0.75, 0.375]))
        expected[90] = [-0.75, 0.375]
        publish_image(base, 90)
        report = bridge.finish()

    counts, drops, events = report["counts"], report["drops"], report["events"]
    # every image went to the link, with a command where one was in force
    assert counts["sent"] == len(expected), report
    assert counts["observations_with_command"] == sum(a is not None for a in expected.values())
    assert drops.get("command:none_before_image") == 1, drops
    assert drops.get("command:stale") == 1, drops
    assert drops.get("command:missing_joint") == 1 and drops.get("command:no_points") == 1, drops
    # the engine: each image's context chunk carries its command, held over the horizon (4),
    # columns in the model's order (shoulder, elbow), float32 values exactly
    contexts = {pixel: actions for kind, pixel, actions in events if kind == "context"}
    assert len(contexts) == len(expected), contexts  # each waited for: none superseded
    for pixel, actions in contexts.items():
        want = expected[round(pixel)]
        if want is None:
            assert actions is None, (pixel, actions)
        else:
            np.testing.assert_array_equal(actions, np.tile(np.float32(want), (4, 1)), str(pixel))
    # generate requests of a condition model carry the newest context's actions
    held = None
    generates_with_actions = 0
    for kind, _pixel, actions in events:
        if kind == "context":
            held = actions
        else:
            assert actions == held, (actions, held)
            generates_with_actions += actions is not None
    assert generates_with_actions > 0


def test_a_replayed_bag_conditions_the_engine_as_the_model_was_trained(ros_env, tmp_path):
    """physis-replay of a recorded bag -> bridge (default command order: the first
    command's) -> server -> engine: each frame's context chunk carries the bag's command in
    force when that frame was taken, the alignment training and physis-eval use."""
    from physis_ros.eval.bag import read_episode
    from physis_ros.sim.record import IMAGE_TOPIC, RecordConfig, record_episode

    bag = tmp_path / "bag"
    record_episode(bag, RecordConfig(seed=5, duration_s=3.0, image_height=16, image_width=16))
    episode = read_episode(bag)
    params = {
        "image_topic": IMAGE_TOPIC,
        "input_reliability": "reliable",
        "target_interval_ms": 30.0,
    }
    with _command_bridge(ros_env, tmp_path, params) as bridge:
        replay = subprocess.run(
            [sys.executable, "-m", "physis_ros.eval.replay", str(bag), "--reliable",
             "--wait-subscribers-s", "15"],
            env=ros_env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert replay.returncode == 0, replay.stderr
        sent = json.loads(replay.stdout.strip().splitlines()[-1])["published"][IMAGE_TOPIC]
        # every replayed image sent, or dropped and counted (a busy host delays the bag's
        # state messages past the pairing window: "unpaired")
        bridge.wait(
            lambda s: s["counts"]["sent"] + s["drops"].get("unpaired", 0) >= sent - 1,
            "the replayed images sent or counted",
        )
        report = bridge.finish()

    # frames are told apart by their mean pixel value (those sharing one are left out)
    means = [float(frame.mean()) for frame in episode.frames]
    index = {m: i for i, m in enumerate(means) if means.count(m) == 1}
    checked = 0
    for kind, pixel, actions in report["events"]:
        if kind != "context" or pixel not in index:
            continue
        i = index[pixel]
        if i == 0:  # the bag's first command comes after its first frame
            assert actions is None
            continue
        want = np.float32(episode.actions_for_chunk(i, 1, 1)[0])
        # the bridge waits (command_wait_s) for a command in flight: on a busy host too
        np.testing.assert_array_equal(actions, np.tile(want, (4, 1)), f"frame {i}")
        checked += 1
    # Reliable QoS end to end; frames the server superseded (newest wins when the engine
    # falls behind, as on a busy machine) are the only ones missing.
    identifiable = len(index) - (0 in index)
    assert identifiable >= 10 and checked >= identifiable // 2, (checked, identifiable, report)
    counts = report["counts"]
    assert counts["observations_with_command"] >= counts["sent"] - 1, report
    assert report["drops"].get("command:none_before_image", 0) <= 1, report["drops"]
