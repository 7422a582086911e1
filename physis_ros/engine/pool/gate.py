"""Admission in front of a running engine (rank 0): admit, place, then open the stream.

``AdmittedEngine`` wraps any engine whose ``open_stream(spec, layout=...)`` takes an explicit
K x L layout of ranks (the engine core over torch.distributed ranks, for one). A stream's
``StreamSpec.target_interval_ms`` and ``response_latency_budget_ms`` go to the
``AdmissionController``; an admitted plan becomes
the layout (device d = rank d), a refusal is raised before the engine hears of the stream.
Closing a stream frees its slots in the controller.
"""

from __future__ import annotations

from typing import Protocol

from physis_ros.engine.api import StreamPromise, StreamSpec
from physis_ros.engine.config import ModelConfig, SamplerConfig
from physis_ros.engine.pool.admission import AdmissionController
from physis_ros.engine.pool.plan import StreamPlan
from physis_ros.engine.pool.terms import Admission, StreamRequest


class LayoutEngine(Protocol):
    def open_stream(self, spec: StreamSpec, *, layout) -> StreamPromise: ...

    def close_stream(self, stream_id: int) -> None: ...


def plan_layout(plan: StreamPlan) -> tuple[tuple[int, ...], ...]:
    """The engine's layout[k][l] = rank of stage (k, l)."""
    L = plan.model.num_blocks
    sd = plan.stage_devices
    return tuple(tuple(sd[k * L : (k + 1) * L]) for k in range(plan.sampler.steps))


class AdmittedEngine:
    """Admission control on rank 0 in front of an engine; stream ids are the engine's."""

    def __init__(
        self,
        engine: LayoutEngine,
        controller: AdmissionController,
        model: ModelConfig,
        sampler: SamplerConfig,
    ) -> None:
        self.engine = engine
        self.controller = controller
        self.model = model
        self.sampler = sampler
        self.admissions: dict[int, Admission] = {}
        """Engine stream id -> what admission promised."""
        self._pool_ids: dict[int, int] = {}

    def open_stream(self, spec: StreamSpec, **engine_kw) -> tuple[StreamPromise, Admission]:
        """Admit (or raise ``AdmissionRefused``), then open on the engine with the plan."""
        request = StreamRequest(
            model=self.model,
            sampler=self.sampler,
            target_interval_ms=spec.target_interval_ms,
            latency_budget_ms=spec.response_latency_budget_ms,
        )
        admission = self.controller.admit(request)
        try:
            promise = self.engine.open_stream(spec, layout=plan_layout(admission.plan), **engine_kw)
        except BaseException:
            self.controller.close(admission.plan.stream_id)
            raise
        self.admissions[promise.stream_id] = admission
        self._pool_ids[promise.stream_id] = admission.plan.stream_id
        return promise, admission

    def close_stream(self, stream_id: int) -> None:
        if stream_id not in self._pool_ids:
            raise ValueError(f"stream {stream_id} was not opened through admission")
        self.engine.close_stream(stream_id)
        self.controller.close(self._pool_ids.pop(stream_id))
        del self.admissions[stream_id]
