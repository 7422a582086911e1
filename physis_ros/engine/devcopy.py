"""Copies between host and device that never make the worker's thread wait for the GPU.

A plain ``tensor.to("cuda")`` from pageable memory, or ``tensor.cpu()`` of a CUDA tensor, waits
until everything queued on the compute stream is done: on a worker's hot path that drains the
GPU's queue once per call, and the GPU then idles while Python refills it. Here:

- ``to_device``: host -> device through pinned memory, asynchronous (the copy is ordered on the
  current stream; the caching host allocator keeps the pinned buffer until it is done).
- ``HostCopier``: device -> host on its own stream into pinned memory. The copy starts once the
  compute stream reaches the point where it was asked for (an event), overlaps later compute,
  and a thread hands the finished host tensors on; the compute stream never waits for it.
On the CPU both are plain copies, done at once (a CPU ``HostCopier`` still delivers on its
thread: its lifecycle is tested there).

Every ``HostCopier`` thread ends before the interpreter finalises: ``close()`` (the worker's
``close``), else an ``atexit`` hook that closes and joins every live copier. A daemon thread
still inside a torch call that released the GIL (``Event.synchronize``) when Python finalises
is ended by ``pthread_exit`` inside a C++ destructor, which aborts the process: "terminate
called without an active exception", rc 134, seen at the exit of the GPU check's engine step.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


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
    the copier's own thread once the copy has landed, in the order the copies were asked for.
    On a CPU ``device`` the copy is made at once and still delivered on the thread."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"HostCopier copies from a CUDA device (or the CPU), not {device}")
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self.error: BaseException | None = None
        """The first exception a ``deliver`` raised (the copier stops then)."""
        self._thread = threading.Thread(target=self._loop, name="host-copier", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    def copy(
        self, tensors: list[torch.Tensor], deliver: Callable[[list[torch.Tensor]], None]
    ) -> None:
        """Start copying ``tensors`` (on ``device``, written by work already queued on the
        current stream) to pinned host memory; returns at once."""
        if self.error is not None:
            raise RuntimeError("the host copier stopped") from self.error
        if self._closed:
            raise RuntimeError("the host copier is closed")
        if self.stream is None:
            outs, done = [t.clone() for t in tensors], None
        else:
            outs, done = copy_to_host_async(tensors, self.stream)
        self._todo.put((done, outs, deliver))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, *, wait: bool = True, timeout_s: float = 10.0) -> None:
        """Stop the copier's thread after the copies asked for so far (delivered first);
        ``wait``: join it. Idempotent; from the copier's own thread (a ``deliver`` that drops
        the last reference to its worker) it only asks."""
        if not self._closed:
            self._closed = True
            self._todo.put(None)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join(timeout=timeout_s)
            if self._thread.is_alive():
                log.warning(
                    "host copier still busy after %.0f s (a copy never finished)", timeout_s
                )

    def _loop(self) -> None:
        while (item := self._todo.get()) is not None:
            if not self._deliver(*item):
                return
            del item  # holds nothing (deliver: its worker) while it waits for the next copy

    def _deliver(self, done, outs: list[torch.Tensor], deliver) -> bool:
        if done is not None:
            done.synchronize()  # this copy only: not the compute queued after it
        try:
            deliver(outs)
        except BaseException as err:  # noqa: BLE001 - kept and raised by the next copy()
            self.error = err
            return False
        return True


_LIVE: weakref.WeakSet[HostCopier] = weakref.WeakSet()


def close_all(timeout_s: float = 10.0) -> None:
    """Close and join every live ``HostCopier`` (registered with ``atexit``: runs while the
    interpreter is whole, before daemon threads are cut off)."""
    for copier in list(_LIVE):
        copier.close(timeout_s=timeout_s)


atexit.register(close_all)
