"""physis-serve's configuration: the YAML file's sections, the front end's settings and the
serving spec, from the file and the flags that override it, checked before anything loads.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from physis_ros.cli_errors import UsageError, check_fields
from physis_ros.serve import listen
from physis_ros.serve.frontend import FrontendConfig
from physis_ros.serve.session import SessionLimits
from physis_ros.serve.spec import ServingSpec

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
    and value checked (type, finiteness) before anything is built."""
    values = {**section, **{k: v for k, v in overrides.items() if v is not None}}
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
    """The spec from the YAML sections and the flags that override them (not resolved)."""
    model, weights = args.model, args.weights
    if weights and weights != "random" and model is None:
        model, weights = weights, None  # a physis-train file names its model in its metadata
    spec = ServingSpec.from_config(
        config,
        model=model,
        weights=weights,
        plan=args.plan,
        policy=args.policy,
        default_target_ms=args.default_target_ms,
        dtype=args.dtype,
        vae=args.vae,
        resolution=args.resolution,
        latent_frames=args.latent_frames,
        known_rows_ahead=args.known_rows_ahead,
    )
    if getattr(args, "prompts", None):  # added to the file's, as --prompts says
        spec = dataclasses.replace(spec, prompts=(*spec.prompts, *args.prompts))
    return spec


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
        resume_grace_s=args.resume_grace_s,
    )
    listen.check_address(config.host, config.port)
    if config.tls_cert_path is not None:
        listen.tls_credentials(config.tls_cert_path, config.tls_key_path, config.tls_client_ca_path)
    loop_options = {k: float(frontend_section[k]) for k in _LOOP_KEYS if k in frontend_section}
    return config, loop_options


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
