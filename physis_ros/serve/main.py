"""`physis-serve`: the inference server.

Single-process mode (the default): an in-process engine, the EngineLoop thread and the gRPC
front end in one process. ``serve_single_process`` is that path; a torchrun mode (rank 0
runs the front end over a distributed engine) can call ``run_frontend`` with its own engine.
Parameters come from ``--config`` (YAML, section ``frontend`` and ``engine``); flags override.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from physis_ros.engine.api import StreamEngine
from physis_ros.serve.frontend import FrontendConfig, ServerDescription, start_server
from physis_ros.serve.session import EngineLoop, SessionLimits

log = logging.getLogger("physis-serve")

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "config" / "serve.yaml"
_LIMIT_KEYS = ("max_observation_bytes", "outbound_queue", "unattached_timeout_s", "stall_timeout_s")
_LOOP_KEYS = ("poll_timeout_s", "idle_wait_s")


def load_config(path: str | Path | None) -> dict[str, dict[str, Any]]:
    """The YAML file as {section: {key: value}} (empty sections when there is no file)."""
    if path is None:
        return {"frontend": {}, "engine": {}}
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of sections, got {type(data).__name__}")
    for section in ("frontend", "engine"):
        data.setdefault(section, {})
        if not isinstance(data[section], dict):
            raise ValueError(f"{path}: section {section!r} must be a mapping")
    return data


def frontend_config(section: dict[str, Any], **overrides: Any) -> FrontendConfig:
    """FrontendConfig from the YAML ``frontend`` section plus non-None overrides."""
    values = {**section, **{k: v for k, v in overrides.items() if v is not None}}
    limits = SessionLimits(**{k: values.pop(k) for k in _LIMIT_KEYS if k in values})
    for key in _LOOP_KEYS:
        values.pop(key, None)
    known = set(FrontendConfig.__dataclass_fields__)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(
            f"unknown frontend keys {unknown}; known: {sorted(known | set(_LIMIT_KEYS))}"
        )
    return FrontendConfig(limits=limits, **values)


def build_local_engine(engine_section: dict[str, Any]) -> tuple[StreamEngine, ServerDescription]:
    """The in-process engine described by the YAML ``engine`` section (LocalEngine's keyword
    arguments: model, steps, window, workers, mode, max_streams, checkpoint, ...); a preset
    with shipped weights gets them (``physis_ros.weights.SHIPPED``) unless it names its own."""
    from physis_ros.engine.local import LocalEngine
    from physis_ros.weights import shipped_engine_defaults

    # A preset with shipped weights (push-wm) is served with them, at the window and schedule
    # it was trained for; keys the section sets explicitly win.
    engine_section = {**shipped_engine_defaults(engine_section.get("model")), **engine_section}
    engine = LocalEngine(**engine_section)

    def engine_info() -> dict[str, Any]:
        return {
            "kind": "LocalEngine",
            "mode": engine.mode,
            "workers": engine.workers,
            "open_streams": len(engine.runtime.controller.streams),
            "max_streams": engine.max_streams,
            "block_ms": f"{engine.block_ms:.3f}",
            "prompts": ",".join(engine.prompts.names()),
        }

    return engine, ServerDescription(
        model=engine.cfg.name,
        steps=engine.sampler.steps,
        blocks=engine.cfg.num_blocks,
        placement=str(engine.runtime.placement),
        action_mode=engine.cfg.action_mode,
        horizon=engine.horizon,
        engine_info=engine_info,
    )


def run_frontend(
    engine: StreamEngine,
    description: ServerDescription,
    config: FrontendConfig,
    *,
    port_file: str | None,
    stop: threading.Event,
    loop_options: dict[str, float] | None = None,
) -> int:
    """Serves ``engine`` until ``stop`` is set; writes the bound port to ``port_file``."""
    loop = EngineLoop(
        engine,
        generate_with_actions=description.action_mode == "condition",
        **(loop_options or {}),
    )
    loop.start()
    handle = start_server(loop, config=config, description=description)
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
    try:
        if port_file:
            # Written atomically: a reader never sees a half-written number.
            directory = os.path.dirname(os.path.abspath(port_file))
            with tempfile.NamedTemporaryFile("w", dir=directory, delete=False) as f:
                f.write(f"{handle.port}\n")
            os.replace(f.name, port_file)
        stop.wait()
    finally:
        log.info("shutting down")
        handle.stop()
        loop.stop()
        engine.shutdown()
    return 0


def serve_single_process(
    args: argparse.Namespace,
    engine_factory: Callable[[dict[str, Any]], tuple[StreamEngine, ServerDescription]]
    | None = None,
) -> int:
    """physis-serve with an in-process engine, until SIGINT / SIGTERM."""
    cfg = load_config(args.config)
    engine_section = model_section(cfg["engine"], args)
    frontend_section = dict(cfg["frontend"])
    loop_options = {k: float(frontend_section[k]) for k in _LOOP_KEYS if k in frontend_section}
    token = args.token
    if args.token_file:
        token = Path(args.token_file).read_text().strip()
    config = frontend_config(
        frontend_section,
        host=args.host,
        port=args.port,
        token=token,
        tls_cert_path=args.tls_cert,
        tls_key_path=args.tls_key,
        tls_client_ca_path=args.tls_client_ca,
    )
    if engine_factory is None:
        engine_factory = (
            _factory_from_name(args.engine_factory) if args.engine_factory else build_local_engine
        )
    engine, description = engine_factory(engine_section)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda _signum, _frame: stop.set())
    return run_frontend(
        engine, description, config, port_file=args.port_file, stop=stop, loop_options=loop_options
    )


MODEL_FLAGS = ("model", "dtype", "vae", "resolution", "latent_frames")
"""Flags that override the YAML ``engine`` section's keys of the same name."""


