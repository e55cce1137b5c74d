"""What every view is built of: the colours, a live chart (`LiveFigure`), the error line, the one
widget base (`LessonWidget`) and the predict-first widget, and the controls (sliders, toggles, a
progress bar, tables)."""
from __future__ import annotations

import asyncio
import contextlib
import html
import json
import math
import numbers
import signal
import threading

from .. import estimates, explore
from ._plotly import go, pio, widgets
from ..errors import LabError

# ---- plumbing: a live chart, the error line, the one widget base, controls
PREDICTED = dict(color="#1f77b4")
MEASURED = dict(color="#d62728")
NOISY = dict(color="#ff9896")

# The chapter's planning line is a convention, not this machine's roof: grey and dash-dotted, so it
# is never taken for the blue dashed line of a prediction's linear term (lesson 02).
PLAN = dict(color="#555555", dash="dashdot", width=1.5)
IN_TURN = dict(color=PREDICTED["color"], dash="dot", width=2.5)
TIER = dict(color="#7f7f7f", dash="dot", width=1)

ATTENTION = dict(color="#ff7f0e")
LINEAR = dict(color="#1f77b4")


class LiveFigure(go.Figure):
    """A plotly figure shown live: `.widget` (an ipywidgets Output) is redrawn, whole, after every
    change plotly reports (a batch update, an added trace, a relayout). Display `.widget`, or the
    figure itself, which shows the same widget.

    Why not plotly's FigureWidget: it is an anywidget whose 5 MB front-end module is compiled once
    per chart, and anywidget 0.11 gives each chart 2 s to become ready; a chart that misses that
    drops every later update for good (manzt/anywidget#828 added the deadline). A Voilà page, or
    JupyterLab reopening a notebook, creates all its charts at once, so on a 2-core machine the
    second chart missed it and never redrew when its slider moved. Here the whole figure (a few kB)
    goes to the plotly renderer that draws every other chart: no per-chart module, no deadline,
    no deltas to lose, and a page that loads late still gets the current figure.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._output = widgets.Output()
        self._shown = False  # nothing is sent to a front end until the widget is asked for

    @property
    def widget(self) -> widgets.Output:
        if not self._shown:
            self._shown = True
            self._redraw()
        return self._output

    def _repr_mimebundle_(self, include=None, exclude=None, **kwargs):
        return self.widget._repr_mimebundle_(include=include, exclude=exclude, **kwargs)

    def mime_bundle(self) -> dict:
        """What the Output shows: plotly's JSON mime type, and the title as plain text."""
        return {"application/vnd.plotly.v1+json": json.loads(pio.to_json(self, validate=False, remove_uids=False)),
                "text/plain": f"<chart: {self.layout.title.text or 'untitled'}>"}

    def _redraw(self):
        if not getattr(self, "_shown", False):  # still being built, or not displayed yet
            return
        # The Output keeps its height while the new chart renders, so the page does not jump.
        self._output.layout.min_height = f"{self.layout.height or 450}px"
        self._output.outputs = ({"output_type": "display_data", "data": self.mime_bundle(), "metadata": {}},)

    # plotly calls these after applying each change (a FigureWidget forwards them to its views).
    def _send_addTraces_msg(self, *args, **kwargs):
        self._redraw()

    _send_moveTraces_msg = _send_deleteTraces_msg = _send_restyle_msg = _send_addTraces_msg
    _send_relayout_msg = _send_update_msg = _send_animate_msg = _send_addTraces_msg


class ErrorLine:
    """An HTML line under a widget: a status while measuring, the message when something fails."""

    def __init__(self):
        self.widget = widgets.HTML("").add_class("labkit-status")  # the browser tests read held status lines

    def status(self, text: str):
        """`text` in grey; each of its lines ("\\n") on a line of its own."""
        lines = "<br>".join(html.escape(line) for line in text.split("\n"))
        self.widget.value = f"<span style='color:#555'>{lines}</span>"

    @contextlib.contextmanager
    def guard(self):
        """Run a callback; any error becomes one red line here and the kernel keeps running."""
        try:
            yield
        except Exception as err:  # noqa: BLE001 — a learner's slider must never kill the kernel
            kind = "" if isinstance(err, ValueError) else f"{type(err).__name__}: "
            self.widget.value = f"<span style='color:#b00'>⚠ {html.escape(kind + str(err))}</span>"
            self.last_error = err
        else:
            self.last_error = None


