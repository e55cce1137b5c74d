"""Whether a memory limit leaves room to load PyTorch: checked the moment torch is first imported.

Stdlib only. Why it exists: under a hub's per-learner memory limit every lesson a learner leaves
open keeps its own kernel, and a new lesson's first import (torch, numba and the lab) is memory no
footprint check sees. Where the limit had no room for it, the kernel's OOM killer ended a kernel:
the new one, or an older lesson's ("The kernel for 01_two_phases.ipynb appears to have died").
Measured on the 2-core EPYC VM (2026-12-06): a cgroup of 2 GiB, other processes leaving 200 MiB
free, lesson 05 under papermill: "Kernel died"; at 300 MiB free it loaded and refused its model in
one line. So the import of torch is refused first, in one line that says what to shut down:

    check_before_torch_loads()   # `import labkit` calls it: the first `import torch` checks
    check_room_to_import()       # FootprintError where a limit leaves less than IMPORT_BYTES free

Only torch's import is checked, so what never loads torch runs under any limit: lesson 08 (the
formulas and the quiz), `make lab`'s launcher (the server where a learner shuts kernels down), and
`make update`. A refused import can be run again: the check stays until torch has loaded.
"""
from __future__ import annotations

import sys

from . import cgroups
from .errors import FootprintError
from .units import format_bytes

# What importing torch and a lesson's labkit modules (numba, numpy, plotly, ipywidgets) made a
# fresh process resident: 302 MiB, 185 of them its own (anonymous) and 117 the libraries' pages,
# which a limit charges to whichever process reads them first. Measured on the 2-core EPYC VM,
# VmRSS/RssAnon/RssFile of /proc/self/status before and after, 2026-12-06.
IMPORT_BYTES = 300 * 2**20


def check_room_to_import(limits: list[tuple[int, int | None]] | None = None) -> None:
    """FootprintError, one line, unless every cgroup memory limit on this process
    (`cgroups.memory_limits`, or `limits` as (limit, in use) bytes) leaves IMPORT_BYTES free.
    Without a limit nothing is checked: a machine's own memory is not shared by a hub's rules,
    and the lessons' checks (`backend.check_fits`) see it."""
    for limit, used in cgroups.memory_limits() if limits is None else limits:
        if used is None:
            continue
        free = max(limit - used, 0)
        if free < IMPORT_BYTES:
            raise FootprintError(
                f"this server's {format_bytes(limit)} memory limit has {format_bytes(free)} free, and loading "
                f"PyTorch and the lab takes about {format_bytes(IMPORT_BYTES)}; {format_bytes(used)} is in use, most "
                "often by the kernels of lessons still open: shut down those you have finished (Kernel > Shut "
                "Down Kernel, or close their tabs), then run this again")


class TorchImportCheck:
    """A finder first on `sys.meta_path` that runs `check_room_to_import` when "torch" is imported
    (not when a library only asks whether it is installed) and finds nothing itself (the usual
    finders then load torch); it steps aside once a check has passed. A refusal raised here is what
    the `import torch` statement raises."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "torch" and _importing():
            try:
                check_room_to_import()
            except FootprintError:
                _one_line_when_uncaught()
                raise
            if cls in sys.meta_path:
                sys.meta_path.remove(cls)
        return None


def _importing() -> bool:
    """Whether this lookup is an import statement's (CPython's `_find_and_load` is on the stack),
    not a library asking `importlib.util.find_spec("torch")` whether torch is installed, which
    loads nothing and must get its answer. Where the stack says neither, an import is assumed."""
    frame, seen = sys._getframe(1), []
    while frame is not None and len(seen) < 8:
        seen.append(frame.f_code.co_name)
        frame = frame.f_back
    if "_find_and_load" in seen or "_find_and_load_unlocked" in seen:
        return True
    return "find_spec" not in seen[1:]


def check_before_torch_loads() -> None:
    """Put `TorchImportCheck` first on `sys.meta_path`, unless torch has loaded already (nothing
    left to refuse) or it is there."""
    if "torch" not in sys.modules and TorchImportCheck not in sys.meta_path:
        sys.meta_path.insert(0, TorchImportCheck)


def _one_line_when_uncaught() -> None:
    """Outside IPython (a script, `python -m labkit.warm`), show an uncaught refusal as its one
    line, as the CLI and a notebook cell do (`errors.LabError`), and every other exception as
    before. IPython shows it by `_render_traceback_` and never calls sys.excepthook for a cell."""
    previous = sys.excepthook
    if getattr(previous, "labkit_one_line", False):
        return

    def hook(kind, value, traceback):
        if isinstance(value, FootprintError):
            print(f"labkit: error: {value}", file=sys.stderr)
        else:
            previous(kind, value, traceback)
    hook.labkit_one_line = True
    sys.excepthook = hook
