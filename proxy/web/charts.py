"""Inline SVG for the dashboard: budget bars, bar charts and line charts, styled by CSS classes.

No script and no inline styles (the pages' Content-Security-Policy allows neither); every text
that reaches the markup is escaped. Hovering a bar or point shows its value (an SVG `<title>`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from markupsafe import Markup, escape

__all__ = ["Series", "bar_chart", "budget_bar", "line_chart"]

_WIDTH = 720
_HEIGHT = 200
_LEFT = 64
_RIGHT = 12
_TOP = 12
_BOTTOM = 28
_PLOT_W = _WIDTH - _LEFT - _RIGHT
_PLOT_H = _HEIGHT - _TOP - _BOTTOM


@dataclass(frozen=True, slots=True)
class Series:
    name: str
    values: Sequence[float | None]
    css: str


def budget_bar(ratio: float, level: str) -> Markup:
    """A 120x10 bar filled to `ratio` (capped at 100%), coloured by `level` (ok, warn, over)."""
    filled = max(0.0, min(ratio, 1.0)) * 120
    return Markup(  # noqa: S704 - numbers and escaped text only
        '<svg class="budget" width="120" height="10" viewBox="0 0 120 10" role="img" '
        f'aria-label="{ratio:.0%} used"><rect class="track" width="120" height="10" rx="2"/>'
        f'<rect class="fill {escape(level)}" width="{filled:.1f}" height="10" rx="2"/></svg>'
    )


def bar_chart(
    labels: Sequence[str], values: Sequence[float], fmt: Callable[[float], str], title: str
) -> Markup:
    """One bar per label (a time bucket), the y axis from 0 to the largest value."""
    top = _nice_top(max(values, default=0.0))
    step = _PLOT_W / max(len(values), 1)
    parts = [_frame(title, top, fmt), *_x_labels(labels, step)]
    for i, (label, value) in enumerate(zip(labels, values, strict=True)):
        height = value / top * _PLOT_H
        x = _LEFT + i * step + step * 0.1
        parts.append(
            f'<rect class="bar" x="{x:.1f}" y="{_TOP + _PLOT_H - height:.1f}" '
            f'width="{step * 0.8:.1f}" height="{height:.1f}">'
            f"<title>{escape(label)}: {escape(fmt(value))}</title></rect>"
        )
    return _svg(title, parts)


def line_chart(
    labels: Sequence[str], series: Sequence[Series], fmt: Callable[[float], str], title: str
) -> Markup:
    """One polyline per series; gaps (None) break the line, a legend names each series."""
    found = [v for s in series for v in s.values if v is not None]
    top = _nice_top(max(found, default=0.0))
    step = _PLOT_W / max(len(labels), 1)
    parts = [_frame(title, top, fmt), *_x_labels(labels, step)]
    for n, line in enumerate(series):
        points = []
        for i, (label, value) in enumerate(zip(labels, line.values, strict=True)):
            if value is None:
                continue
            x, y = _LEFT + (i + 0.5) * step, _TOP + _PLOT_H - value / top * _PLOT_H
            points.append(f"{x:.1f},{y:.1f}")
            parts.append(
                f'<circle class="dot {escape(line.css)}" cx="{x:.1f}" cy="{y:.1f}" r="2.5">'
                f"<title>{escape(label)} {escape(line.name)}: {escape(fmt(value))}</title></circle>"
            )
        if len(points) > 1:
            parts.append(f'<polyline class="line {escape(line.css)}" points="{" ".join(points)}"/>')
        legend_x = _LEFT + 8 + n * 110
        parts.append(
            f'<rect class="key {escape(line.css)}" x="{legend_x}" y="{_TOP}" '
            'width="10" height="10"/>'
            f'<text class="legend" x="{legend_x + 14}" y="{_TOP + 9}">{escape(line.name)}</text>'
        )
    return _svg(title, parts)


def _svg(title: str, parts: list[str]) -> Markup:
    return Markup(  # noqa: S704 - every part was built from numbers and escaped text
        f'<svg class="chart" viewBox="0 0 {_WIDTH} {_HEIGHT}" role="img" '
        f'aria-label="{escape(title)}">{"".join(parts)}</svg>'
    )


def _frame(title: str, top: float, fmt: Callable[[float], str]) -> str:
    """Axes, three gridlines and their values."""
    lines = []
    for fraction in (0.0, 0.5, 1.0):
        y = _TOP + _PLOT_H - fraction * _PLOT_H
        lines.append(
            f'<line class="grid" x1="{_LEFT}" x2="{_WIDTH - _RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>'
            f'<text class="tick" x="{_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">'
            f"{escape(fmt(top * fraction))}</text>"
        )
    return f"<title>{escape(title)}</title>" + "".join(lines)


def _x_labels(labels: Sequence[str], step: float) -> list[str]:
    """At most ~8 labels, evenly spaced, so they never overlap."""
    every = max(1, -(-len(labels) // 8))
    return [
        f'<text class="tick" x="{_LEFT + (i + 0.5) * step:.1f}" y="{_HEIGHT - 8}" '
        f'text-anchor="middle">{escape(label)}</text>'
        for i, label in enumerate(labels)
        if i % every == 0
    ]


def _nice_top(value: float) -> float:
    """The axis top: 1, 2 or 5 times a power of ten, at or above `value` (1 for nothing)."""
    if value <= 0:
        return 1.0
    magnitude = 10.0 ** int(f"{value:e}".split("e")[1])
    for factor in (1.0, 2.0, 5.0, 10.0):
        if value <= factor * magnitude:
            return factor * magnitude
    return 10.0 * magnitude
