"""Test-session setup. The environment is set first: triton reads TRITON_INTERPRET when it is
imported, and test modules import torch/triton only after this file has run."""
import os
import shutil
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


def pytest_collection_modifyitems(config, items):
    """Skip `triton`-marked tests where Triton is not installed (macOS, Windows: no wheels) and
    `gpu`-marked tests on a machine without CUDA, with the reason in the -ra summary."""
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
