"""The command line's place in the package: its imports go one way (cli -> api, methods, autotune,
jit, env; env -> jit at most; nothing in rtkernels but ``__main__`` imports cli), and neither it,
env nor the profiling scripts of bench/ import a private (underscore) name of another module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import rtkernels

PKG = Path(rtkernels.__file__).resolve().parent
ROOT = PKG.parent
PROFILING = ROOT / "bench" / "profiling"


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import of ``path``, relative ones resolved."""
    mod = _module(path)
    base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                target = ".".join(base[:len(base) - node.level + 1] + ([target] if target else []))
            out.append((target, [a.name for a in node.names]))
    return out


def _rtkernels_deps(path: Path) -> set[str]:
    deps = set()
    for target, names in _imports(path):
        if target == "rtkernels" or target.startswith("rtkernels."):
            deps.add(target)
            deps.update(f"{target}.{n}" for n in names)
    return deps


def _private_uses(path: Path) -> list[str]:
    """``from m import _x``, ``import m._x`` and ``m._x`` where ``m`` is an imported module."""
    tree = ast.parse(path.read_text(), str(path))
    private = lambda name: name.startswith("_") and not name.startswith("__")  # noqa: E731
    found, bound = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found += [f"{path.name}:{node.lineno}: from {node.module} import {a.name}" for a in node.names
                      if private(a.name)]
            bound.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            found += [f"{path.name}:{node.lineno}: import {a.name}" for a in node.names
                      if any(private(p) for p in a.name.split("."))]
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_nothing_in_the_package_imports_the_cli():
    for path in PKG.rglob("*.py"):
        mod = _module(path)
        if mod.startswith("rtkernels.cli") or mod == "rtkernels.__main__":
            continue
        assert not any(d == "rtkernels.cli" or d.startswith("rtkernels.cli.") for d in _rtkernels_deps(path)), mod


def test_env_imports_jit_at_most():
    deps = _rtkernels_deps(PKG / "env.py")
    assert all(d.startswith("rtkernels.jit") for d in deps), deps


def test_the_cli_imports_only_the_package_layers_below_it():
    allowed = ("rtkernels.cli", "rtkernels.api", "rtkernels.methods", "rtkernels.autotune", "rtkernels.jit",
               "rtkernels.env", "rtkernels.autograd", "rtkernels.normalize_op",  # the bench labels its rows by it
               "rtkernels.instances",  # the kernel inventory `rtkernels compile` fills the cache with
               "rtkernels.compiled_call")  # `rtkernels compile` and the bench build the compiled entry
    for path in (PKG / "cli").rglob("*.py"):
        bad = {d for d in _rtkernels_deps(path) if d != "rtkernels" and not d.startswith(allowed)}
        # "from rtkernels import causal_linear_attention, METHODS": the package's public names
        bad -= {f"rtkernels.{n}" for n in rtkernels.__all__}
        assert not bad, (_module(path), bad)


@pytest.mark.parametrize("path", [*sorted((PKG / "cli").rglob("*.py")), PKG / "env.py", PKG / "__main__.py",
                                  *sorted(PROFILING.glob("*.py"))], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_names_of_other_modules(path):
    assert _private_uses(path) == []


@pytest.mark.skipif(not PROFILING.is_dir(), reason="bench/ is not in the sdist")
def test_profiling_scripts_set_no_removed_knobs():
    for path in sorted(p for p in PROFILING.iterdir() if p.suffix in (".py", ".sh")):
        text = path.read_text()
        assert "RTK_PROBE" not in text and "RTK_KUNROLL" not in text, path.name
