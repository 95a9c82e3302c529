"""Small line charts written as SVG text: the run report's plots, with no plotting library to import.

A ``Chart`` is a title over a grid of ``Panel``s; each panel has its own linear x and y scales (the data range
plus 5% each side), ticks at round numbers with grid lines, axis labels, a legend, and any number of ``Line``s
(solid or dashed, with or without point markers) and unlabelled horizontal ``Level``s. ``Chart.svg()`` returns
the markup; ``Chart.boxes()`` the pixel box and data limits of each panel, which is what the markup maps points by.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from typing import NamedTuple

# Ten colours that stay apart from each other on white, in the order lines of a panel take them.
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
FONT = 11  # px; the layout below estimates a label's width as 0.6 of the font size per character
CHAR_WIDTH = 0.6 * FONT
# Pixel layout of one panel's cell: the plot box sits inside these margins.
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 64, 16, 26, 60
TITLE_HEIGHT = 34  # the chart's title band above the grid of panels
PANEL_HEIGHT = 280


@dataclass
class Line:
    label: str
    xs: list[float]
    ys: list[float]
    color: str
    dashed: bool = False
    markers: bool = False


@dataclass
class Level:
    """A horizontal segment at ``y`` from ``x0`` to ``x1``; both None: across the whole panel. Not in the legend."""

    y: float
    color: str
    x0: float | None = None
    x1: float | None = None
    dotted: bool = True


@dataclass
class Panel:
    title: str = ""
    xlabel: str = ""
    lines: list[Line] = field(default_factory=list)
    levels: list[Level] = field(default_factory=list)

    def add_line(self, label: str, xs: list[float], ys: list[float], dashed: bool = False, markers: bool = False):
        """A line in the panel's next palette colour; returns it (its colour is what a matching Level takes)."""
        if len(xs) != len(ys):
            raise ValueError(f"line {label!r} has {len(xs)} x values and {len(ys)} y values; give one y per x.")
        line = Line(label, list(xs), list(ys), PALETTE[len(self.lines) % len(PALETTE)], dashed, markers)
        self.lines.append(line)
        return line

    def limits(self) -> tuple[tuple[float, float], tuple[float, float]]:
        """(x limits, y limits): every drawn x and y, plus 5% of the range each side."""
        xs = [x for line in self.lines for x in line.xs]
        xs += [x for level in self.levels for x in (level.x0, level.x1) if x is not None]
        ys = [y for line in self.lines for y in line.ys] + [level.y for level in self.levels]
        return padded(xs), padded(ys)


def padded(values: list[float]) -> tuple[float, float]:
    """The range of ``values`` widened by 5% each side; one distinct value v: v +- 5% of |v| (or +-0.5 at 0)."""
    if not values:
        return 0.0, 1.0
    low, high = min(values), max(values)
    pad = 0.05 * (high - low) if high > low else (0.05 * abs(low) or 0.5)
    return low - pad, high + pad


