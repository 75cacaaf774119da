"""The proxy's routing policies and conditional disaggregation (issue 16 §4): core.routing
through the RoomRouter that embeds it."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.config import RouterConfig
from pd_fsm.core.router import RoomRouter
from pd_fsm.core.routing import (
    BLOCK_CHARS,
    Attempts,
    PrefixIndex,
    Prompt,
    RoutingConfig,
    block_chain,
)

SYSTEM = "You are a museum guide. " * 12  # 288 characters: 4 whole blocks


def _router(prefill: int = 2, decode: int = 2, **routing: object) -> RoomRouter:
    return RoomRouter([f"p{i}" for i in range(prefill)], [f"d{i}" for i in range(decode)],
                      random.Random(7), routing=RoutingConfig(**routing))  # type: ignore[arg-type]


def _send(router: RoomRouter, text: str, tokens: int | None = None) -> fx.RouterEffect:
    prompt = Prompt(text, len(text) // 4 if tokens is None else tokens)
    (effect,) = router.handle(ev.RoomRequested(f"r{len(router.rooms)}", prompt), 0.0)
    return effect


def _finish(router: RoomRouter, room: int) -> None:
    router.handle(ev.LegResponded(room, "prefill", True), 0.0)
    router.handle(ev.LegResponded(room, "decode", True), 0.0)
    router.handle(ev.RelayFinished(room), 0.0)


def test_config_refuses_unknown_policies_and_negative_thresholds() -> None:
    with pytest.raises(ValueError, match="prefill_policy must be one of"):
        RoutingConfig(prefill_policy="random")
    with pytest.raises(ValueError):
        RoutingConfig(local_prefill_tokens=-1)


def test_cache_aware_sends_a_shared_prefix_to_one_worker_and_spreads_the_rest() -> None:
    router = _router(prefill=3, decode=2, prefill_policy="cache_aware",
                     decode_policy="cache_aware")
    first = _send(router, SYSTEM + "Where is the Mona Lisa?")
    assert isinstance(first, fx.DispatchRoom)
    for q in ("When do you close?", "Is there a café?", "How much is a ticket?"):
        e = _send(router, SYSTEM + q)
        assert isinstance(e, fx.DispatchRoom)
        assert (e.prefill, e.decode) == (first.prefill, first.decode)
    # Unrelated prompts go where the index is smallest: the other workers, in turn.
    others = {_send(router, f"{i} " + "unrelated text " * 20).prefill  # type: ignore[union-attr]
              for i in range(2)}
    assert others == {"p0", "p1", "p2"} - {first.prefill}
    d = router.planner.decisions
    assert d["prefill:cache_hit"] == 3 and d["prefill:cache_miss"] == 3
    assert d["decode:cache_hit"] == 3


def test_cache_aware_routes_by_load_when_out_of_balance() -> None:
    router = _router(prefill=2, decode=1, prefill_policy="cache_aware", balance_abs=4,
                     balance_rel=1.5)
    first = _send(router, SYSTEM + "q")
    assert isinstance(first, fx.DispatchRoom)
    for _ in range(4):  # live rooms pile up on the cached worker ...
        assert _send(router, SYSTEM + "q").prefill == first.prefill  # type: ignore[union-attr]
    # ... until the spread passes 4 rooms (5 live against 0): the other worker takes the
    # next one, cached or not.
    e = _send(router, SYSTEM + "q")
    assert isinstance(e, fx.DispatchRoom) and e.prefill != first.prefill
    assert router.planner.decisions["prefill:load_balance"] == 1
    # Rooms that end stop counting: the cached worker is in balance again.
    for room in [r for r, x in router.rooms.items() if x.prefill == first.prefill]:
        _finish(router, room)
    assert _send(router, SYSTEM + "q").prefill == first.prefill  # type: ignore[union-attr]
    assert router.planner._load(first.prefill, router._live) == 1


def test_power_of_two_picks_the_less_loaded_of_two() -> None:
    router = _router(prefill=2, decode=3, prefill_policy="power_of_two",
                     decode_policy="power_of_two")
    router.planner.set_loads({"p0": 9, "p1": 2, "d0": 0, "d1": 50, "d2": 50})
    picks = []
    for _ in range(40):
        picks.append(_send(router, "x"))
        _finish(router, picks[-1].room)  # the polled loads stay the larger
    assert {e.prefill for e in picks} == {"p1"}  # type: ignore[union-attr]
    # With three D the two drawn may both be loaded; d0 wins whenever it is drawn.
    assert sum(e.decode == "d0" for e in picks) > 20  # type: ignore[union-attr]
    assert router.planner.decisions["prefill:power_of_two"] == 40


def test_a_short_prompt_goes_to_decode_alone() -> None:
    router = _router(local_prefill_tokens=32)
    local = _send(router, "What is the capital of France?", tokens=8)
    assert isinstance(local, fx.DispatchLocal) and local.reason == "short_prompt"
    assert router.poll(local.room) == "LOCAL"
    pd = _send(router, SYSTEM, tokens=72)
    assert isinstance(pd, fx.DispatchRoom)
    unknown = _send(router, "", tokens=0)  # the adapter could not size it: never local
    assert isinstance(unknown, fx.DispatchRoom)
    # The local room's life: D answers, the relay ends; no P leg is ever aborted.
    router.handle(ev.LegResponded(local.room, "decode", True), 0.0)
    assert router.poll(local.room) == "LOCAL_RELAYING"
    assert router.handle(ev.LegResponded(local.room, "prefill", True), 0.0) == []
    assert router.dropped == 1  # a P answer for a room without a P leg is counted, not taken
    router.handle(ev.RelayFinished(local.room), 0.0)
    assert router.poll(local.room) is None and router.outcomes["COMPLETED"] == 1
    assert router.planner.decisions["local:short_prompt"] == 1


def test_a_local_room_aborts_only_its_decode_leg() -> None:
    router = _router(local_prefill_tokens=32)
    local = _send(router, "hi", tokens=1)
    out = router.handle(ev.ClientDisconnected(local.room), 0.0)
    assert out == [fx.AbortLeg(local.room, "decode", local.decode)]  # type: ignore[union-attr]
    late = _send(router, "hi", tokens=1)
    out = router.handle(ev.TimeAdvanced(), 1e9)
    assert out == [fx.AbortLeg(late.room, "decode", late.decode),  # type: ignore[union-attr]
                   fx.ReplyError(late.room, "room deadline passed")]


def test_every_prefill_busy_sends_rooms_to_decode_alone() -> None:
    router = _router(prefill=2, local_prefill_queue=4)
    router.planner.set_loads({"p0": 4, "p1": 3})
    assert isinstance(_send(router, SYSTEM), fx.DispatchRoom)  # p1 still has room
    router.planner.set_loads({"p0": 4, "p1": 4})
    busy = _send(router, SYSTEM)
    assert isinstance(busy, fx.DispatchLocal) and busy.reason == "prefill_busy"


def test_uncached_share_uses_the_decode_index() -> None:
    """With cache_aware on D, a long prompt whose prefix D was sent before is short enough."""
    router = _router(decode=1, decode_policy="cache_aware", local_prefill_tokens=40)
    assert isinstance(_send(router, SYSTEM + "first question", tokens=80), fx.DispatchRoom)
    again = _send(router, SYSTEM + "second question", tokens=80)
    assert isinstance(again, fx.DispatchLocal)  # 256 of its 303 characters D was sent


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=400), st.text(max_size=400))
def test_index_matches_the_common_prefix_in_whole_blocks(a: str, b: str) -> None:
    index = PrefixIndex(max_blocks=1000)
    index.insert("w", block_chain(a))
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    assert index.matched("w", block_chain(b)) == min(common, len(a), len(b)) // BLOCK_CHARS
    assert index.size("w") == len(a) // BLOCK_CHARS


def test_index_evicts_the_least_recently_routed_continuation_first() -> None:
    index = PrefixIndex(max_blocks=5)
    index.insert("w", block_chain(SYSTEM + "A" * 64))  # 5 blocks
    index.insert("w", block_chain(SYSTEM + "B" * 64))  # 1 new block: A's tail goes
    assert index.matched("w", block_chain(SYSTEM + "B" * 64)) == 5
    assert index.matched("w", block_chain(SYSTEM + "A" * 64)) == 4
    index.keep(["other"])
    assert index.size("w") == 0


def test_a_prompt_mostly_cached_on_decode_is_prefilled_there() -> None:
    """Dynamo's cached-to-raw threshold: D's index holds most of the prompt, so D computes the
    rest itself instead of pulling all of it."""
    router = _router(decode=1, decode_policy="cache_aware", local_prefill_cached_ratio=0.8)
    assert isinstance(_send(router, SYSTEM + "first question", tokens=80), fx.DispatchRoom)
    again = _send(router, SYSTEM + "second question", tokens=80)  # 256 of 303 characters: 0.84
    assert isinstance(again, fx.DispatchLocal) and again.reason == "cached_on_decode"
    other = _send(router, "an unrelated prompt " * 8, tokens=40)
    assert isinstance(other, fx.DispatchRoom)


def test_a_busy_decode_worker_never_prefills_locally() -> None:
    """The decode-busy guard: whatever rule would send a room to D alone, not while that D has
    the guard's count of requests; the refusal is counted."""
    router = _router(decode=1, local_prefill_tokens=32, local_prefill_decode_guard=2)
    router.planner.set_loads({"d0": 1})
    assert isinstance(_send(router, "hi", tokens=1), fx.DispatchLocal)
    router.planner.set_loads({"d0": 2})
    busy = _send(router, "hi", tokens=1)
    assert isinstance(busy, fx.DispatchRoom)
    assert router.planner.decisions["local_refused:decode_busy"] == 1
    assert router.planner.wants_loads


