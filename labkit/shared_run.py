"""One measurement that several readers of a lesson share.

A lesson may ask a question about a measurement and then chart the same measurement (lesson 06:
the worst stall of a long prefill, then its timeline; lesson 07: the shape that leans furthest
towards decode, then the six shapes' split). Measured once per reader, the answer and the chart
would show two runs of one thing, seconds apart, and a learner reads the difference as an
inconsistency (lesson 06 in Chromium: "measured 483 ms" above a timeline whose worst gap was
424 ms). Shared, they show one run and the learner waits once.
"""
from __future__ import annotations


class SharedRun:
    """`run(*args, **kwargs)`, run once for several readers. A reader gets the latest result
    unless it has had that one already; then `run` runs afresh, so running a cell again always
    measures again, and the other readers then show the new result."""

    def __init__(self, run):
        self.run = run
        self.runs = 0  # how many times `run` ran
        self._result = None
        self._seen: dict[str, int] = {}  # reader -> the run it last got

    def has_fresh(self, reader: str) -> bool:
        """True when `reader` would get a result it has not had, without running anything."""
        return self.runs > 0 and self._seen.get(reader) != self.runs

    def read(self, reader: str, *args, **kwargs):
        """The latest result for `reader`, or a new run's if `reader` has had the latest already
        (or nothing ran yet); args and kwargs go to `run` when it runs."""
        if not self.has_fresh(reader):
            self._result = self.run(*args, **kwargs)
            self.runs += 1
        self._seen[reader] = self.runs
        return self._result

    def reader(self, name: str):
        """`run` as reader `name` reads it (`read`): what a reveal or a chart is given."""
        return lambda *args, **kwargs: self.read(name, *args, **kwargs)


class SharedPoints:
    """`measure(**values)`, each distinct point run once for several readers (`SharedRun` per
    point): lesson 01's answer and its decode slider read the same batch-1 and batch-16 steps,
    lesson 02's answer and its prefill slider the same 512- and 4,096-token prefills, so the
    reveal and the chart (and the growth printed from it) agree. A reader asking again for a
    point it has had (a slider moved back to it) measures it again."""

    def __init__(self, measure):
        self.measure = measure
        self._points: dict[tuple, SharedRun] = {}

    def read(self, reader: str, **values):
        """The point at `values` for `reader` (`SharedRun.read`)."""
        key = tuple(sorted(values.items()))
        if key not in self._points:
            self._points[key] = SharedRun(lambda: self.measure(**values))
        return self._points[key].read(reader)

    def reader(self, name: str):
        """measure(**values) as reader `name` reads it: what a view or a reveal is given."""
        return lambda **values: self.read(name, **values)
