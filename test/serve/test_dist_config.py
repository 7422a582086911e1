"""RuntimeConfig and the YAML `distributed` section: bad values are refused by name; the JSON
rank 0 sends to the other ranks rebuilds the same config."""

from __future__ import annotations

import dataclasses

import pytest

from physis_ros.engine.ranks.config import RuntimeConfig, blocks_for_rank, parse_placement


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"model": "nope"}, "unknown model preset 'nope'"),
        ({"dtype": "int8"}, "dtype 'int8'"),
        ({"device": "tpu"}, "device 'tpu'"),
        ({"placement": "groups:2,x"}, "groups must be integers"),
        ({"placement": "spiral"}, "placement 'spiral'"),
        ({"fault_timeout_s": 0.4, "heartbeat_interval_s": 0.25}, "fault_timeout_s 0.4"),
        ({"comm_timeout_s": 3.0, "fault_timeout_s": 5.0}, "comm_timeout_s 3.0"),
        ({"threads": 0}, "threads must be >= 1"),
        ({"steps": 0}, "steps must be >= 1"),
    ],
)
def test_bad_values_are_refused_by_name(kw, message):
    with pytest.raises(ValueError, match=message):
        RuntimeConfig(**kw)


def test_json_round_trip_rebuilds_the_same_config():
    cfg = RuntimeConfig(
        model="small",
        steps=3,
        window=1,
        dtype="bfloat16",
        placement="groups:5,7",
        batching=False,
        fault_timeout_s=2.5,
        heartbeat_interval_s=0.1,
    )
    again = RuntimeConfig.from_json(cfg.to_json())
    assert again.model_config == cfg.model_config
    assert again == dataclasses.replace(cfg, resolved_config=cfg.model_config)


def test_placements_and_the_blocks_each_rank_loads():
    assert parse_placement("groups:3,5", 4, 2, 2) == ((0, 0), (0, 1), (1, 1), (1, 1))
    with pytest.raises(ValueError, match="needs 3 ranks, the job has 2"):
        parse_placement("groups:2,3,3", 4, 2, 2)
    cfg = RuntimeConfig(model="small", placement="even")  # K=4, L=4: 8 stages per rank
    assert blocks_for_rank(cfg, 0, 2) == {0, 1, 2, 3}  # steps 0-1, every block
    cfg = RuntimeConfig(model="small", placement="groups:2,14")
    assert blocks_for_rank(cfg, 0, 2) == {0, 1}
