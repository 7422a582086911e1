"""Previews over real gloo ranks: a stream that asked for them gets, before each chunk, its x0
estimate after every step but the last, equal to the oracle's (<= 1e-5), decoded by
``poll``; a stream that did not gets none. A causal codec refuses previews."""

from __future__ import annotations

import time

import pytest
import torch
from stream_plans import live_random_plan, tiny_cond

from physis_ros.engine import oracle
from physis_ros.engine.api import StreamSpec
from physis_ros.engine.build import build_model
from physis_ros.engine.codec import check_stream_codec
from physis_ros.engine.config import SamplerConfig, get_preset
from physis_ros.engine.forward import make_cond
from physis_ros.engine.placement import layout_groups
from physis_ros.engine.ranks.config import RuntimeConfig
from physis_ros.engine.ranks.executor import ranks_engine

torch.set_num_threads(1)
TOL = 1e-5
K, W = 4, 2


@pytest.mark.slow
def test_previews_cross_ranks_and_equal_the_oracle():
    cfg = RuntimeConfig(
        device="cpu",
        model="tiny",
        steps=K,
        window=W,
        heartbeat_interval_s=0.2,
        fault_timeout_s=5.0,
        comm_timeout_s=30.0,
        startup_timeout_s=60.0,
    )
    tiny = get_preset("tiny")
    # stage (0, 1) and every step's last block on another rank than the sink (rank 0)
    layout = layout_groups(K, tiny.num_blocks, [3, 2, 3])
    plan = live_random_plan(tiny, 5, horizon=2, observations=5)
    with ranks_engine(cfg, world_size=3) as engine:
        sids = [
            engine.open_stream(
                StreamSpec(seed=3, prompt_embedding=tiny_cond(9), previews=wants, horizon=2),
                layout=layout,
            ).stream_id
            for wants in (True, False)
        ]
        expected = 0
        for item in plan:
            for sid in sids:
                if item[0] == "observe":
                    engine.submit_context_x(sid, item[2], slot=item[1])
                else:
                    engine.submit_generate(sid)
                    expected += 1
        got: dict[int, list] = {sid: [] for sid in sids}
        deadline = time.monotonic() + 120
        while sum(1 for r in got[sids[0]] + got[sids[1]] if not r.preview_steps) < expected:
            assert time.monotonic() < deadline, got
            for res in engine.poll_results(0.1):
                got[res.stream_id].append(res)
    model = build_model(tiny, device="cpu")
    sampler = SamplerConfig(steps=K, window=W)
    ref_previews: dict = {}
    ref = oracle.sample_noisy(
        model, sampler, plan, seed=3, cond=make_cond(tiny, 9), previews=ref_previews
    )
    with_previews, without = got[sids[0]], got[sids[1]]
    assert not any(r.preview_steps for r in without)
    shown = {(r.chunk, r.preview_steps): r for r in with_previews if r.preview_steps}
    assert sorted(shown) == sorted(ref_previews)
    for key, x0 in ref_previews.items():
        assert (shown[key].x.cpu() - x0).abs().max().item() <= TOL, key
    finals = {r.chunk: r for r in with_previews if not r.preview_steps}
    for c, x in ref.items():
        assert (finals[c].x.cpu() - x).abs().max().item() <= TOL, c


def test_a_causal_codec_refuses_previews():
    class Causal:
        causal = True

    with pytest.raises(ValueError, match="causal per stream"):
        check_stream_codec(StreamSpec(previews=True), Causal())
    check_stream_codec(StreamSpec(previews=False), Causal())
