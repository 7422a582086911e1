"""Turning an ``EvalResult`` into report.json, report.md and PNG plots.

What belongs here: aggregation over windows per horizon step (model vs baseline, in the
same run), latency and interval statistics, and the files a user reads. Keys of
report.json's ``horizon`` entries: ``step`` (1-based), ``chunk``, ``time_ahead_s``, ``psnr``,
``ssim``, ``baseline_psnr``, ``baseline_ssim``, ``psnr_gain_db``, ``action_mse``,
``baseline_action_mse``, ``windows``, and ``psnr_of_mean_mse`` / ``baseline_psnr_of_mean_mse``
(PSNR of the pixel MSE averaged over windows: unlike the mean of per-frame PSNR it is not
dominated by frames that copy-last-frame gets exactly right, whose PSNR is infinite and
capped at ``metrics.PSNR_CAP_DB``). ``by_chunk`` entries also split ``psnr_gain_db`` into
``gain_from_still_db`` and ``gain_from_moving_db`` (``still_share``: the share of still
frames, STILL_PSNR_DB). A metric that was not measured is null, and the report says why.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path

import numpy as np

from physis_ros.eval.evaluate import EvalResult
from physis_ros.eval.metrics import PSNR_CAP_DB, summarize
from physis_ros.eval.paired import comparison_lines
from physis_ros.eval.plots import histogram, image_strips, line_chart


def _values_at(rows: list[list[float | None] | None], j: int) -> list[float]:
    """Step ``j`` of every row that has it (over the link a row misses steps it did not
    predict: None)."""
    return [r[j] for r in rows if r is not None and j < len(r) and r[j] is not None]


def _mean_at(rows: list[list[float | None] | None], j: int) -> float | None:
    vals = _values_at(rows, j)
    return float(np.mean(vals)) if vals else None


def output_sequences(result: EvalResult) -> list[list[float]]:
    """Runs of consecutive outputs' times (s): per window, or per stream over the link."""
    if result.output_sequences_s is not None:
        return result.output_sequences_s
    return [w.output_times_s for w in result.windows]


def _psnr_of(mean_mse: float | None) -> float | None:
    if mean_mse is None:
        return None
    return PSNR_CAP_DB if mean_mse <= 0 else min(PSNR_CAP_DB, 10 * math.log10(255.0**2 / mean_mse))


STILL_PSNR_DB = 50.0
"""A frame copy-last-frame scores at least this on (pixel RMS error under 1 level of 255) is
*still*: the scene barely moved. Copy-last is exact on many of them (PSNR_CAP_DB), so a
model that is off by one level in a few pixels loses tens of dB there, and a few percent of
still frames can outweigh the rest in the mean per-frame PSNR."""


def _gain_split(psnr_rows, baseline_rows, j: int) -> tuple[float, float, float] | None:
    """At step ``j``: (share of still frames, their part of the mean PSNR gain, the moving
    frames' part); the two parts add up to the step's gain. None without model PSNR."""
    pairs = [
        (p[j], b[j])
        for p, b in zip(psnr_rows, baseline_rows, strict=True)
        if p and b is not None and j < len(p) and p[j] is not None and b[j] is not None
    ]
    if not pairs:
        return None
    still = [p - b for p, b in pairs if b >= STILL_PSNR_DB]
    moving = [p - b for p, b in pairs if b < STILL_PSNR_DB]
    n = len(pairs)
    return len(still) / n, sum(still) / n, sum(moving) / n


def _chunk_gain_split(result: EvalResult, steps: list[int]) -> dict:
    """The chunk's mean PSNR gain split into what its still frames and its moving frames add
    (averaged over its steps, as the gain is)."""
    psnr_rows = [w.psnr for w in result.windows]
    baseline_rows = [w.baseline_psnr for w in result.windows]
    splits = [_gain_split(psnr_rows, baseline_rows, j) for j in steps]
    if not splits or any(s is None for s in splits):
        return {"still_share": None, "gain_from_still_db": None, "gain_from_moving_db": None}
    share, still, moving = (float(np.mean(col)) for col in zip(*splits, strict=True))
    return {"still_share": share, "gain_from_still_db": still, "gain_from_moving_db": moving}


