"""Start JupyterLab on lesson 01: loopback only, always with a token. `make lab` runs this, and
so does a learner without make (Windows), from the repository root:

    python -m labkit.launch [--port 8888] [--notebook notebooks/01_two_phases.ipynb]
    python -m labkit.launch --install-defaults   # only the defaults below, into this Python's environment

It prints one line, `JupyterLab: http://127.0.0.1:8888/lab/tree/notebooks/01_two_phases.ipynb?token=…`
(Jupyter's own URL line hides the token, so this is the link to open), then becomes JupyterLab:

  * --ip=127.0.0.1: nothing beyond this machine can connect;
  * the token is the caller's JUPYTER_TOKEN, else a fresh `secrets.token_urlsafe(24)`, passed in
    the environment, so it stays out of `ps`;
  * --ServerApp.port_retries=0: a busy port fails, rather than serving on another port than the
    link printed;
  * --ServerApp.root_dir is the repository: with a notebook path alone its folder (notebooks/)
    would be the root, and the printed /lab/tree/notebooks/... link "Could not find path". The
    path is still passed, so that where a browser can open, it opens the lesson. Kernels start in
    the notebook's folder (notebooks/) either way;
  * the lab's JupyterLab defaults (LAB_DEFAULTS: no prompt over the lesson asking to fetch
    Jupyter's news, no check for newer releases, a closed lesson's tab shuts its kernel down) and
    its server config (SERVER_DEFAULTS: a lesson only read closes without "Save your work?") are
    copied into this Python's environment first, where they are missing or older: `make venv`
    copies them too, but a learner without make has no other step that would;
  * --no-browser where no browser can open: Linux or BSD without DISPLAY or WAYLAND_DISPLAY
    (macOS and Windows always have one); --allow-root only where we are root already
    (containers, the lab's CI machines).
"""
from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from .cli_args import Parser, UsageError

ROOT = Path(__file__).resolve().parent.parent  # the repository (the lab is installed with `pip install -e .`)
LESSON = "notebooks/01_two_phases.ipynb"
DEFAULT_PORT = 8888
HOST = "127.0.0.1"
# JupyterLab reads every file in <environment>/share/jupyter/lab/settings/overrides.d as default
# settings (a learner's own settings still win); `make venv` installs both files through
# --install-defaults (the Makefile's DEFAULTS names them, to know when to).
LAB_DEFAULTS = "share/jupyter/lab/settings/overrides.d/prefill-decode-lab.json"
# ...and every file in <environment>/etc/jupyter/jupyter_server_config.d as the server's config: the
# lab's contents manager (`lab_contents`).
SERVER_DEFAULTS = "etc/jupyter/jupyter_server_config.d/prefill-decode-lab.json"
ENVIRONMENT = Path(sys.prefix)  # this Python's environment, whose JupyterLab main() starts


def token() -> str:
    """The caller's JUPYTER_TOKEN, else a fresh random one: never empty (an empty token lets anyone in)."""
    return os.environ.get("JUPYTER_TOKEN") or secrets.token_urlsafe(24)


def can_open_browser(platform: str = sys.platform, env=os.environ) -> bool:
    """macOS and Windows always have a desktop to open a browser on; elsewhere only a session with
    an X or Wayland display has one."""
    return platform in ("darwin", "win32") or bool(env.get("DISPLAY") or env.get("WAYLAND_DISPLAY"))


def is_root() -> bool:
    """Whether this process runs as root (Jupyter refuses that without --allow-root); never on Windows."""
    return hasattr(os, "geteuid") and os.geteuid() == 0


def command(port: int, notebook: str, root: Path, browser: bool, as_root: bool) -> list[str]:
    """The JupyterLab command line (this Python's `-m jupyterlab`: the venv's, on every OS)."""
    flags = [f"--ip={HOST}", f"--port={port}", "--ServerApp.port_retries=0"]
    flags += [] if browser else ["--no-browser"]
    flags += ["--allow-root"] if as_root else []
    return [sys.executable, "-m", "jupyterlab", *flags, f"--ServerApp.root_dir={root}", *([notebook] if notebook else [])]


