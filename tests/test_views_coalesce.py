"""A change made in the browser is measured on the kernel's main thread, and changes a learner makes
faster than the lab measures are measured once, at the newest values.

JupyterLab 4.4 and later send widget messages to a kernel subshell (a thread of ipykernel 7's):
`LessonWidget.on_control` hands them to the main thread's event loop, which waits a moment for the
clicks queued behind a measurement and computes the newest values only. A change made in code is
still computed before the assignment returns."""
import asyncio
import threading
import time

import pytest

pytest.importorskip("ipywidgets")

from jupyter_client.manager import start_new_kernel  # noqa: E402

from labkit import views  # noqa: E402


def browser_update(control, value):
    """What ipywidgets does with a front end's 'update' message (its `_handle_msg`)."""
    control._handle_msg({"content": {"data": {"method": "update", "state": {"value": value}}}})


def browser_pick(control, index: int):
    """What ipywidgets does with a toggle's or a dropdown's 'update': the front end sends its index."""
    control._handle_msg({"content": {"data": {"method": "update", "state": {"index": index}}}})


def counting_widget(computed: list):
    slider = views.int_slider("B", 1, 1, 64, 1)
    return views.LessonWidget({"batch": slider}, [], lambda batch: computed.append(batch) or batch,
                              draw=lambda result: None, describe=lambda result: f"measured B={result}",
                              busy="measuring")


def test_browser_changes_arriving_together_are_computed_once_at_the_newest_value():
    computed = []

    async def clicks():
        widget = counting_widget(computed)  # made in a cell: the kernel's loop is running
        for value in (2, 3, 4, 5):  # queued behind a measurement: handled back to back
            browser_update(widget.controls["batch"], value)
        assert computed == [] and "measuring B = 5 …" in widget.error.widget.value
        await asyncio.sleep(4 * widget.COALESCE_S)
        return widget

    widget = asyncio.run(clicks())
    assert computed == [5] and widget.error.widget.value.endswith("measured B=5</span>")


def test_browser_changes_further_apart_than_the_wait_are_each_computed():
    computed = []

    async def clicks():
        widget = counting_widget(computed)
        for value in (2, 3):
            browser_update(widget.controls["batch"], value)
            await asyncio.sleep(4 * widget.COALESCE_S)

    asyncio.run(clicks())
    assert computed == [2, 3]


def test_a_change_in_code_is_computed_before_the_assignment_returns():
    computed = []

    async def in_a_cell():  # a cell's code runs with the kernel's loop running, as here
        widget = counting_widget(computed)
        widget.controls["batch"].value = 7
        assert computed == [7]
        browser_update(widget.controls["batch"], 9)  # the pin `_sent_by_browser` relies on
        assert computed == [7]
        await asyncio.sleep(4 * widget.COALESCE_S)
        assert computed == [7, 9]

    asyncio.run(in_a_cell())
    widget = counting_widget(computed)  # and with no loop at all (a script, a test)
    browser_update(widget.controls["batch"], 8)
    assert computed == [7, 9, 8]


def test_a_toggle_or_dropdown_picked_in_the_browser_is_coalesced_like_a_slider():
    """A toggle's front end sends its index, and the value follows under ipywidgets' lock on
    `index` only: lesson 04's cache toggle was taken for a change made in code, measured at once
    for every click, none coalesced."""
    computed = []

    async def in_a_cell():
        for control in (views.toggle("cache", ["fp32", "bf16", "int8"], "fp32"),
                        views.widgets.Dropdown(options=["H100-SXM", "H200"], value="H100-SXM")):
            computed.clear()
            widget = views.LessonWidget({"pick": control}, [], lambda pick: computed.append(pick) or pick,
                                        draw=lambda result: None)
            for index in (1, 2, 1):
                browser_pick(control, index % len(control.options))
            assert computed == []  # not yet: the picks wait COALESCE_S for those behind them
            await asyncio.sleep(4 * widget.COALESCE_S)
            assert computed == [control.options[1]]  # once, at the newest pick
            control.value = control.options[0]  # in code: at once, as before
            assert computed == [control.options[1], control.options[0]]

    asyncio.run(in_a_cell())


