"""Every lesson in a real browser: JupyterLab runs all cells in headless Chromium, every slider
is moved, and every chart beside it must change with no error anywhere on the page.

One JupyterLab server (loopback, random token, LABKIT_QUICK=1, a fresh labkit cache) and one
Chromium page serve the whole module: JupyterLab boots once (4-6 s a page load) and each notebook
is opened with its `docmanager:open` command, closed unsaved afterwards, and its kernel shut down
in the background. A test that fails leaves the page suspect, so the next one loads a fresh page.
Cells run through JupyterLab's own command `notebook:run-all-cells`, reached via
`window.jupyterapp` (the server runs with `--LabApp.expose_app_in_browser`). A slider is moved
with the keyboard on its noUiSlider handle (ArrowRight, or ArrowLeft at the maximum): the
widget sets its value on the change event, as on a mouse release. A full-length screenshot of
each notebook lands in build/screenshots/<notebook>.png.
"""
from __future__ import annotations

import json
import re
import subprocess
import threading
import time
import warnings
from pathlib import Path

import pytest

from labkit import estimates
from browser_util import (ROOT, SCREENSHOTS, VENV_BIN, commit_predictions, full_screenshot, launch_chromium,
                          move_slider, page_errors, start_jupyter_lab, sync_playwright, wait_for_widgets)

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
RUN_TIMEOUT_S = 300  # one notebook's cells, LABKIT_QUICK=1, on 2 cores
MOVE_TIMEOUT_S = 180  # one slider move: one real measurement and a redraw (a busy machine: minutes)


class Lab:
    """The module's server and browser context, and the one JupyterLab page the tests share."""

    def __init__(self, server, context):
        self.server, self.context, self.page, self.trusted = server, context, None, False
        self.console: list[tuple[str, str]] = []  # (type, text) of every console message and page error

    def fresh_page(self):
        """The shared page with JupyterLab booted and nothing open; a new one after a failure."""
        if self.page is not None and self.trusted:
            return self.page
        if self.page is not None and not self.page.is_closed():
            self.page.close()
        self.page = self.context.new_page()
        self.page.on("console", lambda msg: self.console.append((msg.type, msg.text)))
        self.page.on("pageerror", lambda err: self.console.append(("pageerror", str(err))))
        self.page.goto(self.server.url("/lab?reset"))  # ?reset: an empty workspace
        self.page.wait_for_function(APP_READY_JS, timeout=120_000, polling=100)
        # Opened before the layout is restored (and ?reset has cleared it), a notebook is closed again.
        self.page.evaluate("() => window.jupyterapp.restored")
        self.page.wait_for_function("() => !location.search.includes('reset')", timeout=30_000, polling=100)
        self.trusted = True
        return self.page


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A `Lab` for the module; the context's HTTP cache keeps JupyterLab's and plotly's bundles.
    The server's process group is always stopped."""
    start = sync_playwright()
    server = start_jupyter_lab(tmp_path_factory.mktemp("jupyter-lab"))
    try:
        with start() as playwright:
            browser = launch_chromium(playwright)
            try:
                yield Lab(server, browser.new_context(viewport={"width": 1400, "height": 1000}))
            finally:
                browser.close()
    finally:
        server.stop()


# ------------------------------------------------------------------ JupyterLab, driven
APP_READY_JS = """() => !!(window.jupyterapp && window.jupyterapp.shell && window.jupyterapp.commands
                         && window.jupyterapp.commands.hasCommand('docmanager:open'))"""

OPEN_JS = """path => { window.jupyterapp.commands.execute('docmanager:open', {path, factory: 'Notebook'}); }"""

# Closes the current notebook without saving: marked clean first, so no "save changes?" dialog.
CLOSE_JS = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  if (w && w.context) { w.context.model.dirty = false; w.close(); }
}"""

NOTEBOOK_READY_JS = """path => {
  const app = window.jupyterapp, w = app && app.shell.currentWidget;
  const kernel = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  return !!(w && w.context && w.context.path === path && w.content && w.content.widgets.length
            && kernel && kernel.status === 'idle');
}"""

RUN_ALL_JS = """() => {
  window.__labkitRunAll = 'running';
  window.jupyterapp.commands.execute('notebook:run-all-cells').then(
    () => { window.__labkitRunAll = 'done'; }, err => { window.__labkitRunAll = 'failed: ' + err; });
}"""

KERNEL_IDLE_JS = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  const kernel = w.sessionContext.session && w.sessionContext.session.kernel;
  return window.__labkitRunAll !== 'running' && !!kernel && kernel.status === 'idle';
}"""

