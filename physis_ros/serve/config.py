"""physis-serve's configuration: the YAML file's sections, the front end's settings and the
serving spec, from the file and the flags that override it, checked before anything loads.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from physis_ros.cli_errors import CliError, UsageError, check_fields, refuse_unused_flags
from physis_ros.engine.config import PRESETS
from physis_ros.engine.models import RANDOM_WEIGHTS
from physis_ros.engine.weight_files import FLAGS_BY_MODEL_KIND, MODEL_DIRECTORY, NOT_A_DIRECTORY
from physis_ros.serve import listen
from physis_ros.serve.frontend_config import FrontendConfig, SessionLimits
from physis_ros.serve.spec import LEGACY_KEYS, ServingSpec
from physis_ros.serve.spec import SECTIONS as SPEC_SECTIONS

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "config" / "serve.yaml"
_LOOP_KEYS = ("poll_timeout_s", "idle_wait_s")


SECTIONS = ("frontend", "engine", "placement", "pool", "distributed")


def load_config(path: str | Path | None) -> dict[str, dict[str, Any]]:
    """The YAML file as {section: {key: value}} (empty sections when there is no file)."""
    if path is None:
        return {"frontend": {}, "engine": {}}
    with open(path) as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as exc:
            raise UsageError(
                f"{path} is not valid YAML: {exc}", "correct the file at the line named"
            ) from exc
    if not isinstance(data, dict):
        raise UsageError(
            f"{path}: expected a mapping of sections, got {type(data).__name__}",
            f"write sections {', '.join(SECTIONS)} at the top level (see config/serve.yaml)",
        )
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise UsageError(
            f"{path}: unknown section(s) {unknown}", f"known sections: {', '.join(SECTIONS)}"
        )
    for section in SECTIONS:
        if data.get(section) is None:
            data[section] = {}
        if not isinstance(data[section], dict):
            raise UsageError(
                f"{path}: section {section!r} must be a mapping of key: value",
                "see config/serve.yaml",
            )
    return data


def frontend_config(
    section: dict[str, Any], where: str = "frontend", **overrides: Any
) -> FrontendConfig:
    """FrontendConfig from the YAML ``frontend`` section plus non-None overrides; every key
    and value checked (type, finiteness, range) before anything is built, those that an
    override replaces too (``_overridden_checked``)."""
    given = {k: v for k, v in overrides.items() if v is not None}
    config = _frontend({**section, **given}, where)
    _overridden_checked(section, given, where, lambda kept: _frontend({**section, **kept}, where))
    return config


def _overridden_checked(
    filed: dict[str, Any],
    given: dict[str, Any],
    where: str,
    build: Callable[[dict], Any],
    sections: dict[str, str] | None = None,
) -> None:
    """A value of the file that a flag overrides is never used, but it is checked: the
    config built as if that one flag were not given (``build`` of the other overrides) must
    be valid. Raises UsageError naming the file's key (``where``: the file and section, or
    the file and ``sections``: key -> "section.") and value."""
    for key in sorted(set(given) & set(filed)):
        try:
            build({k: v for k, v in given.items() if k != key})
        except ValueError as err:
            problem = err.problem if isinstance(err, UsageError) else str(err)
            name = (sections or {}).get(key, "") + key
            raise UsageError(
                f"{where}: {name} {filed[key]!r} is not valid, though a flag overrides it: "
                + problem.removeprefix(f"{where}: "),
                "correct or remove it in the file: every value the file holds is checked",
            ) from err


def _frontend(values: dict[str, Any], where: str) -> FrontendConfig:
    values = dict(values)
    limit_keys = [f for f in SessionLimits.__dataclass_fields__ if f in values]
    limits_values = {k: values.pop(k) for k in limit_keys}
    loop_values = {k: values.pop(k) for k in _LOOP_KEYS if k in values}
    for key, value in loop_values.items():
        check_fields(_LoopOptions, {key: value}, where)
    check_fields(SessionLimits, limits_values, where)
    values.pop("limits", None)
    known = set(FrontendConfig.__dataclass_fields__) - {"limits"}
    unknown = sorted(set(values) - known)
    if unknown:
        raise UsageError(
            f"{where}: unknown key(s) {unknown}",
            "remove or correct them; known keys: "
            + ", ".join(sorted(known | set(SessionLimits.__dataclass_fields__) | set(_LOOP_KEYS))),
        )
    check_fields(FrontendConfig, values, where)
    return FrontendConfig(limits=SessionLimits(**limits_values), **values)


@dataclass(frozen=True)
class _LoopOptions:
    """The EngineLoop's options in the ``frontend`` section (checked like the others)."""

    poll_timeout_s: float = 0.002
    idle_wait_s: float = 0.02


def serving_spec(args: argparse.Namespace, config: dict[str, dict[str, Any]]) -> ServingSpec:
    """The spec from the YAML sections and the flags that override them (not resolved);
    the file's values that a flag overrides are checked too (``_overridden_checked``)."""
    model, weights = args.model, args.weights
    if weights and weights != "random" and model is None:
        model, weights = weights, None  # a physis-train file names its model in its metadata
    flags = dict(
        model=model,
        weights=weights,
        plan=args.plan,
        policy=args.policy,
        default_target_ms=args.default_target_ms,
        dtype=args.dtype,
        vae=args.vae,
        variant=args.variant,
        resolution=args.resolution,
        latent_frames=args.latent_frames,
        known_rows_ahead=args.known_rows_ahead,
    )
    given = {k: v for k, v in flags.items() if v is not None}
    spec = ServingSpec.from_config(config, **given)
    filed = _spec_values(config)
    where = str(args.config) if getattr(args, "config", None) else "config"
    _overridden_checked(
        filed, given, where, lambda kept: ServingSpec.from_config(config, **kept), _SECTION_OF
    )
    for key in sorted(set(given) & set(filed) & set(_PATHS)):
        if filed[key] not in _PATHS[key] and not Path(str(filed[key])).exists():
            raise UsageError(
                f"{where}: {_SECTION_OF[key]}{key} {filed[key]!r} is neither {_PATHS_TEXT[key]} "
                "nor a path that exists, though a flag overrides it",
                "correct or remove it in the file: every value the file holds is checked",
            )
    if getattr(args, "prompts", None):  # added to the file's, as --prompts says
        spec = dataclasses.replace(spec, prompts=(*spec.prompts, *args.prompts))
    return spec