def test_in_a_real_kernel_browser_changes_sent_to_a_subshell_are_measured_on_the_main_thread():
    """ipykernel 7 as JupyterLab 4.6 drives it: widget updates sent to a subshell (their header
    names it, and ipykernel routes a comm's messages to the subshell that last spoke on it), a 0.5 s
    'measurement', five updates 0.1 s apart. Every measurement runs on the main thread; the first
    is measured, the three that arrive during it are skipped, the newest is measured (one by one
    they would take 2.5 s). A change sent while a cell runs is measured after the cell, not beside
    it; so is a Predict commit clicked then."""
    manager, client = start_new_kernel(kernel_name="python3")
    try:
        comm_id = run(client, (
            "import threading, time\nfrom labkit import views\ncomputed, arrived = [], []\n"
            "def measure(batch):\n"
            "    computed.append((batch, threading.current_thread().name, time.monotonic()))\n"
            "    time.sleep(0.5)\n"
            "slider = views.int_slider('B', 1, 1, 64, 1)\n"
            "slider.observe(lambda change: arrived.append(threading.current_thread().name), names='value')\n"
            "widget = views.LessonWidget({'batch': slider}, [], measure, draw=lambda r: None)\n"
            "print(slider.model_id)"))
        subshell = subshell_of(client)
        for value in (2, 3, 4, 5, 6):
            send_update(client, comm_id, value, subshell)
            time.sleep(0.1)
        time.sleep(1.5)
        assert run(client, "print([b for b, _, _ in computed], {t for _, t, _ in computed})") == "[2, 6] {'MainThread'}"
        assert "subshell" in run(client, "print(arrived)"), "no update reached a subshell: this test tests nothing"

        # a change sent while a cell runs: said at once, measured once the cell has ended
        cell = client.execute("time.sleep(1.5); cell_ended = time.monotonic()")
        time.sleep(0.3)
        send_update(client, comm_id, 9, subshell)
        time.sleep(0.5)
        assert run(client, "print(widget.error.widget.value)", subshell) == (
            "<span style='color:#555'>updating B = 9 once the running cell has finished …</span>")
        time.sleep(2.0)
        wait_idle(client, cell)
        assert run(client, "print(computed[-1][:2], computed[-1][2] >= cell_ended)") == "(9, 'MainThread') True"

        # a Predict commit clicked in the browser: its reveal (a measurement) on the main thread too.
        # ipykernel sends a comm's messages where it last spoke: a button that spoke while a
        # subshell's message was handled (set here by hand, as ipykernel 7.4 records it) gets its
        # clicks on that subshell's thread
        button_id = run(client, (
            "revealed = []\n"
            "def reveal(estimate):\n"
            "    revealed.append(threading.current_thread().name)\n"
            "    return {'question': 'q', 'rows': [], 'gap': ''}\n"
            "ask = views.Predict('How long?', reveal, default=1.0, unit='ms')\n"
            f"ask.input.value = '2'\nask.button.comm._reply_subshell_id = {subshell!r}\n"
            "ask.button.on_click(lambda b: revealed.append('click on ' + threading.current_thread().name))\n"
            "print(ask.button.model_id)"))
        send_click(client, button_id, subshell)
        time.sleep(0.5)
        seen = eval(run(client, "print(revealed)"))
        clicked, reveals = [s for s in seen if s.startswith("click on ")], [s for s in seen if not s.startswith("click on ")]
        assert clicked[0].startswith("click on subshell"), "the click did not reach a subshell: this tests nothing"
        assert reveals == ["MainThread"] and run(client, "print(ask.error.last_error)") == "None"
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def test_in_a_real_kernel_the_first_move_made_while_a_cell_runs_is_said():
    """ipykernel 7.4 sends a comm's incoming messages to the subshell it last spoke from, and a
    control made by a cell last spoke from the main thread: in JupyterLab the first move made
    while a later cell ran waited silently behind that cell (seen in Chromium: three moves during
    a 20 s cell, none said until it ended). The lab's controls are routed by the header, as
    JupyterLab names the subshell in it."""
    manager, client = start_new_kernel(kernel_name="python3")
    try:
        comm_id = run(client, (
            "import time\nfrom labkit import views\nslider = views.int_slider('B', 1, 1, 64, 1)\n"
            "widget = views.LessonWidget({'batch': slider}, [], lambda batch: batch, draw=lambda r: None, "
            "describe=lambda r: f'measured B={r}', busy='measuring')\n"
            "slider.description = 'B'  # the control speaks once more from the main thread, as a cell may\n"
            "print(slider.model_id)"))
        subshell = subshell_of(client)
        cell = client.execute("time.sleep(2.0)")
        time.sleep(0.3)
        send_update(client, comm_id, 9, subshell)  # the control's first message from the browser
        time.sleep(0.5)
        assert run(client, "print(widget.error.widget.value)", subshell) == (
            "<span style='color:#555'>measuring B = 9 once the running cell has finished …</span>")
        wait_idle(client, cell)
        time.sleep(1.0)
        assert "measured B=9" in run(client, "print(widget.error.widget.value)")
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def test_in_a_real_kernel_a_move_says_it_waits_only_when_it_does_and_names_what_for():
    """Said at once, "… once the running cell has finished" flashed on an idle kernel too, before
    "measuring …" replaced it. Now it is said only by a move the main thread has not taken up
    `QUEUED_S` later, naming what runs there: a cell, or another measurement. The held charts'
    "Show it without an estimate" and Predict's commit, clicked while a cell runs, say so too (they
    were silent until it ended)."""
    manager, client = start_new_kernel(kernel_name="python3")
    try:
        comm_id = run(client, (
            "import time\nfrom labkit import views\nslider = views.int_slider('B', 1, 1, 64, 1)\n"
            "widget = views.LessonWidget({'batch': slider}, [], lambda batch: time.sleep(1.0) or batch, "
            "draw=lambda r: None, describe=lambda r: f'measured B={r}', busy='measuring')\n"
            "said = []\nwidget.error.widget.observe(lambda c: said.append(c['new']), names='value')\n"
            "print(slider.model_id)"))
        subshell = subshell_of(client)
        send_update(client, comm_id, 2, subshell)  # the kernel idle
        time.sleep(0.3)
        send_update(client, comm_id, 3, subshell)  # while B = 2 is measured
        time.sleep(0.5)
        assert run(client, "print(said[-1])", subshell) == (
            "<span style='color:#555'>measuring B = 3 once measuring B = 2 has finished …</span>")
        time.sleep(2.0)
        said = eval(run(client, "print(said)"))
        assert said[-1].endswith("measured B=3</span>")
        assert sum("once" in line for line in said) == 1, said  # the move made while idle said none

        # held charts and a Predict commit, clicked while a cell runs
        anyway_id, button_id = run(client, (
            "from labkit.views import base\nheld = base.after_estimate('q-held', 'the chart')\n"
            "ask = views.Predict('How long?', lambda e: {'question': 'q', 'rows': [], 'gap': 'done'}, "
            "default=1.0, unit='ms')\nask.input.value = '2'\n"
            "print(held.children[1].model_id, ask.button.model_id)")).split()
        cell = client.execute("time.sleep(1.5)")
        time.sleep(0.3)
        for model_id in (anyway_id, button_id):
            send_click(client, model_id, subshell)
        time.sleep(0.5)
        assert run(client, "print(held.children[0].value, '|', ask.error.widget.value)", subshell) == (
            "<i>Shown here once the running cell has finished …</i> | "
            "<span style='color:#555'>measuring on this machine once the running cell has finished …</span>")
        wait_idle(client, cell)
        time.sleep(0.5)
        assert run(client, "print(held.children[0].value, '|', ask.answer.value != '', ask.error.widget.value)") == (
            "<pre style='margin:0'>the chart</pre> | True <span style='color:#555'></span>")
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def test_in_a_real_kernel_an_interrupted_browser_measurement_says_so_and_the_next_move_measures():
    manager, client = start_new_kernel(kernel_name="python3")
    try:
        comm_id = run(client, (
            "import time\nfrom labkit import views\nslider = views.int_slider('B', 1, 1, 64, 1)\n"
            "widget = views.LessonWidget({'batch': slider}, [], lambda batch: time.sleep(2) or batch, "
            "draw=lambda r: None, describe=lambda r: f'measured B={r}', busy='measuring')\n"
            "print(slider.model_id)"))
        subshell = subshell_of(client)
        send_update(client, comm_id, 2, subshell)
        time.sleep(0.8)
        manager.interrupt_kernel()  # Kernel > Interrupt
        time.sleep(0.5)
        assert "interrupted: move a control to measure again" in run(client, "print(widget.error.widget.value)")
        send_update(client, comm_id, 3, subshell)
        time.sleep(2.5)
        assert "measured B=3" in run(client, "print(widget.error.widget.value)")
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def test_in_a_real_kernel_an_interrupted_reveal_clicked_in_the_browser_says_so_and_can_commit_again():
    """A Predict's commit clicked in JupyterLab (on a subshell) measures on the main thread's
    event loop, where ipykernel ignores SIGINT: Kernel > Interrupt did nothing for the seconds the
    reveal's measurement took. It stops it, as it stops a slider's."""
    manager, client = start_new_kernel(kernel_name="python3")
    try:
        button_id = run(client, (
            "import time\nfrom labkit import views\n"
            "def reveal(estimate):\n    time.sleep(3)\n    return {'question': 'q', 'rows': [], 'gap': 'done'}\n"
            "ask = views.Predict('How long?', reveal, default=1.0, unit='ms')\nask.input.value = '2'\n"
            "print(ask.button.model_id)"))
        subshell = subshell_of(client)
        run(client, f"ask.button.comm._reply_subshell_id = {subshell!r}")  # as ipykernel 7.4 records a click's thread
        send_click(client, button_id, subshell)
        time.sleep(1.0)
        assert "measuring on this machine" in run(client, "print(ask.error.widget.value)", subshell)
        manager.interrupt_kernel()  # Kernel > Interrupt
        time.sleep(0.5)
        said = run(client, "print(ask.error.widget.value, ask.button.disabled, ask.answer.value == '')", subshell)
        assert "interrupted: commit again to measure" in said and said.endswith("False True"), said
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def test_in_a_real_kernel_an_estimate_and_its_commit_on_subshells_of_their_own_are_handled_in_order():
    """JupyterLab's "one subshell per comm" gives the estimate's text box and the commit button a
    thread each: a click could be committed before the estimate's last keystroke was set, and the
    estimate before it committed instead. Here the text box's thread is still busy when its update
    arrives (a 1.5 s cell on it), and the click is sent to the button's own subshell just after:
    the click must wait behind the update, so 7 is committed, not the 2 typed before."""
    manager, client = start_new_kernel(kernel_name="python3")
    try:
        ids = run(client, (
            "import threading\nfrom labkit import views\n"
            "revealed = []\n"
            "def reveal(estimate):\n"
            "    revealed.append(estimate)\n"
            "    return {'question': 'q', 'rows': [], 'gap': ''}\n"
            "ask = views.Predict('How long?', reveal, default=1.0, unit='ms')\nask.input.value = '2'\n"
            "print(ask.input.model_id, ask.button.model_id)")).split()
        typing, clicking = subshell_of(client), subshell_of(client)
        send_update(client, ids[0], "2", typing)  # an earlier keystroke: the box's comm speaks from its subshell
        time.sleep(0.3)
        busy = client.session.msg("execute_request", {"code": "import time; time.sleep(1.5)", "silent": False,
                                                      "store_history": False, "user_expressions": {}, "allow_stdin": False})
        busy["header"]["subshell_id"] = typing
        client.shell_channel.send(busy)
        time.sleep(0.3)
        send_update(client, ids[0], "7", typing)  # the last keystroke, queued behind the busy cell
        send_click(client, ids[1], clicking)  # the click, sent just after it to its own subshell
        deadline, seen = time.monotonic() + 30, "[]"
        while seen == "[]" and time.monotonic() < deadline:  # the busy cell, then the commit on the main thread
            time.sleep(0.5)
            seen = run(client, "print(revealed)", clicking)
        assert seen == "[7.0]"
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def subshell_of(client) -> str:
    """A new subshell of the kernel (JEP 91's create_subshell_request, as JupyterLab sends)."""
    client.control_channel.send(client.session.msg("create_subshell_request", {}))
    return client.control_channel.get_msg(timeout=30)["content"]["subshell_id"]


