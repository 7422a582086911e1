"""What the engine core asks of whatever runs the stages: an executor.

The core (``engine/core.py``) numbers and releases chunks and decodes what comes back; an
executor owns the workers that run the stages and moves activations between them. Two
implement it: worker threads in this process (``engine/threads.py``) and one torch.distributed
rank per device (``engine/ranks/executor.py``). Between them only plain values cross: a
``StreamOrder`` to open a stream on the workers, ``Activation``s released into the
pipeline, and ``(left_s, Activation)`` pairs that reached the sink.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from physis_ros.engine.api import StreamFailed
from physis_ros.engine.model import WanDiT
from physis_ros.engine.placement import Layout
from physis_ros.engine.transport import Activation

HISTORY_OF_MODE = {"pipelined": "noisy", "sequential-noisy": "noisy", "sequential-clean": "clean"}
"""The history the workers keep for a stream of each controller mode."""


@dataclass(frozen=True, kw_only=True)
class StreamOrder:
    """Open a stream on the workers: its stages' KV rings, where each stage runs."""

    stream_id: int
    seed: int
    """Seeds the noise of an observation taken noised (``context_noise``)."""
    cond: torch.Tensor | None
    """[n <= text_len, text_dim] prompt embedding (None: none)."""
    layout: Layout
    """Worker of each stage (K x L)."""
    history: str = "noisy"
    """``noisy`` or ``clean`` (``sequential-clean``)."""
    horizon: int = 0
    """Chunks ahead of the newest observation (sizes the KV rings: W + horizon)."""


class Executor(Protocol):
    """The workers behind the core (module docstring)."""

    model: WanDiT
    """The blocks this process holds: the core measures them and draws noise on its device."""
    default_layout: Layout
    """Where a stream opened without a layout runs."""

    @property
    def num_workers(self) -> int:
        """Workers a layout may name (0 .. num_workers - 1)."""

    def open_stream(self, order: StreamOrder) -> None:
        """Open the stream's stages on every worker that runs one."""

    def close_stream(self, stream_id: int) -> None:
        """Free the stream's KV rings; its activations still in flight are dropped."""

    def relayout(self, stream_id: int, *, epoch: int, first_ticket: int, layout: Layout) -> None:
        """From ``first_ticket`` on (placement epoch ``epoch``) the stream runs on ``layout``."""

    def send(self, dst: int, act: Activation) -> None:
        """Release a chunk into the pipeline at worker ``dst`` (its first stage's)."""

    def collect(self, timeout_s: float) -> list[tuple[float, Activation]]:
        """Chunks (and previews) that reached the sink: (time.monotonic() it left the last
        stage, activation); waits up to ``timeout_s`` for the first."""

    def failure(self) -> BaseException | None:
        """Why every stream has failed (a worker thread died), or None."""

    def take_stream_failures(self) -> list[StreamFailed]:
        """Streams failed since the last call, each naming its stream (a rank that held its
        stages died); the core closes them and tells their callers."""

    def impairment(self) -> str:
        """Why the executor cannot serve as configured ("" when it can)."""

    def shutdown(self) -> None:
        """Stop every worker and join every thread and process it started."""
