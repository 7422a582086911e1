"""Wire protocol and the robot-side client. Imports neither torch nor rclpy."""
