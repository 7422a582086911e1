"""physis-serve --model PATH: a diffusers Wan directory (random tiny weights), the real Wan VAE
codec (random tiny) and a prompt by name, served in one process and under torchrun (2 gloo
ranks); the predictions a robot client receives equal an in-process engine's on the same
chunks, prompt and seed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from wan_fixtures import make_diffusers_wan, make_vae

from physis_ros.engine.api import StreamSpec
from physis_ros.engine.prompts import write_prompts
from physis_ros.engine.threads import local_engine

REPO_ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).parent / "torchrun"
CONFIG = """
engine: {steps: 3, window: 2}
distributed: {heartbeat_interval_s: 0.2, fault_timeout_s: 10.0, comm_timeout_s: 60.0}
"""
MODEL_FLAGS = ["--resolution", "32x32", "--latent-frames", "2"]
SIZE = 32
PREDICTIONS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("byo")
    make_diffusers_wan(root)
    make_vae(root)
    gen = torch.Generator().manual_seed(5)
    write_prompts(
        root / "prompts.safetensors",
        {"pick": torch.randn(5, 16, generator=gen), "empty": torch.randn(1, 16, generator=gen)},
        texts={"pick": "a robot arm picks up the red cube", "empty": ""},
        encoder="test",
        text_len=512,
    )
    (root / "serve.yaml").write_text(CONFIG)
    return root


def _image() -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)


def _serve(root: Path, tmp_path: Path, ranks: int):
    port_file = tmp_path / "port"
    args = [
        "-m", "physis_ros.serve.main", "--config", str(root / "serve.yaml"),
        "--model", str(root), "--vae", str(root / "vae"), *MODEL_FLAGS,
        "--prompts", str(root / "prompts.safetensors"),
        "--port", "0", "--port-file", str(port_file), "--threads", "1",
    ]  # fmt: skip
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", str(ranks), *args]
    if ranks == 1:
        cmd = [sys.executable, *args]
    pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath)
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 - closed by the caller
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log.close()
            raise AssertionError((tmp_path / "serve.log").read_text(errors="replace")[-4000:])
        time.sleep(0.2)
    return proc, log, int(port_file.read_text())


def _predictions(port: int, model: str) -> dict[int, np.ndarray]:
    from physis_ros.link.client import CameraImage, LinkClient, Observation

    client = LinkClient(f"127.0.0.1:{port}", seed=3, prompt="pick")
    client.start()
    image = CameraImage(
        encoding="rgb8", height=SIZE, width=SIZE, step=SIZE * 3, data=_image().tobytes()
    )
    got: dict[int, np.ndarray] = {}
    seq, deadline = 0, time.monotonic() + 240
    try:
        while len(got) < PREDICTIONS and time.monotonic() < deadline:
            seq += 1
            client.send_observation(
                Observation(seq=seq, capture_stamp_ns=time.time_ns(), image=image)
            )
            pred = client.get_prediction(0.3)
            if pred is not None:
                got[pred.chunk_index] = pred.frames
        assert client.stats().promise.model == model
    finally:
        client.close()
    assert len(got) == PREDICTIONS, client.stats()
    return got


def _reference(root: Path, got: dict[int, np.ndarray], prompt: str) -> dict[int, np.ndarray]:
    """The same chunks through an in-process engine on the live timeline the server ran
    (DESIGN.md §3.1, horizon 1): slot c - 1's observation (its frames, all the same image),
    then slot c generated, for every slot up to the last one predicted."""
    engine = local_engine(
        str(root), steps=3, window=2, vae=str(root / "vae"), resolution="32x32", latent_frames=2,
        prompts=[str(root / "prompts.safetensors")],
    )  # fmt: skip
    try:
        sid = engine.open_stream(StreamSpec(seed=3, prompt=prompt, horizon=1)).stream_id
        frames = np.repeat(_image()[None], engine.cfg.frames_per_chunk, axis=0)
        for c in range(1, max(got) + 1):
            engine.submit_context(sid, frames, slot=c - 1)
            engine.submit_generate(sid)
        out: dict[int, np.ndarray] = {}
        deadline = time.monotonic() + 120
        while len(out) < len(got) and time.monotonic() < deadline:
            out.update({o.chunk: o.frames for o in engine.poll(0.2)})
        return out
    finally:
        engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize(
    "ranks",
    [
        1,
        pytest.param(
            2, marks=pytest.mark.skipif(not TORCHRUN.exists(), reason="no torchrun in this venv")
        ),
    ],
)
def test_served_model_dir_equals_in_process_engine(model_dir, tmp_path, ranks):
    proc, log, port = _serve(model_dir, tmp_path, ranks)
    try:
        got = _predictions(port, model_dir.name)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
    text = (tmp_path / "serve.log").read_text(errors="replace")
    assert "diffusers layout" in text and "wan_vae" in text  # the summary at load
    ref = _reference(model_dir, got, "pick")
    assert sorted(ref) == sorted(got)
    unprompted = _reference(model_dir, got, "")  # the prompt reaches the model
    assert any(not np.array_equal(unprompted[c], ref[c]) for c in got)
    worst = 0
    for c, frames in got.items():
        assert frames.shape == ref[c].shape == (8, SIZE, SIZE, 3)
        worst = max(worst, int(np.abs(frames.astype(int) - ref[c].astype(int)).max()))
    print(f"{ranks} rank(s): chunks {sorted(got)}, max |served - in-process| = {worst} levels")
    assert worst <= 1  # float rounding across batch shapes may move a pixel by one level
