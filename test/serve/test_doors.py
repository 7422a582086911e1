"""physis-serve refuses, at the start and in one line naming the culprit, what used to pass
unseen or end in an internal error: a config value a flag overrides, a flag the chosen way of
serving or the chosen model does not use, and a model whose first stream does not fit the
memory (estimated before anything loads). Typed as a user would, through ``main``."""

from __future__ import annotations

import pytest

from physis_ros.engine.checkpoints import resolve_model_config
from physis_ros.engine.config import SamplerConfig, get_preset
from physis_ros.engine.pool import footprint
from physis_ros.engine.pool.memory import MemoryModel
from physis_ros.serve import build
from physis_ros.serve import main as serve_main

FIX_FILE = "every value the file holds is checked"


def _serve(capsys, *argv: str) -> tuple[int, str]:
    """(exit status, the one error line) of physis-serve's main."""
    try:
        code = serve_main.main(list(argv))
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    return code, lines[0]


@pytest.fixture
def nothing_loads(monkeypatch):
    """Fails the test if physis-serve got as far as building its engine."""

    def never(*_args, **_kwargs):
        raise AssertionError("the engine was built")

    monkeypatch.setattr(serve_main, "build_local", never)


@pytest.mark.parametrize(
    ("yaml_text", "flags", "words"),
    [
        ("frontend: {port: 70000}\n", ["--port", "0"], "frontend: port 70000 is not valid"),
        ("frontend: {port: abc}\n", ["--port", "0"], "frontend: port 'abc' is not valid"),
        ("frontend: {host: 7}\n", ["--host", "127.0.0.1"], "frontend: host 7 is not valid"),
        ("engine: {model: tiny, dtype: float64}\n", ["--dtype", "float32"],
         "engine.dtype 'float64' is not valid, though a flag overrides it"),
        ("placement: {plan: spiral}\n", ["--plan", "even"], "placement.plan 'spiral'"),
        ("pool: {policy: greedy}\n", ["--policy", "shared"], "pool.policy 'greedy'"),
        ("pool: {default_target_ms: -5}\n", ["--default-target-ms", "100"],
         "pool.default_target_ms -5 is not valid"),
        ("engine: {latent_frames: -1}\n", ["--latent-frames", "2"], "engine.latent_frames -1"),
        ("engine: {known_rows_ahead: -2}\n", ["--known-rows-ahead", "1"],
         "engine.known_rows_ahead -2"),
        ("engine: {model: tinyy}\n", [], "engine.model 'tinyy' is neither a preset nor a path"),
        ("engine: {weights: /no/such.safetensors}\n", ["--weights", "random"],
         "engine.weights '/no/such.safetensors' is neither"),
        ("distributed: {threads: 0}\n", ["--threads", "2"], "threads must be >= 1, got 0"),
        ("engine: {model: tiny, dtpye: float32}\n", ["--dtype", "float32"],
         "unknown engine key 'dtpye'"),
    ],
)  # fmt: skip
@pytest.mark.usefixtures("nothing_loads")
def test_a_config_value_a_flag_overrides_is_still_checked(
    capsys, tmp_path, yaml_text, flags, words
):
    path = tmp_path / "serve.yaml"
    path.write_text(yaml_text)
    code, line = _serve(capsys, "--config", str(path), "--model", "tiny", "--port", "0", *flags)
    assert code == 2, line
    assert words in line, line
    if "a flag overrides it" in words:
        assert str(path) in line and FIX_FILE in line


def test_the_overridden_values_that_are_valid_still_serve_the_flags(tmp_path):
    """A file whose overridden values are valid builds the spec and front end of the flags."""
    from physis_ros.serve.config import checked_frontend, load_config, serving_spec

    path = tmp_path / "serve.yaml"
    path.write_text("frontend: {port: 7}\nengine: {model: push-wm, dtype: bfloat16}\n")
    args = serve_main.parse_args(["--config", str(path), "--model", "tiny", "--port", "0"])
    cfg = load_config(path)
    assert serving_spec(args, cfg).model == "tiny"
    assert checked_frontend(args, cfg)[0].port == 0


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--engine-factory", "link_fake_engine:make", "--plan", "even"],
         "--plan is not used by physis-serve --engine-factory (one process): it applies to "
         "physis-serve's own engine (one process) or physis-serve under torchrun"),
        (["--engine-factory", "link_fake_engine:make", "--threads", "2"],
         "--threads is not used by physis-serve --engine-factory"),
        (["--model", "tiny", "--variant", "fp16"], "--variant is not used by a preset or a "
         "physis-train weights file: it applies to a model directory"),
        (["--model", "push-wm", "--known-rows-ahead", "2"], "--known-rows-ahead is not used by "
         "push-wm, a model without committed actions: it applies to a world-action model"),
        (["--model", "tiny", "--token", "t", "--token-file", "f"],
         "argument --token-file: not allowed with argument --token"),
    ],
)  # fmt: skip
def test_a_flag_the_server_does_not_use_is_refused_by_name(capsys, nothing_loads, argv, words):
    code, line = _serve(capsys, "--port", "0", *argv)
    assert code == 2, line
    assert words in line, line


