"""The drain's hand-off gate (worker/drain_gate.py): a draining decode worker hands its streams off
only when the registry lists another decode worker that could take them and that answers its
/health 200 (real HTTP servers here: one healthy, one draining, one port with nobody behind
it); each decision is
counted in /metrics by outcome and reason. And the flags: on by default, ``--no-drain-handoff``
turns it off. And the proxy's side: it asks a leg's D for a hand-off only while it routes
another D."""

from __future__ import annotations

import argparse
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pd_fsm.io_trio.bootstrap.client import BootstrapError
from pd_fsm.io_trio.bootstrap.records import InstanceRecord
from pd_fsm.io_trio.http_server import serve_app
from pd_fsm.io_trio.proxy.migration import Progress
from pd_fsm.io_trio.worker import drain_gate
from pd_fsm.io_trio.worker.config import ServeConfig, add_serve_arguments, config_from_args
from pd_fsm.io_trio.worker.metrics import DRAIN_OUTCOMES, WorkerMetrics

LAYOUT = "layout-a"


def record(name: str, **kw: Any) -> InstanceRecord:
    fields: dict[str, Any] = dict(
        role="decode", instance_id=name, tp_rank=0, tp_size=1, cp_rank=0, cp_size=1, dp_rank=0,
        dp_size=1, pp_rank=0, pp_size=1, transfer_addr="127.0.0.1:1", zmq_addr="127.0.0.1:2",
        page_size=16, kv_dtype="float32", layout_hash=LAYOUT,
        scheduler_addr=f"http://{name}:8000", mesh_meta={"processes": 1})
    return InstanceRecord(**{**fields, **kw})


OWN = record("d0")


class FakeDecode:
    """What the gate reads of a decode backend, and where ``start_hand_off`` lands."""

    mode = "decode"

    def __init__(self, listed: list[InstanceRecord] | Exception, delay: float = 0.0) -> None:
        self.listed = listed
        self.delay = delay
        self.leases: list[float] = []

    async def handoff_peers(self) -> tuple[InstanceRecord, list[InstanceRecord]]:
        await trio.sleep(self.delay)
        if isinstance(self.listed, Exception):
            raise self.listed
        return OWN, self.listed

    def hand_off(self, lease_s: float) -> None:
        self.leases.append(lease_s)


@asynccontextmanager
async def health_server(status: int) -> AsyncIterator[str]:
    """A real HTTP server whose /health answers ``status`` (200: serving; 503: draining, as a
    worker's does); yields its URL."""
    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok" if status == 200 else "draining"},
                            status_code=status)

    async with trio.open_nursery() as nursery:
        [url] = await nursery.start(serve_app, Starlette(routes=[Route("/health", health)]),
                                    "127.0.0.1", 0)
        yield url
        nursery.cancel_scope.cancel()


