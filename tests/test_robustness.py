"""Robustness audit: bad and extreme input never ends in a traceback, a hang or a lost file.

* the CLI: hypothesis throws odd numbers, strings and malformed config.json files at it; every
  answer is exit code 0 (valid input) or 2 with exactly one "labkit: error: ..." line on stderr;
* the widgets: a SliderLab on the tiny model, with sliders pushed to and past their bounds and
  measure functions given bad arguments, shows one message under the chart and keeps running;
  a chart's widget state is the whole figure, as a browser that reloads it must see;
* recordings: the same name twice keeps both files; a write that fails leaves nothing behind;
* noisy timings are flagged and drawn apart from trusted points.
"""
from __future__ import annotations

import pytest

pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")

from labkit import views  # noqa: E402


# ------------------------------------------------------------------ charts in containers
def test_a_figure_inside_a_container_reports_its_whole_figure_as_widget_state():
    # Voilà builds each widget from the state the kernel reports when the page loads. plotly
    # refreshes that state only when the figure itself is displayed, never inside a VBox:
    # without labkit's FigureWidget, the lesson app drew every slider chart empty.
    predicted = {"prompt_tokens": [64, 128], "predicted_time_s": [1e-3, 2e-3]}
    lab = views.SliderLab({"prompt_tokens": views.int_slider("P", 64, 64, 128, 64)},
                          lambda prompt_tokens: {"prompt_tokens": prompt_tokens, "time_s": 1e-3,
                                                 "predicted_time_s": 1e-3, "device": "cpu"},
                          predicted, "prompt_tokens", "P", "title")
    lab.prime([{"prompt_tokens": 64}])
    state = lab.figure.get_state()
    assert [trace["type"] for trace in state["_widget_data"]] == ["scatter", "scatter", "scatter", "bar"]
    assert state["_widget_data"][1]["x"] == [64]  # the primed point, added after construction
    assert state["_widget_layout"]["title"]["text"] == "title"
