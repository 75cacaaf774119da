"""Loading, checking and compiling the state tables (``pd_fsm/core/state_tables/*.toml``, package
data read with ``importlib.resources``; ``spec/state_tables`` links there).

The TOML files are the single source of truth. Each is compiled once, at import, into a dict keyed
by ``(state, trigger)``; a step on the hot path is one dict lookup. Checking (``check_table``)
is separate from compiling so that ``pd-fsm spec check`` can report every problem at once, while
import refuses a table with any problem.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterator, Mapping
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import attrs

from pd_fsm.core.kvpoll import KVPoll

SAME = "@same"  # `to = "@same"`: a self-loop row shared by several `from` states

TABLE_NAMES = ("kv_sender", "kv_receiver", "kv_hold_lease", "instance_lease", "room",
               "worker_breaker", "proxy_session", "proxy_sequence", "kv_handoff", "role_switch")


def tables_dir() -> Traversable:
    """The project's tables, as package data (a checkout and an installed wheel alike)."""
    return resources.files("pd_fsm.core") / "state_tables"


@attrs.frozen(slots=True)
class Transition:
    target: str
    effects: tuple[str, ...]
    reason: str


@attrs.frozen(slots=True)
class Row:
    source: str
    trigger: str
    target: str  # already resolved from "@same"
    effects: tuple[str, ...]
    reason: str


@attrs.frozen(slots=True)
class StateTimeout:
    """A waiting state's deadline (``[timeouts]``): the config window it lasts, and what the
    client is told when it passes."""

    window: str  # a field of the endpoint's config (DecodeConfig)
    status: int
    reason: str  # format fields: {window} (seconds), {bootstrap_addr}

    def message(self, seconds: float, bootstrap_addr: str) -> str:
        return self.reason.format(window=seconds, bootstrap_addr=bootstrap_addr)


class Names:
    """A table's state or trigger names as attributes, so Python code never spells one as a
    string: ``KV_RECEIVER.T.PeerLost`` is ``"PeerLost"``, and a name the table lacks is
    an ``AttributeError`` naming the table (``tests/unit/test_core_names.py`` reads every such
    attribute in the core's source and checks it against its table)."""

    __slots__ = ("_kind", "_names", "_table")

    def __init__(self, table: str, kind: str, names: frozenset[str]) -> None:
        self._table, self._kind, self._names = table, kind, names

    def __getattr__(self, name: str) -> str:
        if name in self._names:
            return name
        raise AttributeError(f"table {self._table} has no {self._kind} {name!r}")

    def __contains__(self, name: object) -> bool:
        return name in self._names


@attrs.frozen(slots=True, eq=False)  # compared by identity: one compiled instance per table
class StateTable:
    name: str
    doc: str
    initial: str
    terminal: frozenset[str]
    states: Mapping[str, str]  # state -> doc
    poll_of: Mapping[str, KVPoll]  # empty for machines that do not expose KVPoll
    triggers: Mapping[str, str]  # trigger -> doc
    remote_triggers: frozenset[str]
    effects: Mapping[str, str]  # effect -> doc
    rows: tuple[Row, ...]
    transitions: Mapping[tuple[str, str], Transition]
    status_of: Mapping[str, int] = attrs.field(factory=dict)  # trigger -> HTTP status on failure
    timeouts: Mapping[str, StateTimeout] = attrs.field(factory=dict)  # state -> its deadline
    # The names as attributes (``Names``): ``table.S.RESOLVING``, ``table.T.PeerLost``.
    S: Names = attrs.field(init=False)
    T: Names = attrs.field(init=False)

    @S.default
    def _state_names(self) -> Names:
        return Names(self.name, "state", frozenset(self.states))

    @T.default
    def _trigger_names(self) -> Names:
        return Names(self.name, "trigger", frozenset(self.triggers))

    def status(self, trigger: str) -> int:
        """The HTTP status a room failing on ``trigger`` answers with (500 unless the table
        says otherwise)."""
        return self.status_of.get(trigger, 500)

    def step(self, state: str, trigger: str) -> Transition | None:
        return self.transitions.get((state, trigger))

    def pairs(self) -> Iterator[tuple[str, str]]:
        """Every (state, trigger) pair, rows or not: the domain of the exhaustive tests."""
        for state in self.states:
            for trigger in self.triggers:
                yield state, trigger


