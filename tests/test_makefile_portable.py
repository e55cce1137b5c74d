"""The Makefile runs on a Mac as it is: macOS ships GNU make 3.81, bash 3.2 and BSD's sed, grep,
awk, mktemp and coreutils, none of GNU coreutils' own tools (issue 16, item 3).

Every line the shell runs (recipes, and the variables they expand) is read for the GNU-only
flags and tools below, and the Makefile itself for GNU make features newer than 3.81. A learner
without make (Windows) has the README's commands instead, checked at the end.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAKEFILE = ROOT / "Makefile"

# (pattern, why it breaks on macOS). Patterns are matched against shell text, comments removed.
GNU_ONLY = [
    (r"\bsed\b[^|;&]*\s-i\b", "sed -i: BSD sed needs a suffix argument (-i ''), GNU sed takes none: write to a new file"),
    (r"\bsed\b[^|;&]*\s-r\b", "sed -r: GNU's spelling of extended regexps; use sed -E"),
    (r"\bsed\b[^|;&]*\s--", "sed --long-option: GNU only"),
    (r"\bgrep\b[^|;&]*\s-[a-zA-Z]*P", "grep -P: Perl regexps are GNU grep's; use grep -E"),
    (r"\bgrep\b[^|;&]*\s--(?!-)", "grep --long-option: BSD grep knows few; use the short flags"),
    (r"\breadlink\b[^|;&]*\s-f\b", "readlink -f: GNU (and macOS 12.3+ only)"),
    (r"\brealpath\b", "realpath: not on macOS before 13"),
    (r"\bmktemp\b(?![^|;&]*(-t\b|XXX))", "mktemp without a template: give one (mktemp -d build/tmp.XXXXXX)"),
    (r"\bnproc\b", "nproc: GNU coreutils; python -c 'import os; print(os.cpu_count())'"),
    (r"\btimeout\b\s+\d", "timeout: GNU coreutils, not on macOS"),
    (r"\b(sha256sum|sha1sum|md5sum|tac|stdbuf)\b", "a GNU coreutils tool macOS lacks"),
    (r"\bdate\b[^|;&]*\s-d\b", "date -d: GNU; BSD date -j -f"),
    (r"\bstat\b[^|;&]*\s-c\b", "stat -c: GNU; BSD stat -f"),
    (r"\bxargs\b[^|;&]*\s-r\b", "xargs -r: GNU"),
    (r"\bfind\b[^|;&]*\s-printf\b", "find -printf: GNU"),
    (r"\b(sort\b[^|;&]*\s-V|head\b[^|;&]*\s-n\s*-\d|ln\b[^|;&]*\s-[a-z]*r)", "a GNU-only coreutils flag"),
    (r"\b(cp|mv|rm|mkdir|ls|du|tar)\b[^|;&]*\s--[a-z]", "a coreutils long option: BSD's tools have none"),
    (r"\bawk\b.*\b(gensub|strftime|systime|asort|asorti|PROCINFO)\b", "a gawk-only function; macOS has BSD awk"),
    (r"\becho\s+-e\b", "echo -e: not portable; use printf"),
    (r"\$\(shell\s+nproc", "$(shell nproc): GNU coreutils"),
]
# GNU make features after 3.81, the make macOS ships: .ONESHELL, undefine, != and file are 3.82 / 4.0.
NEWER_MAKE = [
    (r"^\.ONESHELL\s*:", ".ONESHELL (make 3.82)"),
    (r"^\s*undefine\b", "undefine (make 3.82)"),
    (r"^[A-Za-z_][A-Za-z0-9_]*\s*!=", "!= shell assignment (make 4.0)"),
    (r"\$\(file\s", "$(file ...) (make 4.0)"),
    (r"^\.RECIPEPREFIX\b", ".RECIPEPREFIX (make 3.82)"),
    (r"\$\(guile\s", "$(guile ...) (make 4.0)"),
    (r"^[^\t#]*::=", "::= (make 4.0)"),
]


def logical_lines(text: str) -> list[str]:
    """The Makefile's lines with backslash continuations joined and comments removed."""
    joined = re.sub(r"\\\n", " ", text)
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def shell_text(lines: list[str]) -> list[str]:
    """What the shell runs: recipe lines (tab first) and variable definitions (they expand into recipes)."""
    return [line.strip() for line in lines
            if line.startswith("\t") or re.match(r"^[A-Za-z_][A-Za-z0-9_]*\s*(:=|\?=|=|\+=)", line)]


def offences(shell_lines: list[str], make_lines: list[str]) -> list[str]:
    found = [f"{why}: {line[:120]}" for line in shell_lines for pattern, why in GNU_ONLY if re.search(pattern, line)]
    found += [f"{why}: {line[:120]}" for line in make_lines for pattern, why in NEWER_MAKE if re.search(pattern, line)]
    return found


def test_the_makefile_uses_no_gnu_only_flags_or_newer_make():
    lines = logical_lines(MAKEFILE.read_text())
    found = offences(shell_text(lines), lines)
    assert not found, "the Makefile would fail on macOS:\n" + "\n".join(found)


@pytest.mark.parametrize("bad", [
    "\tsed -i 's/a/b/' file", "\tsed -r 's/(a)/b/' f", "\tgrep -P '\\d' f", "\tgrep -oP 'x' f",
    "\tt=$$(mktemp); echo $$t", "\tJOBS=$$(nproc)", "\tpath=$$(readlink -f x)", "\ttimeout 480 python x",
    "\tsha256sum f", "\tcp --parents a b", "\tdate -d yesterday", "\tawk '{print gensub(/a/, \"b\", \"g\")}' f",
    "JOBS := $(shell nproc)", "X != ls", ".ONESHELL:", "\techo -e 'a\\tb'",
])
def test_the_check_catches_each_gnu_only_use(bad):
    lines = logical_lines(bad + "\n")
    assert offences(shell_text(lines), lines), f"not caught: {bad!r}"


@pytest.mark.parametrize("fine", [
    "\tsed 's/^torch==.*/torch/' requirements.txt > build/requirements-gpu.txt",
    "\t@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = \":.*## \"} {printf \"  %-15s %s\\n\", $$1, $$2}'",
    "\tdir=$$(mktemp -d build/tmp.XXXXXX)", "\tgrep -n -E 'x|y' log", "\tpython3 -m venv .venv",
])
def test_the_check_lets_portable_uses_through(fine):
    lines = logical_lines(fine + "\n")
    assert not offences(shell_text(lines), lines)


def test_the_readme_gives_the_commands_without_make():
    """A learner without make installs the pins with the lab's extra and starts the launcher
    `make lab` runs; each line is in one of the README's code blocks, as written."""
    readme = (ROOT / "README.md").read_text()
    code = "\n".join(re.findall(r"```\n(.*?)```", readme, flags=re.DOTALL))
    install = next((line for line in code.splitlines() if line.startswith("python -m pip install -e")), "")
    assert '".[lab]"' in install, "the lab's extra, quoted for zsh (macOS's shell globs brackets)"
    assert "-r requirements.txt" in install and "-r requirements-cpu.txt" in install, install
    assert re.search(r"^python -m labkit\.launch(\s|$)", code, re.M), "no launcher command"
    assert "exec $(PY) -m labkit.launch" in MAKEFILE.read_text(), "make lab runs the same launcher"
