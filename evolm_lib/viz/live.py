"""A live plot in a notebook: a plotly figure redrawn from the run's rows after each generation or step.

The figure is shown through JupyterLab's own plotly renderer inside an ``ipywidgets.Output``, whose
outputs are part of the widget's synced state: a front end draws the latest figure whenever it gets
to it, however slowly it loaded. Not a plotly ``FigureWidget``: that is an anywidget, and anywidget
(0.11) drops every later message to a widget whose code took over 2 s to load (plotly's 5 MB bundle,
loaded anew for each widget on a busy machine), so its plot stays empty for good.
"""
from __future__ import annotations

from collections.abc import Sequence

import ipywidgets
import plotly.graph_objects as go
import plotly.io as pio

from ..metrics import Row
from . import plots


class LivePlot:
    """A fitness figure (``plots.fitness_figure``, the one to export) shown in ``widget`` (put it in a
    box, or display the LivePlot itself); ``update(rows)`` redraws it from all rows so far."""

    def __init__(self, figure: go.Figure):
        self.figure = figure
        self.widget = ipywidgets.Output()
        self._draw()

    def update(self, rows: Sequence[Row]) -> None:
        """Refresh the fitness traces from ``rows`` and redraw (one message to the front end)."""
        plots.update_fitness(self.figure, rows)
        self._draw()

    def _draw(self) -> None:
        bundle = pio.renderers["plotly_mimetype"].to_mimebundle(self.figure.to_dict())
        bundle["text/plain"] = f"<{self.figure.layout.title.text or 'plot'}: {_points(self.figure)} points>"
        self.widget.outputs = ({"output_type": "display_data", "data": bundle, "metadata": {}},)

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


def _points(figure: go.Figure) -> int:
    return sum(len(trace.x or ()) for trace in figure.data if trace.name == plots.MEAN)


def live_fitness_plot(title: str = "ES fitness", reward_label: str | None = None) -> LivePlot:
    """An empty live fitness plot (the traces `plots.update_fitness` fills); call ``update(rows)`` after
    each generation or step."""
    return LivePlot(plots.fitness_figure(title, reward_label))
