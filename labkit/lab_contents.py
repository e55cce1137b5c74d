"""The lab's Jupyter contents manager: a notebook for this Python's own kernel is served with the
kernel's metadata already in it, so a lesson opened, read and closed asks nothing.

Why: once a notebook's kernel starts, JupyterLab writes the kernel's spec ("Python 3 (ipykernel)")
and its language_info (the Python's exact version among them) into the notebook's metadata, and a
notebook whose metadata changed has unsaved changes. Closing a lesson that was only read asked
"Save your work?"; saved, the lesson differed from git, and `git pull` would not replace it (README).
The committed lessons cannot carry that metadata themselves: it names the Python that runs them
(3.11.7 on the lab's CI machines, 3.11.2 in Debian's). Here the server fills in what JupyterLab is
about to write, for the one kernel whose answer it knows without starting it: ipykernel on the
server's own Python. Any other kernel, or any failure here, serves the notebook as it is on disk.

A Jupyter server extension, enabled by SERVER_DEFAULTS (`make venv`, `labkit.launch`): linked before
the server makes its contents manager, it names this one, unless the server's config names another
(a hub's, a user's). Should it fail to import, the server logs that and runs without it. It imports
nothing of labkit's beyond the package's thread settings, which the kernels set for themselves.
"""
from __future__ import annotations

import functools
import sys

from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager

# jupyter_client runs a kernel whose command starts with one of these on the server's own Python.
_OWN_PYTHON = {"python", f"python{sys.version_info[0]}", "python{}.{}".format(*sys.version_info[:2]), sys.executable}


@functools.cache
def own_language_info() -> dict:
    """The language_info ipykernel on this Python answers in its kernel_info_reply (ipykernel's own
    class attribute, so it cannot drift from what the kernel says)."""
    from ipykernel.ipkernel import IPythonKernel  # it imports IPython: only once a notebook is served
    return dict(IPythonKernel.language_info)


def kernel_metadata(name: str, specs: KernelSpecManager) -> dict | None:
    """{"kernelspec", "language_info"} as JupyterLab writes them once kernel `name` runs, where it is
    ipykernel on this Python; else None (its language_info is known only to the kernel)."""
    try:
        spec = specs.get_kernel_spec(name)
    except NoSuchKernel:
        return None
    if not spec.argv or spec.argv[0] not in _OWN_PYTHON or spec.language != "python":
        return None
    return {"kernelspec": {"name": name, "display_name": spec.display_name, "language": spec.language},
            "language_info": own_language_info()}


def fill_metadata(metadata: dict, specs: KernelSpecManager) -> bool:
    """Put into a notebook's `metadata` what JupyterLab will write there once its kernel starts
    (`kernel_metadata` of the kernel it names); True where anything changed."""
    name = (metadata.get("kernelspec") or {}).get("name")
    filled = kernel_metadata(name, specs) if name else None
    if filled is None or all(metadata.get(key) == value for key, value in filled.items()):
        return False
    metadata.update(filled)
    return True


class LessonContentsManager(AsyncLargeFileManager):
    """Jupyter server's default contents manager, but a notebook it reads comes with
    `fill_metadata` applied (saving and everything else unchanged)."""

    async def get(self, path, content=True, type=None, format=None, **kwargs):
        model = await super().get(path, content=content, type=type, format=format, **kwargs)
        if model.get("type") == "notebook" and model.get("content") is not None:
            try:
                fill_metadata(model["content"]["metadata"], self._kernel_specs())
            except Exception as err:  # never keep a notebook from opening over its metadata
                self.log.warning("labkit: %s served without its kernel's metadata (%s: %s)", path,
                                 err.__class__.__name__, err)  # `type` is get's argument here
        return model

    def _kernel_specs(self) -> KernelSpecManager:
        """The server's kernel specs (a hub's or a user's kernels included), else the default ones."""
        return getattr(self.parent, "kernel_spec_manager", None) or KernelSpecManager()


def _jupyter_server_extension_points() -> list[dict]:
    return [{"module": "labkit.lab_contents"}]


def _link_jupyter_server_extension(serverapp) -> None:
    """Before the server makes its contents manager: this one, unless its config names another."""
    if "contents_manager_class" not in serverapp.config.get("ServerApp", {}):
        serverapp.contents_manager_class = LessonContentsManager


def _load_jupyter_server_extension(serverapp) -> None:
    manager = type(serverapp.contents_manager).__name__
    if isinstance(serverapp.contents_manager, LessonContentsManager):
        serverapp.log.info("labkit: notebooks for this Python's kernel are served with its metadata")
    else:
        serverapp.log.info("labkit: the server's config names its own contents manager (%s); lessons "
                           "only read may ask to be saved when closed", manager)
