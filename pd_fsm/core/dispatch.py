"""One way to execute a table's effects, for every machine in the core.

An owner (an endpoint, the registry, the router) has one ``_fx_<Effect>`` method per effect its
tables name, and no other ``_fx_`` method. ``bind_effects`` checks both directions and returns the
bound methods by name, so a step calls ``handlers[name](...)`` for each effect of its row: an
effect runs because the row names it. A mismatch fails when the owner is built (at import for the
module-level tables, at start-up for a worker) and in ``pd-fsm spec check`` (``handler_problems``
over ``machines.core_machines``, which lists the owners: it lives above them, since they import
this module).
"""

from __future__ import annotations

from collections.abc import Callable

from pd_fsm.core.tables import StateTable

PREFIX = "_fx_"


def handler_problems(owner: type, tables: tuple[StateTable, ...]) -> list[str]:
    """What is wrong between ``owner``'s ``_fx_`` methods and the effects of ``tables``."""
    effects = {e for t in tables for e in t.effects}
    methods = {
        n[len(PREFIX):] for n in dir(owner) if n.startswith(PREFIX) and callable(getattr(owner, n))
    }
    names = "+".join(t.name for t in tables)
    return [
        *(f"{owner.__name__}: effect {e!r} of {names} has no {PREFIX}{e} method"
          for e in sorted(effects - methods)),
        *(f"{owner.__name__}: method {PREFIX}{m} runs no effect of {names}"
          for m in sorted(methods - effects)),
    ]


def bind_effects(owner: object, *tables: StateTable) -> dict[str, Callable[..., None]]:
    """``owner``'s handler for every effect of ``tables`` (TypeError on any mismatch)."""
    problems = handler_problems(type(owner), tables)
    if problems:
        raise TypeError("; ".join(problems))
    return {e: getattr(owner, PREFIX + e) for t in tables for e in t.effects}
