"""The world-action model push-wam in the engine: its pipelined output equals its oracle
(<= 1e-5, fp32), committed rows come back unchanged, and bad requests are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_helpers import TOL

from physis_ros.engine import oracle
from physis_ros.engine.api import StreamSpec
from physis_ros.engine.build import build_model
from physis_ros.engine.codec import Codec
from physis_ros.engine.config import SamplerConfig, get_preset
from physis_ros.engine.forward import forward_sequence, make_cond
from physis_ros.engine.sampler import (
    chunk_layout,
    initial_noise,
    pack_chunk,
    request_actions,
    request_state,
    unpack_chunk,
    unpack_state,
)
from physis_ros.engine.threads import local_engine
from physis_ros.weights import WAM_WEIGHTS

SAMPLER = SamplerConfig(steps=4, window=3, shift=3.0)


def _observed(rng, cfg, known: int):
    frames = rng.integers(0, 256, (cfg.frames_per_chunk, *cfg.image_size, 3), dtype=np.uint8)
    rows = rng.normal(1.2, 0.4, (cfg.action_horizon, cfg.action_dim)).astype(np.float32)
    rows[known:] = np.nan  # the robot knows a prefix of the timeline
    state = rng.normal(0, 1, (cfg.frames_per_chunk, cfg.state_dim)).astype(np.float32)
    return frames, rows, state


def _poll(engine, n):
    out = []
    for _ in range(600):
        out += engine.poll(0.5)
        if len(out) >= n:
            return sorted(out, key=lambda o: o.chunk)
    raise AssertionError(f"{len(out)} of {n} chunks")


@pytest.mark.parametrize("workers", [1, 3])
def test_pipelined_push_wam_equals_its_oracle(workers):
    """Observed chunks with frames, state and known rows, then generated chunks with
    committed rows, through the pipelined engine (1 and 3 workers) and through the oracle's
    full-sequence sampler: equal to fp32 round-off. The shipped weights when present."""
    weights = str(WAM_WEIGHTS) if WAM_WEIGHTS.exists() else None
    rng = np.random.default_rng(7)
    with local_engine(
        "push-wam", steps=4, window=3, shift=3.0, workers=workers, checkpoint=weights
    ) as eng:
        cfg = eng.cfg
        codec = Codec(cfg)
        sid = eng.open_stream(StreamSpec(seed=11)).stream_id
        plan = []
        for known in (12, 9):
            frames, rows, state = _observed(rng, cfg, known)
            eng.submit_context(sid, frames, rows, state)
            x = pack_chunk(
                cfg,
                codec.encode(frames),
                request_actions(cfg, rows, context=True),
                request_state(cfg, state),
            )
            plan.append(("context", x))
        committed = np.full((cfg.action_horizon, cfg.action_dim), np.nan, np.float32)
        committed[:3] = [[1.0, 1.5], [1.02, 1.52], [1.04, 1.55]]
        for rows in (committed, None):
            eng.submit_generate(sid, rows)
            plan.append(("generate", request_actions(cfg, rows, context=False)))
        outs = _poll(eng, 2)
        cond = eng.prompts.resolve("", None)
        ref = oracle.sample(eng.model, SAMPLER, plan, mode="pipelined", seed=11, cond=cond)
    for o in outs:
        _, actions = unpack_chunk(cfg, ref[o.chunk])
        np.testing.assert_allclose(o.actions, actions.numpy(), atol=TOL, rtol=0)
        np.testing.assert_allclose(o.state, unpack_state(cfg, ref[o.chunk]).numpy(), atol=TOL)
        assert o.frames.shape == (cfg.frames_per_chunk, *cfg.image_size, 3)
    # committed rows come back as committed (never denoised); the rest was generated
    np.testing.assert_allclose(outs[0].actions[:3], committed[:3], atol=1e-6)
    assert not np.allclose(outs[0].actions[3:], outs[1].actions[3:])


def test_committed_rows_are_conditioning_not_state():
    """A known row's value and flag get zero velocity: the sampler never moves them."""
    cfg = get_preset("push-wam")
    model = build_model(cfg, seed=3)
    committed = torch.full((cfg.action_horizon, cfg.action_dim), float("nan"))
    committed[:5] = 1.3
    x = initial_noise(cfg, 5, 0, committed)
    v = forward_sequence(model, x[None], torch.tensor([0.75]), make_cond(cfg, 0), window=3)[0]
    lay = chunk_layout(cfg)
    rows_v = v[lay.actions].view(cfg.action_horizon, cfg.action_dim)
    assert torch.all(rows_v[:5] == 0) and torch.all(rows_v[5:] != 0)
    assert torch.all(v[lay.known] == 0) and torch.all(v[lay.state] != 0)
    # the noise drawn does not depend on which rows are committed
    free = initial_noise(cfg, 5, 0, None)
    assert torch.equal(x[lay.video], free[lay.video]) and torch.equal(x[lay.state], free[lay.state])


def test_bad_world_action_requests_are_refused_and_the_stream_goes_on():
    with local_engine("push-wam", steps=2, window=3, shift=3.0) as eng:
        cfg = eng.cfg
        sid = eng.open_stream(StreamSpec()).stream_id
        frames = np.zeros((2, *cfg.image_size, 3), np.uint8)
        rows = np.ones((cfg.action_horizon, cfg.action_dim), np.float32)
        with pytest.raises(ValueError, match="needs the state"):
            eng.submit_context(sid, frames, rows)
        with pytest.raises(ValueError, match="state values have shape"):
            eng.submit_context(sid, frames, rows, np.zeros((2, 3), np.float32))
        half = rows.copy()
        half[4, 0] = np.nan
        with pytest.raises(ValueError, match="partly NaN"):
            eng.submit_generate(sid, half)
        with pytest.raises(ValueError, match="NaN or inf"):
            eng.submit_context(sid, frames, rows, np.full((2, cfg.state_dim), np.inf, np.float32))
        eng.submit_context(sid, frames, rows, np.zeros((1, cfg.state_dim), np.float32))
        assert eng.submit_generate(sid) == 1
        assert [o.chunk for o in _poll(eng, 1)] == [1]
