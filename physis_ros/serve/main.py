"""`physis-serve`: the inference server.

Single-process mode (the default): the engine's worker threads, the pool in front of them
(admission, placement, promises), the EngineLoop thread and the gRPC front end in one
process. Under torchrun rank 0 runs the same front end over every rank
(``physis_ros.serve.torchrun_main``). What is served is one ``ServingSpec`` (serve/spec.py) from
``--config`` (YAML sections ``engine``, ``placement``, ``pool``, ``distributed``; the
``frontend`` section configures the gRPC server) and flags, resolved and checked once.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable

import torch

from physis_ros.children import tie_to_launcher
from physis_ros.cli_errors import (
    UsageError,
    cli_main,
    finite_float,
    ignore_further_interrupts,
    log_level,
    positive_int,
)
from physis_ros.engine.api import StreamEngine
from physis_ros.engine.ranks.runtime import exit_now
from physis_ros.serve.build import build_local, torch_device
from physis_ros.serve.config import (
    DEFAULT_CONFIG,
    check_flags_used,
    checked_frontend,
    load_config,
    model_section,
    serving_spec,
)
from physis_ros.serve.engine_loop import EngineLoop
from physis_ros.serve.fits import check_one_stream_fits
from physis_ros.serve.frontend_config import FrontendConfig, ServerDescription
from physis_ros.serve.metrics import ServeMetrics
from physis_ros.serve.server import start_server
from physis_ros.serve.spec import ServingSpec
from physis_ros.serve.torchrun_main import build_dist, join_serving, under_torchrun

log = logging.getLogger("physis-serve")

SIGNAL_POLL_S = 0.2
"""Longest the main thread sleeps between looks at the stop flag (see run_frontend)."""


def run_frontend(
    engine: StreamEngine,
    description: ServerDescription,
    config: FrontendConfig,
    *,
    port_file: str | None,
    stop: threading.Event,
    loop_options: dict[str, float] | None = None,
    metrics_port_file: str | None = None,
) -> int:
    """Serves ``engine`` until ``stop`` is set; writes the bound port to ``port_file`` (and
    the metrics port, when ``config.metrics_port`` asks for metrics, to ``metrics_port_file``)."""
    loop = EngineLoop(engine, **(loop_options or {}))
    loop.start()
    try:
        handle = start_server(loop, config=config, description=description)
    except BaseException:
        loop.stop()
        engine.shutdown()  # under torchrun: the worker ranks are told to stop
        raise
    log.info(
        "serving %s (K=%d, L=%d) on %s:%d%s%s",
        description.model,
        description.steps,
        description.blocks,
        config.host,
        handle.port,
        " with TLS" if config.tls_cert_path else "",
        " and a bearer token" if config.token else "",
    )
    unguarded = [
        n for n, on in (("TLS", config.tls_cert_path), ("a token", config.token)) if not on
    ]
    if config.host not in {"127.0.0.1", "::1", "localhost"} and unguarded:
        # Observations are camera images of someone's lab and the predictions steer a robot.
        log.warning(
            "listening on %s without %s: anyone who reaches this port can stream to the model",
            config.host,
            " or ".join(unguarded),
        )
    metrics = None
    try:
        if config.metrics_port is not None:
            metrics = ServeMetrics(handle.frontend, engine, description)
            metrics_port = metrics.serve(config.host, config.metrics_port)
            log.info("metrics on http://%s:%d/metrics", config.host, metrics_port)
            if metrics_port_file:
                _write_port(metrics_port_file, metrics_port)
        if port_file:
            _write_port(port_file, handle.port)
        # Woken at least every SIGNAL_POLL_S: a signal the kernel hands to another thread
        # (gRPC's, gloo's) only trips Python's flag, and a main thread blocked in an untimed
        # wait would run the handler when something else woke it (seen under torchrun: the
        # rank stayed up until torchrun's SIGTERM 20 s later).
        while not stop.wait(SIGNAL_POLL_S):
            pass
    finally:
        log.info("shutting down")
        if metrics is not None:
            metrics.stop()
        handle.stop()
        loop.stop()
        engine.shutdown()
    return 0


def _write_port(path: str, port: int) -> None:
    """Written atomically: a reader never sees a half-written number."""
    directory = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile("w", dir=directory, delete=False) as f:
        f.write(f"{port}\n")
    os.replace(f.name, path)


def serve_single_process(
    args: argparse.Namespace,
    engine_factory: Callable[[ServingSpec], tuple[StreamEngine, ServerDescription]] | None = None,
    *,
    spec: ServingSpec | None = None,
) -> int:
    """physis-serve until SIGINT / SIGTERM: an in-process engine, or the one
    ``engine_factory`` builds from the resolved spec (rank 0 under torchrun)."""
    cfg = load_config(args.config)
    config, loop_options = checked_frontend(args, cfg)
    if engine_factory is not None:
        engine, description = engine_factory(spec or serving_spec(args, cfg).resolve())
    elif args.engine_factory:  # another StreamEngine (tests): it reads the engine section
        engine_section = model_section(cfg["engine"], args)
        engine, description = _factory_from_name(args.engine_factory)(engine_section)
    else:
        spec = serving_spec(args, cfg).resolve()
        log.info("serving spec: %s", spec.to_json())
        check_one_stream_fits(spec, torch_device(spec))  # before anything loads
        # One intra-op thread per worker unless told: worker threads share the cores.
        torch.set_num_threads(args.threads if args.threads is not None else spec.threads)
        engine, description = build_local(spec)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, functools.partial(_stop_serving, stop))
    return run_frontend(
        engine,
        description,
        config,
        port_file=args.port_file,
        stop=stop,
        loop_options=loop_options,
        metrics_port_file=args.metrics_port_file,
    )


def _stop_serving(stop: threading.Event, _signum: int, _frame) -> None:
    """The first SIGINT or SIGTERM stops the server; then ignore_further_interrupts."""
    stop.set()
    ignore_further_interrupts()


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--model and what goes with a model directory; shared by physis-serve and physis-eval."""
    parser.add_argument(
        "--model",
        default=None,
        help="model preset, or a model directory: upstream Wan (config.json + safetensors) "
        "or diffusers (transformer/config.json); overrides engine.model",
    )
    parser.add_argument(
        "--dtype", default=None, choices=("float32", "bfloat16", "float16"), help="weights dtype"
    )
    parser.add_argument(
        "--variant",
        default=None,
        help="which weights of a model directory that holds several, e.g. fp16 for "
        "diffusion_pytorch_model.fp16.safetensors (default: the one --dtype names, fp16 or "
        "bf16, when present, else the files without a variant; overrides engine.variant)",
    )
    parser.add_argument(
        "--prompts",
        action="append",
        default=None,
        metavar="FILE",
        help="prompt-embedding file (physis-embed); streams pick its prompts by name "
        "(repeatable; added to engine.prompts)",
    )
    parser.add_argument(
        "--vae", default=None, help="diffusers AutoencoderKLWan directory: the real codec"
    )
    parser.add_argument(
        "--resolution", default=None, help="camera image HxW of a model directory, e.g. 480x832"
    )
    parser.add_argument(
        "--latent-frames", type=int, default=None, help="latent frames per chunk (default 3)"
    )


