"""The premise of a PD instance spanning processes (``pd_replica.py``): two replicas of a
real prefill scheduler (tiny model, real transfer servers, in one process here), fed the same
tick frames, take the same decisions: the same pages, the same room states, the same transfer
uuid registered on each one's own transfer server, the same release. A frame whose fingerprint
is not the replica's state, or that a PD rank cannot apply, is a divergence."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pd_fsm.core import events as ev
from pd_fsm.core.messages import Done, RecvInit
from pd_fsm.io_trio.worker.config import ServeConfig
from pd_fsm.io_trio.worker.pd_backends import fingerprint, make_pd_backend
from pd_fsm.io_trio.worker.pd_replica import PDReplica
from pd_fsm.io_trio.worker.spmd.follower import Divergence
from pd_fsm.io_trio.worker.spmd.frames import (
    Announced,
    Arrival,
    LegAdded,
    Pinged,
    StepOrdered,
    TickStarted,
)
from pd_fsm.io_trio.worker.spmd.tick_inputs import TickInputs
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers.request import LogprobSpec
from tests.integration.serve_support import TINY

pytestmark = pytest.mark.slow

ROOM = 42
KEY = bytes(range(32))


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[tuple[PDReplica, object]]]:
    out = []
    for _ in range(2):
        config = ServeConfig(**{**TINY, "port": 0, "disaggregation_mode": "prefill"})
        backend = make_pd_backend(config)
        backend.tick_inputs = TickInputs(KEY)  # what rank 0 would have broadcast
        sched = backend.build_scheduler()
        out.append((PDReplica(backend, sched, 1), sched))
    yield out
    for _, sched in out:
        sched.role.engine.close()  # type: ignore[attr-defined]


def _both(replicas: list[tuple[PDReplica, object]], frame: TickStarted) -> str:
    for replica, _ in replicas:
        replica.apply(frame)
    prints = {fingerprint(sched) for _, sched in replicas}
    assert len(prints) == 1, prints
    return prints.pop()


def test_replicas_fed_the_same_ticks_register_the_same_uuid(
        replicas: list[tuple[PDReplica, object]]) -> None:
    scheds = [sched for _, sched in replicas]
    leg = LegAdded("r", tuple(range(3, 12)), SamplingParams(max_new_tokens=4, temperature=0.0),
                   LogprobSpec(), accepted=0.5, bootstrap_host="127.0.0.1",
                   bootstrap_port=1234, room=ROOM)
    layout = scheds[0].role.kv_args.layout_hash  # type: ignore[attr-defined]
    hello = ev.MessageReceived("d-peer", RecvInit(ROOM, "d-peer", 3, layout, incarnation=5))
    state = _both(replicas, TickStarted(1, 1.0, "", legs=(leg,)))
    state = _both(replicas, TickStarted(2, 2.0, state, arrivals=(Arrival(1.5, hello),)))
    tick = 3
    while not scheds[0].role.engine.registrations():  # type: ignore[attr-defined]
        state = _both(replicas, TickStarted(tick, float(tick), state))
        tick += 1
        assert tick < 20, "the room's KV was never registered"
    uuids = [set(s.role.engine.registrations()) for s in scheds]  # type: ignore[attr-defined]
    assert uuids[0] == uuids[1] and len(uuids[0]) == 1
    done = ev.MessageReceived("d-peer", Done(ROOM, True))
    state = _both(replicas, TickStarted(tick, float(tick), state,
                                        arrivals=(Arrival(tick - 0.5, done),)))
    for sched in scheds:
        assert not sched.role.engine.registrations()  # type: ignore[attr-defined]
        s = sched.stats()  # type: ignore[attr-defined]
        assert s.free_pages + s.cached_pages == s.total_pages


def test_a_frame_the_replica_cannot_follow_is_a_divergence(
        replicas: list[tuple[PDReplica, object]]) -> None:
    replica, sched = replicas[0]
    with pytest.raises(Divergence, match="rank 0's state was not-this"):
        replica.apply(TickStarted(99, 99.0, "not-this"))
    with pytest.raises(Divergence, match="cannot apply StepOrdered"):
        replica.apply(StepOrdered(()))
    with pytest.raises(Divergence, match="cannot apply Pinged"):
        replica.apply(Pinged())
    assert fingerprint(sched)  # untouched and still readable


def test_an_unreadable_record_from_rank0_is_a_divergence(
        replicas: list[tuple[PDReplica, object]]) -> None:
    replica, _ = replicas[0]
    for junk in ("not json", '{"role": "prefill"}'):
        with pytest.raises(Divergence, match="registry record is unreadable"):
            replica.apply(Announced(junk))
