"""``physis-bench ros``: the bridge node under camera-rate load, with the real server.

A feed process publishes 640x480 rgb8 images at 30 Hz with wrench and joint states at 100 Hz
(sensor-data QoS, config/fastdds.xml); the bridge pairs, downsizes to the model's image size
and sends them to physis-serve (tiny, CPU); a monitor reads the bridge's PipelineStats.
Reports, as JSON: images the node dropped after the warm-up (``dropped``: its own drop
reasons; ``dropped_total`` with the warm-up) and lost
between processes (``dds_lost``), the newest-wins drops of the link (by design: the server
takes one observation per chunk), and median/p99 of observation-callback -> handed to the
link client (``obs_to_send_ms_*``) and prediction-received -> all its messages published
(``receive_to_publish_ms_*``), over the bridge's last 200 samples, all after the warm-up.

    physis-bench ros --json [--duration-s 20] [--warmup-s 5] [--target-interval-ms 100]
    python -m physis_ros.bench.ros --feed   (the feed process alone)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

from physis_ros.cli_errors import finite_float
from physis_ros.nodes.conversions import fill_image_msg
from physis_ros.nodes.system import LocalSystem


def feed_main(rate_hz: float, state_rate_hz: float, height: int, width: int) -> int:
    """Publishes synthetic camera/wrench/joint messages until SIGINT; prints the counts."""
    # ROS (rclpy and the message packages) is optional on a workstation: only the feed
    # process and the monitor load it, so ``physis-bench ros --help`` answers without it.
    from geometry_msgs.msg import WrenchStamped
    from rclpy.node import Node
    from rclpy.qos import qos_profile_sensor_data
    from sensor_msgs.msg import Image, JointState

    from physis_ros.nodes.run import run_node

    class Feed(Node):
        def __init__(self) -> None:
            super().__init__("bench_feed")
            rng = np.random.default_rng(0)
            self.images = []
            for _ in range(
                4
            ):  # a few distinct frames, built once (the feed must not be the bottleneck)
                msg = Image()
                pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
                fill_image_msg(
                    msg, pixels, stamp=self.get_clock().now().to_msg(), frame_id="camera"
                )
                self.images.append(msg)
            self.image_pub = self.create_publisher(Image, "camera/image", qos_profile_sensor_data)
            self.wrench_pub = self.create_publisher(
                WrenchStamped, "wrench", qos_profile_sensor_data
            )
            self.joints_pub = self.create_publisher(
                JointState, "joint_states", qos_profile_sensor_data
            )
            self.published = {"images": 0, "states": 0}
            self.create_timer(1.0 / rate_hz, self._on_image)
            self.create_timer(1.0 / state_rate_hz, self._on_state)

        def _on_image(self) -> None:
            # start once the bridge listens: images published before discovery completes are
            # lost by design of best effort and would be counted as transport losses
            if self.published["images"] == 0 and self.image_pub.get_subscription_count() == 0:
                return
            msg = self.images[self.published["images"] % len(self.images)]
            msg.header.stamp = self.get_clock().now().to_msg()
            self.image_pub.publish(msg)
            self.published["images"] += 1

        def _on_state(self) -> None:
            if self.published["images"] == 0:
                return
            stamp = self.get_clock().now().to_msg()
            wrench = WrenchStamped()
            wrench.header.stamp = stamp
            wrench.wrench.force.x = 1.0
            self.wrench_pub.publish(wrench)
            joints = JointState()
            joints.header.stamp = stamp
            joints.name = ["shoulder", "elbow"]
            joints.position = [1.0, 0.5]
            self.joints_pub.publish(joints)
            self.published["states"] += 1

        def shutdown(self) -> None:
            print(json.dumps(self.published), flush=True)

    return run_node(Feed)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench(args) -> dict:
    from physis_ros.nodes.monitor import Monitor  # rclpy: optional, as in feed_main

    domain_id = args.domain_id or int(os.environ.get("ROS_DOMAIN_ID") or random.randint(150, 199))
    loop = LocalSystem(domain_id=domain_id, log_dir=args.log_dir)
    os.environ.update(
        {k: loop.env[k] for k in ("ROS_AUTOMATIC_DISCOVERY_RANGE", "FASTDDS_DEFAULT_PROFILES_FILE")}
    )
    monitor = None
    try:
        loop.start_server()
        monitor = Monitor(domain_id=domain_id)
        loop.start_bridge(target_interval_ms=args.target_interval_ms)
        loop.start_module(
            "feed",
            "physis_ros.bench.ros",
            ["--feed", "--rate-hz", str(args.rate_hz), "--height", str(args.height),
             "--width", str(args.width)],
        )  # fmt: skip

        def streaming() -> bool:
            stats = monitor.get("pipeline_stats")
            return stats is not None and stats.chunks_published > 0

        if not monitor.wait_for(streaming, timeout_s=60):
            raise RuntimeError(f"the bridge published no chunk; logs in {loop.log_dir}")
        time.sleep(args.warmup_s)
        bridge_pid = loop.procs["bridge"].pid
        cpu0, wall0 = _cpu_s(bridge_pid), time.monotonic()
        start = monitor.get("pipeline_stats")
        time.sleep(args.duration_s)
        cpu1, wall1 = _cpu_s(bridge_pid), time.monotonic()
        # stop the feed first and let its last images arrive, then read the final counts
        loop.stop_one("feed")
        time.sleep(args.stats_period_s + 0.5)
        end = monitor.get("pipeline_stats")
    finally:
        if monitor is not None:
            monitor.close()
        codes = loop.stop()
    feed_log = (loop.log_dir / "feed.log").read_text().strip().splitlines()
    published = json.loads(feed_log[-1])["images"]
    drops_end = dict(zip(end.drop_reasons, end.drop_counts, strict=True))
    drops_start = dict(zip(start.drop_reasons, start.drop_counts, strict=True))
    node_drops = {k: v for k, v in drops_end.items() if not k.startswith("link:")}
    link_drops = {k: v for k, v in drops_end.items() if k.startswith("link:")}
    return {
        "bench": "ros",
        "input": f"{args.width}x{args.height} rgb8 at {args.rate_hz:g} Hz + wrench/joints 100 Hz",
        "model": end.model,
        "duration_s": args.duration_s,
        "warmup_s": args.warmup_s,
        "images_published": published,
        "images_received": end.images_received,
        "dds_lost": published - end.images_received,
        # images the node itself dropped in the measured window (after warm-up), and in all
        "dropped": sum(node_drops.values())
        - sum(v for k, v in drops_start.items() if not k.startswith("link:")),
        "dropped_total": sum(node_drops.values()),
        "dropped_by_reason": node_drops,
        "link_newest_wins_drops": link_drops,
        "observations_sent": end.observations_sent,
        "obs_to_send_ms_median": round(end.obs_to_send_median_ms, 3),
        "obs_to_send_ms_p99": round(end.obs_to_send_p99_ms, 3),
        "receive_to_publish_ms_median": round(end.receive_to_publish_median_ms, 3),
        "receive_to_publish_ms_p99": round(end.receive_to_publish_p99_ms, 3),
        "latency_samples": "bridge's last 200 per quantity, all after warm-up",
        "interval_median_ms": round(end.interval_median_ms, 2),
        "target_interval_ms": args.target_interval_ms,
        "chunks_published": end.chunks_published,
        "bridge_cpu_percent": round(100 * (cpu1 - cpu0) / (wall1 - wall0), 1),
        "children_exit_codes": codes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="physis-bench ros", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON result")
    parser.add_argument(
        "--duration-s", type=finite_float, default=20.0, help="measured time after warm-up"
    )
    parser.add_argument(
        "--warmup-s", type=finite_float, default=5.0, help="excluded from the latencies"
    )
    parser.add_argument("--rate-hz", type=finite_float, default=30.0, help="camera rate")
    parser.add_argument("--height", type=int, default=480, help="camera height")
    parser.add_argument("--width", type=int, default=640, help="camera width")
    parser.add_argument(
        "--target-interval-ms", type=finite_float, default=100.0, help="server pacing"
    )
    parser.add_argument(
        "--domain-id", type=int, default=None, help="ROS_DOMAIN_ID (default random)"
    )
    parser.add_argument("--log-dir", default=None, help="child logs (default: a temp dir)")
    parser.add_argument("--feed", action="store_true", help="run only the feed publisher")
    args = parser.parse_args(argv)
    args.stats_period_s = 1.0
    for name in ("duration_s", "rate_hz", "height", "width"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.feed:
        return feed_main(args.rate_hz, 100.0, args.height, args.width)
    result = bench(args)
    print(json.dumps(result, indent=None if args.json else 2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