def send_click(client, comm_id: str, subshell: str):
    """A button's click as JupyterLab sends it: a custom comm message, to `subshell`."""
    msg = client.session.msg("comm_msg", {"comm_id": comm_id, "data": {
        "method": "custom", "content": {"event": "click"}}})
    msg["header"]["subshell_id"] = subshell
    client.shell_channel.send(msg)


def send_update(client, comm_id: str, value, subshell: str):
    msg = client.session.msg("comm_msg", {"comm_id": comm_id, "data": {
        "method": "update", "state": {"value": value}, "buffer_paths": []}})
    msg["header"]["subshell_id"] = subshell
    client.shell_channel.send(msg)


def wait_idle(client, msg_id: str):
    while True:
        msg = client.get_iopub_msg(timeout=60)
        if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"):
            return


def run(client, code: str, subshell: str | None = None) -> str:
    """Run `code` in the kernel (on `subshell`'s thread if given: while the main thread is busy);
    its printed text (an error fails the test with its traceback)."""
    if subshell is None:
        msg_id = client.execute(code)
    else:
        msg = client.session.msg("execute_request", {"code": code, "silent": False, "store_history": False,
                                                     "user_expressions": {}, "allow_stdin": False})
        msg["header"]["subshell_id"] = subshell
        client.shell_channel.send(msg)
        msg_id = msg["header"]["msg_id"]
    text = []
    while True:
        msg = client.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            text.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            pytest.fail("\n".join(msg["content"]["traceback"]))
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return "".join(text).strip()


