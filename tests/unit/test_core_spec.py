"""`pd-fsm spec check` finds every kind of table problem; `spec diagram` draws every table."""

from __future__ import annotations

from pathlib import Path

import pytest

from pd_fsm.cli import main
from pd_fsm.core.tables import ALL_TABLES, TABLE_NAMES, check_all, load_table, tables_dir

GOOD = """
name = "t"
doc = "a test table"
initial = "A"
terminal = ["C"]
[states]
A = { doc = "a" }
B = { doc = "b" }
C = { doc = "c" }
[triggers]
go = { doc = "go" }
stop = { remote = true, doc = "stop" }
[effects]
Ping = "ping"
[[rows]]
from = "A"
on = "go"
to = "B"
do = ["Ping"]
why = "because"
[[rows]]
from = "B"
on = "stop"
to = "C"
why = "done"
"""


def _write(tmp_path: Path, text: str) -> Path:
    (tmp_path / "t.toml").write_text(text)
    return tmp_path


def test_project_tables_are_clean() -> None:
    assert check_all() == {f"{n}.toml": [] for n in sorted(TABLE_NAMES)}
    assert main(["spec", "check"]) == 0


def test_good_table_passes(tmp_path: Path) -> None:
    assert check_all(_write(tmp_path, GOOD)) == {"t.toml": []}


@pytest.mark.parametrize(
    ("mutation", "problem"),
    [
        (('to = "C"', 'to = "Z"'), "unknown state 'Z'"),
        (('D = { doc = "d" }', None), "state 'D' is unreachable"),
        (("ADD_ROW_FROM_C", None), "terminal state 'C' has an exit"),
        (("[effects]", '[effects]\nUnused = "x"'), "effect 'Unused' is used by no row"),
        (("[triggers]", '[triggers]\nidle = { doc = "x" }'), "trigger 'idle' is used by no row"),
        (('on = "go"', 'on = "went"'), "unknown trigger 'went'"),
        (('do = ["Ping"]', 'do = ["Pong"]'), "unknown effect 'Pong'"),
        (('initial = "A"', 'initial = "Q"'), "initial state 'Q' is not a state"),
        (('B = { doc = "b" }', 'B = { doc = "b" }\nE = { doc = "dead end" }\n'), "unreachable"),
        (('go = { doc = "go" }', 'go = { status = 200, doc = "go" }'),
         "trigger go: status must be an HTTP error code, got 200"),
        (("[triggers]", '[timeouts]\nZ = { window = "w", status = 504, reason = "r" }\n'
          "[triggers]"), "timeout for unknown state 'Z'"),
        (("[triggers]", '[timeouts]\nB = { window = "w", status = 504, reason = "{room}" }\n'
          "[triggers]"), "timeout of B: needs window, status and a reason template"),
        (("[triggers]", '[timeouts]\nB = { window = "w", reason = "r" }\n[triggers]'),
         "timeout of B: needs window, status and a reason template"),
    ],
)
def test_each_problem_is_reported(
    tmp_path: Path, mutation: tuple[str, str | None], problem: str
) -> None:
    old, new = mutation
    text = GOOD
    if old == "ADD_ROW_FROM_C":
        text += '[[rows]]\nfrom = "C"\non = "go"\nto = "A"\nwhy = "x"\n'
    elif new is None:
        text = text.replace("[triggers]", f"{old}\n[triggers]") if "doc" in old else text
    else:
        text = text.replace(old, new, 1)
    problems = check_all(_write(tmp_path, text))["t.toml"]
    assert any(problem in p for p in problems), problems
    assert main(["spec", "check", "--tables", str(tmp_path)]) == 1


def test_duplicate_rows_and_dead_ends(tmp_path: Path) -> None:
    text = GOOD + '[[rows]]\nfrom = "A"\non = "go"\nto = "C"\nwhy = "again"\n'
    text = text.replace('C = { doc = "c" }', 'C = { doc = "c" }\nD = { doc = "d" }')
    text += '[[rows]]\nfrom = "A"\non = "stop"\nto = "D"\nwhy = "to a dead end"\n'
    problems = check_all(_write(tmp_path, text))["t.toml"]
    assert any("duplicate row for (A, go)" in p for p in problems)
    assert any("non-terminal state 'D' has no exits" in p for p in problems)


def test_invalid_toml_is_reported(tmp_path: Path) -> None:
    assert "not valid TOML" in check_all(_write(tmp_path, "name = "))["t.toml"][0]


def test_diagrams_written_for_every_table(tmp_path: Path) -> None:
    assert main(["spec", "diagram", "--out", str(tmp_path)]) == 0
    for name in TABLE_NAMES:
        text = (tmp_path / f"{name}.md").read_text()
        assert "stateDiagram-v2" in text
        for row in ALL_TABLES[name].rows:
            assert f"{row.source} --> {row.target}" in text