def build_report(result: EvalResult) -> dict:
    """The report.json content."""
    horizon = _horizon_entries(result)
    latency = _latency(result)
    return {
        "mode": result.mode,
        "link": result.link,
        "model": dataclasses.asdict(result.model),
        "config": dataclasses.asdict(result.config),
        "windows": len(result.windows),
        "horizon": horizon,
        "by_chunk": _by_chunk_entries(result, horizon),
        "latency": latency,
        "not_measured": _not_measured(result),
        "bags": result.bags,
        "window_set": result.window_set,
        "skipped_bags": result.skipped_bags,
        "skipped_windows": dict(result.skipped_windows),
        "wall_s": result.wall_s,
    }


def _horizon_entries(result: EvalResult) -> list[dict]:
    """report.json's ``horizon``: per horizon step, model and baselines over the windows."""
    m, cfg, wins = result.model, result.config, result.windows
    n_frames = m.frames_per_chunk * cfg.horizon_chunks
    n_actions = m.action_horizon * cfg.horizon_chunks if m.action_mode != "none" else 0
    horizon = []
    for j in range(max(n_frames, n_actions)):
        entry = {
            "step": j + 1,
            "chunk": j // m.frames_per_chunk + 1 if j < n_frames else None,
            "time_ahead_s": round((j + 1) / cfg.frame_hz, 6) if j < n_frames else None,
            "psnr": _mean_at([w.psnr or None for w in wins], j),
            "ssim": _mean_at([w.ssim or None for w in wins], j),
            "baseline_psnr": _mean_at([w.baseline_psnr for w in wins], j),
            "baseline_ssim": _mean_at([w.baseline_ssim for w in wins], j),
            "psnr_of_mean_mse": _psnr_of(_mean_at([w.frame_mse or None for w in wins], j)),
            "baseline_psnr_of_mean_mse": _psnr_of(
                _mean_at([w.baseline_frame_mse for w in wins], j)
            ),
            "action_mse": _mean_at([w.action_mse for w in wins], j),
            "baseline_action_mse": _mean_at([w.baseline_action_mse for w in wins], j),
            # windows scored at this step (all of them in process; over the link, those whose
            # server predicted this far ahead before a newer observation took over)
            "windows": max(
                len(_values_at([w.baseline_psnr for w in wins], j)),
                len(_values_at([w.baseline_action_mse for w in wins], j)),
            ),
        }
        if entry["psnr"] is not None and entry["baseline_psnr"] is not None:
            entry["psnr_gain_db"] = entry["psnr"] - entry["baseline_psnr"]
        else:
            entry["psnr_gain_db"] = None
        horizon.append(entry)
    return horizon


def _by_chunk_entries(result: EvalResult, horizon: list[dict]) -> list[dict]:
    """report.json's ``by_chunk``: each predicted chunk's steps averaged, its gain split."""
    by_chunk = []
    for c in range(result.config.horizon_chunks):
        rows = [e for e in horizon if e["chunk"] == c + 1]
        mean = lambda key, rows=rows: (  # noqa: E731
            float(np.mean([e[key] for e in rows]))
            if rows and all(e[key] is not None for e in rows)
            else None
        )
        entry = {"chunk": c + 1, "psnr": mean("psnr"), "baseline_psnr": mean("baseline_psnr")}
        entry["windows"] = min((e["windows"] for e in rows), default=0)
        entry["psnr_of_mean_mse"] = mean("psnr_of_mean_mse")
        entry["baseline_psnr_of_mean_mse"] = mean("baseline_psnr_of_mean_mse")
        entry["ssim"], entry["baseline_ssim"] = mean("ssim"), mean("baseline_ssim")
        entry["psnr_gain_db"] = (
            entry["psnr"] - entry["baseline_psnr"] if entry["psnr"] is not None else None
        )
        entry.update(_chunk_gain_split(result, [e["step"] - 1 for e in rows]))
        by_chunk.append(entry)
    return by_chunk


def _not_measured(result: EvalResult) -> dict[str, str]:
    """report.json's ``not_measured``: metric -> why the model gives none."""
    not_measured = {}
    if result.model.action_mode == "condition":
        not_measured["action_mse"] = (
            "the model is conditioned on the recorded commands and predicts no actions"
        )
    elif result.model.action_mode == "none":
        not_measured["action_mse"] = "the model has no actions"
        not_measured["baseline_action_mse"] = "the model has no actions"
    if result.windows and not result.windows[0].psnr:
        not_measured["psnr"] = not_measured["ssim"] = "the model predicts no frames"
    return not_measured


