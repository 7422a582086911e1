"""physis-eval's flags, one argument group per function, and which way of running reads which.

``physis_ros.eval.cli.build_parser`` adds the groups in the order ``--help`` lists them.
"""

from __future__ import annotations

import argparse

from physis_ros.cli_errors import finite_float
from physis_ros.eval.evaluate import EvalConfig


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The in-process engine and its model (also what --serve-local serves)."""
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--weights", default=None, help="safetensors checkpoint (default: the shipped push-wm)"
    )
    group.add_argument(
        "--model",
        default=None,
        help="model preset (default: from the checkpoint's metadata), or a model directory "
        "(upstream Wan or diffusers; its own weights, no --weights)",
    )
    group.add_argument("--vae", default=None, help="diffusers AutoencoderKLWan dir: the real codec")
    group.add_argument("--resolution", default=None, help="camera HxW of a model directory")
    group.add_argument("--latent-frames", type=int, default=None, help="latent frames per chunk")
    group.add_argument(
        "--prompts", action="append", default=None, help="prompt-embedding file (physis-embed)"
    )
    group.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"))
    group.add_argument(
        "--variant", default=None, help="weights variant of a model directory, e.g. fp16"
    )
    group.add_argument(
        "--random-weights", action="store_true", help="no checkpoint: random init (timing runs)"
    )
    group.add_argument("--steps", type=int, default=None, help="denoising steps K (default 4)")
    group.add_argument(
        "--window", type=int, default=None, help="attention window W (default: as trained)"
    )
    group.add_argument(
        "--shift", type=finite_float, default=None, help="schedule shift (default: as trained)"
    )
    group.add_argument(
        "--workers", type=int, default=1, help="pipeline workers (threads) in the engine"
    )
    group.add_argument(
        "--mode", default="pipelined", help="pipelined | sequential-noisy | sequential-clean"
    )


def add_window_arguments(parser: argparse.ArgumentParser) -> None:
    """How the bags are cut into windows and replayed."""
    group = parser.add_argument_group("windows")
    defaults = EvalConfig()
    group.add_argument(
        "--context-chunks",
        type=int,
        default=None,
        help="observed chunks per window (default: the model's window W, what a served "
        "stream's chunk reads)",
    )
    group.add_argument("--horizon-chunks", type=int, default=defaults.horizon_chunks)
    group.add_argument("--stride-chunks", type=int, default=defaults.window_stride_chunks)
    group.add_argument(
        "--max-windows",
        type=int,
        default=0,
        help="windows per bag (0: all); in process and over the link alike",
    )
    group.add_argument(
        "--max-seconds",
        type=finite_float,
        default=0.0,
        help="bag seconds used per bag, from its first frame (0: all); in process and over "
        "the link alike",
    )
    group.add_argument(
        "--frame-hz", type=finite_float, default=None, help="model frame rate (default: as trained)"
    )
    group.add_argument(
        "--realtime", action="store_true", help="feed context at the recorded timing"
    )
    group.add_argument(
        "--future-commands",
        action="store_true",
        help="in process: condition predicted chunks on the recorded commands that followed "
        "(no server knows them; default: the last observed command held, as served)",
    )
    group.add_argument("--seed", type=int, default=0, help="stream seed of the first window")


def add_topic_arguments(parser: argparse.ArgumentParser) -> None:
    """Which topics of a bag hold the images and the commands."""
    group = parser.add_argument_group("topics (default: the first topic of the right type)")
    group.add_argument("--image-topic", default=None)
    group.add_argument("--command-topic", default=None)


def add_link_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Where the physis-serve is and how to reach it; returns the group."""
    group = parser.add_argument_group("over the link (a physis-serve, live semantics)")
    where = group.add_mutually_exclusive_group()
    where.add_argument("--link", metavar="HOST:PORT", help="a running physis-serve")
    where.add_argument(
        "--serve-local",
        action="store_true",
        help="start a physis-serve child on 127.0.0.1 with the engine settings above",
    )
    group.add_argument("--token-file", default=None, help="bearer token for the server (file)")
    group.add_argument("--tls-ca", default=None, help="CA (PEM) of the server's certificate: TLS")
    group.add_argument("--tls-cert", default=None, help="client certificate (PEM), with --tls-key")
    group.add_argument("--tls-key", default=None, help="client private key (PEM)")
    group.add_argument("--tls-server-name", default=None, help="name the certificate is for")
    group.add_argument(
        "--connect-timeout", type=finite_float, default=5.0, help="seconds (default 5)"
    )
    group.add_argument(
        "--interval-ms",
        type=finite_float,
        default=0.0,
        help="target interval the stream asks for (default 0: as fast as the server can)",
    )
    group.add_argument(
        "--compare-in-process",
        action="store_true",
        help="after the live run, score the same windows in process with the engine settings "
        "above; the report gives live minus in process per horizon with its spread",
    )
    return group


