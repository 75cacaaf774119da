"""PD failures end to end, between real `pd-fsm` processes killed with SIGKILL (issue 7).

One fleet per module, started once (in parallel) and shared: the bootstrap server, two prefill
workers (``p1`` serves, ``p2`` is the one that dies), three decode workers (``dfail`` with the
default failure policy and scarce pages, ``drec`` with ``--disaggregation-failure-policy
recompute``, ``d3`` the one that dies), a colocated worker for the reference answers, and a proxy
over ``p1`` + ``dfail``. Everything runs with a cluster secret and the short windows of
``failure_support.WINDOWS``, except ``plong`` + ``dlong``: the abort test's pair, whose leases and
waits are LONG so that only an abort can release their rooms within the test's bound.

The test is the router: it posts P's and D's legs itself, so the stage a fault hits is chosen,
not raced. "Mid-transfer" is made deterministic by freezing D (SIGSTOP) while P hands the room
off (P registers the KV and sends READY, which waits in D's socket), then killing D or P.

Every test ends with page accounting on the workers it touched: all pages free, no room, no
queue, no transfer-server registration. Times are deadlines (window + SLACK), not benchmarks.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
import zmq

from pd_fsm.core.codec import encode
from pd_fsm.core.keys import registry_key, side_channel_key
from pd_fsm.core.messages import Abort, Done
from pd_fsm.core.request_auth import sign_request
from pd_fsm.io_trio.side_channel.channel import frame_now
from pd_fsm.jax_engine.kv import host_memory
from tests.integration.failure_support import (
    HEARTBEAT,
    HOST,
    LEASE_EXTENSION,
    LEASE_INITIAL,
    PEER_TIMEOUT,
    PULL_DEADLINE,
    QUEUE_TIMEOUT,
    SLACK,
    Fleet,
    Proc,
    error_message,
    greedy,
    kvpoll,
    leg,
    listening_addresses,
    new_room,
    prompt,
    stats,
    wait_clean,
    wait_healthy,
    wait_until,
    warm_pd,
)

pytestmark = pytest.mark.slow

DFAIL_PAGES = 40  # 39 usable: one 100-token prompt + 40 new tokens (35 pages) starves the rest

# The abort test's own P and D (``plong``, ``dlong``): every window that could end a room without
# the abort (P's lease, initial and extended; D's READY and page-queue waits) is LONG, so a room
# released within the test's bound (SLACK) was released by the abort, not by a timer. Later flags
# win: these override WINDOWS.
LONG = 120.0
LONG_WINDOWS = ["--disaggregation-lease-initial", str(LONG),
                "--disaggregation-lease-extension", str(LONG),
                "--disaggregation-ready-timeout", str(LONG),
                "--disaggregation-queue-timeout", str(LONG)]
assert SLACK * 10 <= LONG
FIRST_USE = 60.0  # a wait that may include a fresh worker's first compile (not a bound)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("failures"), secret=True)
    f.bootstrap()
    p1 = f.prefill("p1")
    f.prefill("p2")
    dfail = f.decode("dfail", num_pages=DFAIL_PAGES)
    f.decode("drec", extra=["--disaggregation-failure-policy", "recompute"])
    f.decode("d3")
    f.prefill("plong", extra=LONG_WINDOWS)
    f.decode("dlong", num_pages=DFAIL_PAGES, extra=LONG_WINDOWS)
    f.colocated()
    f.proxy("proxy", [p1], [dfail])
    # The prefill that dies under two proxies over drec: one told that D recomputes.
    p4 = f.prefill("p4")
    f.proxy("proxy_rec", [p4], [f["drec"]], ["--decode-recomputes"])
    f.proxy("proxy_norec", [p4], [f["drec"]])
    f.start()
    warm_pd([p1, f["p2"]], dfail, (9, 13))
    yield f
    f.close()


@attrs.define
class Outcome:
    """What a client saw: a status and body, or a transport error; and when."""

    status: int | None = None
    body: Any = None
    error: BaseException | None = None
    at: float = 0.0

    def ok_ids(self) -> list[int]:
        assert self.status == 200, (self.status, self.body, self.error)
        return list(self.body["output_ids"])


async def post(http: httpx.AsyncClient, url: str, body: dict[str, Any], out: Outcome) -> None:
    try:
        r = await http.post(url, json=body)
        out.status = r.status_code
        try:
            out.body = r.json()
        except ValueError:
            out.body = r.text
    except httpx.TransportError as exc:
        out.error = exc
    out.at = trio.current_time()


async def p_state(http: httpx.AsyncClient, p: Proc, state: str, n: int) -> bool | None:
    return True if kvpoll(await stats(http, p), state) == n else None


def client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=60.0))


# ----------------------------------------------------------------------------- D dies


async def test_d_dies_mid_transfer_p_frees_kv_and_registration(fleet: Fleet) -> None:
    """Stage: P has prefilled, registered the room's KV with its transfer server and sent READY
    (KVPoll Transferring on P; its HTTP leg answered 200); D is frozen with READY unread, then
    SIGKILLed. P hears no more heartbeats, so the room's lease runs out (at most LEASE_INITIAL
    after D's hello, LEASE_EXTENSION after its last heartbeat): P frees the pages and removes
    the transfer-server registration, and keeps serving."""
    p1, d3, dfail, colo = fleet["p1"], fleet["d3"], fleet["dfail"], fleet["colocated"]
    async with client() as http:
        await wait_clean(http, p1, timeout=SLACK)
        before = await stats(http, p1)
        ids = prompt(9, seed=1)
        room = new_room()
        body = leg(room, ids, 6, p1)
        d_leg = Outcome()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(post, http, f"{d3.url}/generate", body, d_leg)
            await wait_until(lambda: p_state(http, p1, "EARLY_PEER", 1), SLACK, "D's hello")
            d3.pause()
            r = await http.post(f"{p1.url}/generate", json=body)
            assert r.status_code == 200, r.text  # P's leg: the room is handed off
            s = await stats(http, p1)
            assert kvpoll(s, "TRANSFERRING") == 1
            assert s["transfer_registrations"] == 1
            killed = trio.current_time()
            d3.kill()
        # D's client: the connection died with D (a router turns this into a 502).
        assert isinstance(d_leg.error, httpx.TransportError), d_leg
        took = await wait_clean(http, p1, timeout=LEASE_INITIAL + SLACK)
        after = await stats(http, p1)
        assert after["pd_events"]["failed"] == before["pd_events"]["failed"] + 1
        assert after["transfer"]["released"] == before["transfer"]["released"] + 1
        assert after["transfer"]["release_unverified"] == before["transfer"]["release_unverified"]
        assert took <= max(LEASE_INITIAL, LEASE_EXTENSION) + SLACK
        print(f"P reclaimed the room {trio.current_time() - killed:.2f} s after D died")

        # P keeps serving: a fresh room through p1 and another D.
        room2, ids2 = new_room(), prompt(7, seed=2)
        want = await greedy(http, colo, ids2, 5)
        d_ok, p_ok = Outcome(), Outcome()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(post, http, f"{dfail.url}/generate", leg(room2, ids2, 5, p1), d_ok)
            nursery.start_soon(post, http, f"{p1.url}/generate", leg(room2, ids2, 5, p1), p_ok)
        assert p_ok.status == 200, p_ok
        assert d_ok.ok_ids() == want
        await wait_clean(http, p1, dfail, timeout=SLACK)


# ----------------------------------------------------------------------------- P dies


async def test_p_dies_d_fails_cleanly_or_recomputes(fleet: Fleet) -> None:
    """P (``p2``) is SIGKILLed with four rooms in two stages on two D's:

    * before the transfer: D's legs only (D reserved pages, said hello, waits for READY; P never
      got its leg). D hears no heartbeat answer: after PEER_TIMEOUT and two unanswered heartbeats
      P is lost, the room fails, D frees its pages.
    * during the transfer: both D's frozen, P's legs sent (P prefilled, registered, sent READY,
      which waits in the frozen D's socket), P killed, D's resumed. D reads READY and pulls from
      a transfer server that is gone: the pull fails (by PULL_DEADLINE at the latest).

    ``dfail`` (policy fail) answers both with a 502 JSON error naming the cause; ``drec``
    (policy recompute) prefills locally and answers both correctly (= colocated greedy)."""
    p2, dfail, drec, colo = fleet["p2"], fleet["dfail"], fleet["drec"], fleet["colocated"]
    cases = {
        "before-fail": (dfail, prompt(10, seed=3)),
        "before-recompute": (drec, prompt(11, seed=4)),
        "during-fail": (dfail, prompt(12, seed=5)),
        "during-recompute": (drec, prompt(13, seed=6)),
    }
    rooms = {name: new_room() for name in cases}
    async with client() as http:
        await wait_clean(http, dfail, drec, timeout=SLACK)
        want = {name: await greedy(http, colo, ids, 6) for name, (_, ids) in cases.items()}
        recomputed_before = (await stats(http, drec))["recomputed_total"]
        outcomes = {name: Outcome() for name in cases}
        async with trio.open_nursery() as nursery:
            for name, (d, ids) in cases.items():
                nursery.start_soon(post, http, f"{d.url}/generate",
                                   leg(rooms[name], ids, 6, p2), outcomes[name])
            await wait_until(lambda: p_state(http, p2, "EARLY_PEER", 4), SLACK, "4 hellos")
            dfail.pause()
            drec.pause()
            try:
                for name in ("during-fail", "during-recompute"):
                    r = await http.post(f"{p2.url}/generate",
                                        json=leg(rooms[name], cases[name][1], 6, p2))
                    assert r.status_code == 200, r.text
                s = await stats(http, p2)
                assert kvpoll(s, "TRANSFERRING") == 2 and s["transfer_registrations"] == 2
                killed = trio.current_time()
                p2.kill()
            finally:
                dfail.resume()
                drec.resume()

        for name in ("before-fail", "during-fail"):
            out = outcomes[name]
            assert out.status == 502, (name, out)
            message = error_message_of(out)
            assert "prefill" in message or "transfer" in message, message
            assert out.body["error"]["type"] == "bad_gateway"
        before = outcomes["before-fail"]
        assert before.at - killed <= PEER_TIMEOUT + 2 * HEARTBEAT + SLACK
        assert "silent" in error_message_of(before) or "restarted" in error_message_of(before)
        assert outcomes["during-fail"].at - killed <= PULL_DEADLINE + PEER_TIMEOUT + SLACK
        for name in ("before-recompute", "during-recompute"):
            assert outcomes[name].ok_ids() == want[name], name
        print({name: round(o.at - killed, 2) for name, o in outcomes.items()})

        await wait_clean(http, dfail, drec, timeout=PULL_DEADLINE + SLACK)
        assert (await stats(http, drec))["recomputed_total"] == recomputed_before + 2


async def test_a_proxy_told_decode_recomputes_leaves_a_dead_prefill_to_d(fleet: Fleet) -> None:
    """Found by `pd-fsm sim`: with D's recompute policy behind our proxy, P's leg failing made
    the proxy fail the room at once, although D would have answered it. P (``p4``) is frozen
    before two requests arrive, one through each proxy over ``drec``; once D waits for READY on
    both, P is SIGKILLed: its legs break. The proxy run with ``--decode-recomputes`` leaves the
    room to D, which declares P lost and prefills it: 200, the colocated answer. The other fails
    the room on P's broken leg: 502, and D's recomputation is aborted."""
    p4, drec, colo = fleet["p4"], fleet["drec"], fleet["colocated"]
    proxies = {"rec": fleet["proxy_rec"], "norec": fleet["proxy_norec"]}
    ids = {"rec": prompt(10, seed=7), "norec": prompt(12, seed=8)}
    async with client() as http:
        await wait_clean(http, drec, timeout=SLACK)
        want = await greedy(http, colo, ids["rec"], 6)
        outcomes = {name: Outcome() for name in proxies}
        p4.pause()
        try:
            async with trio.open_nursery() as nursery:
                for name, proxy in proxies.items():
                    body = {"input_ids": ids[name],
                            "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
                    nursery.start_soon(post, http, f"{proxy.url}/generate", body,
                                       outcomes[name])
                await wait_until(lambda: p_state(http, drec, "WAITING_FOR_READY", 2), SLACK,
                                 "D waiting for READY from the frozen P")
                killed = trio.current_time()
                p4.kill()
        finally:
            if p4.alive():  # the wait failed before the kill: let the fleet stop it
                p4.resume()
        assert outcomes["rec"].ok_ids() == want
        assert outcomes["rec"].at - killed <= PEER_TIMEOUT + 2 * HEARTBEAT + SLACK
        assert outcomes["norec"].status == 502, outcomes["norec"]
        assert "prefill" in error_message_of(outcomes["norec"])
        await wait_clean(http, drec, timeout=PULL_DEADLINE + SLACK)


def error_message_of(out: Outcome) -> str:
    body = out.body
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), out
    return str(body["error"]["message"])


async def test_a_p_leg_whose_d_never_comes_is_a_504_after_the_lease(fleet: Fleet) -> None:
    """P's leg for a room no D ever claims: P prefills and holds the KV for its lease, then
    fails the leg as a timeout waiting for its peer (504, gateway_timeout: what a router's
    retry logic reads as one), naming the lease; nothing is left held."""
    p1 = fleet["p1"]
    async with client() as http:
        await wait_clean(http, p1, timeout=SLACK)
        start = trio.current_time()
        r = await http.post(f"{p1.url}/generate", json=leg(new_room(), prompt(9, seed=9), 4, p1))
        assert r.status_code == 504, r.text
        error = r.json()["error"]
        assert error["type"] == "gateway_timeout" and "lease expired" in error["message"], error
        assert trio.current_time() - start <= LEASE_INITIAL + SLACK
        await wait_clean(http, p1, timeout=SLACK)


# ----------------------------------------------------------------------------- bootstrap restart


async def test_bootstrap_restart_reregisters_and_spares_inflight(fleet: Fleet) -> None:
    """The bootstrap server is SIGKILLed and started again (same port, no state) while a room is
    in flight (D's leg waiting for P's). Every live instance registers again within about one
    heartbeat interval of the server being back (its next heartbeat gets 404); the in-flight
    room completes correctly, and so does a new one."""
    boot, p1, dfail, drec, colo = (fleet[n] for n in ("bootstrap", "p1", "dfail", "drec",
                                                      "colocated"))
    workers = [p for p in fleet.procs.values()
               if p.alive() and "--disaggregation-mode" in p.argv
               and p.argv[p.argv.index("--disaggregation-mode") + 1] != "null"]
    expected = {str(p.url) for p in workers}
    ids = prompt(8, seed=7)
    room = new_room()
    async with client() as http:
        want = await greedy(http, colo, ids, 6)

        async def listed() -> bool | None:
            try:
                r = await http.get(f"{boot.url}/list")
            except httpx.TransportError:
                return None
            got = {rec["scheduler_addr"] for rec in r.json()["instances"]}
            return True if expected <= got else None

        await wait_until(listed, SLACK, "every worker listed before the restart")
        d_leg = Outcome()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(post, http, f"{dfail.url}/generate", leg(room, ids, 6, p1), d_leg)
            await wait_until(lambda: p_state(http, p1, "EARLY_PEER", 1), SLACK, "D's hello")
            boot.kill()
            await trio.sleep(2 * HEARTBEAT)  # the workers' heartbeats fail meanwhile
            boot.start()
            await trio.to_thread.run_sync(wait_healthy, [boot], 60.0)
            _, took = await wait_until(listed, SLACK, "every worker registered again")
            print(f"all {len(expected)} instances registered again {took:.2f} s after the "
                  f"bootstrap server was back")
            assert took <= HEARTBEAT + 2.0
            r = await http.post(f"{p1.url}/generate", json=leg(room, ids, 6, p1))
            assert r.status_code == 200, r.text
        assert d_leg.ok_ids() == want

        # A new room after the restart, on a D that resolves P through the new registry.
        room2 = new_room()
        d2, p2 = Outcome(), Outcome()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(post, http, f"{drec.url}/generate", leg(room2, ids, 6, p1), d2)
            nursery.start_soon(post, http, f"{p1.url}/generate", leg(room2, ids, 6, p1), p2)
        assert p2.status == 200 and d2.ok_ids() == want
        await wait_clean(http, p1, dfail, drec, timeout=SLACK)


# ----------------------------------------------------------------------------- aborts


async def _abort(http: httpx.AsyncClient, proc: Proc, rid: str) -> None:
    r = await http.post(f"{proc.url}/abort_request", json={"rid": rid})
    assert r.status_code == 200 and r.json()["aborted"] == [rid], r.text


async def _read_chunks_then_leave(http: httpx.AsyncClient, url: str, body: dict[str, Any],
                                  n: int) -> int:
    """Stream ``body``, read ``n`` SSE events, then close the connection (the client leaves)."""
    seen = 0
    async with http.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                assert line != "data: [DONE]", "finished before the client left"
                seen += 1
                if seen >= n:
                    break
    return seen


STAGES = ["d-waiting-for-ready", "p-prefilled-no-peer", "d-queued-for-pages",
          "d-decoding-disconnect", "proxy-stream-disconnect"]


@pytest.mark.parametrize("stage", STAGES)
async def test_abort_or_disconnect_releases_both_legs(fleet: Fleet, stage: str) -> None:
    """``/abort_request`` or a client that goes away, at each stage, releases both legs on both
    sides: the aborted leg answers 499 (JSON) while it is still answering, and P and D end with
    every page free, no room, no queue and no transfer registration within SLACK of the abort.

    Nothing but the abort can do it that fast: the first three stages run on ``plong`` +
    ``dlong``, whose KV hold lease (initial and extension) and READY / page-queue waits are LONG
    (15 x SLACK), so a P that ignored D's ABORT, or a D that ignored the abort, would hold the room
    far past the bound. In the two disconnect stages the room is already over on P (D pulled the
    KV) and only D's generation is left to stop: there D must also have generated fewer tokens
    than the request's max_new_tokens (a disconnect that released nothing would run to the end).

    * d-waiting-for-ready: D's leg only (P bound the room, no P leg): abort on D; D's ABORT
      closes P's room.
    * p-prefilled-no-peer: P's leg only (prefilled, KV registered, no D yet): abort on P.
    * d-queued-for-pages: D's pages taken by another room, both legs of this one sent (P holds
      its KV, D heartbeats it from the queue): abort on D; D's ABORT frees P's KV at once.
    * d-decoding-disconnect: both legs, D streaming; the client reads two chunks and leaves.
    * proxy-stream-disconnect: through the proxy, streaming; the client reads two chunks and
      leaves; the proxy aborts both legs.
    """
    p1, dfail, drec, proxy = fleet["p1"], fleet["dfail"], fleet["drec"], fleet["proxy"]
    plong, dlong = fleet["plong"], fleet["dlong"]
    workers = (plong, dlong, p1, dfail, drec)
    room = new_room()
    async with client() as http:
        await wait_clean(http, *workers, timeout=SLACK)
        generated0 = {d.name: (await stats(http, d))["generated_tokens_total"]
                      for d in (dfail, drec)}
        start = trio.current_time()
        max_new = 0  # the disconnect stages: D must stop before generating this many tokens
        decoder = drec
        if stage == "d-waiting-for-ready":
            body = leg(room, prompt(8, seed=8), 6, plong)
            d_leg = Outcome()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(post, http, f"{dlong.url}/generate", body, d_leg)
                await wait_until(lambda: p_state(http, plong, "EARLY_PEER", 1), SLACK, "hello")
                start = trio.current_time()
                await _abort(http, dlong, body["rid"])
            assert d_leg.status == 499 and "abort" in error_message_of(d_leg), d_leg
        elif stage == "p-prefilled-no-peer":
            body = leg(room, prompt(8, seed=9), 6, plong)
            p_leg = Outcome()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(post, http, f"{plong.url}/generate", body, p_leg)

                async def registered() -> bool | None:
                    s = await stats(http, plong)
                    return True if s["transfer_registrations"] == 1 else None

                await wait_until(registered, FIRST_USE, "P's KV registered")
                assert kvpoll(await stats(http, plong), "PREFILLED_NO_PEER") == 1
                start = trio.current_time()
                await _abort(http, plong, body["rid"])
            assert p_leg.status == 499 and "abort" in error_message_of(p_leg), p_leg
        elif stage == "d-queued-for-pages":
            hold = leg(new_room(), prompt(100, seed=10), 40, plong)  # 35 of dlong's 39 pages
            body = leg(room, prompt(12, seed=11), 8, plong)
            hold_leg, d_leg, p_leg = Outcome(), Outcome(), Outcome()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(post, http, f"{dlong.url}/generate", hold, hold_leg)
                await wait_until(lambda: p_state(http, plong, "EARLY_PEER", 1), SLACK, "hold")
                nursery.start_soon(post, http, f"{dlong.url}/generate", body, d_leg)
                nursery.start_soon(post, http, f"{plong.url}/generate", body, p_leg)

                async def queued() -> bool | None:
                    d, p = await stats(http, dlong), await stats(http, plong)
                    return True if (d["pd_queues"]["alloc_queue"] == 1
                                    and p["transfer_registrations"] == 1) else None

                await wait_until(queued, FIRST_USE, "room queued on D, KV held on P")
                start = trio.current_time()
                await _abort(http, dlong, body["rid"])
                await wait_until(lambda: p_state(http, plong, "PREFILLED_NO_PEER", 0), SLACK,
                                 "P's room closed by D's ABORT")
                await _abort(http, dlong, hold["rid"])
            assert d_leg.status == 499, d_leg
            assert p_leg.status is not None and p_leg.status >= 400, p_leg
            error_message_of(p_leg)  # P's leg fails with a JSON reason (D aborted)
            assert hold_leg.status == 499, hold_leg
        elif stage == "d-decoding-disconnect":
            ids = prompt(8, seed=12)
            max_new = 240
            body = leg(room, ids, max_new, p1, stream=True)  # 62 of drec's 63 pages
            p_leg = Outcome()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(post, http, f"{p1.url}/generate", body, p_leg)
                seen = await _read_chunks_then_leave(http, f"{drec.url}/generate", body, 2)
                start = trio.current_time()
            assert seen == 2
            assert p_leg.status == 200, p_leg
        else:
            max_new, decoder = 120, dfail
            body = {"input_ids": prompt(8, seed=13), "stream": True,
                    "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0}}
            seen = await _read_chunks_then_leave(http, f"{proxy.url}/generate", body, 2)
            start = trio.current_time()
            assert seen == 2
        took = await wait_clean(http, *workers, timeout=SLACK)
        print(f"{stage}: both sides clean {trio.current_time() - start:.2f} s after the abort")
        assert took < SLACK < LONG
        if max_new:
            generated = ((await stats(http, decoder))["generated_tokens_total"]
                         - generated0[decoder.name])
            print(f"{stage}: D generated {generated} of {max_new} tokens")
            assert 1 <= generated < max_new, "the disconnect did not stop D's generation"


# ----------------------------------------------------------------------------- duplicate room


async def test_duplicate_live_room_is_rejected_first_unaffected(fleet: Fleet) -> None:
    """A second request reusing a live ``bootstrap_room`` is refused with 409 and a clear
    message, on D (first D leg waiting for READY) and on P (first P leg prefilled, waiting for
    D); both first requests then complete correctly."""
    p1, dfail, colo = fleet["p1"], fleet["dfail"], fleet["colocated"]
    room_d, room_p = new_room(), new_room()
    ids_d, ids_p = prompt(9, seed=14), prompt(10, seed=15)
    async with client() as http:
        await wait_clean(http, p1, dfail, timeout=SLACK)
        want_d, want_p = await greedy(http, colo, ids_d, 5), await greedy(http, colo, ids_p, 5)
        first_d, first_d_p, first_p, first_p_d = Outcome(), Outcome(), Outcome(), Outcome()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(post, http, f"{dfail.url}/generate", leg(room_d, ids_d, 5, p1),
                               first_d)
            await wait_until(lambda: p_state(http, p1, "EARLY_PEER", 1), SLACK, "D's hello")
            # The same room again on D, under another rid and another prompt.
            t0 = trio.current_time()
            dup = leg(room_d, prompt(5, seed=99), 5, p1, rid="dup-on-d")
            r = await http.post(f"{dfail.url}/generate", json=dup)
            assert r.status_code == 409, r.text
            assert f"bootstrap_room {room_d} is already live" in error_message(r)
            assert trio.current_time() - t0 < SLACK

            # P: the first P leg of room_p waits for its D (KV registered, lease running).
            nursery.start_soon(post, http, f"{p1.url}/generate", leg(room_p, ids_p, 5, p1),
                               first_p)
            await wait_until(lambda: p_state(http, p1, "PREFILLED_NO_PEER", 1), SLACK,
                             "P's first leg prefilled")
            dup = leg(room_p, prompt(5, seed=98), 5, p1, rid="dup-on-p")
            r = await http.post(f"{p1.url}/generate", json=dup)
            assert r.status_code == 409, r.text
            assert f"bootstrap_room {room_p} is already live" in error_message(r)

            # The first requests go on: their other legs arrive now.
            nursery.start_soon(post, http, f"{dfail.url}/generate", leg(room_p, ids_p, 5, p1),
                               first_p_d)
            nursery.start_soon(post, http, f"{p1.url}/generate", leg(room_d, ids_d, 5, p1),
                               first_d_p)
        assert first_d.ok_ids() == want_d
        assert first_p_d.ok_ids() == want_p
        assert first_d_p.status == 200 and first_p.status == 200, (first_d_p, first_p)
        await wait_clean(http, p1, dfail, timeout=SLACK)


# ----------------------------------------------------------------------------- trust


async def test_secret_refuses_unsigned_writes_and_forgeries(fleet: Fleet) -> None:
    """With a cluster secret: registry writes not signed with the registry key (unsigned, any
    bearer token, the cluster secret itself as one, signed with the side-channel key) and a
    signed write sent again are refused (401) and counted; side-channel frames without a valid
    side-channel signature (unsigned, signed with another key, the registry key or the secret
    itself) are dropped and counted (``malformed``); correctly signed DONE and ABORT for a room
    bound to another D are dropped and counted (``foreign_peer``) and change nothing: the room
    completes correctly. Every listening socket of every process is on 127.0.0.1."""
    boot, p1, dfail, colo = fleet["bootstrap"], fleet["p1"], fleet["dfail"], fleet["colocated"]
    assert fleet.secret is not None
    ids = prompt(9, seed=16)
    room = new_room()
    async with client() as http:
        await wait_clean(http, p1, dfail, timeout=SLACK)
        want = await greedy(http, colo, ids, 6)

        # -- the registry: a write that would deregister p1, and a forged registration.
        health0 = (await http.get(f"{boot.url}/health")).json()
        p_record = next(rec for rec in (await http.get(f"{boot.url}/list")).json()["instances"]
                        if rec["scheduler_addr"] == p1.url)
        key = {k: p_record[k] for k in ("role", "instance_id", "tp_rank", "cp_rank", "dp_rank",
                                        "pp_rank")}
        forged = {**p_record, "zmq_addr": "127.0.0.1:1", "transfer_addr": "127.0.0.1:1"}

        def signed(method: str, path: str, body: bytes, key: bytes) -> dict[str, str]:
            return sign_request(key, method, path, body, sent_at=time.time(),
                                nonce=secrets.token_bytes(16))

        wrong_key = side_channel_key(fleet.secret)
        attempts = [
            ("DELETE", "/route", key, {}),
            ("DELETE", "/route", key, {"authorization": "Bearer wrong"}),
            ("DELETE", "/route", key, {"authorization": f"Bearer {fleet.secret.decode()}"}),
            ("PUT", "/route", forged, {}),
            ("PUT", "/route", forged, {"authorization": "Bearer " + "x" * 32}),
            ("PUT", "/route", forged, signed("PUT", "/route", json.dumps(forged).encode(),
                                             wrong_key)),
            ("POST", "/heartbeat", key, {"authorization": "Basic abc"}),
        ]
        for method, path, body, headers in attempts:
            content = json.dumps(body).encode()
            r = await http.request(method, f"{boot.url}{path}", content=content, headers=headers)
            assert r.status_code == 401, (method, path, r.text)
        # A good heartbeat for p1, recorded and sent again: the copy is refused.
        beat = json.dumps(key).encode()
        beat_headers = signed("POST", "/heartbeat", beat, registry_key(fleet.secret))
        for status in (200, 401):
            r = await http.post(f"{boot.url}/heartbeat", content=beat, headers=beat_headers)
            assert r.status_code == status, r.text
        assert "replayed" in r.json()["error"]
        health1 = (await http.get(f"{boot.url}/health")).json()
        assert health1["bad_requests_total"] == health0["bad_requests_total"] + len(attempts) + 1
        listed = (await http.get(f"{boot.url}/list")).json()["instances"]
        assert [rec for rec in listed if rec["scheduler_addr"] == p1.url] == [p_record]

        # -- the side channel: a room bound to dfail, forgeries from "mallory".
        d_leg = Outcome()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(post, http, f"{dfail.url}/generate", leg(room, ids, 6, p1), d_leg)
            await wait_until(lambda: p_state(http, p1, "EARLY_PEER", 1), SLACK, "D's hello")
            s0 = await stats(http, p1)
            unsigned = [encode(Done(room, True), None), encode(Abort(room, "forged"), None),
                        frame_now(Done(room, True), b"not-the-secret"), b"\x00garbage",
                        # keys of this cluster, but not the side channel's
                        frame_now(Done(room, True), registry_key(fleet.secret)),
                        frame_now(Abort(room, "forged"), fleet.secret)]
            side_key = side_channel_key(fleet.secret)
            frames = [frame_now(Done(room, True), side_key),
                      frame_now(Abort(room, "forged"), side_key)]
            replayed = frames[:1]  # captured off the wire and sent again
            await trio.to_thread.run_sync(_send_frames, p1, unsigned + frames + replayed)

            async def counted() -> dict[str, Any] | None:
                s = await stats(http, p1)
                done = (s["side_channel"]["malformed"] - s0["side_channel"]["malformed"]
                        == len(unsigned)
                        and s["pd_events"]["foreign_peer"] - s0["pd_events"]["foreign_peer"]
                        == len(frames)
                        and s["side_channel"]["replayed"] - s0["side_channel"]["replayed"]
                        == len(replayed))
                return s if done else None

            s1, _ = await wait_until(counted, SLACK, "forgeries counted")
            assert kvpoll(s1, "EARLY_PEER") == 1  # the room did not move
            assert s1["pd_events"]["failed"] == s0["pd_events"]["failed"]
            r = await http.post(f"{p1.url}/generate", json=leg(room, ids, 6, p1))
            assert r.status_code == 200, r.text
        assert d_leg.ok_ids() == want
        await wait_clean(http, p1, dfail, timeout=SLACK)

    # -- every service listens on 127.0.0.1 only (the transfer servers included).
    for proc in fleet.procs.values():
        if proc.alive():
            addrs = listening_addresses(proc.pid)
            assert addrs, proc.name
            assert {a for a, _ in addrs} == {HOST}, (proc.name, addrs)

    # -- workers re-executed themselves with the huge-page heap (--host-heap's default), same PID.
    if host_memory._is_glibc() and host_memory._thp_available():
        for proc in fleet.procs.values():
            if proc.alive() and "serve" in proc.argv:
                environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
                assert any(
                    e.startswith(b"GLIBC_TUNABLES=") and host_memory.TUNABLE.encode() in e
                    for e in environ
                ), proc.name


def _send_frames(p: Proc, frames: list[bytes]) -> None:
    """Send ``frames`` to P's ROUTER from a DEALER with an identity no D has."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.IDENTITY, b"mallory")
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(f"tcp://{HOST}:{p.bootstrap_port}")
        for frame in frames:
            sock.send(frame)
    finally:
        sock.close()  # LINGER: the frames are flushed first
        ctx.term()


