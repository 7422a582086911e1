"""Live minus in process on the same windows: paired differences per horizon, with their spread.

Both runs score one window set (``evaluate.window_anchors``: fixed by the bags and the
configuration, not by either run's timing), so a window is keyed by its bag and anchor frame
and each window scored by both runs at a horizon gives one paired difference there. What
is left between the two is the serving: a stream's longer history, its pacing, frames filled,
slots it skipped, and the initial noise (a stream's seed, not a window's). Per horizon chunk
h: the mean over those windows of per-window PSNR (the mean of the chunk's per-frame PSNR) in
each run, the mean of the per-window differences with their 10th-90th percentile and a
bootstrap interval of the mean (windows resampled), and the pooled PSNR (of the pixel MSE
averaged over the windows) of each run with its difference and interval. Copy-last is
compared the same way: on the same anchors its difference is exactly zero, which checks the
pairing. No torch.
"""

from __future__ import annotations

import math

import numpy as np

from physis_ros.eval.evaluate import EvalResult, WindowResult
from physis_ros.eval.metrics import PSNR_CAP_DB

BOOTSTRAP_RESAMPLES = 2000
"""Resamples of the paired windows behind each interval."""
INTERVAL = 0.95
"""Coverage of the bootstrap intervals."""
SPREAD_PERCENTILES = (10.0, 90.0)
"""The spread of the per-window differences."""

Key = tuple[str, int]
"""(bag, anchor frame): one window of the set."""


def _chunk_mean(row: list[float | None], steps: range) -> float | None:
    vals = [row[j] for j in steps] if row and steps.stop <= len(row) else []
    return float(np.mean(vals)) if vals and all(v is not None for v in vals) else None


def chunk_values(result: EvalResult, chunk: int) -> dict[Key, tuple[float, ...]]:
    """Per window scored at every frame of horizon chunk ``chunk`` (1-based): its model PSNR,
    copy-last PSNR, model MSE and copy-last MSE there (model entries NaN without frames). A
    window several streams scored (one per horizon named) gets the mean of their values."""
    f = result.model.frames_per_chunk
    steps = range((chunk - 1) * f, chunk * f)
    found: dict[Key, list[tuple[float, ...]]] = {}
    for w in result.windows:
        values = _window_values(w, steps)
        if values is not None:
            found.setdefault((w.bag, w.anchor_frame), []).append(values)
    return {key: tuple(np.mean(rows, axis=0)) for key, rows in found.items()}


def _window_values(w: WindowResult, steps: range) -> tuple[float, ...] | None:
    base = _chunk_mean(w.baseline_psnr, steps)
    base_mse = _chunk_mean(w.baseline_frame_mse, steps)
    if base is None or base_mse is None:
        return None
    model, model_mse = _chunk_mean(w.psnr, steps), _chunk_mean(w.frame_mse, steps)
    if w.psnr and (model is None or model_mse is None):
        return None  # the model's frames were not all scored at this chunk
    nan = float("nan")
    return (
        nan if model is None else model,
        base,
        nan if model_mse is None else model_mse,
        base_mse,
    )


