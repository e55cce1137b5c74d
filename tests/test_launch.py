"""labkit.launch: `make lab`'s one implementation, and what a learner without make (Windows) runs.

The command line and the environment are checked directly (exec is replaced by a recorder);
then the launcher is started for real on a free port, with no DISPLAY and Jupyter's directories
under a temporary HOME, and its printed link's token opens the server's API (and nothing opens
without it). tests/test_make_lab.py opens `make lab`'s link in a browser (slow; CI runs it).
"""
from __future__ import annotations

import re
import sys
import json
import os
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from browser_util import ROOT, Server, free_port, http_get, isolated_env
from labkit import launch


class Exec(BaseException):
    """Stands for os.execve, which never returns."""


@pytest.fixture
def recorded(monkeypatch):
    """main() with exec and spawn replaced: the argv and environment JupyterLab would get."""
    calls = []

    def execve(path, argv, env):
        calls.append((argv, env))
        raise Exec

    monkeypatch.setattr(launch.os, "execve", execve)
    monkeypatch.setattr(launch.subprocess, "call", lambda argv, env: calls.append((argv, env)) or 0)
    monkeypatch.setattr(launch, "port_in_use", lambda port: False)  # the fixed ports below, whatever holds them
    monkeypatch.setattr(launch, "install_lab_defaults", lambda prefix: calls.append(("defaults", prefix)) and None)
    return calls


def run(args):
    """launch.main(args), through the stand-in exec on POSIX."""
    try:
        return launch.main(args)
    except Exec:
        return None


def test_loopback_a_fixed_port_the_repository_as_root_and_the_lesson(recorded, monkeypatch, capsys):
    monkeypatch.delenv("JUPYTER_TOKEN", raising=False)
    monkeypatch.setattr(launch, "can_open_browser", lambda: False)
    monkeypatch.setattr(launch, "is_root", lambda: False)
    run(["--port", "8899"])
    defaults, (argv, env) = recorded
    assert defaults == ("defaults", Path(sys.prefix)) and launch.ENVIRONMENT == Path(sys.prefix), "this Python's environment gets the lab's JupyterLab defaults first"
    assert argv[:3] == [sys.executable, "-m", "jupyterlab"]
    assert argv[3:] == ["--ip=127.0.0.1", "--port=8899", "--ServerApp.port_retries=0", "--no-browser",
                        f"--ServerApp.root_dir={ROOT}", "notebooks/01_two_phases.ipynb"]
    printed = capsys.readouterr().out.strip()
    assert printed == f"JupyterLab: http://127.0.0.1:8899/lab/tree/notebooks/01_two_phases.ipynb?token={env['JUPYTER_TOKEN']}"
    assert len(env["JUPYTER_TOKEN"]) >= 32, "a fresh token, in the environment (never on the command line)"
    assert not any(env["JUPYTER_TOKEN"] in arg for arg in argv)


def test_the_callers_token_is_kept_and_a_fresh_one_is_new_each_time(monkeypatch):
    monkeypatch.setenv("JUPYTER_TOKEN", "mine")
    assert launch.token() == "mine"
    monkeypatch.setenv("JUPYTER_TOKEN", "")  # empty would let anyone in: a fresh one instead
    first, second = launch.token(), launch.token()
    assert first and second and first != second


@pytest.mark.parametrize("platform, env, opens", [
    ("linux", {}, False), ("linux", {"DISPLAY": ":0"}, True), ("linux", {"WAYLAND_DISPLAY": "wayland-0"}, True),
    ("darwin", {}, True), ("win32", {}, True)])
def test_a_browser_opens_only_where_there_is_a_desktop(platform, env, opens):
    assert launch.can_open_browser(platform, env) is opens


def test_as_root_it_allows_root_and_with_a_display_it_opens_the_lesson(recorded, monkeypatch):
    monkeypatch.setattr(launch, "can_open_browser", lambda: True)
    monkeypatch.setattr(launch, "is_root", lambda: True)
    run([])
    _, (argv, _) = recorded
    assert "--allow-root" in argv and "--no-browser" not in argv and "--port=8888" in argv


def test_windows_waits_for_jupyterlab_instead_of_exec(recorded, monkeypatch):
    monkeypatch.setattr(launch.os, "name", "nt")
    assert launch.main(["--port", "8890"]) == 0 and len(recorded) == 2


def test_a_missing_lesson_opens_the_file_browser(recorded, capsys):
    run(["--notebook", "notebooks/99_missing.ipynb"])
    _, (argv, _) = recorded
    out = capsys.readouterr().out
    assert "lab: notebooks/99_missing.ipynb not written yet; opening the file browser" in out
    assert re.search(r"^JupyterLab: http://127\.0\.0\.1:8888/lab/tree/\?token=\S+$", out, re.M)
    assert argv[-1].startswith("--ServerApp.root_dir="), "no notebook path passed"


@pytest.mark.parametrize("args", [["--port", "0"], ["--port", "http"], ["--frobnicate"]])
def test_bad_arguments_are_one_line_and_exit_2(args, recorded, capsys):
    assert run(args) == 2 and not recorded
    err = capsys.readouterr().err
    assert err.startswith("launch: error: ") and len(err.strip().splitlines()) == 1


