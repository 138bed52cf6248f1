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
            missing = [
                alias.name for alias in node.names if alias.name.startswith("megatron_zb") and alias.name not in known
            ]
            assert not missing, f"{path.relative_to(ROOT)}:{node.lineno} imports {missing}, which do not exist"
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if module.startswith("megatron_zb") and module not in known:  # an import inside a function fails late
                raise AssertionError(f"{path.relative_to(ROOT)}:{node.lineno} imports {module}, which does not exist")
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


# Assignments the registry test lets through, each for a reason: (file, the assigned target as written).
NOT_FOREIGN = {
    ("megatron_zb/megatron_lm/preflight.py", "parser.error"): "a copy of the parser made there, for that parse only",
}


def foreign_changes(path: Path) -> list[str]:
    """Where ``path`` changes torch, megatron-core, Megatron-LM or ``sys`` itself, not through ``patching``.

    Caught: an assignment to an attribute of (something under) a name imported from another package, ``sys``
    included; ``setattr``/``delattr`` on one; an object's ``__class__`` swapped; and a function installed as an
    attribute of an object that is not this module's own (``self``) or a megatron-zb module, which is how a
    method of another package's object (an optimizer's ``step``) is replaced.
    """
    tree = ast.parse(path.read_text())
    foreign, own = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound = (alias.asname or alias.name).split(".")[0]
                (own if alias.name.startswith("megatron_zb") else foreign).add(bound)
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            ours = node.level > 0 or (node.module or "").startswith("megatron_zb")
            (own if ours else foreign).update(alias.asname or alias.name for alias in node.names)
    functions = {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}

    def root(node: ast.AST) -> str | None:
        while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
            node = node.func if isinstance(node, ast.Call) else node.value
        return node.id if isinstance(node, ast.Name) else None

    def behaviour(value: ast.AST) -> bool:
        if isinstance(value, ast.Lambda) or (isinstance(value, ast.Name) and value.id in functions):
            return True
        return isinstance(value, ast.Attribute) and root(value) == "self"  # a bound method of this object

    found = []
    relative = str(path.relative_to(ROOT))
    for node in ast.walk(tree):
        stores = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            stores = [(target, node.value) for target in targets if isinstance(target, ast.Attribute)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            value = node.args[2] if node.func.id == "setattr" and len(node.args) == 3 else None
            stores = [(node.args[0], value)] if node.args else []
            if stores and isinstance(node.args[0], ast.Name) and node.args[0].id in foreign:
                found.append(f"{relative}:{node.lineno}: {ast.unparse(node)}")
                continue
        for target, value in stores:
            written = ast.unparse(target)
            if (relative, written) in NOT_FOREIGN:
                continue
            base = root(target.value) if isinstance(target, ast.Attribute) else root(target)
            swapped = isinstance(target, ast.Attribute) and target.attr == "__class__"
            installed = value is not None and behaviour(value) and base not in ("self", "cls") and base not in own
            if base in foreign or swapped or installed:
                found.append(f"{relative}:{node.lineno}: {written}")
    return found


def test_every_change_to_another_package_goes_through_the_registry() -> None:
    found = [
        line for path in sorted(PACKAGE.rglob("*.py")) if path.name != "patching.py" for line in foreign_changes(path)
    ]
    assert not found, "changes to another package made outside megatron_zb/patching.py:\n" + "\n".join(found)


def test_the_registry_check_sees_each_kind_of_change(tmp_path: Path) -> None:
    source = tmp_path / "megatron_zb" / "example.py"
    source.parent.mkdir()
    source.write_text(
        "import sys\nimport torch\nfrom megatron.core import parallel_state\nfrom . import ours\n\n"
        "def f(optimizer, module, step):\n"
        "    sys.argv = []\n"
        "    torch.cuda.synchronize = None\n"
        "    setattr(parallel_state, 'x', 1)\n"
        "    module.__class__ = object\n"
        "    optimizer.step = f\n"
        "    ours.value = f\n"
        "    optimizer.count = 1\n"
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = foreign_changes(source)
    finally:
        ROOT = saved
    assert sorted(line.split(": ", 1)[1] for line in found) == sorted([
        "sys.argv", "torch.cuda.synchronize", "setattr(parallel_state, 'x', 1)", "module.__class__", "optimizer.step"
    ])  # fmt: skip