# ----------------------------------------------------------------------------- overload


async def test_overload_waits_in_queue_then_503(fleet: Fleet) -> None:
    """D has no free pages (a held room takes 35 of its 39): a new room waits in D's queue,
    heartbeating its P lease, for longer than LEASE_INITIAL, and completes correctly once pages
    free up. A room that cannot get pages within QUEUE_TIMEOUT fails with 503 (JSON), and D's
    ABORT frees its KV on P at once."""
    p1, dfail, colo = fleet["p1"], fleet["dfail"], fleet["colocated"]
    hold_ids, ids = prompt(100, seed=17), prompt(12, seed=18)
    async with client() as http:
        await wait_clean(http, p1, dfail, timeout=SLACK)
        want_hold, want = await greedy(http, colo, hold_ids, 40), await greedy(http, colo, ids, 8)

        async def start_hold(nursery: trio.Nursery, out: Outcome) -> dict[str, Any]:
            body = leg(new_room(), hold_ids, 40, p1)
            nursery.start_soon(post, http, f"{dfail.url}/generate", body, out)
            await wait_until(lambda: p_state(http, p1, "EARLY_PEER", 1), SLACK, "hold's hello")
            return body

        async def queued() -> bool | None:
            d = await stats(http, dfail)
            return True if d["pd_queues"]["alloc_queue"] == 1 else None

        # 0. The hold's shapes once end to end, so that no compile (P's 100-token prefill, D's
        # 35-page scatter) eats into the queue timeout below.
        warm_d, warm_p = Outcome(), Outcome()
        async with trio.open_nursery() as nursery:
            warm = leg(new_room(), hold_ids, 40, p1)
            nursery.start_soon(post, http, f"{dfail.url}/generate", warm, warm_d)
            nursery.start_soon(post, http, f"{p1.url}/generate", warm, warm_p)
        assert warm_p.status == 200 and warm_d.ok_ids() == want_hold

        # 1. Wait longer than P's initial lease, then get pages and finish.
        hold_out, d_out, p_out = Outcome(), Outcome(), Outcome()
        async with trio.open_nursery() as nursery:
            hold = await start_hold(nursery, hold_out)
            body = leg(new_room(), ids, 8, p1)
            nursery.start_soon(post, http, f"{dfail.url}/generate", body, d_out)
            nursery.start_soon(post, http, f"{p1.url}/generate", body, p_out)
            await wait_until(queued, SLACK, "queued on D")
            queued_at = trio.current_time()
            await trio.sleep_until(queued_at + LEASE_INITIAL + 1.0)
            s = await stats(http, p1)
            # Still held on P thanks to D's heartbeats: the initial lease alone has run out.
            assert kvpoll(s, "PREFILLED_NO_PEER") == 1 and s["transfer_registrations"] == 1, s
            assert d_out.status is None
            r = await http.post(f"{p1.url}/generate", json=hold)  # the hold's P leg: it ends
            assert r.status_code == 200, r.text
        assert hold_out.ok_ids() == want_hold
        assert p_out.status == 200, p_out
        assert d_out.ok_ids() == want
        assert d_out.at - queued_at > LEASE_INITIAL
        await wait_clean(http, p1, dfail, timeout=SLACK)

        # 2. No pages within the queue timeout: 503.
        hold_out, d_out, p_out = Outcome(), Outcome(), Outcome()
        async with trio.open_nursery() as nursery:
            hold = await start_hold(nursery, hold_out)
            body = leg(new_room(), ids, 8, p1)
            nursery.start_soon(post, http, f"{dfail.url}/generate", body, d_out)
            nursery.start_soon(post, http, f"{p1.url}/generate", body, p_out)
            await wait_until(queued, SLACK, "queued on D")
            queued_at = trio.current_time()
            with trio.fail_after(QUEUE_TIMEOUT + SLACK):
                while d_out.status is None:
                    await trio.sleep(0.05)
            assert d_out.status == 503, d_out
            assert "no free KV pages" in error_message_of(d_out)
            assert QUEUE_TIMEOUT - 0.5 <= d_out.at - queued_at <= QUEUE_TIMEOUT + SLACK

            async def p_released() -> bool | None:
                return True if (await stats(http, p1))["transfer_registrations"] == 0 else None

            _, took = await wait_until(p_released, SLACK, "P's KV released")
            assert took < LEASE_EXTENSION  # by D's ABORT, not by the lease
            await _abort(http, dfail, hold["rid"])
        assert p_out.status is not None and p_out.status >= 500, p_out
        error_message_of(p_out)
        assert hold_out.status == 499
        await wait_clean(http, p1, dfail, timeout=SLACK)

