"""`make test`, the GPU check's dry run and the test suite never write the user's calibration
cache: a calibration measured while the suite loads the machine would judge every later lesson
point against too low a roof (issue 13: 12.1 GB/s cached by a test run, 20.0 GB/s idle)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SESSION_CACHES = ROOT / "build" / "test-cache"


def test_the_session_and_its_subprocesses_use_a_private_cache():
    here = Path(os.environ["LABKIT_CACHE_DIR"])
    assert here.parent == SESSION_CACHES and here.name.startswith("session-")
    code = "from labkit import calibrate; print(calibrate.cache_dir())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert Path(out) == here


def test_the_session_overrides_a_cache_the_callers_environment_names():
    code = "import os; import conftest; print(os.environ['LABKIT_CACHE_DIR'])"
    env = {**os.environ, "LABKIT_CACHE_DIR": str(Path.home() / ".cache" / "labkit")}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "tests", env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    made = Path(done.stdout.strip().splitlines()[-1])
    shutil.rmtree(made, ignore_errors=True)  # that process ran no session that would remove it
    assert made.parent == SESSION_CACHES and made.name.startswith("session-")


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_tests_notebooks_and_dry_run_each_name_a_cache_under_build():
    dry = subprocess.run(["make", "-n", "gpu-check", "DRY=1"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert f'export LABKIT_CACHE_DIR="{ROOT}/build/test-cache/gpu-check-dry"' in dry
    real = subprocess.run(["make", "-n", "gpu-check"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "LABKIT_CACHE_DIR" not in real  # a real GPU check calibrates this machine for its user
    recipe = (ROOT / "Makefile").read_text().split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert "LABKIT_CACHE_DIR=$(CURDIR)/build/test-cache/notebooks" in recipe
    # The dry run `make test` makes is the GPU check's tests' own, through the target above.
    assert '"gpu-check", "DRY=1"' in (ROOT / "tests" / "test_gpu_check.py").read_text()
    # The compile check's results too: `make test` keeps them under build/, never in ~/.cache/labkit.
    assert "LABKIT_CACHE_DIR=$(CURDIR)/build/test-cache $(MAKE) gpu-compile" in recipe
