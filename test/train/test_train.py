"""physis-train: runs on recorded bags, is reproducible from its seed, and the engine loads it."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from physis_ros.engine.build import build_model
from physis_ros.engine.config import get_preset
from physis_ros.engine.forward import forward_sequence, make_cond
from physis_ros.engine.sampler import chunk_layout, chunk_numel, latent_to_tokens, tokens_to_latent
from physis_ros.sim.record import RecordConfig, record_episode
from physis_ros.train.train import TrainConfig
from physis_ros.train.windows import DEFAULT_LOG_FLOOR, Windows, noisy_history_loss
from physis_ros.weights import engine_kwargs, read_metadata


@pytest.fixture(scope="module")
def bag(tmp_path_factory):
    path = tmp_path_factory.mktemp("trainbag") / "ep"
    record_episode(path, RecordConfig(seed=11, duration_s=4.0, image_height=32, image_width=32))
    return path


def _train(bag, out, seed: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "physis_ros.train.train",
            str(bag),
            "--val",
            str(bag),
            "--out",
            str(out),
            "--steps",
            "3",
            "--batch-size",
            "2",
            "--max-context",
            "2",
            "--horizon",
            "2",
            "--window",
            "2",
            "--val-every",
            "1",
            "--seed",
            str(seed),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_training_is_reproducible_and_loadable(bag, tmp_path):
    a = _train(bag, tmp_path / "a", seed=5)
    b = _train(bag, tmp_path / "b", seed=5)
    c = _train(bag, tmp_path / "c", seed=6)
    from safetensors.torch import load_file

    wa, wb, wc = (load_file(str(tmp_path / r / "weights.safetensors")) for r in "abc")
    assert wa.keys() == wb.keys() == wc.keys()
    assert {t.dtype for t in wa.values()} == {torch.float16}  # a few MB, not 14
    assert all(torch.equal(wa[k], wb[k]) for k in wa)  # bit-identical: same seed, same data
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)
    assert torch.equal(wa["head.anchor_gate"].float(), torch.ones(192))  # not trained
    assert a["steps_done"] == 3 and math.isfinite(a["final_val_loss"])
    log = json.loads((tmp_path / "a" / "train_log.json").read_text())
    assert len(log["train_loss"]) == 3 and [s for s, _ in log["val_loss"]] == [0, 1, 2]
    assert (tmp_path / "a" / "loss_curve.png").stat().st_size > 1000
    meta = read_metadata(tmp_path / "a" / "weights.safetensors")
    assert meta["model"] == "push-wm" and meta["window"] == "2" and meta["frame_hz"] == "10.0"
    assert meta["horizon"] == "2" and meta["context_noise"] == "clean"
    kwargs = engine_kwargs(tmp_path / "a" / "weights.safetensors")
    assert kwargs["horizon"] == 2 and kwargs["context_noise"] == "clean"  # served as trained
    model = build_model(get_preset(kwargs["model"]))
    model.load_safetensors(kwargs["checkpoint"])  # upstream key names, strict
    # loaded into float32, exactly the stored values
    for key, val in model.state_dict().items():
        stored = wa[key].float().reshape(val.shape)
        assert val.dtype == torch.float32 and torch.equal(val, stored), key
    del b, c


def test_window_loss_is_the_live_timeline_with_teacher_forced_predictions():
    """A window: n_obs observed chunks (clean, ending at the last observed position; unused
    leading positions attended by none), then h predicted chunks at the row's sigma,
    conditioned on the last observed command held and anchored on the last observed chunk's
    newest frame; the loss scores only the predicted."""
    torch.manual_seed(0)
    cfg = get_preset("push-wm")
    assert cfg.anchor_residual
    model = build_model(cfg)
    nvp = cfg.video_tokens * cfg.patch_dim
    lay = chunk_layout(cfg)
    x0 = torch.randn(2, 5, chunk_numel(cfg))
    x0[..., lay.anchor] = 0.0  # as packed from a bag: observed chunks carry no anchor
    eps = torch.randn(2, 5, nvp)
    cond = make_cond(cfg, 0).expand(2, -1, -1)
    windows = Windows(x0, torch.tensor([1, 3]), torch.tensor([0.5, 0.9]), eps, horizon=2)
    loss = noisy_history_loss(model, windows, cond=cond, window=2)
    # the same number by hand: row 0 is [obs 2 | pred 3, 4], row 1 [obs 0, 1, 2 | pred 3, 4]
    expected, expected_log, count = 0.0, 0.0, 0
    for row, first in ((0, 2), (1, 0)):
        x = x0[row, first:].clone()
        held = x[2 - first, lay.actions].reshape(cfg.action_horizon, cfg.action_dim)[-1]
        x[3 - first :, lay.actions] = held.repeat(cfg.action_horizon)
        newest = tokens_to_latent(cfg, x[2 - first, :nvp].reshape(cfg.video_tokens, -1))
        copy_last = newest[:, -1:].expand_as(newest)  # the newest latent frame, repeated
        x[3 - first :, lay.anchor] = latent_to_tokens(cfg, copy_last).reshape(-1)
        sig = torch.zeros(len(x))
        sig[3 - first :] = windows.sigma[row]
        x_in = x.clone()
        x_in[:, :nvp] = (1 - sig[:, None]) * x[:, :nvp] + sig[:, None] * eps[row, first:]
        with torch.no_grad():
            v = forward_sequence(model, x_in, sig, cond[row], window=2)[:, :nvp]
        err = (v - (eps[row, first:] - x[:, :nvp])).pow(2).mean(-1)
        expected += err[3 - first :].sum().item()
        # log_mse: each predicted chunk's x0 error (in the frame's units), in log
        x0_hat = x_in[:, :nvp] - sig[:, None] * v
        x0_mse = (x0_hat - x[:, :nvp]).pow(2).mean(-1)
        expected_log += torch.log(x0_mse[3 - first :] + DEFAULT_LOG_FLOOR).sum().item()
        count += 2
    assert np.isclose(loss.item(), expected / count, rtol=1e-5)
    log_loss = noisy_history_loss(model, windows, cond=cond, window=2, loss="log_mse")
    assert np.isclose(log_loss.item(), expected_log / count, rtol=1e-4)
    # noised context: the observed chunks at the row's sigma too, and a different loss
    noised = noisy_history_loss(model, windows, cond=cond, window=2, context_noise="noised")
    assert abs(noised.item() - loss.item()) > 1e-5


def test_training_noise_levels_are_the_served_samplers_levels():
    from physis_ros.engine.config import SamplerConfig
    from physis_ros.engine.sampler import sigmas
    from physis_ros.train.train import _train_sigmas

    gen = torch.Generator().manual_seed(0)
    cfg = TrainConfig(sample_steps=4, shift=3.0, batch_size=256)
    drawn = set(_train_sigmas(cfg, gen).tolist())
    levels = sigmas(SamplerConfig(steps=4, shift=3.0))[:-1]  # sigma_0 .. sigma_{K-1}
    assert drawn == {torch.tensor(v, dtype=torch.float32).item() for v in levels}
    continuous = _train_sigmas(TrainConfig(sample_steps=0, batch_size=256), gen)
    assert len(set(continuous.tolist())) == 256 and 0 < continuous.min() < continuous.max() < 1


def test_shipped_weights_are_served_by_default_and_small():
    from physis_ros.weights import DEFAULT_WEIGHTS, shipped_engine_defaults

    kwargs = shipped_engine_defaults("push-wm")
    meta = read_metadata(DEFAULT_WEIGHTS)
    assert kwargs["checkpoint"] == str(DEFAULT_WEIGHTS) and kwargs["model"] == "push-wm"
    assert kwargs["window"] == int(meta["window"]) and kwargs["steps"] == int(meta["steps"])
    assert shipped_engine_defaults("tiny") == {}  # random weights for the other presets
    assert DEFAULT_WEIGHTS.stat().st_size < 8 * 2**20  # "a few MB"


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="max_context"):
        TrainConfig(max_context=0)
    with pytest.raises(ValueError, match="context_noise"):
        TrainConfig(context_noise="sometimes")
    with pytest.raises(ValueError, match="predicts actions"):
        TrainConfig(model="tiny")