def _factory_from_name(spec: str):
    module, _, name = spec.partition(":")
    if not module or not name:
        raise UsageError(
            f"--engine-factory {spec!r} is not module:function", "e.g. my_pkg.engines:make"
        )
    try:
        factory = getattr(importlib.import_module(module), name)
    except ImportError as exc:
        raise UsageError(
            f"--engine-factory {spec!r}: module {module!r} cannot be imported ({exc})",
            "check the name and that its package is installed or on PYTHONPATH",
        ) from exc
    except AttributeError as exc:
        raise UsageError(
            f"--engine-factory {spec!r}: module {module!r} has no {name!r}",
            "name a function of that module",
        ) from exc
    if not callable(factory):
        raise UsageError(f"--engine-factory {spec!r} is not callable", "name a function")
    return factory


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="physis-serve", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config",
        # A pip-installed server has no config/ beside it: built-in defaults then.
        default=str(DEFAULT_CONFIG) if DEFAULT_CONFIG.exists() else None,
        help="YAML parameters (default: config/serve.yaml of the source tree, if present)",
    )
    add_model_arguments(parser)
    parser.add_argument(
        "--weights",
        default=None,
        help="safetensors weights written by physis-train: the model, window, steps and shift "
        "come from its metadata unless --model names the model ('random': random weights; "
        "overrides engine.weights)",
    )
    parser.add_argument(
        "--plan",
        default=None,
        help="placement: auto (planned at start-up) or by hand: even, single, one-stage, "
        "groups:a,b,..., balanced (overrides placement.plan)",
    )
    parser.add_argument(
        "--policy",
        default=None,
        choices=("shared", "static"),
        help="how streams share the workers (overrides pool.policy)",
    )
    parser.add_argument(
        "--default-target-ms",
        type=float,
        default=None,
        help="interval of a stream that asks for 0 (overrides pool.default_target_ms; 0: the "
        "fastest the plan can promise one stream, which takes the pool)",
    )
    parser.add_argument(
        "--known-rows-ahead",
        type=int,
        default=None,
        help="a world-action stream is told the committed rows up to this many rows past the "
        "newest frame (0: none; default: the weights' max_known_rows_ahead; overrides "
        "engine.known_rows_ahead)",
    )
    add_listen_arguments(parser)
    parser.add_argument(
        "--engine-factory",
        default=None,
        help="module:function(engine_section) -> (engine, ServerDescription), "
        "to serve another StreamEngine",
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch intra-op threads per process (default: distributed.threads, 1)",
    )
    parser.add_argument("--log-level", type=log_level, default="INFO", help="DEBUG ... ERROR")
    return parser


