"""The simulator against the real runtime on this machine (CPU ranks over gloo).

``calibrate_on`` measures, on a live torch.distributed job, what the simulator needs beyond
the per-block times: the worker loop's cost per task and per batched forward and the
controller's cost per finished chunk (every stage on rank 0, with and without batching); with
two ranks or more, a hop's latency (ping-pong) and, by accounting every thread of rank 0
in two layouts on all the job's ranks (stages dealt round robin, whole steps dealt round
robin), the processor time its send and receive threads spend per message and what the
worker's own work costs beside the other ranks (a scale, and a cost per message).
``realcheck`` runs free-running ``tiny`` streams (every chunk queued at once, stages split
evenly over the ranks) for each (ranks, streams) case, calibrating each job in rounds
between its cases, and simulates the same cases with those calibrations and the host's core
count; it reports predicted, measured and relative error per case. ``calibrate_gloo``
(``physis-profile --runtime gloo``) is the same calibration on a two-rank job, for profiles
used elsewhere.

Other jobs on the host (other users' tests) take processor time the simulation does not have,
so calibration and every measured run record the other jobs' load while they ran, and only
quiet runs count (see ``realcheck``).

Calibration layouts are ones no checked case uses, except that with one rank "every stage on
rank 0" is the one-rank case itself: that case repeats a calibration run; every other case is
a prediction. ``physis-sim --experiment realcheck`` prints the result as JSON. This module
imports ``physis_ros.serve`` lazily: the rest of the pool package does not need
torch.distributed.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import asdict, astuple, dataclass, replace

K, W = 4, 2
"""Steps and window of the real checks (the ``tiny`` model has L = 2: 8 stages)."""
BATCHES = [1, 2, 3, 4, 6, 8, 12]
"""Batch sizes the checked cases form (up to 3 streams x 4 steps on one rank)."""
WARM_CHUNKS = 30
"""Unmeasured chunks run just before every measured run (and 0.1 s of forwards before the
block timing), and no run follows an idle wait unless it retries a run other jobs disturbed:
a run that starts after the host sat idle for a moment is slower, for longer than a few
chunks. On this VM, 120-chunk one-rank runs after 0.3 s idle had a median of 1.53 ms, right
after another run 1.26 ms (16 runs each); an engine serving streams is never idle that
long."""
QUIET_CORES = 0.1
"""A run counts as quiet when other jobs used fewer processors than this while it ran."""


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


def _process_ticks(pid: int, *, children: bool = False) -> int:
    """utime + stime of one process, all its threads (clock ticks, as /proc/stat), and with
    ``children`` those of its children it has waited for."""
    with open(f"/proc/{pid}/stat") as f:
        fields = [int(v) for v in f.read().rsplit(")", 1)[1].split()[11:15]]
    return sum(fields) if children else fields[0] + fields[1]


class ForeignLoad:
    """Other jobs' processor use while our processes (``pids``) run: the host's busy time
    less ours, in processors (0.5: half a core of other work on average)."""

    def __init__(self, pids: list[int], *, children: bool = False) -> None:
        """``children``: count the children ``pids`` start and wait for as ours too."""
        self.pids = pids
        self.children = children
        self._ours0 = self._ours()
        self._host0, _ = _cpu_times()
        self._t0 = time.perf_counter()

    def cores(self) -> float:
        wall_s = time.perf_counter() - self._t0
        ours = self._ours() - self._ours0
        host = _cpu_times()[0] - self._host0
        return max(host - ours, 0) / os.sysconf("SC_CLK_TCK") / max(wall_s, 1e-9)

    def _ours(self) -> int:
        return sum(_process_ticks(pid, children=self.children) for pid in self.pids)


def runtime_config(model: str = "tiny", steps: int = K, window: int = W):
    from physis_ros.serve.dist.runtime import RuntimeConfig

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
        engine.open_stream(StreamSpec(seed=i), layout=lay).stream_id
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


def calibrate_on(
    engine, entries, *, chunks: int = 120, older: set[int]
) -> tuple[dict, list, float, list[WorkerSample]]:
    """One calibration of each kind on a live gloo ``engine`` (rank 0 in this process), as
    the simulator needs it beyond the probed block times ``entries``.

    1. All stages on rank 0 (``layout_single``), one free-running stream, ``chunks`` queued,
       once without batching (one task per forward) and once with. The rank's serial work is
       ``tasks * (block(1) + batch_oh + task_oh) + chunks * chunk_oh`` without batching and
       ``sum(block(b) + batch_oh) + tasks * task_oh + chunks * chunk_oh`` with it (batch
       sizes recorded); ``chunk_oh`` is the controller thread's processor time per chunk,
       measured directly. ``block`` is the probed ``entries`` scaled so that they add up to
       the worker's own processor time in its forwards of both runs: the probe gives the
       shape over batch sizes, the runs the level (the host's speed moves between the probe
       and the runs, and loop overheads derived from a slower probe would come out
       negative). The worker thread's processor time per unit of that modelled work is the
       one-rank reference of step 3.
    2. With two ranks or more: a ping-pong of 100 activations with rank 1 (no forwards):
       ``hop_ms`` is half a round trip.
    3. With two ranks or more: two free-running runs of one stream, with every thread of rank
       0 accounted (``/proc`` schedstat): the stages dealt round robin over all the job's
       ranks (``layout_strided``: every hop crosses ranks) and whole steps dealt round robin
       (``layout_whole_steps``: a quarter to a half of the messages per forward), layouts no
       checked case uses. ``send_cpu_ms`` is rank 0's send threads' time per message sent
       and ``recv_cpu_ms`` its receive thread's per message received, over both runs, each
       plus an even share of the threads Python does not own (gloo's transport). The worker
       thread's time beside the other ranks is fitted over the two runs
       (``fit_worker_costs``) as ``rank_work_scale`` times its modelled work (relative to
       step 1) plus ``worker_message_ms`` per message rank 0 sent or received: the wakeups,
       GIL handoffs and cold caches every message costs the worker, and the slower
       processor beside other ranks. A single scale measured on the strided run over-charged
       layouts with fewer messages per forward (2 ranks, layout_even: worker time 1.22x its
       modelled work, strided 1.52x). All are measured with as many ranks sharing the cores
       as the job has, since they grow with that number. ``older``: this process's threads
       from before the engine started (not its).

    Returns the costs, the scaled block times, the other jobs' load, and step 3's two
    ``WorkerSample`` (empty with one rank): ``rank_work_scale`` and ``worker_message_ms``
    are left to ``fit_worker_costs`` over many calibrations (the callers pool them).
    """
    from physis_ros.engine.placement import layout_single
    from physis_ros.engine.pool.costmodel import Profile, ProfileCostModel

    cfg = engine.model_cfg
    steps, L = engine.cfg.steps, cfg.num_blocks
    tasks = chunks * steps * L
    probe = Profile(
        device="-", model="-", steps=steps, window=0, dtype="-", entries=tuple(entries), hop_ms=0.0
    )
    probed = ProfileCostModel(probe).block_ms
    worker = engine.host.worker
    worker_tid = engine._threads[0].native_id
    pids = [os.getpid()] + [proc.pid for proc in engine.procs]
    foreign = []
    single: dict[bool, tuple[float, float, list[int], float]] = {}
    forwards: list[tuple[int, float]] = []  # (tasks, worker processor ms) of every forward
    for batching in (False, True):
        worker.batching = batching  # read by the worker's loop at each pick
        run_free(engine, [layout_single(steps, L)], WARM_CHUNKS)
        worker.record_block_times()
        w0 = task_cpu_ms(worker_tid)
        meter = ForeignLoad(pids)
        cpu0, t0 = time.thread_time(), time.perf_counter()
        run_free(engine, [layout_single(steps, L)], chunks)
        wall_ms = (time.perf_counter() - t0) * 1e3
        main_ms = (time.thread_time() - cpu0) * 1e3
        sizes = [b for _, b, _, _ in worker.stats.block_times]
        single[batching] = (wall_ms, main_ms, sizes, task_cpu_ms(worker_tid) - w0)
        forwards += zip(sizes, worker.stats.block_cpu_ms, strict=True)
        foreign.append(meter.cores())
    worker.batching = True
    level = sum(ms for _, ms in forwards) / sum(probed(b) for b, _ in forwards)
    entries = scaled_entries(entries, level)

    def block(tasks: int) -> float:
        return probed(tasks) * level

    chunk_oh = statistics.mean(r[1] for r in single.values()) / chunks
    a = single[False][0] / tasks - block(1) - chunk_oh * chunks / tasks
    wall_b, _, sizes, worker_ms = single[True]
    rest = wall_b - sum(block(b) for b in sizes) - chunk_oh * chunks
    batch_oh = (a * tasks - rest) / (tasks - len(sizes)) if len(sizes) < tasks else a
    batch_oh = min(max(batch_oh, 0.0), max(a, 0.0))
    task_oh = max(a - batch_oh, 0.0)
    costs = {
        "task_overhead_ms": task_oh,
        "batch_overhead_ms": batch_oh,
        "chunk_overhead_ms": chunk_oh,
        "hop_ms": 0.0,
        "send_cpu_ms": 0.0,
        "recv_cpu_ms": 0.0,
    }
    if engine.world_size < 2:
        return costs, entries, max(foreign), []

    def modelled_ms(sizes: list[int]) -> float:
        """The worker's work as the simulator charges it: forwards and loop overheads."""
        return sum(block(b) + batch_oh + b * task_oh for b in sizes)

    one_rank = worker_ms / modelled_ms(sizes)
    engine.measure_hop_ms(rounds=1, warmup=WARM_CHUNKS)
    hop_ms = statistics.median(engine.measure_hop_ms(rounds=100, warmup=0))
    runs = []
    for layout in (layout_strided, layout_whole_steps):
        lay = layout(steps, L, engine.world_size)
        run_free(engine, [lay], WARM_CHUNKS)
        meter = ForeignLoad(pids)
        runs.append(_rank0_under_load(engine, lay, 2 * chunks, older, modelled_ms))
        foreign.append(meter.cores())
    sent, received = sum(r.sent for r in runs), sum(r.received for r in runs)
    shared = sum(r.native_ms for r in runs) / max(sent + received, 1)
    samples = [
        WorkerSample(
            modelled_ms=r.modelled_ms / r.chunks,
            messages=(r.sent + r.received) / r.chunks,
            worker_ms=r.worker_ms / r.chunks / one_rank,
        )
        for r in runs
    ]
    costs.update(
        hop_ms=hop_ms,
        send_cpu_ms=sum(r.send_ms for r in runs) / max(sent, 1) + shared,
        recv_cpu_ms=sum(r.recv_ms for r in runs) / max(received, 1) + shared,
    )
    return costs, entries, max(foreign), samples


@dataclass(frozen=True)
class WorkerSample:
    """Rank 0's worker in one calibration run, per chunk: its work as the simulator models
    it, the messages rank 0 sent and received, and its processor time (in units of the
    one-rank run's processor time per modelled ms)."""

    modelled_ms: float
    messages: float
    worker_ms: float


def fit_worker_costs(calibrations: list[list[WorkerSample]]) -> tuple[float, float]:
    """``(rank_work_scale, worker_message_ms)`` with worker_ms = scale * modelled_ms +
    worker_message_ms * messages through the two layouts' samples, each the median over
    ``calibrations`` (one run of each layout is noisy: solved alone, a calibration's two runs
    gave scales from -1.9 to 3.4 on this host). Bounded to what is physical: a worker is
    never faster beside other ranks than alone (scale >= 1) and a message never saves it
    time (cost >= 0); when the exact solution is outside the bounds, the least-squares fit
    on a bound."""
    (m1, n1, w1), (m2, n2, w2) = (
        map(statistics.median, zip(*(astuple(c[i]) for c in calibrations), strict=True))
        for i in range(2)
    )
    det = m1 * n2 - m2 * n1
    if det:
        scale, per_message = (w1 * n2 - w2 * n1) / det, (m1 * w2 - m2 * w1) / det
        if scale >= 1 and per_message >= 0:
            return scale, per_message
    on_bounds = [
        (1.0, max((n1 * (w1 - m1) + n2 * (w2 - m2)) / (n1 * n1 + n2 * n2), 0.0)),
        (max((m1 * w1 + m2 * w2) / (m1 * m1 + m2 * m2), 1.0), 0.0),
    ]

    def squared_error(fit: tuple[float, float]) -> float:
        a, c = fit
        return (w1 - a * m1 - c * n1) ** 2 + (w2 - a * m2 - c * n2) ** 2

    return min(on_bounds, key=squared_error)


def layout_strided(steps: int, blocks: int, workers: int) -> list[list[int]]:
    """Stage s (step-major) on rank s mod ``workers``: every hop crosses ranks (with 2 ranks
    it is ``layout_by_block_even``)."""
    return [[(k * blocks + b) % workers for b in range(blocks)] for k in range(steps)]


def layout_whole_steps(steps: int, blocks: int, workers: int) -> list[list[int]]:
    """Each step's blocks on one rank, the steps dealt round robin (step k on rank k mod
    ``workers``), the fewest messages per forward of a layout on all ranks; backwards (step k
    on rank -k-1 mod ``workers``) where forwards is ``layout_even`` (``workers`` = K), which
    the checked cases use."""
    from physis_ros.engine.placement import layout_even

    if not 1 <= workers <= steps:
        raise ValueError(f"whole steps on {workers} ranks needs 1 <= ranks <= K = {steps}")
    forwards = [[k % workers] * blocks for k in range(steps)]
    if forwards != [list(row) for row in layout_even(steps, blocks, workers)]:
        return forwards
    return [[(-k - 1) % workers] * blocks for k in range(steps)]


def calibrate_gloo(
    model: str, steps: int, window: int, entries, *, chunks: int = 120, repeats: int = 5
) -> tuple[dict, list]:
    """Worker-loop, controller and message costs of a two-rank gloo job on this host, and
    the probed block times ``entries`` at the level the worker's forwards ran at: the
    medians of ``repeats`` calibrations (``calibrate_on``; the worker's scale and cost per
    message fitted over all of them), counting only those during which other jobs used
    under ``QUIET_CORES`` (up to ``3 * repeats`` tries; all of them when none was quiet)."""
    from physis_ros.serve.dist.engine import DistEngine

    older = set(_all_tasks_cpu_ms())
    quiet, noisy = [], []
    with DistEngine.launch_local(runtime_config(model, steps, window), 2) as engine:
        warm_up(engine)
        while len(quiet) < repeats and len(quiet) + len(noisy) < 3 * repeats:
            if noisy:
                wait_for_quiet(5.0)
            costs, scaled, foreign, samples = calibrate_on(
                engine, entries, chunks=chunks, older=older
            )
            (quiet if foreign < QUIET_CORES else noisy).append((costs, scaled, samples))
    runs = quiet or noisy
    medians = {key: statistics.median(c[key] for c, _, _ in runs) for key in runs[0][0]}
    scale, per_message_ms = fit_worker_costs([samples for _, _, samples in runs])
    medians.update(rank_work_scale=scale, worker_message_ms=per_message_ms)
    level = statistics.median(e[0].ms_p50 for _, e, _ in runs) / entries[0].ms_p50
    return medians, scaled_entries(entries, level)


def scaled_entries(entries, level: float) -> list:
    """Profile entries with both block times multiplied by ``level``."""
    return [replace(e, ms_p50=e.ms_p50 * level, ms_p99=e.ms_p99 * level) for e in entries]


def warm_up(engine) -> None:
    """A few chunks through every rank and the transport's threads (first-use costs)."""
    from physis_ros.engine.placement import layout_even

    K_, L = engine.cfg.steps, engine.model_cfg.num_blocks
    run_free(engine, [layout_even(K_, L, engine.world_size)], 8)
    if engine.world_size > 1:
        engine.measure_hop_ms(rounds=5, warmup=5)


def task_cpu_ms(tid: int) -> float:
    """Processor time of one thread of this process (ns resolution, any thread)."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e6


def _all_tasks_cpu_ms() -> dict[int, float]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            out[int(tid)] = task_cpu_ms(int(tid))
        except FileNotFoundError:  # the thread ended
            continue
    return out


@dataclass(frozen=True)
class _Rank0Run:
    """Rank 0's threads in one run (processor ms, totals over ``chunks``)."""

    chunks: int
    worker_ms: float
    modelled_ms: float
    """The worker's work as the simulator models it."""
    send_ms: float
    sent: int
    recv_ms: float
    received: int
    native_ms: float
    """Threads Python does not own (gloo's transport, serving both directions)."""


def _rank0_under_load(engine, layout, chunks: int, older: set[int], modelled_ms) -> _Rank0Run:
    """One free-running run of ``layout`` with rank 0's threads accounted. ``older``:
    threads from before the job."""
    transport, worker = engine.transport, engine.host.worker
    worker_tid = engine._threads[0].native_id
    known = {worker_tid, engine._threads[1].native_id}  # worker, monitor
    known |= {threading.get_native_id()} | older  # the caller (the controller)
    recv_tid = transport._recv_thread.native_id
    send_tids = {t.native_id for t in transport._send_threads.values()}
    sent0, recv0 = transport.counters["sent"], transport.counters["received"]
    n0 = len(worker.stats.block_times)
    before = _all_tasks_cpu_ms()
    run_free(engine, [layout], chunks)
    used = {tid: ms - before.get(tid, 0.0) for tid, ms in _all_tasks_cpu_ms().items()}
    sizes = [b for _, b, _, _ in worker.stats.block_times[n0:]]
    return _Rank0Run(
        chunks=chunks,
        worker_ms=used.get(worker_tid, 0.0),
        modelled_ms=modelled_ms(sizes),
        send_ms=sum(used.get(t, 0.0) for t in send_tids),
        sent=transport.counters["sent"] - sent0,
        recv_ms=used.get(recv_tid, 0.0),
        received=transport.counters["received"] - recv0,
        native_ms=sum(ms for tid, ms in used.items() if tid not in known | send_tids | {recv_tid}),
    )


def profile_gloo(
    model: str = "tiny",
    steps: int = K,
    window: int = W,
    repeats: int = 20,
    *,
    batches: str = "1,2,3,4,6,8,12",
    rounds: int = 3,
    gloo_repeats: int = 5,
):
    """A ``physis-profile --runtime gloo`` profile of this CPU (one torch thread per rank).
    The default batch sizes are every size the checked cases form (up to 3 streams x 4 steps
    on one rank), each the fastest of ``rounds`` round-robin medians."""
    import torch

    from physis_ros.tools.profile_cli import _parser, measure

    torch.set_num_threads(1)
    argv = ["--model", model, "--steps", str(steps), "--window", str(window), "--runtime", "gloo"]
    argv += ["--batches", batches, "--repeats", str(repeats), "--rounds", str(rounds)]
    argv += ["--gloo-repeats", str(gloo_repeats)]
    return measure(_parser().parse_args(argv))


POOLED = ("send_cpu_ms", "recv_cpu_ms", "hop_ms")
"""Calibrated message costs that ``pool_message_costs`` takes as the median over all
calibrations of one number of ranks (every round of every job)."""


def pool_message_costs(profiles: list, samples: list[list[WorkerSample]]) -> list:
    """The calibrations with their message costs replaced by the median over all of them and
    the worker's scale and cost per message by one fit over all their ``samples``
    (``fit_worker_costs``). Each is a ratio or a per-message time from runs of its own, so
    pooling them averages out one round's unlucky run (one round's rank work scale, from one
    run, ranged 1.0-1.8); the block times and loop overheads stay per round, since the
    overheads were derived from that round's block times."""
    pooled = {key: statistics.median(getattr(p, key) for p in profiles) for key in POOLED}
    if any(samples):
        scale, per_message_ms = fit_worker_costs([s for s in samples if s])
        pooled.update(rank_work_scale=scale, worker_message_ms=per_message_ms)
    return [replace(p, **pooled) for p in profiles]


def mean_block_entries(timers: dict, window_s: float = 0.4) -> list:
    """Block forward times by batch size, as the runs see them: every size sampled in turn
    (one forward each) for ``window_s``, so that all sizes see the same stretch of the host's
    speed, and averaged (a run's time is the sum of its forwards, so the mean, not the
    median, is what it pays). ``ms_p50`` holds that mean; ``ms_p99`` the 99th percentile."""
    from physis_ros.engine.pool.costmodel import ProfileEntry

    samples: dict[int, list[float]] = {b: [] for b in timers}
    warm_until = time.perf_counter() + 0.1
    while time.perf_counter() < warm_until:
        for timer in timers.values():
            timer.sample()
    deadline = time.perf_counter() + window_s
    while time.perf_counter() < deadline or min(map(len, samples.values())) < 5:
        for b, timer in timers.items():
            samples[b].append(timer.sample())
    return [
        ProfileEntry(
            tasks=b,
            ms_p50=statistics.mean(ms),
            ms_p99=sorted(ms)[min(len(ms) - 1, int(0.99 * len(ms)))],
        )
        for b, ms in samples.items()
    ]


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
            # A rank's own work costs more processor time beside other ranks (calibrated).
            forward_scale=profile.rank_work_scale if world > 1 else 1.0,
            worker_message_ms=profile.worker_message_ms if world > 1 else 0.0,
        ),
    )
    return [s.interval_mean_ms for s in rep.streams]


