"""The frontier as a PNG (Pillow; matplotlib is not a dependency): response latency against
interval on log axes, each front point coloured by devices per stream, the published points
as labelled vertical lines at their interval (their response latency is not published)."""

from __future__ import annotations

import math
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

WIDTH, HEIGHT = 900, 560
LEFT, RIGHT, TOP, BOTTOM = 80, 230, 50, 60
# Devices per stream, upper bound of each colour class.
CLASSES = [
    (0.5, "<= 0.5", (31, 119, 180)),
    (1.0, "<= 1", (44, 160, 44)),
    (2.0, "<= 2", (188, 189, 34)),
    (8.0, "<= 8", (255, 127, 14)),
    (32.0, "<= 32", (214, 39, 40)),
    (math.inf, "> 32", (148, 103, 189)),
]


def _font(size: int = 13):
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow without FreeType: a fixed bitmap font
        return ImageFont.load_default()


def _decades(lo: float, hi: float) -> list[float]:
    """1, 2, 5 x 10^k ticks spanning [lo, hi] (every digit where that gives fewer than 3)."""
    for digits in ((1, 2, 5), range(1, 10)):
        ticks = [
            m * 10.0**k
            for k in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
            for m in digits
            if lo <= m * 10.0**k <= hi
        ]
        if len(ticks) >= 3:
            break
    return ticks


def _label(v: float) -> str:
    return f"{v:g}" if v < 1e4 else f"{v:.0e}"


def frontier_chart(result: dict, path: str | Path) -> None:
    """Draw ``physis-sim --experiment frontier`` output into ``path``."""
    points = result["frontier"]
    if not points:
        raise ValueError("no frontier points to draw")
    xs = [p["interval_ms"] for p in points] + [p["interval_ms"] for p in result["published"]]
    ys = [p["response_latency_ms"] for p in points]
    x0, x1 = min(xs) / 1.5, max(xs) * 1.5
    y0, y1 = min(ys) / 1.2, max(ys) * 1.2
    img = Image.new("RGB", (WIDTH, HEIGHT), "white")
    draw = ImageDraw.Draw(img)
    font = _font()
    right = WIDTH - RIGHT

    def px(x: float, y: float) -> tuple[float, float]:
        fx = (math.log10(x) - math.log10(x0)) / (math.log10(x1) - math.log10(x0))
        fy = (math.log10(y) - math.log10(y0)) / (math.log10(y1) - math.log10(y0))
        return LEFT + fx * (right - LEFT), HEIGHT - BOTTOM - fy * (HEIGHT - BOTTOM - TOP)

    title = (
        f"{result['model']}, {result['latent_frames']} latent frame(s) per chunk, W = "
        f"{result['window']}: front on {result['devices']} modelled H200s"
    )
    draw.text((WIDTH / 2, 16), title, fill="black", font=_font(15), anchor="mt")
    draw.text(
        ((LEFT + right) / 2, HEIGHT - 16),
        "interval (ms, log)",
        fill="black",
        font=font,
        anchor="mb",
    )
    draw.text((8, TOP - 22), "response latency (ms, log)", fill="black", font=font)
    draw.rectangle([LEFT, TOP, right, HEIGHT - BOTTOM], outline="black")
    for t in _decades(x0, x1):
        x, _ = px(t, y0)
        draw.line([x, TOP, x, HEIGHT - BOTTOM], fill=(232, 232, 232))
        draw.text((x, HEIGHT - BOTTOM + 6), _label(t), fill="black", font=font, anchor="mt")
    for t in _decades(y0, y1):
        _, y = px(x0, t)
        draw.line([LEFT, y, right, y], fill=(232, 232, 232))
        draw.text((LEFT - 6, y), _label(t), fill="black", font=font, anchor="rm")
    for i, p in enumerate(result["published"]):
        x, _ = px(p["interval_ms"], y0)
        for y in range(TOP, HEIGHT - BOTTOM, 10):  # dashed
            draw.line([x, y, x, min(y + 5, HEIGHT - BOTTOM)], fill=(120, 120, 120), width=2)
        draw.text(
            (x + 4, TOP + 4 + 16 * i),
            f"published {p['interval_ms']:g} ms @ {p['devices_per_stream']:g} dev/stream",
            fill=(80, 80, 80),
            font=_font(11),
        )
    for p in sorted(points, key=lambda p: -p["devices_per_stream"]):
        color = next(c for bound, _, c in CLASSES if p["devices_per_stream"] <= bound)
        x, y = px(p["interval_ms"], p["response_latency_ms"])
        draw.ellipse([x - 4, y - 4, x + 4, y + 4], fill=color, outline="black")
    _legend(draw, points, right, font)
    img.save(str(path))


def _legend(draw: ImageDraw.ImageDraw, points: list[dict], right: float, font) -> None:
    """The colour classes and what the points are, right of the plot."""
    draw.text((right + 14, TOP + 4), "devices per stream", fill="black", font=font)
    for i, (_, name, color) in enumerate(CLASSES):
        y = TOP + 26 + 20 * i
        draw.ellipse([right + 16, y - 5, right + 26, y + 5], fill=color, outline="black")
        draw.text((right + 34, y), name, fill="black", font=font, anchor="lm")
    note_y = TOP + 26 + 20 * len(CLASSES) + 16
    missed = sum(1 for p in points if not p.get("simulated", {}).get("keeps_promise", True))
    simulated = all("simulated" in p for p in points)
    verdict = (
        ["not simulated"]
        if not simulated
        else ["every one simulated as", "planned kept its promise"]
        if not missed
        else ["simulated as planned:", f"{missed} missed its promise"]
    )
    for line in (
        "each point: a placement",
        "(depth x streams sharing);",
        "none beats another on",
        "interval, latency and",
        "devices per stream;",
        *verdict,
    ):
        draw.text((right + 14, note_y), line, fill=(60, 60, 60), font=_font(11))
        note_y += 15
