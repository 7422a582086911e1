"""Engine: the block-causal denoising model, its stages, KV caches, scheduler and placement.

Imports torch; never rclpy.
"""
