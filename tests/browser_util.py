"""Helpers for the real-browser tests: start and stop a loopback server with a token, launch
Debian's Chromium through Playwright, and read what a page shows (plotly data, error lines).

Playwright's own browser download is not reachable here, so the tests launch /usr/bin/chromium.
Without it (or without Playwright) they skip with the reason; with CI=true they fail instead,
so CI can never pass by skipping.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = ROOT / ".venv" / "bin"
CHROMIUM = "/usr/bin/chromium"
# No sandbox (we may be root), no GPU, and nothing that reaches out to the network.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
SCREENSHOTS = ROOT / "build" / "screenshots"


# ------------------------------------------------------------------ skip or fail
def unavailable(reason: str):
    """Skip with `reason`, or fail with it when CI=true (CI must run the browser tests)."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: browser tests may not be skipped)", pytrace=False)
    pytest.skip(reason)


def sync_playwright():
    """Playwright's sync entry point, after checking that Chromium and Playwright are here."""
    if not os.access(CHROMIUM, os.X_OK):
        unavailable(f"no Chromium at {CHROMIUM} (as root: apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright as start
    except ImportError as err:
        unavailable(f"Playwright is not installed ({err})")
    return start


def launch_chromium(playwright):
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)


# ------------------------------------------------------------------ servers
def free_port() -> int:
    """A port nothing listens on now. Servers get port_retries=0, so a race fails loudly."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def new_token() -> str:
    return secrets.token_urlsafe(24)


class Server:
    """A server process in its own process group, logging to `log`; `stop` ends the group."""

    def __init__(self, argv: list[str], env: dict, log: Path, base_url: str, token: str):
        self.base_url, self.token, self.log, self.env = base_url, token, log, env
        self._log_file = open(log, "w")
        self.process = subprocess.Popen(_dying_with_us(argv), env=env, cwd=ROOT, stdout=self._log_file,
                                        stderr=subprocess.STDOUT, start_new_session=True)

    def wait_until_up(self, path: str, token: bool = True, answered=lambda status: status == 200,
                      timeout_s: float = 120):
        """Poll `path` until its status satisfies `answered`; fail with the log's tail if not."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if answered(http_get(self.url(path, token))[0]):
                    return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.3)
        pytest.fail(f"server not up after {timeout_s:.0f} s:\n{self.log_tail()}")

    def url(self, path: str, token: bool = True) -> str:
        sep = "&" if "?" in path else "?"
        return f"{self.base_url}{path}{sep}token={self.token}" if token else f"{self.base_url}{path}"

    def api(self, method: str, path: str, body: dict | None = None):
        """A JSON REST call authenticated by the token header (no XSRF cookie needed)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.base_url}{path}", data=data, method=method,
                                         headers={"Authorization": f"token {self.token}",
                                                  "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            text = answer.read().decode()
        return json.loads(text) if text else None

    def log_tail(self, chars: int = 4000) -> str:
        if not self._log_file.closed:
            self._log_file.flush()
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self):
        """SIGTERM the whole process group (server and its kernels), SIGKILL after 10 s."""
        if self.process.poll() is None:
            _signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(self.process.pid, signal.SIGKILL)  # kernels may outlive the server
        if self.process.poll() is None:
            self.process.wait(10)
        self._log_file.close()


def printed_link(server: Server, label: str, port: int, timeout_s: float = 60) -> str:
    """The `<label>: URL` line the target printed; checks that it is a loopback URL on `port`
    with a token, and gives the server that token."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = re.search(rf"^{label}: (\S+)$", server.log_tail(100_000), re.M)
        if match:
            break
        if server.process.poll() is not None:
            pytest.fail(f"make exited with {server.process.returncode} before printing its link:\n"
                        f"{server.log_tail()}")
        time.sleep(0.2)
    else:
        pytest.fail(f"no '{label}: URL' line after {timeout_s:.0f} s:\n{server.log_tail()}")
    link = match.group(1)
    parts = urlsplit(link)
    token = parse_qs(parts.query).get("token", [""])[0]
    assert (parts.scheme, parts.hostname, parts.port) == ("http", "127.0.0.1", port), link
    assert token, f"the printed link has no token: {link}"
    server.token = token
    return link


def http_get(url: str, timeout_s: float = 60) -> tuple[int, str | None, str]:
    """(status, Location header, body) of one GET; redirects are reported, not followed."""
    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    try:
        with urllib.request.build_opener(NoRedirect).open(url, timeout=timeout_s) as answer:
            return answer.status, answer.headers.get("Location"), answer.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("Location"), err.read().decode(errors="replace")


