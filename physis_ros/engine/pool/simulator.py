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

The inputs (``SimStream``, ``SimConfig``) live in ``simconfig``, the report in ``simreport``;
this module runs the events between them.
"""

from __future__ import annotations

import heapq
import math
from collections import deque

from physis_ros.engine.pool.costmodel import CostModel
from physis_ros.engine.pool.memory import MemoryModel
from physis_ros.engine.pool.plan import StreamPlan
from physis_ros.engine.pool.simconfig import SimConfig, SimStream
from physis_ros.engine.pool.simreport import SimReport, build_report

__all__ = ["SimConfig", "SimReport", "SimStream", "simulate"]

_RELEASE, _ARRIVE, _DONE, _WIRE = 0, 1, 2, 3


def simulate(
    streams: list[SimStream],
    cost: CostModel,
    config: SimConfig,
    memory: MemoryModel | None = None,
) -> SimReport:
    """Run the pool until every stream has produced ``config.chunks`` chunks."""
    for s in streams:
        if max(s.plan.stage_devices) >= config.num_devices:
            raise ValueError(
                f"stream {s.plan.stream_id} uses a device >= num_devices {config.num_devices}"
            )
        if s.plan.target_interval_ms == 0 and s.max_inflight < 1:
            raise ValueError(f"stream {s.plan.stream_id}: T = 0 needs max_inflight >= 1")
        if (s.context_chunks or s.rollout > 1) and s.plan.target_interval_ms == 0:
            raise ValueError(
                f"stream {s.plan.stream_id}: context chunks and rollouts need a target interval"
            )
    sim = _Simulation(streams, cost, config)
    sim.run()
    return build_report(
        streams,
        config,
        memory,
        release=sim.generated(sim.release),
        start=sim.generated(sim.start),
        done=sim.generated(sim.done),
        busy_spans=sim.busy_spans,
        batches=sim.batches,
        tasks_run=sim.tasks_run,
    )


class _Simulation:
    """One run of the pool: its state and the events that change it.

    Entities that do work: devices ``0..G-1`` (their workers) and, with ``cost.comm_threads``,
    device d's send thread ``G + d`` and receive thread ``2G + d``. The event heap holds
    ``(time, seq, kind, a, b, c)``: ``_RELEASE`` (stream), ``_ARRIVE`` (stream, stage, chunk),
    ``_WIRE`` (stream, stage, chunk * G + receiver) and ``_DONE`` (entity, index of its work,
    version: a finish time moved by a change of speed leaves a stale event behind).
    """

    def __init__(self, streams: list[SimStream], cost: CostModel, config: SimConfig) -> None:
        self.streams, self.cost, self.config = streams, cost, config
        G = self.G = config.num_devices
        n, C = len(streams), config.chunks
        self.per_release = [int(s.context_chunks) + s.rollout for s in streams]
        self.plans = plans = [s.plan for s in streams]
        self.keys = [(p.model.name, p.sampler.steps, p.sampler.window) for p in plans]
        self._group_cache: dict[tuple, float] = {}
        self._hop_cache: dict[tuple, float] = {}
        # Processor time of messages (0 for devices whose communication runs beside compute).
        self.comm = [
            (cost.send_cpu_ms(p.model), cost.recv_cpu_ms(p.model), cost.chunk_overhead_ms(p.model))
            for p in plans
        ]
        self.debt = [0.0] * G  # processor time owed by each device for messages and the sink
        # A device's send and receive threads serve one message at a time each, in order;
        # their processor time shares the host's cores with the workers but never stops one.
        self.threads = cost.comm_threads
        self.server_queue: dict[int, deque] = {e: deque() for e in range(G, 3 * G)}
        # per stream and chunk (context and rollout chunks included)
        self.release = [[math.nan] * (C * self.per_release[si]) for si in range(n)]
        self.start = [[math.nan] * (C * self.per_release[si]) for si in range(n)]
        self.done = [[math.nan] * (C * self.per_release[si]) for si in range(n)]
        self.released = [0] * n
        # per stream and stage: a chunk in service, and the chunks waiting behind it
        self.in_service: list[list[bool]] = [[False] * p.num_stages for p in plans]
        self.pending: list[list[deque]] = [[deque() for _ in range(p.num_stages)] for p in plans]
        # per device: block key -> deque of (seq, stream, stage, chunk); heap of (prio, seq, key)
        self.ready: list[dict[tuple, deque]] = [{} for _ in range(G)]
        self.ready_heap: list[list] = [[] for _ in range(G)]
        self.prio_of: dict[int, float] = {}  # seq of a ready task not yet run -> its priority
        self.busy = [False] * G
        self.link_free = [0.0] * G
        self.busy_spans: list[list[tuple[float, float]]] = [[] for _ in range(G)]
        self.batches = [[0, 0] for _ in range(G)]  # groups, tasks
        self.tasks_run = 0
        self.heap: list = []
        self.seq = 0
        self.dirty: set[int] = set()  # devices to offer work to once this instant's events ran
        # processor sharing: work left per busy entity, and what each is running
        self.group_store: list[list] = []
        self.remaining: dict[int, float] = {}  # busy device or message thread -> work left (ms)
        self.started = [0.0] * (3 * G)
        self.current = [0] * (3 * G)
        self.version = [0] * (3 * G)
        self.starting: list[int] = []  # began work since the last reschedule
        self.last_t = 0.0

    # --- costs

    def group_ms(self, si: int, tasks: int) -> float:
        k = (self.keys[si], tasks)
        if k not in self._group_cache:
            plan = self.plans[si]
            group_ms = self.cost.group_ms(plan.model, plan.sampler, tasks)
            self._group_cache[k] = group_ms * self.config.forward_scale
        return self._group_cache[k]

    def hop_ms(self, si: int, a: int, b: int) -> float:
        k = (self.keys[si][0], a, b)
        if k not in self._hop_cache:
            self._hop_cache[k] = self.cost.hop_ms(self.plans[si].model, a, b)
        return self._hop_cache[k]

    def wire_ms(self, si: int, a: int, b: int) -> float:
        """Hop time not spent as processor time at either end (non-overlapping sends)."""
        return max(self.hop_ms(si, a, b) - self.comm[si][0] - self.comm[si][1], 0.0)

    def destination(self, si: int, nxt: int) -> int | None:
        """Device of stage ``nxt`` (the sink when ``nxt`` is past the last stage)."""
        sd = self.plans[si].stage_devices
        return sd[nxt] if nxt < len(sd) else self.config.sink_device

    # --- the event loop

    def run(self) -> None:
        for si, s in enumerate(self.streams):
            if s.plan.target_interval_ms > 0:
                for c in range(self.config.chunks):
                    self.push(s.phase_ms + c * s.plan.target_interval_ms, _RELEASE, si, 0, 0)
            else:
                for _ in range(min(self.config.chunks, s.max_inflight)):
                    self.push(s.phase_ms, _RELEASE, si, 0, 0)
        handlers = {
            _RELEASE: self.on_release,
            _ARRIVE: self.on_arrive,
            _WIRE: self.on_wire,
            _DONE: self.on_done,
        }
        heap = self.heap
        while heap:
            t = heap[0][0]
            while heap and heap[0][0] == t:
                _, _, kind, a, b, c = heapq.heappop(heap)
                handlers[kind](t, a, b, c)
            for d in sorted(self.dirty):
                self.dispatch(t, d)
            self.dirty.clear()

    def push(self, t: float, kind: int, a: int, b: int, c: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a, b, c))

    def generated(self, times: list[list[float]]) -> list[list[float]]:
        """Per stream, the first generated chunk of each release (context chunks skipped)."""
        first = [int(s.context_chunks) for s in self.streams]
        return [row[first[si] :: self.per_release[si]] for si, row in enumerate(times)]

    # --- events

    def on_release(self, t: float, si: int, _b: int, _c: int) -> None:
        for _ in range(self.per_release[si]):  # the context chunk first, if any
            self.release_chunk(t, si)

    def on_arrive(self, t: float, si: int, stage: int, chunk: int) -> None:
        """A remote hop landed: the receiver pays its processor time."""
        last = stage == self.plans[si].num_stages
        dst = self.destination(si, stage)
        self.charge_worker(dst)
        if self.comm[si][1] > 0:
            self.debt[dst] += self.comm[si][1]
            self.dirty.add(dst)
        if last:
            self.complete(t, si, chunk)
        else:
            self.arrive(t, si, stage, chunk)

    def on_wire(self, t: float, si: int, nxt: int, code: int) -> None:
        """A message left the wire: the receiver's receive thread takes it."""
        chunk, dst = divmod(code, self.G)
        self.server_queue[2 * self.G + dst].append((si, nxt, chunk, dst))
        self.serve(t, 2 * self.G + dst)

    def on_done(self, t: float, entity: int, work: int, version: int) -> None:
        if version != self.version[entity]:
            return  # made stale by a change of speed
        if entity >= self.G:
            self.served(t, entity)
        else:
            group = self.group_store[work]
            self.group_store[work] = []
            self.finish(t, entity, group)

    # --- streams and stages

    def release_chunk(self, t: float, si: int) -> None:
        c = self.released[si]
        self.released[si] += 1
        self.release[si][c] = t
        self.arrive(t, si, 0, c)

    def arrive(self, t: float, si: int, stage: int, chunk: int) -> None:
        self.pending[si][stage].append(chunk)
        self.try_ready(t, si, stage)

    def try_ready(self, t: float, si: int, stage: int) -> None:
        """The stage's next chunk becomes a ready task on its device (per-stage FIFO)."""
        q = self.pending[si][stage]
        if self.in_service[si][stage] or not q:
            return
        chunk = q.popleft()
        self.in_service[si][stage] = True
        plan = self.plans[si]
        d = plan.stage_devices[stage]
        key = (self.keys[si], stage % plan.model.num_blocks)
        self.seq += 1
        self.ready[d].setdefault(key, deque()).append((self.seq, si, stage, chunk))
        if self.config.priority != "engine":
            prio = self.release[si][chunk] if self.config.priority == "oldest_chunk" else t
            self.prio_of[self.seq] = prio
            heapq.heappush(self.ready_heap[d], (prio, self.seq, key))
        self.dirty.add(d)

    def complete(self, t: float, si: int, chunk: int) -> None:
        self.done[si][chunk] = t
        sink = self.config.sink_device
        if sink is not None and self.comm[si][2] > 0:
            self.debt[sink] += self.comm[si][2]
            self.dirty.add(sink)
        if self.plans[si].target_interval_ms == 0 and self.released[si] < self.config.chunks:
            self.release_chunk(t, si)

    # --- devices

    def charge_worker(self, d: int) -> None:
        """A remote message sent or received: its cost to device d's worker."""
        if self.config.worker_message_ms:
            self.debt[d] += self.config.worker_message_ms
            self.dirty.add(d)

    def dispatch(self, t: float, d: int) -> None:
        """An idle device takes its most urgent block and runs its ready tasks as one group."""
        if self.busy[d]:
            return
        if self.config.priority == "engine":
            group = _engine_pick(self.ready[d], self.plans, self.config)
            if group or self.debt[d] > 0:
                self.run_group(t, d, group)
            return
        rh = self.ready_heap[d]
        while rh and rh[0][1] not in self.prio_of:
            heapq.heappop(rh)  # stale: that task already ran in an earlier batch
        if not rh:
            if self.debt[d] > 0:
                self.run_group(t, d, [])  # message / controller work alone
            return
        _, _, key = heapq.heappop(rh)
        dq = self.ready[d][key]
        limit = self.config.max_batch if self.config.batching else 1
        # The key's most urgent tasks (the popped one is the most urgent on the device).
        group = sorted(dq, key=lambda task: (self.prio_of[task[0]], task[0]))[:limit]
        taken = {task[0] for task in group}
        self.ready[d][key] = deque(task for task in dq if task[0] not in taken)
        for sq in taken:
            del self.prio_of[sq]
        self.run_group(t, d, group)

    def run_group(self, t: float, d: int, group: list) -> None:
        work = self.group_ms(group[0][1], len(group)) if group else 0.0
        work += self.debt[d]
        self.debt[d] = 0.0
        for _, si, stage, _ in group:  # sends that cost this device processor time
            dst = self.destination(si, stage + 1)
            if dst is not None and dst != d and not self.threads:
                work += self.comm[si][0]
        for _, si, stage, chunk in group:
            if stage == 0:
                self.start[si][chunk] = t
        self.advance(t)
        self.busy[d] = True
        self.started[d] = t
        self.remaining[d] = work
        self.starting.append(d)
        self.current[d] = len(self.group_store)
        self.group_store.append(group)
        if group:
            self.batches[d][0] += 1
            self.batches[d][1] += len(group)
        self.tasks_run += len(group)
        self.reschedule(t)

    def finish(self, t: float, d: int, group: list) -> None:
        self.advance(t)
        del self.remaining[d]
        self.busy_spans[d].append((self.started[d], t))
        self.reschedule(t)
        self.busy[d] = False
        self.dirty.add(d)
        for _, si, stage, chunk in group:
            self.in_service[si][stage] = False
            self.try_ready(t, si, stage)
            self.forward(t, d, si, stage + 1, chunk)

    def forward(self, t: float, d: int, si: int, nxt: int, chunk: int) -> None:
        """Chunk ``chunk`` finished the stage before ``nxt`` on device d: on to stage ``nxt``
        (past the last stage: the sink)."""
        if nxt == self.plans[si].num_stages:
            sink = self.config.sink_device
            if sink is None or sink == d:  # same device, or the exit hop is not modelled
                self.complete(t, si, chunk)
                return
            self.charge_worker(d)
            if self.threads:
                self.message(t, si, d, nxt, chunk)
            else:
                delay = self.hop_ms(si, d, sink)
                if not self.cost.comm_overlaps_compute:
                    delay = self.wire_ms(si, d, sink)
                self.push(t + delay, _ARRIVE, si, nxt, chunk)
            return
        dst = self.plans[si].stage_devices[nxt]
        if dst == d:
            self.arrive(t, si, nxt, chunk)
            return
        self.charge_worker(d)
        if self.threads:
            self.message(t, si, d, nxt, chunk)
        elif self.cost.comm_overlaps_compute:
            h = self.hop_ms(si, d, dst)
            send_start = max(t, self.link_free[d])
            self.link_free[d] = send_start + h
            self.push(send_start + h, _ARRIVE, si, nxt, chunk)
        else:  # the device sent serially before it became free; sends are done
            self.push(t + self.wire_ms(si, d, dst), _ARRIVE, si, nxt, chunk)

    # --- message threads (``cost.comm_threads``)

    def message(self, t: float, si: int, d: int, nxt: int, chunk: int) -> None:
        """Stage ``nxt`` of ``chunk`` goes from d to a remote device (the sink when ``nxt`` is
        past the last stage): the sender's thread, the wire, the receiver's."""
        self.server_queue[self.G + d].append((si, nxt, chunk, self.destination(si, nxt)))
        self.serve(t, self.G + d)

    def serve(self, t: float, e: int) -> None:
        q = self.server_queue[e]
        if e in self.remaining or not q:
            return
        si = q[0][0]
        self.advance(t)
        self.remaining[e] = self.comm[si][0] if e < 2 * self.G else self.comm[si][1]
        self.starting.append(e)
        self.started[e] = t
        self.reschedule(t)

    def served(self, t: float, e: int) -> None:
        self.advance(t)
        del self.remaining[e]
        self.reschedule(t)
        si, nxt, chunk, dst = self.server_queue[e].popleft()
        if e < 2 * self.G:  # on the wire; the event carries chunk and receiver in one integer
            self.push(t + self.wire_ms(si, e - self.G, dst), _WIRE, si, nxt, chunk * self.G + dst)
        else:  # received
            self.charge_worker(dst)
            if nxt == self.plans[si].num_stages:
                self.complete(t, si, chunk)
            else:
                self.arrive(t, si, nxt, chunk)
        self.serve(t, e)

    # --- processor sharing: devices and message threads share ``host_cores`` processors
    # (0: each its own); with b of them busy on c cores each progresses at min(1, c / b).

    def speed(self) -> float:
        demand = len(self.remaining) + self.config.foreign_load
        if not self.config.host_cores or demand <= self.config.host_cores:
            return 1.0
        return self.config.host_cores / demand

    def advance(self, t: float) -> None:
        if self.config.host_cores:  # otherwise every speed is 1: a finish time never moves
            sp = self.speed()
            for entity in self.remaining:
                self.remaining[entity] -= (t - self.last_t) * sp
        self.last_t = t

    def reschedule(self, t: float) -> None:
        sp = self.speed()
        # Without shared cores only work that just started needs its finish event (a loop
        # over every busy device would cost a 200-device pipeline O(devices) per event).
        for e in list(self.remaining) if self.config.host_cores else self.starting:
            self.version[e] += 1
            self.push(
                t + max(self.remaining[e], 0.0) / sp, _DONE, e, self.current[e], self.version[e]
            )
        self.starting.clear()


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
