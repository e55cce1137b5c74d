"""Charts and the lessons' widgets. Needs plotly and ipywidgets (the Jupyter side only).

Figures are built from `labkit.explore` data, in lesson order. Every lesson widget is a
`LessonWidget`: controls in, one labkit call per change, figures out, the error line under the
charts, a status line; a lesson's own widget only names its controls, its call and its figures.
Every widget is constructible headless (tests build them with no browser) and shows errors as one
line under itself instead of a traceback.
"""
from __future__ import annotations

import contextlib
import html
import json
import math
import numbers
import os
import sys


@contextlib.contextmanager
def _without_iri_format_checker():
    """Import plotly without jsonschema's `iri` format checker: 3-5 s off every kernel start.

    plotly imports nbformat, which imports jsonschema, which imports `rfc3987_syntax` when it is
    installed (JupyterLab's server pulls it in) — and that package compiles ~40 lark grammars on
    import (python-jsonschema/jsonschema#1428). While plotly loads, the module reads as absent,
    so jsonschema skips that one optional checker (nbformat's schemas never use `iri`); afterwards
    it is importable again. Does nothing when jsonschema was imported before us.
    """
    block = "jsonschema" not in sys.modules and "rfc3987_syntax" not in sys.modules
    if block:
        sys.modules["rfc3987_syntax"] = None  # `import` of a None entry raises ImportError
    try:
        yield
    finally:
        if block and sys.modules.get("rfc3987_syntax", 0) is None:
            del sys.modules["rfc3987_syntax"]


with _without_iri_format_checker():
    import ipywidgets as widgets
    import plotly.graph_objects as go
    import plotly.io as pio
    from plotly.subplots import make_subplots
    pio.renderers  # noqa: B018 — lazy in plotly: this is what imports nbformat, which every chart's display needs

from . import explore
from .errors import LabError
from .specs import get_gpu


# ---- plumbing: a live chart, the error line, the one widget base, controls
PREDICTED = dict(color="#1f77b4")
MEASURED = dict(color="#d62728")
NOISY = dict(color="#ff9896")


class LiveFigure(go.Figure):
    """A plotly figure shown live: `.widget` (an ipywidgets Output) is redrawn, whole, after every
    change plotly reports (a batch update, an added trace, a relayout). Display `.widget`, or the
    figure itself, which shows the same widget.

    Why not plotly's FigureWidget: it is an anywidget whose 5 MB front-end module is compiled once
    per chart, and anywidget 0.11 gives each chart 2 s to become ready; a chart that misses that
    drops every later update for good (manzt/anywidget#828 added the deadline). A Voilà page, or
    JupyterLab reopening a notebook, creates all its charts at once, so on a 2-core machine the
    second chart missed it and never redrew when its slider moved. Here the whole figure (a few kB)
    goes to the plotly renderer that draws every other chart: no per-chart module, no deadline,
    no deltas to lose, and a page that loads late still gets the current figure.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._output = widgets.Output()
        self._shown = False  # nothing is sent to a front end until the widget is asked for

    @property
    def widget(self) -> widgets.Output:
        if not self._shown:
            self._shown = True
            self._redraw()
        return self._output

    def _repr_mimebundle_(self, include=None, exclude=None, **kwargs):
        return self.widget._repr_mimebundle_(include=include, exclude=exclude, **kwargs)

    def mime_bundle(self) -> dict:
        """What the Output shows: plotly's JSON mime type, and the title as plain text."""
        return {"application/vnd.plotly.v1+json": json.loads(pio.to_json(self, validate=False, remove_uids=False)),
                "text/plain": f"<chart: {self.layout.title.text or 'untitled'}>"}

    def _redraw(self):
        if not getattr(self, "_shown", False):  # still being built, or not displayed yet
            return
        # The Output keeps its height while the new chart renders, so the page does not jump.
        self._output.layout.min_height = f"{self.layout.height or 450}px"
        self._output.outputs = ({"output_type": "display_data", "data": self.mime_bundle(), "metadata": {}},)

    # plotly calls these after applying each change (a FigureWidget forwards them to its views).
    def _send_addTraces_msg(self, *args, **kwargs):
        self._redraw()

    _send_moveTraces_msg = _send_deleteTraces_msg = _send_restyle_msg = _send_addTraces_msg
    _send_relayout_msg = _send_update_msg = _send_animate_msg = _send_addTraces_msg


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


class LessonWidget:
    """The one shape of every lesson widget: controls in, one labkit call per change, figures out,
    the error line under the charts, and a status line.

        compute(**values) -> result   one labkit call (a measurement, a simulation, a prediction),
                                      with the controls' values by name
        draw(result)                  puts the result into the figures (set_* functions: no arithmetic)
        describe(result) -> str       the status line after a change ("" for none)

    `busy`, when given, is shown while `compute` runs ("measuring" for a real measurement, which
    takes seconds). Controls with `continuous_update` fire only when released: each change may run
    a real measurement. Any error becomes one red line under the charts and the kernel lives on.
    """

    def __init__(self, controls: dict, figures: list, compute, draw, describe=lambda result: "",
                 busy: str | None = None):
        self.controls, self.figures = controls, figures
        self.compute, self.draw, self.describe, self.busy = compute, draw, describe, busy
        self.result = None
        self.error = ErrorLine()
        for control in controls.values():
            if hasattr(control, "continuous_update"):
                control.continuous_update = False
            control.observe(self.on_change, names="value")
        self.widget = widgets.VBox([widgets.HBox(list(controls.values())), *(f.widget for f in figures),
                                    self.error.widget])

    def values(self) -> dict:
        return {name: control.value for name, control in self.controls.items()}

    def on_change(self, _change=None):
        """Control callback: compute once at the controls' values, draw, say what happened."""
        if self.busy:
            self.error.status(f"{self.busy} {self.values()} …")
        with self.error.guard():
            self.result = self.compute(**self.values())
            self.draw(self.result)
            self.error.status(self.describe(self.result))

    def prime(self, settings: list[dict]):
        """Compute, then draw, a first few settings (with a progress bar), so a chart starts with
        points on it; the controls keep their own values.

        All are measured before any is drawn, the last (in a sweep, the longest) first: a chart
        redrawn in the browser while the next point is timed, or the cells above still drawing
        when the first is, took the same 2 cores, and the shortest call suffers most (lesson 02's
        512-token prefill timed 2x slow, confirmed, in a 2-core browser run)."""
        bar, advance = progress(len(settings))
        self.widget.children = (*self.widget.children, bar)
        results = {}
        for done, index in enumerate(reversed(range(len(settings))), start=1):
            with self.error.guard():
                results[index] = self.compute(**settings[index])
            advance(done, len(settings))
        for index in sorted(results):
            with self.error.guard():
                self.result = results[index]
                self.draw(self.result)
        self.widget.children = self.widget.children[:-1]


