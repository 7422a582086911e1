"""Calibrating the cost model on a live torch.distributed job (CPU ranks over gloo): what the
simulator needs beyond per-block times, measured on the job's own ranks.

``calibrate_on`` measures, on a live job, the worker loop's cost per task and per batched
forward and the controller's cost per finished chunk (every stage on rank 0, with and without
batching); with two ranks or more, a hop's latency (ping-pong) and, by accounting every thread
of rank 0 in two layouts on all the job's ranks (stages dealt round robin, whole steps dealt
round robin), the processor time its send and receive threads spend per message and what the
worker's own work costs beside the other ranks (a scale, and a cost per message, fitted by
``fit_worker_costs``). ``startup_profile`` is the short calibration physis-serve runs at
start-up under torchrun; ``physis_ros.tools.realcheck`` repeats it in rounds to check the
simulator against this machine (docs/pool/README.md).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import astuple, dataclass, replace

from physis_ros.engine.api import StreamSpec
from physis_ros.engine.placement import layout_even, layout_single
from physis_ros.engine.pool.costmodel import Profile, ProfileCostModel, ProfileEntry
from physis_ros.engine.stage import BlockTimer

K, W = 4, 2
"""Steps and window of the real checks (the ``tiny`` model has L = 2: 8 stages)."""

WARM_CHUNKS = 30
"""Unmeasured chunks run just before every measured run (and 0.1 s of forwards before the
block timing), and no run follows an idle wait unless it retries a run other jobs disturbed:
a run that starts after the host sat idle for a moment is slower, for longer than a few
chunks. On this VM, 120-chunk one-rank runs after 0.3 s idle had a median of 1.53 ms, right
after another run 1.26 ms (16 runs each); an engine serving streams is never idle that
long."""


def host_cores() -> int:
    return len(os.sched_getaffinity(0))


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


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


def run_free(engine, layouts: list, chunks: int, timeout_s: float = 120.0) -> list[list[float]]:
    """Open one stream per layout, queue every chunk at once, return left_s per stream."""
    # horizon 0: generated chunks with no observation (weights whose metadata names a
    # horizon would refuse the second one)
    sids = [
        engine.open_stream(StreamSpec(seed=i, horizon=0), layout=lay).stream_id
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
    engine, entries, *, chunks: int = 120, older: set[int], warm_chunks: int = WARM_CHUNKS
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
    3. With two ranks or more: two free-running runs of one stream on all the job's ranks,
       with every thread of rank 0 accounted (``_cross_rank_runs``). ``older``: this
       process's threads from before the engine started (not its).

    Returns the costs, the scaled block times, the other jobs' load, and step 3's two
    ``WorkerSample`` (empty with one rank): ``rank_work_scale`` and ``worker_message_ms``
    are left to ``fit_worker_costs`` over many calibrations (the callers pool them).
    """
    steps, L = engine.sampler.steps, engine.cfg.num_blocks
    tasks = chunks * steps * L
    probe = Profile(
        device="-", model="-", steps=steps, window=0, dtype="-", entries=tuple(entries), hop_ms=0.0
    )
    probed = ProfileCostModel(probe).block_ms
    pids = [os.getpid()] + [proc.pid for proc in engine.executor.procs]
    single, forwards, foreign = _one_rank_runs(engine, chunks, warm_chunks, pids)
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
    if engine.executor.world_size < 2:
        return costs, entries, max(foreign), []

    def modelled_ms(sizes: list[int]) -> float:
        """The worker's work as the simulator charges it: forwards and loop overheads."""
        return sum(block(b) + batch_oh + b * task_oh for b in sizes)

    one_rank = worker_ms / modelled_ms(sizes)
    engine.executor.measure_hop_ms(rounds=1, warmup=warm_chunks)
    costs["hop_ms"] = statistics.median(engine.executor.measure_hop_ms(rounds=100, warmup=0))
    send_ms, recv_ms, samples, loads = _cross_rank_runs(
        engine,
        chunks=chunks,
        warm_chunks=warm_chunks,
        pids=pids,
        older=older,
        modelled_ms=modelled_ms,
    )
    costs.update(send_cpu_ms=send_ms, recv_cpu_ms=recv_ms)
    samples = [replace(sample, worker_ms=sample.worker_ms / one_rank) for sample in samples]
    foreign += loads
    return costs, entries, max(foreign), samples


def _one_rank_runs(engine, chunks: int, warm_chunks: int, pids: list[int]):
    """Step 1 of ``calibrate_on``: every stage on rank 0, once without batching and once
    with; per run (wall ms, controller processor ms, batch sizes, worker processor ms), the
    (tasks, worker processor ms) of every forward, and the other jobs' load."""
    steps, L = engine.sampler.steps, engine.cfg.num_blocks
    worker = engine.executor.host.worker
    worker_tid = engine.executor.threads[0].native_id
    foreign = []
    single: dict[bool, tuple[float, float, list[int], float]] = {}
    forwards: list[tuple[int, float]] = []
    for batching in (False, True):
        worker.batching = batching  # read by the worker's loop at each pick
        run_free(engine, [layout_single(steps, L)], warm_chunks)
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
    return single, forwards, foreign


