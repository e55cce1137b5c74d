"""`lab_contents`: the server serves a lesson with the metadata JupyterLab writes once its kernel
starts (so a lesson only read has no unsaved changes), for this Python's own kernel only, and a
failure there never keeps a notebook from opening."""
import asyncio
import json
import logging
import shutil
from pathlib import Path

import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import start_new_kernel

from labkit import lab_contents, launch

ROOT = Path(__file__).resolve().parent.parent
LESSON = ROOT / "notebooks" / "01_two_phases.ipynb"


@pytest.fixture
def lessons(tmp_path):
    """A folder with a copy of lesson 01, and the manager serving it."""
    shutil.copy(LESSON, tmp_path / LESSON.name)
    return lab_contents.LessonContentsManager(root_dir=str(tmp_path))


def served(manager, **kwargs) -> dict:
    return asyncio.run(manager.get(LESSON.name, **kwargs))


def test_a_lesson_is_served_with_what_its_running_kernel_reports():
    """The metadata filled in is what a real kernel on this Python answers, and what the kernel
    spec says, field for field (JupyterLab compares them as values)."""
    committed = json.loads(LESSON.read_text())["metadata"]
    assert "version" not in committed["language_info"], "the committed lessons name no Python"
    manager, client = start_new_kernel(kernel_name=committed["kernelspec"]["name"])
    try:
        reply = client.kernel_info(reply=True, timeout=60)["content"]
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    spec = KernelSpecManager().get_kernel_spec("python3")
    filled = lab_contents.kernel_metadata("python3", KernelSpecManager())
    assert filled == {"kernelspec": {"name": "python3", "display_name": spec.display_name, "language": "python"},
                      "language_info": reply["language_info"]}


def test_the_manager_fills_a_lesson_and_leaves_the_file_as_it_is(lessons, tmp_path):
    on_disk = (tmp_path / LESSON.name).read_bytes()
    metadata = served(lessons)["content"]["metadata"]
    assert metadata == lab_contents.kernel_metadata("python3", KernelSpecManager())
    assert served(lessons, content=False)["content"] is None
    assert (tmp_path / LESSON.name).read_bytes() == on_disk


def test_another_kernel_or_a_notebook_without_one_is_served_as_it_is():
    specs = KernelSpecManager()
    for metadata in ({"kernelspec": {"name": "ir", "display_name": "R", "language": "R"}},
                     {"kernelspec": {"name": "", "display_name": ""}}, {}):
        before = json.loads(json.dumps(metadata))
        assert lab_contents.fill_metadata(metadata, specs) is False and metadata == before


def test_a_kernel_on_another_python_is_left_to_jupyterlab(monkeypatch):
    class Spec:
        argv, language, display_name = ["/opt/other/bin/python3", "-m", "ipykernel_launcher"], "python", "Other"
    specs = KernelSpecManager()
    monkeypatch.setattr(specs, "get_kernel_spec", lambda name: Spec())
    assert lab_contents.kernel_metadata("python3", specs) is None


def test_a_failure_while_filling_serves_the_notebook_as_it_is(lessons, monkeypatch, caplog):
    monkeypatch.setattr(lab_contents, "kernel_metadata", lambda name, specs: 1 / 0)
    with caplog.at_level(logging.WARNING):
        metadata = served(lessons)["content"]["metadata"]
    assert metadata == json.loads(LESSON.read_text())["metadata"]
    assert "served without its kernel's metadata (ZeroDivisionError" in caplog.text


def test_the_extension_names_this_manager_unless_the_config_names_another():
    from jupyter_server.serverapp import ServerApp
    from traitlets.config import Config
    plain = ServerApp()
    lab_contents._link_jupyter_server_extension(plain)
    assert plain.contents_manager_class is lab_contents.LessonContentsManager
    config = Config({"ServerApp": {"contents_manager_class": "jupyter_server.services.contents.filemanager.FileContentsManager"}})
    chosen = ServerApp(config=config)
    lab_contents._link_jupyter_server_extension(chosen)
    assert chosen.contents_manager_class.__name__ == "FileContentsManager"


def test_the_environment_enables_the_extension(tmp_path):
    """`make venv` and `labkit.launch` put SERVER_DEFAULTS into the environment's server config."""
    assert launch.install_lab_defaults(tmp_path) is None
    enabled = json.loads((tmp_path / launch.SERVER_DEFAULTS).read_text())["ServerApp"]["jpserver_extensions"]
    assert enabled == {"labkit.lab_contents": True}
    assert lab_contents._jupyter_server_extension_points() == [{"module": "labkit.lab_contents"}]
