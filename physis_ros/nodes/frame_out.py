"""The bridge's predicted frames out: ``predicted/image``, ``predicted/side_by_side`` and the
previews.

Each frame of a prediction is stamped at the time the camera will capture the frame it
stands for (``frames_stamp_ns``), so a rollout's horizons and the camera's own frames line
up. ``predicted/side_by_side`` shows the observation a chunk answers beside its first frame.

Previews (parameter ``previews``): a stream opened with previews gets, after each denoising
step k < K of a chunk, the chunk's x0 estimate (``Prediction.preview_steps`` = k) before the
chunk itself. ``PreviewOutput`` publishes each on ``predicted/preview/step_<k>`` (one image
per frame, stamped like ``predicted/image``; the topic names the step) and measures how much
sooner than its chunk each step's preview came: the response latency a robot that looks at
previews gains (``/diagnostics``: ``preview_step_<k>_sooner_median_ms``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np
from sensor_msgs.msg import Image

from physis_ros.link.client import Prediction
from physis_ros.nodes import outputs
from physis_ros.nodes.conversions import ImageFields, fields_to_rgb, fill_image_msg, side_by_side
from physis_ros.nodes.stats import RollingWindow

PENDING_CHUNKS = 64
"""Chunks whose previews wait for the chunk (older ones are forgotten: the chunk was lost)."""


def frames_stamp_ns(pred: Prediction, frame_dt_s: float, fallback_ns: int) -> int:
    """When the camera will capture the first frame a prediction stands for: its anchor's
    capture stamp plus the frames between them; ``fallback_ns`` without an anchor."""
    if pred.observation_stamp_ns > 0 and pred.observation_seq >= 0 and pred.first_frame_seq >= 0:
        ahead = pred.first_frame_seq - pred.observation_seq
        return pred.observation_stamp_ns + int(ahead * frame_dt_s * 1e9)
    return fallback_ns


def publish_frames(pub, frames: np.ndarray, *, start_ns: int, frame_dt_s: float, frame_id: str):
    """One Image per frame [N, H, W, 3] uint8, frame j stamped start + j * frame_dt."""
    for j, frame in enumerate(frames):
        msg = Image()
        stamp = outputs.time_msg(start_ns + int(j * frame_dt_s * 1e9))
        fill_image_msg(msg, frame, stamp=stamp, frame_id=frame_id)
        pub.publish(msg)


class FrameOutput:
    """A chunk's frames on ``predicted/image`` and, beside the observation it answers (from
    ``observed_image``: the image sent as that observation), on ``predicted/side_by_side``."""

    def __init__(
        self,
        frames_pub,
        side_by_side_pub,
        *,
        camera_frame: str,
        side_by_side_height: int,
        observed_image: Callable[[int], ImageFields | None],
    ) -> None:
        self.frames_pub, self.side_by_side_pub = frames_pub, side_by_side_pub
        self.camera_frame = camera_frame
        self.side_by_side_height = side_by_side_height
        self.observed_image = observed_image
        self.published = 0
        """Frames published on ``predicted/image``."""

    def publish(self, pred: Prediction, start_ns: int, frame_dt_s: float) -> None:
        frames = np.asarray(pred.frames, dtype=np.uint8)
        publish_frames(
            self.frames_pub,
            frames,
            start_ns=start_ns,
            frame_dt_s=frame_dt_s,
            frame_id=self.camera_frame,
        )
        self.published += len(frames)
        observed = self.observed_image(pred.observation_seq)
        msg = Image()
        fill_image_msg(
            msg,
            side_by_side(
                fields_to_rgb(observed) if observed is not None else None,
                frames[0],
                height=self.side_by_side_height,
            ),
            stamp=outputs.time_msg(start_ns),
            frame_id=self.camera_frame,
        )
        self.side_by_side_pub.publish(msg)


class PreviewOutput:
    def __init__(self, node, qos, camera_frame: str) -> None:
        self.node, self.qos, self.camera_frame = node, qos, camera_frame
        self.publishers: dict[int, object] = {}
        self.pending: OrderedDict[tuple[int, int], dict[int, int]] = OrderedDict()
        """(stream, chunk) -> step -> when its preview was received (ns, robot clock)."""
        self.sooner_ms: dict[int, RollingWindow] = {}
        self.published = 0

    def publish(self, pred: Prediction, start_ns: int, frame_dt_s: float) -> None:
        """Publish one preview (receive thread); remember when it came."""
        k = pred.preview_steps
        pub = self.publishers.get(k)
        if pub is None:
            pub = self.node.create_publisher(Image, f"predicted/preview/step_{k}", self.qos)
            self.publishers[k] = pub
        if pred.frames is not None:
            publish_frames(
                pub,
                np.asarray(pred.frames, dtype=np.uint8),
                start_ns=start_ns,
                frame_dt_s=frame_dt_s,
                frame_id=self.camera_frame,
            )
        # a slot's version: with rollouts one slot is generated again from each observation
        version = (pred.stream_id, pred.anchor_slot, pred.chunk_index)
        self.pending.setdefault(version, {})[k] = pred.received_ns
        while len(self.pending) > PENDING_CHUNKS:
            self.pending.popitem(last=False)
        self.published += 1

    def on_chunk(self, pred: Prediction) -> None:
        """The chunk itself came: how much sooner each of its previews was."""
        got = self.pending.pop((pred.stream_id, pred.anchor_slot, pred.chunk_index), None)
        for k, received_ns in (got or {}).items():
            window = self.sooner_ms.setdefault(k, RollingWindow())
            window.add((pred.received_ns - received_ns) / 1e6)

    def values(self) -> dict[str, float | int]:
        """For /diagnostics (the output status)."""
        out: dict[str, float | int] = {"previews_published": self.published}
        for k, window in sorted(self.sooner_ms.items()):
            out[f"preview_step_{k}_sooner_median_ms"] = window.summary()["median"]
        return out
