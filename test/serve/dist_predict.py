"""Test helper, run by torchrun (test_serve_weights.py): joins the job as physis-serve does
(rank 0 resolves the serving spec and sends it as JSON; every rank loads its blocks strictly),
then rank 0 runs ``observed_plan`` on the engine core over every rank and writes each
generated chunk's final state to OUT (.npz).

Usage: torchrun --nproc-per-node N test/serve/dist_predict.py [physis-serve flags] OUT
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from stream_plans import observed_plan

from physis_ros.engine.api import StreamSpec
from physis_ros.engine.ranks.executor import ranks_engine
from physis_ros.engine.ranks.runtime import exit_now
from physis_ros.serve.main import parse_args
from physis_ros.serve.torchrun_main import join_serving

SEED = 7


def main() -> int:
    args = parse_args(sys.argv[1:-1])
    out = sys.argv[-1]
    ctx, spec = join_serving(args)  # the other ranks serve inside and exit there
    engine = ranks_engine(spec.runtime_config(ctx.world_size), ctx)
    try:
        # no prompt: the model's empty prompt (push-wm: the conditioning it was trained with)
        sid = engine.open_stream(StreamSpec(seed=SEED)).stream_id
        expected = 0
        for kind, value in observed_plan(spec.model_config, seed=1, pairs=4):
            if kind == "context":
                engine.submit_context_x(sid, value)
            else:
                engine.submit_generate(sid, None if value is None else value.numpy())
                expected += 1
        got: dict[str, np.ndarray] = {}
        deadline = time.monotonic() + 120
        while len(got) < expected and time.monotonic() < deadline:
            for res in engine.poll_results(0.2):
                got[str(res.chunk)] = res.x.float().cpu().numpy()
        np.savez(out, **got)
    finally:
        engine.shutdown()
    exit_now(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