def add_closed_loop_arguments(parser: argparse.ArgumentParser) -> None:
    """The closed loop: task, episodes, delays and how chunks are executed."""
    group = parser.add_argument_group(
        "closed loop (a world-action model drives the simulated robot)"
    )
    group.add_argument("--closed-loop", action="store_true", help="run episodes instead of bags")
    group.add_argument(
        "--task",
        default=None,
        help="simulated task: push or reach (default: the weights' task, else push)",
    )
    group.add_argument("--episodes", type=int, default=20, help="episodes per run (default 20)")
    group.add_argument(
        "--seed0", type=int, default=10_000, help="task seed of the first episode (held out)"
    )
    group.add_argument(
        "--delay-ms",
        type=finite_float,
        nargs="+",
        default=[0.0],
        help="response latencies to run at (ms; the control period is 50 ms)",
    )
    group.add_argument(
        "--modes",
        nargs="+",
        default=["crossfade", "replace", "naive"],
        choices=["crossfade", "replace", "naive"],
        help="execution: delay-aware with crossfade or replace joins, or naive (no delay handling)",
    )
    group.add_argument("--no-expert", action="store_true", help="skip the scripted expert's run")
    group.add_argument("--fade-rows", type=int, default=4, help="rows a crossfade spans")
    group.add_argument(
        "--known-rows-ahead",
        type=int,
        default=None,
        help="delay-aware runs tell the model at most this many committed rows past the newest "
        "frame (0: none; default: the weights' max_known_rows_ahead, what it was trained with)",
    )
    group.add_argument(
        "--min-committed-ms",
        type=finite_float,
        default=None,
        help="delay-aware runs commit the rows up to at least this long after the newest frame "
        "(told to the model, executed as planned), however soon the answer comes (default: the "
        "weights' min_committed_ms, as physis-serve does)",
    )
    group.add_argument(
        "--time-limit-s",
        type=finite_float,
        default=None,
        help="simulated seconds an episode may take to reach the goal (default: the task's)",
    )


def add_stream_request_arguments(group: argparse._ArgumentGroup) -> None:
    """What each stream over the link asks the server for."""
    group.add_argument(
        "--horizons",
        default="",
        help="comma-separated horizons (chunks ahead of the newest observation): each bag is "
        "streamed once per horizon, the stream asking for it (default: the model's)",
    )
    group.add_argument(
        "--rollouts",
        choices=("default", "on", "off"),
        default="default",
        help="on: every observation generates the whole horizon again, so one stream scores "
        "every horizon up to its own; off: only the slot h ahead (default: the server's, on "
        "for world models)",
    )
    group.add_argument(
        "--previews",
        action="store_true",
        help="streams ask for previews (x0 estimates after each denoising step): PSNR by step "
        "against the chunk and the recorded frames, and how much sooner they arrive",
    )


IN_PROCESS, LINK = "physis-eval in process", "physis-eval --link"
SERVE_LOCAL, CLOSED_LOOP = "physis-eval --serve-local", "physis-eval --closed-loop"
_ENGINE = {"weights", "steps", "window", "shift", "workers", "mode"}
_MODEL = {"model", "vae", "variant", "resolution", "latent_frames", "prompts", "dtype"}
_MODEL |= {"random_weights"}
_BAGS = {"bags", "context_chunks", "horizon_chunks", "stride_chunks", "max_windows", "frame_hz"}
_BAGS |= {"realtime", "seed", "image_topic", "command_topic"}
_CLIENT = {"token_file", "tls_ca", "tls_cert", "tls_key", "tls_server_name", "connect_timeout"}
_CLIENT |= {"interval_ms", "horizons", "rollouts"}
_CLOSED = {"task", "episodes", "seed0", "delay_ms", "modes", "no_expert", "fade_rows"}
_CLOSED |= {"known_rows_ahead", "min_committed_ms", "time_limit_s"}
FLAGS_USED = {
    IN_PROCESS: _ENGINE | _MODEL | _BAGS | {"future_commands"},
    LINK: _BAGS | _CLIENT | {"link"},
    SERVE_LOCAL: _ENGINE | _MODEL | _BAGS | _CLIENT | {"serve_local"},
    CLOSED_LOOP: _ENGINE | _CLOSED,
}
"""The flags each way of running reads; the others are refused by name (the server's engine
is not ours to set over --link; the closed loop runs the weights' own model)."""
