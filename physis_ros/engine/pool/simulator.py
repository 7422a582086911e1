"""Discrete-event simulator of a device pool running many streams under a placement.

It follows the workers' scheduling rules:
- a task (stream, chunk, stage) is ready when the chunk has arrived at the stage's device and
  the stream's previous chunk has been processed at that stage (per-stage, per-stream FIFO);
- an idle device takes the block (model, block) of its oldest ready task and runs every
  ready task of that block (any step, chunk or stream; up to ``max_batch``) as one batched
  forward costing ``cost.group_ms(model, sampler, tasks)``;
- a finished task's activation moves to the next stage's device: no delay on the same device,
  one hop (``cost.hop_ms``) otherwise; hops out of a device are serialised on its link, and
  when communication does not overlap compute the device is busy while it sends;
- messages cost processor time where the cost model says so (CPU ranks: packing, the
  transport's threads, the GIL): ``cost.send_cpu_ms`` at the sender, ``cost.recv_cpu_ms`` at
  the receiver, ``cost.chunk_overhead_ms`` at the sink (the controller) per finished chunk.
  ``SimConfig.worker_message_ms`` more at each end's worker (CPU ranks beside each other).
  With ``cost.comm_threads`` (gloo ranks) a send and a receive are served in order by the
  device's own send and receive threads, beside its worker: the message reaches the next
  stage after the sender's thread, the wire (``hop_ms`` less both threads' times) and the
  receiver's thread, and both threads' time shares the host's cores. Otherwise the send is
  added to the sending batch and the receive to the receiving device's work (a device with
  such work and no ready task runs it alone);
- devices that share ``host_cores`` processors (ranks on one CPU host) slow down together
  (processor sharing among the busy ones).

Sources: a stream with a target interval T releases chunk c at ``phase + c * T`` (the robot
asks for one chunk per interval); a stream with T = 0 keeps ``max_inflight`` chunks in the
pipeline (as fast as it goes). Time is in milliseconds.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import asdict, dataclass

from physis_ros.engine.pool.costmodel import CostModel
from physis_ros.engine.pool.memory import MemoryModel
from physis_ros.engine.pool.plan import StreamPlan

PRIORITIES = ("oldest_chunk", "ready_first", "engine")


@dataclass(frozen=True, kw_only=True)
class SimStream:
    plan: StreamPlan
    phase_ms: float = 0.0
    """Release time of chunk 0."""
    latency_budget_ms: float = math.inf
    """The promised response latency: a chunk leaving later than release + budget counts as
    a latency-promise miss (reported; the target that admission guarantees is the interval)."""
    max_inflight: int = 0
    """Chunks kept in flight when the plan's target interval is 0."""
    context_chunks: bool = False
    """Every release also brings an observation: a context chunk that enters just ahead of the
    generated chunk and passes every stage too (the server puts the newest observation in
    right before a generate request). Reported are the generated chunks only; their latency
    counts from the release, when the observation entered. Needs a target interval."""
    rollout: int = 1
    """Generated chunks per release (a rollout of the stream's horizon from each
    observation); reported is the first of each release, the one its response latency means."""


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    num_devices: int
    chunks: int = 16
    """Chunks simulated per stream."""
    warmup_chunks: int = 4
    """Chunks per stream excluded from the statistics (pipeline fill)."""
    cooldown_chunks: int = 2
    """Last chunks per stream excluded too: once other streams finish, the pool is emptier
    than in steady state."""
    max_batch: int = 8
    batching: bool = True
    sink_device: int | None = None
    """Device that collects finished chunks (one more hop from the last stage's device);
    None: the exit hop is not modelled."""
    forward_scale: float = 1.0
    """Multiplies every batched forward's cost (``cost.group_ms``): a slowdown of every
    forward that the cost model's isolated timing does not see (what-if studies; CPU ranks
    beside each other: ``Profile.rank_work_scale``)."""
    worker_message_ms: float = 0.0
    """Work each remote message adds to the sending and to the receiving device (the sink
    for a finished chunk), beside the message's own ``send_cpu_ms`` / ``recv_cpu_ms``
    (CPU ranks: ``Profile.worker_message_ms``)."""
    host_cores: float = 0.0
    """Processors the devices share (CPU workers on one host; may be fractional: the share of
    a loaded host that is left); 0: each device is its own processor."""
    foreign_load: float = 0.0
    """Processors' worth of other jobs' runnable work on that host, sharing it with the busy
    devices (processor sharing: each busy device runs at min(1, cores / (busy + foreign)))."""
    priority: str = "oldest_chunk"
    """Which ready task picks the next block: ``oldest_chunk`` (earliest released chunk, so
    late chunks catch up), ``ready_first`` (the task that became ready first) or ``engine``
    (``Worker._pick``: the block with most ready tasks, ties and cuts to the most downstream
    stages; without batching the most downstream task)."""
    interval_tolerance: float = 0.01
    """A stream meets its target when its median interval is within this of T and it
    misses no deadline."""
    jitter_tolerance: float = 0.10
    """Deadline of chunk c: the stream's output clock, first measured chunk out + (c - c0) * T,
    plus this fraction of T (a consumer that plays chunks at the target rate)."""

    def __post_init__(self) -> None:
        if self.num_devices < 1:
            raise ValueError(f"num_devices must be >= 1, got {self.num_devices}")
        if self.warmup_chunks < 0 or self.cooldown_chunks < 0:
            raise ValueError("warmup_chunks and cooldown_chunks must be >= 0")
        if self.chunks < self.warmup_chunks + self.cooldown_chunks + 3:
            raise ValueError(
                f"chunks ({self.chunks}) must exceed warmup_chunks ({self.warmup_chunks}) + "
                f"cooldown_chunks ({self.cooldown_chunks}) by >= 3"
            )
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if not self.forward_scale > 0:
            raise ValueError(f"forward_scale must be > 0, got {self.forward_scale}")
        if self.worker_message_ms < 0:
            raise ValueError(f"worker_message_ms must be >= 0, got {self.worker_message_ms}")
        if self.foreign_load < 0:
            raise ValueError(f"foreign_load must be >= 0, got {self.foreign_load}")
        if self.host_cores < 0:
            raise ValueError(f"host_cores must be >= 0, got {self.host_cores}")
        if self.sink_device is not None and not 0 <= self.sink_device < self.num_devices:
            raise ValueError(f"sink_device {self.sink_device} outside 0..{self.num_devices - 1}")
        if self.priority not in PRIORITIES:
            raise ValueError(f"priority {self.priority!r} is not one of {PRIORITIES}")