def _dying_with_us(argv: list[str]) -> list[str]:
    """`argv` run so that it gets SIGTERM if this test process dies without stopping it (killed
    by `timeout`, say): otherwise the server, in its own session, would outlive the test."""
    setpriv = shutil.which("setpriv")  # util-linux; elsewhere the fixture's `finally` has to do
    return [setpriv, "--pdeathsig", "TERM", "--", *argv] if setpriv else argv


def _signal_group(pgid: int, sig):
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def isolated_env(home: Path, cache_dir: Path) -> dict:
    """The server's environment: quick notebooks, a fresh labkit cache, the learner's kept estimates,
    and Jupyter's config, data and runtime directories under `home` so nothing reads or writes the user's."""
    env = dict(os.environ, LABKIT_QUICK="1", LABKIT_CACHE_DIR=str(cache_dir), LABKIT_DATA_DIR=str(home / "labkit-data"),
               JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_RUNTIME_DIR=str(home / "runtime"),
               IPYTHONDIR=str(home / "ipython"), PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("JUPYTER_TOKEN", None)  # the token is given on the command line
    return env


# JupyterLab user settings for a test run: never write a notebook back (autosave would put
# outputs into notebooks/*.ipynb), and no news or update checks (no network, no pop-up).
LAB_SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                        "checkForUpdates": False},
}


def start_jupyter_lab(home: Path) -> Server:
    """JupyterLab on 127.0.0.1 with a random token, rooted at the repository, its app exposed
    as window.jupyterapp so a test can run its commands."""
    home.mkdir(parents=True, exist_ok=True)
    settings = home / "lab-settings"
    for name, values in LAB_SETTINGS.items():
        (settings / name).parent.mkdir(parents=True, exist_ok=True)
        (settings / name).write_text(json.dumps(values))
    port, token = free_port(), new_token()
    argv = [str(VENV_BIN / "jupyter"), "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
            "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={ROOT}",
            "--LabApp.expose_app_in_browser=True", f"--LabApp.user_settings_dir={settings}",
            f"--LabApp.workspaces_dir={home / 'workspaces'}",
            # JupyterLab checkpoints a notebook when it opens it: keep those out of notebooks/.
            f"--FileCheckpoints.checkpoint_dir={home / 'checkpoints'}"]
    if os.geteuid() == 0:
        argv.append("--allow-root")
    server = Server(argv, isolated_env(home, home / "labkit-cache"), home / "jupyter-lab.log",
                    f"http://127.0.0.1:{port}", token)
    try:
        server.wait_until_up("/api/status")
    except BaseException:
        server.stop()
        raise
    return server


def venv_has(tool: str) -> bool:
    return (VENV_BIN / tool).exists() or shutil.which(tool) is not None


# ------------------------------------------------------------------ reading a page
# Every plotly chart under `root`, serialised: typed arrays become objects, which still compare.
_SERIALISE_JS = "g => JSON.stringify({data: g.data || null, title: g.layout && g.layout.title || null})"
PLOT_DATA_JS = f"root => [...root.querySelectorAll('.js-plotly-plot')].map({_SERIALISE_JS})"

# True once every chart under `cell` differs from `before`, or an error line appeared there.
CHANGED_JS = f"""([cell, before]) => {{
  const now = [...cell.querySelectorAll('.js-plotly-plot')].map({_SERIALISE_JS});
  const error = [...cell.querySelectorAll('.widget-html-content')].some(e => e.textContent.includes('\\u26a0'));
  return error || (now.length === before.length && now.every((d, i) => d !== before[i]));
}}"""

# What would tell a learner something broke: a traceback or an error name in any output, and
# the red line `views.ErrorLine` draws under a widget.
ERRORS_JS = """root => {
  const found = [];
  for (const el of root.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')) {
    if (/Traceback|Error\\b/.test(el.textContent)) found.push('stderr: ' + el.textContent.slice(0, 600));
  }
  for (const el of root.querySelectorAll('.jp-RenderedText')) {
    if (/Traceback|\\w*Error\\b/.test(el.textContent)) found.push('output: ' + el.textContent.slice(0, 600));
  }
  for (const el of root.querySelectorAll('.widget-html-content, .widget-html')) {
    if (el.textContent.includes('\\u26a0')) found.push('error line: ' + el.textContent.slice(0, 300));
  }
  return [...new Set(found)];
}"""


def plot_data(page, root_handle=None) -> list[str]:
    """Serialised data of each plotly chart in the page (or under an element handle)."""
    if root_handle is None:
        return page.evaluate(f"({PLOT_DATA_JS})(document)")
    return root_handle.evaluate(PLOT_DATA_JS)


