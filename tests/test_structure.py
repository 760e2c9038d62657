"""The package's shape: no import cycle inside ``ringfa4/`` and only the options module reads
``RINGFA4_*`` variables. Both are built statically from the source (every import statement,
function-local and ``TYPE_CHECKING`` ones included), so they need no GPU and import nothing."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "ringfa4"
OPTIONS = ROOT / "options.py"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(module: str, is_package: bool, node: ast.ImportFrom | ast.Import, known: set[str]) -> list[str]:
    """The ringfa4 modules an import statement loads (a ``from pkg import name`` of a submodule
    counts as that submodule; otherwise the package itself)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "ringfa4" and a.name in known]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != "ringfa4":
        return []
    out = []
    for a in node.names:
        sub = f"{target}.{a.name}"
        if sub in known:
            out.append(sub)
        elif target in known:
            out.append(target)
    return out


def import_graph(modules: dict[str, pathlib.Path] | None = None) -> dict[str, set[str]]:
    """module -> the ringfa4 modules it imports (any import statement anywhere in the file). A
    module importing ``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__``: those edges count."""
    modules = modules or _modules()
    known = set(modules)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _resolve(mod, is_package, node, known):
                    parts = target.split(".")
                    for i in range(2, len(parts) + 1):
                        dep = ".".join(parts[:i])
                        # a package's own submodules importing the package: not an edge to itself
                        if dep in known and dep != mod and not mod.startswith(dep + "."):
                            graph[mod].add(dep)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
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


def test_no_import_cycle():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles inside ringfa4/: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_cycle_finder_sees_function_local_and_type_checking_imports(tmp_path):
    """The finder is not blind to the imports that hide cycles: a function-local import and a
    ``TYPE_CHECKING`` one closing a loop are reported."""
    pkg = tmp_path / "ringfa4"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from .b import x\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from . import c\nx = 1\n")
    (pkg / "sub" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      "    from ringfa4.sub.a import y\n")
    mods = {".".join(p.relative_to(tmp_path).with_suffix("").parts).removesuffix(".__init__"): p
            for p in pkg.rglob("*.py")}
    assert find_cycles(import_graph(mods)) == [["ringfa4.sub.a", "ringfa4.sub.b", "ringfa4.sub.c"]]


def _strings_outside_docstrings(tree: ast.AST):
    doc_nodes = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                doc_nodes.add(id(first.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in doc_nodes:
            yield node


def test_only_the_options_module_reads_ringfa4_variables():
    """No module but ``ringfa4/options.py`` names a ``RINGFA4_`` variable in code (strings in
    docstrings may mention them): every choice comes through RingOptions."""
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        if path == OPTIONS:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in _strings_outside_docstrings(tree):
            if "RINGFA4_" in node.value:
                offenders.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {node.value[:60]!r}")
    assert not offenders, "RINGFA4_ variables read outside ringfa4/options.py:\n" + "\n".join(offenders)