class Predict(LessonWidget):
    """Predict first: the learner commits an estimate — a number in `unit`, or one of `options` —
    and only then does `reveal(estimate)` (one labkit call, a `predict.reveal_*` function) compute
    the formula's answer and measure; the reveal shows the three side by side with one line on the
    gap. The estimate is locked once committed.

    A run with nobody at the keyboard (LABKIT_AUTO_REVEAL=1: nbval, papermill, `make report`)
    commits `default`, the estimate recorded in `predict.DEFAULTS`, so every reveal executes."""

    def __init__(self, question: str, reveal, default, unit: str | None = None, options: list | None = None):
        if options:
            self.input = widgets.RadioButtons(options=list(options), value=None, layout=widgets.Layout(width="auto"))
        else:
            self.input = widgets.Text(placeholder=f"your estimate ({unit})", layout=widgets.Layout(width="220px"))
        self.unit, self.default = unit, default
        self.button = widgets.Button(description="Commit, then measure", button_style="primary",
                                     layout=widgets.Layout(width="auto"))
        self.answer = widgets.HTML("")
        super().__init__({}, [], reveal, self.show, busy=None)
        self.widget = widgets.VBox([widgets.HTML(f"<b>Predict first.</b> {html.escape(question)}"),
                                    widgets.HBox([self.input, self.button]), self.answer, self.error.widget])
        self.widget.add_class("labkit-predict")
        self.button.on_click(lambda _button: self.commit())
        if os.environ.get("LABKIT_AUTO_REVEAL") == "1":
            self.input.value = default if options else f"{default:g}"
            self.commit()

    def estimate(self):
        """The committed value: the chosen option, or the typed number (LabError-free: ValueError
        with what was expected, shown as the red line)."""
        if self.unit is None:
            if self.input.value is None:
                raise ValueError("pick one of the options first")
            return self.input.value
        text = self.input.value.strip().replace(",", "").rstrip("×x%").strip()
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"type a number ({self.unit}), e.g. {self.default:g}; got {self.input.value!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"type a positive number ({self.unit}); got {self.input.value!r}")
        return value

    def commit(self):
        """Lock the estimate, measure, reveal. A bad estimate leaves the widget open to try again."""
        with self.error.guard():
            estimate = self.estimate()
            self.input.disabled = self.button.disabled = True
            self.error.status("measuring on this machine …")
            self.result = self.compute(estimate)
            self.draw(self.result)
            self.error.status("")
        if self.error.last_error is not None and not self.answer.value:
            self.input.disabled = self.button.disabled = False

    def show(self, reveal: dict):
        rows = "".join(f"<tr><td style='padding:2px 12px 2px 0'>{html.escape(name)}</td>"
                       f"<td style='padding:2px 0'><b>{html.escape(str(value))}</b></td></tr>"
                       for name, value in reveal["rows"])
        self.answer.value = (f"<div><em>{html.escape(reveal['question'])}</em><table>{rows}</table>"
                             f"<p>{html.escape(reveal['gap'])}</p></div>")