def test_engine_factory_under_torchrun_is_refused(capsys, monkeypatch):
    monkeypatch.setattr(serve_main, "under_torchrun", lambda: True)
    monkeypatch.setattr(serve_main, "join_serving", lambda _args: pytest.fail("joined the job"))
    code, line = _serve(capsys, "--engine-factory", "link_fake_engine:make")
    assert code == 2 and "--engine-factory is not used by physis-serve under torchrun" in line


def test_a_model_whose_first_stream_does_not_fit_is_refused_before_loading(
    capsys, tmp_path, nothing_loads
):
    path = tmp_path / "serve.yaml"
    path.write_text("pool: {memory_gib: 0.0005}\n")  # 0.5 MiB per worker, given by hand
    code, line = _serve(
        capsys, "--config", str(path), "--model", "tiny", "--resolution", "256x256", "--port", "0"
    )
    assert code == 2, line
    for words in (
        "model tiny at 256x256 with window 2 needs",
        "weights",
        "KV slots",
        "block activations",
        "for one stream; pool.memory_gib 0.0005 GiB per worker is 524.3 KiB",
        "what fits: ",
        "(fix: serve what fits (--resolution",
    ):
        assert words in line, line
    # the resolution it names fits, one step larger would not
    fits = line.split("what fits: ")[1].split(" (fix")[0]
    size, _, rest = fits.partition(" ")
    assert rest == "at window 2", fits
    h, w = (int(v) for v in size.split("x"))
    cfg = resolve_model_config("tiny", resolution=size)
    unit = cfg.codec_stride[1] * cfg.patch[1]
    larger = resolve_model_config("tiny", resolution=f"{h + unit}x{w + unit}")
    sampler, memory = SamplerConfig(steps=4, window=2), MemoryModel(dtype_bytes=4)
    available = 0.0005 * 1024**3
    assert footprint.one_stream(cfg, sampler, memory).total <= available
    assert footprint.one_stream(larger, sampler, memory).total > available


def test_the_measured_memory_is_what_the_check_compares(capsys, monkeypatch, nothing_loads):
    monkeypatch.setattr(build, "available_bytes", lambda _device: 64 * 1024)  # 64 KiB free
    code, line = _serve(capsys, "--model", "tiny", "--port", "0")
    assert code == 2, line
    assert "the share of the available memory of cpu a worker plans with is 51.2 KiB" in line
    assert "the weights alone do not fit" in line, line


def test_the_estimate_is_the_pools_own_and_what_fits_fits():
    cfg = get_preset("tiny")
    sampler = SamplerConfig(steps=4, window=3)
    memory = MemoryModel(dtype_bytes=4)
    need = footprint.one_stream(cfg, sampler, memory)
    assert need.usage.kv == cfg.num_blocks * sampler.steps * memory.stage_kv_bytes(cfg, sampler)
    assert need.usage.weights == cfg.num_params() * 4 and need.scores == 0
    with_scores = footprint.one_stream(cfg, sampler, memory, scores=True)
    n = cfg.tokens_per_chunk
    assert with_scores.scores == 2 * cfg.num_heads * n * (sampler.window + 1) * n * 4
    two = footprint.one_stream(cfg, sampler, memory, workers=2)
    assert two.usage.kv == need.usage.kv // 2  # the busiest of two workers: half the stages
    # just below what window 3 needs: window 2 is named as what fits
    available = need.total - 1
    smaller = footprint.one_stream(cfg, SamplerConfig(steps=4, window=2), memory).total
    assert smaller <= available
    with pytest.raises(ValueError, match=r"what fits: window 2 at 16x16") as err:
        footprint.check_one_stream_fits(
            cfg, sampler, memory, available=available, where="here", fix="less"
        )
    assert err.value.fix == "less"