def realcheck(
    ranks: tuple[int, ...] = (1, 2, 3, 4),
    streams: tuple[int, ...] = (1, 2, 3),
    *,
    model: str = "tiny",
    chunks: int = 120,
    skip: int = 8,
    jobs: int = 3,
    rounds: int = 5,
    runs_per_round: int = 2,
    profile=None,
    quiet_wait_s: float = 10.0,
    max_foreign_cores: float = QUIET_CORES,
) -> dict:
    """Calibrate and measure every case in interleaved rounds, then predict.

    This host's speed is not steady: on the shared 2-core VM, 240-chunk runs of the same
    one-rank case back to back ranged 1.18-2.22 ms (8 runs), with no other job on the host (a
    neighbour under the VM, on the scale of tens of milliseconds to seconds), and a
    block-forward probe just before or after a run did not predict it (correlation 0.2-0.5
    over 25 runs). So one run, or one calibration, is a sample of a wide distribution, and
    a calibration done once before the cases compares different stretches of time. Instead
    each number of ranks gets ``jobs`` jobs that calibrate themselves (``calibrate_on``:
    block times in this process, then the single-rank, ping-pong, strided and whole-step
    runs on the job's own ranks) and run every case ``runs_per_round`` times, in ``rounds`` rounds
    each, so that the calibrations and the runs sample the same minutes. Several jobs,
    because a job's processes keep how the kernel placed them: within one job the
    calibrations and the runs differed by up to 16% in the same direction, a fresh job
    drew again. A case's prediction is the median of the predictions of the calibrations
    (``_compare``; message costs and the worker's scale and cost per message pooled,
    ``pool_message_costs``),
    its measured interval the median of its runs. A given ``profile`` is used instead of
    calibrating.

    Other jobs on the host take processor time the simulation does not have (a multi-rank
    case needs both cores), so every run's foreign load is measured while it runs (the
    host's busy time less our processes'); a run counts as quiet below ``max_foreign_cores``
    and is retried when it is not (up to 3 tries, each retry waiting up to ``quiet_wait_s``
    for a quiet host; no other run waits, see ``WARM_CHUNKS``). A case with no quiet run is
    measured on all of its runs and marked not quiet."""
    import torch

    from physis_ros.engine.config import get_preset
    from physis_ros.engine.model import build_model
    from physis_ros.engine.stage import BlockTimer

    torch.set_num_threads(1)  # rank 0 lives in this process
    t_start = time.perf_counter()
    load_before = os.getloadavg()[0]
    cores = host_cores()
    block_model = build_model(get_preset(model), device="cpu")
    timers = {b: BlockTimer(block_model, [W] * b, window=W) for b in BATCHES}
    cases, profiles = [], {}
    for world in ranks:
        calibrations: list = []  # (profile, other jobs' cores while it ran, worker samples)
        runs: dict[int, list[tuple[float, float]]] = {n: [] for n in streams}
        for _ in range(jobs):
            _Job(
                world=world,
                model=model,
                chunks=chunks,
                skip=skip,
                max_foreign_cores=max_foreign_cores,
                quiet_wait_s=quiet_wait_s,
                timers=timers,
                calibrations=calibrations if profile is None else None,
                runs=runs,
            ).run(rounds, runs_per_round)
        job_profiles = [profile]
        if profile is None:
            quiet = [c for c in calibrations if c[1] < max_foreign_cores]
            job_profiles = pool_message_costs(
                [p for p, _, _ in quiet or calibrations], [s for _, _, s in quiet or calibrations]
            )
            profiles[world] = {
                "calibrations": [p.to_json() for p in job_profiles],
                "calibrations_quiet": len(quiet),
                "calibration_foreign_cores": [round(f, 2) for _, f, _ in calibrations],
                "worker_samples": [[asdict(x) for x in s] for _, _, s in calibrations],
            }
        for n, case_runs in runs.items():
            cases.append(
                _compare(
                    job_profiles,
                    world,
                    n,
                    case_runs,
                    chunks=chunks,
                    skip=skip,
                    cores=cores,
                    max_foreign_cores=max_foreign_cores,
                )
            )
    worst = max(abs(c["error"]) for c in cases)
    noisy = [(c["ranks"], c["streams"]) for c in cases if not c["quiet"]]
    worst_load = max(abs(c["error_with_measured_load"]) for c in cases)
    return {
        "experiment": "realcheck",
        "cases": cases,
        "max_abs_error": worst,
        "within_15_percent": worst <= 0.15,
        "cases_without_a_quiet_run": noisy,
        "max_abs_error_with_measured_load": worst_load,
        "host_cores": cores,
        "loadavg_1min_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "runtime_s": round(time.perf_counter() - t_start, 1),
        "profiles_by_ranks": profiles if profile is None else {"given": profile.to_json()},
        "method": (
            f"per number of ranks, {jobs} gloo jobs; {rounds} rounds in each, a calibration "
            "(block times: shape from a round-robin probe, level from the worker's forwards; "
            "all stages on rank 0 without and with batching; with 2+ ranks a ping-pong and "
            "two runs on all ranks, the stages and whole steps dealt round robin) then "
            f"{runs_per_round} runs of "
            "every case, each after an unmeasured warm-up: "
            f"free-running streams (all {chunks} chunks queued), stages split evenly over the "
            f"ranks (layout_even), mean interval after {skip} chunks; measured: the median "
            f"of the runs with other jobs below {max_foreign_cores} cores "
            "(measured during each run); prediction: the median over the calibrations of "
            "physis-sim with that calibration (message costs: medians over the "
            "calibrations; the worker's scale and cost per message: one fit over them), "
            "the worker's pick rule, processor sharing of "
            f"{cores} cores among busy ranks and message threads; '_with_measured_load': the "
            "same, with the other jobs' load (median over the case's runs, in processors) "
            "sharing those cores"
        ),
    }