def page_errors(page) -> list[str]:
    return page.evaluate(f"({ERRORS_JS})(document)")


# Counts that stop changing once every widget view and every chart has rendered (plotly's
# renderer loads plotly.js the first time it draws).
RENDERED_JS = """() => [document.querySelectorAll('.js-plotly-plot').length,
  [...document.querySelectorAll('.js-plotly-plot')].filter(g => g._fullLayout).length,
  document.querySelectorAll('.widget-slider').length, document.querySelectorAll('.jupyter-widgets').length]"""


def wait_for_widgets(page, timeout_s: float = 60):
    """Until the rendered charts, sliders and widgets stop changing for 1 s, with every chart drawn."""
    deadline, last, stable_since = time.monotonic() + timeout_s, None, time.monotonic()
    while time.monotonic() < deadline:
        counts = page.evaluate(RENDERED_JS)
        if counts != last:
            last, stable_since = counts, time.monotonic()
        elif counts[0] == counts[1] and time.monotonic() - stable_since >= 1:
            return counts
        page.wait_for_timeout(250)
    return last


def move_slider(page, slider, timeout_s: float, settle=None) -> dict:
    """Move one ipywidgets slider a step with the keyboard on its noUiSlider handle (ArrowRight,
    or ArrowLeft at the maximum; with continuous_update=False the value is sent on the change
    event, as on a mouse release), wait until every chart in the same cell (or output area) has
    changed, then call `settle()`; report the move and which charts stayed as they were."""
    handle = slider.locator(".noUi-handle").first
    label = (slider.locator(".widget-label").first.text_content() or "").strip() or "?"
    value, high = (float(handle.get_attribute(a)) for a in ("aria-valuenow", "aria-valuemax"))
    cell = slider.element_handle().evaluate_handle(
        "el => el.closest('.jp-Cell') || el.closest('.jp-OutputArea') || document.body")
    before = plot_data(page, cell)
    handle.press("ArrowLeft" if value >= high else "ArrowRight")
    try:
        page.wait_for_function(CHANGED_JS, arg=[cell, before], timeout=timeout_s * 1000, polling=250)
    except Exception:  # noqa: BLE001 — a timeout is reported below, as charts that did not change
        pass
    if settle is not None:
        settle()
    after = plot_data(page, cell)
    unchanged = [i for i, (b, a) in enumerate(zip(before, after)) if a == b]
    return {"slider": label, "from": value, "to": float(handle.get_attribute("aria-valuenow")),
            "charts": len(after), "unchanged": unchanged, "count_changed": len(before) != len(after)}


# The element that scrolls the page's content: the one with the most hidden height whose
# overflow scrolls (JupyterLab's notebook and Voilà's page both scroll inside a div).
_SCROLLER_JS = """() => {
  let best = document.scrollingElement, hidden = best.scrollHeight - best.clientHeight;
  for (const el of document.querySelectorAll('*')) {
    const overflow = getComputedStyle(el).overflowY;
    if ((overflow === 'auto' || overflow === 'scroll') && el.scrollHeight - el.clientHeight > hidden) {
      best = el; hidden = el.scrollHeight - el.clientHeight;
    }
  }
  window.__labkitScroller = best;
  return hidden;
}"""


def full_screenshot(page, path: Path, width: int = 1400, max_height: int = 16000):
    """A screenshot of the whole content: the viewport is made as tall as the scrolling element's
    content (JupyterLab and Voilà scroll inside a div, so full_page alone shows one screen)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    before = page.viewport_size
    hidden = page.evaluate(_SCROLLER_JS)
    page.set_viewport_size({"width": width, "height": min(max_height, before["height"] + max(0, hidden))})
    page.evaluate("() => { window.__labkitScroller.scrollTop = 0; }")
    page.wait_for_timeout(1000)  # let plotly redraw at the new size
    page.screenshot(path=str(path), full_page=True)
    page.set_viewport_size(before)


def commit_predictions(page, timeout_s: float) -> list[str]:
    """Answer every "Predict first" widget as a learner would — type a number, or pick the first
    option — click its button, and wait for the reveal; return each reveal's text."""
    reveals = []
    for box in page.locator(".labkit-predict").all():
        box.scroll_into_view_if_needed()
        text_input = box.locator("input[type=text]")
        if text_input.count():
            text_input.first.fill("3")
            text_input.first.press("Tab")  # ipywidgets' Text sends its value on change
        else:
            box.locator("input[type=radio]").first.check()
        box.locator("button").first.click()
        box.locator("text=your estimate").first.wait_for(timeout=timeout_s * 1000)
        reveals.append(box.inner_text())
    return reveals
