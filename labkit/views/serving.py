"""Lessons 05-07: static against continuous batching, a long prefill among decoding streams,
where a request's time goes by workload shape."""
from __future__ import annotations

from .. import explore
from ..specs import get_gpu
from ._plotly import go, make_subplots, widgets
from .base import MEASURED, NOISY, PREDICTED, LessonWidget, LiveFigure, int_slider, table, table_html

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
        self.error.status(view["status"])  # the first run's line from the start, not only after a move

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
    for key, name in (("prefill_pct", "prefill"), ("decode_pct", "decode")):
        fig.add_bar(y=[], x=[], orientation="h", name=name, marker=dict(color=SPLIT_COLOURS[key]),
                    textposition="inside", insidetextanchor="middle")
    fig.update_xaxes(title="share of the request's time (%)", range=[0, 100])
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(title=title, height=380, barmode="stack", legend=dict(orientation="h", y=-0.2, traceorder="normal"),
                      margin=dict(l=200))
    set_split(fig, split)
    return fig


NARROW_PCT = 8.0  # a bar narrower than this share has no room for its label; its neighbour carries it


def split_labels(split: dict) -> dict:
    """Each bar's label, "62%"; a share under NARROW_PCT is named inside its neighbour's bar
    instead ("98% (prefill 2%)"), as a 2-3% bar clipped its own label to a sliver, unless the
    neighbour is narrow too; a share under half a percent reads "<1%", not "0%"."""
    def pct(value: float) -> str:
        return "<1%" if 0 < value < 0.5 else f"{value:.0f}%"

    labels = {"prefill_pct": [], "decode_pct": []}
    for prefill, decode in zip(split["prefill_pct"], split["decode_pct"]):
        prefill_label, decode_label = pct(prefill), pct(decode)
        if prefill < NARROW_PCT <= decode:
            prefill_label, decode_label = "", f"{decode_label} (prefill {prefill_label})"
        elif decode < NARROW_PCT <= prefill:
            prefill_label, decode_label = f"{prefill_label} (decode {decode_label})", ""
        labels["prefill_pct"].append(prefill_label)
        labels["decode_pct"].append(decode_label)
    return labels


def set_split(fig: LiveFigure, split: dict):
    """Put a split into a `split_figure`; a shape flagged noisy gets pale bars."""
    noisy = split.get("noisy", [False] * len(split["titles"]))
    labels = split_labels(split)
    with fig.batch_update():
        for trace, key, pale in zip(fig.data, ("prefill_pct", "decode_pct"), ("#ffd8b1", "#c6dbef")):
            trace.y, trace.x = split["titles"], split[key]
            trace.text = labels[key]
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
