"""`make report`'s HTML shows each lesson widget as it stood when the notebook finished: the
settings, the live charts as static plotly charts, the status line; no widget state, no network."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbconvert import HTMLExporter

from labkit import report, views

PREDICTED = {"prompt_tokens": [64, 128], "predicted_time_s": [1e-3, 2e-3]}


def measure(prompt_tokens):
    return {"prompt_tokens": prompt_tokens, "time_s": 1.5e-3, "predicted_time_s": 1e-3, "device": "cpu"}


def executed_notebook():
    """A notebook as papermill leaves it: a static chart, then a slider lab moved once (its
    widget output and the widget state in the metadata), then a formula-only toggle view."""
    lab = views.SliderLab({"prompt_tokens": views.int_slider("prompt length P", 64, 64, 128, 64)}, measure,
                          PREDICTED, "prompt_tokens", "P", "Prefill on cpu: measured vs predicted")
    lab.prime([{"prompt_tokens": 64}])
    lab.sliders["prompt_tokens"].value = 128
    share = views.share_figure([{"model": "m", "prompt_tokens": [1, 2], "attention_share": [0.1, 0.6],
                                 "crossover_tokens": 1.5}], "share")
    toggle = views.ToggleView("count", {"chapter": "chapter", "kernel": "kernel"}, share, lambda _: None)
    static = views.roofline_figure([], [], "a static chart")
    cells = [nbformat.v4.new_code_cell("static", outputs=[nbformat.v4.new_output(
                 "display_data", data={"application/vnd.plotly.v1+json": json.loads(static.to_json()),
                                       "text/plain": "static"})]),
             *(nbformat.v4.new_code_cell("lab.widget", outputs=[nbformat.v4.new_output(
                 "execute_result", execution_count=1, data={**widget._repr_mimebundle_()})])
               for widget in (lab.widget, toggle.widget))]
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["widgets"] = {report.WIDGET_STATE: views.widgets.Widget.get_manager_state()}
    return nb, lab


def test_each_widget_output_becomes_its_settings_charts_and_status_line_as_static_html():
    nb, lab = executed_notebook()
    page, _ = HTMLExporter(preprocessors=[report.static_widgets]).from_notebook_node(nb)

    assert report.WIDGET_VIEW not in page and report.WIDGET_STATE not in page  # no widget manager, no CDN
    assert "settings when the notebook finished:</em> prompt length P: 128" in page
    assert "count: chapter" in page  # toggle buttons: the chosen option's label
    assert "measured 1.5 ms on cpu; predicted 1.0 ms" in page  # the status line under the chart
    # Both measured points (primed, then the slider's) are in the static chart, as in the lab.
    figures = [_traces(line) for line in page.splitlines() if "Plotly.newPlot(" in line and "measured" in line]
    assert figures and [64, 128] in [trace.get("x") for trace in figures[0] if trace.get("name") == "measured"]
    assert page.count(report.PLOTLYJS_MARK) == 1  # plotly.js inlined once, before the first chart


def _traces(line: str) -> list[dict]:
    """The traces of the first `Plotly.newPlot("id", [traces], layout, config)` call on a line."""
    rest = line.split("Plotly.newPlot(", 1)[1]
    return json.JSONDecoder().raw_decode(rest[rest.index("["):])[0]


def test_a_page_that_already_has_plotlyjs_does_not_get_it_twice():
    nb, _ = executed_notebook()
    nb.cells[0].outputs[0]["data"]["text/html"] = f"<script>{report.PLOTLYJS_MARK} = {{}};</script>"
    page, _ = HTMLExporter(preprocessors=[report.static_widgets]).from_notebook_node(nb)
    assert page.count(report.PLOTLYJS_MARK) == 1


def test_make_report_converts_with_the_preprocessor(tmp_path):
    """The exact nbconvert command line of the Makefile's report recipe."""
    nb, _ = executed_notebook()
    path = tmp_path / "lesson.ipynb"
    nbformat.write(nb, path)
    makefile = Path(report.__file__).resolve().parents[1] / "Makefile"
    recipe = next(line for line in makefile.read_text().splitlines() if "nbconvert --to html" in line)
    option = next(arg for arg in recipe.split() if arg.startswith("--HTMLExporter.preprocessors="))
    subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "html", option.strip("'\""),
                    str(path)], check=True, capture_output=True)
    page = (tmp_path / "lesson.html").read_text()
    assert report.WIDGET_VIEW not in page and "prompt length P: 128" in page


@pytest.mark.browser
@pytest.mark.timeout(120)
def test_the_static_charts_draw_in_a_browser_with_no_network(tmp_path):
    from browser_util import launch_chromium, sync_playwright
    start = sync_playwright()
    nb, _ = executed_notebook()
    page_html, _ = HTMLExporter(preprocessors=[report.static_widgets]).from_notebook_node(nb)
    path = tmp_path / "lesson.html"
    path.write_text(page_html)
    with start() as playwright:
        browser = launch_chromium(playwright)
        try:
            page = browser.new_page()
            page.route("http*://**", lambda route: route.abort())  # offline: only the file itself
            page.goto(path.as_uri())
            page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length >= 2", timeout=60_000)
            drawn = page.evaluate("() => [...document.querySelectorAll('.js-plotly-plot')]"
                                  ".map(g => (g.data || []).length)")
            assert len(drawn) == 2 and all(n > 0 for n in drawn), drawn  # the lab's chart and the toggle's
        finally:
            browser.close()
