"""What the server front end asks of an engine, whatever runs underneath.

The front end (physis_ros.serve) opens streams, feeds observations and generation
requests, and collects decoded chunks. An in-process engine, the torch.distributed
runtime and the shared pool all implement ``StreamEngine``. Images cross this boundary as
uint8 numpy arrays, actions as float32 numpy arrays: no torch in the caller's hands.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

DEFAULT_HORIZON = 1
"""Chunks ahead of its newest observation a served (live) stream predicts when neither the
client nor the model's weights (metadata ``horizon``) say."""


@dataclass(frozen=True, kw_only=True)
class StreamSpec:
    """What a client asks for when it opens a stream."""

    seed: int = 0
    """Seeds the initial noise of chunk c as (seed, c)."""
    target_interval_ms: float = 0.0
    """Interval the client needs between chunks; 0: as fast as the pool allows."""
    prompt: str = ""
    """Name of a prompt embedding the server holds ("": the model's empty prompt)."""
    prompt_embedding: np.ndarray | None = None
    """Or the embedding itself: [n <= text_len, text_dim] float32/float16 (not with ``prompt``)."""
    task: dict[str, float] = field(default_factory=dict)
    """The task's parameters by the names the model's contract gives them (a world-action
    model's: its task state inputs and a ``task_features`` prompt are made of them)."""
    response_latency_budget_ms: float = 0.0
    """Most response latency the client accepts (an observation in to the first chunk
    conditioned on it out); 0: no budget. A pool that cannot meet it refuses the stream."""
    horizon: int | None = None
    """Chunks ahead of its newest observation the stream may generate (the live timeline,
    DESIGN.md §3.1); None: the engine's default (the model's); 0: no limit, and observations
    then only take new slots (offline generation)."""
    previews: bool = False
    """After each denoising step k < K, also deliver the chunk's x0 estimate, decoded
    (``ChunkOutput.preview_steps`` = k): a look at the chunk one step-time sooner."""
    rollouts: bool = False
    """Every observation generates all slots up to its horizon again (a rollout: each
    horizon 1..h anchored on the newest observation, h chunks through the pipeline per
    observation, overlapping there); False: each observation generates only the slot h
    ahead of it. Needs a horizon and a codec that decodes each chunk on its own."""


@dataclass(frozen=True, kw_only=True)
class StreamPromise:
    """What the engine promises an admitted stream."""

    stream_id: int
    model: str
    steps: int
    blocks: int
    expected_interval_ms: float
    pipeline_depth: int
    """Chunks in flight at once in steady state."""
    expected_response_latency_ms: float
    chunk_frames: int
    """Camera frames per chunk (decoded output frames)."""
    image_height: int
    image_width: int
    action_horizon: int
    action_dim: int
    """Values per action the stream sends (condition models) or gets (predict models)."""
    horizon: int = 0
    """Chunks ahead of its newest observation the stream generates (0: no limit)."""
    action_mode: str = "none"
    """The model's: ``none``/``condition`` (a world model: frames only) or ``predict`` (a
    world-action model: its chunks carry actions)."""
    target_interval_ms: float = 0.0
    """The interval the stream is paced at: what it asked for, or the pool's default target
    when it asked for 0; 0: not paced (an engine without admission, as fast as it goes)."""
    revision: int = 0
    """0 at admission; +1 each time the promise is revised (another stream joined or left)."""
    rollouts: bool = False
    """Each observation generates the whole horizon again (``StreamSpec.rollouts``); the
    interval is then between rollouts, the response latency that of a rollout's first chunk."""
    contract: str = ""
    """A world-action model's contract (its JSON: what each observation must carry by name);
    "" for a world model."""


def check_rollouts(spec: StreamSpec, horizon: int) -> None:
    """Rollouts generate up to the horizon again: a stream without one has none to redo."""
    if spec.rollouts and horizon < 1:
        raise ValueError(f"rollouts need a horizon >= 1, the stream has {horizon}")


class AdmissionRefused(Exception):
    """The pool cannot take the stream; ``resource`` ran out by ``shortfall`` (with unit)."""

    def __init__(self, reason: str, *, resource: str, shortfall: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.resource = resource
        self.shortfall = shortfall


class StreamFailed(Exception):
    """A stream can no longer run (e.g. a worker rank died); says which and why."""


@dataclass(frozen=True, kw_only=True)
class ChunkOutput:
    """One generated chunk, decoded."""

    stream_id: int
    chunk: int
    """Its time slot: it predicts camera frames [chunk*F, (chunk+1)*F) of the stream."""
    frames: np.ndarray | None
    """[F, H, W, 3] uint8 predicted camera frames (None for an action-only model)."""
    actions: np.ndarray | None
    """[H, A] float32 predicted actions (None when the model predicts none)."""
    entered_s: float
    """time.monotonic() when the chunk entered the pipeline."""
    left_s: float
    """time.monotonic() when it left the last stage."""
    decoded_s: float
    """time.monotonic() when decoding finished."""
    finite: bool = True
    """False when the model's output (the chunk's latent and actions) held NaN or inf: its
    frames and actions mean nothing, and the server never publishes it."""
    state: np.ndarray | None = None
    """[F, S] float32 predicted proprioception per frame (models with state values)."""
    anchor: int = -1
    """The newest observed slot when it entered (-1: none): it is chunk - anchor ahead."""
    preview_steps: int = 0
    """0: the chunk; k (1..K-1): a preview, its x0 estimate after k of K denoising steps
    (streams opened with ``previews``), delivered before the chunk."""

    @property
    def horizon(self) -> int:
        """Chunks ahead of its anchor (0: no anchor); with rollouts 1 is a rollout's first."""
        return self.chunk - self.anchor if self.anchor >= 0 else 0


class StreamEngine(Protocol):
    """The engine as the server front end sees it."""

    def open_stream(self, spec: StreamSpec) -> StreamPromise:
        """Admit a stream or raise AdmissionRefused."""

    def close_stream(self, stream_id: int) -> None:
        """Free the stream's KV slots; outputs still in flight are dropped."""

    def submit_context(
        self,
        stream_id: int,
        frames: np.ndarray,
        actions: np.ndarray | None = None,
        state: np.ndarray | None = None,
        *,
        slot: int | None = None,
    ) -> int:
        """Queue the observation of ``slot`` (None: the next new one; with a horizon, one
        already generated is replaced in the history of every chunk queued after it):
        frames [F, H, W, 3] uint8, F <= chunk_frames (the newest frame is repeated to fill),
        ``actions`` [H, A] the commanded actions it carries (a model with committed actions:
        NaN rows are unknown), ``state`` [F, S] the proprioception at each frame, for a model
        with state values. Returns its slot."""

    def submit_generate(
        self, stream_id: int, actions: np.ndarray | None = None, *, slot: int | None = None
    ) -> int:
        """Queue a chunk to generate for ``slot`` (None: the next new slot; a slot after the
        newest observed one that was generated before is generated again: a rollout from
        each observation), anchored at the newest observed one: ``actions`` [H, A]
        conditions a world model; for a world-action model with committed actions they are
        the rows the robot has committed (NaN rows: to generate). Returns its slot;
        ValueError when it would lie beyond the stream's horizon."""

    def next_slot(self, stream_id: int) -> int:
        """The slot the stream's next generated chunk (or new observation) takes."""

    def poll(self, timeout_s: float) -> list[ChunkOutput]:
        """Generated chunks that finished, in per-stream chunk order; waits up to timeout_s."""

    def shutdown(self) -> None:
        """Stop every worker and free resources."""
