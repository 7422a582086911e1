"""GPU check of issue 20's engine-side fault handling (never part of CI: it needs CUDA).

    python benchmarks/gpu_faults_check.py     # prints one JSON object; exit 1 if a check fails

On the GPU: a device this machine lacks is refused by name (checked_device), a checkpoint
with a NaN tensor is refused naming the tensor, a local_engine on cuda reports its chunks
finite, and the same engine with a poisoned weight reports them non-finite (ChunkOutput.finite
False: the server never publishes them).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from physis_ros.cli_errors import UsageError
from physis_ros.engine.api import StreamSpec
from physis_ros.engine.core import EngineCore
from physis_ros.engine.devices import checked_device
from physis_ros.engine.threads import local_engine


def _chunks(engine: EngineCore, n: int) -> list:
    sid = engine.open_stream(StreamSpec(seed=1)).stream_id
    for _ in range(n):
        engine.submit_generate(sid)
    out, deadline = [], time.monotonic() + 120
    while len(out) < n and time.monotonic() < deadline:
        out += engine.poll(0.1)
    engine.close_stream(sid)
    return out


def main() -> int:
    result: dict = {"cuda": torch.cuda.is_available()}
    if not result["cuda"]:
        print(json.dumps({**result, "error": "CUDA is not available here"}))
        return 2
    count = torch.cuda.device_count()
    result["device_count"] = count
    checked_device("cuda")
    checked_device("cuda:0")
    try:
        checked_device(f"cuda:{count}")
        result["missing_device"] = "accepted (wrong)"
    except UsageError as exc:
        result["missing_device"] = str(exc)
    engine = local_engine("tiny", device="cuda")
    try:
        good = _chunks(engine, 3)
        result["finite_chunks"] = [c.finite for c in good]
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "w.safetensors"
            engine.model.save_safetensors(path)
            from safetensors.torch import load_file, save_file

            state = load_file(str(path))
            name = sorted(state)[2]
            state[name][..., 0] = float("nan")
            save_file(state, str(path))
            try:
                local_engine("tiny", device="cuda", checkpoint=str(path)).shutdown()
                result["nan_checkpoint"] = "accepted (wrong)"
            except UsageError as exc:
                result["nan_checkpoint"] = str(exc)
                result["nan_checkpoint_names_tensor"] = name in str(exc)
        with torch.no_grad():
            next(engine.model.parameters()).fill_(float("nan"))
        bad = _chunks(engine, 3)
        result["poisoned_chunks_finite"] = [c.finite for c in bad]
    finally:
        engine.shutdown()
    ok = (
        "accepted" not in result["missing_device"]
        and result["finite_chunks"] == [True] * 3
        and result.get("nan_checkpoint_names_tensor") is True
        and result["poisoned_chunks_finite"] == [False] * 3
    )
    result["ok"] = ok
    print(json.dumps(result))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
