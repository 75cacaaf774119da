"""One way to execute a table's effects, for every machine in the core.

An owner (an endpoint, the registry, the router) has one ``_fx_<Effect>`` method per effect its
tables name, and no other ``_fx_`` method; an endpoint split by concern runs some of them through
its parts (the objects it holds: D's peer tracker, its pulls, ...), each effect through exactly
one of them. ``bind_effects`` checks both directions and returns the bound methods by name, so a
step calls ``handlers[name](...)`` for each effect of its row: an effect runs because the row
names it. A mismatch fails when the owner is built (at import for the module-level tables, at
start-up for a worker) and in ``pd-fsm spec check`` (``handler_problems`` over
``machines.core_machines``, which lists the owners: it lives above them, since they import this
module).
"""

from __future__ import annotations

from collections.abc import Callable

from pd_fsm.core.tables import StateTable

PREFIX = "_fx_"


def _handlers(owner: type) -> list[str]:
    """The effect names ``owner`` has a ``_fx_`` method for, sorted."""
    return sorted(
        n[len(PREFIX):] for n in dir(owner) if n.startswith(PREFIX) and callable(getattr(owner, n))
    )


def handler_problems(owner: type, tables: tuple[StateTable, ...],
                     parts: tuple[type, ...] = ()) -> list[str]:
    """What is wrong between the ``_fx_`` methods of ``owner`` and its ``parts`` and the effects
    of ``tables``: an effect no method runs, or two do, or a method that runs no effect."""
    effects = {e for t in tables for e in t.effects}
    names = "+".join(t.name for t in tables)
    runs: dict[str, list[type]] = {}
    extra: list[str] = []
    for o in (owner, *parts):
        for m in _handlers(o):
            if m in effects:
                runs.setdefault(m, []).append(o)
            else:
                extra.append(f"{o.__name__}: method {PREFIX}{m} runs no effect of {names}")
    return [
        *(f"{owner.__name__}: effect {e!r} of {names} has no {PREFIX}{e} method"
          for e in sorted(effects - runs.keys())),
        *extra,
        *(f"{owner.__name__}: effect {e!r} of {names} has a {PREFIX}{e} method in "
          f"{' and in '.join(o.__name__ for o in by)}"
          for e, by in sorted(runs.items()) if len(by) > 1),
    ]


def bind_effects(owner: object, *tables: StateTable,
                 parts: tuple[object, ...] = ()) -> dict[str, Callable[..., None]]:
    """The handler for every effect of ``tables``, ``owner``'s or one of its ``parts``'
    (TypeError on any mismatch)."""
    problems = handler_problems(type(owner), tables, tuple(type(p) for p in parts))
    if problems:
        raise TypeError("; ".join(problems))
    by_name = {e: o for o in (owner, *parts) for e in _handlers(type(o))}
    return {e: getattr(by_name[e], PREFIX + e) for t in tables for e in t.effects}
