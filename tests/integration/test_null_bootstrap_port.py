"""A PD request with ``bootstrap_port: null`` (sglang's mini-lb may send it) to a D started
without ``--disaggregation-prefill-port``: D answers 400 at once, and P's leg of the same room
must end within seconds too, not at P's lease expiry (issue 11 §3).

D cannot tell which P the router picked, but it knows ``bootstrap_host`` and the room: it ABORTs
the room to every P registered at that host. A P that already holds its leg fails it at once
(kv_sender AbortReceived rows); a P whose leg has not arrived yet remembers the room (REFUSED) and
fails the leg the moment it arrives.

Real processes: bootstrap + one P + one D, cluster secret, the short windows of
``failure_support.WINDOWS`` except P's initial lease, which is LONG: a P leg that ended within
the bound below was ended by D's ABORT, not by the lease. The test is the router.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import httpx
import pytest
import trio

from tests.integration.failure_support import (
    SLACK,
    Fleet,
    Proc,
    error_message,
    kvpoll,
    leg,
    new_room,
    prompt,
    stats,
    wait_clean,
    wait_until,
)

pytestmark = pytest.mark.slow

LONG = 60.0  # P's initial lease: what P's leg would wait without D's ABORT
FAST = 2 * SLACK  # P's leg must end within this of D's refusal (a deadline, not a benchmark)
assert FAST * 3 < LONG


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("null_port"), secret=True)
    f.bootstrap()
    f.prefill("p", extra=["--disaggregation-lease-initial", str(LONG)])
    f.decode("d")  # no --disaggregation-prefill-port: a null bootstrap_port is a 400
    f.start()
    yield f
    f.close()


@attrs.define
class Outcome:
    status: int | None = None
    message: str = ""
    at: float = 0.0


async def _post(http: httpx.AsyncClient, proc: Proc, body: dict[str, Any], out: Outcome) -> None:
    r = await http.post(f"{proc.url}/generate", json=body)
    out.status, out.at = r.status_code, trio.current_time()
    if r.status_code != 200:
        out.message = error_message(r)  # a JSON error body


def _null_port_leg(fleet: Fleet, seed: int) -> dict[str, Any]:
    body = leg(new_room(), prompt(8, seed=seed), 4, fleet["p"])
    body["bootstrap_port"] = None
    return body


def _client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=LONG + 30.0))


def _check_d_refused(d_out: Outcome) -> None:
    assert d_out.status == 400, d_out
    assert "bootstrap_port is null" in d_out.message, d_out


async def _told(http: httpx.AsyncClient, fleet: Fleet, before: int) -> int | None:
    n = int((await stats(http, fleet["d"]))["refused_rooms_told_total"])
    return n if n > before else None


async def test_both_legs_at_once_p_ends_fast(fleet: Fleet) -> None:
    """The router posts both legs concurrently: whichever order they land in, P's leg ends
    within FAST of D's 400 (well under its LONG lease), with a JSON error naming D's refusal,
    and both workers are back to idle."""
    p, d = fleet["p"], fleet["d"]
    async with _client() as http:
        await wait_clean(http, p, d, timeout=SLACK)
        for seed in (1, 2):  # the first may include P's first prefill of this shape
            body = _null_port_leg(fleet, seed)
            p_out, d_out = Outcome(), Outcome()
            start = trio.current_time()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_post, http, p, body, p_out)
                nursery.start_soon(_post, http, d, body, d_out)
            _check_d_refused(d_out)
            assert p_out.status is not None and p_out.status >= 400, p_out
            assert "decode refused the request: bootstrap_port is null" in p_out.message, p_out
            took = p_out.at - start
            print(f"seed {seed}: D {d_out.status} after {d_out.at - start:.2f} s, "
                  f"P {p_out.status} after {took:.2f} s: {p_out.message}")
            assert took < FAST < LONG
            await wait_clean(http, p, d, timeout=SLACK)


async def test_abort_before_p_leg_fails_it_at_once(fleet: Fleet) -> None:
    """D's leg first, alone: D answers 400 and ABORTs the room to P, which remembers it
    (REFUSED); P's leg, posted afterwards, fails at once (502) without touching a page."""
    p, d = fleet["p"], fleet["d"]
    async with _client() as http:
        await wait_clean(http, p, d, timeout=SLACK)
        before = int((await stats(http, d))["refused_rooms_told_total"])
        body = _null_port_leg(fleet, 3)
        d_out = Outcome()
        await _post(http, d, body, d_out)
        _check_d_refused(d_out)
        await wait_until(lambda: _told(http, fleet, before), SLACK, "D told P")

        async def refused() -> bool | None:
            return True if kvpoll(await stats(http, p), "REFUSED") == 1 else None

        await wait_until(refused, SLACK, "P remembers the refused room")
        p_out = Outcome()
        start = trio.current_time()
        await _post(http, p, body, p_out)
        print(f"P {p_out.status} after {p_out.at - start:.2f} s: {p_out.message}")
        assert p_out.status == 502, p_out
        assert "before this leg arrived" in p_out.message, p_out
        assert "decode refused the request: bootstrap_port is null" in p_out.message, p_out
        assert p_out.at - start < SLACK
        await wait_clean(http, p, d, timeout=SLACK)


async def test_p_leg_first_is_failed_by_ds_abort(fleet: Fleet) -> None:
    """P's leg first (it is in P's room, waiting for D's hello), then D's: D's 400 is followed
    by its ABORT, which fails P's waiting leg and frees its pages at once."""
    p, d = fleet["p"], fleet["d"]
    async with _client() as http:
        await wait_clean(http, p, d, timeout=SLACK)
        body = _null_port_leg(fleet, 4)
        p_out, d_out = Outcome(), Outcome()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_post, http, p, body, p_out)

            async def p_holds_it() -> bool | None:
                s = await stats(http, p)
                live = kvpoll(s, "BOOTSTRAPPING") + kvpoll(s, "PREFILLED_NO_PEER")
                return True if live == 1 else None

            await wait_until(p_holds_it, SLACK, "P's leg in its room")
            start = trio.current_time()
            await _post(http, d, body, d_out)
            _check_d_refused(d_out)
        assert p_out.status is not None and p_out.status >= 500, p_out
        assert "decode refused the request: bootstrap_port is null" in p_out.message, p_out
        print(f"P {p_out.status} {p_out.at - start:.2f} s after D's 400: {p_out.message}")
        assert p_out.at - start < FAST < LONG
        await wait_clean(http, p, d, timeout=SLACK)
