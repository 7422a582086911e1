"""physis-serve's Prometheus metrics: ``/metrics`` over HTTP on an opt-in port
(``--metrics-port`` / ``frontend.metrics_port``; docs/metrics.md lists every metric).

Read when scraped from where the figures live (``ServeCollector``): the front end's sessions
and counts, the pool's admission, the executor's workers (threads: their ``WorkerStats``;
torch.distributed ranks: ``RankExecutor.rank_usage``, one control message per rank a scrape).
Kept here only what lives nowhere else: each open stream's interval and response-latency
histograms (observed as its chunks leave, ``Session.on_chunk``), the totals of the streams
that closed (so that counters never go back), and the previous busy sample of each worker
(its busy fraction is the share of the time between two scrapes it spent computing). A
stream's series go when it closes: the labels never grow past the streams open.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from physis_ros.engine.api import StreamEngine
from physis_ros.serve.frontend import Frontend
from physis_ros.serve.frontend_config import ServerDescription
from physis_ros.serve.session import Session

log = logging.getLogger(__name__)

SECONDS_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 10.0,
)  # fmt: skip
"""Interval and response-latency buckets: a fast GPU pipeline's few ms to a CPU host's seconds,
finest around the 100-300 ms a camera-rate stream is promised."""
BUSY_WINDOW_MIN_S = 1.0
"""A worker's busy fraction is measured over at least this long (closer scrapes repeat it)."""
RANK_USAGE_TIMEOUT_S = 2.0
"""Longest a scrape waits for the ranks' usage; past it the scrape goes without them."""


@dataclass(frozen=True)
class WorkerSample:
    """One worker's figures at one moment."""

    wall_s: float
    """The worker's monotonic clock when sampled."""
    busy_s: float
    """Seconds it spent computing so far."""
    queued: int | None
    """Tasks waiting at its stages now (None: not reported)."""


def sample_workers(engine: StreamEngine) -> dict[str, WorkerSample]:
    """Worker label -> its sample now: the engine's worker threads or ranks; none for an
    engine without an executor (another StreamEngine)."""
    executor = getattr(engine, "executor", None)
    if hasattr(executor, "rank_usage"):  # torch.distributed ranks: each answers for itself
        try:
            usage = executor.rank_usage(timeout_s=RANK_USAGE_TIMEOUT_S)
        except (TimeoutError, RuntimeError) as exc:
            log.debug("metrics: no rank usage this scrape: %s", exc)
            return {}
        return {
            str(rank): WorkerSample(u["wall_s"], u["busy_s"], u.get("queued"))
            for rank, u in usage.items()
        }
    now_s = time.monotonic()
    return {
        str(w.rank): WorkerSample(now_s, w.stats.busy_s, w.queued_tasks())
        for w in getattr(executor, "workers", ())
    }


class BusyFractions:
    """Per worker, the share of the wall time between two samples (at least
    ``BUSY_WINDOW_MIN_S`` apart) that it spent computing; until the first such window has
    passed, the share since the first sample."""

    def __init__(self) -> None:
        self._last: dict[str, WorkerSample] = {}
        self._fraction: dict[str, float] = {}

    def update(self, worker: str, now: WorkerSample) -> float | None:
        """The fraction over the latest window (None with a single sample)."""
        last = self._last.get(worker)
        if last is None or now.wall_s < last.wall_s:  # first sample, or a restarted rank
            self._last[worker] = now
            return self._fraction.get(worker)
        window_s = now.wall_s - last.wall_s
        if window_s > 0 and (window_s >= BUSY_WINDOW_MIN_S or worker not in self._fraction):
            share = (now.busy_s - last.busy_s) / window_s
            self._fraction[worker] = min(max(share, 0.0), 1.0)
        if window_s >= BUSY_WINDOW_MIN_S:
            self._last[worker] = now
        return self._fraction.get(worker)


