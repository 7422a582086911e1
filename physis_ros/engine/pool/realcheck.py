"""The simulator against the real runtime on this machine (CPU ranks over gloo).

``calibrate_gloo`` measures, on the torch.distributed runtime itself, what the simulator needs
beyond the per-block times: the worker loop's cost per task and per batched forward and the
controller's cost per finished chunk (one-rank runs, with and without batching), the
processor time of one message and how much slower forwards run inside a multi-rank job
(processor-time accounting of a two-rank run), and a hop's latency (ping-pong). ``realcheck`` then
runs free-running ``tiny`` streams (every chunk queued at once, stages split evenly over the
ranks) for each (ranks, streams) case and simulates the same cases with that profile and the
host's core count; it reports predicted, measured and relative error per case.

Calibration uses one rank and a two-rank layout that no checked case uses (each rank one
block at every step). The one-rank one-stream case repeats a calibration run; every other
case is a prediction. ``physis-sim --experiment realcheck`` prints the result as JSON.
This module imports ``physis_ros.serve`` lazily: the rest of the pool package does not need
torch.distributed.
"""

from __future__ import annotations

import os
import statistics
import time

K, W = 4, 2
"""Steps and window of the real checks (the ``tiny`` model has L = 2: 8 stages)."""


def host_cores() -> int:
    return len(os.sched_getaffinity(0))


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def host_busy(window_s: float = 0.3) -> float:
    """Fraction of all processors busy over ``window_s`` (ours idle: other jobs' load)."""
    b0, t0 = _cpu_times()
    time.sleep(window_s)
    b1, t1 = _cpu_times()
    return (b1 - b0) / max(t1 - t0, 1)


def wait_for_quiet(max_wait_s: float, below: float = 0.15) -> float:
    """Wait (up to ``max_wait_s``) until other jobs leave the host nearly idle; returns the
    last busy fraction seen. A quiet host returns at once."""
    deadline = time.monotonic() + max_wait_s
    busy = host_busy()
    while busy > below and time.monotonic() < deadline:
        busy = host_busy()
    return busy


def runtime_config(model: str = "tiny", steps: int = K, window: int = W):
    from physis_ros.serve.runtime import RuntimeConfig

    return RuntimeConfig(
        model=model,
        steps=steps,
        window=window,
        device="cpu",
        placement="even",
        heartbeat_interval_s=0.2,
        fault_timeout_s=5.0,
        comm_timeout_s=60.0,
        startup_timeout_s=60.0,
    )


def intervals_ms(left_s: list[float], skip: int) -> list[float]:
    return [(b - a) * 1e3 for a, b in zip(left_s[skip:], left_s[skip + 1 :], strict=False)]


def run_free(engine, layouts: list, chunks: int, timeout_s: float = 120.0) -> list[list[float]]:
    """Open one stream per layout, queue every chunk at once, return left_s per stream."""
    from physis_ros.engine.api import StreamSpec

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


