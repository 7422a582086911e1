"""The serving spec: read from the YAML sections and flags, refused by name when wrong,
resolved once (model config, weights checked key by key, sampler from the weights), and sent
to ranks as JSON that rebuilds exactly the same spec."""

from __future__ import annotations

import json

import pytest

from physis_ros.serve.spec import ServingSpec


def test_sections_and_flags_build_the_spec_and_older_keys_still_work():
    spec = ServingSpec.from_config(
        {
            "frontend": {"port": 1},  # the gRPC server's, not the spec's
            "engine": {"model": "tiny", "checkpoint": "", "workers": 2, "steps": 3},
            "placement": {"plan": "groups:3,9"},
            "pool": {"policy": "static", "default_target_ms": 80},
            "distributed": {"placement": "even", "fault_timeout_s": 3.0},
        },
        model="small",
        policy=None,  # a flag not given changes nothing
    )
    assert (spec.model, spec.workers, spec.steps) == ("small", 2, 3)
    assert (spec.plan, spec.policy, spec.default_target_ms) == ("even", "static", 80)
    assert spec.fault_timeout_s == 3.0


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"engine": {"modle": "tiny"}}, "unknown engine key 'modle'"),
        ({"pool": {"policy": "greedy"}}, "policy 'greedy'"),
        ({"placement": {"plan": "spiral"}}, "placement 'spiral'"),
        ({"engine": {"dtype": "int8"}}, "dtype 'int8'"),
        ({"pool": {"max_utilization": 1.5}}, "max_utilization must be in"),
        ({"engine": {"steps": 0}}, "steps must be >= 1"),
        ({"gpu": {}}, "unknown config section 'gpu'"),
        ({"engine": {"model_config": {}}}, "set by resolving the model"),
        ({"engine": {"known_rows_ahead": -1}}, "known_rows_ahead must be >= 0"),
        # the ranks' settings are checked by the spec itself, also when one process serves
        ({"distributed": {"fault_timeout_s": 0.4}}, "must exceed two heartbeats"),
        ({"distributed": {"comm_timeout_s": 4.0}}, "must exceed fault_timeout_s"),
        ({"distributed": {"threads": 0}}, "threads must be >= 1"),
        ({"distributed": {"startup_timeout_s": 0.0}}, "startup_timeout_s must be > 0"),
    ],
)
def test_bad_values_are_refused_by_name(config, message):
    with pytest.raises(ValueError, match=message):
        ServingSpec.from_config(config)


def test_resolving_takes_the_weights_and_what_they_were_trained_for():
    spec = ServingSpec(model="push-wm").resolve()
    assert spec.weights.endswith("push_wm.safetensors")
    assert (spec.steps, spec.window, spec.shift) == (4, 5, 3.0)  # the shipped metadata
    assert spec.model_config.name == "push-wm" and spec.model_config.num_blocks == 3
    assert ServingSpec(model="push-wm", weights="random", window=2).resolve().weights == ""
    assert ServingSpec(model="tiny").resolve().weights == ""  # no trained weights: random
    with pytest.raises(ValueError, match="neither a preset"):
        ServingSpec(model="no-such-model").resolve()


def test_a_world_action_stream_is_told_the_committed_rows_the_spec_allows():
    """physis-serve --known-rows-ahead N (engine.known_rows_ahead) replaces the weights'
    max_known_rows_ahead in the served streams' timing; unset, the weights' value stands."""
    from physis_ros.contract.safetensors import read_metadata
    from physis_ros.serve.config import serving_spec
    from physis_ros.serve.main import parse_args

    trained = ServingSpec(model="push-wam").resolve()
    meta = read_metadata(trained.weights)
    assert trained.contract().max_known_rows_ahead == int(meta["max_known_rows_ahead"]) > 0
    args = parse_args(["--model", "push-wam", "--known-rows-ahead", "0"])
    spec = serving_spec(args, {"engine": {"known_rows_ahead": 3}}).resolve()
    assert spec.known_rows_ahead == 0  # the flag overrides the file
    assert spec.contract().max_known_rows_ahead == 0
    assert ServingSpec.from_json(spec.to_json()).contract().max_known_rows_ahead == 0


def test_json_rebuilds_exactly_the_resolved_spec():
    spec = ServingSpec(model="push-wm", plan="groups:4,8", policy="static").resolve()
    text = spec.to_json()
    assert json.loads(text)["engine"]["model_config"]["num_blocks"] == 3
    again = ServingSpec.from_json(text)
    assert again == spec
    assert again.runtime_config(2) == spec.runtime_config(2)
    assert spec.runtime_config(2).model_config == spec.model_config
    with pytest.raises(ValueError, match="section 'pool'"):
        broken = json.loads(text)
        del broken["pool"]["policy"]
        ServingSpec.from_json(json.dumps(broken))
    with pytest.raises(ValueError, match="not resolved"):
        ServingSpec(model="tiny").to_json()


def test_under_torchrun_every_rank_is_a_worker():
    spec = ServingSpec(model="tiny", workers=3).resolve()
    with pytest.raises(ValueError, match="every one of the 2 ranks is a worker"):
        spec.runtime_config(2)
    assert spec.runtime_config(3).placement == "even"  # planned: even split loaded first