@dataclass(kw_only=True)
class _Job:
    """One gloo job of ``world`` ranks in ``realcheck``: rounds of one calibration (unless
    ``calibrations`` is None) and ``runs_per_round`` runs of every case, appended to
    ``calibrations`` and ``runs``."""

    world: int
    model: str
    chunks: int
    skip: int
    max_foreign_cores: float
    quiet_wait_s: float
    timers: dict
    calibrations: list | None
    runs: dict[int, list[tuple[float, float]]]

    def run(self, rounds: int, runs_per_round: int) -> None:
        from physis_ros.serve.dist.engine import DistEngine

        older = set(_all_tasks_cpu_ms())
        with DistEngine.launch_local(runtime_config(self.model), self.world) as engine:
            warm_up(engine)
            pids = [os.getpid()] + [proc.pid for proc in engine.procs]
            for _ in range(rounds):
                if self.calibrations is not None:
                    last = self.calibrations[-1:]
                    if last and last[0][1] >= self.max_foreign_cores:
                        wait_for_quiet(self.quiet_wait_s)
                    self.calibrations.append(self._calibrate(engine, older))
                for n in [*self.runs] * runs_per_round:
                    self.runs[n].append(self._measure(engine, pids, n))

    def _calibrate(self, engine, older: set[int]) -> tuple:
        from physis_ros.engine.pool.costmodel import Profile

        costs, entries, foreign, samples = calibrate_on(
            engine, mean_block_entries(self.timers), chunks=self.chunks, older=older
        )
        profile = Profile(
            device="cpu x1 threads",
            model=self.model,
            steps=K,
            window=W,
            dtype="float32",
            entries=tuple(entries),
            **costs,
            comm_threads=True,
            host_cores=host_cores(),
            calibrated_on="gloo",
        )
        return profile, foreign, samples

    def _measure(self, engine, pids, n: int) -> tuple[float, float]:
        """Mean interval of ``n`` free-running streams and other jobs' load meanwhile; a run
        other jobs disturbed is retried (twice at most) after waiting for a quiet host."""
        from physis_ros.engine.placement import layout_even

        layouts = [layout_even(K, engine.model_cfg.num_blocks, self.world)] * n
        for attempt in range(3):
            if attempt:
                wait_for_quiet(self.quiet_wait_s)
            run_free(engine, layouts, WARM_CHUNKS)
            meter = ForeignLoad(pids)
            lefts = run_free(engine, layouts, self.chunks)
            interval = statistics.mean(statistics.mean(intervals_ms(x, self.skip)) for x in lefts)
            foreign = meter.cores()
            if foreign < self.max_foreign_cores:
                break
        return interval, foreign


