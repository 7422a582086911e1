"""The bridge with ``object_topic`` (an object tracker's positions, for push-wam's box_x,
box_y): each image goes with the tracked position stamped with it, as its object_position;
a NaN position is dropped and counted, and its image, with no object within the slop, is
not sent. Real topics in a real ROS process (helpers/object_bridge.py); the wire and the
server's side are test/link/test_link_units.py's and test/serve/test_serve_wam.py's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HELPER = str(Path(__file__).parent / "helpers" / "object_bridge.py")


@pytest.mark.ros
def test_each_image_goes_with_the_object_position_stamped_with_it(ros_env):
    child = subprocess.Popen(
        [sys.executable, HELPER], env=ros_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        out, err = child.communicate(timeout=300)
    finally:
        child.kill()
    assert child.returncode == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    sent = report["object_positions"]
    assert len(sent) == 2, report  # the NaN one's image was not sent
    np.testing.assert_allclose(sent, [[0.1, -0.2, 0.0], [0.3, -0.1, 0.05]], atol=1e-6)
    assert report["drops"].get("nan_object") == 1, report["drops"]
