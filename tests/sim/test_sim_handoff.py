"""Issue 32 §2 in the simulation: a draining D (a role switch leaving decode) hands its running
streams off to another D, which pulls their KV and goes on, racing the seed's faults
(``pd_fsm/sim/workers.py``, its hand-off part). Every registration is released exactly once,
every pull that fails falls back to a re-prefill, and each handed-off client that gets a 200
has every token once."""

from __future__ import annotations

from collections import Counter

import pytest

from pd_fsm.cli import main as cli_main
from pd_fsm.sim import SimConfig, run_seed
from pd_fsm.sim.proxy import Proxy, Tickets
from pd_fsm.sim.workers import Client, Desk, Ticket
from pd_fsm.sim.world import World

# Thirty clients in five seconds and a switch request or two a seed: streams are running when a D
# starts draining (~120 hand-offs over these seeds, ~10 s on this machine shared with others).
BUSY = SimConfig(requests=30, arrival_window=5.0, role_switches=1.0)
SEEDS = 150


def test_hand_offs_racing_every_fault_lose_nothing() -> None:
    """Hand-offs are taken, fall back to a re-prefill, and their registrations are released by
    the proxy's word or by their lease; pulls fail each way the world can fail them (the
    draining D gone, a partition, a slow or failing transfer); no invariant breaks."""
    counts: Counter[str] = Counter()
    for seed in range(SEEDS):
        r = run_seed(seed, BUSY)
        assert r.violation is None, (seed, r.violation)
        counts.update(r.handoffs)
    assert counts["handed_off"] >= 50, counts
    assert counts["taken"] >= 20 and counts["fell_back"] >= 10, counts
    # Every hand-off room's leg answered tells the draining D; some tickets die with their room
    # (a client gone, the proxy restarted, the draining D crashed) and are released by nobody.
    assert counts["released"] <= counts["taken"] + counts["fell_back"] + counts["failed"]
    assert counts["released"] + counts["expired"] <= counts["handed_off"], counts
    for cause in ("pull source gone", "pull partitioned", "pull injected, or past the pull "
                  "deadline"):
        assert counts[cause] >= 1, (cause, counts)
    assert counts["expired"] >= 1, counts


def test_a_taken_hand_off_continues_the_stream_token_for_token() -> None:
    """A client whose stream a draining D handed off gets, after the tokens it had, the taking
    D's continuation from the pulled KV: the whole answer, none repeated or missing."""
    continued = 0
    for seed in range(40):
        world = World(seed, BUSY)
        world.run()
        for c in world.clients:
            if c.sent and c.answer is not None and c.answer[0] == 200:
                assert c.answer[1] == c.expected() and 0 < len(c.sent) < c.out, (seed, c)
                continued += 1
    assert continued >= 5, continued


def test_a_missing_release_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug: the draining D's transfer server keeps a registration its ledger released.
    The per-step books check (``Desk.check``) catches it at once."""
    monkeypatch.setattr(Desk, "release_offer", lambda self, uuid, reason: None)
    caught = next((r for r in (run_seed(s, BUSY) for s in range(40)) if r.violation), None)
    assert caught is not None and caught.violation is not None
    assert "hand-off registrations [" in caught.violation, caught.violation
    assert "but the ledger offers [" in caught.violation, caught.violation


def test_a_release_twice_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug: a ReleaseOffer carried out twice: the second finds nothing registered."""
    release = Desk.release_offer

    def twice(self: Desk, uuid: int, reason: str) -> None:
        release(self, uuid, reason)
        release(self, uuid, reason)

    monkeypatch.setattr(Desk, "release_offer", twice)
    caught = next((r for r in (run_seed(s, BUSY) for s in range(40)) if r.violation), None)
    assert caught is not None and caught.violation is not None
    assert "released twice" in caught.violation, caught.violation


def test_a_stream_handed_off_and_failed_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug: the draining D hands a stream off and then fails its leg too (as if its
    drain deadline failed it): the client would see the stream both go on and break. The
    proxy's check (``Tickets.check_answer``) catches it."""
    give = Desk._give

    def and_fail(self: Desk, room: int) -> bool:
        router_gen = self.node.legs[room][0] if room in self.node.legs else -1
        went = give(self, room)
        if went:
            self.node.world.proxy.leg_answer(router_gen, room, "decode", False, "drained")
        return went

    monkeypatch.setattr(Desk, "_give", and_fail)
    caught = next((r for r in (run_seed(s, BUSY) for s in range(40)) if r.violation), None)
    assert caught is not None and caught.violation is not None
    assert "was handed off, then its D answered it" in caught.violation, caught.violation


