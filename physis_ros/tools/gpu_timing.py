"""What both GPU runs time with: the full measurement (``gpu_check``,
``scripts/gpu_check.sh``) and the short verification (``gpu_verify``,
``scripts/gpu_verify.sh``). A JSON recorder that keeps every step's result or error; wall,
device (CUDA events) and CUDA-graph timings; one middle block built alone with a one-task and
a four-task batch to time; reading and formatting the results.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from physis_ros.engine.build import build_model
from physis_ros.engine.config import SamplerConfig
from physis_ros.engine.model import WanDiT
from physis_ros.engine.stage import BlockTimer, run_block

SAMPLER = SamplerConfig(steps=4, window=2)


class Recorder:
    """A JSON file of results, rewritten after every step; a failed step records why."""

    def __init__(self, path: Path, **head) -> None:
        self.path = path
        self.data: dict = {**head, "errors": {}, "seconds": {}}
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        os.replace(tmp, self.path)

    @contextlib.contextmanager
    def step(self, name: str):
        t0 = time.perf_counter()
        try:
            yield self.data
        except Exception as err:  # noqa: BLE001 - recorded; the next measurement still runs
            self.data["errors"][name] = f"{err!r}\n{traceback.format_exc(limit=4)[-1500:]}"
            print(f"gpu_check: {name} failed: {err!r}", file=sys.stderr)
        finally:
            self.data["seconds"][name] = round(time.perf_counter() - t0, 2)
            self.save()


# ---- timing ----------------------------------------------------------------------------------
def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def wall_ms(fn, dev: torch.device, *, warmup: int, reps: int) -> float:
    """Median wall time of fn() from a synchronised start to a synchronised end (CPU launch
    overhead included, as ``stage.BlockTimer`` and physis-profile time)."""
    out = []
    for i in range(warmup + reps):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        if i >= warmup:
            out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def device_ms(fn, dev: torch.device, *, warmup: int, reps: int) -> float:
    """Median device time of fn() (CUDA events, launched back to back; wall on a CPU)."""
    if dev.type != "cuda":
        return wall_ms(fn, dev, warmup=warmup, reps=reps)
    for _ in range(warmup):
        fn()
    marks = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        marks.append((a, b))
    torch.cuda.synchronize(dev)
    return statistics.median(a.elapsed_time(b) for a, b in marks)


def graph_ms(fn, dev: torch.device, *, reps: int) -> float:
    """fn captured once as a CUDA graph, then its replays timed (no launch overhead)."""
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return device_ms(graph.replay, dev, warmup=2, reps=reps)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


# ---- one block -------------------------------------------------------------------------------
@dataclasses.dataclass
class BlockBench:
    """The middle block of a model, built alone on a device, with a one-task and a four-task
    batch to time (what ``check_block`` and gpu_verify measure); times go into ``data``."""

    model: WanDiT
    mid: int
    one: BlockTimer
    four: BlockTimer
    dev: torch.device
    data: dict
    reps: int

    @classmethod
    def build(cls, cfg, dev: torch.device, dtype: torch.dtype, *, data: dict, reps: int):
        mid = cfg.num_blocks // 2
        model = build_model(
            cfg, seed=None, device=dev, dtype=dtype, block_ids={mid}, block_impl="eager"
        )
        one = BlockTimer(model, [SAMPLER.window], block=mid, window=SAMPLER.window)
        four = BlockTimer(model, [SAMPLER.window] * 4, block=mid, window=SAMPLER.window)
        return cls(model, mid, one, four, dev, data, reps)

    def forward(self, timer: BlockTimer):
        return lambda: run_block(self.model, self.mid, timer.tasks, timer.caches)

    def timed(self, key: str, timer: BlockTimer) -> None:
        self.data[key] = wall_ms(self.forward(timer), self.dev, warmup=3, reps=self.reps)


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def fmt(v, spec: str = ".2f") -> str:
    return format(v, spec) if isinstance(v, int | float) and math.isfinite(v) else "-"
