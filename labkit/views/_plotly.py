"""plotly and ipywidgets, imported once for every view: without jsonschema's `iri` checker
(`_without_iri_format_checker`), which cost every kernel start 3-5 s."""
from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def _without_iri_format_checker():
    """Import plotly without jsonschema's `iri` format checker: 3-5 s off every kernel start.

    plotly imports nbformat, which imports jsonschema, which imports `rfc3987_syntax` when it is
    installed (JupyterLab's server pulls it in) — and that package compiles ~40 lark grammars on
    import (python-jsonschema/jsonschema#1428). While plotly loads, the module reads as absent,
    so jsonschema skips that one optional checker (nbformat's schemas never use `iri`); afterwards
    it is importable again. Does nothing when jsonschema was imported before us.
    """
    block = "jsonschema" not in sys.modules and "rfc3987_syntax" not in sys.modules
    if block:
        sys.modules["rfc3987_syntax"] = None  # `import` of a None entry raises ImportError
    try:
        yield
    finally:
        if block and sys.modules.get("rfc3987_syntax", 0) is None:
            del sys.modules["rfc3987_syntax"]


with _without_iri_format_checker():
    import ipywidgets as widgets
    import plotly.graph_objects as go
    import plotly.io as pio
    from plotly.subplots import make_subplots
    pio.renderers  # noqa: B018 — lazy in plotly: this is what imports nbformat, which every chart's display needs


__all__ = ["go", "make_subplots", "pio", "widgets"]  # what the views import from here
