"""A transfer engine that pulls nothing real: for executor tests that must not (or cannot)
reach a transfer server. ``on_pull(deadline_s)`` decides what a pull does."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax

from pd_fsm.jax_engine.transfer.base import KVTransferEngine, PendingPull, ReleaseResult


class FakeEngine(KVTransferEngine):
    def __init__(self, on_pull: Callable[[float], PendingPull]) -> None:
        self.on_pull = on_pull
        self.pulls = 0

    @property
    def address(self) -> str:
        return "nowhere:0"

    def register(self, uuid: int, arrays: Sequence[jax.Array], lease_s: float) -> None:
        raise AssertionError("a fake engine registers nothing")

    def extend_lease(self, uuid: int, lease_s: float) -> bool:
        raise AssertionError("a fake engine holds no lease")

    def release(self, uuid: int, reason: str) -> ReleaseResult:
        raise AssertionError("a fake engine releases nothing")

    def reap_expired(self) -> list[ReleaseResult]:
        return []

    def registrations(self) -> dict[int, int]:
        return {}

    def start_pull(
        self, peer: str, uuid: int, specs: Sequence[jax.ShapeDtypeStruct], deadline_s: float
    ) -> PendingPull:
        self.pulls += 1
        return self.on_pull(deadline_s)

    def drop_connection(self, peer: str, reason: str) -> None:
        pass

    def close(self) -> None:
        pass
