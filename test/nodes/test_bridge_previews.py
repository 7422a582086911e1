"""The bridge with previews (parameter ``previews``), with real processes: physis-serve (tiny,
CPU, K = 4), sim_robot and the bridge on an isolated ROS domain. Each chunk's x0 estimates
after steps 1..3 come out on predicted/preview/step_<k> (images of the chunk's frames) before
the chunk; /diagnostics says how much sooner each step's preview came; the chunks themselves
still drive the actions."""

from __future__ import annotations

import pytest

from physis_testing import adopt_discovery_env, reserved_ros_domain, restore_env

pytestmark = [pytest.mark.ros, pytest.mark.slow]
STEPS = ("1", "2", "3")


def test_previews_are_published_per_step_before_their_chunks(tmp_path):

    from physis_ros.nodes.monitor import Monitor, diagnostics_by_name
    from physis_ros.nodes.system import LocalSystem

    with reserved_ros_domain() as domain_id:
        loop = LocalSystem(domain_id=domain_id, log_dir=str(tmp_path))
        saved = adopt_discovery_env(loop.env)
        topics = [f"predicted/preview/step_{k}" for k in STEPS]
        monitor = Monitor(
            domain_id=domain_id, keep=("action_chunk", "/diagnostics", *topics), images=topics
        )
        try:
            loop.start_server()
            loop.start_sim_robot()
            loop.start_bridge(target_interval_ms=200.0, previews=True)
            assert monitor.wait_for(
                lambda: (
                    all(monitor.count(t) >= 5 for t in topics)
                    and monitor.count("action_chunk") >= 5
                ),
                timeout_s=60,
            ), ({t: monitor.count(t) for t in (*topics, "action_chunk")}, loop.log_dir)
            for t in topics:
                assert monitor.published_types(t) == {"sensor_msgs/msg/Image"}, t
                frame = monitor.get(t)
                assert (frame.height, frame.width, frame.encoding) == (16, 16, "rgb8")

            def sooner() -> dict[str, float]:
                diagnostics = monitor.get("/diagnostics")
                if diagnostics is None:
                    return {}
                values = diagnostics_by_name(diagnostics)["bridge: output"][2]
                return {
                    k: float(values[f"preview_step_{k}_sooner_median_ms"])
                    for k in STEPS
                    if f"preview_step_{k}_sooner_median_ms" in values
                }

            assert monitor.wait_for(
                lambda: len(sooner()) == 3 and all(v > 0 for v in sooner().values()),
                timeout_s=30,
            ), sooner()
            ms = sooner()
            assert ms["1"] > ms["2"] > ms["3"] > 0, ms  # earlier steps come sooner
        finally:
            monitor.close()
            codes = loop.stop()
            restore_env(saved)
        assert all(code == 0 for code in codes.values()), codes
