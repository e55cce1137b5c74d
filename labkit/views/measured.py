"""Every lesson's measured-beside-predicted chart: the roofline's line (with the chapter's plan,
the kernels-in-turn roof and the cache tiers where they apply), the measured points and their
residual, recorded runs; and the two widgets that measure on release (`SliderLab`, `MeasureLab`)."""
from __future__ import annotations

import math

from .. import explore
from ._plotly import make_subplots
from .base import IN_TURN, LINEAR, MEASURED, NOISY, PLAN, PREDICTED, TIER, LessonWidget, LiveFigure

# ---- every lesson: measured beside predicted
def measured_vs_predicted_figure(x_title: str, predicted: dict, x_key: str, title: str,
                                 log_y: bool = False) -> LiveFigure:
    """Two rows: time (predicted line, measured points) and residual (measured / predicted - 1).
    Where `predicted` has them (`explore.with_plan_and_tiers`): the chapter's planning line,
    grey and dash-dotted, as trace 4 (after the four the measured points update), the roof of a decode step's
    kernels in turn (`explore.decode_prediction`), dotted, where it parts from the whole step's, and
    a dotted mark where the working set leaves a cache ("past the L3: DRAM"), so that bend is not
    read as a phase's."""
    fig = LiveFigure(make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.7, 0.3],
                                   vertical_spacing=0.06))
    fig.add_scatter(x=predicted[x_key], y=predicted["predicted_time_s"], mode="lines",
                    line=PREDICTED, name=roof_name(predicted), row=1, col=1)
    fig.add_scatter(x=[], y=[], mode="markers", marker=dict(size=10, **MEASURED), name="measured", row=1, col=1)
    fig.add_scatter(x=[], y=[], mode="markers", marker=dict(size=10, symbol="x", **NOISY),
                    name="measured, noisy (spread too wide)", row=1, col=1)
    fig.add_bar(x=[], y=[], marker=MEASURED, name="residual", showlegend=False, row=2, col=1)
    fig.update_yaxes(title="time (s)", type="log" if log_y else "linear", rangemode="tozero", row=1, col=1)
    # "residual" (measured / predicted - 1, the lessons say): the longer title ran out of its short
    # panel, down into the x axis's; the legend hangs from below the x axis's title, however many
    # rows it wraps to (it had run over that title on a chart's first draw)
    fig.update_yaxes(title="residual", tickformat="+.0%", row=2, col=1)
    fig.update_xaxes(title=x_title, row=2, col=1)
    fig.update_layout(title=title, height=560, legend=dict(orientation="h", y=-0.22, yanchor="top"), bargap=0.6,
                      margin=dict(b=140))
    if "planned_time_s" in predicted:
        fig.add_scatter(x=predicted[x_key], y=predicted["planned_time_s"], mode="lines", line=PLAN,
                        name=explore.PLAN_LABEL, row=1, col=1)
    if explore.in_turn_parts(predicted.get("in_turn_time_s"), predicted["predicted_time_s"]):
        fig.add_scatter(x=predicted[x_key], y=predicted["in_turn_time_s"], mode="lines", line=IN_TURN,
                        name=explore.IN_TURN_LABEL, row=1, col=1)
    add_tier_marks(fig, predicted.get("tiers", []), rows=(1, 2))
    return fig


def roof_name(predicted: dict) -> str:
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
    """Put `explore.measured_series` output into the measured, noisy and residual traces, and its
    note on points over their roof (`explore.over_roof_note`) under the title."""
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
        fig.update_yaxes(range=residual_range(series["residual"]), row=2, col=1)
        # points over their roof: what that means, under the title (a fixed chart has no status line)
        fig.update_layout(title_subtitle_text=series.get("note") or "")


def residual_range(residuals: list[float]) -> list[float] | None:
    """The residual row's y range: from 0 to the farthest bar and a tenth of the span beyond it, so
    the tallest bar ends below the frame, not at it (plotly fits bars flush, and a +50 % bar then
    reads as the +40 % tick below it). None (plotly's own) where there is no bar."""
    shown = [r for r in residuals if math.isfinite(r)]
    if not shown:
        return None
    low, high = min(0.0, *shown), max(0.0, *shown)
    pad = 0.1 * (high - low) or 0.05
    return [low - pad if low < 0 else 0.0, high + pad if high > 0 else 0.0]


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
