"""RuntimeConfig and the YAML `distributed` section: bad values are refused by name; the flags
rank 0 hands to the other ranks rebuild the same config."""

from __future__ import annotations

import argparse

import pytest

from physis_ros.serve.dist.runtime import RuntimeConfig, blocks_for_rank, parse_placement
from physis_ros.serve.dist.serve import runtime_config


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


def test_argv_round_trip_rebuilds_the_same_config():
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
    parser = argparse.ArgumentParser()
    RuntimeConfig.add_arguments(parser)
    assert RuntimeConfig.from_namespace(parser.parse_args(cfg.to_argv())) == cfg


def test_placements_and_the_blocks_each_rank_loads():
    assert parse_placement("groups:3,5", 4, 2, 2) == ((0, 0), (0, 1), (1, 1), (1, 1))
    with pytest.raises(ValueError, match="needs 3 ranks, the job has 2"):
        parse_placement("groups:2,3,3", 4, 2, 2)
    cfg = RuntimeConfig(model="small", placement="even")  # K=4, L=4: 8 stages per rank
    assert blocks_for_rank(cfg, 0, 2) == {0, 1, 2, 3}  # steps 0-1, every block
    cfg = RuntimeConfig(model="small", placement="groups:2,14")
    assert blocks_for_rank(cfg, 0, 2) == {0, 1}


def test_yaml_section_merges_engine_keys_and_refuses_unknown_ones():
    cfg = runtime_config(
        {"engine": {"model": "small", "steps": 3}, "distributed": {"placement": "single"}}
    )
    assert (cfg.model, cfg.steps, cfg.placement) == ("small", 3, "single")
    assert (
        runtime_config({"engine": {"model": "small"}}, argparse.Namespace(model="tiny")).model
        == "tiny"
    )
    with pytest.raises(ValueError, match="distributed: unknown key\\(s\\) \\['heartbeat_s'\\]"):
        runtime_config({"distributed": {"heartbeat_s": 1}})
