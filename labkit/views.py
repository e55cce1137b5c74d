"""Charts and slider widgets. Needs plotly and ipywidgets (the Jupyter side only).

Figures are built from `labkit.explore` data. Widget callbacks call one labkit function and set
trace data — no arithmetic here. Every widget is constructible headless (tests build them with
no browser) and shows errors as one line under itself instead of a traceback.
"""
from __future__ import annotations

import contextlib
import html

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from . import explore

PREDICTED = dict(color="#1f77b4")
MEASURED = dict(color="#d62728")
NOISY = dict(color="#ff9896")


def roofline_figure(curves: list[dict], points: list[list[dict]], title: str) -> go.Figure:
    """Log-log roofline(s) from `explore.roofline_curve`, each with its `explore.phase_points`."""
    fig = go.Figure()
    for curve, pts, dash in zip(curves, points, ("solid", "dash", "dot")):
        fig.add_scatter(x=curve["intensity_flops_per_byte"], y=curve["attainable_flops_per_s"],
                        mode="lines", line=dict(dash=dash), name=f"{curve['name']} ({curve['kind']}, {curve['dtype']})")
        fig.add_scatter(x=[curve["ridge_flops_per_byte"]], y=[curve["peak_flops_per_s"]], mode="markers",
                        marker=dict(symbol="diamond", size=9), showlegend=False,
                        hovertext=[f"ridge point {curve['ridge_flops_per_byte']:,.0f} FLOP/byte"])
        fig.add_scatter(x=[p["intensity_flops_per_byte"] for p in pts],
                        y=[p["attainable_flops_per_s"] for p in pts], mode="markers+text",
                        text=[f"{p['label']} ({p['bound']}-bound)" for p in pts], textposition="top center",
                        marker=dict(size=11), name=f"phases on {curve['name']}")
    fig.update_xaxes(type="log", title="arithmetic intensity (FLOP per byte moved)")
    fig.update_yaxes(type="log", title="attainable FLOP/s")
    fig.update_layout(title=title, height=480, legend=dict(orientation="h", y=-0.2))
    return fig


class ErrorLine:
    """An HTML line under a widget: a status while measuring, the message when something fails."""

    def __init__(self):
        self.widget = widgets.HTML("")

    def status(self, text: str):
        self.widget.value = f"<span style='color:#555'>{html.escape(text)}</span>"

    @contextlib.contextmanager
    def guard(self):
        """Run a callback; any error becomes one red line here and the kernel keeps running."""
        try:
            yield
        except Exception as err:  # noqa: BLE001 — a learner's slider must never kill the kernel
            kind = "" if isinstance(err, ValueError) else f"{type(err).__name__}: "
            self.widget.value = f"<span style='color:#b00'>⚠ {html.escape(kind + str(err))}</span>"
            self.last_error = err
        else:
            self.last_error = None


def measured_vs_predicted_figure(x_title: str, predicted: dict, x_key: str, title: str,
                                 log_y: bool = False) -> go.FigureWidget:
    """Two rows: time (predicted line, measured points) and residual (measured / predicted - 1)."""
    fig = go.FigureWidget(make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.7, 0.3],
                                        vertical_spacing=0.06))
    fig.add_scatter(x=predicted[x_key], y=predicted["predicted_time_s"], mode="lines",
                    line=PREDICTED, name="predicted (calibrated roofline)", row=1, col=1)
    fig.add_scatter(x=[], y=[], mode="markers", marker=dict(size=10, **MEASURED), name="measured", row=1, col=1)
    fig.add_scatter(x=[], y=[], mode="markers", marker=dict(size=10, symbol="x", **NOISY),
                    name="measured, noisy (spread too wide)", row=1, col=1)
    fig.add_bar(x=[], y=[], marker=MEASURED, name="residual", showlegend=False, row=2, col=1)
    fig.update_yaxes(title="time (s)", type="log" if log_y else "linear", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title="measured/predicted − 1", tickformat="+.0%", row=2, col=1)
    fig.update_xaxes(title=x_title, row=2, col=1)
    fig.update_layout(title=title, height=520, legend=dict(orientation="h", y=-0.25), bargap=0.6)
    return fig


def set_measured(fig: go.FigureWidget, series: dict):
    """Put `explore.measured_series` output into the measured, noisy and residual traces."""
    clean = [i for i, noisy in enumerate(series["noisy"]) if not noisy]
    noisy = [i for i, flag in enumerate(series["noisy"]) if flag]
    with fig.batch_update():
        fig.data[1].x = [series["x"][i] for i in clean]
        fig.data[1].y = [series["time_s"][i] for i in clean]
        fig.data[1].hovertext = [series["label"][i] for i in clean]
        fig.data[2].x = [series["x"][i] for i in noisy]
        fig.data[2].y = [series["time_s"][i] for i in noisy]
        fig.data[3].x = series["x"]
        fig.data[3].y = series["residual"]


class SliderLab:
    """Sliders that re-run one real measurement each time they are released.

    `measure(**values) -> record` is one labkit call (a `sweeps.measure_*` function); `x_key`
    names the record field on the x axis. Records accumulate, so moving the slider builds the curve.
    """

    def __init__(self, sliders: dict, measure, predicted: dict, x_key: str, x_title: str, title: str,
                 log_y: bool = False):
        self.sliders, self.measure, self.x_key = sliders, measure, x_key
        self.records: list[dict] = []
        self.figure = measured_vs_predicted_figure(x_title, predicted, x_key, title, log_y)
        self.error = ErrorLine()
        for slider in sliders.values():
            slider.continuous_update = False
            slider.observe(self.on_change, names="value")
        self.widget = widgets.VBox([widgets.HBox(list(sliders.values())), self.figure, self.error.widget])

    def prime(self, settings: list[dict]):
        """Measure a first few points (with a progress bar) so the chart starts with a curve."""
        bar = widgets.IntProgress(value=0, min=0, max=len(settings), description="measuring")
        self.widget.children = (*self.widget.children, bar)
        for values in settings:
            with self.error.guard():
                self.records.append(self.measure(**values))
            bar.value += 1
        with self.error.guard():
            set_measured(self.figure, explore.measured_series(self.records, self.x_key))
        self.widget.children = self.widget.children[:-1]

    def values(self) -> dict:
        return {name: slider.value for name, slider in self.sliders.items()}

    def on_change(self, _change=None):
        """Slider callback: measure once at the sliders' values, redraw."""
        self.error.status(f"measuring {self.values()} …")
        with self.error.guard():
            self.records.append(self.measure(**self.values()))
            set_measured(self.figure, explore.measured_series(self.records, self.x_key))
            last = self.records[-1]
            self.error.status(f"measured {last['time_s'] * 1e3:,.1f} ms on {last.get('device_name', last['device'])}; "
                              f"predicted {last['predicted_time_s'] * 1e3:,.1f} ms")


def int_slider(name: str, value: int, low: int, high: int, step: int = 1) -> widgets.IntSlider:
    """An integer slider that only fires on release (each move runs a real measurement)."""
    return widgets.IntSlider(value=value, min=low, max=high, step=step, description=name,
                             continuous_update=False, style={"description_width": "initial"},
                             layout=widgets.Layout(width="420px"))
