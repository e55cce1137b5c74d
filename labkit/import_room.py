"""Whether a memory limit leaves room to load PyTorch: checked on `import labkit`, before torch.

Stdlib only. Why it exists: under a hub's per-learner memory limit every lesson a learner leaves
open keeps its own kernel, and a new lesson's first import (torch, numba and the lab) is memory no
footprint check sees. Where the limit had no room for it, the kernel's OOM killer ended a kernel:
the new one, or an older lesson's ("The kernel for 01_two_phases.ipynb appears to have died").
Measured on the 2-core EPYC VM (2026-12-06): a cgroup of 2 GiB, other processes leaving 200 MiB
free, lesson 05 under papermill: "Kernel died"; at 300 MiB free it loaded and refused its model in
one line. So `import labkit` refuses first, in one line that says what to shut down:

    check_room_to_import()   # FootprintError where a limit leaves less than IMPORT_BYTES free
    needs_torch()            # False for `python -m labkit.launch` (`make lab`) and `labkit.update`
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
# Entry points that never load torch: `make lab`'s launcher (a hub's full cgroup must not keep a
# learner from the server whose kernels they are told to shut down) and `make update`.
TORCH_FREE_MODULES = ("labkit.launch", "labkit.update")


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


def needs_torch(argv: list[str] | None = None) -> bool:
    """False where this process is `python -m` one of TORCH_FREE_MODULES (`argv`: the interpreter's
    own command line, `sys.orig_argv`), else True."""
    argv = list(getattr(sys, "orig_argv", []) if argv is None else argv)
    module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else None
    return module not in TORCH_FREE_MODULES
