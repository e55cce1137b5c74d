"""Lesson prose: every number a notebook's Markdown states is computed by labkit.claims, and
every number labkit.claims lists for a lesson appears in it. Notebooks stay thin."""
import json
import re
from pathlib import Path

import pytest

from labkit import claims

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("[0-9][0-9]_*.ipynb"))
# Names that contain digits but are not figures: model and GPU names, dtypes, code spans.
NAMES = re.compile(r"`[^`]*`|Llama \d+(\.\d+)? \d+B|\b[A-Z]+\d+[A-Za-z\d-]*\b|\b\w*\d+[a-zA-Z]\w*\b")
NUMBER = re.compile(r"(?<![\w.,])\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\w])|(?<![\w.,])\d+(?:\.\d+)?(?![\w])")


def markdown(path):
    cells = json.loads(path.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def numbers_in(text):
    return set(NUMBER.findall(NAMES.sub(" ", text)))


def lesson_id(path):
    return path.name[:2]


def test_there_are_lessons():
    assert NOTEBOOKS, "no notebooks found"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_number_in_the_prose_is_computed_by_labkit(path):
    stated = numbers_in(markdown(path))
    computed = set(claims.lesson_numbers(lesson_id(path)).values())
    assert stated <= computed, f"{path.name} states numbers labkit does not compute: {sorted(stated - computed)}"
    assert computed <= stated, f"{path.name} no longer states labkit's figures: {sorted(computed - stated)}"


def test_number_extraction_skips_names_and_reads_separators():
    text = "Llama 3.1 8B on an H100 in bf16 moves 16.06 GB; 2,000 tokens at `x = 7` cost 89 ms."
    assert numbers_in(text) == {"16.06", "2,000", "89"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_are_thin_and_parameterised(path):
    cells = json.loads(path.read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    assert any("parameters" in c.get("metadata", {}).get("tags", []) for c in code), "no `parameters` cell"
    for c in code:
        source = "".join(c["source"])
        for block in re.findall(r"^def .*?(?=^\S|\Z)", source, flags=re.S | re.M):
            assert block.count("\n") <= 4, f"{path.name}: a function of more than a few lines belongs in labkit"
        assert not c.get("outputs"), f"{path.name} is committed with outputs"


def _names(source: str, context) -> set[str]:
    """The names a cell stores (or loads) at its own level: not a comprehension's or a lambda's own."""
    import ast
    scoped = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.Lambda, ast.FunctionDef)
    found, todo = set(), [ast.parse(source)]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Name) and isinstance(node.ctx, context):
            found.add(node.id)
        todo.extend(child for child in ast.iter_child_nodes(node) if not isinstance(child, scoped))
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lesson_id)
def test_a_lesson_runs_without_its_predict_first_cells(path):
    """A learner may skip a question (or run the cells below it after a restart): nothing a
    `views.Predict` cell defines is needed by another cell, so what it shares with a chart after
    it (`shared_run`) is made in a cell before it."""
    code = ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    asks = [source for source in code if "views.Predict(" in source]
    import ast
    defined = set().union(*(_names(source, ast.Store) for source in asks)) if asks else set()
    for source in code:
        if source not in asks:
            needed = defined & _names(source, ast.Load)
            assert not needed, f"{path.name}: needs {needed} from a Predict cell"
