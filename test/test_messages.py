"""The generated interfaces cross a process boundary over DDS with every field intact."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

PEER = str(Path(__file__).parent / "helpers" / "msg_peer.py")


@pytest.mark.ros
@pytest.mark.parametrize("kind", ["ActionChunk", "PipelineStats"])
def test_message_round_trip_between_processes(kind, ros_env):
    sub = subprocess.Popen(
        [sys.executable, PEER, "sub", kind], env=ros_env, stdout=subprocess.PIPE, text=True
    )
    pub = subprocess.Popen([sys.executable, PEER, "pub", kind], env=ros_env)
    try:
        out, _ = sub.communicate(timeout=30)
    finally:
        pub.terminate()
        sub.kill()
        pub.wait(timeout=10)
    assert sub.returncode == 0
    got = json.loads(out.strip().splitlines()[-1])
    if kind == "ActionChunk":
        assert got == {
            "frame_id": "table",
            "sec": 12,
            "stream_id": 3,
            "chunk_index": 41,
            "observation_seq": 7,
            "action_names": ["shoulder", "elbow"],
            "dt": 0.1,
            "shape": [3, 2],
            "data": [0.5, -0.25, 1.0, 2.0, -3.0, 4.5],
        }
    else:
        assert got["connection_state"] == 2
        assert got["model"] == "tiny"
        assert got["steps"] == 4
        assert got["interval_median_ms"] == 12.5
        assert got["hops"] == {"link_up": 0.75, "pipeline": 9.0}
        assert got["drops"] == {"bad_encoding": 2}
