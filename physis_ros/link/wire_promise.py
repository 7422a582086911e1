"""The stream's terms on the wire: the promise the server makes a stream (and revises) as
the robot receives it, and the ticket that lets the stream's opener resume it after its call
broke. The wire's messages themselves: ``link/wire.py``. numpy + protobuf only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from physis_ros.link.proto_gen import physis_pb2 as pb
from physis_ros.link.wire import (
    PROTOCOL_VERSION,
    RESUME_TOKEN_METADATA_KEY,
    STREAM_ID_METADATA_KEY,
)

# ---- the promise ----------------------------------------------------------------------------

_PROMISE_FIELDS = (
    "stream_id",
    "model",
    "steps",
    "blocks",
    "expected_interval_ms",
    "pipeline_depth",
    "expected_response_latency_ms",
    "chunk_frames",
    "image_height",
    "image_width",
    "action_horizon",
    "action_dim",
    "target_interval_ms",
    "revision",
    "horizon",
    "action_mode",
    "rollouts",
    "contract",
)
"""The fields of the engine's promise that cross the wire unchanged (StreamPromise ->
pb.StreamPromise -> LinkPromise)."""


@dataclass(frozen=True, kw_only=True)
class LinkPromise:
    """What the server promised a stream, as the robot receives it (from OpenStream; revised
    by the server when other streams join or leave)."""

    stream_id: int
    model: str
    steps: int
    blocks: int
    expected_interval_ms: float
    pipeline_depth: int
    expected_response_latency_ms: float
    chunk_frames: int
    image_height: int
    image_width: int
    action_horizon: int
    action_dim: int
    max_observation_bytes: int
    target_interval_ms: float = 0.0
    """The interval the server paces the stream at (0: unpaced)."""
    revision: int = 0
    """0: the promise made at OpenStream; n: its n-th revision."""
    horizon: int = 0
    """Chunks ahead of its newest observation the stream predicts."""
    action_mode: str = ""
    """none / condition: a world model (frames only); predict: a world-action model (its
    chunks carry actions); empty: the server did not say."""
    rollouts: bool = False
    """Every observation generates the whole horizon again: predictions come in rollouts
    (horizons 1..h on one anchor), the interval is between rollouts."""
    contract: str = ""
    """A world-action model's contract (JSON, ``contract.model.WamContract.from_json``):
    what each observation must carry by name; "" for a world model."""


def promise_to_proto(promise: Any, out: pb.StreamPromise, *, max_observation_bytes: int) -> None:
    """The engine's promise (its ``StreamPromise``) as the wire carries it."""
    for name in _PROMISE_FIELDS:
        setattr(out, name, getattr(promise, name))
    out.max_observation_bytes = max_observation_bytes


def promise_from_proto(
    p: pb.StreamPromise, *, max_observation_bytes: int | None = None
) -> LinkPromise:
    """A promise off the wire (``max_observation_bytes``: the limit OpenStream gave, which a
    revised promise keeps)."""
    return LinkPromise(
        **{name: getattr(p, name) for name in _PROMISE_FIELDS},
        max_observation_bytes=(
            p.max_observation_bytes if max_observation_bytes is None else max_observation_bytes
        ),
    )


def serialize_promise(promise: Any, *, max_observation_bytes: int) -> bytes:
    """A revised promise for the stream's client."""
    msg = pb.ServerMessage(protocol_version=PROTOCOL_VERSION)
    promise_to_proto(promise, msg.promise, max_observation_bytes=max_observation_bytes)
    return msg.SerializeToString()


# ---- resuming a stream ------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ResumeTicket:
    """What lets the opener of a stream re-attach to it after its Stream call broke."""

    stream_id: int
    token: str
    """The stream's resume token (the opener's alone: never logged, never sent elsewhere)."""
    grace_s: float
    """How long the server holds the stream after its call ended."""

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The Stream call's metadata that names the stream and proves it is the opener's."""
        return (
            (STREAM_ID_METADATA_KEY, str(self.stream_id)),
            (RESUME_TOKEN_METADATA_KEY, self.token),
        )


def resume_to_reply(reply: pb.OpenStreamReply, *, token: str, grace_s: float) -> None:
    """A resumable stream's token and the grace the server holds it for, in its reply."""
    reply.resume_token = token
    reply.resume_grace_s = grace_s


def resume_from_reply(reply: pb.OpenStreamReply) -> ResumeTicket | None:
    """The stream's resume ticket (None: the server will not hold it once its call ends)."""
    if not reply.resume_token or not reply.resume_grace_s > 0:
        return None
    return ResumeTicket(
        stream_id=reply.promise.stream_id,
        token=reply.resume_token,
        grace_s=reply.resume_grace_s,
    )
