"""The simulated demo scene (numpy only) and a headless episode recorder (rosbags, no rclpy)."""
