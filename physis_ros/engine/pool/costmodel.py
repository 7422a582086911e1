"""Cost model: how long one batched block forward and one activation hop take on a device.

Two sources of numbers behind one interface (``CostModel``):

- ``AnalyticCostModel``: FLOPs and bytes from a ``ModelConfig`` and a ``DeviceSpec`` (a
  roofline with stated efficiencies). It stands in for devices the local machine does not have;
  ``H200`` is the preset used by the pool24 and depth experiments.
- ``ProfileCostModel``: per-block times *measured* by ``physis-profile`` on the actual
  device, as a function of the batch composition (tasks per batched forward), read from the
  JSON profile that command writes.

Every number that is assumed rather than measured lives in a ``DeviceSpec`` field with a
docstring, so ``assumptions()`` can print it next to every result.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from physis_ros.engine.config import ModelConfig, SamplerConfig

GIB = 1024**3


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator model and its interconnect, as the analytic model sees it."""

    name: str
    peak_flops: float
    """Dense peak FLOP/s in the compute dtype."""
    gemm_efficiency: float
    """Fraction of ``peak_flops`` that large weight GEMMs reach."""
    attn_efficiency: float
    """Fraction of ``peak_flops`` that fused (flash) attention reaches."""
    mem_bandwidth_Bps: float
    """Device memory bandwidth, bytes/s."""
    bandwidth_efficiency: float
    """Fraction of ``mem_bandwidth_Bps`` that streaming kernels reach."""
    memory_bytes: float
    """Device memory capacity, bytes."""
    reserved_bytes: float
    """Memory never given to streams: runtime context, communicator buffers, fragmentation."""
    dtype_bytes: int
    """Bytes per weight / activation / KV element (2: bf16)."""
    launch_overhead_ms: float
    """Fixed cost of one block forward (kernel launches, scheduling), independent of size."""
    elementwise_passes: float
    """Memory passes over [N, D] per task per block for norms, modulation, RoPE, residuals."""
    devices_per_node: int
    """Devices joined by the fast intra-node link."""
    intra_node_Bps: float
    """Per-direction bandwidth of one device's intra-node link (NVLink), bytes/s."""
    intra_node_latency_ms: float
    """Fixed latency of one intra-node point-to-point message."""
    inter_node_Bps: float
    """Per-device bandwidth between nodes (one NIC per device), bytes/s."""
    inter_node_latency_ms: float
    """Fixed latency of one inter-node point-to-point message."""
    comm_overlaps_compute: bool
    """True when sends run on their own stream and never stall the worker's compute."""

    def __post_init__(self) -> None:
        for name in (
            "peak_flops",
            "mem_bandwidth_Bps",
            "memory_bytes",
            "intra_node_Bps",
            "inter_node_Bps",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("gemm_efficiency", "attn_efficiency", "bandwidth_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if not 0 <= self.reserved_bytes < self.memory_bytes:
            raise ValueError(f"reserved_bytes {self.reserved_bytes} must be in [0, memory_bytes)")
        if self.dtype_bytes not in (1, 2, 4):
            raise ValueError(f"dtype_bytes must be 1, 2 or 4, got {self.dtype_bytes}")
        if self.devices_per_node < 1:
            raise ValueError(f"devices_per_node must be >= 1, got {self.devices_per_node}")
        if self.launch_overhead_ms < 0 or self.elementwise_passes < 0:
            raise ValueError("launch_overhead_ms and elementwise_passes must be >= 0")

    @property
    def usable_bytes(self) -> float:
        return self.memory_bytes - self.reserved_bytes


# NVIDIA H200 SXM (HGX H200 8-GPU node). Peak, bandwidth, memory and links: datasheet
# figures. Compute efficiencies, elementwise passes and the per-forward overhead: fitted
# (``pool/calibrate.py``) to block-task times of the fused block path measured on an H200 by
# scripts/gpu_check.sh: docs/pool/h200_calibration.json holds them with their environment, and
# test_pool_calibrate checks that refitting that file gives these numbers.
H200 = DeviceSpec(
    name="H200-SXM (calibrated: NVIDIA H200)",
    peak_flops=989e12,  # dense BF16 tensor-core peak (datasheet 1979 TFLOP/s is with sparsity)
    gemm_efficiency=0.7269,  # fitted: the block's six weight GEMMs timed alone (cuBLAS)
    attn_efficiency=0.5067,  # fitted: self + cross attention timed alone (SDPA, cuDNN)
    mem_bandwidth_Bps=4.8e12,  # HBM3e
    bandwidth_efficiency=0.80,  # assumption (a device-to-device copy reaches about 0.885)
    memory_bytes=141e9,  # 141 GB HBM3e
    reserved_bytes=6 * GIB,  # assumption: CUDA context, NCCL buffers, allocator slack
    dtype_bytes=2,  # bf16 weights, activations and KV
    launch_overhead_ms=0.2426,  # fitted: per block forward, whatever its batch
    elementwise_passes=31.74,  # fitted: passes over [N, D] per task (norms, RoPE, copies...)
    devices_per_node=8,
    intra_node_Bps=450e9,  # NVLink 4: 900 GB/s bidirectional per GPU
    intra_node_latency_ms=0.015,  # assumption: NCCL p2p small-message latency in a node
    inter_node_Bps=50e9,  # one 400 Gb/s NDR InfiniBand NIC per GPU
    inter_node_latency_ms=0.030,  # assumption: NCCL p2p latency across nodes
    comm_overlaps_compute=True,  # NCCL sends on a separate CUDA stream
)


@dataclass(frozen=True)
class BlockWork:
    """FLOPs and bytes of one block forward for one task (one chunk at one step)."""

    gemm_flops: float
    """Weight GEMMs: self-attn QKVO, cross-attn Q/O, FFN (batched across tasks)."""
    attn_flops: float
    """Attention score/value products against (W+1)*N self keys and text_len cross keys."""
    weight_bytes: float
    """Block weights read once per batched forward."""
    kv_bytes: float
    """KV read by this task's attention (window + own chunk + cross-attn cache)."""
    elementwise_bytes: float
    """Activation traffic of the non-GEMM kernels."""


def block_work(cfg: ModelConfig, sampler: SamplerConfig, dtype_bytes: int) -> BlockWork:
    """Per block per task: the FLOP formulas of the brief, with N tokens per chunk.

    Self-attn QKVO: 4 GEMMs of N x D x D (2 FLOP per MAC). Self attention: QK^T and AV
    against (W+1)*N keys. Cross-attn: Q and O GEMMs on N tokens; its K/V of the text_len
    conditioning tokens are computed once per stream and cached (so not per task), attention
    against text_len keys. FFN: two GEMMs N x D x F.
    """
    n, d, f = cfg.tokens_per_chunk, cfg.dim, cfg.ffn_dim
    keys = (sampler.window + 1) * n
    gemm = n * d * d * 4 * 2 + n * d * d * 2 * 2 + 2 * n * d * f * 2
    attn = 2 * 2 * n * keys * d + 2 * 2 * n * cfg.text_len * d
    weight_bytes = cfg.block_params() * dtype_bytes
    kv_bytes = (keys + cfg.text_len) * 2 * d * dtype_bytes
    return BlockWork(
        gemm_flops=float(gemm),
        attn_flops=float(attn),
        weight_bytes=float(weight_bytes),
        kv_bytes=float(kv_bytes),
        elementwise_bytes=0.0,
    )


def activation_bytes(cfg: ModelConfig, dtype_bytes: int) -> int:
    """Bytes of one activation message: h [N, D] (compute dtype) + x (float32) + header."""
    x_values = cfg.video_tokens * cfg.patch_dim + cfg.action_horizon * cfg.action_dim
    return cfg.tokens_per_chunk * cfg.dim * dtype_bytes + 4 * x_values + 64


class CostModel(Protocol):
    """What the admission controller and the simulator ask of a cost model."""

    name: str
    comm_overlaps_compute: bool
    """False: a worker is busy while it sends (charge hops to the sender's compute)."""
    comm_threads: bool
    """True: each device's sends and receives are served by its own send and receive threads
    beside the worker (CPU ranks over gloo): ``send_cpu_ms`` and ``recv_cpu_ms`` are those
    threads' processor time per message, which shares the host's cores but never stops the
    worker."""

    def group_ms(self, cfg: ModelConfig, sampler: SamplerConfig, tasks: int) -> float:
        """One batched forward of one block over ``tasks`` tasks (full KV windows)."""

    def hop_ms(self, cfg: ModelConfig, src: int, dst: int) -> float:
        """One activation of ``cfg`` sent from device ``src`` to device ``dst``: the time
        from the sender's batch ending to the activation being ready at ``dst``."""

    def send_cpu_ms(self, cfg: ModelConfig) -> float:
        """Work one remote send adds to the sending worker when sends do not overlap
        compute (part of ``hop_ms``)."""

    def recv_cpu_ms(self, cfg: ModelConfig) -> float:
        """Work one remote receive adds to the receiving worker (part of ``hop_ms``)."""

    def chunk_overhead_ms(self, cfg: ModelConfig) -> float:
        """Work the sink (controller) spends per finished chunk."""

    def assumptions(self) -> dict:
        """Every number the model rests on, for printing beside results."""


class AnalyticCostModel:
    """Roofline per kernel class: time = max(FLOPs / achieved FLOP/s, bytes / achieved B/s)."""

    def __init__(self, device: DeviceSpec) -> None:
        self.device = device
        self.name = f"analytic:{device.name}"
        self.comm_overlaps_compute = device.comm_overlaps_compute
        self.comm_threads = False

    def group_ms(self, cfg: ModelConfig, sampler: SamplerConfig, tasks: int) -> float:
        if tasks < 1:
            raise ValueError(f"tasks must be >= 1, got {tasks}")
        dev = self.device
        work = block_work(cfg, sampler, dev.dtype_bytes)
        bw = dev.mem_bandwidth_Bps * dev.bandwidth_efficiency
        # Weight GEMMs are batched: weights are read once for the whole group.
        gemm_s = max(
            tasks * work.gemm_flops / (dev.peak_flops * dev.gemm_efficiency),
            (work.weight_bytes + tasks * 6 * cfg.tokens_per_chunk * cfg.dim * dev.dtype_bytes) / bw,
        )
        # Attention runs per task against its own KV.
        attn_s = tasks * max(
            work.attn_flops / (dev.peak_flops * dev.attn_efficiency), work.kv_bytes / bw
        )
        elem_bytes = dev.elementwise_passes * cfg.tokens_per_chunk * cfg.dim * dev.dtype_bytes
        elem_s = tasks * elem_bytes / bw
        return dev.launch_overhead_ms + 1e3 * (gemm_s + attn_s + elem_s)

    def hop_ms(self, cfg: ModelConfig, src: int, dst: int) -> float:
        if src == dst:
            return 0.0
        dev = self.device
        nbytes = activation_bytes(cfg, dev.dtype_bytes)
        if src // dev.devices_per_node == dst // dev.devices_per_node:
            return dev.intra_node_latency_ms + 1e3 * nbytes / dev.intra_node_Bps
        return dev.inter_node_latency_ms + 1e3 * nbytes / dev.inter_node_Bps

    def send_cpu_ms(self, cfg: ModelConfig) -> float:
        return 0.0  # NCCL sends run on their own stream, posted by a comm thread

    def recv_cpu_ms(self, cfg: ModelConfig) -> float:
        return 0.0

    def chunk_overhead_ms(self, cfg: ModelConfig) -> float:
        return 0.0  # the controller runs on the host CPU, beside the GPU's work

    def assumptions(self) -> dict:
        return {"cost_model": "analytic roofline", "device": asdict(self.device)}


@dataclass(frozen=True, kw_only=True)
class ProfileEntry:
    tasks: int
    """Tasks in the batched forward."""
    ms_p50: float
    ms_p99: float


@dataclass(frozen=True, kw_only=True)
class Profile:
    """What ``physis-profile`` measured: block forward time vs batch size on one device."""

    device: str
    model: str
    steps: int
    window: int
    dtype: str
    entries: tuple[ProfileEntry, ...]
    hop_ms: float
    """One activation hop between two workers, measured (0 when not measured)."""
    task_overhead_ms: float = 0.0
    """Worker-loop cost per task outside the timed block forward (receive, FIFO bookkeeping,
    Euler update, send), calibrated from one-worker runs of the engine."""
    batch_overhead_ms: float = 0.0
    """Worker-loop cost per batched forward (pick, stack, loop turn), calibrated likewise."""
    comm_overlaps_compute: bool = False
    comm_threads: bool = False
    """Messages are served by each rank's send and receive threads (``CostModel``)."""
    rank_work_scale: float = 1.0
    """Processor time of a rank's worker-loop work (forwards, loop) inside a multi-rank job
    relative to a one-rank job on the same host, measured (the processor is slower beside
    other ranks). 1: not measured."""
    worker_message_ms: float = 0.0
    """Processor time each message a rank sends or receives costs that rank's worker inside
    a multi-rank job (CPU ranks: the wakeups, GIL handoffs and cold caches of its message
    threads' work), measured with ``rank_work_scale``. 0: not measured."""
    send_cpu_ms: float = 0.0
    """Processor time one remote send costs the sending rank (with ``comm_threads``: its send
    thread and a share of gloo's transport thread; what the messages cost the worker itself
    is in ``worker_message_ms``); 0 with ``recv_cpu_ms`` 0: not measured (a worker that cannot
    overlap sends is then charged ``hop_ms``)."""
    recv_cpu_ms: float = 0.0
    """Processor time one remote receive costs the receiving rank (with ``comm_threads``: its
    receive thread and a share of gloo's transport thread)."""
    chunk_overhead_ms: float = 0.0
    """Processor time the controller (rank 0's driver thread) spends per finished chunk."""
    host_cores: int = 0
    """Processors the ranks of one host share (``os.sched_getaffinity``); 0: not recorded."""
    calibrated_on: str = ""
    """Runtime the worker-loop and communication costs were measured on (``inproc``,
    ``gloo``)."""

    def __post_init__(self) -> None:
        if not self.entries:
            raise ValueError("a profile needs at least one entry")
        for name in (
            "hop_ms",
            "task_overhead_ms",
            "batch_overhead_ms",
            "send_cpu_ms",
            "recv_cpu_ms",
            "chunk_overhead_ms",
            "worker_message_ms",
            "host_cores",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.rank_work_scale > 0:
            raise ValueError(f"rank_work_scale must be > 0, got {self.rank_work_scale}")
        sizes = [e.tasks for e in self.entries]
        if sizes != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"profile batch sizes must be increasing and >= 1, got {sizes}")
        for e in self.entries:
            if not e.ms_p50 > 0:
                raise ValueError(f"profile entry for {e.tasks} tasks has ms_p50 {e.ms_p50}")

    def to_json(self) -> dict:
        out = asdict(self)
        out["entries"] = [asdict(e) for e in self.entries]
        return out

    @classmethod
    def from_json(cls, data: dict) -> Profile:
        try:
            entries = tuple(ProfileEntry(**e) for e in data["entries"])
            fields = {k: data[k] for k in ("device", "model", "steps", "window", "dtype")}
            return cls(
                **fields,
                entries=entries,
                hop_ms=float(data.get("hop_ms", 0.0)),
                task_overhead_ms=float(data.get("task_overhead_ms", 0.0)),
                batch_overhead_ms=float(data.get("batch_overhead_ms", 0.0)),
                comm_overlaps_compute=bool(data.get("comm_overlaps_compute", False)),
                comm_threads=bool(data.get("comm_threads", False)),
                rank_work_scale=float(data.get("rank_work_scale", 1.0)),
                worker_message_ms=float(data.get("worker_message_ms", 0.0)),
                send_cpu_ms=float(data.get("send_cpu_ms", 0.0)),
                recv_cpu_ms=float(data.get("recv_cpu_ms", 0.0)),
                chunk_overhead_ms=float(data.get("chunk_overhead_ms", 0.0)),
                host_cores=int(data.get("host_cores", 0)),
                calibrated_on=str(data.get("calibrated_on", "")),
            )
        except (KeyError, TypeError) as err:
            raise ValueError(f"not a physis-profile JSON: {err!r}") from None

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.from_json(json.loads(Path(path).read_text()))


class ProfileCostModel:
    """Measured per-block times, linearly interpolated in the batch size.

    Beyond the largest measured batch the last segment's slope is extended (a batched
    forward never gets cheaper per task than the measured marginal cost). Only the model,
    K and W that were profiled are accepted: anything else would be a guess.
    """

    def __init__(self, profile: Profile, *, use_p99: bool = False) -> None:
        self.profile = profile
        self.name = f"profile:{profile.device}:{profile.model}"
        self.comm_overlaps_compute = profile.comm_overlaps_compute
        self.comm_threads = profile.comm_threads
        self._points = [(e.tasks, e.ms_p99 if use_p99 else e.ms_p50) for e in profile.entries]

    def _check(self, cfg: ModelConfig, sampler: SamplerConfig) -> None:
        p = self.profile
        if (cfg.name, sampler.steps, sampler.window) != (p.model, p.steps, p.window):
            raise ValueError(
                f"profile is for model {p.model} K={p.steps} W={p.window}, asked for "
                f"{cfg.name} K={sampler.steps} W={sampler.window}"
            )

    def group_ms(self, cfg: ModelConfig, sampler: SamplerConfig, tasks: int) -> float:
        self._check(cfg, sampler)
        if tasks < 1:
            raise ValueError(f"tasks must be >= 1, got {tasks}")
        p = self.profile
        return self.block_ms(tasks) + p.batch_overhead_ms + tasks * p.task_overhead_ms

    def block_ms(self, tasks: int) -> float:
        """The measured block forward alone (no worker-loop overheads)."""
        pts = self._points
        if len(pts) == 1:
            return pts[0][1] * tasks
        for (b0, t0), (b1, t1) in itertools.pairwise(pts):
            if tasks <= b1:
                if tasks < b0:  # below the first point: scale down proportionally
                    return t0 * tasks / b0
                return t0 + (t1 - t0) * (tasks - b0) / (b1 - b0)
        (b0, t0), (b1, t1) = pts[-2], pts[-1]
        return t1 + max(t1 - t0, 0.0) / (b1 - b0) * (tasks - b1)

    def hop_ms(self, cfg: ModelConfig, src: int, dst: int) -> float:
        return 0.0 if src == dst else self.profile.hop_ms

    def send_cpu_ms(self, cfg: ModelConfig) -> float:
        p = self.profile
        if p.send_cpu_ms or p.recv_cpu_ms:
            return p.send_cpu_ms
        return 0.0 if p.comm_overlaps_compute else p.hop_ms

    def recv_cpu_ms(self, cfg: ModelConfig) -> float:
        return self.profile.recv_cpu_ms

    def chunk_overhead_ms(self, cfg: ModelConfig) -> float:
        return self.profile.chunk_overhead_ms

    def assumptions(self) -> dict:
        return {"cost_model": "measured profile", "profile": self.profile.to_json()}


def per_chunk_ms(cost: CostModel, cfg: ModelConfig, sampler: SamplerConfig) -> float:
    """Unbatched compute of one chunk through all K*L stages on one device."""
    return sampler.steps * cfg.num_blocks * cost.group_ms(cfg, sampler, 1)