@dataclass(frozen=True, kw_only=True)
class StreamReport:
    stream_id: int
    model: str
    target_interval_ms: float
    interval_p50_ms: float
    interval_p99_ms: float
    interval_mean_ms: float
    latency_p50_ms: float
    """Release (observation in) -> chunk out; with T = 0, first stage start -> out."""
    latency_p99_ms: float
    deadline_misses: int
    """Chunks out later than their slot on the output clock (+ jitter tolerance)."""
    latency_promise_misses: int
    """Chunks out later than release + the promised response latency."""
    chunks_measured: int
    meets_target: bool


@dataclass(frozen=True, kw_only=True)
class DeviceReport:
    device: int
    utilization: float
    """Busy fraction over the measured window."""
    mean_batch: float
    memory: dict


@dataclass(frozen=True, kw_only=True)
class SimReport:
    streams: tuple[StreamReport, ...]
    devices: tuple[DeviceReport, ...]
    window_ms: float
    tasks: int

    @property
    def all_meet_target(self) -> bool:
        return all(s.meets_target for s in self.streams)

    def to_json(self) -> dict:
        return {
            "all_meet_target": self.all_meet_target,
            "window_ms": round(self.window_ms, 3),
            "tasks": self.tasks,
            "streams": [asdict(s) for s in self.streams],
            "devices": [asdict(d) for d in self.devices],
        }


def _pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]


_RELEASE, _ARRIVE, _DONE, _WIRE = 0, 1, 2, 3


