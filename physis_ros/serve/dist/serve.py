"""``physis-serve`` under torchrun: rank 0 serves the front end over a ``DistEngine``; every
other rank runs a worker loop (``runtime.run_worker_rank``).

One node, 4 GPUs (or 4 CPU ranks with gloo)::

    torchrun --nproc-per-node 4 -m physis_ros.serve.main --config config/serve.yaml --port 50051

Two nodes, 8 GPUs each (run on both machines; HOST0 is reachable from the other on PORT and
the gloo/NCCL interfaces; rank 0, and so the gRPC front end, lands on one of them)::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 \\
        --rdzv-id physis-1 -m physis_ros.serve.main --config config/serve.yaml --host 0.0.0.0

(or statically: ``--nnodes 2 --node-rank {0,1} --master-addr HOST0 --master-port 29500``).
Set ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` when the hosts have several interfaces.
The ``distributed`` section of the YAML file configures the runtime (``RuntimeConfig``);
``engine.model/steps/window`` choose the model. Every rank reads the same file and flags.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
from typing import Any

import torch

from physis_ros.serve.dist.runtime import RuntimeConfig, StopFlag, exit_now, run_worker_rank

log = logging.getLogger("physis-serve")

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def under_torchrun() -> bool:
    """True when this process was started by torchrun (or spawn_ranks)."""
    return all(v in os.environ for v in TORCHRUN_VARS)


ENGINE_KEYS = (
    "model",
    "steps",
    "window",
    "dtype",
    "vae",
    "resolution",
    "latent_frames",
    "shift",
    "horizon",
    "context_noise",
)
"""Keys of the YAML ``engine`` section every rank takes (unless ``distributed`` sets them)."""


def runtime_config(config: dict[str, Any], args: argparse.Namespace | None = None) -> RuntimeConfig:
    """RuntimeConfig from the YAML ``engine`` (model, steps, window, ...) and ``distributed``
    sections; the model flags (--model, --dtype, --vae, ...) override. A preset with shipped
    weights (push-wm) runs them, as trained, unless told otherwise."""
    from physis_ros.serve.main import model_section
    from physis_ros.weights import shipped_engine_defaults

    engine = config.get("engine", {}) or {}
    section = dict(config.get("distributed", {}) or {})
    for key in ENGINE_KEYS:
        if key in engine and key not in section:
            section[key] = engine[key]
    flags = model_section({}, args) if args is not None else {}
    section.update({k: v for k, v in flags.items() if k in ENGINE_KEYS})
    shipped = shipped_engine_defaults(section.get("model", RuntimeConfig.model))
    if shipped and "weights_path" not in section:
        section["weights_path"] = shipped.pop("checkpoint")
        shipped.pop("model")
        for key, value in shipped.items():
            section.setdefault(key, value)
    known = {f for f in RuntimeConfig.__dataclass_fields__}
    unknown = sorted(set(section) - known)
    if unknown:
        raise ValueError(f"unknown distributed keys {unknown}; known: {sorted(known)}")
    return RuntimeConfig(**section)


def serve_torchrun(args: argparse.Namespace) -> int:
    """Entry of every rank of ``torchrun ... -m physis_ros.serve.main``."""
    from physis_ros.serve.dist.launch import init_from_env, tie_to_parent
    from physis_ros.serve.main import load_config, model_section, serve_single_process

    file_config = load_config(args.config)
    cfg = runtime_config(file_config, args)
    prompts = model_section(file_config["engine"], args).get("prompts", [])
    torch.set_num_threads(args.threads if args.threads is not None else cfg.threads)
    rank = int(os.environ["RANK"])
    tie_to_parent(os.getppid())  # a killed torchrun takes its ranks with it
    if rank != 0:
        faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints every thread's stack
        logging.basicConfig(level=logging.INFO, format="%(asctime)s rank%(process)d %(message)s")
        ctx = init_from_env(device=cfg.device, comm_timeout_s=cfg.comm_timeout_s)
        stop = StopFlag()  # after init: until then SIGTERM ends the process at once
        stop.install_signal_handlers()
        exit_now(run_worker_rank(cfg, ctx, stop))

    def factory(_engine_section: dict[str, Any]):
        from physis_ros.serve.dist.engine import DistEngine
        from physis_ros.serve.frontend import ServerDescription

        ctx = init_from_env(device=cfg.device, comm_timeout_s=cfg.comm_timeout_s)
        engine = DistEngine(cfg, ctx, prompts=prompts)

        def engine_info() -> dict[str, Any]:
            return {
                "kind": "DistEngine",
                "ranks": str(engine.world_size),
                "backend": engine.ctx.backend,
                "placement": cfg.placement,
                "open_streams": str(len(engine.controller.streams)),
                "failed_ranks": str(engine.failed_ranks),
                "prompts": ",".join(engine.prompts.names()),
            }

        mc = cfg.model_config
        return engine, ServerDescription(
            model=mc.name,
            steps=cfg.steps,
            blocks=mc.num_blocks,
            placement=f"{cfg.placement} over {engine.world_size} ranks ({ctx.backend})",
            action_mode=mc.action_mode,
            horizon=cfg.horizon,
            engine_info=engine_info,
        )

    code = serve_single_process(args, engine_factory=factory)
    log.info("rank 0 done")
    exit_now(code)
    return code