def int_slider(name: str, value: int, low: int, high: int, step: int = 1) -> widgets.IntSlider:
    """An integer slider that only fires on release (each move runs a real measurement). A start
    outside low..high is refused (LabError), not clamped: the lesson's first chart is drawn at the
    start value, and a clamped slider would sit at another one beside it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= value <= high:
        raise LabError(f"{name} must start at a whole number in {low:,}..{high:,}, got {value!r}")
    return widgets.IntSlider(value=value, min=low, max=high, step=step, description=name,
                             continuous_update=False, style={"description_width": "initial"},
                             layout=widgets.Layout(width="420px"))


def toggle(name: str, options: list, value=None) -> widgets.ToggleButtons:
    """Toggle buttons (a choice fires once per click)."""
    return widgets.ToggleButtons(options=options, value=value or options[0], description=name,
                                 style={"description_width": "initial", "button_width": "auto"})


def progress(total: int, description: str = "measuring"):
    """An IntProgress bar and a `progress(done, total)` callback that moves it (for sweeps)."""
    bar = widgets.IntProgress(value=0, min=0, max=total, description=description,
                              style={"description_width": "initial"})

    def advance(done, _total):
        bar.value = done
    return bar, advance


def table_html(rows: list[dict]) -> str:
    """A list of flat dicts as an HTML table (keys as the header), every value escaped."""
    cell = "text-align:left;padding:2px 8px"
    head = "".join(f"<th style='{cell}'>{html.escape(str(k))}</th>" for k in rows[0])
    body = "".join("<tr>" + "".join(f"<td style='{cell}'>{html.escape(str(v))}</td>" for v in row.values())
                   + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def table(rows: list[dict]) -> widgets.HTML:
    """`table_html` as a widget: a view can set its `.value` again when its rows change."""
    return widgets.HTML(table_html(rows))


# ---- every lesson: measured beside predicted
def measured_vs_predicted_figure(x_title: str, predicted: dict, x_key: str, title: str,
                                 log_y: bool = False) -> LiveFigure:
    """Two rows: time (predicted line, measured points) and residual (measured / predicted - 1).
    Where `predicted` has them (`explore.with_plan_and_tiers`): the chapter's planning line,
    dashed, as trace 4 (after the four the measured points update), the roof of a decode step's
    kernels in turn (`explore.decode_prediction`), dotted, where it parts from the whole step's, and
    a dotted mark where the working set leaves a cache ("past the L3: DRAM"), so that bend is not
    read as a phase's."""
    fig = LiveFigure(make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.7, 0.3],
                                   vertical_spacing=0.06))
    fig.add_scatter(x=predicted[x_key], y=predicted["predicted_time_s"], mode="lines",
                    line=PREDICTED, name=_roof_name(predicted), row=1, col=1)
    fig.add_scatter(x=[], y=[], mode="markers", marker=dict(size=10, **MEASURED), name="measured", row=1, col=1)
    fig.add_scatter(x=[], y=[], mode="markers", marker=dict(size=10, symbol="x", **NOISY),
                    name="measured, noisy (spread too wide)", row=1, col=1)
    fig.add_bar(x=[], y=[], marker=MEASURED, name="residual", showlegend=False, row=2, col=1)
    fig.update_yaxes(title="time (s)", type="log" if log_y else "linear", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title="measured/predicted − 1", tickformat="+.0%", row=2, col=1)
    fig.update_xaxes(title=x_title, row=2, col=1)
    fig.update_layout(title=title, height=520, legend=dict(orientation="h", y=-0.25), bargap=0.6)
    if "planned_time_s" in predicted:
        fig.add_scatter(x=predicted[x_key], y=predicted["planned_time_s"], mode="lines", line=PLAN,
                        name=explore.PLAN_LABEL, row=1, col=1)
    if explore.in_turn_parts(predicted.get("in_turn_time_s"), predicted["predicted_time_s"]):
        fig.add_scatter(x=predicted[x_key], y=predicted["in_turn_time_s"], mode="lines", line=IN_TURN,
                        name=explore.IN_TURN_LABEL, row=1, col=1)
    add_tier_marks(fig, predicted.get("tiers", []), rows=(1, 2))
    return fig


PLAN = dict(color=PREDICTED["color"], dash="dash", width=1.5)
IN_TURN = dict(color=PREDICTED["color"], dash="dot", width=2.5)
TIER = dict(color="#7f7f7f", dash="dot", width=1)


def _roof_name(predicted: dict) -> str:
    """The predicted line's legend name, with the tiers whose bandwidth it is drawn at."""
    tiers = predicted.get("roof_tiers") or []
    return "predicted (calibrated roofline" + (f", {' then '.join(tiers)} bandwidth)" if tiers else ")")


def add_tier_marks(fig, marks: list[dict], rows=(None,)):
    """A dotted vertical line at each `explore.tier_marks` mark (labelled in the first row, its
    detail on hover): where the working set leaves a cache and the roof drops a tier."""
    for mark in marks:
        for i, row in enumerate(rows):
            where = dict(row=row, col=1) if row else {}
            label = dict(annotation_text=mark["label"], annotation_position="top right",
                         annotation=dict(hovertext=mark["detail"], font=dict(size=11, color="#555"))) if i == 0 else {}
            fig.add_vline(x=mark["x"], line=TIER, **label, **where)


def set_measured(fig: LiveFigure, series: dict):
    """Put `explore.measured_series` output into the measured, noisy and residual traces."""
    clean = [i for i, noisy in enumerate(series["noisy"]) if not noisy]
    noisy = [i for i, flag in enumerate(series["noisy"]) if flag]
    with fig.batch_update():
        fig.data[1].x = [series["x"][i] for i in clean]
        fig.data[1].y = [series["time_s"][i] for i in clean]
        fig.data[1].hovertext = [series["label"][i] for i in clean]
        fig.data[2].x = [series["x"][i] for i in noisy]
        fig.data[2].y = [series["time_s"][i] for i in noisy]
        fig.data[2].hovertext = [series["label"][i] for i in noisy]
        fig.data[3].x = series["x"]
        fig.data[3].y = series["residual"]
        # A noisy point's residual is as untrustworthy as its time: its bar takes the noisy colour.
        fig.data[3].marker.color = [NOISY["color"] if flag else MEASURED["color"] for flag in series["noisy"]]


def add_band(fig, x: list, low: list, high: list, low_name: str, band_name: str, row: int | None = None):
    """A dashed line at `low` and the area between it and `high` shaded (e.g. linear-only
    prediction and the attention term's extra time above it). Appended: existing traces keep
    their indices, so a SliderLab's measured traces still update."""
    where = dict(row=row, col=1) if row else {}
    fig.add_scatter(x=x, y=low, mode="lines", line=dict(dash="dash", **LINEAR), name=low_name, **where)
    fig.add_scatter(x=x, y=high, mode="lines", line=dict(width=0), fill="tonexty",
                    fillcolor="rgba(255,127,14,0.25)", name=band_name, **where)


def add_recorded(fig, series: list[dict], row: int | None = None):
    """Markers for `explore.recorded_series`, each labelled with its hardware and date; a
    host-bound point is hollow and says so when hovered."""
    where = dict(row=row, col=1) if row else {}
    for s in series:
        host_bound = s.get("host_bound") or [False] * len(s["x"])
        fig.add_scatter(x=s["x"], y=s["y"], mode="markers+lines", line=dict(dash="dot"),
                        marker=dict(symbol=["diamond-open" if h else "diamond" for h in host_bound], size=9),
                        hovertext=[explore.HOST_BOUND_NOTE if h else "" for h in host_bound], name=s["label"], **where)