def _pooled_db(mean_mse: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        db = 10 * np.log10(255.0**2 / np.asarray(mean_mse, dtype=np.float64))
    return np.minimum(db, PSNR_CAP_DB)


def paired_difference(
    live_db: np.ndarray,
    in_process_db: np.ndarray,
    live_mse: np.ndarray,
    in_process_mse: np.ndarray,
    *,
    rng: np.random.Generator,
    resamples: int = BOOTSTRAP_RESAMPLES,
) -> dict:
    """Live minus in process over paired windows (same index, same window): the per-window
    means, the mean difference with its spread and bootstrap interval, and the pooled PSNR of
    each with their difference and its interval (same resamples)."""
    d = live_db - in_process_db
    n = len(d)
    idx = rng.integers(0, n, size=(resamples, n))
    tail = 100 * (1 - INTERVAL) / 2
    pooled_live, pooled_in = _pooled_db(live_mse.mean()), _pooled_db(in_process_mse.mean())
    boot_pooled = _pooled_db(live_mse[idx].mean(axis=1)) - _pooled_db(
        in_process_mse[idx].mean(axis=1)
    )
    lo, hi = SPREAD_PERCENTILES
    return {
        "in_process": float(in_process_db.mean()),
        "live": float(live_db.mean()),
        "difference": float(d.mean()),
        "difference_p10": float(np.percentile(d, lo)),
        "difference_p90": float(np.percentile(d, hi)),
        "difference_interval": [
            float(v) for v in np.percentile(d[idx].mean(axis=1), [tail, 100 - tail])
        ],
        "pooled_in_process": float(pooled_in),
        "pooled_live": float(pooled_live),
        "pooled_difference": float(pooled_live - pooled_in),
        "pooled_difference_interval": [
            float(v) for v in np.percentile(boot_pooled, [tail, 100 - tail])
        ],
    }


def live_vs_in_process(
    live: EvalResult, in_process: EvalResult, *, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
) -> dict:
    """report.json's ``live_vs_in_process``: per horizon chunk, live minus in process on the
    windows both scored, for the model and copy-last. ValueError when the runs' window sets
    differ (other bags or another window configuration)."""
    if live.window_set != in_process.window_set:
        only = sorted(set(live.window_set).symmetric_difference(in_process.window_set))
        raise ValueError(
            "the two runs scored different window sets"
            + (f" (bags in one run only: {', '.join(only)})" if only else "")
        )
    rng = np.random.default_rng(seed)
    by_chunk = []
    for chunk in range(1, live.config.horizon_chunks + 1):
        ours, theirs = chunk_values(live, chunk), chunk_values(in_process, chunk)
        both = sorted(set(ours) & set(theirs))
        entry = {
            "chunk": chunk,
            "windows": len(both),
            "scored_in_process": len(theirs),
            "scored_live": len(ours),
            "model": None,
            "copy_last": None,
        }
        if both:
            a = np.array([ours[k] for k in both])
            b = np.array([theirs[k] for k in both])
            entry["copy_last"] = paired_difference(
                a[:, 1], b[:, 1], a[:, 3], b[:, 3], rng=rng, resamples=resamples
            )
            if not np.isnan(a[:, 0]).any() and not np.isnan(b[:, 0]).any():
                entry["model"] = paired_difference(
                    a[:, 0], b[:, 0], a[:, 2], b[:, 2], rng=rng, resamples=resamples
                )
        by_chunk.append(entry)
    diffs = [(abs(e["model"]["difference"]), e["chunk"]) for e in by_chunk if e["model"]]
    return {
        "windows_in_set": sum(len(a) for a in live.window_set.values()),
        "same_anchors": True,
        "bootstrap": {"resamples": resamples, "interval": INTERVAL, "seed": seed},
        "spread_percentiles": list(SPREAD_PERCENTILES),
        "largest_model_difference_db": max(diffs)[0] if diffs else None,
        "by_chunk": by_chunk,
    }


def _f(v: float | None, digits: int = 2) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:+.{digits}f}"


def _plain(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}"


def comparison_lines(cmp: dict) -> list[str]:
    """The report.md section of ``live_vs_in_process``."""
    pct = f"{100 * cmp['bootstrap']['interval']:g} %"
    lo, hi = cmp["spread_percentiles"]
    lines = [
        "",
        "## Live minus in process (the same windows)",
        "",
        f"Both runs scored one window set ({cmp['windows_in_set']} windows, fixed by the bags "
        "and the window settings); each row pairs the windows both scored at that horizon. "
        "PSNR: mean over windows of the chunk's per-frame PSNR; difference: the mean of live "
        f"minus in process per window, its p{lo:g} / p{hi:g} over windows and a {pct} bootstrap "
        f"interval of the mean ({cmp['bootstrap']['resamples']} resamples of the windows); "
        "pooled: PSNR of the pixel MSE averaged over the windows.",
    ]
    for name, key in (("Model", "model"), ("Copy-last", "copy_last")):
        lines += [
            "",
            f"| {name}: h | windows | in process dB | live dB | live - in process dB "
            f"| p{lo:g} / p{hi:g} | {pct} interval | pooled in process / live dB "
            f"| pooled difference ({pct} interval) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for e in cmp["by_chunk"]:
            d = e[key]
            if d is None:
                lines.append(f"| {e['chunk']} | {e['windows']} | – | – | – | – | – | – | – |")
                continue
            ci, pci = d["difference_interval"], d["pooled_difference_interval"]
            lines.append(
                f"| {e['chunk']} | {e['windows']} | {_plain(d['in_process'])} "
                f"| {_plain(d['live'])} | {_f(d['difference'])} "
                f"| {_f(d['difference_p10'])} / {_f(d['difference_p90'])} "
                f"| {_f(ci[0])} ... {_f(ci[1])} "
                f"| {_plain(d['pooled_in_process'])} / {_plain(d['pooled_live'])} "
                f"| {_f(d['pooled_difference'])} ({_f(pci[0])} ... {_f(pci[1])}) |"
            )
    for e in cmp["by_chunk"]:
        unpaired = {
            "in process": e["scored_in_process"] - e["windows"],
            "live": e["scored_live"] - e["windows"],
        }
        for run, n in unpaired.items():
            if n:
                other = "live" if run == "in process" else "in process"
                lines.append(
                    f"\n- h = {e['chunk']}: {n} window(s) scored {run} only, none {other} "
                    "(over the link: see Link, its drops and unscored predictions)"
                )
    return lines