# --- colocated workers (role "null", issue 30) ------------------------------------------------


def _colocated_router(prefill: list[str], decode: list[str], colocated: list[str],
                      max_queue: int = 0, **config: object) -> RoomRouter:
    return RoomRouter(prefill, decode, random.Random(7),
                      RouterConfig(**config),  # type: ignore[arg-type]
                      RoutingConfig(max_queue=max_queue), colocated=colocated)


def _ask(router: RoomRouter, **kw: object) -> fx.RouterEffect:
    (effect,) = router.handle(
        ev.RoomRequested(f"r{len(router.rooms)}", **kw), 0.0)  # type: ignore[arg-type]
    return effect


def test_a_colocated_worker_takes_a_room_when_it_has_fewer_in_flight_than_the_chosen_d() -> None:
    router = _colocated_router(["p0"], ["d0"], ["c0"])
    first = _ask(router)
    assert isinstance(first, fx.DispatchRoom)  # equal loads (none): the PD pair
    second = _ask(router)  # d0 has a room, c0 none
    assert isinstance(second, fx.DispatchLocal)
    assert (second.decode, second.role, second.reason) == ("c0", "null", "fewer_in_flight")
    assert router.poll(second.room) == "LOCAL"  # a D-alone room, addressed as null
    third = _ask(router)  # one each: the PD pair again
    assert isinstance(third, fx.DispatchRoom) and third.decode == "d0"
    _finish(router, first.room)
    fourth = _ask(router)  # d0 has one (third), c0 one (second): PD
    assert isinstance(fourth, fx.DispatchRoom)
    router.planner.set_loads({"c0": 5})  # c0's polled load counts as a D's does
    assert isinstance(_ask(router), fx.DispatchRoom)
    assert router.routed == {"pd": 4, "decode_alone": 0, "colocated": 1, "handoff": 0}
    assert router.planner.decisions["colocated:fewer_in_flight"] == 1