class SliderLab(LessonWidget):
    """Sliders that re-run one real measurement each time they are released; the records
    accumulate, so moving the slider builds the curve. `measure(**values) -> record` is one
    labkit call (a `sweeps.measure_*` function); `x_key` names the record field on the x axis."""

    def __init__(self, sliders: dict, measure, predicted: dict, x_key: str, x_title: str, title: str,
                 log_y: bool = False):
        self.x_key, self.records = x_key, []
        self.figure = measured_vs_predicted_figure(x_title, predicted, x_key, title, log_y)
        super().__init__(sliders, [self.figure], measure, self.add, explore.point_summary, busy="measuring")

    def add(self, record: dict):
        self.records.append(record)
        set_measured(self.figure, explore.measured_series(self.records, self.x_key))


class MeasureLab(LessonWidget):
    """Controls (sliders, toggle buttons) that re-run one real measurement when released and
    redraw one figure: `measure(**values) -> record`, then `draw(figure, record)`."""

    def __init__(self, controls: dict, measure, figure, draw):
        self.figure, self.records = figure, []
        super().__init__(controls, [figure], measure, lambda record: self.add(record, draw), explore.point_summary,
                         busy="measuring")

    def add(self, record: dict, draw):
        self.records.append(record)
        draw(self.figure, record)


# ---- lesson 01: the two phases on a roofline
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


# ---- lesson 02: prefill's two terms
ATTENTION = dict(color="#ff7f0e")
LINEAR = dict(color="#1f77b4")


def prefill_terms_figure(terms: dict, title: str) -> go.Figure:
    """`explore.prefill_terms` as stacked areas (linear below, attention on top) against P,
    with the crossover marked."""
    fig = go.Figure()
    x = terms["prompt_tokens"]
    fig.add_scatter(x=x, y=terms["linear_flops"], stackgroup="flops", line=LINEAR, name="linear term 2NP")
    fig.add_scatter(x=x, y=terms["attention_flops"], stackgroup="flops", line=ATTENTION, name="attention term")
    fig.add_vline(x=terms["crossover_tokens"], line=dict(dash="dot", color="#555"),
                  annotation_text=f"crossover {terms['crossover_tokens']:,.0f}", annotation_position="top left")
    fig.update_xaxes(title="prompt tokens P")
    fig.update_yaxes(title="FLOPs of one prefill")
    fig.update_layout(title=title, height=420, legend=dict(orientation="h", y=-0.2))
    return fig


def share_figure(curves: list[dict], title: str) -> LiveFigure:
    """Attention's share of prefill FLOPs against P (log x), one line per model, each
    crossover marked where the share reaches one half."""
    fig = LiveFigure()
    for curve in curves:
        fig.add_scatter(x=curve["prompt_tokens"], y=curve["attention_share"], mode="lines", name=curve["model"])
    fig.add_scatter(x=[c["crossover_tokens"] for c in curves], y=[0.5] * len(curves), mode="markers+text",
                    text=[f"{c['crossover_tokens']:,.0f}" for c in curves], textposition="top left",
                    marker=dict(size=10, color="#333"), name="crossover (attention = linear)")
    fig.add_hline(y=0.5, line=dict(dash="dot", color="#999"))
    fig.update_xaxes(type="log", title="prompt tokens P")
    fig.update_yaxes(title="attention's share of prefill FLOPs", tickformat=".0%", range=[0, 1])
    fig.update_layout(title=title, height=440, legend=dict(orientation="h", y=-0.2))
    return fig


def set_share_curves(fig: LiveFigure, curves: list[dict]):
    """Put new `explore.share_curves` into a `share_figure` (same models, same order)."""
    with fig.batch_update():
        for trace, curve in zip(fig.data, curves):
            trace.y = curve["attention_share"]
        fig.data[len(curves)].x = [c["crossover_tokens"] for c in curves]
        fig.data[len(curves)].text = [f"{c['crossover_tokens']:,.0f}" for c in curves]


class ToggleView(LessonWidget):
    """Toggle buttons above a figure: choosing an option calls `redraw(value)` once."""

    def __init__(self, description: str, options: dict, figure, redraw):
        self.toggle = widgets.ToggleButtons(options=list(options.items()), description=description,
                                            style={"description_width": "initial", "button_width": "auto"})
        self.figure = figure
        super().__init__({"option": self.toggle}, [figure], lambda option: option, redraw)


def cost_bars_figure(table: dict, title: str) -> go.Figure:
    """`explore.prefill_cost_table` as stacked bars (linear, attention) per prompt, each
    labelled with its time ratio to the first prompt beside the token ratio."""
    names = [f"{p:,}" for p in table["prompt_tokens"]]
    fig = go.Figure()
    fig.add_bar(x=names, y=table["linear_s"], marker=LINEAR, name="linear term")
    fig.add_bar(x=names, y=table["attention_s"], marker=ATTENTION, name="attention term",
                text=[f"{t:.1f}× the time, {n:.0f}× the tokens" for t, n in zip(table["time_ratio"], table["token_ratio"])],
                textposition="outside")
    fig.update_layout(barmode="stack", title=title, height=440, legend=dict(orientation="h", y=-0.2))
    fig.update_xaxes(title="prompt tokens P", type="category")
    fig.update_yaxes(title="compute time (s)")
    return fig


def prefill_split_figure(split: dict, title: str, x_title: str = "prompt tokens P") -> go.Figure:
    """`explore.prefill_split_prediction` alone, log-log: linear-only line, attention's band above."""
    fig = go.Figure()
    add_band(fig, split["prompt_tokens"], split["linear_only_s"], split["predicted_time_s"],
             "predicted, linear term only", "attention term")
    fig.add_scatter(x=split["prompt_tokens"], y=split["predicted_time_s"], mode="lines", line=PREDICTED,
                    name="predicted, linear + attention")
    fig.update_xaxes(type="log", title=x_title)
    fig.update_yaxes(type="log", title="time (s)")
    fig.update_layout(title=title, height=440, legend=dict(orientation="h", y=-0.2))
    return fig



# ---- lessons 02 and 04: where the time of one measured step goes
PART_COLOURS = {"products": LINEAR["color"], "attention": ATTENTION["color"], "other": "#2ca02c",
                "overhead": "#7f7f7f"}
