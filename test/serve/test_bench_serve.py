"""physis-bench serve end to end on a small case: a real physis-serve (tiny, a given cost
profile, so that the admissions do not depend on this machine's load), streams opened one by
one until refused, the JSON the issue asks for. How close promises come to what streams get
is the benchmark's number to read, not asserted here (the machine is shared)."""

from __future__ import annotations

import json

from test_serve_admission import PROFILE

from physis_ros.bench.serve import main


def test_bench_opens_streams_until_refused_and_reports_each(tmp_path, capsys):
    (tmp_path / "profile.json").write_text(json.dumps(PROFILE))
    config = tmp_path / "serve.yaml"
    config.write_text(
        "engine: {model: tiny, steps: 4, window: 2}\n"
        f"placement: {{workers: 1, profile: {tmp_path / 'profile.json'}}}\n"
        # the profile's costs throughout: what the host measures must not move admissions
        "pool: {max_utilization: 0.9, recalibrate: false}\n"
    )
    args = ["--config", str(config), "--target-ms", "32", "--max-streams", "5"]
    code = main([*args, "--settle-s", "1.5", "--measure-s", "3", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["runtime"] == "single process"
    assert out["admitted"] == 3 == len(out["streams"])  # what the profile admits at 32 ms
    assert out["refused_reason"].startswith("RESOURCE_EXHAUSTED: compute")
    assert 0.0 <= out["overlap"] <= 1.0
    for stream in out["streams"]:
        assert stream["target_ms"] == 32.0 and stream["promised_ms"] >= 32.0
        assert (
            stream["measured_p50_ms"] > 0 and stream["measured_p99_ms"] >= stream["measured_p50_ms"]
        )
    # the first stream was measured after each of the two that joined later
    assert len(out["streams"][0]["p50_after_each_later_join_ms"]) == 2
    assert out["streams"][0]["promise_revision"] >= 1  # told when the third joined
