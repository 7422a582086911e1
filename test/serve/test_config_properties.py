"""Property-based tests of physis-serve's YAML configuration (hypothesis): any file and any
values end in a built config or a UsageError that names the section and key — never another
exception (a TypeError deep in a constructor, a NaN accepted) — and every number that is
accepted is finite."""

from __future__ import annotations

import math
from dataclasses import fields

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from physis_ros.cli_errors import UsageError
from physis_ros.serve.config import _LOOP_KEYS, SECTIONS, frontend_config, load_config
from physis_ros.serve.frontend_config import FrontendConfig, SessionLimits
from physis_ros.serve.spec import SECTIONS as SPEC_SECTIONS
from physis_ros.serve.spec import ServingSpec

PROPERTY = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# What YAML can produce for a value.
values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.lists(st.integers(0, 9), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
FRONTEND_KEYS = sorted(
    ({f.name for f in fields(FrontendConfig)} - {"limits"})
    | {f.name for f in fields(SessionLimits)}
    | set(_LOOP_KEYS)
)


def _finite_numbers(obj) -> bool:
    return all(
        math.isfinite(getattr(obj, f.name))
        for f in fields(obj)
        if isinstance(getattr(obj, f.name), float)
    )


@PROPERTY
@given(
    section=st.dictionaries(
        st.one_of(st.sampled_from(FRONTEND_KEYS), st.text(max_size=8)), values, max_size=5
    )
)
def test_any_frontend_section_is_built_or_refused_by_name(section):
    try:
        config = frontend_config(section, "serve.yaml: frontend")
    except ValueError as exc:  # UsageError is one; so are the dataclasses' own checks
        text = str(exc)
        assert isinstance(exc, UsageError) or any(key in text for key in section), text
        return
    assert _finite_numbers(config) and _finite_numbers(config.limits)


@PROPERTY
@given(name=st.sampled_from(sorted(SPEC_SECTIONS)), data=st.data())
def test_any_serving_spec_section_is_built_or_refused_by_name(name, data):
    """engine, placement, pool, distributed: what every rank is sent (before resolving)."""
    keys = st.one_of(st.sampled_from(SPEC_SECTIONS[name]), st.text(max_size=8))
    section = data.draw(st.dictionaries(keys, values, max_size=5))
    try:
        spec = ServingSpec.from_config({name: section})
    except ValueError as exc:
        text = str(exc)
        named = any(
            key in text or repr(key) in text or str(v) in text or repr(v) in text
            for key, v in section.items()
        )
        assert isinstance(exc, UsageError) or named, text
        return
    assert _finite_numbers(spec)


@PROPERTY
@given(text=st.one_of(st.text(max_size=200), st.builds(yaml.safe_dump, st.dictionaries(
    st.sampled_from([*SECTIONS, "other"]),
    st.one_of(values, st.dictionaries(st.sampled_from(FRONTEND_KEYS), values, max_size=3)),
    max_size=3,
))))  # fmt: skip
def test_any_yaml_file_loads_or_is_refused_as_a_usage_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("yaml") / "serve.yaml"
    path.write_text(text)
    try:
        config = load_config(path)
    except UsageError as exc:
        assert str(path) in str(exc)
        return
    assert set(config) <= set(SECTIONS)
    assert all(isinstance(section, dict) for section in config.values())
