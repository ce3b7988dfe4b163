"""A figure for a PNG file: matplotlib's figure API on the Agg canvas, never pyplot.

    fig = agg_figure(figsize=(8, 4.5))       # raises ImportError without matplotlib (an optional dependency)
    ax = fig.subplots()
    ...
    fig.savefig("plot.png", dpi=110)

pyplot would switch the process's backend (``matplotlib.use``), keep every figure in its registry until
``plt.close`` and import its whole state machine; a figure of its own touches no global state, so it is safe in a
training process, a notebook or a thread, and needs no closing.
"""
from __future__ import annotations

from typing import Any

__all__ = ["agg_figure"]


def agg_figure(**kwargs: Any):
    """A ``matplotlib.figure.Figure(**kwargs)`` drawn by the Agg canvas (``savefig`` writes PNG)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig
