"""The lab's user-facing errors: one line wherever they surface, a notebook cell included."""
import numpy as np
import pytest

from labkit.errors import FootprintError, LabError, SpecError, whole_number


@pytest.mark.parametrize("error", [LabError("batch must be a positive integer, got 0"),
                                   SpecError("unknown GPU 'B200'; known: H100-SXM"),
                                   FootprintError("needs 129 GiB but cpu has 22 GiB free")])
def test_a_notebook_cell_shows_a_lab_error_as_its_one_line(error, capsys):
    """IPython asks an exception for `_render_traceback_` before formatting a traceback: a cell
    that raises one shows its one line (what was wrong, what is allowed), not labkit's frames."""
    InteractiveShell = pytest.importorskip("IPython.core.interactiveshell").InteractiveShell
    shell = InteractiveShell.instance()
    shell.user_ns["error"] = error
    result = shell.run_cell("def deep():\n    raise error\ndeep()")
    assert result.error_in_exec is error
    shown = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert shown == [f"{type(error).__name__}: {error}"]


@pytest.mark.parametrize("value, low, ok", [(1, 1, True), (np.int64(3), 1, True), (0, 0, True), (0, 1, False),
                                            (-1, 0, False), (2.0, 1, False), (True, 1, False), ("3", 1, False),
                                            (None, 1, False)])
def test_whole_number_takes_integers_from_low_up(value, low, ok):
    if ok:
        assert whole_number("batch", value, low) == value and type(whole_number("batch", value, low)) is int
    else:
        what = "a positive integer" if low == 1 else f"an integer >= {low}"
        with pytest.raises(LabError, match=rf"^batch must be {what}, got "):
            whole_number("batch", value, low)