class TableError(ValueError):
    """A table that is malformed or fails the checks; the message lists every problem."""


def _as_list(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def parse_table(data: Mapping[str, Any], name: str) -> tuple[StateTable, list[str]]:
    """Build a table from parsed TOML plus the list of problems ``check`` finds in it."""
    states_raw: Mapping[str, Mapping[str, str]] = data.get("states", {})
    states = {s: info.get("doc", "") for s, info in states_raw.items()}
    poll_of, problems = _poll_values(states_raw)
    triggers_raw: Mapping[str, Mapping[str, Any]] = data.get("triggers", {})
    triggers = {t: info.get("doc", "") for t, info in triggers_raw.items()}
    status_of, status_problems = _statuses(triggers_raw)
    timeouts, timeout_problems = _timeouts(data.get("timeouts", {}), states)
    effects: dict[str, str] = dict(data.get("effects", {}))
    rows, transitions, row_problems = _rows(data.get("rows", []), states, triggers, effects)
    table = StateTable(
        name=data.get("name", name),
        doc=data.get("doc", ""),
        initial=data.get("initial", ""),
        terminal=frozenset(data.get("terminal", [])),
        states=states,
        poll_of=poll_of,
        triggers=triggers,
        remote_triggers=frozenset(
            t for t, info in triggers_raw.items() if info.get("remote", False)
        ),
        effects=effects,
        rows=tuple(rows),
        transitions=transitions,
        status_of=status_of,
        timeouts=timeouts,
    )
    problems += status_problems + timeout_problems + row_problems + check_table(table)
    return table, problems


def _poll_values(
    states_raw: Mapping[str, Mapping[str, str]],
) -> tuple[dict[str, KVPoll], list[str]]:
    """Each state's KVPoll value (all states have one, or none does), and the problems."""
    problems: list[str] = []
    poll_of: dict[str, KVPoll] = {}
    for s, info in states_raw.items():
        if "poll" in info:
            try:
                poll_of[s] = KVPoll[info["poll"]]
            except KeyError:
                problems.append(f"state {s}: unknown KVPoll value {info['poll']!r}")
    if poll_of and set(poll_of) != set(states_raw):
        problems.append(f"states without a poll value: {sorted(set(states_raw) - set(poll_of))}")
    return poll_of, problems


def _statuses(triggers_raw: Mapping[str, Mapping[str, Any]]) -> tuple[dict[str, int], list[str]]:
    """The HTTP status a room failing on each trigger answers with, and the problems."""
    problems: list[str] = []
    status_of: dict[str, int] = {}
    for t, info in triggers_raw.items():
        if "status" in info:
            code: object = info["status"]
            if not isinstance(code, int) or isinstance(code, bool) or not 400 <= code <= 599:
                problems.append(f"trigger {t}: status must be an HTTP error code, got {code!r}")
            else:
                status_of[t] = code
    return status_of, problems


def _timeouts(raw: Mapping[str, Mapping[str, Any]],
              states: Mapping[str, str]) -> tuple[dict[str, StateTimeout], list[str]]:
    """Each waiting state's deadline (``[timeouts]``), and the problems."""
    problems: list[str] = []
    timeouts: dict[str, StateTimeout] = {}
    for s, info in raw.items():
        if s not in states:
            problems.append(f"timeout for unknown state {s!r}")
            continue
        try:
            timeout = StateTimeout(str(info["window"]), int(info["status"]), str(info["reason"]))
            timeout.message(1.0, "host:1")  # the template names only the fields it may
        except (KeyError, ValueError, TypeError, IndexError) as exc:
            problems.append(f"timeout of {s}: needs window, status and a reason template ({exc})")
            continue
        timeouts[s] = timeout
    return timeouts, problems


def _rows(
    raw_rows: list[Mapping[str, Any]], states: Mapping[str, str], triggers: Mapping[str, str],
    effects: Mapping[str, str],
) -> tuple[list[Row], dict[tuple[str, str], Transition], list[str]]:
    """The rows, one per (state, trigger) a TOML row names (``from`` and ``on`` may be lists),
    the transitions they make, and the problems."""
    problems: list[str] = []
    rows: list[Row] = []
    transitions: dict[tuple[str, str], Transition] = {}
    for i, raw in enumerate(raw_rows):
        where = f"row {i + 1}"
        missing = [k for k in ("from", "on", "to", "why") if k not in raw]
        if missing:
            problems.append(f"{where}: missing keys {missing}")
            continue
        for source in _as_list(raw["from"]):
            for trigger in _as_list(raw["on"]):
                target = source if raw["to"] == SAME else raw["to"]
                row = Row(source, trigger, target, tuple(raw.get("do", [])), raw["why"])
                for st in (row.source, row.target):
                    if st not in states:
                        problems.append(f"{where}: unknown state {st!r}")
                if trigger not in triggers:
                    problems.append(f"{where}: unknown trigger {trigger!r}")
                problems.extend(
                    f"{where}: unknown effect {e!r}" for e in row.effects if e not in effects
                )
                if (source, trigger) in transitions:
                    problems.append(f"{where}: duplicate row for ({source}, {trigger})")
                transitions[(source, trigger)] = Transition(row.target, row.effects, row.reason)
                rows.append(row)
    return rows, transitions, problems


def check_table(table: StateTable) -> list[str]:
    """Structural checks: the ones ``pd-fsm spec check`` reports."""
    problems: list[str] = []
    if table.initial not in table.states:
        problems.append(f"initial state {table.initial!r} is not a state")
    problems.extend(
        f"terminal state {t!r} is not a state" for t in table.terminal - set(table.states)
    )
    if not table.terminal:
        problems.append("no terminal states")
    # Reachability from the initial state.
    seen = {table.initial}
    frontier = [table.initial]
    while frontier:
        state = frontier.pop()
        for row in table.rows:
            if row.source == state and row.target not in seen:
                seen.add(row.target)
                frontier.append(row.target)
    problems.extend(
        f"state {s!r} is unreachable from {table.initial!r}" for s in table.states if s not in seen
    )
    problems.extend(
        f"terminal state {r.source!r} has an exit on {r.trigger!r}"
        for r in table.rows
        if r.source in table.terminal
    )
    sources = {r.source for r in table.rows}
    problems.extend(
        f"non-terminal state {s!r} has no exits"
        for s in table.states
        if s not in table.terminal and s not in sources
    )
    used_triggers = {r.trigger for r in table.rows}
    problems.extend(
        f"trigger {t!r} is used by no row" for t in table.triggers if t not in used_triggers
    )
    used_effects = {e for r in table.rows for e in r.effects}
    problems.extend(
        f"effect {e!r} is used by no row" for e in table.effects if e not in used_effects
    )
    problems.extend(
        f"remote trigger {t!r} is not declared" for t in table.remote_triggers - set(table.triggers)
    )
    return problems


def load_table(name: str, directory: Path | None = None) -> StateTable:
    source: Path | Traversable = (directory or tables_dir()) / f"{name}.toml"
    data = tomllib.loads(source.read_text(encoding="utf-8"))
    table, problems = parse_table(data, name)
    if problems:
        raise TableError(f"{source}:\n  " + "\n  ".join(problems))
    return table


def check_all(directory: Path | None = None) -> dict[str, list[str]]:
    """Problems per table file in ``directory`` (every ``*.toml``, not only the known names)."""
    where: Path | Traversable = directory or tables_dir()
    report: dict[str, list[str]] = {}
    for path in sorted(where.iterdir(), key=lambda p: p.name):
        if not path.name.endswith(".toml"):
            continue
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            report[path.name] = [f"not valid TOML: {exc}"]
            continue
        _, problems = parse_table(data, path.name.removesuffix(".toml"))
        report[path.name] = problems
    return report


# Compiled once, at import: everything below reads these.
KV_SENDER = load_table("kv_sender")
KV_RECEIVER = load_table("kv_receiver")
KV_HOLD_LEASE = load_table("kv_hold_lease")
INSTANCE_LEASE = load_table("instance_lease")
ROOM = load_table("room")
WORKER_BREAKER = load_table("worker_breaker")
PROXY_SESSION = load_table("proxy_session")
PROXY_SEQUENCE = load_table("proxy_sequence")
KV_HANDOFF = load_table("kv_handoff")
ROLE_SWITCH = load_table("role_switch")
ALL_TABLES: Mapping[str, StateTable] = {
    t.name: t for t in (KV_SENDER, KV_RECEIVER, KV_HOLD_LEASE, INSTANCE_LEASE, ROOM,
                        WORKER_BREAKER, PROXY_SESSION, PROXY_SEQUENCE, KV_HANDOFF, ROLE_SWITCH)
}
