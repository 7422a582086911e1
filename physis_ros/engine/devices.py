"""The device a run asks for, checked before anything is built on it: a config that names a
device this machine lacks is refused by name, not by an assertion deep inside torch."""

from __future__ import annotations

import torch

from physis_ros.cli_errors import UsageError


def checked_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch.device that exists here; UsageError (a ValueError) otherwise."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise UsageError(
            f"device {device!r} is not a torch device ({exc})", "use cpu, cuda or cuda:N"
        ) from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(
                f"device {str(device)!r} asked for, but this machine has no usable CUDA device",
                "use device cpu (or auto), or run where a GPU and a CUDA build of torch are",
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise UsageError(
                f"device {str(device)!r} asked for, but this machine has {count} CUDA device(s)",
                f"use cuda:0 .. cuda:{count - 1}",
            )
    return dev