_SECTION_OF = {name: f"{section}." for section, names in SPEC_SECTIONS.items() for name in names}
"""How the file names a spec field (``engine.dtype``); a front end key needs no section: its
``where`` names it."""
_PATHS = {"model": set(PRESETS), "weights": {"", RANDOM_WEIGHTS}, "vae": {""}}
"""Keys whose value is a file or directory, and the values that are not."""
_PATHS_TEXT = {"model": "a preset", "weights": "'' or 'random'", "vae": "''"}


def _spec_values(config: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The spec's fields that the file's sections set (older key names as the fields they
    now set)."""
    return {
        LEGACY_KEYS.get((section, key), key): value
        for section, body in config.items()
        if section != "frontend"
        for key, value in (body or {}).items()
    }


def checked_frontend(
    args: argparse.Namespace, cfg: dict[str, dict[str, Any]]
) -> tuple[FrontendConfig, dict[str, float]]:
    """The front end's config and the engine loop's options from the file and the flags,
    with what can be checked before the engine loads (minutes for a large model) checked:
    every key and value, the host resolves, the port is free, the TLS files are PEM and the
    key is the certificate's. Raises UsageError (or OSError) naming what is wrong."""
    frontend_section = dict(cfg["frontend"])
    token = args.token
    if args.token_file:
        token = Path(args.token_file).read_text().strip()
    config = frontend_config(
        frontend_section,
        f"{args.config}: frontend" if args.config else "frontend",
        host=args.host,
        port=args.port,
        token=token,
        tls_cert_path=args.tls_cert,
        tls_key_path=args.tls_key,
        tls_client_ca_path=args.tls_client_ca,
        metrics_port=args.metrics_port,
        resume_grace_s=args.resume_grace_s,
    )
    listen.check_address(config.host, config.port)
    if args.metrics_port_file and config.metrics_port is None:
        raise UsageError(
            "--metrics-port-file without a metrics port",
            "add --metrics-port (0: any free port) or set frontend.metrics_port",
        )
    if config.metrics_port:
        try:
            listen.check_address(config.host, config.metrics_port)
        except CliError as exc:
            raise type(exc)(
                f"metrics port: {exc.problem}",
                "choose another --metrics-port / frontend.metrics_port (0: any free port, "
                "see --metrics-port-file)",
            ) from exc
    if config.tls_cert_path is not None:
        listen.tls_credentials(config.tls_cert_path, config.tls_key_path, config.tls_client_ca_path)
    loop_options = {k: float(frontend_section[k]) for k in _LOOP_KEYS if k in frontend_section}
    return config, loop_options


MODEL_FLAGS = ("model", "dtype", "vae", "variant", "resolution", "latent_frames")
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


OWN_ENGINE = "physis-serve's own engine (one process)"
FACTORY = "physis-serve --engine-factory (one process)"
TORCHRUN = "physis-serve under torchrun"
_OWN_ENGINE_FLAGS = {"weights", "plan", "policy", "default_target_ms", "known_rows_ahead"}
_OWN_ENGINE_FLAGS |= {"threads"}
FLAGS_BY_ENGINE = {
    OWN_ENGINE: _OWN_ENGINE_FLAGS,
    TORCHRUN: _OWN_ENGINE_FLAGS,
    FACTORY: {"engine_factory"},
}
"""What each way of serving reads: another engine reads only the model flags (its engine
section); under torchrun the ranks are the engine."""
COMMITTED_ROWS = "a world-action model with committed actions"
FLAGS_BY_ACTIONS = {COMMITTED_ROWS: {"known_rows_ahead"}}


def check_flags_used(
    parser: argparse.ArgumentParser, args: argparse.Namespace, *, torchrun: bool
) -> None:
    """Refuses a flag that the chosen way of serving, or the chosen model, does not use
    (``cli_errors.refuse_unused_flags``); what is wrong with the config or the model itself
    is named where the spec is built (under torchrun by rank 0, for every rank)."""
    mode = TORCHRUN if torchrun else FACTORY if args.engine_factory else OWN_ENGINE
    refuse_unused_flags(parser, args, mode, FLAGS_BY_ENGINE)
    if mode == FACTORY:  # the factory reads the engine section as it likes
        return
    try:
        spec = serving_spec(args, load_config(args.config))
    except (ValueError, OSError):
        return
    kind = MODEL_DIRECTORY if spec.model_directory else NOT_A_DIRECTORY
    refuse_unused_flags(parser, args, kind, FLAGS_BY_MODEL_KIND)
    given = [d for d in FLAGS_BY_ACTIONS[COMMITTED_ROWS] if getattr(args, d) is not None]
    if not given:  # resolved only for a flag that depends on the model's actions
        return
    try:
        cfg = spec.resolve().model_config
    except (ValueError, OSError):
        return
    if not cfg.committed_actions:
        actions = f"{cfg.name}, a model without committed actions"
        refuse_unused_flags(parser, args, actions, {**FLAGS_BY_ACTIONS, actions: set()})