def _compare(
    profiles: list,
    world: int,
    n: int,
    case_runs,
    *,
    chunks: int,
    skip: int,
    cores: int,
    max_foreign_cores: float,
) -> dict:
    """One case's measured runs against the simulator's prediction: the median of the
    predictions of the calibrations for its number of ranks, each used whole (its loop
    overheads were derived from its own block times, so mixing numbers of different
    calibrations would not add up to any run's time)."""
    from physis_ros.engine.config import get_preset
    from physis_ros.engine.placement import layout_even

    layouts = [layout_even(K, get_preset(profiles[0].model).num_blocks, world)] * n
    quiet = [m for m, f in case_runs if f < max_foreign_cores] or [m for m, _ in case_runs]
    foreign = statistics.median(f for _, f in case_runs)

    def predict(other_cores: float) -> list[float]:
        return [
            statistics.mean(
                simulate_free(
                    p, world, layouts, chunks, skip=skip, cores=cores, foreign=other_cores
                )
            )
            for p in profiles
        ]

    by_calibration = predict(0.0)
    pred = statistics.median(by_calibration)
    pred_load = statistics.median(predict(foreign))
    real = statistics.median(quiet)
    return {
        "ranks": world,
        "streams": n,
        "measured_interval_ms": round(real, 3),
        "quiet": any(f < max_foreign_cores for _, f in case_runs),
        "runs": [{"interval_ms": round(m, 3), "foreign_cores": round(f, 2)} for m, f in case_runs],
        "predicted_interval_ms": round(pred, 3),
        "predicted_by_calibration_ms": [round(v, 3) for v in by_calibration],
        "error": round(pred / real - 1, 4),
        "predicted_with_measured_load_ms": round(pred_load, 3),
        "error_with_measured_load": round(pred_load / real - 1, 4),
    }
