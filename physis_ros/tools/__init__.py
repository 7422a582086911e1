"""Command-line tools over the engine and the server: ``physis-sim`` (the pool simulator and
its experiments), ``physis-profile`` (per-block costs on a device or on gloo ranks),
``physis-embed`` (prompts -> prompt embeddings with a local text encoder), and in
``experiments/`` what ``physis-sim --experiment`` runs (pool24, depth, frontier, and the
simulator-vs-real checks ``realcheck`` and ``latencycheck``, which run the real
torch.distributed server).

They may import ``physis_ros.engine`` and ``physis_ros.serve``; the engine imports neither.
"""
