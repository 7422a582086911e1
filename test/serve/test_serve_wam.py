"""physis-serve serves a world-action model with state values and committed actions.

A real physis-serve (one process, and 2 gloo ranks under torchrun) serves ``tiny-wam`` on
random weights saved with the metadata physis-train-wam writes. A robot stream (LinkClient)
sends camera frames with joint states, the wrench and its command timeline, kept by a
``ChunkExecutor`` that executes the replies as the bridge does. Every reply's actions equal
(<= 1e-5, fp32) what the in-process engine gives for the same stream seed and the requests the
closed-loop evaluation builds (per-frame state in the weights' order; the rows known up to the
newest capture plus the promised response latency (``known_until_ns``), read off the command
timeline with ``ChunkExecutor.rows_on_grid`` and ``known_rows``), and its action timing is the
robot-clock time of its slot's first frame. Each observation carries the model's inputs by
the names its contract gives them; bad observations (a state value missing, one the model does
not take, commands of the wrong shape) are dropped, counted by reason, and the stream goes on.
Weights that ask for a commit floor (min_committed_ms) get their committed rows that far
whatever the latency. push-wam (random weights) is served only streams with its task's values,
and takes its box inputs from each observation's named state.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from physis_ros.children import stop_child
from physis_ros.contract.timeline import ChunkExecutor, TimedRows, known_rows, known_until_ns

REPO_ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).parent / "torchrun"
MODEL = "tiny-wam"
SEED = 11
T0_NS = 1_000_000_000_000  # robot clock of frame 0
FRAME_NS = 50_000_000  # a 20 Hz camera: the next slot's first row is one row after a capture
ROW_NS = 50_000_000  # 20 Hz rows
JOINTS = ("shoulder", "elbow")
STATE_NAMES = (
    "shoulder_pos", "elbow_pos", "shoulder_vel", "elbow_vel",
    "force_x", "force_y", "force_z", "torque_x", "torque_y", "torque_z",
)  # fmt: skip
MAX_KNOWN_ROWS_AHEAD = 8
WRENCH = ("force_x", "force_y", "force_z", "torque_x", "torque_y", "torque_z")


def named_state(pos, vel, force, *, joints=True, wrench=True, box_xy=None) -> dict[str, float]:
    """The robot's state by the contract's names, as the bridge sends it."""
    state = {}
    if joints:
        for j, name in enumerate(JOINTS):
            state[f"{name}_pos"], state[f"{name}_vel"] = float(pos[j]), float(vel[j])
    if wrench:
        state.update(zip(WRENCH, map(float, force), strict=True))
    if box_xy is not None:
        state["box_x"], state["box_y"] = map(float, box_xy)
    return state


SLOTS = 5
WAIT_S = 180.0  # a generous bound for a busy machine: no timing is asserted


def _tiny_wam_weights(folder: Path, *, min_committed_ms: float = 0.0) -> Path:
    from safetensors.torch import save_file

    from physis_ros.contract.model import CONTRACT_KEY
    from physis_ros.engine.build import build_model
    from physis_ros.engine.config import get_preset
    from physis_ros.engine.model import to_upstream_state_dict
    from physis_ros.train.wam import WamTrainConfig, contract, metadata

    path = folder / "weights.safetensors"
    model = build_model(get_preset(MODEL), seed=3)
    cfg = WamTrainConfig(
        model=MODEL, window=2, max_obs=2, chunks=3, sample_steps=2, prompt="",
        min_committed_ms=min_committed_ms, max_freeze_rows=MAX_KNOWN_ROWS_AHEAD,
    )  # fmt: skip
    # the task's contract with a 20 Hz camera (FRAME_NS), in the metadata and in the contract
    camera_20hz = dataclasses.replace(contract(cfg), frame_hz=1e9 / FRAME_NS)
    meta = metadata(cfg, {"frame_hz": str(1e9 / FRAME_NS), CONTRACT_KEY: camera_20hz.to_json()})
    assert meta["state_names"].split(",") == list(STATE_NAMES)
    save_file(to_upstream_state_dict(model), str(path), metadata=meta)
    return path


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    return _tiny_wam_weights(tmp_path_factory.mktemp("tiny_wam"))


def _env() -> dict[str, str]:
    pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath)


def _serve(weights: Path, folder: Path, ranks: int):
    """(process, port) of physis-serve on an ephemeral port of 127.0.0.1."""
    port_file = folder / "port"
    args = ["--weights", str(weights), "--host", "127.0.0.1", "--port", "0"]
    args += ["--port-file", str(port_file)]
    if ranks:
        (folder / "serve.yaml").write_text(
            "distributed: {heartbeat_interval_s: 0.2, fault_timeout_s: 5.0, comm_timeout_s: 30}\n"
        )
        cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", str(ranks)]
        cmd += ["-m", "physis_ros.serve.main", "--config", str(folder / "serve.yaml"), *args]
    else:
        cmd = [sys.executable, "-m", "physis_ros.serve.main", *args]
    log_path = folder / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + WAIT_S
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_child(proc, timeout_s=30)
            pytest.fail("physis-serve did not serve: " + log_path.read_text()[-3000:])
        time.sleep(0.1)
    return proc, int(port_file.read_text())


@pytest.fixture(scope="module")
def server(weights, tmp_path_factory):
    proc, port = _serve(weights, tmp_path_factory.mktemp("serve"), ranks=0)
    yield port
    assert stop_child(proc, timeout_s=30) == 0


class Robot:
    """The robot side of one stream: frames with joint state and wrench, the command timeline
    of a ChunkExecutor that executes each reply when it arrives, and what each request to the
    model must hold (the closed-loop evaluation's builder)."""

    def __init__(
        self,
        port: int,
        *,
        task: dict | None = None,
        image_size: int = 8,
        min_committed_ms: float = 0.0,
        target_interval_ms: float = 200.0,
    ) -> None:
        from physis_ros.link.client import LinkClient

        self.client = LinkClient(
            f"127.0.0.1:{port}", seed=SEED, task=task, target_interval_ms=target_interval_ms
        )
        self.client.start()
        self.rng = np.random.default_rng(5)
        self.image_size = image_size
        """The camera's height and width: the model's (the server takes no other)."""
        self.min_committed_ms = min_committed_ms
        """The weights' floor under the latency the committed rows reach."""
        self.executor = ChunkExecutor(join="crossfade")
        self.executor.seed(T0_NS, np.array([1.0, 1.7]))
        self.seq = 0
        self.sent: list[dict] = []
        """Per frame: image, state, and the rows known at its capture (per slot asked)."""

    def latency_ms(self) -> float:
        deadline = time.monotonic() + WAIT_S
        while self.client.stats().promise is None:
            assert time.monotonic() < deadline, self.client.stats()
            time.sleep(0.05)
        return self.client.stats().promise.expected_response_latency_ms

    def observation(self, *, joints=True, wrench=True, commands_cols=2, box_xy=None, extra=None):
        """``box_xy``: the box centre its object tracker reports (none: no box_x, box_y);
        ``extra``: a named value the model does not take."""
        from physis_ros.link.client import Observation
        from physis_ros.link.wire import rgb_image

        n = self.seq
        capture_ns = T0_NS + n * FRAME_NS
        size = self.image_size
        image = self.rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
        pos, vel = self.rng.normal(1.2, 0.3, 2), self.rng.normal(0, 0.5, 2)
        force = self.rng.normal(0, 2, 6)
        # the timeline the bridge sends: commanded before the capture, committed after it
        start_ns = max(T0_NS, capture_ns - 1_000_000_000)
        count = (self.executor.plan_end_ns() - start_ns) // ROW_NS + 1
        commands = self.executor.rows_on_grid(start_ns, ROW_NS, int(count))
        assert np.isfinite(commands).all()
        commands = np.tile(commands, (1, 2))[:, :commands_cols]
        obs = Observation(
            seq=1000 + n,
            capture_stamp_ns=capture_ns,
            image=rgb_image(image),
            wrench=force.astype(np.float32) if wrench else None,
            joint_names=JOINTS if joints else (),
            joint_positions=pos.astype(np.float32) if joints else None,
            joint_velocities=vel.astype(np.float32) if joints else None,
            commands=commands.astype(np.float32),
            commands_start_ns=start_ns,
            commands_dt_ns=ROW_NS,
            state=named_state(pos, vel, force, joints=joints, wrench=wrench, box_xy=box_xy)
            | (extra or {}),
        )
        state = np.concatenate([pos, vel, force]).astype(np.float32)
        return obs, image, state, capture_ns

    def send(self, obs) -> None:
        sent = self.client.stats().observations_sent
        self.client.send_observation(obs)
        deadline = time.monotonic() + WAIT_S
        while self.client.stats().observations_sent == sent:  # on the wire, in order
            assert time.monotonic() < deadline, self.client.stats()
            time.sleep(0.005)
        self.seq += 1

    def known(self, slot: int, capture_ns: int, latency_ms: float) -> np.ndarray:
        """The closed-loop evaluation's rows of ``slot`` known at ``capture_ns``."""
        until_ns = known_until_ns(
            capture_ns, latency_ms * 1e6, dt_ns=ROW_NS, max_rows_ahead=MAX_KNOWN_ROWS_AHEAD,
            min_committed_ns=self.min_committed_ms * 1e6,
        )  # fmt: skip
        start = T0_NS + slot * 2 * FRAME_NS
        grid = self.executor.rows_on_grid(start, ROW_NS, 6)
        return known_rows(grid, row_start_ns=start, dt_ns=ROW_NS, known_until_ns=until_ns,
                          known_after_ns=capture_ns)  # fmt: skip

    def observe_slot(self, slot: int, latency_ms: float) -> dict:
        """Sends the slot's two frames; what the engine must be given for it and for the
        slot it releases."""
        frames, states = [], []
        for _ in range(2):
            obs, image, state, capture_ns = self.observation()
            self.send(obs)
            frames.append(image)
            states.append(state)
        return {
            "slot": slot,
            "frames": np.stack(frames),
            "state": np.stack(states),
            "rows": self.known(slot, capture_ns, latency_ms),
            "generate": self.known(slot + 1, capture_ns, latency_ms),
            "capture_ns": capture_ns,
        }

    def prediction(self, chunk: int, *, at_least: bool = False):
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            pred = self.client.get_prediction(0.2)
            if pred is None or pred.preview_steps:
                continue
            if pred.chunk_index == chunk or (at_least and pred.chunk_index > chunk):
                return pred
        pytest.fail(f"no prediction of chunk {chunk}: {self.client.stats()}")

    def execute(self, pred, now_ns: int) -> None:
        rows = np.asarray(pred.actions, np.float64)
        report = self.executor.accept(
            TimedRows(pred.action_start_ns, pred.action_dt_ns, rows),
            now_ns=now_ns,
            chunk_id=pred.chunk_index,
        )
        assert report.accepted, report


def _run_stream(port: int, min_committed_ms: float = 0.0) -> tuple[list[dict], list]:
    robot = Robot(port, min_committed_ms=min_committed_ms)
    try:
        latency_ms = robot.latency_ms()
        requests, preds = [], []
        for slot in range(SLOTS):
            req = robot.observe_slot(slot, latency_ms)
            requests.append(req)
            pred = robot.prediction(slot + 1)
            preds.append(pred)
            # it arrives a response latency after the capture: the robot executes it then
            robot.execute(pred, req["capture_ns"] + int(latency_ms * 1e6) + 1)
        assert robot.client.stats().drops == {}, robot.client.stats()
    finally:
        robot.client.close()
    for req in requests:
        req["latency_ms"] = latency_ms
    return requests, preds


def _in_process(weights: Path, requests: list[dict]) -> dict[int, np.ndarray]:
    """The in-process engine on the same stream seed and requests: chunk -> actions."""
    from physis_ros.engine.api import StreamSpec
    from physis_ros.engine.threads import local_engine
    from physis_ros.weights import engine_kwargs

    out: dict[int, np.ndarray] = {}
    with local_engine(**engine_kwargs(weights)) as engine:
        sid = engine.open_stream(StreamSpec(seed=SEED)).stream_id
        for req in requests:
            engine.submit_context(sid, req["frames"], req["rows"], req["state"], slot=req["slot"])
            chunk = engine.submit_generate(sid, req["generate"])
            deadline = time.monotonic() + WAIT_S
            while chunk not in out:
                assert time.monotonic() < deadline
                out.update({o.chunk: o.actions for o in engine.poll(0.2) if not o.preview_steps})
    return out


def _check(weights: Path, requests: list[dict], preds: list) -> None:
    expected = _in_process(weights, requests)
    worst = 0.0
    known_generated = known_observed = 0
    for req, pred in zip(requests, preds, strict=True):
        chunk = req["slot"] + 1
        assert pred.actions.shape == (6, 2) and pred.anchor_slot == req["slot"]
        worst = max(worst, float(np.abs(pred.actions - expected[chunk]).max()))
        # row i is for the time of the chunk's first frame + i rows, on the robot's clock
        assert pred.action_start_ns == T0_NS + chunk * 2 * FRAME_NS
        assert pred.action_dt_ns == ROW_NS
        known = ~np.isnan(req["generate"]).any(axis=1)
        leading = int(np.argmax(~known)) if not known.all() else len(known)
        assert pred.known_action_rows == leading
        # the committed rows come back unchanged
        np.testing.assert_allclose(pred.actions[known], req["generate"][known], atol=1e-5)
        known_generated += int(known.sum())
        known_observed += int((~np.isnan(req["rows"]).any(axis=1)).sum())
    assert worst <= 1e-5, worst
    # the command timeline reached both kinds of request (the rows after the capture, up to
    # it plus the promised latency: a row ahead of each capture but the first one's, before
    # any chunk was committed)
    assert known_generated >= len(preds) - 1 and known_observed >= len(preds) - 1, (
        known_generated,
        known_observed,
    )


def test_served_world_action_stream_equals_the_in_process_engine(weights, server):
    requests, preds = _run_stream(server)
    _check(weights, requests, preds)


def test_the_weights_commit_floor_reaches_the_served_requests(tmp_path):
    """Weights whose metadata says min_committed_ms 200 (four rows, beyond this stream's
    promised latency): every generated chunk is asked with the committed rows up to 200 ms
    after the newest capture, and says so (known_action_rows), as the closed loop builds it."""
    weights = _tiny_wam_weights(tmp_path, min_committed_ms=200.0)
    proc, port = _serve(weights, tmp_path, ranks=0)
    try:
        requests, preds = _run_stream(port, min_committed_ms=200.0)
    finally:
        assert stop_child(proc, timeout_s=30) == 0
    assert requests[0]["latency_ms"] < 150.0  # the floor, not the latency, sets the reach
    _check(weights, requests, preds)
    assert max(p.known_action_rows for p in preds) >= 3, [p.known_action_rows for p in preds]


def test_bad_observations_are_counted_and_the_stream_goes_on(server):
    robot = Robot(server)
    try:
        latency_ms = robot.latency_ms()
        robot.observe_slot(0, latency_ms)
        robot.prediction(1)
        for bad in (
            {"joints": False},
            {"wrench": False},
            {"extra": {"gripper_width": 0.03}},
            {"commands_cols": 1},
        ):
            robot.send(robot.observation(**bad)[0])
        for _ in range(6):  # frames 5..10: slots 1 (filled) to 4 complete
            robot.send(robot.observation()[0])
        pred = robot.prediction(5, at_least=True)
        assert pred.actions.shape == (6, 2) and np.isfinite(pred.actions).all()
        drops = robot.client.stats().drops
    finally:
        robot.client.close()
    assert drops.get("server:missing_state") == 2, drops  # no joint states; no wrench
    for reason in ("unknown_state", "commands_shape"):
        assert drops.get(f"server:{reason}") == 1, drops


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not in this venv")
def test_two_gloo_ranks_serve_it_as_the_in_process_engine(weights, tmp_path):
    proc, port = _serve(weights, tmp_path, ranks=2)
    try:
        requests, preds = _run_stream(port)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        finally:
            stop_child(proc, timeout_s=10)
    _check(weights, requests, preds)


@pytest.fixture(scope="module")
def push_wam_server(tmp_path_factory):
    """The port of physis-serve serving push-wam on random weights with the metadata
    physis-train-wam writes: its state ends with goal_x, goal_y, box_x, box_y."""
    from safetensors.torch import save_file

    from physis_ros.engine.build import build_model
    from physis_ros.engine.config import get_preset
    from physis_ros.engine.model import to_upstream_state_dict
    from physis_ros.train.wam import WamTrainConfig, metadata

    folder = tmp_path_factory.mktemp("push_wam")
    path = folder / "push_wam.safetensors"
    model = build_model(get_preset("push-wam"), seed=0)
    save_file(to_upstream_state_dict(model), str(path), metadata=metadata(WamTrainConfig(), {}))
    proc, port = _serve(path, folder, ranks=0)
    yield port
    assert stop_child(proc, timeout_s=30) == 0


def test_a_goal_conditioned_model_is_served_only_streams_with_a_goal(push_wam_server):
    """push-wam takes the task's goal (its contract's task values goal_x, goal_y: state
    inputs and its prompt): a client's stream opens with them; one without them, with other
    names, or with a goal off the table, is refused with what to send, and the server goes
    on. The server says what the model takes before a stream opens (GetServerInfo)."""
    import grpc

    from physis_ros.link.proto_gen import physis_pb2 as pb
    from physis_ros.link.proto_gen import physis_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{push_wam_server}") as channel:
        stub = pb_grpc.PhysisStub(channel)

        def open_with(task: dict):
            spec = pb.StreamSpec(protocol_version=1, task=task, target_interval_ms=1000)
            return stub.OpenStream(spec, timeout=60)

        info = stub.GetServerInfo(pb.ServerInfoRequest(), timeout=60)
        assert '"task_features"' in info.contract and '"goal_x"' in info.contract
        for task, why in (({}, "missing ['goal_x', 'goal_y']"),
                          ({"goal_x": 0.1, "target_y": 0.2}, "unknown ['target_y']"),
                          ({"goal_x": 0.9, "goal_y": 0.0}, "outside the range")):  # fmt: skip
            with pytest.raises(grpc.RpcError) as refused:
                open_with(task)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert why in refused.value.details()
        promise = open_with({"goal_x": 0.12, "goal_y": -0.3}).promise
        assert promise.action_mode == "predict" and promise.stream_id > 0
        assert '"box.x"' in promise.contract


def test_push_wam_takes_the_box_from_each_observations_named_state(push_wam_server):
    """push-wam's box_x, box_y come from the robot's object tracker (the observation's named
    state values): an observation without them is dropped and counted (missing_state), and
    the stream goes on with those that carry them."""
    # a target interval push-wam keeps on a loaded host too (admission measures the host)
    robot = Robot(
        push_wam_server,
        task={"goal_x": 0.12, "goal_y": -0.3},
        image_size=32,
        target_interval_ms=1000,
    )
    try:
        robot.latency_ms()  # the stream is open
        robot.send(robot.observation()[0])  # no tracker: dropped
        for _ in range(4):  # two slots observed: the next one is generated
            robot.send(robot.observation(box_xy=(0.05, -0.25))[0])
        pred = robot.prediction(1, at_least=True)
        assert pred.actions.shape == (12, 2) and np.isfinite(pred.actions).all()
        drops = robot.client.stats().drops
    finally:
        robot.client.close()
    assert drops == {"server:missing_state": 1}, drops


def test_a_client_opens_its_stream_only_once_it_has_the_tasks_values(push_wam_server):
    """LinkClient learns the model's contract from the server before it opens a stream: with
    no task values it opens none and says what it waits for; set_task opens it with them."""
    from physis_ros.link.client import LinkClient

    client = LinkClient(f"127.0.0.1:{push_wam_server}", connect_timeout_s=30)
    client.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while "waiting for the task's values" not in client.stats().last_error:
            assert time.monotonic() < deadline, client.stats()
            time.sleep(0.05)
        assert client.stats().promise is None and client.contract.task_names == (
            "goal_x",
            "goal_y",
        )
        client.set_task({"goal_x": 0.12, "goal_y": -0.3})
        while client.stats().promise is None:
            assert time.monotonic() < deadline, client.stats()
            time.sleep(0.05)
        assert client.stats().state == "streaming"
    finally:
        client.close()
