"""Helpers of the real checks: profile this CPU, run tiny streams on the gloo runtime, and
simulate the same thing with the measured profile. Used by test_pool_real.py and runnable
as ``python test/pool/realcheck.py`` (prints JSON)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from physis_ros.engine.api import StreamSpec  # noqa: E402
from physis_ros.engine.config import get_preset  # noqa: E402
from physis_ros.engine.placement import layout_even  # noqa: E402
from physis_ros.engine.pool.costmodel import Profile, ProfileCostModel  # noqa: E402
from physis_ros.engine.pool.plan import StreamPlan  # noqa: E402
from physis_ros.engine.pool.profile_cli import _parser, measure  # noqa: E402
from physis_ros.engine.pool.simulator import SimConfig, SimStream, simulate  # noqa: E402
from physis_ros.serve.dist_engine import DistEngine  # noqa: E402
from physis_ros.serve.runtime import RuntimeConfig  # noqa: E402

K, W = 4, 2


def profile_here(model: str = "tiny") -> Profile:
    torch.set_num_threads(1)
    return measure(
        _parser().parse_args(
            ["--model", model, "--steps", str(K), "--window", str(W), "--repeats", "20"]
        )
    )


def runtime_config(model: str = "tiny") -> RuntimeConfig:
    return RuntimeConfig(
        model=model,
        steps=K,
        window=W,
        device="cpu",
        placement="even",
        heartbeat_interval_s=0.2,
        fault_timeout_s=5.0,
        comm_timeout_s=60.0,
        startup_timeout_s=60.0,
    )


def intervals_ms(left_s: list[float], skip: int) -> list[float]:
    return [(b - a) * 1e3 for a, b in zip(left_s[skip:], left_s[skip + 1 :], strict=False)]


def run_free(engine: DistEngine, layouts: list, chunks: int, timeout_s: float = 120.0):
    """Open one stream per layout, queue every chunk at once, return left_s per stream."""
    sids = [
        engine.open_stream(StreamSpec(seed=i, cond_seed=i), layout=lay).stream_id
        for i, lay in enumerate(layouts)
    ]
    for sid in sids:
        for _ in range(chunks):
            engine.submit_generate(sid)
    left: dict[int, list[float]] = {sid: [] for sid in sids}
    deadline = time.monotonic() + timeout_s
    while sum(map(len, left.values())) < chunks * len(sids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {sum(map(len, left.values()))} chunks finished")
        for res in engine.poll_results(0.5):
            left[res.stream_id].append(res.left_s)
    for sid in sids:
        engine.close_stream(sid)
    return [left[sid] for sid in sids]


def simulate_free(  # noqa: PLR0917
    profile: Profile, world: int, layouts: list, chunks: int, skip: int, cores: float = 0.0
):
    cfg = get_preset(profile.model)
    from physis_ros.engine.config import SamplerConfig

    sampler = SamplerConfig(steps=K, window=W)
    streams = [
        SimStream(
            plan=StreamPlan(
                stream_id=i,
                model=cfg,
                sampler=sampler,
                target_interval_ms=0.0,
                stage_devices=tuple(r for row in lay for r in row),
            ),
            max_inflight=chunks,
        )
        for i, lay in enumerate(layouts)
    ]
    rep = simulate(
        streams,
        ProfileCostModel(profile),
        SimConfig(
            num_devices=world,
            chunks=chunks,
            warmup_chunks=skip,
            cooldown_chunks=0,
            max_batch=10_000,
            priority="engine",
            sink_device=0,
            host_cores=cores,
        ),
    )
    return [s.interval_mean_ms for s in rep.streams]


_SPIN = (
    "import time, torch\n"
    "torch.set_num_threads(1)\n"
    "a = torch.randn(192, 192)\n"
    "t0 = time.perf_counter()\n"
    "for _ in range({n}):\n"
    "    a = torch.tanh(a @ a)\n"
    "print(time.perf_counter() - t0)\n"
)


def effective_cores(processes: int, iterations: int = 3000) -> float:
    """How many processors `processes` busy single-thread processes get right now on this
    host (the others' load included): processes * solo_time / mean parallel time."""
    import subprocess

    def run(n: int) -> list[float]:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _SPIN.format(n=iterations)],
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(n)
        ]
        out = []
        for p in procs:
            stdout, _ = p.communicate(timeout=120)
            out.append(float(stdout))
        return out

    solo = min(run(1)[0], run(1)[0])
    par = statistics.mean(run(processes))
    return min(float(processes), processes * solo / par)


def sim_vs_real(world: int, streams: int, model: str = "tiny", chunks: int = 40, skip: int = 8):
    """Free-running streams (all chunks queued), stages split evenly over `world` ranks.
    Profile, effective cores and the run are measured back to back (the host is shared)."""
    profile = profile_here(model)
    layouts = [layout_even(K, get_preset(profile.model).num_blocks, world)] * streams
    # One rank: the profile, measured just now in one process, already runs at the speed the
    # host gives one process. Several ranks: how many processors they get together.
    cores = effective_cores(world) if world > 1 else 0.0
    with DistEngine.launch_local(runtime_config(profile.model), world) as engine:
        hop = statistics.median(engine.measure_hop_ms()) if world > 1 else 0.0
        lefts = run_free(engine, layouts, chunks)
    real = [statistics.mean(intervals_ms(left, skip)) for left in lefts]
    # gloo sends run on the transport's own threads: a hop is latency, not worker time.
    prof = dataclasses.replace(profile, hop_ms=hop, comm_overlaps_compute=True)
    pred = simulate_free(prof, world, layouts, chunks, skip, cores)
    return {
        "ranks": world,
        "streams": streams,
        "hop_ms": round(hop, 4),
        "block_ms_1": round(profile.entries[0].ms_p50, 4),
        "task_overhead_ms": round(profile.task_overhead_ms, 4),
        "batch_overhead_ms": round(profile.batch_overhead_ms, 4),
        "effective_cores": round(cores, 2),
        "measured_interval_ms": round(statistics.mean(real), 3),
        "predicted_interval_ms": round(statistics.mean(pred), 3),
        "error": round(statistics.mean(pred) / statistics.mean(real) - 1, 4),
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--streams", default="1,2,3")
    args = ap.parse_args()
    for w in map(int, args.ranks.split(",")):
        for s in map(int, args.streams.split(",")):
            print(json.dumps(sim_vs_real(w, s)), flush=True)
