"""`make lab` as a learner runs it: the link it prints opens lesson 01 (`make app`'s printed link:
tests/test_app.py, which opens the default lesson through it).

Jupyter's own URL line hides the token, so the line the target prints is the only link a learner
can click. Each target is started with `make -o venv <target> PORT=<free port>` (`-o venv`: never
reinstall the venv from inside a test) in the repository root, in its own process group, with no
DISPLAY (so --no-browser) and Jupyter's config, data, runtime and settings directories under a
temporary HOME. The link is read from the target's stdout and opened exactly as printed in
headless Chromium.

JupyterLab: lesson 01 is the open document (its heading shows, no "Could not find path"
dialog), its kernel is idle and was started in notebooks/ (the lessons read ../data), and the
file browser's root lists the repository.
"""
from __future__ import annotations

import contextlib
import json
import re
import shutil
import time
from pathlib import Path

import pytest

from browser_util import (LAB_SETTINGS, ROOT, SCREENSHOTS, Server, free_port, full_screenshot, isolated_env,
                          launch_chromium, page_errors, printed_link, sync_playwright)

pytestmark = [pytest.mark.browser, pytest.mark.slow]

LESSON = "notebooks/01_two_phases.ipynb"
LAB_TIMEOUT_S = 120  # JupyterLab's page and a kernel start, on 2 busy cores


def lesson_heading() -> str:
    """The first markdown heading of lesson 01: what a learner sees at the top of the lesson."""
    cells = json.loads((ROOT / LESSON).read_text())["cells"]
    for cell in cells:
        if cell["cell_type"] == "markdown":
            match = re.search(r"^#+\s+(.+)$", "".join(cell["source"]), re.M)
            if match:
                return match.group(1).strip()
    pytest.fail(f"{LESSON} has no markdown heading")