# Code cells that did not run, and outputs of type "error", read from the cell models (so a
# cell scrolled out of view, not rendered, is still checked).
CELL_REPORT_JS = """() => {
  const w = window.jupyterapp.shell.currentWidget, unrun = [], errors = [];
  w.content.widgets.forEach((cell, i) => {
    if (cell.model.type !== 'code') return;
    if (cell.model.executionCount === null) unrun.push(i);
    for (const out of cell.model.outputs.toJSON()) {
      if (out.output_type === 'error') errors.push(`cell ${i}: ${out.ename}: ${out.evalue}`);
    }
  });
  return {unrun, errors, runAll: window.__labkitRunAll};
}"""

def open_notebook(page, server, notebook: Path):
    path = f"notebooks/{notebook.name}"
    page.evaluate(OPEN_JS, path)
    try:
        page.wait_for_function(NOTEBOOK_READY_JS, arg=path, timeout=120_000, polling=250)
    except Exception:
        dialog = page.locator(".jp-Dialog").all_inner_texts()
        pytest.fail(f"{path} did not open with an idle kernel; dialogs: {dialog}\n{server.log_tail()}")


def run_all_cells(page, notebook: Path):
    page.evaluate(RUN_ALL_JS)
    page.wait_for_function(KERNEL_IDLE_JS, timeout=RUN_TIMEOUT_S * 1000, polling=500)
    report = page.evaluate(CELL_REPORT_JS)
    assert report["runAll"] == "done", f"{notebook.name}: run-all-cells {report['runAll']}"
    assert not report["errors"], f"{notebook.name}: cells raised: {report['errors']}"
    assert not report["unrun"], f"{notebook.name}: code cells {report['unrun']} did not run"


def empty_charts(page) -> list[int]:
    """Indexes of plotly charts drawn with no trace at all (a view that never got its figure)."""
    return page.evaluate("() => [...document.querySelectorAll('.js-plotly-plot')]"
                         ".map((g, i) => [i, (g.data || []).length]).filter(([i, n]) => n === 0).map(([i]) => i)")


def wait_until_idle(page):
    page.wait_for_function(KERNEL_IDLE_JS, timeout=MOVE_TIMEOUT_S * 1000, polling=250)


def shut_down_kernels(server) -> threading.Thread:
    """Shut down the sessions open now, in the background (a kernel takes ~2 s to exit); the
    ids are read first, so a session the next test opens is never among them."""
    sessions = [session["id"] for session in server.api("GET", "/api/sessions")]

    def run():
        for session in sessions:
            server.api("DELETE", f"/api/sessions/{session}")
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# ------------------------------------------------------------------ what a learner would notice
# Everything the notebook's code cells printed (stream outputs), read from the cell models.
PRINTED_JS = """() => {
  const w = window.jupyterapp.shell.currentWidget, out = [];
  w.content.widgets.forEach(cell => {
    if (cell.model.type !== 'code') return;
    for (const o of cell.model.outputs.toJSON()) {
      if (o.output_type === 'stream') out.push(Array.isArray(o.text) ? o.text.join('') : o.text);
    }
  });
  // what views.after_estimate held back until the estimate was committed, printed as text; its
  // textContent, as innerText is empty in a cell off screen (JupyterLab's contentVisibility windowing)
  document.querySelectorAll('.labkit-held pre').forEach(p => out.push(p.textContent + '\\n'));
  return out.join('');
}"""

