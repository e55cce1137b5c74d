"""Test-session setup. The environment is set first: triton reads TRITON_INTERPRET when it is
imported, and test modules import torch/triton only after this file has run."""
import os
import shutil
import sys
import tempfile
from pathlib import Path

import labkit  # noqa: E402,F401 — its import chooses Triton's interpreter when there is no NVIDIA driver

# A fresh cache per session under build/, so tests never read or write the user's labkit cache —
# not even one the caller's LABKIT_CACHE_DIR names (a calibration measured while the suite loads
# the machine would judge every later lesson point against too low a roof). Every subprocess a
# test starts inherits it. Removed when the session ends.
_CACHE_PARENT = Path(__file__).resolve().parent.parent / "build" / "test-cache"
_CACHE_PARENT.mkdir(parents=True, exist_ok=True)
_OWN_CACHE = tempfile.mkdtemp(prefix="session-", dir=_CACHE_PARENT)
os.environ["LABKIT_CACHE_DIR"] = _OWN_CACHE
# The learner's kept estimates (labkit.estimates) likewise: a test's commit is not the user's.
os.environ["LABKIT_DATA_DIR"] = str(Path(_OWN_CACHE) / "data")

# The parallel run's workers keep each other's cores busy all along: a point timed there would
# wait for a quiet moment that never comes (sweeps.QUIET_WAIT_S), so its workers do not wait.
# Serial runs (the timed and browser tests) keep the wait, as a learner's lab does.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("LABKIT_QUIET_WAIT_S", "0")

import pytest  # noqa: E402


def _cuda_available():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# `make test` runs every CPU test without Triton first (tests/test_no_triton.py), which writes who
# asked for Triton to the file this names; without a GPU, the run with Triton then takes only what
# the run without it cannot stand for (`only_what_asked`; tests/no_triton/sitecustomize.py says why).
WITH_TRITON_ONLY_ENV = "LABKIT_WITH_TRITON_ONLY"
TRITON_ASKED_ENV = "LABKIT_TRITON_ASKED"  # where the run without Triton records who asked (the block's ASKED_ENV)
NOT_RUN_WITHOUT_TRITON = ("triton", "browser")  # skipped there, or left out of it (`-m "not browser"`)


def who_asked(asked_lines: list[str]) -> tuple[set, set, str | None]:
    """(tests, files, why every test runs) from the lines of the run without Triton: the tests
    that asked for Triton, the files that asked while collected or set up (a module-scoped
    fixture serves its whole file), and, where an ask names nobody, why all must run again. The
    collection hook below asks only to skip the `triton`-marked tests, which run again anyway."""
    tests, files = set(), set()
    for line in asked_lines:
        kind, _, what = line.partition("\t")
        if kind == "test":
            tests.add(what)
        elif kind == "file":
            files.add(what)
        elif kind != "conftest":
            return tests, files, f"Triton was asked for outside any test ({what or line!r})"
    return tests, files, None


def only_what_asked(items, asked_lines: list[str]) -> tuple[list, list, str | None]:
    """(kept, deselected, why all are kept or None) for a run with Triton after one without it:
    kept are the tests marked `triton` or `browser` (the run without Triton skipped or left them
    out) and those that asked for Triton, themselves or through their file (`who_asked`)."""
    tests, files, why = who_asked(asked_lines)
    if why:
        return list(items), [], why
    kept, deselected = [], []
    for item in items:
        asked = item.nodeid in tests or item.nodeid.split("::")[0] in files
        marked = any(item.get_closest_marker(name) is not None for name in NOT_RUN_WITHOUT_TRITON)
        (kept if asked or marked else deselected).append(item)
    return kept, deselected, None


ASKED_LINES = pytest.StashKey[list]()


def pytest_configure(config):
    """With LABKIT_WITH_TRITON_ONLY, its file's lines, read once a process; a missing file stops
    the run in one line (never a run of nothing: the run without Triton has to write it first)."""
    path = os.environ.get(WITH_TRITON_ONLY_ENV)
    if not path:
        return
    try:
        config.stash[ASKED_LINES] = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise pytest.UsageError(f"{WITH_TRITON_ONLY_ENV}={path}: {err.strerror}; `make test-no-triton` writes it") from None


def pytest_report_header(config):
    """Which tests this run with Triton takes, said once by the main process (pytest-xdist's
    workers, which select them, print nothing)."""
    if ASKED_LINES not in config.stash:
        return None
    tests, files, why = who_asked(config.stash[ASKED_LINES])
    if why:
        return f"with Triton: every test, as {why}"
    return (f"with Triton: the tests marked {' or '.join(NOT_RUN_WITHOUT_TRITON)}, and the {len(tests)} tests and "
            f"{len(files)} test files that asked for it without Triton ({os.environ[WITH_TRITON_ONLY_ENV]})")


def _keep_only_what_asked(config, items):
    if ASKED_LINES not in config.stash:
        return
    kept, deselected, _ = only_what_asked(items, config.stash[ASKED_LINES])
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


def pytest_runtest_setup(item):
    """In the run without Triton that records who asked for it (tests/no_triton/sitecustomize.py),
    torch's cached answers are forgotten before each test, so a test relying on one asks again."""
    if os.environ.get(TRITON_ASKED_ENV) and "torch.utils._triton" in sys.modules:
        for value in vars(sys.modules["torch.utils._triton"]).values():
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()


def pytest_collection_modifyitems(config, items):
    """Skip `triton`-marked tests where Triton is not installed (macOS, Windows: no wheels) and
    `gpu`-marked tests on a machine without CUDA, with the reason in the -ra summary; with
    LABKIT_WITH_TRITON_ONLY, keep only what a run without Triton cannot stand for."""
    _keep_only_what_asked(config, items)
    from labkit import backend  # torch loads here: after the environment above is set
    if not backend.triton_installed():
        no_triton = pytest.mark.skip(reason=f"skipped: {backend.TRITON_MISSING}")
        for item in items:
            if item.get_closest_marker("triton") is not None:
                item.add_marker(no_triton, append=False)
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def pytest_unconfigure(config):
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)
