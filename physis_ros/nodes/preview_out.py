"""The bridge's previews (parameter ``previews``): a look at each chunk before it is done.

A stream opened with previews gets, after each denoising step k < K of a chunk, the chunk's
x0 estimate (``Prediction.preview_steps`` = k) before the chunk itself. ``PreviewOutput``
publishes each on ``predicted/preview/step_<k>`` (sensor_msgs/Image, one per frame, stamped at
the frame's predicted time like ``predicted/image``; the topic names the step) and measures
how much sooner than its chunk each step's preview came: the response latency a robot that
looks at previews gains (``/diagnostics``: ``preview_step_<k>_sooner_median_ms``).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
from sensor_msgs.msg import Image

from physis_ros.link.client import Prediction
from physis_ros.nodes import outputs
from physis_ros.nodes.conversions import fill_image_msg
from physis_ros.nodes.stats import RollingWindow

PENDING_CHUNKS = 64
"""Chunks whose previews wait for the chunk (older ones are forgotten: the chunk was lost)."""


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
            for j, frame in enumerate(np.asarray(pred.frames, dtype=np.uint8)):
                msg = Image()
                stamp = outputs.time_msg(start_ns + int(j * frame_dt_s * 1e9))
                fill_image_msg(msg, frame, stamp=stamp, frame_id=self.camera_frame)
                pub.publish(msg)
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