def model_section(engine: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The YAML ``engine`` section with the model flags (and ``--prompts``) applied."""
    section = dict(engine)
    for key in MODEL_FLAGS:
        if getattr(args, key, None) is not None:
            section[key] = getattr(args, key)
    if getattr(args, "prompts", None):
        section["prompts"] = [*section.get("prompts", []), *args.prompts]
    return section


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
        raise ValueError(f"--engine-factory must be module:function, got {spec!r}")
    return getattr(importlib.import_module(module), name)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="physis-serve", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config",
        # A pip-installed server has no config/ beside it: built-in defaults then.
        default=str(DEFAULT_CONFIG) if DEFAULT_CONFIG.exists() else None,
        help="YAML parameters (default: config/serve.yaml of the source tree, if present)",
    )
    add_model_arguments(parser)
    parser.add_argument("--host", default=None, help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port; 0 = ephemeral")
    parser.add_argument("--port-file", default=None, help="write the bound port here once serving")
    parser.add_argument("--token", default=None, help="bearer token every call must carry")
    parser.add_argument("--token-file", default=None, help="read the bearer token from a file")
    parser.add_argument("--tls-cert", default=None, help="server certificate chain (PEM)")
    parser.add_argument("--tls-key", default=None, help="server private key (PEM)")
    parser.add_argument(
        "--tls-client-ca",
        default=None,
        help="CA (PEM) that client certificates must chain to; requires them",
    )
    parser.add_argument(
        "--engine-factory",
        default=None,
        help="module:function(engine_section) -> (engine, ServerDescription), "
        "to serve another StreamEngine",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's own choice)",
    )
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    try:
        from physis_ros.serve.dist.serve import serve_torchrun, under_torchrun

        if under_torchrun():  # torchrun: rank 0 serves over a DistEngine, others are workers
            return serve_torchrun(args)
        return serve_single_process(args)
    except (ValueError, OSError) as exc:
        log.error("%s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
