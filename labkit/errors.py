"""The lab's user-facing errors: each message says what was wrong and what is allowed.

The CLI turns any `LabError` into one line on stderr and exit code 2; widget callbacks show the
message under the widget; a notebook cell shows the one line too (`_render_traceback_`). Anything
else escaping is a bug in the lab, not in the user's input.
"""
import numbers


class LabError(ValueError):
    """Bad input or an impossible request, explained in one line."""

    def _render_traceback_(self) -> list[str]:
        """What IPython (a notebook cell, papermill, nbval) shows for it: its one line, not a
        traceback through labkit's code to the line that raised it (IPython asks any exception for
        this method before it formats a traceback)."""
        return [f"{type(self).__name__}: {self}"]


class SpecError(LabError):
    """An unknown model/GPU name, a malformed config.json, an out-of-range setting."""


class FootprintError(LabError):
    """A configuration whose predicted memory footprint exceeds what the device has free."""


def whole_number(name: str, value, low: int = 1, error: type[LabError] = LabError) -> int:
    """`value` if it is an integer (not a bool; numpy's count) of at least `low`, as an int; else
    `error` naming `name`, what it must be and what it got (a notebook's parameter, a slider's
    value; a spec's field raises SpecError)."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
        what = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise error(f"{name} must be {what}, got {value!r}")
    return int(value)
