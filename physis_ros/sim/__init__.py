"""The simulated tasks by name (numpy only: ``push`` and ``reach``, their scenes, scripted
experts and episodes) and a headless episode recorder (rosbags, no rclpy)."""
