"""Builds made at setup, for a learner who cannot write to the installed labkit.

Why it exists: numba keeps a compiled kernel (`cache=True`) in `__pycache__` beside its source only
where the process may write there. A lab installed once for a room — TLJH's `/opt/tljh/user`, a
container image built as root — is not the learner's to write, so numba passes over the builds
`python -m labkit.warm` left there and compiles every kernel again into the learner's own cache
(NUMBA_CACHE_DIR, else ~/.cache/numba): 25 s of both cores for each learner, at their first decode
step (2-core EPYC VM, a non-root user, 2026-12-05). `seed_from_install` asks numba's own cache
locators where this process's builds will go and, where that is not beside the sources, copies the
setup's builds there first (numba checks each against its source's hash on load, as always):

    seed_from_install([Path(labkit.cpu_kernels.__file__).parent, Path(labkit.__file__).parent])

It must run before the kernels are defined: numba picks a kernel's cache folder when it decorates it
(`_jit` calls it for this package's folder, `cpu_step` for its own, each before its kernels). A
file is copied only where the learner has none or an older one, through a temporary name, so two
lessons starting at once never see half a file and nothing the learner's numba compiled since is
overwritten. Any failure leaves numba to compile, as it would without this.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

try:
    from numba.core import caching, config
except ImportError:  # the core installs without numba (a GPU image): there is nothing to copy
    caching = config = None

# numba's index (.nbi) and builds (.nbc), and `_jit.drop_stale_builds`'s mark of the sources they
# were made with (.kernels), which keeps them from being dropped as stale.
BUILD_SUFFIXES = (".nbi", ".nbc", ".kernels")


def numba_cache_folder(source_folder: Path) -> Path | None:
    """Where numba will keep the builds of functions defined in `source_folder`'s modules, by its own
    locators in its own order (NUMBA_CACHE_DIR, beside the source, the user's cache); None without
    numba, when the order is overridden (NUMBA_CACHE_LOCATOR_CLASSES) or where numba no longer has
    them where 0.68 does (`CacheImpl._locator_classes`; tests/test_installed_builds.py fails then)."""
    if caching is None:
        return None
    locator_classes = getattr(getattr(caching, "CacheImpl", None), "_locator_classes", None)
    if getattr(config, "CACHE_LOCATOR_CLASSES", None) or not locator_classes:
        return None
    source = source_folder / "__init__.py"  # any file of the folder: the locators use its folder only
    for locator_class in locator_classes:
        locator = locator_class.from_function(numba_cache_folder, str(source))
        if locator is not None:
            return Path(locator.get_cache_path())
    return None


def copy_missing_builds(installed: Path, own: Path) -> int:
    """Copy every build file of `installed` (a `__pycache__`) into `own` where `own` has none or an
    older one; the number copied. Each goes through a temporary file and a rename."""
    copied = 0
    for path in sorted(installed.glob("*")):
        if path.suffix not in BUILD_SUFFIXES:
            continue
        target = own / path.name
        try:
            if target.exists() and target.stat().st_mtime >= path.stat().st_mtime:
                continue
            handle, temporary = tempfile.mkstemp(dir=own, prefix=f".{path.name}.")
            os.close(handle)
            shutil.copy2(path, temporary)
            os.replace(temporary, target)
            copied += 1
        except OSError:
            continue
    return copied


def seed_from_install(source_folders) -> int:
    """For each folder of kernel sources whose builds numba will keep elsewhere (see the module
    docstring), copy the setup's builds from its `__pycache__` there; the number of files copied."""
    copied = 0
    for folder in map(Path, source_folders):
        installed, own = folder / "__pycache__", numba_cache_folder(folder)
        if own is None or not installed.is_dir() or own.resolve() == installed.resolve():
            continue
        copied += copy_missing_builds(installed, own)
    return copied