BREAKDOWN_ROWS = ("measured", "each part at its roof", "the chapter's plan")


def breakdown_figure(title: str = "") -> LiveFigure:
    """Horizontal stacked bars from `explore.breakdown_bars`: the measured step split into its
    parts (products, attention, everything else, overhead), the same parts at their roofline
    times, and the whole step at the chapter's planning fraction."""
    fig = LiveFigure()
    for part, colour in PART_COLOURS.items():
        fig.add_bar(y=[], x=[], orientation="h", name=part, marker=dict(color=colour), hoverinfo="text",
                    texttemplate="%{x:,.3~r}", textposition="inside")
    fig.add_bar(y=[], x=[], orientation="h", name="", marker=PLAN_BAR, hoverinfo="text", showlegend=False,
                texttemplate="%{x:,.3~r}", textposition="inside")
    fig.update_xaxes(title="time of one step (ms)", rangemode="tozero")
    fig.update_yaxes(autorange="reversed", categoryorder="array", categoryarray=list(BREAKDOWN_ROWS))
    # legend in the bars' own order (plotly reverses it for stacked bars); a part too thin for its
    # number shows none rather than a number turned on its side
    fig.update_layout(title=title, height=330, barmode="stack",
                      legend=dict(orientation="h", y=-0.3, traceorder="normal"),
                      uniformtext=dict(minsize=9, mode="hide"), margin=dict(l=170))
    return fig


def set_breakdown(fig: LiveFigure, bars: dict):
    """Put `explore.breakdown_bars` into a `breakdown_figure`: one trace per part, then the plan."""
    measured, roof, plan = BREAKDOWN_ROWS
    with fig.batch_update():
        for i, name in enumerate(bars["names"]):
            trace = fig.data[i]
            trace.name, trace.y = name, [measured, roof]
            trace.x = [bars["measured_ms"][i], bars["roof_ms"][i]]
            trace.hovertext = [bars["measured_hover"][i], bars["roof_hover"][i]]
        fig.data[-1].y, fig.data[-1].x = [plan], [bars["plan_ms"]]
        fig.data[-1].hovertext = [bars["plan_label"]]
        fig.layout.title.text = bars["title"]


class BreakdownLab(LessonWidget):
    """Controls that re-run one step's breakdown when released: `measure(**values) -> record` is
    one labkit call (`breakdown.bind_prefill` / `bind_decode`), drawn as stacked bars beside the
    roof, with `explore.breakdown_line`, where the step's fraction comes from, as the status line."""

    def __init__(self, controls: dict, measure, title: str = ""):
        self.figure = breakdown_figure(title)
        super().__init__(controls, [self.figure], measure,
                         lambda record: set_breakdown(self.figure, explore.breakdown_bars(record)),
                         explore.breakdown_line, busy="timing one step whole and in parts at")

# ---- lesson 03: FlashAttention
def error_histogram_figure(results: list[dict], title: str) -> go.Figure:
    """One histogram per `attention.compare_with_reference` result: |flash - naive| per output
    element (log counts), its max and mean in the panel's title."""
    fig = make_subplots(rows=1, cols=len(results), subplot_titles=[
        f"{res['dtype']}: max {res['max_abs_error']:.1e}, mean {res['mean_abs_error']:.1e}" for res in results])
    for i, res in enumerate(results, start=1):
        hist = explore.histogram(res["abs_errors"])  # binned here, so a large check stays a small figure
        fig.add_bar(x=hist["centres"], y=hist["counts"], width=hist["width"], marker=MEASURED, showlegend=False,
                    row=1, col=i)
        fig.update_xaxes(title="|flash − naive|", exponentformat="e", row=1, col=i)
        fig.update_yaxes(type="log", title="output elements" if i == 1 else None, row=1, col=i)
    fig.update_layout(title=title, height=380, bargap=0.05)
    return fig


def memory_figure(series: dict, limit_bytes: float, title: str) -> go.Figure:
    """`explore.memory_series`: naive attention's predicted footprint (line), measured peaks of
    naive and flash (points), the memory limit, and where a size was refused."""
    gib = 2**30
    fig = go.Figure()
    pred = series["predicted"]
    fig.add_scatter(x=pred["tokens"], y=[b / gib for b in pred["bytes"]], mode="lines", line=PREDICTED,
                    name="naive, predicted (two P×P fp32 matrices per head)")
    for method, style in (("naive", MEASURED), ("flash", dict(color="#2ca02c"))):
        fig.add_scatter(x=series[method]["tokens"], y=[b / gib for b in series[method]["peak_bytes"]],
                        mode="markers+lines", marker=dict(size=10, **style), line=style,
                        name=f"{method}, measured on {series['device_name']}")
    fig.add_hline(y=limit_bytes / gib, line=dict(dash="dot", color="#b00"),
                  annotation_text=f"limit {limit_bytes / gib:,.1f} GiB", annotation_position="bottom right")
    refused = series["refused"]
    fig.add_scatter(x=[r["tokens"] for r in refused], y=[limit_bytes / gib] * len(refused), mode="markers",
                    marker=dict(symbol="x", size=14, color="#b00"), name="refused before allocating",
                    hovertext=[r["message"] for r in refused])
    fig.update_xaxes(type="log", title="sequence length P = S")
    fig.update_yaxes(type="log", title="peak memory (GiB)", exponentformat="power")
    fig.update_layout(title=title, height=460, legend=dict(orientation="h", y=-0.22))
    return fig