class LessonWidget:
    """The one shape of every lesson widget: controls in, one labkit call per change, figures out,
    the error line under the charts, and a status line.

        compute(**values) -> result   one labkit call (a measurement, a simulation, a prediction),
                                      with the controls' values by name
        draw(result)                  puts the result into the figures (set_* functions: no arithmetic)
        describe(result) -> str       the status line after a change ("" for none)

    `busy`, when given, is shown while `compute` runs ("measuring" for a real measurement, which
    takes seconds). Controls with `continuous_update` fire only when released: each change may run
    a real measurement. Any error becomes one red line under the charts and the kernel lives on.

    A change made in the browser is computed on the kernel's main thread, `COALESCE_S` later
    (`on_control`). On the main thread: JupyterLab 4.4 and later send widget messages to a kernel
    subshell, a thread of its own (ipykernel 7), where a measurement would run beside a cell's, and
    where a CPU decode step ran slow (lab-cpu, B = 4 on the 2-core EPYC: 2x on a second thread of
    a script; in JupyterLab, once lesson 04's slider had measured there, 1.5x for every later step
    of that kernel, main thread too: numba's OpenMP runtime, given a second team of threads for
    that thread, has more threads than cores and stops spinning between kernels, see
    `labkit/__init__.py`). Later: clicks made while a measurement ran (a toggle tried
    four ways, a slider stepped with the arrow keys) arrive together when it ends, and only the
    newest values are measured, not every step in turn. A change made in a cell's code (a test, a
    cell setting `.value`) is computed before the assignment returns, as it always was. A move made
    while a cell runs is said `QUEUED_S` later and measured after it (`_routed_by_header`: the first one too).
    """

    COALESCE_S = 0.05  # the changes queued behind a measurement all arrive within this (ms apart)

    def __init__(self, controls: dict, figures: list, compute, draw, describe=lambda result: "",
                 busy: str | None = None):
        self.controls, self.figures = controls, figures
        self.compute, self.draw, self.describe, self.busy = compute, draw, describe, busy
        self.result = None
        self._home = _running_loop()  # the main thread's event loop in a kernel (a cell makes the widget)
        self._home_thread = threading.get_ident()
        if self._home is not None:
            _cells.track()
        self._pending = None  # the timer of a browser change not computed yet
        self.error = ErrorLine()
        for control in controls.values():
            if hasattr(control, "continuous_update"):
                control.continuous_update = False
            control.observe(self.on_control, names="value")
            _routed_by_header(control)
        # The controls wrap as whole widgets: two 420 px sliders and a toggle overflow a notebook's
        # ~960 px output, and unwrapped the toggle was squeezed until its own buttons broke a line.
        row = widgets.HBox(list(controls.values()), layout=widgets.Layout(flex_flow="row wrap"))
        self.widget = widgets.VBox([row, *(f.widget for f in figures), self.error.widget])

    def values(self) -> dict:
        return {name: control.value for name, control in self.controls.items()}

    def setting(self, values: dict | None = None) -> str:
        """The controls' values (or `values`, by control name) as the learner reads them: "batch B =
        16, context S = 1,024, cache bf16"."""
        def one(name, control):
            label = getattr(control, "description", "") or name
            value = control.value if values is None else values.get(name, control.value)
            if isinstance(value, numbers.Number) and not isinstance(value, bool):
                return f"{label} = {value:,}"
            return f"{label} {value}"
        return ", ".join(one(name, control) for name, control in self.controls.items())

    def on_control(self, change):
        """Every control's observer: a change sent by the browser goes to the main thread, waits
        `COALESCE_S` there for those queued behind it (each restarts the wait), then `on_change` runs
        once at the newest values. A change made in code runs `on_change` on the main thread: now
        from a cell (or outside a kernel), after the running cell from another thread (a subshell's
        console)."""
        if self._home is None:  # outside a kernel: a script, a test
            self.on_change(change)
            return
        # A move that waits in silence behind a running cell (a Run All still going) reads as a
        # slider that does nothing: said once it has waited QUEUED_S, and only then (said at once,
        # it flashed "… once the running cell has finished" on an idle kernel too).
        self.at_home(self._coalesce if _sent_by_browser(change["owner"], change["name"]) else self.on_change,
                     waiting=lambda ahead: self.error.status(
                         f"{self.busy or 'updating'} {self.setting()} once {ahead} has finished …"))

    def at_home(self, call, waiting=None):
        """Run `call()` on the thread that made this widget: now if this is it (or there is no
        event loop to hand it to), else as soon as that thread's event loop is free (after the cell
        it runs, if any: a measurement never runs beside another), where an interrupt still stops
        it (`_interruptibly`). Called now, an interrupt goes on to the cell or handler that called.
        Handed on, `waiting(ahead)` says so if the call has not started `QUEUED_S` later, `ahead`
        naming what runs there ("the running cell", "measuring B = 4")."""
        _at_home(self._home, self._home_thread, call, waiting)

    def _coalesce(self):
        if self._pending is not None:
            self._pending.cancel()
        if self.busy:
            self.error.status(f"{self.busy} {self.setting()} …")
        self._pending = self._home.call_later(self.COALESCE_S, self._run_pending)

    def _run_pending(self):
        self._pending = None
        _interruptibly(self.on_change)

    def on_change(self, _change=None):
        """Control callback: compute once at the controls' values, draw, say what happened. An
        interrupt (Kernel > Interrupt) is said in the status line, then raised on to whoever called
        (a cell stops; ipykernel's handler or `_run_pending` takes it)."""
        doing = f"{self.busy or 'updating'} {self.setting()}"
        if self.busy:
            self.error.status(f"{doing} …")
        try:
            with self.error.guard(), _running(doing):
                self.result = self.compute(**self.values())
                self.draw(self.result)
                self.error.status(self.describe(self.result))
        except KeyboardInterrupt:
            self.error.status("interrupted: move a control to measure again")
            raise

    def prime(self, settings: list[dict]):
        """Compute, then draw, a first few settings (with a progress bar), so a chart starts with
        points on it; the controls keep their own values.

        All are measured before any is drawn, the last (in a sweep, the longest) first: a chart
        redrawn in the browser while the next point is timed, or the cells above still drawing
        when the first is, took the same 2 cores, and the shortest call suffers most (lesson 02's
        512-token prefill timed 2x slow, confirmed, in a 2-core browser run)."""
        bar, advance = progress(len(settings))
        self.widget.children = (*self.widget.children, bar)
        results = {}
        for done, index in enumerate(reversed(range(len(settings))), start=1):
            with self.error.guard():
                results[index] = self.compute(**settings[index])
            advance(done, len(settings))
        for index in sorted(results):
            with self.error.guard():
                self.result = results[index]
                self.draw(self.result)
        if results and self.error.last_error is None:  # the last point's line, as after a move (was empty)
            with self.error.guard():  # named: the control still shows its own value, not this point's
                last = settings[max(results)]
                self.error.status(f"{len(results)} points measured; the last, {self.setting(last)}: "
                                  f"{self.describe(self.result)}")
        self.widget.children = self.widget.children[:-1]


