"""Many streams on one device pool: cost and memory models, admission control, simulator.

Pure Python on top of ``physis_ros.engine.config`` (no torch import here): the analytic side
runs anywhere. ``physis-profile`` (``profile_cli``) is the one part that runs the engine's
model to measure per-block times on the actual device.
"""