# Text a learner cannot read whole: a widget label, button or readout narrower than its text
# (ipywidgets cuts it with an ellipsis), and chart text that runs past its chart or, for bar and
# point labels, past the plot area that clips them; and rates printed with an exponent (1.8e+3).
CLIPPED_JS = r"""() => {
  const out = [], seen = el => el.getClientRects().length > 0;
  for (const el of document.querySelectorAll(
      '.widget-label, .widget-toggle-button, .jupyter-button, .widget-readout, .widget-dropdown select')) {
    if (seen(el) && el.scrollWidth > el.clientWidth + 1) out.push(`widget text cut: "${el.textContent.trim()}"`);
  }
  for (const gd of document.querySelectorAll('.js-plotly-plot')) {
    const full = gd._fullLayout, box = gd.getBoundingClientRect();
    if (!full || !seen(gd)) continue;
    const outside = (r, x0, x1, y0, y1) => r.width > 0 && (r.left < x0 - 1 || r.right > x1 + 1 || r.top < y0 - 1 || r.bottom > y1 + 1);
    for (const t of gd.querySelectorAll('text')) {
      const text = t.textContent.trim();
      if (!text) continue;
      if (/\de\+\d/.test(text)) out.push(`exponent in chart text: "${text}"`);
      if (outside(t.getBoundingClientRect(), box.left, box.right, box.top, box.bottom)) out.push(`chart text past its chart: "${text}"`);
    }
    for (const p of Object.values(full._plots || {})) {
      if (!p.plot || !p.xaxis || !p.yaxis) continue;
      const x0 = box.left + p.xaxis._offset, y0 = box.top + p.yaxis._offset;
      for (const t of p.plot.node().querySelectorAll('text.bartext, .textpoint text')) {
        const clip = t.closest('[clip-path]');  // a trace drawn with cliponaxis: false is not clipped
        if (clip && outside(t.getBoundingClientRect(), x0, x0 + p.xaxis._length, y0, y0 + p.yaxis._length))
          out.push(`chart label cut at its axes: "${t.textContent.trim()}"`);
      }
    }
  }
  return [...new Set(out)];
}"""


def console_failures(messages: list[tuple[str, str]]) -> list[str]:
    """Console errors, uncaught page errors, and JupyterLab's warnings that a front-end module is
    not the version an extension asks for."""
    return [f"{kind}: {text[:300]}" for kind, text in messages
            if kind in ("error", "pageerror") or re.search(r"does not satisfy|version.*required|required.*version", text)]


GROWTH = re.compile(r"P from ([\d,]+) to ([\d,]+) is ([\d.]+)× the tokens; measured time ([\d.]+)×")
BUSY_LEFT_OUT = re.compile(r"\(\d+ point\(s\) timed on a busy machine left out\)")  # explore.growth_line
EXTREMES = re.compile(r"Furthest towards decode: (.+?) \(\d+% prefill\)\. Furthest towards prefill: (.+?) \(")
SHAPE_ROW = re.compile(r"^ *(.+?): prefill +([\d,.]+) ms, decode +([\d,.]+) ms", re.M)
# Lesson 06: the unchunked run's line (printed once the estimate is in) and the chunk slider's status line
STALL = re.compile(r"worst gap ([\d,]+) ms while [\d,]+ prompt tokens were prefilled in one pass")
CHUNKED = re.compile(r"measured on [^:\n]+: worst gap ([\d,]+) ms, prefill ([\d,]+) ms")
# The status lines of what views.after_estimate held back (a lab's measured line), as text
STATUS_JS = """() => [...document.querySelectorAll('.labkit-held .labkit-status')].map(e => e.textContent).join('\\n')"""
PREFILL_HEAVY_SHAPES = {"Classification / extraction", "Inline code completion", "Long-document summarisation"}


