"""pd_fsm.core imports only the standard library, attrs, cattrs and msgpack (docs/design.md,
"pd_fsm's own principles")."""

from __future__ import annotations

import json
import subprocess
import sys

ALLOWED_THIRD_PARTY = {
    "attrs",
    "attr",
    "cattrs",
    "cattr",
    "msgpack",
    "typing_extensions",
    "exceptiongroup",
}
# Stdlib modules that do I/O, threads or clocks have no business in the core.
FORBIDDEN_STDLIB = {"socket", "threading", "asyncio", "selectors", "subprocess", "time", "select"}


def _modules_loaded_by(statement: str) -> set[str]:
    code = (
        "import sys, json; before = set(sys.modules); "
        f"{statement}; "
        "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return {m.split(".")[0] for m in json.loads(out.stdout)}


def test_core_imports_only_allowed_modules() -> None:
    loaded = _modules_loaded_by("import pd_fsm.core")
    # msgpack's C extension brings Cython's runtime modules along
    third_party = {
        m
        for m in loaded
        if m not in sys.stdlib_module_names and m != "pd_fsm" and "cython" not in m
    }
    assert third_party <= ALLOWED_THIRD_PARTY, (
        f"core pulled in {sorted(third_party - ALLOWED_THIRD_PARTY)}"
    )
    for banned in (
        "jax",
        "jaxlib",
        "numpy",
        "trio",
        "zmq",
        "httpx",
        "hypercorn",
        "starlette",
        "transitions",
    ):
        assert banned not in loaded


def test_core_source_has_no_io_imports() -> None:
    import ast
    import pathlib

    import pd_fsm.core

    for path in pathlib.Path(pd_fsm.core.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module.split(".")[0]]
            bad = FORBIDDEN_STDLIB.intersection(names)
            assert not bad, f"{path.name} imports {bad}"


# Modules above the core that must not load JAX either: the text layer (handling text needs no
# accelerator stack), what the HTTP layer checks requests with, and host_memory, which the worker
# imports to re-execute itself before JAX is imported (issue 29 §6; each folder's __init__ is
# kept empty so that importing these loads nothing else of their folder).
JAX_FREE = (
    "pd_fsm.text",
    "pd_fsm.text.tokenizer",
    "pd_fsm.text.chat_template",
    "pd_fsm.jax_engine.sampling.params",
    "pd_fsm.jax_engine.sampling.grammar",
    "pd_fsm.jax_engine.kv.host_memory",
    "pd_fsm.jax_engine.kv.counters",
    "pd_fsm.jax_engine.compilation.buckets",
)


def test_text_and_the_jax_free_engine_modules_do_not_load_jax() -> None:
    loaded = _modules_loaded_by("; ".join(f"import {m}" for m in JAX_FREE))
    assert not {"jax", "jaxlib"} & loaded, f"one of {JAX_FREE} loads JAX"
