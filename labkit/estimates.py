"""The learner's committed estimates, kept: each "Predict first" answer, with the formula's answer
and the measurement it was shown beside, one JSON line appended to a journal.

A widget's state dies with its kernel: a restarted kernel, or a notebook reopened the next day,
showed an empty box where the learner's estimate and its reveal had been. The journal keeps them,
so the lab can say "you answered this before" and `python -m labkit estimates` lists every answer.
It is only ever appended to: a line that cannot be read is skipped and counted, never rewritten.

Where: $LABKIT_DATA_DIR/estimates.jsonl, else $XDG_DATA_HOME/labkit/, else
~/.local/share/labkit/. User data, not a cache: not under ~/.cache/labkit, which may be cleared.
A run with nobody at the keyboard (LABKIT_AUTO_REVEAL=1) keeps nothing: its estimates are samples.
"""
from __future__ import annotations

import datetime as dt
import json
import numbers
import os
import statistics
from pathlib import Path

from .errors import LabError
from .explore.points import CLOSE_WITHIN, shown_value

JOURNAL_NAME = "estimates.jsonl"
SCHEMA = 1


def unattended() -> bool:
    """A run with nobody at the keyboard (nbval, papermill, `make report`): its estimates are the
    recorded samples, never kept."""
    return os.environ.get("LABKIT_AUTO_REVEAL") == "1"


def journal_path() -> Path:
    """Where the journal is (it may not exist yet)."""
    named = os.environ.get("LABKIT_DATA_DIR")
    if named:
        return Path(named) / JOURNAL_NAME
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "labkit" / JOURNAL_NAME


def entry(question_id: str, question: str, estimate, unit: str | None, shown: dict,
          when: dt.datetime | None = None, seen_first: bool = False) -> dict:
    """One journal line: the question (`predict.ask`'s name and the words the learner read), the
    estimate as committed (a number in `unit`, or the option picked), the reveal as shown
    (`explore.reveal`'s dict: what it compared, its rows, the estimate's first and the lab's answer
    last, and its line on the gap), and `seen_first`: whether the learner had opened the held
    answer ("Show it without an estimate") before committing."""
    when = when or dt.datetime.now(dt.timezone.utc)
    values = {name: _plain(value) for name, value in shown.get("values", {}).items()}
    return {"schema": SCHEMA, "recorded_utc": when.strftime("%Y-%m-%dT%H:%M:%SZ"), "question_id": question_id,
            "question": question, "compared": shown["question"], "estimate": _plain(estimate), "unit": unit,
            "rows": [list(row) for row in shown["rows"]], "gap": shown["gap"], "values": values,
            "seen_first": bool(seen_first)}


