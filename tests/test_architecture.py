"""The package's imports follow docs/architecture.md: none runs up a layer, none closes a loop.

The layers are read from the table in docs/architecture.md, the imports from the source (those inside functions
too, which run as surely as the module-level ones), so the page and the code cannot drift apart unnoticed.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "megatron_zb"
PAGE = ROOT / "docs" / "architecture.md"


def layers() -> list[tuple[str, set[str]]]:
    """(layer, its top-level names), top first, from the page's table."""
    found = []
    for line in PAGE.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1].startswith("`"):
            found.append((cells[0], set(re.findall(r"`([a-z_]+)`", cells[1]))))
    return found


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules ``name`` imports (a name imported from a package counts as its module if it is one)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            targets.update(
                f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module for alias in node.names
            )
    resolved = set()
    for target in targets:
        while target not in known and "." in target:
            target = target.rsplit(".", 1)[0]
        if target in known and target != name:
            resolved.add(target)
    return resolved


def layer_of(module: str, table: list[tuple[str, set[str]]]) -> int:
    top = "megatron_zb" if module == "megatron_zb" else module.split(".")[1]
    for index, (_, names) in enumerate(table):
        if top in names:
            return index
    raise AssertionError(f"{module} is in no layer of docs/architecture.md: add megatron_zb/{top} to its table")


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_the_page_names_every_top_level_module_once() -> None:
    table = layers()
    named = [name for _, names in table for name in names]
    assert len(named) == len(set(named)), f"a name in two layers: {named}"
    tops = {
        path.stem if path.is_file() else path.name
        for path in PACKAGE.iterdir()
        if path.suffix == ".py" or (path / "__init__.py").exists()
    }
    tops = {"megatron_zb" if top == "__init__" else top for top in tops}
    assert tops == set(named), (
        f"the page lacks {sorted(tops - set(named))}, names what is gone: {sorted(set(named) - tops)}"
    )


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    table = layers()
    upward = [
        f"{module} ({table[layer_of(module, table)][0]}) imports {target} ({table[layer_of(target, table)][0]})"
        for module, targets in graph().items()
        for target in targets
        if layer_of(target, table) < layer_of(module, table)
    ]
    assert not upward, "imports that run up the layers:\n" + "\n".join(sorted(upward))


def test_no_modules_import_each_other_round_a_loop() -> None:
    edges = graph()
    loops = [sorted(component) for component in strongly_connected(edges) if len(component) > 1]
    assert not loops, f"modules that import each other (directly or round a loop): {loops}"


def strongly_connected(edges: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's components, iteratively (the graph is a few hundred modules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                components.append(component)
    return components


@pytest.mark.parametrize("edges", [{"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}])
def test_the_loop_finder_finds_a_loop(edges: dict[str, set[str]]) -> None:
    assert [component for component in strongly_connected(edges) if len(component) > 1] == [{"a", "b", "c"}]