def _routed_by_header(widget):
    """Let the browser's messages for `widget` reach the thread their header names. ipykernel 7.4
    sends a comm's incoming messages to the subshell it last spoke from: a control made by a cell
    last spoke from the main thread, so its first move in JupyterLab (which sends every widget
    message to a subshell, unless its "Kernel Comms over subshells" setting is off) waited behind
    whatever cell ran then, in silence, and only the moves after it reached the subshell. Measured
    in Chromium with JupyterLab 4.6.6 and ipykernel 7.4.0, a 20 s cell running: three moves, none
    said until the cell ended. Routed by their header, the moves reach `on_control` at once on the
    subshell, which hands them to the main thread and says, if they wait there, what for
    (`_hand_home`; Voilà sends no subshell: the main thread, as before). What the routing is for,
    a reply to a request with an id, these controls never receive. Where ipykernel has no such
    routing (before 7.4) there is nothing to undo."""
    comm = getattr(widget, "comm", None)
    if comm is not None and hasattr(comm, "_reply_subshell_for"):
        comm._reply_subshell_for = lambda _data, named: named


def _routed_in_order(first, then):
    """Route `first`'s messages by their header (`_routed_by_header`) and `then`'s to the thread
    `first`'s last message went to, while it lives: a Predict's estimate and its commit click are
    then handled in the order the kernel received them. With JupyterLab's default (a subshell per
    comm target) both name one subshell anyway; with its "one subshell per comm" setting each names
    its own thread, and a click could be committed before the estimate's last update had been set,
    the estimate before it committed instead. ipykernel routes every incoming message on one thread,
    in arrival order, so the click queued behind the update is handled after it. An estimate whose
    last update went to the main thread (sent before JupyterLab had made its comm's subshell) takes
    the click there too: after a running cell, but in order. (That the browser sends the update
    before the click is the Predict's `Text`'s part: it sends its value when it loses focus.)"""
    unsent = object()
    last = {"thread": unsent}

    def route_first(_data, named):
        last["thread"] = named
        return named

    def route_then(_data, named):
        held = last["thread"]
        if held is unsent or held == named:
            return named
        return held if held is None or _subshell_lives(held) else named

    for control, route in ((first, route_first), (then, route_then)):
        comm = getattr(control, "comm", None)
        if comm is not None and hasattr(comm, "_reply_subshell_for"):
            comm._reply_subshell_for = route