def calibrate_gloo(
    model: str, steps: int, window: int, entries, *, chunks: int = 40, repeats: int = 3
) -> dict:
    """Worker-loop, controller and message costs measured on the gloo runtime.

    Contention on a shared host only ever adds time, so every wall time below is the fastest
    of ``repeats`` runs (on a quiet host fastest and median agree).

    1. One rank, one free-running stream, all ``chunks`` queued. Without batching (one task
       per forward) the rank's serial work is ``tasks * (block(1) + batch_oh + task_oh) +
       chunks * chunk_oh``; with batching (batch sizes recorded) ``sum(block(b) + batch_oh)
       + tasks * task_oh + chunks * chunk_oh``. ``chunk_oh`` is the controller thread's
       processor time per chunk, measured directly.
    2. Two ranks, each holding one block at every step (``layout_by_block``: 8 messages per
       chunk for the tiny model, a layout the checked cases do not use), one free-running
       stream, ``repeats`` runs. Processor-time accounting on rank 0: its process time less
       the idle rate, the controller thread, the forwards (thread time of each, recorded by
       the worker) and the loop costs of step 1 is what its messages cost; divided by the
       messages it sent and received, that is ``send_cpu_ms`` = ``recv_cpu_ms`` (the
       transport's send and receive threads, gloo's own threads, the worker's send-side
       work). The forwards are subtracted at their isolated cost (``entries``): what they
       take beyond it in this run (every op's GIL release is contended while the transport's
       threads handle a message; ~2x on this host) is charged to the messages, so a layout
       with fewer messages sees less of it. ``hop_ms``: half a ping-pong round trip.
    """

    from physis_ros.engine.config import get_preset
    from physis_ros.engine.placement import layout_by_block_even
    from physis_ros.engine.pool.costmodel import Profile, ProfileCostModel
    from physis_ros.serve.dist_engine import DistEngine

    cfg = runtime_config(model, steps, window)
    L = get_preset(model).num_blocks
    tasks = chunks * steps * L
    probe = Profile(
        device="-",
        model=model,
        steps=steps,
        window=window,
        dtype="-",
        entries=tuple(entries),
        hop_ms=0.0,
    )
    block = ProfileCostModel(probe).block_ms
    runs: dict[bool, list[tuple[float, float, list[int]]]] = {False: [], True: []}
    with DistEngine.launch_local(cfg, 1) as engine:
        worker = engine.host.worker
        worker.record_block_times()
        run_free(engine, [None], 8)  # warm-up
        for _ in range(repeats):
            for batching in (False, True):
                worker.batching = batching  # read by the worker's loop at each pick
                n0 = len(worker.stats.block_times)
                cpu0, t0 = time.thread_time(), time.perf_counter()
                run_free(engine, [None], chunks)
                wall_ms = (time.perf_counter() - t0) * 1e3
                main_ms = (time.thread_time() - cpu0) * 1e3
                sizes = [b for _, b, _, _ in worker.stats.block_times[n0:]]
                runs[batching].append((wall_ms, main_ms, sizes))
    chunk_oh = min(m for _, m, _ in runs[False] + runs[True]) / chunks
    a = min(w for w, _, _ in runs[False]) / tasks - block(1) - chunk_oh * chunks / tasks
    wall_b, _, sizes = min(runs[True], key=lambda r: r[0])
    rest = wall_b - sum(block(b) for b in sizes) - chunk_oh * chunks
    batch_oh = (a * tasks - rest) / (tasks - len(sizes)) if len(sizes) < tasks else a
    batch_oh = min(max(batch_oh, 0.0), max(a, 0.0))
    costs = {
        "task_overhead_ms": max(a - batch_oh, 0.0),
        "batch_overhead_ms": batch_oh,
        "chunk_overhead_ms": chunk_oh,
    }
    by_block = layout_by_block_even(steps, L, 2)
    with DistEngine.launch_local(cfg, 2) as engine:
        hops = engine.measure_hop_ms(rounds=50, warmup=10)
        worker = engine.host.worker
        worker.record_block_times()
        run_free(engine, [by_block], 8)  # warm-up (and the send thread to rank 1 exists)
        t0 = time.perf_counter()
        c0 = time.process_time()
        time.sleep(0.5)
        idle_rate = (time.process_time() - c0) / (time.perf_counter() - t0)
        shares = [
            _message_share(engine, by_block, chunks, idle_rate, costs, block)
            for _ in range(repeats)
        ]
    msg_ms = min(shares)
    return {
        **costs,
        "hop_ms": statistics.median(hops),
        "send_cpu_ms": msg_ms,
        "recv_cpu_ms": msg_ms,
    }


def _thread_cpu_ms(thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident)) * 1e3


def _message_share(  # noqa: PLR0917
    engine, layout, chunks: int, idle_rate: float, loop: dict, block
) -> float:
    """Rank 0's processor time per message (a send or a receive) in a two-rank run: its
    process time less the forwards, the worker loop's calibrated costs, the controller thread
    and the idle rate, over the messages it sent and received."""
    worker = engine.host.worker
    transport = engine.transport
    wthread = engine._threads[0]  # rank 0's worker loop
    n0, sent0 = len(worker.stats.block_times), transport.counters["sent"]
    recv0 = transport.counters["received"]
    w0, m0 = _thread_cpu_ms(wthread), time.thread_time()
    p0, t0 = time.process_time(), time.perf_counter()
    run_free(engine, [layout], chunks)
    wall_s = time.perf_counter() - t0
    proc_ms = (time.process_time() - p0 - idle_rate * wall_s) * 1e3
    main_ms = (time.thread_time() - m0) * 1e3  # the controller: charged per chunk
    worker_ms = _thread_cpu_ms(wthread) - w0
    sizes = [b for _, b, _, _ in worker.stats.block_times[n0:]]
    forwards = sum(block(b) for b in sizes)  # isolated: the slowdown in the run is the messages'
    fw_cpu = sum(worker.stats.block_cpu_ms[n0:])
    messages = transport.counters["sent"] - sent0 + transport.counters["received"] - recv0
    expected_loop = len(sizes) * loop["batch_overhead_ms"] + sum(sizes) * loop["task_overhead_ms"]
    loop_ms = min(expected_loop, max(worker_ms - fw_cpu, 0.0))
    rest = proc_ms - main_ms - forwards - loop_ms
    return max(rest, 0.0) / max(messages, 1)


