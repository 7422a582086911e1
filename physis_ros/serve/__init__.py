"""Server process: workers, torch.distributed transport, front end. Imports torch; never rclpy."""
