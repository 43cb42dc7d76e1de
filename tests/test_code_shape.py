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