def test_a_proxy_that_never_releases_leaves_it_to_the_lease(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The proxy's /handoff_release lost every time: each registration is released when its
    lease ends, before the drain's deadline, and the drains still end with nothing held."""
    monkeypatch.setattr(Tickets, "_release", lambda self, ticket: None)
    counts: Counter[str] = Counter()
    for seed in range(40):
        r = run_seed(seed, BUSY)
        assert r.violation is None, (seed, r.violation)
        counts.update(r.handoffs)
    assert counts["released"] == 0 and counts["expired"] >= 10, counts


def test_a_seed_with_hand_offs_replays_bit_for_bit() -> None:
    seed = next(s for s in range(40) if run_seed(s, BUSY).handoffs.get("handed_off"))
    a, b = run_seed(seed, BUSY, trace=True), run_seed(seed, BUSY, trace=True)
    assert a.trace == b.trace and a.handoffs == b.handoffs
    assert any("hands off" in line for line in a.trace)


def test_the_command_reports_hand_offs(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["sim", "--seeds", "0:20", "--role-switches", "1", "--requests", "30"]) == 0
    out = capsys.readouterr().out
    assert "20 seeds, 0 failing" in out and "hand-offs handed off " in out, out


def test_a_drain_whose_listed_decode_workers_are_down_finishes_in_place(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 32's gap: a crashed D stays listed (its registry record lives until its TTL), and a
    drain that handed its streams off to it lost them (the hand-off room failed on the dead D,
    and the fallback found no D but the draining one). The drain's gate probes each listed D's
    /health: a drain hands off only while one of them is up; else its streams finish in place.
    ``Desk.hand_off`` is wrapped (it still runs) to see the processes as it starts."""
    starts: list[tuple[str, int, int]] = []  # (D, other Ds listed, of them up)
    hand_off = Desk.hand_off

    def seen(self: Desk, lease_s: float) -> int:
        world = self.node.world
        assert isinstance(world, World)
        procs = world.workers.procs
        listed = [p for p in procs.values() if p.name != self.node.name and p.listed == "decode"]
        up = [p for p in listed if p.switch is not None and p.node.alive]
        starts.append((self.node.name, len(listed), len(up)))
        return hand_off(self, lease_s)

    monkeypatch.setattr(Desk, "hand_off", seen)
    counts: Counter[str] = Counter()
    for seed in range(SEEDS):
        r = run_seed(seed, BUSY)
        assert r.violation is None, (seed, r.violation)
        counts.update(r.handoffs)
    assert starts and all(up >= 1 for _, _, up in starts), starts
    # The race happens in these seeds: drains that found every listed D down kept their streams.
    assert counts["in_place_no_healthy_decode"] >= 1, counts


def test_a_hand_off_room_refused_by_a_dead_decode_worker_goes_to_a_live_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 32's other gap: the proxy picks the hand-off room's D itself (the least loaded),
    and may pick a listed D that is down while the drain's gate found another up. Refused there,
    the leg goes within the room, with the same ticket, to another D the proxy routes, never one
    that refused it; it falls back to a re-prefill only when no such D is left. Three Ds, so
    that one can be down and another up. ``Proxy._post_leg`` is wrapped (it still runs) to see
    each hand-off leg and the processes as it is posted."""
    legs: dict[tuple[int, int, int], list[tuple[str, bool, bool, int]]] = {}
    post = Proxy._post_leg
    seed = -1

    def seen(self: Proxy, leg: str, name: str, gen: int, room: int, client: Client,
             bootstrap: str | None, ticket: Ticket | None = None) -> None:
        if ticket is not None:
            procs = self.procs

            def up(n: str) -> bool:
                p = procs[n]
                return (p.switch is not None and p.node.alive and p.node.role == "decode"
                        and not p.refusing)

            others = [d for d in self.router.breakers.routable(self._shown[1])
                      if d not in (name, ticket.source) and up(d)]
            legs.setdefault((seed, gen, room), []).append(
                (name, up(name), bool(others), ticket.uuid))
        post(self, leg, name, gen, room, client, bootstrap, ticket)

    monkeypatch.setattr(Proxy, "_post_leg", seen)
    three = SimConfig(decode=3, requests=30, arrival_window=5.0, role_switches=1.0)
    for seed in range(60):
        r = run_seed(seed, three)
        assert r.violation is None, (seed, r.violation)
    redirected = 0
    for key, posts in legs.items():
        assert len({uuid for *_, uuid in posts}) == 1, (key, posts)  # one ticket throughout
        assert len({name for name, *_ in posts}) == len(posts), (key, posts)  # each D once
        for (_, alive, another, _), nxt in zip(posts, [*posts[1:], None], strict=True):
            if not alive and another:  # refused while another routed D was up: posted again
                assert nxt is not None, (key, posts)
                redirected += 1
    assert redirected >= 1, legs


def test_a_handed_off_client_gets_an_error_only_when_no_worker_of_a_role_is_up() -> None:
    """Issue 32: each handed-off client that got no 200 is counted by why (``proxy.why_lost``):
    the client left, the proxy restarted, none of the Ds (or Ps) the proxy routes to was up and
    taking legs, or each role had one and the request's last room failed on a PD fault (a
    re-prefill's failed or partitioned transfer, as any PD request meets it). Never a leg
    refused while a D was up: after a hand-off whose pull failed, the request avoids the
    draining D and the taker, and a PD room's refused leg was redirected only to a D it did
    not avoid; with every D avoided the client got the refusal as a 502 while another D served
    (seed 97; ``router._redirect_taker`` falls back to the avoided Ds)."""
    counts: Counter[str] = Counter()
    for seed in range(SEEDS):
        r = run_seed(seed, BUSY)
        assert r.violation is None, (seed, r.violation)
        counts.update({k: n for k, n in r.handoffs.items() if k.startswith("lost ")})
    whys = {key.split(" ", 2)[2] for key in counts}
    assert whys <= {"client left", "proxy restart", "no decode up", "no prefill up",
                    "both up, failed"}, counts
    assert counts["lost 502 no decode up"] >= 1, counts