def add_listen_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the server listens, who may call it, and how long a broken stream is held."""
    parser.add_argument("--host", default=None, help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=port_number, default=None, help="port; 0 = ephemeral")
    parser.add_argument("--port-file", default=None, help="write the bound port here once serving")
    parser.add_argument(
        "--metrics-port",
        type=port_number,
        default=None,
        help="serve Prometheus /metrics over HTTP on --host at this port (0 = ephemeral; "
        "overrides frontend.metrics_port; default: no metrics)",
    )
    parser.add_argument(
        "--metrics-port-file", default=None, help="write the bound metrics port here"
    )
    token = parser.add_mutually_exclusive_group()  # the file's token would win unseen
    token.add_argument("--token", default=None, help="bearer token every call must carry")
    token.add_argument("--token-file", default=None, help="read the bearer token from a file")
    parser.add_argument("--tls-cert", default=None, help="server certificate chain (PEM)")
    parser.add_argument("--tls-key", default=None, help="server private key (PEM)")
    parser.add_argument(
        "--tls-client-ca",
        default=None,
        help="CA (PEM) that client certificates must chain to; requires them",
    )
    parser.add_argument(
        "--resume-grace-s",
        type=finite_float,
        default=None,
        help="how long a stream whose client lost its connection is held for the client to "
        "resume it (default 10; 0: closed at once; overrides frontend.resume_grace_s)",
    )


def port_number(text: str) -> int:
    """argparse ``type=``: 0..65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not in 0..65535")
    return value


@cli_main("physis-serve")
def main(argv: list[str] | None = None) -> int:
    tie_to_launcher()  # ends with the launcher that named itself in PHYSIS_PARENT_PID
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    check_flags_used(parser, args, torchrun=under_torchrun())
    if under_torchrun():  # torchrun: rank 0 serves over every rank, the others are workers
        ctx, spec = join_serving(args)  # worker ranks serve inside and never return
        code = serve_single_process(args, lambda resolved: build_dist(resolved, ctx), spec=spec)
        log.info("rank 0 done")
        exit_now(code)
    return serve_single_process(args)


if __name__ == "__main__":
    sys.exit(main())