def profile_gloo(
    model: str = "tiny",
    steps: int = K,
    window: int = W,
    repeats: int = 20,
    *,
    batches: str = "1,2,3,4,6,8,12",
    rounds: int = 3,
):
    """A ``physis-profile --runtime gloo`` profile of this CPU (one torch thread per rank).
    The default batch sizes are every size the checked cases form (up to 3 streams x 4 steps
    on one rank), each the fastest of 3 round-robin medians."""
    import torch

    from physis_ros.engine.pool.profile_cli import _parser, measure

    torch.set_num_threads(1)
    argv = ["--model", model, "--steps", str(steps), "--window", str(window), "--runtime", "gloo"]
    argv += ["--batches", batches, "--repeats", str(repeats), "--rounds", str(rounds)]
    return measure(_parser().parse_args(argv))


def simulate_free(
    profile,
    world: int,
    layouts: list,
    chunks: int,
    *,
    skip: int,
    cores: float,
    foreign: float = 0.0,
):
    """Mean interval per stream that the simulator predicts for ``run_free``."""
    from physis_ros.engine.config import SamplerConfig, get_preset
    from physis_ros.engine.pool.costmodel import ProfileCostModel
    from physis_ros.engine.pool.plan import StreamPlan
    from physis_ros.engine.pool.simulator import SimConfig, SimStream, simulate

    cfg = get_preset(profile.model)
    sampler = SamplerConfig(steps=profile.steps, window=profile.window)
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
            foreign_load=foreign,
        ),
    )
    return [s.interval_mean_ms for s in rep.streams]


def realcheck(
    ranks: tuple[int, ...] = (1, 2, 3, 4),
    streams: tuple[int, ...] = (1, 2, 3),
    *,
    model: str = "tiny",
    chunks: int = 40,
    skip: int = 8,
    repeats: int = 5,
    profile=None,
    quiet_wait_s: float = 10.0,
) -> dict:
    """Calibrate (unless ``profile`` is given), then measure and predict every case. Before
    the calibration and before each case it waits up to ``quiet_wait_s`` for other jobs to
    leave the host nearly idle (and reports how busy it was)."""
    from physis_ros.engine.config import get_preset
    from physis_ros.engine.placement import layout_even
    from physis_ros.serve.dist_engine import DistEngine

    t_start = time.perf_counter()
    load_before = os.getloadavg()[0]
    busy_at_calibration = wait_for_quiet(quiet_wait_s) if profile is None else None
    profile = profile or profile_gloo(model)
    cores = profile.host_cores or host_cores()
    L = get_preset(profile.model).num_blocks
    cases = []
    for world in ranks:
        with DistEngine.launch_local(runtime_config(profile.model), world) as engine:
            run_free(engine, [layout_even(K, L, world)], 8)  # warm-up
            for n in streams:
                layouts = [layout_even(K, L, world)] * n
                busy = wait_for_quiet(quiet_wait_s)
                foreign = busy * cores  # other jobs' processors, measured just before
                measured = []
                for _ in range(repeats):
                    lefts = run_free(engine, layouts, chunks)
                    measured.append(
                        statistics.mean(statistics.mean(intervals_ms(x, skip)) for x in lefts)
                    )
                pred = statistics.mean(
                    simulate_free(profile, world, layouts, chunks, skip=skip, cores=cores)
                )
                pred_load = statistics.mean(
                    simulate_free(
                        profile, world, layouts, chunks, skip=skip, cores=cores, foreign=foreign
                    )
                )
                real = min(measured)  # contention only adds time: the quietest run
                cases.append(
                    {
                        "ranks": world,
                        "streams": n,
                        "measured_interval_ms": round(real, 3),
                        "measured_runs_ms": [round(m, 3) for m in measured],
                        "predicted_interval_ms": round(pred, 3),
                        "error": round(pred / real - 1, 4),
                        "host_busy_before": round(busy, 2),
                        "predicted_with_measured_load_ms": round(pred_load, 3),
                        "error_with_measured_load": round(pred_load / real - 1, 4),
                    }
                )
    worst = max(abs(c["error"]) for c in cases)
    worst_load = max(abs(c["error_with_measured_load"]) for c in cases)
    return {
        "experiment": "realcheck",
        "cases": cases,
        "max_abs_error": worst,
        "within_15_percent": worst <= 0.15,
        "max_abs_error_with_measured_load": worst_load,
        "host_cores": cores,
        "host_busy_before_calibration": busy_at_calibration,
        "loadavg_1min_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "runtime_s": round(time.perf_counter() - t_start, 1),
        "profile": profile.to_json(),
        "method": (
            f"free-running streams (all {chunks} chunks queued), stages split evenly over the "
            f"ranks (layout_even), mean interval after {skip} chunks, fastest of {repeats} runs; "
            "prediction: physis-sim with the gloo-calibrated profile (block times vs batch "
            "size, worker-loop/controller/hop costs), the worker's pick rule, processor "
            f"sharing of {cores} cores among busy ranks; '_with_measured_load': the same, "
            "with the other jobs' load (busy fraction of the host just before the case, in "
            "processors) sharing those cores"
        ),
    }
