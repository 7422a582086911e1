"""Every executor, placement, batching setting and stream count equals the oracle (<= 1e-5)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import SAMPLER, TOL, plan_for, run_and_compare

from physis_ros.engine import oracle
from physis_ros.engine.config import SamplerConfig
from physis_ros.engine.controller import MODES
from physis_ros.engine.forward import make_cond
from physis_ros.engine.pipeline import run_plan
from physis_ros.engine.placement import (
    blocks_share_worker,
    layout_by_block,
    layout_groups,
    layout_one_stage_per_worker,
    layout_single,
)
from physis_ros.engine.threads import InProcRuntime

K, L = SAMPLER.steps, 2
LAYOUTS = {
    "one-worker": layout_single(K, L),
    "stage-per-worker": layout_one_stage_per_worker(K, L),
    "uneven-groups": layout_groups(K, L, [1, 3, 2]),
    "by-block": layout_by_block(K, L, [1, 1]),
}
CASES = [
    (mode, name, batching, streams)
    for mode in MODES
    for name in LAYOUTS
    for batching in (False, True)
    for streams in (1, 3)
    if mode != "sequential-clean" or blocks_share_worker(LAYOUTS[name])
]


@pytest.mark.parametrize(("mode", "layout", "batching", "streams"), CASES)
def test_executor_equals_oracle(tiny, mode, layout, batching, streams):
    diff = run_and_compare(tiny, LAYOUTS[layout], mode=mode, batching=batching, streams=streams)
    assert diff <= TOL


@pytest.mark.parametrize("mode", MODES)
def test_action_conditioning_equals_oracle(tiny_condition, mode):
    layout = LAYOUTS["by-block"] if mode == "sequential-clean" else LAYOUTS["uneven-groups"]
    diff = run_and_compare(
        tiny_condition, layout, mode=mode, batching=True, streams=3, with_actions=True
    )
    assert diff <= TOL


def test_video_only_model_equals_oracle(tiny_video):
    diff = run_and_compare(
        tiny_video, LAYOUTS["uneven-groups"], mode="pipelined", batching=True, streams=2
    )
    assert diff <= TOL


@pytest.mark.parametrize("mode", MODES)
def test_x0_predicting_model_equals_oracle(tiny_x0, mode):
    layout = LAYOUTS["by-block"] if mode == "sequential-clean" else LAYOUTS["uneven-groups"]
    diff = run_and_compare(tiny_x0, layout, mode=mode, batching=True, streams=2)
    assert diff <= TOL


@pytest.mark.parametrize("mode", MODES)
def test_threads_equal_oracle(tiny, mode):
    layout = LAYOUTS["by-block"] if mode == "sequential-clean" else LAYOUTS["uneven-groups"]
    diff = run_and_compare(tiny, layout, mode=mode, batching=True, streams=3, threads=True)
    assert diff <= TOL


def test_throttled_pipeline_equals_oracle(tiny):
    diff = run_and_compare(
        tiny, LAYOUTS["uneven-groups"], mode="pipelined", batching=True, streams=2, max_in_flight=2
    )
    assert diff <= TOL


def test_longer_window_and_steps(tiny):
    sampler = SamplerConfig(steps=2, window=4, shift=3.0)
    diff = run_and_compare(
        tiny,
        layout_groups(2, L, [3, 1]),
        mode="pipelined",
        batching=True,
        streams=1,
        sampler=sampler,
    )
    assert diff <= TOL


def test_comparison_is_sensitive(tiny):
    """The oracle tells the history modes and windows apart, so the checks above can fail."""
    plan = plan_for(tiny, 0)
    noisy = oracle.sample(
        tiny, SAMPLER, plan, mode="pipelined", seed=7, cond=make_cond(tiny.cfg, 70)
    )
    clean = oracle.sample(
        tiny, SAMPLER, plan, mode="sequential-clean", seed=7, cond=make_cond(tiny.cfg, 70)
    )
    narrow = oracle.sample(
        tiny,
        SamplerConfig(steps=3, window=1),
        plan,
        mode="pipelined",
        seed=7,
        cond=make_cond(tiny.cfg, 70),
    )
    last = max(noisy)
    assert (noisy[last] - clean[last]).abs().max() > 1e-3
    assert (noisy[last] - narrow[last]).abs().max() > 1e-3
    # the first generated chunk sees only the observation before it: same in both modes
    assert (noisy[1] - clean[1]).abs().max() <= TOL


def test_actions_condition_the_world_model(tiny_condition):
    """Different commanded actions give different frames (the conditioning is wired)."""
    rt_outs = []
    for seed in (0, 1):
        rt = InProcRuntime(tiny_condition, SAMPLER, LAYOUTS["one-worker"])
        gen = torch.Generator().manual_seed(seed)
        act = torch.randn(
            tiny_condition.cfg.action_horizon, tiny_condition.cfg.action_dim, generator=gen
        )
        out = run_plan(rt, {0: [("generate", act)]}, mode="pipelined", seeds={0: 3})
        rt_outs.append(out[0][0].x)
    video = tiny_condition.cfg.video_tokens * tiny_condition.cfg.patch_dim
    assert (rt_outs[0][:video] - rt_outs[1][:video]).abs().max() > 1e-4


def test_predicted_actions_are_denoised(tiny):
    """The action part of a world-action chunk changes from its initial noise."""
    from physis_ros.engine.sampler import initial_noise

    rt = InProcRuntime(tiny, SAMPLER, LAYOUTS["one-worker"])
    out = run_plan(rt, {0: [("generate", None)]}, mode="pipelined", seeds={0: 5})
    video = tiny.cfg.video_tokens * tiny.cfg.patch_dim
    noise = initial_noise(tiny.cfg, 5, 0)
    assert (out[0][0].x[video:] - noise[video:]).abs().max() > 1e-3
