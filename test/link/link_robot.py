"""Test helper, run as a child process: a robot that streams to physis-serve until killed.

Usage: python link_robot.py TARGET READY_FILE
Writes READY_FILE once it has received a prediction.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from physis_ros.link.client import LinkClient, Observation
from physis_ros.link.wire import rgb_image


def main() -> int:
    target, ready = sys.argv[1], Path(sys.argv[2])
    client = LinkClient(target, client_name="robot-child", connect_timeout_s=10)
    client.start()
    seq = 0
    while True:
        stats = client.stats()
        if stats.promise is not None:
            frame = np.zeros((stats.promise.image_height, stats.promise.image_width, 3), np.uint8)
            client.send_observation(
                Observation(seq=seq, capture_stamp_ns=time.time_ns(), image=rgb_image(frame))
            )
            seq += 1
        if client.get_prediction(0.05) is not None and not ready.exists():
            ready.write_text("streaming\n")


if __name__ == "__main__":
    sys.exit(main())
