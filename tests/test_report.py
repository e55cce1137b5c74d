"""`make report`'s HTML shows each lesson widget as it stood when the notebook finished: the
settings, the live charts as static plotly charts, the status line; no widget state, no network:
no script or stylesheet from another host, plotly.js once per page, and a browser with no network
draws every chart without one failed request."""
from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest

from labkit import report, views

ROOT = Path(report.__file__).resolve().parents[1]

PREDICTED = {"prompt_tokens": [64, 128], "predicted_time_s": [1e-3, 2e-3]}


def measure(prompt_tokens):
    return {"prompt_tokens": prompt_tokens, "time_s": 1.5e-3, "predicted_time_s": 1e-3, "device": "cpu"}


def executed_notebook():
    """A notebook as papermill leaves it: a static chart, then a slider lab moved once (its
    widget output and the widget state in the metadata), then a formula-only toggle view."""
    slider = views.int_slider("prompt length P", 64, 64, 128, 64)
    lab = views.SliderLab({"prompt_tokens": slider}, measure, PREDICTED, "prompt_tokens", "P",
                          "Prefill on cpu: measured vs predicted")
    lab.prime([{"prompt_tokens": 64}])
    slider.value = 128
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
    for cell in cells:
        cell.execution_count = 1  # as papermill leaves them: a notebook's page would show "In [1]:"
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["widgets"] = {report.WIDGET_STATE: views.widgets.Widget.get_manager_state()}
    return nb, lab


def test_each_widget_output_becomes_its_settings_charts_and_status_line_as_static_html():
    nb, lab = executed_notebook()
    page, _ = report.ReportExporter().from_notebook_node(nb)

    assert report.WIDGET_VIEW not in page and report.WIDGET_STATE not in page  # no widget manager, no CDN
    assert "settings when the notebook finished:</em> prompt length P: 128" in page
    assert "count: chapter" in page  # toggle buttons: the chosen option's label
    status = re.sub(r"<[^>]+>", "\n", lab.error.widget.value).strip().split("\n")  # the status under the chart
    assert status[0].startswith("measured") and len(status) == 2
    assert f"{html.escape(status[0], quote=False)}<br/>{html.escape(status[1], quote=False)}" in page  # its lines too
    # Both measured points (primed, then the slider's) are in the static chart, as in the lab.
    figures = [_traces(line) for line in page.splitlines() if "Plotly.newPlot(" in line and "measured" in line]
    assert figures and [64, 128] in [trace.get("x") for trace in figures[0] if trace.get("name") == "measured"]
    assert page.count(report.PLOTLYJS_MARK) == 1  # plotly.js inlined once, before the first chart
    assert not re.search(r'class="jp-(Input|Output)Prompt', page)  # a handout: no "In [1]:" beside the code


def test_an_unnamed_choice_is_no_setting():
    """A choice Predict's radio buttons have no description: the report's settings line leaves
    them out (it read ": Inline code completion"), while named controls keep theirs."""
    states = {"box": {"state": {"_model_name": "VBoxModel", "children": ["IPY_MODEL_pick", "IPY_MODEL_gpu"]}},
              "pick": {"state": {"_model_name": "RadioButtonsModel", "description": "", "index": 1,
                                 "_options_labels": ["Chat", "Inline code completion"]}},
              "gpu": {"state": {"_model_name": "DropdownModel", "description": "GPU", "index": 0,
                                "_options_labels": ["H100-SXM"]}}}
    assert report.shown_by("box", states) == [("setting", "GPU: H100-SXM")]


def _traces(line: str) -> list[dict]:
    """The traces of the first `Plotly.newPlot("id", [traces], layout, config)` call on a line."""
    rest = line.split("Plotly.newPlot(", 1)[1]
    return json.JSONDecoder().raw_decode(rest[rest.index("["):])[0]


def test_a_page_that_already_has_plotlyjs_does_not_get_it_twice():
    nb, _ = executed_notebook()
    nb.cells[0].outputs.insert(0, nbformat.v4.new_output(
        "display_data", data={"text/html": f"<script>{report.PLOTLYJS_MARK} = {{}};</script>"}))
    page, _ = report.ReportExporter().from_notebook_node(nb)
    assert page.count(report.PLOTLYJS_MARK) == 1


def test_plotlyjs_comes_once_before_the_first_chart_when_a_widget_chart_precedes_plotlys_own_copy():
    """Lesson 07's order: a widget's chart, then plotly's notebook renderer writes its copy of
    plotly.js, then a plain chart (JSON with the renderer's HTML, which loads MathJax from a CDN)."""
    nb, _ = executed_notebook()
    static = nb.cells.pop(0)
    static.outputs[0]["data"]["text/html"] = ('<script src="https://cdnjs.cloudflare.com/ajax/libs/mathjax/3.2.2/'
                                              'es5/tex-svg.min.js"></script><div>copy</div>')
    activation = nbformat.v4.new_output("display_data", data={"text/html": (
        f"<script>{report.PLOTLYJS_MARK} = {{MathJaxConfig: 'local'}};</script><script>{PLOTLYJS[:300]}</script>")})
    nb.cells.append(nbformat.v4.new_code_cell("chart", outputs=[activation, *static.outputs]))
    page, _ = report.ReportExporter().from_notebook_node(nb)

    assert page.count(PLOTLYJS[:300]) == 1 and page.count(report.PLOTLYJS_MARK) == 1
    assert page.index(PLOTLYJS[:300]) < page.index("Plotly.newPlot(")  # before the first chart
    assert page.count("Plotly.newPlot(") == 3 and "<div>copy</div>" not in page  # drawn from the JSON
    assert external_references(page) == []


