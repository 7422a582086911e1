"""Helpers of the real checks (they live in ``physis_ros.tools.experiments.realcheck``,
``physis_ros.tools.gloo_calibration`` and ``physis_ros.engine.ranks.calibrate``), and
``python test/pool/realcheck.py [--ranks 1,2] [--streams 1,3]``: the sim-vs-real comparison
as JSON (same as ``physis-sim --experiment realcheck --json``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from physis_ros.engine.ranks.calibrate import K, W, run_free
from physis_ros.tools.experiments.realcheck import intervals_ms, profile_gloo, realcheck
from physis_ros.tools.gloo_calibration import runtime_config

__all__ = [
    "K",
    "W",
    "intervals_ms",
    "profile_gloo",
    "realcheck",
    "run_free",
    "runtime_config",
]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="1,2,3,4")
    ap.add_argument("--streams", default="1,2,3")
    ap.add_argument("--quiet-wait-s", type=float, default=10.0)
    args = ap.parse_args()
    ranks = tuple(map(int, args.ranks.split(",")))
    streams = tuple(map(int, args.streams.split(",")))
    print(json.dumps(realcheck(ranks, streams, quiet_wait_s=args.quiet_wait_s), indent=1))
