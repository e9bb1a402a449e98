"""Small charts as inline SVG text: no matplotlib, no JavaScript, nothing fetched.

Two shapes cover the report: :func:`line_chart` (losses, bytes per step) and :func:`bar_chart`
(horizontal grouped bars: stage balance, raw vs wire bytes per edge). Every value shows in a
``<title>`` tooltip; text is escaped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from html import escape

SERIES_COLOURS = ["#3d85c6", "#e69138", "#6aa84f", "#cc0000", "#674ea7", "#45818e", "#a64d79",
                  "#bf9000"]
FONT = "font-family=\"Helvetica, Arial, sans-serif\""


def _num(x) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [0.0, 1.0]
    if hi <= lo:
        lo, hi = (lo - 1, hi + 1) if lo == 0 else (lo - abs(lo) * 0.1, hi + abs(hi) * 0.1)
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = mag
    for m in (1, 2, 2.5, 5, 10):
        step = m * mag
        if (hi - lo) / step <= n:
            break
    start = math.floor(lo / step) * step
    ticks = []
    t = start
    while t < hi + step * 0.5 and len(ticks) < 50:
        ticks.append(round(t, 12))
        t += step
    if ticks[-1] < hi:
        ticks.append(round(t, 12))
    return ticks


def scaled_ticks(lo: float, hi: float, n: int = 5, binary: bool = False) -> list[float]:
    """:func:`nice_ticks`, round in units of 1024**k when ``binary`` (bytes: 4 KiB, 8 KiB…)."""
    if not binary or not math.isfinite(hi) or hi <= 0:
        return nice_ticks(lo, hi, n)
    scale = 1024.0 ** max(0, math.floor(math.log(hi, 1024)))
    return [t * scale for t in nice_ticks(lo / scale, hi / scale, n)]


def default_fmt(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e6 or a < 1e-3:
        return f"{v:.2e}"
    if a >= 100:
        return f"{v:.0f}"
    return f"{v:.3g}"


def _text(x, y, s, *, anchor="start", size=11, weight="normal", colour="#333", extra="") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-size="{size}" '
            f'font-weight="{weight}" fill="{colour}" {FONT}{extra}>{escape(str(s))}</text>')


def _colour(name: str, i: int, colours: Mapping[str, str] | None) -> str:
    """A series' colour: the one ``colours`` gives its name (a meaning, the same in every chart
    of a report), else the ``i``-th of :data:`SERIES_COLOURS`."""
    if colours and name in colours:
        return colours[name]
    return SERIES_COLOURS[i % len(SERIES_COLOURS)]


def _legend(names: Sequence[str], x: float, y: float,
            colours: Mapping[str, str] | None = None) -> tuple[list[str], float]:
    out = []
    cx = x
    for i, name in enumerate(names):
        colour = _colour(name, i, colours)
        out.append(f'<rect x="{cx:.1f}" y="{y - 9:.1f}" width="12" height="10" fill="{colour}"/>')
        out.append(_text(cx + 16, y, name))
        cx += 16 + 7 * len(str(name)) + 18
    return out, cx


def line_chart(series: Mapping[str, Sequence[float]], *, title: str, x_label: str = "step",
               y_label: str = "", fmt: Callable[[float], str] = default_fmt, width: int = 720,
               height: int = 320, x_start: int = 1, zero: bool = False,
               binary: bool = False, colours: Mapping[str, str] | None = None) -> str:
    """One line per series, x = index + ``x_start``. NaN/None values break the line.
    ``colours``: name → colour, for series whose colour carries a meaning.
    ``zero``: the y axis starts at 0; ``binary``: round ticks in KiB/MiB (bytes)."""
    names = list(series)
    data = {k: [_num(v) for v in series[k]] for k in names}
    values = [v for vs in data.values() for v in vs if math.isfinite(v)]
    n = max((len(vs) for vs in data.values()), default=0)
    left, right, top, bottom = 74, 16, 48, 44
    pw, ph = width - left - right, height - top - bottom
    parts = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">'),
             f'<rect width="{width}" height="{height}" fill="white"/>',
             _text(left, 20, title, size=14, weight="bold")]
    if not values or n == 0:
        parts.append(_text(width / 2, height / 2, "no data", anchor="middle"))
        return "".join(parts) + "</svg>"
    yt = scaled_ticks(min([*values, 0.0]) if zero else min(values), max(values), 5, binary)
    y0, y1 = yt[0], yt[-1]
    xt = nice_ticks(x_start, x_start + max(n - 1, 1), 6)
    xt = [t for t in xt if x_start <= t <= x_start + max(n - 1, 1) and float(t).is_integer()] \
        or [x_start]
    x_hi = x_start + max(n - 1, 1)

    def px(i: float) -> float:
        return left + (i - x_start) / (x_hi - x_start) * pw

    def py(v: float) -> float:
        return top + ph - (v - y0) / ((y1 - y0) or 1) * ph

    for t in yt:
        parts.append(f'<line x1="{left}" x2="{left + pw}" y1="{py(t):.1f}" y2="{py(t):.1f}" '
                     'stroke="#e5e5e5"/>')
        parts.append(_text(left - 6, py(t) + 4, fmt(t), anchor="end", size=10))
    for t in xt:
        parts.append(f'<line x1="{px(t):.1f}" x2="{px(t):.1f}" y1="{top + ph}" '
                     f'y2="{top + ph + 4}" stroke="#999"/>')
        parts.append(_text(px(t), top + ph + 16, f"{t:.0f}", anchor="middle", size=10))
    parts.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" '
                 'stroke="#999"/>')
    parts.append(_text(left + pw / 2, height - 8, x_label, anchor="middle", size=11))
    if y_label:
        parts.append(_text(14, top + ph / 2, y_label, anchor="middle", size=11,
                           extra=f' transform="rotate(-90 14 {top + ph / 2:.1f})"'))
    for si, name in enumerate(names):
        points = [f"{px(i + x_start):.1f},{py(v):.1f}" if math.isfinite(v) else None
                  for i, v in enumerate(data[name])]
        parts += _series_svg(name, data[name], points, _colour(name, si, colours), fmt)
    legend, _ = _legend(names, left + 4, 38, colours)
    parts += legend
    return "".join(parts) + "</svg>"


def _series_svg(name: str, values: list[float], points: list[str | None], colour: str,
                fmt: Callable[[float], str]) -> list[str]:
    """One series as a group with a tooltip (points, last, min): a polyline per run of
    finite values (``points``: "x,y" or None), a dot for a run of one."""
    runs: list[list[str]] = [[]]
    for point in points:
        if point is not None:
            runs[-1].append(point)
        elif runs[-1]:
            runs.append([])
    finite = [v for v in values if math.isfinite(v)]
    tip = f"{name}: {len(finite)} points"
    if finite:
        tip += f", last {fmt(finite[-1])}, min {fmt(min(finite))}"
    out = [f'<g><title>{escape(tip)}</title>']
    for run in runs:
        if len(run) == 1:
            x, y = run[0].split(",")
            out.append(f'<circle cx="{x}" cy="{y}" r="2.5" fill="{colour}"/>')
        elif run:
            out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.8" '
                       f'points="{" ".join(run)}"/>')
    out.append("</g>")
    return out


def bar_chart(categories: Sequence[str], series: Mapping[str, Sequence[float]], *, title: str,
              fmt: Callable[[float], str] = default_fmt, width: int = 720,
              reference: float | None = None, reference_label: str = "",
              bar_height: int = 14, binary: bool = False,
              colours: Mapping[str, str] | None = None) -> str:
    """Horizontal grouped bars: one group per category, one bar per series; an optional
    dashed vertical reference line (e.g. the ideal stage cost)."""
    names = list(series)
    data = {k: [_num(v) for v in series[k]] for k in names}
    label_w = min(260, 12 + 7 * max((len(str(c)) for c in categories), default=4))
    left, right, top = label_w, 90, 50
    group_h = bar_height * len(names) + 8
    height = top + group_h * len(categories) + 30
    pw = width - left - right
    values = [v for vs in data.values() for v in vs if math.isfinite(v)]
    hi = max([*values, reference or 0.0, 0.0])
    ticks = scaled_ticks(0.0, hi or 1.0, 5, binary)
    x1 = ticks[-1]

    def px(v: float) -> float:
        return left + max(v, 0.0) / (x1 or 1) * pw

    parts = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">'),
             f'<rect width="{width}" height="{height}" fill="white"/>',
             _text(8, 20, title, size=14, weight="bold")]
    legend, _ = _legend(names, left, 40, colours)
    parts += legend if len(names) > 1 else []
    base = top + group_h * len(categories)
    for t in ticks:
        parts.append(f'<line x1="{px(t):.1f}" x2="{px(t):.1f}" y1="{top}" y2="{base}" '
                     'stroke="#eee"/>')
        parts.append(_text(px(t), base + 14, fmt(t), anchor="middle", size=10))
    for ci, cat in enumerate(categories):
        gy = top + ci * group_h + 4
        parts.append(_text(left - 6, gy + group_h / 2, cat, anchor="end", size=11))
        for si, name in enumerate(names):
            v = data[name][ci] if ci < len(data[name]) else math.nan
            if not math.isfinite(v):
                continue
            colour = _colour(name, si, colours)
            y = gy + si * bar_height
            parts.append(f'<rect x="{left}" y="{y:.1f}" width="{px(v) - left:.1f}" '
                         f'height="{bar_height - 2}" fill="{colour}"><title>'
                         f'{escape(f"{cat} · {name}: {fmt(v)}")}</title></rect>')
            parts.append(_text(px(v) + 4, y + bar_height - 4, fmt(v), size=10, colour="#555"))
    if reference is not None and math.isfinite(reference):
        x = px(reference)
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top - 4}" y2="{base}" '
                     'stroke="#cc0000" stroke-dasharray="5,3"/>')
        if reference_label:
            parts.append(_text(x, top - 8, reference_label, anchor="middle", size=10,
                               colour="#cc0000"))
    parts.append(f'<line x1="{left}" x2="{left}" y1="{top}" y2="{base}" stroke="#999"/>')
    return "".join(parts) + "</svg>"
