"""SIGTERM in the simulation (issue 32 §3 and §2; ``pd_fsm/sim/sigterm.py``): a worker leaves the
registry, refuses new legs (503), a D hands its running streams off when its gate finds another
healthy D (else they finish in place), what is left at the drain deadline fails (a stream then
migrates), and the process exits holding nothing, then restarts. Each path is reached by a
SIGTERM the test sends at a chosen moment, without faults (so what follows is the SIGTERM's
doing); the drawn SIGTERMs race every fault in the seed sweep."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest

from pd_fsm.cli import main as cli_main
from pd_fsm.sim import SimConfig, World, run_seed
from pd_fsm.sim.config import Violation
from pd_fsm.sim.sigterm import Stops
from pd_fsm.sim.workers import Client, DecodeWorker, Node, PrefillWorker

# Thirty clients in five seconds: streams are running when a worker gets its SIGTERM. Pages for
# all: a worker down leaves the others its load, which must not fail anyone for want of pages.
CALM = SimConfig(requests=30, arrival_window=5.0, faults=False, pages=200)


def streaming(left: int) -> Callable[[Node], bool]:
    """A D relaying a stream that may be handed off with at least ``left`` tokens to go."""
    def ready(node: Node) -> bool:
        return isinstance(node, DecodeWorker) and any(
            s.accept and len(s.tokens) - s.sent(node.world.now) >= left
            for s in node.desk.streams.values())
    return ready


def sigterm_when(world: World, name: str, drain_s: float, ready: Callable[[Node], bool]
                 ) -> list[Client]:
    """Send ``name`` SIGTERM as soon as its node is ``ready`` (looked at every 10 ms); the list
    fills, then, with the clients whose streams it relays (a D) or whose rooms it holds."""
    held: list[Client] = []
    sent = False

    def poll() -> None:
        nonlocal sent
        node = world.procs[name].node
        if not (node.alive and ready(node)):
            world.at(0.01, f"{name}: not yet", poll)
            return
        if isinstance(node, DecodeWorker):
            held.extend(s.client for s in node.desk.streams.values())
        elif isinstance(node, PrefillWorker):
            held.extend(client for _, client in node.legs.values())
        sent = True
        world.stops.sigterm(name, drain_s)

    world.at(0.01, f"{name}: not yet", poll)
    world.run()  # raises Violation on any broken invariant
    assert sent, f"{name} never became ready"
    return held


def test_a_sigtermed_decode_worker_hands_its_streams_off() -> None:
    """Another D is up: the SIGTERMed D's running streams go to it (pulled, not re-prefilled),
    every registration is released by the proxy's word, the D exits before its deadline with
    nothing held and restarts."""
    world = World(0, CALM)
    held = sigterm_when(world, "d0", 8.0, streaming(2))
    assert held
    h = world.handoffs
    assert h["handed_off"] >= 1 and h["taken"] == h["handed_off"] == h["released"], h
    assert world.proxy.reopened["migration"] == 0, world.proxy.reopened
    assert world.stops.summary() == {"decode exited": 1}
    assert all(c.answer is not None and c.answer[0] == 200 for c in world.clients)
    assert any(c.handed_off for c in held)
    d0 = world.procs["d0"]
    assert d0.switch is not None and d0.node.alive and d0.node.gen == 2 and d0.listed == "decode"


def test_with_every_other_decode_worker_down_the_streams_finish_in_place() -> None:
    """The only other D crashed (the proxy and the gate still list it): the gate's /health
    probe finds none up, so nothing is handed off and the streams finish on the draining D."""
    world = World(0, CALM)
    world.at(0.005, "d1 crashes (test)", world.workers.crash, "d1", 60.0)
    held = sigterm_when(world, "d0", 12.0, streaming(2))
    assert held
    assert world.handoffs == {"in_place_no_healthy_decode": 1}, world.handoffs
    assert world.stops.summary() == {"decode exited": 1}
    for c in held:
        assert c.answer is not None and c.answer[0] == 200 and not c.handed_off, c


def test_a_stream_the_drain_deadline_fails_migrates() -> None:
    """A drain too short for a hand-off's lease and for the stream: the deadline fails it, the
    proxy migrates it to the other D, and the client gets its whole answer once."""
    world = World(0, CALM)
    held = sigterm_when(world, "d0", 0.05, streaming(4))
    assert held
    assert world.stops.summary() == {"decode exited_after_drain_timeout": 1}
    assert world.handoffs == {}, world.handoffs
    assert world.proxy.reopened["migration"] >= len(held), world.proxy.reopened
    for c in held:
        assert c.answer is not None and c.answer[0] == 200 and not c.handed_off, c


@pytest.mark.parametrize(("drain_s", "outcome"), [(8.0, "prefill exited"),
                                                   (0.01, "prefill exited_after_drain_timeout")])
def test_a_sigtermed_prefill_worker_with_rooms_in_flight(drain_s: float, outcome: str) -> None:
    """P gets SIGTERM while it holds rooms: with time, they finish (D pulls their KV) and P
    exits; with a drain too short, they are aborted at the deadline, each client answered with
    the reason (the router does not retry a P leg that failed after it was accepted; with
    ``--decode-recomputes`` D would prefill it). Everyone else gets a 200, the legs that reach
    P while it drains or is down being retried on the other P, and P comes back."""
    world = World(1, CALM)
    held = sigterm_when(world, "p0", drain_s,
                        lambda node: isinstance(node, PrefillWorker) and bool(node.core.rooms))
    assert held
    assert world.stops.summary() == {outcome: 1}
    failed = {c.id: c.answer for c in world.clients if c.answer is None or c.answer[0] != 200}
    if drain_s > 1.0:
        assert not failed, failed
    else:
        assert set(failed) <= {c.id for c in held} and failed, failed
        assert all(a is not None and "SIGTERM" in str(a[1]) for a in failed.values()), failed
    p0 = world.procs["p0"]
    assert p0.node.alive and p0.node.gen == 2 and p0.listed == "prefill"


def test_a_decode_worker_that_exits_keeping_its_hand_offs_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug: the SIGTERM drain does not wait for its hand-off registrations (the D exits
    while takers may still pull them, and the ledger never releases them). The exit's check
    names them."""
    holds = Stops.holds

    def but_hand_offs(self: Stops, node: Node) -> str:
        left = holds(self, node)
        return "" if left.endswith("hand-off registrations") and "," not in left else left

    monkeypatch.setattr(Stops, "holds", but_hand_offs)
    with pytest.raises(Violation, match=r"d0: exited on SIGTERM holding \d+ hand-off "
                                        "registrations"):
        sigterm_when(World(0, CALM), "d0", 8.0, streaming(2))


