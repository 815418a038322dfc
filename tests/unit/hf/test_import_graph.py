"""The modules of ``lmcompact.hf`` import each other without a cycle, and no cache layer
imports its cache (transformers' rule: a layer never calls its cache; the cache drives).

Imports are read with ``ast`` (every ``import`` statement, also those under
``TYPE_CHECKING`` or inside functions), so nothing is imported to check them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lmcompact

ROOT = Path(lmcompact.__file__).resolve().parent
PACKAGE = "lmcompact.hf"
LAYER_MODULES = ("lmcompact.hf.compacting_layer", "lmcompact.hf.paged.layer")
CACHE_MODULES = ("lmcompact.hf.cache", "lmcompact.hf.paged.cache")


def module_files() -> dict[str, Path]:
    """Module name -> file, for every module of the package (``__init__`` as the package)."""
    out = {}
    for path in sorted((ROOT / "hf").rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imported(name: str, path: Path, modules: set[str]) -> set[str]:
    """Modules of ``modules`` that ``name`` (at ``path``) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from pkg import mod`` imports the module, ``from mod import name`` the module
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        out.update(target for target in targets if target in modules and target != name)
    return out


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    modules = set(files)
    return {name: imported(name, path, modules) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_reader_sees_the_known_imports() -> None:
    graph = import_graph()
    assert "lmcompact.hf.compacting_layer" in graph["lmcompact.hf.cache"]
    assert "lmcompact.hf.paged.cache" in graph["lmcompact.hf.paged"]  # the package's __init__
    assert "lmcompact.hf.paged.layer" in graph["lmcompact.hf.paged.compaction"]  # TYPE_CHECKING


def test_the_cycle_finder_names_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_hf_modules_import_without_a_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle among lmcompact.hf modules: " + " -> ".join(cycle or [])


def test_no_layer_imports_its_cache() -> None:
    graph = import_graph()
    for layer in LAYER_MODULES:
        caches = reachable(graph, layer) & set(CACHE_MODULES)
        assert not caches, f"{layer} imports {sorted(caches)} (directly or through others)"
