"""A PrefillScheduler and a DecodeScheduler in one process, wired through the core's wire codec
(the side channel) and two real transfer servers (the data plane)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pd_fsm.core import codec
from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.jax_engine.model import LoadedModel
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers.disaggregation import DecodeScheduler, DisaggregationArgs, PrefillScheduler
from pd_fsm.schedulers.request import Req, RequestOutput

BOOT = "127.0.0.1:8998"
P_ADDR = "tcp://127.0.0.1:0"  # P's side-channel address as D knows it
SECRET = b"test-secret"


class PDPair:
    def __init__(
        self,
        model: LoadedModel,
        p_args: DisaggregationArgs,
        d_args: DisaggregationArgs,
        decode_cls: type[DecodeScheduler] = DecodeScheduler,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.p = PrefillScheduler(p_args, model=model, clock=clock)
        self.d = decode_cls(d_args, model=model, clock=clock)
        self.d_id = d_args.instance_id
        self.p_outputs: list[RequestOutput] = []
        self.d_outputs: list[RequestOutput] = []
        self.resolvable = True
        self.drop_to_p = False  # simulate a P that stopped answering

    def pump(self) -> None:
        """Move every pending side-channel message and lookup (through the real codec)."""
        for _ in range(100):
            moved = False
            for e in self.p.role.link.take_outbox():
                moved = True
                assert isinstance(e, fx.SendMessage) and e.peer == self.d_id
                msg = codec.decode(codec.encode(e.message, SECRET), SECRET)
                self.d.role.deliver(ev.MessageReceived(P_ADDR, msg))
            for e in self.d.role.link.take_outbox():
                moved = True
                if isinstance(e, fx.ResolvePeer):
                    if self.resolvable:
                        found = ev.PeerResolved(
                            e.bootstrap_addr, P_ADDR, self.p.role.engine.address,
                            self.p.role.kv_args.layout_hash,
                        )
                    else:
                        found = ev.PeerResolutionFailed(e.bootstrap_addr, "no such prefill")
                    self.d.role.deliver(found)
                elif not self.drop_to_p:
                    msg = codec.decode(codec.encode(e.message, SECRET), SECRET)
                    self.p.role.deliver(ev.MessageReceived(self.d_id, msg))
            if not moved:
                return

    def step(self) -> None:
        self.pump()
        self.p_outputs += self.p.step()
        self.pump()
        self.d_outputs += self.d.step()
        self.pump()

    def run(self, until: Callable[[], bool], timeout: float = 300.0) -> None:
        """Step both sides until ``until()``; a deadline, not a step count: a first transfer of
        a page bucket may wait seconds for its kernels to compile."""
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if until():
                return
            self.step()
            if self.d.role.pull_executor.inflight:
                time.sleep(0.002)  # let the pull threads run
        raise AssertionError(f"PD pair did not finish within {timeout:g} s")

    def close(self) -> None:
        self.d.role.close()
        self.p.role.engine.close()
        self.d.role.engine.close()

    def books_balanced(self) -> bool:
        """Every page free (or held by a prefix cache alone), no registration, no room."""
        p, d = self.p.stats(), self.d.stats()
        return (
            p.free_pages + p.cached_pages == p.total_pages
            and d.free_pages + d.cached_pages == d.total_pages
            and not self.p.role.engine.registrations()
            and not self.p.role.link.core.rooms
            and not self.d.role.link.core.rooms
        )


def collect(outputs: list[RequestOutput]) -> dict[str, Any]:
    acc: dict[str, Any] = {}
    for o in outputs:
        entry = acc.setdefault(o.rid, {"ids": [], "text": "", "reason": None})
        entry["ids"] += list(o.new_token_ids)
        entry["text"] += o.text_delta
        if o.finished:
            entry["reason"] = o.finish_reason
    return acc


def serve_through(pair: PDPair, prompts: list[list[int]], sampling: SamplingParams,
                  first_room: int) -> dict[str, Any]:
    """Each prompt as one room (``r0``, ``r1``, ... from ``first_room``), both legs posted, run
    until every answer is whole and the books balance; then the pair is closed. The answers, by
    rid (:func:`collect`)."""
    try:
        for i, ids in enumerate(prompts):
            pair.d.role.add_pd_request(Req(f"r{i}", ids, sampling), BOOT, first_room + i)
            pair.p.role.add_pd_request(Req(f"r{i}", ids, sampling), first_room + i)
        pair.run(lambda: len(collect(pair.d_outputs)) == len(prompts)
                 and all(v["reason"] for v in collect(pair.d_outputs).values())
                 and pair.books_balanced())
        return collect(pair.d_outputs)
    finally:
        pair.close()