def closed_url() -> str:
    """A URL nobody listens on: a worker SIGKILLed, whose registry record lives on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_only_another_instance_of_our_layout_in_one_process_can_take_a_hand_off() -> None:
    ok = record("d1")
    records = [
        OWN,  # ourselves, still listed while our withdrawal is on its way
        attrs.evolve(OWN, tp_rank=1),
        record("d2", scheduler_addr=OWN.scheduler_addr),  # our URL under another name
        record("d3", layout_hash="layout-b"),  # a ticket of ours would be refused
        record("d4", layout_hash=""),  # not ours: no layout to check a ticket against
        record("d5", mesh_meta={"processes": 2}),  # spans processes: takes no hand-off
        record("d6", tp_rank=1),  # a rank > 0 serves no HTTP
        ok,
    ]
    assert drain_gate.takers(OWN, records) == [ok]
    assert drain_gate.takers(attrs.evolve(OWN, layout_hash=""), [ok]) == []


@pytest.mark.parametrize(("backend", "config", "reason"), [
    (FakeDecode([record("d1")]), ServeConfig(drain_handoff=False), "disabled"),
    (FakeDecode([record("d1")]), ServeConfig(nnodes=2), "spans_processes"),
    (FakeDecode([OWN]), ServeConfig(), "no_other_decode"),
    (FakeDecode([OWN, record("d1", layout_hash="x")]), ServeConfig(), "no_other_decode"),
    (FakeDecode(BootstrapError("GET /list: HTTP 503")), ServeConfig(), "registry_unreadable"),
    (FakeDecode([record("d1")], delay=5.0), ServeConfig(), "registry_unreadable"),
])
async def test_a_decode_worker_without_a_taker_finishes_its_streams_in_place(
        backend: FakeDecode, config: ServeConfig, reason: str, autojump_clock: Any) -> None:
    started = trio.current_time()
    decision = await drain_gate.drain_streams(
        backend, config, time.monotonic(), "draining")  # type: ignore[arg-type]
    assert (decision.outcome, decision.reason) == ("finished_in_place", reason)
    assert backend.leases == []  # nothing handed off
    # A registry that does not answer delays the drain by the gate's timeout, no more.
    assert trio.current_time() - started <= drain_gate.GATE_TIMEOUT_S


async def test_a_decode_worker_with_another_healthy_one_hands_off_within_the_drain() -> None:
    async with health_server(200) as up, health_server(503) as draining:
        dead = closed_url()
        backend = FakeDecode([OWN, record("d1", scheduler_addr=dead),
                              record("d2", scheduler_addr=draining),
                              record("d3", scheduler_addr=up)])
        config = ServeConfig(drain_timeout=10.0)
        started = time.monotonic()
        decision = await drain_gate.drain_streams(backend, config, started, "switch")  # type: ignore[arg-type]
    assert (decision.outcome, decision.reason) == ("handed_off", "other_decode_healthy")
    assert f"1 other decode worker(s) registered and healthy: d3 {up}" in decision.detail
    assert f"d1 {dead}: ConnectError" in decision.detail
    assert f"d2 {draining}: HTTP 503" in decision.detail
    # The lease ends half a second before the drain's deadline.
    [lease] = backend.leases
    assert 9.0 < lease <= 9.5


async def test_a_decode_worker_whose_listed_takers_are_down_or_draining_finishes_in_place(
        ) -> None:
    """A registry record outlives a crashed worker (until its lease expires): handing off to it
    would lose the streams. Only a taker whose /health answers 200 counts."""
    async with health_server(503) as draining:
        dead = closed_url()
        backend = FakeDecode([OWN, record("d1", scheduler_addr=dead),
                              record("d2", scheduler_addr=draining)])
        decision = await drain_gate.drain_streams(
            backend, ServeConfig(drain_timeout=10.0), time.monotonic(), "draining")  # type: ignore[arg-type]
    assert (decision.outcome, decision.reason) == ("finished_in_place", "no_healthy_decode")
    assert decision.detail == (f"2 other decode worker(s) registered, none answered /health "
                               f"200: d1 {dead}: ConnectError; d2 {draining}: HTTP 503")
    assert backend.leases == []


async def test_a_taker_that_does_not_answer_in_time_does_not_count() -> None:
    """A taker that accepts the connection but never answers (a hung process): the gate's one
    deadline ends the probe (before httpx's own 10 s timeout would: "no answer in time")."""
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen()
        url = f"http://127.0.0.1:{hung.getsockname()[1]}"
        decision = await drain_gate.decide(
            FakeDecode([record("d1", scheduler_addr=url)]), ServeConfig(), 0.5)  # type: ignore[arg-type]
    assert (decision.outcome, decision.reason) == ("finished_in_place", "no_healthy_decode")
    assert f"d1 {url}: no answer in time" in decision.detail


async def test_a_worker_of_another_role_is_not_asked() -> None:
    class Prefill:
        mode = "prefill"

    decision = await drain_gate.decide(Prefill(), ServeConfig(), 1.0)  # type: ignore[arg-type]
    assert (decision.outcome, decision.reason) == ("finished_in_place", "not_decode")


def test_every_drain_outcome_is_in_metrics_from_zero() -> None:
    m = WorkerMetrics(lambda: {})
    m.drains.labels("finished_in_place", "no_other_decode").inc()
    text = m.render().decode()
    for outcome, reasons in DRAIN_OUTCOMES.items():
        for reason in reasons:
            n = 1.0 if reason == "no_other_decode" else 0.0
            assert (f'pd_fsm_worker_drains_total{{outcome="{outcome}",reason="{reason}"}} '
                    f'{n}') in text


def _parsed(*argv: str) -> ServeConfig:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_hand_off_is_on_by_default_and_no_drain_handoff_turns_it_off() -> None:
    assert _parsed().drain_handoff
    assert _parsed("--drain-handoff").drain_handoff  # the default, stated
    assert not _parsed("--no-drain-handoff").drain_handoff
    with pytest.raises(SystemExit):
        _parsed("--drain-handoff", "--no-drain-handoff")


def test_the_proxy_asks_for_a_hand_off_only_while_it_routes_another_decode_worker() -> None:
    p = Progress("/generate", stream=True)
    body = {"text": "hi", "stream": True}
    assert p.leg_body(body)["accept_handoff"] is True
    assert "accept_handoff" not in p.leg_body(body, handoff=False)
