"""Triton made absent, exactly as on macOS or Windows (Triton publishes no wheels for them):
`import triton` raises ModuleNotFoundError("No module named 'triton'"), and
`importlib.util.find_spec("triton")` fails as well, so nothing can tell this from a laptop.

Python imports `sitecustomize` at start-up from the first directory on sys.path that has one;
PYTHONPATH=tests/no_triton puts this one first. `make test` runs the notebooks this way and
tests/test_no_triton.py runs the CLI and the CPU tests this way: the CPU path must never need Triton.

Where LABKIT_TRITON_ASKED names a file, every refused lookup also appends to it who asked, one
line each (`asked`), in this process or any it starts: a test ("test<TAB>nodeid"), or, during a
module's collection or a fixture's set-up or tear-down, its whole file ("file<TAB>tests/test_x.py"),
since what a module or its fixtures learnt there serves every test in it. A test that never asked,
in no process, ran the same code as it would with Triton installed (a failed import is never
cached, so each test that depends on the answer asks again), so `make test` runs with Triton only
the tests that asked, beside those marked `triton` (tests/conftest.py, `only_what_asked`).
"""
import os
import sys

ASKED_ENV = "LABKIT_TRITON_ASKED"


def asked() -> str:
    """Who is asking, as a line of the LABKIT_TRITON_ASKED file: pytest's current test (which
    pytest keeps in the environment, so a test's subprocesses name it too), else the nearest test
    file on the stack (a module being collected), else tests/conftest.py's hooks, else "unknown"."""
    current = os.environ.get("PYTEST_CURRENT_TEST")  # "tests/test_x.py::test_y[id] (call)"
    if current:
        nodeid, _, phase = current.rpartition(" ")
        if phase == "(call)":
            return f"test\t{nodeid}"
        return f"file\t{nodeid.split('::')[0]}"  # a fixture's set-up or tear-down: maybe module-scoped
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        folder, _, name = path.rpartition("/tests/")
        if folder and "/" not in name and name.startswith(("test_", "conftest")):
            return f"{'conftest' if name.startswith('conftest') else 'file'}\ttests/{name}"
        frame = frame.f_back
    return f"unknown\t{' '.join(sys.argv)[:200]}"


class NoTriton:
    """A meta-path finder, first in line, that finds no `triton` nor any of its submodules."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            log = os.environ.get(ASKED_ENV)
            if log:
                with open(log, "a", encoding="utf-8") as out:  # one short append: whole lines across processes
                    out.write(asked() + "\n")
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None  # anything else: the usual finders

    @staticmethod
    def invalidate_caches():
        pass


sys.meta_path.insert(0, NoTriton())
