"""Starting ranks: the torchrun environment, and a programmatic launcher with the same contract.

``torchrun`` starts every rank with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``
and ``MASTER_PORT`` in the environment; ``init_from_env`` reads exactly those and calls
``init_process_group(init_method="env://")``. ``spawn_ranks`` (tests, the bench) starts worker
ranks 1..N-1 as child processes with the same variables, while the caller becomes rank 0, so
both launch paths run the same code after start-up.

Children tie themselves to their parent (``tie_to_parent``: ``PR_SET_PDEATHSIG``): if the
parent dies they get SIGTERM, so no rank is left behind even when a test process is killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from physis_ros.cli_errors import UsageError

_PR_SET_PDEATHSIG = 1
_PARENT_PID_ENV = "PHYSIS_PARENT_PID"


@dataclass(frozen=True, kw_only=True)
class RankContext:
    """Who this process is in the job and which device it owns."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def free_port(host: str = "127.0.0.1") -> int:
    """An ephemeral TCP port that was free a moment ago (the store binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def rank_env(*, rank: int, world_size: int, master_port: int, master_addr: str = "127.0.0.1"):
    """The environment torchrun would give ``rank`` on a single node."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


@contextlib.contextmanager
def as_rank(*, rank: int, world_size: int, master_port: int) -> Iterator[None]:
    """torchrun's variables for this process while it joins the job, then the environment as
    it was: left behind, they would make every ``physis-serve`` this process starts later
    (a test suite, the demo) believe it runs under torchrun and wait for ranks that never come."""
    saved = {k: os.environ.get(k) for k in RANK_VARS}
    os.environ.update(rank_env(rank=rank, world_size=world_size, master_port=master_port))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def pick_device_and_backend(local_rank: int, local_world_size: int, device: str = "auto"):
    """``cuda:LOCAL_RANK`` with NCCL when every local rank has its own GPU; several ranks on
    one GPU (NCCL refuses duplicate GPUs) use gloo with CPU staging; CPU runs use gloo."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu"), "gloo"
    if not torch.cuda.is_available():
        raise UsageError(
            f"device {device!r} asked for: no usable CUDA device (CUDA is not available)",
            "use device cpu, or auto",
        )
    count = torch.cuda.device_count()
    if local_world_size <= count:
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cuda", local_rank % count), "gloo"


def init_from_env(*, device: str = "auto", comm_timeout_s: float = 60.0) -> RankContext:
    """Join the job described by the torchrun environment variables."""
    missing = [
        k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
    ]
    if missing:
        raise RuntimeError(f"not started by torchrun or spawn_ranks: {missing} unset")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    dev, backend = pick_device_and_backend(local_rank, local_world, device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    # The process-group timeout bounds every wait; heartbeats keep idle receives below it.
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=comm_timeout_s),
    )
    return RankContext(
        rank=rank, world_size=world_size, local_rank=local_rank, device=dev, backend=backend
    )


def broadcast_text(ctx: RankContext, text: str | None) -> str:
    """Rank 0's ``text`` on every rank (others pass None): its UTF-8 length, then its bytes,
    broadcast over the process group. A collective: every rank calls it once, right after
    joining and before any point-to-point message. Used for the JSON every rank must run
    with (never pickle)."""
    dev = ctx.device if ctx.backend == "nccl" else torch.device("cpu")
    if ctx.rank == 0:
        if text is None:
            raise ValueError("rank 0 must give the text to broadcast")
        data = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8).to(dev)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=dev)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=dev)
    dist.broadcast(size, src=0)
    if ctx.rank != 0:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
    dist.broadcast(data, src=0)
    return data.cpu().numpy().tobytes().decode()


def tie_to_parent(parent_pid: int | None = None) -> None:
    """In a rank started by ``spawn_ranks`` (or by torchrun, with ``parent_pid`` = the
    launcher's pid): get SIGTERM when the parent dies (Linux).

    Called by the child itself at start-up (a ``preexec_fn`` is unsafe in a threaded parent);
    if the parent is already gone by then, exit at once."""
    parent = parent_pid if parent_pid is not None else os.environ.get(_PARENT_PID_ENV)
    if parent is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):
        sys.exit("parent process is gone")


def spawn_ranks(
    *,
    world_size: int,
    master_port: int,
    argv: Sequence[str],
    ranks: Sequence[int] | None = None,
    extra_env: dict[str, str] | None = None,
    log_dir: str | None = None,
) -> list[subprocess.Popen]:
    """Start ``python <argv...>`` once per rank in ``ranks`` (default 1..N-1), e.g.
    ``argv = ["-m", "physis_ros.engine.ranks.runtime", "--model", "tiny"]``."""
    procs = []
    for rank in ranks if ranks is not None else range(1, world_size):
        env = dict(os.environ)
        env.update(rank_env(rank=rank, world_size=world_size, master_port=master_port))
        env.update(extra_env or {})
        env[_PARENT_PID_ENV] = str(os.getpid())
        out = subprocess.DEVNULL
        if log_dir is not None:
            out = open(os.path.join(log_dir, f"rank{rank}.log"), "wb")  # noqa: SIM115
        procs.append(
            subprocess.Popen(
                [sys.executable, *argv],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        )
        if log_dir is not None:
            out.close()
    return procs


def stop_ranks(procs: Sequence[subprocess.Popen], timeout_s: float = 10.0) -> list[int]:
    """Wait for the ranks to exit; SIGTERM, then SIGKILL, those that outlive ``timeout_s``.
    Returns their exit codes."""
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=3.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return [proc.returncode for proc in procs]
