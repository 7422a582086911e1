"""``physis-serve`` under torchrun: rank 0 serves the front end over the engine core on every
rank, with the pool in front of it (admission, placement, promises); every other rank runs a
worker loop (``runtime.run_worker_rank``).

One node, 4 GPUs (or 4 CPU ranks with gloo)::

    torchrun --nproc-per-node 4 -m physis_ros.serve.main --config config/serve.yaml --port 50051

Two nodes, 8 GPUs each (run on both machines; HOST0 is reachable from the other on PORT and
the gloo/NCCL interfaces; rank 0, and so the gRPC front end, lands on one of them)::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 \\
        --rdzv-id physis-1 -m physis_ros.serve.main --config config/serve.yaml --host 0.0.0.0

(or statically: ``--nnodes 2 --node-rank {0,1} --master-addr HOST0 --master-port 29500``).
Set ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` when the hosts have several interfaces.

Start-up: every rank reads, from its own flags and config file, only how to join the job
(``engine.device``, ``distributed.comm_timeout_s``). Rank 0 builds the ``ServingSpec`` from
its config and flags, resolves and checks it (the weights against the model, key by key),
and sends it as JSON to every rank (``launch.broadcast_text``); a rank whose own device
setting differs stops. If rank 0 cannot resolve it, it sends the error instead and every
rank stops with that one line. Each rank then loads its blocks strictly; rank 0 measures
the job (``calibrate.startup_profile``), plans the default target and serves.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import sys

import torch

from physis_ros.cli_errors import describe
from physis_ros.engine.placement import layout_even
from physis_ros.engine.pool.costmodel import ProfileCostModel
from physis_ros.engine.pool.planning import PoolSimulation
from physis_ros.engine.ranks.calibrate import host_cores, startup_profile
from physis_ros.engine.ranks.executor import ranks_engine
from physis_ros.engine.ranks.launch import broadcast_text, init_from_env, tie_to_parent
from physis_ros.engine.ranks.runtime import StopFlag, exit_now, run_worker_rank
from physis_ros.serve.build import (
    as_served,
    burst_scaled,
    check_default_target,
    hand_layout,
    load_profile,
    plan_pool,
    usable_bytes,
)
from physis_ros.serve.build import describe as describe_server
from physis_ros.serve.config import checked_frontend, load_config, serving_spec
from physis_ros.serve.fits import check_one_stream_fits
from physis_ros.serve.spec import ServingSpec

log = logging.getLogger("physis-serve")

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
EXIT_BAD_SPEC = 2


def under_torchrun() -> bool:
    """True when this process was started by torchrun (or spawn_ranks)."""
    return all(v in os.environ for v in TORCHRUN_VARS)


def join_serving(args: argparse.Namespace):
    """Join the job and agree on the serving spec (module docstring). Rank 0 returns
    ``(RankContext, resolved ServingSpec)``; every other rank runs its worker loop with that
    spec and exits the process (as every rank does when the spec is refused)."""
    rank = int(os.environ["RANK"])
    tie_to_parent(os.getppid())  # a killed torchrun takes its ranks with it
    if rank != 0:
        faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints every thread's stack
        logging.basicConfig(level=logging.INFO, format="%(asctime)s rank%(process)d %(message)s")
    # How to join: from this rank's own config; everything else comes from rank 0.
    failure: BaseException | None = None
    spec = None
    try:
        spec = serving_spec(args, load_config(args.config))
    except (ValueError, OSError) as exc:
        failure = exc
    device = spec.device if spec is not None else "auto"
    timeout_s = spec.comm_timeout_s if spec is not None else 60.0
    ctx = init_from_env(device=device, comm_timeout_s=timeout_s)
    if rank != 0:
        stop = StopFlag()  # after init: until then SIGTERM ends the process at once
        stop.install_signal_handlers()
        text = broadcast_text(ctx, None)
        reply = json.loads(text)
        if "error" in reply:
            log.error("rank %d: rank 0 refused the serving spec: %s", rank, reply["error"])
            exit_now(EXIT_BAD_SPEC)
        spec = ServingSpec.from_json(text)
        if spec.device != device:
            log.error("rank %d: joined with device %r, rank 0 serves %r", rank, device, spec.device)
            exit_now(EXIT_BAD_SPEC)
        cfg = spec.runtime_config(ctx.world_size)
        torch.set_num_threads(args.threads if args.threads is not None else cfg.threads)
        exit_now(run_worker_rank(cfg, ctx, stop))
    if failure is None:
        try:
            spec = spec.resolve()
            spec.runtime_config(ctx.world_size)  # its checks, before any rank goes on
            check_one_stream_fits(spec, ctx.device, ctx.world_size)
            checked_frontend(args, load_config(args.config))  # rank 0 serves: its front end too
        except (ValueError, OSError) as exc:
            failure = exc
    if failure is not None:
        # every rank stops with this line; rank 0 says it the way every command ends a fault
        broadcast_text(ctx, json.dumps({"error": str(failure)}))
        code, line = describe(failure, "physis-serve")
        print(line, file=sys.stderr, flush=True)
        exit_now(code)
    broadcast_text(ctx, spec.to_json())
    log.info("serving spec (sent to %d ranks): %s", ctx.world_size, spec.to_json())
    torch.set_num_threads(args.threads if args.threads is not None else spec.threads)
    return ctx, spec


def build_dist(spec, ctx):
    """Rank 0's engine: the core over every rank, measured, planned and pooled."""
    cfg = spec.runtime_config(ctx.world_size)
    engine = ranks_engine(cfg, ctx, prompts=spec.prompts, max_streams=spec.max_streams)
    ranks = engine.executor
    try:
        sampler = spec.sampler()
        profile = load_profile(spec, spec.model_config, sampler)
        if profile is None:
            log.info(
                "measuring the job: block, loop and message costs on %d ranks", ranks.world_size
            )
            profile = startup_profile(engine)
        cpu = ctx.device.type == "cpu"
        simulation = PoolSimulation(
            host_cores=host_cores() if cpu else 0.0,
            forward_scale=profile.rank_work_scale if ranks.world_size > 1 else 1.0,
            worker_message_ms=profile.worker_message_ms if ranks.world_size > 1 else 0.0,
            batching=spec.batching,
        )
        block_ms = None
        if spec.plan == "balanced":
            costs = ranks.measure_block_costs()
            block_ms = [
                min(c[b] for c in costs.values() if b in c)
                for b in range(cfg.model_config.num_blocks)
            ]
        given = hand_layout(spec, ranks.world_size, block_ms) if spec.plan != "auto" else None
        # CPU ranks of one host share its memory; a GPU rank has its own.
        sharing = ranks.world_size if cpu else 1
        pool = plan_pool(
            spec,
            ProfileCostModel(profile),
            simulation,
            workers=ranks.world_size,
            usable=usable_bytes(spec, ctx.device, sharing),
            stage_devices=given,
        )
        if not spec.profile:  # a given profile is taken as it is
            # Scaled on a burst over every rank (what messages cost included), then planned.
            probe = pool
            if ranks.world_size > 1 and given is None:
                K, L = sampler.steps, cfg.model_config.num_blocks
                even = tuple(r for row in layout_even(K, L, ranks.world_size) for r in row)
                probe = plan_pool(
                    spec,
                    pool.cost,
                    simulation,
                    workers=ranks.world_size,
                    usable=pool.config.usable_bytes,
                    stage_devices=even,
                )
            scaled = burst_scaled(engine, probe, spec, profile)
            pool = plan_pool(
                spec,
                scaled.cost,
                simulation,
                workers=ranks.world_size,
                usable=pool.config.usable_bytes,
                stage_devices=given,
            )
        check_default_target(spec, pool)
        log.info("planned %s", pool.default.describe())
    except BaseException:
        engine.shutdown()
        raise
    served = as_served(engine, pool, spec)
    description = describe_server(spec, served, pool, kind=f"ranks ({ctx.backend})")
    return served, description