def simulate(
    streams: list[SimStream],
    cost: CostModel,
    config: SimConfig,
    memory: MemoryModel | None = None,
) -> SimReport:
    """Run the pool until every stream has produced ``config.chunks`` chunks."""
    G = config.num_devices
    for s in streams:
        if max(s.plan.stage_devices) >= G:
            raise ValueError(f"stream {s.plan.stream_id} uses a device >= num_devices {G}")
        if s.plan.target_interval_ms == 0 and s.max_inflight < 1:
            raise ValueError(f"stream {s.plan.stream_id}: T = 0 needs max_inflight >= 1")
        if (s.context_chunks or s.rollout > 1) and s.plan.target_interval_ms == 0:
            raise ValueError(
                f"stream {s.plan.stream_id}: context chunks and rollouts need a target interval"
            )
    n = len(streams)
    C = config.chunks
    per_release = [int(s.context_chunks) + s.rollout for s in streams]
    plans = [s.plan for s in streams]
    keys = [(p.model.name, p.sampler.steps, p.sampler.window) for p in plans]
    group_cache: dict[tuple, float] = {}

    def group_ms(si: int, tasks: int) -> float:
        k = (keys[si], tasks)
        if k not in group_cache:
            group_ms = cost.group_ms(plans[si].model, plans[si].sampler, tasks)
            group_cache[k] = group_ms * config.forward_scale
        return group_cache[k]

    hop_cache: dict[tuple, float] = {}

    def hop_ms(si: int, a: int, b: int) -> float:
        k = (keys[si][0], a, b)
        if k not in hop_cache:
            hop_cache[k] = cost.hop_ms(plans[si].model, a, b)
        return hop_cache[k]

    # Processor time of messages (0 for devices whose communication runs beside compute).
    comm = [
        (
            cost.send_cpu_ms(p.model),
            cost.recv_cpu_ms(p.model),
            cost.chunk_overhead_ms(p.model),
        )
        for p in plans
    ]

    def wire_ms(si: int, a: int, b: int) -> float:
        """Hop time not spent as processor time at either end (non-overlapping sends)."""
        return max(hop_ms(si, a, b) - comm[si][0] - comm[si][1], 0.0)

    debt = [0.0] * G  # processor time owed by each device for messages and the controller
    # With ``cost.comm_threads`` a device's messages are handled by its send thread (entity
    # G + d) and its receive thread (entity 2G + d), one message at a time each, in order;
    # their processor time shares the host's cores with the workers but never stops one.
    threads = cost.comm_threads
    server_queue: dict[int, deque] = {e: deque() for e in range(G, 3 * G)}

    def serve(t: float, e: int) -> None:
        q = server_queue[e]
        if e in remaining or not q:
            return
        si = q[0][0]
        advance(t)
        remaining[e] = comm[si][0] if e < 2 * G else comm[si][1]
        starting.append(e)
        started[e] = t
        reschedule(t)

    def message(t: float, si: int, d: int, nxt: int, chunk: int) -> None:
        """Stage ``nxt`` of chunk ``chunk`` goes from d to a remote device (the sink when
        ``nxt`` is past the last stage): the sender's thread, the wire, the receiver's."""
        sd = plans[si].stage_devices
        dst = sd[nxt] if nxt < len(sd) else config.sink_device
        server_queue[G + d].append((si, nxt, chunk, dst))
        serve(t, G + d)

    def served(t: float, e: int) -> None:
        advance(t)
        del remaining[e]
        reschedule(t)
        si, nxt, chunk, dst = server_queue[e].popleft()
        if e < 2 * G:  # on the wire; the event carries chunk and receiver in one integer
            push(t + wire_ms(si, e - G, dst), _WIRE, si, nxt, chunk * G + dst)
        else:  # received
            charge_worker(dst)
            if nxt == plans[si].num_stages:
                complete(t, si, chunk)
            else:
                arrive(t, si, nxt, chunk)
        serve(t, e)

    release = [[math.nan] * (C * per_release[si]) for si in range(n)]
    start = [[math.nan] * (C * per_release[si]) for si in range(n)]
    done = [[math.nan] * (C * per_release[si]) for si in range(n)]
    in_service: list[list[bool]] = [[False] * p.num_stages for p in plans]
    pending: list[list[deque]] = [[deque() for _ in range(p.num_stages)] for p in plans]
    # per device: block key -> deque of (seq, stream, stage, chunk); heap of (ready_ms, seq, key)
    ready: list[dict[tuple, deque]] = [{} for _ in range(G)]
    ready_heap: list[list] = [[] for _ in range(G)]
    prio_of: dict[int, float] = {}  # seq of a ready task not yet run -> its priority
    busy = [False] * G
    link_free = [0.0] * G
    busy_spans: list[list[tuple[float, float]]] = [[] for _ in range(G)]
    batches = [[0, 0] for _ in range(G)]  # groups, tasks
    heap: list = []
    seq = 0
    released = [0] * n
    completed = [0] * n
    tasks_run = 0
    dirty: set[int] = set()

    def charge_worker(d: int) -> None:
        """A remote message sent or received: its cost to device d's worker."""
        if config.worker_message_ms:
            debt[d] += config.worker_message_ms
            dirty.add(d)

    def push(t: float, kind: int, a: int, b: int, c: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, seq, kind, a, b, c))

    def try_ready(t: float, si: int, stage: int) -> None:
        nonlocal seq
        q = pending[si][stage]
        if in_service[si][stage] or not q:
            return
        chunk = q.popleft()
        in_service[si][stage] = True
        plan = plans[si]
        d = plan.stage_devices[stage]
        key = (keys[si], stage % plan.model.num_blocks)
        seq += 1
        ready[d].setdefault(key, deque()).append((seq, si, stage, chunk))
        if config.priority != "engine":
            prio = release[si][chunk] if config.priority == "oldest_chunk" else t
            prio_of[seq] = prio
            heapq.heappush(ready_heap[d], (prio, seq, key))
        dirty.add(d)

    def arrive(t: float, si: int, stage: int, chunk: int) -> None:
        pending[si][stage].append(chunk)
        try_ready(t, si, stage)

    def do_release(t: float, si: int) -> None:
        c = released[si]
        released[si] += 1
        release[si][c] = t
        arrive(t, si, 0, c)

    def dispatch(t: float, d: int) -> None:
        if busy[d]:
            return
        if config.priority == "engine":
            group = _engine_pick(ready[d], plans, config)
            if group or debt[d] > 0:
                run(t, d, group)
            return
        rh = ready_heap[d]
        while rh and rh[0][1] not in prio_of:
            heapq.heappop(rh)  # stale: that task already ran in an earlier batch
        if not rh:
            if debt[d] > 0:
                run(t, d, [])  # message / controller work alone
            return
        _, _, key = heapq.heappop(rh)
        dq = ready[d][key]
        limit = config.max_batch if config.batching else 1
        # The key's most urgent tasks (the popped one is the most urgent on the device).
        group = sorted(dq, key=lambda task: (prio_of[task[0]], task[0]))[:limit]
        taken = {task[0] for task in group}
        ready[d][key] = deque(task for task in dq if task[0] not in taken)
        for sq in taken:
            del prio_of[sq]
        run(t, d, group)

    def run(t: float, d: int, group: list) -> None:
        nonlocal tasks_run
        work = group_ms(group[0][1], len(group)) if group else 0.0
        work += debt[d]
        debt[d] = 0.0
        for _, si, stage, _ in group:  # sends that cost this device processor time
            nxt = stage + 1
            sd = plans[si].stage_devices
            dst = sd[nxt] if nxt < len(sd) else config.sink_device
            if dst is not None and dst != d and not threads:
                work += comm[si][0]
        for _, si, stage, chunk in group:
            if stage == 0:
                start[si][chunk] = t
        advance(t)
        busy[d] = True
        started[d] = t
        remaining[d] = work
        starting.append(d)
        current[d] = len(group_store)
        group_store.append(group)
        if group:
            batches[d][0] += 1
            batches[d][1] += len(group)
        tasks_run += len(group)
        reschedule(t)

    # Devices and message threads share ``host_cores`` processors (0: each its own): with b
    # of them busy on c cores each progresses at min(1, c / b) (processor sharing).
    def speed() -> float:
        demand = len(remaining) + config.foreign_load
        if not config.host_cores or demand <= config.host_cores:
            return 1.0
        return config.host_cores / demand

    def advance(t: float) -> None:
        nonlocal last_t
        if config.host_cores:  # otherwise every speed is 1: a finish time never moves
            sp = speed()
            for dev in remaining:
                remaining[dev] -= (t - last_t) * sp
        last_t = t

    def reschedule(t: float) -> None:
        sp = speed()
        # Without shared cores only work that just started needs its finish event (the
        # loop over every busy device made a 200-device pipeline cost O(devices) per event).
        for dev in list(remaining) if config.host_cores else starting:
            version[dev] += 1
            push(t + max(remaining[dev], 0.0) / sp, _DONE, dev, current[dev], version[dev])
        starting.clear()

    group_store: list[list] = []
    remaining: dict[int, float] = {}  # busy device or message thread -> work left (ms)
    started = [0.0] * (3 * G)
    current = [0] * (3 * G)
    version = [0] * (3 * G)
    starting: list[int] = []  # began work since the last reschedule
    last_t = 0.0

    def complete(t: float, si: int, chunk: int) -> None:
        done[si][chunk] = t
        completed[si] += 1
        if config.sink_device is not None and comm[si][2] > 0:
            debt[config.sink_device] += comm[si][2]
            dirty.add(config.sink_device)
        if plans[si].target_interval_ms == 0 and released[si] < C:
            do_release(t, si)

    def finish(t: float, d: int, group: list) -> None:
        advance(t)
        del remaining[d]
        busy_spans[d].append((started[d], t))
        reschedule(t)
        busy[d] = False
        dirty.add(d)
        for _, si, stage, chunk in group:
            in_service[si][stage] = False
            try_ready(t, si, stage)
            plan = plans[si]
            nxt = stage + 1
            if nxt == plan.num_stages:
                sink = config.sink_device
                if sink is None or sink == d:  # same device, or the exit hop is not modelled
                    complete(t, si, chunk)
                    continue
                charge_worker(d)
                if threads:
                    message(t, si, d, nxt, chunk)
                else:
                    delay = hop_ms(si, d, sink)
                    if not cost.comm_overlaps_compute:
                        delay = wire_ms(si, d, sink)
                    push(t + delay, _ARRIVE, si, nxt, chunk)
                continue
            dst = plan.stage_devices[nxt]
            if dst == d:
                arrive(t, si, nxt, chunk)
                continue
            charge_worker(d)
            if threads:
                message(t, si, d, nxt, chunk)
            else:
                h = hop_ms(si, d, dst)
                if cost.comm_overlaps_compute:
                    send_start = max(t, link_free[d])
                    link_free[d] = send_start + h
                    push(send_start + h, _ARRIVE, si, nxt, chunk)
                else:  # the device sent serially before it became free; sends are done
                    push(t + wire_ms(si, d, dst), _ARRIVE, si, nxt, chunk)

    for si, s in enumerate(streams):
        if s.plan.target_interval_ms > 0:
            for c in range(C):
                push(s.phase_ms + c * s.plan.target_interval_ms, _RELEASE, si, 0, 0)
        else:
            for _ in range(min(C, s.max_inflight)):
                push(s.phase_ms, _RELEASE, si, 0, 0)

    while heap:
        t = heap[0][0]
        while heap and heap[0][0] == t:
            _, _, kind, a, b, c = heapq.heappop(heap)
            if kind == _RELEASE:
                for _ in range(per_release[a]):  # the context chunk first, if any
                    do_release(t, a)
            elif kind == _ARRIVE:  # a remote hop: the receiver pays its processor time
                dst = config.sink_device if b == plans[a].num_stages else plans[a].stage_devices[b]
                charge_worker(dst)
                if comm[a][1] > 0:
                    debt[dst] += comm[a][1]
                    dirty.add(dst)
                if b == plans[a].num_stages:
                    complete(t, a, c)
                else:
                    arrive(t, a, b, c)
            elif kind == _WIRE:  # c encodes chunk and receiver
                chunk, dst = divmod(c, G)
                server_queue[2 * G + dst].append((a, b, chunk, dst))
                serve(t, 2 * G + dst)
            elif c == version[a] and a >= G:
                served(t, a)
            elif c == version[a]:  # a DONE made stale by a change of speed is skipped
                group = group_store[b]
                group_store[b] = []
                finish(t, a, group)
        for d in sorted(dirty):
            dispatch(t, d)
        dirty.clear()

    def generated(times: list[list[float]]) -> list[list[float]]:
        first = [int(s.context_chunks) for s in streams]  # of each release's generated ones
        return [row[first[si] :: per_release[si]] for si, row in enumerate(times)]

    return _report(
        streams,
        config,
        memory,
        release=generated(release),
        start=generated(start),
        done=generated(done),
        busy_spans=busy_spans,
        batches=batches,
        tasks_run=tasks_run,
    )


