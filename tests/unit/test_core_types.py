"""The core's types are its contract with embedders: a wrong event or an unhandled effect is a
type error. Checked with mypy itself, on small programs that use the public API."""

from __future__ import annotations

import ast
import textwrap
import types
import typing
from pathlib import Path

import attrs
import pytest
from mypy import api

from pd_fsm.core import effects as fx
from pd_fsm.core import registry

HEADER = """
import random
from typing import assert_never
from pd_fsm.core import DecodeEndpoint, PrefillEndpoint
from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.drive import Endpoint
from pd_fsm.core.handoff import HandoffLedger
from pd_fsm.core.role_switch import RoleSwitch
from pd_fsm.core.registry import BootstrapRegistry, RegistryEffect
from pd_fsm.core.router import RoomRouter
from pd_fsm.core.session import ProxySession, SequenceSession
p = PrefillEndpoint("layout", rng=random.Random(1))
d = DecodeEndpoint(identity="d0", layout_hash="layout")
r = RoomRouter(["p0"], ["d0"], rng=random.Random(1))
reg: BootstrapRegistry[str] = BootstrapRegistry()
ps = ProxySession()
"""


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One mypy cache for the module: the first run analyses pd_fsm.core, the others reuse it."""
    return tmp_path_factory.mktemp("mypy-cache")


def _mypy(cache: Path, body: str) -> tuple[str, int]:
    out, err, status = api.run(["--strict", "--no-error-summary", f"--cache-dir={cache}",
                                "-c", HEADER + textwrap.dedent(body)])
    return out + err, status


def test_a_correct_embedding_checks(cache: Path) -> None:
    out, status = _mypy(cache, """
        effects: list[fx.PrefillEffect] = p.handle(ev.PrefillRequestAccepted(1), 0.0)
        for e in effects:
            match e:
                case fx.SendMessage() | fx.RegisterKV() | fx.NarrowKV() | fx.ReleaseKV():
                    pass
                case fx.RegisterPart():
                    pass
                case fx.CompleteRequest() | fx.FailRequest() | fx.RejectRequest():
                    pass
                case fx.AckWhileBusy():
                    pass
                case _:
                    assert_never(e)
        d_effects: list[fx.DecodeEffect] = d.handle(ev.TimeAdvanced(), 0.0)
    """)
    assert status == 0, out


def test_a_decode_event_given_to_p_is_a_type_error(cache: Path) -> None:
    out, status = _mypy(cache, """
        p.handle(ev.PullSucceeded(1), 0.0)
    """)
    assert status == 1 and 'incompatible type "PullSucceeded"' in out, out


def test_a_forgotten_effect_is_a_type_error(cache: Path) -> None:
    out, status = _mypy(cache, """
        for e in p.handle(ev.TimeAdvanced(), 0.0):
            match e:
                case fx.SendMessage() | fx.RegisterKV() | fx.NarrowKV() | fx.ReleaseKV():
                    pass
                case fx.CompleteRequest() | fx.FailRequest():
                    pass
                case _:
                    assert_never(e)
    """)
    assert status == 1 and "RejectRequest" in out, out


def test_each_owner_is_an_endpoint_of_its_own_unions(cache: Path) -> None:
    out, status = _mypy(cache, """
        pe: Endpoint[ev.PrefillEvent, fx.PrefillEffect] = p
        de: Endpoint[ev.DecodeEvent, fx.DecodeEffect] = d
        re: Endpoint[ev.RouterEvent, fx.RouterEffect] = r
        rg: Endpoint[ev.RegistryEvent[str], RegistryEffect[str]] = reg
        se: Endpoint[ev.SessionEvent, fx.SessionEffect] = ps
        sq: Endpoint[ev.SessionEvent, fx.SessionEffect] = SequenceSession()
        ho: Endpoint[ev.HandoffEvent, fx.HandoffEffect] = HandoffLedger()
        rs: Endpoint[ev.RoleSwitchEvent, fx.RoleSwitchEffect] = RoleSwitch("null", ("null",))
        # Events are contravariant: an endpoint of P's events serves a driver of fewer.
        narrower: Endpoint[ev.TimeAdvanced, fx.PrefillEffect] = p
    """)
    assert status == 0, out


def test_an_owner_is_not_an_endpoint_of_another_union(cache: Path) -> None:
    out, status = _mypy(cache, """
        wrong: Endpoint[ev.DecodeEvent, fx.DecodeEffect] = p
    """)
    assert status == 1 and "PrefillEndpoint" in out and "Endpoint[" in out, out


def test_a_router_embedding_is_checked_for_every_effect(cache: Path) -> None:
    complete = """
        for e in r.handle(ev.TimeAdvanced(), 0.0):
            match e:
                case fx.DispatchRoom() | fx.DispatchLocal() | fx.RelayDecode() | fx.AbortLeg():
                    pass
                case fx.ReplyError() | fx.ReopenRoom() | fx.BreakerChanged():
                    pass
                case fx.RedirectDecode() | fx.ShedRequest() | fx.NoWorkers():
                    pass
                case _:
                    assert_never(e)
    """
    out, status = _mypy(cache, complete)
    assert status == 0, out
    out, status = _mypy(cache, complete.replace("| fx.BreakerChanged()", ""))
    assert status == 1 and "BreakerChanged" in out, out


# The closed unions, and the module each owner's effects are built in (fx.<Effect>(...)).
UNIONS = {
    "PrefillEffect": fx.PrefillEffect,
    "DecodeEffect": fx.DecodeEffect,
    "RouterEffect": fx.RouterEffect,
    "RegistryEffect": registry.RegistryEffect,
    "SessionEffect": fx.SessionEffect,
    "HandoffEffect": fx.HandoffEffect,
    "RoleSwitchEffect": fx.RoleSwitchEffect,
}
OWNERS = {
    "prefill_endpoint.py": "PrefillEffect",
    "decode_endpoint.py": "DecodeEffect",
    "router.py": "RouterEffect",
    "breakers.py": "RouterEffect",  # the router's breakers build its BreakerChanged
    "registry.py": "RegistryEffect",
    "session.py": "SessionEffect",
    "handoff.py": "HandoffEffect",
    "role_switch.py": "RoleSwitchEffect",
}


def _members(union: object) -> set[str]:
    out = set()
    for t in typing.get_args(union):
        t = typing.get_origin(t) or t  # InstanceExpired[Rec]
        out.add(t.__name__)
    return out


def test_every_effect_an_owner_builds_is_in_its_union() -> None:
    """mypy proves it through each owner's typed ``out`` list; this says it without mypy, and
    fails with the owner's name if one builds an effect its union lacks."""
    core = Path(fx.__file__).parent
    missing = []
    for module, union in OWNERS.items():
        tree = ast.parse((core / module).read_text())
        built = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)
                 and n.func.value.id == "fx"}
        assert built, module
        missing += [f"{module}: fx.{name} not in {union}"
                    for name in sorted(built - _members(UNIONS[union]))]
    assert not missing, missing


def test_every_effect_class_is_in_a_union() -> None:
    classes = {name for name, obj in vars(fx).items()
               if isinstance(obj, type) and attrs.has(obj) and obj.__module__ == fx.__name__}
    covered = set().union(*(_members(u) for u in UNIONS.values()))
    assert classes - covered == set()
    assert isinstance(fx.IOEffect, types.UnionType)
    assert _members(fx.IOEffect) <= _members(fx.PrefillEffect) | _members(fx.DecodeEffect)
