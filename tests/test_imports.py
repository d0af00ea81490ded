"""The package's imports go one way: no module of ``rtkernels`` reaches itself again through
imports, counting the imports inside functions too (a lazy import only hides a circle)."""

from __future__ import annotations

import ast
from pathlib import Path

import rtkernels

ROOT = Path(rtkernels.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _resolve(current: str, is_package: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = current.split(".")
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def import_graph() -> dict[str, set[str]]:
    """Module -> the rtkernels modules it imports (``from pkg import name`` counts as an edge to
    ``pkg.name`` when that is a module, else to ``pkg``)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_pkg, node.level, node.module)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                while t and t not in mods:  # "rtkernels.jit.driver.x" -> the module that holds it
                    t = t.rpartition(".")[0]
                if t and t != name:
                    graph[name].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_the_package():
    g = import_graph()
    assert "rtkernels.api" in g and "rtkernels.methods.chunk.launch" in g
    assert "rtkernels.jit" in g["rtkernels.methods.scan"]  # an edge it must find


def test_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles():
    assert cycles(import_graph()) == []


def test_jit_imports_nothing_else_of_rtkernels():
    g = import_graph()
    for mod, deps in g.items():
        if mod.startswith("rtkernels.jit"):
            assert all(d.startswith("rtkernels.jit") for d in deps), (mod, deps)


def test_autotune_reaches_methods_only_through_the_registry():
    g = import_graph()
    for mod, deps in g.items():
        if mod.startswith("rtkernels.autotune"):
            bad = {d for d in deps if d.startswith("rtkernels.methods") and d != "rtkernels.methods.registry"}
            assert not bad and "rtkernels.api" not in deps and "rtkernels" not in deps, (mod, deps)


def test_former_module_names_still_work():
    """Modules that moved keep their old import paths, as the very same module objects."""
    import rtkernels.decay_grad
    import rtkernels.jit
    import rtkernels.kernel_backward
    import rtkernels.methods.chunk.backward
    import rtkernels.methods.chunk.decay_grad
    import rtkernels.runtime
    import rtkernels.runtime.kernel_cache

    assert rtkernels.kernel_backward is rtkernels.methods.chunk.backward
    assert rtkernels.decay_grad is rtkernels.methods.chunk.decay_grad
    assert rtkernels.runtime.kernel_cache is rtkernels.jit.kernel_cache
    assert rtkernels.runtime.get_function is rtkernels.jit.get_function
