"""Lessons 02 and 04: where one measured step's time goes, and decode's cache read."""
from __future__ import annotations

from .. import explore
from ..units import format_rate
from ._plotly import go, make_subplots
from .base import ATTENTION, IN_TURN, LINEAR, MEASURED, PLAN, PREDICTED, LessonWidget, LiveFigure
from .measured import add_tier_marks, roof_name

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
    colours = [MEASURED["color"], PREDICTED["color"], PLAN_BAR["color"]][:len(readout["time_ms"])]
    with fig.batch_update():
        for trace, key in ((fig.data[0], "time_ms"), (fig.data[1], "tokens_per_s")):
            trace.x, trace.y, trace.marker.color = readout.get("bars", ["measured", "predicted"]), readout[key], colours
        fig.data[2].x = [readout["cache_share"]]
        read = readout["weights_bytes"] + readout["cache_bytes"]
        fig.data[2].text = [f"{readout['cache_share']:.0%} ({format_rate(readout['cache_bytes'], 'B')} of "
                            f"{format_rate(read, 'B')}): {readout['regime']}"]
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
        fig.data[0].name = roof_name(predicted)
    if explore.in_turn_parts(predicted.get("in_turn_tokens_per_s"), predicted["tokens_per_s"]):
        fig.add_scatter(x=predicted["batch"], y=predicted["in_turn_tokens_per_s"], mode="lines", line=IN_TURN,
                        name=explore.IN_TURN_LABEL)
    add_tier_marks(fig, predicted.get("tiers", []))
    fig.update_xaxes(title="batch B")
    fig.update_yaxes(title="tokens/s (B ÷ step time)", rangemode="tozero")
    fig.update_layout(title=title, height=440, legend=dict(orientation="h", y=-0.2))
    return fig
