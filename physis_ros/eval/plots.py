"""Small PNG charts drawn with Pillow (matplotlib is not a dependency of this package).

What belongs here: a line chart, a histogram and image strips — axes with ticks and
labels, a legend — enough for the evaluation and training reports. Nothing else.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189)]
WIDTH, HEIGHT = 720, 420
MARGIN_L, MARGIN_R, MARGIN_T, MARGIN_B = 70, 20, 40, 55


def _font(size: int = 13):
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow without FreeType: fixed bitmap font
        return ImageFont.load_default()


def _nice_ticks(lo: float, hi: float, n: int = 6) -> list[float]:
    if not math.isfinite(lo) or not math.isfinite(hi):
        return [0.0]
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), default=10 * mag)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 100 or float(v).is_integer() else f"{v:.3g}"


LEGEND_ROW = 18
LEGEND_COLUMNS = 2


class _Axes:
    """A plot area with ticks, labels and, below the x label (never over the data), a legend
    of ``names`` in two columns."""

    def __init__(  # noqa: PLR0917 - a chart's texts, ranges and legend
        self, title: str, xlabel: str, ylabel: str, xr, yr, names: list[str]
    ) -> None:
        self.names = names
        rows = math.ceil(len(names) / LEGEND_COLUMNS)
        self.height = HEIGHT + LEGEND_ROW * rows + (6 if rows else 0)
        self.img = Image.new("RGB", (WIDTH, self.height), "white")
        self.draw = ImageDraw.Draw(self.img)
        pad_y = 0.05 * (yr[1] - yr[0] or 1.0)
        self.x0, self.x1 = xr
        self.y0, self.y1 = yr[0] - pad_y, yr[1] + pad_y
        if self.x1 <= self.x0:
            self.x1 = self.x0 + 1
        if self.y1 <= self.y0:
            self.y1 = self.y0 + 1
        self.left, self.top = MARGIN_L, MARGIN_T
        self.right, self.bottom = WIDTH - MARGIN_R, HEIGHT - MARGIN_B
        d, f = self.draw, _font()
        d.text((WIDTH / 2, 12), title, fill="black", font=_font(15), anchor="mt")
        d.text((WIDTH / 2, HEIGHT - 14), xlabel, fill="black", font=f, anchor="mb")
        d.text((8, MARGIN_T - 22), ylabel, fill="black", font=f)
        d.rectangle([self.left, self.top, self.right, self.bottom], outline="black")
        for t in _nice_ticks(self.x0, self.x1):
            px = self.px(t, self.y0)[0]
            d.line([px, self.bottom, px, self.bottom + 4], fill="black")
            d.text((px, self.bottom + 6), _fmt(t), fill="black", font=f, anchor="mt")
        for t in _nice_ticks(self.y0, self.y1):
            py = self.px(self.x0, t)[1]
            d.line([self.left - 4, py, self.left, py], fill="black")
            d.line([self.left + 1, py, self.right - 1, py], fill=(230, 230, 230))
            d.text((self.left - 6, py), _fmt(t), fill="black", font=f, anchor="rm")

    def px(self, x: float, y: float) -> tuple[float, float]:
        fx = (x - self.x0) / (self.x1 - self.x0)
        fy = (y - self.y0) / (self.y1 - self.y0)
        return (
            self.left + fx * (self.right - self.left),
            self.bottom - fy * (self.bottom - self.top),
        )

    def legend(self) -> None:
        f = _font()
        column_w = (self.right - self.left) / LEGEND_COLUMNS
        for i, name in enumerate(self.names):
            row, col = divmod(i, LEGEND_COLUMNS)
            x = self.left + col * column_w
            y = HEIGHT + 4 + LEGEND_ROW * row
            self.draw.line([x, y, x + 24, y], fill=COLORS[i % len(COLORS)], width=3)
            self.draw.text((x + 30, y), name, fill="black", font=f, anchor="lm")

    def save(self, path: Path | str) -> None:
        self.img.save(str(path))


def line_chart(
    path: Path | str,
    series: dict[str, tuple[list[float], list[float]]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    markers: bool = True,
) -> None:
    """One line per series {name: (xs, ys)}; None/NaN points are left out."""
    pts = {
        k: [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None and math.isfinite(y)]
        for k, (xs, ys) in series.items()
    }
    all_x = [x for p in pts.values() for x, _ in p] or [0.0, 1.0]
    all_y = [y for p in pts.values() for _, y in p] or [0.0, 1.0]
    ax = _Axes(
        title, xlabel, ylabel, (min(all_x), max(all_x)), (min(all_y), max(all_y)), list(series)
    )
    for i, p in enumerate(pts.values()):
        color = COLORS[i % len(COLORS)]
        xy = [ax.px(x, y) for x, y in p]
        if len(xy) > 1:
            ax.draw.line(xy, fill=color, width=2)
        if markers:
            for x, y in xy:
                ax.draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=color)
    ax.legend()
    ax.save(path)


def histogram(
    path: Path | str, values: dict[str, list[float]], *, title: str, xlabel: str, bins: int = 30
) -> None:
    """Overlaid histograms (outlined bars) of each named list of values."""
    all_v = [v for vs in values.values() for v in vs if math.isfinite(v)]
    lo, hi = (min(all_v), max(all_v)) if all_v else (0.0, 1.0)
    if hi <= lo:
        hi = lo + 1.0
    edges = np.linspace(lo, hi, bins + 1)
    counts = {k: np.histogram(np.asarray(vs, float), bins=edges)[0] for k, vs in values.items()}
    top = max((int(c.max()) for c in counts.values() if c.size), default=1) or 1
    ax = _Axes(title, xlabel, "count", (lo, hi), (0, top), list(values))
    for i, c in enumerate(counts.values()):
        color = COLORS[i % len(COLORS)]
        for j, n in enumerate(c):
            if n:
                x_a, y_a = ax.px(edges[j], n)
                x_b, y_b = ax.px(edges[j + 1], 0)
                ax.draw.rectangle([x_a + 1, y_a, x_b - 1, y_b], outline=color, width=2)
    ax.legend()
    ax.save(path)


def image_strips(
    path: Path | str,
    rows: list[tuple[str, list[np.ndarray | None]]],
    *,
    title: str,
    scale: int = 3,
) -> None:
    """A grid of [H, W, 3] uint8 images, one labelled row each; None leaves a blank cell."""

    cells = [img for _, imgs in rows for img in imgs if img is not None]
    if not cells:
        raise ValueError("image_strips needs at least one image")
    h, w = cells[0].shape[:2]
    ch, cw = h * scale, w * scale
    label_w = 110
    n_cols = max(len(imgs) for _, imgs in rows)
    canvas = Image.new("RGB", (label_w + n_cols * (cw + 2), 28 + len(rows) * (ch + 4)), "white")
    draw = ImageDraw.Draw(canvas)
    draw.text((4, 6), title, fill="black", font=_font(14))
    for r, (label, imgs) in enumerate(rows):
        y = 28 + r * (ch + 4)
        draw.text((4, y + ch / 2), label, fill="black", font=_font(12), anchor="lm")
        for c, img in enumerate(imgs):
            if img is None:
                continue
            tile = Image.fromarray(img).resize((cw, ch), Image.Resampling.NEAREST)
            canvas.paste(tile, (label_w + c * (cw + 2), y))
    canvas.save(str(path))