# ------------------------------------------------------------------ the make targets
def target_env(home: Path) -> dict:
    """isolated_env plus a fresh HOME, no DISPLAY and no JUPYTER_TOKEN (the target makes one),
    and a JupyterLab setting that never writes the lesson back. Not the news settings the other
    browser tests write: here the venv's defaults (`make venv`, LAB_DEFAULTS) must keep news away."""
    settings, env = home / "lab-settings", isolated_env(home, home / "labkit-cache")
    for name, values in LAB_SETTINGS.items():
        if name.startswith("@jupyterlab/apputils-extension/notification"):
            continue
        (settings / name).parent.mkdir(parents=True, exist_ok=True)
        (settings / name).write_text(json.dumps(values))
    # Opening a notebook checkpoints it: keep that out of notebooks/ (read from JUPYTER_CONFIG_DIR).
    (home / "config").mkdir(parents=True, exist_ok=True)
    (home / "config" / "jupyter_server_config.json").write_text(
        json.dumps({"FileCheckpoints": {"checkpoint_dir": str(home / "checkpoints")}}))
    env.update(HOME=str(home), JUPYTER_DATA_DIR=str(home / "data"), JUPYTERLAB_SETTINGS_DIR=str(settings),
               JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"))
    env.pop("DISPLAY", None)
    return env


def start_target(target: str, home: Path) -> tuple[Server, int]:
    """`make <target>` on a free port, its output logged; the caller stops it."""
    if shutil.which("make") is None:
        pytest.fail(f"make is not installed; `make {target}` is how a learner starts the lab")
    port = free_port()
    argv = ["make", "--no-print-directory", "-o", "venv", "-o", ".venv/.stamp", target, f"PORT={port}"]
    # The token is unknown until the target prints its link (printed_link sets it).
    return Server(argv, target_env(home), home / f"make-{target}.log", f"http://127.0.0.1:{port}", ""), port


@pytest.fixture
def lab_server(tmp_path):
    """`make lab`: the server and the link it printed; its process group always stopped."""
    server, port = start_target("lab", tmp_path)
    try:
        link = printed_link(server, "JupyterLab", port)
        server.wait_until_up("/api/status")
        yield server, link
    finally:
        server.stop()


# ------------------------------------------------------------------ JupyterLab, read from the page
# The open document's tab label and its notebook's first heading, or the text of any dialog.
LAB_STATE_JS = """() => {
  const tab = document.querySelector('#jp-main-dock-panel .lm-TabBar-tab.lm-mod-current .lm-TabBar-tabLabel');
  const panel = document.querySelector('#jp-main-dock-panel .jp-NotebookPanel:not(.lm-mod-hidden)');
  const heading = panel && panel.querySelector('.jp-MarkdownOutput h1, .jp-MarkdownOutput h2');
  const status = panel && panel.querySelector('.jp-Notebook-ExecutionIndicator');
  return {tab: tab && tab.textContent, heading: heading && heading.textContent.replace(/¶$/, '').trim(),
          kernel: status && status.getAttribute('data-status'),
          dialogs: [...document.querySelectorAll('.jp-Dialog')].map(d => d.innerText)};
}"""

LISTING_JS = """() => [...document.querySelectorAll('.jp-FileBrowser .jp-DirListing-item .jp-DirListing-itemText')]
                       .map(e => e.textContent.trim())"""


def wait_for(page, predicate, timeout_s: float, what: str, server: Server):
    """Poll LAB_STATE_JS until `predicate(state)` or a dialog shows; return the last state."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = page.evaluate(LAB_STATE_JS)
        if predicate(state) or state["dialogs"]:
            return state
        if time.monotonic() > deadline:
            pytest.fail(f"{what} after {timeout_s:.0f} s; the page shows {state}\n{server.log_tail()}")
        page.wait_for_timeout(250)


def kernel_cwd(kernel_id: str) -> str | None:
    """The working directory of the kernel process whose connection file names `kernel_id`."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if f"kernel-{kernel_id}.json" in cmdline.read_bytes().decode(errors="replace"):
                return str(Path(cmdline.parent, "cwd").resolve(strict=True))
        except OSError:  # the process ended, or is not ours to read
            continue
    return None


def check_kernel(server: Server, timeout_s: float = 60):
    """One session, for lesson 01, its kernel idle and started in notebooks/ (the lessons read ../data).
    Polled: the page's indicator can read idle a moment before the server lists the session."""
    deadline = time.monotonic() + timeout_s
    while True:
        sessions = server.api("GET", "/api/sessions")
        ready = len(sessions) == 1 and sessions[0]["kernel"]["execution_state"] == "idle"
        if ready or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert [s["path"] for s in sessions] == [LESSON], sessions
    kernel = sessions[0]["kernel"]
    assert kernel["execution_state"] == "idle", kernel
    if Path("/proc/self/cwd").exists():
        assert kernel_cwd(kernel["id"]) == str(ROOT / "notebooks")


def check_file_browser(page, server: Server):
    """From the file browser's root (its home crumb), the repository is listed."""
    page.locator(".jp-FileBrowser .jp-BreadCrumbs-home").click()
    wanted = {"labkit", "notebooks", "README.md"}
    try:
        page.wait_for_function(f"() => {json.dumps(sorted(wanted))}.every(n => ({LISTING_JS})().includes(n))",
                               timeout=30_000, polling=250)
    except Exception:  # noqa: BLE001 — reported below with what the browser lists
        pass
    listed = page.evaluate(LISTING_JS)
    assert wanted <= set(listed), f"the file browser's root lists {listed}, not the repository"


# ------------------------------------------------------------------ the tests
@contextlib.contextmanager
def opened(link: str, timeout_s: float, screenshot: str):
    """A Chromium page on `link`, as a learner opens it; a screenshot of it afterwards, pass or
    fail, and the browser always closed."""
    with sync_playwright()() as playwright:
        browser = launch_chromium(playwright)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(link, timeout=timeout_s * 1000)
            try:
                yield page
            finally:
                full_screenshot(page, SCREENSHOTS / screenshot)
        finally:
            browser.close()


@pytest.mark.timeout(LAB_TIMEOUT_S * 2 + 120)
def test_make_lab_prints_a_link_that_opens_lesson_01_in_the_repository(lab_server):
    server, link = lab_server
    original = (ROOT / LESSON).read_bytes()
    heading = lesson_heading()
    with opened(link, LAB_TIMEOUT_S, "make-lab.png") as page:
        state = wait_for(page, lambda s: s["heading"] == heading, LAB_TIMEOUT_S,
                         f"no notebook showing '{heading}'", server)
        assert not state["dialogs"], f"JupyterLab shows a dialog: {state['dialogs']}"
        assert state["tab"] == Path(LESSON).name, state
        state = wait_for(page, lambda s: s["kernel"] == "idle", LAB_TIMEOUT_S, "no idle kernel", server)
        assert not state["dialogs"], f"JupyterLab shows a dialog: {state['dialogs']}"
        check_kernel(server)
        check_file_browser(page, server)
        assert page_errors(page) == []
        news = page.locator("text=/Jupyter news/i")
        assert news.count() == 0, f"JupyterLab asks about news over the lesson: {news.all_inner_texts()}"
    assert (ROOT / LESSON).read_bytes() == original, f"opening {LESSON} wrote it back"