def test_with_no_prefill_or_no_decode_worker_rooms_go_to_colocated_ones_in_turn() -> None:
    router = _colocated_router([], [], ["c0", "c1"])
    rooms = [_ask(router) for _ in range(2)]
    assert [(r.decode, r.reason) for r in rooms] == [  # type: ignore[union-attr]
        ("c0", "no_prefill"), ("c1", "no_prefill")]
    for r in rooms:
        router.handle(ev.LegResponded(r.room, "decode", True), 0.0)  # type: ignore[union-attr]
        router.handle(ev.RelayFinished(r.room), 0.0)  # type: ignore[union-attr]
    assert router.outcomes["COMPLETED"] == 2 and not router.rooms
    # Idle again: the turn goes on (ties are shared, not all the first worker's).
    assert _ask(router).decode == "c0"  # type: ignore[union-attr]
    only_p = _colocated_router(["p0"], [], ["c0"])
    room = _ask(only_p)
    assert isinstance(room, fx.DispatchLocal) and room.reason == "no_decode"
    # No colocated worker: as before, no room.
    assert _ask(_colocated_router(["p0"], [], [])) == fx.NoWorkers("r0", "decode")


def test_a_colocated_leg_fails_as_a_d_alone_leg_does() -> None:
    """Refused before its answer: retried around it (on the PD pair though c0 is idler);
    broken off mid-stream: migrated; the client leaving: only its leg aborted."""
    router = _colocated_router(["p0"], ["d0"], ["c0"], retry_limit=1, migration_limit=1)
    _ask(router)  # d0 busy, so the next room is c0's
    local = _ask(router, migratable=True)
    assert isinstance(local, fx.DispatchLocal) and local.decode == "c0"
    out = router.handle(ev.LegResponded(local.room, "decode", False, "HTTP 409", refused=True),
                        0.1)
    assert [type(e).__name__ for e in out] == ["ReopenRoom"]  # no P leg to abort
    reopen = out[0]
    assert isinstance(reopen, fx.ReopenRoom) and reopen.attempts.avoid == ("c0",)
    retried = _ask(router, attempts=reopen.attempts)
    assert isinstance(retried, fx.DispatchRoom) and retried.decode == "d0"
    broken = _ask(router, migratable=True)  # d0 has two, c0 none
    assert isinstance(broken, fx.DispatchLocal) and broken.decode == "c0"
    router.handle(ev.LegResponded(broken.room, "decode", True), 0.2)
    out = router.handle(ev.LegResponded(broken.room, "decode", False, "reset", lost=True), 0.3)
    assert [type(e).__name__ for e in out] == ["ReopenRoom"]
    assert isinstance(out[0], fx.ReopenRoom) and out[0].cause == "migration"
    gone = _ask(router)
    assert isinstance(gone, fx.DispatchLocal) and gone.decode == "c0"
    assert router.handle(ev.ClientDisconnected(gone.room), 0.4) == [
        fx.AbortLeg(gone.room, "decode", "c0")]
    assert router.outcomes["RETRIED"] == 1 and router.outcomes["MIGRATED"] == 1