def test_a_change_made_in_code_on_another_thread_is_computed_on_the_widgets_thread():
    """A subshell's console setting `.value`: measured on the main thread, once it is free."""
    threads = []

    async def in_a_cell():
        widget = views.LessonWidget({"batch": views.int_slider("B", 1, 1, 64, 1)}, [],
                                    lambda batch: threads.append((batch, threading.current_thread().name)),
                                    draw=lambda result: None)
        other = threading.Thread(target=lambda: setattr(widget.controls["batch"], "value", 11), name="subshell")
        other.start()
        other.join()
        assert threads == []
        await asyncio.sleep(0.05)
        assert threads == [(11, threading.main_thread().name)]

    asyncio.run(in_a_cell())


def interrupted(*args, **kwargs):
    raise KeyboardInterrupt  # what Kernel > Interrupt raises in a measurement


def test_an_interrupted_measurement_says_so_and_the_interrupt_goes_on_to_the_cell():
    widget = views.LessonWidget({"batch": views.int_slider("B", 1, 1, 64, 1)}, [], interrupted,
                                draw=lambda result: None, busy="measuring")
    with pytest.raises(KeyboardInterrupt):
        widget.on_change()
    assert "interrupted: move a control to measure again" in widget.error.widget.value


def test_an_interrupted_reveal_leaves_the_estimate_open_to_commit_again():
    calls = []

    def reveal(estimate):
        calls.append(estimate)
        if len(calls) == 1:
            interrupted()
        return {"question": "q", "rows": [], "gap": "g"}

    ask = views.Predict("How long?", reveal, default=1.0, unit="ms")
    ask.input.value = "2"
    with pytest.raises(KeyboardInterrupt):
        ask.commit()
    assert not ask.button.disabled and not ask.input.disabled
    assert "interrupted: commit again to measure" in ask.error.widget.value
    ask.commit()
    assert calls == [2.0, 2.0] and ask.button.disabled and "<p>g</p>" in ask.answer.value
    # a click made in a cell's code: the interrupt stops that cell, as it would any
    calls.clear()
    clicked = views.Predict("How long?", reveal, default=1.0, unit="ms")
    clicked.input.value = "3"
    with pytest.raises(KeyboardInterrupt):
        clicked.button.click()
    assert calls == [3.0] and not clicked.button.disabled