def _engine_pick(ready_d: dict, plans: list[StreamPlan], config: SimConfig) -> list:
    """The engine worker's rule (physis_ros.engine.worker.Worker._pick)."""

    def depth(task) -> tuple[int, int]:
        _, si, stage, _ = task
        return (stage, -plans[si].stream_id)

    nonempty = [(key, dq) for key, dq in ready_d.items() if dq]
    if not nonempty:
        return []
    if not config.batching:
        _, dq = max(nonempty, key=lambda kd: max(depth(task) for task in kd[1]))
        best = max(dq, key=depth)
        dq.remove(best)
        return [best]
    _, dq = max(nonempty, key=lambda kd: (len(kd[1]), max(depth(task) for task in kd[1])))
    chosen = sorted(dq, key=depth, reverse=True)[: config.max_batch]
    for task in chosen:
        dq.remove(task)
    return chosen


def _report(streams, config, memory, *, release, start, done, busy_spans, batches, tasks_run):
    W, C = config.warmup_chunks, config.chunks - config.cooldown_chunks
    stream_reports = []
    for si, s in enumerate(streams):
        plan = s.plan
        T = plan.target_interval_ms
        out = done[si]
        if any(math.isnan(x) for x in out):
            raise RuntimeError(f"internal: stream {plan.stream_id} did not finish every chunk")
        intervals = [out[c] - out[c - 1] for c in range(W + 1, C)]
        ref = release[si] if T > 0 else start[si]
        lat = [out[c] - ref[c] for c in range(W, C)]
        budget = s.latency_budget_ms * (1 + 1e-9)  # a promise met to float round-off is met
        promise_misses = sum(1 for c in range(W, C) if out[c] - release[si][c] > budget)
        misses = 0
        if T > 0:
            # Output clock anchored at the earliest slot the stream ever reached (a consumer
            # that starts playing as soon as it can and then plays one chunk per T).
            anchor = min(out[c] - c * T for c in range(W, C))
            slack = config.jitter_tolerance * T
            misses = sum(1 for c in range(W, C) if out[c] > anchor + c * T + slack)
        p50 = _pct(intervals, 0.5)
        meets = T == 0 or (p50 <= T * (1 + config.interval_tolerance) and misses == 0)
        stream_reports.append(
            StreamReport(
                stream_id=plan.stream_id,
                model=plan.model.name,
                target_interval_ms=T,
                interval_p50_ms=round(p50, 4),
                interval_p99_ms=round(_pct(intervals, 0.99), 4),
                interval_mean_ms=round(sum(intervals) / len(intervals), 4),
                latency_p50_ms=round(_pct(lat, 0.5), 4),
                latency_p99_ms=round(_pct(lat, 0.99), 4),
                deadline_misses=misses,
                latency_promise_misses=promise_misses,
                chunks_measured=C - W,
                meets_target=meets,
            )
        )
    # Utilization window: every stream past warm-up, and no stream's source exhausted yet
    # (after the last release, upstream devices drain and would read as idle).
    n = len(streams)
    t0 = max(done[si][W] for si in range(n))
    last_release = min(release[si][-1] for si in range(n))
    t1 = min(max(done[si][C - 1] for si in range(n)), last_release)
    if t1 <= t0:  # too few chunks for such a window: fall back to the measured span
        t0 = min(done[si][W] for si in range(n))
        t1 = max(done[si][C - 1] for si in range(n))
    window = max(t1 - t0, 1e-9)
    plans = [s.plan for s in streams]
    device_reports = []
    for d in range(config.num_devices):
        busy = sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in busy_spans[d])
        groups, tasks = batches[d]
        mem = memory.device_usage(plans, d).gib() if memory is not None else {}
        device_reports.append(
            DeviceReport(
                device=d,
                utilization=round(busy / window, 4),
                mean_batch=round(tasks / groups, 3) if groups else 0.0,
                memory=mem,
            )
        )
    return SimReport(
        streams=tuple(stream_reports),
        devices=tuple(device_reports),
        window_ms=window,
        tasks=tasks_run,
    )