def test_committed_diagrams_are_current(tmp_path: Path) -> None:
    main(["spec", "diagram", "--out", str(tmp_path)])
    committed = Path(__file__).resolve().parents[2] / "docs" / "state_machines"
    for name in TABLE_NAMES:
        assert (committed / f"{name}.md").read_text() == (tmp_path / f"{name}.md").read_text(), (
            f"docs/state_machines/{name}.md is stale: run `pd-fsm spec diagram`"
        )


def test_load_table_refuses_a_broken_table(tmp_path: Path) -> None:
    from pd_fsm.core.tables import TableError

    _write(tmp_path, GOOD.replace('to = "C"', 'to = "Z"'))
    with pytest.raises(TableError, match="unknown state 'Z'"):
        load_table("t", tmp_path)


def test_status_and_timeout_columns_are_compiled(tmp_path: Path) -> None:
    text = GOOD.replace('go = { doc = "go" }', 'go = { status = 503, doc = "go" }').replace(
        "[triggers]", '[timeouts]\nB = { window = "w", status = 504, '
        'reason = "none from {bootstrap_addr} in {window:g} s" }\n[triggers]')
    table = load_table("t", _write(tmp_path, text))
    assert table.status("go") == 503 and table.status("stop") == 500
    assert table.timeouts["B"].status == 504
    assert table.timeouts["B"].message(2.5, "p:1") == "none from p:1 in 2.5 s"


def test_a_timeout_window_that_is_no_config_field_fails_at_construction() -> None:
    import attrs

    from pd_fsm.core.decode_endpoint import DecodeEndpoint
    from pd_fsm.core.tables import KV_RECEIVER, StateTimeout

    class Misnamed(DecodeEndpoint):
        table = attrs.evolve(KV_RECEIVER, timeouts={
            **KV_RECEIVER.timeouts, "RESOLVING": StateTimeout("resolve_timeot", 504, "x")})

    with pytest.raises(TypeError, match="resolve_timeot"):
        Misnamed("d0", "layout")


def test_spec_check_matches_every_effect_with_its_handler(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["spec", "check"]) == 0
    out = capsys.readouterr().out
    for owner in ("PrefillEndpoint runs kv_sender", "Leases runs kv_hold_lease",
                  "DecodeEndpoint runs kv_receiver", "BootstrapRegistry runs instance_lease",
                  "RoomRouter runs room"):
        assert f"{owner}: every effect has its handler" in out, out


def test_an_effect_without_a_handler_or_a_handler_without_an_effect_is_refused() -> None:
    from pd_fsm.core.dispatch import bind_effects, handler_problems
    from pd_fsm.core.router import RoomRouter
    from pd_fsm.core.tables import ROOM

    class Forgetful(RoomRouter):
        _fx_ReplyError = None  # type: ignore[assignment]  # the handler is gone

        def _fx_Teleport(self) -> None:  # a handler no row names
            pass

    problems = handler_problems(Forgetful, (ROOM,))
    assert any("method _fx_Teleport runs no effect of room" in p for p in problems), problems
    assert any("effect 'ReplyError' of room has no _fx_ReplyError" in p for p in problems)
    with pytest.raises(TypeError, match="_fx_Teleport"):
        bind_effects(object.__new__(Forgetful), ROOM)


def test_an_effect_runs_through_exactly_one_of_the_owner_and_its_parts() -> None:
    from pd_fsm.core.decode_endpoint import DecodeEndpoint
    from pd_fsm.core.decode_outbox import ReceiverOutbox
    from pd_fsm.core.decode_peers import PeerTracker
    from pd_fsm.core.decode_pulls import Pulls
    from pd_fsm.core.dispatch import handler_problems

    tables = (DecodeEndpoint.table,)
    assert handler_problems(DecodeEndpoint, tables, DecodeEndpoint.effect_parts) == []

    class Twice(ReceiverOutbox):
        def _fx_StartPull(self) -> None:  # Pulls runs StartPull already
            pass

    problems = handler_problems(DecodeEndpoint, tables, (PeerTracker, Pulls, Twice))
    assert problems == ["DecodeEndpoint: effect 'StartPull' of kv_receiver has a _fx_StartPull "
                        "method in Pulls and in Twice"], problems
    missing = handler_problems(DecodeEndpoint, tables, (PeerTracker, ReceiverOutbox))
    assert any("effect 'StartPull' of kv_receiver has no _fx_StartPull" in p for p in missing)


def test_tables_are_package_data_and_spec_links_there() -> None:

    shipped = sorted(p.name for p in tables_dir().iterdir() if p.name.endswith(".toml"))
    assert shipped == sorted(f"{n}.toml" for n in TABLE_NAMES)
    link = Path(__file__).resolve().parents[2] / "spec" / "state_tables"
    assert link.resolve() == Path(str(tables_dir())).resolve()
