"""The torch.distributed executor: one process per device under torchrun.

``launch`` (rank environment, programmatic launcher), ``transport`` (every point-to-point
call), ``runtime`` (configuration and the worker loop of ranks 1..N-1), ``placement`` (per-block
costs measured on the ranks, balanced layouts), ``calibrate`` (the job's start-up profile) and
``engine`` (rank 0's side of the job).
"""
