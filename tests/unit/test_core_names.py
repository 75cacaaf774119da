"""No state or trigger name is spelled as a string in Python: the code reads them as attributes of
their table (``tables.Names``), and every such attribute in the package names something its table
has — checked here for every module, so a typo in a path no test runs still fails CI."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import pd_fsm
from pd_fsm.core.tables import (
    INSTANCE_LEASE,
    KV_HOLD_LEASE,
    KV_RECEIVER,
    KV_SENDER,
    ROOM,
    Names,
)

TABLES = (KV_SENDER, KV_RECEIVER, KV_HOLD_LEASE, INSTANCE_LEASE, ROOM)
ALL_NAMES = {n for t in TABLES for n in (*t.states, *t.triggers)}
PACKAGE = Path(pd_fsm.__file__).parent
MODULES = sorted(
    m.name for m in pkgutil.walk_packages([str(PACKAGE)], "pd_fsm.")
    if not m.ispkg and m.name != "pd_fsm.__main__"
)


def _source(module: str) -> ast.Module:
    return ast.parse(Path(importlib.import_module(module).__file__ or "").read_text())


def _docstrings(tree: ast.Module) -> set[int]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {
        id(node.body[0].value) for node in ast.walk(tree)
        if isinstance(node, kinds) and node.body and isinstance(node.body[0], ast.Expr)
    }


@pytest.mark.parametrize("module", MODULES)
def test_no_state_or_trigger_name_as_a_string(module: str) -> None:
    tree = _source(module)
    docs = _docstrings(tree)
    spelled = sorted({
        (node.lineno, node.value) for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in ALL_NAMES and id(node) not in docs
    })
    assert not spelled, f"{module} spells table names as strings: {spelled}"


@pytest.mark.parametrize("module", MODULES)
def test_every_name_read_from_a_table_exists(module: str) -> None:
    mod = importlib.import_module(module)
    aliases = {k: v for k, v in vars(mod).items() if isinstance(v, Names)}
    tables = {k: v for k, v in vars(mod).items() if any(v is t for t in TABLES)}
    for node in ast.walk(_source(module)):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        names = None
        if isinstance(base, ast.Name) and base.id in aliases:  # _T.PeerLost
            names = aliases[base.id]
        elif (isinstance(base, ast.Attribute) and base.attr in ("S", "T")
              and isinstance(base.value, ast.Name) and base.value.id in tables):  # ROOM.S.X
            names = getattr(tables[base.value.id], base.attr)
        if names is not None:
            assert node.attr in names, f"{module}:{node.lineno}: no {node.attr!r} in its table"


def test_a_missing_name_is_an_error_naming_the_table() -> None:
    with pytest.raises(AttributeError, match="table kv_receiver has no trigger 'PeerLots'"):
        _ = KV_RECEIVER.T.PeerLots
    assert KV_RECEIVER.S.RESOLVING == "RESOLVING" and "PeerLost" in KV_RECEIVER.T
