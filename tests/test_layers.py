"""The package import graph is one-way (docs/design.md, "Layers"), read from the source.

Lowest first: ``memory`` <- ``protocol`` <- ``common`` <- ``model_runners`` and
``scheduler`` (siblings: neither imports the other) <- ``runtime`` <- the HTTP
front (``runtime.front``) <- ``launch``. A module may import its own package
and the layers below it, never one above or beside it; imports inside
functions count (hiding one there does not make the layering hold). Within the
whole tree no modules import each other in a cycle (imports only a type
checker reads, under ``if TYPE_CHECKING:``, are left out: they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = "radixmux"
LAYERS: list[set[str]] = [
    {"memory"},
    {"protocol"},
    {"common"},
    {"model_runners", "scheduler"},
    {"runtime"},
    {"runtime.front"},
    {"launch"},
]
LEVEL = {part: i for i, layer in enumerate(LAYERS) for part in layer}
OUTSIDE = ("tests", "bench", "deploy", ".venv", "build")


def module_files() -> dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in OUTSIDE or rel.parts[0].startswith("."):
            continue
        parts = [PKG, *rel.with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Line numbers of imports under ``if TYPE_CHECKING:``."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                for sub in ast.walk(inner):
                    if isinstance(sub, ast.Import | ast.ImportFrom):
                        lines.add(sub.lineno)
    return lines


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports (at run time)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_only(tree)
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package
                anchor = name.split(".")[: len(name.split(".")) - node.level + is_pkg]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules and m != name}


def layer_part(module: str) -> str:
    """The layering unit a module belongs to (``runtime.front`` is its own)."""
    parts = module.split(".")[1:]
    if not parts:
        return PKG
    if parts[:2] == ["runtime", "front"]:
        return "runtime.front"
    return parts[0]


def graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_no_package_imports_one_above_or_beside_it() -> None:
    bad = []
    for module, deps in graph().items():
        mine = layer_part(module)
        if mine not in LEVEL:
            continue  # the package's own __init__: imports nothing
        for dep in deps:
            theirs = layer_part(dep)
            if theirs in (mine, PKG):
                continue
            if theirs not in LEVEL:
                bad.append(f"{module} -> {dep}: {theirs!r} is in no layer (add it to LAYERS)")
            elif LEVEL[theirs] >= LEVEL[mine]:
                bad.append(f"{module} ({mine}) -> {dep} ({theirs})")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def test_every_package_is_in_a_layer() -> None:
    parts = {layer_part(m) for m in module_files()} - {PKG}
    assert parts <= set(LEVEL), f"not in LAYERS: {sorted(parts - set(LEVEL))}"


def test_no_import_cycles() -> None:
    g = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert not cycles, f"modules importing each other: {cycles}"


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    """The walk really finds imports, in functions and relative ones too."""
    modules = {"radixmux.memory.a": tmp_path / "a.py", "radixmux.runtime.b": tmp_path / "b.py"}
    modules["radixmux.memory.a"].write_text(
        "def f():\n    from radixmux.runtime import b\n    return b\n"
    )
    modules["radixmux.runtime.b"].write_text("from ..memory import a\n")
    assert imports_of("radixmux.memory.a", modules["radixmux.memory.a"], modules) == {
        "radixmux.runtime.b"
    }
    assert imports_of("radixmux.runtime.b", modules["radixmux.runtime.b"], modules) == {
        "radixmux.memory.a"
    }
