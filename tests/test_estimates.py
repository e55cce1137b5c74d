"""The learner's committed estimates are kept (labkit.estimates): a widget's state died with its
kernel, and a notebook reopened the next day showed an empty box where the estimate and its reveal
had been. The journal is only ever appended to."""
from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from labkit import cli, estimates, explore

ROOT = Path(__file__).resolve().parent.parent


def shown(estimate=12.0, measured=9.7):
    return explore.reveal("a ratio", "×", estimate, 15.9, measured, "a CPU", "a reason")


def test_the_session_keeps_estimates_in_a_private_folder():
    path = estimates.journal_path()
    assert path.parent == Path(os.environ["LABKIT_DATA_DIR"]) and "test-cache" in path.parts


def test_where_the_journal_is(monkeypatch, tmp_path):
    monkeypatch.setenv("LABKIT_DATA_DIR", str(tmp_path / "named"))
    assert estimates.journal_path() == tmp_path / "named" / "estimates.jsonl"
    monkeypatch.delenv("LABKIT_DATA_DIR")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert estimates.journal_path() == tmp_path / "xdg" / "labkit" / "estimates.jsonl"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert estimates.journal_path() == tmp_path / "home" / ".local" / "share" / "labkit" / "estimates.jsonl"


def test_entries_are_appended_and_a_line_that_cannot_be_read_is_skipped_and_left(tmp_path):
    path = tmp_path / "deep" / "estimates.jsonl"
    day = dt.datetime(2026, 12, 5, 14, 3, tzinfo=dt.timezone.utc)
    estimates.record(estimates.entry("decode_batch", "How many times longer?", 12.0, "×", shown(), day), path)
    with open(path, "a") as journal:
        journal.write('{"cut off by a full disk\n[1, 2]\n')
    estimates.record(estimates.entry("decode_batch", "How many times longer?", 4.0, "×", shown(4.0, 3.1)), path)
    before = path.read_bytes()
    entries, unreadable = estimates.read(path)
    assert [e["estimate"] for e in entries] == [12.0, 4.0] and unreadable == 2
    assert path.read_bytes() == before  # reading rewrites nothing
    first = entries[0]
    assert first["recorded_utc"] == "2026-12-05T14:03:00Z" and first["question"] == "How many times longer?"
    assert first["compared"] == "a ratio" and first["rows"][0] == ["your estimate", "12×"]
    assert estimates.yours_and_measured(first) == ("12×", "9.7×", "measured")


def test_a_line_of_the_wrong_shape_is_counted_unreadable_and_breaks_nothing(tmp_path, monkeypatch, capsys):
    """Valid JSON, wrong insides (a line edited by hand): the widget, lesson 08 and the command
    raised IndexError or TypeError on it, at every later commit."""
    path = tmp_path / "estimates.jsonl"
    good = estimates.entry("decode_batch", "q?", 12.0, "×", shown())
    bad = [{**good, "rows": []}, {**good, "recorded_utc": None}, {**good, "rows": [["only a name"]]},
           {**good, "question_id": 7}, [good], {**good, "values": [12.0, 9.7]}]
    path.write_text("".join(json.dumps(line) + "\n" for line in [*bad, good]))
    entries, unreadable = estimates.read(path)
    assert len(entries) == 1 and unreadable == len(bad)
    assert "1 answer kept" in estimates.summary(path)
    monkeypatch.setenv("LABKIT_DATA_DIR", str(tmp_path))
    assert cli.main(["estimates"]) == 0 and "6 line(s) could not be read" in capsys.readouterr().out


def test_a_line_cut_short_does_not_swallow_the_next(tmp_path):
    path = tmp_path / "estimates.jsonl"
    path.write_text('{"schema": 1, "recorded_utc": "2026-12-0')  # a full disk, a killed kernel
    estimates.record(estimates.entry("decode_batch", "q?", 12.0, "×", shown()), path)
    entries, unreadable = estimates.read(path)
    assert [e["estimate"] for e in entries] == [12.0] and unreadable == 1
    assert path.read_text().startswith('{"schema": 1, "recorded_utc": "2026-12-0\n')  # left as it was