def test_shedding_counts_a_colocated_worker_under_the_bound() -> None:
    router = _colocated_router(["p0"], ["d0"], ["c0"], max_queue=2)
    router.planner.set_loads({"p0": 2, "d0": 2, "c0": 1})
    room = _ask(router)  # P and D full, c0 has room: it takes it
    assert isinstance(room, fx.DispatchLocal) and room.decode == "c0"
    router.planner.set_loads({"p0": 2, "d0": 2, "c0": 2})
    shed = _ask(router)  # c0 full too: the full role named as without colocated workers
    assert isinstance(shed, fx.ShedRequest) and shed.role == "decode"
    alone = _colocated_router([], [], ["c0"], max_queue=1)
    assert isinstance(_ask(alone), fx.DispatchLocal)
    shed = _ask(alone)  # its one live room: at the bound
    assert isinstance(shed, fx.ShedRequest) and shed.role == "colocated"
    assert alone.shed == {"colocated": 1}


def test_a_handoff_room_is_never_shed_for_prefill() -> None:
    # A draining D's stream needs another D only: full P queues, or no P at all, shed nothing.
    for prefill, loads in ((["p0"], {"p0": 2, "d0": 0}), ([], {"d0": 0})):
        router = _colocated_router(prefill, ["d0"], [], max_queue=2)
        router.planner.set_loads(loads)
        room = _ask(router, prompt=Prompt("hi", 1), migratable=True, handoff=True)
        assert not isinstance(room, fx.ShedRequest), (prefill, room)
        assert not any(router.shed.values())
    router = _colocated_router(["p0"], ["d0"], [], max_queue=2)
    router.planner.set_loads({"p0": 0, "d0": 2})
    shed = _ask(router, prompt=Prompt("hi", 1), migratable=True, handoff=True)
    assert isinstance(shed, fx.ShedRequest) and shed.role == "decode"  # D full: shed as before


