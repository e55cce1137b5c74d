"""Update the lab with `git pull`, keeping the lessons you changed. `make update` runs this, and so
does a learner without make, from the repository root:

    python -m labkit.update

JupyterLab saves a lesson with its outputs into notebooks/, and git will not pull a new version of
a lesson over one you changed ("Your local changes ... would be overwritten"). So first every
lesson that differs from git is copied to saved/<date-time>/ (never over an earlier copy), then
set back to git's version, then `git pull --ff-only` brings the new lessons. Your copies stay in
saved/, which git ignores; open them in JupyterLab beside the new versions. A file of yours that
git does not track where the update brings one of the same name (a `make bench` recording,
data/recordings/bench-cpu-60.json, when the lab's next one is committed under that name) would stop
the pull too: it is moved to the same saved/ folder first. If the pull fails (no network, commits
of your own), your copies are kept all the same and git's message is shown.
Standard library only: it runs before the venv is rebuilt, with any Python 3.
"""
from __future__ import annotations

import datetime
import shutil
import subprocess
import sys
from pathlib import Path

from .cli_args import Parser, UsageError

ROOT = Path(__file__).resolve().parent.parent
LESSONS = "notebooks"
SAVED = "saved"


class GitError(Exception):
    """A git command failed: its own message."""


def git(repo: Path, *args: str) -> str:
    """`git -C repo args...`'s output; GitError with git's message where it fails."""
    try:
        done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=600)
    except FileNotFoundError as err:
        raise GitError("git is not installed (the lab is updated with git pull)") from err
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        # git's own verdict lines ("fatal: Not possible to fast-forward, aborting."), not its progress
        verdict = [line for line in said if line.startswith(("fatal:", "error:"))] or said[-1:]
        raise GitError(" ".join(verdict) or f"git {' '.join(args)} exited {done.returncode}")
    return done.stdout


def changed_lessons(repo: Path) -> list[str]:
    """The tracked files under notebooks/ that differ from git's version (modified or deleted),
    as paths relative to `repo`."""
    status = git(repo, "status", "--porcelain", "--untracked-files=no", "-z", "--", LESSONS)
    return sorted(entry[3:] for entry in status.split("\0") if entry[:2].strip())


def in_the_way(repo: Path) -> list[str]:
    """Files the pull would bring that exist here untracked (git refuses to overwrite them), as
    paths relative to `repo`; [] where the branch has no upstream (the pull then says why)."""
    try:
        git(repo, "fetch", "-q")
        incoming = git(repo, "diff", "--name-only", "-z", "--diff-filter=A", "HEAD", "@{upstream}")
    except GitError:
        return []
    paths = [path for path in incoming.split("\0") if path]
    if not paths:
        return []
    # only the incoming paths are asked about: a clone's .venv alone holds tens of thousands of
    # untracked files; an ignored one git overwrites without asking, so only untracked ones count
    literal = [f":(literal){path}" for path in paths]  # a name with * or ? is that name, not a pattern
    return sorted(path for path in git(repo, "ls-files", "--others", "--exclude-standard", "-z", "--", *literal)
                  .split("\0") if path)


def new_folder(repo: Path, now: datetime.datetime) -> Path:
    """A new saved/<date-time>/ folder; one that exists already gets a suffix, so no earlier copy
    is overwritten."""
    stamp = now.strftime("%Y-%m-%d_%H%M%S")
    folder, n = repo / SAVED / stamp, 1
    while folder.exists():
        n += 1
        folder = repo / SAVED / f"{stamp}-{n}"
    folder.mkdir(parents=True)
    return folder


def keep(repo: Path, paths: list[str], folder: Path, move: bool = False):
    """Copy (or move) `paths` (relative to `repo`) into `folder`, keeping their places."""
    for path in paths:
        if (repo / path).is_file():  # a lesson you deleted has nothing to keep
            (folder / path).parent.mkdir(parents=True, exist_ok=True)
            (shutil.move if move else shutil.copy2)(repo / path, folder / path)


def keep_lessons(repo: Path, now: datetime.datetime) -> tuple[list[str], Path | None]:
    """Copy the changed lessons to a new saved/ folder and set them back to git's version: the
    lines to print, and the folder (None where no lesson had changed)."""
    changed = changed_lessons(repo)
    if not changed:
        return [], None
    folder = new_folder(repo, now)
    keep(repo, changed, folder)
    git(repo, "checkout", "--", *changed)
    return [f"update: kept {len(changed)} lesson(s) you changed in {folder.relative_to(repo)}/ "
            f"({', '.join(Path(p).name for p in changed)})"], folder


def update(repo: Path, now: datetime.datetime) -> list[str]:
    """Keep the changed lessons, set them back, pull. The lines to print; GitError where the pull
    (or git itself) failed, after the lessons were kept."""
    lines, folder = keep_lessons(repo, now)
    blocking = in_the_way(repo)
    if blocking:
        folder = folder or new_folder(repo, now)
        keep(repo, blocking, folder, move=True)
        lines.append(f"update: moved {len(blocking)} file(s) of yours to {folder.relative_to(repo)}/, out of the way of "
                     f"files of the same name the update brings ({', '.join(blocking)})")
    before = git(repo, "rev-parse", "HEAD").strip()
    try:
        git(repo, "pull", "--ff-only")
    except GitError as err:
        kept = f" (your files are kept in {folder.relative_to(repo)}/)" if folder else ""
        raise GitError(f"git pull failed{kept}: {err}") from err
    after = git(repo, "rev-parse", "HEAD").strip()
    lines.append("update: already up to date" if after == before else f"update: {before[:7]} -> {after[:7]}")
    return lines


def main(argv=None) -> int:
    parser = Parser(prog="python -m labkit.update", description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=ROOT, help="the lab's repository (this one)")
    parser.add_argument("--keep-only", action="store_true",
                        help="keep the lessons you changed in saved/ and set them back, without pulling (make keep)")
    try:
        args = parser.parse_args(argv)
        now = datetime.datetime.now()
        if args.keep_only:
            lines = keep_lessons(args.repo, now)[0] or ["update: no lesson differs from git's version; nothing kept"]
        else:
            lines = update(args.repo, now)
        for line in lines:
            print(line)
    except (UsageError, GitError) as err:
        print(f"update: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
