"""Lessons 01-03: the two phases on a roofline, prefill's two terms, FlashAttention."""
from __future__ import annotations

import math

from .. import explore
from ._plotly import go, make_subplots, widgets
from .base import ATTENTION, LINEAR, MEASURED, PREDICTED, LessonWidget, LiveFigure
from .measured import add_band

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
                        text=[f"{p['label']} ({p['bound']}-bound)" for p in pts],
                        textposition=[_away_from_edge(p["intensity_flops_per_byte"], curve) for p in pts],
                        marker=dict(size=11), name=f"phases on {curve['name']}")
    fig.update_xaxes(type="log", title="arithmetic intensity (FLOP per byte moved)")
    fig.update_yaxes(type="log", title="attainable FLOP/s")
    fig.update_layout(title=title, height=480, legend=dict(orientation="h", y=-0.2))
    return fig


def _away_from_edge(intensity: float, curve: dict) -> str:
    """Where a point's label goes: centred over it, but in the outer quarters of the log x axis
    towards the middle, so a label near an edge (decode at about 1 FLOP per byte) is not cut at
    the axes."""
    grid = curve["intensity_flops_per_byte"]
    along = math.log(intensity / grid[0]) / math.log(grid[-1] / grid[0])  # 0 at the left edge, 1 at the right
    return "top right" if along < 0.25 else "top left" if along > 0.75 else "top center"


# ---- lesson 02: prefill's two terms


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