def _plain(value):
    """A number as a JSON float (a numpy float32 is not one), a pick as its text."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return value if value is None else str(value)


def record(line: dict, path: Path | None = None) -> Path:
    """Append `line` (an `entry`) to the journal, creating its folder; the journal's path.
    OSError (a read-only home, a full disk) goes to the caller: the reveal is shown all the same."""
    path = path or journal_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(line, ensure_ascii=False) + "\n"
    # One write of one line in append mode: two kernels answering at once add two whole lines.
    with open(path, "a+b") as journal:
        journal.seek(0, os.SEEK_END)
        if journal.tell():  # a line cut short (a full disk, a killed kernel) must not swallow this one
            journal.seek(-1, os.SEEK_END)
            if journal.read(1) != b"\n":
                text = "\n" + text
        journal.write(text.encode("utf-8"))
        journal.flush()
        os.fsync(journal.fileno())
    return path


def read(path: Path | None = None) -> tuple[list[dict], int]:
    """(every readable entry, oldest first; how many lines could not be read). A journal not made
    yet is empty; one that is not a file, or cannot be opened, is a LabError naming it."""
    path = path or journal_path()
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return [], 0
    except OSError as err:  # a folder in its place, a folder it may not read
        raise LabError(f"cannot read the estimates journal {path}: {err.strerror or err}") from None
    entries, unreadable = [], 0
    for text in lines:
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except ValueError:
            unreadable += 1
            continue
        if _well_formed(line):
            entries.append(line)
        else:
            unreadable += 1
    return entries, unreadable


def _well_formed(line) -> bool:
    """Whether a parsed line has what the lab reads of it: a question id and a date as text, and
    rows of (name, value) pairs, the estimate's first (a line edited by hand, or another schema's,
    is counted unreadable instead of breaking a widget, lesson 08 or the command)."""
    if not isinstance(line, dict):
        return False
    rows = line.get("rows")
    return (isinstance(line.get("question_id"), str) and isinstance(line.get("recorded_utc"), str)
            and isinstance(rows, list) and len(rows) > 0
            and all(isinstance(row, list) and len(row) == 2 for row in rows)
            and isinstance(line.get("values", {}), dict))


def earlier(question_id: str, path: Path | None = None, compared: str | None = None) -> list[dict]:
    """The entries for `question_id` (and, given, the same `compared`: the reveal's words, which
    carry its settings), oldest first ([] if the journal cannot be read: a widget's question must
    show all the same)."""
    try:
        entries, _ = read(path)
    except LabError:
        return []
    return [e for e in entries if e["question_id"] == question_id
            and (compared is None or e.get("compared") == compared)]


def local_date(line: dict) -> str:
    """The day a line was kept, in this machine's time zone (kept in UTC): "2026-12-05"."""
    try:
        when = dt.datetime.strptime(line["recorded_utc"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
    except ValueError:  # a hand-edited date: shown as written
        return line["recorded_utc"][:10]
    return when.astimezone().date().isoformat()


def yours_and_measured(line: dict) -> tuple[str, str, str]:
    """The estimate and the lab's answer as the reveal showed them (its first and last rows), and
    how that answer was had: "measured", or "simulated" (lesson 05's, on measured step times)."""
    rows = line["rows"]
    how = str(rows[-1][0]).split(" ", 1)[0]
    return str(rows[0][1]), str(rows[-1][1]), how if how in ("measured", "simulated") else "the lab's answer"


def measured_busy(line: dict) -> bool:
    """Whether the lab's answer of this line was measured while other programs kept the cores busy
    (the reveal said so, and kept the share: `explore.reveal`'s busy_share)."""
    return (line.get("values") or {}).get("busy_share") is not None


def earlier_sentence(entries: list[dict], shown_at_most: int = 3) -> str:
    """'Your earlier answers here: 16× on 2026-12-05 (measured then: 2.96×); …' — the newest
    `shown_at_most`, oldest first; '' for none."""
    if not entries:
        return ""
    newest = entries[-shown_at_most:]
    parts = []
    for line in newest:
        yours, answer, how = yours_and_measured(line)
        parts.append(f"{yours} on {local_date(line)} ({how} then{', on a busy machine' if measured_busy(line) else ''}: {answer})")
    more = len(entries) - len(newest)
    head = "Your earlier answers here" + (f" (the newest {len(newest)} of {len(entries)})" if more else "")
    return f"{head}: {'; '.join(parts)}."


def kept_rows(entries: list[dict]) -> list[dict]:
    """Each kept answer as lesson 08 and `python -m labkit estimates` show it: the day (local), what
    was compared, the estimate, the formula's answer and the lab's as the reveal showed them, how
    the lab had it, and the estimate ÷ the lab's answer (None for a pick, or a line kept without
    its unrounded values): where the learner was furthest off, at a glance."""
    rows = []
    for line in entries:
        yours, answer, how = yours_and_measured(line)
        values = line.get("values") or {}
        estimate, measured = values.get("estimate"), values.get("measured")
        ratio = (estimate / measured if line.get("unit") is not None and isinstance(estimate, float)
                 and isinstance(measured, float) and measured else None)
        rows.append({"day": local_date(line), "compared": str(line.get("compared") or line["question_id"]),
                     "yours": yours, "formula": str(line["rows"][1][1]) if len(line["rows"]) > 2 else None,
                     "lab_answer": answer, "how": f"{how} (busy)" if measured_busy(line) else how,
                     "yours_over_lab": ratio})
    return rows


def summary(path: Path | None = None) -> str:
    """Every kept answer as lines a learner reads (lesson 08, `kept_rows`); with none kept, how to
    keep one. A run with nobody at the keyboard (LABKIT_AUTO_REVEAL=1: a report, a test) lists
    nobody's: a handout made on an instructor's machine would otherwise print the instructor's."""
    if unattended():
        return ("This copy was run with nobody at the keyboard, so it committed sample estimates and "
                "kept none; in your own lab, your committed answers are listed here.")
    try:
        entries, unreadable = read(path)
    except LabError as err:
        return str(err)
    if not entries:
        return (f"No estimates kept yet in {path or journal_path()}: commit one in a lesson's "
                "\"Predict first\" box and it is listed here.")
    lines = [f"{len(entries):,} answer{'s' if len(entries) > 1 else ''} kept in {path or journal_path()}, oldest first:"]
    for row in kept_rows(entries):
        formula = f", the formula {row['formula']}" if row["formula"] else ""
        off = f" (yours ÷ the lab's: {row['yours_over_lab']:.2g})" if row["yours_over_lab"] is not None else ""
        lines.append(f"  {row['day']}  {row['compared']}: yours {row['yours']}{formula}, {row['how']} "
                     f"{row['lab_answer']}{off}")
    if unreadable:
        lines.append(f"({unreadable:,} line{'s' if unreadable > 1 else ''} could not be read, left as "
                     f"{'they are' if unreadable > 1 else 'it is'})")
    return "\n".join(lines)


def room(journals: list[list[dict]]) -> list[dict]:
    """A workshop room's answers, question by question (in the order they were first answered),
    from each learner's journal (`read`'s entries): a question at other settings (its reveal's
    words differ) is another question, and only a learner's first answer to it counts, the one
    made before they saw the lab's (an answer committed after "Show it without an estimate" is
    left out). For a number: how many answered, the median
    estimate and the median of the lab's answers (each on its learner's machine), and how many
    estimates were close to their own lab answer (within `CLOSE_WITHIN`, as the reveal says "close");
    for a pick: how many picked each option, and how many picked the lab's answer. Lines kept before
    the reveal's unrounded values were (none but the shown text) count as answered, not as close.
    A lab answer measured on a busy machine (`measured_busy`: more learners than cores, a browser
    drawing) is left out of the median lab answer and of "close", and counted ("busy"): one such
    batch-16 step timed faster than its batch-1 step put a room's median at 2.16× between a true
    3.81× and its own 0.517× (two learners measuring at once on a 2-core hub, 2026-12-06)."""
    firsts: dict[tuple, list[dict]] = {}
    for entries in journals:
        seen = set()
        for line in entries:
            key = (line["question_id"], str(line.get("compared") or line["question_id"]))  # its settings too
            if key not in seen and not line.get("seen_first"):
                seen.add(key)
                firsts.setdefault(key, []).append(line)
    rows = []
    for (question_id, compared), lines in firsts.items():
        values = [line.get("values") or {} for line in lines if not measured_busy(line)]
        row = {"question": question_id, "compared": compared,
               "unit": lines[-1].get("unit"), "learners": len(lines), "busy": sum(map(measured_busy, lines))}
        if row["unit"] is None:  # a pick
            picks = [str(line.get("estimate")) for line in lines]
            row["picks"] = {pick: picks.count(pick) for pick in dict.fromkeys(picks)}
            row["matched"] = sum(v.get("measured") is not None and v.get("estimate") == v.get("measured") for v in values)
        else:
            pairs = [(v["estimate"], v["measured"]) for v in values
                     if isinstance(v.get("estimate"), float) and isinstance(v.get("measured"), float) and v["measured"]]
            estimates_ = [line["estimate"] for line in lines if isinstance(line.get("estimate"), float)]
            row["median_estimate"] = statistics.median(estimates_) if estimates_ else None
            row["median_lab_answer"] = statistics.median([m for _, m in pairs]) if pairs else None
            row["close"] = sum(abs(e / m - 1) <= CLOSE_WITHIN for e, m in pairs)
        rows.append(row)
    return rows


def room_lines(summary: list[dict]) -> list[str]:
    """`room`'s rows as lines an instructor reads to the room."""
    lines = []
    for row in summary:
        head = f"{row['compared']} ({row['question']}): {row['learners']:,} answered"
        if row["unit"] is None:
            picks = ", ".join(f"{pick} {count:,}" for pick, count in row["picks"].items())
            lines.append(f"{head}; picks: {picks}; the lab's answer picked by {row['matched']:,}")
        else:
            median = lambda value: "—" if value is None else shown_value(value, row["unit"])
            busy = row.get("busy", 0)
            lines.append(f"{head}; median estimate {median(row['median_estimate'])}, median lab answer "
                         f"{median(row['median_lab_answer'])}; close (within {CLOSE_WITHIN:.0%}): "
                         f"{row['close']:,} of {row['learners'] - busy:,}"
                         + (f" ({busy:,} measured on a busy machine, left out of both)" if busy else ""))
    return lines
