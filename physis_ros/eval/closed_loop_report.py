"""Closed-loop runs: run the configurations, summarise them, write the report and the plots.

What belongs here: the named runs a ``physis-eval --closed-loop`` makes (the expert, the model
with delay-aware execution — crossfade and replace — and the model without delay handling, at
each requested delay), their summary (success rate, time to goal, action error, jumps where
chunks join), ``report.json`` / ``report.md``, the paths of what the task moves against the
goals (push: ``box_paths_<run>.png``, reach: ``tool_tip_paths_<run>.png``) and the strip of
one episode (``strip.png``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw
from tqdm import tqdm

from physis_ros.eval.closed_loop import ClosedLoopConfig, EpisodeResult, run_episode
from physis_ros.sim.base import CONTROL_HZ
from physis_ros.sim.table import TABLE_HALF_M
from physis_ros.sim.tasks import get_task


def run_names(delays_ms: list[float], *, with_expert: bool, modes: list[str]) -> list[tuple]:
    """(name, config overrides) of every run: the expert once, then each mode per delay.
    Modes: ``crossfade``, ``replace`` (delay-aware joins), ``naive`` (no delay handling)."""
    runs = [("expert", {"policy": "expert"})] if with_expert else []
    for d in delays_ms:
        for mode in modes:
            over = {"policy": "model", "delay_ms": d}
            if mode == "naive":
                over.update(delay_aware=False, join="replace")
            else:
                over.update(delay_aware=True, join=mode)
            runs.append((f"model_{mode}_{d:g}ms", over))
    return runs


def run_all(base: ClosedLoopConfig, runs: list[tuple], decider, *, progress=True) -> dict:
    """name -> (config, [EpisodeResult]); the first model episode keeps its frames."""

    out = {}
    for name, over in runs:
        cfg = dataclasses.replace(base, **over)
        results = []
        bar = tqdm(range(cfg.episodes), desc=name, unit="ep", disable=not progress)
        for i in bar:
            keep = cfg.policy == "model" and i == 0
            use = decider if cfg.policy == "model" else None
            results.append(run_episode(cfg, cfg.seed0 + i, use, keep_frames=keep))
            bar.set_postfix(success=f"{sum(r.success for r in results)}/{len(results)}")
        out[name] = (cfg, results)
    return out


def _stats(values: list[float]) -> dict:
    v = [x for x in values if x is not None and math.isfinite(x)]
    if not v:
        return {"n": 0}
    return {
        "n": len(v),
        "mean": float(np.mean(v)),
        "median": float(np.median(v)),
        "max": float(np.max(v)),
    }


def summarize(cfg: ClosedLoopConfig, results: list[EpisodeResult]) -> dict:
    ok = [r for r in results if r.success]
    jumps = [j for r in results for j in r.boundary_jumps]
    return {
        "policy": cfg.policy,
        "delay_ms": cfg.delay_ms,
        "delay_control_periods": cfg.delay_ms / (1e3 / CONTROL_HZ),
        "delay_aware": cfg.delay_aware,
        "join": cfg.join,
        "known_rows_ahead": cfg.max_known_rows_ahead if cfg.delay_aware else 0,
        "min_committed_ms": cfg.min_committed_ms if cfg.delay_aware else 0.0,
        "episodes": len(results),
        "successes": len(ok),
        "success_rate": len(ok) / len(results),
        "time_to_goal_s": _stats([r.time_to_goal_s for r in ok]),
        "final_error_m": _stats([r.final_error_m for r in results]),
        "action_rmse_rad": _stats([r.action_rmse_rad for r in results]),
        "boundary_jump_rad": {
            "largest": max(jumps, default=0.0),
            "mean_per_join": float(np.mean(jumps)) if jumps else 0.0,
            "largest_per_episode_mean": float(
                np.mean([max(r.boundary_jumps) for r in results if r.boundary_jumps] or [0.0])
            ),
        },
        "max_step_rad": max((r.max_step for r in results), default=0.0),
        "discontinuity_rad": _stats([d for r in results for d in r.discontinuities]),
        "chunks_accepted": sum(r.chunks_accepted for r in results),
        "chunks_refused": _sum_counts([r.chunks_refused for r in results]),
        "rows_skipped": sum(r.rows_skipped for r in results),
        "per_episode": [
            {
                "seed": r.seed,
                "success": r.success,
                "time_to_goal_s": r.time_to_goal_s,
                "final_error_m": round(r.final_error_m, 4),
                "action_rmse_rad": round(r.action_rmse_rad, 4),
            }
            for r in results
        ],
    }


def _sum_counts(dicts: list[dict]) -> dict:
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def write_report(out_dir: Path, runs: dict, *, engine: dict, command: str) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    first = next(iter(runs.values()))[0]
    task = get_task(first.task)
    report = {
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": command,
        "engine": engine,
        "success_definition": f"{task.success_text} within {first.time_limit_s:g} s of "
        "simulated time",
        "control_period_ms": 1e3 / CONTROL_HZ,
        "runs": {name: summarize(cfg, res) for name, (cfg, res) in runs.items()},
    }
    (out_dir / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out_dir / "report.md").write_text(render_markdown(report))
    moved = task.moved.replace(" ", "_")
    for name, (_, results) in runs.items():
        box_paths_png(out_dir / f"{moved}_paths_{name}.png", results, title=name)
    for _, (cfg, results) in runs.items():
        if cfg.policy == "model" and results and results[0].observed:
            strip_png(out_dir / "strip.png", results[0], frames_per_slot=2)
            break
    return report


def render_markdown(report: dict) -> str:
    lines = [
        "# Closed-loop evaluation",
        "",
        f"`{report['command']}`",
        "",
        f"Success: {report['success_definition']}. Control period "
        f"{report['control_period_ms']:g} ms.",
        "",
        "| run | delay ms (periods) | success | time to goal s (median) | action RMSE rad "
        "| largest jump at joins rad | mean per-join jump rad | largest step anywhere rad |",
        "|---|---|---|---|---|---|---|---|",
    ]
    floors = {r.get("min_committed_ms", 0.0) for r in report["runs"].values()} - {0.0}
    if floors:  # before the table: what "no delay" means for the delay-aware runs
        lines[-2:-2] = [
            f"Delay-aware runs commit the plan at least {', '.join(f'{f:g}' for f in floors)} "
            "ms past the newest frame (the weights' `min_committed_ms`).",
            "",
        ]
    for name, r in report["runs"].items():
        ttg = r["time_to_goal_s"].get("median")
        lines.append(
            f"| {name} | {r['delay_ms']:g} ({r['delay_control_periods']:g}) "
            f"| {r['successes']}/{r['episodes']} ({100 * r['success_rate']:.0f} %) "
            f"| {'-' if ttg is None else f'{ttg:.2f}'} "
            f"| {r['action_rmse_rad'].get('mean', 0):.4f} "
            f"| {r['boundary_jump_rad']['largest']:.4f} "
            f"| {r['boundary_jump_rad']['mean_per_join']:.4f} "
            f"| {r['max_step_rad']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def box_paths_png(path: Path, results: list[EpisodeResult], *, title: str, cell: int = 150):
    """One panel per episode: the table, the goal (tolerance circle), the path of what the
    task moves onto it (push: the box; blue), its start (grey) and end (green: success, red:
    failure)."""

    from physis_ros.eval.plots import _font

    cols = min(5, len(results))
    rows = math.ceil(len(results) / cols)
    img = Image.new("RGB", (cols * cell, 24 + rows * cell), "white")
    draw = ImageDraw.Draw(img)
    moved = f"{get_task(results[0].task).moved} " if results else ""
    draw.text((4, 4), f"{title}: {moved}path vs goal", fill="black", font=_font(14))

    def px(xy, ox, oy):
        s = (cell - 10) / (2 * TABLE_HALF_M)
        return (ox + 5 + (xy[0] + TABLE_HALF_M) * s, oy + 5 + (TABLE_HALF_M - xy[1]) * s)

    for i, r in enumerate(results):
        ox, oy = (i % cols) * cell, 24 + (i // cols) * cell
        draw.rectangle([ox + 5, oy + 5, ox + cell - 5, oy + cell - 5], outline=(180, 170, 150))
        gx, gy = px(r.goal_xy, ox, oy)
        rad = get_task(r.task).tolerance_m * (cell - 10) / (2 * TABLE_HALF_M)
        draw.ellipse([gx - rad, gy - rad, gx + rad, gy + rad], outline=(40, 160, 60), width=2)
        pts = [px(p, ox, oy) for p in r.path]
        if len(pts) > 1:
            draw.line(pts, fill=(31, 119, 180), width=2)
        if pts:
            sx, sy = pts[0]
            draw.rectangle([sx - 3, sy - 3, sx + 3, sy + 3], fill=(120, 120, 120))
            ex, ey = pts[-1]
            color = (40, 160, 60) if r.success else (214, 39, 40)
            draw.ellipse([ex - 3, ey - 3, ex + 3, ey + 3], fill=color)
        label = f"{r.seed} " + (f"{r.time_to_goal_s:.1f}s" if r.success else "fail")
        draw.text((ox + 8, oy + 8), label, fill="black", font=_font(11))
    img.save(str(path))


def strip_png(path: Path, result: EpisodeResult, *, frames_per_slot: int, columns: int = 10):
    """Observed frames (one per slot) above the frames the model predicted for that slot."""
    from physis_ros.eval.plots import image_strips

    slots = sorted(s for s in result.predicted if result.predicted[s] is not None)
    step = max(1, math.ceil(len(slots) / columns))
    picked = [s for s in slots if s * frames_per_slot < len(result.observed)][::step][:columns]
    observed = [result.observed[s * frames_per_slot] for s in picked]
    predicted = [result.predicted[s][0] for s in picked]
    image_strips(
        path,
        [("observed", observed), ("predicted", predicted)],
        title=f"episode {result.seed}: slots {picked} (0.2 s each), "
        + ("reached the goal" if result.success else "did not reach the goal"),
    )