def traffic_figure(traffic: dict, title: str) -> go.Figure:
    """`explore.attention_traffic`: bytes moved against P for naive and flash (worst, best)."""
    fig = go.Figure()
    x = traffic["prompt_tokens"]
    for key, name, style in (("naive_bytes", "naive: scores written and read back", MEASURED),
                             ("flash_worst_bytes", "flash, K and V re-read for every query tile", dict(color="#2ca02c", dash="dash")),
                             ("flash_best_bytes", "flash, K and V read once", dict(color="#2ca02c"))):
        fig.add_scatter(x=x, y=[b / 1e9 for b in traffic[key]], mode="lines", line=style, name=name)
    fig.update_xaxes(type="log", title="sequence length P = S")
    fig.update_yaxes(type="log", title="bytes moved, one layer (GB)", exponentformat="power")
    fig.update_layout(title=title, height=440, legend=dict(orientation="h", y=-0.22))
    return fig


# ---- lesson 04: decode and the cache read
PLAN_BAR = dict(color="#aec7e8")  # the chapter's plan: the roofline's blue, paler
REGIME_COLOURS = {"weights-dominated": "rgba(31,119,180,0.15)", "mixed": "rgba(150,150,150,0.15)",
                  "cache-dominated": "rgba(214,39,40,0.15)"}


def _shade_regimes(fig, bands: list[dict], axis: str = "x", **where):
    """Shade the three regimes of `explore.regime_bands` along the cache-share `axis`."""
    for band in bands:
        span = dict(x0=band["from"], x1=band["to"]) if axis == "x" else dict(y0=band["from"], y1=band["to"])
        add = fig.add_vrect if axis == "x" else fig.add_hrect
        label = band["regime"] if axis == "y" else band["regime"].split("-")[0]  # narrow bands: one word
        add(**span, fillcolor=REGIME_COLOURS[band["regime"]], line_width=0, annotation_text=label,
            annotation_position="top left" if axis == "y" else "top", **where)


def decode_readout_figure(bands: list[dict]) -> LiveFigure:
    """Three panels for one decode measurement: step time and tokens/s (measured beside
    predicted), and the cache's share of the step's read against the three regimes."""
    fig = LiveFigure(make_subplots(rows=1, cols=3, column_widths=[0.22, 0.22, 0.56], horizontal_spacing=0.09,
                                   subplot_titles=["step time (ms)", "tokens/s", "the cache's share of one step's read"]))
    for col in (1, 2):  # measured, the roofline, and (when the record has it) the chapter's plan
        fig.add_bar(x=["measured", "predicted"], y=[0, 0], marker=dict(color=[MEASURED["color"], PREDICTED["color"]]),
                    texttemplate="%{y:,.3~r}", textposition="outside", showlegend=False, row=1, col=col)
    # The label sits inside a long bar and beside a short one, so it never runs past the axis's end.
    fig.add_bar(x=[0], y=[""], orientation="h", marker=dict(color="#333"), width=0.3, text=[""],
                textposition="outside", insidetextanchor="end", cliponaxis=False, showlegend=False, row=1, col=3)
    _shade_regimes(fig, bands, row=1, col=3)
    fig.update_xaxes(range=[0, 1], tickformat=".0%", row=1, col=3)
    fig.update_layout(height=340, margin=dict(t=80))
    return fig


def set_decode_readout(fig: LiveFigure, readout: dict):
    """Put an `explore.decode_readout` into a `decode_readout_figure`."""
    gb = 1e9
    colours = [MEASURED["color"], PREDICTED["color"], PLAN_BAR["color"]][:len(readout["time_ms"])]
    with fig.batch_update():
        for trace, key in ((fig.data[0], "time_ms"), (fig.data[1], "tokens_per_s")):
            trace.x, trace.y, trace.marker.color = readout.get("bars", ["measured", "predicted"]), readout[key], colours
        fig.data[2].x = [readout["cache_share"]]
        fig.data[2].text = [f"{readout['cache_share']:.0%} ({readout['cache_bytes'] / gb:.3g} of "
                            f"{(readout['weights_bytes'] + readout['cache_bytes']) / gb:.3g} GB): {readout['regime']}"]
        fig.data[2].textposition = "inside" if readout["cache_share"] >= 0.5 else "outside"
        fig.layout.title = readout["label"]


def draw_decode(fig: LiveFigure, record: dict):
    """`MeasureLab` draw for decode: one `sweeps.measure_decode` record into the readout."""
    set_decode_readout(fig, explore.decode_readout(record))


def cache_share_figure(curves: list[dict], bands: list[dict], marks: list[dict], title: str) -> go.Figure:
    """`explore.cache_share_curves` against context (log x) over the shaded regimes, with
    `marks` ({"context_tokens", "cache_share", "label"}) pointed out."""
    fig = go.Figure()
    for curve in curves:
        fig.add_scatter(x=curve["context_tokens"], y=curve["cache_share"], mode="lines", name=f"batch {curve['batch']}")
    fig.add_scatter(x=[m["context_tokens"] for m in marks], y=[m["cache_share"] for m in marks], mode="markers+text",
                    text=[m["label"] for m in marks], textposition="top center", marker=dict(size=10, color="#333"),
                    cliponaxis=False, name="the chapter's settings")  # a mark near the axis keeps its whole label
    _shade_regimes(fig, bands, axis="y")
    fig.update_xaxes(type="log", title="context S (tokens per sequence)")
    fig.update_yaxes(title="cache's share of one decode step's read", tickformat=".0%", range=[0, 1])
    fig.update_layout(title=title, height=460, legend=dict(orientation="h", y=-0.2))
    return fig


