"""Copies between host and device that never make the worker's thread wait for the GPU.

A plain ``tensor.to("cuda")`` from pageable memory, or ``tensor.cpu()`` of a CUDA tensor, waits
until everything queued on the compute stream is done: on a worker's hot path that drains the
GPU's queue once per call, and the GPU then idles while Python refills it. Here:

- ``to_device``: host -> device through pinned memory, asynchronous (the copy is ordered on the
  current stream; the caching host allocator keeps the pinned buffer until it is done).
- ``HostCopier``: device -> host on its own stream into pinned memory. The copy starts once the
  compute stream reaches the point where it was asked for (an event), overlaps later compute,
  and a thread hands the finished host tensors on; the compute stream never waits for it.
On the CPU both are plain copies, done at once.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` (host) on ``device``; on CUDA without a host synchronisation."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def copy_to_host_async(
    tensors: list[torch.Tensor], stream: torch.cuda.Stream
) -> tuple[list[torch.Tensor], torch.cuda.Event]:
    """Copy CUDA ``tensors`` (written by work queued so far on the current stream) to new
    pinned host tensors on ``stream``. Returns them and the event that marks the copy done;
    nothing waits here."""
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        stream.wait_event(ready)
        outs = []
        for t in tensors:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            # the allocator must not hand t's memory to compute before the copy has read it
            t.record_stream(stream)
            outs.append(host)
        done = torch.cuda.Event()
        done.record(stream)
    return outs, done


def copy_to_device_sync(
    tensors: list[torch.Tensor], device: torch.device, stream: torch.cuda.Stream
) -> list[torch.Tensor]:
    """Pinned host ``tensors`` -> new tensors on ``device``, copied on ``stream`` (not behind the
    compute queued on the default stream); returns once these copies, and only they, are
    done. The results may be used on the default stream."""
    with torch.cuda.stream(stream):
        outs = [t.to(device, non_blocking=True) for t in tensors]
        done = torch.cuda.Event()
        done.record(stream)
    done.synchronize()
    compute = torch.cuda.default_stream(device)
    for t in outs:
        t.record_stream(compute)  # allocated on ``stream``, read by compute
    return outs


class HostCopier:
    """Device -> host copies on a side stream of ``device``; ``deliver(host_tensors)`` runs on
    the copier's own thread once the copy has landed, in the order the copies were asked for."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"HostCopier copies from a CUDA device, not {self.device}")
        self.stream = torch.cuda.Stream(self.device)
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="host-copier", daemon=True)
        self._thread.start()
        self.error: BaseException | None = None
        """The first exception a ``deliver`` raised (the copier stops then)."""

    def copy(
        self, tensors: list[torch.Tensor], deliver: Callable[[list[torch.Tensor]], None]
    ) -> None:
        """Start copying ``tensors`` (on ``device``, written by work already queued on the
        current stream) to pinned host memory; returns at once."""
        if self.error is not None:
            raise RuntimeError("the host copier stopped") from self.error
        outs, done = copy_to_host_async(tensors, self.stream)
        self._todo.put((done, outs, deliver))

    def close(self, *, wait: bool = True) -> None:
        """Stop the copier's thread after the copies asked for so far."""
        self._todo.put(None)
        if wait:
            self._thread.join(timeout=10.0)

    def _loop(self) -> None:
        while True:
            item = self._todo.get()
            if item is None:
                return
            done, outs, deliver = item
            done.synchronize()  # this copy only: not the compute queued after it
            try:
                deliver(outs)
            except BaseException as err:  # noqa: BLE001 - kept and raised by the next copy()
                self.error = err
                return
