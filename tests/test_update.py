"""`make update` / `python -m labkit.update`: a lesson the learner changed is kept in saved/ before
`git pull` brings the new version, never overwritten, and a failed pull keeps it too."""
import datetime
import subprocess
from pathlib import Path

import pytest

from labkit import update

NOW = datetime.datetime(2026, 12, 6, 3, 0, 0)
LESSON = "notebooks/01_two_phases.ipynb"


def run(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=lab", "-c", "user.email=lab@example.org", *args],
                          check=True, capture_output=True, text=True).stdout


def commit(repo: Path, path: str, text: str, message: str):
    (repo / path).parent.mkdir(parents=True, exist_ok=True)
    (repo / path).write_text(text)
    run(repo, "add", path)
    run(repo, "commit", "-q", "-m", message)


@pytest.fixture
def upstream_and_clone(tmp_path):
    """The lab's upstream with one lesson, and a learner's clone of it."""
    upstream = tmp_path / "upstream"
    upstream.mkdir()
    run(upstream, "init", "-q", "-b", "main")
    commit(upstream, LESSON, '{"v": 1}\n', "lesson 01")
    commit(upstream, "notebooks/02_prefill_two_terms.ipynb", '{"v": 1}\n', "lesson 02")
    subprocess.run(["git", "clone", "-q", str(upstream), str(tmp_path / "clone")], check=True)
    return upstream, tmp_path / "clone"


def test_a_changed_lesson_is_kept_then_the_new_version_pulled(upstream_and_clone):
    upstream, clone = upstream_and_clone
    (clone / LESSON).write_text('{"v": 1, "outputs": "mine"}\n')
    commit(upstream, LESSON, '{"v": 2}\n', "lesson 01, new")
    lines = update.update(clone, NOW)
    kept = clone / "saved" / "2026-12-06_030000" / LESSON
    assert kept.read_text() == '{"v": 1, "outputs": "mine"}\n', "the learner's copy is kept as it was"
    assert (clone / LESSON).read_text() == '{"v": 2}\n', "the new lesson is pulled"
    assert lines[0] == "update: kept 1 lesson(s) you changed in saved/2026-12-06_030000/ (01_two_phases.ipynb)"
    head = run(clone, "rev-parse", "--short=7", "HEAD").strip()
    assert lines[1].startswith("update: ") and lines[1].endswith(f" -> {head}")
    assert update.changed_lessons(clone) == []


def test_an_earlier_copy_is_never_overwritten(upstream_and_clone):
    _, clone = upstream_and_clone
    for text in ('{"first": 1}\n', '{"second": 2}\n'):
        (clone / LESSON).write_text(text)
        update.update(clone, NOW)  # the same second twice: a second folder, not the first one again
    assert (clone / "saved" / "2026-12-06_030000" / LESSON).read_text() == '{"first": 1}\n'
    assert (clone / "saved" / "2026-12-06_030000-2" / LESSON).read_text() == '{"second": 2}\n'


def test_nothing_changed_nothing_kept(upstream_and_clone):
    _, clone = upstream_and_clone
    assert update.update(clone, NOW) == ["update: already up to date"]
    assert not (clone / "saved").exists()


def test_a_failed_pull_keeps_the_lessons_and_says_why(upstream_and_clone, capsys):
    upstream, clone = upstream_and_clone
    commit(clone, "notebooks/02_prefill_two_terms.ipynb", '{"mine": 1}\n', "a commit of the learner's own")
    commit(upstream, "notebooks/02_prefill_two_terms.ipynb", '{"v": 2}\n', "lesson 02, new")
    (clone / LESSON).write_text('{"outputs": "mine"}\n')
    assert update.main(["--repo", str(clone)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("update: error: git pull failed (your files are kept in saved/") and err.count("\n") == 1
    assert "): fatal: " in err, err  # git's verdict (its wording varies with git's version), not its progress
    kept = next((clone / "saved").iterdir()) / LESSON
    assert kept.read_text() == '{"outputs": "mine"}\n'


def test_not_a_repository_is_one_line(tmp_path, capsys):
    assert update.main(["--repo", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("update: error: ") and "not a git repository" in err


def test_saved_lessons_are_ignored_by_git():
    root = Path(update.__file__).resolve().parent.parent
    assert subprocess.run(["git", "-C", str(root), "check-ignore", "-q", "saved/2026-12-06_030000/x.ipynb"]).returncode == 0


def test_a_file_of_yours_where_the_update_brings_one_is_moved_to_saved_not_lost(upstream_and_clone):
    """A learner's `make bench` writes the first free name under data/recordings/ (bench-cpu-60.json),
    untracked; when the lab later commits its own bench-cpu-60.json, git pull refused to overwrite
    the learner's file and the update failed for good."""
    upstream, clone = upstream_and_clone
    mine = "data/recordings/bench-cpu-60.json"
    (clone / mine).parent.mkdir(parents=True)
    (clone / mine).write_text('{"measured": "by me"}\n')
    (clone / "data/recordings/bench-cpu-61.json").write_text('{"also": "mine"}\n')  # no clash: stays
    commit(upstream, mine, '{"measured": "by the lab"}\n', "a recording")
    lines = update.update(clone, NOW)
    assert (clone / mine).read_text() == '{"measured": "by the lab"}\n'
    assert (clone / "saved" / "2026-12-06_030000" / mine).read_text() == '{"measured": "by me"}\n'
    assert (clone / "data/recordings/bench-cpu-61.json").read_text() == '{"also": "mine"}\n'
    assert lines[0] == ("update: moved 1 file(s) of yours to saved/2026-12-06_030000/, out of the way of files of "
                        f"the same name the update brings ({mine})")


def test_keep_only_keeps_and_resets_the_lessons_without_pulling(upstream_and_clone, capsys):
    """make test refused lessons JupyterLab had saved with outputs and said 'run make strip', which
    deletes them: `make keep` (--keep-only) keeps them in saved/ first and pulls nothing."""
    upstream, clone = upstream_and_clone
    commit(upstream, LESSON, '{"v": 2}\n', "lesson 01, new")
    (clone / LESSON).write_text('{"v": 1, "outputs": "mine"}\n')
    assert update.main(["--repo", str(clone), "--keep-only"]) == 0
    assert capsys.readouterr().out.startswith("update: kept 1 lesson(s) you changed in saved/")
    assert next((clone / "saved").iterdir()).joinpath(LESSON).read_text() == '{"v": 1, "outputs": "mine"}\n'
    assert (clone / LESSON).read_text() == '{"v": 1}\n', "git's version, not the upstream's: nothing pulled"
    assert update.main(["--repo", str(clone), "--keep-only"]) == 0
    assert "nothing kept" in capsys.readouterr().out
