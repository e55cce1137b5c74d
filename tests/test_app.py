"""`make app`: a lesson served by Voilà on loopback, behind a token, works in a real browser.

For the Makefile's default NB and every `make app NB=...` the README shows, the server is started
by the Makefile's own `app` recipe (`make -o venv app [NB=...] PORT=...`; `-o venv`: never
reinstall the venv from inside a test). The default lesson runs as a learner types it, `make app`
with no token given: the recipe makes one, and Chromium opens the link it printed. The others get
theirs in JUPYTER_TOKEN, as a user may give it. Chromium waits for the lesson's heading and its
widgets, moves every slider and checks that its chart changed and no error showed; without the
token (or with a wrong one) nothing is served.
The browser's console stays clean from the first request to the last slider move: no error, no
uncaught exception, no warning (JupyterLab's "Unsatisfied version" module warnings among them),
and no request leaves 127.0.0.1.
"""
from __future__ import annotations

import json
import re
import shutil
import socket
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from browser_util import (ROOT, SCREENSHOTS, Server, commit_predictions, free_port, full_screenshot, http_get,
                          isolated_env, launch_chromium, move_slider, new_token, page_errors, printed_link,
                          sync_playwright, wait_for_widgets)

pytestmark = pytest.mark.browser



DEFAULT_NB = re.search(r"^NB\s*\?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)


def app_notebooks() -> list[str]:
    """The Makefile's default NB and every `make app NB=...` the README shows."""
    shown = re.findall(r"make app NB=(\S+?\.ipynb)", (ROOT / "README.md").read_text())
    return sorted({DEFAULT_NB, *shown})


NOTEBOOKS = app_notebooks()
LOAD_TIMEOUT_S = 240  # Voilà runs every cell before the page is complete (LABKIT_QUICK=1)
MOVE_TIMEOUT_S = 180  # one real measurement and a redraw; generous for a machine running two suites

# Console messages a clean page may still log: (regular expression, the reason it is harmless).
# Nothing is tolerated now; an entry needs its reason, and every other error or warning fails.
TOLERATED: list[tuple[str, str]] = []
MODULE_VERSION = re.compile(r"Unsatisfied version|No satisfying version")  # webpack's shared-module check


class Console:
    """What the page tells its console, from before the first request: errors, warnings, uncaught
    exceptions, failed requests and requests to any host but the server's."""

    def __init__(self, page, base_url: str):
        self.host = urlsplit(base_url).netloc
        self.messages: list[str] = []
        page.on("console", self._console)
        page.on("pageerror", lambda error: self.messages.append(f"uncaught {error}"))
        page.on("requestfailed", lambda request: self.messages.append(
            f"request failed: {request.url} ({request.failure})"))
        page.on("request", self._request)

    def _console(self, message):
        if message.type in ("error", "warning", "assert"):
            self.messages.append(f"console.{message.type}: {message.text}")

    def _request(self, request):
        parts = urlsplit(request.url)
        if parts.scheme in ("http", "https", "ws", "wss") and parts.netloc != self.host:
            self.messages.append(f"request to another host: {request.url}")

    def problems(self) -> list[str]:
        return [m for m in self.messages if not any(re.search(pattern, m) for pattern, _ in TOLERATED)]

    def check(self, when: str):
        problems = self.problems()
        versions = [m for m in problems if MODULE_VERSION.search(m)]
        assert not problems, (f"{when}: the console shows {len(problems)} problem(s), {len(versions)} of them "
                              "JupyterLab module-version warnings:\n" + "\n".join(problems))


@pytest.fixture(scope="module", params=NOTEBOOKS)
def app(request, tmp_path_factory):
    """The `make app` server for one notebook and the link to open; its process group (make,
    voila, kernel) always stopped. The Makefile's default NB runs as `make app` with no token
    given, so the recipe makes one and the link is the one it printed (what a learner clicks);
    every other NB runs with the token in JUPYTER_TOKEN, as a user may give it."""
    start = sync_playwright()
    notebook = request.param
    if not (ROOT / notebook).exists():
        pytest.skip(f"{notebook} not written yet")
    if shutil.which("make") is None:
        pytest.fail("make is not installed; `make app` is how the lesson is served")
    home = tmp_path_factory.mktemp("voila")
    port, default = free_port(), notebook == DEFAULT_NB
    # One labkit cache for the lessons served here, as a learner's lessons share theirs: the first
    # calibrates (fresh, none of the user's), the next reads it (a calibration is ~5 s of make test).
    cache = tmp_path_factory.getbasetemp() / "app-labkit-cache"
    env, token = isolated_env(home, cache), "" if default else new_token()
    env.pop("JUPYTER_TOKEN", None)
    if token:
        env["JUPYTER_TOKEN"] = token
    argv = ["make", "--no-print-directory", "-o", "venv", "-o", ".venv/.stamp", "app", f"PORT={port}",
            *([] if default else [f"NB={notebook}"])]
    server = Server(argv, env, home / "voila.log", f"http://127.0.0.1:{port}", token)
    try:
        link = printed_link(server, "Voila", port) if default else server.url("/")
        # Any answer means it listens; "/" without the token is a redirect to the login page
        # (with the token it would run the whole notebook once just to say it is up).
        server.wait_until_up("/", token=False, answered=lambda status: status > 0)
        yield server, start, notebook, link
    finally:
        server.stop()


def first_heading(notebook: str) -> str:
    """The lesson's first markdown heading: what a learner sees at the top of the page."""
    for cell in json.loads((ROOT / notebook).read_text())["cells"]:
        if cell["cell_type"] == "markdown" and (match := re.search(r"^#+\s+(.+)$", "".join(cell["source"]), re.M)):
            return match.group(1).strip()
    pytest.fail(f"{notebook} has no markdown heading")


def other_addresses() -> list[str]:
    """This machine's addresses outside 127.0.0.0/8 (a server on loopback must not answer there)."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
    except OSError:
        return []
    return sorted({info[4][0] for info in infos if not info[4][0].startswith("127.")})


@pytest.mark.timeout(120)
def test_the_app_listens_on_loopback_only_and_refuses_requests_without_the_token(app):
    server, _, notebook, _link = app
    port = int(server.base_url.rsplit(":", 1)[1])
    for address in other_addresses():
        with socket.socket() as sock:
            sock.settimeout(2)
            assert sock.connect_ex((address, port)) != 0, f"the app answers on {address}, not only on loopback"
    for url in (server.url("/", token=False), f"{server.base_url}/?token=wrong-{server.token}",
                server.url("/api/kernels", token=False)):
        status, location, body = http_get(url)
        refused = status in (401, 403) or (status in (301, 302, 303, 307) and "/login" in (location or ""))
        assert refused, f"{url.replace(server.token, '<token>')} answered {status} {location}"
        assert "jp-OutputArea" not in body and Path(notebook).stem not in body  # nothing of the lesson leaks


@pytest.mark.timeout(LOAD_TIMEOUT_S + 3 * MOVE_TIMEOUT_S + 60)
def test_the_app_renders_the_lesson_and_every_slider_redraws_its_chart(app):
    server, start, notebook, link = app
    with start() as playwright:
        browser = launch_chromium(playwright)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            console = Console(page, server.base_url)
            page.goto(link, timeout=LOAD_TIMEOUT_S * 1000)
            page.get_by_role("heading", name=first_heading(notebook)).first.wait_for(timeout=LOAD_TIMEOUT_S * 1000)
            page.wait_for_selector(".widget-slider .noUi-handle", timeout=LOAD_TIMEOUT_S * 1000)
            page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length > 0",
                                   timeout=LOAD_TIMEOUT_S * 1000)
            wait_for_widgets(page)  # every chart drawn, the counts steady
            assert page_errors(page) == [] and "There was an error" not in page.inner_text("body")
            console.check("once the page had loaded")
            # Every slider: a chart created together with others on a cold page is where updates
            # were lost (plotly's FigureWidget under anywidget's 2 s deadline; see views.LiveFigure).
            # as a learner: the estimate first, which shows the charts it held back (views.after_estimate)
            commit_predictions(page, MOVE_TIMEOUT_S)
            wait_for_widgets(page)
            assert page.locator(".labkit-show-anyway").count() == 0, "a chart still held back after the estimate"
            moves = [move_slider(page, slider, MOVE_TIMEOUT_S) for slider in page.locator(".widget-slider").all()]
            try:
                assert moves and all(m["charts"] >= 1 and m["from"] != m["to"] for m in moves), moves
                stuck = [m for m in moves if m["unchanged"] or m["count_changed"]]
                assert not stuck, f"a slider move left its chart as it was: {stuck}"
                assert page_errors(page) == [] and "There was an error" not in page.inner_text("body")
                console.check("after every slider moved")
            finally:
                full_screenshot(page, SCREENSHOTS / f"app-{Path(notebook).stem}.png")
        finally:
            browser.close()


@pytest.mark.parametrize("nb, why", [("notebooks/99_no_such_lesson.ipynb", "no such notebook"),
                                     ("README.md", "is not a notebook (.ipynb)"), ("", "is not a notebook (.ipynb)")])
def test_make_app_refuses_what_is_not_a_lesson_in_one_line(nb, why):
    """Voilà itself answered a missing notebook with a traceback and served README.md as a page."""
    import subprocess
    done = subprocess.run(["make", "--no-print-directory", "-o", "venv", "app", f"NB={nb}", f"PORT={free_port()}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    error = [line for line in done.stderr.splitlines() if not re.match(r"make(\[\d+\])?: \*\*\*", line)]  # under make test: make[1]
    assert len(error) == 1 and error[0].startswith(f"app: error: NB={nb}") and why in error[0], done.stderr
    assert "notebooks/01_two_phases.ipynb" in error[0]  # it names the lessons there are


def test_make_app_refuses_a_port_in_use_before_printing_a_link():
    """Voilà, with port_retries=0, stopped inside its log after the recipe printed its link."""
    import socket
    import subprocess
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = subprocess.run(["make", "--no-print-directory", "-o", "venv", "app", f"PORT={port}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines()[0] == (f"app: error: port {port} on 127.0.0.1 is in use (another server?); choose "
                                           f"another, e.g. make app PORT={port + 1}")
