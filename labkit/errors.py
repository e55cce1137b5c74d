"""The lab's user-facing errors: each message says what was wrong and what is allowed.

The CLI turns any `LabError` into one line on stderr and exit code 2; widget callbacks show the
message under the widget. Anything else escaping is a bug in the lab, not in the user's input.
"""


class LabError(ValueError):
    """Bad input or an impossible request, explained in one line."""


class SpecError(LabError):
    """An unknown model/GPU name, a malformed config.json, an out-of-range setting."""


class FootprintError(LabError):
    """A configuration whose predicted memory footprint exceeds what the device has free."""
