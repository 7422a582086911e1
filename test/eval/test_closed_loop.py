"""physis-eval --closed-loop: the expert's episodes, the model's at injected delays in each
execution mode, and the report a user reads (success, time to goal, action error, jumps where
chunks join, box paths, a strip)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from physis_ros.eval.closed_loop import ClosedLoopConfig, run_episode
from physis_ros.eval.closed_loop_report import box_paths_png, run_names


def test_the_expert_reaches_held_out_goals_in_the_closed_loop(tmp_path):
    cfg = ClosedLoopConfig(policy="expert")
    results = [run_episode(cfg, 10_000 + i, None) for i in range(3)]
    assert all(r.success and r.time_to_goal_s < cfg.time_limit_s for r in results)
    assert all(r.action_rmse_rad == 0.0 for r in results)  # it is its own reference
    box_paths_png(tmp_path / "paths.png", results, title="expert")
    assert (tmp_path / "paths.png").stat().st_size > 1000


def test_run_names_cover_the_expert_and_each_mode_per_delay():
    runs = dict(run_names([0.0, 150.0], with_expert=True, modes=["crossfade", "naive"]))
    assert list(runs) == [
        "expert", "model_crossfade_0ms", "model_naive_0ms",
        "model_crossfade_150ms", "model_naive_150ms",
    ]  # fmt: skip
    assert runs["model_naive_150ms"] == {"policy": "model", "delay_ms": 150.0,
                                         "delay_aware": False, "join": "replace"}  # fmt: skip


@pytest.fixture(scope="module")
def untrained_wam(tmp_path_factory):
    """push-wam with its seeded initial weights and the metadata physis-train-wam writes."""
    from safetensors.torch import save_file

    from physis_ros.engine.build import build_model
    from physis_ros.engine.config import get_preset
    from physis_ros.engine.model import to_upstream_state_dict
    from physis_ros.train.wam import WamTrainConfig, metadata

    path = tmp_path_factory.mktemp("wam") / "weights.safetensors"
    model = build_model(get_preset("push-wam"), seed=0)
    save_file(to_upstream_state_dict(model), str(path), metadata=metadata(WamTrainConfig(), {}))
    return path


def test_closed_loop_command_writes_the_report(untrained_wam, tmp_path):
    out = tmp_path / "report"
    cmd = [
        sys.executable, "-m", "physis_ros.eval.cli", "--closed-loop", "--weights",
        str(untrained_wam), "--episodes", "1", "--delay-ms", "0", "200", "--modes", "crossfade",
        "naive", "--time-limit-s", "1.2", "--out", str(out), "--quiet",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(summary["runs"]) == {
        "expert", "model_crossfade_0ms", "model_naive_0ms",
        "model_crossfade_200ms", "model_naive_200ms",
    }  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    aware, naive = report["runs"]["model_crossfade_200ms"], report["runs"]["model_naive_200ms"]
    assert aware["delay_control_periods"] == 4 and aware["delay_aware"] and not naive["delay_aware"]
    # 200 ms late, each delay-aware chunk skips the rows whose time has passed; the naive
    # baseline executes them late instead (none skipped)
    assert aware["rows_skipped"] >= aware["chunks_accepted"] and naive["rows_skipped"] == 0
    assert aware["chunks_accepted"] >= 3 and np.isfinite(aware["action_rmse_rad"]["mean"])
    for name in summary["runs"]:
        assert (out / f"box_paths_{name}.png").stat().st_size > 1000
    assert (out / "strip.png").stat().st_size > 1000
    assert "| model_naive_200ms | 200 (4) |" in (out / "report.md").read_text()


class _ConstantDecider:
    """Answers every request with rows that hold the arm where it started (a model that
    never moves), counting the requests."""

    def __init__(self, cfg, hold: np.ndarray):
        self.engine = type("E", (), {"cfg": cfg})()
        self.hold, self.requests = hold, 0
        self.known_rows: list[int] = []  # per request: committed rows given for the new chunk

    def answer(self, contexts, known, gen_known, seed, goal_xy=None):
        from physis_ros.eval.closed_loop import Answer

        self.requests += 1
        self.known_rows.append(int(np.isfinite(gen_known).all(axis=1).sum()))
        return Answer(rows=np.tile(self.hold, (self.engine.cfg.action_horizon, 1)))


def test_on_policy_episodes_label_the_models_states_with_the_experts_rows():
    """DAgger data: the model drives, the expert takes over in the spans Takeovers draws.
    The record's rows are what was commanded; the model's are flagged (history only), the
    expert's are not, and they move the arm where the still model does not."""
    from physis_ros.engine.config import get_preset
    from physis_ros.eval.closed_loop import NS, ROW_NS, Takeovers
    from physis_ros.sim.task import sample_task

    seed = 3
    start = np.array(sample_task(seed).joints)
    decider = _ConstantDecider(get_preset("push-wam"), start)
    cfg = ClosedLoopConfig(time_limit_s=4.0, after_goal_s=1.0)
    takeovers = Takeovers(seed, cfg.time_limit_s)
    r = run_episode(cfg, seed, decider, takeovers=takeovers)
    ep = r.record
    assert ep is not None and len(ep.rows) == 2 * (len(ep.frames) - 1) + 1
    assert len(ep.proprio) == len(ep.frames) == len(ep.box)
    np.testing.assert_allclose(ep.rows[0], start, atol=1e-6)
    expert = np.array([takeovers.expert_at((i - 1) * ROW_NS) for i in range(len(ep.rows))])
    expert[0] = False
    np.testing.assert_array_equal(~ep.perturbed[1:], expert[1:])
    assert 0.2 < expert.mean() < 0.8  # both drive a fair share
    moves = np.abs(np.diff(ep.rows, axis=0)).max(axis=1)  # row i -> i + 1
    first = -(-takeovers.spans_ns[0][0] // ROW_NS)  # the expert's first control period
    assert all(moves[i] < 1e-6 for i in range(first))  # the still model's rows hold
    assert moves[first] > 1e-3  # the expert moves from its first row
    # no request whose answer would arrive while the expert drives: fewer than one a slot
    slots = int(r.duration_s * NS // (2 * ROW_NS * 2))
    assert 0 < decider.requests < slots


@pytest.mark.parametrize(("ahead", "expect"), [(8, 2), (2, 1), (0, 0)])
def test_committed_rows_given_are_capped_by_known_rows_ahead(ahead, expect):
    """150 ms late, the rows up to +150 ms after the newest frame are committed before the
    answer arrives; the new chunk's are those at +100 ms and +150 ms, and the model is told
    them up to ``ahead`` rows (50 ms each) past the newest frame (``physis-eval
    --known-rows-ahead``): both, the first only, or none."""
    from physis_ros.engine.config import get_preset
    from physis_ros.sim.task import sample_task

    seed = 3
    decider = _ConstantDecider(get_preset("push-wam"), np.array(sample_task(seed).joints))
    cfg = ClosedLoopConfig(time_limit_s=2.0, delay_ms=150.0, max_known_rows_ahead=ahead)
    run_episode(cfg, seed, decider)
    assert decider.requests >= 5
    assert decider.known_rows[1:] == [expect] * (len(decider.known_rows) - 1), decider.known_rows


@pytest.mark.parametrize(
    ("delay_ms", "floor_ms", "expect"), [(0, 0, 0), (0, 150, 2), (150, 100, 2)]
)
def test_committed_rows_reach_at_least_min_committed_ms(delay_ms, floor_ms, expect):
    """``min_committed_ms``: with no delay nothing is committed before the answer arrives,
    but with a floor of 150 ms the rows at +100 and +150 ms after the newest frame are told
    (and executed as planned) all the same; a floor below the delay changes nothing."""
    from physis_ros.engine.config import get_preset
    from physis_ros.sim.task import sample_task

    seed = 3
    decider = _ConstantDecider(get_preset("push-wam"), np.array(sample_task(seed).joints))
    cfg = ClosedLoopConfig(time_limit_s=2.0, delay_ms=delay_ms, min_committed_ms=floor_ms)
    run_episode(cfg, seed, decider)
    assert decider.requests >= 5
    assert decider.known_rows[1:] == [expect] * (len(decider.known_rows) - 1), decider.known_rows


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_min_committed_ms_must_be_a_finite_nonnegative_time(bad):
    with pytest.raises(ValueError, match="min_committed_ms"):
        ClosedLoopConfig(min_committed_ms=bad)


def test_the_report_states_the_commit_floor_of_delay_aware_runs():
    from physis_ros.engine.config import get_preset
    from physis_ros.eval.closed_loop_report import render_markdown, summarize
    from physis_ros.sim.task import sample_task

    decider = _ConstantDecider(get_preset("push-wam"), np.array(sample_task(3).joints))
    runs = {}
    for name, aware in (("model_crossfade_0ms", True), ("model_naive_0ms", False)):
        cfg = ClosedLoopConfig(time_limit_s=1.0, min_committed_ms=150.0, delay_aware=aware)
        runs[name] = summarize(cfg, [run_episode(cfg, 3, decider)])
    assert runs["model_crossfade_0ms"]["min_committed_ms"] == 150.0
    assert runs["model_naive_0ms"]["min_committed_ms"] == 0.0  # naive commits nothing
    report = {"command": "c", "success_definition": "s", "control_period_ms": 50.0, "runs": runs}
    md = render_markdown(report)
    assert "commit the plan at least 150 ms" in md
    runs["model_crossfade_0ms"]["min_committed_ms"] = 0.0
    assert "commit the plan" not in render_markdown(report)


def test_the_reach_expert_reaches_held_out_targets_in_the_closed_loop(tmp_path):
    """Any task by name: reach's expert on held-out seeds, its own time limit and success,
    and the report draws the tool tip's paths against the targets."""
    from physis_ros.eval.closed_loop_report import write_report
    from physis_ros.sim.reach import TIME_LIMIT_S, TOLERANCE_M

    cfg = ClosedLoopConfig(task="reach", policy="expert", episodes=3)
    assert cfg.time_limit_s == TIME_LIMIT_S
    results = [run_episode(cfg, 10_000 + i, None) for i in range(3)]
    assert all(r.success and r.time_to_goal_s < cfg.time_limit_s for r in results)
    assert all(r.final_error_m <= TOLERANCE_M and r.action_rmse_rad == 0.0 for r in results)
    assert all(r.path.shape[1] == 2 and r.task == "reach" for r in results)
    report = write_report(tmp_path, {"expert": (cfg, results)}, engine={}, command="c")
    assert report["success_definition"].startswith("tool tip within 0.04 m of the target")
    assert report["runs"]["expert"]["success_rate"] == 1.0
    assert (tmp_path / "tool_tip_paths_expert.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="task 'lift'"):
        ClosedLoopConfig(task="lift")


class _RecordingEngine:
    """A StreamEngine stand-in that keeps what a request feeds it and answers rows that hold
    the arm at ``hold``."""

    def __init__(self, cfg, hold: np.ndarray):
        self.cfg, self.hold = cfg, hold
        self.specs, self.states = [], []

    def open_stream(self, spec):
        self.specs.append(spec)
        return type("Opened", (), {"stream_id": len(self.specs)})()

    def submit_context(self, sid, frames, rows, state):
        self.states.append(state)

    def submit_generate(self, sid, known):
        return 7

    def poll(self, timeout_s):
        rows = np.tile(self.hold, (self.cfg.action_horizon, 1))
        return [type("Out", (), {"stream_id": len(self.specs), "chunk": 7, "actions": rows,
                                 "frames": None})()]  # fmt: skip

    def close_stream(self, sid):
        pass


@pytest.mark.parametrize("task", ["push", "reach"])
def test_the_model_is_fed_through_its_contract(task):
    """The decider builds each frame's state from the contract's names (robot values from
    the task's state, task inputs from the episode's task values) and conditions the stream
    on the task values' features: push's goal in the middle and its box at the end, reach's
    joints and target (the engine makes the features of the values: test_embed.py)."""
    from physis_ros.engine.config import get_preset
    from physis_ros.eval.closed_loop import ModelDecider
    from physis_ros.sim.tasks import get_task
    from physis_ros.train.wam_data import wam_contract

    sim_task = get_task(task)
    cfg = get_preset(sim_task.default_model)
    contract = wam_contract(cfg, sim_task)
    start = np.array(sim_task.sample(10_000).joints)
    engine = _RecordingEngine(cfg, start)
    decider = ModelDecider(engine, meta={"contract": contract.to_json()})
    result = run_episode(ClosedLoopConfig(task=task, time_limit_s=1.0), 10_000, decider)
    assert result.chunks_accepted >= 3 and len(engine.states) >= 3
    values = sim_task.task_values(sim_task.sample(10_000))
    first = engine.states[0]
    assert first.shape == (cfg.frames_per_chunk, cfg.state_dim) and first.dtype == np.float32
    names = contract.state_names
    task_cols = [names.index(k) for k in sim_task.task_value_names]
    np.testing.assert_array_equal(first[:, task_cols][0], np.float32(list(values.values())))
    joint_cols = [names.index(f"{j}_pos") for j in sim_task.joint_names]
    np.testing.assert_array_equal(first[0, joint_cols], np.float32(start))
    if task == "push":
        assert names[10:12] == ("goal_x", "goal_y") and names[12:] == ("box_x", "box_y")
        np.testing.assert_array_equal(first[0, 12:], np.float32(sim_task.sample(10_000).box_xy))
    assert engine.specs[0].task == values and engine.specs[0].prompt_embedding is None
