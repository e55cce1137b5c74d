"""A learner who cannot write to the installed labkit starts from the builds made at setup
(labkit/cpu_kernels/_installed_builds.py) instead of compiling every kernel again.

The end-to-end test stands in for that learner with NUMBA_CACHE_DIR (numba's first locator, so its
builds go there even for root, who may write anywhere): the warm-up's steps, run again there, must
load the setup's builds and compile nothing.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from labkit import cpu_kernels
from labkit.cpu_kernels._installed_builds import BUILD_SUFFIXES, copy_missing_builds, numba_cache_folder

ROOT = Path(__file__).resolve().parent.parent
KERNEL_FOLDERS = (ROOT / "labkit" / "cpu_kernels", ROOT / "labkit")

needs_numba = pytest.mark.skipif(not cpu_kernels.AVAILABLE, reason="numba is not installed")


def _build_files(folder: Path) -> dict[str, tuple[float, int]]:
    return {p.name: (p.stat().st_mtime, p.stat().st_size) for p in folder.glob("*") if p.suffix in BUILD_SUFFIXES}


def test_copies_builds_only_where_the_learner_has_none_or_an_older_one(tmp_path):
    installed, own = tmp_path / "installed", tmp_path / "own"
    installed.mkdir()
    own.mkdir()
    for name in ("k.f-10.py311.nbi", "k.f-10.py311.1.nbc", "k.f-10.py311.nbi.kernels", "k.cpython-311.pyc"):
        (installed / name).write_text(f"setup's {name}")
    os.utime(installed / "k.f-10.py311.nbi", (1_000, 1_000))
    (own / "k.f-10.py311.nbi").write_text("the learner's newer index")  # numba compiled since: keep it
    (own / "k.f-10.py311.1.nbc").write_text("an older build")
    os.utime(own / "k.f-10.py311.1.nbc", (500, 500))

    assert copy_missing_builds(installed, own) == 2
    assert (own / "k.f-10.py311.nbi").read_text() == "the learner's newer index"
    assert (own / "k.f-10.py311.1.nbc").read_text() == "setup's k.f-10.py311.1.nbc"
    assert (own / "k.f-10.py311.nbi.kernels").read_text() == "setup's k.f-10.py311.nbi.kernels"
    assert sorted(p.name for p in own.iterdir()) == ["k.f-10.py311.1.nbc", "k.f-10.py311.nbi",
                                                      "k.f-10.py311.nbi.kernels"]  # no .pyc, no temporary file
    assert copy_missing_builds(installed, own) == 0  # copies keep the setup's times: nothing newer now


@needs_numba
def test_asks_numba_where_its_builds_go(tmp_path, monkeypatch):
    """numba 0.68's locators, in its order: beside the sources where this process may write (the
    tests run where the repository is theirs), NUMBA_CACHE_DIR first when it is set."""
    from numba.core import config
    monkeypatch.setattr(config, "CACHE_DIR", "")
    for folder in KERNEL_FOLDERS:
        assert numba_cache_folder(folder) == folder / "__pycache__"
    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path))
    own = numba_cache_folder(KERNEL_FOLDERS[0])
    assert own is not None and own.parent == tmp_path and own.name.startswith("cpu_kernels_")


@needs_numba
@pytest.mark.slow
def test_a_learner_elsewhere_loads_the_setups_builds_without_compiling(tmp_path):
    """numba's own cache log (NUMBA_DEBUG_CACHE) says what the learner's process loaded and saved:
    it must load builds from its own folder and save none (a save is a kernel compiled again).
    Read from the log, not from the files: other tests may compile into the sources' folder meanwhile."""
    run = [sys.executable, "-m", "labkit.warm", "--cache-dtypes", "fp32"]
    env = {**os.environ, "LABKIT_CACHE_DIR": str(tmp_path / "labkit")}
    env.pop("NUMBA_CACHE_DIR", None)
    setup = subprocess.run(run, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert setup.returncode == 0, setup.stdout + setup.stderr  # the setup's builds, beside the sources
    own = tmp_path / "numba"
    learner = subprocess.run(run, cwd=ROOT, env={**env, "NUMBA_CACHE_DIR": str(own), "NUMBA_DEBUG_CACHE": "1"},
                             capture_output=True, text=True, timeout=300)
    assert learner.returncode == 0, learner.stdout + learner.stderr
    log = learner.stdout.splitlines()
    loaded = [line for line in log if line.startswith("[cache] data loaded from") and str(own) in line]
    saved = [line for line in log if line.startswith("[cache]") and " saved to " in line]
    assert not saved, f"numba compiled again instead of loading the setup's builds: {saved[:5]}"
    for folder in KERNEL_FOLDERS:
        assert any(f"/{folder.name}_" in line for line in loaded), f"nothing of {folder.name} loaded from {own}"
        assert _build_files(next(own.glob(f"{folder.name}_*"))), f"nothing copied for {folder.name}"
