"""Training the engine's model on recorded episodes (``physis-train``). Torch, never rclpy."""
