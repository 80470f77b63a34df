"""Plots for the benchmark pages, written as SVG by hand: a page needs a few lines and bars, not a
plotting library to install."""

from __future__ import annotations

import math
from collections.abc import Iterable


def ticks(lo: float, hi: float) -> list[float]:
    """Round values in [lo, hi], about 5: multiples of 1, 2 or 5 × a power of ten."""
    step = 10 ** math.floor(math.log10((hi - lo) / 5 or 1))
    step *= next(m for m in (1, 2, 5, 10) if (hi - lo) / (step * m) <= 6)
    return [i * step for i in range(math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9) + 1)]


def _value(v: object) -> str:
    return f"{v:.1f}" if isinstance(v, float) else str(v)


class Canvas:
    """An SVG picture on a white ground; `add` takes attributes as keywords (font_size → font-size)."""

    def __init__(self, width: int, height: int, font_size: int = 12) -> None:
        self.parts = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
            f'font-size="{font_size}">',
            f'<rect width="{width}" height="{height}" fill="white"/>',
        ]

    def add(self, tag: str, content: str = "", **attrs: object) -> None:
        a = " ".join(f'{k.replace("_", "-")}="{_value(v)}"' for k, v in attrs.items() if v is not None)
        self.parts.append(f"<{tag} {a}>{content}</{tag}>" if content else f"<{tag} {a}/>")

    def text(self, x: float, y: float, label: str, anchor: str = "start", **attrs: object) -> None:
        self.add("text", label, x=x, y=y, text_anchor=anchor, **attrs)

    def line(
        self, x1: float, y1: float, x2: float, y2: float, colour: str, width: float = 1, dash: str | None = None
    ) -> None:
        self.add("line", x1=x1, y1=y1, x2=x2, y2=y2, stroke=colour, stroke_width=width, stroke_dasharray=dash)

    def polyline(
        self, points: Iterable[tuple[float, float]], colour: str, width: float = 2, dash: str | None = None
    ) -> None:
        d = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
        self.add("polyline", points=d, fill="none", stroke=colour, stroke_width=width, stroke_dasharray=dash)

    def legend(
        self, items: list[tuple[str, str, str | None]], x: float, y: float, across: bool, box: bool = False
    ) -> None:
        """(label, colour, dash) per entry: a line swatch (a square one for bars), in a row or a column."""
        for label, colour, dash in items:
            if box:
                self.add("rect", x=x, y=y - 10, width=12, height=12, fill=colour)
            else:
                self.line(x, y - 4, x + 24, y - 4, colour, 3 if across else 2, dash)
            self.text(x + (16 if box else 30), y, label)
            x, y = (x + 40 + 6.5 * len(label), y) if across else (x, y + 22)

    def render(self) -> str:
        return "\n".join([*self.parts, "</svg>"]) + "\n"


class Axes:
    """A box of the canvas that maps data to pixels: x linear or log₂, y linear."""

    def __init__(
        self,
        canvas: Canvas,
        box: tuple[float, float, float, float],  # left, top, width, height
        x_range: tuple[float, float],
        y_range: tuple[float, float],
        log_x: bool = False,
    ) -> None:
        self.canvas, (self.left, self.top, self.width, self.height) = canvas, box
        self.x_range, self.y_range, self.log_x = x_range, y_range, log_x

    def x(self, v: float) -> float:
        lo, hi = self.x_range
        share = math.log2(v / lo) / math.log2(hi / lo) if self.log_x else (v - lo) / ((hi - lo) or 1)
        return self.left + self.width * share

    def y(self, v: float) -> float:
        lo, hi = self.y_range
        return self.top + self.height * (1 - (v - lo) / ((hi - lo) or 1))

    def curve(
        self, points: Iterable[tuple[float, float]], colour: str, width: float = 2, dash: str | None = None
    ) -> None:
        self.canvas.polyline(((self.x(a), self.y(b)) for a, b in points), colour, width, dash)

    def dots(self, points: Iterable[tuple[float, float]], colour: str) -> None:
        for a, b in points:
            self.canvas.add("circle", cx=self.x(a), cy=self.y(b), r=3.5, fill=colour)

    def level(self, v: float, colour: str = "#888", dash: str | None = "4 3") -> None:
        """A horizontal line across the box at y = v (a target, a grid line)."""
        self.canvas.line(self.left, self.y(v), self.left + self.width, self.y(v), colour, 1, dash)

    def y_ticks(self, values: Iterable[float], fmt: str = "{:g}") -> None:
        for v in values:
            self.level(v, "#e4e4e4", None)
            self.canvas.text(self.left - 6, self.y(v) + 4, fmt.format(v), "end")

    def x_ticks(self, values: Iterable[float], fmt: str = "{:g}") -> None:
        for v in values:
            self.canvas.text(self.x(v), self.top + self.height + 16, fmt.format(v), "middle")

    def labels(self, title: str, x_label: str, y_label: str = "") -> None:
        """A title over the box, the x axis's name under it, the y axis's name up its left side."""
        c, middle = self.canvas, self.left + self.width / 2
        c.text(self.left, self.top - 8, title, font_size=14)
        c.text(middle, self.top + self.height + 34, x_label, "middle")
        if y_label:
            c.text(
                0,
                0,
                y_label,
                "middle",
                transform=f"translate({self.left - 44},{self.top + self.height / 2}) rotate(-90)",
            )

    def frame(self) -> None:
        self.canvas.add(
            "rect", x=self.left, y=self.top, width=self.width, height=self.height, fill="none", stroke="#999"
        )