def _cross_rank_runs(
    engine, *, chunks: int, warm_chunks: int, pids, older: set[int], modelled_ms
) -> tuple[float, float, list[WorkerSample], list[float]]:
    """Step 3 of ``calibrate_on``: rank 0's send and receive processor ms per message, the
    worker samples (worker ms per chunk, not yet in units of the one-rank reference) and the
    other jobs' load in each run.

    Two free-running runs of one stream, with every thread of rank 0 accounted (``/proc``
    schedstat): the stages dealt round robin over all the job's ranks (``layout_strided``:
    every hop crosses ranks) and whole steps dealt round robin (``layout_whole_steps``: a
    quarter to a half of the messages per forward), layouts no checked case uses.
    ``send_cpu_ms`` is rank 0's send threads' time per message sent and ``recv_cpu_ms`` its
    receive thread's per message received, over both runs, each plus an even share of the
    threads Python does not own (gloo's transport). The worker thread's time beside the
    other ranks is fitted over the two runs (``fit_worker_costs``) as ``rank_work_scale``
    times its modelled work (relative to step 1) plus ``worker_message_ms`` per message rank
    0 sent or received: the wakeups, GIL handoffs and cold caches every message costs the
    worker, and the slower processor beside other ranks. A single scale measured on the
    strided run over-charged layouts with fewer messages per forward (2 ranks, layout_even:
    worker time 1.22x its modelled work, strided 1.52x). All are measured with as many ranks
    sharing the cores as the job has, since they grow with that number.
    """
    steps, L = engine.sampler.steps, engine.cfg.num_blocks
    runs, loads = [], []
    for layout in (layout_strided, layout_whole_steps):
        lay = layout(steps, L, engine.executor.world_size)
        run_free(engine, [lay], warm_chunks)
        meter = ForeignLoad(pids)
        runs.append(_rank0_under_load(engine, lay, 2 * chunks, older, modelled_ms))
        loads.append(meter.cores())
    sent, received = sum(r.sent for r in runs), sum(r.received for r in runs)
    shared = sum(r.native_ms for r in runs) / max(sent + received, 1)
    samples = [
        WorkerSample(
            modelled_ms=r.modelled_ms / r.chunks,
            messages=(r.sent + r.received) / r.chunks,
            worker_ms=r.worker_ms / r.chunks,
        )
        for r in runs
    ]
    send_ms = sum(r.send_ms for r in runs) / max(sent, 1) + shared
    recv_ms = sum(r.recv_ms for r in runs) / max(received, 1) + shared
    return send_ms, recv_ms, samples, loads


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
    if not 1 <= workers <= steps:
        raise ValueError(f"whole steps on {workers} ranks needs 1 <= ranks <= K = {steps}")
    forwards = [[k % workers] * blocks for k in range(steps)]
    if forwards != [list(row) for row in layout_even(steps, blocks, workers)]:
        return forwards
    return [[(-k - 1) % workers] * blocks for k in range(steps)]


def scaled_entries(entries, level: float) -> list:
    """Profile entries with both block times multiplied by ``level``."""
    return [replace(e, ms_p50=e.ms_p50 * level, ms_p99=e.ms_p99 * level) for e in entries]


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
    transport, worker = engine.executor.transport, engine.executor.host.worker
    worker_tid = engine.executor.threads[0].native_id
    known = {worker_tid, engine.executor.threads[1].native_id}  # worker, monitor
    known |= {threading.get_native_id()} | older  # the caller (the controller)
    recv_tids = transport.recv_thread_ids()
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
        recv_ms=sum(used.get(t, 0.0) for t in recv_tids),
        received=transport.counters["received"] - recv0,
        native_ms=sum(ms for tid, ms in used.items() if tid not in known | send_tids | recv_tids),
    )


def mean_block_entries(timers: dict, window_s: float = 0.4) -> list:
    """Block forward times by batch size, as the runs see them: every size sampled in turn
    (one forward each) for ``window_s``, so that all sizes see the same stretch of the host's
    speed, and averaged (a run's time is the sum of its forwards, so the mean, not the
    median, is what it pays). ``ms_p50`` holds that mean; ``ms_p99`` the 99th percentile."""
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


def startup_profile(engine, *, chunks: int = 16, warm_chunks: int = 6, window_s: float = 0.3):
    """A ``Profile`` of this job measured now (physis-serve under torchrun, CPU ranks): block
    times by batch size probed on rank 0's middle block and levelled by the worker's own
    forwards, then one ``calibrate_on`` of ``chunks`` chunks per run on the job's ranks (a
    few seconds for a small model; ``physis-profile --runtime gloo`` measures longer)."""
    cfg, sampler = engine.cfg, engine.sampler
    K, L = sampler.steps, cfg.num_blocks
    # The calibration's layouts need blocks where the initial placement put none.
    for layout in (layout_single, layout_strided, layout_whole_steps):
        if layout is layout_whole_steps and engine.executor.world_size > K:
            continue
        lay = layout(K, L) if layout is layout_single else layout(K, L, engine.executor.world_size)
        engine.load_blocks(tuple(tuple(row) for row in lay))
    older = set(_all_tasks_cpu_ms())
    model = engine.model
    timers = {
        b: BlockTimer(model, [sampler.window] * b, window=sampler.window) for b in (1, 2, 4, 8)
    }
    costs, entries, _, samples = calibrate_on(
        engine,
        mean_block_entries(timers, window_s),
        chunks=chunks,
        older=older,
        warm_chunks=warm_chunks,
    )
    extra = {}
    if samples:
        scale, per_message_ms = fit_worker_costs([samples])
        extra = {"rank_work_scale": scale, "worker_message_ms": per_message_ms}
    return Profile(
        device=f"cpu x{engine.executor.cfg.threads} threads per rank",
        model=cfg.name,
        steps=sampler.steps,
        window=sampler.window,
        dtype=engine.executor.cfg.dtype,
        entries=tuple(entries),
        **costs,
        **extra,
        comm_threads=True,
        host_cores=host_cores(),
        calibrated_on="gloo",
    )