def conclusions(notebook: Path, printed: str) -> dict:
    """The measured conclusion a lesson printed, parsed: lesson 02's growth from the shortest to
    the longest prompt, lesson 07's prefill share per shape and its two extremes."""
    if notebook.stem.startswith("02_"):
        busy = bool(BUSY_LEFT_OUT.search(printed))  # the lab said it left points out: the machine was busy
        if m := GROWTH.search(printed):
            return {"from": m[1], "to": m[2], "tokens_ratio": float(m[3]), "measured_ratio": float(m[4]), "busy": busy}
        return {"busy": busy}
    if notebook.stem.startswith("07_"):
        shares = {name: float(p.replace(",", "")) / (float(p.replace(",", "")) + float(d.replace(",", "")))
                  for name, p, d in SHAPE_ROW.findall(printed)}
        m = EXTREMES.search(printed)
        return {"shares": shares, "extremes": (m[1], m[2]) if m else None}
    if notebook.stem.startswith("06_"):
        stall, chunked = STALL.search(printed), CHUNKED.search(printed)
        number = lambda text: float(text.replace(",", ""))  # noqa: E731
        return {"unchunked_worst_ms": number(stall[1]) if stall else None,
                "chunked_worst_ms": number(chunked[1]) if chunked else None,
                "chunked_prefill_ms": number(chunked[2]) if chunked else None}
    return {}


def contradictions(notebook: Path, printed: str) -> list[str]:
    """Where a lesson's printed, measured conclusion says the opposite of its text."""
    found = conclusions(notebook, printed)
    if notebook.stem.startswith("02_"):
        if "measured_ratio" not in found:
            return [f"no growth conclusion printed: {printed[-400:]!r}"]
        if found["measured_ratio"] <= found["tokens_ratio"]:
            return [f"measured time grew {found['measured_ratio']}x for {found['tokens_ratio']}x the tokens: "
                    "no bend away from a straight line, which the lesson promises"]
    if notebook.stem.startswith("07_"):
        if not found["extremes"]:
            return [f"no extremes printed: {printed[-400:]!r}"]
        decode_end, prefill_end = found["extremes"]
        if decode_end != "Chat" or prefill_end not in PREFILL_HEAVY_SHAPES:
            return [f"the text says chat leans furthest to decode and a short-answer shape or the long "
                    f"document furthest to prefill; measured: {decode_end}, {prefill_end}"]
    if notebook.stem.startswith("06_"):
        return chunking_contradictions(found, printed)
    return []


def chunking_contradictions(found: dict, printed: str) -> list[str]:
    """Lesson 06 says chunking shrinks the streams' worst gap and that the long prompt pays for it
    in prefill time. The unchunked worst gap is its prefill plus one decode step; each run is the
    fastest of runs confirmed to within CONFIRM_TOLERANCE (`interference.MAX_RUNS`), so a chunked
    prefill counts as cheaper only when it is more than that below the single pass (`make
    report` on the 2-core EPYC VM, timed once a side: 518 ms chunked against 638 ms)."""
    from labkit.timing import CONFIRM_TOLERANCE
    if found.get("unchunked_worst_ms") is None or found.get("chunked_worst_ms") is None:
        return [f"lesson 06's measured lines not found: {printed[-400:]!r}"]
    problems = []
    if found["chunked_worst_ms"] >= found["unchunked_worst_ms"]:
        problems.append(f"chunking left the worst gap at {found['chunked_worst_ms']:,.0f} ms against "
                        f"{found['unchunked_worst_ms']:,.0f} ms in one pass: the lesson says it shrinks")
    if found["chunked_prefill_ms"] < (1 - CONFIRM_TOLERANCE) * found["unchunked_worst_ms"]:
        problems.append(f"the chunked prefill took {found['chunked_prefill_ms']:,.0f} ms, under the single pass's "
                        f"{found['unchunked_worst_ms']:,.0f} ms: the lesson says the long prompt pays for chunking")
    return problems


def test_lesson_06s_check_tells_a_chunked_prefill_that_pays_from_one_that_wins():
    nb = ROOT / "notebooks" / "06_chunked_prefill.ipynb"
    line = ("on AMD EPYC: streams' usual gap 4 ms, worst gap {} ms while 4,096 prompt tokens were prefilled in one pass\n"
            "measured on AMD EPYC: worst gap {} ms, prefill {} ms")
    assert contradictions(nb, line.format(416, 85, 458)) == []  # this VM, 2026-12-06, confirmed runs
    assert contradictions(nb, line.format(416, 85, 400)) == []  # within a confirmation of each other
    (cheaper,) = contradictions(nb, line.format(638, 85, 518))  # `make report`, one run a side
    assert "the long prompt pays" in cheaper
    (wider,) = contradictions(nb, line.format(416, 450, 470))
    assert "shrinks" in wider
    assert "not found" in contradictions(nb, "nothing measured")[0]