def test_a_port_in_use_is_refused_before_any_link_is_printed(recorded, monkeypatch, capsys):
    """JupyterLab stopped on a busy port inside its start-up log, after the link (to whatever held
    the port) was printed."""
    import socket
    monkeypatch.undo()  # the real port check
    monkeypatch.setattr(launch.os, "execve", lambda *a: pytest.fail("started JupyterLab on a busy port"))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        assert launch.main(["--port", str(port)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (f"launch: error: port {port} on 127.0.0.1 is in use (another JupyterLab?); choose "
                                 f"another, e.g. make lab PORT={port + 1} or --port {port + 1}\n")
    assert not launch.port_in_use(port)  # once it is let go


def test_the_lab_defaults_go_into_an_environment_that_lacks_them_and_stay_where_they_are(tmp_path):
    target = tmp_path / launch.LAB_DEFAULTS
    assert launch.install_lab_defaults(tmp_path) is None
    assert target.read_bytes() == (ROOT / launch.LAB_DEFAULTS).read_bytes()
    assert "fetchNews" in json.loads(target.read_text())["@jupyterlab/apputils-extension:notification"]
    os.utime(target, (1, 1))
    assert launch.install_lab_defaults(tmp_path) is None and target.stat().st_mtime == 1, "an identical copy is left alone"
    target.write_text("{}")
    assert launch.install_lab_defaults(tmp_path) is None and target.read_bytes() == (ROOT / launch.LAB_DEFAULTS).read_bytes()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes through a read-only folder")
def test_a_read_only_environment_gets_a_one_line_note_and_the_lab_still_starts(tmp_path, recorded, monkeypatch, capsys):
    monkeypatch.undo()
    recorded.clear()
    monkeypatch.setattr(launch.os, "execve", lambda path, argv, env: recorded.append(argv) or (_ for _ in ()).throw(Exec))
    monkeypatch.setattr(launch, "port_in_use", lambda port: False)
    monkeypatch.setattr(launch, "ENVIRONMENT", tmp_path)
    tmp_path.chmod(0o555)
    try:
        run([])
    finally:
        tmp_path.chmod(0o755)
    err = capsys.readouterr().err
    assert recorded and err.startswith("launch: note: could not put the lab's JupyterLab defaults in ")
    assert len(err.strip().splitlines()) == 1


def test_a_read_only_environment_is_named_not_raised(tmp_path, monkeypatch):
    """The same as root (CI): the copy's failure is what install_lab_defaults returns."""
    def refuse(source, target):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(launch.shutil, "copyfile", refuse)
    problem = launch.install_lab_defaults(tmp_path)
    assert problem == (f"could not put the lab's JupyterLab defaults in {tmp_path / launch.LAB_DEFAULTS}".rsplit("/", 1)[0]
                       + " (Permission denied)")


@pytest.mark.slow
def test_the_printed_link_opens_the_server_and_nothing_else_does(tmp_path):
    port = free_port()
    env = isolated_env(tmp_path, tmp_path / "labkit-cache")
    env.update(HOME=str(tmp_path), JUPYTER_DATA_DIR=str(tmp_path / "data"))
    for name in ("DISPLAY", "WAYLAND_DISPLAY"):
        env.pop(name, None)
    server = Server([sys.executable, "-m", "labkit.launch", "--port", str(port)], env, tmp_path / "launch.log",
                    f"http://127.0.0.1:{port}", "")
    try:
        server.wait_until_up("/api/status", token=False, answered=lambda status: status in (200, 403), timeout_s=90)
        link = re.search(r"^JupyterLab: (\S+)$", server.log_tail(100_000), re.M).group(1)
        parts = urlsplit(link)
        assert (parts.hostname, parts.port, parts.path) == ("127.0.0.1", port, "/lab/tree/notebooks/01_two_phases.ipynb")
        server.token = parse_qs(parts.query)["token"][0]
        assert http_get(server.url("/api/status"))[0] == 200
        assert http_get(server.url("/api/status", token=False))[0] == 403
        status, _, body = http_get(server.url("/api/contents/notebooks/01_two_phases.ipynb?content=0"))
        assert status == 200 and '"type": "notebook"' in body.replace('":"', '": "'), "root_dir is the repository"
        status, _, body = http_get(server.url("/lab/api/settings/@jupyterlab/apputils-extension:notification"))
        defaults = {name: field["default"] for name, field in json.loads(body)["schema"]["properties"].items()}
        assert status == 200 and defaults["fetchNews"] == "false", \
            "JupyterLab serves the lab's defaults: no news prompt over the lesson"
        status, _, body = http_get(server.url("/lab/api/settings/@jupyterlab/notebook-extension:tracker"))
        assert status == 200 and json.loads(body)["schema"]["properties"]["kernelShutdown"]["default"] is True, \
            "closing a lesson's tab shuts its kernel down"
    finally:
        server.stop()


def test_install_defaults_only_puts_both_files_and_starts_nothing(tmp_path, monkeypatch, capsys):
    """A hub's shared environment: its owner runs `python -m labkit.launch --install-defaults`."""
    monkeypatch.setattr(launch, "ENVIRONMENT", tmp_path)
    monkeypatch.setattr(launch.os, "execve", lambda *a: pytest.fail("started JupyterLab"))
    monkeypatch.setattr(launch.subprocess, "call", lambda *a, **k: pytest.fail("started JupyterLab"))
    assert launch.main(["--install-defaults"]) == 0
    for name in (launch.LAB_DEFAULTS, launch.SERVER_DEFAULTS):
        assert (tmp_path / name).read_bytes() == (ROOT / name).read_bytes()
    out, err = capsys.readouterr()
    assert out == f"launch: the lab's JupyterLab defaults are in {tmp_path} ({launch.LAB_DEFAULTS}, {launch.SERVER_DEFAULTS})\n"
    assert err == ""


def test_install_defaults_only_into_a_read_only_environment_is_one_line_and_exit_1(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(launch, "ENVIRONMENT", tmp_path)
    monkeypatch.setattr(launch.shutil, "copyfile", lambda s, t: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
    assert launch.main(["--install-defaults"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("launch: error: could not put the lab's JupyterLab defaults in ") and "Permission denied" in err
    assert len(err.strip().splitlines()) == 1