def ticks(low: float, high: float, most: int = 7, integers: bool = False) -> list[float]:
    """Round numbers (1, 2, 2.5 or 5 times a power of ten apart) between ``low`` and ``high``, at most ``most``;
    ``integers``: whole numbers only (an axis of steps has no step 1.5)."""
    raw = (high - low) / max(most - 1, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    if integers and step < 1:
        step = 1.0
    elif integers and step != round(step):  # 2.5, 25, ...: the next round multiple that is whole
        step = 2 * step
    first = math.ceil(low / step - 1e-9)
    values = []
    for index in range(first, first + most + 2):
        value = index * step
        if value > high + 1e-9 * step:
            break
        values.append(0.0 if abs(value) < 1e-12 * step else value)
    return values


def tick_label(value: float) -> str:
    return f"{value:.4g}"


class Box(NamedTuple):
    """A panel's plot box in pixels and the data limits it shows; ``x``/``y`` map data to pixels."""

    left: float
    top: float
    width: float
    height: float
    xlim: tuple[float, float]
    ylim: tuple[float, float]

    def x(self, value: float) -> float:
        return self.left + (value - self.xlim[0]) / (self.xlim[1] - self.xlim[0]) * self.width

    def y(self, value: float) -> float:
        return self.top + (self.ylim[1] - value) / (self.ylim[1] - self.ylim[0]) * self.height


def _number(value: float) -> str:
    return f"{value:.2f}".rstrip("0").rstrip(".")


def _text(x: float, y: float, text: str, anchor: str = "middle", extra: str = "") -> str:
    return (
        f'<text x="{_number(x)}" y="{_number(y)}" text-anchor="{anchor}"{extra}>{html.escape(text, quote=False)}</text>'
    )


@dataclass
class Chart:
    title: str
    panels: list[Panel]
    columns: int = 1

    @property
    def size(self) -> tuple[int, int]:
        rows = math.ceil(len(self.panels) / self.columns)
        return (700 if self.columns == 1 else 1100), TITLE_HEIGHT + PANEL_HEIGHT * rows

    def boxes(self) -> list[Box]:
        width = self.size[0] / self.columns
        boxes = []
        for index, panel in enumerate(self.panels):
            row, column = divmod(index, self.columns)
            xlim, ylim = panel.limits()
            boxes.append(
                Box(
                    column * width + MARGIN_LEFT,
                    TITLE_HEIGHT + row * PANEL_HEIGHT + MARGIN_TOP,
                    width - MARGIN_LEFT - MARGIN_RIGHT,
                    PANEL_HEIGHT - MARGIN_TOP - MARGIN_BOTTOM,
                    xlim,
                    ylim,
                )
            )
        return boxes

    def svg(self, name: str = "chart", standalone: bool = False) -> str:
        """The chart as an ``<svg>`` element; ``name`` prefixes its element ids (unique per page), ``standalone``
        adds the XML namespace a file of its own needs."""
        width, height = self.size
        namespace = ' xmlns="http://www.w3.org/2000/svg"' if standalone else ""
        parts = [
            f'<svg{namespace} viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
            f'aria-label="{html.escape(self.title, quote=True)}" font-family="system-ui, sans-serif" '
            f'font-size="{FONT}">',
            f'<rect width="{width}" height="{height}" fill="#fff"/>',
            _text(width / 2, 22, self.title, extra=' font-size="15"'),
        ]
        for index, (panel, box) in enumerate(zip(self.panels, self.boxes())):
            parts.append(_panel_svg(panel, box, f"{name}-clip{index}"))
        parts.append("</svg>")
        return "\n".join(parts)


def _panel_svg(panel: Panel, box: Box, clip: str) -> str:
    parts = [
        f'<g class="panel"><clipPath id="{clip}"><rect x="{_number(box.left)}" y="{_number(box.top)}" '
        f'width="{_number(box.width)}" height="{_number(box.height)}"/></clipPath>'
    ]
    parts += _axes_svg(panel, box)
    parts.append(f'<g clip-path="url(#{clip})">')
    for level in panel.levels:
        x0 = box.left if level.x0 is None else box.x(level.x0)
        x1 = box.left + box.width if level.x1 is None else box.x(level.x1)
        style = ' stroke-dasharray="1.5 3" stroke-width="1"' if level.dotted else ' stroke-width="1.5"'
        parts.append(
            f'<line class="level" x1="{_number(x0)}" y1="{_number(box.y(level.y))}" x2="{_number(x1)}" '
            f'y2="{_number(box.y(level.y))}" stroke="{level.color}"{style}/>'
        )
    for line in panel.lines:
        points = " ".join(f"{_number(box.x(x))},{_number(box.y(y))}" for x, y in zip(line.xs, line.ys))
        dash = ' stroke-dasharray="6 4"' if line.dashed else ""
        parts.append(
            f'<polyline points="{points}" fill="none" stroke="{line.color}" stroke-width="1.5"{dash}>'
            f"<title>{html.escape(line.label, quote=False)}</title></polyline>"
        )
        if line.markers:
            parts += [
                f'<circle cx="{_number(box.x(x))}" cy="{_number(box.y(y))}" r="2.5" fill="{line.color}"/>'
                for x, y in zip(line.xs, line.ys)
            ]
    parts.append("</g>")
    parts.append(_legend_svg(panel, box))
    parts.append("</g>")
    return "\n".join(parts)


def _axes_svg(panel: Panel, box: Box) -> list[str]:
    """The box's frame, grid lines and tick labels on both axes, the panel title and the x label."""
    right, bottom = box.left + box.width, box.top + box.height
    parts = []
    whole = all(float(x).is_integer() for line in panel.lines for x in line.xs)
    for value in ticks(*box.xlim, integers=whole):
        x = box.x(value)
        parts.append(
            f'<line x1="{_number(x)}" y1="{_number(box.top)}" x2="{_number(x)}" y2="{_number(bottom + 4)}" '
            'stroke="#000" stroke-opacity="0.15"/>'
        )
        parts.append(_text(x, bottom + 16, tick_label(value)))
    for value in ticks(*box.ylim):
        y = box.y(value)
        parts.append(
            f'<line x1="{_number(box.left - 4)}" y1="{_number(y)}" x2="{_number(right)}" y2="{_number(y)}" '
            'stroke="#000" stroke-opacity="0.15"/>'
        )
        parts.append(_text(box.left - 7, y + FONT / 3, tick_label(value), anchor="end"))
    parts.append(
        f'<rect class="plot-box" x="{_number(box.left)}" y="{_number(box.top)}" width="{_number(box.width)}" '
        f'height="{_number(box.height)}" fill="none" stroke="#444"/>'
    )
    if panel.title:
        parts.append(_text(box.left + box.width / 2, box.top - 8, panel.title, extra=' font-size="12"'))
    if panel.xlabel:
        parts.append(_text(box.left + box.width / 2, bottom + 33, panel.xlabel))
    return parts


def _legend_svg(panel: Panel, box: Box) -> str:
    """Each line's label beside a sample of its stroke, in one row centred under the x label (never over data)."""
    if not panel.lines:
        return ""
    widths = [34 + len(line.label) * CHAR_WIDTH for line in panel.lines]
    left, y = box.left + (box.width - sum(widths)) / 2, box.top + box.height + 50
    parts = ['<g class="legend">']
    for line, width in zip(panel.lines, widths):
        dash = ' stroke-dasharray="6 4"' if line.dashed else ""
        parts.append(
            f'<line x1="{_number(left + 4)}" y1="{_number(y)}" x2="{_number(left + 26)}" y2="{_number(y)}" '
            f'stroke="{line.color}" stroke-width="1.5"{dash}/>'
        )
        parts.append(_text(left + 30, y + FONT / 3, line.label, anchor="start"))
        left += width
    parts.append("</g>")
    return "\n".join(parts)
