"""ROS 2 nodes: convert, enqueue, publish. Imports rclpy; never torch."""
