"""physis_ros: large autoregressive denoising models in a robot's control loop.

Sub-packages and what each may import (DESIGN.md §5, enforced by test/test_boundaries.py):
  engine/  model, sampler, stages, scheduler, placement  - torch, never rclpy
  serve/   server process, workers, front end            - torch, never rclpy
  link/    wire protocol and robot-side client           - neither torch nor rclpy
  nodes/   ROS 2 nodes                                   - rclpy, never torch
  eval/    bag replay evaluation                         - no rclpy needed
"""

# The ROS build installs generated messages as physis_ros/msg in site-packages; when this
# source tree is also on sys.path (running from the repository root), extend the package
# path so that both `physis_ros.msg` and the source sub-packages resolve.
__path__ = __import__("pkgutil").extend_path(__path__, __name__)
