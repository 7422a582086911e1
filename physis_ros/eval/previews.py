"""Preview quality over the link (``physis-eval --previews``).

A stream opened with previews gets, before each chunk, its x0 estimate after every denoising
step k < K (``Prediction.preview_steps`` = k). Per step k this scores, over every chunk whose
preview and final version both came back: the preview against the chunk itself (PSNR, what a
robot acting on it sees of the chunk early), both against the recorded frames the chunk stands
for (PSNR), and how much sooner the preview arrived than the chunk (ms, the response latency
it gains). Means are over chunks, and per bag then over bags (``bag_mean``). No torch, no rclpy.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from physis_ros.eval.bag import Episode
from physis_ros.eval.metrics import psnr, summarize
from physis_ros.link.client import Prediction


def _frames_psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over the chunk's frames of the per-frame PSNR (dB)."""
    return float(np.mean([psnr(x, y) for x, y in zip(a, b, strict=True)]))


def score_previews(ep: Episode, previews: list[Prediction], chunks: list[Prediction]) -> dict:
    """step k -> {"vs_chunk_db", "vs_recorded_db", "chunk_vs_recorded_db", "earlier_ms"}: one
    value per chunk of this bag that has both (the chunk's own values repeated per step)."""
    final = {p.chunk_index: p for p in chunks if p.frames is not None}
    out: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for pv in previews:
        ch = final.get(pv.chunk_index)
        if ch is None or pv.frames is None or pv.frames.shape != ch.frames.shape:
            continue
        row = out[pv.preview_steps]
        row["vs_chunk_db"].append(_frames_psnr(pv.frames, ch.frames))
        row["earlier_ms"].append((ch.received_ns - pv.received_ns) / 1e6)
        first, f = ch.first_frame_seq, len(ch.frames)
        if first >= 0 and first + f <= len(ep.frames):
            recorded = ep.frames[first : first + f]
            row["vs_recorded_db"].append(_frames_psnr(pv.frames, recorded))
            row["chunk_vs_recorded_db"].append(_frames_psnr(ch.frames, recorded))
    return {k: dict(v) for k, v in out.items()}


def summarize_previews(per_bag: list[dict], steps: int | None) -> dict:
    """The report's ``link.previews``: per step, each measure summarised over chunks, and its
    mean of per-bag means (``bag_mean``)."""
    table: dict[str, dict] = {}
    for k in sorted({k for bag in per_bag for k in bag}):
        entry: dict[str, dict] = {}
        for name in ("vs_chunk_db", "vs_recorded_db", "chunk_vs_recorded_db", "earlier_ms"):
            pooled = [v for bag in per_bag for v in bag.get(k, {}).get(name, [])]
            means = [float(np.mean(bag[k][name])) for bag in per_bag if bag.get(k, {}).get(name)]
            entry[name] = {
                **summarize(pooled),
                "bag_mean": float(np.mean(means)) if means else None,
            }
        table[str(k)] = entry
    return {
        "steps": steps,
        "by_step": table,
        "what": "preview after k of K steps vs the chunk itself and vs the recorded frames "
        "(PSNR dB, mean over the chunk's frames), and ms it arrived before the chunk",
    }
