"""What the simulated D endpoints stepped through, for tests that must see rows taken."""

from __future__ import annotations

from collections import Counter

import pytest

from pd_fsm.core.decode_endpoint import DecodeEndpoint


@pytest.fixture
def receiver_rows(monkeypatch: pytest.MonkeyPatch) -> Counter[tuple[str, str]]:
    """(state, trigger) of every kv_receiver step any DecodeEndpoint takes during the test."""
    rows: Counter[tuple[str, str]] = Counter()
    step = DecodeEndpoint._step

    def recorded(self: DecodeEndpoint, r: object, trigger: str, *args: object) -> None:
        rows[(r.state, trigger)] += 1  # type: ignore[attr-defined]
        step(self, r, trigger, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(DecodeEndpoint, "_step", recorded)
    return rows