def throughput_figure(predicted: dict, measured: dict, title: str) -> go.Figure:
    """`explore.throughput_prediction` (line) and `explore.throughput_series` (measured points)
    against batch; the compute-bound batch is marked where it lies among the measured batches,
    and named in the title where it does not. The roof of the step's kernels in turn is dotted,
    where it parts from the whole step's (`explore.in_turn_parts`)."""
    fig = go.Figure()
    fig.add_scatter(x=predicted["batch"], y=predicted["tokens_per_s"], mode="lines", line=PREDICTED,
                    name="predicted (calibrated roofline)")
    fig.add_scatter(x=measured["batch"], y=measured["tokens_per_s"], mode="markers+lines", marker=dict(size=10, **MEASURED),
                    line=MEASURED, name=f"measured on {measured['device_name']}", hovertext=measured.get("hover"),
                    hoverinfo="text+x")
    ridge = predicted["compute_bound_batch"]
    if ridge is not None and ridge <= max(measured["batch"], default=0):
        fig.add_vline(x=ridge, line=dict(dash="dot", color="#555"), annotation_position="bottom right",
                      annotation_text=f"compute-bound from B ≈ {ridge:,.0f}")  # the top is the tier marks' (add_tier_marks)
    elif measured["batch"]:  # a mark past the last measured point would only stretch the chart
        title += (" — at this context no batch reaches the ridge" if ridge is None
                  else f" — compute-bound from B ≈ {ridge:,.0f}, past the batches measured")
    if "planned_tokens_per_s" in predicted:  # the chapter's planning line, and where the roof drops a tier
        fig.add_scatter(x=predicted["batch"], y=predicted["planned_tokens_per_s"], mode="lines", line=PLAN,
                        name=explore.PLAN_LABEL)
        fig.data[0].name = _roof_name(predicted)
    if explore.in_turn_parts(predicted.get("in_turn_tokens_per_s"), predicted["tokens_per_s"]):
        fig.add_scatter(x=predicted["batch"], y=predicted["in_turn_tokens_per_s"], mode="lines", line=IN_TURN,
                        name=explore.IN_TURN_LABEL)
    add_tier_marks(fig, predicted.get("tiers", []))
    fig.update_xaxes(title="batch B")
    fig.update_yaxes(title="tokens/s (B ÷ step time)", rangemode="tozero")
    fig.update_layout(title=title, height=440, legend=dict(orientation="h", y=-0.2))
    return fig


# ---- lesson 05: static vs continuous batching
STATIC = dict(color="#8c8c8c")
CONTINUOUS = dict(color="#2ca02c")


def batching_figure(bars: dict, title: str) -> LiveFigure:
    """Slot utilisation and throughput side by side, static vs continuous, from `explore.batching_bars`."""
    fig = LiveFigure(make_subplots(rows=1, cols=2, horizontal_spacing=0.12,
                                   subplot_titles=("slot utilisation (%)", "output throughput (tokens/s)")))
    for policy, style in (("static", STATIC), ("continuous", CONTINUOUS)):
        fig.add_bar(x=[], y=[], marker=style, name=f"{policy} batching", row=1, col=1)
        fig.add_bar(x=[], y=[], marker=style, name=f"{policy} batching", showlegend=False, row=1, col=2)
    fig.update_yaxes(range=[0, 100], row=1, col=1)
    fig.update_traces(textangle=0)
    fig.update_layout(title=title, height=420, barmode="group", legend=dict(orientation="h", y=-0.2))
    set_batching(fig, bars)
    return fig


def set_batching(fig: LiveFigure, bars: dict):
    """Put `explore.batching_bars` output into the four bar traces."""
    with fig.batch_update():
        for i, policy in enumerate(("static", "continuous")):
            fig.data[2 * i].x, fig.data[2 * i].y = bars["sets"], bars[policy]["utilisation_pct"]
            fig.data[2 * i].text = [f"{u:.0f}%" for u in bars[policy]["utilisation_pct"]]
            fig.data[2 * i + 1].x, fig.data[2 * i + 1].y = bars["sets"], bars[policy]["tokens_per_s"]
            fig.data[2 * i + 1].text = [f"{t:,.0f}" for t in bars[policy]["tokens_per_s"]]


class BatchingLab(LessonWidget):
    """A max-batch slider that re-simulates both policies on every request set; `bars(max_batch)`
    is one labkit call (e.g. a partial of `explore.batching_bars`)."""

    def __init__(self, bars, max_batch: int, low: int, high: int, title: str):
        self.bars, self.slider = bars, int_slider("max batch", max_batch, low, high)
        first = bars(max_batch)
        self.figure = batching_figure(first, title)
        super().__init__({"max_batch": self.slider}, [self.figure], bars,
                         lambda result: set_batching(self.figure, result), explore.batching_line)
        self.error.status(self.describe(first))  # the ratios from the start, then after every move


def step_time_figure(curves: list[dict], title: str) -> go.Figure:
    """Decode step time against batch, one line per source: dicts with name, batch, time_s
    (measured points as markers, interpolation as a line)."""
    fig = go.Figure()
    for curve in curves:
        fig.add_scatter(x=curve["batch"], y=[1e3 * t for t in curve["time_s"]], name=curve["name"],
                        mode=curve.get("mode", "lines"))
    fig.update_xaxes(title="batch B")
    fig.update_yaxes(title="decode step time (ms)", rangemode="tozero")
    fig.update_layout(title=title, height=380, legend=dict(orientation="h", y=-0.25))
    return fig


# ---- lesson 06: a long prefill among decoding streams
def interference_figure(series: list[dict], title: str) -> LiveFigure:
    """One row per timeline (`explore.interference_series`): the gap before each stream token
    (ms) at the time it arrived, prefill chunks shaded."""
    fig = LiveFigure(make_subplots(rows=len(series), cols=1, shared_xaxes=True, vertical_spacing=0.12,
                                   subplot_titles=[s["name"] for s in series]))
    for row, s in enumerate(series, start=1):
        fig.add_bar(x=[], y=[], marker=MEASURED, name="gap before a stream token", showlegend=row == 1, row=row, col=1)
        fig.update_yaxes(title="gap (ms)", row=row, col=1)
    fig.update_xaxes(title="time since the first timed step (s)", row=len(series), col=1)
    fig.update_layout(title=title, height=220 + 180 * len(series), legend=dict(orientation="h", y=-0.15), bargap=0.2)
    for row, s in enumerate(series, start=1):
        set_interference(fig, row, s)
    return fig