class ServeCollector(Collector):
    """Everything but the histograms and the process figures, read when scraped."""

    def __init__(
        self, frontend: Frontend, engine: StreamEngine, description: ServerDescription
    ) -> None:
        self._frontend = frontend
        self._engine = engine
        self._description = description
        self._lock = threading.Lock()  # one scrape at a time folds and samples
        self._closed: list[Session] = []
        self._closed_chunks = 0
        self._closed_drops: Counter[str] = Counter()
        self._busy = BusyFractions()
        for worker, sample in sample_workers(engine).items():  # the first window starts now
            self._busy.update(worker, sample)

    def stream_closed(self, session: Session) -> None:
        """Its counts join the closed streams' totals at the next scrape: by then the serving
        loop has long forgotten it."""
        with self._lock:
            self._closed.append(session)

    def collect(self) -> Iterator:
        with self._lock:
            open_sessions = self._frontend.open_sessions()
            closing, self._closed = self._closed, []
            for s in closing:
                if s not in open_sessions:
                    self._closed_chunks += s.chunks_out
                    self._closed_drops.update(dict(s.drops))
            chunks, drops = self._closed_chunks, Counter(self._closed_drops)
            workers = {
                w: (s, self._busy.update(w, s)) for w, s in sample_workers(self._engine).items()
            }
        for s in open_sessions:
            chunks += s.chunks_out
            drops.update(dict(s.drops))
        yield from self._server(chunks, drops, len(open_sessions))
        yield from self._streams(open_sessions)
        yield from self._workers(workers)

    def _server(self, chunks: int, drops: Counter[str], open_now: int) -> Iterator:
        f, d = self._frontend, self._description
        info = GaugeMetricFamily(
            "physis_server_info", "The model served (value 1)", labels=["model", "steps", "blocks"]
        )
        info.add_metric([d.model, str(d.steps), str(d.blocks)], 1)
        yield info
        yield GaugeMetricFamily("physis_streams_open", "Streams open now", value=open_now)
        yield CounterMetricFamily(
            "physis_streams_opened", "Streams opened (admitted)", value=f.streams_opened
        )
        yield CounterMetricFamily("physis_streams_closed", "Streams closed", value=f.streams_closed)
        yield CounterMetricFamily(
            "physis_chunks", "Chunks out of the pipeline, every stream (previews not counted)",
            value=chunks,
        )  # fmt: skip
        yield _labelled_counter(
            "physis_drops", "Messages or chunks dropped, by reason", "reason", drops
        )
        yield _labelled_counter(
            "physis_admission_refusals",
            "OpenStream refused for want of a resource (compute, memory, latency, streams, ...)",
            "resource",
            dict(f.admission_refusals),
        )
        yield _labelled_counter(
            "physis_refusals", "Calls refused, by gRPC status code", "code", dict(f.refusals)
        )
        admission = getattr(self._engine, "admission", None)
        if admission is not None:
            yield GaugeMetricFamily(
                "physis_measured_slowdown_ratio",
                "Measured / predicted forward time the pool admits with (1: as calibrated)",
                value=admission.measured_slowdown,
            )

    def _streams(self, sessions: list[Session]) -> Iterator:
        promised_interval = GaugeMetricFamily(
            "physis_stream_promised_interval_seconds",
            "Interval between chunks the stream was promised",
            labels=["stream"],
        )
        promised_latency = GaugeMetricFamily(
            "physis_stream_promised_response_latency_seconds",
            "Response latency the stream was promised",
            labels=["stream"],
        )
        chunks = CounterMetricFamily(
            "physis_stream_chunks", "Chunks out of the pipeline for the stream", labels=["stream"]
        )
        drops = CounterMetricFamily(
            "physis_stream_drops", "The stream's drops, by reason", labels=["stream", "reason"]
        )
        client = GaugeMetricFamily(
            "physis_stream_info", "The stream's client (value 1)", labels=["stream", "client"]
        )
        for s in sessions:
            sid, promise = str(s.stream_id), s.promise
            promised_interval.add_metric([sid], promise.expected_interval_ms / 1e3)
            promised_latency.add_metric([sid], promise.expected_response_latency_ms / 1e3)
            chunks.add_metric([sid], s.chunks_out)
            for reason, count in dict(s.drops).items():
                drops.add_metric([sid, reason], count)
            client.add_metric([sid, s.client_name], 1)
        yield from (promised_interval, promised_latency, chunks, drops, client)

    def _workers(self, workers: dict[str, tuple[WorkerSample, float | None]]) -> Iterator:
        busy_s = CounterMetricFamily(
            "physis_worker_busy_seconds", "Seconds the worker spent computing", labels=["worker"]
        )
        busy = GaugeMetricFamily(
            "physis_worker_busy_ratio",
            "Share of the time since the previous scrape the worker spent computing",
            labels=["worker"],
        )
        queued = GaugeMetricFamily(
            "physis_worker_queued_tasks", "Tasks waiting at the worker's stages", labels=["worker"]
        )
        for worker, (sample, fraction) in sorted(workers.items()):
            busy_s.add_metric([worker], sample.busy_s)
            if fraction is not None:
                busy.add_metric([worker], fraction)
            if sample.queued is not None:
                queued.add_metric([worker], sample.queued)
        yield from (busy_s, busy, queued)


def _labelled_counter(name: str, documentation: str, label: str, counts) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=[label])
    for key, count in sorted(counts.items()):
        family.add_metric([key], count)
    return family


class ServeMetrics:
    """The registry, the per-stream histograms, and the HTTP server that exposes them."""

    def __init__(
        self, frontend: Frontend, engine: StreamEngine, description: ServerDescription
    ) -> None:
        self.registry = CollectorRegistry()
        self.collector = ServeCollector(frontend, engine, description)
        self.registry.register(self.collector)
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, CPU, fds
        self.interval = Histogram(
            "physis_stream_interval_seconds",
            "Time between consecutive chunks of the stream leaving the pipeline",
            ["stream"],
            buckets=SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.response_latency = Histogram(
            "physis_stream_response_latency_seconds",
            "Observation handed to the engine -> the first chunk conditioned on it left",
            ["stream"],
            buckets=SECONDS_BUCKETS,
            registry=self.registry,
        )
        frontend.on_opened = self.stream_opened
        frontend.on_closed = self.stream_closed
        self._server = None

    def stream_opened(self, session: Session) -> None:
        sid = str(session.stream_id)
        interval, latency = self.interval.labels(sid), self.response_latency.labels(sid)

        def observe(interval_s: float | None, response_ms: float | None) -> None:
            if interval_s is not None:
                interval.observe(interval_s)
            if response_ms is not None:
                latency.observe(response_ms / 1e3)

        session.on_chunk = observe

    def stream_closed(self, session: Session) -> None:
        self.interval.remove(str(session.stream_id))
        self.response_latency.remove(str(session.stream_id))
        self.collector.stream_closed(session)

    def serve(self, host: str, port: int) -> int:
        """Serves /metrics on ``host:port`` (0: an ephemeral port) in a thread; the port."""
        self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return self._server.server_port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
