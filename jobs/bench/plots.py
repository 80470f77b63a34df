"""The benchmark pages' plots, drawn with matplotlib (the plot extra) in one style and saved as SVG beside
the page. Each benchmark draws from a JSON-able dict of its numbers, which the harness writes beside the
plot, so `--replot` redraws a page's plot from what was measured without measuring again."""

from __future__ import annotations

import io
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

try:
    import matplotlib
    from matplotlib.figure import Figure
except ImportError:
    raise SystemExit(
        f"{Path(sys.argv[0]).stem}: the plots are drawn with matplotlib, which is not installed: "
        'pip install -e ".[plot]"'
    ) from None

matplotlib.use("Agg")  # files only, no screen

STYLE = {
    "font.size": 9,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "svg.fonttype": "none",  # text stays text: smaller files, searchable
    "svg.hashsalt": "distrain",  # the same figure, the same file
}


def figure(width: float, height: float, rows: int = 1, cols: int = 1, **subplots: object) -> tuple[Figure, object]:
    """A figure of width × height inches and its axes (one, or an array of rows × cols)."""
    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.subplots(rows, cols, squeeze=rows * cols == 1, **subplots)


def log2_x(ax, ticks: Sequence[float]) -> None:  # noqa: ANN001  (a matplotlib Axes)
    """A log₂ x axis labelled at `ticks` in plain numbers."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()


def svg(draw: Callable[[dict], Figure], data: dict) -> str:
    """draw(data) in the house style, as SVG text without the date: the same numbers, the same file."""
    out = io.StringIO()
    with matplotlib.rc_context(STYLE):
        draw(data).savefig(out, format="svg", metadata={"Date": None})
    return out.getvalue()