def set_interference(fig: LiveFigure, row: int, series: dict):
    """Redraw row `row` of an `interference_figure` from `explore.interference_series`."""
    with fig.batch_update():
        trace = fig.data[row - 1]
        trace.x, trace.y = series["end_s"], series["gap_ms"]
        trace.width = [0.6 * min(series["gap_ms"]) / 1e3] * len(series["gap_ms"])
        fig.layout.annotations[row - 1].text = series["name"]
        keep = [s for s in fig.layout.shapes if s.name != f"chunk-{row}"]
        chunks = [dict(type="rect", x0=a, x1=b, y0=0, y1=1, yref=f"y{'' if row == 1 else row} domain",
                       xref=f"x{'' if row == 1 else row}", fillcolor="#1f77b4", opacity=0.15, line_width=0,
                       name=f"chunk-{row}") for a, b in series["chunks_s"]]
        fig.layout.shapes = keep + chunks


def interference_bars_figure(bars: dict, title: str) -> LiveFigure:
    """The streams' worst and p99 gap beside the long prompt's prefill time, per timeline."""
    fig = LiveFigure(make_subplots(rows=1, cols=2, horizontal_spacing=0.12,
                                   subplot_titles=("streams: gap between tokens (ms)",
                                                   "long prompt: prefill time (ms)")))
    fig.add_bar(x=[], y=[], name="worst gap", marker=MEASURED, row=1, col=1)
    fig.add_bar(x=[], y=[], name="p99 gap", marker=NOISY, row=1, col=1)
    fig.add_bar(x=[], y=[], name="undisturbed gap", marker=dict(color="#555"), row=1, col=1)
    fig.add_bar(x=[], y=[], name="arrival to last chunk (its TTFT)", marker=PREDICTED, row=1, col=2)
    fig.add_bar(x=[], y=[], name="chunks alone", marker=dict(color="#aec7e8"), row=1, col=2)
    fig.update_layout(title=title, height=420, barmode="group", legend=dict(orientation="h", y=-0.2))
    set_interference_bars(fig, bars)
    return fig


def set_interference_bars(fig: LiveFigure, bars: dict):
    keys = ("itl_max_ms", "itl_p99_ms", "itl_undisturbed_ms", "prefill_wall_ms", "prefill_compute_ms")
    with fig.batch_update():
        for trace, key in zip(fig.data, keys):
            trace.x, trace.y = bars["names"], bars[key]
            trace.text = [f"{v:,.0f}" for v in bars[key]]


class ChunkLab(LessonWidget):
    """A chunk-size slider that re-runs the chunked timeline for real beside a fixed unchunked
    one: `run(chunk_tokens=C)` returns an `interference.Timeline`, and `explore.chunk_view`
    turns it into everything the two charts and the table show."""

    def __init__(self, run, unchunked, chunk: int, low: int, high: int, step: int, title: str):
        self.slider = int_slider("chunk C (tokens)", chunk, low, high, step)
        view = explore.chunk_view(run, unchunked, chunk)
        self.timeline = view["timeline"]
        self.figure = interference_figure([explore.interference_series(unchunked), view["series"]], title)
        self.bars = interference_bars_figure(view["bars"], f"{title}: summary")
        self.table = table(view["rows"])  # shown in its own cell
        super().__init__({"chunk_tokens": self.slider}, [self.figure, self.bars],
                         lambda chunk_tokens: explore.chunk_view(run, unchunked, chunk_tokens), self.show,
                         lambda view: view["status"], busy="running the timeline at")

    def show(self, view: dict):
        self.timeline = view["timeline"]
        set_interference(self.figure, 2, view["series"])
        set_interference_bars(self.bars, view["bars"])
        self.table.value = table_html(view["rows"])


# ---- lesson 07: where a request's time goes
SPLIT_COLOURS = {"prefill_pct": "#ff7f0e", "decode_pct": PREDICTED["color"]}


def split_figure(split: dict, title: str) -> LiveFigure:
    """Prefill and decode shares (%) per workload, stacked horizontal bars (`explore.predicted_split`
    or `explore.measured_split`)."""
    fig = LiveFigure()
    fig.add_bar(y=[], x=[], orientation="h", name="prefill", marker=dict(color=SPLIT_COLOURS["prefill_pct"]))
    fig.add_bar(y=[], x=[], orientation="h", name="decode", marker=dict(color=SPLIT_COLOURS["decode_pct"]))
    fig.update_xaxes(title="share of the request's time (%)", range=[0, 100])
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(title=title, height=380, barmode="stack", legend=dict(orientation="h", y=-0.2, traceorder="normal"),
                      margin=dict(l=200))
    set_split(fig, split)
    return fig


def set_split(fig: LiveFigure, split: dict):
    """Put a split into a `split_figure`; a shape flagged noisy gets pale bars."""
    noisy = split.get("noisy", [False] * len(split["titles"]))
    with fig.batch_update():
        for trace, key, pale in zip(fig.data, ("prefill_pct", "decode_pct"), ("#ffd8b1", "#c6dbef")):
            trace.y, trace.x = split["titles"], split[key]
            trace.text = [f"{v:.0f}%" for v in split[key]]
            trace.marker.color = [pale if flag else SPLIT_COLOURS[key] for flag in noisy]
        fig.layout.title.text = split["label"]


class SplitLab(LessonWidget):
    """A GPU dropdown and a batch slider over `split(gpu_name, batch)` (one labkit call, e.g.
    `explore.predicted_split` with the model bound)."""

    def __init__(self, split, gpus: list[str], gpu: str, batch: int, high: int):
        self.gpu = widgets.Dropdown(options=gpus, value=get_gpu(gpu).name, description="GPU")  # unknown: its SpecError
        self.batch = int_slider("batch B", batch, 1, high)
        first = split(gpu, batch)
        self.figure = split_figure(first, "")
        super().__init__({"gpu": self.gpu, "batch": self.batch}, [self.figure], lambda gpu, batch: split(gpu, batch),
                         lambda result: set_split(self.figure, result), lambda result: result.get("note", ""))
        self.error.status(self.describe(first))