def _latency(result: EvalResult) -> dict:
    """report.json's ``latency``: response, chunk and interval statistics (and the hops')."""
    wins = result.windows
    intervals = [
        (b - a) * 1e3 for seq in output_sequences(result) for a, b in itertools.pairwise(seq)
    ]
    latency = {
        "response_latency_ms": summarize([w.response_latency_ms for w in wins]),
        "chunk_latency_ms": summarize([x for w in wins for x in w.chunk_latency_ms]),
        "interval_ms": summarize(intervals),
    }
    if result.link is not None:
        latency["hop_ms"] = result.link["hop_ms"]
    return latency


def _preview_lines(pv: dict) -> list[str]:
    """The previews table (``physis-eval --previews``): per step, means over chunks (and of
    per-bag means)."""
    lines = [
        "",
        f"## Previews (x0 estimate after k of {pv['steps']} steps)",
        "",
        "| k | chunks | PSNR vs the chunk dB | PSNR vs recorded dB | the chunk vs recorded dB "
        "| sooner than the chunk, median ms |",
        "|---|---|---|---|---|---|",
    ]
    for k, e in pv["by_step"].items():
        vc, vr, cr, ms = (
            e[n] for n in ("vs_chunk_db", "vs_recorded_db", "chunk_vs_recorded_db", "earlier_ms")
        )
        lines.append(
            f"| {k} | {vc['count']} | {_f(vc['mean'])} (bags {_f(vc['bag_mean'])}) | "
            f"{_f(vr['mean'])} (bags {_f(vr['bag_mean'])}) | {_f(cr['mean'])} | "
            f"{_f(ms['median'])} |"
        )
    return lines


def _f(v, digits: int = 2) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def render_markdown(report: dict) -> str:
    link = report.get("link")
    lines = [
        f"# Evaluation: {report['model']['name']}",
        "",
        _what_was_run(report) + " Baselines (copy-last-frame, hold-last-command) are scored "
        "on the same windows and steps.",
    ]
    lines += _chunk_lines(report["by_chunk"])
    lines += _horizon_lines(report["horizon"])
    lines += _latency_lines(report["latency"])
    if link is not None:
        lines += _link_lines(link)
    if report.get("live_vs_in_process"):
        lines += comparison_lines(report["live_vs_in_process"])
    if report["not_measured"]:
        lines += ["", "## Not measured", ""]
        lines += [f"- `{k}`: {v}" for k, v in report["not_measured"].items()]
    lines += _bag_lines(report)
    lines += [
        "",
        "Plots: strips.png, error_vs_horizon.png, latency_hist.png, interval_timeline.png",
        "",
    ]
    return "\n".join(lines)


def _what_was_run(report: dict) -> str:
    """The report's first sentence: which windows were scored, how, and how they were fed."""
    m, cfg = report["model"], report["config"]
    link = report.get("link")
    if link is None:
        return (
            f"{report['windows']} windows from {len(report['bags'])} bags "
            f"({len(report['skipped_bags'])} bags skipped), in process; each window: "
            f"{cfg['context_chunks']} observed chunks, then {cfg['horizon_chunks']} predicted "
            f"chunks of {m['frames_per_chunk']} frames at {cfg['frame_hz']} Hz, all anchored on "
            "the last observed one"
            + (
                ", conditioned on the recorded commands that followed (no server knows them)"
                if cfg.get("future_commands")
                else ", conditioned on its last command held (as served)"
                if m["action_mode"] == "condition"
                else ""
            )
            + f"; replay {'at recorded timing' if cfg['realtime'] else 'as fast as possible'}."
        )
    return (
        f"Over the link to physis-serve at `{link['target']}`: {len(report['bags'])} bags "
        f"({len(report['skipped_bags'])} skipped) streamed frame by frame "
        f"{'at recorded timing' if cfg['realtime'] else 'as fast as the server took them'}"
        f", one stream per bag and horizon {link['horizons']}; "
        f"{link['predictions_scored']} of {link['predictions_received']} predictions "
        f"scored, from {report['windows']} anchors (a window here: an observed slot), up to "
        f"{cfg['horizon_chunks']} chunks of {m['frames_per_chunk']} frames ahead of their "
        f"anchor, at {cfg['frame_hz']} Hz. Response latency: the anchor's newest frame "
        "handed to the client -> first prediction anchored on it received; "
        "chunk latency: entered the pipeline -> decoded, on the server."
    )


