"""The architecture as ARCHITECTURE.md states it, checked against the code.

Every import in `labkit` is read from the source (module level and inside functions alike):
* the imports between labkit's modules form no circle;
* the pure modules import no torch, so they load on any machine and the lessons' prose numbers
  (`claims`) never wait for a GPU stack;
* an import inside a function says why, on its line or the line above (torch's heavy load, a
  Jupyter-only package, TRITON_INTERPRET that must be set before triton loads);
* ARCHITECTURE.md's module table names every module, and its imports column lists exactly the
  labkit modules and the heavy third-party packages each one imports.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "labkit"
PURE = ("specs", "roofline", "claims", "explore", "units", "timing", "sizes", "workloads", "quiz")
# Third-party packages the table names: the ones that decide where a module can run.
HEAVY = ("torch", "numpy", "triton", "plotly", "ipywidgets", "nbformat", "nbconvert", "kernels")
UNLISTED = ("errors",)  # the exception classes: a leaf every module may import, left out of the column


def modules() -> dict[str, Path]:
    """labkit's modules by name: "roofline", and in a subpackage "cpu_kernels" (its __init__) and
    "cpu_kernels.panels"."""
    found = {path.stem: path for path in sorted(PACKAGE.glob("*.py")) if path.stem != "__init__"}
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        found[init.parent.name] = init
        found.update((f"{init.parent.name}.{path.stem}", path) for path in sorted(init.parent.glob("*.py"))
                     if path.stem != "__init__")
    return found


def imports_of(path: Path) -> list[tuple[str, int, bool]]:
    """(imported top-level name, line, inside a function?) for each import in `path`; a labkit
    module is named as `modules` names it ("roofline", "cpu_kernels.panels"), anything else by its
    package ("torch")."""
    tree = ast.parse(path.read_text())
    found = []
    inside = path.parent.name if path.parent != PACKAGE else None  # the subpackage `path` is in

    def relative(level: int, name: str) -> str:  # `from .name` / `from ..name` as `modules` names it
        if inside and level == 1:
            return f"{inside}.{name}"
        return name

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((alias.name.split(".")[0], child.lineno, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:  # from . import x / from .x import y
                    names = ([relative(child.level, child.module.split(".")[0])] if child.module
                             else [relative(child.level, a.name) for a in child.names])
                else:
                    names = [child.module.split(".")[0]] if child.module != "labkit" else [a.name for a in child.names]
                found.extend((name, child.lineno, in_function) for name in names)
            visit(child, nested)
    visit(tree, False)
    return found


def labkit_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: {imp for imp, _, _ in imports_of(path) if imp in known and imp != name}
            for name, path in known.items()}


def test_no_import_circles_in_labkit():
    graph, circles = labkit_graph(), []

    def walk(node, stack):
        if node in stack:
            circles.append(" -> ".join(stack[stack.index(node):] + [node]))
            return
        for nxt in sorted(graph[node]):
            walk(nxt, stack + [node])
    for start in graph:
        walk(start, [])
    assert not circles, f"import circles: {sorted(set(circles))[:5]}"


def test_the_graph_walker_finds_a_circle(monkeypatch):
    import test_architecture as me
    monkeypatch.setattr(me, "labkit_graph", lambda: {"a": {"b"}, "b": {"a"}})
    with pytest.raises(AssertionError, match="a -> b -> a"):
        me.test_no_import_circles_in_labkit()


@pytest.mark.parametrize("name", PURE)
def test_pure_modules_never_import_torch(name):
    graph, seen, todo = labkit_graph(), set(), [name]
    while todo:  # a pure module may import only modules that are pure too
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        heavy = {imp for imp, _, _ in imports_of(modules()[current])} & {"torch", "triton", "kernels"}
        assert not heavy, f"{name} reaches {current}, which imports {sorted(heavy)}"
        todo.extend(graph[current])


def test_every_function_level_import_says_why():
    silent = []
    for name, path in modules().items():
        lines = path.read_text().splitlines()
        for imp, line, in_function in imports_of(path):
            if in_function and "#" not in lines[line - 1] and not lines[line - 2].strip().startswith("#"):
                silent.append(f"{path.relative_to(ROOT)}:{line} imports {imp} inside a function without a reason")
    assert not silent, "\n".join(silent)


def architecture_table() -> dict[str, set[str]]:
    """ARCHITECTURE.md's module table: module -> the names in its imports column."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        listed = set(re.findall(r"`?([a-z_][a-z_0-9.]*[a-z_0-9])`?", cells[2].replace("stdlib", "").replace("only", "")))
        for module in re.findall(r"`([a-z_][a-z_0-9.]*)`", cells[0]):
            rows[module] = listed
    return rows


def test_architecture_md_names_every_module_and_its_imports():
    table, known = architecture_table(), modules()
    assert set(table) == set(known), (f"ARCHITECTURE.md's table misses {sorted(set(known) - set(table))} "
                                      f"and names {sorted(set(table) - set(known))}, which do not exist")
    wrong = []
    for name, path in known.items():
        actual = {imp for imp, _, _ in imports_of(path)
                  if (imp in known and imp not in (name, *UNLISTED)) or imp in HEAVY}
        listed = {imp for imp in table[name] if (imp in known and imp not in UNLISTED) or imp in HEAVY}
        if actual != listed:
            wrong.append(f"{name}: table says {sorted(listed)}, code imports {sorted(actual)}")
    assert not wrong, "ARCHITECTURE.md's imports column disagrees with the code:\n" + "\n".join(wrong)