def _subshell_lives(subshell_id: str) -> bool:
    """Whether this kernel still has the subshell (JupyterLab deletes a comm's own subshell with the
    comm); False where that cannot be asked, so a message is never sent to a thread that is gone."""
    try:
        # imported here: a script has no kernel to ask (Voilà has one, and sends no subshells)
        from ipykernel.kernelbase import Kernel
        return Kernel.initialized() and subshell_id in Kernel.instance().shell_channel_thread.manager.list_subshell()
    except Exception:  # noqa: BLE001 - no kernel, no subshells, another ipykernel: route by the header
        return False


QUEUED_S = 0.15  # a call handed to an idle main thread starts within ms; one not started by now waits


# What the main thread is computing for a widget now, innermost last ("measuring B = 4"): a move
# handed to it meanwhile waits for that, not for a cell.
_RUNNING: list[str] = []


@contextlib.contextmanager
def _running(doing: str):
    on_main = threading.current_thread() is threading.main_thread()
    if on_main:
        _RUNNING.append(doing)
    try:
        yield
    finally:
        if on_main:
            _RUNNING.pop()


class _CellCount:
    """How many cells the kernel runs now, by IPython's pre_run_cell and post_run_cell events (a
    subshell's cell counts too: it runs beside the main thread's). `running`: True, False, or
    None where nobody counts (outside IPython). Without it, a hand-off landing just after one
    measurement ended and before the next began said "once the running cell has finished" with
    no cell running."""

    def __init__(self):
        self._lock, self._count, self._shell = threading.Lock(), 0, None

    def track(self):
        """Count the cells of the IPython shell this runs in, once (a no-op outside IPython). Called
        from the cell that makes a widget: that cell counts as running (its pre_run_cell has passed,
        and its own measurements, a `prime`, may keep it going for seconds)."""
        try:
            from IPython import get_ipython  # the kernel's shell; absent outside Jupyter
        except ImportError:
            return
        shell = get_ipython()
        if shell is None or shell is self._shell:
            return
        self._shell, self._count = shell, 1
        shell.events.register("pre_run_cell", self._began)
        shell.events.register("post_run_cell", self._ended)

    def _began(self, _info=None):
        with self._lock:
            self._count += 1

    def _ended(self, _result=None):
        with self._lock:
            self._count = max(self._count - 1, 0)

    @property
    def running(self):
        return None if self._shell is None else self._count > 0


_cells = _CellCount()


def _at_home(loop, home_thread: int, call, waiting=None):
    """`call()` now on the home thread (or with no `loop` to hand it to), else `_hand_home`."""
    if loop is None or threading.get_ident() == home_thread:
        call()
    else:
        _hand_home(loop, call, waiting)


def _hand_home(loop, call, waiting=None):
    """Post `call()` to the main thread's event `loop`, interruptibly. If it has not started
    `QUEUED_S` later, `waiting(ahead)` runs here (a timer thread), where `ahead` is what the main
    thread is busy with: the innermost `_running` measurement, else "the running cell". A lock
    orders the two, so `waiting` never writes over what `call` has begun to say."""
    lock, started = threading.Lock(), []

    def start():
        with lock:
            started.append(True)
        _interruptibly(call)

    def check():
        with lock:
            if not started:
                ahead, cells = _RUNNING[-1:], _cells.running  # a slice: the main thread may pop it meanwhile
                if cells:  # a cell runs (one that measures too): the call waits for all of it
                    waiting("the running cell")
                elif ahead:  # a measurement started by the browser, or a commit
                    waiting(ahead[0])
                elif cells is None:  # nobody counts cells (outside IPython): as before
                    waiting("the running cell")
                # else the main thread is between two calls and takes this one up next: nothing to say

    loop.call_soon_threadsafe(start)
    if waiting is not None:
        timer = threading.Timer(QUEUED_S, check)
        timer.daemon = True
        timer.start()