def test_a_deadline_that_fails_nothing_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug: past the SIGTERM's drain deadline the D exits without failing what is left
    (its streams' pages, their legs): the exit's check names the pages."""
    monkeypatch.setattr(DecodeWorker, "fail_in_flight", lambda self, reason: None)
    with pytest.raises(Violation, match=r"d0: exited on SIGTERM holding .*pages never freed"):
        sigterm_when(World(0, CALM), "d0", 0.05, streaming(4))


def test_drawn_sigterms_racing_every_fault_lose_nothing() -> None:
    """SIGTERMs drawn in every seed (no role switches, so every hand-off is a SIGTERM's): no
    invariant breaks, and every way a SIGTERM ends happens."""
    config = SimConfig(requests=30, arrival_window=5.0, role_switches=0.0, sigterms=1.0)
    outcomes: Counter[str] = Counter()
    handoffs: Counter[str] = Counter()
    for seed in range(120):
        r = run_seed(seed, config)
        assert r.violation is None, (seed, r.violation)
        outcomes.update(r.sigterms)
        handoffs.update(r.handoffs)
    for key in ("decode exited", "prefill exited", "decode exited_after_drain_timeout",
                "prefill exited_after_drain_timeout", "down", "crashed"):
        assert outcomes[key] >= 1, (key, outcomes)
    assert handoffs["handed_off"] >= 10 and handoffs["taken"] >= 5, handoffs


def test_a_seed_that_draws_no_sigterm_replays_as_before() -> None:
    """The SIGTERM draws have a random stream of their own: a seed that draws none runs step
    for step as with SIGTERMs off."""
    same = 0
    for seed in range(12):
        r = run_seed(seed, SimConfig(), trace=True)
        if not r.sigterms:
            assert r.trace == run_seed(seed, SimConfig(sigterms=0.0), trace=True).trace, seed
            same += 1
    assert same >= 3, same


def test_the_command_reports_sigterms(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["sim", "--seeds", "0:10", "--sigterms", "1"]) == 0
    out = capsys.readouterr().out
    assert "10 seeds, 0 failing" in out and "SIGTERMs {" in out, out
    assert cli_main(["sim", "--seeds", "0:10", "--sigterms", "0", "--role-switches", "0"]) == 0
    assert "SIGTERMs" not in capsys.readouterr().out
    assert cli_main(["sim", "--seeds", "0:5", "--sigterms", "2"]) == 2


def test_a_full_decode_worker_takes_hand_offs_once_its_pages_free() -> None:
    """Few pages a worker: the D taking the SIGTERMed D's streams is often full. Its claims
    wait for pages (ahead of new rooms) instead of refusing: every stream handed off is taken
    (pulled, not re-prefilled) and its client gets the whole answer; the books balance after."""
    waited = 0
    for seed in range(12):
        world = World(seed, SimConfig(requests=30, arrival_window=5.0, faults=False, pages=24))
        sigterm_when(world, "d0", 8.0, streaming(2))
        h = world.handoffs
        assert h["taken"] == h["handed_off"] == h["released"], (seed, h)
        assert world.proxy.reopened["migration"] == 0, (seed, world.proxy.reopened)
        assert all(c.answer is not None and c.answer[0] == 200
                   for c in world.clients if c.handed_off), seed
        waited += h["waited_for_pages"]
    assert waited > 0  # the wait was taken: the seeds reach WAITING_FOR_PAGES
