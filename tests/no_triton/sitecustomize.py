"""Triton made absent, exactly as on macOS or Windows (Triton publishes no wheels for them):
`import triton` raises ModuleNotFoundError("No module named 'triton'"), and
`importlib.util.find_spec("triton")` fails as well, so nothing can tell this from a laptop.

Python imports `sitecustomize` at start-up from the first directory on sys.path that has one;
PYTHONPATH=tests/no_triton puts this one first. `make test` runs the notebooks this way and
tests/test_no_triton.py runs the CLI and the CPU tests this way: the CPU path must never need Triton.
"""
import sys


class NoTriton:
    """A meta-path finder, first in line, that finds no `triton` nor any of its submodules."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None  # anything else: the usual finders

    @staticmethod
    def invalidate_caches():
        pass


sys.meta_path.insert(0, NoTriton())
