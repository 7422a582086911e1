"""The fixed experiments of ``physis-sim --experiment``: ``pool24`` (static against shared on
24 modelled H200s), ``depth`` (one stream, one stage per GPU), ``frontier`` (interval against
response latency and devices per stream; ``frontier_plot`` draws it), and the checks against
the real torch.distributed runtime on gloo ranks (``realcheck``, ``latencycheck``).

They use ``physis_ros.engine`` (the pool's models, admission and simulator) and
``physis_ros.serve``; nothing in the engine imports them.
"""
