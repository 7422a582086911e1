"""The shipped weights have learned something a baseline has not, on held-out data (seeds
10000.., never trained on: push-wm trained on bags of seeds 0-199, push-wam on expert episodes
of seeds 0-2999).

- push-wm against copying the last frame: every window of a held-out 12 s bag (13 windows, 5
  observed chunks, 4 predicted), pixel MSE pooled over the windows and horizon steps, and the
  mean per-frame PSNR. Here: 228 against 307 (0.74), +1.12 dB; over the bags of seeds
  10000-10003 the model's MSE was 0.74-0.81 of copy-last's, its PSNR 0.8-1.4 dB higher.
- push-wam against the same model untrained (its seeded initialisation): the action part of
  the training loss (the velocity error of the generated action rows, at the sampler's noise
  levels, fixed noise) on windows of held-out expert episodes, served as the model is (the
  rows before the newest frame hidden). Here (16 windows): 0.20 against 2.83; three draws of
  32 windows gave 0.12-0.16 for the shipped weights, 1.6-2.4 for two random initialisations.
"""

from __future__ import annotations

import numpy as np
import torch

HELD_OUT_SEED = 10_000


def test_the_shipped_world_model_beats_copying_the_last_frame_on_a_held_out_bag(tmp_path):
    from physis_ros.engine.config import get_preset
    from physis_ros.engine.threads import local_engine
    from physis_ros.eval.evaluate import EvalConfig, ModelInfo, evaluate
    from physis_ros.sim.record import RecordConfig, record_episode
    from physis_ros.weights import DEFAULT_WEIGHTS, engine_kwargs, read_metadata

    bag = tmp_path / "heldout"
    cfg = RecordConfig(seed=HELD_OUT_SEED, duration_s=12.0, image_height=32, image_width=32)
    record_episode(bag, cfg)
    assert read_metadata(DEFAULT_WEIGHTS)["model"] == "push-wm"
    preset = get_preset("push-wm")
    model = ModelInfo(
        name="push-wm", frames_per_chunk=preset.frames_per_chunk, image_height=32,
        image_width=32, action_horizon=preset.action_horizon, action_dim=preset.action_dim,
        action_mode="condition",
    )  # fmt: skip
    with local_engine(**engine_kwargs(DEFAULT_WEIGHTS)) as engine:
        result = evaluate(engine, model, [bag], EvalConfig(), progress=False)
    assert len(result.windows) == 13 and not result.skipped_windows
    mse = np.array([w.frame_mse for w in result.windows])
    copy_last = np.array([w.baseline_frame_mse for w in result.windows])
    assert mse.mean() < 0.9 * copy_last.mean(), (mse.mean(), copy_last.mean())
    gain_db = np.mean([w.psnr for w in result.windows]) - np.mean(
        [w.baseline_psnr for w in result.windows]
    )
    assert gain_db > 0.3, gain_db


def test_the_shipped_world_action_model_beats_the_untrained_one_on_held_out_windows():
    from safetensors.torch import load_file

    from physis_ros.contract.model import WamContract
    from physis_ros.engine.build import build_model
    from physis_ros.engine.config import get_preset
    from physis_ros.engine.model import load_upstream_state_dict
    from physis_ros.engine.sampler import chunk_layout
    from physis_ros.sim.episodes import run_expert_episode
    from physis_ros.sim.task import sample_task
    from physis_ros.train.wam_data import WamWindows
    from physis_ros.train.wam_loss import noise_levels, wam_loss, window_cond
    from physis_ros.weights import WAM_WEIGHTS, read_metadata

    meta = read_metadata(WAM_WEIGHTS)
    contract = WamContract.from_metadata(meta)
    cfg = get_preset(meta["model"])
    episodes = [run_expert_episode(sample_task(HELD_OUT_SEED + i)) for i in range(4)]
    windows = WamWindows(
        episodes, cfg, contract=contract, chunks=4, max_obs=3, max_freeze_rows=8, seed=0,
        hide_history_fraction=1.0,
    )  # fmt: skip
    size, steps = 16, int(meta["steps"])
    batch = windows.batch(size)
    sigma = noise_levels(steps, 3.0)[torch.arange(size) % steps]
    eps = torch.randn(
        size, 4, chunk_layout(cfg).denoised, generator=torch.Generator().manual_seed(0)
    )
    cond = window_cond(cfg, contract.prompt, batch.prompt_values)

    def action_error(model) -> float:
        with torch.no_grad():
            _, parts = wam_loss(
                model.eval(), batch, sigma=sigma, eps=eps, cond=cond,
                window=int(meta["window"]), action_weight=1.0, state_weight=1.0,
            )  # fmt: skip
        return parts["action"]

    shipped = build_model(cfg, seed=0)
    load_upstream_state_dict(shipped, {k: v.float() for k, v in load_file(WAM_WEIGHTS).items()})
    trained, untrained = action_error(shipped), action_error(build_model(cfg, seed=0))
    assert trained < 0.25 * untrained, (trained, untrained)
