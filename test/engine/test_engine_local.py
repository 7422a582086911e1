"""local_engine end to end: StreamEngine calls in, decoded numpy chunks out, equal to the oracle."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from engine_helpers import TOL
from stream_plans import tiny_cond

from physis_ros.engine import oracle
from physis_ros.engine.api import AdmissionRefused, StreamSpec
from physis_ros.engine.codec import Codec
from physis_ros.engine.config import SamplerConfig
from physis_ros.engine.sampler import pack_chunk
from physis_ros.engine.threads import local_engine


def _poll_until(engine, count, timeout_s=30.0):
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        got += engine.poll(0.2)
    return got


@pytest.mark.parametrize("mode", ["pipelined", "sequential-clean"])
def test_local_engine_end_to_end_equals_oracle(mode):
    workers = 2
    with local_engine("tiny", steps=3, window=2, mode=mode, workers=workers) as eng:
        promise = eng.open_stream(StreamSpec(seed=4, prompt_embedding=tiny_cond(9)))
        assert promise.chunk_frames == 2 and (promise.image_height, promise.image_width) == (16, 16)
        assert promise.action_horizon == 4 and promise.expected_interval_ms > 0
        rng = np.random.default_rng(0)
        frames = rng.integers(0, 256, (2, 16, 16, 3), dtype=np.uint8)
        observed = rng.normal(size=(4, 4)).astype(np.float32)
        sid = promise.stream_id
        assert eng.submit_context(sid, frames, observed) == 0
        assert [eng.submit_generate(sid) for _ in range(3)] == [1, 2, 3]
        outs = _poll_until(eng, 3)
    assert [o.chunk for o in outs] == [1, 2, 3]
    cfg = eng.cfg
    codec = Codec(cfg)
    plan = [("context", pack_chunk(cfg, codec.encode(frames), torch.from_numpy(observed)))]
    plan += [("generate", None)] * 3
    ref = oracle.sample(
        eng.model,
        SamplerConfig(steps=3, window=2),
        plan,
        mode=mode,
        seed=4,
        cond=torch.from_numpy(tiny_cond(9)),
    )
    for o in outs:
        assert o.frames.dtype == np.uint8 and o.frames.shape == (2, 16, 16, 3)
        assert o.actions.shape == (4, 4)
        x = ref[o.chunk]
        nvp = cfg.video_tokens * cfg.patch_dim
        np.testing.assert_allclose(o.actions, x[nvp:].view(4, 4).numpy(), atol=TOL, rtol=0)
        from physis_ros.engine.sampler import unpack_chunk

        expect = codec.decode(unpack_chunk(cfg, x)[0])
        # uint8 rounding of values within 1e-5: at most one level apart
        assert np.abs(o.frames.astype(int) - expect.astype(int)).max() <= 1
        assert o.entered_s <= o.left_s <= o.decoded_s


def test_local_engine_live_stream_replaces_predictions_and_names_anchors():
    """Through the StreamEngine calls a server makes: observations of slots already
    predicted (submit_context(slot=...)) while chunks are in flight; every output equals the
    live oracle and names its anchor."""
    from physis_ros.engine.sampler import unpack_chunk

    horizon = 3
    with local_engine("tiny", steps=3, window=2, workers=2) as eng:
        sid = eng.open_stream(
            StreamSpec(seed=6, prompt_embedding=tiny_cond(8), horizon=horizon)
        ).stream_id
        rng = np.random.default_rng(1)
        codec = Codec(eng.cfg)
        plan, outs = [], []
        for slot in range(6):
            frames = rng.integers(0, 256, (2, 16, 16, 3), dtype=np.uint8)
            assert eng.submit_context(sid, frames, slot=slot) == slot
            plan.append(("observe", slot, pack_chunk(eng.cfg, codec.encode(frames))))
            while eng.controller.next_slot(sid) <= slot + horizon:
                eng.submit_generate(sid)
                plan.append(("generate", None))
            outs += eng.poll(0.01)  # the next observation arrives while these are in flight
        outs += _poll_until(eng, 6 + horizon - 1 - len(outs))
        with pytest.raises(ValueError, match="horizon"):
            eng.submit_generate(sid)
    ref = oracle.sample(
        eng.model,
        SamplerConfig(steps=3, window=2),
        plan,
        mode="pipelined",
        seed=6,
        cond=torch.from_numpy(tiny_cond(8)),
    )
    anchors = {v.slot: v.anchor for v in oracle.versions(plan, 2) if not v.observed}
    assert sorted(o.chunk for o in outs) == sorted(ref) == list(range(1, 6 + horizon))
    for o in outs:
        assert o.anchor == anchors[o.chunk] and 1 <= o.chunk - o.anchor <= horizon
        expect = codec.decode(unpack_chunk(eng.cfg, ref[o.chunk])[0])
        assert np.abs(o.frames.astype(int) - expect.astype(int)).max() <= 1


def test_bad_input_is_refused_and_the_stream_goes_on():
    with local_engine("tiny", steps=2, window=1) as eng:
        sid = eng.open_stream(StreamSpec()).stream_id
        with pytest.raises(ValueError, match="frames have shape"):
            eng.submit_context(sid, np.zeros((2, 8, 8, 3), np.uint8))
        with pytest.raises(ValueError, match="takes no commanded actions"):
            eng.submit_generate(sid, np.zeros((4, 4), np.float32))
        with pytest.raises(ValueError, match="NaN"):
            eng.submit_context(
                sid, np.zeros((1, 16, 16, 3), np.uint8), np.full((4, 4), np.nan, np.float32)
            )
        with pytest.raises(ValueError, match="not open"):
            eng.submit_generate(sid + 5)
        with pytest.raises(ValueError, match="the model takes none"):
            eng.open_stream(StreamSpec(task={"goal_x": 0.1}))
        assert eng.submit_generate(sid) == 0  # nothing was numbered for the refused inputs
        assert [o.chunk for o in _poll_until(eng, 1)] == [0]


def test_condition_model_takes_actions_and_admission_is_bounded():
    from physis_ros.engine.config import get_preset

    cfg = get_preset("tiny", action_mode="condition")
    with local_engine(cfg, steps=2, window=1, max_streams=2) as eng:
        a = eng.open_stream(StreamSpec(seed=1)).stream_id
        eng.open_stream(StreamSpec(seed=2))
        with pytest.raises(AdmissionRefused) as err:
            eng.open_stream(StreamSpec(seed=3))
        assert err.value.resource == "streams"
        eng.submit_generate(a, np.ones((4, 4), np.float32))
        out = _poll_until(eng, 1)
        assert out[0].actions is None and out[0].frames.shape == (2, 16, 16, 3)
        eng.close_stream(a)
        eng.open_stream(StreamSpec(seed=4))  # the closed stream's slot is free again


def test_shutdown_stops_every_thread():
    before = {t.name for t in threading.enumerate()}
    eng = local_engine("tiny", steps=2, window=1, workers=2)
    eng.open_stream(StreamSpec())
    eng.shutdown()
    left = {t.name for t in threading.enumerate() if t.is_alive()} - before
    assert not left, left