def test_lesson_02s_conclusion_says_whether_the_lab_left_points_out_as_busy():
    """The three-run check runs a missed run twice again only where the lab itself said the
    machine was busy: the growth line's own words (explore.growth_line), parsed here."""
    from labkit.explore import growth_line
    nb = ROOT / "notebooks" / "02_prefill_two_terms.ipynb"
    g = {"left_out": 0, "device_name": "AMD EPYC", "from": 512, "to": 4096, "x_ratio": 8.0, "measured_ratio": 13.3,
         "predicted_ratio": 15.9, "linear_only_ratio": 7.9}
    assert conclusions(nb, growth_line(g)) == {"from": "512", "to": "4,096", "tokens_ratio": 8.0,
                                               "measured_ratio": 13.3, "busy": False}
    busy = conclusions(nb, growth_line({**g, "left_out": 3, "to": 2304, "x_ratio": 4.5, "measured_ratio": 6.4}))
    assert busy["busy"] and busy["to"] == "2,304"
    assert conclusions(nb, growth_line({**g, "left_out": 5, "measured_ratio": None})) == {"busy": True}
    assert "no growth conclusion" in contradictions(nb, growth_line({**g, "left_out": 5, "measured_ratio": None}))[0]


def wait_for_conclusion(page, notebook: Path, timeout_s: float = 30) -> dict:
    """The lesson's measured conclusion once the page shows it (views.after_estimate releases it
    beneath the reveal, which comes first), or its word that too few points were trustworthy;
    after `timeout_s`, whatever the page shows."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = page.evaluate(PRINTED_JS)
        found = conclusions(notebook, text)
        done = "measured_ratio" in found if notebook.stem.startswith("02_") else bool(found.get("extremes"))
        if done or "Too few trustworthy" in text or time.monotonic() > deadline:
            return found
        page.wait_for_timeout(250)


RUNS: dict[str, list[dict]] = {}  # notebook stem -> the conclusions of each browser run so far


# ------------------------------------------------------------------ the test
# Whether the open notebook has unsaved changes, and its metadata as JupyterLab holds it.
UNSAVED_JS = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  return {dirty: w.context.model.dirty, metadata: w.context.model.toJSON().metadata};
}"""


def open_and_run(page, server, notebook: Path):
    open_notebook(page, server, notebook)
    # Its kernel running, JupyterLab has written the kernel's spec and language_info into the
    # metadata (a moment after the kernel turns idle); the server served them already
    # (labkit.lab_contents), so a lesson only read closes without "Save your work?".
    page.wait_for_timeout(1000)
    unsaved = page.evaluate(UNSAVED_JS)
    assert unsaved["dirty"] is False, f"{notebook.name}: unsaved changes before any cell ran: {unsaved['metadata']}"
    run_all_cells(page, notebook)
    wait_for_widgets(page)


def close(page, server):
    page.evaluate(CLOSE_JS)
    return shut_down_kernels(server)


