"""The step's timer hook: seconds accumulated per category inside a real prefill or decode step.

    clock = Clock()
    model.clock = clock                          # the model's code paths time their parts on it
    with clock.time("products"): y = x @ w       # a part that runs inline
    mm = clock.timed("products", mm)             # or a callable whose every call is a part
    clock.seconds                                # {"products": 0.0031, "attention": ..., "other": ...}

`OFF`, every model's default, times nothing: `OFF.time(c)` is one shared do-nothing context and
`OFF.timed(c, fn)` is `fn` itself, so a step that is not being broken down runs the same calls,
at a few tenths of a microsecond per `with`. `CALL_BY_CALL` times nothing too, and keeps a step
that could run as one compiled call (`cpu_step`) in its separate, bracketable calls.

Why a hook and not a profiler: the lab's claim is about *this* step's parts as they ran, each
bracketed by `time.perf_counter` around the real call; what the brackets leave out (Python
between the calls, dispatch, thread hand-offs) is the step's overhead, measured by timing the
same step without the hook (`labkit.breakdown`). Parts never nest: a part opened inside another
would count its seconds twice, so the clock refuses it.

Host time only: on CUDA a bracket would time the kernel launch, not the GPU's work, so
`labkit.breakdown` refuses CUDA rather than report launch times as kernel times.
"""
from __future__ import annotations

import time

from .errors import LabError

# The parts of a step: the weight matrices' products, attention, and everything else the layers
# do (norms, RoPE, SiLU, residual adds, cache writes, the embedding gather).
CATEGORIES = ("products", "attention", "other")


class _Part:
    """One category's bracket: perf_counter at enter, the difference added to the clock at exit."""

    __slots__ = ("clock", "category", "start_s")

    def __init__(self, clock: Clock, category: str):
        self.clock, self.category, self.start_s = clock, category, 0.0

    def __enter__(self):
        if self.clock.open is not None:
            raise LabError(f"timer part {self.category!r} opened inside {self.clock.open!r}: parts never nest")
        self.clock.open = self.category
        self.start_s = time.perf_counter()

    def __exit__(self, *exc):
        self.clock.seconds[self.category] += time.perf_counter() - self.start_s
        self.clock.open = None


class Clock:
    """Seconds per category (`CATEGORIES`), summed over every part timed since it was made."""

    enabled = True

    def __init__(self):
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)
        self.open: str | None = None  # the category whose part is running
        self._parts = {c: _Part(self, c) for c in CATEGORIES}

    def time(self, category: str) -> _Part:
        """A context that adds the seconds of its body to `category`."""
        try:
            return self._parts[category]
        except KeyError:
            raise LabError(f"timer category {category!r} unknown; known: {', '.join(CATEGORIES)}") from None

    def timed(self, category: str, fn):
        """`fn` with each call timed as a part of `category`."""
        part = self.time(category)

        def call(*args, **kwargs):
            with part:
                return fn(*args, **kwargs)
        return call


class _NoPart:
    """The do-nothing context `OFF.time` returns."""

    __slots__ = ()

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


class _Off:
    """The clock of a step nobody is breaking down: nothing is timed, nothing is wrapped."""

    enabled = False
    _NOTHING = _NoPart()

    def time(self, category: str) -> _NoPart:
        return self._NOTHING

    def timed(self, category: str, fn):
        return fn


OFF = _Off()
# Times nothing either, but asks for the step as separate calls: the CPU decode step otherwise runs
# as one compiled call (`cpu_step`), which has no parts to bracket. `labkit.breakdown` times its
# whole step under this clock, so the whole and the timed run are the same calls.
CALL_BY_CALL = _Off()
