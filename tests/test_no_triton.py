"""The CPU path with Triton absent, as on macOS and Windows, which Triton publishes no wheels for
(issue 16): the CLI, the GPU and compile checks, and the CPU tests.

Each test runs fresh processes with tests/no_triton/ first on PYTHONPATH: its sitecustomize makes
`import triton` fail exactly as it fails on a Mac. `make test-no-triton` runs the notebooks (quick
mode) that way and then this file; `make test` runs that target. A process may not show a traceback,
let alone one about triton; what needs Triton must say it is skipped, and why.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TRITON_ASKED_ENV

ROOT = Path(__file__).resolve().parent.parent
BLOCK = ROOT / "tests" / "no_triton"
SKIPPED = "skipped: Triton is not installed (no wheels for this platform)"
# Who asked for Triton in the CPU tests' run without it, for `make test`'s run with it (LABKIT_WITH_TRITON_ONLY).
ASKED = ROOT / "build" / "triton-asked.txt"
# Run beside this file by `make test` (or by hand), never inside the no-Triton CPU test run.
NOT_HERE = ("test_no_triton.py", "test_make_lab.py", "test_app.py", "test_report.py", "test_browser.py")


def without_triton(args: list[str], timeout: float = 300, cwd: Path = ROOT,
                   asked: Path | None = None) -> subprocess.CompletedProcess:
    """`args` in a process where `import triton` fails, on the CPU path; stdout and stderr together.
    `asked`: the file where every lookup of Triton is recorded with who asked (the block's docstring)."""
    path = os.pathsep.join(p for p in (str(BLOCK), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "LABKIT_DEVICE": "cpu", "PYTHONUNBUFFERED": "1"}
    env.pop("PYTEST_CURRENT_TEST", None)  # this test is not the one asking: the suite's own tests name themselves
    if asked is not None:
        env[TRITON_ASKED_ENV] = str(asked)
    return subprocess.run(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)


def assert_clean(done: subprocess.CompletedProcess, code: int = 0):
    """Exit `code`, and no traceback or failed triton import anywhere in the output."""
    tail = done.stdout[-4000:]
    assert done.returncode == code, f"exit {done.returncode}, expected {code}:\n{tail}"
    assert "Traceback" not in done.stdout, tail
    assert "No module named 'triton'" not in done.stdout, tail


def test_the_block_makes_triton_absent_as_on_a_mac():
    done = without_triton([sys.executable, "-c", "import triton"])
    assert done.returncode == 1 and done.stdout.strip().splitlines()[-1] == "ModuleNotFoundError: No module named 'triton'"
    probe = ("import sys, labkit; from labkit import backend; "
             "print(backend.triton_installed(), backend.triton_mode(), 'triton' in sys.modules)")
    done = without_triton([sys.executable, "-c", probe])
    assert_clean(done)
    assert done.stdout.split() == ["False", "none", "False"]


@pytest.mark.parametrize("args", [
    ["predict", "decode", "--batch", "8", "--context", "4096"],
    ["calibrate", "--json"],
    ["measure", "decode", "--batch", "1", "--context", "256", "--json"],  # the command
    ["measure", "decode", "--batch", "2", "--context", "256", "--cache-dtype", "int8", "--json"],  # quantised in torch
    ["measure", "prefill", "--prompt", "256", "--json"],
], ids=lambda args: "-".join(a.lstrip("-") for a in args[:2] + args[-3:-1]))
def test_the_cli_runs_without_triton(args):
    done = without_triton([sys.executable, "-m", "labkit", *args])
    assert_clean(done)
    if args[0] == "measure":
        result = json.loads(done.stdout.strip().splitlines()[-1])
        assert result["device"] == "cpu" and result["time_s"] > 0, result


def test_the_gpu_check_and_the_compile_check_say_they_are_skipped(tmp_path):
    """Both run only the lab's Triton kernels: one line each, the reason in it; a dry run and the
    compile check exit 0 (nothing is wrong with the machine), a full GPU check 2 (nothing checked)."""
    for args, code in (([sys.executable, "-m", "labkit.gpu_check", "--out", str(tmp_path), "--dry-run"], 0),
                       ([sys.executable, "-m", "labkit.gpu_check", "--out", str(tmp_path)], 2),
                       ([sys.executable, "-m", "labkit.gpu_compile", "--targets", "sm_90a"], 0)):
        done = without_triton(args, timeout=120)
        assert_clean(done, code)
        name = args[2].split(".")[-1]
        assert done.stdout.strip() == f"{name}: {SKIPPED}", done.stdout
    assert not list(tmp_path.iterdir()), "a skipped check writes no recording"


@pytest.mark.slow
def test_the_cpu_tests_pass_and_name_what_they_skip():
    """The suite beside this file (the browser and notebook-running tests are left to `make test`),
    without Triton (in TEST_JOBS processes where `make test` passes them): it passes, and every
    test that needs Triton is skipped with the reason, never failed with a traceback. The `timed`
    tests are left out: they time the CPU path, the same code with Triton or without it, and what
    they time needs a machine to itself, which `make test` gives them once, with Triton.
    It also writes who asked for Triton (ASKED): without a GPU, `make test` runs with Triton only
    those tests and the ones marked `triton` or `browser`, the others having just run the same
    code here (tests/conftest.py, `only_what_asked`)."""
    ignored = [arg for name in NOT_HERE for arg in ("--ignore", f"tests/{name}")]
    jobs = os.environ.get("TEST_JOBS", "0")  # `make test` passes its TEST_JOBS (pytest-xdist's -n)
    parallel = [] if jobs == "0" else ["-n", jobs]
    ASKED.parent.mkdir(exist_ok=True)
    ASKED.unlink(missing_ok=True)  # this run's askers only (tests/no_triton/sitecustomize.py)
    done = without_triton([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *ignored, "tests",
                           "-m", "not browser and not timed", *parallel], timeout=900, asked=ASKED)
    summary = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 0, f"the CPU tests failed without Triton: {summary}\n{done.stdout[-6000:]}"
    for name in ("test_kernels_matmul", "test_kernels_flash_attention", "test_kernels_decode_attention",
                 "test_kernels_kv_quant", "test_kernels_add_rms_norm", "test_kernels_rope_store", "test_kernels_swiglu",
                 "test_gpu_compile"):
        assert re.search(rf"tests/{name}\.py:\d+: {re.escape(SKIPPED)}", done.stdout), f"{name}: not skipped, or not saying why"
    assert "No module named 'triton'" not in done.stdout, done.stdout[-6000:]
    # What `make test` then runs with Triton (tests/conftest.py, only_what_asked): the kernel tests'
    # files asked while they were collected, and lesson 03's check asked in its test. A recorder
    # that stopped writing would leave the run with Triton only the `triton`-marked tests.
    asked = set(ASKED.read_text(encoding="utf-8").splitlines())
    for name in ("test_kernels_matmul", "test_kernels_flash_attention", "test_gpu_compile"):
        assert f"file\ttests/{name}.py" in asked, f"{name}: its asking for Triton was not recorded in {ASKED}"
    assert any(line.startswith("test\ttests/test_attention.py::") for line in asked), sorted(asked)


@pytest.mark.parametrize("current, line", [
    ("tests/test_x.py::test_y[a b] (call)", "test\ttests/test_x.py::test_y[a b]"),
    ("tests/test_x.py::test_y[a b] (setup)", "file\ttests/test_x.py"),  # a module-scoped fixture serves the file
    (None, "unknown\t-c"),
])
def test_the_block_records_who_asked_for_triton_in_every_process(tmp_path, current, line):
    """A lookup of Triton in a process the test started names the test pytest was running, or
    its file while a fixture was set up; with no test running and no test file on the stack, it
    is unknown (and `only_what_asked` then keeps every test)."""
    log = tmp_path / "asked.txt"
    env = {**os.environ, TRITON_ASKED_ENV: str(log), "PYTHONPATH": str(BLOCK)}
    env.pop("PYTEST_CURRENT_TEST", None)
    if current:
        env["PYTEST_CURRENT_TEST"] = current
    probe = "import importlib.util\ntry:\n    importlib.util.find_spec('triton')\nexcept ImportError:\n    pass\nimport numpy"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert log.read_text().splitlines() == [line]


def test_a_module_asking_while_collected_names_every_test_file_importing_it(tmp_path):
    """A test module's import-time ask counts for each test file on the stack: one test file
    importing another (test_arm_fallbacks imports test_model) shares what that one learnt."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_inner.py").write_text("import importlib.util\ntry:\n    importlib.util.find_spec('triton')\n"
                                                      "except ImportError:\n    pass\n")
    (tmp_path / "tests" / "test_outer.py").write_text("import test_inner\n")
    log = tmp_path / "asked.txt"
    env = {**os.environ, TRITON_ASKED_ENV: str(log), "PYTHONPATH": os.pathsep.join([str(BLOCK), str(tmp_path / "tests")])}
    env.pop("PYTEST_CURRENT_TEST", None)
    done = subprocess.run([sys.executable, "-c", "import test_outer"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert log.read_text().splitlines() == ["file\ttests/test_inner.py", "file\ttests/test_outer.py"]


class _Item:
    def __init__(self, nodeid, marker=None):
        self.nodeid, self.marker = nodeid, marker

    def get_closest_marker(self, name):
        return object() if name == self.marker else None


def test_the_run_with_triton_keeps_the_marked_the_askers_and_their_files():
    from conftest import only_what_asked
    items = [_Item("tests/test_a.py::test_marked", "triton"), _Item("tests/test_a.py::test_asked"),
             _Item("tests/test_a.py::test_quiet"), _Item("tests/test_a.py::test_slow", "slow"),
             _Item("tests/test_a.py::test_in_chromium", "browser"),
             _Item("tests/test_b.py::test_one"), _Item("tests/test_b.py::test_two")]
    kept, deselected, why = only_what_asked(items, ["test\ttests/test_a.py::test_asked", "file\ttests/test_b.py",
                                                    "conftest\ttests/conftest.py"])
    assert [i.nodeid for i in kept] == ["tests/test_a.py::test_marked", "tests/test_a.py::test_asked",
                                        "tests/test_a.py::test_in_chromium",  # the run without Triton left it out
                                        "tests/test_b.py::test_one", "tests/test_b.py::test_two"]
    assert [i.nodeid for i in deselected] == ["tests/test_a.py::test_quiet", "tests/test_a.py::test_slow"] and why is None
    kept, deselected, why = only_what_asked(items, ["test\ttests/test_a.py::test_asked", "unknown\t-c"])
    assert kept == items and deselected == [] and "outside any test" in why


KERNEL_MODULES = sorted(p.stem for p in (ROOT / "kernels").glob("*.py") if p.stem not in ("__init__", "_runtime", "tolerances"))


def test_no_code_branches_on_a_kernel_modules_kept_answer():
    """What makes `make test`'s run with Triton skip the tests that never asked for it (the block's
    docstring): a kernel module keeps whether Triton imported, but only to define its Triton
    kernel, at module level; nothing else reads its `triton` or `tl`."""
    for stem in KERNEL_MODULES:
        for number, line in enumerate((ROOT / "kernels" / f"{stem}.py").read_text().splitlines(), 1):
            if re.search(r"\b(triton|tl) is (not )?None\b", line):
                assert line.startswith("if "), f"kernels/{stem}.py:{number} branches on it inside code: {line.strip()}"
    reader = re.compile(rf"\b(?:{'|'.join(KERNEL_MODULES)})\.(?:triton|tl)\b|from kernels\.\w+ import [^#\n]*\b(?:triton|tl)\b")
    for path in [*(ROOT / "labkit").rglob("*.py"), *(ROOT / "kernels").glob("*.py"), *(ROOT / "tests").glob("*.py")]:
        found = reader.search(path.read_text())
        assert not found, f"{path.relative_to(ROOT)} reads a kernel module's kept answer: {found[0]}"
