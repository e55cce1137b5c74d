"""Triton made absent, exactly as on macOS or Windows (Triton publishes no wheels for them):
`import triton` raises ModuleNotFoundError("No module named 'triton'"), and
`importlib.util.find_spec("triton")` fails as well, so nothing can tell this from a laptop.

Python imports `sitecustomize` at start-up from the first directory on sys.path that has one;
PYTHONPATH=tests/no_triton puts this one first. `make test` runs the notebooks this way and
tests/test_no_triton.py runs the CLI and the CPU tests this way: the CPU path must never need Triton.

Where LABKIT_TRITON_ASKED names a file, every refused lookup also appends to it who asked, one
line each (`asked`), in this process or any it starts: a test ("test<TAB>nodeid"), or, during a
module's collection or a fixture's set-up or tear-down, its whole file ("file<TAB>tests/test_x.py"),
since what a module or its fixtures learnt there serves every test in it. `make test` then runs
with Triton only the tests that asked, beside those marked `triton` (tests/conftest.py,
`only_what_asked`): a test that never asked, in no process, ran the same code as it would with
Triton installed. That holds because the lab reaches Triton only after asking: a failed import
is never cached, and `backend.triton_installed` asks each time. Two answers are kept: the
kernels' modules keep theirs from their import, but only to define their Triton kernels, which
nothing calls without asking first (tests/test_no_triton.py checks that no code branches on it);
and torch caches its own, which tests/conftest.py clears before each test of such a run.
"""
import os
import sys

ASKED_ENV = "LABKIT_TRITON_ASKED"


def asked() -> str:
    """Who is asking, as lines of the LABKIT_TRITON_ASKED file: pytest's current test (which
    pytest keeps in the environment, so a test's subprocesses name it too), else every test file
    on the stack (a module being collected, and one importing it), else tests/conftest.py's
    collection hook (its skip of the `triton`-marked tests), else "unknown"."""
    current = os.environ.get("PYTEST_CURRENT_TEST")  # "tests/test_x.py::test_y[id] (call)"
    if current:
        nodeid, _, phase = current.rpartition(" ")
        if phase == "(call)":
            return f"test\t{nodeid}"
        return f"file\t{nodeid.split('::')[0]}"  # a fixture's set-up or tear-down: maybe module-scoped
    files, hook = [], False
    frame = sys._getframe(2)
    while frame is not None:
        folder, _, name = frame.f_code.co_filename.replace(os.sep, "/").rpartition("/tests/")
        if folder and name.startswith("test_") and name.endswith(".py") and "/" not in name:
            files.append(f"file\ttests/{name}")
        hook = hook or (name == "conftest.py" and frame.f_code.co_name == "pytest_collection_modifyitems")
        frame = frame.f_back
    if files:
        return "\n".join(dict.fromkeys(files))
    return "conftest\ttests/conftest.py" if hook else f"unknown\t{' '.join(sys.argv)[:200]}"


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
