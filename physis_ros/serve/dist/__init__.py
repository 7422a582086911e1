"""The torch.distributed runtime of ``physis-serve``: one process per device under torchrun.

``launch`` (rank environment, programmatic launcher), ``transport`` (every point-to-point
call), ``runtime`` (configuration and the worker loop of ranks 1..N-1), ``placement`` (per-block
costs measured on the ranks, balanced layouts), ``engine`` (``DistEngine``, rank 0's
``StreamEngine``) and ``serve`` (the torchrun entry of ``physis-serve``).
"""