def install_lab_defaults(prefix: Path, root: Path = ROOT) -> str | None:
    """Copy the lab's JupyterLab defaults (LAB_DEFAULTS, SERVER_DEFAULTS) into the environment at
    `prefix` (sys.prefix) unless identical copies are there (an older one is replaced, as `make venv`
    does: the files are the lab's own, and a learner's own settings, made in JupyterLab's Settings
    editor, always win over them). None when they are in place, else why they could not be (a
    read-only environment: JupyterLab then asks about Jupyter's news once, and whether to save a
    lesson only read, nothing worse)."""
    for name in (LAB_DEFAULTS, SERVER_DEFAULTS):
        source, target = root / name, prefix / name
        try:
            if target.is_file() and target.read_bytes() == source.read_bytes():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
        except OSError as err:
            return f"could not put the lab's JupyterLab defaults in {target.parent} ({err.strerror or err})"
    return None


def link(port: int, notebook: str, secret: str) -> str:
    """The URL that opens `notebook` ("" : the file browser) with the token."""
    return f"http://{HOST}:{port}/lab/tree/{notebook}?token={secret}"


def parse_args(argv=None):
    parser = Parser(prog="python -m labkit.launch", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port on {HOST} ({DEFAULT_PORT})")
    parser.add_argument("--notebook", default=LESSON, help=f"the lesson to open, relative to the repository ({LESSON})")
    parser.add_argument("--install-defaults", action="store_true",
                        help="only put the lab's JupyterLab defaults into this Python's environment, and exit "
                             "(for a hub's shared environment: run it as its owner)")
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be 1 .. 65535, got {args.port}")
    return args


def port_in_use(port: int) -> bool:
    """Whether something already listens on HOST:port. JupyterLab would print its start-up log and
    stop on it (port_retries=0), after this module had printed a link to whatever holds the port.
    SO_REUSEADDR as tornado sets it, so a port left in TIME_WAIT by a server just stopped is free."""
    with socket.socket() as probe:
        if os.name == "posix":  # on Windows the flag would let the bind succeed over a listener
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((HOST, port))
        except OSError:
            return True
    return False


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        if args.install_defaults:
            return _install_only()
        if port_in_use(args.port):
            raise UsageError(f"port {args.port} on {HOST} is in use (another JupyterLab?); choose another, "
                             f"e.g. make lab PORT={args.port + 1} or --port {args.port + 1}")
    except UsageError as err:
        print(f"launch: error: {err}", file=sys.stderr)
        return 2
    notebook = args.notebook.replace(os.sep, "/")
    if not (ROOT / notebook).is_file():
        print(f"lab: {notebook} not written yet; opening the file browser")
        notebook = ""
    problem = install_lab_defaults(ENVIRONMENT)
    if problem:
        print(f"launch: note: {problem}; JupyterLab may ask once whether to fetch Jupyter's news, and "
              "whether to save a lesson only read", file=sys.stderr)
    secret = token()
    argv = command(args.port, notebook, ROOT, can_open_browser(), is_root())
    print(f"JupyterLab: {link(args.port, notebook, secret)}", flush=True)
    env = {**os.environ, "JUPYTER_TOKEN": secret}
    try:
        if os.name == "posix":  # become JupyterLab: make's process group and Ctrl+C reach it directly
            os.execve(argv[0], argv, env)
        return subprocess.call(argv, env=env)  # Windows: os.exec* would return to the console at once
    except KeyboardInterrupt:
        return 130
    except OSError as err:
        print(f"launch: error: could not start JupyterLab: {err}", file=sys.stderr)
        return 1


def _install_only() -> int:
    """--install-defaults: the defaults into ENVIRONMENT, one line saying where, or why not (exit 1)."""
    problem = install_lab_defaults(ENVIRONMENT)
    if problem:
        print(f"launch: error: {problem}", file=sys.stderr)
        return 1
    print(f"launch: the lab's JupyterLab defaults are in {ENVIRONMENT} ({LAB_DEFAULTS}, {SERVER_DEFAULTS})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