@pytest.mark.browser
@pytest.mark.timeout(RUN_TIMEOUT_S + 3 * MOVE_TIMEOUT_S + 60)  # the first one also starts the server
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[nb.stem for nb in NOTEBOOKS])
def test_notebook_runs_in_the_browser_and_every_slider_redraws_its_charts(lab, notebook):
    server = lab.server
    original = notebook.read_bytes()
    page = lab.fresh_page()
    lab.trusted = False  # until this test has closed its notebook cleanly
    lab.console.clear()
    try:
        # The notebook before shuts its kernel down in the background: a lesson that measures
        # (02's growth, 07's order) would otherwise share the two cores with it.
        wait_for_no_sessions(server)
        open_and_run(page, server, notebook)
        assert page_errors(page) == [], f"{notebook.name}: errors on the page after running"
        # what shows a lesson's measured answer waits for its "Predict first" estimate (views.after_estimate):
        # under a Run All it had drawn the answer beneath the unanswered question
        held = page.locator(".labkit-show-anyway").count()
        assert held >= 1 or notebook.stem[:2] in ("03", "08"), f"{notebook.name}: the answer shown before the estimate"
        journal = Path(server.env["LABKIT_DATA_DIR"]) / estimates.JOURNAL_NAME
        kept_before = len(estimates.read(journal)[0])
        reveals = commit_predictions(page, MOVE_TIMEOUT_S)
        wait_for_widgets(page)
        assert page.locator(".labkit-show-anyway").count() == 0, f"{notebook.name}: held back after the estimate"
        # each committed estimate kept in the learner's journal, with the reveal it was shown beside
        kept = estimates.read(journal)[0][kept_before:]
        assert len(kept) == len(reveals), f"{notebook.name}: {len(reveals)} reveals, {len(kept)} kept"
        assert all(line["compared"] in reveal for line, reveal in zip(kept, reveals)), (kept, reveals)
        printed = page.evaluate(PRINTED_JS) + page.evaluate(STATUS_JS)
        RUNS.setdefault(notebook.stem, []).append(conclusions(notebook, printed))
        assert contradictions(notebook, printed) == [], f"{notebook.name}: printed conclusion against its text"
        assert page.evaluate(CLIPPED_JS) == [], f"{notebook.name}: text a learner cannot read whole"
        print(f"{notebook.name}: reveals: {reveals}")
        for reveal in reveals:  # the estimate, the formula and the measurement, and a line on the gap
            assert all(word in reveal for word in ("your estimate", "the formula", "measured on", "Why:")), reveal
        # Once plotly's FigureWidget drew a chart with no figure about once in fifteen runs; the
        # lessons' charts (views.LiveFigure) now always carry their whole figure.
        assert empty_charts(page) == [], f"{notebook.name}: plotly charts drawn empty"
        moves = [move_slider(page, slider, MOVE_TIMEOUT_S, settle=lambda: wait_until_idle(page))
                 for slider in page.locator(".widget-slider").all()]
        print(f"{notebook.name}: sliders moved: {moves}")
        stuck = [m for m in moves if m["unchanged"] or m["count_changed"] or m["from"] == m["to"]]
        assert not stuck, f"{notebook.name}: a slider move left its charts as they were: {stuck}"
        assert page_errors(page) == [], f"{notebook.name}: errors on the page after moving the sliders"
        assert page.evaluate(CLIPPED_JS) == [], f"{notebook.name}: text cut after moving the sliders"
        assert console_failures(lab.console) == [], f"{notebook.name}: browser console"
    finally:
        if not page.is_closed():  # a picture for people to look at, pass or fail
            try:
                full_screenshot(page, SCREENSHOTS / f"{notebook.stem}.png")
            except Exception as err:  # noqa: BLE001 — never hide the test's own failure
                warnings.warn(f"{notebook.name}: no screenshot ({err})")
        try:
            close(page, server)
            page.wait_for_function("() => !window.jupyterapp.shell.currentWidget"
                                   " || !window.jupyterapp.shell.currentWidget.context", timeout=10_000)
            lab.trusted = page_errors(page) == []  # nothing left over from this notebook
        except Exception as err:  # noqa: BLE001 — the next test loads a fresh page instead
            warnings.warn(f"{notebook.name}: could not close the notebook cleanly ({err})")
    assert notebook.read_bytes() == original, f"{notebook.name} was written during the test"


@pytest.mark.parametrize("ci", [None, "true"])
def test_without_chromium_the_browser_tests_skip_or_under_ci_fail(monkeypatch, ci):
    import browser_util

    monkeypatch.setattr(browser_util, "CHROMIUM", "/nonexistent/chromium")
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    outcome = pytest.fail.Exception if ci == "true" else pytest.skip.Exception
    with pytest.raises(outcome, match="no Chromium at /nonexistent/chromium"):
        browser_util.sync_playwright()


