"""Cost model: the brief's FLOP/byte formulas, roofline behaviour, measured-profile reading."""

import dataclasses
import json

import pytest

from physis_ros.engine.config import SamplerConfig, get_preset
from physis_ros.engine.pool.costmodel import (
    H200,
    AnalyticCostModel,
    Profile,
    ProfileCostModel,
    ProfileEntry,
    activation_bytes,
    block_work,
)

SAMPLER = SamplerConfig(steps=4, window=2)


def test_block_flops_follow_the_stated_formulas():
    cfg = get_preset("wan2.1-14b")
    n, d, f = 3 * 1560, 5120, 13824  # 3 latent frames x 1560 tokens at 480x832
    assert cfg.tokens_per_chunk == n
    work = block_work(cfg, SAMPLER, 2)
    qkvo = n * d * d * 4 * 2
    cross_qo = n * d * d * 2 * 2
    ffn = 2 * n * d * f * 2
    assert work.gemm_flops == qkvo + cross_qo + ffn
    self_attn = 4 * n * (SAMPLER.window + 1) * n * d
    cross_attn = 4 * n * cfg.text_len * d
    assert work.attn_flops == self_attn + cross_attn
    assert work.weight_bytes == cfg.block_params() * 2
    assert 4.0e12 < work.gemm_flops + work.attn_flops < 4.5e12  # ~4.2 TFLOP per stage


def test_analytic_h200_is_compute_bound_for_real_presets_and_batching_helps_small_ones():
    cost = AnalyticCostModel(H200)
    big = get_preset("dit-33b")
    one = cost.group_ms(big, SAMPLER, 1)
    work = block_work(big, SAMPLER, 2)
    floor_ms = (work.gemm_flops + work.attn_flops) / H200.peak_flops * 1e3
    assert one > floor_ms  # never faster than the datasheet peak
    assert cost.group_ms(big, SAMPLER, 4) == pytest.approx(4 * one, rel=0.02)
    # `small` (144 tokens) reads its weights once per batch: batching is nearly free.
    small = get_preset("small")
    assert cost.group_ms(small, SAMPLER, 8) < 3 * cost.group_ms(small, SAMPLER, 1)
    with pytest.raises(ValueError, match="tasks must be >= 1"):
        cost.group_ms(small, SAMPLER, 0)


def test_hops_cost_bytes_over_the_link_and_inter_node_is_slower():
    cost = AnalyticCostModel(H200)
    cfg = get_preset("dit-33b")
    assert cost.hop_ms(cfg, 3, 3) == 0.0
    intra, inter = cost.hop_ms(cfg, 0, 1), cost.hop_ms(cfg, 7, 8)
    assert inter > 5 * intra
    nbytes = activation_bytes(cfg, 2)
    assert intra == pytest.approx(H200.intra_node_latency_ms + 1e3 * nbytes / 450e9)


def test_device_spec_rejects_bad_values_by_name():
    with pytest.raises(ValueError, match="gemm_efficiency"):
        dataclasses.replace(H200, gemm_efficiency=1.5)
    with pytest.raises(ValueError, match="peak_flops"):
        dataclasses.replace(H200, peak_flops=0)
    with pytest.raises(ValueError, match="reserved_bytes"):
        dataclasses.replace(H200, reserved_bytes=H200.memory_bytes)


def _profile(**kw):
    entries = (
        ProfileEntry(tasks=1, ms_p50=2.0, ms_p99=3.0),
        ProfileEntry(tasks=2, ms_p50=3.0, ms_p99=4.0),
        ProfileEntry(tasks=4, ms_p50=5.0, ms_p99=7.0),
    )
    base = dict(
        device="cpu", model="tiny", steps=4, window=2, dtype="float32", entries=entries, hop_ms=0.5
    )
    base.update(kw)
    return Profile(**base)


def test_profile_cost_interpolates_extrapolates_and_round_trips(tmp_path):
    prof = _profile()
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof.to_json()))
    cost = ProfileCostModel(Profile.load(path))
    cfg = get_preset("tiny")
    assert cost.group_ms(cfg, SAMPLER, 1) == 2.0
    assert cost.group_ms(cfg, SAMPLER, 3) == pytest.approx(4.0)
    assert cost.group_ms(cfg, SAMPLER, 8) == pytest.approx(9.0)  # last slope: 1 ms / task
    assert cost.hop_ms(cfg, 0, 1) == 0.5 and cost.hop_ms(cfg, 1, 1) == 0.0
    assert ProfileCostModel(prof, use_p99=True).group_ms(cfg, SAMPLER, 1) == 3.0


def test_profile_refuses_other_models_and_malformed_input():
    cost = ProfileCostModel(_profile())
    with pytest.raises(ValueError, match="profile is for model tiny K=4 W=2"):
        cost.group_ms(get_preset("small"), SAMPLER, 1)
    with pytest.raises(ValueError, match="K=4 W=2"):
        cost.group_ms(get_preset("tiny"), SamplerConfig(steps=4, window=3), 1)
    with pytest.raises(ValueError, match="increasing"):
        _profile(
            entries=(
                ProfileEntry(tasks=2, ms_p50=1, ms_p99=1),
                ProfileEntry(tasks=1, ms_p50=1, ms_p99=1),
            )
        )
    with pytest.raises(ValueError, match="not a physis-profile JSON"):
        Profile.from_json({"device": "cpu"})