def test_the_status_line_names_each_control_as_its_label_reads():
    widget = views.LessonWidget({"batch": views.int_slider("batch B", 16, 1, 64),
                                 "context_tokens": views.int_slider("context S", 1024, 16, 4096),
                                 "cache_dtype": views.toggle("cache", ["fp32", "bf16"], "bf16")},
                                [], lambda **values: None, draw=lambda result: None)
    assert widget.setting() == "batch B = 16, context S = 1,024, cache bf16"


@pytest.mark.parametrize("cells, measuring, said", [
    (True, None, ["the running cell"]), (None, None, ["the running cell"]),  # nobody counts: as before
    (True, "measuring B = 2", ["the running cell"]),  # a cell that measures: the call waits for all of it
    (False, "measuring B = 2", ["measuring B = 2"]),
    (False, None, [])])  # between two calls, no cell running: the call is taken up next, nothing said
def test_a_waiting_call_names_what_it_waits_for_or_says_nothing(monkeypatch, cells, measuring, said):
    """A hand-off that landed just after one measurement ended and before the next began said
    "once the running cell has finished" with no cell running."""
    from types import SimpleNamespace
    from labkit.views import base
    monkeypatch.setattr(base, "QUEUED_S", 0.01)
    monkeypatch.setattr(base, "_cells", SimpleNamespace(running=cells))
    monkeypatch.setattr(base, "_RUNNING", [measuring] if measuring else [])
    never_started = SimpleNamespace(call_soon_threadsafe=lambda *args: None)  # a main thread busy throughout
    heard = []
    base._hand_home(never_started, lambda: None, waiting=heard.append)
    time.sleep(0.2)
    assert heard == said


