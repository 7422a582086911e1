"""Bag replay evaluation, metrics and reports. Needs no rclpy."""