def _chunk_lines(by_chunk: list[dict]) -> list[str]:
    """The per predicted chunk table, and where its gain comes from when that is known."""
    lines = [
        "",
        "## Per predicted chunk",
        "",
        "PSNR is the mean over windows of per-frame PSNR (what a user feels; identical frames "
        f"count as {PSNR_CAP_DB:.0f} dB); PSNR(mean MSE) pools the pixel error over windows.",
        "",
        "| chunk | windows | PSNR dB | copy-last PSNR dB | gain dB | PSNR(mean MSE) "
        "| copy-last PSNR(mean MSE) | SSIM | copy-last SSIM |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in by_chunk:
        lines.append(
            f"| {e['chunk']} | {e['windows']} | {_f(e['psnr'])} | {_f(e['baseline_psnr'])} "
            f"| {_f(e['psnr_gain_db'])} | {_f(e['psnr_of_mean_mse'])} "
            f"| {_f(e['baseline_psnr_of_mean_mse'])} | {_f(e['ssim'], 3)} "
            f"| {_f(e['baseline_ssim'], 3)} |"
        )
    if any(e.get("still_share") is not None for e in by_chunk):
        lines += [
            "",
            f"Where the gain comes from: *still* frames are those copy-last scores "
            f">= {STILL_PSNR_DB:.0f} dB on (the scene barely moved; copy-last is often exact "
            "there). The two parts add up to the gain.",
            "",
            "| chunk | still frames % | gain from still dB | gain from moving dB |",
            "|---|---|---|---|",
        ]
        for e in by_chunk:
            if e.get("still_share") is not None:
                lines.append(
                    f"| {e['chunk']} | {_f(100 * e['still_share'], 1)} "
                    f"| {_f(e['gain_from_still_db'])} | {_f(e['gain_from_moving_db'])} |"
                )
    return lines


def _horizon_lines(horizon: list[dict]) -> list[str]:
    """The per horizon step table."""
    lines = [
        "",
        "## Per horizon step",
        "",
        "| step | chunk | ahead s | PSNR | copy-last PSNR | SSIM | copy-last SSIM "
        "| action MSE | hold MSE |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in horizon:
        lines.append(
            f"| {e['step']} | {e['chunk'] or '–'} | {_f(e['time_ahead_s'])} | {_f(e['psnr'])} | "
            f"{_f(e['baseline_psnr'])} | {_f(e['ssim'], 3)} | {_f(e['baseline_ssim'], 3)} | "
            f"{_f(e['action_mse'], 4)} | {_f(e['baseline_action_mse'], 4)} |"
        )
    return lines


def _latency_lines(lat: dict) -> list[str]:
    """The latency and interval table."""
    lines = [
        "",
        "## Latency and interval",
        "",
        "| quantity | median ms | p99 ms | count |",
        "|---|---|---|---|",
    ]
    for key in ("response_latency_ms", "chunk_latency_ms", "interval_ms"):
        s = lat[key]
        lines.append(f"| {key} | {_f(s['median'])} | {_f(s['p99'])} | {s['count']} |")
    return lines


def _link_lines(link: dict) -> list[str]:
    """Over the link: hop latencies, streams, anchoring lag, rate, drops, previews."""
    lines = ["", "## Link", "", "| hop | median ms | p99 ms | count |", "|---|---|---|---|"]
    for name, st in link["hop_ms"].items():
        lines.append(f"| {name} | {_f(st['median'])} | {_f(st['p99'])} | {st['count']} |")
    lines.append("")
    lines.append(f"- streams opened: {link['streams_opened']}, horizons {link['horizons']}")
    lag_f, lag_ms = link["anchoring_lag_frames"], link["anchoring_lag_ms"]
    lines.append(
        f"- anchoring lag (frames sent after the anchor's newest frame when its prediction "
        f"came back): median {_f(lag_f['median'], 1)}, p99 {_f(lag_f['p99'], 1)}; "
        f"anchor frame sent -> prediction received: median {_f(lag_ms['median'])} ms, "
        f"p99 {_f(lag_ms['p99'])} ms"
    )
    rate = link["rate"]
    lines.append(
        f"- rate achieved: {_f(rate['predictions_per_s'])} predictions/s, "
        f"{_f(rate['observed_slots_per_s'])} observed slots/s over {_f(rate['replay_s'], 1)} s"
    )
    for name, n in link["drops"].items():
        lines.append(f"- dropped {n}: {name}")
    for reason, n in link["unscored_predictions"].items():
        lines.append(f"- not scored, {n} prediction(s): {reason}")
    if "previews" in link:
        lines += _preview_lines(link["previews"])
    return lines


def _bag_lines(report: dict) -> list[str]:
    """Each bag scored (with its skipped messages and notes), the bags and windows skipped."""
    lines = ["", "## Bags", ""]
    for b in report["bags"]:
        lines.append(
            f"- `{b['path']}` ({b['storage']}, {b['image_topic']}, {b['frames']} frames at "
            f"{b['frame_hz']} Hz): {b['windows']} windows"
        )
        for reason, n in b["skipped_messages"].items():
            lines.append(f"  - skipped {n} message(s): {reason}")
        for note in b["notes"]:
            lines.append(f"  - note: {note}")
    if report["skipped_bags"]:
        lines += ["", "## Skipped bags", ""]
        lines += [f"- `{b['path']}`: {b['reason']}" for b in report["skipped_bags"]]
    if report["skipped_windows"]:
        lines += ["", "## Skipped windows", ""]
        lines += [f"- {n} window(s): {r}" for r, n in report["skipped_windows"].items()]
    return lines


def write_report(
    result: EvalResult,
    out_dir: Path | str,
    *,
    engine: dict | None = None,
    live_vs_in_process: dict | None = None,
) -> dict:
    """Write report.json, report.md and the plots into ``out_dir``; returns the report.
    ``engine``: what served the predictions (settings), kept in report.json as ``engine``;
    ``live_vs_in_process``: a live run's comparison with the same windows in process
    (``paired.live_vs_in_process``), kept under that key."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = build_report(result)
    if engine is not None:
        report["engine"] = engine
    if live_vs_in_process is not None:
        report["live_vs_in_process"] = live_vs_in_process
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(render_markdown(report))
    _write_plots(report, result, out)
    return report


def _write_plots(report: dict, result: EvalResult, out: Path) -> None:
    """error_vs_horizon.png (and action_error_vs_horizon.png), latency_hist.png,
    interval_timeline.png, strips.png."""
    steps = [e["step"] for e in report["horizon"]]
    series = {
        "model PSNR": (steps, [e["psnr"] for e in report["horizon"]]),
        "copy-last-frame PSNR": (steps, [e["baseline_psnr"] for e in report["horizon"]]),
        "model PSNR(mean MSE)": (steps, [e["psnr_of_mean_mse"] for e in report["horizon"]]),
        "copy-last PSNR(mean MSE)": (
            steps,
            [e["baseline_psnr_of_mean_mse"] for e in report["horizon"]],
        ),
    }
    line_chart(
        out / "error_vs_horizon.png",
        series,
        title="PSNR vs horizon",
        xlabel="horizon step (frames ahead)",
        ylabel="PSNR dB",
    )
    if any(e["action_mse"] is not None for e in report["horizon"]):  # a world-action model
        line_chart(
            out / "action_error_vs_horizon.png",
            {
                "model action MSE": (steps, [e["action_mse"] for e in report["horizon"]]),
                "hold MSE": (steps, [e["baseline_action_mse"] for e in report["horizon"]]),
            },
            title="Action MSE vs horizon",
            xlabel="horizon step (actions ahead)",
            ylabel="MSE rad^2",
        )
    wins = result.windows
    histogram(
        out / "latency_hist.png",
        {
            "chunk latency": [x for w in wins for x in w.chunk_latency_ms],
            "response latency": [w.response_latency_ms for w in wins],
        },
        title="Latency",
        xlabel="ms",
    )
    sequences = output_sequences(result)
    first_s = min((seq[0] for seq in sequences if seq), default=0.0)
    per_window = [
        ((a - first_s), (b - a) * 1e3) for seq in sequences for a, b in itertools.pairwise(seq)
    ]
    per_window.sort()
    line_chart(
        out / "interval_timeline.png",
        {"interval between chunks": ([t for t, _ in per_window], [v for _, v in per_window])},
        title="Interval between consecutive chunks of a "
        + ("stream" if result.mode == "link" else "window"),
        xlabel="time since first output (s)",
        ylabel="interval ms",
        markers=True,
    )
    if result.strips:
        rows = []
        for s in result.strips:
            n_ctx = len(s["observed"]) - (0 if s["predicted"] is None else len(s["predicted"]))
            name = Path(s["bag"]).name
            rows.append((f"{name}@{s['start_frame']} obs", list(s["observed"])))
            pred = [None] * n_ctx + (list(s["predicted"]) if s["predicted"] is not None else [])
            rows.append(("predicted", pred))
        image_strips(out / "strips.png", rows, title="observed (context + future) vs predicted")