def test_cells_are_counted_by_ipythons_events():
    from labkit.views import base

    class Events:
        def __init__(self):
            self.handlers = {}

        def register(self, name, fn):
            self.handlers[name] = fn

    shell = type("Shell", (), {})()
    shell.events = Events()
    count = base._CellCount()
    assert count.running is None  # outside IPython: unknown
    import IPython
    real = IPython.get_ipython
    try:
        IPython.get_ipython = lambda: shell
        count.track()
    finally:
        IPython.get_ipython = real
    assert count.running is True  # the cell making the widget is running
    shell.events.handlers["post_run_cell"](None)
    assert count.running is False
    shell.events.handlers["pre_run_cell"](None)
    shell.events.handlers["pre_run_cell"](None)  # a subshell's cell beside the main one
    shell.events.handlers["post_run_cell"](None)
    assert count.running is True
    shell.events.handlers["post_run_cell"](None)
    shell.events.handlers["post_run_cell"](None)  # one more end than starts: never below zero
    assert count.running is False


def test_a_click_follows_its_estimate_only_to_a_subshell_that_still_lives(monkeypatch):
    """The commit's message goes where the estimate's last went, unless that subshell is gone
    (JupyterLab deletes a comm's own subshell with the comm): then by its own header, never to a
    thread ipykernel no longer has (it would answer "unknown subshell" and the click be lost)."""
    from types import SimpleNamespace
    from labkit.views import base
    estimate, click = (SimpleNamespace(comm=SimpleNamespace(_reply_subshell_for=None)) for _ in range(2))
    base._routed_in_order(estimate, click)
    route_estimate, route_click = estimate.comm._reply_subshell_for, click.comm._reply_subshell_for
    assert route_click({}, "B") == "B"  # the estimate has sent nothing yet
    assert route_estimate({}, "A") == "A"
    alive = {"A"}
    monkeypatch.setattr(base, "_subshell_lives", lambda subshell: subshell in alive)
    assert route_click({}, "B") == "A" and route_click({}, None) == "A"
    alive.clear()
    assert route_click({}, "B") == "B"
    # the estimate's last update went to the main thread (before its subshell was made): the click
    # follows it there, where it waits behind a running cell but cannot overtake the update
    assert route_estimate({}, None) is None and route_click({}, "B") is None
    monkeypatch.undo()
    route_estimate({}, "A")
    assert route_click({}, "B") == "B"  # outside a kernel nobody can say "A" lives


def test_a_typed_estimate_is_sent_once_when_the_box_loses_focus():
    """ipywidgets holds a keystroke's update while the one before is unanswered, and never holds a
    click: typed "37" then clicked at once, the click could reach the kernel before the "7". Sent on
    losing focus (which pressing the button takes first), the estimate goes out before the click."""
    ask = views.Predict("How long?", lambda estimate: {"question": "q", "rows": [], "gap": ""}, default=1.0, unit="ms")
    assert ask.input.continuous_update is False