def test_make_report_converts_with_the_report_exporter(tmp_path):
    """The exporter the Makefile's report recipe names."""
    nb, _ = executed_notebook()
    path = tmp_path / "lesson.ipynb"
    nbformat.write(nb, path)
    recipe = next(line for line in (ROOT / "Makefile").read_text().splitlines() if "jupyter nbconvert" in line)
    exporter = re.search(r"--to[ =](\S+)", recipe).group(1)
    assert exporter == "labkit.report.ReportExporter", recipe
    subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", exporter, str(path)],
                   check=True, capture_output=True)
    page = (tmp_path / "lesson.html").read_text()
    assert report.WIDGET_VIEW not in page and "prompt length P: 128" in page
    assert external_references(page) == []


def test_a_lesson_that_fails_under_make_report_is_its_error_line_not_papermills_traceback(tmp_path):
    """A mistyped parameter ended in papermill's own traceback through click, its error last."""
    done = subprocess.run(["make", "--no-print-directory", "-o", "venv", "report", 'PARAMS=-p GPU B200',
                           f"REPORT={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "LABKIT_QUICK": "1", "LABKIT_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode != 0 and done.stdout == "report: executing notebooks/01_two_phases.ipynb\n"
    said = [line for line in done.stderr.splitlines() if not line.startswith("make")]
    assert said[0] == "report: notebooks/01_two_phases.ipynb failed:" and said[1].startswith("Exception encountered at")
    assert said[2].startswith("SpecError: unknown GPU 'B200'; known: H100-SXM") and "Traceback" not in done.stderr
    assert said[3] == (f"report: papermill's whole log is {tmp_path}/01_two_phases.papermill.log, the notebook as "
                       f"far as it ran {tmp_path}/01_two_phases.ipynb") and len(said) == 4


# ------------------------------------------------------------------ nothing from another host
PLOTLYJS = __import__("plotly.offline", fromlist=["get_plotlyjs"]).get_plotlyjs()
# What loads from another host: a tag's src or href to http(s):// or //host, a CSS @import or url().
_REMOTE = re.compile(r"^\s*(https?:)?//", re.I)
_CSS_REMOTE = re.compile(r"@import\s+(url\()?\s*[\"']?\s*(https?:)?//|url\(\s*[\"']?\s*(https?:)?//", re.I)


class _Tags(HTMLParser):
    """Every src/href of a tag (script and style bodies are text to HTMLParser, so plotly.js's
    own strings are not tags), and the text of every <style>."""

    def __init__(self):
        super().__init__()
        self.refs, self.styles, self._in_style = [], [], False

    def handle_starttag(self, tag, attrs):
        self._in_style = tag == "style"
        for name, value in attrs:
            if name in ("src", "href", "data") and value and _REMOTE.match(value) and tag != "a":
                self.refs.append(f"<{tag} {name}={value}>")

    def handle_endtag(self, tag):
        self._in_style = False

    def handle_data(self, data):
        if self._in_style:
            self.styles.append(data)


def external_references(page: str) -> list[str]:
    """What in the page would load from another host (links a reader clicks, <a href>, do not)."""
    tags = _Tags()
    tags.feed(page)
    return tags.refs + [m.group(0) for style in tags.styles for m in _CSS_REMOTE.finditer(style)]


def test_external_references_finds_cdn_scripts_stylesheets_and_fonts():
    page = ('<script src="https://cdnjs.cloudflare.com/x.js"></script><link rel="stylesheet" '
            'href="//cdn.jsdelivr.net/y.css"><style>@font-face {src: url("https://fonts.example/f.woff")}</style>'
            '<a href="https://plotly.com/">a link</a><script>var s = "<script src=https://in.a/string>";</script>')
    assert len(external_references(page)) == 3


# MathJax as nbconvert set it up typesets between two $ (or $$, \( \), \[ \], \begin{...}): any $ counts.
MATH_OR_MERMAID = re.compile(r"\$|\\\(|\\\[|\\begin\{|```mermaid")


def test_no_lesson_needs_mathjax_or_mermaid():
    """ReportExporter leaves MathJax and mermaid out: no markdown cell has LaTeX or a diagram."""
    found = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
            if cell.cell_type == "markdown" and MATH_OR_MERMAID.search(cell.source):
                found.append(f"{path.name} cell {i}: {MATH_OR_MERMAID.search(cell.source).group(0)!r}")
    assert not found, "a lesson has LaTeX or mermaid; embed MathJax/mermaid in labkit.report first: " + str(found)
    assert MATH_OR_MERMAID.search("costs $O(P^2)$ FLOPs") and not MATH_OR_MERMAID.search("costs O(P^2) FLOPs")


# Lesson 07 shows widget charts before plotly's own chart (where plotly.js came twice), plain charts
# and a reveal too. A page that starts with a plain chart is the tests above (make test's time: each
# real lesson here is a papermill run of ~15 s on 2 cores, lesson 01 with a calibration).
REAL_LESSONS = ["notebooks/07_workload_shapes.ipynb"]


@pytest.fixture(scope="module")
def real_report(tmp_path_factory):
    """`make report` (the Makefile's recipe: papermill, then nbconvert) on real lessons, quick mode."""
    if shutil.which("make") is None:
        pytest.fail("make is not installed; `make report` is how the HTML is made")
    out = tmp_path_factory.mktemp("report")
    env = dict(os.environ, LABKIT_QUICK="1")
    run = subprocess.run(["make", "--no-print-directory", "-o", "venv", "-o", ".venv/.stamp", "report",
                          f"NOTEBOOKS={' '.join(REAL_LESSONS)}", f"REPORT={out}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return {lesson: (out / Path(lesson).with_suffix(".html").name).read_text() for lesson in REAL_LESSONS}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("lesson", REAL_LESSONS)
def test_a_real_lesson_s_html_loads_nothing_from_another_host_and_has_plotlyjs_once(real_report, lesson):
    page = real_report[lesson]
    assert external_references(page) == []
    assert page.count(PLOTLYJS[:300]) == 1, "plotly.js's source is not in the page exactly once"
    assert page.index(PLOTLYJS[:300]) < page.index("Plotly.newPlot(")
    assert "cdnjs.cloudflare.com" not in page.replace(PLOTLYJS, "")  # nor in a script's text, as a URL
    assert report.WIDGET_VIEW not in page and "settings when the notebook finished" in page


def draw_offline(page_html: str, path: Path, charts: int) -> tuple[list[int], list[str]]:
    """Open the page in Chromium with the network cut off; (traces of each chart drawn, every request
    that was not the file itself, failed request, console error or warning and uncaught exception)."""
    from browser_util import launch_chromium, sync_playwright
    start = sync_playwright()
    path.write_text(page_html)
    problems: list[str] = []
    with start() as playwright:
        browser = launch_chromium(playwright)
        try:
            page = browser.new_page()
            page.on("request", lambda r: r.url.startswith("file:") or problems.append(f"request: {r.url}"))
            page.on("requestfailed", lambda r: problems.append(f"failed: {r.url} {r.failure}"))
            page.on("console", lambda m: m.type in ("error", "warning") and problems.append(f"{m.type}: {m.text}"))
            page.on("pageerror", lambda e: problems.append(f"uncaught: {e}"))
            page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
                       else route.abort())  # offline: only the file itself
            page.goto(path.as_uri())
            page.wait_for_function(f"() => [...document.querySelectorAll('.js-plotly-plot')]"
                                   f".filter(g => g._fullLayout).length >= {charts}", timeout=60_000)
            drawn = page.evaluate("() => [...document.querySelectorAll('.js-plotly-plot')]"
                                  ".map(g => (g.data || []).length)")
            page.wait_for_timeout(500)  # a late request or error still counts
        finally:
            browser.close()
    return drawn, problems


@pytest.mark.browser
@pytest.mark.timeout(120)
def test_the_static_charts_draw_in_a_browser_with_no_network(tmp_path):
    nb, _ = executed_notebook()
    page_html, _ = report.ReportExporter().from_notebook_node(nb)
    drawn, problems = draw_offline(page_html, tmp_path / "lesson.html", 3)
    # The static chart (an empty roofline: drawn, no traces), then the lab's and the toggle's.
    assert len(drawn) == 3 and drawn[1] > 0 and drawn[2] > 0, drawn
    assert problems == []


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_real_lesson_s_html_draws_every_chart_with_no_network_and_no_failed_request(real_report, tmp_path):
    page_html = real_report["notebooks/07_workload_shapes.ipynb"]
    charts = page_html.count("Plotly.newPlot(")
    drawn, problems = draw_offline(page_html, tmp_path / "07_workload_shapes.html", charts)
    assert len(drawn) == charts >= 2 and all(n > 0 for n in drawn), drawn
    assert problems == []


def test_each_page_says_when_with_what_and_where_it_ran(tmp_path, monkeypatch):
    """A handout named neither its date nor its parameters (only a calibration's date, which can be
    older than its measurements), and its text keeps the H100 whatever GPU it was run for."""
    from labkit import report
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# A lesson")])
    nb.metadata["papermill"] = {"start_time": "2026-12-06T11:32:56.1", "parameters": {"GPU": "H200"}}
    monkeypatch.setenv("LABKIT_GIT_COMMIT", "0123456789abcdef0123")
    nb, _ = report.add_provenance(nb, {})
    line = nb.cells[0].source
    assert line.startswith("*Run 2026-12-06 11:32:56 UTC with parameters GPU = 'H200', the lab at commit 0123456789ab")
    assert "CPU is " in line and "the chapter's figures (an H100)" in line and nb.cells[1].source == "# A lesson"