def test_a_journal_that_may_not_be_read_is_a_clear_error(tmp_path, monkeypatch):
    path = tmp_path / "estimates.jsonl"
    path.write_text("")

    def refused(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(Path, "read_text", refused)
    monkeypatch.setattr(Path, "stat", refused)  # a folder above it it may not search: exists() raised this
    with pytest.raises(Exception, match="cannot read the estimates journal .*: Permission denied"):
        estimates.read(path)
    assert estimates.earlier("q", path) == []


def test_the_earlier_answers_sentence_names_the_newest_three(tmp_path):
    path = tmp_path / "estimates.jsonl"
    for day, guess in enumerate((20.0, 12.0, 8.0, 4.0), start=1):
        when = dt.datetime(2026, 12, day, tzinfo=dt.timezone.utc)
        estimates.record(estimates.entry("q", "q?", guess, "×", shown(guess), when), path)
    estimates.record(estimates.entry("other", "o?", 1.0, "×", shown(1.0)), path)
    said = estimates.earlier_sentence(estimates.earlier("q", path))
    assert said == ("Your earlier answers here (the newest 3 of 4): 12× on 2026-12-02 (measured then: 9.7×); "
                    "8× on 2026-12-03 (measured then: 9.7×); 4× on 2026-12-04 (measured then: 9.7×).")
    assert estimates.earlier_sentence([]) == ""
    simulated = explore.reveal("u", "%", 90.0, 62.0, 55.0, "a CPU", "why", measured_label="simulated on step times")
    line = estimates.entry("static_utilisation", "What share?", 90.0, "%", simulated)
    assert estimates.yours_and_measured(line) == ("90%", "55%", "simulated")


def test_a_journal_that_is_not_a_file_is_a_clear_error_and_a_question_still_shows(tmp_path):
    (tmp_path / "estimates.jsonl").mkdir()
    with pytest.raises(Exception, match="cannot read the estimates journal"):
        estimates.read(tmp_path / "estimates.jsonl")
    assert estimates.earlier("q", tmp_path / "estimates.jsonl") == []


def test_the_command_lists_every_kept_answer(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("LABKIT_DATA_DIR", str(tmp_path))
    assert cli.main(["estimates"]) == 0
    assert "no estimates kept yet" in capsys.readouterr().out
    estimates.record(estimates.entry("decode_batch", "How many?", 12.0, "×", shown(),
                                     dt.datetime(2026, 12, 5, 14, 3, tzinfo=dt.timezone.utc)))
    with open(estimates.journal_path(), "a") as journal:
        journal.write("not json\n")
    assert cli.main(["estimates"]) == 0
    out = capsys.readouterr().out
    assert "2026-12-05 a ratio 12× 15.9× 9.7× measured 1.237" in [" ".join(x.split()) for x in out.splitlines()]
    assert "(1 line(s) could not be read, left as they are)" in out
    assert cli.main(["estimates", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["estimates"][0]["yours"] == "12×" and listed["unreadable_lines"] == 1
    (tmp_path / "estimates.jsonl").unlink()
    (tmp_path / "estimates.jsonl").mkdir()
    assert cli.main(["estimates"]) == 2
    assert capsys.readouterr().err.startswith("labkit: error: cannot read the estimates journal")


def test_the_command_runs_as_a_learner_types_it(tmp_path):
    env = {**os.environ, "LABKIT_DATA_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "labkit", "estimates"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and f"journal: {tmp_path / 'estimates.jsonl'}" in done.stdout, done.stderr


class TestTheWidget:
    """views.Predict keeps each committed estimate, says a question was answered before (by date
    only: the question is still asked first) and shows the earlier answers with the reveal."""

    @pytest.fixture(autouse=True)
    def _isolated(self, monkeypatch, tmp_path):
        pytest.importorskip("ipywidgets")
        monkeypatch.delenv("LABKIT_AUTO_REVEAL", raising=False)
        monkeypatch.setenv("LABKIT_DATA_DIR", str(tmp_path))
        self.path = tmp_path / "estimates.jsonl"

    def commit(self, typed: str, name="decode_batch", measured=9.7):
        from labkit import views
        guess = views.Predict("How many times longer?", lambda e: shown(e, measured), 8.0, unit="×", name=name)
        guess.input.value = typed
        guess.button.click()
        return guess

    def test_a_commit_is_kept_and_the_next_answer_shows_it(self):
        first = self.commit("12")
        assert "earlier" not in first.answer.value and "answered this" not in first.widget.children[0].value
        entries, _ = estimates.read(self.path)
        assert [(e["question_id"], e["estimate"], e["question"]) for e in entries] == [
            ("decode_batch", 12.0, "How many times longer?")]
        assert first.error.widget.value == "<span style='color:#555'></span>"

        from labkit import views
        again = views.Predict("How many times longer?", lambda e: shown(e, 3.1), 8.0, unit="×", name="decode_batch")
        today = entries[0]["recorded_utc"][:10]
        asked = again.widget.children[0].value
        assert f"You answered this once before, last on {today}" in asked and str(self.path) in asked
        assert "9.7" not in asked  # the earlier answer is not given away before the new estimate
        again.input.value = "4"
        again.button.click()
        assert f"Your earlier answers here: 12× on {today} (measured then: 9.7×)." in again.answer.value
        assert [e["estimate"] for e in estimates.read(self.path)[0]] == [12.0, 4.0]

    def test_an_answer_committed_after_showing_it_anyway_says_so(self, monkeypatch):
        from labkit.views import base
        for name, empty in (("_COMMITTED", set()), ("_HELD", {}), ("_SEEN_FIRST", set())):
            monkeypatch.setattr(base, name, empty)
        held = base.after_estimate("decode_batch", "the chart")
        held.children[1].click()  # "Show it without an estimate"
        self.commit("12")
        self.commit("9", name="prefill_growth")
        assert [(e["question_id"], e["seen_first"]) for e in estimates.read(self.path)[0]] == [
            ("decode_batch", True), ("prefill_growth", False)]

    def test_a_sample_estimate_is_not_kept(self, monkeypatch):
        from labkit import views
        monkeypatch.setenv("LABKIT_AUTO_REVEAL", "1")
        views.Predict("How many times longer?", lambda e: shown(e), 8.0, unit="×", name="decode_batch")
        assert not self.path.exists()

    def test_an_interrupt_after_the_reveal_leaves_it_committed(self, monkeypatch):
        """Kernel > Interrupt landing while the answer is kept (after it is shown) reopened the box:
        a second estimate, made after seeing the answer, was kept too."""
        def interrupted(line, path=None):
            raise KeyboardInterrupt
        monkeypatch.setattr(estimates, "record", interrupted)
        with pytest.raises(KeyboardInterrupt):
            self.commit("12")
        from labkit.views import base
        guess = base.Predict("How many?", lambda e: shown(e), 8.0, unit="×", name="q-after")
        guess.input.value = "12"
        with pytest.raises(KeyboardInterrupt):
            guess.button.click()
        assert "9.7×" in guess.answer.value and guess.button.disabled and guess.input.disabled
        assert "interrupted after the reveal" in guess.error.widget.value
        assert "q-after" in base._COMMITTED  # what it held back below is shown

    def test_a_journal_that_cannot_be_written_says_so_and_the_reveal_is_shown(self, monkeypatch, tmp_path):
        blocked = tmp_path / "a-file"
        blocked.write_text("")
        monkeypatch.setenv("LABKIT_DATA_DIR", str(blocked / "sub"))  # its folder cannot be made
        guess = self.commit("12")
        assert "9.7×" in guess.answer.value and guess.button.disabled
        assert f"shown, but not kept in {blocked / 'sub' / 'estimates.jsonl'}" in guess.error.widget.value


def test_lesson_08_lists_every_kept_answer(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_AUTO_REVEAL", "1")  # a report made on an instructor's machine lists none of theirs
    path = tmp_path / "estimates.jsonl"
    estimates.record(estimates.entry("decode_batch", "q?", 16.0, "×", shown(16.0)), path)
    assert estimates.summary(path).startswith("This copy was run with nobody at the keyboard")
    path.unlink()
    monkeypatch.delenv("LABKIT_AUTO_REVEAL")
    assert estimates.summary(path).startswith(f"No estimates kept yet in {path}: commit one")
    when = dt.datetime(2026, 12, 5, tzinfo=dt.timezone.utc)
    estimates.record(estimates.entry("decode_batch", "q?", 16.0, "×", shown(16.0), when), path)
    pick = explore.reveal("the heaviest decode share", None, "Chat", "RAG", "Chat", "a CPU", "why")
    estimates.record(estimates.entry("decode_heaviest", "Which?", "Chat", None, pick, when), path)
    with open(path, "a") as journal:
        journal.write("{}\n")
    assert estimates.summary(path).splitlines() == [
        f"2 answers kept in {path}, oldest first:",
        "  2026-12-05  a ratio: yours 16×, the formula 15.9×, measured 9.7× (yours ÷ the lab's: 1.6)",
        "  2026-12-05  the heaviest decode share: yours Chat, the formula RAG, measured Chat",
        "(1 line could not be read, left as it is)"]
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "estimates.jsonl").mkdir()
    assert "cannot read the estimates journal" in estimates.summary(tmp_path / "elsewhere" / "estimates.jsonl")


def test_a_rooms_summary_counts_each_learners_first_answer(tmp_path, monkeypatch, capsys):
    """An instructor's view (`python -m labkit estimates --room`): a second answer, made after
    seeing the lab's, does not count; close means within the reveal's quarter of the learner's own
    lab answer."""
    def journal(name, answers):
        path = tmp_path / name / "estimates.jsonl"
        for question, estimate, unit, reveal in answers:
            estimates.record(estimates.entry(question, "q?", estimate, unit, reveal), path)
        return path

    ratio = lambda e, m: explore.reveal("batch 16 ÷ batch 1", "×", e, 8.1, m, "a CPU", "why")
    pick = lambda e: explore.reveal("heaviest decode share", None, e, "RAG", "Chat", "a CPU", "why")
    ada = journal("ada", [("decode_batch", 16.0, "×", ratio(16.0, 6.4)), ("decode_batch", 6.0, "×", ratio(6.0, 6.5)),
                          ("decode_heaviest", "Chat", None, pick("Chat"))])
    bo = journal("bo", [("decode_batch", 7.0, "×", ratio(7.0, 6.0)), ("decode_heaviest", "RAG", None, pick("RAG"))])
    summary = estimates.room([estimates.read(ada)[0], estimates.read(bo)[0]])
    assert summary == [
        {"question": "decode_batch", "compared": "batch 16 ÷ batch 1", "unit": "×", "learners": 2, "busy": 0,
         "median_estimate": 11.5, "median_lab_answer": 6.2, "close": 1},
        {"question": "decode_heaviest", "compared": "heaviest decode share", "unit": None, "learners": 2, "busy": 0,
         "picks": {"Chat": 1, "RAG": 1}, "matched": 1}]
    assert estimates.room_lines(summary) == [
        "batch 16 ÷ batch 1 (decode_batch): 2 answered; median estimate 11.5×, median lab answer 6.2×; "
        "close (within 25%): 1 of 2",
        "heaviest decode share (decode_heaviest): 2 answered; picks: Chat 1, RAG 1; the lab's answer picked by 1"]

    assert cli.main(["estimates", "--room", str(ada), str(bo)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("2 learners' journals") and "close (within 25%): 1 of 2" in out
    assert cli.main(["estimates", "--room", str(ada), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["questions"][0]["median_estimate"] == 16.0
    assert cli.main(["estimates", "--room", str(tmp_path / "nobody" / "estimates.jsonl")]) == 2
    assert "--room: no journal at" in capsys.readouterr().err


def test_a_question_at_other_settings_and_an_answer_seen_first_are_apart(tmp_path, monkeypatch, capsys):
    """The reveal's words carry its settings ("batch 16 … 1,024 tokens"): an answer at other
    settings is not an earlier answer to this one, nor pooled with it in a room. An answer
    committed after "Show it without an estimate" was made with the answer in view: the room
    leaves it out of the first answers."""
    path = tmp_path / "ada" / "estimates.jsonl"
    at = lambda tokens, e, m: explore.reveal(f"batch 16 ÷ batch 1 ({tokens:,} tokens each)", "×", e, 8.1, m, "a CPU", "w")
    estimates.record(estimates.entry("decode_batch", "q?", 16.0, "×", at(1024, 16.0, 6.4), seen_first=True), path)
    estimates.record(estimates.entry("decode_batch", "q?", 9.0, "×", at(1024, 9.0, 6.4)), path)
    estimates.record(estimates.entry("decode_batch", "q?", 5.0, "×", at(256, 5.0, 7.9)), path)
    assert [e["estimate"] for e in estimates.earlier("decode_batch", path, compared="batch 16 ÷ batch 1 (256 tokens each)")] == [5.0]
    assert len(estimates.earlier("decode_batch", path)) == 3
    rows = estimates.room([estimates.read(path)[0]])
    assert [(r["compared"], r["median_estimate"]) for r in rows] == [
        ("batch 16 ÷ batch 1 (1,024 tokens each)", 9.0), ("batch 16 ÷ batch 1 (256 tokens each)", 5.0)]
    assert cli.main(["estimates", "--room", str(tmp_path / "*" / "nobody.jsonl")]) == 2
    said = capsys.readouterr().err  # with the command to paste: this Python, the pattern as typed
    assert "matched no journal" in said and said.rstrip().endswith(
        f"sudo sh -c '{sys.executable} -B -m labkit estimates --room {tmp_path}/*/nobody.jsonl'")
    assert cli.main(["estimates", "--room", str(tmp_path / "ada" / "estimates.jsonl"), str(tmp_path / "b*" / "e.jsonl"), "--json"]) == 2
    assert capsys.readouterr().err.rstrip().endswith(  # every pattern, and --json
        f"sudo sh -c '{sys.executable} -B -m labkit estimates --room {path} {tmp_path}/b*/e.jsonl --json'")


def test_a_day_is_shown_in_the_machines_time_zone(monkeypatch):
    import time
    line = {"recorded_utc": "2026-12-06T02:00:00Z"}
    monkeypatch.setenv("TZ", "America/Los_Angeles")
    time.tzset()
    try:
        assert estimates.local_date(line) == "2026-12-05"
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
    assert estimates.local_date({"recorded_utc": "yesterday-ish"}) == "yesterday-"


def test_a_lab_answer_measured_on_a_busy_machine_is_marked_and_left_out_of_the_rooms_figures(tmp_path):
    """Learners on a 2-core hub, two measuring at once: one's batch-16 step was timed faster than its batch-1 step
    (0.517×) while the others' lessons kept the cores busy, and the room's median lab answer came
    out 2.16× between a true 3.81× and it. The reveal keeps the busy share; the room leaves that
    answer out of the median and of "close" and says how many it left out; the learner's own list
    and earlier answers mark it."""
    ratio = lambda e, m, busy=None: explore.reveal("batch 16 ÷ batch 1", "×", e, 2.3, m, "a CPU", "why", busy_share=busy)
    assert "busy_share" not in ratio(3.0, 3.81)["values"] and ratio(3.0, 0.517, 0.61)["values"]["busy_share"] == 0.61
    journals = []
    for name, estimate, measured, busy in (("ann", 3.0, 3.81, None), ("bob", 0.6, 0.517, 0.61), ("cat", 4.0, 3.5, None)):
        path = tmp_path / name / "estimates.jsonl"
        estimates.record(estimates.entry("decode_batch", "q?", estimate, "×", ratio(estimate, measured, busy)), path)
        journals.append(estimates.read(path)[0])
    [row] = estimates.room(journals)
    assert (row["learners"], row["busy"], row["median_estimate"], row["close"]) == (3, 1, 3.0, 2)
    assert row["median_lab_answer"] == pytest.approx((3.81 + 3.5) / 2)  # not 3.5 with bob's 0.517 among them
    assert estimates.room_lines([row]) == [
        "batch 16 ÷ batch 1 (decode_batch): 3 answered; median estimate 3×, median lab answer 3.66×; close (within 25%): "
        "2 of 2 (1 measured on a busy machine, left out of both)"]
    assert estimates.kept_rows(journals[1])[0]["how"] == "measured (busy)" and estimates.kept_rows(journals[0])[0]["how"] == "measured"
    assert estimates.earlier_sentence(journals[1]).endswith("(measured then, on a busy machine: 0.517×).")