def _interruptibly(call):
    """`call()` (a measurement) from the event loop. Outside a message's handler ipykernel ignores
    SIGINT, so Kernel > Interrupt would do nothing for the seconds a measurement takes: it is made
    to raise here, as in a handler; `call` says so in its status line, and the interrupt goes no
    further (the event loop has nothing more to stop). The kernel's own handler is put back even
    if a second interrupt lands while it is (an interrupt escaping into the event loop would end
    the kernel); one that Python cannot read back (None) is left alone, measurement uninterruptible."""
    before = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    swapped = False
    try:
        if before is not None:  # inside the try: an interrupt just after it still ends here
            signal.signal(signal.SIGINT, signal.default_int_handler)
            swapped = True
        call()
    except KeyboardInterrupt:
        pass
    finally:
        while swapped:
            try:
                signal.signal(signal.SIGINT, before)
                swapped = False
            except KeyboardInterrupt:
                pass


def _running_loop():
    """The event loop running this call (ipykernel's, inside a kernel), or None (a script, a test)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _sent_by_browser(control, name: str) -> bool:
    """Whether `control.name` is changing because the browser said so: ipywidgets (8.1) applies a
    front end's update under `_property_lock` holding the names it sets, and an assignment in code
    holds none. A toggle, a dropdown or radio buttons send their `index`, and their `value` follows
    it under that lock (lesson 04's cache toggle was taken for a change in code: each click measured
    in turn, not coalesced, and Kernel > Interrupt could not stop it). tests/test_views_coalesce.py
    pins this, so an ipywidgets that changes it fails there."""
    lock = getattr(control, "_property_lock", {})
    return name in lock or (name in ("value", "label") and "index" in lock)


class Predict(LessonWidget):
    """Predict first: the learner commits an estimate — a number in `unit`, or one of `options` —
    and only then does `reveal(estimate)` (one labkit call, a `predict.reveal_*` function) compute
    the formula's answer and measure; the reveal shows the three side by side with one line on the
    gap. The estimate is locked once committed.

    A run with nobody at the keyboard (LABKIT_AUTO_REVEAL=1: nbval, papermill, `make report`)
    commits `default`, the estimate recorded in `predict.DEFAULTS`, so every reveal executes, and
    the reveal calls it a sample estimate, not the reader's.

    `name` (`predict.ask` gives it) opens what `after_estimate(name, ...)` holds back below."""

    def __init__(self, question: str, reveal, default, unit: str | None = None, options: list | None = None,
                 name: str | None = None):
        if options:
            self.input = widgets.RadioButtons(options=list(options), value=None, layout=widgets.Layout(width="auto"))
        else:
            # Its value is sent once, when it loses focus (pressing the commit button takes the focus
            # first), not a message a keystroke: ipywidgets holds a keystroke's update while the one
            # before is unanswered, and the click, never held, could reach the kernel before it.
            self.input = widgets.Text(placeholder=f"your estimate ({unit})", layout=widgets.Layout(width="220px"),
                                      continuous_update=False)
        self.unit, self.default = unit, default
        self.button = widgets.Button(description="Commit, then measure", button_style="primary",
                                     layout=widgets.Layout(width="auto"))
        self.answer = widgets.HTML("")
        super().__init__({}, [], reveal, self.show, busy=None)
        self.question = question
        self.name, self.auto = name, estimates.unattended()
        # Kept answers (`estimates`): said before, by date only, so the question is still asked first.
        self.kept = name is not None and not self.auto
        before = estimates.earlier(name) if self.kept else []
        asked = f"<b>Question.</b> {html.escape(question)}"
        if before:
            asked += (f"<br><i>You answered this {_times(len(before))} before, last on {estimates.local_date(before[-1])}; "
                      f"your answers are kept in {html.escape(str(estimates.journal_path()))}.</i>")
        self.widget = widgets.VBox([widgets.HTML(asked),
                                    widgets.HBox([self.input, self.button]), self.answer, self.error.widget])
        self.widget.add_class("labkit-predict")
        self.button.on_click(self._clicked)
        # The estimate's text, then the click, handled in the order they were sent (`_routed_in_order`).
        _routed_in_order(self.input, self.button)
        if self.auto:
            self.input.value = default if options else f"{default:g}"
            self.commit()

    def _clicked(self, _button):
        """A click (the browser's, or `button.click()` in a cell): committed on the main thread. One queued behind a commit
        already made (a double click) is dropped here, where its wait would be said over that
        commit's "measuring" line."""
        if self.button.disabled:
            return
        self.at_home(self.commit, waiting=lambda ahead: self.error.status(
            f"measuring on this machine once {ahead} has finished …"))

    def estimate(self):
        """The committed value: the chosen option, or the typed number (LabError-free: ValueError
        with what was expected, shown as the red line)."""
        if self.unit is None:
            if self.input.value is None:
                raise ValueError("pick one of the options first")
            return self.input.value
        text = self.input.value.strip().replace(",", "").rstrip("×x%").strip()
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"type a number ({self.unit}), e.g. {self.default:g}; got {self.input.value!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"type a positive number ({self.unit}); got {self.input.value!r}")
        return value

    def commit(self):
        """Lock the estimate, measure, reveal. A bad estimate, or an interrupted measurement (Kernel >
        Interrupt: said, then raised on), leaves the widget open to try again; a commit after the
        first (a double click queued behind a cell) does nothing."""
        if self.button.disabled:
            return
        try:
            with self.error.guard():
                estimate = self.estimate()
                self.input.disabled = self.button.disabled = True
                self.error.status("measuring on this machine …")
                with _running("checking an estimate"):
                    self.result = self.compute(estimate)
                    self.draw(self.result)
                kept = self._keep(estimate)  # before anything else can be interrupted
                if self.name is not None:
                    _estimate_committed(self.name)
                self.error.status(kept)
        except KeyboardInterrupt:
            if self.answer.value:  # already revealed: committed, whatever the interrupt stopped after it
                if self.name is not None and self.name not in _COMMITTED:
                    _estimate_committed(self.name)
                self.error.status("interrupted after the reveal: this answer may not have been kept")
            else:
                self.input.disabled = self.button.disabled = False
                self.error.status("interrupted: commit again to measure")
            raise
        if self.error.last_error is not None and not self.answer.value:
            self.input.disabled = self.button.disabled = False

    def _keep(self, estimate) -> str:
        """Append the committed estimate and its reveal to the learner's journal (`estimates`);
        the status line: "" when kept (or nothing is to be kept), else why not."""
        if not self.kept:
            return ""
        try:
            estimates.record(estimates.entry(self.name, self.question, estimate, self.unit, self.result,
                                             seen_first=self.name in _SEEN_FIRST))
        except OSError as err:
            return f"shown, but not kept in {estimates.journal_path()}: {err.strerror or err}"
        return ""

    def show(self, reveal: dict):
        if self.auto:  # nobody typed it: a report's reader must not take it for theirs
            reveal = explore.as_sample(reveal)
        rows, gap = reveal["rows"], reveal["gap"]
        # read before this answer is kept: the earlier ones to this very comparison (a question
        # asked at other settings compares something else), in a paragraph of their own
        earlier = estimates.earlier_sentence(estimates.earlier(self.name, compared=reveal["question"])) \
            if self.kept else ""
        rows = "".join(f"<tr><td style='padding:2px 12px 2px 0'>{html.escape(name)}</td>"
                       f"<td style='padding:2px 0'><b>{html.escape(str(value))}</b></td></tr>"
                       for name, value in rows)
        self.answer.value = (f"<div><em>{html.escape(reveal['question'])}</em><table>{rows}</table>"
                             f"<p>{html.escape(gap)}</p>"
                             + (f"<p style='color:#555'>{html.escape(earlier)}</p>" if earlier else "") + "</div>")


def _times(count: int) -> str:
    return {1: "once", 2: "twice"}.get(count, f"{count:,} times")


# Predict first, kept: the questions whose estimate this kernel has committed, and the boxes
# `after_estimate` holds back until it is. A Run All, or a Voila page, runs every cell at once, and
# lesson 01's chart drew the measured answer under the still unanswered question.
_COMMITTED: set[str] = set()
_HELD: dict[str, list] = {}
_SEEN_FIRST: set[str] = set()  # questions whose held answer was shown before any estimate (kept with it)


def after_estimate(question: str, *items) -> widgets.VBox:
    """`items` (widgets, `LiveFigure`s, or text shown as printed) in a box that shows them once the
    estimate for `question` (a `predict.ask` name) is committed above; until then one line asks for
    it, beside a button that shows them anyway (a question skipped, or a kernel restarted below it).
    The measurement behind them runs either way: the cells below may need it."""
    shown = tuple(_as_widget(item) for item in items)
    if question in _COMMITTED:
        return widgets.VBox(shown).add_class("labkit-held")
    anyway = widgets.Button(description="Show it without an estimate", layout=widgets.Layout(width="auto"))
    anyway.add_class("labkit-show-anyway")
    asking = widgets.HTML("<i>Commit your estimate above, and this measurement is shown here.</i>")
    box = widgets.VBox([asking, anyway])
    box.add_class("labkit-held")  # the browser tests read held text (`pre`) once the estimate is in
    home, home_thread = _running_loop(), threading.get_ident()
    if home is not None:
        _cells.track()

    def open_box(_button=None):
        box.children = shown

    def shown_anyway():
        _SEEN_FIRST.add(question)  # an estimate committed after this saw the answer first
        open_box()

    # Opened on the main thread, which draws the charts it shows; a click made while a cell runs
    # says, once it has waited QUEUED_S, what it waits for (it was silent until the cell ended).
    anyway.on_click(lambda _button: _at_home(home, home_thread, shown_anyway, waiting=lambda ahead: setattr(
        asking, "value", f"<i>Shown here once {html.escape(ahead)} has finished …</i>")))
    _routed_by_header(anyway)
    _HELD.setdefault(question, []).append(open_box)
    return box


def _estimate_committed(question: str):
    _COMMITTED.add(question)
    for open_box in _HELD.pop(question, []):
        open_box()


def _as_widget(item):
    """A widget as is; a `LiveFigure` as its widget; text as a printed line."""
    if isinstance(item, widgets.Widget):
        return item
    if isinstance(item, str):
        return widgets.HTML(f"<pre style='margin:0'>{html.escape(item)}</pre>")
    return item.widget


def int_slider(name: str, value: int, low: int, high: int, step: int = 1) -> widgets.IntSlider:
    """An integer slider that only fires on release (each move runs a real measurement). A start
    outside low..high is refused (LabError), not clamped: the lesson's first chart is drawn at the
    start value, and a clamped slider would sit at another one beside it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= value <= high:
        raise LabError(f"{name} must start at a whole number in {low:,}..{high:,}, got {value!r}")
    return widgets.IntSlider(value=value, min=low, max=high, step=step, description=name,
                             continuous_update=False, style={"description_width": "initial"},
                             layout=widgets.Layout(width="420px"))


def toggle(name: str, options: list, value=None) -> widgets.ToggleButtons:
    """Toggle buttons (a choice fires once per click)."""
    # width auto: the default fixed inline width put the buttons on a line below their name
    return widgets.ToggleButtons(options=options, value=value or options[0], description=name,
                                 style={"description_width": "initial", "button_width": "auto"},
                                 layout=widgets.Layout(width="auto"))


def progress(total: int, description: str = "measuring"):
    """An IntProgress bar and a `progress(done, total)` callback that moves it (for sweeps)."""
    bar = widgets.IntProgress(value=0, min=0, max=total, description=description,
                              style={"description_width": "initial"})

    def advance(done, total):
        bar.max, bar.value = total, done
    return bar, advance


def table_html(rows: list[dict]) -> str:
    """A list of flat dicts as an HTML table (keys as the header), every value escaped."""
    cell = "text-align:left;padding:2px 8px"
    head = "".join(f"<th style='{cell}'>{html.escape(str(k))}</th>" for k in rows[0])
    body = "".join("<tr>" + "".join(f"<td style='{cell}'>{html.escape(str(v))}</td>" for v in row.values())
                   + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def table(rows: list[dict]) -> widgets.HTML:
    """`table_html` as a widget: a view can set its `.value` again when its rows change."""
    return widgets.HTML(table_html(rows))