def test_without_prefill_d_prefills_alone_only_when_asked() -> None:
    """``local_prefill_without_prefill``: no P listed (a colocated worker draining to become P
    beside a standby D) and no colocated worker: D alone, not a 503. Off: NoWorkers as ever;
    a colocated worker listed still takes the room first."""
    assert _ask(RoomRouter([], ["d0"], random.Random(1))) == fx.NoWorkers("r0", "prefill")
    router = RoomRouter([], ["d0", "d1"], random.Random(1),
                        routing=RoutingConfig(local_prefill_without_prefill=True))
    rooms = [_ask(router) for _ in range(2)]
    assert all(isinstance(r, fx.DispatchLocal) and r.reason == "no_prefill" for r in rooms)
    assert sorted(r.decode for r in rooms) == ["d0", "d1"]  # type: ignore[union-attr]
    assert router.routed["decode_alone"] == 2
    assert router.planner.decisions["local:no_prefill"] == 2
    with_colocated = RoomRouter([], ["d0"], random.Random(1), colocated=["c0"],
                                routing=RoutingConfig(local_prefill_without_prefill=True))
    room = _ask(with_colocated)
    assert room.decode == "c0" and room.reason == "no_prefill"  # type: ignore[union-attr]
    # No D either: still no room.
    none = RoomRouter([], [], random.Random(1),
                      routing=RoutingConfig(local_prefill_without_prefill=True))
    assert _ask(none) == fx.NoWorkers("r0", "decode")


def test_a_retry_around_a_refusing_colocated_worker_goes_to_a_standby_d_alone() -> None:
    """The colocated worker starts its switch to P beside a standby D and refuses a room (503):
    the retry, avoiding it, goes to the D alone where ``local_prefill_without_prefill`` allows
    it (run 19 of bench/RESULTS_adaptive.md answered 503 to two requests that went back to the
    switching worker on every retry); without the flag, back to the only colocated worker as
    ever. A P that refused is routed around the same way."""
    retry = Attempts(retries=1, avoid=("c0",))
    flagged = RoomRouter([], ["d0"], random.Random(1), colocated=["c0"],
                         routing=RoutingConfig(local_prefill_without_prefill=True))
    room = _ask(flagged, attempts=retry)
    assert isinstance(room, fx.DispatchLocal)
    assert (room.decode, room.role, room.reason) == ("d0", "decode", "no_prefill")
    plain = RoomRouter([], ["d0"], random.Random(1), colocated=["c0"])
    room = _ask(plain, attempts=retry)
    assert isinstance(room, fx.DispatchLocal) and room.decode == "c0" and room.role == "null"
    around_p = RoomRouter(["p0"], ["d0"], random.Random(1),
                          routing=RoutingConfig(local_prefill_without_prefill=True))
    room = _ask(around_p, attempts=Attempts(retries=1, avoid=("p0",)))
    assert isinstance(room, fx.DispatchLocal) and room.decode == "d0"
    room = _ask(RoomRouter(["p0"], ["d0"], random.Random(1)),
                attempts=Attempts(retries=1, avoid=("p0",)))
    assert isinstance(room, fx.DispatchRoom) and room.prefill == "p0"  # the flag off: as ever
