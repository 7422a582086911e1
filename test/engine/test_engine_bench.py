"""physis-bench: the engine subcommand's JSON, and lazy dispatch (robot side never needs torch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _bench(*args: str, timeout_s: float = 240.0) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "physis_ros.bench.cli", *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout_s, env=ENV, cwd=REPO, check=False
    )


def test_engine_bench_json_has_the_reported_keys():
    proc = _bench(
        "engine",
        "--model",
        "tiny",
        "--mode",
        "all",
        "--chunks",
        "6",
        "--steps",
        "2",
        "--check-oracle",
        "--compare-batching",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    for key in (
        "model",
        "K",
        "L",
        "workers",
        "streams",
        "interval_ms",
        "interval_p99_ms",
        "fill_latency_ms",
        "response_latency_ms",
        "block_ms",
        "ideal_interval_ms",
        "efficiency",
        "sequential_clean_interval_ms",
        "sequential_noisy_interval_ms",
        "speedup_vs_clean",
        "oracle_max_abs_diff",
        "interval_batched_ms",
        "interval_unbatched_ms",
    ):
        assert rep.get(key) is not None, key
    assert rep["model"] == "tiny" and (rep["K"], rep["L"], rep["workers"]) == (2, 2, 1)
    assert rep["oracle_max_abs_diff"] <= 1e-5
    assert rep["ideal_interval_ms"] == rep["block_ms"] * 2 * 2
    assert rep["interval_ms"] > 0
    assert rep["efficiency"] == rep["ideal_interval_ms"] / rep["interval_ms"]
    assert rep["drops"] == 0


def test_engine_bench_threads_and_human_table():
    proc = _bench(
        "engine",
        "--model",
        "tiny",
        "--chunks",
        "5",
        "--steps",
        "2",
        "--workers",
        "2",
        "--streams",
        "2",
        "--check-oracle",
    )
    assert proc.returncode == 0, proc.stderr
    assert "interval_ms" in proc.stdout and "oracle_max_abs_diff" in proc.stdout
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("oracle_max_abs_diff"))
    assert float(line.split()[1]) <= 1e-5


def test_cli_usage_and_errors():
    assert _bench().returncode == 2
    assert _bench("nope").returncode == 2
    bad = _bench("engine", "--model", "tiny", "--chunks", "1")
    assert bad.returncode == 2 and "--chunks" in bad.stderr


def test_cli_imports_no_torch():
    code = "import sys, physis_ros.bench.cli; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env=ENV, cwd=REPO, timeout=60)


def test_engine_bench_over_torch_distributed_ranks_reports_comm_and_speedup():
    proc = _bench(
        "engine", "--ranks", "2", "--model", "tiny", "--chunks", "8", "--skip", "2", "--json"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(proc.stdout)
    assert (rep["ranks"], rep["backend"], rep["threads"]) == (2, "gloo", 1)
    # both runs (1 rank and 2 ranks) equal the oracle
    assert rep["oracle_max_abs_diff"] <= 1e-5
    assert rep["comm_ms"] > 0 and rep["comm_p99_ms"] >= rep["comm_ms"]
    assert rep["speedup_vs_1_rank"] == rep["interval_1_rank_ms"] / rep["interval_ms"]
    assert len(rep["rank_cpu_share"]) == len(rep["rank_busy_frac"]) == 2
    cores = os.cpu_count() or 1  # a rank's process has a few threads besides compute
    assert all(0 < share <= cores + 0.1 for share in rep["rank_cpu_share"])
    assert 0 < rep["cpu_share_1_rank"] <= cores + 0.1


def test_ranks_keep_start_up_objects_out_of_garbage_collection():
    from physis_ros.engine.ranks.config import RuntimeConfig
    from physis_ros.engine.ranks.executor import ranks_engine

    cfg = RuntimeConfig(model="tiny", device="cpu", fault_timeout_s=30.0, comm_timeout_s=60.0)
    with ranks_engine(cfg, world_size=2) as engine:
        usage = engine.executor.rank_usage()
    # tens of thousands of start-up objects (torch, the model) are frozen on every rank, so
    # a full collection no longer walks them
    assert all(u["gc_frozen"] > 10_000 for u in usage.values()), usage
