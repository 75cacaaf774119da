"""The size rule ("the house"): no class in ``pd_fsm`` with more than 20 methods
(defs in its body) and no function over 60 lines, except those named here with the reason —
the same list as docs/architecture.md. A class that grows past the bound is a class
with a second concern; split it (or name it here and in docs/architecture.md, saying why)."""

from __future__ import annotations

import ast
from pathlib import Path

import pd_fsm

MAX_METHODS = 20
MAX_LINES = 60

# "module:Class" -> (its methods today, why it may).
CLASS_EXCEPTIONS: dict[str, tuple[int, str]] = {}
FUNCTION_EXCEPTIONS: dict[str, tuple[int, str]] = {}

ROOT = Path(pd_fsm.__file__).parent


def _shapes() -> tuple[dict[str, int], dict[str, int]]:
    classes: dict[str, int] = {}
    functions: dict[str, int] = {}
    for path in sorted(ROOT.rglob("*.py")):
        name = path.relative_to(ROOT.parent).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                classes[f"{name}:{node.name}"] = sum(
                    isinstance(x, ast.FunctionDef | ast.AsyncFunctionDef) for x in node.body)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                key = f"{name}:{node.name}"
                functions[key] = max(lines, functions.get(key, 0))
    return classes, functions


def test_no_class_over_the_bound_unless_named() -> None:
    classes, _ = _shapes()
    over = {k: n for k, n in classes.items()
            if n > CLASS_EXCEPTIONS.get(k, (MAX_METHODS, ""))[0]}
    assert not over, f"classes over {MAX_METHODS} methods (split, or name them): {over}"
    stale = [k for k, (n, _) in CLASS_EXCEPTIONS.items() if classes.get(k, 0) <= MAX_METHODS]
    assert not stale, f"named exceptions now within the bound: drop them: {stale}"


def test_no_function_over_the_bound_unless_named() -> None:
    _, functions = _shapes()
    over = {k: n for k, n in functions.items()
            if n > FUNCTION_EXCEPTIONS.get(k, (MAX_LINES, ""))[0]}
    assert not over, f"functions over {MAX_LINES} lines (split, or name them): {over}"
