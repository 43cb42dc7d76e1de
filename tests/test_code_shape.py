"""The shape the package keeps (issue 37): no function over 80 lines, docstring included, so that each
one can be read whole; a longer one is split by job (see fastml_strategy/autotune/cli.py's parser)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fastml_strategy"
MAX_LINES = 80


def test_no_function_over_80_lines():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "split these functions by job: " + "; ".join(long)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports, at module level or inside functions (an import of a
    module's own parent package does not count: Python runs the parent first anyway)."""
    mods = {}
    for p in PACKAGE.rglob("*.py"):
        parts = p.relative_to(PACKAGE.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph = {}
    for m, p in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(p.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = m.split(".") if p.name == "__init__.py" else m.split(".")[:-1]
                mod = (".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
                       if node.level else node.module or "")
                names = [mod] + [f"{mod}.{a.name}" for a in node.names]
            for d in names:
                while d and d not in mods:
                    d = d.rpartition(".")[0]
                if d and d != m and not m.startswith(d + "."):
                    deps.add(d)
        graph[m] = deps
    return graph


def test_no_import_circle():
    """No module of the package reaches itself through its imports (issue 37): each layer imports
    only the layers below it."""
    graph = _import_graph()

    def reaches(start):
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo += graph[m]
        return seen

    circles = sorted(m for m in graph if m in reaches(m))
    assert not circles, f"modules on an import circle: {circles}"
