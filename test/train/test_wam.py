"""physis-train-wam: the windows it trains on follow the live timeline with a known-action
prefix, a run is reproducible from its seed, and the engine and the closed loop load it."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import physis_ros.weights
from physis_ros.contract.safetensors import read_metadata
from physis_ros.engine.codec import Codec
from physis_ros.engine.config import get_preset
from physis_ros.engine.sampler import chunk_layout, latent_to_tokens
from physis_ros.sim.episodes import run_expert_episode
from physis_ros.sim.task import sample_task
from physis_ros.train.wam_data import ROWS_PER_FRAME, WamWindows
from physis_ros.weights import engine_kwargs


@pytest.fixture(scope="module")
def episodes():
    return [run_expert_episode(sample_task(s), perturb=True) for s in (5, 7, 8)]


def test_windows_follow_the_timeline_with_a_known_action_prefix(episodes):
    cfg = get_preset("push-wam")
    windows = WamWindows(episodes, cfg, chunks=4, max_obs=3, max_freeze_rows=8, seed=0)
    batch = windows.batch(64)
    lay = chunk_layout(cfg)
    h, f = cfg.action_horizon, cfg.frames_per_chunk
    assert set(batch.n_obs.tolist()) == {1, 2, 3}
    flags = batch.x0[..., lay.known]
    assert torch.equal(flags.bool(), batch.known)
    for b in range(64):
        obs = int(batch.n_obs[b])
        # known rows: one prefix of the whole window's timeline (rows of chunk c start
        # ROWS_PER_FRAME * f rows after chunk c-1's), ending between the newest observed
        # frame and max_freeze_rows rows after it
        t = torch.arange(4)[:, None] * ROWS_PER_FRAME * f + torch.arange(h)[None, :]
        # the newest observed chunk's rows reach 9 rows past its last frame: it shows the end
        horizon = int(t[obs - 1][batch.known[b, obs - 1]].max())
        last = ROWS_PER_FRAME * (obs * f - 1)
        assert last <= horizon <= last + 8
        assert torch.equal(batch.known[b, obs:], t[obs:] <= horizon)
        # observed chunks know their rows as of the newest frame, or each as of its own
        own_last = (torch.arange(obs)[:, None] + 1) * ROWS_PER_FRAME * f - ROWS_PER_FRAME
        newest = torch.equal(batch.known[b, :obs], t[:obs] <= horizon)
        own = torch.equal(batch.known[b, :obs], t[:obs] <= own_last + (horizon - last))
        assert newest or own
        # only generated, unknown rows are trained; no observed chunk is
        assert not batch.trained_rows[b, :obs].any() and not batch.trained_chunks[b, :obs].any()
        assert not (batch.trained_rows[b] & batch.known[b]).any()
    # an observed chunk's video is the codec's tokens of its two frames
    ep = episodes[0]
    lat = Codec(cfg).encode(ep.frames[6:8])
    one = WamWindows([ep], cfg, chunks=4, max_obs=3, max_freeze_rows=8, seed=0)
    first = ROWS_PER_FRAME * 6
    video = torch.from_numpy(one.episodes[0].latents[6:8]).float() / 127.5 - 1
    assert torch.allclose(
        latent_to_tokens(cfg, video.permute(1, 0, 2, 3)), latent_to_tokens(cfg, lat)
    )
    assert np.isfinite(ep.rows[first : first + h]).all()


def test_windows_that_hide_the_history_keep_only_the_committed_rows(episodes):
    cfg = get_preset("push-wam")
    common = dict(chunks=4, max_obs=3, max_freeze_rows=8, seed=3)
    shown = WamWindows(episodes, cfg, **common).batch(64)
    hidden = WamWindows(episodes, cfg, hide_history_fraction=1.0, **common).batch(64)
    # the same windows drawn (the same seed), only what is known differs
    assert torch.equal(shown.n_obs, hidden.n_obs)
    h, f = cfg.action_horizon, cfg.frames_per_chunk
    t = torch.arange(4)[:, None] * ROWS_PER_FRAME * f + torch.arange(h)[None, :]
    for b in range(64):
        newest = ROWS_PER_FRAME * (int(hidden.n_obs[b]) * f - 1)
        # nothing at or before the newest frame is known; after it, what the robot committed
        assert not hidden.known[b][t <= newest].any()
        assert torch.equal(hidden.known[b][t > newest], shown.known[b][t > newest])
        # the rows trained on are the same: hiding the history adds no target
        assert torch.equal(hidden.trained_rows[b], shown.trained_rows[b])
    assert shown.known[t.expand(64, -1, -1) <= 0].all()  # the shown windows do know row 0


def test_drifted_committed_rows_leave_the_history_and_the_targets_the_experts(episodes):
    cfg = get_preset("push-wam")
    lay = chunk_layout(cfg)
    common = dict(chunks=4, max_obs=3, max_freeze_rows=8, seed=5)
    expert = WamWindows(episodes, cfg, **common).batch(64)
    drifted = WamWindows(
        episodes, cfg, committed_drift_rad=0.1, committed_drift_fraction=1.0, **common
    ).batch(64)
    # the same windows, the same rows known and trained on
    assert torch.equal(expert.n_obs, drifted.n_obs)
    assert torch.equal(expert.known, drifted.known)
    assert torch.equal(expert.trained_rows, drifted.trained_rows)
    h, f, a = cfg.action_horizon, cfg.frames_per_chunk, cfg.action_dim
    t = (torch.arange(4)[:, None] * ROWS_PER_FRAME * f + torch.arange(h)[None, :]).double()
    moved = 0
    for b in range(64):
        diff = (drifted.x0[b, :, lay.actions] - expert.x0[b, :, lay.actions]).double()
        diff = diff.reshape(4, h, a)
        ahead = t - ROWS_PER_FRAME * (int(expert.n_obs[b]) * f - 1)
        committed = expert.known[b] & (ahead > 0)
        # only the committed rows after the newest frame move: never the history (the
        # frames show it) nor a target
        assert diff[~committed].abs().max() == 0
        if committed.any():
            # one drift per window, growing linearly from the newest frame
            slope = diff[committed] / ahead[committed][:, None]
            assert torch.allclose(slope, slope[:1].expand_as(slope), atol=1e-5)
            moved += bool(slope.abs().max() > 0)
    assert moved > 10


def test_windows_that_open_their_episode_start_at_its_first_frame(episodes):
    cfg = get_preset("push-wam")
    lay = chunk_layout(cfg)
    common = dict(chunks=4, max_obs=3, max_freeze_rows=8, seed=4)
    firsts = [
        torch.from_numpy(e.state[:2].reshape(-1))
        for e in WamWindows(episodes, cfg, **common).episodes
    ]

    def opens(batch) -> list[bool]:
        return [any(torch.equal(x[0, lay.state], s) for s in firsts) for x in batch.x0]

    assert all(opens(WamWindows(episodes, cfg, start_fraction=1.0, **common).batch(64)))
    assert not all(opens(WamWindows(episodes, cfg, **common).batch(64)))


def _train(out, seed: int, *extra: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable, "-m", "physis_ros.train.wam", "--out", str(out),
        "--episodes", "3", "--val-episodes", "2", "--steps", "3", "--batch-size", "2",
        "--val-every", "1", "--checkpoint-every", "2", "--seed", str(seed), "--quiet",
        "--data-dir", str(out.parent / "data"), *extra,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_training_is_reproducible_and_the_closed_loop_runs_it(tmp_path):
    from safetensors.torch import load_file

    a = _train(tmp_path / "a", seed=5)
    _train(tmp_path / "b", seed=5)
    wa, wb = (load_file(str(tmp_path / r / "weights.safetensors")) for r in "ab")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert {t.dtype for t in wa.values()} == {torch.float16}
    assert a["steps_done"] == 3 and np.isfinite(a["final_val"]["action"])
    log = json.loads((tmp_path / "a" / "train_log.json").read_text())
    assert [v["step"] for v in log["val"]] == [0, 1, 2]
    # the checkpoint at step 2 is kept by its step, the end's weights beside it
    assert read_metadata(tmp_path / "a" / "w2.safetensors")["steps_done"] == "2"
    weights = tmp_path / "a" / "weights.safetensors"
    meta = read_metadata(weights)
    assert meta["format"] == "physis_ros world-action model" and meta["model"] == "push-wam"
    names = meta["state_names"].split(",")
    assert names[-5:] == ["torque_z", "goal_x", "goal_y", "box_x", "box_y"]
    assert meta["action_hz"] == "20.0" and meta["prompt"] == "goal_xy"
    # a run started from a's weights names them, and (at a negligible learning rate, the same
    # seed: the same validation windows) it validates as a did at its end
    c = _train(tmp_path / "c", 5, "--init", str(weights), "--lr", "1e-9")
    meta_c = read_metadata(tmp_path / "c" / "weights.safetensors")
    assert meta_c["init_sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    log_c = json.loads((tmp_path / "c" / "train_log.json").read_text())
    assert log_c["val"][0]["action"] == pytest.approx(a["final_val"]["action"], rel=1e-3)
    assert c["final_val"]["action"] == pytest.approx(a["final_val"]["action"], rel=1e-3)
    # weights of another model are refused in one line before anything runs
    wm = str(Path(physis_ros.weights.__file__).parent / "push_wm.safetensors")
    cmd = [sys.executable, "-m", "physis_ros.train.wam", "--out", str(tmp_path / "d"), "--init"]
    proc = subprocess.run([*cmd, wm], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2 and "holds model 'push-wm', not 'push-wam'" in proc.stderr
    assert not (tmp_path / "d").exists()
    kwargs = engine_kwargs(weights)
    assert kwargs["window"] == 3 and kwargs["steps"] == 4 and kwargs["shift"] == 3.0

    from physis_ros.engine.threads import local_engine
    from physis_ros.eval.closed_loop import ClosedLoopConfig, ModelDecider, run_episode

    with local_engine(**kwargs) as engine:
        decider = ModelDecider(engine, meta=meta)
        cfg = ClosedLoopConfig(delay_ms=150.0, time_limit_s=1.0)
        result = run_episode(cfg, 10_000, decider, keep_frames=True)
    # an untrained model: it need not succeed, but every chunk was answered and joined
    assert result.chunks_accepted == 4 and len(result.predicted) == 4
    assert result.box_path.shape == (11, 2) and result.boundary_jumps


@pytest.mark.slow
def test_a_dagger_round_adds_the_models_own_episodes_to_the_training_data(tmp_path):
    """physis-train-wam --on-policy-from W --on-policy-episodes N: W drives N training
    episodes with expert takeovers first (cached beside the expert's), and they are trained
    on with the rest."""
    from physis_ros.sim.episodes import load_episodes

    first = _train(tmp_path / "a", seed=5)
    weights = str(tmp_path / "a" / "weights.safetensors")
    dagger = _train(tmp_path / "b", 5, "--init", weights, "--on-policy-from", weights,
                    "--on-policy-episodes", "2")  # fmt: skip
    assert dagger["train_episodes"] == first["train_episodes"] + 2
    (cached,) = (tmp_path / "data").glob("on_policy_*.npz")
    episodes = load_episodes(cached)
    assert [ep.setup.seed for ep in episodes] == [0, 1]
    for ep in episodes:  # the model's rows are history, the expert's the targets
        assert ep.perturbed[1:].any() and not ep.perturbed[1:].all()
    assert dagger["train_frames"] == first["train_frames"] + sum(len(e.frames) for e in episodes)
    # two worker processes drive the same episodes (each stream is seeded by its task seed;
    # another process may round a float differently in its last bit, so not bit for bit)
    from physis_ros.train.wam_onpolicy import on_policy_episodes

    split = on_policy_episodes(weights, [0, 1], cache_dir=None, progress=False, workers=2)
    assert [ep.setup.seed for ep in split] == [0, 1]
    for one, two in zip(episodes, split, strict=True):
        np.testing.assert_array_equal(one.perturbed, two.perturbed)  # same takeovers, same length
        np.testing.assert_allclose(one.rows, two.rows, atol=1e-3)
    # a count without checkpoints (or the reverse) is refused in one line
    cmd = [sys.executable, "-m", "physis_ros.train.wam", "--out", str(tmp_path / "c"),
           "--on-policy-episodes", "2"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2 and "on_policy_episodes has an invalid value" in proc.stderr


def test_the_wrench_ablation_leaves_out_only_the_wrench():
    from physis_ros.engine.config import get_preset
    from physis_ros.sim.task import MODEL_STATE_NAMES, WRENCH_SLICE
    from physis_ros.train.wam_data import state_names

    full = state_names(get_preset("push-wam"))
    ablated = state_names(get_preset("push-wam-nowrench"))
    assert full == MODEL_STATE_NAMES
    assert ablated == tuple(n for n in full if n not in MODEL_STATE_NAMES[WRENCH_SLICE])
    assert len(ablated) == get_preset("push-wam-nowrench").state_dim == len(full) - 6


def test_training_writes_the_contract_the_model_was_trained_with():
    """The weights' metadata holds the contract (``contract``): push-wam's settings give the
    shipped push-wam's contract exactly, and an unprompted model's has no prompt."""
    from physis_ros.contract.model import WamContract
    from physis_ros.train.wam import WamTrainConfig, metadata

    shipped = WamContract.from_metadata(read_metadata(physis_ros.weights.WAM_WEIGHTS))
    meta = metadata(WamTrainConfig(min_committed_ms=250.0), {})
    assert WamContract.from_metadata(meta) == shipped and meta["task"] == "push"
    assert meta["state_names"].split(",") == list(shipped.state_names)
    tiny = metadata(WamTrainConfig(model="tiny-wam", prompt=""), {})
    assert WamContract.from_metadata(tiny).prompt.kind == "none"
    assert WamContract.from_metadata(tiny).state_names == shipped.state_names[:10]


def test_a_reach_model_trains_on_reach_episodes_and_carries_its_contract(tmp_path):
    """physis-train-wam --task reach: reach-wam on the reach expert's episodes (3 joints, no
    wrench, no box, the target as task values), its contract in the weights (it round-trips),
    and the closed loop drives the reach task with it."""
    from physis_ros.contract.model import WamContract
    from physis_ros.engine.threads import local_engine
    from physis_ros.eval.closed_loop import ClosedLoopConfig, ModelDecider, run_episode

    summary = _train(tmp_path / "r", 5, "--task", "reach")
    weights = tmp_path / "r" / "weights.safetensors"
    meta = read_metadata(weights)
    assert meta["model"] == "reach-wam" and meta["task"] == "reach"
    contract = WamContract.from_metadata(meta)
    assert WamContract.from_json(contract.to_json()) == contract
    assert contract.action_names == ("shoulder", "elbow", "wrist") and contract.objects == ()
    assert contract.state_names == (
        "shoulder_pos", "elbow_pos", "wrist_pos", "shoulder_vel", "elbow_vel", "wrist_vel",
        "target_x", "target_y",
    )  # fmt: skip
    assert contract.prompt.kind == "task_features" and contract.task_names == (
        "target_x",
        "target_y",
    )
    assert meta["action_names"] == "shoulder,elbow,wrist"
    assert meta["state_names"].split(",") == list(contract.state_names)
    assert summary["steps_done"] == 3 and np.isfinite(summary["final_val"]["action"])
    with local_engine(**engine_kwargs(weights)) as engine:
        decider = ModelDecider(engine, meta=meta)
        cfg = ClosedLoopConfig(task="reach", delay_ms=150.0, time_limit_s=1.0)
        result = run_episode(cfg, 10_000, decider)
    assert result.chunks_accepted == 4 and result.path.shape == (11, 2)
    # a preset that does not fit the task is refused in one line before anything runs
    cmd = [sys.executable, "-m", "physis_ros.train.wam", "--out", str(tmp_path / "x"),
           "--task", "reach", "--model", "push-wam"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2 and "does not fit task 'reach'" in proc.stderr
    assert not (tmp_path / "x").exists()