IDLE_GROWTH_PY = """
import json, sys
from labkit import sweeps
prompts = [int(p) for p in sys.argv[1:]]
best = {}
for _ in range(2):  # each prompt twice, alternating, in one warm process; its fastest kept
    for p in prompts:
        best[p] = min(best.get(p, float("inf")), sweeps.measure_prefill(prompt_tokens=p)["time_s"])
print(json.dumps([best[p] for p in prompts]))
"""


IDLE_PROMPTS = (512, 4096)  # lesson 02's shortest and longest primed prompts, outside quick mode


def idle_growth(server, prompts=IDLE_PROMPTS) -> float:
    """What labkit measures on the idle machine (no notebook open, the browser waiting): the ratio
    of the longest prompt's prefill time to the shortest's, each the fastest of two points timed
    in alternation in one warm process, as the lesson's kernel is warm (single cold `measure`
    runs put the same ratio anywhere from 11.5x to 13.5x on the 2-core EPYC)."""
    out = subprocess.run([str(VENV_BIN / "python"), "-c", IDLE_GROWTH_PY, *map(str, prompts)], cwd=ROOT,
                         env=server.env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    times = json.loads(out.stdout.strip().splitlines()[-1])
    return times[-1] / times[0]


def wait_for_no_sessions(server, timeout_s: float = 90):
    """Until the server lists no session (the kernels of a closed notebook have shut down)."""
    deadline = time.monotonic() + timeout_s
    while server.api("GET", "/api/sessions") and time.monotonic() < deadline:
        time.sleep(0.5)


def share_resolution(share: float) -> float:
    """How far a measured prefill share can move while each phase's time is only confirmed to
    within labkit.timing.CONFIRM_TOLERANCE: s = p / (p + d), each of p and d known to ±t, moves by
    up to about s (1 - s) 2t."""
    from labkit.timing import CONFIRM_TOLERANCE
    return share * (1 - share) * 2 * CONFIRM_TOLERANCE


def orders_agree(runs: list[dict]) -> list[str]:
    """Pairs of shapes whose order differs between runs by more than the measurement resolves.
    In one run the gap between two shares is known to within the sum of their resolutions
    (`share_resolution`), so two runs' gaps may differ by up to twice that: a tie may fall either
    way, and a near-tie may show a gap of up to its resolution one way in one run and a little
    the other way in the next (a fresh-clone make test on the 2-core EPYC VM: RAG against agent
    loop -0.101, +0.010, +0.008 at a resolution of 0.099; on the idle machine the two measure
    0.50-0.59 each, in either order). A real gap that turns round moves further than that."""
    names = sorted(runs[0]["shares"])
    problems = []
    for a, b in ((a, b) for i, a in enumerate(names) for b in names[i + 1:]):
        gaps = [run["shares"][a] - run["shares"][b] for run in runs]
        tie = max(share_resolution(run["shares"][a]) + share_resolution(run["shares"][b]) for run in runs)
        if min(gaps) < 0 < max(gaps) and max(gaps) - min(gaps) > 2 * tie:
            problems.append(f"{a} vs {b}: prefill share differences {[round(g, 3) for g in gaps]}, "
                            f"resolution {tie:.3f} a run")
    return problems


def test_the_order_check_tells_a_tie_from_a_swap():
    tie = [{"shares": {"a": 0.70, "b": 0.66}}, {"shares": {"a": 0.64, "b": 0.70}}]  # resolution ~0.09
    near_tie = [{"shares": {"a": 0.51, "b": 0.61}}, {"shares": {"a": 0.55, "b": 0.54}}]  # ~0.10
    swap = [{"shares": {"a": 0.90, "b": 0.20}}, {"shares": {"a": 0.20, "b": 0.90}}]
    gap_turned = [{"shares": {"a": 0.70, "b": 0.50}}, {"shares": {"a": 0.55, "b": 0.60}}]  # 0.20, then -0.05
    assert orders_agree(tie) == [] and orders_agree(near_tie) == []
    assert len(orders_agree(swap)) == 1 and len(orders_agree(gap_turned)) == 1


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.timeout(10 * RUN_TIMEOUT_S)  # three runs, each at most twice again, and their idle references
@pytest.mark.parametrize("stem", ["02_prefill_two_terms", "07_workload_shapes"])
def test_measured_conclusions_hold_in_three_browser_runs(lab, stem):
    """With JupyterLab and Chromium on the same cores, lesson 02's measured growth from 512 to
    4,096 tokens lands within 25 % of what `measure` gives on the idle machine, and lesson 07's
    order of the six shapes is the same, in three runs out of three, up to ties within what the
    measurement resolves (the run of the test above counts as the first).

    Lesson 02's idle reference is taken before the runs and again after them: a shared VM's
    neighbours move the idle figure too (a fresh-clone run on the 2-core Xeon measured 12.7x idle
    before its runs, and runs of 12.0x, 16.2x and 12.9x), so a run is held to within 25 % of the
    idle range. A run outside it is run once more, after a new idle reference (the idle figure at
    that moment joins the range), and the new run must be inside: one transient slowdown is the
    neighbours', the same miss twice is the lab's. Unless the lab itself said, in the rerun, that
    the machine was busy (points left out of the growth as timed on a busy machine): then it is
    run once more again, the last chance (a fresh clone on the 2-core Zen 4 EPYC VM, idle 12.8x
    and 13.1x: 13.3x, then 17.5x and on its rerun 6.4x from 512 to 2,304 tokens, the longer
    prompts left out as timed on a busy machine, then 15.1x)."""
    notebook = ROOT / "notebooks" / f"{stem}.ipynb"
    page = lab.fresh_page()
    wait_for_no_sessions(lab.server)  # the test before closed its notebook: an idle machine, not one shutting a kernel down
    references = [idle_growth(lab.server)] if stem.startswith("02_") else []
    runs = RUNS.setdefault(stem, [])

    def run_once() -> dict:
        lab.trusted = False
        # The test before closed its notebook and shuts its kernel down in the background: opened
        # before that ends, the notebook would attach to the dying session.
        wait_for_no_sessions(lab.server)
        open_and_run(page, lab.server, notebook)
        commit_predictions(page, MOVE_TIMEOUT_S)  # the conclusion waits for the estimate (views.after_estimate)
        wait_for_widgets(page)
        printed = wait_for_conclusion(page, notebook)
        close(page, lab.server).join(timeout=60)
        lab.trusted = True
        return printed

    while len(runs) < 3:
        runs.append(run_once())

    def reference():
        wait_for_no_sessions(lab.server)
        references.append(idle_growth(lab.server))

    # The same growth as the idle reference's: a run whose end point was timed noisy prints the
    # growth between other prompts, which no idle figure here stands for.
    ends = tuple(f"{p:,}" for p in IDLE_PROMPTS)

    def inside(run) -> bool:
        return ((run.get("from"), run.get("to")) == ends and run.get("measured_ratio") is not None
                and 0.75 * min(references) <= run["measured_ratio"] <= 1.25 * max(references))

    if references:
        reference()
        for i, run in enumerate(runs):
            for attempt in (1, 2):
                if inside(run) or (attempt == 2 and not run.get("busy")):
                    break
                missed = run
                reference()
                run = runs[i] = {**run_once(), "replaces": missed}
                print(f"{stem}: run {i + 1} measured {missed.get('measured_ratio')}x from {missed.get('from')} to "
                      f"{missed.get('to')}, outside {0.75 * min(references):.1f}-{1.25 * max(references):.1f}x "
                      f"(busy: {missed.get('busy')}): run again, {run.get('measured_ratio')}x")
    print(f"{stem}: idle growth {references}; browser runs {runs}")
    if references:
        ratios = [run.get("measured_ratio") for run in runs]
        assert all(inside(run) for run in runs), \
            (f"lesson 02's growth in the browser {ratios} (from, to: {[(r.get('from'), r.get('to')) for r in runs]}) "
             f"against {min(references):.2f}-{max(references):.2f}x measured idle from {IDLE_PROMPTS[0]:,} to "
             f"{IDLE_PROMPTS[1]:,} (before and after the runs)")
    else:
        assert all(len(run["shares"]) == 6 for run in runs), runs
        assert orders_agree(runs) == [], "lesson 07's order of the shapes changed between browser runs"
