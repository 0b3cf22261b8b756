"""The package has no import circles: read from the source (every import outside ``if
TYPE_CHECKING:``, those inside functions included: a deferred import is still a dependency),
so a circle fails here even where import order or laziness happens to hide it."""

from __future__ import annotations

import ast
from pathlib import Path

import kvtier

ROOT = Path(kvtier.__file__).resolve().parent


def module_names() -> dict[str, Path]:
    names: dict[str, Path] = {}
    for path in ROOT.rglob("*.py"):
        parts = ["kvtier", *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree`` at any depth, but those under ``if TYPE_CHECKING:``."""
    if isinstance(tree, ast.If) and "TYPE_CHECKING" in ast.unparse(tree.test):
        return [n for child in tree.orelse for n in runtime_imports(child)]
    if isinstance(tree, ast.Import | ast.ImportFrom):
        return [tree]
    return [n for child in ast.iter_child_nodes(tree) for n in runtime_imports(child)]


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports, now or when one of its functions runs."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in runtime_imports(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            submodules = {f"{base}.{a.name}" for a in node.names} & known.keys()
            found.update(submodules)
            if len(submodules) < len(node.names):  # names from the module itself
                found.add(base)
    return {m for m in found if m in known and m != name}


def test_no_import_circles() -> None:
    known = module_names()
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    circles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                circles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def every_import(path: Path) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of every import in a file, at any depth (functions included)."""
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.append((node.module or "", [a.name for a in node.names]))
    return found


def modules_under(prefix: str) -> dict[str, Path]:
    return {n: p for n, p in module_names().items() if n == prefix or n.startswith(prefix + ".")}


def test_engine_uses_only_what_kvtier_hf_exports() -> None:
    import kvtier.hf

    exported = set(kvtier.hf.__all__)
    wrong: list[str] = []
    for name, path in modules_under("kvtier.engine").items():
        for module, names in every_import(path):
            if module.startswith("kvtier.hf."):
                wrong.append(f"{name} imports {module}")
            elif module == "kvtier.hf":
                wrong += [f"{name} imports kvtier.hf.{n}" for n in names if n not in exported]
    assert not wrong, "the engine reaches inside kvtier.hf: " + "; ".join(wrong)


def test_runtime_is_framework_free() -> None:
    banned = ("transformers", "kvtier.hf", "kvtier.engine", "kvtier.server")
    wrong = [
        f"{name} imports {module}"
        for name, path in modules_under("kvtier.runtime").items()
        for module, _ in every_import(path)
        if any(module == b or module.startswith(b + ".") for b in banned)
    ]
    assert modules_under("kvtier.runtime")
    assert not wrong, "kvtier.runtime must not depend on adapters: " + "; ".join(wrong)


def test_no_module_over_400_lines() -> None:
    long = {
        name: n
        for name, path in module_names().items()
        if (n := len(path.read_text().splitlines())) > 400
    }
    assert not long, f"split these by responsibility (lines): {long}"
